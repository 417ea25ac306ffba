"""LFM2 (short-conv + attention hybrid) against two oracles: the float64 numpy reference of
tests/lfm2_reference.py and llama.cpp's logits for the same files
(tests/fixtures/lfm2_tiny*.{json,npz}, recorded by scripts/record_lfm2_fixtures.py); and the
recurrent-state group's sequence rules (docs/KV_SEMANTICS.md, "Recurrent state") against the
reference run on what each rule says a sequence holds.

Tolerances (max |diff| / max |logit|): against the reference, 1e-4 for F32 weights (float32
order; both round K/V to f16) and 2e-2 for quantized ones (8-bit activations emulated; float32
vs float64 rounding can land on neighbouring 8-bit steps). Against llama.cpp, 2e-3 for F32
(llama.cpp also rounds q to f16 in its K·q product) and 1e-1 for quantized weights, where
llama.cpp was measured 1e-3..2e-3 away from the 8-bit emulation per quantized matmul (each
matrix quantized alone), which adds up over a model's dozen matrices; there its greedy tokens
must also be ours.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).parent))

import lfm2_reference as lref  # noqa: E402

import kvserve._core as core  # noqa: E402
from kvserve import KvCacheFull, ModelError  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
META = json.loads((FIXTURES / "lfm2_tiny.json").read_text())
PROMPT: list[int] = META["prompt_tokens"]


class Tiny:
    def __init__(self, name: str, path: Path, spec: lref.Spec | None = None):
        self.name = name
        self.spec = spec if spec is not None else lref.VARIANTS[name]
        self.tol_f32 = 1e-4
        self.path = path
        self.w = lref.write_model(path, self.spec)
        self.model = core.Model(str(path), threads=2)

    def ref(self, tokens: list[int], **kw) -> np.ndarray:
        return lref.forward(self.w, self.spec, tokens, **kw)[0]

    def decode(self, ctx, tokens, positions, seqs) -> np.ndarray:
        n = len(tokens)
        out = ctx.decode(tokens, positions, seqs, [True] * n)
        return np.frombuffer(out, dtype=np.float32).reshape(n, out.n_vocab).astype(np.float64)

    @property
    def tol(self) -> float:
        return 2e-2 if self.spec.quantized else self.tol_f32


@pytest.fixture(scope="module", params=list(lref.VARIANTS), ids=list(lref.VARIANTS))
def tiny(request, tmp_path_factory) -> Tiny:
    return Tiny(request.param, tmp_path_factory.mktemp("lfm2") / f"{request.param}.gguf")


@pytest.fixture(scope="module")
def f32(tmp_path_factory) -> Tiny:
    return Tiny("cca-f32", tmp_path_factory.mktemp("lfm2") / "cca-f32.gguf")


def rel(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape and np.isfinite(got).all()
    return float(np.abs(got - want).max() / np.abs(want).max())


def close(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    d = rel(got, want)
    assert d < tol, f"{what}: max |diff| / max |logit| = {d:.3g} >= {tol}"


# ------------------------------------------------------------------------------------------
# The model


def test_file_layout_is_llama_cpps(tiny: Tiny):
    """What the file says (read with gguf) is what the engine loaded: the per-layer KV head
    counts with 0 on conv layers, llama.cpp's tensor names."""
    r = GGUFReader(tiny.path)
    kv = r.fields["lfm2.attention.head_count_kv"].contents()
    assert [n == 0 for n in kv] == [k == "C" for k in tiny.spec.layers]
    names = {t.name for t in r.tensors}
    assert "token_embd_norm.weight" in names and "output_norm.weight" not in names
    for i, k in enumerate(tiny.spec.layers):
        conv = f"blk.{i}.shortconv.in_proj.weight" in names
        assert conv == (k == "C") and (f"blk.{i}.attn_q.weight" in names) == (k == "A")
    m = tiny.model
    assert (m.arch, m.n_layer, m.n_embd) == ("lfm2", tiny.spec.n_layer, tiny.spec.n_embd)


def test_prompt_logits_vs_reference(tiny: Tiny):
    n = len(PROMPT)
    got = tiny.decode(tiny.model.new_context(128), PROMPT, list(range(n)), [0] * n)
    close(got, tiny.ref(PROMPT), tiny.tol, "prompt vs reference")


