"""The routes of ``kvserve serve``: an OpenAI-compatible HTTP API over one :class:`kvserve.Engine`.

The HTTP layer only translates. A generation request becomes one engine request per prompt
(:meth:`kvserve.Engine.choices` with the request's ``n``), all checked before any is queued;
the engine thread computes, the event loop only moves text. The ``n`` choices of a prompt are
computed once and forked (``seq_cp``): they share the prompt's K/V blocks. Sampled choices
get ``seed + j`` (choice ``j``), so a seeded request with ``n > 1`` gives different,
reproducible choices. Each streamed chunk carries the logprobs of the tokens its text came
from (when asked), so the chunks' entries join to the non-streamed ones.

Echo (``/v1/completions``): ``echo: true`` puts the prompt before each choice's text, and with
``logprobs: N`` the prompt's tokens before the completion's in the legacy ``logprobs`` object
(the first token's logprob and alternatives null, as OpenAI's), computed in the prompt's own
prefill (the engine's ``prompt_logprobs``); a completion ended by an end-of-generation token
then lists that token last, as OpenAI's and vLLM's legacy completions do, so a harness that
slices the entries by position scores the right tokens. ``max_tokens: 0`` is allowed with
echo only (the prompt alone: what evaluation harnesses send to score a text).

Admission: at most ``parallel + max_queue`` sequences are in the server at once; a request
that would pass that gets 503 with ``Retry-After``. Its ``priority`` orders the engine's queue
(higher first). A client that disconnects (streaming or not) has its requests cancelled; the
engine frees their blocks at its next step.

Nothing slow runs on the event loop: tokenizing prompts, rendering chat templates and the token
routes run in worker threads (:func:`_blocking`; the Rust tokenizer releases the GIL), after
the checks that need no tokens (prompt characters, token-id prompt length, ``max_tokens``
against the engine's ``max_tokens_limit``, sequences per request), so a request's work before
the engine is bounded by the context, and other clients' streams, ``/health`` and
``/metrics`` go on meanwhile.

Errors: every bad request gets a 4xx with an OpenAI-style body (:class:`http.ApiError`);
request shapes and types are checked by the pydantic models of :mod:`.schemas`, value ranges
by the engine (:func:`kvserve.options.resolve`), whose ``ValueError`` names the argument.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from .. import __version__
from .._model import (
    FINISH_CONTEXT,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TOOL_CALLS,
    EngineError,
    GenerateResult,
    KvCacheFull,
    Model,
    prompt_ids,
)
from ..engine import Delta, Engine, EngineClosed, TenantPolicy, TooManySessions
from ..grammar import Constraint
from ..options import RequestOptions
from ..sampling import TokenLogprob
from ..sessions import SessionFileError, SessionInfo, remove_stale_temps
from ..tools import ToolCall, ToolPlan
from .config import ServerConfig
from .cors import Cors, parse_origins
from .http import (
    ACCESS,
    ARRIVAL,
    REQUEST_ID,
    TENANT,
    ApiError,
    EventStream,
    Gate,
    error_response,
)
from .metrics import CONTENT_TYPE, Metrics, priority_label
from .responses import (
    EventWriter,
    ReplyItems,
    ResponseStore,
    StoredResponse,
    engine_format,
    failure,
    format_error,
    input_messages,
    refuse_unsupported,
    reply_status,
    response_object,
)
from .schemas import (
    SESSION_ID,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponseRequest,
    RestoreRequest,
    TemplateRequest,
    TokenizeRequest,
)
from .tenants import Tenant, Tenants

__all__ = ["create_app", "load_engine"]

log = logging.getLogger("kvserve.server")

Prompt = str | list[int]

# HTTP field -> engine option (kvserve.options.RequestOptions); a new engine option is one line
# here and one field in schemas.py. A field whose option the engine does not have is refused
# with a 400 naming it, never silently ignored.
_OPTION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "seed": "seed",
    "stop": "stop",
    "ignore_eos": "ignore_eos",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repeat_penalty",
    "repeat_last_n": "penalty_last_n",
    "logit_bias": "logit_bias",
    "context_shift": "context_shift",
    "n_keep": "n_keep",
    "session_id": "session_id",
    "priority": "priority",
    "cache_salt": "cache_salt",
    "response_format": "response_format",
    "grammar": "grammar",
    "json_schema": "json_schema",
}
_HTTP_NAME = {option: field for field, option in _OPTION_FIELDS.items()}
# The chat fields of tool calls (kvserve.tools): errors name them by path ("tools[2].function").
_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_ENGINE_OPTIONS = frozenset(RequestOptions.__annotations__)
_PROMPT_TOO_LONG = re.compile(r"^the (prompt|session with this prompt) has \d+ tokens")
_SSE_DONE = b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def _finish_reason(result: GenerateResult) -> str:
    # OpenAI knows "stop" and "length"; a full context is a length limit too.
    return FINISH_LENGTH if result.finish_reason == FINISH_CONTEXT else result.finish_reason


def _bad_value(error: Exception, prompt_param: str) -> ApiError:
    """The 400 for a ``ValueError``/``TypeError`` the engine raised while building a request."""
    message = str(error)
    if _PROMPT_TOO_LONG.match(message):
        return ApiError(400, message, param=prompt_param, code="context_length_exceeded")
    # The engine's messages start with the option's name (a constraint's with the path to the
    # bad part of it and a colon: "response_format.json_schema.schema: ...").
    first = message.split(" ", 1)[0]
    path = first.rstrip(":")
    param = _HTTP_NAME.get(first, first if first in ("max_tokens", "logprobs", "n") else None)
    if param is None and (path.split(".")[0] in _HTTP_NAME or path.startswith(_TOOL_FIELDS)):
        param = path
    if message.startswith(("prompt token", "the prompt")):
        param = prompt_param
    return ApiError(400, message, param=param, code="invalid_value")


class _Server:
    """The app's state: the engine (None while loading), admission, limits and metrics."""

    def __init__(self, config: ServerConfig, engine: Engine | None) -> None:
        self.config = config
        self.engine: Engine | None = None
        self.prompt_chars = 0  # the most characters of one prompt (set with the engine)
        self.created = int(time.time())
        self.in_flight = 0  # sequences this server has admitted and not yet seen finish
        self.jobs: set[_Job] = set()  # generation requests streaming now
        self.draining = False  # shutting down: new requests get 503 (see drain)
        self.metrics = Metrics(self.stats, self.waiting, self.tenant_kv)
        # The engine's tenant policies, from the tenants in force (None: the server has no
        # tenants, and an engine it was given keeps its own).
        self.policies: dict[str, TenantPolicy] | None = None
        self.responses = ResponseStore(config.max_stored_responses)  # /v1/responses
        if engine is not None:
            self.set_engine(engine, prompt_char_limit(config, engine))

    def set_engine(self, engine: Engine | None, prompt_chars: int = 0) -> None:
        self.engine = engine
        self.prompt_chars = prompt_chars
        if engine is not None and self.policies is not None:
            engine.set_tenants(self.policies)

    def set_tenants(self, tenants: Tenants | None) -> None:
        """The tenants in force (at start and after each reload): their shares go to the
        engine, now or when it has loaded."""
        self.policies = None if tenants is None else tenants.policies()
        if self.engine is not None and self.policies is not None:
            self.engine.set_tenants(self.policies)

    def tenant_kv(self) -> dict[str, int] | None:
        """K/V blocks held per tenant (named tenants only: the keys file's)."""
        if self.engine is None:
            return None
        return {t: n for t, n in self.engine.kv_blocks_by_tenant().items() if t is not None}

    def stats(self) -> dict[str, float | int] | None:
        return None if self.engine is None else self.engine.stats()

    def waiting(self) -> dict[int, int] | None:
        return None if self.engine is None else self.engine.waiting_by_priority()

    def drain(self, grace: float) -> None:
        """Shutdown begins (SIGTERM; on the event loop): new requests get 503
        ``shutting_down``; generation requests in flight get ``grace`` seconds to finish,
        then end with that error (a stream: an SSE error event, then ``[DONE]``), so no
        client sees a connection cut mid-stream."""
        if self.draining:
            return
        self.draining = True
        log.info("shutting down: %d request(s) in flight get %g s", len(self.jobs), grace)
        asyncio.get_running_loop().call_later(grace, self.end_jobs)

    def end_jobs(self) -> None:
        for job in list(self.jobs):
            job.stop(EngineClosed("the server is shutting down"))

    def ready(self) -> Engine:
        if self.draining:
            raise ApiError(
                503,
                "the server is shutting down",
                code="shutting_down",
                headers={"Retry-After": "1"},
            )
        if self.engine is None:
            raise ApiError(
                503, "the model is loading", code="model_loading", headers={"Retry-After": "1"}
            )
        return self.engine

    @property
    def model_id(self) -> str:
        if self.config.model_id:
            return self.config.model_id
        name = self.engine.model.path.name if self.engine is not None else "kvserve"
        return name[: -len(".gguf")] if name.endswith(".gguf") else name

    @property
    def fingerprint(self) -> str:
        """``system_fingerprint``: what decides outputs besides the request (kvserve's
        version, the model's weights identity and the K/V type); it changes when they do."""
        from .. import __version__

        engine = self.engine
        if engine is None:
            return f"kvserve-{__version__}"
        ident = str(engine.model.core.identity)[:12]
        return f"kvserve-{__version__}-{ident}-{engine.kv_type}"

    def capacity(self, engine: Engine) -> int:
        return engine.parallel + self.config.max_queue

    def drop_sessions(self, sessions: list[str]) -> None:
        """Drops the engine's ``sessions`` (by their engine ids) in the background: a stored
        response that held one left the store. A session already gone is no error."""
        engine = self.engine
        if engine is None:
            return
        for sid in sessions:

            def drop(sid: str = sid) -> None:
                try:
                    engine.drop_session(sid)
                except (KeyError, EngineClosed):
                    pass
                except Exception:  # nobody awaits this: say it here
                    log.exception("could not drop session %s", sid)

            asyncio.get_running_loop().run_in_executor(None, drop)


