"""Cross-origin resource sharing (CORS) for browser clients: ``kvserve serve --cors-origins``.

:class:`Cors` is the outermost ASGI layer when origins are configured (outside the gate, so a
preflight, which never carries an API key, is answered before the key is checked). For an
allowed origin (the ``Origin`` header equal to one configured, or any with ``*``):

- a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
  here with 204: ``Access-Control-Allow-Origin``, ``-Allow-Methods`` (the methods the server
  serves), ``-Allow-Headers`` (``Authorization``, ``Content-Type`` and the header names the
  browser asked for), ``-Max-Age`` and ``Vary``;
- every other response (errors, 401s, 413s and server-sent-event streams included) gets
  ``Access-Control-Allow-Origin`` (the origin itself, or ``*`` when ``*`` is configured) and
  ``Access-Control-Expose-Headers`` naming the server's own headers (``X-Request-Id``,
  ``Retry-After``, ``WWW-Authenticate``; the cluster ingress adds its ``x-kvserve-*``).

A request from another origin gets no CORS headers, and its preflight is a 403 with an
OpenAI-style error body (``cors_origin_refused``; the browser then blocks the request with a
console error that names the origin). With a list of origins (not ``*``) every response carries
``Vary: Origin``, so a cache never hands one origin's answer to another. Requests without
``Origin`` (curl, SDKs outside a browser) are untouched but for that ``Vary``. No credentials
mode: keys travel in ``Authorization``, never cookies, so ``Access-Control-Allow-Credentials``
is never sent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["ALLOWED_METHODS", "EXPOSED_HEADERS", "MAX_AGE_S", "Cors", "parse_origins"]

# What a preflight allows: the methods the server's routes use.
ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
# The headers every preflight allows, besides those the browser asks for.
_ALWAYS_ALLOWED = ("Authorization", "Content-Type")
# The server's own response headers that a page may read (beyond the CORS-safelisted ones).
EXPOSED_HEADERS = ("X-Request-Id", "Retry-After", "WWW-Authenticate")
# Seconds a browser may cache a preflight's answer (Chromium caps it at 7200).
MAX_AGE_S = 600
# A header name (an RFC 9110 token); a preflight asks for at most this many, this long.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")
_MAX_ASKED = 64
# An origin as browsers send it: scheme://host[:port], no path, no trailing slash.
_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/?#\s]+$", re.IGNORECASE)


def parse_origins(text: str | Iterable[str] | None) -> tuple[str, ...] | None:
    """The allowed origins of ``--cors-origins``: a comma-separated string (or a list) of
    origins such as ``https://app.example.com`` or ``http://localhost:3000``, or ``*`` alone
    (any origin); None or empty: no CORS. A ``ValueError`` names an entry that no browser
    would send (a path, a trailing slash, no scheme), which would never match."""
    if text is None:
        return None
    items = text.split(",") if isinstance(text, str) else list(text)
    origins = tuple(dict.fromkeys(o.strip() for o in items if o.strip()))
    if not origins:
        return None
    if "*" in origins:
        if len(origins) > 1:
            raise ValueError("cors origins: '*' allows every origin; give it alone")
        return origins
    for o in origins:
        if o != "null" and not _ORIGIN.match(o):
            raise ValueError(
                f"cors origins: {o!r} is not an origin (scheme://host[:port], no path or"
                " trailing slash, e.g. https://app.example.com)"
            )
    return origins


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


class Cors:
    """The CORS layer (module docs) over ``app``; ``origins``: as :func:`parse_origins`
    returns them; ``expose``: the response headers a page may read. Other attributes are the
    wrapped app's (the gate's ``drain`` and ``reload``)."""

    def __init__(
        self, app: ASGIApp, origins: Sequence[str], expose: Sequence[str] = EXPOSED_HEADERS
    ) -> None:
        self.app = app
        self.any = tuple(origins) == ("*",)
        self.origins = frozenset(origins)
        self.expose = ", ".join(expose).encode()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    def allowed(self, origin: str) -> bool:
        return self.any or origin in self.origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = _header(scope, b"origin")
        preflight = (
            scope["method"] == "OPTIONS"
            and origin is not None
            and _header(scope, b"access-control-request-method") is not None
        )
        ok = origin is not None and self.allowed(origin)
        if preflight:
            assert origin is not None
            await (self._preflight(scope, origin) if ok else self._refused(origin))(send)
            return
        added: list[tuple[bytes, bytes]] = []
        if ok:
            assert origin is not None
            added += [
                (b"access-control-allow-origin", b"*" if self.any else origin.encode("latin-1")),
                (b"access-control-expose-headers", self.expose),
            ]
        vary = not self.any  # the answer depends on the Origin header

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += added
                if vary:
                    headers = _add_vary(headers, b"Origin")
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _preflight(self, scope: Scope, origin: str) -> _Answer:
        asked = _header(scope, b"access-control-request-headers") or ""
        names = dict.fromkeys(h.lower() for h in _ALWAYS_ALLOWED)
        for name in asked.split(",")[:_MAX_ASKED]:
            name = name.strip().lower()
            if _TOKEN.match(name):
                names.setdefault(name)
        headers = [
            (b"access-control-allow-origin", b"*" if self.any else origin.encode("latin-1")),
            (b"access-control-allow-methods", ALLOWED_METHODS.encode()),
            (b"access-control-allow-headers", ", ".join(names).encode("latin-1")),
            (b"access-control-max-age", str(MAX_AGE_S).encode()),
            (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
            (b"content-length", b"0"),
        ]
        return _Answer(204, headers, b"")

    def _refused(self, origin: str) -> _Answer:
        body = json.dumps(
            {
                "error": {
                    "message": f"origin {origin!r} is not allowed (the server's --cors-origins)",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "cors_origin_refused",
                }
            }
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"vary", b"Origin"),
        ]
        return _Answer(403, headers, body)


class _Answer:
    """A response the CORS layer gives itself."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    async def __call__(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def _add_vary(headers: list[tuple[bytes, bytes]], value: bytes) -> list[tuple[bytes, bytes]]:
    """``headers`` with ``value`` in their ``Vary`` (one header, values joined)."""
    for i, (key, old) in enumerate(headers):
        if key.lower() == b"vary":
            present = {v.strip().lower() for v in old.split(b",")}
            if value.lower() not in present and b"*" not in present:
                headers[i] = (key, old + b", " + value)
            return headers
    return [*headers, (b"vary", value)]
