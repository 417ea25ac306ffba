"""The engine's forward pass against an independent float64 numpy reference (tests/reference.py)
on tiny random models of every supported architecture and RoPE variant.

Tolerances: with F32/F16 weights the only difference in kind is the KV cache, which the engine
stores in f16; against a float64 reference with exact keys/values the max abs logit difference
must stay under 2e-2 of the logit scale (max |logit|), and against a reference that rounds keys
and values to f16 too, under 1e-3 (float32 summation order only). Quantized weights (Q8_0, the
K-quants, a Q4_K_M-style mix) also mean 8-bit activations, which the reference then emulates
(and rounds K/V to f16); what remains are activations that float32 and float64 round to
neighbouring 8-bit steps, which 2 layers amplify: measured up to 1.6e-2 (Q4_K), so 5e-2. Each
variant also checks that dropping its feature from the reference (the scaling, the biases, the
q/k norms, the block layout, the separate output matrix...) moves the reference far outside the
tolerance, so a passing test really exercises the feature.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).parent))

import reference as ref  # noqa: E402

import kvserve._core as core  # noqa: E402

TEXT = "the cat in the hat ran on and on, then another one sat in the sun"

VARIANTS: dict[str, ref.Spec] = {
    "llama": ref.Spec(arch="llama", seed=1),
    "qwen2": ref.Spec(arch="qwen2", seed=2),
    "qwen3": ref.Spec(arch="qwen3", head_dim=32, seed=3),
    "llama-linear": ref.Spec(scaling="linear", factor=4.0, seed=4),
    "llama-yarn": ref.Spec(scaling="yarn", factor=4.0, orig_ctx=32, seed=5),
    "llama-rope-freqs": ref.Spec(rope_freqs=True, seed=6),
    "llama-f16-untied": ref.Spec(wtype="F16", tied=False, seed=7),
    "llama-q8_0": ref.Spec(wtype="Q8_0", tied=False, seed=8),
    # K-quants need rows of whole 256-element super-blocks.
    **{
        f"llama-{wt.lower()}": ref.Spec(wtype=wt, tied=False, n_embd=256, n_ff=512, seed=10 + i)
        for i, wt in enumerate(ref.KQUANTS)
    },
    "llama-q4_k_m": ref.Spec(
        wtype="Q4_K", wtypes=ref.Q4_K_M, tied=False, n_embd=256, n_ff=512, seed=13
    ),
    # Gemma 3: layers 0 and 2 local (window of 5 positions, RoPE base 10000), 1 and 3 global
    # (base 1e6); GQA 2:1.
    "gemma3": ref.Spec(
        arch="gemma3", n_layer=4, head_dim=32, window=5, swa_pattern=2, freq_base=1e6, seed=20
    ),
    # llama.cpp's default pattern (no key: layer 5 global, the others local), a local RoPE base
    # from the file, linear scaling on the global layer only, final logit soft-capping.
    "gemma3-pattern-softcap": ref.Spec(
        arch="gemma3",
        n_layer=7,
        head_dim=32,
        n_head_kv=1,
        window=4,
        freq_base=1e6,
        freq_base_swa=500.0,
        scaling="linear",
        factor=8.0,
        final_softcap=4.0,
        seed=21,
    ),
    # The real Gemma 3 270M Q4_K_M's mix of types: Q5_0 q/k/gate/up, Q8_0 v and embeddings
    # (tied output), Q4_K attention output, Q6_K down; one KV head of 4 query heads.
    "gemma3-q4_k_m": ref.Spec(
        arch="gemma3",
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=1,
        head_dim=64,
        n_ff=512,
        window=6,
        swa_pattern=2,
        freq_base=1e6,
        wtype="Q5_0",
        wtypes={
            "token_embd.weight": "Q8_0",
            "attn_v.weight": "Q8_0",
            "attn_output.weight": "Q4_K",
            "ffn_down.weight": "Q6_K",
        },
        seed=22,
    ),
}


def _quantized(spec: ref.Spec) -> bool:
    return any(
        spec.type_of(n) not in ("F32", "F16")
        for n in ("output.weight", "attn_q.weight", "token_embd.weight")
    )


def _tol(spec: ref.Spec) -> float:
    return 5e-2 if _quantized(spec) else 2e-2


class Tiny:
    def __init__(self, path: Path, spec: ref.Spec, weights: dict[str, np.ndarray]):
        self.path = path
        self.spec = spec
        self.w = weights
        self.model = core.Model(str(path), threads=2)

    def reference(self, tokens: list[int], positions: list[int] | None = None) -> np.ndarray:
        """The reference logits the engine is held to (see the module docs)."""
        q = _quantized(self.spec)
        return ref.forward(self.w, self.spec, tokens, positions, kv_f16=q, quant_acts=q)

    def decode(
        self, ctx: core.Context, tokens: list[int], positions: list[int], seqs: list[int]
    ) -> np.ndarray:
        n = len(tokens)
        out = ctx.decode(tokens, positions, seqs, [True] * n)
        assert out.n_rows == n and out.n_vocab == self.model.n_vocab
        return np.frombuffer(out, dtype=np.float32).reshape(n, out.n_vocab).astype(np.float64)


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def tiny(request, tmp_path_factory) -> Tiny:
    name = request.param
    spec = VARIANTS[name]
    path = tmp_path_factory.mktemp("tiny") / f"{name}.gguf"
    weights = ref.write_model(path, spec)
    return Tiny(path, spec, weights)


def _rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _check_close(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite logits"
    d = _rel_diff(got, want)
    assert d < tol, f"{what}: max |diff| / max |logit| = {d:.3g} >= {tol}"
    # Argmax must agree wherever the reference's top two are clearly apart.
    scale = np.abs(want).max()
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 4 * tol * scale
    bad = np.nonzero(clear & (got.argmax(1) != want.argmax(1)))[0]
    assert bad.size == 0, f"{what}: argmax differs at rows {bad.tolist()}"


def _prompt(t: Tiny) -> list[int]:
    toks = t.model.tokenize(TEXT, add_special=False)
    assert len(toks) >= 20
    return toks[:24]


def test_model_attributes(tiny: Tiny):
    m, s = tiny.model, tiny.spec
    assert m.arch == s.arch
    assert (m.n_layer, m.n_embd, m.n_vocab) == (s.n_layer, s.n_embd, ref.N_VOCAB)
    # The tiny vocabulary's merges apply: "the" is one token.
    assert m.tokenize(" the", add_special=False) == [ref.N_VOCAB - 6]
    # Every matrix has the type the variant asks for (read back with gguf).
    types = {t.name: t.tensor_type.name for t in GGUFReader(tiny.path).tensors if len(t.shape) == 2}
    assert types == {name: s.type_of(name) for name in types}


def test_prompt_logits_every_position(tiny: Tiny):
    toks = _prompt(tiny)
    n = len(toks)
    ctx = tiny.model.new_context(64)
    got = tiny.decode(ctx, toks, list(range(n)), [0] * n)
    want = tiny.reference(toks)
    _check_close(got, want, _tol(tiny.spec), "prompt vs reference")
    if not _quantized(tiny.spec):
        want16 = ref.forward(tiny.w, tiny.spec, toks, kv_f16=True)
        _check_close(got, want16, 1e-3, "prompt vs reference with an f16 KV cache")


def test_incremental_decoding(tiny: Tiny):
    toks = _prompt(tiny)
    n, k = len(toks), 6
    ctx = tiny.model.new_context(64)
    rows = [tiny.decode(ctx, toks[:k], list(range(k)), [0] * k)]
    for i in range(k, n):
        rows.append(tiny.decode(ctx, [toks[i]], [i], [0]))
    assert ctx.seq_pos_max(0) == n - 1
    got = np.concatenate(rows)
    want = tiny.reference(toks)
    _check_close(got, want, _tol(tiny.spec), "incremental decoding vs reference")


def test_far_positions(tiny: Tiny):
    """A sequence that starts at position 100 (past YaRN's original context of 32)."""
    toks = _prompt(tiny)[:12]
    pos = list(range(100, 112))
    ctx = tiny.model.new_context(64)
    got = tiny.decode(ctx, toks, pos, [0] * len(toks))
    want = tiny.reference(toks, pos)
    _check_close(got, want, _tol(tiny.spec), "positions 100..111 vs reference")


def _ablated(spec: ref.Spec, w: dict[str, np.ndarray]) -> tuple[ref.Spec, dict[str, np.ndarray]]:
    """The reference model without the feature the variant exists to test."""
    w = dict(w)
    if spec.arch == "gemma3":
        # The sliding window: every layer global. (The block formats of its quantized mix are
        # each held to the emulation in test_quantized_matmul_matches_8bit_activation_emulation;
        # through gemma's post-norms the reversed-block ablation moves the logits only ~2.5x
        # the tolerance.)
        return dataclasses.replace(spec, window=None), w
    if _quantized(spec):
        # The block format: values unpacked in the wrong order inside each 32-element group
        # (as a swapped nibble or sub-block layout would), every quantized matrix.
        for name, arr in w.items():
            if arr.ndim == 2 and spec.type_of(name) not in ("F32", "F16"):
                w[name] = arr.reshape(arr.shape[0], -1, 32)[..., ::-1].reshape(arr.shape)
        return spec, w
    if not spec.tied:
        # The separate output matrix: the embedding used as output instead.
        del w["output.weight"]
        return spec, w
    if spec.scaling is not None:
        return dataclasses.replace(spec, scaling=None, factor=1.0), w
    if spec.rope_freqs:
        del w["rope_freqs.weight"]
        return spec, w
    if spec.arch == "qwen2":
        return spec, {k: v for k, v in w.items() if not k.endswith(".bias")}
    if spec.arch == "qwen3":
        return spec, {
            k: v
            for k, v in w.items()
            if not k.endswith(("attn_q_norm.weight", "attn_k_norm.weight"))
        }
    # llama: the other RoPE layout (NeoX instead of adjacent pairs).
    return dataclasses.replace(spec, arch="qwen2"), w


def test_variant_feature_matters(tiny: Tiny):
    """The reference without the variant's feature must be far from the engine's logits, so
    that the agreement in the other tests is evidence the feature is implemented right."""
    toks = _prompt(tiny)
    pos = list(range(20, 20 + len(toks)))
    ctx = tiny.model.new_context(64)
    got = tiny.decode(ctx, toks, pos, [0] * len(toks))
    spec2, w2 = _ablated(tiny.spec, tiny.w)
    wrong = ref.forward(w2, spec2, toks, pos)
    d = _rel_diff(got, wrong)
    assert d > 3 * _tol(tiny.spec), f"ablated reference is only {d:.3g} away: test is too weak"


def test_two_sequences_in_one_batch_equal_each_alone(tiny: Tiny):
    toks = _prompt(tiny)
    a, b = toks[:9], toks[9:16]
    # Alone.
    ctx = tiny.model.new_context(64)
    alone_a = tiny.decode(ctx, a, list(range(len(a))), [0] * len(a))
    ctx.clear()
    alone_b = tiny.decode(ctx, b, list(range(len(b))), [1] * len(b))
    # Interleaved in one batch.
    order = [(0, i) for i in range(len(a))] + [(1, i) for i in range(len(b))]
    order.sort(key=lambda si: (si[1], si[0]))
    ctx2 = tiny.model.new_context(64)
    tokens = [(a, b)[s][i] for s, i in order]
    got = tiny.decode(ctx2, tokens, [i for _, i in order], [s for s, _ in order])
    got_a = got[[j for j, (s, _) in enumerate(order) if s == 0]]
    got_b = got[[j for j, (s, _) in enumerate(order) if s == 1]]
    _check_close(got_a, alone_a, 1e-4, "seq 0 batched vs alone")
    _check_close(got_b, alone_b, 1e-4, "seq 1 batched vs alone")
    tol = _tol(tiny.spec)
    _check_close(got_a, tiny.reference(a), tol, "seq 0 vs reference")
    _check_close(got_b, tiny.reference(b), tol, "seq 1 vs reference")
    assert (ctx2.seq_pos_max(0), ctx2.seq_pos_max(1)) == (len(a) - 1, len(b) - 1)


def test_batch_mixing_a_new_sequence_with_a_running_one(tiny: Tiny):
    """Seq 0 has positions 0..9 cached; one batch carries seq 0's token at position 10 and
    seq 1's first five tokens at positions 0..4."""
    toks = _prompt(tiny)
    a, b = toks[:11], toks[11:16]
    ctx = tiny.model.new_context(64)
    first = tiny.decode(ctx, a[:10], list(range(10)), [0] * 10)
    got = tiny.decode(ctx, [a[10]] + b, [10] + list(range(5)), [0] + [1] * 5)
    tol = _tol(tiny.spec)
    want_a = tiny.reference(a)
    _check_close(np.concatenate([first, got[:1]]), want_a, tol, "seq 0 vs reference")
    _check_close(got[1:], tiny.reference(b), tol, "seq 1 vs reference")
    assert ctx.n_cells == 16
    assert (ctx.seq_pos_max(0), ctx.seq_pos_max(1)) == (10, 4)


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *ref.KQUANTS])
def test_quantized_matmul_matches_8bit_activation_emulation(tmp_path, wtype: str):
    """With every block a no-op the logits are a single quantized matmul; against a float64
    emulation of it (dequantized weights times 8-bit quantized activations: blocks of 32, or
    Q8_K blocks of 256 for K-quants) only float32 summation order remains, for a batch and for
    single tokens."""
    width = 256 if wtype in ref.KQUANTS else 64
    spec = ref.Spec(wtype=wtype, tied=False, branch_scale=0.0, n_embd=width, n_ff=width, seed=9)
    w = ref.write_model(tmp_path / "m.gguf", spec)
    t = Tiny(tmp_path / "m.gguf", spec, w)
    toks = list(range(0, ref.N_VOCAB, 5))
    want = ref.matmul_only_logits(w, spec, toks)
    ctx = t.model.new_context(128)
    batch = t.decode(ctx, toks, list(range(len(toks))), [0] * len(toks))
    ctx.clear()
    single = np.concatenate([t.decode(ctx, [tok], [i], [0]) for i, tok in enumerate(toks)])
    _check_close(batch, want, 1e-5, f"{wtype} batch matmul vs emulation")
    _check_close(single, want, 1e-5, f"{wtype} single-token matmul vs emulation")
    # Without the activation quantization the difference is orders of magnitude larger.
    exact = ref.forward(w, spec, toks)
    assert _rel_diff(batch, exact) > 1e-3


