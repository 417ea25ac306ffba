#!/usr/bin/env python3
"""Many users of one HTTP server: `kvserve serve` against llama.cpp's `llama-server` and
llama-cpp-python's server, side by side in one run (issue #8).

Each server is started cold (a fresh process, nothing cached) with ``--threads`` (2) threads,
driven by the same asyncio client over loopback, then stopped; the next one starts after it.
Every user streams its turns from ``POST /v1/chat/completions`` (the server applies the model's
chat template), greedy (``temperature: 0``), ``--max-tokens`` (48) new tokens a turn, all users
starting at once; turn 2 sends turn 1's messages, the answer and a new question.

Scenarios:

- ``A`` (issue #8): ``--users`` (16) users, two turns each of a chat opening with the same
  ~800-token system prompt (``benches/bench_users.py``'s prompt and questions).
- ``B`` (retrieval-style): ``--docs`` (4) documents of ~1,500 tokens; user ``u`` asks two
  questions about document ``u % docs`` (the document in its first user message, under a short
  shared system prompt), so 16 users share 4 long prompts. ``--doc-words 2400,600,900,300``
  gives each document its length and ``--doc-users 2,8,4,10`` each its number of users.

Measured per server: wall time from the first request to the last answer, time to first token
(TTFT: from sending a turn to its first text; median and p95 over all turns), generated tokens
per second of wall time (``usage`` from ``stream_options.include_usage`` where the server sends
it, else one token per streamed chunk), peak RSS of the server's process tree (sampled every
50 ms, and at least the root's ``VmHWM``), errors (a non-200 answer, an error event, an empty
or unfinished stream, a client exception). Answers of kvserve and llama-server are compared
(both greedy; they may differ where two tokens are near-ties).

Servers (all on 127.0.0.1, ``--ctx`` tokens per user: kvserve ``--ctx-size``, llama-server
``-c users x ctx`` over ``-np users`` slots, llama-cpp-python ``--n_ctx``):

  python -m kvserve serve --model MODEL --threads 2 --parallel 16 --ctx-size 2048 --port P
  $LLAMA_CPP_BIN_DIR/llama-server -m MODEL -t 2 -tb 2 -np 16 -c 32768 --port P --no-webui
  PYTHON_WITH_LLAMA_CPP -m llama_cpp.server --model MODEL --n_threads 2 \\
      --n_threads_batch 2 --n_ctx 2048 --interrupt_requests False --port P

llama-server keeps its defaults otherwise (continuous batching, prompt cache on, unified KV).
llama-cpp-python's server runs one request at a time (its ``Llama`` reuses the longest common
prefix with the previous request); by default a new request interrupts the running one (each
user would get an empty answer), so ``--interrupt_requests False`` makes them wait their turn.
kvserve runs with ``--step-log`` (one JSON line per computed batch, in the log folder): the
report gives how long its engine computed, and how many prompt tokens, until the last first
turn's first token (where a first turn's wait goes: computing, or idle).
``--write`` appends the table to BENCHMARKS.md.

  python benches/bench_server.py --scenario A --llama-python PY --write
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO_ROOT,
    append_section,
    default_llama_bin_dir,
    default_model,
    loadavg,
    machine_desc,
)
from bench_users import pct, questions, system_prompt  # noqa: E402

HEADING = "## The server under many users (issue #8)"
# kvserve-fcfs: kvserve with --prompt-order fcfs (prompts in arrival order, the order before
# issue 25), to weigh the default prompt order against it in one run.
SERVERS = ("kvserve", "kvserve-fcfs", "llama-server", "llama-cpp-python")

# -- scenario B: documents ----------------------------------------------------------------------

TOWNS = ["Harrowgate", "Millbrook", "Eastwick", "Stonehaven"]
SUBJECTS = [
    "the water supply", "the school roof", "the harbour wall", "the library hours",
    "the bus timetable", "the market square", "the bridge repairs", "the recycling centre",
    "the summer festival", "the flood defences", "the park benches", "the street lights",
]  # fmt: skip


def document(d: int, words: int) -> str:
    """A deterministic council report of about ``words`` words (~1.3 tokens a word)."""
    town = TOWNS[d % len(TOWNS)]
    parts = [f"Annual report of the {town} town council, volume {d + 1}."]
    i = 0
    while sum(len(p.split()) for p in parts) < words:
        s = SUBJECTS[(i + 5 * d) % len(SUBJECTS)]
        year = 1990 + (7 * i + 3 * d) % 30
        parts.append(
            f"Item {i + 1}: in {year} the council of {town} reviewed {s}; the budget was "
            f"{(i + 2) * (d + 3) * 1000} pounds, the work took {(i % 9) + 2} months, and the "
            f"committee voted {5 + i % 4} to {i % 3} to continue {s} next year."
        )
        i += 1
    return " ".join(parts)


DOC_SYSTEM = "You answer questions about the document the user gives. Be brief."


def doc_questions(u: int, d: int) -> tuple[str, str]:
    s = SUBJECTS[(u + 5 * d) % len(SUBJECTS)]
    return (f"What does the report say about {s}?", "And how much money was spent on it?")


def doc_words(args: argparse.Namespace) -> list[int]:
    """Words of each document: ``--doc-words`` (one number for all, or one per document)."""
    words = [int(w) for w in str(args.doc_words).split(",")]
    return words * args.docs if len(words) == 1 else words


def doc_of(u: int, args: argparse.Namespace) -> int:
    """User ``u``'s document: ``u % docs``, or by ``--doc-users`` (users per document, the
    users dealt round-robin over the documents that still have room)."""
    if not args.doc_users:
        return u % args.docs
    left = [int(n) for n in args.doc_users.split(",")]
    order: list[int] = []
    while any(left):
        for d, n in enumerate(left):
            if n:
                order.append(d)
                left[d] -= 1
    return order[u]


# -- users ------------------------------------------------------------------------------------


def conversations(args: argparse.Namespace) -> list[tuple[list[dict[str, str]], str]]:
    """Per user: the messages of turn 1 and the question of turn 2."""
    out = []
    if args.scenario == "A":
        system = system_prompt(args.system_words)
        for u in range(args.users):
            q1, q2 = questions(u)
            out.append(
                ([{"role": "system", "content": system}, {"role": "user", "content": q1}], q2)
            )
    else:
        docs = [document(d, w) for d, w in enumerate(doc_words(args))]
        for u in range(args.users):
            d = doc_of(u, args)
            q1, q2 = doc_questions(u, d)
            first = f"Document:\n{docs[d]}\n\nQuestion: {q1}"
            out.append(
                (
                    [{"role": "system", "content": DOC_SYSTEM}, {"role": "user", "content": first}],
                    q2,
                )
            )
    return out


class Turn:
    def __init__(self) -> None:
        self.ttft: float | None = None
        self.first_at: float | None = None  # time.monotonic() of the first text
        self.text = ""
        self.tokens = 0
        self.error: str | None = None


async def one_turn(
    http: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int
) -> Turn:
    turn = Turn()
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    chunks = 0
    usage: int | None = None
    done = False
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                turn.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return turn
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    turn.error = f"error event: {obj['error']}"
                    return turn
                if obj.get("usage"):
                    usage = int(obj["usage"].get("completion_tokens", 0))
                for c in obj.get("choices") or []:
                    piece = (c.get("delta") or {}).get("content") or ""
                    if piece:
                        if turn.ttft is None:
                            turn.ttft = time.perf_counter() - t0
                            turn.first_at = time.monotonic()
                        turn.text += piece
                        chunks += 1
    except Exception as e:  # a failed connection or a broken stream counts as an error
        turn.error = f"{type(e).__name__}: {e}"
        return turn
    if not done:
        turn.error = "the stream ended without [DONE]"
    elif not turn.text:
        turn.error = "empty answer"
    turn.tokens = usage if usage is not None else chunks
    return turn


async def drive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    convs = conversations(args)
    turns: dict[str, Turn] = {}

    async def user(http: httpx.AsyncClient, u: int) -> None:
        messages, q2 = convs[u]
        t1 = await one_turn(http, url, messages, args.max_tokens)
        turns[f"{u}.0"] = t1
        if t1.error is not None:
            return
        follow = messages + [
            {"role": "assistant", "content": t1.text},
            {"role": "user", "content": q2},
        ]
        turns[f"{u}.1"] = await one_turn(http, url, follow, args.max_tokens)

    limits = httpx.Limits(max_connections=4 * args.users)
    timeout = httpx.Timeout(args.timeout, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        t0, start = time.perf_counter(), time.monotonic()
        tasks = [asyncio.ensure_future(user(http, u)) for u in range(args.users)]
        _, pending = await asyncio.wait(tasks, timeout=args.timeout)
        wall = time.perf_counter() - t0
        for task in pending:  # past --timeout: the turns not finished count as errors
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    errors = [f"{k}: {t.error}" for k, t in sorted(turns.items()) if t.error is not None]
    missing = 2 * args.users - len(turns)
    ttfts = [t.ttft for t in turns.values() if t.ttft is not None]
    firsts = [t.ttft for k, t in turns.items() if k.endswith(".0") and t.ttft is not None]
    tokens = sum(t.tokens for t in turns.values())
    first_ats = [t.first_at for k, t in turns.items() if k.endswith(".0") and t.first_at]
    return {
        "start": start,
        "last_first_at": max(first_ats, default=None),
        "wall_s": wall,
        "ttft_p50": statistics.median(ttfts) if ttfts else None,
        "ttft_p95": pct(ttfts, 0.95) if ttfts else None,
        # First turns only (a user's wait for the first token of its first answer).
        "ttft1_mean": statistics.mean(firsts) if firsts else None,
        "ttft1_p50": statistics.median(firsts) if firsts else None,
        "ttft1_p95": pct(firsts, 0.95) if firsts else None,
        "tokens": tokens,
        "tok_s": tokens / wall if wall > 0 else 0.0,
        "errors": len(errors) + missing,
        "timed_out": bool(pending),
        "error_list": errors[:5],
        "answers": {k: t.text for k, t in turns.items()},
        "ttfts": {k: t.ttft for k, t in sorted(turns.items())},  # per turn ("user.turn")
    }


# -- servers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_cmd(name: str, args: argparse.Namespace, port: int) -> list[str]:
    t, users, ctx = str(args.threads), str(args.users), str(args.ctx)
    if name in ("kvserve", "kvserve-fcfs"):
        order = ["--prompt-order", "fcfs"] if name == "kvserve-fcfs" else []
        steps = ["--step-log", str(step_log(name, args))]
        return [
            sys.executable, "-m", "kvserve", "serve", "--model", args.model, "--threads", t,
            "--parallel", users, "--ctx-size", ctx, "--port", str(port), *order, *steps,
        ]  # fmt: skip
    if name == "llama-server":
        return [
            str(Path(args.llama_bin_dir) / "llama-server"), "-m", args.model, "-t", t, "-tb", t,
            "-np", users, "-c", str(args.users * args.ctx), "--host", "127.0.0.1",
            "--port", str(port), "--no-webui",
        ]  # fmt: skip
    return [
        args.llama_python, "-m", "llama_cpp.server", "--model", args.model, "--n_threads", t,
        "--n_threads_batch", t, "--n_ctx", ctx, "--interrupt_requests", "False",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def step_log(name: str, args: argparse.Namespace) -> Path:
    """Where a kvserve server's step log goes (a fresh file each run)."""
    return Path(args.log_dir) / f"{name}-{args.scenario}.steps.jsonl"


