"""Tiny random GGUF models and an independent float64 numpy forward pass for them.

``write_model(path, spec)`` writes a llama/qwen2/qwen3/gemma3 model with random weights (plus a tiny
gpt2-style byte-level vocabulary so the engine accepts it) and returns the weights it wrote, as
float64 arrays of the values the file really holds (after F16 rounding or quantization, read
back with ``gguf``'s dequantization). Legacy types are quantized by ``gguf.quants``; K-quants
(Q4_K, Q5_K, Q6_K), which it cannot write, by the small numpy quantizers below: they only need
to produce valid blocks close to the input, since the oracle is what ``gguf`` dequantizes.
``forward(weights, spec, tokens, positions)`` is the reference: RMSNorm, RoPE as ggml computes it
(normal or NeoX layout, linear / YaRN scaling, per-pair frequency factors), grouped-query causal
attention, SwiGLU, tied or separate output; for gemma3 (after llama.cpp's reading of Gemma 3
GGUF files and the Gemma 3 paper) embeddings scaled by sqrt(n_embd), norms after attention and
after the FFN, q/k norms, GELU (tanh) gating, local layers with a sliding window and their own
RoPE base, final logit soft-capping. It is written from the model definitions, not from
the engine's code; its only shared assumption is that positions, not batch order, define causality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize


@dataclass
class Spec:
    arch: str = "llama"
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_layer: int = 2
    n_ff: int = 128
    head_dim: int | None = None  # None: n_embd / n_head (no key_length key written)
    eps: float = 1e-5
    freq_base: float = 10000.0
    scaling: str | None = None  # None | "linear" | "yarn"
    factor: float = 1.0
    orig_ctx: int = 32
    rope_freqs: bool = False
    tied: bool = True
    # "F32" | "F16" | "Q8_0" | "Q4_0" | "Q4_1" | "Q5_0" | "Q5_1" | "Q4_K" | "Q5_K" | "Q6_K"
    wtype: str = "F32"
    # Per-tensor types overriding wtype, keyed by name or by the name within a layer
    # ("attn_v.weight" matches blk.<i>.attn_v.weight), as in llama.cpp's mixed files; see Q4_K_M.
    wtypes: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    # Multiplies attn_output and ffn_down: 0 makes every block a no-op, so the logits are one
    # matmul, rms_norm(token_embd[t]) @ output^T, which isolates the matmul kernels.
    branch_scale: float = 1.0
    # Tensors to store as zero blocks of another ggml type (to exercise unsupported types).
    raw_types: dict[str, str] = field(default_factory=dict)
    # gemma3: sliding window of local layers (None: no window key, every layer global), the
    # pattern key (None: not written, llama.cpp's default 6: every 6th layer global), the local
    # RoPE base key (None: not written, default 10000) and final logit soft-capping.
    window: int | None = None
    swa_pattern: int | None = None
    freq_base_swa: float | None = None
    final_softcap: float | None = None

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def neox(self) -> bool:
        return self.arch in ("qwen2", "qwen3", "gemma3")

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` attends over the sliding window (llama.cpp's rule: with pattern n,
        layer i is local iff i % n < n - 1)."""
        if self.arch != "gemma3" or not self.window:
            return False
        n = 6 if self.swa_pattern is None else self.swa_pattern
        return n == 0 or layer % n < n - 1

    def type_of(self, name: str) -> str:
        """The weight type of matrix ``name``."""
        for key, ty in self.wtypes.items():
            if name == key or name.endswith("." + key):
                return ty
        return self.wtype