def test_incremental_decoding_carries_the_state(tiny: Tiny):
    """A prefill of 5 tokens, then one token per call: the conv state carries between calls."""
    toks = PROMPT[:16]
    ctx = tiny.model.new_context(128)
    rows = [tiny.decode(ctx, toks[:5], list(range(5)), [0] * 5)]
    rows += [tiny.decode(ctx, [t], [i], [0]) for i, t in enumerate(toks[5:], start=5)]
    want = tiny.ref(toks)
    close(np.concatenate(rows), want, tiny.tol, "incremental vs reference")
    # With the state dropped between calls (the conv restarting from zeros at each call)
    # the reference is far away: the carried state is what makes them agree.
    lost = lref.forward(tiny.w, tiny.spec, toks, conv_resets=list(range(5, 16)))[0]
    assert rel(np.concatenate(rows), lost) > 5 * tiny.tol, "the state does not matter?"


def test_conv_tap_order_matters(tiny: Tiny):
    """The kernel applied in the wrong time order is far from the engine: the agreement above
    is evidence the taps are read as llama.cpp lays them out."""
    n = len(PROMPT)
    got = tiny.decode(tiny.model.new_context(128), PROMPT, list(range(n)), [0] * n)
    wrong = lref.forward(tiny.w, tiny.spec, PROMPT, taps_reversed=True)[0]
    assert rel(got, wrong) > 5 * tiny.tol


def test_logits_vs_llama_cpp(tiny: Tiny):
    """llama.cpp's logits for the same file: every prompt position, then its 8 greedy steps
    (fed one token per call). The file must be byte-identical to the one recorded."""
    rec = next(r for r in META["variants"] if r["name"] == tiny.name)
    sha = hashlib.sha256(tiny.path.read_bytes()).hexdigest()
    assert sha == rec["sha256"], (
        f"{tiny.name}: the generated file differs from the recorded one; rerun "
        "scripts/record_lfm2_fixtures.py"
    )
    z = np.load(FIXTURES / "lfm2_tiny_logits.npz")
    n = len(PROMPT)
    ctx = tiny.model.new_context(128)
    got = tiny.decode(ctx, PROMPT, list(range(n)), [0] * n)
    tol = 1e-1 if tiny.spec.quantized else 2e-3
    close(got, z[f"{tiny.name}/prompt"].astype(np.float64), tol, "prompt vs llama.cpp")
    greedy = rec["greedy_tokens"]
    assert int(got[-1].argmax()) == greedy[0]
    steps = [tiny.decode(ctx, [t], [n + i], [0])[0] for i, t in enumerate(greedy)]
    close(np.stack(steps), z[f"{tiny.name}/steps"].astype(np.float64), tol, "steps vs llama.cpp")
    assert [int(s.argmax()) for s in steps[:-1]] == greedy[1:], "greedy tokens differ"


