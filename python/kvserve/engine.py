"""kvserve.Engine: one model shared by many callers through continuous batching.

One engine thread owns one decoding context over the model's shared K/V memory and runs
*steps*; callers (sync calls from any thread, async calls from any task) only queue requests
and receive results. The thread sleeps on a condition while there is nothing to do.

One step:
1. take new requests and cancellations queued since the last step (cancelled sequences are
   removed with ``seq_rm``; their full blocks stay cached for prefix reuse);
2. admit waiting requests, highest ``priority`` first and FCFS within a priority, while fewer
   than ``parallel`` run and the pool has room for the prompt (plus a block to grow) beside
   what the running sequences still need; an admitted request first maps the longest cached
   prefix of its tokens (``match_prefix``), so only the rest is computed. A request whose
   prompt starts with whole blocks that a running request is prefilling right now waits
   (keeping its place) until they are computed and cached, instead of computing them again.
   While the step's prompt budget is taken, a request of the head's priority that needs at
   most a few blocks of prompt computed (the rest cached: a shared document, a session's next
   turn) is admitted out of turn if memory and a slot (leaving one for the head) allow;
3. build ONE batch: one token for every sequence that is generating, then chunks of the
   prompts still being prefilled (short remainders first, then highest priority, earliest
   first) up to ``batch_tokens``
   tokens in all (chunked prefill: a long prompt never stalls the running streams for more
   than one chunk);
4. ``decode`` it (the GIL is released). If the pool cannot hold the batch (``KvCacheFull``),
   the lowest-priority, latest-arrived sequence is *preempted* (its blocks released; it goes
   back to the waiting queue with its place and is later resumed by recomputing its prompt and
   generated tokens, with prefix reuse), and the batch is rebuilt and retried. Only a request
   that cannot fit when it runs alone fails (``KvCacheFull``);
5. sample every row at once (greedy rows without logit bias or penalties with one argmax over
   the batch; the others with each request's own sampler: bias and penalties over its tokens,
   then argmax or its own seeded generator, so a seeded request gives the same tokens whatever
   else is in the batch), deliver the text (and the token's logprobs when asked), check
   end-of-generation, stop strings, max_tokens and ``ctx_size``, and retire finished sequences.

Per-step cost: O(R + T + W_admitted) Python work plus the argmax/sampling over R rows of
``n_vocab`` logits, where R is the number of running sequences (at most ``parallel``), T the
batch's tokens (at most ``batch_tokens`` plus R) and W_admitted the requests admitted in the
step (each O(log W) out of a heap of W waiting requests); a step whose prompt budget is full
also peeks at the cached prefix of the first 2 x parallel waiting requests (the fast lane:
O(min(W, 2P) x prompt blocks) hash lookups). Otherwise nothing scans all requests: cancelled
waiting requests are dropped lazily when they reach the head of the queue; only a preemption
scans the R running sequences for its victim.

Generation follows :meth:`kvserve.Model.generate` exactly (same tokenization, stop rules,
``finish_reason`` and text assembly), so a greedy request gives the tokens that model's own
generation gives for the same prompt.

Sessions (``session_id=``; the bookkeeping lives in :mod:`kvserve.sessions`):
- A session is a named conversation: its tokens (every prompt and output so far) and, while it
  is *resident*, a sequence of the context that holds their K/V between requests (a *parked*
  sequence: sequence ids are not limited to ``parallel``; at most ``parallel`` sequences run).
  A request on a session continues it: its prompt is tokenized without BOS and appended to the
  session's tokens, and the request starts from the parked sequence, so only the new tokens are
  computed (``cached_tokens`` counts the rest). A finished turn (``stop``/``length``) decodes
  its last output token too before it parks (one more row in the next step, no logits), so the
  next turn computes only its own tokens. A turn that fails or is cancelled leaves the session
  as it was. An unknown id starts a new session (the prompt as usual, with BOS).
- One request at a time per session: a second request on a busy session waits until the
  first has finished (FIFO per session; the waiting time counts as ``waiting``), and so do
  ``save_session``/``drop_session`` called on a busy session.
- Reclaim: after every step, when the pool's usage (referenced blocks / total) is above
  ``kv_high_watermark``, idle resident sessions are *evicted* — lowest priority (of their last
  request) first, least recently used first within a priority — until usage is at most
  ``kv_low_watermark``. When the pool is short for running requests (admission or a decode),
  idle sessions are evicted first, then the K/V of sessions whose next request is still
  waiting, and only then is a running request preempted. Evicting releases the sequence (its
  full blocks stay in the prefix index as cached blocks) and keeps the tokens: the session's
  next turn recomputes its K/V, mapping what is still cached (``session_misses`` counts such
  turns). A session idle for ``session_ttl`` seconds is dropped (tokens too); with
  ``max_sessions`` set, creating or loading one more drops the least recently used idle
  session (an error if every session is busy).
- ``save_session`` writes a session (tokens, random generator state, and the K/V of its cells
  as stored; with sliding-window layers, what each layer group holds) to a checksummed file
  atomically; ``load_session`` restores it without recomputation. Session operations run on
  the engine thread between steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import re
import struct
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

import numpy as np
from typing_extensions import Unpack

from . import models
from ._model import (
    FINISH_CONTEXT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerateResult,
    KvCacheFull,
    Model,
    StrPath,
    prompt_ids,
    token_logprob,
)
from .options import RequestOptions, resolve
from .sampling import Sampler, TokenLogprob
from .sessions import (
    Session,
    SessionFileError,
    SessionInfo,
    SessionTable,
    Turn,
    check_header,
    read_session_file,
    write_session_file,
)
from .textstream import TextStream

if TYPE_CHECKING:
    from .chat import Message

__all__ = ["Delta", "Engine", "SessionFileError", "SessionInfo", "parse_size"]

T = TypeVar("T")

# Seconds of recent steps that ``decode_tok_s`` averages over.
_RATE_WINDOW_S = 10.0

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size string: ``"2GiB"``, ``"512MiB"``, ``"1.5G"`` (binary units;
    ``"KB"``, ``"MB"``, ``"GB"``, ``"TB"`` are decimal), ``"1000000"``."""
    if isinstance(size, bool):
        raise ValueError(f"kv_memory must be bytes or a size string such as '2GiB', got {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"kv_memory must be > 0 bytes, got {size}")
        return size
    m = _SIZE_RE.match(size) if isinstance(size, str) else None
    if m is None:
        raise ValueError(f"kv_memory must be bytes or a size string such as '2GiB', got {size!r}")
    number, unit, binary, b = m.groups()
    decimal = unit != "" and b != "" and binary == ""
    value = int(float(number) * (1000 if decimal else 1024) ** _SIZE_POWER[unit.lower()])
    if value <= 0:
        raise ValueError(f"kv_memory must be > 0 bytes, got {size!r}")
    return value


# -- requests and where their output goes -----------------------------------------------------

_NEW, _WAITING, _RUNNING, _DONE = range(4)


class _Sink:
    """Where a request's output goes; the engine thread calls these (never blocking).
    ``logprobs`` (None when not asked): the entries of the tokens delivered since the previous
    call, so the entries of all calls join to the result's ``logprobs``."""

    def piece(self, text: str, logprobs: list[TokenLogprob] | None) -> None:
        pass  # a piece of text (whole characters, never empty)

    def done(self, result: GenerateResult, logprobs: list[TokenLogprob] | None) -> None:
        raise NotImplementedError

    def fail(self, error: BaseException) -> None:
        raise NotImplementedError


class _FutureSink(_Sink):
    """A sync caller waits on a ``concurrent.futures.Future``."""

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[GenerateResult] = concurrent.futures.Future()

    def done(self, result: GenerateResult, logprobs: list[TokenLogprob] | None) -> None:
        if not self.future.done():
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


def _resolve(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if isinstance(error, asyncio.CancelledError):
        fut.cancel()  # a cancelled request: nothing to report (and nothing logged)
    elif error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class _End:
    """The last item of a stream's queue: the request's error (None when it finished) and its
    result."""

    def __init__(self, error: BaseException | None, result: GenerateResult | None = None) -> None:
        self.error = error
        self.result = result


class _LoopSink(_Sink):
    """An async caller: everything is handed to its event loop with ``call_soon_threadsafe``,
    either the result to an asyncio future or the pieces and the end to a stream's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.loop = loop
        self.result: asyncio.Future[GenerateResult] = loop.create_future()
        self.queue: asyncio.Queue[str | _End] | None = asyncio.Queue() if stream else None

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def piece(self, text: str, logprobs: list[TokenLogprob] | None) -> None:
        if self.queue is not None:
            self._call(self.queue.put_nowait, text)

    def done(self, result: GenerateResult, logprobs: list[TokenLogprob] | None) -> None:
        if self.queue is not None:
            self._call(self.queue.put_nowait, _End(None, result))
        else:
            self._call(_resolve, self.result, result, None)

    def fail(self, error: BaseException) -> None:
        if self.queue is not None:
            self._call(self.queue.put_nowait, _End(error))
        else:
            self._call(_resolve, self.result, None, error)


@dataclass(frozen=True)
class Delta:
    """One step of one choice's output, as :meth:`Engine.choices` streams it.

    ``index``: the choice (0 to n - 1). ``text``: the new text (whole characters; empty only
    in a choice's last delta). ``logprobs`` (None when not asked): the entries of the tokens
    delivered since the choice's previous delta (a token whose text is held back, such as the
    start of a possible stop string, comes with the text it becomes part of, or in the last
    delta), so a choice's entries join to its result's ``logprobs``. ``result``: set in the
    choice's last delta (finish reason, tokens, token counts), None before."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None = None
    result: GenerateResult | None = None


class _ChoiceSink(_Sink):
    """One choice of :meth:`Engine.choices`: its deltas go to the stream's shared queue (the
    error of a failed choice as an ``_End``) through the event loop."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Delta | _End], index: int
    ) -> None:
        self.loop = loop
        self.queue = queue
        self.index = index

    def _put(self, item: Delta | _End) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def piece(self, text: str, logprobs: list[TokenLogprob] | None) -> None:
        self._put(Delta(self.index, text, logprobs))

    def done(self, result: GenerateResult, logprobs: list[TokenLogprob] | None) -> None:
        self._put(Delta(self.index, "", logprobs, result))

    def fail(self, error: BaseException) -> None:
        self._put(_End(error))


class _Request:
    """One generation as the engine thread sees it."""

    def __init__(
        self,
        ids: list[int],
        max_tokens: int,
        sampler: Sampler,
        stops: list[str],
        ignore_eos: bool,
        priority: int,
        logprobs: int | None = None,
    ) -> None:
        self.ids = ids  # prompt, then the generated tokens (the penalties' history)
        self.n_prompt = len(ids)
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.stops = stops
        self.ignore_eos = ignore_eos
        self.priority = priority
        self.key: tuple[int, int] = (-priority, 0)  # set on submission: (-priority, arrival)
        self.sink: _Sink = _FutureSink()
        self.state = _NEW
        self.cancel_requested = False
        self.seq = -1  # sequence id in the context while running
        self.n_done = 0  # ids[:n_done] have their K/V in the context
        self.cached_tokens = -1  # prompt tokens reused at first admission (-1: not yet)
        self.session_cached = 0  # of those, held by its resident session (the rest: prefix index)
        self.text = TextStream(stops)
        self.pieces: list[str] = []
        # Context shift: the sequence holds ids[:keep] + ids[keep + shift:] at positions 0, 1,
        # ...; n_done and the plan's indices count in that view (see context()).
        self.context_shift = False
        self.keep = 0
        self.shift = 0
        # logprobs: alternatives per token (None: not asked); one entry per delivered token,
        # appended as each is delivered (``pending_logprob``: the entry of the token just picked).
        self.n_logprobs = logprobs
        self.logprobs: list[TokenLogprob] | None = None if logprobs is None else []
        self.pending_logprob: TokenLogprob | None = None
        self.logprobs_sent = 0  # entries already handed to the sink
        self.turn: Turn | None = None  # the session part (session requests only)
        # n > 1 (Engine.choices): the other choices, forked from this request's sequence
        # (seq_cp) when its prompt is computed; emptied then. They wait with it until then.
        self.children: list[_Request] = []

    @property
    def n_generated(self) -> int:
        return len(self.ids) - self.n_prompt

    @property
    def n_tokens(self) -> int:
        """Tokens of the sequence's context (prompt and output less what shifts dropped)."""
        return len(self.ids) - self.shift

    def context(self, a: int = 0, b: int | None = None) -> list[int]:
        """Tokens ``[a, b)`` of the context (``b`` None: to its end); token ``i`` sits at
        position ``i``. Without a shift this is ``ids[a:b]`` (no copy for the whole)."""
        ids, keep, shift = self.ids, self.keep, self.shift
        if b is None:
            b = len(ids) - shift
        if shift == 0:
            return ids if (a, b) == (0, len(ids)) else ids[a:b]
        if b <= keep:
            return ids[a:b]
        if a >= keep:
            return ids[a + shift : b + shift]
        return ids[a:keep] + ids[keep + shift : b + shift]

    def unsent_logprobs(self) -> list[TokenLogprob] | None:
        """The logprob entries not yet handed to the sink (None when not asked); marks them
        sent."""
        if self.logprobs is None:
            return None
        new = self.logprobs[self.logprobs_sent :]
        self.logprobs_sent = len(self.logprobs)
        return new

    @property
    def argmax_only(self) -> bool:
        """Greedy without bias or penalties: the token is the argmax of the raw logits."""
        return self.sampler.params.is_plain_greedy


class _Call:
    """Work a caller hands to the engine thread (session operations); ``session_id``: run it
    when that session is idle (FIFO behind its requests)."""

    def __init__(self, fn: Callable[[], Any], session_id: str | None) -> None:
        self.fn = fn
        self.session_id = session_id
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run(self) -> None:
        if self.future.done():
            return
        try:
            self.future.set_result(self.fn())
        except BaseException as e:  # handed to the caller
            self.future.set_exception(e)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _primary_section(kv: bytes) -> int:
    """Offset of the cells of the primary (first full-attention, else first) K/V group in a
    sequence state (rust/core/src/kv/state.rs): 0 for a one-group state (version 1); in a
    layer-group state (version 2: the group count at byte 24, then 20 bytes per group — kind,
    window and layers as u32, section length as u64 — then the sections in that order) the
    offset of that group's section. -1 if the bytes are too short to say."""
    if len(kv) < 28 or int.from_bytes(kv[4:8], "little") != 2:
        return 0
    n = int.from_bytes(kv[24:28], "little")
    table = 28 + 20 * n
    if n == 0 or len(kv) < table:
        return -1
    entries = [struct.unpack_from("<IIIQ", kv, 28 + 20 * i) for i in range(n)]
    primary = next((i for i, e in enumerate(entries) if e[0] == 0), 0)
    return table + sum(e[3] for e in entries[:primary])


def _check_state(kv: bytes, tokens: list[int], path: StrPath) -> None:
    """A session's K/V state must hold exactly ``tokens`` at positions ``0..n-1`` in its primary
    group (the core's sequence state layout, rust/core/src/kv/state.rs: from the section's
    start, the cell count at byte 44, then the positions and the token ids as little-endian
    32-bit integers). The core checks the rest (every other group's cells are the primary's)."""
    n = len(tokens)
    at = _primary_section(kv)
    ok = at >= 0 and len(kv) >= at + 48 + 8 * n
    ok = ok and int.from_bytes(kv[at + 44 : at + 48], "little") == n
    if ok and n:
        cells = np.frombuffer(kv, dtype="<i4", count=2 * n, offset=at + 48)
        ok = bool(np.array_equal(cells[:n], np.arange(n))) and cells[n:].tolist() == tokens
    if not ok:
        raise SessionFileError(
            f"session file {path}: its K/V state does not hold the session's {n} tokens"
        )


# -- the engine ------------------------------------------------------------------------------


def _load_model(model: Model | StrPath | None, threads: int | None) -> Model:
    if isinstance(model, Model):
        if threads is not None:
            raise ValueError("threads applies only when the engine loads the model; got a Model")
        return model
    if model is None:
        return Model.load(None, threads)
    if isinstance(model, str) and model in models.REGISTRY and not Path(model).exists():
        return Model(models.pull(model, quiet=True), threads)
    return Model(model, threads)


def _group_stats(st: dict[str, Any]) -> dict[str, float | int]:
    """``kv_<kind>_*`` counters of each layer group in a context's ``stats()``."""
    out: dict[str, float | int] = {}
    for g in st.get("groups", []):
        k = str(g["kind"])
        total, used = int(g["blocks_total"]), int(g["blocks_referenced"])
        out[f"kv_{k}_layers"] = int(g["layers"])
        out[f"kv_{k}_blocks_total"] = total
        out[f"kv_{k}_blocks_used"] = used
        out[f"kv_{k}_blocks_cached"] = int(g["blocks_cached"])
        out[f"kv_{k}_bytes_used"] = int(g["bytes_referenced"])
        out[f"kv_{k}_bytes_total"] = int(g["bytes_total"])
        out[f"kv_{k}_usage"] = used / total if total else 0.0
    return out


class Engine:
    """Serves one model to many callers at once; see the module docs.

    ``model``: a :class:`Model`, a GGUF path or a registered model name; None = the default
    model. ``threads``: worker threads when the engine loads the model. ``parallel``: the most
    sequences decoded together. ``ctx_size``: the most tokens (prompt + output) of one
    sequence. ``kv_memory``: the K/V pool in bytes (an int or a size string such as
    ``"2GiB"``); None sizes it for ``parallel x ctx_size`` tokens. The pool is the model's
    (shared with its other contexts of the same ``kv_type``); if it exists already and is in
    use, it is shared as it is. ``batch_tokens``: tokens per step for prompts (chunked prefill;
    generating sequences always get their one token). ``prefix_cache``: reuse and publish
    cached prompt prefixes. ``context_shift``: the default of the per-request option (a
    sequence that reaches ``ctx_size`` drops the older half of its context after ``n_keep``
    tokens and goes on, as llama.cpp's ``--context-shift``; off: it finishes with
    ``finish_reason="context"``).

    Sessions (module docs): ``kv_high_watermark`` / ``kv_low_watermark`` (0 < low <= high <= 1):
    idle sessions are evicted when the pool's usage passes the high mark, down to the low mark;
    ``session_ttl``: seconds an idle session is kept (None: no limit); ``max_sessions``: most
    sessions held at once (None: no limit). ``max_tokens_limit``: the most tokens one request
    may ask to generate (``max_tokens`` above it is a ``ValueError``; None: no limit), so that
    neither ``ignore_eos`` nor ``context_shift`` holds a slot without end. The engine's context
    may use the whole K/V pool, so idle sessions can hold whatever the running requests leave;
    the reclaim rules keep it so.
    """

    def __init__(
        self,
        model: Model | StrPath | None = None,
        *,
        threads: int | None = None,
        parallel: int = 16,
        ctx_size: int = 4096,
        kv_memory: int | str | None = None,
        kv_type: str = "f16",
        batch_tokens: int = 512,
        prefix_cache: bool = True,
        context_shift: bool = False,
        kv_high_watermark: float = 0.9,
        kv_low_watermark: float = 0.7,
        session_ttl: float | None = None,
        max_sessions: int | None = None,
        max_tokens_limit: int | None = None,
    ) -> None:
        for name, value in (
            ("parallel", parallel),
            ("ctx_size", ctx_size),
            ("batch_tokens", batch_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0.0 < kv_low_watermark <= kv_high_watermark <= 1.0:
            raise ValueError(
                "watermarks must satisfy 0 < kv_low_watermark <= kv_high_watermark <= 1, got"
                f" {kv_low_watermark} and {kv_high_watermark}"
            )
        if session_ttl is not None and not session_ttl > 0:
            raise ValueError(f"session_ttl must be > 0 seconds or None, got {session_ttl}")
        if max_sessions is not None and max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1 or None, got {max_sessions}")
        if max_tokens_limit is not None and max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1 or None, got {max_tokens_limit}")
        kv_bytes = None if kv_memory is None else parse_size(kv_memory)
        self.model = _load_model(model, threads)
        # The context may use the whole pool (its token limit is the pool): idle sessions are
        # parked beside the running sequences, and the reclaim policy, not the context's
        # n_ctx, decides how much they keep. The pool is sized for parallel x ctx_size tokens
        # unless kv_memory says otherwise.
        self._ctx = self.model.core.new_context(
            parallel * ctx_size,
            kv_type=kv_type,
            kv_memory=kv_bytes,
            prefix_cache=prefix_cache,
            memory_tokens=None if kv_bytes is not None else parallel * ctx_size,
            # Sliding-window memory is sized for the running sequences and one step's batch
            # (prompt chunks of batch_tokens plus one token per running sequence).
            n_seq_max=parallel,
            n_batch=batch_tokens + parallel,
        )
        st = self._ctx.stats()
        self.kv_type = str(st["kv_type"])
        self._block = int(st["block_size"])
        pool_tokens = int(st["blocks_total"]) * self._block
        self.parallel = parallel
        self.batch_tokens = batch_tokens
        # Prompt tokens left to compute that still let a waiting request skip the queue while
        # the step's prompt budget is taken (see _admit): four blocks, or 1/8 of the budget.
        self._fast_lane = max(4 * self._block, batch_tokens // 8)
        self.prefix_cache = prefix_cache
        self.context_shift = bool(context_shift)
        self.ctx_size = ctx_size
        self.max_tokens_limit = max_tokens_limit
        # The longest sequence that can exist: ctx_size, unless the pool holds less.
        self._seq_limit = min(ctx_size, self._ctx.n_ctx, pool_tokens)
        self._limit_name = (
            f"ctx_size={ctx_size}"
            if self._seq_limit == ctx_size
            else f"the KV pool's {self._seq_limit} tokens (kv_memory)"
        )

        self._cond = threading.Condition()
        self._closed = False
        self._fatal: str | None = None  # why the engine thread stopped, if it did unasked
        self._waiting_prio: dict[int, int] = {}  # waiting sequences by priority (for metrics)
        self._inbox: list[_Request] = []  # submitted, not yet seen by the engine thread
        self._cancels: list[_Request] = []
        self._arrival = itertools.count()
        # Engine-thread state.
        self._waiting: list[tuple[tuple[int, int], _Request]] = []  # heap by key
        self._n_waiting = 0
        self._running: dict[int, _Request] = {}  # sequence id -> request
        self._free_seqs = list(range(parallel - 1, -1, -1))
        self._next_seq = parallel  # sequence ids beyond: parked sessions hold ids too
        self._calls: list[_Call] = []  # session operations for the engine thread
        self._sessions = SessionTable()
        self.kv_high_watermark = kv_high_watermark
        self.kv_low_watermark = kv_low_watermark
        self.session_ttl = session_ttl
        self.max_sessions = max_sessions
        # Counters (written by the engine thread, read by stats()).
        self._prompt_tokens = 0
        self._cached_prompt_tokens = 0
        self._generated_tokens = 0
        self._computed_tokens = 0
        self._preemptions = 0
        self._evictions = 0
        self._session_misses = 0
        self._session_cached_tokens = 0
        # (time, prompt tokens, cached tokens) of recent admissions: the recent hit rate.
        self._recent_prompts: deque[tuple[float, int, int]] = deque()
        self._recent: deque[tuple[float, int, float]] = deque()  # (end, tokens, seconds)
        self._is_eog = self.model.is_eog
        self._piece = self.model.token_to_piece

        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread; requests still queued or running fail with RuntimeError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------------
    def _request(
        self, prompt: str | Sequence[int], max_tokens: int, options: RequestOptions
    ) -> _Request:
        """Validates everything and builds the request (nothing is queued yet); ``prompt`` is
        text or the token ids to feed as they are."""
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if self.max_tokens_limit is not None and max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"max_tokens must be <= max_tokens_limit={self.max_tokens_limit}, got {max_tokens}"
            )
        # TypeError / ValueError naming the argument
        opts = resolve(options, n_vocab=self.model.n_vocab, engine=True)
        ids = prompt_ids(self.model, prompt) if isinstance(prompt, str) else self._ids(prompt)
        turn = None
        n = len(ids)
        if opts.session_id is not None:
            # Text continues the session (no second BOS); token ids (a chat) give the whole
            # conversation, which reuses the longest prefix the session holds.
            cont = (
                self.model.tokenize(prompt, add_special=False, parse_special=True)
                if isinstance(prompt, str)
                else None
            )
            turn = Turn(opts.session_id, ids, cont)
            s = self._sessions.get(opts.session_id)  # a snapshot, to check the length early
            if s is not None and s.ids and cont is not None:
                n = len(s.ids) + len(cont)
        if n > self._seq_limit:
            what = "the prompt" if n == len(ids) else "the session with this prompt"
            raise ValueError(f"{what} has {n} tokens, more than {self._limit_name} allows")
        req = _Request(
            ids,
            max_tokens,
            opts.sampler,
            opts.stops,
            opts.ignore_eos,
            opts.priority,
            logprobs=opts.logprobs,
        )
        req.context_shift = self.context_shift if opts.context_shift is None else opts.context_shift
        req.keep = self._keep(opts.n_keep)
        req.turn = turn
        return req

    def _keep(self, n_keep: int) -> int:
        """Tokens a context shift keeps at the start (llama.cpp's server rule: ``n_keep``, plus
        the BOS when the model adds one, at most the limit less 4)."""
        if n_keep >= self._seq_limit:
            raise ValueError(f"n_keep must be < {self._limit_name}, got {n_keep}")
        return max(0, min(self._seq_limit - 4, n_keep + int(self.model.add_bos)))

    def _ids(self, tokens: Sequence[int]) -> list[int]:
        """``tokens`` checked as a prompt of token ids (a ``ValueError`` naming the bad one)."""
        ids = list(tokens)
        if not ids:
            raise ValueError("the prompt has no tokens")
        n_vocab = self.model.n_vocab
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
                raise ValueError(f"prompt token {i} is {t!r}, not a token id in [0, {n_vocab})")
        return ids

    def _submit(self, req: _Request) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            req.key = (-req.priority, next(self._arrival))
            for child in req.children:  # after it, in choice order
                child.key = (-child.priority, next(self._arrival))
            self._inbox.append(req)
            self._cond.notify()

    def _cancel(self, *reqs: _Request) -> None:
        """Ask the engine thread to drop ``reqs`` at its next step."""
        with self._cond:
            for req in reqs:
                if req.state != _DONE and not req.cancel_requested:
                    req.cancel_requested = True
                    self._cancels.append(req)
            self._cond.notify()

    def generate(
        self,
        prompt: str,
        max_tokens: int = 128,
        **options: Unpack[RequestOptions],
    ) -> GenerateResult:
        """Complete ``prompt`` (blocking; any thread). ``options``: see
        :class:`kvserve.options.RequestOptions` (sampling, stop rules, ``priority``,
        ``session_id``: continue that session, see the module docs)."""
        return self._wait(self._request(prompt, max_tokens, options))

    def _wait(self, req: _Request) -> GenerateResult:
        sink = _FutureSink()
        req.sink = sink
        self._submit(req)
        try:
            return sink.future.result()
        except BaseException:
            self._cancel(req)
            raise

    async def agenerate(
        self,
        prompt: str,
        max_tokens: int = 128,
        **options: Unpack[RequestOptions],
    ) -> GenerateResult:
        """:meth:`generate` for asyncio; cancelling the task cancels the request."""
        return await self._await(self._request(prompt, max_tokens, options))

    async def _await(self, req: _Request) -> GenerateResult:
        sink = _LoopSink(asyncio.get_running_loop(), stream=False)
        req.sink = sink
        self._submit(req)
        try:
            return await sink.result
        finally:
            self._cancel(req)  # no-op once the request is done

    def stream(
        self,
        prompt: str,
        max_tokens: int = 128,
        **options: Unpack[RequestOptions],
    ) -> AsyncGenerator[str, None]:
        """``async for piece in engine.stream(...)``: text pieces (whole characters) as they
        come; they join to :meth:`generate`'s text. Arguments are checked at the call; the
        request is queued when iteration starts. Closing the iterator early (``break``,
        ``aclose()``) or cancelling its task cancels the request."""
        req = self._request(prompt, max_tokens, options)
        return cast("AsyncGenerator[str, None]", self._stream(req))  # only str without results

    def events(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        **options: Unpack[RequestOptions],
    ) -> AsyncGenerator[str | GenerateResult, None]:
        """:meth:`stream` that ends with the request's :class:`GenerateResult` (finish reason,
        token counts, tokens): text pieces (``str``) as they come, then the result as the last
        item. ``prompt`` is text, or token ids fed as they are (no BOS added; each checked
        against the vocabulary). This is what a server needs to stream and then report usage."""
        req = self._request(prompt, max_tokens, options)
        return self._stream(req, with_result=True)

    def choices(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        n: int = 1,
        **options: Unpack[RequestOptions],
    ) -> AsyncGenerator[Delta, None]:
        """``n`` completions of one prompt, streamed as :class:`Delta` items (each choice's
        deltas in order, the choices interleaved as they come; each choice ends with a delta
        that carries its result). ``prompt`` is text or token ids, as for :meth:`events`.

        The prompt is computed once: the request runs as one sequence until its prompt is
        computed, then the other ``n - 1`` choices fork from it (``seq_cp``: they share its
        K/V blocks; a partial last block is copied when a choice first writes into it), each
        picks its first token from the same logits and goes on as a sequence of its own. The
        choices are admitted together (they need ``n`` of the ``parallel`` slots), so
        ``1 <= n <= parallel``. Choice ``j`` samples with its own generator: with ``seed``,
        seeded ``seed + j`` (choice 0 is what the same request with ``n=1`` gives); without,
        each draws fresh entropy. Greedy choices are all the one greedy completion. The
        engine's ``prompt_tokens`` counts the prompt once. With ``session_id``, ``n`` must be 1.
        Arguments are checked at the call; closing the iterator early or cancelling its task
        cancels every choice; the first failed choice raises its error (and cancels the rest).
        """
        reqs = self._group(prompt, max_tokens, n, options)
        return self._stream_choices(reqs)

    def _group(
        self, prompt: str | Sequence[int], max_tokens: int, n: int, options: RequestOptions
    ) -> list[_Request]:
        """The requests of :meth:`choices`: the first, which holds the others as its
        ``children`` until they fork."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.parallel:
            raise ValueError(f"n must be an integer in [1, parallel={self.parallel}], got {n!r}")
        req = self._request(prompt, max_tokens, options)
        if n > 1 and req.turn is not None:
            raise ValueError("n must be 1 with session_id (a session continues one conversation)")
        seed = options.get("seed")
        for j in range(1, n):
            opts = resolve(
                options if seed is None else {**options, "seed": seed + j},
                n_vocab=self.model.n_vocab,
                engine=True,
            )
            child = _Request(
                list(req.ids),
                max_tokens,
                opts.sampler,
                opts.stops,
                opts.ignore_eos,
                opts.priority,
                logprobs=opts.logprobs,
            )
            child.context_shift, child.keep = req.context_shift, req.keep
            req.children.append(child)
        return [req, *req.children]

    async def _stream_choices(self, reqs: list[_Request]) -> AsyncGenerator[Delta, None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta | _End] = asyncio.Queue()
        for i, req in enumerate(reqs):
            req.sink = _ChoiceSink(loop, queue, i)
        self._submit(reqs[0])
        try:
            left = len(reqs)
            while left:
                item = await queue.get()
                if isinstance(item, _End):
                    raise item.error or RuntimeError("a choice ended without a result")
                if item.result is not None:
                    left -= 1
                yield item
        finally:
            self._cancel(*reqs)

    async def _stream(
        self, req: _Request, with_result: bool = False
    ) -> AsyncGenerator[str | GenerateResult, None]:
        sink = _LoopSink(asyncio.get_running_loop(), stream=True)
        assert sink.queue is not None
        req.sink = sink
        self._submit(req)
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    if with_result and item.result is not None:
                        yield item.result
                    break
                yield item
        finally:
            self._cancel(req)

    # -- chat --------------------------------------------------------------------------------
    def chat(
        self,
        messages: Sequence[Message],
        max_tokens: int = 128,
        **options: Unpack[RequestOptions],
    ) -> GenerateResult:
        """Reply to ``messages`` (blocking; any thread): the model's chat template with the
        generation prompt (:meth:`Model.tokenize_chat`), then as :meth:`generate`. Bad messages
        and template errors raise ``ValueError`` at the call, before anything is queued. With
        ``session_id``, ``messages`` is the whole conversation: the turn reuses the longest
        prefix of its tokens that the session holds and computes the rest."""
        return self._wait(self._request(self.model.tokenize_chat(messages), max_tokens, options))

    async def achat(
        self,
        messages: Sequence[Message],
        max_tokens: int = 128,
        **options: Unpack[RequestOptions],
    ) -> GenerateResult:
        """:meth:`chat` for asyncio; cancelling the task cancels the request."""
        req = self._request(self.model.tokenize_chat(messages), max_tokens, options)
        return await self._await(req)

    def stream_chat(
        self,
        messages: Sequence[Message],
        max_tokens: int = 128,
        **options: Unpack[RequestOptions],
    ) -> AsyncGenerator[str, None]:
        """:meth:`stream` for a chat: the reply's text pieces; arguments and messages are
        checked at the call."""
        req = self._request(self.model.tokenize_chat(messages), max_tokens, options)
        return cast("AsyncGenerator[str, None]", self._stream(req))

    # -- sessions ------------------------------------------------------------------------------
    def _on_engine(self, fn: Callable[[], T], session_id: str | None = None) -> T:
        """Runs ``fn`` on the engine thread between steps (after the requests queued on
        ``session_id`` before it) and returns its result or raises its error."""
        call = _Call(fn, session_id)
        if threading.current_thread() is self._thread:
            call.run()  # a callback on the engine thread: queueing would wait for ourselves
        else:
            with self._cond:
                if self._closed:
                    raise RuntimeError("the engine is closed")
                self._calls.append(call)
                self._cond.notify()
        result: T = call.future.result()
        return result

    def sessions(self) -> list[SessionInfo]:
        """Every session held: id, token count, last use (wall time), whether its K/V is
        resident, whether it is busy."""
        return self._on_engine(lambda: [s.info() for s in self._sessions.values()])

    def drop_session(self, session_id: str) -> None:
        """Forgets a session (after the requests already queued on it): its tokens and its
        K/V (full blocks stay cached for prefix reuse). ``KeyError`` for an unknown id."""
        self._on_engine(lambda: self._drop_session(self._session(session_id)), session_id)

    def save_session(self, session_id: str, path: StrPath) -> None:
        """Writes the session (after the requests already queued on it) to ``path``: its
        tokens, random generator state and the K/V of its cells in the pool's storage type,
        versioned and checksummed, atomically (a temporary file in the same directory, renamed;
        an interrupted save leaves an existing ``path`` as it was). An evicted session is
        saved with the K/V the prefix cache still holds for it (its next turn computes the
        rest). ``KeyError`` for an unknown id."""
        header, kv = self._on_engine(lambda: self._snapshot(session_id), session_id)
        write_session_file(path, header, kv)

    def load_session(self, path: StrPath, session_id: str | None = None) -> str:
        """Restores a session saved by :meth:`save_session` (by any engine of the same model
        and ``kv_type``) under its saved id, or ``session_id``; returns the id. Its K/V is
        written back as saved, not recomputed: its next turn computes only the new tokens.
        A truncated, corrupt, other-version, other-model or other-``kv_type`` file raises
        :class:`SessionFileError` (a ``ValueError``), an id in use ``ValueError``, no room in
        the pool ``KvCacheFull``; in every case nothing was loaded."""
        header, kv = read_session_file(path)
        check_header(header, path, self.model.core.identity, self.kv_type)
        sid = header["session_id"] if session_id is None else session_id
        if not isinstance(sid, str) or not sid:
            raise ValueError(f"session_id must be a non-empty string, got {sid!r}")
        return self._on_engine(lambda: self._restore(sid, header, kv, path))

    # -- stats ---------------------------------------------------------------------------------
    def health(self) -> str | None:
        """None while the engine serves; else why it does not (closed, or its thread stopped
        on an internal error: every request then fails at once)."""
        if self._fatal is not None:
            return self._fatal
        if self._closed or not self._thread.is_alive():
            return "the engine is closed"
        return None

    def waiting_by_priority(self) -> dict[int, int]:
        """Sequences waiting for the engine thread to admit them, by priority (any thread)."""
        with self._cond:
            return dict(self._waiting_prio)

    def stats(self) -> dict[str, float | int]:
        """Counters for monitoring; cheap and safe from any thread (never waits for a step).

        ``kv_*`` describe the model's K/V pool (``kv_blocks_used``: blocks referenced by live
        sequences; ``kv_blocks_cached``: unreferenced blocks kept for prefix reuse).
        ``prompt_tokens``/``cached_prompt_tokens`` count admitted requests' prompts (a
        :meth:`choices` request's once) and the part reused at admission; ``computed_tokens``
        counts the tokens fed to the model (prompt tokens not reused, recomputation after a
        preemption or an eviction, and every generated token but each sequence's last);
        ``decode_tok_s`` is tokens generated per second of step time over the last 10 s.
        ``sessions``: sessions held; ``evictions``: times an idle session's K/V was reclaimed;
        ``session_misses``: turns of an evicted session (recomputed); ``kv_blocks_evicted``:
        cached blocks the pool evicted for new content (all users of the model's pool, since
        it was made). ``kv_<kind>_*`` (``kind``: ``full``, ``window``) describe each layer
        group's pool: a model with sliding-window layers (Gemma 3) has both, and its
        ``kv_window_blocks_used`` stays bounded by the window, not the context.
        ``prefix_hit_rate_recent``: the hit rate of requests admitted in the last 60 s;
        ``cached_prompt_tokens_session`` / ``_prefix``: the cached prompt tokens held by a
        resident session / mapped from the prefix index; ``prefix_lookups``,
        ``prefix_hit_tokens``: the core's prefix lookups and the tokens they mapped (this
        engine's context); ``prefix_blocks_shared``: pool blocks referenced by more than one
        sequence; ``prefix_blocks_indexed``: blocks in the prefix index."""
        st = self._ctx.stats()
        total = int(st["blocks_total"])
        used = int(st["blocks_referenced"])
        now = time.monotonic()
        recent = [(n, dt) for end, n, dt in list(self._recent) if now - end <= _RATE_WINDOW_S]
        busy = sum(dt for _, dt in recent)
        with self._cond:
            waiting = self._n_waiting + len(self._inbox)
            running = len(self._running)
        prompt = self._prompt_tokens
        cached = self._cached_prompt_tokens
        recent_prompts = [(p, c) for t, p, c in list(self._recent_prompts) if now - t <= 60.0]
        recent_prompt = sum(p for p, _ in recent_prompts)
        recent_cached = sum(c for _, c in recent_prompts)
        return {
            "kv_blocks_total": total,
            "kv_blocks_used": used,
            "kv_blocks_cached": int(st["blocks_cached"]),
            "kv_bytes_used": used * int(st["bytes_per_block"]),
            "kv_usage": used / total if total else 0.0,
            "prompt_tokens": prompt,
            "cached_prompt_tokens": cached,
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "prefix_hit_rate_recent": recent_cached / recent_prompt if recent_prompt else 0.0,
            "cached_prompt_tokens_session": self._session_cached_tokens,
            "cached_prompt_tokens_prefix": cached - self._session_cached_tokens,
            "prefix_lookups": int(st["prefix_lookups"]),
            "prefix_hit_tokens": int(st["prefix_hit_tokens"]),
            "prefix_blocks_shared": int(st["blocks_shared"]),
            "prefix_blocks_indexed": int(st["prefix_indexed"]),
            "generated_tokens": self._generated_tokens,
            "computed_tokens": self._computed_tokens,
            "evictions": self._evictions,
            "preemptions": self._preemptions,
            "running": running,
            "waiting": waiting,
            "sessions": len(self._sessions),
            "session_misses": self._session_misses,
            "kv_blocks_evicted": int(st["blocks_evicted"]),
            "decode_tok_s": sum(n for n, _ in recent) / busy if busy > 0 else 0.0,
            **_group_stats(st),
        }

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._closed
                        or self._inbox
                        or self._cancels
                        or self._calls
                        or self._running
                        or self._n_waiting
                    ):
                        timeout = self._ttl_timeout()
                        if timeout is not None and timeout <= 0:
                            break
                        self._cond.wait(timeout)
                    if self._closed:
                        break
                    inbox, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, []
                    calls, self._calls = self._calls, []
                    for req in inbox:
                        req.state = _WAITING
                        for child in req.children:
                            child.state = _WAITING
                    for req in inbox:
                        self._waiting_changed(req, 1 + len(req.children))
                self._expire_sessions()
                for req in inbox:
                    self._accept(req)
                for req in cancels:
                    self._drop(req)
                for call in calls:
                    self._run_call(call)
                try:
                    self._step()
                except Exception as e:  # a failed decode (EngineError) or a bug: fail the batch
                    for req in list(self._running.values()):
                        self._finish(req, error=e)
        except BaseException as e:
            if not self._closed:
                self._fatal = f"the engine thread stopped: {type(e).__name__}: {e}"
            raise
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        error = RuntimeError("the engine was closed before the request finished")
        with self._cond:
            self._closed = True
            pending = self._inbox + [r for _, r in self._waiting] + list(self._running.values())
            calls, self._calls = self._calls, []
            self._inbox, self._waiting, self._n_waiting = [], [], 0
            self._waiting_prio.clear()
        for s in self._sessions.values():
            for item in s.pending:
                if isinstance(item, _Call):
                    calls.append(item)
                elif isinstance(item, _Request):
                    pending.append(item)
            s.pending.clear()
            s.busy = None
        for call in calls:
            call.future.set_exception(RuntimeError("the engine is closed"))
        for req in pending:
            if req.state != _DONE:
                self._finish(req, error=error)
        self._ctx.clear()

    def _accept(self, req: _Request) -> None:
        """A new request (state waiting): into the waiting queue, or for a session request into
        its session's FIFO (it waits there while the session is busy)."""
        turn = req.turn
        if turn is None:
            heapq.heappush(self._waiting, (req.key, req))
            return
        s = self._sessions.get(turn.session_id)
        if s is None:
            try:
                s = self._new_session(turn.session_id)
            except RuntimeError as e:
                self._fail_waiting(req, e)
                return
        turn.session = s
        s.pending.append(req)
        if s.busy is None:
            self._session_next(s)

    def _waiting_changed(self, req: _Request, d: int) -> None:
        """``d`` more sequences of ``req``'s priority wait (call holding ``_cond``)."""
        self._n_waiting += d
        n = self._waiting_prio.get(req.priority, 0) + d
        if n:
            self._waiting_prio[req.priority] = n
        else:
            del self._waiting_prio[req.priority]

    def _fail_waiting(self, req: _Request, error: BaseException) -> None:
        with self._cond:
            self._waiting_changed(req, -1)
        self._finish(req, error=error)

    def _drop(self, req: _Request) -> None:
        """A cancelled request leaves: its sequence is removed (full blocks stay cached)."""
        if req.state == _WAITING:
            with self._cond:
                self._waiting_changed(req, -1)  # its heap entry is skipped at the head
        if req.state != _DONE:
            self._finish(req, error=asyncio.CancelledError())

    def _alloc_seq(self) -> int:
        if self._free_seqs:
            return self._free_seqs.pop()
        self._next_seq += 1
        return self._next_seq - 1

    def _release(self, req: _Request) -> None:
        """Removes ``req``'s sequence if it runs (also a finished session turn that is still
        computing its last token)."""
        if req.seq >= 0 and self._running.get(req.seq) is req:
            self._ctx.seq_rm(req.seq)
            with self._cond:
                del self._running[req.seq]
            self._free_seqs.append(req.seq)
            req.seq = -1

    def _finish(
        self, req: _Request, reason: str = FINISH_LENGTH, error: BaseException | None = None
    ) -> None:
        turn = req.turn
        if req.state == _DONE:  # a finished session turn still computing its last token
            if turn is not None and turn.closing:
                self._park(req)
            return
        if req.children:  # failed or cancelled before its prompt was computed
            self._unfork(req, error if error is not None else asyncio.CancelledError())
        if turn is not None and turn.session is not None and turn.session.busy is req:
            self._end_turn(req, error is None)
        else:
            self._release(req)
        req.state = _DONE
        if error is not None:
            req.sink.fail(error)
            return
        tail = req.text.finish()
        if tail:
            req.pieces.append(tail)
            req.sink.piece(tail, req.unsent_logprobs())
        if req.text.stopped:
            reason = FINISH_STOP
        req.sink.done(
            GenerateResult(
                text="".join(req.pieces),
                tokens=req.ids[req.n_prompt :],
                finish_reason=reason,
                prompt_tokens=req.n_prompt,
                cached_tokens=max(req.cached_tokens, 0),
                logprobs=req.logprobs,
                session_cached_tokens=req.session_cached if req.cached_tokens >= 0 else 0,
            ),
            req.unsent_logprobs(),
        )

    def _unfork(self, req: _Request, error: BaseException) -> None:
        """The choices still waiting to fork from ``req`` end with ``error``."""
        children, req.children = req.children, []
        for child in children:
            if child.state == _WAITING:
                with self._cond:
                    self._waiting_changed(child, -1)
            if child.state != _DONE:
                self._finish(child, error=error)

    def _fork(self, parent: _Request, row: np.ndarray) -> int:
        """``parent``'s prompt is computed (``row``: the logits of its last token): each choice
        waiting for it gets a sequence that shares the prompt's K/V (``seq_cp``, which copies
        and allocates nothing; a shared partial last block is copied when a choice first writes
        into it), picks its first token from ``row`` with its own sampler and runs on. Returns
        the tokens generated."""
        children, parent.children = parent.children, []
        generated = 0
        for child in children:
            if child.state != _WAITING or child.cancel_requested:
                continue  # a cancelled one is dropped at the next step
            child.seq = self._alloc_seq()
            self._ctx.seq_cp(parent.seq, child.seq)
            child.n_done = parent.n_done
            child.cached_tokens = parent.cached_tokens
            child.state = _RUNNING
            with self._cond:
                self._waiting_changed(child, -1)
                self._running[child.seq] = child
            tok = int(np.argmax(row)) if child.argmax_only else child.sampler(row, child.ids)
            if child.n_logprobs is not None:
                child.pending_logprob = token_logprob(self.model, row, tok, child.n_logprobs)
            generated += self._deliver(child, tok)
        return generated

    def _preempt(self, req: _Request) -> None:
        """Release ``req``'s blocks; it waits again with its place and is recomputed later."""
        turn = req.turn
        self._release(req)  # a session's K/V goes too: its next admission recomputes it
        self._preemptions += 1
        if turn is not None and turn.session is not None:
            turn.session.seq, turn.session.n_kv = -1, 0
            if turn.closing:  # its result is out; the session just loses its K/V
                turn.closing = False
                self._session_idle(turn.session)
                return
        req.state = _WAITING
        req.n_done = 0
        heapq.heappush(self._waiting, (req.key, req))
        with self._cond:
            self._waiting_changed(req, 1)

    # -- sessions on the engine thread ----------------------------------------------------------
    def _session(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise KeyError(session_id)
        return s

    def _new_session(self, sid: str) -> Session:
        """A new, empty session; with ``max_sessions`` reached the least recently used idle
        session is dropped first (``RuntimeError`` if every session is busy)."""
        if self.max_sessions is not None and len(self._sessions) >= self.max_sessions:
            oldest = self._sessions.oldest_idle()
            if oldest is None:
                raise RuntimeError(
                    f"max_sessions={self.max_sessions} sessions are held and all are busy"
                )
            self._drop_session(oldest)
        s = Session(sid, time.monotonic())
        self._sessions.add(s)
        return s

    def _drop_session(self, s: Session) -> None:
        """Forgets ``s`` (idle): its sequence is removed (full blocks stay cached)."""
        if s.resident:
            self._ctx.seq_rm(s.seq)
            self._free_seqs.append(s.seq)
            s.seq, s.n_kv = -1, 0
        self._sessions.remove(s)

    def _evict(self, s: Session) -> None:
        """Releases the K/V of a session that is not running (its tokens stay)."""
        self._ctx.seq_rm(s.seq)
        self._free_seqs.append(s.seq)
        s.seq, s.n_kv = -1, 0
        s.evicted = True
        self._sessions.evicted(s)
        self._evictions += 1

    def _evict_one(self) -> bool:
        """Frees K/V for running requests: the first idle session to evict, else the K/V of a
        session whose next request still waits (O(waiting)); False if there is none."""
        s = self._sessions.victim()
        if s is None:
            for _, req in self._waiting:
                t = req.turn
                if req.state == _WAITING and t is not None and t.session and t.session.resident:
                    s = t.session
                    break
        if s is None:
            return False
        self._evict(s)
        return True

    def _reclaim(self) -> None:
        """Evicts idle sessions from the high watermark down to the low one (module docs)."""
        if self._sessions.victim() is None:
            return
        st = self._ctx.stats()
        total = int(st["blocks_total"])
        used = int(st["blocks_referenced"])
        if used <= self.kv_high_watermark * total:
            return
        while used > self.kv_low_watermark * total:
            s = self._sessions.victim()
            if s is None:
                break
            self._evict(s)
            used = int(self._ctx.stats()["blocks_referenced"])

    def _ttl_timeout(self) -> float | None:
        """Seconds until the oldest idle session expires (None: nothing expires)."""
        if self.session_ttl is None:
            return None
        s = self._sessions.oldest_idle()
        if s is None:
            return None
        return s.last_use + self.session_ttl - time.monotonic()

    def _expire_sessions(self) -> None:
        while (t := self._ttl_timeout()) is not None and t <= 0:
            s = self._sessions.oldest_idle()
            assert s is not None
            self._drop_session(s)

    def _session_idle(self, s: Session) -> None:
        """``s`` has finished its current work: it becomes idle and its queue moves on."""
        s.busy = None
        s.last_use, s.last_use_wall = time.monotonic(), time.time()
        self._sessions.idle(s)
        self._session_next(s)

    def _session_next(self, s: Session) -> None:
        """Starts the next work queued on the idle session ``s``: session operations run at
        once, the next request is activated (it joins the waiting queue)."""
        while s.busy is None and s.pending:
            item = s.pending.popleft()
            if isinstance(item, _Call):
                item.run()
                if self._sessions.get(s.id) is not s:  # dropped: the rest starts afresh
                    rest = list(s.pending)
                    s.pending.clear()
                    for other in rest:
                        if isinstance(other, _Call):
                            self._run_call(other)
                        elif isinstance(other, _Request) and other.state == _WAITING:
                            self._accept(other)
                    return
            elif isinstance(item, _Request) and item.state == _WAITING:
                self._activate(item, s)
        if s.busy is None and not s.pending and not s.ids and self._sessions.get(s.id) is s:
            self._drop_session(s)  # a new session whose first turn did not complete

    def _activate(self, req: _Request, s: Session) -> None:
        """The session's turn starts: the request's tokens are the session's plus its prompt
        (a first turn: the prompt as usual), and it joins the waiting queue."""
        turn = req.turn
        assert turn is not None
        if s.ids and turn.cont is not None:
            ids = s.ids + turn.cont
        else:
            ids = turn.first
        if len(ids) > self._seq_limit:
            msg = f"the session with this prompt has {len(ids)} tokens, more than"
            self._fail_waiting(req, ValueError(f"{msg} {self._limit_name} allows"))
            return
        req.ids = list(ids)
        req.n_prompt = len(ids)
        sampler = req.sampler
        if s.rng_state is not None and sampler.seed is None and not sampler.params.is_greedy:
            sampler.rng.bit_generator.state = s.rng_state  # the session's random stream
        s.busy = req
        self._sessions.busy(s)
        heapq.heappush(self._waiting, (req.key, req))

    def _attach(self, req: _Request) -> int:
        """Gives the admitted session request its sequence: the parked one (reusing the longest
        prefix it holds) or, for a session that is not resident, a new one with what the prefix
        cache still has. Returns the tokens reused."""
        turn = req.turn
        assert turn is not None and turn.session is not None
        s = turn.session
        context = req.context()
        turn.base = _common_prefix(s.ids, context)
        if s.resident:
            n = min(turn.base, s.n_kv, len(context) - 1)
            if n < s.n_kv:
                n = self._truncate(s.seq, n)
            req.seq = s.seq
            if n == 0 and self.prefix_cache:
                return self._ctx.match_prefix(req.seq, context)
            if req.cached_tokens < 0:
                req.session_cached = n
            return n
        s.seq = req.seq = self._alloc_seq()
        if req.cached_tokens < 0 and s.evicted:
            self._session_misses += 1
        s.evicted = False
        return self._ctx.match_prefix(req.seq, context) if self.prefix_cache else 0

    def _truncate(self, seq: int, n: int) -> int:
        """Keeps the first ``n`` positions of ``seq``; returns what it holds then. Where the
        memory cannot continue at ``n`` (``seq_rm`` refuses, changing nothing: a hybrid model's
        recurrent state cannot be cut back, a sliding-window group already dropped what a token
        at ``n`` sees), the whole sequence goes instead (0), and the caller recomputes from the
        prefix cache."""
        try:
            self._ctx.seq_rm(seq, n, -1)
            return n
        except ValueError:
            self._ctx.seq_rm(seq)
            return 0

    def _end_turn(self, req: _Request, ok: bool) -> None:
        """The session's running or waiting request ends. Finished: the session takes its
        tokens (and random state) and parks its sequence, after computing the last token's K/V
        (``closing``). Failed or cancelled: the session keeps what it had before the turn."""
        turn = req.turn
        assert turn is not None and turn.session is not None
        s = turn.session
        if ok:
            # What the sequence holds: after a context shift, the shifted context.
            s.ids = list(req.context())
            s.priority = req.priority
            if not req.sampler.params.is_greedy:
                s.rng_state = dict(req.sampler.rng.bit_generator.state)
            if req.n_done < req.n_tokens <= self._seq_limit:
                turn.closing = True  # decoded in the next step, then parked (_park)
                return
            self._park(req)
            return
        if req.state == _RUNNING:
            keep = min(req.n_done, turn.base)
            if req.shift:  # a context shift moved everything after req.keep
                keep = min(keep, req.keep)
            with self._cond:
                del self._running[req.seq]
            if keep > 0:
                keep = self._truncate(req.seq, keep)
            if keep > 0:
                s.seq, s.n_kv = req.seq, keep
            else:
                self._ctx.seq_rm(req.seq)
                self._free_seqs.append(req.seq)
                s.seq, s.n_kv = -1, 0
            req.seq = -1
        self._session_idle(s)

    def _park(self, req: _Request) -> None:
        """The session's sequence stops running and stays, holding its K/V (idle session)."""
        turn = req.turn
        assert turn is not None and turn.session is not None
        s = turn.session
        turn.closing = False
        with self._cond:
            del self._running[req.seq]
        s.seq, s.n_kv = req.seq, req.n_done
        req.seq = -1
        self._session_idle(s)

    def _run_call(self, call: _Call) -> None:
        """A session operation: now, or queued behind the work on its session."""
        s = self._sessions.get(call.session_id) if call.session_id is not None else None
        if s is not None and (s.busy is not None or s.pending):
            s.pending.append(call)
        else:
            call.run()

    def _snapshot(self, session_id: str) -> tuple[dict[str, Any], bytes]:
        """The header and K/V state of a session file (engine thread; the caller writes)."""
        s = self._session(session_id)
        if s.resident:
            kv = self._ctx.seq_state_read(s.seq)
            n_kv = s.n_kv
        else:  # evicted: what the prefix cache still holds
            seq = self._alloc_seq()
            try:
                n_kv = self._ctx.match_prefix(seq, s.ids) if self.prefix_cache and s.ids else 0
                kv = self._ctx.seq_state_read(seq)
            finally:
                self._ctx.seq_rm(seq)
                self._free_seqs.append(seq)
        header = {
            "session_id": s.id,
            "model_identity": self.model.core.identity,
            "model_name": self.model.core.name,
            "kv_type": self.kv_type,
            "tokens": s.ids,
            "n_kv": n_kv,
            "rng_state": s.rng_state,
            "priority": s.priority,
            "saved_at": time.time(),
        }
        return header, kv

    def _restore(self, sid: str, header: dict[str, Any], kv: bytes, path: StrPath) -> str:
        """Creates session ``sid`` from a checked session file (engine thread)."""
        if self._sessions.get(sid) is not None:
            raise ValueError(f"a session {sid!r} exists; drop it first or load under another id")
        tokens: list[int] = header["tokens"]
        n_kv: int = header["n_kv"]
        _check_state(kv, tokens[:n_kv], path)
        seq = self._alloc_seq()
        while True:
            try:
                n = self._ctx.seq_state_write(seq, kv)
                break
            except KvCacheFull:
                if self._sessions.victim() is None:
                    self._free_seqs.append(seq)
                    raise
                self._evict(self._sessions.victim())  # type: ignore[arg-type]
            except ValueError as e:
                self._free_seqs.append(seq)
                raise SessionFileError(f"session file {path}: {e}") from e
        try:
            s = self._new_session(sid)
        except RuntimeError:
            self._ctx.seq_rm(seq)
            self._free_seqs.append(seq)
            raise
        self._sessions.busy(s)  # re-enters the idle orders below, resident
        s.ids = list(tokens)
        s.seq, s.n_kv = (seq, n) if n > 0 else (-1, 0)
        if n == 0:
            self._free_seqs.append(seq)
        s.priority = header["priority"]
        s.rng_state = header.get("rng_state")
        self._sessions.idle(s)
        return sid

    def _blocks_to_fill(self, req: _Request, extra: int = 0) -> int:
        """Fresh blocks ``req`` needs to hold all its tokens (+ ``extra``) from ``n_done``."""
        b = self._block
        return -(-(req.n_tokens + extra) // b) - (-(-req.n_done // b))

    def _available(self) -> int:
        st = self._ctx.stats()
        return int(st["blocks_free"]) + int(st["blocks_cached"])

    def _admit(self) -> None:
        """Admits waiting requests (module docs, step 2). A request with choices still to fork
        (:meth:`choices`) takes a slot for each and a block for each choice's own last block.

        FCFS within a priority, with one exception: while this step's prompt budget is taken
        (``prefill >= batch_tokens``), a waiting request of the head's priority whose prompt is
        all cached but for at most ``_fast_lane`` tokens (a shared document or system prompt
        computed before, a session's next turn, or a short prompt) is admitted anyway if memory
        and a slot allow, leaving one slot for the head: it costs the batch almost nothing, and
        its user need not wait for others' long prompts (:meth:`_plan` gives such short
        remainders their tokens first)."""
        avail = self._available()
        running = self._running.values()
        room = avail - sum(self._blocks_to_fill(r) + len(r.children) for r in running)
        prefill = sum(r.n_tokens - r.n_done - 1 for r in running)
        slots = len(self._running) + sum(len(r.children) for r in running)
        deferred: list[tuple[tuple[int, int], _Request]] = []
        while self._waiting and slots < self.parallel:
            if prefill >= self.batch_tokens:
                self._admit_cached(room, slots)
                break  # no room in this step's batch: admitting now would only hold blocks
            key, req = self._waiting[0]
            if req.state != _WAITING:  # cancelled while waiting
                heapq.heappop(self._waiting)
                continue
            if slots + 1 + len(req.children) > self.parallel:
                break  # its choices wait for slots (FCFS)
            session = req.turn.session if req.turn is not None else None
            resident = session is not None and session.resident
            if resident:  # what the parked sequence already holds is not allocated again
                assert session is not None
                req.n_done = min(_common_prefix(session.ids, req.context()), session.n_kv)
            need = self._blocks_to_fill(req, extra=1) + len(req.children)
            while self._running and need > room and self._sessions.victim() is not None:
                self._evict(self._sessions.victim())  # type: ignore[arg-type]
                now = self._available()
                room, avail = room + now - avail, now
            if self._running and need > room:
                break  # wait for memory (FCFS: nobody overtakes the head)
            heapq.heappop(self._waiting)
            if self.prefix_cache and not resident and self._computing_shared_prefix(req):
                deferred.append((key, req))  # its blocks come cached in a step or two
                continue
            matched = self._start(req)
            room -= need
            prefill += req.n_tokens - matched - 1
            slots += 1 + len(req.children)
        for item in deferred:
            heapq.heappush(self._waiting, item)

    def _admit_cached(self, room: int, slots: int) -> None:
        """The fast lane of :meth:`_admit`: admits, in queue order, waiting requests with at
        most ``_fast_lane`` prompt tokens left to compute (by :meth:`Context.peek_prefix` or
        the session's resident tokens) that fit ``room`` blocks and the free slots, among the
        first ``2 x parallel`` of the queue: at most that many peeks of O(prompt blocks) each
        (~20 µs for a 2,000-token prompt), only on steps whose prompt budget is full."""
        if not self.prefix_cache or not self._waiting:
            return
        admitted: set[int] = set()
        # The queue's first 2 x parallel requests (keys are unique): a bounded cost per step.
        queue = heapq.nsmallest(2 * self.parallel, self._waiting, key=lambda item: item[0])
        head = queue[0][0]
        for key, req in queue:
            # Never the last free slot (the queue's head may need it) and never ahead of a
            # request of higher priority.
            if slots + 2 > self.parallel or key[0] > head[0]:
                break
            if req.state != _WAITING or req.children:
                continue
            session = req.turn.session if req.turn is not None else None
            ids = req.context()
            if session is not None and session.resident:
                done = min(_common_prefix(session.ids, ids), session.n_kv)
            elif session is None:
                done = self._ctx.peek_prefix(ids)
            else:
                continue  # an evicted session: the normal path recomputes it
            if req.n_tokens - done > self._fast_lane:
                continue
            if session is None and self._computing_shared_prefix(req):
                continue  # more of it comes cached in a step or two: wait for that
            if session is not None:
                req.n_done = done
            need = self._blocks_to_fill(req, extra=1)
            if need > room:
                continue
            self._start(req)
            room -= need
            slots += 1
            admitted.add(id(req))
        if admitted:
            self._waiting = [x for x in self._waiting if id(x[1]) not in admitted]
            heapq.heapify(self._waiting)

    def _start(self, req: _Request) -> int:
        """Moves an admitted request (already out of the queue) to the running set: a sequence
        for it (the prefix cache mapped onto it, or its session's), its counters. Returns the
        number of prompt tokens it need not compute."""
        session = req.turn.session if req.turn is not None else None
        if session is None:
            req.seq = self._alloc_seq()
            matched = self._ctx.match_prefix(req.seq, req.context()) if self.prefix_cache else 0
        else:
            matched = self._attach(req)
        with self._cond:
            self._waiting_changed(req, -1)
            self._running[req.seq] = req
        req.state = _RUNNING
        req.n_done = matched
        if req.cached_tokens < 0:  # first admission (not a resume after preemption)
            req.cached_tokens = min(matched, req.n_prompt)
            req.session_cached = min(req.session_cached, req.cached_tokens)
            self._prompt_tokens += req.n_prompt
            self._cached_prompt_tokens += req.cached_tokens
            self._session_cached_tokens += req.session_cached
            now = time.monotonic()
            self._recent_prompts.append((now, req.n_prompt, req.cached_tokens))
            while self._recent_prompts and now - self._recent_prompts[0][0] > 60.0:
                self._recent_prompts.popleft()
        return matched

    def _computing_shared_prefix(self, req: _Request) -> bool:
        """Whether a running request is still prefilling whole blocks that ``req``'s prompt
        starts with (then ``req`` waits and maps them from the prefix index instead of
        computing them a second time). O(prefilling requests x shared blocks)."""
        b = self._block
        ids = req.context()
        usable = (len(ids) - 1) // b * b  # what match_prefix could map
        if usable == 0:
            return False
        head = ids[:b]
        for other in self._running.values():
            oids = other.context()
            if other.n_done >= min(usable, len(oids) - 1) or oids[:b] != head:
                continue  # it computed what it had (or nothing shared)
            shared = b
            limit = min(usable, len(oids) // b * b)
            while shared < limit and oids[shared : shared + b] == ids[shared : shared + b]:
                shared += b
            if shared > other.n_done // b * b:
                return True
        return False

    def _plan(self) -> list[tuple[_Request, int, int, bool]]:
        """This step's batch: (request, first index, token count, wants logits)."""
        plan: list[tuple[_Request, int, int, bool]] = []
        prefilling: list[_Request] = []
        for req in self._running.values():
            if req.turn is not None and req.turn.closing:  # the last token's K/V, no logits
                plan.append((req, req.n_done, req.n_tokens - req.n_done, False))
            elif req.n_tokens - req.n_done == 1:
                plan.append((req, req.n_done, 1, True))
            else:
                prefilling.append(req)
        left = self.batch_tokens - len(plan)
        # Short remainders first (a prompt all cached but its tail, admitted by the fast lane
        # of _admit): they cost a long prefill at most _fast_lane tokens of a step each.
        fast = self._fast_lane
        prefilling.sort(key=lambda r: (r.n_tokens - r.n_done > fast, r.key))
        for req in prefilling:
            if left <= 0:
                break
            k = min(req.n_tokens - req.n_done, left)
            plan.append((req, req.n_done, k, req.n_done + k == req.n_tokens))
            left -= k
        return plan

    def _step(self) -> None:
        self._admit()
        while True:
            plan = self._plan()
            if not plan:
                return
            tokens: list[int] = []
            positions: list[int] = []
            seqs: list[int] = []
            flags: list[bool] = []
            for req, start, k, want in plan:
                tokens += req.context(start, start + k)
                positions += range(start, start + k)
                seqs += [req.seq] * k
                flags += [False] * (k - 1) + [want]
            t0 = time.monotonic()
            try:
                logits = self._ctx.decode(tokens, positions, seqs, flags)
                self._computed_tokens += len(tokens)
                break
            except KvCacheFull as e:
                if self._evict_one():  # idle sessions go before any running request
                    continue
                if len(self._running) <= 1:
                    (req,) = self._running.values()
                    msg = (
                        f"the request needs {req.n_tokens} tokens of K/V and does not fit the"
                        f" KV pool even alone ({e})"
                    )
                    self._finish(req, error=KvCacheFull(msg))
                    return
                self._preempt(max(self._running.values(), key=lambda r: r.key))
        for req, _start, k, _want in plan:
            req.n_done += k
            if req.turn is not None and req.turn.closing:
                self._park(req)
        rows = np.frombuffer(memoryview(logits), dtype=np.float32).reshape(
            logits.n_rows, logits.n_vocab
        )
        wanting = [req for req, _s, _k, want in plan if want]
        picked = self._sample(wanting, rows)
        n_generated = 0
        for i, (req, tok) in enumerate(zip(wanting, picked)):
            if req.cancel_requested:
                continue  # dropped at the next step
            if req.children:  # before req may finish and release its sequence
                n_generated += self._fork(req, rows[i])
            n_generated += self._deliver(req, tok)
        self._reclaim()
        now = time.monotonic()
        self._recent.append((now, n_generated, now - t0))
        while self._recent and now - self._recent[0][0] > _RATE_WINDOW_S:
            self._recent.popleft()

    def _sample(self, reqs: list[_Request], rows: np.ndarray) -> list[int]:
        """One token per row: plain greedy rows (no bias, no penalties) with one argmax over all
        of them (sampling.greedy's rule, the first maximum, without its float64 copy); the
        others each with the request's own sampler (bias and penalties over its tokens, then
        greedy or its own generator). A request that asked for logprobs gets the picked
        token's entry, from the raw row, in ``pending_logprob``."""
        picked = [0] * len(reqs)
        plain = [i for i, r in enumerate(reqs) if r.argmax_only]
        if plain:
            best = np.argmax(rows[plain] if len(plain) < len(reqs) else rows, axis=-1)
            for i, tok in zip(plain, best.tolist()):
                picked[i] = tok
        for i, req in enumerate(reqs):
            if not req.argmax_only:
                picked[i] = req.sampler(rows[i], req.ids)
            if req.n_logprobs is not None:
                req.pending_logprob = token_logprob(self.model, rows[i], picked[i], req.n_logprobs)
        return picked

    def _deliver(self, req: _Request, tok: int) -> int:
        """Hands ``tok`` to ``req`` and finishes it when it is done; returns 1 if the token
        counts as generated (counted in ``stats()`` before the request can see its result)."""
        if not req.ignore_eos and self._is_eog(tok):
            self._finish(req, FINISH_STOP)
            return 0
        self._generated_tokens += 1
        req.ids.append(tok)
        if req.logprobs is not None and req.pending_logprob is not None:
            req.logprobs.append(req.pending_logprob)
            req.pending_logprob = None
        out = req.text.push(self._piece(tok))
        if out:
            req.pieces.append(out)
            req.sink.piece(out, req.unsent_logprobs())
        if req.text.stopped:
            self._finish(req, FINISH_STOP)
        elif req.n_generated >= req.max_tokens:
            self._finish(req, FINISH_LENGTH)
        elif req.n_tokens - 1 >= self._seq_limit and not self._shift_context(req):
            self._finish(req, FINISH_CONTEXT)
        return 1

    def _shift_context(self, req: _Request) -> bool:
        """Context shift (llama.cpp's server arithmetic) for a sequence whose K/V fills the
        limit: after the first ``keep`` tokens, drop half of the rest (``seq_rm``) and move the
        remainder down (``seq_add``; keys are re-rotated lazily). Returns False when shifting is
        off for ``req`` or cannot free anything. If the shift needs blocks the pool lacks (moving
        cells shared with another sequence copies them), ``req`` is preempted instead; it resumes
        by recomputing its shifted context."""
        if not req.context_shift:
            return False
        n_left = req.n_done - req.keep
        n_discard = min(n_left // 2, max(0, n_left - 1))
        if n_discard <= 0:
            return False
        start = req.keep + n_discard
        self._ctx.seq_rm(req.seq, req.keep, start)
        req.shift += n_discard
        req.n_done -= n_discard
        try:
            self._ctx.seq_add(req.seq, start, -1, -n_discard)
        except KvCacheFull:
            self._preempt(req)
        return True
