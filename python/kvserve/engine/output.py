"""Output processing: tokens from a step's logits, then text. Sampling (one argmax over every
plain greedy row in the core, each other row with its request's own sampler), log-probabilities,
incremental detokenization and stop strings (:class:`kvserve.textstream.TextStream`: work per
token bounded by the new text, not the stop list), and the rules that end a generation."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .._model import FINISH_CONTEXT, FINISH_LENGTH, FINISH_STOP, token_logprob
from .requests import Request

if TYPE_CHECKING:
    from .._core import Logits
    from .._model import Model

__all__ = ["argmax_rows", "deliver", "pick"]


def argmax_rows(reqs: list[Request], logits: Logits, at: list[int]) -> dict[int, int]:
    """The tokens of the plain greedy requests (no bias, no penalties, no constraint) among
    ``reqs``, whose rows of ``logits`` are ``at``: request index -> token. Each is the first
    maximum of its raw row (sampling.greedy's rule), found by the core's scan of the row
    (``Logits.argmax``): no numpy view and no float64 copy on the per-token path."""
    return {i: logits.argmax(at[i]) for i, r in enumerate(reqs) if r.argmax_only}


def pick(
    model: Model,
    req: Request,
    row: np.ndarray,
    greedy: int | None,
    allowed: np.ndarray | None = None,
) -> int:
    """``req``'s token from its logits ``row`` (``greedy``: the argmax when it is a plain greedy
    row): its own sampler otherwise (bias and penalties over its tokens, then greedy or its own
    seeded generator), among ``allowed`` (the token ids its constraint allows) when given. A
    request that asked for logprobs gets the token's entry, from the raw row, in
    ``pending_logprob``."""
    if greedy is not None:
        tok = greedy
    elif allowed is None:
        tok = req.sampler(row, req.ids)
    else:
        tok = req.sampler(row, req.ids, allowed)
    if req.n_logprobs is not None:
        req.pending_logprob = token_logprob(model, row, tok, req.n_logprobs)
    return tok


def deliver(
    req: Request, tok: int, eog: bool, piece: Callable[[int], bytes], seq_limit: int
) -> str | None:
    """Hands ``tok`` to ``req``: the finish reason when the request is done now, else None.
    ``FINISH_CONTEXT`` means the sequence is full: the caller shifts its context or finishes
    it. ``eog``: ``tok`` ends the generation (an end-of-generation token, ``ignore_eos``
    off); it is not delivered."""
    if eog:
        req.end_logprob, req.pending_logprob = req.pending_logprob, None
        return FINISH_STOP
    req.ids.append(tok)
    if req.logprobs is not None and req.pending_logprob is not None:
        req.logprobs.append(req.pending_logprob)
        req.pending_logprob = None
    out = req.text.push(piece(tok))
    if out:
        req.pieces.append(out)
        req.sink.piece(out, req.unsent_logprobs())
    if req.text.stopped:
        return FINISH_STOP
    if req.n_generated >= req.max_tokens:
        return FINISH_LENGTH
    if req.n_tokens - 1 >= seq_limit:
        return FINISH_CONTEXT
    return None