def longest_token(model: Model) -> int:
    """The most bytes one token's text has (special tokens' text included): no prompt of
    more characters than ``ctx_size`` times this fits in ``ctx_size`` tokens (a character
    is at least one byte, and a prompt's tokens spell at least its bytes)."""
    core = model.core
    return max(1, max(len(core.token_to_piece(t, True)) for t in range(model.n_vocab)))


def prompt_char_limit(config: ServerConfig, engine: Engine) -> int:
    """``config.max_prompt_chars``, else ``ctx_size`` x the longest token: a prompt past
    that cannot fit, so refusing it before tokenizing changes no answer (the tokenizer's
    work stays bounded by the context, whatever the body's size)."""
    if config.max_prompt_chars is not None:
        return config.max_prompt_chars
    return engine.ctx_size * longest_token(engine.model)


def _choices(
    engine: Engine,
    prompts: Sequence[Prompt],
    max_tokens: int,
    n: int,
    options: RequestOptions,
    prompt_param: str,
    constraint: Constraint | None = None,
) -> list[AsyncGenerator[Delta, None]]:
    """The engine streams of a request's prompts, ``n`` choices each, all checked before any
    is queued (nothing is queued until a stream is iterated). Building them tokenizes text
    prompts: called in a worker thread, never on the event loop. ``constraint``: a tool
    plan's (kvserve.tools)."""
    try:
        return [
            engine.choices(prompt, max_tokens, n, constraint=constraint, **options)
            for prompt in prompts
        ]
    except (TypeError, ValueError) as e:
        raise _bad_value(e, prompt_param) from None


