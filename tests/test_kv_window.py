"""Sliding-window layer groups (Gemma 3's local layers) on the paged KV cache.

The oracle for logits is the float64 numpy reference (tests/reference.py), which attends over
a window by its definition (a key at p is visible from q iff q - window < p <= q) with every
token of the sequence available: so the engine's pruned window group must give the same
logits as the reference that never pruned anything. The memory bounds are the issue's
(⌈(window + batch) / block⌉ + 1 blocks per sequence); the blocks a group holds are read from
``Context.stats()["groups"]``, independently of the attention code.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import reference as ref  # noqa: E402

import kvserve._core as core  # noqa: E402

# Layers 0 and 2 local (window of 20 positions), 1 and 3 global; blocks of 16.
SPEC = ref.Spec(
    arch="gemma3", n_layer=4, head_dim=32, window=20, swa_pattern=2, freq_base=1e6, seed=31
)
BLOCK = 16


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("win") / "gemma3.gguf"
    return path, ref.write_model(path, SPEC)


@pytest.fixture(scope="module")
def tiny(tiny_file) -> tuple[core.Model, dict[str, np.ndarray]]:
    path, w = tiny_file
    return core.Model(str(path), threads=2), w


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, ref.N_VOCAB, n)]


def _rows(out) -> np.ndarray:
    return np.frombuffer(out, dtype=np.float32).reshape(out.n_rows, out.n_vocab).astype(np.float64)


def _decode(ctx, toks: list[int], start: int, seq: int = 0) -> np.ndarray:
    n = len(toks)
    return _rows(ctx.decode(toks, list(range(start, start + n)), [seq] * n, [True] * n))


def _group(ctx, kind: str) -> dict:
    (g,) = [g for g in ctx.stats()["groups"] if g["kind"] == kind]
    return g


def _close(got: np.ndarray, want: np.ndarray, what: str, tol: float = 1e-3) -> None:
    d = float(np.abs(got - want).max() / np.abs(want).max())
    assert d < tol, f"{what}: max |diff| / max |logit| = {d:.3g}"


def test_groups_reported(tiny):
    model, _ = tiny
    ctx = model.new_context(256)
    groups = ctx.stats()["groups"]
    assert [(g["kind"], g["window"], g["layers"]) for g in groups] == [
        ("window", SPEC.window, 2),
        ("full", None, 2),
    ]


def test_pruned_window_matches_reference_far_past_the_window(tiny):
    """100 tokens in chunks of 7 (the window group is pruned after every chunk): every row
    equals the reference's, and the rows differ from a reference without the window."""
    model, w = tiny
    toks = _tokens(100)
    ctx = model.new_context(256)
    got = np.concatenate([_decode(ctx, toks[i : i + 7], i) for i in range(0, 100, 7)])
    want = ref.forward(w, SPEC, toks, kv_f16=True)
    _close(got, want, "chunked decode vs reference")
    no_window = ref.forward(w, dataclasses.replace(SPEC, window=None), toks, kv_f16=True)
    assert float(np.abs(got - no_window).max() / np.abs(no_window).max()) > 0.05
    # The window group holds only the window's blocks; the full group every block.
    assert _group(ctx, "window")["blocks_held"] <= math.ceil(SPEC.window / BLOCK) + 1
    assert _group(ctx, "full")["blocks_held"] == math.ceil(100 / BLOCK)
    ctx.audit()


@pytest.mark.parametrize("batch", [1, 64])
def test_window_memory_bounded_over_4096_tokens(tiny, batch):
    """A 4,096-token sequence: after every batch the window group holds at most
    ⌈window/block⌉ + 1 blocks (⌈(window + batch)/block⌉ + 1 while a batch runs), and every
    block it dropped went back to the pool (referenced == held, the rest free or cached)."""
    model, _ = tiny
    ctx = model.new_context(4096)
    toks = _tokens(4096, seed=1)
    bound = math.ceil(SPEC.window / BLOCK) + 1
    step = batch if batch > 1 else 1
    peak = 0
    for i in range(0, 4096 if batch > 1 else 600, step):
        chunk = toks[i : i + step]
        n = len(chunk)
        ctx.decode(chunk, list(range(i, i + n)), [0] * n, [False] * (n - 1) + [True])
        g = _group(ctx, "window")
        peak = max(peak, g["blocks_held"])
        assert g["blocks_held"] <= bound, (i, g)
        assert g["blocks_referenced"] == g["blocks_held"]
        assert g["blocks_free"] + g["blocks_cached"] + g["blocks_referenced"] == g["blocks_total"]
    assert peak >= bound - 1
    assert _group(ctx, "full")["tokens_stored"] == (4096 if batch > 1 else 600)
    ctx.audit()


