"""The KV memory one model shares among its contexts (issue: KV core ready for many users):
one pool and prefix index per model, all-or-nothing decodes (a worker panic rolls the batch
back and never leaves a key on unwritten data), llama.cpp's batch validation, counters that
any thread may read during a decode, and clear errors for impossible sizes."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import kvserve
from kvserve import _core

PROMPT = (
    "The lighthouse keeper climbed the stairs every evening to light the lamp, and the ships "
    "that passed the rocks at night saw its beam sweep across the dark water."
)


@pytest.fixture
def core(model_path: Path) -> _core.Model:
    """A model of its own per test: its pool and index hold only this test's blocks."""
    return _core.Model(model_path, threads=2)


def _rows(out: _core.Logits) -> np.ndarray:
    return np.frombuffer(out, dtype=np.float32).reshape(out.n_rows, out.n_vocab).copy()


def _prefill(ctx: _core.Context, toks: list[int], seq: int = 0, pos0: int = 0) -> np.ndarray:
    n = len(toks)
    out = ctx.decode(toks, list(range(pos0, pos0 + n)), [seq] * n, [False] * (n - 1) + [True])
    return _rows(out)


def _snapshot(ctx: _core.Context, seqs: range) -> tuple[object, ...]:
    st = ctx.stats()
    keep = ("blocks_free", "blocks_cached", "blocks_referenced", "blocks_shared", "sequences")
    keep += ("tokens_stored", "blocks_held", "unused_slots", "prefix_indexed")
    return (
        tuple(st[k] for k in keep),
        tuple((ctx.seq_pos_min(s), ctx.seq_pos_max(s)) for s in seqs),
        ctx.n_cells,
    )


def test_a_worker_panic_rolls_the_batch_back_and_poisons_nothing(
    core: _core.Model, model_path: Path
) -> None:
    toks = core.tokenize(PROMPT * 2, add_special=True)
    assert len(toks) > 48
    ctx = core.new_context(512)
    # Sequence 0 holds 20 tokens (one full block + a partial one); sequence 1 is new.
    _prefill(ctx, toks[:20], seq=0)
    before = _snapshot(ctx, range(3))
    ctx.audit()
    # One batch mixing a continuation of sequence 0 and a 40-token prompt of sequence 1 (two
    # full blocks that would be keyed on success).
    other_prompt = toks[8:48]  # its blocks differ from sequence 0's
    batch_t = toks[20:28] + other_prompt
    batch_p = list(range(20, 28)) + list(range(40))
    batch_s = [0] * 8 + [1] * 40
    want = [False] * 7 + [True] + [False] * 39 + [True]
    core._inject_worker_panic(5)
    with pytest.raises(kvserve.EngineError, match="rolled back"):
        ctx.decode(batch_t, batch_p, batch_s, want)
    assert isinstance(kvserve.EngineError("x"), RuntimeError)
    assert _snapshot(ctx, range(3)) == before
    ctx.audit()
    # Nothing the failed batch computed is found by a prefix match, in this context or another.
    other = core.new_context(512)
    assert other.match_prefix(5, other_prompt + [1]) == 0
    assert ctx.match_prefix(2, other_prompt + [1]) == 0
    ctx.seq_rm(2)
    # The context is usable, and recomputing gives what a fresh model computes.
    got = _rows(ctx.decode(batch_t, batch_p, batch_s, want))
    fresh_model = _core.Model(model_path, threads=2)
    fresh = fresh_model.new_context(512)
    _prefill(fresh, toks[:20], seq=0)
    ref = _rows(fresh.decode(batch_t, batch_p, batch_s, want))
    np.testing.assert_array_equal(got, ref)
    # And now the blocks are keyed: another context reuses them.
    assert other.match_prefix(5, other_prompt + [1]) == 32
    ctx.audit()


