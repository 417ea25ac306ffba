"""The front end: :class:`Engine`'s public API. It validates arguments, builds requests and
their sinks, and hands them to the engine thread (:mod:`kvserve.engine.loop`); everything else
happens there."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from typing_extensions import Unpack

from .. import models
from .._model import FINISH_STOP, FINISH_TOOL_CALLS, GenerateResult, Model, StrPath, prompt_ids
from ..grammar import Constraint, Grammars
from ..options import RequestOptions, Resolved, resolve
from ..sessions import SessionInfo, Turn, check_header, read_session_file, write_session_file
from ..testing import Faults
from .events import to_vllm
from .kv import KvManager
from .loop import HIT_WINDOW_S, RATE_WINDOW_S, EngineLoop
from .requests import (
    DONE,
    Call,
    ChoiceSink,
    Delta,
    End,
    EngineClosed,
    FutureSink,
    LoopSink,
    Request,
    parse_size,
)
from .scheduler import PROMPT_ORDERS, Scheduler
from .steplog import StepLog
from .tenancy import DEFAULT_POLICY, SHARED_POLICY, TenantPolicy, check_policies, salt_for

if TYPE_CHECKING:
    from ..chat import Message
    from ..tools import ToolCall, ToolPlan

__all__ = ["Engine"]

log = logging.getLogger("kvserve.engine")

T = TypeVar("T")

# The logits one step may return for the prompt rows of a request that asked for prompt
# logprobs (float32 x vocabulary per row): its prompt goes in chunks of at most this much
# (341 tokens for a 49k vocabulary, 64 for 262k), each reduced to entries in its step.
PROMPT_LOGITS_BYTES = 64 << 20


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


def _new_request(ids: list[int], max_tokens: int, opts: Resolved, salt: bytes) -> Request:
    return Request(
        ids,
        max_tokens,
        opts.sampler,
        opts.stops,
        opts.ignore_eos,
        opts.priority,
        logprobs=opts.logprobs,
        tenant=opts.tenant,
        salt=salt,
        prompt_logprobs=opts.prompt_logprobs,
    )


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


# Context.stats() ``disk_<name>`` -> Engine.stats() ``kv_disk_<name>``.
_DISK_KEYS = (
    "hit_blocks", "hit_tokens", "misses", "bytes_read", "bytes_written", "writes",
    "writes_dropped", "removed", "evicted", "skipped", "entries", "loaded", "queued",
)  # fmt: skip


def _disk_stats(st: dict[str, Any]) -> dict[str, float | int]:
    """``kv_disk_*`` counters of the disk tier in a context's ``stats()``."""
    out: dict[str, float | int] = {f"kv_disk_{k}": int(st[f"disk_{k}"]) for k in _DISK_KEYS}
    out["kv_disk_enabled"] = int(bool(st["disk_enabled"]))
    out["kv_disk_bytes"] = int(st["disk_bytes_held"])
    out["kv_disk_bytes_max"] = int(st["disk_bytes_max"])
    seconds, reads = float(st["disk_read_seconds"]), int(st["disk_hit_blocks"])
    out["kv_disk_read_seconds"] = seconds
    out["kv_disk_read_latency_s"] = seconds / reads if reads else 0.0
    return out


# Context.stats() ``remote_<name>`` -> Engine.stats() ``kv_remote_<name>``.
_REMOTE_KEYS = (
    "fetches", "fetched_blocks", "hit_blocks", "hit_tokens", "misses", "invalid", "lost",
    "bytes_read", "bytes_written", "writes", "writes_existing", "writes_dropped", "errors",
    "skipped_short", "skipped_down", "skipped_full", "staged_bytes", "queued",
)  # fmt: skip