def test_seq_cp_of_a_pruned_sequence_continues_like_the_source(tiny):
    model, w = tiny
    toks = _tokens(70, seed=2)
    ctx = model.new_context(512)
    _decode(ctx, toks[:60], 0)
    ctx.seq_cp(0, 1)
    a = _decode(ctx, toks[60:], 60, seq=0)
    b = _decode(ctx, toks[60:], 60, seq=1)
    want = ref.forward(w, SPEC, toks, kv_f16=True)[60:]
    _close(a, want, "source after copy")
    _close(b, want, "copy")
    ctx.audit()


def test_seq_rm_tail_inside_the_window_then_redecode(tiny):
    """Removing a tail the window group can continue from (its window is still held: after
    pruning it holds exactly the last `window` positions, so only the last token can go) and
    decoding other tokens there gives the reference's logits for the new tokens."""
    model, w = tiny
    toks = _tokens(60, seed=3)
    other = _tokens(6, seed=4)
    ctx = model.new_context(512)
    _decode(ctx, toks, 0)
    ctx.seq_rm(0, 59, -1)
    got = _decode(ctx, other, 59)
    want = ref.forward(w, SPEC, toks[:59] + other, kv_f16=True)[59:]
    _close(got, want, "re-decoded tail")
    ctx.audit()


def test_seq_rm_tail_beyond_what_the_window_kept_is_refused(tiny):
    """Continuing at a position whose window the window group already dropped would attend
    over missing keys: refused with ValueError, nothing changed (the caller recomputes)."""
    model, w = tiny
    toks = _tokens(80, seed=5)
    ctx = model.new_context(512)
    _decode(ctx, toks, 0)
    before = (ctx.seq_pos_max(0), ctx.n_cells, _group(ctx, "window")["blocks_held"])
    with pytest.raises(ValueError, match="cannot continue"):
        ctx.seq_rm(0, 30, -1)
    assert (ctx.seq_pos_max(0), ctx.n_cells, _group(ctx, "window")["blocks_held"]) == before
    # The sequence still continues correctly, and removing it whole is always allowed.
    got = _decode(ctx, _tokens(3, seed=6), 80)
    want = ref.forward(w, SPEC, toks + _tokens(3, seed=6), kv_f16=True)[80:]
    _close(got, want, "continuation after the refused seq_rm")
    ctx.seq_rm(0)
    assert ctx.n_cells == 0
    assert all(g["blocks_held"] == 0 for g in ctx.stats()["groups"])
    ctx.audit()


def test_prefix_reuse_with_window_groups_equals_recompute(tiny):
    """A second sequence that starts like a first one maps the cached prefix in both groups
    and continues with exactly the logits of a fresh computation."""
    model, w = tiny
    prefix = _tokens(40, seed=7)
    tail = _tokens(5, seed=8)
    ctx = model.new_context(512)
    _decode(ctx, prefix + _tokens(3, seed=9), 0)
    n = ctx.match_prefix(1, prefix + tail)
    assert n > 0 and n % BLOCK == 0
    got = _decode(ctx, (prefix + tail)[n:], n, seq=1)
    want = ref.forward(w, SPEC, prefix + tail, kv_f16=True)[n:]
    _close(got, want, "after prefix reuse")
    ctx.audit()


