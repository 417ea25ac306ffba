"""Token samplers over logits, and the log-probabilities reported for generated tokens.

Every function works on the last axis, so a ``(n_vocab,)`` row and an ``(n_rows, n_vocab)``
batch are handled alike (a token history applies to every row of a batch), and nothing here
modifies its input (logits may be a read-only, zero-copy view of the engine's buffer).

The chain, for one row of raw logits and the sequence's token history (see below):

1. ``logit_bias``: each listed token's bias is added to its logit (OpenAI's semantics; ``-inf``
   bans the token, and so does ``-100`` in practice).
2. Penalties over the *window*, the last ``penalty_last_n`` tokens of the history (llama.cpp's
   ``repeat_last_n``: 0 disables the penalties, -1 takes the whole history; default 64). For
   each token that occurs ``count > 0`` times in the window: ``repeat_penalty`` (llama.cpp's
   rule) divides a positive logit and multiplies a logit <= 0; then ``presence_penalty`` and
   ``frequency_penalty`` (OpenAI's rule) subtract ``presence + frequency * count``. Only the
   window's distinct tokens are touched (O(window) per step, not O(n_vocab)).
3. ``temperature == 0`` is greedy: the index of the largest logit after steps 1-2 (the first one
   on ties), exactly an argmax, as llama.cpp runs its penalties before its greedy pick. The other
   filters are not used then.
4. Otherwise the logits are divided by ``temperature`` and the filters run in this order:
   top-k, typical-p, top-p, min-p. Temperature first and top-k/top-p/min-p in that order is vLLM's
   order; typical-p sits between top-k and top-p as it does in llama.cpp's default chain (so the
   filters see the tempered distribution, where llama.cpp applies its temperature last). A token
   that a filter removes has probability exactly 0 and is never drawn; at least one token always
   survives.

History: the tokens the sequence holds, *prompt included*, then the generated ones. This is
llama.cpp's server: once a prompt is processed it passes every prompt token through its sampler
(``common_sampler_accept``), so the penalty window covers the prompt's last tokens too. (vLLM
differs: its ``repetition_penalty`` counts prompt and output tokens, its presence and frequency
penalties only output tokens.) An end-of-generation token ends a sequence and is not part of
it, unless generation ignores it (then it is history like any other token). A context shift in
the engine does not shorten the history: like llama.cpp's sampler, the penalties still see the
tokens it dropped from the context.

Filters:
- top-k keeps every token whose logit is at least the k-th largest (ties at the boundary kept).
- typical-p (locally typical sampling, llama.cpp's definition): with entropy
  ``H = -sum p log p`` of the current distribution, tokens are ranked by ``|-log p - H|``
  (closest to the entropy first) and kept in that order until the kept mass exceeds
  ``typical_p``; ties at the boundary are kept; 1.0 disables it.
- top-p keeps the smallest set of most probable tokens whose mass reaches ``top_p`` (ties at the
  boundary kept). min-p keeps the tokens at least ``min_p`` times as probable as the best one.

Drawing: ``u = 1 - rng.random()`` (in (0, 1]); the token is the first index whose cumulative
probability reaches ``u`` times the total. One draw per row per step, so with the same seed the
same logits and history give the same tokens.

Cost of one row (the engine's case): one float64 copy of the row, worked on in place; the
penalties touch the window's distinct tokens only; top-k looks for its k near the maximum;
typical-p and top-p sort only the candidates that provably hold what they keep; the later
filters and the draw run on the surviving tokens. Batches (``(n_rows, n_vocab)``) take the
plain whole-array path, which gives the same distribution.

Log-probabilities (:func:`token_logprobs`) are those of the model's own distribution: the
log-softmax of the raw logits, before bias, penalties, temperature and filters, as vLLM reports
them by default (its ``raw_logprobs`` mode). They describe what the model predicted, whatever
sampling settings picked the token.
"""

from __future__ import annotations

import math
import numbers
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = [
    "SamplingParams",
    "Sampler",
    "TokenLogprob",
    "adjusted_logits",
    "apply_logit_bias",
    "apply_penalties",
    "greedy",
    "log_softmax",
    "softmax",
    "top_k_mask",
    "top_p_mask",
    "typical_mask",
    "probabilities",
    "sample",
    "token_logprobs",
]

# The most alternatives ``logprobs`` may ask for per token (OpenAI's and vLLM's limit).
MAX_LOGPROBS = 20
# presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range; vLLM checks the same).
MAX_ABS_PENALTY = 2.0
DEFAULT_PENALTY_LAST_N = 64  # llama.cpp's repeat_last_n default

