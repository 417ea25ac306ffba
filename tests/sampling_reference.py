"""A plain reference of the sampling chain (tests only), written from the definitions with
explicit loops and Python floats rather than from kvserve.sampling's vectorized code:

- logit bias: added per listed token;
- penalties: the window is the last ``last_n`` tokens of the history (0: none, -1: all); for
  each distinct token of the window, counted by hand, llama.cpp's repeat penalty (a positive
  logit divided, a non-positive one multiplied), then ``- (presence + frequency * count)``;
- temperature, then top-k (ties at the k-th value kept), typical-p (rank by |-log p - H|,
  accumulate until the mass passes p), top-p (most probable first until the mass reaches p),
  min-p (at least min_p times the best); each renormalizes;
- a draw: ``u = 1 - rng.random()``, the first token whose running mass reaches ``u`` times the
  total.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def ref_window(history: Sequence[int], last_n: int) -> list[int]:
    if last_n == 0:
        return []
    if last_n == -1 or last_n >= len(history):
        return list(history)
    return list(history)[len(history) - last_n :]


def ref_adjust(
    row: np.ndarray,
    history: Sequence[int] = (),
    *,
    logit_bias: Mapping[int, float] | None = None,
    repeat_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    penalty_last_n: int = 64,
) -> np.ndarray:
    x = np.array(row, dtype=np.float64)
    for token, bias in (logit_bias or {}).items():
        x[token] = x[token] + bias
    counts: dict[int, int] = {}
    for token in ref_window(history, penalty_last_n):
        counts[token] = counts.get(token, 0) + 1
    for token, count in counts.items():
        v = float(x[token])
        v = v * repeat_penalty if v <= 0 else v / repeat_penalty
        x[token] = v - (presence_penalty + frequency_penalty * count)
    return x


def ref_softmax(x: np.ndarray) -> np.ndarray:
    finite = x[np.isfinite(x)]
    m = finite.max()
    e = np.array([math.exp(v - m) if math.isfinite(v) else 0.0 for v in x])
    out: np.ndarray = e / e.sum()
    return out


def ref_top_k(x: np.ndarray, k: int) -> set[int]:
    if k <= 0 or k >= len(x):
        return set(range(len(x)))
    kth = sorted(x.tolist(), reverse=True)[k - 1]
    return {i for i, v in enumerate(x.tolist()) if v >= kth}


def ref_typical(p: np.ndarray, typical_p: float) -> set[int]:
    if typical_p >= 1.0:
        return {i for i, v in enumerate(p.tolist()) if v > 0}
    probs = p.tolist()
    entropy = -sum(v * math.log(v) for v in probs if v > 0)
    score = {i: abs(-math.log(v) - entropy) for i, v in enumerate(probs) if v > 0}
    keep: set[int] = set()
    mass = 0.0
    last = 0.0
    for i in sorted(score, key=lambda j: score[j]):
        keep.add(i)
        last = score[i]
        mass += probs[i]
        if mass > typical_p:
            break
    return keep | {i for i, s in score.items() if s == last}


def ref_top_p(p: np.ndarray, top_p: float) -> set[int]:
    probs = p.tolist()
    if top_p >= 1.0:
        return {i for i, v in enumerate(probs) if v > 0}
    keep: set[int] = set()
    mass = 0.0
    last = 0.0
    for i in sorted(range(len(probs)), key=lambda j: -probs[j]):
        keep.add(i)
        last = probs[i]
        mass += probs[i]
        if mass >= top_p:
            break
    return keep | {i for i, v in enumerate(probs) if v == last}


def ref_min_p(p: np.ndarray, min_p: float) -> set[int]:
    best = max(p.tolist())
    return {i for i, v in enumerate(p.tolist()) if v > 0 and v >= min_p * best}


def restrict(p: np.ndarray, keep: set[int]) -> np.ndarray:
    out = np.zeros_like(p)
    idx = sorted(keep)
    out[idx] = p[idx]
    total: float = out.sum()
    return out / total


def ref_distribution(row: np.ndarray, history: Sequence[int] = (), **options: object) -> np.ndarray:
    """The distribution the chain draws from, for ``options`` named as kvserve's options."""
    opts: dict = dict(options)
    temperature = float(opts.pop("temperature", 0.0))
    top_k = int(opts.pop("top_k", 0))
    typical_p = float(opts.pop("typical_p", 1.0))
    top_p = float(opts.pop("top_p", 1.0))
    min_p = float(opts.pop("min_p", 0.0))
    x = ref_adjust(row, history, **opts)
    if temperature == 0.0:
        onehot = np.zeros_like(x)
        onehot[int(np.argmax(x))] = 1.0
        return onehot
    x = x / temperature
    keep_k = ref_top_k(x, top_k)
    x = np.array([v if i in keep_k else -math.inf for i, v in enumerate(x.tolist())])
    p = ref_softmax(x)
    if typical_p < 1.0:
        p = restrict(p, ref_typical(p, typical_p))
    if top_p < 1.0:
        p = restrict(p, ref_top_p(p, top_p))
    if min_p > 0.0:
        p = restrict(p, ref_min_p(p, min_p))
    return p


def ref_draw(p: np.ndarray, rng: np.random.Generator) -> int:
    u = 1.0 - rng.random()
    total = sum(p.tolist())
    mass = 0.0
    for i, v in enumerate(p.tolist()):
        mass += v
        if v > 0 and mass >= u * total:
            return i
    return max(i for i, v in enumerate(p.tolist()) if v > 0)


def ref_log_softmax(row: np.ndarray) -> np.ndarray:
    x = np.asarray(row, dtype=np.float64)
    m = float(x.max())
    lse = m + math.log(sum(math.exp(v - m) for v in x.tolist()))
    out: np.ndarray = x - lse
    return out
