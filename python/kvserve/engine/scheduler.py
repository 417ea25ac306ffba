"""The scheduler: pure policy. Given the waiting queue, the running set and what the resources
(K/V memory, sessions) say, it decides who is admitted, who is preempted and what one step's
batch holds. It calls no model and no context: every question about memory and every action
goes through :class:`Resources`, which the engine implements with its KV manager and sessions
(python/kvserve/engine/loop.py) and tests implement with a fake (tests/test_scheduler.py).

Order. Within a tenant (below), a waiting request is admitted highest ``priority`` first and
first come, first served within a priority, except:

- *aging*: a request that has waited ``aging_s`` seconds is *promoted*: it goes before every
  request of its tenant that is not, in arrival order among the promoted, so low priority is
  never starved while higher priorities keep arriving (it does not preempt anyone, and once
  admitted it is not preempted for priority either);
- *the fast lane*: while the step's prompt budget is taken, a request of the head's rank
  (among the tenant's first ``2 x parallel``) that the plan would compute within the budget
  is admitted out of turn if memory and a slot allow, leaving one slot for the head: one with
  at most ``fast_lane`` prompt tokens left to compute (the rest cached), or one with less work
  left than the running prompts that take the budget (the plan's order, below);
- *shared prefixes*: a request whose prompt starts with whole blocks that a running request is
  prefilling right now waits (keeping its place; it takes no slot and preempts nobody) until
  they are cached, instead of computing them a second time. It is a *waiter* of that request:
  the two are one prefix group, whose users all get their first token soon after the shared
  part is computed.

The plan's order (``prompt_order="groups"``, the default). Within a tenant's part of the
step's prompt budget, the prefilling requests are served: short remainders (at most
``fast_lane`` tokens) first; then the aged (waited ``aging_s`` since first queued, or
admitted by aging) by arrival; then by priority; within a priority the least *work left per
user served* first, ``tokens left / (1 + waiters)``, then arrival. That is Smith's rule for
the summed time to first token: finishing a prefix that five users wait for costs each of
them one fifth of it, so a shared document is finished before a private one of a fifth its
length, the shortest shared remainder first, and the longest cached prefix first among
equal prompts (the cached part is not work left). A prompt is not put behind others for
ever: aging bounds it (after ``aging_s`` it goes first, by arrival), and priority and the
tenants' shares bound what it is measured against (only the same tenant and priority).
``prompt_order="fcfs"``: priority, then arrival (the waiters count for nothing).

First tokens first (either order). A step that holds a prompt at most ``fast_lane`` tokens
from its end (its first token: a shared document's user once the document is cached, a
session's next turn) leaves the longer prompts out, so it is a short step and those first
tokens come one long step sooner (a 512-token prompt step takes ~0.5-1 s on a small CPU); it
does so at most every other computed step, so the longer prompts always progress, and only
while such remainders total at most a quarter of ``batch_tokens``, so the step is short
indeed and a flood of short prompts (any tenant's) costs the longer prompts at most a
quarter-size step in every two.

Preemption. When no slot is free, or the pool cannot hold the head's prompt after idle sessions
were reclaimed, and the head (not merely promoted) has a higher priority than some running
request of its tenant, the lowest-priority running request of its tenant (latest arrived within
it) is preempted: it goes back to the queue with its place and later resumes by recomputing its
tokens, with prefix reuse. A step that runs out of memory while decoding preempts the same
victim, of any priority (from a tenant above its K/V quota first, below).

Tenants. Every request has a tenant (``Request.tenant``; None, the engine's own namespace, is
one tenant too) and every tenant a :class:`TenantPolicy`: a ``weight`` and a ``kv_share``.
Priority, aging and the fast lane order work within a tenant, never between tenants; between
tenants with work (waiting or running), the two things a step hands out are shared by weight:

- *slots*, and with them decode tokens (one per running sequence a step). Admission takes the
  next request from the waiting tenant with the fewest running slots per weight once its head
  is admitted (``(slots + 1) / weight``; ties: the lower virtual time, below, then the heads'
  order), so free slots fill in proportion to the weights. When no slot is free and the
  head's tenant holds fewer slots than its fair share (``parallel x weight / total weight``
  of the tenants with work) while another holds more than its own and would keep at least as
  many slots per weight as the head's tenant gets (``(s_o - 1) / w_o >= (s_t + 1) / w_t``, so
  a slot never goes back and forth), the most over-share tenant gives up its lowest-priority,
  latest-arrived request (preempted as above; never a closing session turn, nor a request
  admitted in this step). A tenant with work thus gets a slot within one step, however many
  requests others keep queued.
- *the step's prompt budget*, by weighted fair queuing over prompt tokens: each tenant with
  prompt work (waiting or prefilling) has a virtual time, the prompt tokens computed for it
  divided by its weight (charged as they are computed, recomputation after a preemption
  included). The plan fills the budget from the lowest virtual times up (weighted
  water-filling: tenants level up together, each in proportion to its weight, until the
  budget or their prompts run out), so a light tenant's prompt is not stuck behind a heavy
  tenant's long prefills. A tenant that gets prompt work after having none starts at the
  lowest virtual time of those that had some, and none lags the highest by more than one
  step's budget (``batch_tokens / weight``): idle time and unused share are not banked.

A tenant whose head cannot be admitted in this step (no slot and no victim, or its part of the
prompt budget taken by its own prefills: its weighted share of the budget or what the other
tenants' prefills leave, the larger) waits with its place while other tenants' heads may still
be admitted (within a tenant nobody overtakes the head). The budget holds back only a tenant
at or above its fair share of slots: one below it is admitted anyway (its slot would otherwise
go to another tenant, to be preempted back). A head that waits for memory stops admission for
everyone (FCFS, so a large prompt is not starved by small ones). Waits stay bounded: within a
tenant by aging; between tenants by the shares (a tenant with waiting work is the next served
whenever it has the fewest slots per weight, and fair preemption brings it to its share). With
one tenant all of this is the rules above, unchanged.

K/V shares. Blocks held per tenant are estimated as ``ceil(n_done / block)`` per running
request plus ``ceil(n_kv / block)`` per idle resident session (the session table keeps these
sums per tenant as sessions park and leave). Shared blocks (forked choices, a session's
prefix that another request mapped) count once per holder; blocks kept only by the prefix
cache, and those of a session whose next turn waits in the queue, count for nobody. A tenant's
quota is its ``kv_share`` of the pool, else an equal split among the tenants holding K/V. Under
memory shortage the tenants above their quota give first, the most over (held / quota) first:
idle sessions are reclaimed from them before others'; admission preempts the lowest-priority,
latest request of such a tenant for a head whose tenant stays within its quota with it (else,
as above, one of lower priority of the head's own tenant); a decode short of memory preempts
from such a tenant before the overall victim.

Per-step cost. The queue keeps one heap per tenant and distinct priority (keyed by arrival), so a
push, a pop and a tenant's head are O(log W + D) for W waiting requests of D distinct priorities; a
cancelled or out-of-turn request is removed in O(1) (its entry is skipped later; the heaps are
compacted when dead entries outnumber live ones, O(W) amortized over as many removals). The fast
lane walks the head tenant's first ``2 x parallel`` requests in order without touching the rest
(O(k log k), a cache lookup and O(R) each). A request considered looks among the P running requests
still prefilling for one computing its prefix (O(P x shared blocks); nothing when none is), and
sorting the plan costs O(R log R). Admission considers at most ``3 x parallel`` requests a step;
each admission looks at the R running requests (O(R)). Tenants add O(R + T log T) for T tenants
with work: the slots and prompt work per tenant (one pass over the running set), a heap of the
waiting tenants (O(T x D) to build, O(log T + D) per request considered), the budget's
water-filling (a sort of the prefilling tenants' virtual times); a fair preemption or a memory
shortage looks at the T tenants and the R running requests. Nothing scans the queue.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import count, islice
from typing import Protocol

from .requests import Request
from .tenancy import DEFAULT_POLICY, SHARED_POLICY, TenantPolicy

__all__ = ["PROMPT_ORDERS", "Resources", "Scheduler", "Tenant", "WaitQueue"]

Tenant = str | None  # a request's tenant (None: the engine's own namespace, one tenant too)

PlanEntry = tuple[Request, int, int, bool]  # (request, first index, token count, wants logits)
PROMPT_ORDERS = ("groups", "fcfs")  # Scheduler's prompt_order
# A prefilling request's place in its tenant's part of the prompt budget (Scheduler.prompt_order).
OrderKey = tuple[bool, bool, int, float, int]


class WaitQueue:
    """Waiting requests in admission order (module docs): per tenant and priority a heap by
    arrival."""

    def __init__(self, aging_s: float | None) -> None:
        self.aging_s = aging_s
        self._heaps: dict[Tenant, dict[int, list[tuple[int, int, Request]]]] = {}
        self._waiting: dict[Tenant, int] = {}  # live requests per tenant (tenants with some)
        self._entries = count(1)
        self._live = 0
        self._dead = 0

    def __len__(self) -> int:
        return self._live

    def __bool__(self) -> bool:
        return self._live > 0

    def tenants(self) -> list[Tenant]:
        """The tenants with waiting requests (O(T))."""
        return list(self._waiting)

    def push(self, req: Request, now: float) -> None:
        """Queues ``req`` with its place (``req.key``'s arrival); the first push sets the time
        its aging counts from."""
        if req.entry:
            raise RuntimeError("the request is queued already")
        if req.queued_at is None:
            req.queued_at = now
        req.entry = next(self._entries)
        heap = self._heaps.setdefault(req.tenant, {}).setdefault(req.priority, [])
        heapq.heappush(heap, (req.key[1], req.entry, req))
        self._live += 1
        self._waiting[req.tenant] = self._waiting.get(req.tenant, 0) + 1

    def _gone(self, req: Request) -> None:
        req.entry = 0
        self._live -= 1
        n = self._waiting[req.tenant] - 1
        if n:
            self._waiting[req.tenant] = n
        else:
            del self._waiting[req.tenant]

    def remove(self, req: Request) -> bool:
        """Takes ``req`` out (O(1)); False if it was not queued."""
        if not req.entry:
            return False
        self._gone(req)
        self._dead += 1
        return True

    def compact(self) -> None:
        """Drops dead entries once they outnumber the live ones (call between walks)."""
        if self._dead <= 64 or self._dead <= self._live:
            return
        for tenant in list(self._heaps):
            heaps = self._heaps[tenant]
            for prio in list(heaps):
                heap = [e for e in heaps[prio] if e[2].entry == e[1]]
                if heap:
                    heapq.heapify(heap)
                    heaps[prio] = heap
                else:
                    del heaps[prio]
            if not heaps:
                del self._heaps[tenant]
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

    def _top(self, tenant: Tenant, prio: int) -> Request | None:
        heaps = self._heaps[tenant]
        heap = heaps[prio]
        while heap and heap[0][2].entry != heap[0][1]:
            heapq.heappop(heap)
            self._dead -= 1
        if heap:
            return heap[0][2]
        del heaps[prio]
        if not heaps:
            del self._heaps[tenant]
        return None

    def head(self, now: float, tenants: Iterable[Tenant] | None = None) -> Request | None:
        """The first request in this queue's order among those of ``tenants`` (None: every
        tenant); O(D) per tenant plus dead entries popped. Admission asks one tenant at a
        time (the scheduler picks the tenant)."""
        best: Request | None = None
        best_rank = (2, 0, 0)
        for tenant in list(self._heaps) if tenants is None else tenants:
            if tenant not in self._heaps:
                continue
            for prio in list(self._heaps[tenant]):
                req = self._top(tenant, prio)
                if req is not None and (r := self.rank(req, now)) < best_rank:
                    best, best_rank = req, r
        return best

    def pop(self, req: Request) -> None:
        """Takes the head ``req`` out (O(log W))."""
        heaps = self._heaps[req.tenant]
        heap = heaps[req.priority]
        assert heap[0][2] is req and heap[0][1] == req.entry
        heapq.heappop(heap)
        if not heap:
            del heaps[req.priority]
            if not heaps:
                del self._heaps[req.tenant]
        self._gone(req)

    def in_order(self, now: float, tenants: Iterable[Tenant] | None = None) -> Iterator[Request]:
        """Live requests of ``tenants`` (None: every tenant) in this queue's order, lazily:
        O(k log k) for the first k. Nothing may be pushed or compacted while the iterator is
        in use (removals are fine)."""

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
        names = list(self._heaps) if tenants is None else tenants
        walks = [walk(h) for t in names if t in self._heaps for h in self._heaps[t].values()]
        return heapq.merge(*walks, key=lambda r: self.rank(r, now))

    def drain(self) -> list[Request]:
        """Every live request, the queue emptied."""
        out = [
            e[2]
            for heaps in self._heaps.values()
            for h in heaps.values()
            for e in h
            if e[2].entry == e[1]
        ]
        for req in out:
            req.entry = 0
        self._heaps.clear()
        self._waiting.clear()
        self._live = self._dead = 0
        return out

    def by_priority(self) -> dict[int, int]:
        """Live requests per priority (O(W); for tests)."""
        out: dict[int, int] = {}
        for heaps in self._heaps.values():
            for prio, h in heaps.items():
                n = sum(1 for e in h if e[2].entry == e[1])
                if n:
                    out[prio] = out.get(prio, 0) + n
        return out


class Resources(Protocol):
    """What the scheduler asks and tells the rest of the engine (memory in blocks)."""

    def available(self) -> int:
        """Blocks free or held only by the prefix cache (evictable) now."""
        ...

    def total_blocks(self) -> int:
        """Blocks in the pool (what a tenant's ``kv_share`` is a fraction of)."""
        ...

    def session_blocks(self) -> Mapping[Tenant, int]:
        """Blocks held by idle resident sessions, per tenant (the estimate of the module
        docs; O(1): kept up to date as sessions park and leave)."""
        ...

    def resident_prefix(self, req: Request) -> int | None:
        """Tokens of ``req``'s context that its resident session already holds; None when
        ``req`` is not a turn of a resident session."""
        ...

    def cached_estimate(self, req: Request) -> int | None:
        """Tokens of ``req``'s context that admitting it now would not compute (resident or
        cached; changes nothing); None when unknown (then the fast lane skips it)."""
        ...

    def reclaim_idle(self, prefer: Sequence[Tenant] = ()) -> bool:
        """Evicts one idle session's K/V, one of the first tenant in ``prefer`` that has one
        if any; False when there is none."""
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


def _default_policy(tenant: Tenant) -> TenantPolicy:
    return SHARED_POLICY if tenant is None else DEFAULT_POLICY


def _prefilling(req: Request) -> bool:
    """Whether ``req`` still has prompt tokens to compute before its last (O(1))."""
    return req.n_done < len(req.ids) - req.shift - 1


def _closing(req: Request) -> bool:
    return req.turn is not None and req.turn.closing


class Scheduler:
    """The admission and batching policy (module docs). ``policy``: a tenant's
    :class:`TenantPolicy` (its ``weight`` and ``kv_share``; the engine's
    :meth:`kvserve.Engine.tenant_policy`)."""

    def __init__(
        self,
        *,
        parallel: int,
        batch_tokens: int,
        block_size: int,
        prefix_cache: bool = True,
        fast_lane: int | None = None,
        aging_s: float | None = 30.0,
        policy: Callable[[Tenant], TenantPolicy] = _default_policy,
        prompt_rows: int | None = None,
        prompt_order: str = "groups",
    ) -> None:
        if prompt_order not in PROMPT_ORDERS:
            raise ValueError(f"prompt_order must be one of {PROMPT_ORDERS}, got {prompt_order!r}")
        # "groups": prompts by work left per user served (shared prefixes, module docs);
        # "fcfs": by priority and arrival only.
        self.by_groups = prompt_order == "groups"
        self.parallel = parallel
        self.batch_tokens = batch_tokens
        self.block = block_size
        self.prefix_cache = prefix_cache
        # Prompt tokens left to compute that still let a request skip the queue while the
        # step's prompt budget is taken: four blocks, or 1/8 of the budget.
        self.fast_lane = max(4 * block_size, batch_tokens // 8) if fast_lane is None else fast_lane
        # The most prompt tokens per step of a request that asked for prompt logprobs (each
        # gets a logits row in that step's output; None: no limit beyond the budget).
        self.prompt_rows = prompt_rows
        self.queue = WaitQueue(aging_s)
        self.running: dict[int, Request] = {}  # sequence id -> request
        self.policy = policy
        # Virtual times of the tenants with prompt work: prompt tokens computed for each /
        # its weight (module docs, "Tenants"); ``_floor``: the lowest when last tracked.
        self.served: dict[Tenant, float] = {}
        self._floor = 0.0
        # Sequence id of a prefilling request -> waiting requests that, at the last admission,
        # waited for prompt blocks it is computing (its prefix group's other members).
        self.waiters: dict[int, int] = {}
        # Whether the last plan made, and the last one computed, left the long prompts out.
        self._planned_short = self._cut_last = False
        # During an admission: the running requests still prefilling (else None).
        self._prefilling: list[Request] | None = None

    def weight(self, tenant: Tenant) -> float:
        return float(self.policy(tenant).weight)

    # -- arithmetic ------------------------------------------------------------------------------
    def blocks_to_fill(self, req: Request, extra: int = 0) -> int:
        """Fresh blocks ``req`` needs to hold all its tokens (+ ``extra``) from ``n_done``."""
        b = self.block
        return -(-(req.n_tokens + extra) // b) - (-(-req.n_done // b))

    def slots(self) -> int:
        return sum(1 + len(r.children) for r in self.running.values())

    def slots_by_tenant(self) -> dict[Tenant, int]:
        """Running slots per tenant (O(R))."""
        held: dict[Tenant, int] = {}
        for r in self.running.values():
            held[r.tenant] = held.get(r.tenant, 0) + 1 + len(r.children)
        return held

    def victim(
        self,
        below: int | None = None,
        spare: frozenset[int] = frozenset(),
        among: Iterable[Request] | None = None,
    ) -> Request | None:
        """The running request (of ``among``, default all) to preempt: lowest priority,
        latest arrival. With ``below`` (a waiting request's priority): only one of lower
        priority, never a closing session turn (it frees nothing worth a slot), one in
        ``spare`` (admitted in this step), nor one admitted by aging (``protected``: a flood of
        higher priorities cannot starve it by preempting it again and again; memory shortage
        still can preempt it)."""
        best: Request | None = None
        for r in self.running.values() if among is None else among:
            if below is not None and (
                r.priority >= below or r.protected or id(r) in spare or _closing(r)
            ):
                continue
            if best is None or r.key > best.key:
                best = r
        return best

    def _of(self, tenant: Tenant) -> list[Request]:
        return [r for r in self.running.values() if r.tenant == tenant]

    def _yielding(self, tenant: Tenant, spare: frozenset[int]) -> Request | None:
        """The request a tenant gives up for another's share (slots or K/V): its lowest
        priority, latest arrival, never a closing session turn nor one admitted in this step."""
        return self.victim(
            among=(
                r
                for r in self.running.values()
                if r.tenant == tenant and id(r) not in spare and not _closing(r)
            )
        )

    # -- admission -------------------------------------------------------------------------------
    def admit(self, res: Resources, now: float) -> list[Request]:
        """Admits waiting requests (module docs); returns them in admission order."""
        queue = self.queue
        queue.compact()
        self._track()
        self.waiters.clear()
        if not queue:  # nothing waits (every step of a lone stream): nothing to weigh
            return []
        # The running requests still prefilling, kept up to date through this admission
        # (_start, preempt): the only ones a waiting request can wait for.
        self._prefilling = [r for r in self.running.values() if _prefilling(r)]
        try:
            return self._admit(res, now)
        finally:
            self._prefilling = None

    def _admit(self, res: Resources, now: float) -> list[Request]:
        """:meth:`admit` once something waits."""
        queue = self.queue
        avail = res.available()
        room = avail - sum(self.blocks_to_fill(r) + len(r.children) for r in self.running.values())
        held = self.slots_by_tenant()
        slots = sum(held.values())
        weights = {t: self.weight(t) for t in {*held, *queue.tenants()}}  # tenants with work
        turns = _Turns(self, now, held, weights)
        admitted: list[Request] = []
        deferred: list[Request] = []
        retry = False  # after a preemption for a tenant's head: that tenant's head again
        tenant: Tenant = None
        for _ in range(3 * self.parallel):
            req = self.queue.head(now, (tenant,)) if retry else None
            retry = False
            if req is None:
                req = turns.next()
            if req is None:
                break
            tenant = req.tenant
            resident = res.resident_prefix(req)
            if self.prefix_cache and resident is None and self._prefilling:
                sharer = self.sharing_prefix(req)
                if sharer is not None:
                    # Its blocks come cached in a step or two: it waits with its place, takes
                    # no slot and preempts nobody, and counts as a waiter of the one computing
                    # them (the plan's order, below).
                    queue.pop(req)
                    deferred.append(req)
                    self.waiters[sharer.seq] = self.waiters.get(sharer.seq, 0) + 1
                    turns.refile(tenant)
                    continue
            promoted = queue.promoted(req, now)
            prio = req.priority
            need_slots = 1 + len(req.children)
            if not self._below_share(tenant, held, weights) and self._budget_taken(
                res, req, now, weights
            ):
                # No room in this step's batch for it: admitting now would only hold blocks.
                fast, room, slots = self._fast_lane(res, room, slots, now, req, weights)
                admitted += fast
                held[tenant] = held.get(tenant, 0) + len(fast)
                continue  # the tenant waits for budget (nobody of it overtakes its head)
            spare = frozenset(id(r) for r in admitted)
            if slots + need_slots > self.parallel:
                v = self._fair_victim(tenant, need_slots, held, weights, spare)
                if v is None and not promoted:
                    v = self.victim(below=prio, spare=spare, among=self._of(tenant))
                if v is None or need_slots > self.parallel:
                    continue  # the tenant waits for a slot (FCFS within it)
                room, avail, slots = self._preempt(res, v, room, avail, slots, held)
                if v.tenant != tenant:
                    turns.refile(v.tenant)  # requeued, with a slot less
                retry = True
                continue
            if resident is not None:  # what the parked sequence holds is not allocated again
                req.n_done = resident
            need = self.blocks_to_fill(req, extra=1) + len(req.children)
            while self.running and need > room and res.reclaim_idle(self.kv_over(res)):
                now_avail = res.available()
                room, avail = room + now_avail - avail, now_avail
            if self.running and need > room:
                v = self._kv_victim(res, tenant, need, spare)
                if v is None and not promoted:
                    v = self.victim(below=prio, spare=spare, among=self._of(tenant))
                if v is None:
                    break  # wait for memory (nobody, of any tenant, overtakes the head)
                room, avail, slots = self._preempt(res, v, room, avail, slots, held)
                if v.tenant != tenant:
                    turns.refile(v.tenant)  # requeued, with a slot less
                retry = True
                continue
            queue.pop(req)
            if self._start(res, req):
                req.protected = req.protected or promoted
                admitted.append(req)
                room -= need
                slots += need_slots
                held[tenant] = held.get(tenant, 0) + need_slots
            turns.refile(tenant)
        for req in deferred:
            queue.push(req, now)
        return admitted

    def _below_share(
        self, tenant: Tenant, held: Mapping[Tenant, int], weights: Mapping[Tenant, float]
    ) -> bool:
        """Whether ``tenant`` holds fewer slots than its fair share, with other tenants having
        work (O(T)): then it is admitted even while its part of the prompt budget is taken
        (its slot would otherwise go to another tenant, to be preempted back)."""
        if len(weights) < 2:
            return False
        return held.get(tenant, 0) < self.parallel * weights[tenant] / sum(weights.values())

    def _budget_taken(
        self,
        res: Resources,
        req: Request,
        now: float,
        weights: Mapping[Tenant, float],
        work: tuple[float, list[tuple[OrderKey, int]]] | None = None,
        cached: int | None = None,
    ) -> bool:
        """Whether the plan would spend the step's prompt budget before reaching ``req``: on
        its tenant's prompts that :meth:`prompt_order` puts before it (judged with no waiter
        of its own, and with its cached prefix when the prompts before it without one take
        the budget; ``cached``: that prefix, if already looked up), counted against the
        budget of :meth:`_prompt_work` (``work``: its answer, if already asked; O(R), and one
        cache lookup)."""
        budget, mine = self._prompt_work(req.tenant, now, weights) if work is None else work
        if sum(left for _, left in mine) < budget:
            return False

        def taken(left: int) -> bool:
            key = self.prompt_order(req, now, left, waiters=0)
            return sum(n for k, n in mine if k < key) >= budget

        if not taken(req.n_tokens - req.n_done):
            return False
        done = cached
        if done is None:
            done = res.cached_estimate(req) if self.prefix_cache else None
        if not done or done <= req.n_done:
            return True
        return taken(req.n_tokens - done)

    def _prompt_work(
        self, tenant: Tenant, now: float, weights: Mapping[Tenant, float]
    ) -> tuple[float, list[tuple[OrderKey, int]]]:
        """The part of the step's prompt budget ``tenant`` can count on (with other tenants
        prefilling: the larger of its weighted share and what the others leave), and its
        running prompts' order keys and tokens left (O(R))."""
        others = 0
        rivals: dict[Tenant, float] = {}
        mine: list[tuple[OrderKey, int]] = []
        for r in self.running.values():
            left = r.n_tokens - r.n_done - 1
            if left <= 0:
                continue
            if r.tenant == tenant:
                mine.append((self.prompt_order(r, now), left))
            else:
                others += left
                rivals[r.tenant] = weights.get(r.tenant) or self.weight(r.tenant)
        budget = float(self.batch_tokens)
        if others:
            w = weights.get(tenant) or self.weight(tenant)
            budget = max(budget * w / (w + sum(rivals.values())), budget - others)
        return budget, mine

    def _fair_victim(
        self,
        tenant: Tenant,
        need: int,
        held: Mapping[Tenant, int],
        weights: Mapping[Tenant, float],
        spare: frozenset[int],
    ) -> Request | None:
        """For a head of ``tenant`` that finds no free slot: when ``tenant`` holds fewer slots
        than its fair share (``parallel`` x its weight / the weights of the tenants with work)
        and another tenant holds more than its own and would keep at least as many slots per
        weight as ``tenant`` gets (so no slot goes back and forth), the request that tenant
        gives up (the most over-share tenant first); else None (O(T log T + R))."""
        if len(weights) < 2:
            return None
        total = sum(weights.values())
        mine = held.get(tenant, 0)
        if mine >= self.parallel * weights[tenant] / total:
            return None
        after = (mine + need) / weights[tenant]
        over = [
            o
            for o, n in held.items()
            if o != tenant
            and n > self.parallel * weights[o] / total
            and (n - 1) / weights[o] >= after
        ]
        over.sort(key=lambda o: held[o] / weights[o], reverse=True)
        for o in over:
            v = self._yielding(o, spare)
            if v is not None:
                return v
        return None

    def _start(self, res: Resources, req: Request) -> bool:
        """Admits ``req`` through the resources; False when that failed (``req`` was failed
        and finished there: it holds nothing)."""
        matched = res.start(req)
        if matched is None:
            return False
        req.n_done = matched
        self.running[req.seq] = req
        if self._prefilling is not None and _prefilling(req):
            self._prefilling.append(req)
        return True

    def _preempt(
        self,
        res: Resources,
        victim: Request,
        room: int,
        avail: int,
        slots: int,
        held: dict[Tenant, int],
    ) -> tuple[int, int, int]:
        """Preempts ``victim`` during admission; the room and slots it leaves."""
        n = 1 + len(victim.children)
        room += self.blocks_to_fill(victim) + len(victim.children)
        slots -= n
        held[victim.tenant] -= n
        self.preempt(res, victim)
        now_avail = res.available()
        return room + now_avail - avail, now_avail, slots

    def preempt(self, res: Resources, victim: Request) -> None:
        """Takes ``victim`` off the running set and lets the resources release and requeue it."""
        del self.running[victim.seq]
        if self._prefilling is not None and victim in self._prefilling:
            self._prefilling.remove(victim)
        res.preempt(victim)

    def _fast_lane(
        self,
        res: Resources,
        room: int,
        slots: int,
        now: float,
        head: Request,
        weights: Mapping[Tenant, float],
    ) -> tuple[list[Request], int, int]:
        """Admits, in queue order among the head's tenant's first ``2 x parallel``, requests
        of the head's rank that the plan computes within this step's budget (at most
        ``fast_lane`` prompt tokens left to compute, the rest cached; or less work left than
        the tenant's running prompts, :meth:`_budget_taken`) and that fit ``room`` and the
        free slots but one; returns them and the room and slots left."""
        if not self.prefix_cache:
            return [], room, slots
        head_rank = self.queue.rank(head, now)[:2]
        candidates = list(islice(self.queue.in_order(now, (head.tenant,)), 2 * self.parallel))
        work = self._prompt_work(head.tenant, now, weights)
        admitted: list[Request] = []
        for req in candidates:
            if slots + 2 > self.parallel or self.queue.rank(req, now)[:2] != head_rank:
                break
            if req.children:
                continue
            done = res.cached_estimate(req)
            if done is None:
                continue
            if req.n_tokens - done > self.fast_lane and self._budget_taken(
                res, req, now, weights, work, done
            ):
                continue
            resident = res.resident_prefix(req)
            if resident is None and self.sharing_prefix(req) is not None:
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
                work[1].append((self.prompt_order(req, now), req.n_tokens - req.n_done - 1))
        return admitted, room, slots

    def sharing_prefix(self, req: Request) -> Request | None:
        """The running request still prefilling whole blocks that ``req``'s prompt starts with,
        if any (O(prefilling requests x shared blocks))."""
        b = self.block
        ids = req.context()
        usable = (len(ids) - 1) // b * b  # what a prefix match could map
        if req.match_limit is not None:
            usable = min(usable, req.match_limit // b * b)
        if usable == 0:
            return None
        head = ids[:b]
        others = self.running.values() if self._prefilling is None else self._prefilling
        for other in others:
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
                return other
        return None

    # -- K/V shares ------------------------------------------------------------------------------
    def kv_held(self, res: Resources) -> dict[Tenant, int]:
        """Blocks held per tenant, estimated (module docs): ceil(n_done / block) per running
        request plus the idle resident sessions' (O(R + T))."""
        held = dict(res.session_blocks())
        b = self.block
        for r in self.running.values():
            held[r.tenant] = held.get(r.tenant, 0) + -(-r.n_done // b)
        return held

    def _kv_quotas(
        self, held: Mapping[Tenant, int], total: int, asking: tuple[Tenant, ...] = ()
    ) -> dict[Tenant, float]:
        """The K/V quota in blocks of each tenant holding K/V and of ``asking``: its
        ``kv_share`` of ``total``, else an equal split among them."""
        holders = {t for t, n in held.items() if n > 0}.union(asking)
        out: dict[Tenant, float] = {}
        for t in holders:
            share = self.policy(t).kv_share
            out[t] = total * share if share is not None else total / len(holders)
        return out

    def kv_over(self, res: Resources) -> list[Tenant]:
        """The tenants holding more K/V than their quota, the most over (held / quota) first:
        whom memory shortage takes from first (O(R + T log T))."""
        held = self.kv_held(res)
        quota = self._kv_quotas(held, res.total_blocks())
        over = [t for t, q in quota.items() if held[t] > q]
        over.sort(key=lambda t: held[t] / quota[t], reverse=True)
        return over

    def _kv_victim(
        self, res: Resources, tenant: Tenant, need: int, spare: frozenset[int]
    ) -> Request | None:
        """For a head of ``tenant`` that needs ``need`` blocks the pool lacks: when ``tenant``
        stays within its K/V quota with them, the request given up by the tenant most above
        its own quota (another tenant); else None (O(R + T log T))."""
        held = self.kv_held(res)
        quota = self._kv_quotas(held, res.total_blocks(), (tenant,))
        if held.get(tenant, 0) + need > quota[tenant]:
            return None
        over = [t for t, q in quota.items() if t != tenant and held.get(t, 0) > q]
        over.sort(key=lambda t: held[t] / quota[t], reverse=True)
        for o in over:
            v = self._yielding(o, spare)
            if v is not None:
                return v
        return None

    def memory_victim(self, res: Resources) -> Request | None:
        """The running request a step short of memory preempts: the lowest-priority, latest
        of the tenant most above its K/V quota, else (none above) :meth:`victim`'s."""
        for tenant in self.kv_over(res):
            v = self.victim(among=self._of(tenant))
            if v is not None:
                return v
        return self.victim()

    # -- prompt service --------------------------------------------------------------------------
    def _track(self) -> None:
        """Keeps the virtual times of the tenants with prompt work (waiting or prefilling): one
        that has just got some starts at the lowest of those that had (idle time is not
        banked), one without is forgotten, and none lags the highest by more than one step's
        budget (``batch_tokens`` / its weight) (O(R + T))."""
        active = set(self.queue.tenants())
        for r in self.running.values():
            if r.n_tokens - r.n_done > 1 and not _closing(r):
                active.add(r.tenant)
        kept = [v for t, v in self.served.items() if t in active]
        if kept:
            self._floor = min(kept)
        served = {t: self.served.get(t, self._floor) for t in active}
        if len(served) > 1:
            top = max(served.values())
            for t, v in served.items():
                served[t] = max(v, top - self.batch_tokens / self.weight(t))
        self.served = served

    def charge(self, part: Iterable[PlanEntry]) -> None:
        """Counts the prompt tokens of a computed part of a step to their tenants' virtual
        times (call before its requests advance; O(entries)), and whether its plan was a
        short step (:meth:`plan`)."""
        self._cut_last = self._planned_short
        for req, start, k, _want in part:
            if req.n_tokens - start > 1 and not _closing(req):
                t = req.tenant
                self.served[t] = self.served.get(t, self._floor) + k / self.weight(t)

    def _split(self, left: int, demand: Mapping[Tenant, int]) -> dict[Tenant, int]:
        """``left`` prompt tokens among tenants wanting ``demand`` (more than ``left`` in all),
        as weighted fair queuing token by token would give them: each next token to the tenant
        with the lowest virtual time ``v_t + given_t / w_t`` that wants more (ties: ``demand``'s
        order). Computed as water-filling: the level ``L`` solving
        ``sum_t min(demand_t, max(0, (L - v_t) x w_t)) = left`` gives every tenant the tokens
        it starts below ``L``; the few tokens that rounding puts over or under ``left`` are
        then taken back from the highest starts and given to the lowest (O(T log T))."""
        rows = [(self.served.get(t, self._floor), self.weight(t), d) for t, d in demand.items()]
        events = sorted([(v, w) for v, w, _ in rows] + [(v + d / w, -w) for v, w, d in rows])
        level, rate, filled = events[0][0], 0.0, 0.0
        top = events[-1][0]
        for x, dw in events:
            if rate > 0 and filled + rate * (x - level) >= left:
                top = level + (left - filled) / rate
                break
            filled += rate * (x - level)
            level, rate = x, rate + dw
        given = [min(d, max(0, math.ceil((top - v) * w))) for v, w, d in rows]
        extra = sum(given) - left
        # The k-th token of tenant i starts at v_i + (k - 1) / w_i.
        over = [
            (-(v + (g - 1) / w), -i, i)
            for i, ((v, w, _), g) in enumerate(zip(rows, given, strict=True))
            if g
        ]
        heapq.heapify(over)
        while extra > 0:  # the highest starts go back
            _, _, i = heapq.heappop(over)
            v, w, _d = rows[i]
            given[i] -= 1
            extra -= 1
            if given[i]:
                heapq.heappush(over, (-(v + (given[i] - 1) / w), -i, i))
        under = [
            (v + g / w, i)
            for i, ((v, w, d), g) in enumerate(zip(rows, given, strict=True))
            if g < d
        ]
        heapq.heapify(under)
        while extra < 0:  # the lowest starts come in
            _, i = heapq.heappop(under)
            v, w, d = rows[i]
            given[i] += 1
            extra += 1
            if given[i] < d:
                heapq.heappush(under, (v + given[i] / w, i))
        return dict(zip(demand, given, strict=True))

    # -- the batch -------------------------------------------------------------------------------
    def plan(self, now: float | None = None) -> list[PlanEntry]:
        """This step's batch: one token for every generating sequence (and the last token of a
        closing session turn, without logits), then prompt chunks up to ``batch_tokens``
        tokens in all: the budget split among tenants by their virtual times and weights
        (:meth:`_split`), and each tenant's part to its prompts in :meth:`prompt_order`
        (``now``: the time aging is judged at; None: only requests admitted by aging count
        as aged)."""
        plan: list[PlanEntry] = []
        prefilling: dict[Tenant, list[Request]] = {}
        for req in self.running.values():
            if _closing(req):
                plan.append((req, req.n_done, req.n_tokens - req.n_done, False))
            elif req.n_tokens - req.n_done == 1:
                plan.append((req, req.n_done, 1, True))
            else:
                prefilling.setdefault(req.tenant, []).append(req)
        # First tokens first: while a prompt is a short remainder from its first token (the
        # fast lane's, a shared document's user once the document is cached), the longer
        # prompts sit this step out, so it is a short step and the first tokens come a long
        # step sooner; they do so at most every other step, so they always progress, and
        # only while those remainders are at most a quarter of the budget: then the step is
        # short indeed, and a client (of any tenant) that keeps sending such prompts costs
        # the long prompts at most a quarter-size step in two.
        fast = self.fast_lane
        rests = [r.n_tokens - r.n_done for rs in prefilling.values() for r in rs]
        quick = sum(n for n in rests if n <= fast)
        short = (
            not self._cut_last
            and 0 < quick <= self.batch_tokens // 4
            and max(rests, default=0) > fast
        )
        if short:
            cut = {
                t: [r for r in rs if r.n_tokens - r.n_done <= fast] for t, rs in prefilling.items()
            }
            prefilling = {t: rs for t, rs in cut.items() if rs}
        self._planned_short = short
        left = self.batch_tokens - len(plan)
        parts = {t: left for t in prefilling}
        if len(prefilling) > 1 and left > 0:
            demand = {t: sum(r.n_tokens - r.n_done for r in rs) for t, rs in prefilling.items()}
            if sum(demand.values()) > left:
                parts = self._split(left, demand)
        for tenant, reqs in prefilling.items():
            budget = parts[tenant]
            if len(reqs) > 1:
                reqs.sort(key=lambda r: self.prompt_order(r, now))
            for req in reqs:
                if budget <= 0:
                    break
                k = min(req.n_tokens - req.n_done, budget)
                if self.prompt_rows is not None and req.prompt_rows(req.n_done, k):
                    k = min(k, self.prompt_rows)
                plan.append((req, req.n_done, k, req.n_done + k == req.n_tokens))
                budget -= k
        return plan

    def prompt_order(
        self,
        req: Request,
        now: float | None,
        left: int | None = None,
        waiters: int | None = None,
    ) -> OrderKey:
        """Sort key of a prefilling request in its tenant's part of the prompt budget (module
        docs, "Shared prefixes"): short remainders (the fast lane's) first; then the aged
        (waited ``aging_s`` since queued, or admitted by aging) by arrival; then priority;
        within a priority the least remaining work per user served, ``(tokens left) / (1 +
        waiters)`` (Smith's rule: the order that minimizes the summed time to first token of
        the request and the waiters of its prefix group); then arrival (O(1)). ``left`` and
        ``waiters`` default to what the request has."""
        if left is None:
            left = req.n_tokens - req.n_done
        if waiters is None:
            waiters = self.waiters.get(req.seq, 0)
        aging = self.queue.aging_s
        aged = req.protected or (
            now is not None
            and aging is not None
            and req.queued_at is not None
            and now - req.queued_at >= aging
        )
        if aged:
            return (left > self.fast_lane, False, 0, 0.0, req.key[1])
        cost = left / (1 + waiters) if self.by_groups else 0.0
        return (left > self.fast_lane, True, req.key[0], cost, req.key[1])


class _Turns:
    """The waiting tenants in the order admission serves them (module docs): a heap keyed by
    (slots per weight once the tenant's head is admitted, its virtual time, the head's rank);
    a tenant is filed again when one of those changes (stale entries are skipped)."""

    def __init__(
        self,
        sched: Scheduler,
        now: float,
        held: Mapping[Tenant, int],
        weights: Mapping[Tenant, float],
    ) -> None:
        self.sched = sched
        self.now = now
        self.held = held
        self.weights = weights
        self.heap: list[tuple[tuple[float, float, tuple[int, int, int]], int, int, Tenant]] = []
        self.version: dict[Tenant, int] = {}
        self.order = count()
        for tenant in sched.queue.tenants():
            self.refile(tenant)

    def refile(self, *tenants: Tenant) -> None:
        """Files ``tenants`` by their present keys (O(D + log T) each)."""
        sched = self.sched
        for tenant in tenants:
            self.version[tenant] = v = self.version.get(tenant, 0) + 1
            head = sched.queue.head(self.now, (tenant,))
            if head is None:
                continue
            w = self.weights.get(tenant) or sched.weight(tenant)
            key = (
                (self.held.get(tenant, 0) + 1 + len(head.children)) / w,
                sched.served.get(tenant, sched._floor),
                sched.queue.rank(head, self.now),
            )
            heapq.heappush(self.heap, (key, next(self.order), v, tenant))

    def next(self) -> Request | None:
        """The head of the first tenant; the tenant leaves the heap until filed again."""
        while self.heap:
            _key, _n, v, tenant = heapq.heappop(self.heap)
            if self.version.get(tenant) != v:
                continue
            self.version[tenant] = v + 1
            head = self.sched.queue.head(self.now, (tenant,))
            if head is not None:
                return head
        return None
