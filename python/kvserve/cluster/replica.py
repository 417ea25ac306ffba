"""One replica of ``kvserve serve --replicas N``: the single-box server (its FastAPI app and
:class:`kvserve.Engine`) inside a Ray Serve replica. Nothing here imports Ray: the launcher
(:mod:`kvserve.cluster.launch`) makes this class a deployment.

The ingress forwards each HTTP request as plain values (method, path, query, headers, body);
:meth:`ReplicaServer.request` runs it through the same ASGI app ``kvserve serve`` runs, so a
replica answers every route exactly as one server does, and streams the response back: first
``("start", status, headers)``, then the body's chunks as they are sent (SSE included). The
ingress polls :meth:`ReplicaServer.kv_events` to learn what the replica's K/V pool holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from ..server import ServerConfig, configure_logging
from ..server.app import create_app, load_engine

__all__ = ["ReplicaServer"]

log = logging.getLogger("kvserve.cluster")

Headers = list[tuple[str, str]]


class ReplicaServer:
    """A kvserve server answering forwarded requests (see the module docs). ``config``: the
    fields of a :class:`kvserve.server.ServerConfig` (every engine option reaches the
    engine as ``kvserve serve`` passes it: ``ServerConfig.engine_kwargs``)."""

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        cfg = ServerConfig(**config)
        configure_logging(cfg.log_format)
        self.name = name
        self.engine = load_engine(cfg)
        self.app = create_app(cfg, engine=self.engine)
        log.info("replica %s ready (model %s)", name, cfg.model)

    async def request(
        self, method: str, path: str, query: bytes, headers: Headers, body: bytes
    ) -> AsyncIterator[Any]:
        """Runs one HTTP request through the app; yields ``("start", status, headers)``, then
        the body's chunks (bytes). If the caller stops reading (its client went away), the app
        sees the client disconnect, as behind uvicorn."""
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query,
            "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            "client": ("127.0.0.1", 0),
            "server": ("kvserve-replica", 0),
        }
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await out.put(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while True:
                message = await out.get()
                if message is None:
                    task.result()  # the app's own error, if it ended without a response
                    raise RuntimeError(f"replica {self.name}: the app sent no response")
                if message["type"] == "http.response.start":
                    raw = message.get("headers", [])
                    yield ("start", int(message["status"]), _decode(raw))
                elif message["type"] == "http.response.body":
                    chunk = message.get("body", b"")
                    if chunk:
                        yield bytes(chunk)
                    if not message.get("more_body", False):
                        return
        finally:
            gone.set()  # the app's disconnect watchers end; a stream in flight is cancelled

    async def kv_events(self, resync: bool = False) -> dict[str, Any]:
        """``{"replica": name, "events": Engine.kv_events(resync=...)}``."""
        return {"replica": self.name, "events": self.engine.kv_events(resync=resync)}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.close()


def _decode(raw: list[tuple[bytes, bytes]]) -> Headers:
    return [(bytes(k).decode("latin-1"), bytes(v).decode("latin-1")) for k, v in raw]
