"""The HTTP plumbing under the routes: OpenAI-style errors, the gate every request passes
(request id, API key, body size limit, access log, request counter) and the server-sent-events
response that cancels its generation when the client goes away.

Everything here is plain ASGI (no ``BaseHTTPMiddleware``), so a streaming response is never
buffered and a client's disconnect reaches the route.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import Metrics
from .tenants import Tenant, Tenants

__all__ = ["ApiError", "EventStream", "Gate", "error_response"]

log = logging.getLogger("kvserve.server")
access_log = logging.getLogger("kvserve.access")

# Scope keys the gate sets for the routes (and reads back for the access log).
REQUEST_ID = "kvserve.request_id"
ARRIVAL = "kvserve.arrival"  # time.monotonic() when the request arrived
ACCESS = "kvserve.access"  # dict of extra access-log fields a route fills in
TENANT = "kvserve.tenant"  # the request's Tenant (None without API keys)
# The generation routes: a tenant's rate and concurrency limits count these.
GENERATION_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/completions",
        "/chat/completions",
        "/responses",
    }
)


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    return "invalid_request_error" if status < 500 else "server_error"


class ApiError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param",
    "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _error_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        }


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def route_label(routes: list[BaseRoute], scope: Scope) -> str:
    """The route template a request is for (``/v1/sessions/{id}``), for metrics and logs; an
    unknown path is ``unmatched`` (its path would make a label per client typo)."""
    for route in routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            return str(getattr(route, "path", "unmatched"))
    return "unmatched"


class Gate:
    """The outermost ASGI layer: gives each HTTP request an id (``x-request-id``), checks the
    API key (every route but ``/health``; constant-time compare), reads the body up to
    ``max_body`` bytes (413 beyond it), and when the response is done counts it by route and
    status and writes one access-log line (``log_format``: ``text`` or ``json``)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Callable[[], list[BaseRoute]],
        metrics: Metrics,
        tenants: Tenants | None,
        max_body: int,
        body_timeout: float = 30.0,
        on_reload: Callable[[Tenants], None] | None = None,
    ) -> None:
        self.app = app
        self.routes = routes
        self.metrics = metrics
        self.tenants = tenants  # replaced whole on a reload (SIGHUP)
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.on_reload = on_reload

    def drain(self, grace: float) -> None:
        """Shutdown begins (call on the event loop): new requests get 503, streams in flight
        get ``grace`` seconds to finish, then an error event (python/kvserve/server/app.py)."""
        self.app.state.drain(grace)  # type: ignore[attr-defined]

    def reload(self, path: str) -> None:
        """Reads the API keys file again; a bad file keeps the tenants in force (logged).
        Requests in flight finish under the tenant they started as; ``on_reload`` gets the
        new tenants (the engine's policies follow them)."""
        try:
            fresh = Tenants.load(path)
        except (OSError, ValueError) as e:
            log.error("the API keys file %s was not reloaded: %s", path, e)
            return
        if self.tenants is not None:
            fresh.adopt_counts(self.tenants)
        self.tenants = fresh
        if self.on_reload is not None:
            self.on_reload(fresh)
        log.info("reloaded %d tenant(s) from %s", len(fresh.by_name), path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival = time.monotonic()
        rid = uuid.uuid4().hex[:24]
        scope[REQUEST_ID] = rid
        scope[ARRIVAL] = arrival
        scope[ACCESS] = {}
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        tenants = self.tenants
        tenant: Tenant | None = None
        admitted = False
        try:
            if tenants is not None and scope["path"] != "/health":
                tenant = tenants.authenticate(_bearer(scope))
                if tenant is None:
                    error = ApiError(
                        401,
                        "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                    await error_response(error)(scope, receive, send_with_id)
                    return
                scope[ACCESS]["tenant"] = tenant.name
                if scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
                    wait = tenants.admit(tenant)
                    if wait is not None:
                        error = ApiError(
                            429,
                            f"tenant {tenant.name!r} is at its request rate or concurrency"
                            " limit; retry later",
                            code="rate_limited",
                            headers={"Retry-After": str(int(wait))},
                        )
                        await error_response(error)(scope, receive, send_with_id)
                        return
                    admitted = True
            scope[TENANT] = tenant
            body = await self._read_body(scope, receive)
            if isinstance(body, ApiError):
                await error_response(body)(scope, receive, send_with_id)
                return
            if body is None:  # the client left while sending its body
                return
            await self.app(scope, _replay(body, receive), send_with_id)
        finally:
            if admitted:
                assert tenants is not None and tenant is not None
                tenants.release(tenant)
            if tenant is not None:
                self._account(tenant.name, status or 500, scope[ACCESS])
            label = route_label(self.routes(), scope)
            # A response that never started failed inside the app (the error was logged).
            self.metrics.requests.labels(label, str(status or 500)).inc()
            self._log(scope, label, status or 500, arrival)

    def _account(self, tenant: str, status: int, access: dict[str, Any]) -> None:
        """A tenant's request in its counters (the token counts a generation route left in
        the access fields)."""
        self.metrics.tenant_requests.labels(tenant, str(status)).inc()
        for kind, field in (
            ("prompt", "prompt_tokens"),
            ("cached", "cached_tokens"),
            ("generated", "completion_tokens"),
        ):
            n = access.get(field)
            if n:
                self.metrics.tenant_tokens.labels(tenant, kind).inc(n)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | ApiError | None:
        too_large = ApiError(
            413,
            f"the request body is larger than the server's limit of {self.max_body} bytes",
            code="body_too_large",
            # The rest of the body is not read: the connection ends with the answer.
            headers={"Connection": "close"},
        )
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    if int(value) > self.max_body:
                        return too_large
                except ValueError:
                    return ApiError(400, "malformed Content-Length header")
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                # A body that trickles in (slowloris) holds a connection, a tenant's slot and
                # this coroutine: the whole body gets body_timeout seconds.
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return ApiError(
                    408,
                    f"the request body did not arrive within {self.body_timeout:g} s",
                    code="body_timeout",
                    headers={"Connection": "close"},
                )
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _log(self, scope: Scope, route: str, status: int, arrival: float) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        client = scope.get("client")
        entry: dict[str, Any] = {
            "id": scope[REQUEST_ID],
            "method": scope["method"],
            "path": scope["path"],
            "route": route,
            "status": status,
            "client": f"{client[0]}:{client[1]}" if client else None,
            **scope[ACCESS],
            "total_ms": round((time.monotonic() - arrival) * 1000, 1),
        }
        line = " ".join(f"{k}={v}" for k, v in entry.items() if v is not None)
        access_log.info(line, extra={"access": entry})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body the gate read, then the real messages (a
    disconnect, for a route that watches for one)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class EventStream(StreamingResponse):
    """``text/event-stream`` from an async generator of encoded events. It watches for the
    client's disconnect the whole time (not only when a write fails): when the client goes
    away the generator is closed at once (its ``finally`` cancels the generation, so the
    engine frees its blocks at the next step) and ``on_disconnect`` is called. ``on_close`` is
    called in every case once the response is over, even if the generator never started (a
    client gone before the first byte)."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        on_disconnect: Callable[[], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.events = events
        self.on_disconnect = on_disconnect
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone = watching.done() and not streaming.done()
            for task in (streaming, watching):
                task.cancel()
            results = await asyncio.gather(streaming, watching, return_exceptions=True)
            await self.events.aclose()
            if self.on_close is not None:  # also when the generator never started
                self.on_close()
        if gone and self.on_disconnect is not None:
            self.on_disconnect()
        error = results[0]
        if isinstance(error, Exception) and not isinstance(error, OSError):
            log.error("stream failed", exc_info=error)


def _bearer(scope: Scope) -> bytes | None:
    """The token of an ``Authorization: Bearer TOKEN`` header, else None."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None