async def _open_job(
    server: _Server,
    request: Request,
    n_prompts: int,
    prompts: Callable[[Engine], Sequence[Prompt]],
    n: int,
    max_tokens: int,
    options: RequestOptions,
    prompt_param: str,
    constraint: Constraint | None = None,
) -> _Job:
    """Admits a generation request of ``n_prompts`` prompts (``prompts(engine)`` makes them,
    in a worker thread with the tokenization) and ``n`` choices each: checks what can be
    checked without tokenizing, holds its sequences in the admission count, then builds its
    engine streams off the event loop."""
    engine = server.ready()
    count = n_prompts * n
    capacity = server.capacity(engine)
    if count > capacity:
        raise ApiError(
            400,
            f"the request asks for {count} sequences (prompts x n), more than this server"
            f" holds at once ({capacity}: --parallel + --max-queue)",
            param="n" if n > 1 else prompt_param,
            code="invalid_value",
        )
    if server.in_flight + count > capacity:
        raise ApiError(
            503,
            f"the server is full: {server.in_flight} sequences running or queued"
            f" (--parallel + --max-queue = {capacity}); retry later",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    if "session_id" in options and count > 1:
        raise ApiError(
            400,
            "a session continues one conversation: with session_id, send one prompt and n=1",
            param="session_id",
            code="invalid_value",
        )
    server.in_flight += count  # held while the prompts are tokenized, so no one overtakes
    try:
        gens = await _blocking(
            lambda: _choices(
                engine, prompts(engine), max_tokens, n, options, prompt_param, constraint
            )
        )
    except BaseException:
        server.in_flight -= count
        raise
    return _Job(server, engine, request, gens, n, options.get("priority", 0))


class _Job:
    """One admitted generation request: the engine streams of its prompts (``n`` choices
    each), merged into one stream of ``(choice index, delta)`` in arrival order (choice
    ``p * n + j`` is choice ``j`` of prompt ``p``), with the timing that metrics and the
    access log report. Its sequences are in the server's admission count until
    :meth:`release`."""

    def __init__(
        self,
        server: _Server,
        engine: Engine,
        request: Request,
        gens: list[AsyncGenerator[Delta, None]],
        n: int,
        priority: int,
    ) -> None:
        self.server = server
        self.engine = engine
        self.request = request
        self.gens = gens
        self.n = n
        self.count = len(gens) * n
        self.priority = priority
        self.arrival: float = request.scope.get(ARRIVAL, time.monotonic())
        self.results: list[GenerateResult | None] = [None] * self.count
        self.first: list[float | None] = [None] * self.count
        self.last: list[float] = [0.0] * self.count
        self.released = False
        self.queue: asyncio.Queue[tuple[int, Delta | BaseException]] | None = None

    def stop(self, error: BaseException) -> None:
        """Ends the merged stream with ``error`` (its choices are then cancelled)."""
        if self.queue is not None:
            self.queue.put_nowait((0, error))

    def release(self) -> None:
        """Gives the request's sequences back to the admission count and fills in the access
        log; idempotent (called when the merged stream ends and when the response ends)."""
        if not self.released:
            self.released = True
            self.server.in_flight -= self.count
            firsts = [t for t in self.first if t is not None]
            access = self.request.scope.get(ACCESS)
            # Per prompt: the longest wait of its choices for a shared prefix.
            waits = [
                max(r.prefix_wait_s for r in done)
                for p in range(0, len(self.results), self.n)
                if (done := [r for r in self.results[p : p + self.n] if r is not None])
            ]
            for w in waits:
                self.server.metrics.prefix_wait.observe(w)
            if access is not None:
                access.update(self.usage_counts())
                if firsts:
                    access["ttft_ms"] = round((min(firsts) - self.arrival) * 1000, 1)
                if waits:
                    access["prefix_wait_ms"] = round(max(waits) * 1000, 1)
                access["n"] = self.count
                access["priority"] = self.priority

    async def run(self) -> AsyncGenerator[tuple[int, Delta], None]:
        """The merged stream; closing it (or cancelling its consumer) cancels every choice."""
        queue: asyncio.Queue[tuple[int, Delta | BaseException]] = asyncio.Queue()
        self.queue = queue
        self.server.jobs.add(self)

        async def pump(base: int, gen: AsyncGenerator[Delta, None]) -> None:
            try:
                async for delta in gen:
                    queue.put_nowait((base + delta.index, delta))
            except Exception as e:
                queue.put_nowait((base, e))
            finally:
                await gen.aclose()

        tasks = [asyncio.ensure_future(pump(p * self.n, g)) for p, g in enumerate(self.gens)]
        metrics = self.server.metrics
        ttft = metrics.ttft.labels(priority_label(self.priority))
        try:
            left = self.count
            while left:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                now = time.monotonic()
                if item.text:
                    if self.first[i] is None:
                        self.first[i] = now
                        ttft.observe(now - self.arrival)
                    else:
                        metrics.itl.observe(now - self.last[i])
                    self.last[i] = now
                if item.result is not None:
                    self.results[i] = item.result
                    left -= 1
                yield i, item
        finally:
            self.server.jobs.discard(self)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.release()
            metrics.duration.observe(time.monotonic() - self.arrival)

    def usage_counts(self) -> dict[str, int]:
        """Prompt tokens count once per prompt (its ``n`` choices share it); cached tokens are
        those reused for every choice of a prompt (``session_cached_tokens`` of them held by
        the request's session); completion tokens add up all choices."""
        prompt = cached = session = completion = 0
        for p in range(0, len(self.results), self.n):
            done = [r for r in self.results[p : p + self.n] if r is not None]
            if done:
                prompt += done[0].prompt_tokens
                cached += min(r.cached_tokens for r in done)
                session += min(r.session_cached_tokens for r in done)
            completion += sum(len(r.tokens) for r in done)
        return {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "session_cached_tokens": session,
            "completion_tokens": completion,
        }

    def usage(self) -> dict[str, Any]:
        c = self.usage_counts()
        return {
            "prompt_tokens": c["prompt_tokens"],
            "completion_tokens": c["completion_tokens"],
            "total_tokens": c["prompt_tokens"] + c["completion_tokens"],
            "prompt_tokens_details": {
                "cached_tokens": c["cached_tokens"],
                "session_cached_tokens": c["session_cached_tokens"],
            },
        }

    async def collect(self) -> bool:
        """Runs every choice to its end; False when the client disconnected first (then the
        choices are cancelled). Errors of a choice are raised."""

        async def consume() -> None:
            stream = self.run()
            try:
                async for _ in stream:
                    pass
            finally:
                await stream.aclose()

        async def client_gone() -> None:
            while (await self.request.receive())["type"] != "http.disconnect":
                pass

        done = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not done.done():
                done.cancel()
            await asyncio.gather(done, gone, return_exceptions=True)
            self.release()  # also when consume() never started
        if done.cancelled():
            return False
        done.result()
        return True


def _runtime_error(error: BaseException) -> ApiError:
    """The answer for a request that failed after it was queued."""
    if isinstance(error, KvCacheFull):
        return ApiError(400, str(error), code="kv_cache_full")
    if isinstance(error, EngineError):
        return ApiError(500, f"the engine failed: {error}", code="engine_error")
    if isinstance(error, EngineClosed):  # shutting down, or the engine stopped (says why)
        return ApiError(503, str(error), code="shutting_down", headers={"Retry-After": "1"})
    log.error("request failed", exc_info=error)
    return _internal(error)


def _internal(error: BaseException) -> ApiError:
    """A 500 for an unexpected error (its type and message: no paths or prompts in either)."""
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", code="internal_error")


def _options(body: CompletionRequest | ChatRequest | ResponseRequest) -> RequestOptions:
    """The engine options of a request's fields (only those it set and has: the Responses
    route has no ``session_id``)."""
    options: dict[str, Any] = {}
    for field, option in _OPTION_FIELDS.items():
        value = getattr(body, field, None)
        if value is None or (field == "ignore_eos" and value is False):
            continue
        if field == "logit_bias":
            value = _logit_bias(value)
        options[option] = value
    for option in options:
        if option not in _ENGINE_OPTIONS:
            field = _HTTP_NAME[option]
            raise ApiError(
                400,
                f"{field} is not supported by this server yet",
                param=field,
                code="unsupported_parameter",
            )
    return options  # type: ignore[return-value]


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ApiError(
                400,
                f"logit_bias keys must be token ids, got {key!r}",
                param="logit_bias",
                code="invalid_value",
            ) from None
    return out


def _logprobs_option(options: RequestOptions, n: int | None) -> RequestOptions:
    if n is None:
        return options
    if "logprobs" not in _ENGINE_OPTIONS:
        raise ApiError(
            400,
            "logprobs is not supported by this server yet",
            param="logprobs",
            code="unsupported_parameter",
        )
    return {**options, "logprobs": n}  # type: ignore[typeddict-unknown-key]


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt", code="invalid_value")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _messages(body: ChatRequest | TemplateRequest) -> list[dict[str, Any]]:
    # The fields of a handed-back reply that change nothing stay out of the prompt.
    out = []
    for m in body.messages:
        message = m.model_dump(exclude_none=True, exclude={"refusal", "annotations"})
        if not message.get("tool_calls"):
            message.pop("tool_calls", None)
        out.append(message)
    return out


def _tool_plan(engine: Engine, body: ChatRequest | ResponseRequest) -> ToolPlan | None:
    """The request's tool plan (kvserve.tools; in a worker thread: it checks the tools'
    schemas); a 400 naming the bad field."""
    try:
        return engine.tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ValueError as e:
        message = str(e)
        first = re.split(r"[ :]", message, maxsplit=1)[0]
        param = first if first.startswith(_TOOL_FIELDS) else "tools"
        raise ApiError(400, message, param=param, code="invalid_value") from None


def _tool_call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    """A streamed chunk's ``delta`` with one whole call (what the SDK's accumulator joins)."""
    return {"tool_calls": [{"index": index, **call.to_openai()}]}


def _check_prompt_sizes(server: _Server, engine: Engine, prompts: Sequence[Prompt]) -> None:
    """Refuses, before anything is tokenized, a text prompt longer than ``--max-prompt-chars``
    characters and a token-id prompt longer than the context."""
    for i, prompt in enumerate(prompts):
        what = "the prompt" if len(prompts) == 1 else f"prompt {i}"
        if isinstance(prompt, str):
            if len(prompt) > server.prompt_chars:
                raise ApiError(
                    400,
                    f"{what} has {len(prompt)} characters, more than this server takes"
                    f" ({server.prompt_chars}: --max-prompt-chars)",
                    param="prompt",
                    code="prompt_too_long",
                )
        elif len(prompt) > engine.ctx_size:
            raise ApiError(
                400,
                f"{what} has {len(prompt)} tokens, more than ctx_size={engine.ctx_size} allows",
                param="prompt",
                code="context_length_exceeded",
            )


def _check_chat_size(
    server: _Server,
    messages: list[dict[str, Any]],
    param: str = "messages",
    tools: list[dict[str, Any]] | None = None,
) -> None:
    """Refuses, before the template is rendered, messages whose contents (tool calls and
    tools included) have more than ``--max-prompt-chars`` characters in all."""
    chars = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(part["text"]) for part in content)
        for call in m.get("tool_calls") or ():
            chars += len(call["function"]["name"]) + len(call["function"]["arguments"])
    if tools:
        chars += len(json.dumps(tools))
    if chars > server.prompt_chars:
        raise ApiError(
            400,
            f"the messages' contents have {chars} characters, more than this server takes"
            f" ({server.prompt_chars}: --max-prompt-chars)",
            param=param,
            code="prompt_too_long",
        )