def test_a_worker_panic_in_a_decode_step_rolls_it_back(core: _core.Model, model_path: Path) -> None:
    """The same for a decode step of two sequences (one token each: the redoable matmul
    steps of small batches), failing at layer 5 after the first layers stored their keys and
    values: the step leaves nothing behind, and recomputing it gives what a fresh model
    computes."""
    toks = core.tokenize(PROMPT * 2, add_special=True)
    ctx = core.new_context(512)
    _prefill(ctx, toks[:20], seq=0)
    _prefill(ctx, toks[8:24], seq=1)
    before = _snapshot(ctx, range(3))
    ctx.audit()
    step = ([toks[20], toks[24]], [20, 16], [0, 1], [True, True])
    core._inject_worker_panic(5)
    with pytest.raises(kvserve.EngineError, match="rolled back"):
        ctx.decode(*step)
    assert _snapshot(ctx, range(3)) == before
    ctx.audit()
    got = _rows(ctx.decode(*step))
    fresh = _core.Model(model_path, threads=2).new_context(512)
    _prefill(fresh, toks[:20], seq=0)
    _prefill(fresh, toks[8:24], seq=1)
    np.testing.assert_array_equal(got, _rows(fresh.decode(*step)))
    ctx.audit()


@pytest.mark.parametrize(
    ("positions", "seqs", "what"),
    [
        ([0, 0, 5], [0, 0, 0], "same position twice"),
        ([0, 2, 1], [0, 0, 0], "decreasing"),
        ([3, 4, 0], [0, 0, 1], "ok for two sequences"),
    ],
)
def test_batch_positions_must_increase_per_sequence(
    core: _core.Model, positions: list[int], seqs: list[int], what: str
) -> None:
    ctx = core.new_context(64)
    if what.startswith("ok"):
        ctx.decode([1, 2, 3], positions, seqs, [False, False, True])
        assert ctx.n_cells == 3
        # Continuing must start after the last stored position.
        with pytest.raises(ValueError, match="does not increase"):
            ctx.decode([4], [4], [0], [True])
        ctx.decode([4], [7], [0], [True])  # gaps are allowed
        return
    with pytest.raises(ValueError, match="does not increase"):
        ctx.decode([1, 2, 3], positions, seqs, [False, False, True])
    assert ctx.n_cells == 0 and ctx.stats()["blocks_referenced"] == 0


def test_contexts_of_one_model_share_one_pool_and_index(core: _core.Model) -> None:
    toks = core.tokenize(PROMPT, add_special=True)
    a = core.new_context(512)
    b = core.new_context(512)
    assert a.stats()["blocks_total"] == b.stats()["blocks_total"]
    la = _prefill(a, toks, seq=0)
    # Context b finds what a computed, while a still holds it (shared) and after a drops it.
    n = b.match_prefix(0, toks)
    assert n == (len(toks) - 1) // 16 * 16 and n > 0
    st = b.stats()
    assert (st["prefix_lookups"], st["prefix_hit_tokens"]) == (1, n)
    assert st["blocks_shared"] == n // 16  # held by a's and b's sequence
    lb = _prefill(b, toks[n:], seq=0, pos0=n)
    np.testing.assert_allclose(lb, la, rtol=0, atol=1e-4 * float(np.abs(la).max()))
    a.seq_rm(0)
    b.seq_rm(0)
    assert b.stats()["blocks_cached"] >= n // 16
    c = core.new_context(512)
    assert c.match_prefix(3, toks) == n
    c.audit()


def test_one_memory_budget_covers_every_context(core: _core.Model, model_path: Path) -> None:
    probe = core.new_context(16)
    block = int(probe.stats()["bytes_per_block"])
    del probe
    # A pool of 8 blocks (a new model: the 16-token context above made a 4096-token pool).
    m = _core.Model(model_path, threads=2)
    a = m.new_context(kv_memory=8 * block)
    b = m.new_context(kv_memory=8 * block)
    assert a.stats()["blocks_total"] == 8
    a.decode(list(range(100, 200)), list(range(100)), [0] * 100, [False] * 99 + [True])
    # 100 tokens took 7 blocks; b cannot have 2 more.
    with pytest.raises(kvserve.KvCacheFull):
        b.decode(list(range(32)), list(range(32)), [0] * 32, [False] * 31 + [True])
    assert b.n_cells == 0
    a.seq_rm(0)  # its 6 full blocks stay cached: b may evict them
    b.decode(list(range(32)), list(range(32)), [0] * 32, [False] * 31 + [True])
    assert b.n_cells == 32
    a.audit()
    b.audit()


