"""Unit tests for kvserve.sessions.SessionTable, the engine's index of sessions: all of them by
id, the idle ones by last use (TTL and ``max_sessions`` take the oldest) and the idle resident
ones by (priority, last use) (reclaim evicts the first), per tenant with the blocks they hold
(reclaim takes from tenants above their K/V share first).

Oracle: NaiveTable, a direct statement of the semantics: each idle session remembers when it
last became idle, each idle resident one the priority, tenant and blocks it had then;
``oldest_idle`` and ``victim`` are the minimum of plain lists sorted by (last use) and
(priority, last use), ``victim(prefer)`` the same over the first preferred tenant's, and the
blocks per tenant a plain sum.
"""

from __future__ import annotations

import itertools
import random

import pytest

from kvserve.sessions import Session, SessionTable

BLOCK = 4


class NaiveTable:
    def __init__(self) -> None:
        self.known: dict[str, Session] = {}
        self.idle_since: dict[str, int] = {}  # idle sessions: the tick they last became idle
        # idle resident: (priority, tick, tenant, blocks)
        self.parked: dict[str, tuple[int, int, str | None, int]] = {}
        self._ticks = itertools.count()

    def add(self, s: Session) -> None:
        self.known[s.id] = s
        self.idle(s)

    def idle(self, s: Session) -> None:
        tick = next(self._ticks)
        self.idle_since[s.id] = tick
        self.parked.pop(s.id, None)
        if s.seq >= 0:
            self.parked[s.id] = (s.priority, tick, s.tenant, -(-s.n_kv // BLOCK))

    def busy(self, s: Session) -> None:
        self.idle_since.pop(s.id, None)
        self.parked.pop(s.id, None)

    def evicted(self, s: Session) -> None:
        self.parked.pop(s.id, None)

    def remove(self, s: Session) -> None:
        self.known.pop(s.id, None)
        self.busy(s)

    def oldest_idle(self) -> str | None:
        order = sorted((tick, sid) for sid, tick in self.idle_since.items())
        return order[0][1] if order else None

    def victim(self, prefer: tuple[str | None, ...] = ()) -> str | None:
        for tenant in prefer:
            mine = [(p, k, sid) for sid, (p, k, t, _) in self.parked.items() if t == tenant]
            if mine:
                return min(mine)[2]
        order = sorted((prio, tick, sid) for sid, (prio, tick, _, _) in self.parked.items())
        return order[0][2] if order else None

    def blocks(self) -> dict[str | None, int]:
        out: dict[str | None, int] = {}
        for _, _, tenant, blocks in self.parked.values():
            if blocks:
                out[tenant] = out.get(tenant, 0) + blocks
        return out


def session(sid: str, priority: int = 0, resident: bool = True) -> Session:
    s = Session(sid, now=0.0)
    s.priority = priority
    s.seq = 1 if resident else -1
    return s


def ids(s: Session | None) -> str | None:
    return None if s is None else s.id


def test_victim_is_the_lowest_priority_then_least_recently_used() -> None:
    t = SessionTable()
    a, b, c, d = session("a", 1), session("b", 0), session("c", 0), session("d", -1, False)
    for s in (a, b, c, d):
        t.add(s)
    assert ids(t.victim()) == "b"  # d has the lowest priority but holds no K/V
    assert ids(t.oldest_idle()) == "a"  # resident or not
    t.idle(b)  # used again: now after c
    assert ids(t.victim()) == "c"
    assert ids(t.oldest_idle()) == "a"
    t.idle(a)
    assert ids(t.oldest_idle()) == "c"


def test_busy_sessions_are_neither_victims_nor_oldest_idle() -> None:
    t = SessionTable()
    a, b = session("a", 0), session("b", 5)
    t.add(a)
    t.add(b)
    t.busy(a)
    assert ids(t.victim()) == "b" and ids(t.oldest_idle()) == "b"
    t.busy(b)
    assert t.victim() is None and t.oldest_idle() is None
    assert len(t) == 2 and t.get("a") is a  # still known
    a.priority = 9  # the request that ran on it had another priority
    t.idle(a)
    t.idle(b)
    assert ids(t.victim()) == "b"  # 5 < 9


def test_evicted_sessions_stay_idle_in_their_place() -> None:
    t = SessionTable()
    a, b = session("a"), session("b")
    t.add(a)
    t.add(b)
    a.seq = -1
    t.evicted(a)
    assert ids(t.victim()) == "b"
    assert ids(t.oldest_idle()) == "a"  # its last use did not change
    t.evicted(b)
    assert t.victim() is None


def test_removed_sessions_are_forgotten() -> None:
    t = SessionTable()
    a, b = session("a"), session("b")
    t.add(a)
    t.add(b)
    t.remove(a)
    assert t.get("a") is None and len(t) == 1 and t.values() == [b]
    assert ids(t.victim()) == "b" and ids(t.oldest_idle()) == "b"
    t.remove(a)  # again: nothing happens
    assert len(t) == 1
    t.add(session("a"))  # the id can be reused
    assert ids(t.oldest_idle()) == "b" and ids(t.victim()) == "b"


def test_idle_again_files_a_session_under_its_current_priority() -> None:
    t = SessionTable()
    a, b = session("a", 0), session("b", 1)
    t.add(a)
    t.add(b)
    a.priority = 2
    t.idle(a)  # no busy() in between: refiled, not listed twice
    assert ids(t.victim()) == "b"
    t.busy(b)
    assert ids(t.victim()) == "a"
    t.busy(a)
    assert t.victim() is None


def check(t: SessionTable, ref: NaiveTable, busy: set[str]) -> None:
    assert ids(t.victim()) == ref.victim()
    assert ids(t.oldest_idle()) == ref.oldest_idle()
    assert len(t) == len(ref.known)
    assert {s.id for s in t.values()} == set(ref.known)
    for sid, s in ref.known.items():
        assert t.get(sid) is s
    v, o = t.victim(), t.oldest_idle()
    assert v is None or (v.id not in busy and v.resident)
    assert o is None or o.id not in busy


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_match_the_naive_table(seed: int) -> None:
    rng = random.Random(seed)
    t, ref = SessionTable(), NaiveTable()
    busy: set[str] = set()
    names = [f"s{i}" for i in range(12)]
    priorities = [-1000, -1, 0, 0, 1, 1000]
    seen_victims: set[str] = set()
    for _ in range(600):
        op = rng.random()
        known = sorted(ref.known)
        if op < 0.15 or not known:
            free = [n for n in names if n not in ref.known]
            if not free:
                continue
            s = session(rng.choice(free), rng.choice(priorities), rng.random() < 0.7)
            t.add(s)
            ref.add(s)
            busy.discard(s.id)
        else:
            s = ref.known[rng.choice(known)]
            if op < 0.35:
                t.busy(s)
                ref.busy(s)
                busy.add(s.id)
            elif op < 0.65:
                # A turn ends (or an idle session is used again): as the engine does, its
                # priority and residency may have changed meanwhile.
                if rng.random() < 0.5:
                    s.priority = rng.choice(priorities)
                if rng.random() < 0.3:
                    s.seq = -1 if s.resident else 1
                t.idle(s)
                ref.idle(s)
                busy.discard(s.id)
            elif op < 0.8:
                victim = t.victim()
                target = victim if victim is not None and rng.random() < 0.7 else s
                target.seq = -1
                t.evicted(target)
                ref.evicted(target)
                if target is victim:
                    seen_victims.add(target.id)
            elif op < 0.9:
                t.remove(s)
                ref.remove(s)
                busy.discard(s.id)
            else:  # only queries
                pass
        check(t, ref, busy)
    assert len(seen_victims) > 3  # the sequence exercised eviction


@pytest.mark.parametrize("seed", range(10))
def test_tenants_sessions_and_blocks_match_the_naive_table(seed: int) -> None:
    """Sessions of several tenants (their tenant and K/V length change between turns, as a
    session's next turn may come from another tenant and holds more tokens): the blocks of
    the idle resident ones per tenant, and the victim of the first preferred tenant that has
    one, else of any, match the naive table's after every operation."""
    rng = random.Random(100 + seed)
    t, ref = SessionTable(BLOCK), NaiveTable()
    tenants: list[str | None] = [None, "a", "b", "c"]
    names = [f"s{i}" for i in range(12)]
    preferred_hits = 0
    for _ in range(500):
        known = sorted(ref.known)
        op = rng.random()
        if op < 0.2 or not known:
            free = [n for n in names if n not in ref.known]
            if not free:
                continue
            s = session(rng.choice(free), rng.choice([-1, 0, 0, 3]), rng.random() < 0.8)
            s.tenant = rng.choice(tenants)
            s.n_kv = rng.randint(0, 40) if s.resident else 0
            t.add(s)
            ref.add(s)
            continue
        s = ref.known[rng.choice(known)]
        if op < 0.4:
            t.busy(s)
            ref.busy(s)
        elif op < 0.7:  # a turn ends: maybe another tenant's, more tokens, evicted meanwhile
            t.busy(s)
            ref.busy(s)
            s.tenant = rng.choice(tenants)
            s.seq = 1 if rng.random() < 0.8 else -1
            s.n_kv = rng.randint(0, 60) if s.resident else 0
            t.idle(s)
            ref.idle(s)
        elif op < 0.85:
            s.seq, s.n_kv = -1, 0
            t.evicted(s)
            ref.evicted(s)
        else:
            t.remove(s)
            ref.remove(s)
        assert t.parked_blocks == ref.blocks()
        prefer = tuple(rng.sample(tenants, rng.randint(0, 3)))
        got = ids(t.victim(prefer))
        assert got == ref.victim(prefer), prefer
        preferred_hits += got != ref.victim()
    assert preferred_hits > 10  # preferring a tenant changed the victim often