# A Q4_K_M-style mix (after llama.cpp's choices): Q4_K by default, Q6_K for the output and the
# value / down projections, plus a Q5_K and a legacy Q5_0 matrix (llama.cpp's fallback for
# tensors a K-quant does not fit), so that one forward pass needs both activation formats.
Q4_K_M = {
    "output.weight": "Q6_K",
    "attn_v.weight": "Q6_K",
    "ffn_down.weight": "Q6_K",
    "attn_output.weight": "Q5_K",
    "attn_k.weight": "Q5_0",
}
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
QK_K = 256


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, indexed by byte value."""
    keep = list(range(ord("!"), ord("~") + 1))
    keep += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


MERGES = ["t h", "th e", "Ġ the", "i n", "a n", "e r", "o n", "Ġ a"]


def tiny_vocab() -> tuple[list[str], list[str]]:
    """(tokens, merges): the 256 byte characters in byte order, then one token per merge."""
    tokens = _bytes_to_unicode()
    for m in MERGES:
        a, b = m.split(" ")
        tokens.append(a + b)
    assert len(set(tokens)) == len(tokens)
    return tokens, list(MERGES)


N_VOCAB = len(tiny_vocab()[0])


# ---------------------------------------------------------------------------------------------
# Writing


def _pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and mins -> the 12 packed bytes of Q4_K/Q5_K: bytes 0-3 hold scales
    0-3, bytes 4-7 mins 0-3 (low 6 bits each), bytes 8-11 the low nibbles of scales / mins
    4-7; the top two bits of bytes 0-7 hold the high bits of scales / mins 4-7."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _quantize_q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits=4) or Q5_K (bits=5) blocks for ``x`` (n_blocks, 256): per 32-element
    sub-block a 6-bit scale and min under f16 super-block factors, weight = d*sc*q - dmin*m."""
    nb = x.shape[0]
    top = (1 << bits) - 1
    sub = x.reshape(nb, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / top
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63)
    step = (df * sc)[..., None]
    shifted = sub + (dminf * mn)[..., None]
    q = np.divide(shifted, step, out=np.zeros_like(sub), where=step > 0)
    q = np.clip(np.round(q), 0, top).astype(np.uint8)  # (nb, 8, 32)
    # Nibbles: byte l of 32-byte chunk j holds sub-block 2j (low) and 2j+1 (high).
    qs = (q[:, 0::2, :] & 0x0F) | ((q[:, 1::2, :] & 0x0F) << 4)
    parts = [
        d.view(np.uint8).reshape(nb, 2),
        dmin.view(np.uint8).reshape(nb, 2),
        _pack_scales_mins(sc.astype(np.uint8), mn.astype(np.uint8)),
    ]
    if bits == 5:
        # Bit i of qh[l]: the fifth bit of element l of sub-block i.
        high = (q >> 4) & 1
        parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8))
    parts.append(qs.reshape(nb, 128))
    return np.concatenate(parts, axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks for ``x`` (n_blocks, 256): an int8 scale per 16 elements under an f16 factor,
    weight = d*sc*(q-32) with q in 0..63."""
    nb = x.shape[0]
    grp = x.reshape(nb, 16, 16).astype(np.float32)
    scale = np.abs(grp).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 127)
    step = (df * sc)[..., None]
    q = np.divide(grp, step, out=np.zeros_like(grp), where=step > 0)
    q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)
    # 128-element half h, row k of 32: low nibbles in ql[64h + 32(k%2) + l] (low half of the
    # byte for k < 2, high half for k >= 2); the two high bits at bits 2k of qh[32h + l].
    lo = q & 0x0F
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], -1)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(
        2, dtype=np.uint8
    )
    parts = [
        ql.reshape(nb, 128),
        qh.reshape(nb, 64),
        sc.astype(np.int8).view(np.uint8),
        d.view(np.uint8).reshape(nb, 2),
    ]
    return np.concatenate(parts, axis=1)


def quantize_k(a32: np.ndarray, wtype: str) -> np.ndarray:
    """``a32`` (rows, cols), cols a multiple of 256, as the bytes of K-quant ``wtype`` blocks,
    shaped (rows, row bytes) as GGUFWriter takes raw quantized data."""
    rows, cols = a32.shape
    blocks = a32.reshape(rows * cols // QK_K, QK_K)
    if wtype == "Q6_K":
        raw = _quantize_q6_k(blocks)
    else:
        raw = _quantize_q45_k(blocks, 4 if wtype == "Q4_K" else 5)
    qt = GGMLQuantizationType[wtype]
    assert raw.shape[1] == GGML_QUANT_SIZES[qt][1]
    return raw.reshape(rows, -1)


def _stored(arr: np.ndarray, wtype: str) -> tuple[np.ndarray, np.ndarray, GGMLQuantizationType]:
    """(array to hand GGUFWriter, float64 values the file holds, raw dtype)."""
    a32 = np.ascontiguousarray(arr, dtype=np.float32)
    if wtype == "F32":
        return a32, a32.astype(np.float64), GGMLQuantizationType.F32
    if wtype == "F16":
        a16 = a32.astype(np.float16)
        return a16, a16.astype(np.float64), GGMLQuantizationType.F16
    if wtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        qt = GGMLQuantizationType[wtype]
        q = quantize(a32, qt)
        back = dequantize(q, qt).reshape(a32.shape)
        return q, back.astype(np.float64), qt
    if wtype in KQUANTS:
        qt = GGMLQuantizationType[wtype]
        q = quantize_k(a32, wtype)
        back = dequantize(q, qt).reshape(a32.shape)
        return q, back.astype(np.float64), qt
    raise ValueError(f"unsupported weight type {wtype}")


def tokenizer_fields(path: Path | str) -> list[tuple[str, Any, Any, Any]]:
    """The ``tokenizer.*`` metadata of the GGUF file at ``path`` as (key, value, value type,
    array element type) for :func:`write_model`'s ``tokenizer``: a tiny random body can then
    carry a real model's vocabulary (and chat template)."""
    from gguf import GGUFReader, GGUFValueType

    out = []
    for key, f in GGUFReader(path).fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        out.append((key, f.contents(), vtype, sub))
    return out


def write_model(
    path: Path | str,
    spec: Spec,
    tokenizer: list[tuple[str, Any, Any, Any]] | None = None,
) -> dict[str, np.ndarray]:
    """Writes a random model to ``path``; returns name -> float64 weights as stored.

    Matrices are numpy ``(out_features, in_features)`` (ggml dims ``[in, out]``).
    ``tokenizer``: the ``tokenizer.*`` keys to write instead of the tiny vocabulary (see
    :func:`tokenizer_fields`); the vocabulary's size sets the embedding's rows.
    """
    rng = np.random.default_rng(spec.seed)
    nv = N_VOCAB
    if tokenizer is not None:
        nv = next(len(v) for k, v, _t, _s in tokenizer if k == "tokenizer.ggml.tokens")
    d, hd, ff = spec.n_embd, spec.hd, spec.n_ff
    qd, kvd = spec.n_head * hd, spec.n_head_kv * hd
    # Scales chosen so attention is peaked (scores of a few units) and logits spread out.
    # Gemma scales embeddings by sqrt(n_embd); its trained embeddings are that much smaller, so
    # that the (post-normed) blocks' outputs weigh as much as the embedding in the residual.
    embd_std = 2.0 / math.sqrt(d) if spec.arch == "gemma3" else 1.0
    mats: dict[str, np.ndarray] = {"token_embd.weight": rng.normal(0, embd_std, (nv, d))}
    if not spec.tied:
        mats["output.weight"] = rng.normal(0, 0.6, (nv, d))
    vecs: dict[str, np.ndarray] = {"output_norm.weight": rng.uniform(0.5, 1.5, d)}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        mats[p + "attn_q.weight"] = rng.normal(0, 1.6 / math.sqrt(d), (qd, d))
        mats[p + "attn_k.weight"] = rng.normal(0, 1.6 / math.sqrt(d), (kvd, d))
        mats[p + "attn_v.weight"] = rng.normal(0, 1.0 / math.sqrt(d), (kvd, d))
        mats[p + "attn_output.weight"] = (
            rng.normal(0, 1.0 / math.sqrt(qd), (d, qd)) * spec.branch_scale
        )
        mats[p + "ffn_gate.weight"] = rng.normal(0, 1.0 / math.sqrt(d), (ff, d))
        mats[p + "ffn_up.weight"] = rng.normal(0, 1.0 / math.sqrt(d), (ff, d))
        mats[p + "ffn_down.weight"] = (
            rng.normal(0, 1.0 / math.sqrt(ff), (d, ff)) * spec.branch_scale
        )
        vecs[p + "attn_norm.weight"] = rng.uniform(0.5, 1.5, d)
        vecs[p + "ffn_norm.weight"] = rng.uniform(0.5, 1.5, d)
        if spec.arch == "qwen2":
            vecs[p + "attn_q.bias"] = rng.normal(0, 0.5, qd)
            vecs[p + "attn_k.bias"] = rng.normal(0, 0.5, kvd)
            vecs[p + "attn_v.bias"] = rng.normal(0, 0.5, kvd)
        if spec.arch in ("qwen3", "gemma3"):
            vecs[p + "attn_q_norm.weight"] = rng.uniform(0.5, 2.0, hd)
            vecs[p + "attn_k_norm.weight"] = rng.uniform(0.5, 2.0, hd)
        if spec.arch == "gemma3":
            vecs[p + "post_attention_norm.weight"] = rng.uniform(0.5, 1.5, d)
            vecs[p + "post_ffw_norm.weight"] = rng.uniform(0.5, 1.5, d)
    if spec.rope_freqs:
        vecs["rope_freqs.weight"] = rng.uniform(1.0, 8.0, hd // 2)

    a = spec.arch
    w = GGUFWriter(str(path), a)
    w.add_name(f"tiny-{a}")
    w.add_uint32(f"{a}.block_count", spec.n_layer)
    w.add_uint32(f"{a}.context_length", 256)
    w.add_uint32(f"{a}.embedding_length", d)
    w.add_uint32(f"{a}.feed_forward_length", ff)
    w.add_uint32(f"{a}.attention.head_count", spec.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", spec.n_head_kv)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", spec.eps)
    w.add_float32(f"{a}.rope.freq_base", spec.freq_base)
    w.add_uint32(f"{a}.rope.dimension_count", hd)
    if spec.head_dim is not None:
        w.add_uint32(f"{a}.attention.key_length", hd)
        w.add_uint32(f"{a}.attention.value_length", hd)
    if spec.scaling is not None:
        w.add_string(f"{a}.rope.scaling.type", spec.scaling)
        w.add_float32(f"{a}.rope.scaling.factor", spec.factor)
        if spec.scaling == "yarn":
            w.add_uint32(f"{a}.rope.scaling.original_context_length", spec.orig_ctx)
    if spec.window is not None:
        w.add_uint32(f"{a}.attention.sliding_window", spec.window)
    if spec.swa_pattern is not None:
        w.add_uint32(f"{a}.attention.sliding_window_pattern", spec.swa_pattern)
    if spec.freq_base_swa is not None:
        w.add_float32(f"{a}.rope.freq_base_swa", spec.freq_base_swa)
    if spec.final_softcap is not None:
        w.add_float32(f"{a}.final_logit_softcapping", spec.final_softcap)
    if tokenizer is not None:
        for key, value, vtype, sub in tokenizer:
            w.add_key_value(key, value, vtype, sub_type=sub)
    else:
        tokens, merges = tiny_vocab()
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_string("tokenizer.ggml.pre", "default")
        w.add_array("tokenizer.ggml.tokens", tokens)
        w.add_array("tokenizer.ggml.token_type", [1] * len(tokens))
        w.add_array("tokenizer.ggml.merges", merges)

    stored: dict[str, np.ndarray] = {}
    for name, arr in mats.items():
        if name in spec.raw_types:
            qt = GGMLQuantizationType[spec.raw_types[name]]
            block, size = GGML_QUANT_SIZES[qt]
            zeros = np.zeros((arr.shape[0], arr.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, zeros, raw_dtype=qt)
            continue
        data, back, raw = _stored(arr, spec.type_of(name))
        stored[name] = back
        w.add_tensor(name, data, raw_dtype=raw if raw != GGMLQuantizationType.F32 else None)
    for name, arr in vecs.items():
        a32 = np.ascontiguousarray(arr, dtype=np.float32)
        stored[name] = a32.astype(np.float64)
        w.add_tensor(name, a32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


# ---------------------------------------------------------------------------------------------
# Reference forward pass


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_cos_sin(spec: Spec, pos: float, freq_factors: np.ndarray | None) -> np.ndarray:
    """(n_rot/2, 2) array of (cos, sin) for each rotated pair at ``pos``, as ggml defines them.

    Pair i has base angle ``pos * base^(-2i/n_rot) / ff_i``. Linear scaling divides it by the
    factor. YaRN mixes the divided ("interpolated") and undivided ("extrapolated") angle with a
    ramp over pair indices between the correction dims for beta_fast=32 / beta_slow=1, and
    scales cos and sin by ``1 + 0.1 ln(factor)``.
    """
    n_rot = spec.hd
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    theta_extrap = pos * spec.freq_base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        theta_extrap = theta_extrap / freq_factors
    mscale = 1.0
    if spec.scaling == "linear":
        theta = theta_extrap / spec.factor
    elif spec.scaling == "yarn":

        def corr_dim(beta: float) -> float:
            return (
                n_rot
                * math.log(spec.orig_ctx / (beta * 2 * math.pi))
                / (2 * math.log(spec.freq_base))
            )

        low = max(0.0, math.floor(corr_dim(32.0)))
        high = min(n_rot - 1.0, math.ceil(corr_dim(1.0)))
        y = (i - low) / max(0.001, high - low)
        mix = 1.0 - np.clip(y, 0.0, 1.0)  # 1: keep the original angle, 0: interpolate
        theta_interp = theta_extrap / spec.factor
        theta = theta_interp * (1.0 - mix) + theta_extrap * mix
        mscale = 1.0 + 0.1 * math.log(spec.factor)
    else:
        theta = theta_extrap
    return np.stack([np.cos(theta) * mscale, np.sin(theta) * mscale], axis=1)


def _rope(x: np.ndarray, cs: np.ndarray, neox: bool) -> np.ndarray:
    """Rotates every head of ``x`` (..., head_dim) by the (half, 2) angles ``cs``."""
    half = cs.shape[0]
    c, s = cs[:, 0], cs[:, 1]
    y = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half : 2 * half]
        y[..., :half] = a * c - b * s
        y[..., half : 2 * half] = a * s + b * c
    else:
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        y[..., 0 : 2 * half : 2] = a * c - b * s
        y[..., 1 : 2 * half : 2] = a * s + b * c
    return y


def forward(
    w: dict[str, np.ndarray],
    spec: Spec,
    tokens: list[int],
    positions: list[int] | None = None,
    kv_f16: bool = False,
    quant_acts: bool = False,
) -> np.ndarray:
    """Logits (len(tokens), n_vocab) of one sequence, every token attending to the tokens whose
    position is <= its own. ``kv_f16`` rounds keys and values to f16 as a KV cache would;
    ``quant_acts`` feeds every matmul with quantized weights 8-bit activations as ggml does
    (:func:`q8_activations`, or :func:`q8k_activations` for K-quant weights)."""

    def mm(x: np.ndarray, name: str) -> np.ndarray:
        ty = spec.type_of(name)
        if quant_acts and ty in KQUANTS:
            x = q8k_activations(x)
        elif quant_acts and ty not in ("F32", "F16"):
            x = q8_activations(x)
        return x @ w[name].T

    n = len(tokens)
    pos = list(range(n)) if positions is None else list(positions)
    hd, nh, nkv = spec.hd, spec.n_head, spec.n_head_kv
    group = nh // nkv
    gemma = spec.arch == "gemma3"
    ff = w.get("rope_freqs.weight")
    cs_global = [rope_cos_sin(spec, float(p), ff) for p in pos]
    # Local layers: their own base (10000 unless the file says), never scaled.
    local = replace(spec, freq_base=spec.freq_base_swa or 10000.0, scaling=None, factor=1.0)
    cs_local = [rope_cos_sin(local, float(p), ff) for p in pos]
    x = w["token_embd.weight"][np.asarray(tokens)].copy()
    if gemma:
        x = x * math.sqrt(spec.n_embd)
    for li in range(spec.n_layer):
        p = f"blk.{li}."
        window = spec.window if spec.is_local(li) else None
        cs = cs_local if window else cs_global
        h = _rms_norm(x, w[p + "attn_norm.weight"], spec.eps)
        q = mm(h, p + "attn_q.weight")
        k = mm(h, p + "attn_k.weight")
        v = mm(h, p + "attn_v.weight")
        if p + "attn_q.bias" in w:
            q = q + w[p + "attn_q.bias"]
            k = k + w[p + "attn_k.bias"]
            v = v + w[p + "attn_v.bias"]
        q = q.reshape(n, nh, hd)
        k = k.reshape(n, nkv, hd)
        v = v.reshape(n, nkv, hd)
        if p + "attn_q_norm.weight" in w:
            q = _rms_norm(q, w[p + "attn_q_norm.weight"], spec.eps)
            k = _rms_norm(k, w[p + "attn_k_norm.weight"], spec.eps)
        q = np.stack([_rope(q[t], cs[t], spec.neox) for t in range(n)])
        k = np.stack([_rope(k[t], cs[t], spec.neox) for t in range(n)])
        if kv_f16:
            k = k.astype(np.float16).astype(np.float64)
            v = v.astype(np.float16).astype(np.float64)
        att = np.zeros((n, nh, hd))
        for t in range(n):
            visible = [
                j
                for j in range(n)
                if pos[j] <= pos[t] and (window is None or pos[t] - pos[j] < window)
            ]
            for head in range(nh):
                kh = head // group
                s = np.array([q[t, head] @ k[j, kh] for j in visible]) / math.sqrt(hd)
                s = np.exp(s - s.max())
                s /= s.sum()
                att[t, head] = s @ v[visible, kh]
        o = mm(att.reshape(n, nh * hd), p + "attn_output.weight")
        if gemma:
            o = _rms_norm(o, w[p + "post_attention_norm.weight"], spec.eps)
        x = x + o
        h = _rms_norm(x, w[p + "ffn_norm.weight"], spec.eps)
        g = mm(h, p + "ffn_gate.weight")
        u = mm(h, p + "ffn_up.weight")
        act = gelu_tanh(g) if gemma else g / (1.0 + np.exp(-g))
        down = mm(act * u, p + "ffn_down.weight")
        if gemma:
            down = _rms_norm(down, w[p + "post_ffw_norm.weight"], spec.eps)
        x = x + down
    h = _rms_norm(x, w["output_norm.weight"], spec.eps)
    logits = mm(h, "output.weight" if "output.weight" in w else "token_embd.weight")
    if gemma and spec.final_softcap:
        logits = spec.final_softcap * np.tanh(logits / spec.final_softcap)
    return logits


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def q8_activations(h: np.ndarray) -> np.ndarray:
    """``h`` (n, k) as the engine feeds it to a quantized matmul: per block of 32, scale
    ``d = max|x| / 127`` and ``round(x / d)`` in float32 (the rule of ggml's q8_0 / q8_1)."""
    n, k = h.shape
    hb = h.reshape(n, k // 32, 32).astype(np.float32)
    d = (np.abs(hb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    return (np.round(hb * inv) * d).reshape(n, k).astype(np.float64)


def q8k_activations(h: np.ndarray) -> np.ndarray:
    """``h`` (n, k) as the engine feeds it to a K-quant matmul (ggml's Q8_K): per block of 256,
    the first element of largest magnitude ``m`` gives ``iscale = -127 / m``; the quants are
    ``round(iscale * x)`` (ties to even, at most 127) in float32 and the scale ``1 / iscale``."""
    n, k = h.shape
    hb = h.reshape(n, k // QK_K, QK_K).astype(np.float32)
    first = np.abs(hb).argmax(-1)[..., None]
    m = np.take_along_axis(hb, first, -1)
    iscale = np.divide(np.float32(-127), m, out=np.zeros_like(m), where=m != 0)
    q = np.minimum(np.round(iscale * hb), 127)
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
    return (q * d).reshape(n, k).astype(np.float64)


def matmul_only_logits(w: dict[str, np.ndarray], spec: Spec, tokens: list[int]) -> np.ndarray:
    """Logits of a ``branch_scale=0`` model with quantized weights: one matmul of the 8-bit
    quantized final-normed embeddings (blocks of 32, or Q8_K blocks of 256 for K-quant output
    weights) with the output matrix, in float64."""
    assert spec.branch_scale == 0.0
    h = _rms_norm(w["token_embd.weight"][np.asarray(tokens)], w["output_norm.weight"], spec.eps)
    name = "token_embd.weight" if spec.tied else "output.weight"
    acts = q8k_activations(h) if spec.type_of(name) in KQUANTS else q8_activations(h)
    return acts @ w[name].T