def test_prefix_reuse_resumes_far_past_the_window(tiny):
    """A prompt decoded in batches (its window group pruned long before the end) is reused
    by a later sequence up to its last whole block: the window group maps only the blocks
    holding the window before the resume point, and the continuation has the reference's
    logits. With a difference inside that window, reuse stops at the last point whose window
    avoids it."""
    model, w = tiny
    prefix = _tokens(120, seed=21)
    ctx = model.new_context(1024)
    for i in range(0, 120, 32):
        _decode(ctx, prefix[i : i + 32], i)
    ctx.seq_rm(0)
    tail = _tokens(6, seed=22)
    n = ctx.match_prefix(1, prefix + tail)
    assert n == 112
    # The window of position 112 (93..111) lies in blocks 5 and 6.
    assert _group(ctx, "window")["blocks_held"] == 2
    assert _group(ctx, "full")["blocks_held"] == 7
    got = _decode(ctx, (prefix + tail)[n:], n, seq=1)
    want = ref.forward(w, SPEC, prefix + tail, kv_f16=True)[n:]
    _close(got, want, "resumed past the window")
    ctx.seq_rm(1)
    # Position 100 differs: the full group matches up to 96, and the window before 96
    # (77..95, blocks 4 and 5) is cached.
    other = list(prefix)
    other[100] = (other[100] + 1) % ref.N_VOCAB
    assert ctx.match_prefix(2, other + tail) == 96
    got = _decode(ctx, (other + tail)[96:], 96, seq=2)
    want = ref.forward(w, SPEC, other + tail, kv_f16=True)[96:]
    _close(got, want, "resumed before a difference")
    ctx.audit()


def _window_blocks(window: int, n_seq: int, n_batch: int) -> int:
    """The sizing rule of docs/KV_SEMANTICS.md ("Sizing"), restated: per sequence its window
    blocks and a partly filled one, one batch, and the windows of up to 4 resume points."""
    per = math.ceil(window / BLOCK) + 1
    return n_seq * (per + 1) + math.ceil(n_batch / BLOCK) + per * min(n_seq, 4)


def test_window_memory_is_sized_by_the_window_not_the_context(tmp_path):
    """A fresh model's window group gets the blocks its windows need, whatever n_ctx: the
    full group grows with the context, the window group with sequences and batch only."""
    path = tmp_path / "gemma3.gguf"
    ref.write_model(path, SPEC)
    totals = {}
    for n_ctx, n_seq, n_batch in ((4096, 1, 2048), (65536, 1, 2048), (65536, 8, 512)):
        m = core.Model(str(path), threads=1)  # each model makes its own memory
        ctx = m.new_context(n_ctx, n_seq_max=n_seq, n_batch=n_batch)
        totals[n_ctx, n_seq] = (
            _group(ctx, "full")["blocks_total"],
            _group(ctx, "window")["blocks_total"],
        )
        assert totals[n_ctx, n_seq][1] == _window_blocks(SPEC.window, n_seq, n_batch)
    assert totals[65536, 1][0] > 10 * totals[4096, 1][0]
    assert totals[65536, 1][1] == totals[4096, 1][1]


def test_batch_larger_than_n_batch_is_refused_without_changes(tiny):
    model, w = tiny
    ctx = model.new_context(4096, n_batch=64)
    toks = _tokens(100, seed=23)
    _decode(ctx, toks[:30], 0)
    before = ctx.stats()["groups"]
    with pytest.raises(ValueError, match="n_batch"):
        _decode(ctx, toks[30:], 30)
    assert ctx.stats()["groups"] == before and ctx.n_cells == 30
    got = np.concatenate([_decode(ctx, toks[30:94], 30), _decode(ctx, toks[94:], 94)])
    want = ref.forward(w, SPEC, toks, kv_f16=True)[30:]
    _close(got, want, "in two batches of at most n_batch")
    ctx.audit()


def _sections(state: bytes) -> list[tuple[int, int, list[int], list[int]]]:
    """(kind, window, positions, tokens) per K/V group of a layer-group sequence state, read
    by the layout documented in rust/core/src/kv/state.rs (version 2: magic, version, identity,
    group count, 20 bytes per group, then one version-1 section per group)."""
    assert state[:4] == b"KVSQ" and int.from_bytes(state[4:8], "little") == 2
    n_groups = int.from_bytes(state[24:28], "little")
    at = 28 + 20 * n_groups
    out = []
    for i in range(n_groups):
        kind, window, _layers, length = struct.unpack_from("<IIIQ", state, 28 + 20 * i)
        sec = state[at : at + length]
        assert sec[:4] == b"KVSQ" and int.from_bytes(sec[4:8], "little") == 1
        n = int.from_bytes(sec[44:48], "little")
        cells = np.frombuffer(sec, dtype="<i4", count=2 * n, offset=48)
        out.append((kind, window, cells[:n].tolist(), cells[n:].tolist()))
        at += length
    assert at == len(state)
    return out