def _max_tokens(engine: Engine, fields: dict[str, int | None], default: int) -> int:
    """The tokens a request may generate: the first of ``fields`` (HTTP name -> value) that
    is set, else ``default``, bounded by the engine's ``max_tokens_limit``; a field set above
    that limit is a 400 naming it."""
    limit = engine.max_tokens_limit
    for name, value in fields.items():
        if value is not None and limit is not None and value > limit:
            raise ApiError(
                400,
                f"{name} is {value}, more than this server allows ({limit}: --max-tokens-limit)",
                param=name,
                code="invalid_value",
            )
    for value in fields.values():
        if value is not None:
            return value
    return default if limit is None else min(default, limit)


def _chat_ids(
    engine: Engine,
    messages: list[dict[str, Any]],
    special_in_content: bool = False,
    param: str = "messages",
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The chat template rendered (offering ``tools``) and tokenized (in a worker thread,
    never on the loop); message content is plain text unless ``special_in_content``
    (Model.tokenize_chat)."""
    tokenize_chat = getattr(engine.model, "tokenize_chat", None)
    if tokenize_chat is None:
        raise ApiError(
            501, "chat templates are not available in this build", code="not_implemented"
        )
    try:
        ids: list[int] = tokenize_chat(messages, special_in_content=special_in_content, tools=tools)
    except ValueError as e:
        if str(e).startswith("tools"):
            param = "tools"
        raise ApiError(400, str(e), param=param, code="invalid_value") from None
    return ids


# -- logprobs in OpenAI's two formats ---------------------------------------------------------


def _chat_logprobs(engine: Engine, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """Chat's ``logprobs`` object for ``entries`` (a whole reply or one chunk's tokens)."""
    if entries is None:
        return None

    def item(token: int, logprob: float) -> dict[str, Any]:
        piece = engine.model.token_to_piece(token)
        return {
            "token": piece.decode("utf-8", errors="replace"),
            "logprob": logprob,
            "bytes": list(piece),
        }

    return {
        "content": [
            {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def _completion_logprobs(
    engine: Engine, entries: list[TokenLogprob] | None, at: int = 0
) -> dict[str, Any] | None:
    """The legacy ``logprobs`` object for ``entries`` (a whole completion, or one chunk's
    tokens whose first token's text starts at offset ``at`` of the completion)."""
    if entries is None:
        return None

    def text(token: int) -> str:
        return engine.model.token_to_piece(token).decode("utf-8", errors="replace")

    tokens = [text(e.token) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


# -- echo: the prompt before the completion ----------------------------------------------------


@dataclasses.dataclass
class _Echo:
    """An echoed prompt: its text as the response shows it, its token ids (what the engine
    is given) and, with logprobs, each token's text (``tokens`` of the legacy logprobs)."""

    text: str
    ids: list[int]
    pieces: list[str] | None


def _echo(model: Model, prompt: Prompt, with_tokens: bool) -> _Echo:
    """The echo of one prompt (in a worker thread: it tokenizes). A text prompt is echoed
    as it was sent; its tokens are the engine's (``prompt_ids``: the model's BOS rule, special
    tokens parsed), each shown as its text in the prompt (special tokens' markup included; an
    added BOS as ""), so ``text_offset`` indexes the echoed text. A token-id prompt is echoed
    as its tokens' texts."""
    try:
        ids = prompt_ids(model, prompt) if isinstance(prompt, str) else list(prompt)
    except ValueError as e:
        raise _bad_value(e, "prompt") from None
    n_vocab = model.n_vocab
    if not all(0 <= t < n_vocab for t in ids):  # the engine names the bad one
        return _Echo("", ids, None)
    raw = [model.core.token_to_piece(t, True) for t in ids]
    if isinstance(prompt, str) and model.add_bos and ids[:1] == [model.bos]:
        raw[0] = b""  # added by the tokenizer: not in the prompt's text
    text = prompt if isinstance(prompt, str) else b"".join(raw).decode("utf-8", errors="replace")
    pieces = [p.decode("utf-8", errors="replace") for p in raw] if with_tokens else None
    return _Echo(text, ids, pieces)


def _markup(model: Model, token: int) -> str:
    """A token's text with special tokens as their markup (as they are in a prompt's text)."""
    return model.core.token_to_piece(token, True).decode("utf-8", errors="replace")


def _echo_logprobs(
    model: Model, echo: _Echo, entries: Sequence[TokenLogprob | None] | None
) -> dict[str, Any] | None:
    """The legacy ``logprobs`` of an echoed prompt: its tokens, their log-probabilities (the
    first null, as OpenAI's) and alternatives (as the tokens, special tokens by their markup),
    offsets from 0."""
    if entries is None or echo.pieces is None:
        return None
    offsets, at = [], 0
    for piece in echo.pieces:
        offsets.append(at)
        at += len(piece)
    return {
        "tokens": list(echo.pieces),
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [
            None if e is None else {_markup(model, t): lp for t, lp in e.top} for e in entries
        ],
        "text_offset": offsets,
    }


def _end_logprobs(model: Model, result: GenerateResult, at: int) -> dict[str, Any] | None:
    """The legacy ``logprobs`` of the end-of-generation token that ended ``result`` (not in
    its text; offset ``at``, the text's end), listed after an echoed prompt's completion as
    OpenAI's and vLLM's legacy completions list it: a client that scores by position (the
    completion's entries after the prompt's) finds it there. None when no such token ended it."""
    end = result.end_logprob
    if end is None:
        return None

    return {
        "tokens": [_markup(model, end.token)],
        "token_logprobs": [end.logprob],
        "top_logprobs": [{_markup(model, t): lp for t, lp in end.top}],
        "text_offset": [at],
    }


def _join_logprobs(*parts: dict[str, Any] | None) -> dict[str, Any] | None:
    """Legacy ``logprobs`` objects one after the other (None parts left out; None if all are)."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for p in present for x in p[k]] for k in keys}


def _check_echo(body: CompletionRequest) -> None:
    """``max_tokens: 0`` is for an echo alone; echo does not continue a session."""
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(
            400,
            "max_tokens must be greater than or equal to 1 (0 only with echo: true)",
            param="max_tokens",
            code="invalid_value",
        )
    if body.echo and body.session_id is not None:
        raise ApiError(
            400,
            "echo cannot be combined with session_id (a session's turn echoes no prompt)",
            param="echo",
            code="invalid_value",
        )


def load_engine(config: ServerConfig) -> Engine:
    """The engine ``config`` describes: ``Engine(config.model, **config.engine_kwargs())``,
    with the chat template ``config.chat_template`` if given (one that does not compile fails
    here). ``kvserve serve`` loads it so, and so does each replica of ``--replicas``."""
    if config.chat_template is None:
        return Engine(config.model, **config.engine_kwargs())
    kwargs = config.engine_kwargs()
    model = Model.load(config.model, kwargs.pop("threads"), chat_template=config.chat_template)
    model.chat_template  # noqa: B018 - a template that does not compile fails the load
    return Engine(model, **kwargs)


def create_app(
    config: ServerConfig | None = None,
    *,
    engine: Engine | None = None,
    load: Callable[[], Engine] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The ASGI app. With ``engine`` it serves that engine (and never closes it); otherwise it
    builds one at startup in a worker thread with ``load`` (default: ``Engine(config.model,
    **config.engine_kwargs())``), answering ``/health`` with 503 until it is ready, and closes
    it at shutdown. ``on_load_error`` is called when loading fails (``serve`` stops then).
    ``config.model`` is then a GGUF path, a registered name or None (the default model)."""
    config = config or ServerConfig()
    if config.session_dir is not None:
        Path(config.session_dir).mkdir(parents=True, exist_ok=True)
        # A save killed mid-write left its temporary file (the session file is intact).
        for stale in remove_stale_temps(config.session_dir):
            log.warning("removed %s, left by a session save that was killed", stale)
    server = _Server(config, engine)
    owns_engine = engine is None
    loader = load or (lambda: load_engine(config))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading: asyncio.Future[None] | None = None
        if server.engine is None:

            def load_all() -> tuple[Engine, int]:
                engine = loader()
                try:
                    return engine, prompt_char_limit(config, engine)
                except BaseException:
                    engine.close()
                    raise

            async def load_engine() -> None:
                try:
                    engine, prompt_chars = await _blocking(load_all)
                except Exception as e:
                    log.error("could not load the model: %s", e)
                    if on_load_error is not None:
                        on_load_error(e)
                else:
                    server.set_engine(engine, prompt_chars)
                    log.info(
                        "model loaded: %s (parallel=%d, ctx_size=%d, K/V pool of %d blocks,"
                        " max_tokens_limit=%s, max prompt characters %d)",
                        server.model_id,
                        engine.parallel,
                        engine.ctx_size,
                        engine.stats()["kv_blocks_total"],
                        engine.max_tokens_limit,
                        prompt_chars,
                    )

            loading = asyncio.ensure_future(load_engine())
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                loading.cancel()
            if owns_engine and server.engine is not None:
                engine = server.engine
                server.set_engine(None)
                await asyncio.get_running_loop().run_in_executor(None, engine.close)

    app = FastAPI(
        title="kvserve",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.server = server
    app.openapi = lambda: _openapi(
        app,
        api_key=config.api_key is not None
        or (  # type: ignore[method-assign]
            config.api_keys_file is not None
        ),
    )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> Response:
        return error_response(error)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        # Every error is a JSON body, this one too (the exception is logged by the server).
        if isinstance(error, EngineClosed):
            return error_response(_runtime_error(error))
        return error_response(_internal(error))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        message = str(error.detail)
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(ApiError(error.status_code, message, code=code))

    # -- routes -------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if server.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        reason = server.engine.health()
        if reason is not None:
            return JSONResponse({"status": "error", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/models", include_in_schema=False)  # llama-server's unprefixed alias
    @app.get("/v1/models")
    async def models() -> Response:
        engine = server.ready()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.model_id,
                        "object": "model",
                        "created": server.created,
                        "owned_by": "kvserve",
                        "max_model_len": engine.ctx_size,
                    }
                ],
            }
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _parse(request, TokenizeRequest)
        model = server.ready().model

        def run() -> list[int] | list[dict[str, Any]]:
            try:
                ids = model.tokenize(
                    body.content, add_special=body.add_special, parse_special=body.parse_special
                )
            except ValueError as e:
                raise ApiError(400, str(e), param="content", code="invalid_value") from None
            if not body.with_pieces:
                return ids
            return [
                {"id": t, "piece": model.token_to_piece(t).decode("utf-8", errors="replace")}
                for t in ids
            ]

        tokens = await _blocking(run)
        return JSONResponse({"tokens": tokens, "parse_special": body.parse_special})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await _parse(request, DetokenizeRequest)
        model = server.ready().model
        n_vocab = model.n_vocab
        for i, t in enumerate(body.tokens):
            if not 0 <= t < n_vocab:
                raise ApiError(
                    400,
                    f"tokens[{i}] is {t}, not a token id in [0, {n_vocab})",
                    param="tokens",
                    code="invalid_value",
                )
        return JSONResponse({"content": await _blocking(lambda: model.detokenize(body.tokens))})

    @app.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        body = await _parse(request, TemplateRequest)
        model = server.ready().model
        apply = getattr(model, "apply_chat_template", None)
        if apply is None:
            raise ApiError(
                501, "chat templates are not available in this build", code="not_implemented"
            )
        messages = _messages(body)

        def run() -> str:
            try:
                prompt: str = apply(messages, tools=body.tools)
            except ValueError as e:
                param = "tools" if str(e).startswith("tools") else "messages"
                raise ApiError(400, str(e), param=param, code="invalid_value") from None
            return prompt

        return JSONResponse({"prompt": await _blocking(run)})

    @app.post("/completions", include_in_schema=False)
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        engine = server.ready()
        for field, unsupported in (
            ("suffix", body.suffix is not None),
            ("best_of", body.best_of not in (None, body.n)),
        ):
            if unsupported:
                raise ApiError(
                    400, f"{field} is not supported", param=field, code="unsupported_parameter"
                )
        _check_echo(body)
        options = scoped(request, _logprobs_option(_options(body), body.logprobs))
        if body.echo and body.logprobs is not None:
            options["prompt_logprobs"] = body.logprobs  # computed in the prompt's prefill
        _common_checks(request, body)
        prompts = _prompts(body.prompt)
        _check_prompt_sizes(server, engine, prompts)
        max_tokens = _max_tokens(engine, {"max_tokens": body.max_tokens}, 16)  # OpenAI's 16
        echoes: list[_Echo] = []  # per prompt, made with the tokenization (echo only)

        def to_engine(e: Engine) -> Sequence[Prompt]:
            if not body.echo:
                return prompts
            echoes[:] = [_echo(e.model, p, body.logprobs is not None) for p in prompts]
            return [x.ids for x in echoes]

        job = await _open_job(
            server, request, len(prompts), to_engine, body.n, max_tokens, options, "prompt"
        )
        rid = f"cmpl-{request.scope[REQUEST_ID]}"
        base = {"id": rid, "object": "text_completion", "created": int(time.time())}
        base["model"] = server.model_id
        base["system_fingerprint"] = server.fingerprint
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            # Each choice's text so far (text_offset); an echoed prompt's text comes first.
            offsets = [len(echoes[i // body.n].text) if echoes else 0 for i in range(job.count)]
            opened = [False] * job.count

            def choice(i: int, delta: Delta) -> list[dict[str, Any]]:
                logprobs = _completion_logprobs(engine, delta.logprobs, offsets[i])
                if logprobs is not None:
                    offsets[i] += sum(len(t) for t in logprobs["tokens"])
                result = delta.result
                text = delta.text
                if echoes:
                    echo = echoes[i // body.n]
                    if not opened[i]:  # the first chunk of a choice: the prompt before it
                        opened[i] = True
                        text = echo.text + text
                        logprobs = _join_logprobs(
                            _echo_logprobs(engine.model, echo, delta.prompt_logprobs), logprobs
                        )
                    if result is not None and logprobs is not None:
                        end = _end_logprobs(engine.model, result, offsets[i])
                        logprobs = _join_logprobs(logprobs, end)
                return [
                    {
                        "index": i,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": None if result is None else _finish_reason(result),
                    }
                ]

            return _stream(job, base, choice, [], usage)
        if not await _collect(job):
            return Response(status_code=499)
        choices = []
        for i, r in enumerate(job.results):
            assert r is not None
            text, logprobs = r.text, _completion_logprobs(engine, r.logprobs)
            if echoes:
                echo = echoes[i // body.n]
                text = echo.text + r.text
                if logprobs is not None:
                    at = len(echo.text)
                    logprobs = _join_logprobs(
                        _echo_logprobs(engine.model, echo, r.prompt_logprobs),
                        _completion_logprobs(engine, r.logprobs, at),
                        _end_logprobs(engine.model, r, at + len(r.text)),
                    )
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": _finish_reason(r),
                }
            )
        return JSONResponse({**base, "choices": choices, "usage": job.usage()})

    @app.post("/chat/completions", include_in_schema=False)
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatRequest)
        engine = server.ready()
        options = scoped(request, _options(body))
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(
                400,
                "top_logprobs needs logprobs: true",
                param="top_logprobs",
                code="invalid_value",
            )
        if body.logprobs:
            options = _logprobs_option(options, body.top_logprobs or 0)
        _common_checks(request, body)
        messages = _messages(body)
        _check_chat_size(server, messages, tools=body.tools)
        max_tokens = _max_tokens(  # max_completion_tokens wins; default: until the end
            engine,
            {"max_completion_tokens": body.max_completion_tokens, "max_tokens": body.max_tokens},
            engine.ctx_size,
        )
        plan = None
        if body.tools or body.tool_choice is not None:
            plan = await _blocking(lambda: _tool_plan(engine, body))
        shown = None if plan is None else plan.render_tools
        job = await _open_job(
            server,
            request,
            1,
            lambda e: [_chat_ids(e, messages, config.special_in_content, tools=shown)],
            body.n,
            max_tokens,
            options,
            "messages",
            None if plan is None else plan.constraint,
        )
        parsing = plan is not None and plan.active
        rid = f"chatcmpl-{request.scope[REQUEST_ID]}"
        base = {"id": rid, "object": "chat.completion", "created": int(time.time())}
        base["model"] = server.model_id
        base["system_fingerprint"] = server.fingerprint
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            base["object"] = "chat.completion.chunk"
            parsers = [plan.parser() for _ in range(body.n)] if plan and parsing else None

            def choice(i: int, delta: Delta) -> list[dict[str, Any]]:
                result = delta.result
                finish = None if result is None else _finish_reason(result)
                logprobs = _chat_logprobs(engine, delta.logprobs)
                if parsers is None:
                    part = {"content": delta.text} if delta.text else {}
                    return [
                        {"index": i, "delta": part, "logprobs": logprobs, "finish_reason": finish}
                    ]
                # Tools: the parser's content pieces and whole calls; the generic format's
                # JSON envelope is never content.
                parser = parsers[i]
                made = parser.calls
                events = parser.feed(delta.text)
                if result is not None:
                    events += parser.finish()
                parts: list[dict[str, Any]] = []
                for event in events:
                    if isinstance(event, ToolCall):
                        parts.append(_tool_call_delta(made, event))
                        made += 1
                    elif event:
                        parts.append({"content": event})
                if finish is not None:
                    parts.append({})
                    if parser.calls and finish == FINISH_STOP:
                        finish = FINISH_TOOL_CALLS
                elif not parts and logprobs is not None:
                    parts.append({})
                chunks = [
                    {"index": i, "delta": part, "logprobs": None, "finish_reason": None}
                    for part in parts
                ]
                if chunks:
                    chunks[0]["logprobs"] = logprobs
                    chunks[-1]["finish_reason"] = finish
                return chunks

            opening = [
                {
                    "index": i,
                    # (with tools, content may never come: null, as OpenAI sends it)
                    "delta": {"role": "assistant", "content": None if parsing else ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(body.n)
            ]
            return _stream(job, base, choice, opening, usage)
        if not await _collect(job):
            return Response(status_code=499)
        choices = []
        for i, r in enumerate(job.results):
            assert r is not None
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            finish = _finish_reason(r)
            if plan is not None and parsing:
                content, calls = plan.parse(r.text)
                message["content"] = content
                if calls:  # (a reply cut short keeps "length": its calls are the whole ones)
                    message["tool_calls"] = [c.to_openai() for c in calls]
                    finish = FINISH_TOOL_CALLS if finish == FINISH_STOP else finish
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": _chat_logprobs(engine, r.logprobs),
                    "finish_reason": finish,
                }
            )
        return JSONResponse({**base, "choices": choices, "usage": job.usage()})

    # -- the Responses API (python/kvserve/server/responses.py) -------------------------------
    def owner(request: Request) -> str | None:
        tenant = scoped_tenant(request)
        return None if tenant is None else tenant.name

    @app.post("/responses", include_in_schema=False)
    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = await _parse(request, ResponseRequest)
        engine = server.ready()
        refuse_unsupported(body)
        _common_checks(request, body)
        # text.format: the engine options it maps to (responses.py, the one place).
        extra: dict[str, Any] = engine_format(body)
        store = server.responses
        tenant = owner(request)
        previous: StoredResponse | None = None
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id, tenant)
            if previous is None:
                raise ApiError(
                    404,
                    f"previous response {body.previous_response_id!r} not found",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
        # The whole conversation, rendered again: the session reuses what it holds of it.
        conversation = (*(previous.conversation if previous else ()), *input_messages(body))
        system = (
            [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
        )
        messages = [*system, *conversation]
        _check_chat_size(server, messages, "input", tools=body.tools)
        max_tokens = _max_tokens(
            engine, {"max_output_tokens": body.max_output_tokens}, engine.ctx_size
        )
        plan = None  # function tools, as on the chat route (kvserve.tools)
        if body.tools or body.tool_choice is not None:
            plan = await _blocking(lambda: _tool_plan(engine, body))
        shown = None if plan is None else plan.render_tools
        parsing = plan is not None and plan.active
        rid = f"resp_{request.scope[REQUEST_ID]}"
        if body.store:  # a new session is named after the response that starts it
            extra["session_id"] = rid
        options = scoped(request, cast(RequestOptions, {**_options(body), **extra}))
        session: str | None = None
        if body.store:  # the engine's (tenant-scoped) id of that session, or the previous one
            session = store.claim(rid, previous, body.cache_salt, options["session_id"])
            options["session_id"] = session

        def give_back() -> None:  # the turn failed or was cancelled
            if session is not None:
                server.drop_sessions(store.release(rid, session, previous))

        try:
            job = await _open_job(
                server,
                request,
                1,
                lambda e: [_chat_ids(e, messages, config.special_in_content, "input", shown)],
                1,
                max_tokens,
                options,
                "input",
                None if plan is None else plan.constraint,
            )
        except ApiError as e:
            give_back()
            raise format_error(e) from None
        except BaseException:
            give_back()
            raise
        created = int(time.time())
        model = server.model_id
        items = ReplyItems(rid, parsing)
        parser = plan.parser() if plan is not None and parsing else None

        def pieces(text: str, last: bool) -> list[str | ToolCall]:
            """The reply's content and calls in ``text`` (the next piece of it)."""
            if parser is None:
                return [text]
            return parser.feed(text) + (parser.finish() if last else [])

        def finish(result: GenerateResult) -> dict[str, Any]:
            obj = response_object(
                body, rid, model, created, plan=plan, status=reply_status(result),
                output=items.output, usage=job.usage_counts(),
            )  # fmt: skip
            if session is not None:
                reply = items.chat_message()
                entry = StoredResponse(
                    rid, tenant, (*conversation, reply), session, body.cache_salt, obj
                )
                server.drop_sessions(store.put(entry))
            return obj

        if not body.stream:
            try:
                done = await _collect(job)
            except BaseException:
                give_back()
                raise
            if not done:
                give_back()
                return Response(status_code=499)
            result = job.results[0]
            assert result is not None
            items.start()
            items.add(pieces(result.text, last=True))
            items.close(reply_status(result))
            return JSONResponse(finish(result))
        writer = EventWriter()
        finished = False

        async def events() -> AsyncGenerator[bytes, None]:
            nonlocal finished
            stream = job.run()
            try:
                snapshot = response_object(body, rid, model, created, plan=plan)
                for event in writer.opening(snapshot):
                    yield event
                for event in writer.events(items.start()):
                    yield event
                async for _, delta in stream:
                    added = items.add(pieces(delta.text, last=delta.result is not None))
                    for event in writer.events(added):
                        yield event
                result = job.results[0]
                assert result is not None
                closing = items.close(reply_status(result))
                final = finish(result)
                finished = True
                for event in writer.events(closing):
                    yield event
                yield writer.closing(final)
            except Exception as e:
                error = _runtime_error(e)
                failed = response_object(body, rid, model, created, plan=plan, error=failure(error))
                for event in writer.failed(error, failed):
                    yield event
            finally:
                await stream.aclose()

        def disconnected() -> None:
            request.scope[ACCESS]["disconnected"] = True

        def closed() -> None:  # also when the stream never started (the client left first)
            job.release()
            if not finished:
                give_back()

        return EventStream(events(), on_disconnect=disconnected, on_close=closed)

    @app.get("/responses/{response_id}", include_in_schema=False)
    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        server.ready()
        entry = server.responses.get(response_id, owner(request))
        if entry is None:
            raise _no_response(response_id)
        return JSONResponse(entry.body)

    @app.delete("/responses/{response_id}", include_in_schema=False)
    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        server.ready()
        sessions = server.responses.delete(response_id, owner(request))
        if sessions is None:
            raise _no_response(response_id)
        server.drop_sessions(sessions)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # -- sessions -----------------------------------------------------------------------------
    def session_dir(request: Request) -> Path:
        """Where this request's tenant's session files are: ``--session-dir``, or with an API
        keys file its ``<tenant>`` subdirectory (mode 0700, made on first use)."""
        if config.session_dir is None:
            raise ApiError(
                400,
                "session files need the server started with --session-dir",
                code="no_session_dir",
            )
        base = Path(config.session_dir)
        tenant = scoped_tenant(request)
        if tenant is None:
            return base
        path = base / tenant.name
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def session_file(request: Request, file_id: str) -> Path:
        """The file ``<file_id>.kvs`` of the request's tenant's session directory, which must
        be a plain file there or nothing yet: a symbolic link, or a tenant directory that
        resolves elsewhere, is refused (403), so no file outside the directory is read or
        written through it."""
        _check_session_id(file_id)
        folder = session_dir(request)
        path = folder / f"{file_id}.kvs"
        tenant = scoped_tenant(request)
        root = Path(str(config.session_dir)).resolve()
        home = root if tenant is None else root / tenant.name
        if folder.resolve() != home or path.is_symlink():
            log.error("refused session file %s: not a plain file in %s", path, home)
            raise ApiError(
                403,
                f"session file {file_id!r} is not a plain file in the session directory",
                param="id",
                code="session_path_refused",
            )
        return path

    def scoped(request: Request, options: RequestOptions) -> RequestOptions:
        """The request's options as its tenant may have them: run as its ``tenant`` (with an
        API keys file), ``priority`` capped at the tenant's ``max_priority``, ``session_id``
        in the tenant's namespace."""
        tenant: Tenant | None = request.scope.get(TENANT)
        owner = scoped_tenant(request)
        if owner is not None:
            options["tenant"] = owner.name  # its share of compute, memory and prefix cache
        if tenant is not None and options.get("priority", 0) > tenant.max_priority:
            options["priority"] = tenant.max_priority
        sid = options.get("session_id")
        if sid is not None:
            options["session_id"] = internal_id(request, sid)
        return options

    def scoped_tenant(request: Request) -> Tenant | None:
        """The tenant whose namespace the request's session ids are in (None: one namespace,
        without an API keys file)."""
        if config.api_keys_file is None:
            return None
        tenant: Tenant | None = request.scope.get(TENANT)
        return tenant

    def internal_id(request: Request, session_id: str) -> str:
        """The engine's id of the request's tenant's session ``session_id`` (``~`` cannot
        be in a session id, so tenants' ids never meet)."""
        tenant = scoped_tenant(request)
        return session_id if tenant is None else f"{tenant.name}~{session_id}"

    def own(request: Request, info: SessionInfo) -> SessionInfo | None:
        """``info`` with the id its tenant knows, or None for another tenant's session."""
        tenant = scoped_tenant(request)
        if tenant is None:
            return info
        prefix = f"{tenant.name}~"
        if not info.id.startswith(prefix):
            return None
        return dataclasses.replace(info, id=info.id[len(prefix) :])

    async def find(request: Request, session_id: str) -> SessionInfo:
        _check_session_id(session_id)
        want = internal_id(request, session_id)
        for info in await _blocking(server.ready().sessions):
            if info.id == want:
                mine = own(request, info)
                assert mine is not None
                return mine
        raise _no_session(session_id)

    @app.get("/v1/sessions")
    async def list_sessions(request: Request) -> Response:
        infos = await _blocking(server.ready().sessions)
        mine = [m for m in (own(request, i) for i in infos) if m is not None]
        return JSONResponse({"object": "list", "data": [_session_json(m) for m in mine]})

    @app.get("/v1/sessions/{session_id}")
    async def get_session(request: Request, session_id: str) -> Response:
        return JSONResponse(_session_json(await find(request, session_id)))

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(request: Request, session_id: str) -> Response:
        engine = server.ready()
        _check_session_id(session_id)
        sid = internal_id(request, session_id)
        try:
            await _blocking(lambda: engine.drop_session(sid))
        except KeyError:
            raise _no_session(session_id) from None
        return JSONResponse({"id": session_id, "object": "session", "deleted": True})

    @app.post("/v1/sessions/{session_id}/save")
    async def save_session(request: Request, session_id: str) -> Response:
        engine = server.ready()
        _check_session_id(session_id)
        path = session_file(request, session_id)
        sid = internal_id(request, session_id)
        try:
            await _blocking(lambda: engine.save_session(sid, path))
        except KeyError:
            raise _no_session(session_id) from None
        except OSError as e:
            log.error("could not save session %s to %s: %s", session_id, path, e)
            raise ApiError(
                500, f"could not write the session file: {e.strerror}", code="save_failed"
            ) from None
        return JSONResponse(
            {
                "id": session_id,
                "object": "session.saved",
                "file": path.name,
                "bytes": path.stat().st_size,
            }
        )

    @app.post("/v1/sessions/restore")
    async def restore_session(request: Request) -> Response:
        body = await _parse(request, RestoreRequest)
        engine = server.ready()
        path = session_file(request, body.id)
        name = body.session_id or body.id
        sid = internal_id(request, name)
        if not path.is_file():
            raise ApiError(
                404, f"no saved session {body.id!r}", param="id", code="session_not_found"
            )
        try:
            tenant = scoped_tenant(request)
            owner = None if tenant is None else tenant.name
            await _blocking(lambda: engine.load_session(path, sid, tenant=owner))
        except SessionFileError as e:  # bad file: say why, without the server's paths
            message = str(e).replace(str(path), path.name)
            raise ApiError(400, message, param="id", code="invalid_session_file") from None
        except KvCacheFull as e:
            raise ApiError(
                503,
                f"no room in the K/V pool for the session now: {e}",
                code="kv_cache_full",
                headers={"Retry-After": "1"},
            ) from None
        except ValueError as e:  # the id is in use
            raise ApiError(409, str(e), param="session_id", code="session_exists") from None
        except TooManySessions as e:  # max_sessions reached with every session busy
            raise ApiError(503, str(e), code="too_many_sessions") from None
        return JSONResponse(_session_json(await find(request, name)))

    app.state.tenants_file = config.api_keys_file
    app.state.drain = server.drain
    tenants = _tenants(config)
    server.set_tenants(tenants if config.api_keys_file is not None else None)
    gate = Gate(
        app,
        routes=lambda: app.routes,
        metrics=server.metrics,
        tenants=tenants,
        max_body=config.body_limit(engine.ctx_size if engine is not None else None),
        body_timeout=config.body_timeout,
        on_reload=server.set_tenants,
    )
    # CORS outside the gate: a preflight carries no API key (kvserve.server.cors).
    origins = parse_origins(config.cors_origins)
    return gate if origins is None else Cors(gate, origins)  # type: ignore[return-value]


# The JSON body each POST route parses (its schema goes into the OpenAPI document; the routes
# read bodies themselves, for strict types and errors that name the field).
_BODIES: dict[str, type[BaseModel]] = {
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/apply-template": TemplateRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
    "/v1/responses": ResponseRequest,
    "/v1/sessions/restore": RestoreRequest,
}


def _openapi(app: FastAPI, api_key: bool) -> dict[str, Any]:
    """The server's OpenAPI document (``GET /openapi.json``): FastAPI's, plus each POST
    route's request body schema and, with an API key, the bearer scheme; made once."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in _BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        op = doc["paths"][path]["post"]
        op["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
    for item in doc["paths"].values():  # session ids: the pattern the routes check
        for op in item.values():
            for param in op.get("parameters", []):
                if param["name"] == "session_id":
                    param["schema"]["pattern"] = SESSION_ID
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    app.openapi_schema = doc
    return doc


async def _collect(job: _Job) -> bool:
    try:
        return await job.collect()
    except Exception as e:
        raise _runtime_error(e) from None


def _common_checks(
    request: Request, body: CompletionRequest | ChatRequest | ResponseRequest
) -> None:
    """What both generation routes check and log alike."""
    if body.stream_options is not None and not body.stream:
        raise ApiError(
            400,
            "stream_options is only allowed with stream: true",
            param="stream_options",
            code="invalid_value",
        )
    if body.user is not None:
        access = request.scope.get(ACCESS)
        if access is not None:
            access["user"] = body.user


def _stream(
    job: _Job,
    base: dict[str, Any],
    choice: Callable[[int, Delta], list[dict[str, Any]]],
    opening: list[dict[str, Any]],
    include_usage: bool,
) -> Response:
    """The SSE response of a streaming request: ``opening`` choices first (the chat role),
    then for each engine delta the chunks ``choice`` makes of it (one per piece of text, with
    its tokens' logprobs when asked; the finished choice's with its finish reason and the
    logprobs of tokens whose text was held back; a chat with tools: content and tool calls),
    the usage chunk when asked, then ``data: [DONE]``. An error after the stream started is
    sent as ``data: {"error": ...}`` before ``[DONE]``."""
    extra = {"usage": None} if include_usage else {}

    async def events() -> AsyncGenerator[bytes, None]:
        stream = job.run()
        try:
            if opening:
                yield _sse({**base, "choices": opening, **extra})
            async for i, delta in stream:
                for c in choice(i, delta):
                    yield _sse({**base, "choices": [c], **extra})
            if include_usage:
                yield _sse({**base, "choices": [], "usage": job.usage()})
        except Exception as e:
            yield _sse(_runtime_error(e).body())
        finally:
            await stream.aclose()
        yield _SSE_DONE

    def disconnected() -> None:
        access = job.request.scope.get(ACCESS)
        if access is not None:
            access["disconnected"] = True

    return EventStream(events(), on_disconnect=disconnected, on_close=job.release)


_Body = TypeVar("_Body", bound=BaseModel)
_T = TypeVar("_T")


async def _parse(request: Request, model: type[_Body]) -> _Body:
    """The request's body as ``model`` (JSON whatever the Content-Type says; strict types);
    a 400 naming the first bad field otherwise."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as error:
        raise _validation_error(error) from None


# A location part that names a member of a union (``str``, ``list[int]``, ``_TextPart``), not
# a field: pydantic reports a value that fits no member once per member.
_UNION_MEMBER = re.compile(r"[a-z]+\[.*\]|str|int|float|bool|_?[A-Z]\w*")


def _validation_error(error: ValidationError) -> ApiError:
    """A 400 naming the first bad field: pydantic's messages, one per field; a value that
    fits no member of a union is reported once, with the forms it may take."""
    problems: dict[str, list[str]] = {}  # field path -> messages (or union members)
    # Declared fields first, unknown ones last: pydantic's own order varies between versions.
    errors = sorted(error.errors(), key=lambda e: e.get("type") == "extra_forbidden")
    for e in errors:
        if e.get("type") == "json_invalid":
            return ApiError(400, f"the body is not valid JSON: {e.get('msg')}", code="invalid_json")
        loc = [str(p) for p in e.get("loc", ())]
        member = next((i for i, p in enumerate(loc) if _UNION_MEMBER.fullmatch(p)), None)
        if member is not None:
            where = ".".join(loc[:member])
            problems.setdefault(where, [])
            if loc[member] not in problems[where]:
                problems[where].append(loc[member])
        else:
            problems.setdefault(".".join(loc) or "body", []).append(str(e.get("msg")))
    parts = []
    for where, items in list(problems.items())[:5]:
        if all(_UNION_MEMBER.fullmatch(x) for x in items) and len(items) > 1:
            parts.append(f"{where}: must be one of {', '.join(items)}")
        else:
            parts.append(f"{where}: {'; '.join(items)}")
    first = next(iter(problems), "body")
    param = None if first == "body" else first.split(".")[0]
    return ApiError(400, "; ".join(parts) or "invalid request", param=param, code="invalid_value")


# -- sessions -----------------------------------------------------------------------------------

_SESSION_RE = re.compile(SESSION_ID)


def _check_session_id(session_id: str) -> None:
    if not _SESSION_RE.fullmatch(session_id):  # whole: ``$`` alone allows a trailing newline
        raise ApiError(
            400,
            f"invalid session id {session_id!r}: 1 to 128 of A-Z a-z 0-9 . _ -, not starting"
            " with . _ or -",
            param="session_id",
            code="invalid_value",
        )


def _no_session(session_id: str) -> ApiError:
    return ApiError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")


def _no_response(response_id: str) -> ApiError:
    return ApiError(
        404, f"no response {response_id!r}", param="response_id", code="response_not_found"
    )


def _session_json(info: SessionInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "object": "session",
        "tokens": info.tokens,
        "last_use": info.last_use,
        "resident": info.resident,
        "busy": info.busy,
    }


def _tenants(config: ServerConfig) -> Tenants | None:
    """Who may call: the API keys file's tenants, one tenant for ``--api-key``, or anyone."""
    if config.api_keys_file is not None:
        if config.api_key is not None:
            raise ValueError("give --api-key or --api-keys-file, not both")
        return Tenants.load(config.api_keys_file)
    if config.api_key is not None:
        return Tenants.single(config.api_key)
    return None


async def _blocking(fn: Callable[[], _T]) -> _T:
    """``fn()`` in a worker thread (session calls wait for the engine thread's next step)."""
    return await asyncio.get_running_loop().run_in_executor(None, fn)
