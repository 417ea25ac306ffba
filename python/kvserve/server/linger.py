"""A lingering close for uvicorn's HTTP/1.1 connections.

A server that answers before it has read the whole request (a 408 for a body that trickles
in, a 413 for one that is too large) and then closes its socket while the client is still
sending makes the kernel answer the unread bytes with a TCP reset. The reset can reach the
client before it reads the answer, and a reset discards what the client had not read yet: it
sees "connection reset by peer" instead of the error that says why (RFC 9112, section 9.6,
"tear-down"). So a connection is closed in stages, as nginx's ``lingering_close`` does: the
server's side is shut down for writing once what it wrote is sent (the client reads the
answer, then EOF), what the client still sends is read and dropped, and the socket is closed
when the client closes its side or after ``LINGER_S`` seconds at most.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_S = 2.0
"""The longest a closed connection keeps reading what its client still sends."""


class _LingeringTransport:
    """The transport uvicorn's protocol sees: everything goes to the real one, but ``close``
    lingers (see the module's doc)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self.lingering = False
        self.can_linger = True
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        transport = self._transport
        if self.lingering or transport.is_closing():
            return
        if not (self.can_linger and transport.can_write_eof()):  # e.g. TLS: a plain close
            transport.close()
            return
        self.lingering = True
        transport.write_eof()  # after the buffered answer is sent
        # Reading may have been paused by flow control; what arrives now is dropped.
        transport.resume_reading()
        self._timer = self._loop.call_later(LINGER_S, self.finish)

    def finish(self) -> None:
        """Closes the socket for good (the client closed its side, or the time is up)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport.close()

    def abort(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport.abort()


class LingeringH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a lingering close (``uvicorn.Config(http=...)``)."""

    _lingering: _LingeringTransport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._lingering = _LingeringTransport(transport, asyncio.get_running_loop())
        super().connection_made(self._lingering)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None and self._lingering.lingering:
            return  # the rest of a request that was already answered
        super().data_received(data)

    def eof_received(self) -> None:
        if self._lingering is not None and self._lingering.lingering:
            self._lingering.finish()
            return
        super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lingering is not None and self._lingering.lingering:
            self._lingering.finish()  # cancels the timer; the socket is gone already
        super().connection_lost(exc)

    def shutdown(self) -> None:
        # The server is stopping: no lingering (it would hold the shutdown up to LINGER_S),
        # and a connection already lingering closes now.
        if self._lingering is not None:
            self._lingering.can_linger = False
            if self._lingering.lingering:
                self._lingering.finish()
                return
        super().shutdown()
