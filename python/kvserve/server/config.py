"""What ``kvserve serve`` is configured with: one dataclass, filled by the command line (each
flag with its ``KVSERVE_*`` environment twin) or by a program that embeds the server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MIN_DEFAULT_MAX_BODY", "ServerConfig"]

# The default body limit is 256 bytes per token of context, at least this (1 MiB).
MIN_DEFAULT_MAX_BODY = 1 << 20


@dataclass
class ServerConfig:
    """``model``: a GGUF path or a registered model name (None: the default model).
    ``parallel``: sequences decoded at once; ``max_queue``: sequences that may wait beyond
    them (a request past that gets 503 with ``Retry-After``). ``ctx_size``, ``kv_memory``,
    ``kv_type``, ``batch_tokens``, ``prompt_order``, ``threads``, ``context_shift`` (the
    default of the per-request option), ``kv_high_watermark``, ``kv_low_watermark``,
    ``session_ttl``, ``max_sessions``: as :class:`kvserve.Engine` takes them. ``session_dir``: where
    ``/v1/sessions/{id}/save`` writes and ``/v1/sessions/restore`` reads session files (None:
    sessions live in memory only). ``kv_disk``, ``kv_disk_size``: the K/V disk tier's
    directory (None: no tier) and size, as :class:`kvserve.Engine` takes them. ``kv_remote``,
    ``kv_remote_ttl``: the shared K/V tier's store URL (None: no tier) and its blocks' time to
    live in seconds (None: a day), as :class:`kvserve.Engine` takes them.
    ``api_key``: when set, every route but ``/health`` needs ``Authorization: Bearer KEY``.
    ``api_keys_file``: tenants and their keys and limits instead (TOML;
    python/kvserve/server/tenants.py); session ids are then scoped by tenant.
    ``max_body``: the largest request body in bytes (413 beyond, refused on its Content-Length
    before it is read); None: 256 bytes per token of ``ctx_size``, at least 1 MiB (a body past
    that holds more text than the context, even JSON-escaped, so the server need not read and
    parse it: a flood of multi-megabyte bodies costs it next to nothing). ``body_timeout``:
    seconds from a request's first body read until its whole body is in; a body that trickles
    in slower (slowloris) is cut off with a 408 and the connection closed. ``shutdown_grace``:
    seconds that requests in flight at SIGTERM get to finish before they end with a
    ``shutting_down`` error (a stream: an SSE error event and ``[DONE]``). ``model_id``: the
    id that ``/v1/models`` and responses report (default: the model file's name without ``.gguf``).
    ``chat_template``: a Jinja chat template (its source) to use instead of the model's.
    ``max_tokens_limit``: the most tokens one request may generate (an explicit
    ``max_tokens`` above it is a 400; a request without one is bounded by it); None: the
    context size. ``max_prompt_chars``: the most characters of one prompt (a chat: of its
    messages' contents), checked before tokenizing; None: ``ctx_size`` x the model's longest
    token in bytes, past which no prompt can fit. ``special_in_content``: parse special-token
    text inside chat message content as special tokens (llama.cpp's behaviour: a user can
    forge a role; for trusted clients only); off, content is plain text. When the app is given
    an engine, the engine's own ``max_tokens_limit`` applies. ``max_stored_responses``: the most
    ``/v1/responses`` responses kept for ``previous_response_id`` and ``GET`` (least recently
    used out first; python/kvserve/server/responses.py). ``cors_origins``: the origins whose
    browser pages may call the server (``https://app.example.com``, or ``*`` alone for any;
    :mod:`kvserve.server.cors`); None: no CORS headers at all. ``step_log``: the engine's step log
    file, as :class:`kvserve.Engine` takes it (None: none)."""

    model: str | None = None
    chat_template: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    threads: int | None = None
    parallel: int = 16
    ctx_size: int = 4096
    kv_memory: int | str | None = None
    kv_type: str = "f16"
    batch_tokens: int = 512
    prompt_order: str = "groups"
    context_shift: bool = False
    session_dir: str | None = None
    kv_disk: str | None = None
    kv_disk_size: int | str = "20GiB"
    kv_remote: str | None = None
    kv_remote_ttl: float | None = None
    kv_high_watermark: float = 0.9
    kv_low_watermark: float = 0.7
    session_ttl: float | None = None
    max_sessions: int | None = None
    max_queue: int = 256
    api_key: str | None = None
    api_keys_file: str | None = None
    log_format: str = "text"
    max_body: int | None = None
    body_timeout: float = 30.0
    shutdown_grace: float = 3.0
    model_id: str | None = None
    max_tokens_limit: int | None = None
    max_prompt_chars: int | None = None
    special_in_content: bool = False
    max_stored_responses: int = 1024
    cors_origins: list[str] | None = None
    step_log: str | None = None

    def body_limit(self, ctx_size: int | None = None) -> int:
        """``max_body``, or its default for ``ctx_size`` (the engine's; default: this config's
        ``ctx_size``; see the class docs)."""
        if self.max_body is not None:
            return self.max_body
        return max(MIN_DEFAULT_MAX_BODY, 256 * (ctx_size or self.ctx_size))

    def engine_kwargs(self) -> dict[str, Any]:
        """The :class:`kvserve.Engine` arguments (everything but the model)."""
        return {
            "threads": self.threads,
            "parallel": self.parallel,
            "ctx_size": self.ctx_size,
            "kv_memory": self.kv_memory,
            "kv_type": self.kv_type,
            "kv_disk": self.kv_disk,
            "kv_disk_size": self.kv_disk_size,
            "kv_remote": self.kv_remote,
            "kv_remote_ttl": self.kv_remote_ttl,
            "batch_tokens": self.batch_tokens,
            "prompt_order": self.prompt_order,
            "context_shift": self.context_shift,
            "kv_high_watermark": self.kv_high_watermark,
            "kv_low_watermark": self.kv_low_watermark,
            "session_ttl": self.session_ttl,
            "max_sessions": self.max_sessions,
            "step_log": self.step_log,
            "max_tokens_limit": (
                self.ctx_size if self.max_tokens_limit is None else self.max_tokens_limit
            ),
        }
