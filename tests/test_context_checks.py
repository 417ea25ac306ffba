"""The binding's checks before acting and its containment of a panic (issue: core support for
the service core): ``Context.seq_state_check`` holds a saved state to the tokens it must hold
(so the engine never parses the state layout), ``Context.blocks_short`` says before a decode
whether its batch fits the K/V memory, and a context closed by a panic (``_inject_panic``)
gives its blocks back to the model's pools at once. The Rust tests hold the same APIs to
oracles over random states (rust/core: ``kv::state``, ``kv::memory``, ``model`` tests); these
check the binding's side: signatures, exception types, and the closed context."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import lfm2_reference as lref  # noqa: E402

import kvserve  # noqa: E402
from kvserve import _core  # noqa: E402

PROMPT = (
    "The lighthouse keeper climbed the stairs every evening to light the lamp, and the ships "
    "that passed the rocks at night saw its beam sweep across the dark water."
)


def _prefill(ctx: _core.Context, toks: list[int], seq: int = 0, pos0: int = 0) -> None:
    n = len(toks)
    ctx.decode(toks, list(range(pos0, pos0 + n)), [seq] * n, [False] * (n - 1) + [True])


@pytest.fixture(params=["smollm2", "gemma3", "lfm2"])
def any_model(request, model_path: Path, gemma_path: Path, tmp_path: Path) -> _core.Model:
    """One model of each memory layout: one K/V group; a window group beside a full one; a
    hybrid (recurrent states beside attention)."""
    if request.param == "lfm2":
        path = tmp_path / "cca-f32.gguf"
        lref.write_model(path, lref.VARIANTS["cca-f32"])
    else:
        path = model_path if request.param == "smollm2" else gemma_path
    return _core.Model(path, threads=2)


def _tokens(m: _core.Model, n: int) -> list[int]:
    toks = m.tokenize(PROMPT * 4, add_special=True) if m.arch != "lfm2" else []
    return toks[:n] if len(toks) >= n else [(7 * i + 3) % m.n_vocab for i in range(n)]


def test_seq_state_check_holds_a_state_to_its_tokens(any_model: _core.Model) -> None:
    toks = _tokens(any_model, 37)
    a = any_model.new_context(256)
    _prefill(a, toks)
    data = a.seq_state_read(0)
    b = any_model.new_context(256)
    _prefill(b, toks[:5], seq=3)
    before = (b.stats(), b.seq_pos_max(0), b.n_cells)
    assert b.seq_state_check(data, toks) == 37
    other = list(toks)
    other[10] = (other[10] + 1) % any_model.n_vocab
    for _why, d, t in [
        ("another token", data, other),
        ("fewer tokens", data, toks[:36]),
        ("more tokens", data, toks + [1]),
        ("truncated", data[:-1], toks),
        ("padded", data + b"\0", toks),
        ("empty", b"", []),
    ]:
        with pytest.raises(ValueError):
            b.seq_state_check(d, t)
    with pytest.raises(ValueError, match="out of range"):
        b.seq_state_check(data, toks[:36] + [any_model.n_vocab])
    # Nothing was written by any of it; the state still loads as those tokens.
    assert (b.stats(), b.seq_pos_max(0), b.n_cells) == before
    assert b.seq_state_write(0, data) == 37
    b.audit()
    # Another K/V type is another memory: its states are not this one's.
    q8 = any_model.new_context(256, kv_type="q8_0")
    with pytest.raises(ValueError):
        q8.seq_state_check(data, toks)


def test_seq_state_check_wants_the_recurrent_state_after_the_last_token(tmp_path: Path) -> None:
    path = tmp_path / "cca-f32.gguf"
    lref.write_model(path, lref.VARIANTS["cca-f32"])
    m = _core.Model(path, threads=2)
    ctx = m.new_context(128)
    toks = _tokens(m, 21)
    _prefill(ctx, toks)
    data = ctx.seq_state_read(0)
    assert ctx.seq_state_check(data, toks) == 21
    # The footer: position (i32), value count (u64), version (u32), b"KVRS".
    at = len(data) - 20
    moved = data[:at] + (19).to_bytes(4, "little", signed=True) + data[at + 4 :]
    with pytest.raises(ValueError, match="recurrent state is at position 19"):
        ctx.seq_state_check(moved, toks)
    # seq_state_write takes it (it does not know the tokens); the check is what a loader asks.
    assert ctx.seq_state_write(5, moved) == 21


def test_blocks_short_says_before_a_decode_whether_it_fits(model_path: Path) -> None:
    m = _core.Model(model_path, threads=2)
    md = m.metadata()
    kv_dim = m.n_embd // md["llama.attention.head_count"] * md["llama.attention.head_count_kv"]
    per_block = 2 * m.n_layer * 16 * kv_dim * 2  # K and V, 16 tokens of f16 rows per layer
    ctx = m.new_context(kv_memory=6 * per_block)
    assert ctx.stats()["bytes_per_block"] == per_block
    assert ctx.stats()["blocks_total"] == 6
    toks = _tokens(m, 90)
    _prefill(ctx, toks[:40])  # 3 blocks, the last partly filled
    ctx.seq_cp(0, 1)  # shares them all
    # Sequence 1 goes on: a copy of the shared partial tail and one more block; 3 are free.
    assert ctx.blocks_short([40, 41, 42], [1, 1, 1]) == 0
    batch = list(range(40, 80))
    assert ctx.blocks_short(batch, [1] * 40) == 0  # copy + 2 new = 3
    assert ctx.blocks_short(batch + [40], [1] * 40 + [0]) == 1  # and sequence 0's tail copy
    stats = ctx.stats()
    with pytest.raises(kvserve.KvCacheFull):
        ctx.decode(toks[40:80] + [toks[40]], batch + [40], [1] * 40 + [0], [False] * 41)
    assert ctx.stats()["blocks_referenced"] == stats["blocks_referenced"]
    ctx.decode(toks[40:80], batch, [1] * 40, [False] * 39 + [True])
    # No block is left; sequence 0's tail is its own again (8 free slots).
    assert ctx.blocks_short(list(range(40, 48)), [0] * 8) == 0
    assert ctx.blocks_short(list(range(40, 57)), [0] * 17) == 1
    for bad in (([], []), ([0, 1], [0]), ([-1], [2]), ([3, 3], [2, 2]), ([10], [1])):
        with pytest.raises(ValueError):
            ctx.blocks_short(*bad)
    ctx.audit()


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_a_panic_closes_the_context_and_gives_its_blocks_back(
    which: str, model_path: Path, gemma_path: Path
) -> None:
    m = _core.Model(model_path if which == "smollm2" else gemma_path, threads=2)
    toks = _tokens(m, 70)
    keep = m.new_context(512)
    _prefill(keep, toks[:20])
    base = keep.stats()
    ctx = m.new_context(512)
    _prefill(ctx, toks[:65])
    ctx.seq_cp(0, 1)
    _prefill(ctx, toks[65:68], seq=1, pos0=65)
    assert ctx.stats()["blocks_referenced"] > base["blocks_referenced"]
    ctx._inject_panic()
    with pytest.raises(kvserve.EngineError, match="closed"):
        ctx.seq_pos_max(0)
    # Closed at once: every block it held is back in the shared pools, the prompt's full
    # blocks cached for the next context; its own counts read 0.
    after = ctx.stats()
    assert after["blocks_referenced"] == base["blocks_referenced"]
    assert after["blocks_cached"] > base["blocks_cached"]
    for g, b in zip(after["groups"], base["groups"], strict=True):
        assert g["blocks_referenced"] == b["blocks_referenced"], g
        assert (g["tokens_stored"], g["blocks_held"]) == (0, 0)
    assert (ctx.n_cells, after["sequences"], after["blocks_held"]) == (0, 0, 0)
    for call in (lambda: ctx.seq_pos_max(0), lambda: ctx.decode([1], [0], [5], [True])):
        with pytest.raises(kvserve.EngineError, match="closed"):
            call()
    keep.audit()
    fresh = m.new_context(512)
    assert fresh.match_prefix(0, toks[:65]) == 64
    fresh.audit()
