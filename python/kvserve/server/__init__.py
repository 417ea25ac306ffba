"""``kvserve serve``: an OpenAI-compatible HTTP server over :class:`kvserve.Engine`.

FastAPI on uvicorn, one process: the event loop handles HTTP and moves text, the engine thread
computes (continuous batching over every client). :func:`create_app` builds the ASGI app (for
tests and embedding); :func:`serve` runs it until interrupted. Routes and behaviour are in
:mod:`kvserve.server.app`; the API is documented in the README.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from types import FrameType
from typing import Any

from .app import create_app
from .config import ServerConfig

__all__ = ["ServerConfig", "configure_logging", "create_app", "serve"]


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, and the message or, for access-log
    records, their fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            entry.update(access)
        else:
            entry["message"] = record.getMessage()
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Logs of the server, uvicorn and the access log to stderr, as ``text`` lines or ``json``
    objects (one per line)."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("kvserve", "uvicorn"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
    logging.getLogger("uvicorn.access").disabled = True  # the access log is kvserve.access


def serve(config: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM (requests in flight get ``config.shutdown_grace`` seconds to
    finish, then end with a ``shutting_down`` error; new ones get 503). The
    model loads in the background while ``/health`` answers 503; if it fails to load the
    server stops and the error is raised here."""
    import uvicorn

    from .linger import LingeringH11Protocol

    configure_logging(config.log_format)
    failure: list[BaseException] = []
    server: uvicorn.Server | None = None

    def load_failed(error: BaseException) -> None:
        failure.append(error)
        if server is not None:
            server.should_exit = True

    app = create_app(config, on_load_error=load_failed)
    grace = config.shutdown_grace

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # The first SIGTERM/SIGINT: streams in flight get `grace` seconds, then an error
            # event (uvicorn's own graceful shutdown would cut them off mid-stream).
            if not self.should_exit:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    loop = None
                if loop is not None:
                    loop.call_soon_threadsafe(app.drain, grace)  # type: ignore[attr-defined]
            super().handle_exit(sig, frame)

    server = _Uvicorn(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            http=LingeringH11Protocol,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=grace + 2,
        )
    )
    if config.api_keys_file is not None and hasattr(signal, "SIGHUP"):
        keys_file = config.api_keys_file
        signal.signal(signal.SIGHUP, lambda *_: app.reload(keys_file))  # type: ignore[attr-defined]
    server.run()
    if failure:
        raise failure[0]
