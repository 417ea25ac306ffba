"""Incremental detokenization: token byte pieces in, safe-to-show text out.

Guarantees:
- Output contains only complete UTF-8 characters: the bytes of a character split across
  tokens are held until it is complete; invalid bytes become U+FFFD (as ``bytes.decode`` with
  ``errors="replace"`` does on the whole string).
- With stop strings, text that might be the start of a stop string is held back until it is
  known not to be; when a stop string appears, the output ends right before it and
  :attr:`TextStream.stopped` becomes true (later pushes return "").
- Concatenating every :meth:`push` result and the :meth:`finish` result gives the full decoded
  text cut before the first stop string (or the full text when none appears).

Precisely, each push decodes its bytes and appends the new text to the held text; if stop
strings occur in that, the push returns the text before the earliest-starting occurrence
(among all stop strings) and the stream stops; otherwise it holds back the longest suffix that
is a proper prefix of some stop string and returns the rest.

Cost: stop strings are matched by an Aho-Corasick automaton (built once per distinct stop
list and shared through a bounded LRU cache), whose state is carried from push to push. A push
takes at most ``2 * len(new text) + len(held text)`` automaton steps (amortized: 2 per
character), however many stop strings there are; the held text is shorter than the longest
stop string.
"""

from __future__ import annotations

import codecs
import threading
from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["TextStream"]

# Edge keys of the automaton: state << _SHIFT | code point (code points are < 2**21).
_SHIFT = 21

# The automaton cache keeps at most this many stop lists, and at most this many states in all
# (an automaton bigger than that is built for its stream and not kept).
CACHE_MAX_ENTRIES = 64
CACHE_MAX_STATES = 1 << 20


class _Automaton:
    """Aho-Corasick automaton over a list of non-empty stop strings.

    States are trie nodes (0: the root, the empty string); ``depth[q]`` is the length of the
    string of ``q``, ``fail[q]`` the state of its longest proper suffix that is a trie node,
    ``match[q]`` the length of the longest stop string that is a suffix of it (0: none)."""

    __slots__ = ("edges", "fail", "depth", "match")

    def __init__(self, stops: Iterable[str]) -> None:
        edges: dict[int, int] = {}
        depth = [0]
        match = [0]  # for now: the length of the stop string ending exactly here
        children: list[list[int]] = [[]]
        for stop in stops:
            q = 0
            for ch in stop:
                key = q << _SHIFT | ord(ch)
                nxt = edges.get(key)
                if nxt is None:
                    nxt = len(depth)
                    edges[key] = nxt
                    depth.append(depth[q] + 1)
                    match.append(0)
                    children.append([])
                    children[q].append(key)
                q = nxt
            match[q] = len(stop)
        fail = [0] * len(depth)
        # Breadth first: a state's failure state is shallower, hence done before it.
        queue = [edges[key] for key in children[0]]
        mask = (1 << _SHIFT) - 1
        i = 0
        while i < len(queue):
            q = queue[i]
            i += 1
            for key in children[q]:
                v = edges[key]
                c = key & mask
                f = fail[q]
                while True:
                    nxt = edges.get(f << _SHIFT | c)
                    if nxt is not None:
                        f = nxt
                        break
                    if f == 0:
                        break
                    f = fail[f]
                fail[v] = f
                if not match[v]:  # a stop ending here is the longest; else the suffix's
                    match[v] = match[f]
                queue.append(v)
        self.edges = edges
        self.fail = fail
        self.depth = depth
        self.match = match

    @property
    def n_states(self) -> int:
        return len(self.depth)


_cache: OrderedDict[tuple[str, ...], _Automaton] = OrderedDict()
_cache_states = 0
_cache_lock = threading.Lock()


def _automaton(stops: tuple[str, ...]) -> _Automaton:
    """The automaton of ``stops``, from the LRU cache or built (and cached if it fits)."""
    global _cache_states
    with _cache_lock:
        ac = _cache.get(stops)
        if ac is not None:
            _cache.move_to_end(stops)
            return ac
    ac = _Automaton(stops)  # outside the lock: another thread may build the same, harmlessly
    if ac.n_states > CACHE_MAX_STATES:
        return ac
    with _cache_lock:
        if stops not in _cache:
            _cache[stops] = ac
            _cache_states += ac.n_states
            while len(_cache) > CACHE_MAX_ENTRIES or _cache_states > CACHE_MAX_STATES:
                _, old = _cache.popitem(last=False)
                _cache_states -= old.n_states
    return ac


class TextStream:
    """Assembles the text of a generation piece by piece; see the module docs."""

    def __init__(self, stop: Iterable[str] = ()) -> None:
        self.stops = [s for s in stop if s]
        self.stopped = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ac = _automaton(tuple(self.stops)) if self.stops else None
        # Invariant: ``_pending`` is the string of ``_state`` (the held text).
        self._pending = ""
        self._state = 0
        self.steps = 0  # automaton steps taken so far (instrumentation for the tests)

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to show."""
        if self.stopped:
            return ""
        return self._release(self._decoder.decode(piece), final=False)

    def finish(self) -> str:
        """End of generation: flush held bytes (incomplete characters become U+FFFD)."""
        if self.stopped:
            return ""
        return self._release(self._decoder.decode(b"", final=True), final=True)

    def _release(self, text: str, final: bool) -> str:
        ac = self._ac
        if ac is None:
            return text
        pending = self._pending + text
        edges, fail, depth, match = ac.edges, ac.fail, ac.depth, ac.match
        q = self._state
        steps = 0
        best = -1  # start (in ``pending``) of the earliest occurrence found so far
        end = len(self._pending)  # in ``pending``: the end of the text scanned so far
        for ch in text:
            c = ord(ch)
            while True:  # one step of the automaton: goto, else follow the failure links
                steps += 1
                nxt = edges.get(q << _SHIFT | c)
                if nxt is not None:
                    q = nxt
                    break
                if q == 0:
                    break
                q = fail[q]
            end += 1
            m = match[q]
            if m and (best < 0 or end - m < best):
                best = end - m  # the longest stop ending here starts earliest
            # An occurrence ending later starts inside the string of q or after it.
            if best >= 0 and end - depth[q] >= best:
                break
        self.steps += steps
        if best >= 0:
            self.stopped = True
            self._pending, self._state = "", 0
            return pending[:best]
        if final:
            self._pending, self._state = "", 0
            return pending
        # No stop ends in the text: q's string is the longest suffix that is a prefix of a stop
        # string, and a proper one (a whole stop string would have matched).
        ready = len(pending) - depth[q]
        self._pending, self._state = pending[ready:], q
        return pending[:ready]
