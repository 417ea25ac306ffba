"""Sampling one row of logits as the engine does (``Sampler(params, seed)(row, history)``), for
the option sets of bench_sampling.py, over SmolLM2's 49,152-entry rows and the same rows
widened to Gemma 3's 262,144 entries.

Group ``sampling``; benchmark ids read ``<n_vocab>-<option set>``. Rows are the model's own
logits over 32 greedy steps (``bench_sampling.model_rows``), widened with values from each
row's tail (``bench_sampling.widen``, seeded): the same rows on every run.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from bench_sampling import CASES, model_rows, widen

from kvserve.sampling import Sampler, SamplingParams, token_logprobs

VOCABS = [49152, 262144]


@pytest.fixture(scope="module")
def rows(model_path: Path) -> dict[int, list[np.ndarray]]:
    real = model_rows(str(model_path))
    assert real[0].size == VOCABS[0], f"the default model's rows have {real[0].size} entries"
    rng = np.random.default_rng(0)
    return {VOCABS[0]: real, VOCABS[1]: [widen(r, VOCABS[1], rng) for r in real]}


@pytest.mark.benchmark(group="sampling")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("n_vocab", VOCABS, ids=lambda n: f"{n:06d}")
def test_sample_row(
    benchmark, rows: dict[int, list[np.ndarray]], n_vocab: int, case: tuple
) -> None:
    _name, kw, logprobs = case
    sampler = Sampler(SamplingParams(**kw), seed=0)
    history = np.random.default_rng(1).integers(0, n_vocab, size=512).tolist()
    cycle = itertools.cycle(rows[n_vocab])

    def sample() -> int:
        row = next(cycle)
        tok = sampler(row, history)
        if logprobs:
            token_logprobs(row, tok, 5)
        return tok

    tok = benchmark(sample)
    assert 0 <= tok < n_vocab
