"""The per-request generation options shared by :meth:`kvserve.Model.generate` and every
:class:`kvserve.Engine` call (``generate``, ``agenerate``, ``stream`` and the chat variants).

They are declared once, as a ``TypedDict`` that the public methods take as keyword arguments
(``**options: Unpack[SamplingOptions]``), and checked once, by :func:`resolve`, so a new option is
added in one place and every entry point accepts it alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from typing_extensions import TypedDict

from .sampling import Sampler, SamplingParams

__all__ = ["RequestOptions", "SamplingOptions", "Resolved", "resolve", "stop_list"]

Stop = Union[str, Sequence[str], None]


class SamplingOptions(TypedDict, total=False):
    """How tokens are picked and when generation stops (all optional keywords).

    - ``temperature`` (0 = greedy, exactly argmax), ``top_k`` (0 = off), ``top_p`` in (0, 1],
      ``min_p`` in [0, 1] (keep tokens at least ``min_p`` times as probable as the best one);
    - ``seed``: the request's own random generator (same seed, same tokens, whatever else is
      batched with it);
    - ``stop``: strings that end generation (matched across token boundaries, never emitted);
    - ``ignore_eos``: keep generating past end-of-generation tokens.
    """

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    stop: Stop
    ignore_eos: bool


class RequestOptions(SamplingOptions, total=False):
    """What an :class:`kvserve.Engine` call takes beyond :class:`SamplingOptions`.

    - ``priority``: higher is admitted first and preempted last (FCFS within a priority).
    - ``session_id``: the conversation this request belongs to (a non-empty string): the
      prompt continues the session's previous prompts and outputs, whose K/V is reused; an
      unknown id starts a new session. See :class:`kvserve.Engine`.
    - ``context_shift``: when the sequence reaches the engine's ``ctx_size``, drop the older
      half of its context after the first ``n_keep`` tokens and go on generating (llama.cpp's
      ``--context-shift``); default: the engine's ``context_shift``.
    - ``n_keep``: prompt tokens a context shift keeps, besides the BOS (always kept when the
      model adds one); default 0; ``0 <= n_keep < ctx_size``.
    """

    priority: int
    session_id: str | None
    context_shift: bool
    n_keep: int


_KEYS = frozenset(SamplingOptions.__annotations__)
_REQUEST_KEYS = _KEYS | frozenset(RequestOptions.__annotations__)


@dataclass
class Resolved:
    """Validated options: a ready sampler plus the stop rules."""

    sampler: Sampler
    stops: list[str]
    ignore_eos: bool
    priority: int
    session_id: str | None = None
    context_shift: bool | None = None  # None: the engine's default
    n_keep: int = 0


def stop_list(stop: Stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    return [s for s in stop if s]


def resolve(options: RequestOptions, *, engine: bool = False) -> Resolved:
    """Checks ``options`` (an unknown name is a ``TypeError``, a bad value a ``ValueError``
    naming the argument and its limit) and builds the sampler. ``engine``: the
    :class:`RequestOptions` of an Engine call are allowed too."""
    unknown = set(options) - (_REQUEST_KEYS if engine else _KEYS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    params = SamplingParams(  # ValueError naming the argument
        temperature=options.get("temperature", 0.0),
        top_k=options.get("top_k", 0),
        top_p=options.get("top_p", 1.0),
        min_p=options.get("min_p", 0.0),
    )
    session_id = options.get("session_id")
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise ValueError(f"session_id must be a non-empty string or None, got {session_id!r}")
    n_keep = options.get("n_keep", 0)
    if isinstance(n_keep, bool) or not isinstance(n_keep, int) or n_keep < 0:
        raise ValueError(f"n_keep must be an integer >= 0, got {n_keep!r}")
    context_shift = options.get("context_shift")
    if context_shift is not None and not isinstance(context_shift, bool):
        raise ValueError(f"context_shift must be True or False, got {context_shift!r}")
    return Resolved(
        sampler=Sampler(params, seed=options.get("seed")),
        stops=stop_list(options.get("stop")),
        ignore_eos=options.get("ignore_eos", False),
        priority=options.get("priority", 0),
        session_id=session_id,
        context_shift=context_shift,
        n_keep=n_keep,
    )