GEMMA_ABLATIONS = {
    "no window": lambda s, w: (dataclasses.replace(s, window=None), w),
    "local layers with the global RoPE": lambda s, w: (
        dataclasses.replace(s, freq_base_swa=s.freq_base),
        w,
    ),
    "no post-attention / post-FFN norms": lambda s, w: (
        s,
        {
            k: (
                np.ones_like(v)
                if k.endswith(("post_attention_norm.weight", "post_ffw_norm.weight"))
                else v
            )
            for k, v in w.items()
        },
    ),
    "unscaled embeddings": lambda s, w: (
        s,
        {
            **w,
            "token_embd.weight": w["token_embd.weight"] / np.sqrt(s.n_embd),
            **({} if "output.weight" in w else {"output.weight": w["token_embd.weight"]}),
        },
    ),
}


@pytest.mark.parametrize("variant", ["gemma3", "gemma3-pattern-softcap"])
@pytest.mark.parametrize("ablation", list(GEMMA_ABLATIONS))
def test_gemma3_features_matter(tmp_path, variant: str, ablation: str):
    """Each Gemma 3 feature moves the logits far outside the tolerance when the reference drops
    it, on a prompt four windows long, so agreement with the full reference tests all of them."""
    spec = VARIANTS[variant]
    w = ref.write_model(tmp_path / "g.gguf", spec)
    t = Tiny(tmp_path / "g.gguf", spec, w)
    toks = _prompt(t)[:20]
    got = t.decode(t.model.new_context(64), toks, list(range(len(toks))), [0] * len(toks))
    _check_close(got, t.reference(toks), _tol(spec), "vs reference")
    spec2, w2 = GEMMA_ABLATIONS[ablation](spec, w)
    d = _rel_diff(got, ref.forward(w2, spec2, toks))
    assert d > 3 * _tol(spec), f"{ablation}: ablated reference only {d:.3g} away"


def test_gemma3_softcap_bounds_logits(tmp_path):
    spec = VARIANTS["gemma3-pattern-softcap"]
    w = ref.write_model(tmp_path / "g.gguf", spec)
    t = Tiny(tmp_path / "g.gguf", spec, w)
    toks = _prompt(t)[:8]
    got = t.decode(t.model.new_context(64), toks, list(range(8)), [0] * 8)
    assert np.abs(got).max() <= spec.final_softcap
    uncapped = ref.forward(w, dataclasses.replace(spec, final_softcap=None), toks)
    assert np.abs(uncapped).max() > 1.5 * spec.final_softcap, "soft-capping would not show"
