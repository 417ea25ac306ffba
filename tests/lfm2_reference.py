"""Tiny random LFM2 GGUF files and an independent float64 numpy forward pass for them.

``write_model(path, spec)`` writes an ``lfm2`` model the way llama.cpp's converter lays one out
(metadata ``lfm2.attention.head_count_kv`` as one entry per layer, 0 for a short-conv layer,
``lfm2.shortconv.l_cache``; tensors ``blk.N.shortconv.{in_proj,conv,out_proj}.weight`` on conv
layers, ``blk.N.attn_{q,k,v,output,q_norm,k_norm}.weight`` on attention layers,
``blk.N.attn_norm`` / ``ffn_norm`` / ``ffn_{gate,up,down}`` on every layer and
``token_embd_norm.weight`` as the final norm) with the tiny byte-level vocabulary of
``reference.py``, and returns the float64 values the file holds.

``forward(weights, spec, tokens, positions, state)`` is the reference, written from the LFM2
definition (Hugging Face's ``Lfm2ShortConv``: ``in_proj`` -> B, C, x; ``B * x`` through a causal
depthwise conv of ``l_cache`` taps; ``C *`` the result; ``out_proj``) and not from the engine's
code. It returns the logits and the final conv states (the last ``l_cache - 1`` conv inputs of
each conv layer), and can start from given states, so that state checkpoints can be checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import reference as ref
from gguf import GGMLQuantizationType, GGUFWriter


@dataclass
class Spec:
    # One letter per layer: "C" short conv, "A" attention, "W" attention over the last
    # ``window`` positions (a sliding window: kvserve's hybrid + ISWA extension).
    layers: str = "CACA"
    window: int | None = None
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    l_cache: int = 3
    eps: float = 1e-5
    freq_base: float = 10000.0
    tied: bool = True
    wtype: str = "F32"  # matrices: "F32", "F16", "Q8_0", "Q4_0", ...
    wtypes: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    # What reference.rope_cos_sin reads.
    scaling: str | None = None
    factor: float = 1.0
    orig_ctx: int = 32

    @property
    def arch(self) -> str:
        return "lfm2"

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def hd(self) -> int:
        return self.n_embd // self.n_head

    def type_of(self, name: str) -> str:
        for key, ty in self.wtypes.items():
            if name == key or name.endswith("." + key):
                return ty
        return self.wtype

    @property
    def quantized(self) -> bool:
        return any(
            self.type_of(n) not in ("F32", "F16")
            for n in ("token_embd.weight", "ffn_up.weight", "shortconv.in_proj.weight")
        )


def write_model(path: Path | str, spec: Spec) -> dict[str, np.ndarray]:
    """Writes a random LFM2 model to ``path``; returns name -> float64 weights as stored
    (matrices as numpy ``(out, in)``, the conv kernel as ``(n_embd, l_cache)``)."""
    rng = np.random.default_rng(spec.seed)
    nv, d, hd, ff = ref.N_VOCAB, spec.n_embd, spec.hd, spec.n_ff
    kvd = spec.n_head_kv * hd
    mats: dict[str, np.ndarray] = {"token_embd.weight": rng.normal(0, 1.0, (nv, d))}
    if not spec.tied:
        mats["output.weight"] = rng.normal(0, 0.6, (nv, d))
    vecs: dict[str, np.ndarray] = {"token_embd_norm.weight": rng.uniform(0.5, 1.5, d)}
    for i, kind in enumerate(spec.layers):
        p = f"blk.{i}."
        if kind == "C":
            mats[p + "shortconv.in_proj.weight"] = rng.normal(0, 1.5 / math.sqrt(d), (3 * d, d))
            mats[p + "shortconv.out_proj.weight"] = rng.normal(0, 1.0 / math.sqrt(d), (d, d))
            # 2-D but stays F32, as llama.cpp's converter and quantizer keep it.
            vecs[p + "shortconv.conv.weight"] = rng.normal(0, 0.8, (d, spec.l_cache))
        else:
            mats[p + "attn_q.weight"] = rng.normal(0, 1.6 / math.sqrt(d), (d, d))
            mats[p + "attn_k.weight"] = rng.normal(0, 1.6 / math.sqrt(d), (kvd, d))
            mats[p + "attn_v.weight"] = rng.normal(0, 1.0 / math.sqrt(d), (kvd, d))
            mats[p + "attn_output.weight"] = rng.normal(0, 1.0 / math.sqrt(d), (d, d))
            vecs[p + "attn_q_norm.weight"] = rng.uniform(0.5, 2.0, hd)
            vecs[p + "attn_k_norm.weight"] = rng.uniform(0.5, 2.0, hd)
        mats[p + "ffn_gate.weight"] = rng.normal(0, 1.0 / math.sqrt(d), (ff, d))
        mats[p + "ffn_up.weight"] = rng.normal(0, 1.0 / math.sqrt(d), (ff, d))
        mats[p + "ffn_down.weight"] = rng.normal(0, 1.0 / math.sqrt(ff), (d, ff))
        vecs[p + "attn_norm.weight"] = rng.uniform(0.5, 1.5, d)
        vecs[p + "ffn_norm.weight"] = rng.uniform(0.5, 1.5, d)

    a = "lfm2"
    w = GGUFWriter(str(path), a)
    w.add_name("tiny-lfm2")
    w.add_uint32(f"{a}.block_count", spec.n_layer)
    w.add_uint32(f"{a}.context_length", 256)
    w.add_uint32(f"{a}.embedding_length", d)
    w.add_uint32(f"{a}.feed_forward_length", ff)
    w.add_uint32(f"{a}.attention.head_count", spec.n_head)
    w.add_array(
        f"{a}.attention.head_count_kv",
        [0 if k == "C" else spec.n_head_kv for k in spec.layers],
    )
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", spec.eps)
    w.add_float32(f"{a}.rope.freq_base", spec.freq_base)
    w.add_uint32(f"{a}.vocab_size", nv)
    w.add_uint32(f"{a}.shortconv.l_cache", spec.l_cache)
    if "W" in spec.layers:
        assert spec.window, "W layers need a window"
        w.add_uint32(f"{a}.attention.sliding_window", spec.window)
        w.add_array(f"{a}.attention.sliding_window_pattern", [k == "W" for k in spec.layers])
    tokens, merges = ref.tiny_vocab()
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [1] * len(tokens))
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_bool("tokenizer.ggml.add_bos_token", False)

    stored: dict[str, np.ndarray] = {}
    for name, arr in mats.items():
        data, back, raw = ref._stored(arr, spec.type_of(name))
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


States = dict[int, np.ndarray]  # conv layer index (in the model) -> (l_cache - 1, n_embd)


def forward(
    w: dict[str, np.ndarray],
    spec: Spec,
    tokens: list[int],
    positions: list[int] | None = None,
    state: States | None = None,
    kv_f16: bool = True,
    quant_acts: bool | None = None,
    conv_resets: list[int] | None = None,
    taps_reversed: bool = False,
) -> tuple[np.ndarray, States]:
    """(logits (len(tokens), n_vocab), final conv states) of one sequence.

    ``state``: the conv states to start from (default zeros: a new sequence). Attention sees
    the tokens of this call. For the tests' ablations: ``conv_resets`` lists token indices at
    which the convolution forgets everything before (as if the state were lost there);
    ``taps_reversed`` applies each kernel in the wrong time order. ``kv_f16`` rounds keys and
    values to f16 as the engine's cache stores them; ``quant_acts`` (default: the spec has
    quantized matrices) feeds quantized matmuls 8-bit activations as ggml does."""
    q8 = spec.quantized if quant_acts is None else quant_acts

    def mm(x: np.ndarray, name: str) -> np.ndarray:
        ty = spec.type_of(name)
        if q8 and ty in ref.KQUANTS:
            x = ref.q8k_activations(x)
        elif q8 and ty not in ("F32", "F16"):
            x = ref.q8_activations(x)
        return x @ w[name].T

    n = len(tokens)
    pos = list(range(n)) if positions is None else list(positions)
    d, hd, nh, nkv, lc = spec.n_embd, spec.hd, spec.n_head, spec.n_head_kv, spec.l_cache
    group = nh // nkv
    cs = [ref.rope_cos_sin(spec, float(p), None) for p in pos]  # type: ignore[arg-type]
    out_states: States = {}
    x = w["token_embd.weight"][np.asarray(tokens)].copy()
    for li, kind in enumerate(spec.layers):
        p = f"blk.{li}."
        h = ref._rms_norm(x, w[p + "attn_norm.weight"], spec.eps)
        if kind == "C":
            bcx = mm(h, p + "shortconv.in_proj.weight")
            b, c, xin = bcx[:, :d], bcx[:, d : 2 * d], bcx[:, 2 * d :]
            bx = b * xin
            prev = np.zeros((lc - 1, d)) if state is None else state[li]
            win = np.concatenate([prev, bx], axis=0)  # (lc - 1 + n, d), oldest first
            kern = w[p + "shortconv.conv.weight"]  # (d, lc)
            if taps_reversed:
                kern = kern[:, ::-1]
            rows = []
            for t in range(n):
                seg = win[t : t + lc].copy()  # inputs of tokens t - lc + 1 .. t
                for r in conv_resets or []:
                    if r <= t:
                        seg[: max(0, lc - 1 - (t - r))] = 0.0
                rows.append((seg * kern.T).sum(0))
            conv = np.stack(rows)
            out_states[li] = win[-(lc - 1) :].copy()
            o = mm(c * conv, p + "shortconv.out_proj.weight")
        else:
            q = mm(h, p + "attn_q.weight").reshape(n, nh, hd)
            k = mm(h, p + "attn_k.weight").reshape(n, nkv, hd)
            v = mm(h, p + "attn_v.weight").reshape(n, nkv, hd)
            q = ref._rms_norm(q, w[p + "attn_q_norm.weight"], spec.eps)
            k = ref._rms_norm(k, w[p + "attn_k_norm.weight"], spec.eps)
            q = np.stack([ref._rope(q[t], cs[t], True) for t in range(n)])
            k = np.stack([ref._rope(k[t], cs[t], True) for t in range(n)])
            if kv_f16:
                k = k.astype(np.float16).astype(np.float64)
                v = v.astype(np.float16).astype(np.float64)
            kpos = list(pos)
            att = np.zeros((n, nh, hd))
            for t in range(n):
                visible = [
                    j
                    for j in range(len(kpos))
                    if kpos[j] <= pos[t]
                    and (kind != "W" or spec.window is None or pos[t] - spec.window < kpos[j])
                ]
                for head in range(nh):
                    kh = head // group
                    s = np.array([q[t, head] @ k[j, kh] for j in visible]) / math.sqrt(hd)
                    s = np.exp(s - s.max())
                    s /= s.sum()
                    att[t, head] = s @ v[visible, kh]
            o = mm(att.reshape(n, nh * hd), p + "attn_output.weight")
        x = x + o
        h = ref._rms_norm(x, w[p + "ffn_norm.weight"], spec.eps)
        g = mm(h, p + "ffn_gate.weight")
        u = mm(h, p + "ffn_up.weight")
        x = x + mm(g / (1.0 + np.exp(-g)) * u, p + "ffn_down.weight")
    h = ref._rms_norm(x, w["token_embd_norm.weight"], spec.eps)
    return mm(h, "output.weight" if "output.weight" in w else "token_embd.weight"), out_states


# The files the tests and scripts/record_lfm2_fixtures.py write (same seeds: same bytes).
VARIANTS: dict[str, Spec] = {
    "cca-f32": Spec(layers="CCA", seed=21),
    "acac-f32-untied": Spec(layers="ACAC", tied=False, l_cache=4, seed=22),
    "ccaccaca-q8_0": Spec(layers="CCACCACA", wtype="Q8_0", tied=False, seed=23),
    "caac-q4_0": Spec(layers="CAAC", wtype="Q4_0", wtypes={"token_embd.weight": "Q8_0"}, seed=24),
}
