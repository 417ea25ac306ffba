"""The engine's scheduler (python/kvserve/engine/scheduler.py) as pure policy: no model, a fake
of the resources it asks and tells, and a simple model of the rules as the oracle.

- :class:`WaitQueue` against a naive list sorted by the admission rule (promoted by arrival,
  then priority, then arrival), under random pushes, removals, pops and time;
- admission order, slots and memory, the fast lane, shared-prefix deferral;
- preemption: the victim (lowest priority, latest arrival), priority preemption for a slot
  and for memory, never by a merely promoted request, never of an equal priority;
- aging: a low-priority request that waited ``aging_s`` goes first;
- the batch plan: one token per generating sequence, closing turns, prompt chunks in order;
- prefix groups: waiters of a shared prefix take no slot; the plan's order against a brute-force
  minimum of the summed time to first token; priority, the fast lane, aging and tenants bound it;
- tenants: a light tenant's request is admitted next and gets a slot within one step (fair
  preemption) however much another has queued; free slots by slots per weight; priority only
  within a tenant; weights 2:1 give 2:1 slots and prompt tokens over many steps; the prompt
  budget's split against token-by-token weighted fair queuing; virtual times of tenants that
  get work; aging among flooding tenants; one tenant of any policy schedules exactly as
  requests without one; memory shortage takes from the tenant above its K/V share.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from kvserve.engine.requests import DONE, RUNNING, WAITING, Request
from kvserve.engine.scheduler import PlanEntry, Scheduler, WaitQueue
from kvserve.engine.tenancy import TenantPolicy
from kvserve.options import resolve

BLOCK = 4
_arrivals = itertools.count()
_firsts = itertools.count(1000)


def req(
    n_prompt: int = 6,
    priority: int = 0,
    first: int | None = None,
    tokens: list[int] | None = None,
    tenant: str | None = None,
) -> Request:
    """A request of ``n_prompt`` tokens (a fresh first token, so no two share a block, unless
    ``first`` or ``tokens`` say otherwise) of ``tenant``."""
    if tokens is None:
        head = next(_firsts) if first is None else first
        tokens = [head] + [100 + i for i in range(n_prompt - 1)]
    ids = list(tokens)
    r = Request(ids, 16, resolve({}).sampler, [], False, priority, tenant=tenant)
    r.key = (-priority, next(_arrivals))
    r.state = WAITING
    return r


def tenant_blocks(session: int | tuple[str | None, int]) -> tuple[str | None, int]:
    return (None, session) if isinstance(session, int) else session


class FakeResources:
    """Blocks as a counter; sequence ids from a counter; cached prefixes by token tuple."""

    def __init__(self, sched: Scheduler, blocks: int) -> None:
        self.sched = sched
        self.free = self.total = blocks
        self.seqs = itertools.count()
        self.cached: dict[tuple[int, ...], int] = {}  # prompt -> tokens a match maps
        # Blocks each idle session would free, least recently used first, with its tenant as
        # (tenant, blocks) (a bare number: a session without a tenant).
        self.idle_sessions: list[int | tuple[str | None, int]] = []
        self.started: list[Request] = []
        self.preempted: list[Request] = []
        self.fail_start: set[int] = set()  # ids of requests whose start fails

    def available(self) -> int:
        return self.free

    def total_blocks(self) -> int:
        return self.total

    def session_blocks(self) -> dict[str | None, int]:
        out: dict[str | None, int] = {}
        for tenant, blocks in map(tenant_blocks, self.idle_sessions):
            out[tenant] = out.get(tenant, 0) + blocks
        return out

    def resident_prefix(self, r: Request) -> int | None:
        return None

    def cached_estimate(self, r: Request) -> int | None:
        return self.cached.get(tuple(r.ids), 0)

    def reclaim_idle(self, prefer: Sequence[str | None] = ()) -> bool:
        """Evicts the first idle session of the first tenant in ``prefer`` that has one, else
        the first of all."""
        if not self.idle_sessions:
            return False
        tenants = [tenant_blocks(e)[0] for e in self.idle_sessions]
        i = next((tenants.index(t) for t in prefer if t in tenants), 0)
        self.free += tenant_blocks(self.idle_sessions.pop(i))[1]
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


def make(
    parallel: int = 4,
    batch: int = 64,
    blocks: int = 100,
    aging: float | None = None,
    policies: dict[str, TenantPolicy] | None = None,
    fast_lane: int | None = None,
) -> tuple[Scheduler, FakeResources]:
    table = policies or {}

    def policy(tenant: str | None) -> TenantPolicy:
        return table.get(tenant or "", TenantPolicy())

    s = Scheduler(
        parallel=parallel,
        batch_tokens=batch,
        block_size=BLOCK,
        aging_s=aging,
        policy=policy,
        fast_lane=fast_lane,
    )
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
    uncached = req(n_prompt=50, first=8)  # longer than ``long``: the plan puts it after
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
    head = req(n_prompt=50)
    lower = req(n_prompt=30, priority=-1)
    res2.cached[tuple(lower.ids)] = 28
    s2.queue.push(head, 0.0)
    s2.queue.push(lower, 0.0)
    assert s2.admit(res2, 0.0) == []
    assert head.state == WAITING and lower.state == WAITING
    # A prompt the plan computes before the running one (less work left) is admitted though
    # the budget is taken: it gets the budget in the next step. With its cached prefix too.
    shorter = req(n_prompt=30, priority=0)
    s2.queue.push(shorter, 0.0)
    assert s2.admit(res2, 0.0) == [shorter]
    s3, res3 = make(parallel=8, batch=16)
    s3.queue.push(req(n_prompt=40), 0.0)
    s3.admit(res3, 0.0)
    mostly_cached = req(n_prompt=60)
    res3.cached[tuple(mostly_cached.ids)] = 32  # 28 left: before the running 40
    s3.queue.push(mostly_cached, 0.0)
    assert s3.admit(res3, 0.0) == [mostly_cached]
    assert [e[0] for e in s3.plan(0.0)][0] is mostly_cached


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


# -- shared prefixes: prefix groups and their order --------------------------------------------


def doc_group(
    s: Scheduler, res: FakeResources, doc: list[int], waiters: int, done: int = 0, prio: int = 0
) -> tuple[Request, list[Request]]:
    """A request computing ``doc`` (``done`` tokens of it computed) and ``waiters`` queued
    requests whose prompts start with it (each its own question after it)."""
    head = req(tokens=doc + [1, 2], priority=prio)
    s.queue.push(head, 0.0)
    s.admit(res, 0.0)
    assert head.state == RUNNING
    head.n_done = done
    rest = [req(tokens=doc + [3, 4 + i], priority=prio) for i in range(waiters)]
    for r in rest:
        s.queue.push(r, 0.0)
    return head, rest


def summed_ttft(order: Sequence[Request], waiters: dict[int, int]) -> int:
    """The simple model of the plan's order: prompts computed one after another in ``order``;
    a request's users (itself and the requests waiting for its prefix) get their first token
    when it is done; the sum over users of those times, in prompt tokens."""
    t = total = 0
    for r in order:
        t += r.n_tokens - r.n_done
        total += (1 + waiters.get(r.seq, 0)) * t
    return total


def test_requests_waiting_for_a_shared_prefix_are_its_waiters_and_take_no_slot() -> None:
    s, res = make(parallel=2)
    doc = [7] * 24
    head, rest = doc_group(s, res, doc, waiters=2, done=4)
    other = generating(s, res, req())
    eager = req(tokens=doc + [9, 9], priority=5)  # would preempt ``other`` for a slot
    s.queue.push(eager, 0.0)
    assert s.admit(res, 0.0) == []
    assert res.preempted == []  # it waits for the doc's blocks; preempting gains it nothing
    assert other.state == RUNNING and all(r.state == WAITING for r in [*rest, eager])
    assert s.waiters == {head.seq: 3}
    head.n_done = 25  # the doc is cached: the group's next admission is an ordinary one
    for r in [*rest, eager]:
        res.cached[tuple(r.ids)] = 24
    other.n_done = other.n_tokens
    s.running.pop(other.seq)
    assert s.admit(res, 0.0) == [eager]  # the one slot free: priority first
    assert s.waiters == {}


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_orders_prefix_groups_for_the_least_summed_time_to_first_token(seed: int) -> None:
    """Random groups (document length, how much is computed, how many wait for it): the plan
    orders the documents' prompts so that the summed time to first token of their users is
    the least of every order (the simple model above, by brute force), and gives each its
    whole remainder in that order."""
    rng = random.Random(seed)
    s, res = make(parallel=40, batch=4096, blocks=10_000, fast_lane=0)
    heads: list[Request] = []
    for d in range(5):
        doc = [200 + d] * (BLOCK * rng.randint(2, 30))
        done = BLOCK * rng.randint(0, len(doc) // BLOCK - 1)
        head, _ = doc_group(s, res, doc, waiters=rng.choice([0, 0, 1, 3, 7]), done=done)
        heads.append(head)
    s.admit(res, 0.0)  # every waiter examined: counted against the head computing its doc
    plan = s.plan(0.0)
    got = [e[0] for e in plan]
    assert sorted(map(id, got)) == sorted(map(id, heads))
    assert all(e[1] == e[0].n_done and e[1] + e[2] == e[0].n_tokens for e in plan)
    best = min(summed_ttft(p, s.waiters) for p in itertools.permutations(heads))
    assert summed_ttft(got, s.waiters) == best
    # First come, first served (the order before) is worse whenever it is not also the best.
    fcfs = summed_ttft(heads, s.waiters)
    assert fcfs >= best


def test_priority_and_the_fast_lane_bound_the_group_order() -> None:
    s, res = make(parallel=16, batch=4096, blocks=10_000, fast_lane=8)
    big, _ = doc_group(s, res, [300] * 64, waiters=6)
    lone = generating(s, res, req(n_prompt=80, priority=1))
    lone.n_done = 0  # a long prompt of higher priority, alone
    short = generating(s, res, req(n_prompt=40))
    short.n_done = 36  # 4 left: the fast lane's
    s.admit(res, 0.0)
    assert s.waiters == {big.seq: 6}
    assert [e[0] for e in s.plan(0.0)] == [short]  # a short step for the first token
    s.charge([])  # (as if computed)
    assert [e[0] for e in s.plan(0.0)] == [short, lone, big]


def test_aging_bounds_how_long_a_prompt_is_put_behind_groups() -> None:
    s, res = make(parallel=16, batch=4096, blocks=10_000, aging=5.0, fast_lane=0)
    long = req(n_prompt=200)
    s.queue.push(long, 0.0)
    s.admit(res, 0.0)
    group, _ = doc_group(s, res, [400] * 32, waiters=3)
    s.admit(res, 1.0)
    assert [e[0] for e in s.plan(4.9)] == [group, long]  # 33/4 tokens a user against 200
    assert [e[0] for e in s.plan(5.0)] == [long, group]  # queued 5 s ago: aged, first
    assert [e[0] for e in s.plan()] == [group, long]  # no time given: only ``protected``
    long.protected = True  # admitted by aging: always aged
    assert [e[0] for e in s.plan()] == [long, group]


def test_a_tenants_groups_reorder_only_its_own_part_of_the_budget() -> None:
    """Tenant a has a document with many waiters, b two lone prompts: the budget's split
    between them is what it is without any waiter; within b, arrival order stands for equal
    work."""
    parts: list[dict[str | None, int]] = []
    for waiters in (0, 9):
        s, res = make(parallel=32, batch=40, blocks=10_000, fast_lane=0)
        head = req(tokens=[500] * 64 + [1], tenant="a")
        s.queue.push(head, 0.0)
        for i in range(waiters):
            s.queue.push(req(tokens=[500] * 64 + [2, i], tenant="a"), 0.0)
        b1, b2 = req(n_prompt=100, tenant="b"), req(n_prompt=100, tenant="b")
        s.queue.push(b1, 0.0)
        s.queue.push(b2, 0.0)
        s.admit(res, 0.0)
        assert s.waiters == ({head.seq: waiters} if waiters else {})
        plan = s.plan(0.0)
        given: dict[str | None, int] = {}
        for r, _start, k, _want in plan:
            given[r.tenant] = given.get(r.tenant, 0) + k
        parts.append(given)
        assert [e[0] for e in plan if e[0].tenant == "b"] == [b1]
    assert parts[0] == parts[1] == {"a": 20, "b": 20}


def test_groups_of_unequal_documents_finish_smallest_work_per_user_first() -> None:
    """Steps against the fake: a long document asked by one user arrives first, then a short
    one asked by four and a middle one by two. Its users get their first tokens in the order
    of work per user (short, middle, long), every user gets one, and the summed step count to
    first tokens is below what ``prompt_order="fcfs"`` gives in the same run."""

    def run(policy: bool) -> dict[int, int]:
        s, res = make(parallel=16, batch=16, blocks=10_000, fast_lane=4)
        s.by_groups = policy
        users: list[tuple[int, Request]] = []
        lengths = [96, 24, 48]
        for d, (length, n) in enumerate(zip(lengths, [1, 4, 2], strict=True)):
            for u in range(n):
                r = req(tokens=[600 + d] * length + [10 + u])
                s.queue.push(r, 0.0)
                users.append((d, r))
        first: dict[int, int] = {}
        for t in range(200):
            step(s, res, float(t))
            for i, (d, r) in enumerate(users):
                if r.n_generated and i not in first:
                    first[i] = t
                if r.n_done >= lengths[d]:  # the document is cached (the prefix index)
                    for d2, u in users:
                        if d2 == d:
                            res.cached[tuple(u.ids[: lengths[d] + 1])] = lengths[d]
            if len(first) == len(users):
                break
        assert len(first) == len(users)
        return {i: first[i] for i in range(len(users))}

    got, fcfs = run(True), run(False)
    doc_of = [0, 1, 1, 1, 1, 2, 2]
    last = {d: max(t for i, t in got.items() if doc_of[i] == d) for d in range(3)}
    assert last[1] < min(got[5], got[6]) and last[2] < got[0]
    fcfs_last = {d: max(t for i, t in fcfs.items() if doc_of[i] == d) for d in range(3)}
    assert fcfs_last[0] < fcfs_last[1] < fcfs_last[2]  # the order before: arrival
    assert sum(got.values()) < sum(fcfs.values())


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
    # First tokens first: with a remainder that ends in a first token, the longer prompts sit
    # the step out (a short step) ...
    plan = s.plan()
    assert [(e[0], e[2], e[3]) for e in plan[:3]] == [(g, 1, True) for g in gens]
    assert [(e[0], e[1], e[2], e[3]) for e in plan[3:]] == [(short, 8, 4, True)]
    # ... but never two steps in a row: then the budget goes in order, to its end.
    s.charge(plan)
    plan = s.plan()
    assert [(e[0], e[2], e[3]) for e in plan[:3]] == [(g, 1, True) for g in gens]
    rest = [(e[0], e[1], e[2], e[3]) for e in plan[3:]]
    assert rest == [(short, 8, 4, True), (high, 0, 13, False)]
    assert sum(e[2] for e in plan) == 20
    s.charge(plan)  # a full step: the next with a short remainder is short again
    assert [e[0] for e in s.plan()[3:]] == [short]
    # Only while the short remainders are at most a quarter of the budget (here 5 tokens):
    # more than that, and the step is an ordinary one, the remainders first.
    short.n_done = 6  # 6 left
    assert [e[0] for e in s.plan()[3:]] == [short, high]


# -- tenants -----------------------------------------------------------------------------------


def finish(s: Scheduler, res: FakeResources, r: Request) -> None:
    """``r`` ends: off the running set, its blocks back."""
    del s.running[r.seq]
    res.free += -(-(r.n_tokens + 1) // BLOCK)
    r.state = DONE


def step(s: Scheduler, res: FakeResources, now: float = 0.0, out: int = 4) -> list[PlanEntry]:
    """One engine step against the fake: admit, plan, charge the plan, advance every planned
    request (a generating one gets a token; one with ``out`` tokens finishes)."""
    s.admit(res, now)
    plan = s.plan(now)
    s.charge(plan)
    for r, _start, k, want in plan:
        r.n_done += k
        if want:
            r.ids.append(1)
            if r.n_generated >= out:
                finish(s, res, r)
    return plan


def of(rs: list[Request] | dict[int, Request], tenant: str | None) -> list[Request]:
    values = rs.values() if isinstance(rs, dict) else rs
    return [r for r in values if r.tenant == tenant]


def test_a_light_tenant_is_admitted_next_and_gets_a_slot_within_one_step() -> None:
    s, res = make(parallel=4)
    flood = [req(tenant="a") for _ in range(12)]  # 3 x parallel
    for r in flood:
        s.queue.push(r, 0.0)
    assert s.admit(res, 0.0) == flood[:4]  # alone, it takes every slot
    for r in flood[:4]:
        r.n_done = r.n_tokens - 1
    light = req(tenant="b", priority=-5)  # its priority says nothing against another tenant's
    s.queue.push(light, 0.0)
    assert s.admit(res, 0.0) == [light]
    assert res.preempted == [flood[3]]  # a's latest gives up its slot
    assert len(of(s.running, "a")) == 3 and len(s.running) == 4
    # The preempted request waits with its place: first of a's queue.
    assert list(s.queue.in_order(0.0, ("a",)))[:2] == [flood[3], flood[4]]
    # b's next request: b holds one slot of its fair two, a three: a gives up another.
    b2, b3 = req(tenant="b", priority=-5), req(tenant="b", priority=-5)
    s.queue.push(b2, 0.0)
    s.queue.push(b3, 0.0)
    assert s.admit(res, 0.0) == [b2]
    assert res.preempted == [flood[3], flood[2]]
    # Two and two: the fair shares; b3 waits for a slot of b's (no slot goes back and forth).
    assert s.admit(res, 0.0) == [] and len(res.preempted) == 2
    assert len(of(s.running, "a")) == 2 and b3.state == WAITING


def test_free_slots_go_to_the_tenant_with_the_fewest_per_weight() -> None:
    s, res = make(parallel=6)
    a = [req(tenant="a") for _ in range(10)]
    b = [req(tenant="b") for _ in range(2)]
    for r in a + b:  # b arrives after all of a's
        s.queue.push(r, 0.0)
    admitted = s.admit(res, 0.0)
    # Alternating from the earliest head, until b has no more: then a takes the rest.
    assert admitted == [a[0], b[0], a[1], b[1], a[2], a[3]]


def test_priority_orders_within_a_tenant_and_preempts_only_there() -> None:
    s, res = make(parallel=4)
    low_a = generating(s, res, req(tenant="a", priority=0))
    b1 = generating(s, res, req(tenant="b", priority=-3))
    b2 = generating(s, res, req(tenant="b", priority=-3))
    a2 = generating(s, res, req(tenant="a", priority=1))
    urgent = req(tenant="a", priority=9)
    s.queue.push(urgent, 0.0)
    assert s.admit(res, 0.0) == [urgent]
    # Not b's requests, though their priority is the lowest and b2 arrived after low_a.
    assert res.preempted == [low_a] and {b1, b2, a2} <= set(s.running.values())
    # Within a tenant: priority, then arrival; between tenants, their turns.
    s2, res2 = make(parallel=8)
    rs = [
        req(tenant=t, priority=p)
        for t, p in [("a", 0), ("a", 2), ("b", 0), ("a", 2), ("b", 5), ("a", 1)]
    ]
    for r in rs:
        s2.queue.push(r, 0.0)
    admitted = s2.admit(res2, 0.0)
    assert of(admitted, "a") == [rs[1], rs[3], rs[5], rs[0]]
    assert of(admitted, "b") == [rs[4], rs[2]]


def test_weights_share_slots_and_prompt_tokens_over_many_steps() -> None:
    """Two tenants that always have work (long prompts: both always prefill), weights 2:1:
    the running slots and the prompt tokens computed are 2:1 (the weighted ideal) within a
    small tolerance, and no request is preempted back and forth for it."""
    s, res = make(parallel=6, batch=48, blocks=100_000, policies={"a": TenantPolicy(weight=2.0)})
    prompt = {"a": 0, "b": 0}
    slots = {"a": 0, "b": 0}
    for t in range(400):
        for tenant in ("a", "b"):  # both keep 6 requests of 100 to 250 prompt tokens queued
            while s.queue._waiting.get(tenant, 0) < 6:
                s.queue.push(req(n_prompt=100 + 50 * (t % 4), tenant=tenant), float(t))
        plan = step(s, res, float(t), out=2)
        for r, start, k, _want in plan:
            if r.n_tokens - start > 1:
                prompt[r.tenant or ""] += k
        for r in s.running.values():
            slots[r.tenant or ""] += 1
    assert res.preempted == []
    assert slots["a"] / slots["b"] == pytest.approx(2.0, rel=0.05)
    assert prompt["a"] / prompt["b"] == pytest.approx(2.0, rel=0.05)
    assert prompt["a"] + prompt["b"] > 380 * 40  # the budget was used


def test_a_light_tenants_prompt_is_not_stuck_behind_long_prefills() -> None:
    s, res = make(parallel=8, batch=64, blocks=1000)
    long = [req(n_prompt=400, tenant="a") for _ in range(4)]
    for r in long:
        s.queue.push(r, 0.0)
    step(s, res)
    step(s, res)
    short = req(n_prompt=24, tenant="b")
    s.queue.push(short, 1.0)
    plan = step(s, res, 1.0)
    # All of its prompt in the step it is admitted; a's prefills take the rest of the budget.
    assert [(e[1], e[2], e[3]) for e in plan if e[0] is short] == [(0, 24, True)]
    assert sum(e[2] for e in plan) == 64


def naive_split(
    left: int, demand: dict[str, int], served: dict[str, float], weight: dict[str, float]
) -> dict[str, int]:
    """Weighted fair queuing one token at a time: the next token to the tenant with the lowest
    virtual time (served + given / weight) that wants more (ties: the first)."""
    given = dict.fromkeys(demand, 0)
    for _ in range(min(left, sum(demand.values()))):
        t = min(
            (t for t in demand if given[t] < demand[t]),
            key=lambda t: served[t] + given[t] / weight[t],
        )
        given[t] += 1
    return given


def test_the_prompt_budget_split_is_token_by_token_fair_queuing() -> None:
    rng = random.Random(5)
    for _ in range(400):
        names = [f"t{i}" for i in range(rng.randint(2, 6))]
        weight = {t: rng.choice([0.5, 1.0, 1.0, 2.0, 3.0, 7.0]) for t in names}
        s, _res = make(policies={t: TenantPolicy(weight=w) for t, w in weight.items()})
        s.served = {t: rng.choice([0.0, 0.0, 10.0, 37.5, 100.0]) for t in names}
        demand = {t: rng.randint(1, 200) for t in names}
        left = rng.randint(1, sum(demand.values()) - 1)
        got = s._split(left, demand)
        assert list(got) == names and sum(got.values()) == left
        assert got == naive_split(left, demand, s.served, weight)


def test_a_tenant_that_gets_prompt_work_starts_at_the_lowest_virtual_time() -> None:
    s, res = make(parallel=8, batch=32, blocks=1000, policies={"c": TenantPolicy(weight=4.0)})
    a = req(n_prompt=300, tenant="a")
    s.queue.push(a, 0.0)
    for _ in range(5):
        step(s, res)
    assert s.served == {"a": 5 * 32}  # alone: every prompt token, weight 1
    b = req(n_prompt=300, tenant="b")
    s.queue.push(b, 1.0)
    s.admit(res, 1.0)
    assert s.served["b"] == s.served["a"]  # not at 0: what it did not ask for is not banked
    plan = s.plan()
    assert [e[2] for e in plan if e[0] in (a, b)] == [16, 16]
    # An idle tenant comes back no more than one step's budget (/ its weight) behind.
    s.served["a"] += 10_000
    s.queue.push(req(n_prompt=40, tenant="c"), 2.0)
    s.admit(res, 2.0)
    top = s.served["a"]
    assert s.served["b"] == top - 32 and s.served["c"] == top - 32 / 4
    finish(s, res, a)
    finish(s, res, b)
    s.running.clear()
    s.queue.drain()
    s.admit(res, 3.0)
    assert s.served == {}  # tenants without prompt work are forgotten


def test_aging_bounds_a_wait_within_a_tenant_among_flooding_tenants() -> None:
    s, res = make(parallel=2, aging=3.0)
    low = req(priority=-10, tenant="a")
    s.queue.push(low, 0.0)
    served: list[Request] = []
    for t in range(10):
        for tenant in ("a", "b"):
            s.queue.push(req(priority=10, tenant=tenant), float(t))
        for r in list(s.running.values()):
            finish(s, res, r)
        served += s.admit(res, float(t))
    assert low in served and low.protected
    assert of(served, "a").index(low) == 3  # admitted at t = 3, the first step it is promoted
    assert len(of(served, "b")) == 10  # b's turns went on meanwhile


def test_one_tenant_with_any_policy_schedules_exactly_as_requests_without_one() -> None:
    """Random arrivals, priorities, prompt lengths, memory pressure, idle sessions and
    preemptions: every step's admissions, preemptions and plan are the same whether the
    requests have no tenant or all one tenant with its own weight and K/V share."""

    def run(tenant: str | None, seed: int) -> list[tuple]:
        rng = random.Random(seed)
        s, res = make(
            parallel=4,
            batch=24,
            blocks=60,
            aging=5.0,
            policies={"x": TenantPolicy(weight=3.0, kv_share=0.25)},
        )
        trace: list[tuple] = []
        names: dict[int, int] = {}
        for t in range(80):
            for _ in range(rng.choice([0, 0, 1, 2])):
                r = req(n_prompt=rng.randint(2, 40), priority=rng.choice([0, 0, 3]), tenant=tenant)
                names[id(r)] = len(names)
                s.queue.push(r, float(t))
            if rng.random() < 0.2:
                res.idle_sessions.append((tenant, rng.randint(1, 6)))
            admitted = s.admit(res, float(t))
            plan = s.plan()
            s.charge(plan)
            for r, _start, k, want in plan:
                r.n_done += k
                if want:
                    r.ids.append(1)
                    if r.n_generated >= 5:
                        finish(s, res, r)
            preempted = [names[id(r)] for r in res.preempted]
            res.preempted.clear()
            trace.append(
                (
                    [names[id(r)] for r in admitted],
                    preempted,
                    [(names[id(e[0])], e[1], e[2], e[3]) for e in plan],
                    len(res.idle_sessions),
                )
            )
        return trace

    for seed in range(6):
        plain = run(None, seed)
        assert plain == run("x", seed)
        assert any(p for _, p, _, _ in plain)  # the trace had preemptions


def test_memory_shortage_takes_from_the_tenant_above_its_kv_share() -> None:
    # Admission: b's head finds the pool short; a holds more than half (the equal split).
    s, res = make(parallel=8, blocks=40)
    a1 = generating(s, res, req(n_prompt=44, tenant="a", priority=5))
    a2 = generating(s, res, req(n_prompt=44, tenant="a", priority=5))
    b1 = generating(s, res, req(n_prompt=20, tenant="b", priority=-5))
    assert s.kv_held(res) == {"a": 22, "b": 5}  # ceil(n_done / block) each
    assert s.kv_over(res) == ["a"]  # 22 > 40 / 2
    head = req(n_prompt=40, tenant="b", priority=-5)
    s.queue.push(head, 0.0)
    assert s.admit(res, 0.0) == [head]
    assert res.preempted == [a2]  # a's latest, though every b request has a lower priority
    assert a1.state == RUNNING and b1.state == RUNNING
    # A head whose tenant would pass its own quota takes nothing from another tenant.
    s2, res2 = make(parallel=8, blocks=40)
    generating(s2, res2, req(n_prompt=60, tenant="a"))
    big = req(n_prompt=100, tenant="b")  # 26 blocks: more than half of the pool
    s2.queue.push(big, 0.0)
    assert s2.admit(res2, 0.0) == [] and res2.preempted == []
    # An explicit kv_share: c may hold a tenth of the pool; its 15 blocks are over it, d's
    # 20 are not over d's equal split (half: two tenants hold K/V).
    s3, res3 = make(parallel=8, blocks=100, policies={"c": TenantPolicy(kv_share=0.1)})
    c = generating(s3, res3, req(n_prompt=60, tenant="c", priority=9))
    d = generating(s3, res3, req(n_prompt=80, tenant="d", priority=-9))
    assert s3.kv_over(res3) == ["c"]
    # A decode short of memory: c's request, though d's has the lowest priority (which is
    # what the overall victim would be).
    assert s3.victim() is d
    assert s3.memory_victim(res3) is c
    # Idle sessions: the over-share tenant's go first.
    res3.idle_sessions = [("d", 3), ("c", 2), ("d", 1)]
    s3.running.pop(d.seq)
    res3.free = 0
    waiting = req(n_prompt=8, tenant="d")
    s3.queue.push(waiting, 0.0)
    assert s3.admit(res3, 0.0) == [waiting]
    assert res3.idle_sessions == [("d", 1)]  # c's first, then the oldest of the rest


def test_an_unknown_prompt_order_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_order"):
        Scheduler(parallel=2, batch_tokens=8, block_size=BLOCK, prompt_order="lifo")
