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
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

__all__ = ["TextStream"]


def _held_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class TextStream:
    """Assembles the text of a generation piece by piece; see the module docs."""

    def __init__(self, stop: Iterable[str] = ()) -> None:
        self.stops = [s for s in stop if s]
        self.stopped = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

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
        pending = self._pending + text
        if not self.stops:
            self._pending = ""
            return pending
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return pending[: min(hits)]
        keep = 0 if final else _held_suffix(pending, self.stops)
        ready = len(pending) - keep
        self._pending = pending[ready:]
        return pending[:ready]
