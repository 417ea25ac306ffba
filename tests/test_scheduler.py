"""The engine's scheduler (python/kvserve/engine/scheduler.py) as pure policy: no model, a fake
of the resources it asks and tells, and a simple model of the rules as the oracle.

- :class:`WaitQueue` against a naive list sorted by the admission rule (promoted by arrival,
  then priority, then arrival), under random pushes, removals, pops and time;
- admission order, slots and memory, the fast lane, shared-prefix deferral;
- preemption: the victim (lowest priority, latest arrival), priority preemption for a slot
  and for memory, never by a merely promoted request, never of an equal priority;
- aging: a low-priority request that waited ``aging_s`` goes first;
- the batch plan: one token per generating sequence, closing turns, prompt chunks in order.
"""

from __future__ import annotations

import itertools
import random

import pytest

from kvserve.engine.requests import RUNNING, WAITING, Request
from kvserve.engine.scheduler import Scheduler, WaitQueue
from kvserve.options import resolve

BLOCK = 4
_arrivals = itertools.count()
_firsts = itertools.count(1000)


def req(
    n_prompt: int = 6, priority: int = 0, first: int | None = None, tokens: list[int] | None = None
) -> Request:
    """A request of ``n_prompt`` tokens (a fresh first token, so no two share a block, unless
    ``first`` or ``tokens`` say otherwise)."""
    if tokens is None:
        head = next(_firsts) if first is None else first
        tokens = [head] + [100 + i for i in range(n_prompt - 1)]
    ids = list(tokens)
    r = Request(ids, 16, resolve({}).sampler, [], False, priority)
    r.key = (-priority, next(_arrivals))
    r.state = WAITING
    return r


