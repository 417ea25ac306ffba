"""The engine thread's hand-over to asyncio loops (``kvserve.engine.mailbox``): every call runs
on the loop, in the order posted, with one wake-up for a burst of calls; wake-ups deferred by
the engine thread go out at the flush and never later than leaving ``deferred_wakes``; a
closed loop drops calls quietly; a failing call does not stop the ones after it. Each test
runs with the eventfd wake-up and with the ``call_soon_threadsafe`` fallback."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvserve.engine import mailbox as mb


@pytest.fixture(params=["eventfd", "call_soon_threadsafe"])
def wake(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "eventfd":
        if not hasattr(os, "eventfd"):
            pytest.fail("os.eventfd is missing: the eventfd wake-up cannot be tested here")
    else:
        monkeypatch.delattr(os, "eventfd", raising=False)
    yield request.param


def _box(loop: asyncio.AbstractEventLoop, wake: str) -> mb.Mailbox:
    box = mb.Mailbox(loop)
    assert box.uses_eventfd == (wake == "eventfd")
    return box


def test_calls_from_threads_all_arrive_in_each_threads_order(wake: str) -> None:
    async def main() -> dict[int, list[int]]:
        loop = asyncio.get_running_loop()
        box = _box(loop, wake)
        got: dict[int, list[int]] = {t: [] for t in range(4)}
        done = asyncio.Event()
        n = 2000

        def note(t: int, i: int) -> None:
            got[t].append(i)
            if sum(map(len, got.values())) == 4 * n:
                done.set()

        def producer(t: int) -> None:
            for i in range(n):
                box.post(note, t, i)

        threads = [threading.Thread(target=producer, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        await asyncio.wait_for(done.wait(), 30)
        for th in threads:
            th.join()
        return got

    got = asyncio.run(main())
    assert all(v == list(range(2000)) for v in got.values())


def test_a_burst_of_posts_wakes_the_loop_once(wake: str) -> None:
    """While the loop is busy (it has not taken the first wake-up yet), further posts add no
    wake-up: 50 calls, one drain."""

    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        box = _box(loop, wake)
        drains = 0
        real = box._drain

        def counting() -> None:
            nonlocal drains
            drains += 1
            real()

        box._drain = counting  # type: ignore[method-assign]
        got: list[int] = []
        posted = threading.Event()

        def producer() -> None:
            for i in range(50):
                box.post(got.append, i)
            posted.set()

        th = threading.Thread(target=producer)
        th.start()
        posted.wait(10)  # the loop is blocked here: nothing drains meanwhile
        th.join()
        for _ in range(100):
            if len(got) == 50:
                break
            await asyncio.sleep(0.01)
        return got, drains

    got, drains = asyncio.run(main())
    assert got == list(range(50))
    assert drains == 1


def test_deferred_wakes_go_out_at_the_flush(wake: str) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        box = _box(loop, wake)
        got: list[str] = []
        steps = [threading.Event() for _ in range(3)]
        posted, left = threading.Event(), threading.Event()

        def engine() -> None:
            with mb.deferred_wakes():
                box.post(got.append, "a")
                box.post(got.append, "b")
                posted.set()
                steps[0].wait(10)
                mb.flush_wakes()
                steps[1].wait(10)
                box.post(got.append, "c")  # left deferred: the context's exit wakes
                left.set()
                steps[2].wait(10)

        async def until(cond: Any) -> None:
            for _ in range(400):
                if cond():
                    return
                await asyncio.sleep(0.005)

        th = threading.Thread(target=engine)
        th.start()
        await until(posted.is_set)
        await asyncio.sleep(0.1)
        assert got == []  # posted, not woken: nothing ran
        steps[0].set()
        await until(lambda: got == ["a", "b"])
        assert got == ["a", "b"]  # the flush woke the loop
        steps[1].set()
        await until(left.is_set)
        await asyncio.sleep(0.1)
        assert got == ["a", "b"]  # "c" waits for the context's exit
        steps[2].set()
        await until(lambda: len(got) == 3)
        th.join()
        assert got == ["a", "b", "c"]

    asyncio.run(main())


def test_deferred_wakes_are_flushed_when_the_block_raises(wake: str) -> None:
    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        box = _box(loop, wake)
        got: list[int] = []

        def engine() -> None:
            try:
                with mb.deferred_wakes():
                    box.post(got.append, 1)
                    raise RuntimeError("a failing step")
            except RuntimeError:
                pass

        th = threading.Thread(target=engine)
        th.start()
        th.join()
        for _ in range(200):
            if got:
                break
            await asyncio.sleep(0.005)
        return got

    assert asyncio.run(main()) == [1]


def test_a_failing_call_does_not_stop_the_next(wake: str) -> None:
    async def main() -> tuple[list[int], list[dict[str, Any]]]:
        loop = asyncio.get_running_loop()
        errors: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        box = _box(loop, wake)
        got: list[int] = []

        def bad() -> None:
            raise ValueError("boom")

        def producer() -> None:
            box.post(got.append, 1)
            box.post(bad)
            box.post(got.append, 2)

        th = threading.Thread(target=producer)
        th.start()
        th.join()
        for _ in range(200):
            if len(got) == 2:
                break
            await asyncio.sleep(0.005)
        return got, errors

    got, errors = asyncio.run(main())
    assert got == [1, 2]
    assert len(errors) == 1 and isinstance(errors[0]["exception"], ValueError)


def test_posts_to_a_closed_loop_are_dropped(wake: str) -> None:
    loop = asyncio.new_event_loop()
    got: list[int] = []
    box = loop.run_until_complete(_make(loop, wake))
    loop.close()
    for i in range(100):
        box.post(got.append, i)  # no exception, no write to a stale descriptor
    assert got == []
    assert len(box._items) == 0  # dropped, not piling up for a loop that never drains


async def _make(loop: asyncio.AbstractEventLoop, wake: str) -> mb.Mailbox:
    return _box(loop, wake)


def test_one_mailbox_per_loop() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert mb.mailbox_for(loop) is mb.mailbox_for(loop)

    asyncio.run(main())
    a = asyncio.new_event_loop()
    b = asyncio.new_event_loop()
    try:
        box_a = a.run_until_complete(_get())
        box_b = b.run_until_complete(_get())
        assert box_a is not box_b
    finally:
        a.close()
        b.close()


async def _get() -> mb.Mailbox:
    return mb.mailbox_for(asyncio.get_running_loop())


def test_a_stream_of_many_pieces_keeps_a_steady_wake_count(wake: str) -> None:
    """A producer that posts one item at a time, waiting for each to arrive (a stream at one
    token a step): one wake-up per item, none lost (the flag is cleared after the count is
    consumed and before the drain)."""

    async def main() -> int:
        loop = asyncio.get_running_loop()
        box = _box(loop, wake)
        arrived = threading.Semaphore(0)
        n = 300
        lost: list[int] = []

        def producer() -> None:
            for i in range(n):
                box.post(arrived.release)
                if not arrived.acquire(timeout=10):
                    lost.append(i)  # a lost wake-up
                    return

        th = threading.Thread(target=producer)
        t0 = time.monotonic()
        th.start()
        while th.is_alive():
            await asyncio.sleep(0.01)
            assert time.monotonic() - t0 < 60
        th.join()
        assert lost == []
        return n

    assert asyncio.run(main()) == 300