def test_sequence_state_of_a_pruned_sequence_continues_bit_for_bit(tiny_file):
    """A 50-token sequence whose window group was pruned (it holds positions 30..49 of a
    20-position window): its state holds every position in the full group and only the
    window in the window group; written into another Model instance (its own K/V memory),
    the next tokens' logits are bit-identical to the original's and match the reference."""
    path, w = tiny_file
    a = core.Model(str(path), threads=2).new_context(256)
    b = core.Model(str(path), threads=2).new_context(256)
    toks = _tokens(60, seed=11)
    for i in range(0, 50, 7):
        _decode(a, toks[i : min(i + 7, 50)], i)
    state = a.seq_state_read(0)
    groups = _sections(state)
    assert [(k, win) for k, win, _, _ in groups] == [(1, SPEC.window), (0, 0)]
    assert groups[0][2:] == (list(range(30, 50)), toks[30:50])
    assert groups[1][2:] == (list(range(50)), toks[:50])
    _decode(b, _tokens(9, seed=12), 0)  # another sequence beside it
    assert b.seq_state_write(2, state) == 50
    assert (b.seq_pos_min(2), b.seq_pos_max(2)) == (0, 49)
    assert _group(b, "window")["tokens_stored"] == 9 + SPEC.window
    want = ref.forward(w, SPEC, toks, kv_f16=True)[50:]
    for i in range(50, 60):
        got_a = _decode(a, [toks[i]], i)
        got_b = _decode(b, [toks[i]], i, seq=2)
        assert np.array_equal(got_a, got_b), f"position {i}: logits differ"
        _close(got_b, want[i - 50 : i - 49], f"restored sequence at {i}")
    b.audit()


