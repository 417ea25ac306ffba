"""Hand-over from the engine thread to an asyncio event loop, one wake-up per batch.

Every text piece, result and error of an async caller crosses from the engine thread to the
caller's event loop. ``loop.call_soon_threadsafe`` per item wakes the loop through its
self-pipe each time: a socket send (~60 µs of the engine thread's time per item measured
right after a decode step, with caches cold) for every streaming request at every step.

A :class:`Mailbox` (one per event loop, made on the loop's thread by :func:`mailbox_for`)
queues the calls and wakes the loop only when no wake-up is already on its way: once per step
however many of the loop's streams got a piece, through an ``eventfd`` the loop watches
(Linux; ~35 µs) or else one ``call_soon_threadsafe``. The loop runs the queued calls in
order, so each stream still sees its items in the order the engine sent them.

The flag that says a wake-up is on its way is cleared by the loop *after* it consumed the
eventfd's count and *before* it drains the queue: a call queued before the clear is drained
by this wake-up, one queued after it sees the flag down and wakes the loop again. No call is
left queued without a wake-up to drain it (a spurious wake-up drains nothing).
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Mailbox", "deferred_wakes", "flush_wakes", "mailbox_for"]

_local = threading.local()  # .pending: the mailboxes whose wake-up this thread defers


@contextmanager
def deferred_wakes() -> Iterator[None]:
    """Within it, this thread's posts wake their loops only at :func:`flush_wakes` (and on
    leaving it, however it is left). The engine thread runs each step inside one and flushes
    right before the decode releases the GIL: a loop woken earlier would wake only to wait
    for the GIL the engine thread still holds, then wake again when it is released (two
    context switches a token instead of one)."""
    if getattr(_local, "pending", None) is not None:
        yield  # nested: the outer one flushes
        return
    _local.pending = []
    try:
        yield
    finally:
        try:
            flush_wakes()
        finally:
            _local.pending = None


def flush_wakes() -> None:
    """Wakes the loops whose wake-up this thread deferred (module docs); a no-op outside
    :func:`deferred_wakes`."""
    pending: list[Mailbox] | None = getattr(_local, "pending", None)
    if not pending:
        return
    boxes = list(pending)
    pending.clear()
    for box in boxes:
        box._wake()


_boxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


def mailbox_for(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The mailbox of ``loop``, made on first use. Call it on the loop's own thread (it may
    register a reader with the loop)."""
    box = _boxes.get(loop)
    if box is None:
        box = _boxes[loop] = Mailbox(loop)
    return box


class Mailbox:
    """Calls handed from any thread to run on one event loop (module docs)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weak: the mailbox lives in a WeakKeyDictionary keyed by the loop and in sinks that
        # may outlive it; a strong reference would keep every loop alive.
        self._loop = weakref.ref(loop)
        self._items: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._posted = False  # a wake-up is on its way and the loop has not taken it yet
        self._dead = False  # the loop was found closed: posts are dropped
        self._fd: int | None = None
        eventfd = getattr(os, "eventfd", None)
        if eventfd is not None:
            fd = eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            try:
                loop.add_reader(fd, self._wake_read)
            except (NotImplementedError, RuntimeError):  # e.g. the proactor loop (Windows)
                os.close(fd)
            else:
                self._fd = fd
                # The descriptor lives as long as this object (sinks that may still post to
                # it hold it), never less: a closed and reused number must not be written.
                weakref.finalize(self, _close_quietly, fd)

    @property
    def uses_eventfd(self) -> bool:
        return self._fd is not None

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs ``fn(*args)`` on the loop, after every call posted before it (any thread).
        Dropped when the loop is closed: nobody is listening any more."""
        if self._dead:
            return
        self._items.append((fn, args))
        if self._posted:
            return  # the wake-up on its way drains this call too
        self._posted = True
        pending: list[Mailbox] | None = getattr(_local, "pending", None)
        if pending is not None:
            pending.append(self)  # woken at the flush (deferred_wakes)
            return
        self._wake()

    def _wake(self) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            self._close()
            return
        if self._fd is not None:
            os.eventfd_write(self._fd, 1)
            return
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed meanwhile
            self._close()

    def _close(self) -> None:
        """The loop is gone: drop what waits and every later post."""
        self._dead = True
        self._items.clear()

    def _wake_read(self) -> None:
        assert self._fd is not None
        try:
            os.eventfd_read(self._fd)  # consumed before the flag goes down (module docs)
        except BlockingIOError:
            pass  # spurious: another wake-up already consumed the count
        self._drain()

    def _drain(self) -> None:
        self._posted = False
        items = self._items
        while items:
            fn, args = items.popleft()
            try:
                fn(*args)
            except Exception as e:  # as the loop reports a failing call_soon callback
                loop = self._loop()
                if loop is not None:
                    loop.call_exception_handler(
                        {"message": f"mailbox call {fn!r} failed", "exception": e}
                    )


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