def engine_time(path: Path, start: float, until: float) -> dict[str, float] | None:
    """From a kvserve step log (python/kvserve/engine/steplog.py): the seconds the engine
    computed between ``start`` and ``until`` (monotonic times) and the tokens it computed then:
    prompt tokens and fed-back generated ones (steps that started in the window); None
    without a log."""
    if not path.is_file():  # the server did not get to write it (it failed to start)
        return None
    busy = prompt = decode = 0.0
    for line in path.read_text().splitlines():
        st = json.loads(line)
        if start <= st["t"] < until:
            busy += min(st["s"], until - st["t"])
            prompt += st["tokens"] - st["decode"]
            decode += st["decode"]
    return {"window_s": until - start, "busy_s": busy, "prompt": prompt, "decode": decode}


def display(cmd: list[str], args: argparse.Namespace) -> str:
    """``cmd`` with this machine's paths as placeholders."""
    words = []
    for i, w in enumerate(cmd):
        if i and cmd[i - 1] == "--port":
            w = "PORT"
        elif i and cmd[i - 1] == "--step-log":
            w = "STEPS.jsonl"
        w = w.replace(args.model, "MODEL").replace(args.llama_bin_dir, "$LLAMA_CPP_BIN_DIR")
        if w == sys.executable:
            w = "python"
        elif w == args.llama_python:
            w = "PYTHON_WITH_LLAMA_CPP"
        words.append(w)
    return " ".join(words)


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc/PID/task/TID/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class RssSampler(threading.Thread):
    """The peak of the summed RSS of a process tree, sampled every 50 ms. A process of the
    tree found stopped is resumed: load control on a shared machine that pauses other
    processes with SIGSTOP can catch a server just as it starts."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_kib = 0
        self.resumed = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            pids = tree(self.pid)
            for p in pids:
                if state(p) == "T":
                    self.resumed += 1
                    os.kill(p, signal.SIGCONT)
            total = sum(status_kib(p, "VmRSS") for p in pids)
            self.peak_kib = max(self.peak_kib, total)
            self.stop_event.wait(0.05)

    def finish(self) -> float:
        """Stops sampling; the peak in MiB (at least the root process's own high-water mark)."""
        self.peak_kib = max(self.peak_kib, sum(status_kib(p, "VmRSS") for p in tree(self.pid)))
        hwm = status_kib(self.pid, "VmHWM")
        self.stop_event.set()
        self.join()
        return max(self.peak_kib, hwm) / 1024


def wait_ready(proc: subprocess.Popen[bytes], url: str, name: str, timeout: float) -> None:
    path = "/v1/models" if name == "llama-cpp-python" else "/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} was not ready after {timeout} s")