def _remote_stats(st: dict[str, Any]) -> dict[str, float | int]:
    """``kv_remote_*`` counters of the shared tier in a context's ``stats()``."""
    out: dict[str, float | int] = {f"kv_remote_{k}": int(st[f"remote_{k}"]) for k in _REMOTE_KEYS}
    out["kv_remote_enabled"] = int(bool(st["remote_enabled"]))
    out["kv_remote_down"] = int(bool(st["remote_down"]))
    seconds, fetches = float(st["remote_fetch_seconds"]), int(st["remote_fetches"])
    out["kv_remote_fetch_seconds"] = seconds
    out["kv_remote_fetch_latency_s"] = seconds / fetches if fetches else 0.0
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
    neither ``ignore_eos`` nor ``context_shift`` holds a slot without end.
    ``tenants``: a :class:`kvserve.engine.tenancy.TenantPolicy` per tenant name (a request's
    ``tenant`` option; a tenant without one gets the default policy: weight 1, its prefix
    cache isolated); :meth:`set_tenants` replaces them.
    ``priority_aging_s``: a request that has waited this long is admitted before every request
    that has not, whatever their priorities (None: never), so low priority is never starved.
    ``prompt_order``: how the step's prompt budget is spent among a tenant's prompts of one
    priority: ``"groups"`` (default) the least work left per user served first, a prompt
    whose prefix other requests wait for counting once for each of them, so a shared
    document's users all start early (python/kvserve/engine/scheduler.py, "Shared
    prefixes"); ``"fcfs"``: in arrival order.
    The engine's context may use the whole K/V pool, so idle sessions can hold whatever the
    running requests leave; the reclaim rules keep it so.

    ``kv_disk``: a directory for the K/V disk tier (docs/KV_SEMANTICS.md, "Disk tier"): every
    full block the prefix cache keys is also written there (in the background), and a prompt
    whose blocks the pool evicted reads them back instead of recomputing them, also after a
    restart; ``kv_disk_size`` (bytes or a size string) bounds it, least recently used blocks
    going first. Prompts shorter than ``kv_disk_min_tokens`` skip it (None: the break-even
    measured by benches/bench_kv_disk.py, 0: reading was faster than computing at every
    prompt length that maps a block, so none is skipped; raise it for a slow disk). The tier
    belongs to the model's K/V memory and lives as long as the model; :meth:`close` waits for
    its queued writes. A model with sliding-window layers (Gemma 3) gets a tier per layer
    group under ``kv_disk`` (``kv_disk_size`` split between them); a model with recurrent
    layers (LFM2) also stores its state checkpoints there, beside the K/V blocks, so a prompt
    resumes at a block boundary with its state.

    ``kv_remote``: ``redis://[[user]:password@]host[:port][/db]`` of a Redis or Valkey store
    shared by every process serving this model (docs/KV_SEMANTICS.md, "Shared tier"): every
    full block the prefix cache keys is also sent there (in the background, ``SET NX`` with a
    time to live of ``kv_remote_ttl`` seconds, default a day), and before a request is queued,
    the leading blocks of its prompt that neither RAM nor disk holds are fetched from it (on a
    worker thread, never the engine's) and mapped at admission instead of computed. Prompts
    shorter than ``kv_remote_min_tokens`` skip it (None: the measured break-even).
    ``kv_remote_timeout``: seconds each store command may take (default 0.5); a store that is
    down, slow or loses blocks costs a request at most that, and it computes what it did not
    get (``kv_remote_errors`` counts it, and the tier rests a few seconds). Every model can
    use it; for one with recurrent layers (LFM2) the fetch also brings the state checkpoint at
    the end of the fetched K/V run (or one a few blocks below it).

    ``step_log``: a file that gets one JSON line per batch the engine computes (appended; its
    start, seconds, tokens and the rows of each request: python/kvserve/engine/steplog.py), to
    see where a workload's time goes; None (default): no log.
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
        priority_aging_s: float | None = 30.0,
        prompt_order: str = "groups",
        tenants: Mapping[str, TenantPolicy] | None = None,
        kv_disk: StrPath | None = None,
        kv_disk_size: int | str = "20GiB",
        kv_disk_min_tokens: int | None = None,
        kv_remote: str | None = None,
        kv_remote_ttl: float | None = None,
        kv_remote_min_tokens: int | None = None,
        kv_remote_timeout: float | None = None,
        step_log: StrPath | None = None,
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
        disk_bytes = parse_size(kv_disk_size, "kv_disk_size")
        if kv_disk_min_tokens is not None and kv_disk_min_tokens < 0:
            raise ValueError(f"kv_disk_min_tokens must be >= 0 or None, got {kv_disk_min_tokens}")
        if kv_remote_min_tokens is not None and kv_remote_min_tokens < 0:
            raise ValueError(
                f"kv_remote_min_tokens must be >= 0 or None, got {kv_remote_min_tokens}"
            )
        self._tenants = check_policies(tenants)
        if prompt_order not in PROMPT_ORDERS:
            raise ValueError(f"prompt_order must be one of {PROMPT_ORDERS}, got {prompt_order!r}")
        if priority_aging_s is not None and not priority_aging_s > 0:
            raise ValueError(
                f"priority_aging_s must be > 0 seconds or None, got {priority_aging_s}"
            )
        # Opened first: a step log that cannot be written fails here, before the model loads.
        steps = None if step_log is None else StepLog(step_log)
        self.model = _load_model(model, threads)
        self._grammars = Grammars(self.model)  # structured output's compiled grammars
        # The context may use the whole pool (its token limit is the pool): idle sessions are
        # parked beside the running sequences, and the reclaim policy, not the context's
        # n_ctx, decides how much they keep. The pool is sized for parallel x ctx_size tokens
        # unless kv_memory says otherwise.
        kv = KvManager(
            self.model,
            n_ctx=parallel * ctx_size,
            kv_type=kv_type,
            kv_memory=kv_bytes,
            prefix_cache=prefix_cache,
            memory_tokens=None if kv_bytes is not None else parallel * ctx_size,
            parallel=parallel,
            # prompt chunks of batch_tokens plus one token per running sequence
            n_batch=batch_tokens + parallel,
            kv_disk=kv_disk,
            kv_disk_size=disk_bytes,
            kv_disk_min_tokens=kv_disk_min_tokens,
            kv_remote=kv_remote,
            kv_remote_ttl=kv_remote_ttl,
            kv_remote_min_tokens=kv_remote_min_tokens,
            kv_remote_timeout=kv_remote_timeout,
        )
        # Fetches from the shared tier run here, before a request is queued: the engine
        # thread never waits on the network.
        self._fetcher = (
            # Mostly waiting on the store: enough that one slow fetch does not hold up the
            # requests behind it.
            ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvserve-kv-fetch")
            if kv.remote and prefix_cache
            else None
        )
        self.kv_type = kv.kv_type
        self.parallel = parallel
        self.batch_tokens = batch_tokens
        self.prefix_cache = prefix_cache
        self.context_shift = bool(context_shift)
        self.ctx_size = ctx_size
        self.max_tokens_limit = max_tokens_limit
        self.priority_aging_s = priority_aging_s
        self.prompt_order = prompt_order
        # The longest sequence that can exist: ctx_size, unless the pool holds less.
        self._seq_limit = min(ctx_size, kv.n_ctx, kv.pool_tokens)
        self._limit_name = (
            f"ctx_size={ctx_size}"
            if self._seq_limit == ctx_size
            else f"the KV pool's {self._seq_limit} tokens (kv_memory)"
        )
        self._arrival = itertools.count()
        sched = Scheduler(
            parallel=parallel,
            batch_tokens=batch_tokens,
            block_size=kv.block,
            prefix_cache=prefix_cache,
            aging_s=priority_aging_s,
            prompt_order=prompt_order,
            policy=self.tenant_policy,
            prompt_rows=max(16, PROMPT_LOGITS_BYTES // (4 * self.model.n_vocab)),
        )
        self._loop = EngineLoop(
            self.model,
            kv,
            sched,
            seq_limit=self._seq_limit,
            limit_name=self._limit_name,
            kv_high_watermark=kv_high_watermark,
            kv_low_watermark=kv_low_watermark,
            session_ttl=session_ttl,
            max_sessions=max_sessions,
            step_log=steps,
        )
        self._sessions = self._loop.sessions

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread; requests still queued or running fail with RuntimeError.
        Blocks queued for the K/V disk tier and the shared tier are written before it returns.
        """
        self._loop.close()
        if self._fetcher is not None:
            # Queued fetches see the engine closed: each fails its request at once.
            self._fetcher.shutdown(wait=True)
        self._loop.kv.flush_disk()
        self._loop.kv.flush_remote()

    # The session settings, as given (read-only).
    @property
    def kv_high_watermark(self) -> float:
        return self._sessions.kv_high_watermark

    @property
    def kv_low_watermark(self) -> float:
        return self._sessions.kv_low_watermark

    @property
    def session_ttl(self) -> float | None:
        return self._sessions.session_ttl

    @property
    def max_sessions(self) -> int | None:
        return self._sessions.max_sessions

    @property
    def faults(self) -> Faults:
        """Fault injection for tests (:mod:`kvserve.testing`)."""
        return self._loop.faults

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tenants -------------------------------------------------------------------------------
    def set_tenants(self, tenants: Mapping[str, TenantPolicy] | None) -> None:
        """Replaces the tenants' policies (any thread; requests already made keep theirs)."""
        self._tenants = check_policies(tenants)

    def tenant_policy(self, tenant: str | None) -> TenantPolicy:
        """The policy of ``tenant`` (the default one for a tenant without its own; requests
        without a tenant share the unsalted cache)."""
        if tenant is None:
            return SHARED_POLICY
        return self._tenants.get(tenant, DEFAULT_POLICY)

    # -- requests ------------------------------------------------------------------------------
    def _request(
        self,
        prompt: str | Sequence[int],
        max_tokens: int,
        options: RequestOptions,
        constraint: Constraint | None = None,
    ) -> Request:
        """Validates everything and builds the request (nothing is queued yet); ``prompt`` is
        text or the token ids to feed as they are; ``constraint``: one made by the caller
        (a :class:`kvserve.tools.ToolPlan`'s), in place of the options' structured output."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if self.max_tokens_limit is not None and max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"max_tokens must be <= max_tokens_limit={self.max_tokens_limit}, got {max_tokens}"
            )
        # TypeError / ValueError naming the argument
        opts = resolve(options, n_vocab=self.model.n_vocab, engine=True)
        if constraint is not None:
            if opts.constraint is not None:
                raise ValueError(
                    f"{opts.constraint.what.split('.')[0]} cannot be combined with tools"
                    " (unless tool_choice is 'none'): the tool-call format constrains the output"
                )
            opts.constraint = constraint
        ids = prompt_ids(self.model, prompt) if isinstance(prompt, str) else self._ids(prompt)
        turn = None
        n = len(ids)
        if opts.session_id is not None and max_tokens == 0:
            raise ValueError("max_tokens must be >= 1 with session_id (a turn generates)")
        if opts.session_id is not None:
            # Text continues the session (no second BOS); token ids (a chat) give the whole
            # conversation, which reuses the longest prefix the session holds.
            cont = (
                self.model.tokenize(prompt, add_special=False, parse_special=True)
                if isinstance(prompt, str)
                else None
            )
            turn = Turn(opts.session_id, ids, cont)
            s = self._sessions.table.get(opts.session_id)  # a snapshot: the length, early
            if s is not None and s.ids and cont is not None:
                n = len(s.ids) + len(cont)
        if n > self._seq_limit:
            what = "the prompt" if n == len(ids) else "the session with this prompt"
            raise ValueError(f"{what} has {n} tokens, more than {self._limit_name} allows")
        shared = self.tenant_policy(opts.tenant).share_prefix_cache
        req = _new_request(ids, max_tokens, opts, salt_for(opts.tenant, opts.cache_salt, shared))
        req.context_shift = self.context_shift if opts.context_shift is None else opts.context_shift
        req.keep = self._keep(opts.n_keep)
        req.turn = turn
        if opts.constraint is not None:  # compiled here (GrammarError: a ValueError), cached
            req.matcher = self._grammars.matcher(opts.constraint)
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
        if len(ids) > self._seq_limit:  # before looking at each token
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than {self._limit_name} allows"
            )
        n_vocab = self.model.n_vocab
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
                raise ValueError(f"prompt token {i} is {t!r}, not a token id in [0, {n_vocab})")
        return ids

    def _submit(self, req: Request) -> None:
        fetcher = self._fetcher
        # A text turn of a session continues what the session holds here: nothing to fetch;
        # nor for a request that computes its prompt's rows (prompt_logprobs).
        if (
            fetcher is not None
            and (req.turn is None or req.turn.cont is None)
            and req.match_limit is None
        ):
            if self._loop.closed:
                raise EngineClosed(self._loop.fatal or "the engine is closed")
            try:
                fetcher.submit(self._fetch_then_submit, req)
                return
            except RuntimeError:  # shut down by close() meanwhile
                raise EngineClosed(self._loop.fatal or "the engine is closed") from None
        self._loop.submit(req, lambda: next(self._arrival))

    def _fetch_then_submit(self, req: Request) -> None:
        """On a fetch worker: the blocks of the request's prompt that the shared tier holds
        and this process lacks, then the request goes to the engine (a failed fetch is an
        empty one: the request computes its prompt)."""
        try:
            if not (req.cancel_requested or self._loop.closed):
                req.staged = self._loop.kv.fetch(req.ids, req.salt)
        except Exception:
            log.exception("fetching from the shared K/V tier failed (the prompt is computed)")
        try:
            self._loop.submit(req, lambda: next(self._arrival))
        except EngineClosed as e:
            req.staged = None
            req.state = DONE
            req.sink.fail(e)

    def _cancel(self, *reqs: Request) -> None:
        """Ask the engine thread to drop ``reqs`` at its next step."""
        self._loop.cancel(*reqs)

    def generate(
        self,
        prompt: str,
        max_tokens: int = 128,
        **options: Unpack[RequestOptions],
    ) -> GenerateResult:
        """Complete ``prompt`` (blocking; any thread). ``options``: see
        :class:`kvserve.options.RequestOptions` (sampling, stop rules, ``priority``,
        ``session_id``: continue that session, see the module docs; ``prompt_logprobs=N``:
        each prompt token's log-probability and N alternatives, in the result's
        ``prompt_logprobs``). ``max_tokens=0`` computes the prompt alone (with
        ``prompt_logprobs``: scores a text, as evaluation harnesses do) and generates nothing."""
        return self._wait(self._request(prompt, max_tokens, options))

    def _wait(self, req: Request) -> GenerateResult:
        sink = FutureSink()
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

    async def _await(self, req: Request) -> GenerateResult:
        sink = LoopSink(asyncio.get_running_loop(), stream=False)
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
        *,
        constraint: Constraint | None = None,
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
        ``constraint``: a :class:`kvserve.grammar.Constraint` made by the caller (a
        :class:`kvserve.tools.ToolPlan`'s), in place of the options' structured output.
        """
        reqs = self._group(prompt, max_tokens, n, options, constraint)
        return self._stream_choices(reqs)

    def _group(
        self,
        prompt: str | Sequence[int],
        max_tokens: int,
        n: int,
        options: RequestOptions,
        constraint: Constraint | None = None,
    ) -> list[Request]:
        """The requests of :meth:`choices`: the first, which holds the others as its
        ``children`` until they fork."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.parallel:
            raise ValueError(f"n must be an integer in [1, parallel={self.parallel}], got {n!r}")
        req = self._request(prompt, max_tokens, options, constraint)
        if n > 1 and req.turn is not None:
            raise ValueError("n must be 1 with session_id (a session continues one conversation)")
        seed = options.get("seed")
        for j in range(1, n):
            opts = resolve(
                options if seed is None else {**options, "seed": seed + j},
                n_vocab=self.model.n_vocab,
                engine=True,
            )
            child = _new_request(list(req.ids), max_tokens, opts, req.salt)
            child.context_shift, child.keep = req.context_shift, req.keep
            if req.matcher is not None:
                child.matcher = req.matcher.deep_copy()  # nothing consumed yet
            req.children.append(child)
        return [req, *req.children]

    async def _stream_choices(self, reqs: list[Request]) -> AsyncGenerator[Delta, None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta | End] = asyncio.Queue()
        for i, req in enumerate(reqs):
            req.sink = ChoiceSink(loop, queue, i, req)
        self._submit(reqs[0])
        try:
            left = len(reqs)
            while left:
                item = await queue.get()
                if isinstance(item, End):
                    raise item.error or RuntimeError("a choice ended without a result")
                if item.result is not None:
                    left -= 1
                yield item
        finally:
            self._cancel(*reqs)

    async def _stream(
        self, req: Request, with_result: bool = False
    ) -> AsyncGenerator[str | GenerateResult, None]:
        sink = LoopSink(asyncio.get_running_loop(), stream=True)
        assert sink.queue is not None
        req.sink = sink
        self._submit(req)
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, End):
                    if item.error is not None:
                        raise item.error
                    if with_result and item.result is not None:
                        yield item.result
                    break
                yield item
        finally:
            self._cancel(req)

    # -- chat --------------------------------------------------------------------------------
    def tool_plan(
        self,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> ToolPlan | None:
        """How a chat offering ``tools`` is rendered, constrained and parsed with this model's
        chat template (:func:`kvserve.tools.plan_tools`; None without tools). ``ValueError``
        naming the bad field."""
        from ..tools import plan_tools

        return plan_tools(self.model.chat_template, tools, tool_choice, parallel_tool_calls)

    def _chat(
        self,
        messages: Sequence[Message],
        max_tokens: int,
        options: RequestOptions,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: str | Mapping[str, Any] | None,
        parallel_tool_calls: bool | None,
    ) -> tuple[Request, ToolPlan | None]:
        plan = self.tool_plan(tools, tool_choice, parallel_tool_calls)
        shown = None if plan is None else plan.render_tools
        ids = self.model.tokenize_chat(messages, tools=shown)
        constraint = None if plan is None else plan.constraint
        return self._request(ids, max_tokens, options, constraint), plan

    def chat(
        self,
        messages: Sequence[Message],
        max_tokens: int = 128,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **options: Unpack[RequestOptions],
    ) -> GenerateResult:
        """Reply to ``messages`` (blocking; any thread): the model's chat template with the
        generation prompt (:meth:`Model.tokenize_chat`), then as :meth:`generate`. Bad messages
        and template errors raise ``ValueError`` at the call, before anything is queued. With
        ``session_id``, ``messages`` is the whole conversation: the turn reuses the longest
        prefix of its tokens that the session holds and computes the rest.

        ``tools`` (OpenAI function tools), ``tool_choice`` (``"auto"``, the default with
        tools, ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name":
        ...}}``), ``parallel_tool_calls`` (False: at most one call): see :mod:`kvserve.tools`.
        The result's ``tool_calls`` holds the calls, ``text`` the content and
        ``finish_reason`` is ``"tool_calls"`` when the reply made calls. ``messages`` may hold
        assistant messages with ``tool_calls`` and ``tool`` messages with their results."""
        req, plan = self._chat(
            messages, max_tokens, options, tools, tool_choice, parallel_tool_calls
        )
        return _with_calls(self._wait(req), plan)

    async def achat(
        self,
        messages: Sequence[Message],
        max_tokens: int = 128,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **options: Unpack[RequestOptions],
    ) -> GenerateResult:
        """:meth:`chat` for asyncio; cancelling the task cancels the request."""
        req, plan = self._chat(
            messages, max_tokens, options, tools, tool_choice, parallel_tool_calls
        )
        return _with_calls(await self._await(req), plan)

    def stream_chat(
        self,
        messages: Sequence[Message],
        max_tokens: int = 128,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncGenerator[str | ToolCall, None]:
        """:meth:`stream` for a chat: the reply's text pieces; arguments and messages are
        checked at the call. Offered tools, it yields the content's pieces (``str``) and each
        :class:`kvserve.tools.ToolCall` when it is complete (without tools: only ``str``)."""
        req, plan = self._chat(
            messages, max_tokens, options, tools, tool_choice, parallel_tool_calls
        )
        stream = cast("AsyncGenerator[str, None]", self._stream(req))
        if plan is None or not plan.active:
            return stream
        return _stream_calls(stream, plan)

    # -- sessions ------------------------------------------------------------------------------
    def _on_engine(self, fn: Callable[[], T], session_id: str | None = None) -> T:
        """Runs ``fn`` on the engine thread between steps (after the requests queued on
        ``session_id`` before it) and returns its result or raises its error."""
        call = Call(fn, session_id)
        self._loop.call(call)
        result: T = call.future.result()
        return result

    def sessions(self) -> list[SessionInfo]:
        """Every session held: id, token count, last use (wall time), whether its K/V is
        resident, whether it is busy."""
        return self._on_engine(lambda: [s.info() for s in self._sessions.table.values()])

    def drop_session(self, session_id: str) -> None:
        """Forgets a session (after the requests already queued on it): its tokens and its
        K/V (full blocks stay cached for prefix reuse). ``KeyError`` for an unknown id."""
        self._on_engine(lambda: self._sessions.drop(self._sessions.get(session_id)), session_id)

    def save_session(self, session_id: str, path: StrPath) -> None:
        """Writes the session (after the requests already queued on it) to ``path``: its
        tokens, random generator state and the K/V of its cells in the pool's storage type,
        versioned and checksummed, atomically (a temporary file in the same directory, renamed;
        an interrupted save leaves an existing ``path`` as it was). An evicted session is
        saved with the K/V the prefix cache still holds for it (its next turn computes the
        rest). ``KeyError`` for an unknown id."""
        header, kv = self._on_engine(lambda: self._sessions.snapshot(session_id), session_id)
        write_session_file(path, header, kv)

    def load_session(
        self, path: StrPath, session_id: str | None = None, *, tenant: str | None = None
    ) -> str:
        """Restores a session saved by :meth:`save_session` (by any engine of the same model
        and ``kv_type``) under its saved id, or ``session_id``; returns the id. Its K/V is
        written back as saved, not recomputed: its next turn computes only the new tokens.
        A truncated, corrupt, other-version, other-model or other-``kv_type`` file raises
        :class:`SessionFileError` (a ``ValueError``), an id in use ``ValueError``, no room in
        the pool ``KvCacheFull``; in every case nothing was loaded. ``tenant``: whose
        session it is (its K/V enters that tenant's prefix cache, as its turns would)."""
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"tenant must be a non-empty string or None, got {tenant!r}")
        salt = salt_for(tenant, None, self.tenant_policy(tenant).share_prefix_cache)
        header, kv = read_session_file(path)
        check_header(
            header, path, self.model.core.identity, self.kv_type, n_vocab=self.model.n_vocab
        )
        sid = header["session_id"] if session_id is None else session_id
        if not isinstance(sid, str) or not sid:
            raise ValueError(f"session_id must be a non-empty string, got {sid!r}")
        return self._on_engine(lambda: self._sessions.restore(sid, header, kv, path, salt, tenant))

    # -- stats ---------------------------------------------------------------------------------
    def health(self) -> str | None:
        """None while the engine serves; else why it does not (closed, or its thread stopped
        on an internal error: every request then fails at once)."""
        loop = self._loop
        if loop.fatal is not None:
            return loop.fatal
        if loop.closed or not loop.thread.is_alive():
            return "the engine is closed"
        return None

    def waiting_by_priority(self) -> dict[int, int]:
        """Sequences waiting to be admitted, by priority (any thread): queued, waiting behind a
        busy session, or submitted and not yet seen by the engine thread (as ``stats()``'s
        ``waiting`` counts them)."""
        return self._loop.waiting_by_priority()

    def kv_blocks_by_tenant(self) -> dict[str | None, int]:
        """K/V blocks held per tenant (any thread; as of the engine thread's last iteration):
        every tenant with a policy (:meth:`set_tenants`; 0 when it holds none) and any other
        tenant (None: requests without one) holding some. The scheduler's estimate
        (:mod:`kvserve.engine.scheduler`, "K/V shares"): ``ceil(tokens / block)`` of each
        running sequence and idle resident session, a shared block once per holder."""
        held = self._loop.kv_by_tenant
        return {**dict.fromkeys(self._tenants, 0), **held}

    def kv_events(self, capacity: int = 1 << 16, resync: bool = False) -> list[dict[str, Any]]:
        """What the K/V pool stored and evicted since the last call, as vLLM's KV events
        (``BlockStored`` with ``block_hashes``, ``parent_block_hash``, ``token_ids``,
        ``block_size``, ``medium``; ``BlockRemoved``; ``AllBlocksCleared``; keys as 32 hex
        digits; docs/CLUSTER.md). Recording starts at the first call, which returns a
        snapshot (``AllBlocksCleared``, then every block held); at most ``capacity`` events
        wait between calls, and past that the next call returns a snapshot again (its
        ``AllBlocksCleared`` has ``dropped`` > 0). ``resync``: start over with a snapshot (a
        consumer that lost track). Any thread; never waits for a step."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        raw, dropped = self._loop.kv.kv_events(capacity, resync)
        return to_vllm(raw, self._loop.kv.block, dropped)

    def block_keys(self, ids: Sequence[int], salt: bytes = b"") -> list[int]:
        """The content keys the K/V pool gives the whole blocks of prompt ``ids`` under
        ``salt`` (``tenancy.salt_for``): what :meth:`kv_events` names them."""
        return list(self._loop.kv.ctx.block_keys(list(ids), salt))

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
        sequence; ``prefix_blocks_indexed``: blocks in the prefix index. ``failed_requests``:
        requests failed by an error on the engine thread (containment: each failed alone);
        ``cancelled_requests``: requests cancelled before they finished;
        ``decode_retries``: batches that failed and were retried or split;
        ``context_resets``: contexts replaced after an internal error closed them.

        ``kv_disk_*``: the K/V disk tier (zeros, and ``kv_disk_enabled`` 0, without one):
        ``hit_blocks`` / ``hit_tokens`` read back instead of recomputed (counted in
        ``cached_prompt_tokens`` too), ``misses`` (lookups that found no valid entry),
        ``bytes_read`` / ``bytes_written``, ``writes`` and ``writes_dropped`` (the write queue
        was full), ``removed`` (invalid entries: torn, corrupt, another model or version),
        ``evicted`` (by the size limit), ``skipped`` (prompts under the break-even),
        ``entries`` and ``bytes`` held now, ``bytes_max`` (the size limit), ``loaded``
        (entries found in the directory when the tier was opened), ``queued``
        (blocks waiting for the writer), ``read_seconds`` (the time the reads that hit took)
        and ``read_latency_s`` (per block read back).

        ``kv_remote_*``: the shared tier (zeros, and ``kv_remote_enabled`` 0, without one):
        ``fetches`` (requests that asked the store), ``fetched_blocks`` (brought and
        verified), ``hit_blocks`` / ``hit_tokens`` (mapped at admission instead of computed;
        counted in ``cached_prompt_tokens`` too), ``misses`` (fetches that met a block the
        store lacks), ``invalid`` (values that failed verification), ``lost`` (blocks gone
        between the existence check and the read), ``bytes_read`` / ``bytes_written``,
        ``writes`` / ``writes_existing`` (already stored by someone) / ``writes_dropped``
        (queue full, store down), ``errors`` (connection, protocol, timeout: a warning sign),
        ``skipped_short`` (prompts under the break-even), ``skipped_down`` (fetches skipped
        while the tier rests after an error), ``skipped_full`` (fetches skipped while blocks
        staged for requests not yet admitted took their budget), ``staged_bytes`` (those
        now), ``queued``, ``down`` (1 while resting),
        ``fetch_seconds`` and ``fetch_latency_s`` (per fetch).

        ``grammar_*``: structured output (:mod:`kvserve.grammar`): ``compiles`` (grammars
        compiled: cache misses) and ``compile_seconds``, ``cache_hits``, ``masks`` (token masks
        computed), ``mask_seconds`` (their time, on the helper thread, overlapping the
        forward passes) and ``mask_wait_seconds`` (what the engine thread waited for them after
        a pass: the part that did not overlap)."""
        loop = self._loop
        st = loop.kv.stats()
        total = int(st["blocks_total"])
        used = int(st["blocks_referenced"])
        now = time.monotonic()
        recent = [(n, dt) for end, n, dt in list(loop.recent) if now - end <= RATE_WINDOW_S]
        busy = sum(dt for _, dt in recent)
        with loop.cond:
            waiting = loop.n_waiting + loop.inbox_size()
            running = len(loop.sched.running)
        prompt = loop.prompt_tokens
        cached = loop.cached_prompt_tokens
        recent_prompts = [
            (p, c) for t, p, c in list(loop.recent_prompts) if now - t <= HIT_WINDOW_S
        ]
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
            "cached_prompt_tokens_session": loop.session_cached_tokens,
            "cached_prompt_tokens_prefix": cached - loop.session_cached_tokens,
            "prefix_lookups": int(st["prefix_lookups"]),
            "prefix_hit_tokens": int(st["prefix_hit_tokens"]),
            "prefix_blocks_shared": int(st["blocks_shared"]),
            "prefix_blocks_indexed": int(st["prefix_indexed"]),
            "generated_tokens": loop.generated_tokens,
            "computed_tokens": loop.computed_tokens,
            "evictions": loop.sessions.evictions,
            "preemptions": loop.preemptions,
            "failed_requests": loop.failed_requests,
            "cancelled_requests": loop.cancelled_requests,
            "decode_retries": loop.decode_retries,
            "context_resets": loop.kv.reopened,
            "running": running,
            "waiting": waiting,
            "sessions": len(loop.sessions),
            "session_misses": loop.sessions.misses,
            "kv_blocks_evicted": int(st["blocks_evicted"]),
            "decode_tok_s": sum(n for n, _ in recent) / busy if busy > 0 else 0.0,
            "model_repacked_bytes": self.model.core.repacked_bytes,
            "grammar_compiles": self._grammars.compiles,
            "grammar_compile_seconds": self._grammars.compile_seconds,
            "grammar_cache_hits": self._grammars.hits,
            "grammar_masks": loop.masks.rows,
            "grammar_mask_seconds": loop.masks.seconds,
            "grammar_mask_wait_seconds": loop.masks.waited,
            **_group_stats(st),
            **_disk_stats(st),
            **_remote_stats(st),
        }


def _with_calls(result: GenerateResult, plan: ToolPlan | None) -> GenerateResult:
    """A chat result with its tool calls parsed out of its text (see :mod:`kvserve.tools`)."""
    if plan is None or not plan.active:
        return result
    content, calls = plan.parse(result.text)
    if not calls:
        return dataclasses.replace(result, text=content or "")
    # A reply cut short (length) keeps its reason: its calls are those it completed.
    finish = FINISH_TOOL_CALLS if result.finish_reason == FINISH_STOP else result.finish_reason
    return dataclasses.replace(result, text=content or "", tool_calls=calls, finish_reason=finish)


async def _stream_calls(
    stream: AsyncGenerator[str, None], plan: ToolPlan
) -> AsyncGenerator[str | ToolCall, None]:
    parser = plan.parser()
    try:
        async for piece in stream:
            for event in parser.feed(piece):
                yield event
        for event in parser.finish():
            yield event
    finally:
        await stream.aclose()
