"""Prefix-affinity routing: which replica gets a request. Pure policy (no Ray, no model, no
I/O), so tests drive it with plain values.

What the router knows of each replica:

- the content keys of the blocks it holds, mirrored from its KV events
  (:meth:`Router.apply_events`; ``kvserve.Engine.kv_events``): ``BlockStored`` adds keys,
  ``BlockRemoved`` removes them, ``AllBlocksCleared`` (a snapshot follows, e.g. after the
  replica's event log dropped events) empties the mirror; :meth:`Router.forget` empties it
  when the replica's events cannot be had;
- the keys it was just sent (a request routed there will store its prompt's blocks, but its
  events come later): kept apart, for ``pending_s`` seconds, so that a burst of requests with
  one new prefix goes to one replica before the first one's events arrive;
- its load: requests routed there and not finished (:meth:`Router.started` /
  :meth:`Router.finished`).

The decision for a request whose prompt's whole blocks have keys ``keys`` (the chain the
core computes: ``kvserve._core.Context.block_keys``), in order:

1. a request of a session that is stuck to a live replica goes there (``session``);
2. the replica holding the longest leading run of ``keys`` gets it (``prefix``; among equal
   runs the less loaded, then the one holding fewer blocks), unless its load exceeds the least
   loaded replica's by more than ``imbalance`` (a hot prefix must not pile every request onto
   one replica), or unless the request should seed another replica with the prefix
   (``balance``): the replica holding the fewest blocks (``emptiest``) goes instead when
   - the longest-run replica holds more than ``cache_ratio`` x the emptiest's blocks plus
     ``cache_slack`` (the caches are lopsided),
   - the emptiest holds none of this prompt, and
   - what the longest run saves is under ``seed_below`` of the prompt's blocks (the request
     is mostly its own new content: a new conversation on a shared system prompt, not the
     next turn of one).
   Without this rule a shared system prompt held by one replica draws every new conversation
   to it whenever fewer than ``imbalance`` requests are in flight: one replica's cache
   thrashes while the other's sits empty (benches/bench_routing.py, BENCHMARKS.md). Once the
   emptier replica holds the prefix too, new conversations split between them by load and
   by blocks held;
3. otherwise two replicas drawn at random, the less loaded of them (power of two choices;
   ``load``), ties to the longer match.

A session's first request sticks it to the replica chosen; it stays there while that replica
lives (:meth:`Router.remove_replica` unsticks its sessions, so their next turn lands
elsewhere).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Choice", "Router"]


@dataclass
class _Replica:
    name: str
    keys: set[int] = field(default_factory=set)
    # key -> time until which it counts as held (sent with a request, events not yet seen)
    pending: dict[int, float] = field(default_factory=dict)
    load: int = 0

    def holds(self, key: int, now: float) -> bool:
        if key in self.keys:
            return True
        until = self.pending.get(key)
        if until is None:
            return False
        if until < now:
            del self.pending[key]
            return False
        return True

    def held(self) -> int:
        """Blocks it holds or was just sent (pending keys; expired ones go at the next events)."""
        return len(self.keys) + len(self.pending)

    def matched(self, keys: Sequence[int], now: float) -> int:
        n = 0
        for k in keys:
            if not self.holds(k, now):
                break
            n += 1
        return n


@dataclass(frozen=True)
class Choice:
    """The replica a request goes to, why (``session``, ``prefix``, ``balance`` or ``load``)
    and how many of its leading blocks that replica holds (as far as the router knows)."""

    replica: str
    reason: str
    matched_blocks: int


def _key(value: int | str) -> int:
    """A key from an event: an int, or hex as ``Engine.kv_events`` writes it."""
    return value if isinstance(value, int) else int(value, 16)


class Router:
    """Prefix-affinity routing over named replicas (see the module docs). Not thread-safe: one
    owner (the ingress's event loop) calls it."""

    def __init__(
        self,
        replicas: Iterable[str] = (),
        *,
        imbalance: int = 4,
        cache_ratio: float = 2.0,
        cache_slack: int = 64,
        seed_below: float = 0.75,
        pending_s: float = 10.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if imbalance < 0:
            raise ValueError(f"imbalance must be >= 0, got {imbalance}")
        self.imbalance = imbalance
        self.cache_ratio = cache_ratio
        self.cache_slack = cache_slack
        self.seed_below = seed_below
        self.pending_s = pending_s
        self._rng = rng or random.Random()
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}
        self._sessions: dict[str, str] = {}
        for name in replicas:
            self.add_replica(name)

    # -- replicas ------------------------------------------------------------------------------
    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def add_replica(self, name: str) -> None:
        """A live replica, known to hold nothing yet (no-op if known)."""
        self._replicas.setdefault(name, _Replica(name))

    def remove_replica(self, name: str) -> None:
        """The replica is gone: forget what it held and unstick its sessions."""
        self._replicas.pop(name, None)
        for sid in [s for s, r in self._sessions.items() if r == name]:
            del self._sessions[sid]

    def forget(self, name: str) -> None:
        """What the replica holds is unknown (its events were lost): route as if it held
        nothing until a snapshot comes."""
        r = self._replicas.get(name)
        if r is not None:
            r.keys.clear()
            r.pending.clear()

    def held(self, name: str) -> int:
        """How many keys the router believes ``name`` holds (from its events)."""
        r = self._replicas.get(name)
        return 0 if r is None else len(r.keys)

    def load(self, name: str) -> int:
        r = self._replicas.get(name)
        return 0 if r is None else r.load

    # -- what replicas report ------------------------------------------------------------------
    def apply_events(self, name: str, events: Iterable[Mapping[str, Any]]) -> None:
        """Applies KV events of ``name`` in order (dicts as ``Engine.kv_events`` returns them;
        keys as ints or hex). Events of an unknown replica are ignored."""
        r = self._replicas.get(name)
        if r is None:
            return
        now = self._clock()
        for k in [k for k, until in r.pending.items() if until < now]:
            del r.pending[k]
        for e in events:
            kind = e.get("type")
            if kind == "BlockStored":
                for h in e["block_hashes"]:
                    k = _key(h)
                    r.keys.add(k)
                    r.pending.pop(k, None)
            elif kind == "BlockRemoved":
                for h in e["block_hashes"]:
                    r.keys.discard(_key(h))
            elif kind == "AllBlocksCleared":
                r.keys.clear()

    def started(self, name: str) -> None:
        r = self._replicas.get(name)
        if r is not None:
            r.load += 1

    def finished(self, name: str) -> None:
        r = self._replicas.get(name)
        if r is not None and r.load > 0:
            r.load -= 1

    # -- the decision --------------------------------------------------------------------------
    def session_replica(self, session: str) -> str | None:
        """The live replica ``session`` is stuck to, if any."""
        name = self._sessions.get(session)
        return name if name in self._replicas else None

    def choose(self, keys: Sequence[int], session: str | None = None) -> Choice:
        """The replica for a request whose prompt's whole blocks have ``keys`` (see the module
        docs). Remembers ``keys`` as pending on it and sticks ``session`` to it; the caller
        calls :meth:`started` / :meth:`finished` around the request. ``LookupError`` when no
        replica is live."""
        if not self._replicas:
            raise LookupError("no live replica")
        now = self._clock()
        reps = list(self._replicas.values())
        choice: Choice | None = None
        if session is not None:
            stuck = self.session_replica(session)
            if stuck is not None:
                r = self._replicas[stuck]
                choice = Choice(stuck, "session", r.matched(keys, now))
        if choice is None:
            matched = {r.name: r.matched(keys, now) for r in reps}
            held = {r.name: r.held() for r in reps}
            least = min(r.load for r in reps)
            best = max(reps, key=lambda r: (matched[r.name], -r.load, -held[r.name]))
            emptiest = min(reps, key=lambda r: (held[r.name], r.load))
            m = matched[best.name]
            if (
                m > 0
                and emptiest is not best
                and matched[emptiest.name] == 0
                and emptiest.load - least <= self.imbalance
                and held[best.name] > self.cache_ratio * held[emptiest.name] + self.cache_slack
                and m < self.seed_below * len(keys)
            ):
                choice = Choice(emptiest.name, "balance", 0)
            elif m > 0 and best.load - least <= self.imbalance:
                choice = Choice(best.name, "prefix", m)
            else:
                pair = self._rng.sample(reps, 2) if len(reps) > 1 else reps
                pick = min(pair, key=lambda r: (r.load, -matched[r.name]))
                choice = Choice(pick.name, "load", matched[pick.name])
        if session is not None:
            self._sessions[session] = choice.replica
        chosen = self._replicas[choice.replica]
        until = now + self.pending_s
        for k in keys[choice.matched_blocks :]:
            if k not in chosen.keys:
                chosen.pending[k] = until
        return choice
