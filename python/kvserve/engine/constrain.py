"""Token masks of constrained requests (structured output, :mod:`kvserve.grammar`), computed
off the critical path: the engine thread starts them before a forward pass and collects them
after it, so the matchers' work overlaps the pass (the core and llguidance both release the
GIL). A step without constrained rows costs nothing here."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .requests import Request

__all__ = ["Masks", "allowed_ids"]

log = logging.getLogger("kvserve.engine")


class Masks:
    """One helper thread that fills the token bitmasks of a step's constrained rows."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.words = (n_vocab + 31) // 32
        self._pool: ThreadPoolExecutor | None = None
        self.rows = 0  # masks computed
        self.seconds = 0.0  # time spent computing them (on the helper thread)
        self.waited = 0.0  # time the engine thread waited for them after a pass

    def start(self, reqs: list[Request]) -> tuple[list[Request], np.ndarray, Future[None]] | None:
        """Starts computing the masks of ``reqs`` (their matchers' current states); None when
        there are none. :meth:`finish` must be called before any of the matchers changes."""
        if not reqs:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-masks")
        bitmask = np.full((len(reqs), self.words), -1, dtype=np.int32)
        jobs = [(r.matcher, i) for i, r in enumerate(reqs)]
        fut = self._pool.submit(self._fill, jobs, bitmask)
        return reqs, bitmask, fut

    def _fill(self, jobs: list[tuple[Any, int]], bitmask: np.ndarray) -> None:
        # One matcher after another on this thread (each call releases the GIL). llguidance's
        # own parallel executor was measured at ~130 µs per mask here against ~18 µs for this
        # loop: with the forward pass on every core, waking its pool costs more than the work.
        t0 = time.perf_counter()
        row = self.words * 4
        base = bitmask.ctypes.data
        for matcher, i in jobs:
            # The pointer is row i of ``bitmask`` (C-contiguous int32, ``words`` per row),
            # which lives until finish(): what llguidance writes stays inside it.
            matcher.unsafe_compute_mask_ptr(base + i * row, row)
        self.seconds += time.perf_counter() - t0
        self.rows += len(jobs)

    def finish(self, handle: tuple[list[Request], np.ndarray, Future[None]] | None) -> None:
        """Waits for the masks ``start`` began and hands each request its own (``req.mask``)."""
        if handle is None:
            return
        reqs, bitmask, fut = handle
        t0 = time.perf_counter()
        try:
            fut.result()
        except Exception:
            # Not the pass's failure: the rows go without masks, and each of their requests
            # fails alone when it is sampled (engine.loop._emit).
            log.exception("computing the token masks of %d constrained rows failed", len(reqs))
            for r in reqs:
                r.mask = None
            return
        finally:
            self.waited += time.perf_counter() - t0
        for i, r in enumerate(reqs):
            r.mask = bitmask[i]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def allowed_ids(words: np.ndarray, n_vocab: int) -> np.ndarray:
    """The token ids the bitmask ``words`` allows, ascending: token ``t`` is allowed when bit
    ``t % 32`` of word ``t // 32`` is set."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little", count=n_vocab)
    return np.flatnonzero(bits)