class FakeResources:
    """Blocks as a counter; sequence ids from a counter; cached prefixes by token tuple."""

    def __init__(self, sched: Scheduler, blocks: int) -> None:
        self.sched = sched
        self.free = blocks
        self.seqs = itertools.count()
        self.cached: dict[tuple[int, ...], int] = {}  # prompt -> tokens a match maps
        self.idle_sessions: list[int] = []  # blocks each idle session would free
        self.started: list[Request] = []
        self.preempted: list[Request] = []
        self.fail_start: set[int] = set()  # ids of requests whose start fails

    def available(self) -> int:
        return self.free

    def resident_prefix(self, r: Request) -> int | None:
        return None

    def cached_estimate(self, r: Request) -> int | None:
        return self.cached.get(tuple(r.ids), 0)

    def reclaim_idle(self) -> bool:
        if not self.idle_sessions:
            return False
        self.free += self.idle_sessions.pop(0)
        return True

    def start(self, r: Request) -> int | None:
        if id(r) in self.fail_start:
            r.state = 3
            return None
        r.seq = next(self.seqs)
        r.state = RUNNING
        matched = self.cached.get(tuple(r.ids), 0)
        self.free -= -(-(r.n_tokens + 1) // BLOCK) - matched // BLOCK
        self.started.append(r)
        return matched

    def preempt(self, r: Request) -> None:
        self.free += -(-r.n_tokens // BLOCK)
        r.seq = -1
        r.n_done = 0
        r.state = WAITING
        self.preempted.append(r)
        self.sched.queue.push(r, 0.0)


def make(parallel: int = 4, batch: int = 64, blocks: int = 100, aging: float | None = None):
    s = Scheduler(parallel=parallel, batch_tokens=batch, block_size=BLOCK, aging_s=aging)
    return s, FakeResources(s, blocks)


def generating(s: Scheduler, res: FakeResources, r: Request) -> Request:
    """``r`` admitted and its prompt computed (it generates one token a step)."""
    s.queue.push(r, 0.0)
    s.admit(res, 0.0)
    assert r.state == RUNNING
    r.n_done = r.n_tokens - 1
    return r


# -- the queue ---------------------------------------------------------------------------------


def naive_rank(r: Request, now: float, aging: float | None) -> tuple[int, int, int]:
    """The admission rule: promoted (waited ``aging`` s) by arrival, then priority, arrival."""
    assert r.queued_at is not None
    if aging is not None and now - r.queued_at >= aging:
        return (0, 0, r.key[1])
    return (1, -r.priority, r.key[1])


def test_wait_queue_matches_a_sorted_list_under_random_operations() -> None:
    rng = random.Random(7)
    for trial in range(30):
        aging = rng.choice([None, 5.0])
        q = WaitQueue(aging)
        model: list[Request] = []
        now = 0.0

        def rank(r: Request, now: float = 0.0, aging: float | None = aging) -> tuple:
            return naive_rank(r, now, aging)

        for _ in range(400):
            op = rng.random()
            if op < 0.4:
                r = req(priority=rng.choice([-3, 0, 0, 2, 7]))
                q.push(r, now)
                model.append(r)
            elif op < 0.55 and model:
                r = rng.choice(model)
                assert q.remove(r)
                assert not q.remove(r)  # removing twice is a no-op
                model.remove(r)
            elif op < 0.75:
                head = q.head(now)
                want = min(model, key=lambda r: rank(r, now)) if model else None
                assert head is want
                if head is not None:
                    q.pop(head)
                    model.remove(head)
            elif op < 0.85:
                k = rng.randint(0, 10)
                got = list(itertools.islice(q.in_order(now), k))
                assert got == sorted(model, key=lambda r: rank(r, now))[:k]
            elif op < 0.9:
                q.compact()
            else:
                now += rng.choice([0.5, 1.0, 3.0])
            assert len(q) == len(model), trial
        assert sorted(map(id, q.drain())) == sorted(map(id, model))
        assert len(q) == 0 and q.head(now) is None


def test_a_removed_then_requeued_request_keeps_its_place_once() -> None:
    q = WaitQueue(None)
    a, b, c = req(), req(), req()
    for r in (a, b, c):
        q.push(r, 0.0)
    q.remove(a)
    q.push(a, 0.0)  # requeued (a preemption): its arrival still comes first
    assert list(q.in_order(0.0)) == [a, b, c]
    with pytest.raises(RuntimeError):
        q.push(a, 0.0)
    assert q.by_priority() == {0: 3}


# -- admission ---------------------------------------------------------------------------------


def test_admission_is_by_priority_then_arrival_within_the_slots() -> None:
    s, res = make(parallel=3)
    rs = [req(priority=p) for p in (0, 2, 0, 5, 2)]
    for r in rs:
        s.queue.push(r, 0.0)
    admitted = s.admit(res, 0.0)
    assert admitted == [rs[3], rs[1], rs[4]]
    assert len(s.running) == 3 and len(s.queue) == 2


def test_a_request_that_does_not_fit_memory_waits_and_nobody_overtakes_it() -> None:
    s, res = make(parallel=4, blocks=10)
    running = generating(s, res, req(n_prompt=8))
    big, small = req(n_prompt=60), req(n_prompt=4)
    s.queue.push(big, 0.0)
    s.queue.push(small, 0.0)
    assert s.admit(res, 0.0) == []
    assert running.state == RUNNING and res.preempted == []
    # Idle sessions are reclaimed for it first.
    res.idle_sessions = [20, 20]
    assert s.admit(res, 0.0) == [big, small]
    assert res.idle_sessions == [20]  # only as many as it needed


def test_a_failed_start_is_skipped_and_admission_goes_on() -> None:
    s, res = make(parallel=4)
    a, b = req(), req()
    res.fail_start.add(id(a))
    for r in (a, b):
        s.queue.push(r, 0.0)
    assert s.admit(res, 0.0) == [b]
    assert list(s.running.values()) == [b] and len(s.queue) == 0


def test_prompt_budget_full_admits_only_through_the_fast_lane() -> None:
    s, res = make(parallel=4, batch=16)
    long = req(n_prompt=40)
    s.queue.push(long, 0.0)
    assert s.admit(res, 0.0) == [long]  # prefilling: 39 tokens > the 16-token budget
    cached = req(n_prompt=30, first=7)
    res.cached[tuple(cached.ids)] = 28  # all but two tokens cached
    uncached = req(n_prompt=30, first=8)
    s.queue.push(uncached, 0.0)
    s.queue.push(cached, 0.0)
    assert s.admit(res, 0.0) == [cached]  # out of turn; the head waits for budget
    assert uncached.state == WAITING
    # Never the last free slot (the head may need it): one more, then no more.
    other, third = req(n_prompt=30, first=9), req(n_prompt=30, first=13)
    res.cached[tuple(other.ids)] = 28
    res.cached[tuple(third.ids)] = 28
    s.queue.push(other, 0.0)
    s.queue.push(third, 0.0)
    assert s.admit(res, 0.0) == [other]
    assert len(s.running) == 3 and third.state == WAITING
    # Only requests of the head's rank take the fast lane.
    s2, res2 = make(parallel=8, batch=16)
    s2.queue.push(req(n_prompt=40), 0.0)
    s2.admit(res2, 0.0)
    head = req(n_prompt=30)
    lower = req(n_prompt=30, priority=-1)
    res2.cached[tuple(lower.ids)] = 28
    s2.queue.push(head, 0.0)
    s2.queue.push(lower, 0.0)
    assert s2.admit(res2, 0.0) == []
    assert head.state == WAITING and lower.state == WAITING


def test_a_prompt_whose_blocks_are_being_computed_waits_for_them() -> None:
    s, res = make(parallel=4, batch=8)
    doc = [5] * 20
    first = req(tokens=doc + [1, 2])
    s.queue.push(first, 0.0)
    s.admit(res, 0.0)
    first.n_done = 4  # one block of the shared 20 computed so far
    second = req(tokens=doc + [3, 4])
    third = req(n_prompt=3, first=9)  # shares nothing
    s.queue.push(second, 0.0)
    s.queue.push(third, 0.0)
    assert s.admit(res, 0.0) == [third]
    assert second.state == WAITING and second.entry  # still queued with its place
    first.n_done = 21  # the shared blocks are computed
    assert s.admit(res, 0.0) == [second]


# -- preemption --------------------------------------------------------------------------------


def test_the_victim_is_the_lowest_priority_latest_arrival() -> None:
    s, res = make(parallel=8)
    rs = [generating(s, res, req(priority=p)) for p in (1, 0, 3, 0, 1)]
    assert s.victim() is rs[3]
    assert s.victim(below=1) is rs[3]
    assert s.victim(below=0) is None
    assert s.victim(below=1, spare=frozenset({id(rs[3])})) is rs[1]


def test_a_higher_priority_request_preempts_for_a_slot() -> None:
    s, res = make(parallel=2)
    low1 = generating(s, res, req(priority=0))
    low2 = generating(s, res, req(priority=0))
    same = req(priority=0)
    s.queue.push(same, 0.0)
    assert s.admit(res, 0.0) == []  # equal priority never preempts
    high = req(priority=3)
    s.queue.push(high, 0.0)
    assert s.admit(res, 0.0) == [high]
    assert res.preempted == [low2]  # the latest of the lowest priority
    assert low1.state == RUNNING and low2.state == WAITING
    # The victim waits with its place: ahead of ``same``, which arrived after it.
    assert list(s.queue.in_order(0.0)) == [low2, same]


def test_a_higher_priority_request_preempts_for_memory() -> None:
    s, res = make(parallel=4, blocks=12)
    low = generating(s, res, req(n_prompt=20, priority=-1))
    mid = generating(s, res, req(n_prompt=8, priority=2))
    high = req(n_prompt=16, priority=3)
    s.queue.push(high, 0.0)
    assert s.admit(res, 0.0) == [high]
    assert res.preempted == [low] and mid.state == RUNNING


def test_aging_promotes_but_never_preempts() -> None:
    s, res = make(parallel=1, aging=10.0)
    generating(s, res, req(priority=5))
    old = req(priority=-5)
    s.queue.push(old, 0.0)
    fresh = req(priority=4)
    s.queue.push(fresh, 9.0)
    assert s.queue.head(9.0) is fresh
    assert s.queue.head(10.0) is old  # waited aging_s: first, whatever the priorities
    assert s.admit(res, 10.0) == []  # promoted, but it does not preempt the running one
    assert res.preempted == []
    s.running.clear()  # the slot frees
    assert s.admit(res, 10.0) == [old]


def test_a_request_admitted_by_aging_is_not_preempted_for_priority() -> None:
    s, res = make(parallel=1, aging=5.0)
    old = req(priority=-5)
    s.queue.push(old, 0.0)
    assert s.admit(res, 6.0) == [old] and old.protected
    high = req(priority=9)
    s.queue.push(high, 6.0)
    assert s.admit(res, 6.0) == [] and res.preempted == []
    assert s.victim() is old  # memory shortage may still take it


def test_a_promoted_request_is_not_starved_by_a_stream_of_higher_priorities() -> None:
    s, res = make(parallel=1, aging=3.0)
    low = req(priority=-10)
    s.queue.push(low, 0.0)
    served: list[Request] = []
    for t in range(10):
        s.queue.push(req(priority=10), float(t))
        s.running.clear()
        served += s.admit(res, float(t))
    assert low in served
    assert served.index(low) == 3  # admitted at t = 3, the first step it is promoted


# -- the plan ----------------------------------------------------------------------------------


def test_the_plan_gives_every_generating_sequence_a_token_then_prompt_chunks() -> None:
    s, res = make(parallel=8, batch=20)
    gens = [generating(s, res, req(n_prompt=5)) for _ in range(3)]
    high = req(n_prompt=30, priority=1)
    low = req(n_prompt=30)
    short = req(n_prompt=12, first=3)
    for r in (low, high, short):
        s.queue.push(r, 0.0)
    s.admit(res, 0.0)
    short.n_done = 8  # a short remainder (fast lane size) goes first
    plan = s.plan()
    assert [(e[0], e[2], e[3]) for e in plan[:3]] == [(g, 1, True) for g in gens]
    rest = [(e[0], e[1], e[2], e[3]) for e in plan[3:]]
    assert rest == [(short, 8, 4, True), (high, 0, 13, False)]
    assert sum(e[2] for e in plan) == 20
