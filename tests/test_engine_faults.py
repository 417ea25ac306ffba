"""Containment in kvserve.Engine (python/kvserve/engine/loop.py), driven by the fault hook
(python/kvserve/testing.py): a fault at any point of the engine thread fails the affected
request alone, with its error; every other request's output equals a fault-free run; the K/V
pool returns to its baseline; the engine keeps serving.

The oracle is the same engine's fault-free output for the same prompts (greedy decoding gives
the same tokens whatever else is batched; tests/test_engine.py checks that against Model)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve import Engine, EngineError, GenerateResult, Model
from kvserve.testing import InjectedFault, inject, prompt_is, session_is

PROMPTS = [f"Fact {i} about {w} is that" for i, w in enumerate(["cats", "tea", "rain", "maps"])]
N = 8


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[Engine]:
    with Engine(Model.load(model_path, threads=2), parallel=8, ctx_size=256) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[str]:
    return [engine.generate(p, N).text for p in PROMPTS]


def ids(engine: Engine, prompt: str) -> list[int]:
    return engine.model.tokenize(prompt)


def run_all(engine: Engine, prompts: list[str], **kw: Any) -> list[GenerateResult | BaseException]:
    """Every prompt at once (one batch), each result or error."""

    async def main() -> list[GenerateResult | BaseException]:
        tasks = [engine.agenerate(p, N, **kw) for p in prompts]
        return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(main())


def settled(engine: Engine, baseline: int) -> None:
    """The engine holds nothing for requests any more (with a deadline) and passes its audit."""
    deadline = time.monotonic() + 30
    while True:
        st = engine.stats()
        if st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_used"] == baseline:
            break
        assert time.monotonic() < deadline, f"the engine did not settle: {st}"
        time.sleep(0.01)
    assert engine.health() is None
    engine._on_engine(engine._loop.kv.ctx.audit)


@pytest.mark.parametrize(
    "point", ["accept", "admit", "prefix_match", "decode", "sample", "deliver"]
)
def test_a_fault_for_one_request_fails_it_alone(
    engine: Engine, reference: list[str], point: str
) -> None:
    baseline = engine.stats()["kv_blocks_used"]
    failed = engine.stats()["failed_requests"]
    victim = 2
    with inject(engine, point, times=None, request=prompt_is(ids(engine, PROMPTS[victim]))) as f:
        out = run_all(engine, PROMPTS)
    assert f.fired >= 1
    for i, r in enumerate(out):
        if i == victim:
            assert isinstance(r, InjectedFault), (point, r)
        else:
            assert isinstance(r, GenerateResult), (point, i, r)
            assert r.text == reference[i], (point, i)
    settled(engine, baseline)
    assert engine.stats()["failed_requests"] == failed + 1
    assert engine.generate(PROMPTS[victim], N).text == reference[victim]  # it serves on


def test_a_decode_that_fails_once_is_retried_and_nobody_fails(
    engine: Engine, reference: list[str]
) -> None:
    before = engine.stats()
    with inject(engine, "decode", times=1) as f:
        out = run_all(engine, PROMPTS)
    assert f.fired == 1
    assert [r.text for r in out if isinstance(r, GenerateResult)] == reference
    st = engine.stats()
    assert st["decode_retries"] == before["decode_retries"] + 1
    assert st["failed_requests"] == before["failed_requests"]


def test_a_batch_that_keeps_failing_is_split_to_the_failing_rows(
    engine: Engine, reference: list[str]
) -> None:
    """Two of four requests fail in every batch that holds them: the batch is retried, then
    split in halves until only those two fail."""
    pick = [ids(engine, PROMPTS[1]), ids(engine, PROMPTS[3])]
    baseline = engine.stats()["kv_blocks_used"]
    with inject(engine, "decode", times=None, request=lambda r: r.ids[: r.n_prompt] in pick):
        out = run_all(engine, PROMPTS)
    assert isinstance(out[1], InjectedFault) and isinstance(out[3], InjectedFault)
    assert [out[0].text, out[2].text] == [reference[0], reference[2]]  # type: ignore[union-attr]
    settled(engine, baseline)


def test_a_fault_in_forking_a_choice_fails_that_request_only(
    engine: Engine, reference: list[str]
) -> None:
    baseline = engine.stats()["kv_blocks_used"]

    async def main() -> tuple[BaseException | None, list[GenerateResult | BaseException]]:
        async def choices() -> BaseException | None:
            try:
                async for _ in engine.choices(PROMPTS[0], N, n=3):
                    pass
            except InjectedFault as e:
                return e
            return None

        others = [engine.agenerate(p, N) for p in PROMPTS[1:]]
        got = await asyncio.gather(choices(), *others, return_exceptions=True)
        return got[0], list(got[1:])

    with inject(engine, "fork", times=1) as f:
        error, others = asyncio.run(main())
    assert f.fired == 1 and isinstance(error, InjectedFault)
    assert [r.text for r in others if isinstance(r, GenerateResult)] == reference[1:]
    settled(engine, baseline)


def test_a_fault_in_dropping_a_cancelled_request_still_releases_it(
    engine: Engine, reference: list[str]
) -> None:
    baseline = engine.stats()["kv_blocks_used"]

    async def main() -> None:
        task = asyncio.ensure_future(engine.agenerate(PROMPTS[0], 200, ignore_eos=True))
        deadline = time.monotonic() + 30
        while engine.stats()["running"] == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with inject(engine, "drop", times=1) as f:
        asyncio.run(main())
        settled(engine, baseline)
    assert f.fired == 1
    assert engine.generate(PROMPTS[1], N).text == reference[1]


def test_session_faults_leave_the_session_and_the_engine_usable(
    engine: Engine, tmp_path: Path
) -> None:
    baseline = engine.stats()["kv_blocks_used"]
    engine.generate("My name is Ada.", 4, session_id="s1")
    (held,) = engine.sessions()
    with inject(engine, "session_save", times=1), pytest.raises(InjectedFault):
        engine.save_session("s1", tmp_path / "s1.kvs")
    assert not (tmp_path / "s1.kvs").exists()
    engine.save_session("s1", tmp_path / "s1.kvs")
    with inject(engine, "session_load", times=1), pytest.raises(InjectedFault):
        engine.load_session(tmp_path / "s1.kvs", session_id="s2")
    assert sorted(s.id for s in engine.sessions()) == ["s1"]
    # A turn whose session holds a generator state the sampler refuses fails alone, and the
    # session is as it was (the bug of a bogus rng_state: it stopped the engine thread).
    engine._on_engine(lambda: setattr(engine._sessions.get("s1"), "rng_state", {"bad": 1}))
    with pytest.raises((ValueError, TypeError, KeyError)):
        engine.generate(" And then", 4, session_id="s1", temperature=0.8)
    (info,) = engine.sessions()
    assert info.tokens == held.tokens
    assert engine.health() is None
    engine.drop_session("s1")
    settled(engine, baseline)


def test_a_failed_session_turn_leaves_the_session_as_it_was(engine: Engine) -> None:
    engine.generate("The sky is", 4, session_id="t")
    (before,) = [s for s in engine.sessions() if s.id == "t"]
    with inject(engine, "decode", times=None, request=session_is("t")):
        with pytest.raises(InjectedFault):
            engine.generate(" and the sea is", 4, session_id="t")
    (after,) = [s for s in engine.sessions() if s.id == "t"]
    assert after.tokens == before.tokens
    result = engine.generate(" and the sea is", 4, session_id="t")
    assert result.finish_reason in ("length", "stop")
    engine.drop_session("t")


def test_eviction_and_expiry_faults_do_not_stop_the_engine(model_path: Path) -> None:
    with Engine(
        Model.load(model_path, threads=2),
        parallel=2,
        ctx_size=128,
        session_ttl=0.05,
    ) as eng:
        eng.generate("Hello", 2, session_id="old")
        with inject(eng, "session_expire", times=1) as f:
            deadline = time.monotonic() + 30
            while eng.sessions():
                assert time.monotonic() < deadline, "the session never expired"
                time.sleep(0.02)
        assert f.fired == 1  # it failed, and the session went all the same
        assert eng.generate("Hello", 2).finish_reason in ("length", "stop")
        assert eng.health() is None
    probe = Model.load(model_path, threads=2)  # its pool, not the engine's, sized by this
    per_block = int(probe.core.new_context(16).stats()["bytes_per_block"])
    with Engine(
        Model.load(model_path, threads=2),
        parallel=2,
        ctx_size=128,
        kv_memory=16 * per_block,
        kv_high_watermark=0.01,
        kv_low_watermark=0.01,
    ) as eng:
        with inject(eng, "session_evict", times=None) as f:
            eng.generate("Hello there", 2, session_id="a")
            eng.generate("Good morning", 2, session_id="b")
        assert f.fired >= 1
        assert eng.stats()["evictions"] == 0
        eng.generate("Good evening", 2, session_id="c")  # evictions work again
        assert eng.stats()["evictions"] >= 1


def test_a_bookkeeping_error_fails_what_is_in_flight_and_the_engine_goes_on(
    model_path: Path,
) -> None:
    with Engine(Model.load(model_path, threads=2), parallel=4, ctx_size=128) as eng:
        plan = eng._loop.sched.plan
        calls = {"n": 0}

        def broken(now: float | None = None) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("a bug in the plan")
            return plan(now)

        eng._loop.sched.plan = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="a bug in the plan"):
            eng.generate("Hello", 4)
        assert eng.health() is None
        assert eng.generate("Hello", 4).finish_reason in ("length", "stop")
        assert eng.stats()["kv_blocks_used"] == 0


def test_a_thread_that_stops_fails_every_caller_and_says_why(model_path: Path) -> None:
    eng = Engine(Model.load(model_path, threads=2), parallel=4, ctx_size=128)

    def broken(now: float | None = None) -> Any:
        raise RuntimeError("a persistent bug")

    eng._loop.sched.plan = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="persistent bug"):
        eng.generate("Hello", 4)
    for _ in range(3):  # three in a row stop the thread; each caller gets an error, no hang
        try:
            eng.generate("Hello", 4)
        except RuntimeError:
            pass
    eng._loop.thread.join(timeout=30)
    assert not eng._loop.thread.is_alive()
    reason = eng.health()
    assert reason is not None and "persistent bug" in reason
    with pytest.raises(RuntimeError, match="persistent bug"):
        eng.generate("Hello", 4)
    eng.close()


def test_a_panic_that_closes_the_context_gets_a_new_one(model_path: Path) -> None:
    """A real Rust panic inside the context (``Context._inject_panic``) closes it for good:
    the engine makes a new one, recomputes every running request (their outputs equal an
    undisturbed run) and keeps its sessions' tokens (their K/V is recomputed on next use)."""
    with Engine(Model.load(model_path, threads=2), parallel=8, ctx_size=256) as eng:
        reference = [eng.generate(p, N).text for p in PROMPTS]
        eng.generate("My name is Ada.", 4, session_id="s")
        (before,) = eng.sessions()
        assert before.resident
        with inject(eng, "panic", times=1) as f:
            out = run_all(eng, PROMPTS)
        assert f.fired == 1
        assert [r.text if isinstance(r, GenerateResult) else r for r in out] == reference
        st = eng.stats()
        assert st["context_resets"] == 1 and st["failed_requests"] == 0
        (after,) = eng.sessions()
        assert (after.tokens, after.resident) == (before.tokens, False)
        turn = eng.generate(" I live in", 4, session_id="s")
        assert turn.cached_tokens < before.tokens  # recomputed (from what the cache still had)
        eng.drop_session("s")
        settled(eng, 0)


def test_a_request_that_panics_every_time_fails_alone(model_path: Path) -> None:
    """A request whose batches always close the context: after the first loss every request
    of that batch is decoded alone; the one that closes it again fails, the others finish as
    in an undisturbed run."""
    with Engine(Model.load(model_path, threads=2), parallel=8, ctx_size=256) as eng:
        reference = [eng.generate(p, N).text for p in PROMPTS]
        victim = 1
        with inject(eng, "panic", times=None, request=prompt_is(ids(eng, PROMPTS[victim]))):
            out = run_all(eng, PROMPTS)
        for i, r in enumerate(out):
            if i == victim:
                assert isinstance(r, EngineError), r
            else:
                assert isinstance(r, GenerateResult) and r.text == reference[i], (i, r)
        st = eng.stats()
        assert st["context_resets"] == 2 and st["failed_requests"] == 1
        settled(eng, 0)
        assert eng.generate(PROMPTS[victim], N).text == reference[victim]