def _write_bad(tmp_path: Path, name: str, edit) -> Path:
    """A copy of the cca-f32 file with metadata changed by ``edit(key, value)``."""
    from gguf import GGUFWriter

    src = tmp_path / "src.gguf"
    lref.write_model(src, lref.VARIANTS["cca-f32"])
    r = GGUFReader(src)
    out = tmp_path / f"{name}.gguf"
    w = GGUFWriter(str(out), "lfm2")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        v = edit(key, f.contents())
        if v is None:
            continue
        sub = f.types[1] if len(f.types) > 1 else None
        w.add_key_value(key, v, f.types[0], sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize(
    "name,edit,why",
    [
        ("no-lcache", lambda k, v: None if k == "lfm2.shortconv.l_cache" else v, "l_cache"),
        (
            "short-kv",
            lambda k, v: v[:2] if k == "lfm2.attention.head_count_kv" else v,
            "head_count_kv",
        ),
        ("all-conv", lambda k, v: [0, 0, 0] if k == "lfm2.attention.head_count_kv" else v, "0"),
        # Layer 1 becomes an attention layer, whose tensors the file lacks.
        (
            "no-tensor",
            lambda k, v: [0, 2, 2] if k == "lfm2.attention.head_count_kv" else v,
            "blk.1.attn_q",
        ),
    ],
)
def test_bad_files_are_clear_model_errors(tmp_path: Path, name: str, edit, why: str):
    path = _write_bad(tmp_path, name, edit)
    with pytest.raises(ModelError, match=why):
        core.Model(str(path), threads=1)


# ------------------------------------------------------------------------------------------
# Recurrent memory


def test_batch_mates_do_not_change_a_sequence(f32: Tiny):
    """One batch mixing a running sequence's decode token with two prefills: each sequence's
    logits equal those it gets alone (and the reference)."""
    a, b, c = PROMPT[:12], PROMPT[12:21], PROMPT[21:30]
    ctx = f32.model.new_context(256)
    first = f32.decode(ctx, a[:11], list(range(11)), [0] * 11)
    toks = [a[11]] + b + c
    pos = [11] + list(range(len(b))) + list(range(len(c)))
    seqs = [0] + [1] * len(b) + [2] * len(c)
    # Interleave b and c token by token (positions still increase per sequence).
    order = [0] + [j for pair in zip(range(1, 10), range(10, 19), strict=True) for j in pair]
    got = f32.decode(
        ctx, [toks[j] for j in order], [pos[j] for j in order], [seqs[j] for j in order]
    )
    back = np.empty_like(got)
    back[order] = got
    for s, (lo, hi), toks_s in ((1, (1, 10), b), (2, (10, 19), c)):
        alone = f32.model.new_context(64)
        want = f32.decode(alone, toks_s, list(range(len(toks_s))), [0] * len(toks_s))
        close(back[lo:hi], want, 1e-5, f"seq {s} batched vs alone")
    close(np.concatenate([first, back[:1]]), f32.ref(a), f32.tol, "seq 0 vs reference")
    ctx.audit()


def test_partial_seq_rm_fails_and_changes_nothing(f32: Tiny):
    toks = PROMPT[:10]
    ctx = f32.model.new_context(128)
    f32.decode(ctx, toks, list(range(10)), [0] * 10)
    before = ctx.stats()
    for p0, p1 in [(5, -1), (9, 10), (3, 12)]:
        with pytest.raises(ValueError, match="recurrent state"):
            ctx.seq_rm(0, p0, p1)
    with pytest.raises(ValueError, match="all positions"):
        ctx.seq_rm(-1, 4, -1)
    assert ctx.stats() == before and ctx.seq_pos_max(0) == 9 and ctx.n_cells == 10
    # Both groups unchanged: the next token continues exactly.
    got = f32.decode(ctx, [PROMPT[10]], [10], [0])
    close(got, f32.ref(PROMPT[:11])[10:], f32.tol, "after the failed seq_rm")
    ctx.audit()


def test_whole_sequence_removal_frees_its_state(f32: Tiny):
    ctx = f32.model.new_context(128)
    s0 = ctx.stats()
    f32.decode(ctx, PROMPT[:5], list(range(5)), [3] * 5)
    s1 = ctx.stats()
    # One K/V block for 5 tokens plus one block for the conv state, from the same pool.
    assert s1["blocks_referenced"] - s0["blocks_referenced"] == 2
    ctx.seq_rm(3, 0, -1)
    assert ctx.stats()["blocks_referenced"] == s0["blocks_referenced"]
    assert ctx.seq_pos_max(3) == -1
    # The id starts afresh: a new prompt in it is the reference's, from a zero state.
    got = f32.decode(ctx, PROMPT[5:9], list(range(4)), [3] * 4)
    close(got, f32.ref(PROMPT[5:9]), f32.tol, "reused id")
    ctx.audit()


def test_seq_cp_gives_the_copy_its_own_state(f32: Tiny):
    """After seq_cp both sequences go on independently (copy-on-write of the state)."""
    ctx = f32.model.new_context(256)
    p = PROMPT[:8]
    f32.decode(ctx, p, list(range(8)), [0] * 8)
    used = ctx.stats()["blocks_referenced"]
    ctx.seq_cp(0, 1, -1, -1)
    assert ctx.stats()["blocks_referenced"] == used, "shared until written"
    x, y = PROMPT[8:11], PROMPT[20:23]
    gx = f32.decode(ctx, x, [8, 9, 10], [0] * 3)
    gy = f32.decode(ctx, y, [8, 9, 10], [1] * 3)
    close(gx, f32.ref(p + x)[8:], f32.tol, "source after the copy")
    close(gy, f32.ref(p + y)[8:], f32.tol, "copy after the copy")
    ctx.audit()


def test_position_shift_moves_attention_only(f32: Tiny):
    """seq_add shifts the K/V positions (keys re-rotated); the conv state keeps its values."""
    ctx = f32.model.new_context(128)
    p = PROMPT[:9]
    f32.decode(ctx, p, list(range(9)), [0] * 9)
    ctx.seq_add(0, -1, -1, 20)
    assert ctx.seq_pos_max(0) == 28
    got = f32.decode(ctx, [PROMPT[9]], [29], [0])
    want = f32.ref(PROMPT[:10], positions=list(range(20, 30)))[9:]
    close(got, want, f32.tol, "after seq_add")
    ctx.audit()


def test_state_blocks_count_against_the_pool(f32: Tiny):
    """States take blocks of the K/V pool: a pool of 8 blocks holds 4 one-token sequences
    (a K/V block and a state block each); a batch that needs more is refused, nothing changed."""
    # One attention layer x (K, V) x 16 slots x kv_dim 32 x f16; the state (2 conv layers x
    # 2 inputs x 64 channels x f32 = 1 KiB) fits one block.
    block = 1 * 2 * 16 * 32 * 2
    model = core.Model(str(f32.path), threads=2)
    ctx = model.new_context(kv_memory=8 * block)
    st = ctx.stats()
    assert (st["bytes_per_block"], st["blocks_total"]) == (block, 8)
    f32.decode(ctx, [PROMPT[0]] * 3, [0] * 3, [0, 1, 2])
    assert ctx.stats()["blocks_free"] == 2
    with pytest.raises(KvCacheFull):
        f32.decode(ctx, [PROMPT[1]] * 2, [0] * 2, [5, 6])
    assert ctx.stats()["blocks_free"] == 2 and ctx.seq_pos_max(5) == -1
    f32.decode(ctx, [PROMPT[1]], [0], [5])
    assert ctx.stats()["blocks_free"] == 0
    ctx.audit()


# ------------------------------------------------------------------------------------------
# Prefix reuse (state checkpoints), sessions, the Engine and the server


def test_prefix_reuse_resumes_from_a_state_checkpoint(f32: Tiny):
    """A second sequence with the same 40-token prefix maps 32 tokens (two blocks, ending at a
    checkpoint) and its logits are the reference's, as if it had computed them."""
    model = core.Model(str(f32.path), threads=2)
    ctx = model.new_context(256)
    p = PROMPT[:40]
    f32.decode(ctx, p, list(range(40)), [0] * 40)
    ctx.seq_rm(0, -1, -1)
    q = p[:37] + PROMPT[5:9]
    n = ctx.match_prefix(1, q)
    assert n == 32 and ctx.seq_pos_max(1) == 31
    got = f32.decode(ctx, q[n:], list(range(n, len(q))), [1] * (len(q) - n))
    close(got, f32.ref(q)[n:], f32.tol, "after the checkpoint")
    # Without a checkpoint the prefix is not mapped (a model whose contexts never keyed).
    fresh = core.Model(str(f32.path), threads=2)
    off = fresh.new_context(256, prefix_cache=False)
    f32.decode(off, p, list(range(40)), [0] * 40)
    off.seq_rm(0, -1, -1)
    assert off.match_prefix(1, q) == 0 and off.seq_pos_max(1) == -1
    ctx.audit()
    off.audit()


def test_checkpoints_are_evicted_with_cached_blocks(f32: Tiny):
    """Checkpoints are cached pool blocks, evicted by the pool's LRU: a match maps the longest
    prefix whose checkpoint survives, and nothing when none does, even though the K/V blocks
    are still cached (a prefix is never continued without its state)."""
    block = 1 * 2 * 16 * 32 * 2
    model = core.Model(str(f32.path), threads=2)
    ctx = model.new_context(kv_memory=12 * block)
    filler = model.new_context(kv_memory=12 * block, prefix_cache=False)
    p = PROMPT[:33]
    f32.decode(ctx, p, list(range(33)), [0] * 33)
    ctx.seq_rm(0, -1, -1)
    st = ctx.stats()
    assert (st["blocks_cached"], st["blocks_free"]) == (4, 8), "2 K/V blocks, 2 checkpoints"

    def fill(n_blocks: int) -> None:
        toks = (PROMPT * 8)[: 16 * n_blocks]
        f32.decode(filler, toks, list(range(len(toks))), [0] * len(toks))
        filler.seq_rm(0, -1, -1)

    # As many K/V blocks as are free, and a state: one cached block goes, the oldest (the
    # first checkpoint).
    fill(ctx.stats()["blocks_free"])
    assert ctx.stats()["blocks_cached"] == 3
    assert ctx.match_prefix(1, p) == 32
    got = f32.decode(ctx, [p[32]], [32], [1])
    close(got, f32.ref(p)[32:], f32.tol, "after the surviving checkpoint")
    ctx.seq_rm(1, -1, -1)
    # Now the oldest cached block is the second checkpoint (the match refreshed the others).
    fill(ctx.stats()["blocks_free"])
    assert ctx.match_prefix(2, p) == 0 and ctx.seq_pos_max(2) == -1
    ctx.audit()
    filler.audit()


def test_session_state_carries_the_recurrent_state(f32: Tiny, tmp_path: Path):
    """seq_state_read/write move a sequence (K/V and conv state) to another model instance
    without recomputation: the next token's logits are identical; bad input changes nothing."""
    a = core.Model(str(f32.path), threads=2).new_context(128)
    b = core.Model(str(f32.path), threads=2).new_context(128)
    p = PROMPT[:21]
    f32.decode(a, p, list(range(21)), [0] * 21)
    data = a.seq_state_read(0)
    assert data[-4:] == b"KVRS"
    for bad in (data[:30], data[:-4] + b"XXXX", data[:-24] + data[-20:], data[1:]):
        with pytest.raises(ValueError):
            b.seq_state_write(2, bad)
        assert b.seq_pos_max(2) == -1 and b.stats()["blocks_referenced"] == 0
    assert b.seq_state_write(2, data) == 21
    la = f32.decode(a, [PROMPT[21]], [21], [0])
    lb = f32.decode(b, [PROMPT[21]], [21], [2])
    assert np.array_equal(la, lb)
    close(lb, f32.ref(PROMPT[:22])[21:], f32.tol, "restored vs reference")
    b.audit()


def test_engine_greedy_is_the_same_with_and_without_prefix_reuse(f32: Tiny):
    from kvserve import Engine, Model

    prompt = "the cat in the hat ran on and on, then another one sat in the sun and the"
    outs = {}
    for reuse in (False, True):
        m = Model(str(f32.path), threads=2)
        with Engine(m, parallel=4, ctx_size=256, prefix_cache=reuse) as e:
            first = e.generate(prompt, max_tokens=12)
            again = [e.generate(prompt + x, max_tokens=12) for x in (" cat", " hat")]
            outs[reuse] = (first.tokens, [r.tokens for r in again])
            cached = [r.cached_tokens for r in again]
            assert (max(cached) > 0) == reuse, cached
    assert outs[True] == outs[False]


def test_engine_sessions_with_save_and_restore(f32: Tiny, tmp_path: Path):
    from kvserve import Engine, Model

    turns = ["the cat in the hat", " ran on and on,", " then another one"]
    m = Model(str(f32.path), threads=2)
    with Engine(m, parallel=2, ctx_size=256, prefix_cache=False) as e:
        r1 = e.generate(turns[0], max_tokens=6, session_id="s")
        r2 = e.generate(turns[1], max_tokens=6, session_id="s")
        assert r2.cached_tokens == r1.prompt_tokens + len(r1.tokens)
        # The second turn is what the whole conversation gives computed from scratch.
        whole = m.tokenize(turns[0], add_special=True) + r1.tokens
        whole += m.tokenize(turns[1], add_special=False)
        ctx = m.core.new_context(256)
        n = len(whole)
        row = f32.decode(ctx, whole, list(range(n)), [0] * n)[-1]
        assert r2.tokens[0] == int(row.argmax())
        e.save_session("s", tmp_path / "s.kvs")
        r3 = e.generate(turns[2], max_tokens=6, session_id="s")
    with Engine(Model(str(f32.path), threads=2), parallel=2, ctx_size=256) as e2:
        assert e2.load_session(tmp_path / "s.kvs") == "s"
        r3b = e2.generate(turns[2], max_tokens=6, session_id="s")
        assert r3b.tokens == r3.tokens
        assert r3b.cached_tokens == r3.cached_tokens


def test_engine_reports_the_recurrent_group(f32: Tiny):
    """stats() reports the hybrid model's recurrent group beside its attention group: one state
    (of ``blocks_per_state`` pool blocks) per sequence holding one, back to 0 when it goes."""
    from kvserve import Engine, Model

    m = Model(str(f32.path), threads=2)
    with Engine(m, parallel=2, ctx_size=256) as e:
        st = e.stats()
        assert st["kv_recurrent_blocks_used"] == 0 and st["kv_full_blocks_used"] == 0
        assert st["kv_recurrent_layers"] + st["kv_full_layers"] == m.core.n_layer
        e.generate("the cat in the hat", max_tokens=4, session_id="a")
        e.generate("a dog ran", max_tokens=4, session_id="b")
        per_state = e.stats()["kv_recurrent_blocks_used"] // 2
        assert per_state >= 1
        assert e.stats()["kv_recurrent_blocks_used"] == 2 * per_state  # two parked sessions
        e.drop_session("a")
        assert e.stats()["kv_recurrent_blocks_used"] == per_state
        e.drop_session("b")
        assert e.stats()["kv_recurrent_blocks_used"] == 0


def test_server_serves_lfm2_with_sessions_and_prefix_reuse(f32: Tiny, tmp_path: Path):
    """`kvserve serve` on the tiny LFM2 file: a shared prompt is reused (cached tokens), a
    session turn continues from its state, and a saved, dropped and restored session goes on
    as the live one did."""
    import httpx
    from test_server import Server

    from kvserve import Model

    srv = Server(
        [
            "--model", str(f32.path), "--threads", "2", "--parallel", "2",
            "--ctx-size", "256", "--session-dir", str(tmp_path / "saved"),
        ],
        tmp_path / "server.log",
    )  # fmt: skip
    try:
        url = srv.url

        def complete(**body):
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        long = "the cat in the hat ran on and on, then another one sat in the sun; the end"
        a = complete(prompt=long, max_tokens=6)
        b = complete(prompt=long, max_tokens=6)
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        want = Model(str(f32.path), threads=2).generate(long, max_tokens=6)
        assert a["choices"][0]["text"] == want.text

        r1 = complete(prompt=long, max_tokens=4, session_id="s")
        r2 = complete(prompt=" and on", max_tokens=4, session_id="s")
        held = r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"]
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == held
        assert httpx.post(f"{url}/v1/sessions/s/save").status_code == 200
        r3 = complete(prompt=" then", max_tokens=4, session_id="s")
        assert httpx.delete(f"{url}/v1/sessions/s").status_code == 200
        r = httpx.post(f"{url}/v1/sessions/restore", json={"id": "s"})
        assert r.status_code == 200, r.text
        r3b = complete(prompt=" then", max_tokens=4, session_id="s")
        assert r3b["choices"][0]["text"] == r3["choices"][0]["text"]
        assert (
            r3b["usage"]["prompt_tokens_details"]["cached_tokens"]
            == r3["usage"]["prompt_tokens_details"]["cached_tokens"]
        )
    finally:
        srv.stop()


def test_engine_chat_session_that_needs_a_state_cut_recomputes(f32: Tiny):
    """A chat turn whose rendering diverges inside what the session holds would need the
    state cut back (refused for a hybrid model): the engine recomputes from the prefix cache
    instead, and the reply is what the conversation gives without a session."""
    from kvserve import Engine, Model

    m = Model(str(f32.path), threads=2)
    with Engine(m, parallel=2, ctx_size=512) as e:
        first = [{"role": "user", "content": "the cat in the hat"}]
        r1 = e.chat(first, max_tokens=5, session_id="c")
        # The client sends another assistant message than the reply: the conversation
        # diverges from the session's tokens right after the first prompt.
        conv = first + [
            {"role": "assistant", "content": "on and on"},
            {"role": "user", "content": "ran on and on"},
        ]
        r2 = e.chat(conv, max_tokens=5, session_id="c")
        alone = e.chat(conv, max_tokens=5)
        assert r2.tokens == alone.tokens
        assert r2.cached_tokens < len(m.tokenize_chat(first)) + len(r1.tokens)


# ------------------------------------------------------------------------------------------
# Hybrid + ISWA: full-attention, sliding-window and short-conv layers in one model (llama.cpp's
# llama_memory_hybrid_iswa), as three layer groups of one context's memory.

ISWA = lref.Spec(layers="CWACW", window=20, seed=25)
BLOCK = 16


@pytest.fixture(scope="module")
def iswa(tmp_path_factory) -> Tiny:
    t = Tiny("cwacw-iswa", tmp_path_factory.mktemp("lfm2") / "cwacw-iswa.gguf", ISWA)
    # Five layers in float32 against float64: the first token's row, which neither the window
    # nor a carried state touches, was measured 1.5e-4 away (later rows ~1e-5).
    t.tol_f32 = 3e-4
    return t


def _toks(n: int, seed: int) -> list[int]:
    from reference import N_VOCAB

    return [int(t) for t in np.random.default_rng(seed).integers(0, N_VOCAB, n)]


def _groups(ctx) -> dict[str, dict]:
    return {g["kind"]: g for g in ctx.stats()["groups"]}


def test_hybrid_iswa_vs_reference_far_past_the_window(iswa: Tiny):
    """100 tokens in chunks of 7: the window group is pruned after every chunk and the conv
    state carried between them; every row equals the reference's, and the rows are far from
    the same model without the window (the window matters) and from one whose conv state is
    lost between chunks (the state matters)."""
    toks = _toks(100, seed=1)
    ctx = iswa.model.new_context(512)
    g = _groups(ctx)
    assert (g["window"]["window"], g["window"]["layers"], g["full"]["layers"]) == (20, 2, 1)
    rows = []
    for i in range(0, 100, 7):
        chunk = toks[i : i + 7]
        rows.append(iswa.decode(ctx, chunk, list(range(i, i + len(chunk))), [0] * len(chunk)))
        held = _groups(ctx)["window"]["blocks_held"]
        assert held <= math.ceil(ISWA.window / BLOCK) + 1, (i, held)
    got = np.concatenate(rows)
    close(got, iswa.ref(toks), iswa.tol, "hybrid iswa vs reference")
    no_window = lref.forward(iswa.w, dataclasses.replace(ISWA, window=None), toks)[0]
    assert rel(got, no_window) > 5 * iswa.tol, "the window does not matter?"
    lost = iswa.ref(toks, conv_resets=list(range(7, 100, 7)))
    assert rel(got, lost) > 5 * iswa.tol, "the state does not matter?"
    assert _groups(ctx)["full"]["blocks_held"] == math.ceil(100 / BLOCK)
    ctx.audit()


def test_hybrid_iswa_sequence_rules_hold_across_all_groups(iswa: Tiny):
    """llama.cpp's hybrid rules over three groups: a partial seq_rm the state cannot honour
    fails and changes no group (the window group and the full group alike); seq_cp gives the
    copy its own state and what the window holds; removing a whole sequence frees every group."""
    toks = _toks(60, seed=2)
    ctx = iswa.model.new_context(512)
    base = ctx.stats()
    iswa.decode(ctx, toks, list(range(60)), [0] * 60)
    before = ctx.stats()
    for p0, p1 in [(50, -1), (59, 60), (5, -1)]:
        with pytest.raises(ValueError, match="recurrent state"):
            ctx.seq_rm(0, p0, p1)
    assert ctx.stats() == before and ctx.seq_pos_max(0) == 59
    ctx.seq_cp(0, 1, -1, -1)
    x, y = _toks(3, seed=3), _toks(3, seed=4)
    gx = iswa.decode(ctx, x, [60, 61, 62], [0] * 3)
    gy = iswa.decode(ctx, y, [60, 61, 62], [1] * 3)
    close(gx, iswa.ref(toks + x)[60:], iswa.tol, "source after seq_cp")
    close(gy, iswa.ref(toks + y)[60:], iswa.tol, "copy after seq_cp")
    ctx.seq_rm(0, 0, -1)
    ctx.seq_rm(1)
    assert ctx.n_cells == 0 and ctx.seq_pos_max(0) == ctx.seq_pos_max(1) == -1
    assert all(g["blocks_held"] == 0 for g in ctx.stats()["groups"])
    assert ctx.stats()["blocks_referenced"] == base["blocks_referenced"]
    ctx.audit()


def test_hybrid_iswa_prefix_reuse_resumes_from_a_checkpoint(iswa: Tiny):
    """A second sequence sharing a 60-token prefix maps 48 tokens: the longest block boundary
    with a state checkpoint that the window group can resume at (its own cached chain keeps the
    blocks of that window); its logits are the reference's, as if it had computed them."""
    prefix, tail = _toks(60, seed=5), _toks(6, seed=6)
    ctx = iswa.model.new_context(512)
    iswa.decode(ctx, prefix + _toks(3, seed=7), list(range(63)), [0] * 63)
    ctx.seq_rm(0)
    q = prefix + tail
    n = ctx.match_prefix(1, q)
    assert n == 48 and ctx.seq_pos_max(1) == 47
    got = iswa.decode(ctx, q[n:], list(range(n, len(q))), [1] * (len(q) - n))
    close(got, iswa.ref(q)[n:], iswa.tol, "after the checkpoint")
    ctx.audit()


def test_hybrid_iswa_engine_greedy_same_with_and_without_prefix_reuse(iswa: Tiny):
    from kvserve import Engine, Model

    prompt = "the cat in the hat ran on and on, then another one sat in the sun and the " * 2
    outs = {}
    for reuse in (False, True):
        m = Model(str(iswa.path), threads=2)
        with Engine(m, parallel=4, ctx_size=512, prefix_cache=reuse) as e:
            first = e.generate(prompt, max_tokens=12)
            again = [e.generate(prompt + x, max_tokens=12) for x in (" cat", " hat")]
            outs[reuse] = (first.tokens, [r.tokens for r in again])
            cached = [r.cached_tokens for r in again]
            assert (max(cached) > 0) == reuse, cached
    assert outs[True] == outs[False]


def test_hybrid_iswa_state_past_the_window_continues_bit_for_bit(iswa: Tiny):
    """Full, window and recurrent groups in one state: a 50-token sequence (its window group
    pruned to 20 positions) written into another Model instance continues with bit-identical
    logits that match the reference. A pool with room for the K/V but not the state fails the
    write with KvCacheFull and leaves every group as it was (the staged K/V is rolled back)."""
    toks = _toks(56, seed=8)
    a = core.Model(str(iswa.path), threads=2).new_context(512)
    for i in range(0, 50, 7):
        j = min(i + 7, 50)
        iswa.decode(a, toks[i:j], list(range(i, j)), [0] * (j - i))
    data = a.seq_state_read(0)
    assert data[4:8] == (2).to_bytes(4, "little") and data[-4:] == b"KVRS"
    b = core.Model(str(iswa.path), threads=2).new_context(512)
    assert b.seq_state_write(3, data) == 50
    assert _groups(b)["window"]["tokens_stored"] == ISWA.window
    want = iswa.ref(toks)[50:]
    for i in range(50, 56):
        la = iswa.decode(a, [toks[i]], [i], [0])
        lb = iswa.decode(b, [toks[i]], [i], [3])
        assert np.array_equal(la, lb), f"position {i}"
        close(lb, want[i - 50 : i - 49], iswa.tol, f"restored at {i}")
    b.audit()

    m = core.Model(str(iswa.path), threads=2)
    c = m.new_context(4096, prefix_cache=False, memory_tokens=4096)
    free = _groups(c)["full"]["blocks_total"] - math.ceil(50 / BLOCK) - 1  # K/V fits, no state
    filler = _toks(free * BLOCK, seed=9)
    for i in range(0, len(filler), 1024):
        chunk = filler[i : i + 1024]
        c.decode(chunk, list(range(i, i + len(chunk))), [1] * len(chunk), [False] * len(chunk))
    full = _groups(c)["full"]
    assert full["blocks_free"] + full["blocks_cached"] == math.ceil(50 / BLOCK)
    before = c.stats()
    with pytest.raises(KvCacheFull):
        c.seq_state_write(0, data)
    assert c.stats() == before and c.seq_pos_max(0) == -1
    c.audit()
