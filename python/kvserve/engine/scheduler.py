"""The scheduler: pure policy. Given the waiting queue, the running set and what the resources
(K/V memory, sessions) say, it decides who is admitted, who is preempted and what one step's
batch holds. It calls no model and no context: every question about memory and every action
goes through :class:`Resources`, which the engine implements with its KV manager and sessions
(python/kvserve/engine/loop.py) and tests implement with a fake (tests/test_scheduler.py).

Order. A waiting request is admitted highest ``priority`` first and first come, first served
within a priority, except:

- *aging*: a request that has waited ``aging_s`` seconds is *promoted*: it goes before every
  request that is not, in arrival order among the promoted, so low priority is never starved
  while higher priorities keep arriving (it does not preempt anyone, and once admitted it is
  not preempted for priority either);
- *the fast lane*: while the step's prompt budget is taken, a request of the head's rank with
  at most ``fast_lane`` prompt tokens left to compute (the rest cached) is admitted out of
  turn if memory and a slot allow, leaving one slot for the head;
- *shared prefixes*: a request whose prompt starts with whole blocks that a running request is
  prefilling right now waits (keeping its place) until they are cached, instead of computing
  them a second time.

Preemption. When no slot is free, or the pool cannot hold the head's prompt after idle sessions
were reclaimed, and the head (not merely promoted) has a higher priority than some running
request, the lowest-priority running request (latest arrived within it) is preempted: it goes
back to the queue with its place and later resumes by recomputing its tokens, with prefix
reuse. A step that runs out of memory while decoding preempts the same victim, of any priority.

Per-step cost. The queue keeps one heap per distinct priority (keyed by arrival), so a push, a
pop and the head are O(log W + D) for W waiting requests of D distinct priorities; a cancelled
or out-of-turn request is removed in O(1) (its entry is skipped later; the heaps are compacted
when dead entries outnumber live ones, O(W) amortized over as many removals). The fast lane
walks the queue's first ``2 x parallel`` requests in order without touching the rest
(O(k log k)). Admission considers at most ``3 x parallel`` requests a step; each admission
looks at the R running requests (O(R)).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import count, islice
from typing import Protocol

from .requests import Request

__all__ = ["Resources", "Scheduler", "WaitQueue"]

PlanEntry = tuple[Request, int, int, bool]  # (request, first index, token count, wants logits)


class WaitQueue:
    """Waiting requests in admission order (module docs): per priority a heap by arrival."""

    def __init__(self, aging_s: float | None) -> None:
        self.aging_s = aging_s
        self._heaps: dict[int, list[tuple[int, int, Request]]] = {}
        self._entries = count(1)
        self._live = 0
        self._dead = 0

    def __len__(self) -> int:
        return self._live

    def __bool__(self) -> bool:
        return self._live > 0

    def push(self, req: Request, now: float) -> None:
        """Queues ``req`` with its place (``req.key``'s arrival); the first push sets the time
        its aging counts from."""
        if req.entry:
            raise RuntimeError("the request is queued already")
        if req.queued_at is None:
            req.queued_at = now
        req.entry = next(self._entries)
        heapq.heappush(self._heaps.setdefault(req.priority, []), (req.key[1], req.entry, req))
        self._live += 1

    def remove(self, req: Request) -> bool:
        """Takes ``req`` out (O(1)); False if it was not queued."""
        if not req.entry:
            return False
        req.entry = 0
        self._live -= 1
        self._dead += 1
        return True

    def compact(self) -> None:
        """Drops dead entries once they outnumber the live ones (call between walks)."""
        if self._dead <= 64 or self._dead <= self._live:
            return
        for prio in list(self._heaps):
            heap = [e for e in self._heaps[prio] if e[2].entry == e[1]]
            if heap:
                heapq.heapify(heap)
                self._heaps[prio] = heap
            else:
                del self._heaps[prio]
        self._dead = 0

    def promoted(self, req: Request, now: float) -> bool:
        if self.aging_s is None or req.queued_at is None:
            return False
        return now - req.queued_at >= self.aging_s

    def rank(self, req: Request, now: float) -> tuple[int, int, int]:
        """Sort key of admission order: promoted first (by arrival), then priority, arrival."""
        if self.promoted(req, now):
            return (0, 0, req.key[1])
        return (1, -req.priority, req.key[1])

    def _top(self, prio: int) -> Request | None:
        heap = self._heaps[prio]
        while heap and heap[0][2].entry != heap[0][1]:
            heapq.heappop(heap)
            self._dead -= 1
        if not heap:
            del self._heaps[prio]
            return None
        return heap[0][2]

    def head(self, now: float) -> Request | None:
        """The request to admit next (O(D) plus dead entries popped)."""
        best: Request | None = None
        best_rank = (2, 0, 0)
        for prio in list(self._heaps):
            req = self._top(prio)
            if req is not None and (r := self.rank(req, now)) < best_rank:
                best, best_rank = req, r
        return best

    def pop(self, req: Request) -> None:
        """Takes the head ``req`` out (O(log W))."""
        heap = self._heaps[req.priority]
        assert heap[0][2] is req and heap[0][1] == req.entry
        heapq.heappop(heap)
        if not heap:
            del self._heaps[req.priority]
        req.entry = 0
        self._live -= 1

    def in_order(self, now: float) -> Iterator[Request]:
        """Live requests in admission order, lazily: O(k log k) for the first k. Nothing may be
        pushed or compacted while the iterator is in use (removals are fine)."""

        def walk(heap: list[tuple[int, int, Request]]) -> Iterator[Request]:
            if not heap:
                return
            frontier = [(heap[0], 0)]
            while frontier:
                (arrival, entry, req), i = heapq.heappop(frontier)
                if req.entry == entry:
                    yield req
                for c in (2 * i + 1, 2 * i + 2):
                    if c < len(heap):
                        heapq.heappush(frontier, (heap[c], c))

        # Within one priority, arrival order is admission order (the promoted come first).
        walks = [walk(h) for h in self._heaps.values()]
        return heapq.merge(*walks, key=lambda r: self.rank(r, now))

    def drain(self) -> list[Request]:
        """Every live request, the queue emptied."""
        out = [e[2] for h in self._heaps.values() for e in h if e[2].entry == e[1]]
        for req in out:
            req.entry = 0
        self._heaps.clear()
        self._live = self._dead = 0
        return out

    def by_priority(self) -> dict[int, int]:
        """Live requests per priority (O(W); for tests)."""
        out: dict[int, int] = {}
        for prio, h in self._heaps.items():
            n = sum(1 for e in h if e[2].entry == e[1])
            if n:
                out[prio] = n
        return out


class Resources(Protocol):
    """What the scheduler asks and tells the rest of the engine (memory in blocks)."""

    def available(self) -> int:
        """Blocks free or held only by the prefix cache (evictable) now."""
        ...

    def resident_prefix(self, req: Request) -> int | None:
        """Tokens of ``req``'s context that its resident session already holds; None when
        ``req`` is not a turn of a resident session."""
        ...

    def cached_estimate(self, req: Request) -> int | None:
        """Tokens of ``req``'s context that admitting it now would not compute (resident or
        cached; changes nothing); None when unknown (then the fast lane skips it)."""
        ...

    def reclaim_idle(self) -> bool:
        """Evicts one idle session's K/V; False when there is none."""
        ...

    def start(self, req: Request) -> int | None:
        """Admits ``req`` (out of the queue): a sequence, its prefix mapped; returns the tokens
        it need not compute (the scheduler then adds it to the running set), or None when that
        failed: ``req`` was then failed alone and holds nothing."""
        ...

    def preempt(self, req: Request) -> None:
        """Releases running ``req``'s K/V (the scheduler already took it off the running set)
        and requeues it with its place (or parks a closing session turn)."""
        ...


