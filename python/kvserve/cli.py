"""The ``kvserve`` command line (also ``python -m kvserve``).

Subcommands: ``serve``, ``pull``, ``tokenize``, ``complete``, ``chat``, ``bench``, ``info``.
Without ``--model`` the default model is used (downloaded and cached on first use). Every
``serve`` flag also reads a ``KVSERVE_*`` environment variable (the flag wins), shown by
``serve --help``.

Guarantees: every expected failure (missing or malformed model file, download error, bad
argument value, full context) prints exactly one line ``kvserve: error: <message>`` on stderr
and exits with status 1, without a traceback (set ``KVSERVE_DEBUG=1`` to re-raise instead).
Output to stdout is UTF-8 regardless of the locale; ``--json`` output is a single JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__
from .models import DEFAULT_MODEL, REGISTRY

if TYPE_CHECKING:
    from ._model import Model
    from .server import ServerConfig

PROG = "kvserve"


def _write(text: str) -> None:
    buf = getattr(sys.stdout, "buffer", None)
    if buf is not None:
        buf.write(text.encode("utf-8"))
    else:
        sys.stdout.write(text)
    sys.stdout.flush()


def _print_json(obj: object) -> None:
    _write(json.dumps(obj, ensure_ascii=False) + "\n")


def _env_threads() -> int | None:
    raw = os.environ.get("KVSERVE_THREADS", "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"KVSERVE_THREADS must be a positive integer, got {raw!r}")
    return n


def _threads(args: argparse.Namespace) -> int | None:
    """``--threads``, else ``KVSERVE_THREADS``, else None (the engine picks physical cores)."""
    t: int | None = args.threads
    return t if t is not None else _env_threads()


def _int_at_least(lowest: int, what: str) -> Callable[[str], int]:
    """An argparse type accepting integers >= ``lowest``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")


def _int_list(text: str) -> list[int]:
    """A comma-separated list of positive integers (``1,4,16``)."""
    return [_positive_int(part) for part in text.split(",")]


_nonneg_int = _int_at_least(0, "an integer >= 0")


def _logit_bias(text: str) -> tuple[int, float]:
    """``TOKEN=BIAS``: a token id and the bias added to its logit (``-inf`` bans it)."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected TOKEN=BIAS (a token id and a number, e.g. 13=-inf), got {text!r}"
        ) from None


def _load(args: argparse.Namespace) -> Model:
    from ._model import Model

    return Model.load(args.model, threads=_threads(args))


def _read_text(text: str) -> str:
    return sys.stdin.read() if text == "-" else text


# -- subcommands ------------------------------------------------------------------------------
def cmd_pull(args: argparse.Namespace) -> int:
    from .models import pull

    path = pull(args.name, quiet=args.quiet)
    _write(f"{path}\n")
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    model = _load(args)
    tokens = model.tokenize(_read_text(args.text), add_special=args.add_special, parse_special=True)
    if args.json:
        _print_json({"tokens": tokens})
    else:
        _write(" ".join(map(str, tokens)) + "\n")
    return 0


def _generation_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of Model.generate/stream from the flags of _generation_args."""
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "typical_p": args.typical_p,
        "repeat_penalty": args.repeat_penalty,
        "penalty_last_n": args.repeat_last_n,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "logit_bias": dict(args.logit_bias or []),
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "stop": args.stop,
        "n_ctx": args.ctx_size,
        "kv_type": args.kv_type,
    }


