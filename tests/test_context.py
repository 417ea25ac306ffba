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


def test_logits_buffer_is_a_read_only_matrix_view(core: _core.Model) -> None:
    """The buffer the engine exports: 2-D float32 (n_rows, n_vocab), C-contiguous, read-only;
    numpy views it in place (the array's base is the Logits object, nothing copied) and the view
    keeps the logits alive after the object's last other reference is gone."""
    ctx = core.new_context(64)
    toks = core.tokenize("Hello there", add_special=True)
    n = len(toks)
    out = ctx.decode(toks, list(range(n)), [0] * n, [True] * n)
    mv = memoryview(out)
    assert (mv.ndim, mv.shape, mv.format, mv.itemsize) == (2, (n, core.n_vocab), "f", 4)
    assert mv.readonly and mv.c_contiguous
    view = np.asarray(mv)
    assert view.shape == (n, core.n_vocab) and view.dtype == np.float32
    flat = np.frombuffer(out, dtype=np.float32)
    owner = flat.base.obj if isinstance(flat.base, memoryview) else flat.base
    assert owner is out and not flat.flags.owndata
    assert np.array_equal(flat.reshape(n, -1), view)
    with pytest.raises(ValueError, match="read-only"):
        flat[0] = 1.0
    # A decode on another context gives the same rows for the same tokens; the view of the
    # first result must not change when the engine produces the second.
    keep = flat.copy()
    del out, mv, view
    again = core.new_context(64).decode(toks, list(range(n)), [0] * n, [True] * n)
    assert np.array_equal(flat, keep) and np.isfinite(flat).all()
    assert np.array_equal(np.frombuffer(again, dtype=np.float32), keep)


def test_logits_argmax_is_numpys_argmax_of_each_row(core: _core.Model) -> None:
    """``Logits.argmax(i)`` (the engine's greedy pick, a scan in the core) is numpy's argmax of
    row ``i`` on real rows; rows out of range and non-integers are refused. (Ties and NaNs:
    the core's own tests, against its scalar twin.)"""
    ctx = core.new_context(64)
    toks = core.tokenize("The capital of France is Paris, and the capital of Italy is", True)
    n = len(toks)
    out = ctx.decode(toks, list(range(n)), [0] * n, [True] * n)
    rows = np.frombuffer(out, dtype=np.float32).reshape(n, -1)
    want = np.argmax(rows, axis=-1).tolist()
    assert [out.argmax(i) for i in range(n)] == want
    assert len(set(want)) > 1  # different rows, different answers: the row index is used
    for bad in (n, -1, 10**30):
        with pytest.raises((IndexError, OverflowError)):
            out.argmax(bad)
    with pytest.raises(TypeError):
        out.argmax("0")  # type: ignore[arg-type]
