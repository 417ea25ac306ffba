"""The step log (``Engine(step_log=PATH)``, ``kvserve serve --step-log PATH``): one JSON line per
batch the engine computes, appended to a file, to see where a workload's time goes (how long
each step took, what it held, and whether the engine was busy or idle between them).

Each line is an object: ``t``, the step's start by the system's monotonic clock
(``time.monotonic()`` in Python; comparable with the same clock in another process on the
host); ``s``, the seconds the forward pass took; ``tokens``, the tokens computed; ``decode``,
how many of them are generated tokens fed back (one per generating sequence); ``rows``, one
``[request, first, count]`` per request in the batch: the request's arrival number (unique in
the engine), the index of its first token computed in this step and how many. A prompt's
chunks are its rows with ``count > 1`` (or its last token's row). The file is opened (created,
appended to) when the engine starts, so a path that cannot be written is an error then; a
write that fails later is logged once and ends the log, never the step.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from .._model import StrPath
    from .scheduler import PlanEntry

__all__ = ["StepLog"]

log = logging.getLogger("kvserve.engine")


class StepLog:
    """The engine thread's step log (module docs); only that thread writes to it."""

    def __init__(self, path: StrPath) -> None:
        self.path = os.fspath(path)
        # Line-buffered: each step's line is in the file when the step ends (one small
        # write a step), so a reader can follow it while the engine runs.
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def write(self, start: float, seconds: float, plan: Sequence[PlanEntry]) -> None:
        """Logs one computed batch (``start``: its monotonic start, ``seconds``: its time)."""
        if self._file is None:
            return
        rows = [[req.key[1], first, n] for req, first, n, _ in plan]
        decode = sum(1 for req, first, n, _ in plan if n == 1 and first >= req.n_prompt)
        line = json.dumps(
            {
                "t": round(start, 6),
                "s": round(seconds, 6),
                "tokens": sum(n for _, _, n, _ in plan),
                "decode": decode,
                "rows": rows,
            },
            separators=(",", ":"),
        )
        try:
            self._file.write(line + "\n")
        except (OSError, ValueError) as e:
            log.warning("writing the step log %s failed (%s); it ends here", self.path, e)
            self.close()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError as e:
                log.warning("closing the step log %s failed (%s)", self.path, e)