def cmd_complete(args: argparse.Namespace) -> int:
    model = _load(args)
    kwargs = _generation_kwargs(args)
    prompt = _read_text(args.prompt)
    if args.json:
        result = model.generate(prompt, **kwargs)
        _print_json({"text": result.text, "tokens": result.tokens})
        return 0
    for piece in model.stream(prompt, **kwargs):
        _write(piece)
    if sys.stdout.isatty():
        _write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from ._model import Model

    template = None
    if args.chat_template_file is not None:
        with open(args.chat_template_file, encoding="utf-8") as f:
            template = f.read()
    model = Model.load(args.model, threads=_threads(args), chat_template=template)
    kwargs = _generation_kwargs(args)
    messages = [{"role": "user", "content": _read_text(args.message)}]
    if args.system is not None:
        messages.insert(0, {"role": "system", "content": args.system})
    if args.json:
        result = model.chat(messages, **kwargs)
        _print_json({"text": result.text, "tokens": result.tokens})
        return 0
    for piece in model.stream(model.apply_chat_template(messages), **kwargs):
        _write(piece)
    if sys.stdout.isatty():
        _write("\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import _core

    if args.batch and args.depth:
        raise ValueError("bench: --depth is for one sequence (with --batch, -p is the depth)")
    if args.batch and args.n_prompt == 0:
        raise ValueError("bench: --batch needs -p >= 1")
    if args.n_prompt == 0 and args.n_gen == 0:
        raise ValueError("bench: nothing to measure (-p 0 and -n 0)")
    model = _load(args)
    threads = model.core.threads
    if args.batch:
        rows = _core.bench_batched(model.core, args.batch, args.n_prompt, args.n_gen)
        if args.json:
            _print_json({"batches": rows})
        else:
            _write(f"model: {model.path.name}  threads: {threads}  simd: {_core.simd_level()}\n")
            for r in rows:
                _write(
                    f"batch {r['batch']:>3}: prefill {r['prefill_tok_s']:8.1f} tok/s  "
                    f"decode {r['decode_tok_s']:8.1f} tok/s\n"
                )
        return 0
    result = _core.bench(model.core, args.n_prompt, args.n_gen, args.reps, args.depth)
    result["repacked_bytes"] = model.core.repacked_bytes
    if args.json:
        _print_json(result)
    else:
        at = f" after {args.depth} tokens" if args.depth else ""
        _write(f"model: {model.path.name}  threads: {threads}  simd: {_core.simd_level()}\n")
        if args.n_prompt:
            _write(f"prefill ({args.n_prompt} tokens{at}): {result['prefill_tok_s']:.1f} tok/s\n")
        if args.n_gen:
            _write(f"decode  ({args.n_gen} tokens{at}): {result['decode_tok_s']:.1f} tok/s\n")
        seen = args.depth + (args.n_prompt if args.n_prompt > 0 else args.n_gen)
        for g in result["kv_groups"]:
            kind = g["kind"] if g["window"] is None else f"window {g['window']}"
            _write(
                f"KV {kind} ({g['layers']} layers): {g['blocks_held']} blocks held after "
                f"{seen} tokens = {g['bytes_held'] / 2**20:.1f} MiB of "
                f"{g['bytes_total'] / 2**20:.1f} MiB allocated\n"
            )
        if result["repacked_bytes"]:
            _write(f"weights repacked for decode: {result['repacked_bytes'] / 2**20:.1f} MiB\n")
    return 0


# -- serve ------------------------------------------------------------------------------------
def _size(text: str) -> int:
    from .engine import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 2GiB or 512MiB, got {text!r}"
        ) from None


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def _bool(text: str) -> bool:
    """An environment variable's boolean: 1/true/yes/on or 0/false/no/off."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected 1/true/yes/on or 0/false/no/off, got {text!r}")


def _fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _seconds(text: str) -> float:
    """A positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0.0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _origins(text: str) -> list[str]:
    """``--cors-origins``: a comma-separated list of origins, or ``*``."""
    from .server.cors import parse_origins

    try:
        origins = parse_origins(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if origins is None:
        raise argparse.ArgumentTypeError("expected origins such as https://app.example.com, or *")
    return list(origins)


def _port(text: str) -> int:
    value = _nonneg_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {text!r}")
    return value


# (flags, metavar, environment variable, type, default, help) of `kvserve serve`. A flag's value
# wins over its environment twin, which wins over the default (a string default is parsed).
_SERVE_FLAGS: list[tuple[tuple[str, ...], str, str, Callable[[str], Any], Any, str]] = [
    (("-m", "--model"), "PATH", "KVSERVE_MODEL", str, None,
     "GGUF model file or registered model name (default: the default model, downloaded on"
     " first use)"),
    (("--chat-template-file",), "PATH", "KVSERVE_CHAT_TEMPLATE_FILE", str, None,
     "a Jinja chat template to use instead of the model's"),
    (("--special-in-content",), "", "KVSERVE_SPECIAL_IN_CONTENT", _bool, False,
     "parse special-token text inside chat message content (llama.cpp's behaviour; a user"
     " can then forge roles: trusted clients only). Off: content is plain text"),
    (("--host",), "ADDR", "KVSERVE_HOST", str, "127.0.0.1", "address to listen on"),
    (("--port",), "N", "KVSERVE_PORT", _port, 8080, "port to listen on (0: any free port)"),
    (("-t", "--threads"), "N", "KVSERVE_THREADS", _positive_int, None,
     "worker threads (default: the number of physical cores)"),
    (("-np", "--parallel"), "N", "KVSERVE_PARALLEL", _positive_int, 16,
     "sequences decoded at once"),
    (("-c", "--ctx-size"), "N", "KVSERVE_CTX_SIZE", _positive_int, 4096,
     "most tokens (prompt + output) of one sequence"),
    (("--kv-memory",), "SIZE", "KVSERVE_KV_MEMORY", _size, None,
     "K/V pool size such as 2GiB (default: room for parallel x ctx-size tokens)"),
    (("--kv-type",), "{f16,q8_0,f32}", "KVSERVE_KV_TYPE", _choice("f16", "q8_0", "f32"), "f16",
     "K/V element type (q8_0: half the memory of f16)"),
    (("--kv-disk",), "DIR", "KVSERVE_KV_DISK", str, None,
     "K/V disk tier: cached prompt blocks are also written to DIR and read back instead of"
     " recomputed once RAM evicted them, also after a restart (default: none)"),
    (("--kv-disk-size",), "SIZE", "KVSERVE_KV_DISK_SIZE", _size, "20GiB",
     "most bytes the K/V disk tier keeps; least recently used blocks go first"),
    (("--kv-remote",), "URL", "KVSERVE_KV_REMOTE", str, None,
     "shared K/V tier on Redis or Valkey (redis://[[user]:password@]host[:port][/db]):"
     " computed prompt blocks are also stored there, and every process serving the same model"
     " fetches them instead of recomputing (default: none)"),
    (("--kv-remote-ttl",), "SECONDS", "KVSERVE_KV_REMOTE_TTL", _seconds, None,
     "time to live of blocks stored in the shared K/V tier (default: one day)"),
    (("--batch-tokens",), "N", "KVSERVE_BATCH_TOKENS", _positive_int, 512,
     "prompt tokens computed per step (chunked prefill)"),
    (("--prompt-order",), "{groups,fcfs}", "KVSERVE_PROMPT_ORDER", _choice("groups", "fcfs"),
     "groups", "how a step's prompt tokens are spent among prompts of one priority: groups,"
     " the least work left per user served first (a prefix others wait for counts for each"
     " of them); fcfs, in arrival order"),
    (("--context-shift",), "", "KVSERVE_CONTEXT_SHIFT", _bool, False,
     "when a sequence fills --ctx-size, drop the older half of its tokens (after n_keep) and"
     " go on, as llama.cpp's --context-shift (a request's context_shift field overrides it)"),
    (("--session-dir",), "PATH", "KVSERVE_SESSION_DIR", str, None,
     "where /v1/sessions/{id}/save writes and /v1/sessions/restore reads session files"
     " (created if missing; default: no session files)"),
    (("--kv-high-watermark",), "F", "KVSERVE_KV_HIGH_WATERMARK", _fraction, 0.9,
     "when the K/V pool's usage passes this share, idle sessions are evicted ..."),
    (("--kv-low-watermark",), "F", "KVSERVE_KV_LOW_WATERMARK", _fraction, 0.7,
     "... down to this share"),
    (("--session-ttl",), "SECONDS", "KVSERVE_SESSION_TTL", _seconds, None,
     "drop a session idle this long (default: never)"),
    (("--max-sessions",), "N", "KVSERVE_MAX_SESSIONS", _positive_int, None,
     "most sessions held (default: no limit; one more replaces the least recently used idle"
     " one)"),
    (("--max-queue",), "N", "KVSERVE_MAX_QUEUE", _nonneg_int, 256,
     "sequences that may wait beyond --parallel; past that 503 with Retry-After"),
    (("--max-tokens-limit",), "N", "KVSERVE_MAX_TOKENS_LIMIT", _positive_int, None,
     "most tokens one request may generate: a larger max_tokens is a 400, a request without"
     " one stops there (default: --ctx-size)"),
    (("--max-prompt-chars",), "N", "KVSERVE_MAX_PROMPT_CHARS", _positive_int, None,
     "most characters of one prompt (of a chat's message contents), refused with a 400"
     " before tokenizing (default: --ctx-size x the model's longest token in bytes, past"
     " which no prompt fits)"),
    (("--max-stored-responses",), "N", "KVSERVE_MAX_STORED_RESPONSES", _positive_int, 1024,
     "most /v1/responses responses kept for previous_response_id and GET (least recently"
     " used out first, and the session that holds its K/V with it)"),
    (("--api-key",), "KEY", "KVSERVE_API_KEY", str, None,
     "require 'Authorization: Bearer KEY' on every route but /health"),
    (("--api-key-file",), "PATH", "KVSERVE_API_KEY_FILE", str, None,
     "read the API key from the first line of this file"),
    (("--api-keys-file",), "PATH", "KVSERVE_API_KEYS_FILE", str, None,
     "tenants, their keys and limits (TOML, [tenants.NAME] tables; read again on SIGHUP);"
     " session ids are then scoped by tenant"),
    (("--cors-origins",), "ORIGINS", "KVSERVE_CORS_ORIGINS", _origins, None,
     "let browser pages of these origins call the server (CORS): comma-separated origins"
     " such as https://app.example.com,http://localhost:3000, or * for any; preflights are"
     " answered without an API key (default: none, no CORS headers)"),
    (("--max-body",), "SIZE", "KVSERVE_MAX_BODY", _size, None,
     "largest request body (413 beyond it; default: 256 bytes per token of --ctx-size, at"
     " least 1MiB)"),
    (("--body-timeout",), "SECONDS", "KVSERVE_BODY_TIMEOUT", _seconds, 30.0,
     "seconds a request body may take to arrive; a slower one is cut off with a 408"),
    (("--shutdown-grace",), "SECONDS", "KVSERVE_SHUTDOWN_GRACE", _seconds, 3.0,
     "seconds requests in flight at SIGTERM get to finish before they end with an error"),
    (("--step-log",), "PATH", "KVSERVE_STEP_LOG", str, None,
     "append one JSON line per computed batch to PATH (its start, seconds, tokens and"
     " requests: python/kvserve/engine/steplog.py), to see where a workload's time goes"),
    (("--log-format",), "{text,json}", "KVSERVE_LOG_FORMAT", _choice("text", "json"), "text",
     "log lines as text, or one JSON object per line"),
    (("--replicas",), "N", "KVSERVE_REPLICAS", _positive_int, 1,
     "run N >= 2 engine replicas as Ray Serve deployments behind this one endpoint, routed"
     " by prefix-cache affinity (needs: pip install kvserve[cluster]; docs/CLUSTER.md)"),
    (("--ray-address",), "ADDR", "KVSERVE_RAY_ADDRESS", str, None,
     "with --replicas: the Ray cluster to run on (auto, or ray://HOST:PORT; default: start"
     " a local Ray instance)"),
]  # fmt: skip


def _dest(flags: tuple[str, ...]) -> str:
    return flags[-1].lstrip("-").replace("-", "_")


def _serve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Each serve flag's value: the flag, else its environment variable, else the default."""
    settings: dict[str, Any] = {}
    for flags, _metavar, env, parse, default, _help in _SERVE_FLAGS:
        value = getattr(args, _dest(flags))
        raw = os.environ.get(env, "").strip()
        if value is None and raw:
            try:
                value = parse(raw)
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise ValueError(f"{env}: {e}") from None
        if value is None:
            value = parse(default) if isinstance(default, str) else default
        settings[_dest(flags)] = value
    return settings


def serve_config(args: argparse.Namespace) -> ServerConfig:
    """The server's configuration from the serve flags and their variables (the model not
    yet fetched: None or a registered name stay as they are)."""
    from .server import ServerConfig

    s = _serve_settings(args)
    if s["api_key"] is not None and s["api_key_file"] is not None:
        raise ValueError("give the API key with --api-key or with --api-key-file, not both")
    api_key = s["api_key"]
    if s["api_key_file"] is not None:
        with open(s["api_key_file"], encoding="utf-8") as f:
            api_key = f.readline().strip()
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty")
    if s["kv_low_watermark"] > s["kv_high_watermark"]:
        raise ValueError(
            f"--kv-low-watermark ({s['kv_low_watermark']}) must not be above"
            f" --kv-high-watermark ({s['kv_high_watermark']})"
        )
    template = None
    if s["chat_template_file"] is not None:
        with open(s["chat_template_file"], encoding="utf-8") as f:
            template = f.read()
    return ServerConfig(
        model=s["model"],
        chat_template=template,
        host=s["host"],
        port=s["port"],
        threads=s["threads"],
        parallel=s["parallel"],
        ctx_size=s["ctx_size"],
        kv_memory=s["kv_memory"],
        kv_type=s["kv_type"],
        kv_disk=s["kv_disk"],
        kv_disk_size=s["kv_disk_size"],
        kv_remote=s["kv_remote"],
        kv_remote_ttl=s["kv_remote_ttl"],
        batch_tokens=s["batch_tokens"],
        prompt_order=s["prompt_order"],
        context_shift=s["context_shift"],
        session_dir=s["session_dir"],
        kv_high_watermark=s["kv_high_watermark"],
        kv_low_watermark=s["kv_low_watermark"],
        session_ttl=s["session_ttl"],
        max_sessions=s["max_sessions"],
        max_queue=s["max_queue"],
        api_key=api_key,
        api_keys_file=s["api_keys_file"],
        log_format=s["log_format"],
        max_body=s["max_body"],
        body_timeout=s["body_timeout"],
        shutdown_grace=s["shutdown_grace"],
        max_tokens_limit=s["max_tokens_limit"],
        max_prompt_chars=s["max_prompt_chars"],
        special_in_content=s["special_in_content"],
        max_stored_responses=s["max_stored_responses"],
        cors_origins=s["cors_origins"],
        step_log=s["step_log"],
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from . import models
    from .server import serve

    config = serve_config(args)
    settings = _serve_settings(args)
    replicas, ray_address = settings["replicas"], settings["ray_address"]
    if replicas == 1 and ray_address is not None:
        raise ValueError("--ray-address needs --replicas N (N >= 2)")
    if replicas > 1 and config.step_log is not None:
        raise ValueError("--step-log logs one engine's steps; it does not go with --replicas")
    if replicas > 1:
        from .cluster.launch import import_ray

        import_ray()  # before the model download: a missing extra fails at once
    model = config.model
    if model is None or (model in REGISTRY and not os.path.exists(model)):
        # progress bar on a terminal; cached after the first
        config.model = str(models.pull(model))
    if replicas > 1:
        from .cluster.launch import serve_replicas

        serve_replicas(config, replicas, ray_address=ray_address)
        return 0
    serve(config)
    return 0


def _summarize(value: object) -> object:
    """A metadata value made short enough to print: long arrays become their length."""
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"[{len(value)} items]"
    if isinstance(value, str) and len(value) > 80:
        return value[:77] + "..."
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return value


def cmd_info(args: argparse.Namespace) -> int:
    from . import _core

    model = _load(args)
    summary: dict[str, object] = {
        "path": str(model.path),
        "file_size": model.path.stat().st_size,
        "arch": model.arch,
        "name": model.name,
        "n_vocab": model.n_vocab,
        "n_ctx_train": model.n_ctx_train,
        "bos": model.bos,
        "eos": model.eos,
        "add_bos": model.add_bos,
        "simd": _core.simd_level(),
    }
    metadata = {k: _summarize(v) for k, v in sorted(model.metadata().items())}
    if args.json:
        _print_json({**summary, "metadata": metadata})
        return 0
    lines = [f"{k}: {v}" for k, v in summary.items()]
    lines.append("metadata:")
    lines += [
        f"  {k} = {json.dumps(v, ensure_ascii=False, default=str)}" for k, v in metadata.items()
    ]
    _write("\n".join(lines) + "\n")
    return 0


# -- parser -----------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors follow the command's error contract: one line
    ``kvserve: error: <message>`` on stderr and status 1 (argparse's default is the usage text
    and status 2). Subcommand parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"{PROG}: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="CPU inference for GGUF models.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def model_args(p: argparse.ArgumentParser, threads: bool = True) -> None:
        p.add_argument(
            "-m",
            "--model",
            metavar="PATH",
            help="GGUF model file (default: the default model, downloaded on first use)",
        )
        if threads:
            p.add_argument(
                "-t",
                "--threads",
                type=_positive_int,
                help="worker threads (default: $KVSERVE_THREADS or the number of physical cores)",
            )
        p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API (the main job)",
        description="Serve a model to many clients over an OpenAI-compatible HTTP API "
        "(/v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, "
        "/apply-template, /health, /metrics). Each flag can also be set by the environment "
        "variable in brackets; the flag wins.",
    )
    for flags, metavar, env, parse, default, text in _SERVE_FLAGS:
        shown = "" if default is None else f"; default: {default}"
        if parse is _bool:  # a switch: present = on; its variable takes 1/0, true/false, ...
            p.add_argument(
                *flags, dest=_dest(flags), action="store_const", const=True, help=f"{text} [{env}]"
            )
        else:
            p.add_argument(
                *flags,
                dest=_dest(flags),
                metavar=metavar,
                type=parse,
                help=f"{text} [{env}{shown}]",
            )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("pull", help="download and cache a registered model; print its path")
    p.add_argument(
        "name",
        metavar="NAME",
        nargs="?",
        help=f"one of: {', '.join(REGISTRY)} (default: {DEFAULT_MODEL.name})",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="print only the path")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("tokenize", help="print the token ids of TEXT ('-' reads stdin)")
    model_args(p, threads=False)
    p.set_defaults(threads=None)
    p.add_argument(
        "--add-special",
        action="store_true",
        help="add the model's special tokens (BOS) as the model's metadata asks",
    )
    p.add_argument("text", metavar="TEXT")
    p.set_defaults(func=cmd_tokenize)

    def generation_args(p: argparse.ArgumentParser) -> None:
        """Sampling, stop and context flags (read back by _generation_kwargs)."""
        p.add_argument("-n", "--max-tokens", type=_nonneg_int, default=128, help="default: 128")
        p.add_argument(
            "--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)"
        )
        p.add_argument("--top-k", type=_nonneg_int, default=0, help="0 = off (default)")
        p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off (default)")
        p.add_argument("--min-p", type=float, default=0.0, help="0 = off (default)")
        p.add_argument(
            "--typical-p",
            type=float,
            default=1.0,
            help="locally typical sampling; 1.0 = off (default)",
        )
        p.add_argument(
            "--repeat-penalty",
            type=float,
            default=1.0,
            help="penalize tokens of the last --repeat-last-n tokens; 1.0 = off (default)",
        )
        p.add_argument(
            "--repeat-last-n",
            type=int,
            default=64,
            metavar="N",
            help="tokens (prompt included) the penalties look at; 0 = off, -1 = all (default: 64)",
        )
        p.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off (default)")
        p.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off (default)")
        p.add_argument(
            "--logit-bias",
            type=_logit_bias,
            action="append",
            metavar="TOKEN=BIAS",
            help="add BIAS to token id TOKEN's logit; -inf bans it (repeatable)",
        )
        p.add_argument(
            "--ignore-eos",
            action="store_true",
            help="keep generating past end-of-generation tokens",
        )
        p.add_argument("-s", "--seed", type=int, help="random seed for sampling")
        p.add_argument(
            "--stop", action="append", metavar="TEXT", help="stop before TEXT (repeatable)"
        )
        p.add_argument(
            "-c",
            "--ctx-size",
            type=_positive_int,
            help="context size (default: prompt + max tokens)",
        )
        p.add_argument(
            "--kv-type",
            choices=("f16", "q8_0", "f32"),
            default="f16",
            help="K/V cache element type (q8_0: half the memory of f16)",
        )

    p = sub.add_parser("complete", help="continue PROMPT ('-' reads stdin)")
    model_args(p)
    generation_args(p)
    p.add_argument("prompt", metavar="PROMPT")
    p.set_defaults(func=cmd_complete)

    p = sub.add_parser(
        "chat", help="reply to MESSAGE, one user turn in the model's chat template ('-': stdin)"
    )
    model_args(p)
    generation_args(p)
    p.add_argument("--system", metavar="TEXT", help="a system message before MESSAGE")
    p.add_argument(
        "--chat-template-file",
        metavar="PATH",
        help="a Jinja chat template to use instead of the model's",
    )
    p.add_argument("message", metavar="MESSAGE")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="measure prefill and decode speed")
    model_args(p)
    p.add_argument(
        "-p", "--n-prompt", type=_nonneg_int, default=512, help="default: 512 (0: no prefill)"
    )
    p.add_argument(
        "-n", "--n-gen", type=_nonneg_int, default=128, help="default: 128 (0: no decode)"
    )
    p.add_argument(
        "-d",
        "--depth",
        type=_nonneg_int,
        default=0,
        help="tokens already in the context before each timed run, like llama-bench's -d "
        "(default: 0); not with --batch",
    )
    p.add_argument("-r", "--reps", type=_positive_int, default=3, help="timed runs, averaged")
    p.add_argument(
        "--batch",
        type=_int_list,
        metavar="B1,B2,...",
        help="serve B sequences together (each a -p prompt, then -n tokens), like "
        "llama-batched-bench; prints {'batches': [...]}",
    )
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("info", help="print a summary of the model's metadata")
    model_args(p, threads=False)
    p.set_defaults(threads=None)
    p.set_defaults(func=cmd_info)
    return parser


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    debug = os.environ.get("KVSERVE_DEBUG", "") not in ("", "0")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): silence the flush at interpreter exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as exc:
        if debug:
            raise
        sys.stderr.write(f"{PROG}: error: {_one_line(exc)}\n")
        return 1
    except BaseException as exc:
        # pyo3 turns a Rust panic into PanicException (a BaseException): still one line.
        if debug or type(exc).__name__ != "PanicException":
            raise
        sys.stderr.write(f"{PROG}: error: internal error: {_one_line(exc)}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