History = Sequence[int]


def _as_float64(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    arr = np.asarray(logits, dtype=np.float64)
    if arr.ndim == 0 or arr.shape[-1] == 0:
        raise ValueError("logits must have at least one entry on the last axis")
    return arr


def _float64_copy(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    arr = np.array(logits, dtype=np.float64, copy=True)
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


def log_softmax(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Numerically stable log-softmax along the last axis (float64)."""
    x = _as_float64(logits)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    shifted = x - m
    out: npt.NDArray[np.float64] = shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))
    return out


# How far below the largest logit :func:`top_k_mask` first looks for the k largest of one row.
_TOP_K_WINDOWS = (8.0, 16.0, 32.0)


def top_k_mask(logits: npt.ArrayLike, k: int) -> npt.NDArray[np.bool_]:
    """Boolean mask of the tokens kept by top-k; ``k <= 0`` or ``k >= n_vocab`` keeps all."""
    x = _as_float64(logits)
    n = x.shape[-1]
    if k <= 0 or k >= n:
        return np.ones(x.shape, dtype=np.bool_)
    if x.ndim == 1:
        # One row: when at least k logits lie within ``window`` of the largest, the k-th
        # largest is among them, so only they are partitioned (far fewer than n_vocab).
        top = float(np.max(x))
        for window in _TOP_K_WINDOWS:
            near = x[x >= top - window]
            if near.size >= k:
                row_keep: npt.NDArray[np.bool_] = x >= np.partition(near, near.size - k)[-k]
                return row_keep
    kth = np.partition(x, n - k, axis=-1)[..., n - k : n - k + 1]
    keep: npt.NDArray[np.bool_] = x >= kth
    return keep


def _exclusive_cumsum(sorted_p: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Mass strictly before each entry, summed left to right."""
    before = np.zeros_like(sorted_p)
    np.cumsum(sorted_p[..., :-1], axis=-1, out=before[..., 1:])
    return before


def _top_p_keep(pr: npt.NDArray[np.float64], p: float) -> npt.NDArray[np.bool_]:
    """top-p over ``pr``: absolute probabilities of the row's tokens, or of a subset that holds
    the row's most probable tokens up to a mass of at least ``p``."""
    order = np.argsort(-pr, axis=-1)  # the result does not depend on how ties are ordered
    sorted_p = np.take_along_axis(pr, order, axis=-1)
    keep_sorted = _exclusive_cumsum(sorted_p) < p
    keep_sorted[..., 0] = True
    # The smallest kept probability; every token at least that probable is kept (ties).
    threshold = np.min(np.where(keep_sorted, sorted_p, np.inf), axis=-1, keepdims=True)
    keep: npt.NDArray[np.bool_] = pr >= threshold
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
    return _top_p_keep(pr, p)


def _entropy(pr: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``-sum p log p`` along the last axis (0 log 0 = 0)."""
    terms = np.zeros_like(pr)
    np.log(pr, out=terms, where=pr > 0.0)
    np.multiply(pr, terms, out=terms)
    out: npt.NDArray[np.float64] = -np.sum(terms, axis=-1)
    return out


def _typical_scores(
    pr: npt.NDArray[np.float64], entropy: npt.NDArray[np.float64] | float
) -> npt.NDArray[np.float64]:
    """``|-log p - H|`` per token; ``inf`` for tokens of probability 0."""
    positive = pr > 0.0
    logp = np.log(np.where(positive, pr, 1.0))
    out: npt.NDArray[np.float64] = np.where(
        positive, np.abs(-logp - np.expand_dims(entropy, -1)), np.inf
    )
    return out


def _typical_keep(
    pr: npt.NDArray[np.float64], p: float, entropy: npt.NDArray[np.float64] | float
) -> npt.NDArray[np.bool_]:
    """typical-p over ``pr``: absolute probabilities of the row's tokens (or of a subset that
    holds every token the filter keeps), ``entropy`` that of the whole row."""
    scores = _typical_scores(pr, entropy)
    order = np.argsort(scores, axis=-1)
    sorted_p = np.take_along_axis(pr, order, axis=-1)
    keep_sorted = _exclusive_cumsum(sorted_p) <= p
    keep_sorted[..., 0] = True
    sorted_scores = np.take_along_axis(scores, order, axis=-1)
    threshold = np.max(np.where(keep_sorted, sorted_scores, -np.inf), axis=-1, keepdims=True)
    keep: npt.NDArray[np.bool_] = (pr > 0.0) & (scores <= threshold)
    return keep


def typical_mask(probs: npt.ArrayLike, p: float) -> npt.NDArray[np.bool_]:
    """Boolean mask of the tokens kept by locally typical sampling over ``probs`` (rows sum
    to 1); ``p >= 1`` keeps all.

    Tokens are ranked by ``|-log p_i - H|`` (H the entropy of the row) and kept in that order
    while the mass before them is at most ``p`` (llama.cpp: stop after the first token that
    takes the mass past ``p``). Tokens ranked equal to the last kept one are kept too; tokens
    of probability 0 are never kept.
    """
    pr = _as_float64(probs)
    if p >= 1.0:
        return np.ones(pr.shape, dtype=np.bool_)
    if p <= 0.0:
        raise ValueError("typical_p must be in (0, 1]")
    return _typical_keep(pr, p, _entropy(pr))


# -- logit bias and penalties ---------------------------------------------------------------


def _add_bias(x: npt.NDArray[np.float64], bias: Mapping[int, float]) -> None:
    if bias:
        ids = np.fromiter(bias.keys(), dtype=np.intp, count=len(bias))
        x[..., ids] += np.fromiter(bias.values(), dtype=np.float64, count=len(bias))


def apply_logit_bias(logits: npt.ArrayLike, bias: Mapping[int, float]) -> npt.NDArray[np.float64]:
    """A float64 copy of ``logits`` with ``bias[token]`` added to each listed token's logit."""
    x = _float64_copy(logits)
    _add_bias(x, bias)
    return x


def _window(history: History | None, last_n: int) -> npt.NDArray[np.intp]:
    if history is None or last_n == 0:
        return np.zeros(0, dtype=np.intp)
    tail = history if last_n < 0 else history[-last_n:]
    return np.asarray(tail, dtype=np.intp).reshape(-1)


def _penalize(
    x: npt.NDArray[np.float64],
    history: History | None,
    repeat_penalty: float,
    presence_penalty: float,
    frequency_penalty: float,
    last_n: int,
) -> None:
    window = _window(history, last_n)
    if window.size == 0:
        return
    ids, counts = np.unique(window, return_counts=True)  # O(window log window)
    v = x[..., ids]
    if repeat_penalty != 1.0:
        v = np.where(v <= 0.0, v * repeat_penalty, v / repeat_penalty)
    if presence_penalty != 0.0 or frequency_penalty != 0.0:
        v = v - (presence_penalty + frequency_penalty * counts)
    x[..., ids] = v


def apply_penalties(
    logits: npt.ArrayLike,
    history: History | None,
    *,
    repeat_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    last_n: int = DEFAULT_PENALTY_LAST_N,
) -> npt.NDArray[np.float64]:
    """A float64 copy of ``logits`` with the repetition penalties applied for the tokens in the
    last ``last_n`` tokens of ``history`` (0: none, -1: all); see the module docs."""
    x = _float64_copy(logits)
    _penalize(x, history, repeat_penalty, presence_penalty, frequency_penalty, last_n)
    return x


# -- parameters ---------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _check_logit_bias(bias: object) -> Mapping[int, float]:
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for token, value in bias.items():
        if not _is_int(token) or int(token) < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
        b = _real(f"logit_bias[{token}]", value)
        if math.isnan(b) or b == math.inf:
            raise ValueError(
                f"logit_bias[{token}] must be a finite number or -inf (a ban), got {value!r}"
            )
        out[int(token)] = b
    return types.MappingProxyType(out)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token (see the module docs for the chain). ``temperature == 0``
    means greedy: only ``logit_bias`` and the penalties apply then.

    Every field is checked on construction: a bad value is a ``ValueError`` naming the field
    and its limit. ``logit_bias`` is kept as a read-only mapping; its token ids are checked
    against a vocabulary by :meth:`check_vocab`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = DEFAULT_PENALTY_LAST_N
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        t = _real("temperature", self.temperature)
        if not np.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (an integer; 0 disables it), got {self.top_k!r}")
        if not (0.0 < _real("top_p", self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= _real("min_p", self.min_p) <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < _real("typical_p", self.typical_p) <= 1.0):
            raise ValueError(f"typical_p must be in (0, 1] (1 disables it), got {self.typical_p}")
        rp = _real("repeat_penalty", self.repeat_penalty)
        if not (math.isfinite(rp) and rp > 0.0):
            raise ValueError(
                f"repeat_penalty must be a finite number > 0 (1 disables it), got {rp}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not (-MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY):
                raise ValueError(
                    f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}]"
                    f" (0 disables it), got {value}"
                )
        if not _is_int(self.penalty_last_n) or self.penalty_last_n < -1:
            raise ValueError(
                "penalty_last_n must be an integer >= -1 (-1: the whole sequence, 0: off),"
                f" got {self.penalty_last_n!r}"
            )
        object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))

    def check_vocab(self, n_vocab: int) -> None:
        """``ValueError`` unless every ``logit_bias`` id is below ``n_vocab`` and at least
        one token is left unbanned."""
        for token in self.logit_bias:
            if token >= n_vocab:
                raise ValueError(
                    f"logit_bias token id {token} is out of range: the vocabulary has"
                    f" {n_vocab} tokens (ids 0..{n_vocab - 1})"
                )
        bans = sum(1 for b in self.logit_bias.values() if b == -math.inf)
        if bans >= n_vocab:
            raise ValueError("logit_bias bans every token of the vocabulary (-inf on all)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        """Whether the penalties change anything (a window and a non-neutral penalty)."""
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with neither bias nor penalties: the token is the argmax of the raw logits."""
        return self.is_greedy and not self.logit_bias and not self.penalizes


def adjusted_logits(
    logits: npt.ArrayLike, params: SamplingParams, history: History | None = None
) -> npt.NDArray[np.float64]:
    """Steps 1-2 of the chain: float64 logits with ``logit_bias`` and the penalties applied.
    The input is never modified (this is a copy, or the float64 input itself when there is
    nothing to apply)."""
    if not params.logit_bias and not params.penalizes:
        return _as_float64(logits)
    x = _float64_copy(logits)
    _add_bias(x, params.logit_bias)
    if params.penalizes:
        _penalize(
            x,
            history,
            params.repeat_penalty,
            params.presence_penalty,
            params.frequency_penalty,
            params.penalty_last_n,
        )
    return x


def _renormalized(
    probs: npt.NDArray[np.float64], keep: npt.NDArray[np.bool_]
) -> npt.NDArray[np.float64]:
    out = np.where(keep, probs, 0.0)
    out /= np.sum(out, axis=-1, keepdims=True)
    return out


def _filtered(
    probs: npt.NDArray[np.float64], typical_p: float, top_p: float, min_p: float
) -> npt.NDArray[np.float64]:
    """typical-p, top-p and min-p over ``probs`` (rows sum to 1), renormalized after each."""
    if typical_p < 1.0:
        probs = _renormalized(probs, typical_mask(probs, typical_p))
    if top_p < 1.0:
        probs = _renormalized(probs, top_p_mask(probs, top_p))
    if min_p > 0.0:
        probs = _renormalized(probs, probs >= min_p * np.max(probs, axis=-1, keepdims=True))
    return probs


# Candidate cut-offs for one row, relative to its largest probability (0: every token left).
_CUTOFFS = (1e-4, 1e-8, 0.0)
# Slack for rounding when deciding that the candidates hold everything a filter keeps.
_SLACK = 1e-9


def _filtered_row(
    probs: npt.NDArray[np.float64], params: SamplingParams
) -> tuple[npt.NDArray[np.intp] | None, npt.NDArray[np.float64]]:
    """:func:`_filtered` for one row without sorting the whole vocabulary: ``(cand, sub)``, the
    filtered probabilities ``sub`` of the entries ``cand`` of ``probs`` (ascending; None: all
    of them), every other entry having probability 0.

    typical-p and top-p sort, but what they keep lies among the more probable tokens: the
    first of them to run (typical-p, else top-p) runs on the candidates ``p >= c`` for the
    largest cut-off ``c`` that provably holds its kept set, with the row's own entropy and
    absolute mass, so the result equals the whole-row computation. For top-p that holds when
    the candidates' mass reaches ``top_p``: every other token comes later in its order. For
    typical-p a token below ``c`` scores more than ``d = -log c - H``, so it holds when the
    candidates scoring at most ``d`` already weigh more than ``typical_p``. The later filters
    only see what the first one kept."""
    tp, pp = params.typical_p, params.top_p
    if tp >= 1.0 and pp >= 1.0:
        return None, _filtered(probs, 1.0, 1.0, params.min_p)
    entropy = float(_entropy(probs)) if tp < 1.0 else 0.0
    pmax = float(np.max(probs))
    for rel in _CUTOFFS:
        c = pmax * rel
        cand = np.flatnonzero(probs >= c) if c > 0.0 else np.flatnonzero(probs)
        sub = probs[cand]
        if c == 0.0:
            break
        if tp < 1.0:
            d = -math.log(c) - entropy
            if float(np.sum(sub[_typical_scores(sub, entropy) <= d - _SLACK])) > tp + _SLACK:
                break
        elif float(np.sum(sub)) >= pp + _SLACK:
            break
    if tp < 1.0:
        sub = _renormalized(sub, _typical_keep(sub, tp, entropy))
        sub = _filtered(sub, 1.0, pp, params.min_p)
    else:
        sub = _renormalized(sub, _top_p_keep(sub, pp))
        sub = _filtered(sub, 1.0, 1.0, params.min_p)
    return cand, sub


def _row_distribution(
    logits: npt.ArrayLike,
    params: SamplingParams,
    history: History | None,
    allowed: npt.NDArray[np.intp] | None = None,
) -> tuple[npt.NDArray[np.intp] | None, npt.NDArray[np.float64]]:
    """The whole chain for one row of raw logits (temperature > 0), kept sparse: ``(ids, p)``,
    the probabilities ``p`` of the tokens ``ids`` (ascending; None: every token), every other
    token having probability 0. One float64 copy of the row is made and worked on in place;
    after top-k or a filter only the surviving tokens are carried on, so a 262k-entry row is
    passed over a few times and the rest of the chain and the draw run on the survivors.

    ``allowed`` (ascending token ids): only those tokens may be drawn, exactly as if every
    other logit were ``-inf`` (a constraint's mask), but the chain runs on them alone after the
    bias and penalties (``exp`` of hundreds of thousands of ``-inf`` is slow)."""
    z = _float64_copy(logits)
    _add_bias(z, params.logit_bias)
    if params.penalizes:
        _penalize(
            z,
            history,
            params.repeat_penalty,
            params.presence_penalty,
            params.frequency_penalty,
            params.penalty_last_n,
        )
    ids: npt.NDArray[np.intp] | None = None
    if allowed is not None:
        ids, z = allowed, z[allowed]
    z /= params.temperature
    if 0 < params.top_k < z.size:
        keep = np.flatnonzero(top_k_mask(z, params.top_k))
        ids, z = (keep if ids is None else ids[keep]), z[keep]
    # softmax's arithmetic, in place
    top = float(np.max(z))
    z -= top if math.isfinite(top) else 0.0
    probs = np.exp(z, out=z)
    probs /= np.sum(probs)
    cand, probs = _filtered_row(probs, params)
    if cand is not None:
        ids = cand if ids is None else ids[cand]
    return ids, probs


def probabilities(
    logits: npt.ArrayLike, params: SamplingParams, history: History | None = None
) -> npt.NDArray[np.float64]:
    """The distribution that :func:`sample` draws from (the whole chain of the module docs).

    For greedy params this is one-hot on the argmax of the biased, penalized logits.
    """
    if params.is_greedy:
        x = adjusted_logits(logits, params, history)
        onehot = np.zeros(x.shape, dtype=np.float64)
        np.put_along_axis(onehot, greedy(x)[..., None], 1.0, axis=-1)
        return onehot
    if np.ndim(logits) == 1:
        ids, p = _row_distribution(logits, params, history)
        if ids is None:
            return p
        out = np.zeros(np.shape(logits), dtype=np.float64)
        out[ids] = p
        return out
    x = adjusted_logits(logits, params, history)
    scaled = x / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        scaled[~top_k_mask(scaled, params.top_k)] = -np.inf
    return _filtered(softmax(scaled), params.typical_p, params.top_p, params.min_p)


def sample(
    logits: npt.ArrayLike,
    params: SamplingParams,
    rng: np.random.Generator,
    history: History | None = None,
    allowed: npt.NDArray[np.intp] | None = None,
) -> npt.NDArray[np.intp]:
    """Draw one token per row (a 0-d array for a single row of logits); ``history``: the
    sequence's tokens so far (prompt included), for the penalties. ``allowed`` (one row only;
    ascending token ids, at least one): only those may be drawn, the same draw as with every
    other logit at ``-inf``."""
    if allowed is not None:
        if np.ndim(logits) != 1 or len(allowed) == 0:
            raise ValueError("allowed needs one row of logits and at least one token")
        if params.is_greedy:  # the first largest among them, as an argmax over the masked row
            x = logits if params.is_plain_greedy else adjusted_logits(logits, params, history)
            return np.asarray(allowed[int(np.argmax(np.asarray(x)[allowed]))], dtype=np.intp)
    elif params.is_plain_greedy:
        return greedy(logits)
    elif params.is_greedy:
        return greedy(adjusted_logits(logits, params, history))
    if np.ndim(logits) == 1:
        # One row, drawn from its sparse distribution: the running mass over the surviving
        # tokens in id order is the whole row's (the others add exact zeros).
        ids, p = _row_distribution(logits, params, history, allowed)
        cum = np.cumsum(p, out=p)
        # u in (0, 1]: the first token whose running mass reaches u * total has p > 0.
        u = 1.0 - rng.random(size=(1,))
        j = int(np.searchsorted(cum, u[0] * cum[-1], side="left"))  # cum is sorted
        return np.asarray(j if ids is None else ids[j], dtype=np.intp)
    probs = probabilities(logits, params, history)
    cum = np.cumsum(probs, axis=-1, out=probs)
    u = 1.0 - rng.random(size=probs.shape[:-1] + (1,))
    return np.asarray(np.sum(cum < u * cum[..., -1:], axis=-1), dtype=np.intp)


@dataclass
class Sampler:
    """Stateful sampler: fixed params plus a seeded random generator."""

    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def __call__(
        self,
        logits: npt.ArrayLike,
        history: History | None = None,
        allowed: npt.NDArray[np.intp] | None = None,
    ) -> int:
        """Next token for one row of logits; ``history``: the sequence's tokens so far;
        ``allowed``: the only tokens that may be drawn (see :func:`sample`)."""
        if np.ndim(logits) != 1:
            raise ValueError(f"expected one row of logits, got shape {np.shape(logits)}")
        return int(sample(logits, self.params, self.rng, history, allowed))

    def sample_rows(
        self, logits: npt.ArrayLike, history: History | None = None
    ) -> npt.NDArray[np.intp]:
        """Next token for each row of a ``(n_rows, n_vocab)`` batch (one shared history)."""
        return sample(logits, self.params, self.rng, history)


# -- log-probabilities ----------------------------------------------------------------------


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-probability under the model's own distribution
    (log-softmax of the raw logits) and the ``top`` most probable tokens at that step as
    ``(token id, logprob)`` pairs, most probable first (lower id first on ties). ``piece`` is
    the token's bytes; ``text`` decodes them (a piece may hold part of a character, shown as
    U+FFFD)."""

    token: int
    piece: bytes
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.piece.decode("utf-8", errors="replace")


def token_logprobs(
    logits: npt.ArrayLike, token: int, n: int
) -> tuple[float, list[tuple[int, float]]]:
    """For one row of raw logits: ``token``'s log-probability and the ``n`` most probable
    tokens with theirs (most probable first, lower id first on ties). One float64 temporary
    of the row: ``n`` argmax passes over it pick the best (cheaper than a partition for the
    n <= 20 that ``logprobs`` allows), then one log-sum-exp pass."""
    x = np.asarray(logits)
    if x.dtype != np.float32:
        x = _as_float64(x)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"expected one non-empty row of logits, got shape {x.shape}")
    m = float(np.max(x))
    work = np.subtract(x, m, dtype=np.float64)
    n = min(n, x.size)
    best: list[int] = []
    if n > MAX_LOGPROBS:
        part = np.argpartition(-work, n - 1)[:n] if n < x.size else np.arange(x.size)
        tied = np.flatnonzero(work >= float(np.min(work[part])))  # ties broken by id below
        best = tied[np.lexsort((tied, -work[tied]))][:n].tolist()
    else:
        for _ in range(n):
            i = int(np.argmax(work))  # the first maximum: lower id first on ties
            if work[i] == -np.inf:  # only -inf left: the lowest ids not taken yet
                taken = set(best)
                best += [j for j in range(x.size) if j not in taken][: n - len(best)]
                break
            best.append(i)
            work[i] = -np.inf
        for i in best:
            work[i] = float(x[i]) - m  # as np.subtract computed it
    lse = m + math.log(float(np.sum(np.exp(work, out=work))))
    return float(x[token]) - lse, [(i, float(x[i]) - lse) for i in best]