def test_threads_with_their_own_contexts_share_a_model_safely(core: _core.Model) -> None:
    toks = core.tokenize(PROMPT * 3, add_special=True)
    errors: list[BaseException] = []
    hits = [0] * 4
    contexts = [core.new_context(1024) for _ in range(4)]

    def worker(k: int) -> None:
        try:
            ctx = contexts[k]
            rng = np.random.default_rng(k)
            for r in range(6):
                s = r % 3
                n = int(rng.integers(20, 70))
                prompt = toks[:n] if r % 2 == 0 else toks[k : k + n]
                m = ctx.match_prefix(s, prompt)
                hits[k] += m
                _prefill(ctx, prompt[m:], seq=s, pos0=m)
                for i in range(3):
                    ctx.decode([int(rng.integers(0, 1000))], [n + i], [s], [True])
                st = ctx.stats()  # published counters, any thread
                assert st["tokens_stored"] >= n
                if rng.integers(0, 2):
                    ctx.seq_rm(s, n // 2)
                ctx.seq_rm(s)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(hits) > 0, "no thread reused another's prefix"
    for ctx in contexts:  # quiescent now: tables and the pool audit
        ctx.audit()
    contexts.clear()  # their blocks go back to the pool
    final = core.new_context(64)
    final.audit()  # every block free, cached or referenced; refcounts equal holders
    st = final.stats()
    assert st["blocks_referenced"] == 0
    assert st["blocks_free"] + st["blocks_cached"] == st["blocks_total"]


def test_stats_and_n_cells_never_wait_for_a_decode(core: _core.Model) -> None:
    toks = core.tokenize(PROMPT * 8, add_special=True)[:400]
    ctx = core.new_context(1024)
    seen: list[int] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            seen.append(int(ctx.stats()["tokens_stored"]) + 0 * ctx.n_cells)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(3):
            _prefill(ctx, toks, seq=0)
            ctx.seq_rm(0)
    finally:
        done.set()
        t.join()
    assert len(seen) > 3
    assert set(seen) <= {0, len(toks)}


def test_impossible_sizes_are_clear_errors_not_aborts(core: _core.Model) -> None:
    with pytest.raises((MemoryError, ValueError)):
        core.new_context(10**9)
    with pytest.raises((MemoryError, ValueError)):
        core.new_context(10**13)
    # The model is still fine.
    ctx = core.new_context(64)
    _prefill(ctx, [1, 2, 3])
    assert ctx.n_cells == 3


def test_logits_len_is_its_row_count(core: _core.Model) -> None:
    ctx = core.new_context(64)
    out = ctx.decode([1, 2, 3], [0, 1, 2], [0, 0, 0], [True, False, True])
    assert len(out) == out.n_rows == 2
    assert len(_rows(out)) == len(out)


def test_the_memory_grows_when_idle_and_is_shared_as_is_when_busy(core: _core.Model) -> None:
    a = core.new_context(64)
    cap = int(a.stats()["blocks_total"]) * int(a.stats()["block_size"])
    assert cap >= 4096  # the smallest memory a model makes
    b = core.new_context(cap * 2)  # a is alive: b shares the memory, limited by it
    assert b.n_ctx == cap and b.stats()["blocks_total"] == a.stats()["blocks_total"]
    del a, b
    c = core.new_context(cap * 2)  # nobody uses it: it is replaced by a larger one
    assert c.n_ctx == cap * 2
    assert int(c.stats()["blocks_total"]) * 16 >= cap * 2


def test_prefix_cache_off_indexes_nothing(core: _core.Model) -> None:
    toks = core.tokenize(PROMPT, add_special=True)
    off = core.new_context(256, prefix_cache=False)
    _prefill(off, toks)
    assert off.stats()["prefix_indexed"] == 0
    on = core.new_context(256)
    assert on.match_prefix(0, toks) == 0
    _prefill(on, toks, seq=1)
    assert on.stats()["prefix_indexed"] == len(toks) // 16
    assert off.match_prefix(3, toks) == (len(toks) - 1) // 16 * 16  # it still reads the index
