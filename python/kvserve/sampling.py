"""Token samplers over logits: greedy, temperature, top-k, top-p (nucleus) and min-p.

Every function works on the last axis, so a ``(n_vocab,)`` row and an ``(n_rows, n_vocab)``
batch are handled alike, and nothing here modifies its input (logits may be a read-only,
zero-copy view of the engine's buffer).

Guarantees:
- ``temperature == 0`` is greedy: the index of the largest logit (the first one on ties).
- Filters run in this order: temperature, then top-k, then top-p, then min-p (vLLM's order). A
  token that a filter removes has probability exactly 0 and is never drawn; at least one token
  always survives.
- top-k keeps every token whose logit is at least the k-th largest (ties at the boundary are
  kept). top-p keeps the smallest set of most probable tokens whose probability mass reaches
  ``top_p`` (again keeping ties at the boundary). min-p keeps the tokens at least ``min_p``
  times as probable as the most probable one.
- With the same seed, the same logits give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = [
    "SamplingParams",
    "Sampler",
    "greedy",
    "softmax",
    "top_k_mask",
    "top_p_mask",
    "probabilities",
    "sample",
]


def _as_float64(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    arr = np.asarray(logits, dtype=np.float64)
    if arr.ndim == 0 or arr.shape[-1] == 0:
        raise ValueError("logits must have at least one entry on the last axis")
    return arr


def greedy(logits: npt.ArrayLike) -> npt.NDArray[np.intp]:
    """Index of the largest logit along the last axis (the first one on ties)."""
    return np.asarray(np.argmax(_as_float64(logits), axis=-1), dtype=np.intp)


def softmax(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Numerically stable softmax along the last axis; ``-inf`` entries get probability 0."""
    x = _as_float64(logits)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    out: npt.NDArray[np.float64] = e / np.sum(e, axis=-1, keepdims=True)
    return out


def top_k_mask(logits: npt.ArrayLike, k: int) -> npt.NDArray[np.bool_]:
    """Boolean mask of the tokens kept by top-k; ``k <= 0`` or ``k >= n_vocab`` keeps all."""
    x = _as_float64(logits)
    n = x.shape[-1]
    if k <= 0 or k >= n:
        return np.ones(x.shape, dtype=np.bool_)
    kth = np.partition(x, n - k, axis=-1)[..., n - k : n - k + 1]
    keep: npt.NDArray[np.bool_] = x >= kth
    return keep


def top_p_mask(probs: npt.ArrayLike, p: float) -> npt.NDArray[np.bool_]:
    """Boolean mask of the tokens kept by nucleus sampling over ``probs`` (rows sum to 1).

    Keeps the most probable tokens until their mass reaches ``p``; ``p >= 1`` keeps all.
    """
    pr = _as_float64(probs)
    if p >= 1.0:
        return np.ones(pr.shape, dtype=np.bool_)
    if p <= 0.0:
        raise ValueError("top_p must be in (0, 1]")
    order = np.argsort(-pr, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(pr, order, axis=-1)
    mass_before = np.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = mass_before < p
    keep_sorted[..., 0] = True
    # The smallest kept probability; every token at least that probable is kept (ties).
    threshold = np.min(np.where(keep_sorted, sorted_p, np.inf), axis=-1, keepdims=True)
    keep: npt.NDArray[np.bool_] = pr >= threshold
    return keep


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` means greedy (other fields unused)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: npt.ArrayLike, params: SamplingParams) -> npt.NDArray[np.float64]:
    """The distribution that :func:`sample` draws from (after temperature, top-k, top-p, min-p).

    For greedy params this is one-hot on the argmax.
    """
    x = _as_float64(logits)
    if params.is_greedy:
        onehot = np.zeros(x.shape, dtype=np.float64)
        np.put_along_axis(onehot, greedy(x)[..., None], 1.0, axis=-1)
        return onehot
    scaled = x / params.temperature
    scaled = np.where(top_k_mask(scaled, params.top_k), scaled, -np.inf)
    probs = softmax(scaled)
    if params.top_p < 1.0:
        probs = np.where(top_p_mask(probs, params.top_p), probs, 0.0)
        probs /= np.sum(probs, axis=-1, keepdims=True)
    if params.min_p > 0.0:
        cut = params.min_p * np.max(probs, axis=-1, keepdims=True)
        probs = np.where(probs >= cut, probs, 0.0)
        probs /= np.sum(probs, axis=-1, keepdims=True)
    return probs


def sample(
    logits: npt.ArrayLike, params: SamplingParams, rng: np.random.Generator
) -> npt.NDArray[np.intp]:
    """Draw one token per row (a 0-d array for a single row of logits)."""
    x = _as_float64(logits)
    if params.is_greedy:
        return greedy(x)
    probs = probabilities(x, params)
    cum = np.cumsum(probs, axis=-1)
    # u in (0, 1]: the first index whose cumulative mass reaches u * total has probability > 0.
    u = 1.0 - rng.random(size=x.shape[:-1] + (1,))
    target = u * cum[..., -1:]
    return np.asarray(np.sum(cum < target, axis=-1), dtype=np.intp)


@dataclass
class Sampler:
    """Stateful sampler: fixed params plus a seeded random generator."""

    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, logits: npt.ArrayLike) -> int:
        """Next token for one row of logits."""
        x = _as_float64(logits)
        if x.ndim != 1:
            raise ValueError(f"expected one row of logits, got shape {x.shape}")
        return int(sample(x, self.params, self.rng))

    def sample_rows(self, logits: npt.ArrayLike) -> npt.NDArray[np.intp]:
        """Next token for each row of a ``(n_rows, n_vocab)`` batch."""
        return sample(logits, self.params, self.rng)
