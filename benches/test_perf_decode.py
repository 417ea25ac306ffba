"""The forward pass through the binding, as the serving engine calls it (``Context.decode``):
one decode step of B = 1, 4, 16, 32 sequences (each holding a 128-token prompt), and the
prefill of one 512-token prompt.

Groups ``decode-step`` and ``prefill``. Each timed round is one ``decode`` call; between rounds
(untimed) the tokens it added are removed again (``seq_rm``), so every round decodes at the
same positions over the same cache. The contexts do not index their blocks
(``prefix_cache=False``): a prompt is computed in full every round.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvserve import _core

PROMPT = 128
PREFILL = 512


@pytest.fixture(scope="module")
def core_model(model_path: Path) -> Iterator[_core.Model]:
    yield _core.Model(str(model_path))


def _tokens(model: _core.Model, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(100, model.n_vocab, size=n)]


@pytest.mark.benchmark(group="decode-step")
@pytest.mark.parametrize("batch", [1, 4, 16, 32], ids=lambda b: f"B={b:02d}")
def test_decode_step(benchmark, core_model: _core.Model, rounds: int, batch: int) -> None:
    ctx = core_model.new_context(batch * (PROMPT + 16), prefix_cache=False)
    for s in range(batch):  # the prompts, one sequence at a time (untimed)
        ctx.decode(
            _tokens(core_model, PROMPT, s), list(range(PROMPT)), [s] * PROMPT, [False] * PROMPT
        )
    step = _tokens(core_model, batch, 1000)
    seqs = list(range(batch))

    def undo() -> None:
        for s in seqs:
            ctx.seq_rm(s, PROMPT, -1)

    def decode() -> int:
        return ctx.decode(step, [PROMPT] * batch, seqs, [True] * batch).n_rows

    n_rows = benchmark.pedantic(decode, setup=undo, rounds=rounds * 4, warmup_rounds=1)
    assert n_rows == batch
    assert all(ctx.seq_pos_max(s) == PROMPT for s in seqs)
    benchmark.extra_info.update(threads=core_model.threads, tokens_per_call=batch)


@pytest.mark.benchmark(group="prefill")
def test_prefill_512(benchmark, core_model: _core.Model, rounds: int) -> None:
    ctx = core_model.new_context(PREFILL + 16, prefix_cache=False)
    toks = _tokens(core_model, PREFILL, 7)

    def decode() -> int:
        return ctx.decode(
            toks, list(range(PREFILL)), [0] * PREFILL, [False] * (PREFILL - 1) + [True]
        ).n_rows

    n_rows = benchmark.pedantic(decode, setup=lambda: ctx.seq_rm(0), rounds=rounds, warmup_rounds=1)
    assert n_rows == 1 and ctx.seq_pos_max(0) == PREFILL - 1
    benchmark.extra_info.update(threads=core_model.threads, tokens_per_call=PREFILL)
