"""Sessions on the engine thread: their lifecycle (a turn starts, attaches to the parked
sequence, ends and parks), reclaim (watermarks, eviction for running requests, TTL,
``max_sessions``) and persistence (snapshot for a save, restore from a file). The table and the
file format live in :mod:`kvserve.sessions`; the rules are in the package docs
(python/kvserve/engine/__init__.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._model import KvCacheFull, StrPath
from ..sessions import Session, SessionFileError, SessionTable
from .requests import RUNNING, WAITING, Call, Request, common_prefix

if TYPE_CHECKING:
    from .loop import EngineLoop

__all__ = ["SessionManager"]


class TooManySessions(RuntimeError):
    """A new session is needed while ``max_sessions`` sessions are held and all are busy."""


class SessionManager:
    """Every session of one engine and what happens to them (engine thread only, except
    ``table.get`` snapshots for early checks)."""

    def __init__(
        self,
        loop: EngineLoop,
        *,
        kv_high_watermark: float,
        kv_low_watermark: float,
        session_ttl: float | None,
        max_sessions: int | None,
    ) -> None:
        self.loop = loop
        self.table = SessionTable(loop.kv.block)
        self.kv_high_watermark = kv_high_watermark
        self.kv_low_watermark = kv_low_watermark
        self.session_ttl = session_ttl
        self.max_sessions = max_sessions
        # Sessions whose next turn waits in the queue, in activation order: their K/V is what
        # a short pool takes after the idle sessions' (O(1) to find one).
        self.queued_turns: dict[str, Session] = {}
        self.evictions = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.table)

    def get(self, session_id: str) -> Session:
        s = self.table.get(session_id)
        if s is None:
            raise KeyError(session_id)
        return s

    # -- creation and removal ------------------------------------------------------------------
    def new(self, sid: str) -> Session:
        """A new, empty session; with ``max_sessions`` reached the least recently used idle
        session is dropped first (``RuntimeError`` if every session is busy)."""
        if self.max_sessions is not None and len(self.table) >= self.max_sessions:
            oldest = self.table.oldest_idle()
            if oldest is None:
                raise TooManySessions(
                    f"max_sessions={self.max_sessions} sessions are held and all are busy"
                )
            self.drop(oldest)
        s = Session(sid, time.monotonic())
        self.table.add(s)
        return s

    def drop(self, s: Session) -> None:
        """Forgets ``s`` (idle): its sequence is removed (full blocks stay cached). It leaves
        the table even when the removal fails."""
        self.table.remove(s)
        self.queued_turns.pop(s.id, None)
        if s.resident:
            seq, s.seq, s.n_kv = s.seq, -1, 0
            self.loop.kv.remove(seq)

    def forget_kv(self) -> None:
        """The context was replaced: no session holds K/V any more (tokens stay)."""
        for s in self.table.values():
            if s.resident:
                s.seq, s.n_kv = -1, 0
                s.evicted = True
                self.table.evicted(s)

    # -- reclaim -------------------------------------------------------------------------------
    def evict(self, s: Session) -> None:
        """Releases the K/V of a session that is not running (its tokens stay)."""
        self.loop.faults.check("session_evict")
        seq, s.seq, s.n_kv = s.seq, -1, 0
        s.evicted = True
        self.table.evicted(s)
        self.evictions += 1
        self.loop.kv.remove(seq)

    def evict_one(self, prefer: Sequence[str | None] = ()) -> bool:
        """Frees K/V for running requests: the first idle session to evict (of the first
        tenant in ``prefer`` that has one, if any), else the K/V of a session whose next
        request still waits; False if there is none."""
        s = self.table.victim(prefer)
        if s is None:
            s = next((t for t in self.queued_turns.values() if t.resident), None)
        if s is None:
            return False
        self.evict(s)
        return True

    def reclaim(self) -> None:
        """Evicts idle sessions from the high watermark down to the low one, those of tenants
        above their K/V share first."""
        if self.table.victim() is None:
            return
        used, total = self.loop.kv.usage()
        if used <= self.kv_high_watermark * total:
            return
        while used > self.kv_low_watermark * total:
            s = self.table.victim(self.loop.sched.kv_over(self.loop))
            if s is None:
                break
            self.evict(s)
            used, total = self.loop.kv.usage()

    def ttl_timeout(self) -> float | None:
        """Seconds until the oldest idle session expires (None: nothing expires)."""
        if self.session_ttl is None:
            return None
        s = self.table.oldest_idle()
        if s is None:
            return None
        return s.last_use + self.session_ttl - time.monotonic()

    def expire(self) -> None:
        while (t := self.ttl_timeout()) is not None and t <= 0:
            s = self.table.oldest_idle()
            assert s is not None
            try:
                self.loop.faults.check("session_expire")
            finally:
                self.drop(s)  # it goes, whatever failed

    # -- turns -----------------------------------------------------------------------------------
    def idle(self, s: Session) -> None:
        """``s`` has finished its current work: it becomes idle and its queue moves on."""
        s.busy = None
        s.last_use, s.last_use_wall = time.monotonic(), time.time()
        self.queued_turns.pop(s.id, None)
        self.table.idle(s)
        self.next(s)

    def next(self, s: Session) -> None:
        """Starts the next work queued on the idle session ``s``: session operations run at
        once, the next request is activated (it joins the waiting queue)."""
        loop = self.loop
        while s.busy is None and s.pending:
            item = s.pending.popleft()
            if isinstance(item, Call):
                loop.run_call_now(item)
                if self.table.get(s.id) is not s:  # dropped: the rest starts afresh
                    rest = list(s.pending)
                    s.pending.clear()
                    for other in rest:
                        if isinstance(other, Call):
                            loop.run_call(other)
                        elif isinstance(other, Request) and other.state == WAITING:
                            loop.contain(other, loop.accept, other)
                    return
            elif isinstance(item, Request) and item.state == WAITING:
                loop.contain(item, self.activate, item, s)
        if s.busy is None and not s.pending and not s.ids and self.table.get(s.id) is s:
            self.drop(s)  # a new session whose first turn did not complete

    def activate(self, req: Request, s: Session) -> None:
        """The session's turn starts: the request's tokens are the session's plus its prompt
        (a first turn: the prompt as usual), and it joins the waiting queue."""
        turn = req.turn
        assert turn is not None
        ids = s.ids + turn.cont if s.ids and turn.cont is not None else turn.first
        loop = self.loop
        if len(ids) > loop.seq_limit:
            msg = f"the session with this prompt has {len(ids)} tokens, more than"
            loop.fail(req, ValueError(f"{msg} {loop.limit_name} allows"))
            return
        sampler = req.sampler
        if s.rng_state is not None and sampler.seed is None and not sampler.params.is_greedy:
            sampler.rng.bit_generator.state = s.rng_state  # the session's random stream
        req.ids = list(ids)
        req.n_prompt = len(ids)
        s.busy = req
        self.table.busy(s)
        s.tenant = req.tenant
        self.queued_turns[s.id] = s
        loop.sched.queue.push(req, time.monotonic())

    def resident_prefix(self, req: Request) -> int | None:
        """Tokens of ``req``'s context its resident session holds (None: no resident session)."""
        s = req.turn.session if req.turn is not None else None
        if s is None or not s.resident:
            return None
        return min(common_prefix(s.ids, req.context()), s.n_kv)

    def attach(self, req: Request) -> int:
        """Gives the admitted session request its sequence: the parked one (reusing the longest
        prefix it holds) or, for a session that is not resident, a new one with what the prefix
        cache still has. Returns the tokens reused."""
        turn = req.turn
        assert turn is not None and turn.session is not None
        s = turn.session
        kv = self.loop.kv
        self.queued_turns.pop(s.id, None)
        context = req.context()
        turn.base = common_prefix(s.ids, context)
        if s.resident:
            n = min(turn.base, s.n_kv, len(context) - 1)
            if n < s.n_kv:
                n = kv.truncate(s.seq, n)
            req.seq = s.seq
            if n == 0:
                s.salt = req.salt
                return kv.match(req.seq, context, req.salt, req.staged)
            if req.cached_tokens < 0:
                req.session_cached = n
            return n
        s.seq = req.seq = kv.alloc()
        if req.cached_tokens < 0 and s.evicted:
            self.misses += 1
        s.evicted = False
        s.salt = req.salt
        return kv.match(req.seq, context, req.salt, req.staged)

    def end_turn(self, req: Request, ok: bool) -> None:
        """The session's running or waiting request ends. Finished: the session takes its
        tokens (and random state) and parks its sequence, after computing the last token's K/V
        (``closing``). Failed or cancelled: the session keeps what it had before the turn."""
        turn = req.turn
        assert turn is not None and turn.session is not None
        s = turn.session
        loop = self.loop
        if ok:
            # What the sequence holds: after a context shift, the shifted context.
            s.ids = list(req.context())
            s.priority = req.priority
            if not req.sampler.params.is_greedy:
                s.rng_state = dict(req.sampler.rng.bit_generator.state)
            if req.n_done < req.n_tokens <= loop.seq_limit:
                turn.closing = True  # decoded in the next step, then parked (park)
                return
            self.park(req)
            return
        if req.state == RUNNING and req.seq >= 0:
            keep = min(req.n_done, turn.base)
            if req.shift:  # a context shift moved everything after req.keep
                keep = min(keep, req.keep)
            seq, req.seq = req.seq, -1
            loop.sched.running.pop(seq, None)
            s.seq, s.n_kv = -1, 0
            if keep > 0:
                keep = loop.kv.truncate(seq, keep)
            if keep > 0:
                s.seq, s.n_kv = seq, keep
            else:
                loop.kv.remove(seq)
        self.idle(s)

    def park(self, req: Request) -> None:
        """The session's sequence stops running and stays, holding its K/V (idle session)."""
        turn = req.turn
        assert turn is not None and turn.session is not None
        s = turn.session
        turn.closing = False
        self.loop.sched.running.pop(req.seq, None)
        s.seq, s.n_kv = req.seq, req.n_done
        req.seq = -1
        self.idle(s)

    # -- persistence -----------------------------------------------------------------------------
    def snapshot(self, session_id: str) -> tuple[dict[str, Any], bytes]:
        """The header and K/V state of a session file (engine thread; the caller writes)."""
        loop = self.loop
        s = self.get(session_id)
        loop.faults.check("session_save")
        kv = loop.kv
        if s.resident:
            state = kv.state_read(s.seq)
            n_kv = s.n_kv
        else:  # evicted: what the prefix cache still holds
            seq = kv.alloc()
            try:
                n_kv = kv.match(seq, s.ids, s.salt) if s.ids else 0
                state = kv.state_read(seq)
            finally:
                kv.remove(seq)
        model = loop.model
        header = {
            "session_id": s.id,
            "model_identity": model.core.identity,
            "model_name": model.core.name,
            "kv_type": kv.kv_type,
            "tokens": s.ids,
            "n_kv": n_kv,
            "rng_state": s.rng_state,
            "priority": s.priority,
            "saved_at": time.time(),
        }
        return header, state

    def restore(
        self,
        sid: str,
        header: dict[str, Any],
        state: bytes,
        path: StrPath,
        salt: bytes,
        tenant: str | None = None,
    ) -> str:
        """Creates session ``sid`` of ``tenant`` from a checked session file (engine thread),
        its K/V salted with ``salt`` (its tenant's); all or nothing."""
        loop = self.loop
        kv = loop.kv
        if self.table.get(sid) is not None:
            raise ValueError(f"a session {sid!r} exists; drop it first or load under another id")
        tokens: list[int] = header["tokens"]
        n_kv: int = header["n_kv"]
        kv.state_check(state, tokens[:n_kv], path)
        loop.faults.check("session_load")
        seq = kv.alloc()
        try:
            while True:
                try:
                    n = kv.state_write(seq, state, salt)
                    break
                except KvCacheFull:
                    victim = self.table.victim()
                    if victim is None:
                        raise
                    self.evict(victim)
                except ValueError as e:
                    raise SessionFileError(f"session file {path}: {e}") from e
        except BaseException:
            kv.free(seq)  # the write is all or nothing: the sequence is empty
            raise
        try:
            s = self.new(sid)
        except BaseException:
            kv.remove(seq)
            raise
        self.table.busy(s)  # re-enters the idle orders below, resident
        s.ids = list(tokens)
        s.seq, s.n_kv = (seq, n) if n > 0 else (-1, 0)
        if n == 0:
            kv.free(seq)
        s.priority = header["priority"]
        s.salt = salt
        s.tenant = tenant  # its blocks count for its tenant's K/V share
        s.rng_state = header.get("rng_state")
        self.table.idle(s)
        return sid
