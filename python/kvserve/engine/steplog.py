"""The step log (``Engine(step_log=PATH)``, ``kvserve serve --step-log PATH``): one JSON line per
batch the engine computes, appended to a file, to see where a workload's time goes (how long
each step took, what it held, and whether the engine was busy or idle between them).

Each line is an object: ``t``, the step's start by the system's monotonic clock
(``time.monotonic()`` in Python; comparable with the same clock in another process on the
host); ``s``, the seconds the forward pass took; ``tokens``, the tokens computed; ``decode``,
how many of them are generated tokens fed back (one per generating sequence); ``rows``, one
``[request, first, count]`` per request in the batch: the request's arrival number (unique in
the engine), the position in its sequence of its first token computed in this step (after a
context shift, in the shifted sequence) and how many. A prompt's chunks are its rows with
``count > 1`` (or its last token's row); a preempted request that resumes recomputes its
tokens in such chunks too. A batch that fails (the core rolls it back) has no line; its retry
or its halves do.

The file is opened (created, appended to) when the engine is made, so a path that cannot be
written is an error then. The engine thread only queues each step's numbers; a writer thread
formats and writes them, so a slow disk never holds up a step. If the writer falls
``MAX_QUEUED`` steps behind, further steps are left out (a warning says how many when the log
closes); a write that fails is logged once and ends the log, never the engine. Closing the
engine writes what is queued (waiting at most ``CLOSE_WAIT_S`` seconds for it).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from .._model import StrPath
    from .scheduler import PlanEntry

__all__ = ["StepLog"]

log = logging.getLogger("kvserve.engine")

# Steps the writer may fall behind before the engine leaves steps out of the log (a few
# seconds to minutes of steps; at most ~20 MB queued even with 256 rows a step).
MAX_QUEUED = 1024
# Seconds closing waits for the writer to write what is queued.
CLOSE_WAIT_S = 5.0

# One step as the engine thread queues it: (start, seconds, decode rows, rows).
_Step = tuple[float, float, int, list[tuple[int, int, int]]]


class StepLog:
    """The engine's step log (module docs): :meth:`write` is called by the engine thread only."""

    def __init__(self, path: StrPath) -> None:
        self.path = os.fspath(path)
        self._file: TextIO = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._open = True  # steps are taken (until closed, or a write fails)
        self._queue: queue.Queue[_Step | None] = queue.Queue(MAX_QUEUED)
        self._writer: threading.Thread | None = None  # started by the first step
        self.dropped = 0  # steps left out because the writer was behind

    def write(self, start: float, seconds: float, plan: Sequence[PlanEntry]) -> None:
        """Queues one computed batch (``start``: its monotonic start, ``seconds``: its time)."""
        if not self._open:
            return
        rows = [(req.key[1], first, n) for req, first, n, _ in plan]
        decode = sum(1 for req, _, n, _ in plan if n == 1 and req.n_generated > 0)
        if self._writer is None:
            self._writer = threading.Thread(target=self._run, name="kvserve-step-log", daemon=True)
            self._writer.start()
        try:
            self._queue.put_nowait((start, seconds, decode, rows))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        f = self._file
        while (step := self._queue.get()) is not None:
            start, seconds, decode, rows = step
            line = json.dumps(
                {
                    "t": round(start, 6),
                    "s": round(seconds, 6),
                    "tokens": sum(n for _, _, n in rows),
                    "decode": decode,
                    "rows": rows,
                },
                separators=(",", ":"),
            )
            try:
                f.write(line + "\n")
                if self._queue.empty():
                    f.flush()  # a reader following the file sees every step written so far
            except (OSError, ValueError) as e:
                log.warning("writing the step log %s failed (%s); it ends here", self.path, e)
                self._open = False
                break

    def close(self) -> None:
        """Writes what is queued (waiting at most ``CLOSE_WAIT_S``) and closes the file; called
        by the engine thread as it stops (idempotent)."""
        self._open = False
        if self._writer is not None:
            if self._writer.is_alive():
                try:
                    self._queue.put(None, timeout=CLOSE_WAIT_S)
                except queue.Full:
                    pass
                self._writer.join(CLOSE_WAIT_S)
            if self._writer.is_alive():
                log.warning("the step log %s did not finish writing in time", self.path)
                return  # the writer still owns the file (a daemon thread: gone at exit)
            self._writer = None
        if self.dropped:
            n, path = self.dropped, self.path
            log.warning("the step log %s left out %d steps (its writer fell behind)", path, n)
            self.dropped = 0
        if not self._file.closed:
            try:
                self._file.close()
            except OSError as e:
                log.warning("closing the step log %s failed (%s)", self.path, e)
