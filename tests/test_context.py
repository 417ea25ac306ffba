"""The low-level context: bad batches and a full cache raise typed errors and change nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvserve
from kvserve import _core


@pytest.fixture(scope="module")
def core(model_path: Path) -> _core.Model:
    return _core.Model(model_path, threads=2)


def _decode(ctx: _core.Context, tokens: list[int], pos0: int, seq: int = 0) -> np.ndarray:
    n = len(tokens)
    out = ctx.decode(tokens, list(range(pos0, pos0 + n)), [seq] * n, [False] * (n - 1) + [True])
    return np.frombuffer(out, dtype=np.float32).reshape(out.n_rows, out.n_vocab).copy()


def test_failed_batches_leave_the_cache_unchanged(core: _core.Model) -> None:
    prompt = core.tokenize("The quick brown fox", add_special=True)
    n = len(prompt)
    ctx = core.new_context(n + 4)
    _decode(ctx, prompt, 0)
    before = (ctx.n_cells, ctx.seq_pos_max(0))

    with pytest.raises(kvserve.KvCacheFull):
        _decode(ctx, [1] * 5, n)  # 5 more cells do not fit in n + 4
    with pytest.raises(ValueError, match="out of range"):
        ctx.decode([core.n_vocab], [n], [0], [True])
    with pytest.raises(ValueError, match="differ in length"):
        ctx.decode([1, 2], [n], [0], [True])
    with pytest.raises(ValueError, match="negative position"):
        ctx.decode([1], [-1], [0], [True])
    with pytest.raises(ValueError, match="empty"):
        ctx.decode([], [], [], [])
    assert (ctx.n_cells, ctx.seq_pos_max(0)) == before

    # The context still works, and exactly as if the failures never happened.
    nxt = core.tokenize(" jumps", add_special=False)
    got = _decode(ctx, nxt, n)
    fresh = core.new_context(n + 4)
    _decode(fresh, prompt, 0)
    want = _decode(fresh, nxt, n)
    np.testing.assert_array_equal(got, want)


def test_kv_cache_full_is_a_runtime_error() -> None:
    assert issubclass(kvserve.KvCacheFull, RuntimeError)
    assert issubclass(kvserve.ModelError, ValueError)


def test_logits_view_is_zero_copy(core: _core.Model) -> None:
    ctx = core.new_context(64)
    toks = core.tokenize("Hello", add_special=True)
    out = ctx.decode(toks, list(range(len(toks))), [0] * len(toks), [True] * len(toks))
    view = np.frombuffer(out, dtype=np.float32).reshape(out.n_rows, out.n_vocab)
    again = np.frombuffer(out, dtype=np.float32)
    assert view.shape == (len(toks), core.n_vocab)
    assert np.shares_memory(view, again)  # both view the engine's buffer, no copy
    assert not view.flags.writeable
    assert np.isfinite(view).all()
