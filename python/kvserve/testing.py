"""Fault injection for tests of :class:`kvserve.Engine` (and anything built on it).

Every point where the engine thread works on behalf of a request can be made to fail: once,
a number of times, or always, for every request or for the ones a predicate picks. The engine
must then fail the affected request alone (with the injected error), release its K/V, and keep
serving everyone else::

    from kvserve.testing import inject, prompt_is

    with inject(engine, "decode", times=None, request=prompt_is(bad_ids)):
        ...  # every decode batch holding that request fails: the batch is retried, then split,
             # and only that request fails

Points (:data:`POINTS`):

- ``accept``: a new request reaches the engine thread;
- ``admit``: a waiting request is admitted (before its sequence is set up);
- ``prefix_match``: its cached prefix is mapped onto its new sequence;
- ``fork``: a choice of an ``n > 1`` request forks from the computed prompt;
- ``drop``: a cancelled request is removed;
- ``decode``: a batch holding the request (any batch without ``request``) is computed; the
  error is raised before the forward pass (nothing changed, like a rolled-back batch);
- ``panic``: like ``decode``, but a real Rust panic inside the context closes it for good
  (``Context._inject_panic``): the engine must replace the context;
- ``sample``: a row of logits is sampled for the request;
- ``deliver``: a token is handed to the request (text, stop strings, limits);
- ``session_load``, ``session_save``: a session file's state is restored / read;
- ``session_evict``: an idle session's K/V is reclaimed;
- ``session_expire``: an idle session reaches its TTL.

With no fault armed the engine's only cost is one attribute test per point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine
    from .engine.requests import Request

__all__ = [
    "POINTS",
    "Fault",
    "Faults",
    "InjectedFault",
    "inject",
    "live_server",
    "prompt_is",
    "session_is",
]

POINTS = frozenset(
    {
        "accept",
        "admit",
        "prefix_match",
        "fork",
        "drop",
        "decode",
        "panic",
        "sample",
        "deliver",
        "session_load",
        "session_save",
        "session_evict",
        "session_expire",
    }
)


class InjectedFault(RuntimeError):
    """The error an armed fault raises (unless another one was given)."""


Predicate = Callable[["Request"], bool]


class Fault:
    """One armed fault: ``point``, how many more times it fires (None: always), which
    requests it hits (None: all), and the error it raises."""

    def __init__(
        self,
        point: str,
        times: int | None,
        request: Predicate | None,
        error: BaseException | None,
    ) -> None:
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r}; points: {', '.join(sorted(POINTS))}")
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1 or None (always), got {times}")
        self.point = point
        self.times = times
        self.request = request
        self.error = error
        self.fired = 0

    def hits(self, req: Request | None) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        if self.request is not None and (req is None or not self.request(req)):
            return False
        return True


class Faults:
    """The faults armed on one engine (``engine.faults``)."""

    def __init__(self) -> None:
        self.armed: list[Fault] = []

    def add(
        self,
        point: str,
        *,
        times: int | None = 1,
        request: Predicate | None = None,
        error: BaseException | None = None,
    ) -> Fault:
        fault = Fault(point, times, request, error)
        self.armed.append(fault)
        return fault

    def remove(self, fault: Fault) -> None:
        if fault in self.armed:
            self.armed.remove(fault)

    def hit(self, point: str, reqs: Sequence[Request | None]) -> Fault | None:
        """The armed fault at ``point`` that one of ``reqs`` triggers (counted as fired)."""
        for fault in self.armed:
            if fault.point == point and any(fault.hits(r) for r in reqs):
                fault.fired += 1
                return fault
        return None

    def check(self, point: str, *reqs: Request | None) -> None:
        """Raises the armed fault's error at ``point`` (the engine calls this)."""
        fault = self.hit(point, reqs or (None,))
        if fault is not None:
            raise fault.error or InjectedFault(f"injected fault at {point}")


@contextmanager
def inject(
    engine: Engine,
    point: str,
    *,
    times: int | None = 1,
    request: Predicate | None = None,
    error: BaseException | None = None,
) -> Iterator[Fault]:
    """Arms a fault on ``engine`` for the ``with`` block (see the module docs); yields it
    (``fault.fired`` counts the times it fired)."""
    fault = engine.faults.add(point, times=times, request=request, error=error)
    try:
        yield fault
    finally:
        engine.faults.remove(fault)


def prompt_is(ids: Sequence[int]) -> Predicate:
    """Picks the requests whose prompt is exactly ``ids`` (token ids, as ``Model.tokenize``
    gives them)."""
    want = list(ids)
    return lambda req: req.ids[: req.n_prompt] == want


def session_is(session_id: str) -> Predicate:
    """Picks the requests on session ``session_id``."""
    return lambda req: req.turn is not None and req.turn.session_id == session_id


@contextmanager
def live_server(app: object, timeout: float = 30.0) -> Iterator[str]:
    """Serves the ASGI ``app`` (e.g. ``kvserve.server.create_app(config, engine=engine)``)
    with uvicorn on a free loopback port in a thread of this process; yields its URL. The
    server stops, lifespan shutdown included, when the block ends."""
    import threading
    import time

    import uvicorn

    from kvserve.server.linger import LingeringH11Protocol

    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host="127.0.0.1",
        port=0,
        http=LingeringH11Protocol,
        log_config=None,
        lifespan="on",
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not srv.started and thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.02)
        if not srv.started:
            raise RuntimeError("uvicorn stopped before it started")
        yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(timeout)
    if thread.is_alive():
        raise RuntimeError("uvicorn did not stop")
