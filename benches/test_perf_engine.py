"""The serving engine (``kvserve.Engine``): its per-step scheduling overhead with 32 running
sequences, and time to first token with and without a cached prefix.

Group ``engine-step``: everything the engine thread does in a step except the forward pass
(admission, planning the batch, building its lists, the argmax of 32 rows, handing tokens to
their requests and detokenizing them, retiring and reclaiming). The engine's context is
wrapped so that ``decode`` returns fixed logits at once (``_InstantDecode``; the rest of the
context is the real one), 32 client threads keep 32 greedy requests running
(``ignore_eos``, 256 tokens each, a new one as soon as one ends), and each timed call waits for
the engine to finish one more step: the time per call is the time per step.

Group ``ttft``: ``Engine.generate(prompt, max_tokens=1)`` (prefill, then one token) for a
~512-token prompt whose first 512 tokens an earlier request computed ("cached prefix": only the
new question and the last partial block are computed) and for the same prompt behind a
different first line ("no cached prefix": all of it is computed).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvserve import Engine

RUNNING = 32


class _Logits(np.ndarray):
    """What ``Context.decode`` returns, as far as the engine reads it: a buffer of float32
    rows with ``n_rows`` and ``n_vocab``."""

    n_rows: int
    n_vocab: int


class _InstantDecode:
    """The engine's context with a ``decode`` that returns ``rows`` at once and counts steps."""

    def __init__(self, ctx: Any, rows: np.ndarray) -> None:
        self._ctx = ctx
        self._rows = rows
        self.steps = 0
        self.cond = threading.Condition()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int], logits: list[bool]):
        n = sum(logits)
        out = self._rows[:n].view(_Logits)
        out.n_rows, out.n_vocab = n, self._rows.shape[1]
        with self.cond:
            self.steps += 1
            self.cond.notify_all()
        return out

    def wait_step(self) -> None:
        """Returns when the engine has started the step after the current one."""
        with self.cond:
            target = self.steps + 1
            while self.steps < target:
                self.cond.wait()


@pytest.fixture(scope="module")
def busy_engine(model_path: Path) -> Iterator[tuple[Engine, _InstantDecode]]:
    engine = Engine(model_path, parallel=RUNNING, ctx_size=1024, kv_memory="64MiB")
    n_vocab = engine.model.core.n_vocab
    rows = np.random.default_rng(0).normal(size=(RUNNING, n_vocab)).astype(np.float32)
    clock = _InstantDecode(engine._loop.kv.ctx, rows)
    engine._loop.kv.ctx = clock  # type: ignore[assignment]  # read at the engine's next step
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            engine.generate(f"User {i} asks a question:", max_tokens=256, ignore_eos=True)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(RUNNING)]
    for t in threads:
        t.start()
    while engine.stats()["running"] < RUNNING:
        clock.wait_step()
    yield engine, clock
    stop.set()
    for t in threads:
        t.join(60)
    engine.close()


@pytest.mark.benchmark(group="engine-step")
def test_engine_step_overhead_32_running(benchmark, busy_engine, rounds: int) -> None:
    engine, clock = busy_engine
    before = clock.steps
    benchmark.pedantic(clock.wait_step, rounds=rounds * 4, iterations=50, warmup_rounds=1)
    assert clock.steps > before
    assert engine.stats()["running"] >= RUNNING - 1  # (one may be between two requests)
    benchmark.extra_info["running"] = RUNNING


SYSTEM = " ".join(
    f"Rule {i}: answer questions about topic {i} politely, cite section {i + 3}, and keep the "
    "answer under three sentences."
    for i in range(19)
)


@pytest.fixture(scope="module")
def ttft_engine(model_path: Path) -> Iterator[Engine]:
    with Engine(model_path, parallel=4, ctx_size=1024, kv_memory="64MiB") as engine:
        n = len(engine.model.tokenize(SYSTEM))
        assert 480 <= n <= 560, f"the shared prefix is {n} tokens"
        engine.generate(SYSTEM + "\nQuestion 0?", max_tokens=1)  # computes and caches it
        yield engine


@pytest.mark.benchmark(group="ttft")
@pytest.mark.parametrize("prefix", ["cached prefix", "no cached prefix"])
def test_ttft_512_token_prompt(benchmark, ttft_engine: Engine, rounds: int, prefix: str) -> None:
    counter = itertools.count(1)

    def prompt() -> tuple[tuple[str], dict[str, Any]]:
        i = next(counter)
        head = "" if prefix == "cached prefix" else f"Request {i} of the benchmark.\n"
        return (head + SYSTEM + f"\nQuestion {i}?",), {"max_tokens": 1}

    result = benchmark.pedantic(ttft_engine.generate, setup=prompt, rounds=rounds, warmup_rounds=1)
    cached = result.cached_tokens
    if prefix == "cached prefix":
        assert cached >= 480, f"only {cached} prompt tokens came from the cache"
    else:
        assert cached == 0, f"{cached} prompt tokens came from the cache"
    benchmark.extra_info.update(prompt_tokens=result.prompt_tokens, cached_tokens=cached)
