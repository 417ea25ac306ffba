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
   (keeping its place) until they are computed and cached, instead of computing them again;
3. build ONE batch: one token for every sequence that is generating, then chunks of the
   prompts still being prefilled (highest priority, earliest first) up to ``batch_tokens``
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
step (each O(log W) out of a heap of W waiting requests). Nothing scans all requests: cancelled
waiting requests are dropped lazily when they reach the head of the queue; only a preemption
scans the R running sequences for its victim.

Generation follows :meth:`kvserve.Model.generate` exactly (same tokenization, stop rules,
``finish_reason`` and text assembly), so a greedy request gives the tokens that model's own
generation gives for the same prompt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import re
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, cast

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
from .textstream import TextStream

if TYPE_CHECKING:
    from .chat import Message

__all__ = ["Engine", "parse_size"]

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
    """Where a request's output goes; the engine thread calls these (never blocking)."""

    def piece(self, text: str) -> None:  # a piece of text (whole characters)
        pass

    def done(self, result: GenerateResult) -> None:
        raise NotImplementedError

    def fail(self, error: BaseException) -> None:
        raise NotImplementedError


class _FutureSink(_Sink):
    """A sync caller waits on a ``concurrent.futures.Future``."""

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[GenerateResult] = concurrent.futures.Future()

    def done(self, result: GenerateResult) -> None:
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

    def piece(self, text: str) -> None:
        if self.queue is not None:
            self._call(self.queue.put_nowait, text)

    def done(self, result: GenerateResult) -> None:
        if self.queue is not None:
            self._call(self.queue.put_nowait, _End(None, result))
        else:
            self._call(_resolve, self.result, result, None)

    def fail(self, error: BaseException) -> None:
        if self.queue is not None:
            self._call(self.queue.put_nowait, _End(error))
        else:
            self._call(_resolve, self.result, None, error)


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

    @property
    def argmax_only(self) -> bool:
        """Greedy without bias or penalties: the token is the argmax of the raw logits."""
        return self.sampler.params.is_plain_greedy


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
    ) -> None:
        for name, value in (
            ("parallel", parallel),
            ("ctx_size", ctx_size),
            ("batch_tokens", batch_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        kv_bytes = None if kv_memory is None else parse_size(kv_memory)
        self.model = _load_model(model, threads)
        self._ctx = self.model.core.new_context(
            parallel * ctx_size,
            kv_type=kv_type,
            kv_memory=kv_bytes,
            prefix_cache=prefix_cache,
        )
        st = self._ctx.stats()
        self._block = int(st["block_size"])
        pool_tokens = int(st["blocks_total"]) * self._block
        self.parallel = parallel
        self.batch_tokens = batch_tokens
        self.prefix_cache = prefix_cache
        self.context_shift = bool(context_shift)
        self.ctx_size = ctx_size
        # The longest sequence that can exist: ctx_size, unless the pool holds less.
        self._seq_limit = min(ctx_size, self._ctx.n_ctx, pool_tokens)
        self._limit_name = (
            f"ctx_size={ctx_size}"
            if self._seq_limit == ctx_size
            else f"the KV pool's {self._seq_limit} tokens (kv_memory)"
        )

        self._cond = threading.Condition()
        self._closed = False
        self._inbox: list[_Request] = []  # submitted, not yet seen by the engine thread
        self._cancels: list[_Request] = []
        self._arrival = itertools.count()
        # Engine-thread state.
        self._waiting: list[tuple[tuple[int, int], _Request]] = []  # heap by key
        self._n_waiting = 0
        self._running: dict[int, _Request] = {}  # sequence id -> request
        self._free_seqs = list(range(parallel - 1, -1, -1))
        # Counters (written by the engine thread, read by stats()).
        self._prompt_tokens = 0
        self._cached_prompt_tokens = 0
        self._generated_tokens = 0
        self._preemptions = 0
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
        # TypeError / ValueError naming the argument
        opts = resolve(options, n_vocab=self.model.n_vocab, engine=True)
        ids = prompt_ids(self.model, prompt) if isinstance(prompt, str) else self._ids(prompt)
        if len(ids) > self._seq_limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than {self._limit_name} allows"
            )
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
            self._inbox.append(req)
            self._cond.notify()

    def _cancel(self, req: _Request) -> None:
        """Ask the engine thread to drop ``req`` at its next step."""
        with self._cond:
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
        :class:`kvserve.options.RequestOptions` (sampling, stop rules, ``priority``)."""
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
        and template errors raise ``ValueError`` at the call, before anything is queued."""
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

    # -- stats ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, float | int]:
        """Counters for monitoring; cheap and safe from any thread (never waits for a step).

        ``kv_*`` describe the model's K/V pool (``kv_blocks_used``: blocks referenced by live
        sequences; ``kv_blocks_cached``: unreferenced blocks kept for prefix reuse).
        ``prompt_tokens``/``cached_prompt_tokens`` count admitted requests' prompts and the part
        reused at admission; ``decode_tok_s`` is tokens generated per second of step time over
        the last 10 s. ``evictions`` and ``sessions`` stay 0 until sessions exist."""
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
        return {
            "kv_blocks_total": total,
            "kv_blocks_used": used,
            "kv_blocks_cached": int(st["blocks_cached"]),
            "kv_bytes_used": used * int(st["bytes_per_block"]),
            "kv_usage": used / total if total else 0.0,
            "prompt_tokens": prompt,
            "cached_prompt_tokens": cached,
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "generated_tokens": self._generated_tokens,
            "evictions": 0,  # sessions are not implemented yet
            "preemptions": self._preemptions,
            "running": running,
            "waiting": waiting,
            "sessions": 0,
            "decode_tok_s": sum(n for n, _ in recent) / busy if busy > 0 else 0.0,
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
                        or self._running
                        or self._n_waiting
                    ):
                        self._cond.wait()
                    if self._closed:
                        break
                    inbox, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, []
                    for req in inbox:
                        req.state = _WAITING
                        heapq.heappush(self._waiting, (req.key, req))
                    self._n_waiting += len(inbox)
                for req in cancels:
                    self._drop(req)
                try:
                    self._step()
                except Exception as e:  # a failed decode (EngineError) or a bug: fail the batch
                    for req in list(self._running.values()):
                        self._finish(req, error=e)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        error = RuntimeError("the engine was closed before the request finished")
        with self._cond:
            self._closed = True
            pending = self._inbox + [r for _, r in self._waiting] + list(self._running.values())
            self._inbox, self._waiting, self._n_waiting = [], [], 0
        for req in pending:
            if req.state != _DONE:
                self._finish(req, error=error)
        self._ctx.clear()

    def _drop(self, req: _Request) -> None:
        """A cancelled request leaves: its sequence is removed (full blocks stay cached)."""
        if req.state == _WAITING:
            with self._cond:
                self._n_waiting -= 1  # its heap entry is skipped when it reaches the head
        if req.state != _DONE:
            self._finish(req, error=asyncio.CancelledError())

    def _release(self, req: _Request) -> None:
        if req.state == _RUNNING:
            self._ctx.seq_rm(req.seq)
            with self._cond:
                del self._running[req.seq]
            self._free_seqs.append(req.seq)
            req.seq = -1

    def _finish(
        self, req: _Request, reason: str = FINISH_LENGTH, error: BaseException | None = None
    ) -> None:
        self._release(req)
        req.state = _DONE
        if error is not None:
            req.sink.fail(error)
            return
        tail = req.text.finish()
        if tail:
            req.pieces.append(tail)
            req.sink.piece(tail)
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
            )
        )

    def _preempt(self, req: _Request) -> None:
        """Release ``req``'s blocks; it waits again with its place and is recomputed later."""
        self._release(req)
        req.state = _WAITING
        req.n_done = 0
        heapq.heappush(self._waiting, (req.key, req))
        with self._cond:
            self._n_waiting += 1
        self._preemptions += 1

    def _blocks_to_fill(self, req: _Request, extra: int = 0) -> int:
        """Fresh blocks ``req`` needs to hold all its tokens (+ ``extra``) from ``n_done``."""
        b = self._block
        return -(-(req.n_tokens + extra) // b) - (-(-req.n_done // b))

    def _admit(self) -> None:
        st = self._ctx.stats()
        room = int(st["blocks_free"]) + int(st["blocks_cached"])
        room -= sum(self._blocks_to_fill(r) for r in self._running.values())
        prefill = sum(r.n_tokens - r.n_done - 1 for r in self._running.values())
        deferred: list[tuple[tuple[int, int], _Request]] = []
        while self._waiting and len(self._running) < self.parallel:
            if prefill >= self.batch_tokens:
                break  # no room in this step's batch: admitting now would only hold blocks
            key, req = self._waiting[0]
            if req.state != _WAITING:  # cancelled while waiting
                heapq.heappop(self._waiting)
                continue
            need = self._blocks_to_fill(req, extra=1)
            if self._running and need > room:
                break  # wait for memory (FCFS: nobody overtakes the head)
            heapq.heappop(self._waiting)
            if self.prefix_cache and self._computing_shared_prefix(req):
                deferred.append((key, req))  # its blocks come cached in a step or two
                continue
            with self._cond:
                self._n_waiting -= 1
                req.seq = self._free_seqs.pop()
                self._running[req.seq] = req
            req.state = _RUNNING
            matched = self._ctx.match_prefix(req.seq, req.context()) if self.prefix_cache else 0
            req.n_done = matched
            if req.cached_tokens < 0:  # first admission (not a resume after preemption)
                req.cached_tokens = min(matched, req.n_prompt)
                self._prompt_tokens += req.n_prompt
                self._cached_prompt_tokens += req.cached_tokens
            room -= need
            prefill += req.n_tokens - matched - 1
        for item in deferred:
            heapq.heappush(self._waiting, item)

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
            if req.n_tokens - req.n_done == 1:
                plan.append((req, req.n_done, 1, True))
            else:
                prefilling.append(req)
        left = self.batch_tokens - len(plan)
        prefilling.sort(key=lambda r: r.key)
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
                break
            except KvCacheFull as e:
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
        rows = np.frombuffer(memoryview(logits), dtype=np.float32).reshape(
            logits.n_rows, logits.n_vocab
        )
        wanting = [req for req, _s, _k, want in plan if want]
        picked = self._sample(wanting, rows)
        n_generated = 0
        for req, tok in zip(wanting, picked):
            if req.cancel_requested:
                continue  # dropped at the next step
            n_generated += self._deliver(req, tok)
        self._generated_tokens += n_generated
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
        counts as generated."""
        if not req.ignore_eos and self._is_eog(tok):
            self._finish(req, FINISH_STOP)
            return 0
        req.ids.append(tok)
        if req.logprobs is not None and req.pending_logprob is not None:
            req.logprobs.append(req.pending_logprob)
            req.pending_logprob = None
        out = req.text.push(self._piece(tok))
        if out:
            req.pieces.append(out)
            req.sink.piece(out)
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
