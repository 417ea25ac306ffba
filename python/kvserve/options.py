"""The per-request generation options shared by :meth:`kvserve.Model.generate` and every
:class:`kvserve.Engine` call (``generate``, ``agenerate``, ``stream`` and the chat variants).

They are declared once, as a ``TypedDict`` that the public methods take as keyword arguments
(``**options: Unpack[SamplingOptions]``), and checked once, by :func:`resolve`, so a new option is
added in one place and every entry point accepts it alike.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from typing_extensions import TypedDict

from .sampling import DEFAULT_PENALTY_LAST_N, MAX_LOGPROBS, Sampler, SamplingParams

if TYPE_CHECKING:
    from .grammar import Constraint

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "RequestOptions",
    "SamplingOptions",
    "Resolved",
    "resolve",
    "stop_list",
]

Stop = str | Sequence[str] | None

# Limits on what one request may ask (the engine thread serves every user: what it does per
# request and per token must stay bounded). Beyond them, resolve() raises a ValueError.
MAX_STOPS = 256  # entries of ``stop``
MAX_STOP_CHARS = 512  # characters of one stop string
MAX_LOGIT_BIAS = 1024  # entries of ``logit_bias``
MAX_TENANT_CHARS = 64  # ``tenant`` length
MAX_CACHE_SALT_CHARS = 256  # ``cache_salt`` length
PRIORITY_MIN = -1000  # ``priority`` range (an int; higher is served first)
PRIORITY_MAX = 1000


class SamplingOptions(TypedDict, total=False):
    """How tokens are picked and when generation stops (all optional keywords).

    - ``temperature`` (0 = greedy: exactly the argmax of the biased, penalized logits),
      ``top_k`` (0 = off), ``typical_p`` in (0, 1] (locally typical sampling; 1 = off),
      ``top_p`` in (0, 1], ``min_p`` in [0, 1] (keep tokens at least ``min_p`` times as
      probable as the best one);
    - ``repeat_penalty`` > 0 (1 = off; llama.cpp's rule), ``presence_penalty`` and
      ``frequency_penalty`` in [-2, 2] (0 = off; OpenAI's rule), over the last
      ``penalty_last_n`` tokens of the sequence, prompt included (default 64; 0 = off, -1 = the
      whole sequence);
    - ``logit_bias``: ``{token id: bias}`` added to those logits (``-inf`` or -100 bans a token);
      at most ``MAX_LOGIT_BIAS`` (1024) entries;
    - ``seed``: the request's own random generator (same seed, same tokens, whatever else is
      batched with it);
    - ``stop``: strings that end generation (matched across token boundaries, never emitted):
      one string or a list of at most ``MAX_STOPS`` (256), each at most ``MAX_STOP_CHARS``
      (512) characters (empty strings are ignored);
    - ``ignore_eos``: keep generating past end-of-generation tokens;
    - ``logprobs``: N in [0, 20] (None = off): each generated token's log-probability under
      the model's own distribution (log-softmax of the raw logits) and the N most probable
      tokens of that step, in :attr:`kvserve.GenerateResult.logprobs`.

    The chain and the rules are in :mod:`kvserve.sampling`.
    """

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    repeat_penalty: float
    presence_penalty: float
    frequency_penalty: float
    penalty_last_n: int
    logit_bias: Mapping[int, float] | None
    seed: int | None
    stop: Stop
    ignore_eos: bool
    logprobs: int | None


class RequestOptions(SamplingOptions, total=False):
    """What an :class:`kvserve.Engine` call takes beyond :class:`SamplingOptions`.

    - ``priority``: an integer in [``PRIORITY_MIN``, ``PRIORITY_MAX``] = [-1000, 1000], default
      0; higher is admitted first and preempted last (FCFS within a priority).
    - ``session_id``: the conversation this request belongs to (a non-empty string): the
      prompt continues the session's previous prompts and outputs, whose K/V is reused; an
      unknown id starts a new session. See :class:`kvserve.Engine`.
    - ``context_shift``: when the sequence reaches the engine's ``ctx_size``, drop the older
      half of its context after the first ``n_keep`` tokens and go on generating (llama.cpp's
      ``--context-shift``); default: the engine's ``context_shift``.
    - ``n_keep``: prompt tokens a context shift keeps, besides the BOS (always kept when the
      model adds one); default 0; ``0 <= n_keep < ctx_size``.
    - ``tenant``: who the request is for (1 to 64 characters; default None, the engine's own
      namespace). Tenants share compute fairly (the engine's ``tenants`` policies: weight,
      KV share), and the prefix cache of a tenant is its own unless its policy shares it.
    - ``cache_salt``: a string (1 to 256 characters) mixed into the content keys of the
      request's K/V blocks, so that it reuses cached prefixes only of requests with the same
      salt (and tenant), as vLLM's ``cache_salt``; default None.
    - Structured output (at most one; see :mod:`kvserve.grammar`): ``response_format``
      (OpenAI's: ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
      {"schema": {...}, "strict": bool}}``, ``{"type": "text"}``), ``grammar`` (Lark or GBNF
      text), ``json_schema`` (a schema). A bad one is a ``ValueError``
      (:class:`kvserve.grammar.GrammarError`) naming the problem.
    - ``prompt_logprobs``: N in [0, 20] (None = off): the log-probability of every prompt
      token after the first under the model given the tokens before it (log-softmax of the
      raw logits of the position before it) and the N most probable tokens there, in
      :attr:`kvserve.GenerateResult.prompt_logprobs` (what scoring harnesses need: with
      ``max_tokens=0`` nothing is generated). They are computed in the request's own prefill
      (logits of every prompt row, reduced to the entries as each chunk is computed): the
      request reuses no cached prefix (only what a preemption left computed), and it cannot
      continue a session (``session_id``).
    """

    priority: int
    session_id: str | None
    context_shift: bool
    n_keep: int
    tenant: str | None
    cache_salt: str | None
    response_format: Mapping[str, Any] | None
    grammar: str | None
    json_schema: Mapping[str, Any] | str | None
    prompt_logprobs: int | None


_KEYS = frozenset(SamplingOptions.__annotations__)
_REQUEST_KEYS = _KEYS | frozenset(RequestOptions.__annotations__)


@dataclass
class Resolved:
    """Validated options: a ready sampler plus the stop rules and what to report."""

    sampler: Sampler
    stops: list[str]
    ignore_eos: bool
    priority: int
    session_id: str | None = None
    context_shift: bool | None = None  # None: the engine's default
    n_keep: int = 0
    logprobs: int | None = None  # alternatives per token, None: no logprobs
    tenant: str | None = None
    cache_salt: str | None = None
    constraint: Constraint | None = None  # structured output (kvserve.grammar)
    prompt_logprobs: int | None = None  # alternatives per prompt token, None: not asked


def stop_list(stop: Stop) -> list[str]:
    """The non-empty stop strings of ``stop`` (a string, a sequence of strings or None);
    ``ValueError`` beyond :data:`MAX_STOPS` entries or :data:`MAX_STOP_CHARS` characters."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, Sequence):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if len(stop) > MAX_STOPS:
        raise ValueError(f"stop must have at most {MAX_STOPS} strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop must be a string or a list of strings, got an item {s!r}")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop strings must have at most {MAX_STOP_CHARS} characters, got {len(s)}"
            )
    return [s for s in stop if s]


