"""Sessions of the serving engine: named conversations whose K/V outlives their requests.

This module holds what :class:`kvserve.Engine` keeps per session; the engine
(python/kvserve/engine.py) applies the policy (see its docs: reuse, reclaim,
eviction, TTL, ``max_sessions``).

- :class:`Session`: the session's tokens (every prompt and output so far), the sequence that
  holds its K/V while it is *resident* (``seq >= 0``, ``n_kv`` leading tokens computed), its last
  use, priority and random generator state, and the FIFO of work waiting for it (a session runs
  one request at a time).
- :class:`SessionTable`: every session by id, plus the idle ones in last-use order (TTL and
  ``max_sessions`` take the oldest) and the idle *resident* ones per priority in last-use order
  (reclaim evicts the lowest priority, least recently used first). Every operation is O(1)
  except :meth:`SessionTable.victim`, O(distinct priorities).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Session",
    "SessionInfo",
    "SessionTable",
    "Turn",
]


@dataclass(frozen=True)
class SessionInfo:
    """One session as :meth:`kvserve.Engine.sessions` reports it.

    ``tokens``: tokens of the conversation so far (prompts and outputs); ``last_use``: wall
    time (``time.time()``) of the end of its last request (or of its creation or load);
    ``resident``: its K/V is held in the pool (else it was evicted and its next turn recomputes
    it, with prefix reuse where cached blocks remain); ``busy``: a request is running or queued
    on it."""

    id: str
    tokens: int
    last_use: float
    resident: bool
    busy: bool


class Session:
    """A named conversation (see the module docs). Owned by the engine thread."""

    def __init__(self, sid: str, now: float) -> None:
        self.id = sid
        self.ids: list[int] = []  # every prompt and output token so far
        self.seq = -1  # the sequence holding its K/V while resident
        self.n_kv = 0  # ids[:n_kv] have their K/V in ``seq``
        self.last_use = now  # time.monotonic()
        self.last_use_wall = time.time()
        self.priority = 0
        self.rng_state: dict[str, Any] | None = None  # the last sampled turn's generator
        self.busy: object | None = None  # the request (or command) running on it now
        self.pending: deque[object] = deque()  # work waiting for it, FIFO
        self.evicted = False  # its K/V was reclaimed since its last turn

    @property
    def resident(self) -> bool:
        return self.seq >= 0

    def info(self) -> SessionInfo:
        return SessionInfo(
            id=self.id,
            tokens=len(self.ids),
            last_use=self.last_use_wall,
            resident=self.resident,
            busy=self.busy is not None or bool(self.pending),
        )


class Turn:
    """The session part of one request: which session, its tokens as a first turn
    (``first``: with BOS) and as a continuation (``cont``: ``None`` for a request that gives the
    whole conversation, e.g. a chat, which then reuses the longest prefix the session holds)."""

    def __init__(self, session_id: str, first: list[int], cont: list[int] | None) -> None:
        self.session_id = session_id
        self.first = first
        self.cont = cont
        self.session: Session | None = None  # set by the engine thread
        self.base = 0  # tokens of the session's own history this turn starts with
        self.closing = False  # finished; its last token's K/V is computed before it parks


class SessionTable:
    """Sessions by id; idle ones by last use, and idle resident ones per priority by last use."""

    def __init__(self) -> None:
        self.by_id: dict[str, Session] = {}
        self._idle: OrderedDict[str, Session] = OrderedDict()
        self._parked: dict[int, OrderedDict[str, Session]] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, sid: str) -> Session | None:
        return self.by_id.get(sid)

    def add(self, s: Session) -> None:
        self.by_id[s.id] = s
        self.idle(s)

    def idle(self, s: Session) -> None:
        """``s`` has nothing running: it joins the idle orders as the most recently used."""
        self._idle[s.id] = s
        self._idle.move_to_end(s.id)
        if s.resident:
            q = self._parked.setdefault(s.priority, OrderedDict())
            q[s.id] = s
            q.move_to_end(s.id)

    def busy(self, s: Session) -> None:
        """``s`` runs something: it leaves the idle orders (it is neither expired nor evicted)."""
        self._idle.pop(s.id, None)
        self._unpark(s)

    def _unpark(self, s: Session) -> None:
        for prio, q in list(self._parked.items()):
            if q.pop(s.id, None) is not None:
                if not q:
                    del self._parked[prio]
                return

    def evicted(self, s: Session) -> None:
        """``s`` is no longer resident (it stays idle)."""
        self._unpark(s)

    def remove(self, s: Session) -> None:
        self.by_id.pop(s.id, None)
        self._idle.pop(s.id, None)
        self._unpark(s)

    def oldest_idle(self) -> Session | None:
        return next(iter(self._idle.values()), None)

    def victim(self) -> Session | None:
        """The idle resident session to evict first: lowest priority, least recently used."""
        if not self._parked:
            return None
        q = self._parked[min(self._parked)]
        return next(iter(q.values()))

    def values(self) -> list[Session]:
        return list(self.by_id.values())