def kvserve_stats(url: str) -> dict[str, float]:
    """A few counters from kvserve's /metrics (prompt, cached, computed, generated tokens)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("prompt", "cached_prompt", "computed", "generated"):
            if line.startswith(f"kvserve_{name}_tokens_total "):
                out[name] = float(line.split()[1])
    return out


def run_server(name: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    cmd = server_cmd(name, args, port)
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    log = open(log_dir / f"{name}-{args.scenario}.log", "wb")  # noqa: SIM115 - closed below
    if name.startswith("kvserve"):
        step_log(name, args).unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    sampler = RssSampler(proc.pid)
    sampler.start()
    try:
        wait_ready(proc, url, name, args.start_timeout)
        res = asyncio.run(drive(url, args))
        if name.startswith("kvserve"):
            res["kvserve_stats"] = kvserve_stats(url)
        res["peak_rss_mib"] = sampler.finish()
        res["resumed"] = sampler.resumed
    finally:
        if sampler.is_alive():
            sampler.finish()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    if name.startswith("kvserve") and res.get("last_first_at"):
        res["engine"] = engine_time(step_log(name, args), res["start"], res["last_first_at"])
    res["command"] = display(cmd, args)
    return res


# -- report -----------------------------------------------------------------------------------


def fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]], load: str) -> str:
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.scenario == "A":
        what = (
            f"{args.users} users, two turns each of a chat opening with the same "
            f"~{args.system_words}-word system prompt"
        )
    else:
        what = (
            f"{args.users} users over {args.docs} documents of ~{args.doc_words} words, "
            "two questions each"
        )
        if args.doc_users:
            what += f", users per document {args.doc_users}"
    convs = conversations(args)
    cmd = (
        f"python benches/bench_server.py --scenario {args.scenario} --users {args.users} "
        f"--threads {args.threads} --ctx {args.ctx} --max-tokens {args.max_tokens} "
        f"--servers {','.join(results)}"
    )
    if args.scenario == "B":
        cmd += f" --doc-words {args.doc_words}"
        if args.doc_users:
            cmd += f" --doc-users {args.doc_users}"
    if "llama-cpp-python" in results:
        cmd += " --llama-python PYTHON_WITH_LLAMA_CPP"
    lines = [
        f"### {date}: scenario {args.scenario}, {what}",
        "",
        f"- machine: {machine_desc()}; load average before {load}, after {loadavg()}",
        f"- command: `{cmd}`; model {Path(args.model).name}; {args.threads} threads each; "
        f"streaming, greedy, {args.max_tokens} new tokens a turn at most; each server cold "
        "(started for its run, stopped after)",
        f"- first-turn messages: {sum(len(m['content']) for m in convs[0][0])} characters (user 0)",
    ]
    for name, r in results.items():
        lines.append(f"- {name}: `{r['command']}`")
        lines.append(
            f"  - first turns' TTFT: mean {fmt(r.get('ttft1_mean'))} s, p50 "
            f"{fmt(r.get('ttft1_p50'))} s, p95 {fmt(r.get('ttft1_p95'))} s"
        )
        e = r.get("engine")
        if e:
            lines.append(
                f"  - until the last first turn's first token ({e['window_s']:.2f} s, its step "
                f"log): the engine computed for {e['busy_s']:.2f} s "
                f"({e['busy_s'] / e['window_s']:.0%}), {e['prompt']:.0f} prompt tokens and "
                f"{e['decode']:.0f} generated ones ({e['prompt'] / e['busy_s']:.0f} prompt "
                "tok/s of computing time)"
            )
        if r.get("resumed"):
            lines.append(f"  - its processes were found stopped and resumed {r['resumed']} times")
        if r.get("timed_out"):
            lines.append(f"  - stopped after --timeout {args.timeout:.0f} s with turns unfinished")
        if r.get("error_list"):
            lines.append(f"  - first errors: {r['error_list']}")
    kv = results.get("kvserve", {}).get("kvserve_stats")
    if kv:
        lines.append(
            f"- kvserve counters: {int(kv.get('prompt', 0))} prompt tokens, "
            f"{int(kv.get('cached_prompt', 0))} of them reused from the prefix cache, "
            f"{int(kv.get('computed', 0))} tokens computed, {int(kv.get('generated', 0))} generated"
        )
    if "kvserve" in results and "llama-server" in results:
        a, b = results["kvserve"]["answers"], results["llama-server"]["answers"]
        same = sum(a[k] == b.get(k) for k in a)
        lines.append(f"- answers identical, kvserve vs llama-server: {same}/{len(a)} turns")
    lines += [
        "",
        "| server | wall s | TTFT p50 s | TTFT p95 s | tokens/s | peak RSS MiB | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {fmt(r['wall_s'])} | {fmt(r['ttft_p50'])} | {fmt(r['ttft_p95'])} | "
            f"{fmt(r['tok_s'], 1)} | {fmt(r['peak_rss_mib'], 0)} | {r['errors']} |"
        )
    if "kvserve" in results:
        k = results["kvserve"]
        for other in ("kvserve-fcfs", "llama-server", "llama-cpp-python"):
            if other in results:
                o = results[other]
                lines.append(
                    f"| kvserve / {other} | {k['wall_s'] / o['wall_s']:.3f}x | "
                    f"{ratio(k['ttft_p50'], o['ttft_p50'])} | {ratio(k['ttft_p95'], o['ttft_p95'])}"
                    f" | {ratio(k['tok_s'], o['tok_s'])} | "
                    f"{ratio(k['peak_rss_mib'], o['peak_rss_mib'])} | |"
                )
    if args.scenario == "A" and "kvserve" in results and "llama-server" in results:
        k, o = results["kvserve"], results["llama-server"]
        ok = k["errors"] == 0 and o["errors"] == 0 and k["wall_s"] <= 0.25 * o["wall_s"]
        lines += [
            "",
            f"Target (issue #8): zero errors and kvserve wall <= 0.25x llama-server's: "
            f"{'met' if ok else 'NOT met'} ({k['wall_s'] / o['wall_s']:.3f}x).",
        ]
    return "\n".join(lines) + "\n"


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenario", choices=["A", "B"], default="A")
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, in run order")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=2048, help="tokens per user (every server)")
    ap.add_argument("--system-words", type=int, default=600, help="scenario A (~1.3 tokens a word)")
    ap.add_argument("--docs", type=int, default=4, help="scenario B: documents")
    ap.add_argument(
        "--doc-words",
        default="950",
        help="scenario B: words a document, or one number per document (comma-separated)",
    )
    ap.add_argument(
        "--doc-users",
        default=None,
        help="scenario B: users per document, comma-separated (default: user u asks u %% docs)",
    )
    ap.add_argument("--llama-bin-dir", default=default_llama_bin_dir())
    ap.add_argument("--llama-python", default=sys.executable)
    ap.add_argument("--timeout", type=float, default=300, help="seconds for one server's run")
    ap.add_argument("--start-timeout", type=float, default=120)
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="also write the raw results to this file")
    ap.add_argument("--write", action="store_true", help="append the table to BENCHMARKS.md")
    args = ap.parse_args()
    args.model = args.model or default_model()
    if "," in args.doc_words:
        args.docs = len(args.doc_words.split(","))
    if args.doc_users:
        n = [int(x) for x in args.doc_users.split(",")]
        if len(n) != args.docs or sum(n) != args.users:
            print(
                "error: --doc-users needs one count per document, summing to --users",
                file=sys.stderr,
            )
            return 2
    if not args.model:
        print("error: no model (--model or KVSERVE_TEST_MODEL)", file=sys.stderr)
        return 2
    names = [s for s in args.servers.split(",") if s]
    for s in names:
        if s not in SERVERS:
            print(f"error: unknown server {s!r} (one of {', '.join(SERVERS)})", file=sys.stderr)
            return 2
    log_dir = Path(args.log_dir or f"/tmp/bench_server-{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    args.log_dir = str(log_dir)
    load = loadavg()
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        t0 = time.perf_counter()
        results[name] = run_server(name, args, log_dir)
        r = results[name]
        print(
            f"{name}: wall {r['wall_s']:.2f} s, TTFT p50 {fmt(r['ttft_p50'])} s p95 "
            f"{fmt(r['ttft_p95'])} s, {r['tok_s']:.1f} tok/s, peak RSS {r['peak_rss_mib']:.0f} "
            f"MiB, errors {r['errors']} (with start and stop: {time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
        )
    table = report(args, results, load)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write:
        append_section(REPO_ROOT / "BENCHMARKS.md", HEADING, table, "benches/bench_server.py")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