def resolve(
    options: SamplingOptions | RequestOptions,
    *,
    n_vocab: int | None = None,
    engine: bool = False,
) -> Resolved:
    """Checks ``options`` (an unknown name is a ``TypeError``, a bad value a ``ValueError``
    naming the argument and its limit) and builds the sampler. ``n_vocab``: the model's
    vocabulary, which ``logit_bias`` ids must lie in. ``engine``: the :class:`RequestOptions`
    of an Engine call are allowed too."""
    unknown = set(options) - (_REQUEST_KEYS if engine else _KEYS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    # Without ``engine`` the keys were just checked to be SamplingOptions': the engine-only
    # ones read below are then absent and take their defaults.
    options = cast(RequestOptions, options)
    bias = options.get("logit_bias")
    if isinstance(bias, Mapping) and len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    params = SamplingParams(  # ValueError naming the argument
        temperature=options.get("temperature", 0.0),
        top_k=options.get("top_k", 0),
        top_p=options.get("top_p", 1.0),
        min_p=options.get("min_p", 0.0),
        typical_p=options.get("typical_p", 1.0),
        repeat_penalty=options.get("repeat_penalty", 1.0),
        presence_penalty=options.get("presence_penalty", 0.0),
        frequency_penalty=options.get("frequency_penalty", 0.0),
        penalty_last_n=options.get("penalty_last_n", DEFAULT_PENALTY_LAST_N),
        logit_bias={} if bias is None else bias,
    )
    priority = options.get("priority", 0)
    if (
        isinstance(priority, bool)
        or not isinstance(priority, numbers.Integral)
        or not PRIORITY_MIN <= priority <= PRIORITY_MAX
    ):
        raise ValueError(
            f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority!r}"
        )
    stops = stop_list(options.get("stop"))
    session_id = options.get("session_id")
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise ValueError(f"session_id must be a non-empty string or None, got {session_id!r}")
    n_keep = options.get("n_keep", 0)
    if isinstance(n_keep, bool) or not isinstance(n_keep, int) or n_keep < 0:
        raise ValueError(f"n_keep must be an integer >= 0, got {n_keep!r}")
    tenant = _opt_str(options, "tenant", MAX_TENANT_CHARS)
    cache_salt = _opt_str(options, "cache_salt", MAX_CACHE_SALT_CHARS)
    context_shift = options.get("context_shift")
    if context_shift is not None and not isinstance(context_shift, bool):
        raise ValueError(f"context_shift must be True or False, got {context_shift!r}")
    if n_vocab is not None:
        params.check_vocab(n_vocab)
    logprobs = _logprobs(options, "logprobs")
    prompt_logprobs = _logprobs(options, "prompt_logprobs")
    if prompt_logprobs is not None and session_id is not None:
        raise ValueError(
            "prompt_logprobs cannot be combined with session_id (a turn continues K/V whose"
            " rows were not kept)"
        )
    constraint = None
    if any(options.get(k) is not None for k in ("response_format", "grammar", "json_schema")):
        from .grammar import constraint_from  # llguidance only when a request asks

        constraint = constraint_from(
            options.get("response_format"), options.get("grammar"), options.get("json_schema")
        )
    return Resolved(
        sampler=Sampler(params, seed=options.get("seed")),
        stops=stops,
        ignore_eos=options.get("ignore_eos", False),
        priority=int(priority),
        session_id=session_id,
        context_shift=context_shift,
        n_keep=n_keep,
        logprobs=logprobs,
        tenant=tenant,
        cache_salt=cache_salt,
        constraint=constraint,
        prompt_logprobs=prompt_logprobs,
    )


def _logprobs(options: RequestOptions, name: str) -> int | None:
    """Option ``name`` (``logprobs``, ``prompt_logprobs``): None or an integer in [0, 20]."""
    value = options.get(name)
    integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if value is not None and (not integer or not 0 <= value <= MAX_LOGPROBS):
        raise ValueError(
            f"{name} must be an integer in [0, {MAX_LOGPROBS}] (None: off), got {value!r}"
        )
    return None if value is None else int(value)


def _opt_str(options: RequestOptions, name: str, limit: int) -> str | None:
    """Option ``name``: None or a string of 1 to ``limit`` characters (else ``ValueError``)."""
    value = options.get(name)
    if value is not None and (not isinstance(value, str) or not 1 <= len(value) <= limit):
        raise ValueError(
            f"{name} must be a string of 1 to {limit} characters or None, got {value!r}"
        )
    return value
