"""The ingress of ``kvserve serve --replicas N``: one OpenAI-compatible HTTP endpoint in front of
N replicas (:class:`kvserve.cluster.replica.ReplicaServer`, Ray Serve deployments). It speaks
no API of its own: every request is forwarded as it came to the replica the router
(:mod:`kvserve.cluster.router`) picks, and the replica's response, streamed or not, comes back
as the replica sent it, plus three headers: ``x-kvserve-replica`` (who answered),
``x-kvserve-route`` (``session``, ``prefix`` or ``load``) and ``x-kvserve-prefix-blocks`` (how
many of the prompt's leading blocks the router believed that replica held).

To route by prefix the ingress computes a generation request's prompt token ids as the
replica will (the same chat template and tokenizer: :class:`PromptKeys`), their block keys
under the request's salt (tenant and ``cache_salt``, as the engine salts them) with the core's
own function (``kvserve._core.Context.block_keys``), and polls every replica's KV events
(``Engine.kv_events``) every ``poll_s`` seconds. A replica that fails ``misses`` polls in a row
is gone for the router (its sessions unstick); when it answers again (Ray Serve restarts a
dead replica) it comes back with a snapshot of what it holds.

Only ``/health`` (the replicas' state) and ``/metrics`` (the router's counters) are the
ingress's own; everything else is a replica's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .._model import Model, prompt_ids
from ..engine.tenancy import salt_for
from ..server.config import ServerConfig
from ..server.cors import EXPOSED_HEADERS, Cors, parse_origins
from ..server.tenants import Tenants
from ..tools import plan_tools
from .router import Choice, Router

__all__ = ["PromptKeys", "create_ingress"]

log = logging.getLogger("kvserve.cluster")

_GENERATION = ("/v1/chat/completions", "/v1/completions")
# The headers the ingress adds to a replica's answer (module docs).
_ROUTING_HEADERS = ("x-kvserve-replica", "x-kvserve-route", "x-kvserve-prefix-blocks")
# Hop-by-hop and framing headers the ingress's own server sets.
_DROP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date",
                   "server"})  # fmt: skip


class PromptKeys:
    """A generation request's prompt block keys, as a replica's engine will key them: the
    model's tokenizer and chat template (``config.chat_template`` if given), and the block
    keys of a tiny context of the same K/V type (the keys depend on the model, the K/V type and
    the block size, not on the pool's size)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.model = Model(str(config.model), 1, chat_template=config.chat_template)
        size = 1 << 20
        while True:  # the smallest pool that holds a block of this model
            try:
                self.ctx = self.model.new_context(16, kv_type=config.kv_type, kv_memory=size)
                break
            except ValueError:
                if size >= 1 << 32:
                    raise
                size *= 4
        self.tenants = (
            Tenants.load(config.api_keys_file) if config.api_keys_file is not None else None
        )

    def salt(self, body: Mapping[str, Any], token: bytes | None) -> bytes:
        cache_salt = body.get("cache_salt")
        cache_salt = cache_salt if isinstance(cache_salt, str) else None
        if self.tenants is None:
            return salt_for(None, cache_salt, True)
        tenant = self.tenants.authenticate(token)
        if tenant is None:
            return b""
        return salt_for(tenant.name, cache_salt, tenant.share_prefix_cache)

    def ids(self, path: str, body: Mapping[str, Any]) -> list[int]:
        if path == "/v1/chat/completions":
            messages = body.get("messages")
            if not isinstance(messages, list):
                return []
            special = self.config.special_in_content
            # The tools as the replica renders them (kvserve.tools: the template's own format
            # or the generic system section), so that the keys are those of its prompt.
            shown = None
            if body.get("tools"):
                plan = plan_tools(
                    self.model.chat_template,
                    body.get("tools"),
                    body.get("tool_choice"),
                    body.get("parallel_tool_calls"),
                )
                shown = None if plan is None else plan.render_tools
            return list(self.model.tokenize_chat(messages, special_in_content=special, tools=shown))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts: the first one's prefix decides
        if isinstance(prompt, str):
            return prompt_ids(self.model, prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        return []

    def keys(self, path: str, body: Mapping[str, Any], token: bytes | None) -> list[int]:
        """The block keys of the request's prompt; [] when the body is not one the replica
        would accept (the replica then answers the error; routing does not matter)."""
        try:
            return list(self.ctx.block_keys(self.ids(path, body), self.salt(body, token)))
        except (ValueError, TypeError, KeyError):
            return []


def _bearer(request: Request) -> bytes | None:
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" and token.strip() else None


async def _wait(awaitable: Any, timeout: float) -> Any:
    async def run() -> Any:
        return await awaitable

    return await asyncio.wait_for(run(), timeout)


class _Ingress:
    def __init__(
        self,
        replicas: Mapping[str, Any],
        keys: PromptKeys | None,
        router: Router,
        poll_s: float,
        misses: int,
        max_body: int,
    ) -> None:
        self.handles = dict(replicas)
        self.max_body = max_body
        self.keys = keys
        self.router = router
        self.poll_s = poll_s
        self.max_misses = misses
        self.misses: Counter[str] = Counter()
        self.routed: Counter[tuple[str, str]] = Counter()
        self.matched: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.polls = 0

    # -- what the replicas hold ----------------------------------------------------------------
    async def poll_one(self, name: str) -> None:
        handle = self.handles[name]
        known = name in self.router.replicas
        try:
            got = await _wait(handle.kv_events.remote(resync=not known), max(2.0, 20 * self.poll_s))
        except Exception as e:  # a dead or restarting replica: Ray's errors vary
            self.misses[name] += 1
            if known and self.misses[name] >= self.max_misses:
                log.warning("replica %s is gone for the router: %s", name, e)
                self.router.remove_replica(name)
            return
        self.misses[name] = 0
        if not known:
            log.info("replica %s is live", name)
            self.router.add_replica(name)
        self.router.apply_events(name, got["events"])

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll_one(n) for n in self.handles))
        self.polls += 1

    async def poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.poll_all()
            except Exception:  # never let the poller die
                log.exception("polling the replicas' KV events failed")

    # -- requests ------------------------------------------------------------------------------
    async def choose(self, request: Request, body: bytes) -> Choice:
        path = request.url.path
        token = _bearer(request)
        scope = (token or b"").hex()
        session: str | None = None
        keys: list[int] = []
        if path in _GENERATION:
            try:
                parsed = json.loads(body) if body else None
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                sid = parsed.get("session_id")
                if isinstance(sid, str):
                    session = f"{scope}/{sid}"
                if self.keys is not None:
                    keys = await asyncio.to_thread(self.keys.keys, path, parsed, token)
        elif path.startswith("/v1/sessions/"):
            sid = path.removeprefix("/v1/sessions/").split("/", 1)[0]
            if sid == "restore":
                with contextlib.suppress(ValueError, AttributeError):
                    parsed = json.loads(body)
                    sid = parsed.get("session_id") or parsed.get("id") or ""
            session = f"{scope}/{sid}" if sid else None
        return self.router.choose(keys, session)

    async def read_body(self, request: Request) -> bytes | None:
        """The body, or None when it is longer than the replicas accept (``max_body``): refused
        on its Content-Length before it is read, or cut off once it passes the limit, so a
        huge body costs the ingress no more memory than a replica would spend on it."""
        limit = self.max_body
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            return None
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return None
        return bytes(body)

    async def forward(self, request: Request) -> Response:
        body = await self.read_body(request)
        if body is None:
            return JSONResponse(
                {"error": {"message": f"the request body is larger than {self.max_body} bytes",
                           "type": "invalid_request_error", "code": "body_too_large"}},
                status_code=413,
                # The rest of the body is not read: the connection ends with the answer.
                headers={"connection": "close"},
            )  # fmt: skip
        headers = [(k, v) for k, v in request.headers.items() if k.lower() != "host"]
        query = request.url.query.encode("latin-1")
        tried: set[str] = set()
        while True:
            try:
                choice = await self.choose(request, body)
            except LookupError:
                return JSONResponse(
                    {"error": {"message": "no replica is live", "type": "server_error",
                               "code": "no_replica"}},
                    status_code=503,
                    headers={"retry-after": "1"},
                )  # fmt: skip
            name = choice.replica
            self.router.started(name)
            stream = (
                self.handles[name]
                .options(stream=True)
                .request.remote(request.method, request.url.path, query, headers, body)
            )
            try:
                start = await stream.__anext__()
            except Exception as e:
                self.router.finished(name)
                self.failed[name] += 1
                log.warning("replica %s failed a request before answering: %s", name, e)
                self.router.remove_replica(name)
                tried.add(name)
                if len(tried) >= len(self.handles):
                    raise
                continue  # the response has not started: another replica may answer
            break
        self.routed[(name, choice.reason)] += 1
        self.matched[name] += choice.matched_blocks
        _, status, out_headers = start
        kept = {k: v for k, v in out_headers if k.lower() not in _DROP}
        replica, route, blocks = _ROUTING_HEADERS
        kept[replica] = name
        kept[route] = choice.reason
        kept[blocks] = str(choice.matched_blocks)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                stream.cancel()  # a client gone mid-stream: the replica sees the disconnect
                self.router.finished(name)

        media = kept.pop("content-type", None)
        return StreamingResponse(chunks(), status_code=status, headers=kept, media_type=media)

    # -- the ingress's own routes --------------------------------------------------------------
    def health(self) -> Response:
        live = set(self.router.replicas)
        state = {n: ("ok" if n in live else "gone") for n in self.handles}
        ok = bool(live)
        return JSONResponse(
            {"status": "ok" if ok else "error", "replicas": state}, status_code=200 if ok else 503
        )

    def metrics(self) -> Response:
        lines = [
            "# HELP kvserve_router_requests_total Requests routed, by replica and reason.",
            "# TYPE kvserve_router_requests_total counter",
        ]
        for (name, reason), n in sorted(self.routed.items()):
            lines.append(f'kvserve_router_requests_total{{replica="{name}",reason="{reason}"}} {n}')
        per_replica = (
            ("kvserve_router_prefix_blocks_total", "counter",
             "Prompt blocks routed to a replica believed to hold them.", self.matched),
            ("kvserve_router_failed_total", "counter",
             "Requests a replica failed before answering.", self.failed),
            ("kvserve_router_replica_blocks", "gauge",
             "Blocks the router believes a replica holds (from its KV events).",
             {n: self.router.held(n) for n in self.handles}),
            ("kvserve_router_replica_load", "gauge", "Requests in flight per replica.",
             {n: self.router.load(n) for n in self.handles}),
            ("kvserve_router_replica_up", "gauge", "Whether the router routes to a replica.",
             {n: int(n in self.router.replicas) for n in self.handles}),
        )  # fmt: skip
        for metric, kind, text, values in per_replica:
            lines += [f"# HELP {metric} {text}", f"# TYPE {metric} {kind}"]
            lines += [f'{metric}{{replica="{n}"}} {values.get(n, 0)}' for n in self.handles]
        lines += [
            "# HELP kvserve_router_event_polls_total Rounds of KV-event polls.",
            "# TYPE kvserve_router_event_polls_total counter",
            f"kvserve_router_event_polls_total {self.polls}",
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def create_ingress(
    config: ServerConfig,
    replicas: Mapping[str, Any],
    *,
    router: Router | None = None,
    keys: PromptKeys | None = None,
    poll_s: float = 0.1,
    misses: int = 3,
) -> Starlette:
    """The ingress app over ``replicas`` (name -> a Ray Serve ``DeploymentHandle`` of a
    :class:`~kvserve.cluster.replica.ReplicaServer`, or anything with the same ``.remote``
    calls). ``keys``: how prompts are keyed (default: :class:`PromptKeys` of ``config``)."""
    ingress = _Ingress(
        replicas,
        keys if keys is not None else PromptKeys(config),
        router if router is not None else Router(),
        poll_s,
        misses,
        config.body_limit(),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        t0 = time.monotonic()
        await ingress.poll_all()  # the replicas are up: learn what they hold first
        log.info(
            "ingress ready: %d of %d replicas live (%.2fs)",
            len(ingress.router.replicas), len(replicas), time.monotonic() - t0,
        )  # fmt: skip
        task = asyncio.ensure_future(ingress.poll_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def health(request: Request) -> Response:
        return ingress.health()

    async def metrics(request: Request) -> Response:
        return ingress.metrics()

    async def forward(request: Request) -> Response:
        return await ingress.forward(request)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/{path:path}", forward, methods=methods),
        ],
        lifespan=lifespan,
    )
    app.state.ingress = ingress
    origins = parse_origins(config.cors_origins)
    if origins is None:
        return app
    # The ingress answers preflights and adds the CORS headers (the replicas run without).
    return Cors(app, origins, expose=(*EXPOSED_HEADERS, *_ROUTING_HEADERS))  # type: ignore[return-value]