class Scheduler:
    """The admission and batching policy (module docs)."""

    def __init__(
        self,
        *,
        parallel: int,
        batch_tokens: int,
        block_size: int,
        prefix_cache: bool = True,
        fast_lane: int | None = None,
        aging_s: float | None = 30.0,
    ) -> None:
        self.parallel = parallel
        self.batch_tokens = batch_tokens
        self.block = block_size
        self.prefix_cache = prefix_cache
        # Prompt tokens left to compute that still let a request skip the queue while the
        # step's prompt budget is taken: four blocks, or 1/8 of the budget.
        self.fast_lane = max(4 * block_size, batch_tokens // 8) if fast_lane is None else fast_lane
        self.queue = WaitQueue(aging_s)
        self.running: dict[int, Request] = {}  # sequence id -> request

    # -- arithmetic ------------------------------------------------------------------------------
    def blocks_to_fill(self, req: Request, extra: int = 0) -> int:
        """Fresh blocks ``req`` needs to hold all its tokens (+ ``extra``) from ``n_done``."""
        b = self.block
        return -(-(req.n_tokens + extra) // b) - (-(-req.n_done // b))

    def slots(self) -> int:
        return sum(1 + len(r.children) for r in self.running.values())

    def victim(
        self, below: int | None = None, spare: frozenset[int] = frozenset()
    ) -> Request | None:
        """The running request to preempt: lowest priority, latest arrival. With ``below`` (a
        waiting request's priority): only one of lower priority, never a closing session turn
        (it frees nothing worth a slot), one in ``spare`` (admitted in this step), nor one
        admitted by aging (``protected``: a flood of higher priorities cannot starve it by
        preempting it again and again; memory shortage still can preempt it)."""
        best: Request | None = None
        for r in self.running.values():
            if below is not None and (
                r.priority >= below
                or r.protected
                or id(r) in spare
                or (r.turn is not None and r.turn.closing)
            ):
                continue
            if best is None or r.key > best.key:
                best = r
        return best

    # -- admission -------------------------------------------------------------------------------
    def admit(self, res: Resources, now: float) -> list[Request]:
        """Admits waiting requests (module docs); returns them in admission order."""
        queue = self.queue
        queue.compact()
        avail = res.available()
        room = avail - sum(self.blocks_to_fill(r) + len(r.children) for r in self.running.values())
        slots = self.slots()
        admitted: list[Request] = []
        deferred: list[Request] = []
        for _ in range(3 * self.parallel):
            req = queue.head(now)
            if req is None:
                break
            promoted = queue.promoted(req, now)
            prio = req.priority
            need_slots = 1 + len(req.children)
            # The step's prompt budget, counting what the plan serves before ``req``.
            prefill = sum(
                r.n_tokens - r.n_done - 1
                for r in self.running.values()
                if promoted or r.priority >= prio
            )
            if prefill >= self.batch_tokens:
                admitted += self._fast_lane(res, room, slots, now, req)
                break  # no room in this step's batch: admitting now would only hold blocks
            spare = frozenset(id(r) for r in admitted)
            if slots + need_slots > self.parallel:
                v = None if promoted else self.victim(below=prio, spare=spare)
                if v is None or need_slots > self.parallel:
                    break  # wait for a slot (FCFS: nobody overtakes the head)
                room, avail, slots = self._preempt(res, v, room, avail, slots)
                continue
            resident = res.resident_prefix(req)
            if resident is not None:  # what the parked sequence holds is not allocated again
                req.n_done = resident
            need = self.blocks_to_fill(req, extra=1) + len(req.children)
            while self.running and need > room and res.reclaim_idle():
                now_avail = res.available()
                room, avail = room + now_avail - avail, now_avail
            if self.running and need > room:
                v = None if promoted else self.victim(below=prio, spare=spare)
                if v is None:
                    break  # wait for memory (FCFS)
                room, avail, slots = self._preempt(res, v, room, avail, slots)
                continue
            queue.pop(req)
            if self.prefix_cache and resident is None and self.computing_shared_prefix(req):
                deferred.append(req)  # its blocks come cached in a step or two
                continue
            if self._start(res, req):
                req.protected = req.protected or promoted
                admitted.append(req)
                room -= need
                slots += need_slots
        for req in deferred:
            queue.push(req, now)
        return admitted

    def _start(self, res: Resources, req: Request) -> bool:
        """Admits ``req`` through the resources; False when that failed (``req`` was failed
        and finished there: it holds nothing)."""
        matched = res.start(req)
        if matched is None:
            return False
        req.n_done = matched
        self.running[req.seq] = req
        return True

    def _preempt(
        self, res: Resources, victim: Request, room: int, avail: int, slots: int
    ) -> tuple[int, int, int]:
        """Preempts ``victim`` during admission; the room and slots it leaves."""
        room += self.blocks_to_fill(victim) + len(victim.children)
        slots -= 1 + len(victim.children)
        self.preempt(res, victim)
        now_avail = res.available()
        return room + now_avail - avail, now_avail, slots

    def preempt(self, res: Resources, victim: Request) -> None:
        """Takes ``victim`` off the running set and lets the resources release and requeue it."""
        del self.running[victim.seq]
        res.preempt(victim)

    def _fast_lane(
        self, res: Resources, room: int, slots: int, now: float, head: Request
    ) -> list[Request]:
        """Admits, in queue order among the first ``2 x parallel``, requests of the head's rank
        with at most ``fast_lane`` prompt tokens left to compute that fit ``room`` and the free
        slots but one."""
        if not self.prefix_cache:
            return []
        head_rank = self.queue.rank(head, now)[:2]
        candidates = list(islice(self.queue.in_order(now), 2 * self.parallel))
        admitted: list[Request] = []
        for req in candidates:
            if slots + 2 > self.parallel or self.queue.rank(req, now)[:2] != head_rank:
                break
            if req.children:
                continue
            done = res.cached_estimate(req)
            if done is None or req.n_tokens - done > self.fast_lane:
                continue
            resident = res.resident_prefix(req)
            if resident is None and self.computing_shared_prefix(req):
                continue  # more of it comes cached in a step or two: wait for that
            saved = req.n_done
            req.n_done = resident if resident is not None else 0
            need = self.blocks_to_fill(req, extra=1)
            if need > room:
                req.n_done = saved
                continue
            self.queue.remove(req)
            if self._start(res, req):
                admitted.append(req)
                room -= need
                slots += 1
        return admitted

    def computing_shared_prefix(self, req: Request) -> bool:
        """Whether a running request is still prefilling whole blocks that ``req``'s prompt
        starts with (O(prefilling requests x shared blocks))."""
        b = self.block
        ids = req.context()
        usable = (len(ids) - 1) // b * b  # what a prefix match could map
        if usable == 0:
            return False
        head = ids[:b]
        for other in self.running.values():
            if other.salt != req.salt:
                continue  # its blocks are keyed under another salt: nothing to share
            oids = other.context()
            if other.n_done >= min(usable, len(oids) - 1) or oids[:b] != head:
                continue  # it computed what it had (or nothing shared)
            shared = b
            limit = min(usable, len(oids) // b * b)
            while shared < limit and oids[shared : shared + b] == ids[shared : shared + b]:
                shared += b
            if shared > other.n_done // b * b:
                return True
        return False

    # -- the batch -------------------------------------------------------------------------------
    def plan(self) -> list[PlanEntry]:
        """This step's batch: one token for every generating sequence (and the last token of a
        closing session turn, without logits), then prompt chunks: short remainders first (the
        fast lane's), then by priority and arrival, up to ``batch_tokens`` tokens in all."""
        plan: list[PlanEntry] = []
        prefilling: list[Request] = []
        for req in self.running.values():
            if req.turn is not None and req.turn.closing:
                plan.append((req, req.n_done, req.n_tokens - req.n_done, False))
            elif req.n_tokens - req.n_done == 1:
                plan.append((req, req.n_done, 1, True))
            else:
                prefilling.append(req)
        left = self.batch_tokens - len(plan)
        fast = self.fast_lane
        prefilling.sort(key=lambda r: (r.n_tokens - r.n_done > fast, r.key))
        for req in prefilling:
            if left <= 0:
                break
            k = min(req.n_tokens - req.n_done, left)
            plan.append((req, req.n_done, k, req.n_done + k == req.n_tokens))
            left -= k
        return plan