def test_bad_sequence_states_load_nothing(tiny_file, tmp_path):
    """Truncated, corrupt, other-layout and other-model states raise ValueError, and the
    context is as before (no cells in any group, the sequence empty, the pool audit clean)."""
    path, _ = tiny_file
    model = core.Model(str(path), threads=2)
    a = model.new_context(256)
    _decode(a, _tokens(45, seed=13), 0)
    state = a.seq_state_read(0)
    win_sec = 28 + 2 * 20
    token_at = win_sec + 48 + 4 * SPEC.window  # the window section's first token id
    changed = bytearray(state)
    changed[token_at] ^= 1
    other_path = tmp_path / "other.gguf"
    ref.write_model(other_path, dataclasses.replace(SPEC, seed=32))
    other = core.Model(str(other_path), threads=2).new_context(256)
    _decode(other, _tokens(45, seed=13), 0)
    no_window = tmp_path / "nowin.gguf"
    ref.write_model(no_window, dataclasses.replace(SPEC, window=None))
    one_group = core.Model(str(no_window), threads=2).new_context(256)
    _decode(one_group, _tokens(45, seed=13), 0)
    cases = [
        (state[:-1], "runs past the end"),
        (state[: len(state) // 2], "runs past the end"),
        (state[:40], "group table"),
        (state + b"\0", "sections end"),
        (bytes(changed), "holds token"),
        (other.seq_state_read(0), "another model"),
        (one_group.seq_state_read(0), "one K/V group"),
    ]
    b = model.new_context(256)
    _decode(b, _tokens(20, seed=14), 0, seq=1)
    before = (b.n_cells, b.stats()["groups"])
    for data, why in cases:
        with pytest.raises(ValueError, match=why):
            b.seq_state_write(0, data)
        assert (b.n_cells, b.stats()["groups"]) == before, why
        assert b.seq_pos_max(0) == -1
        b.audit()
    with pytest.raises(ValueError, match="several K/V layer groups"):
        one_group.seq_state_write(5, state)
    assert b.seq_state_write(0, state) == 45


def test_real_gemma_state_past_the_window_continues_exactly(gemma_path):
    """Gemma 3 270M, a 700-token prompt (longer than the 512-token window, so the window
    groups were pruned): the state written into another Model instance continues with the
    greedy tokens and bit-identical logits of the uninterrupted original."""
    m1 = core.Model(str(gemma_path), threads=2)
    m2 = core.Model(str(gemma_path), threads=2)
    text = " ".join(f"Line {i}: the river flows past mill number {i}." for i in range(56))
    prompt = m1.tokenize(text + "\nQuestion: what flows past the mills?\nAnswer:", True, True)
    assert len(prompt) > 700
    n = len(prompt)
    a, b = m1.new_context(1024), m2.new_context(1024)
    for i in range(0, n, 256):
        last = _decode_last(a, prompt[i : i + 256], i)
    state = a.seq_state_read(0)
    win = [g for g in _sections(state) if g[0] == 1]
    assert win and all(g[2] == list(range(n - 512, n)) for g in win), "pruned to the window"
    assert b.seq_state_write(0, state) == n
    toks_a, toks_b = [], []
    row_a = row_b = last
    for i in range(8):
        toks_a.append(int(np.argmax(row_a)))
        toks_b.append(int(np.argmax(row_b)))
        row_a = _decode_last(a, [toks_a[-1]], n + i)
        row_b = _decode_last(b, [toks_b[-1]], n + i)
        assert np.array_equal(row_a, row_b), f"step {i}: logits differ"
    assert toks_a == toks_b
    b.audit()


def _decode_last(ctx, toks: list[int], start: int) -> np.ndarray:
    """Decodes ``toks`` into sequence 0 from ``start``; the last token's logits (float32)."""
    k = len(toks)
    out = ctx.decode(toks, list(range(start, start + k)), [0] * k, [False] * (k - 1) + [True])
    return np.frombuffer(out, dtype=np.float32).copy()


def test_real_gemma_4096_tokens_window_bounded(gemma_path):
    """Gemma 3 270M: a 4,096-token sequence in batches of 512 holds at most
    ⌈512/16⌉ + 1 blocks per window layer group after each batch, while the full group holds
    all 256 blocks."""
    m = core.Model(str(gemma_path), threads=2)
    ctx = m.new_context(4096)
    window = next(g["window"] for g in ctx.stats()["groups"] if g["kind"] == "window")
    assert window == 512
    toks = _tokens(4096, seed=10)
    toks = [t + 10 for t in toks]  # skip special ids
    for i in range(0, 4096, 512):
        chunk = toks[i : i + 512]
        ctx.decode(chunk, list(range(i, i + 512)), [0] * 512, [False] * 511 + [True])
        assert _group(ctx, "window")["blocks_held"] <= math.ceil(window / BLOCK) + 1
    assert _group(ctx, "full")["blocks_held"] == 4096 // BLOCK
    st = ctx.stats()["groups"]
    held_bytes = {g["kind"]: g["blocks_held"] * g["bytes_per_block"] for g in st}
    # 15 local layers now take less memory than the 3 global ones.
    assert held_bytes["window"] < held_bytes["full"]


def test_engine_serves_gemma_with_prefix_reuse_identical_to_recompute(gemma_path):
    """Engine on Gemma 3 270M: two requests share a system text longer than a window block
    run; the second reuses cached blocks (in both layer groups), and greedy outputs, including
    one whose prompt is longer than the 512-token window, equal those of an engine without
    prefix reuse. ``stats()`` reports both groups."""
    from kvserve import Engine, Model

    model = Model.load(gemma_path, threads=2)
    system = " ".join(f"Rule {i}: answer briefly and cite rule {i}." for i in range(30))
    long_doc = " ".join(f"Line {i}: the river flows past mill number {i}." for i in range(50))
    prompts = [
        system + "\nQuestion: what is the capital of France?\nAnswer:",
        system + "\nQuestion: what colour is the sky?\nAnswer:",
        long_doc + "\nQuestion: what flows past the mills?\nAnswer:",
        long_doc + "\nQuestion: how many mills are there?\nAnswer:",
    ]
    assert len(model.tokenize(prompts[2])) > 600
    outs = {}
    for reuse in (False, True):
        with Engine(model, parallel=2, ctx_size=2048, batch_tokens=256, prefix_cache=reuse) as e:
            outs[reuse] = [e.generate(p, max_tokens=12, temperature=0) for p in prompts]
            st = e.stats()
            assert st["kv_window_layers"] == 15 and st["kv_full_layers"] == 3
            # Sized for 2 running sequences and one step (256 prompt tokens + 2), not ctx_size.
            assert st["kv_window_blocks_total"] == _window_blocks(512, 2, 256 + 2)
            if reuse:
                # Everything the prompts share, in whole blocks (a long document's prefix
                # resumes far past the 512-token window).
                for a, b in ((0, 1), (2, 3)):
                    ta, tb = model.tokenize(prompts[a]), model.tokenize(prompts[b])
                    common = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
                    assert outs[True][b].cached_tokens == common // 16 * 16
                assert outs[True][3].cached_tokens > 600
    assert [r.text for r in outs[True]] == [r.text for r in outs[False]]
    assert all(r.cached_tokens == 0 for r in outs[False])
