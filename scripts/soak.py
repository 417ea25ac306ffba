#!/usr/bin/env python3
"""A soak of ``kvserve serve`` on loopback (issue 20): ``--clients`` concurrent clients for
``--duration`` seconds, each looping over a mix of

- streamed chats that share a long system prompt (each must end with ``[DONE]``),
- the same, abandoned after a few chunks (the client closes the connection),
- two-turn chats on a ``session_id`` (the second turn continues the first; then the session
  is deleted),
- sampled completions with a seed,
- malformed requests (bad JSON, wrong types, unknown fields, out-of-range values, bad session
  ids, wrong routes and methods): each must be a 4xx with a JSON error body.

Pass: no unexpected error (any 5xx, a dropped connection, a stream without ``[DONE]``, a
malformed request answered otherwise), the server's RSS flat after warm-up (its growth over
the second half of the run within ``--rss-slack``), the K/V back to its
baseline at the end (no sequence running or waiting, no block used), and a greedy probe
answered byte-identically at the start and the end.

    python scripts/soak.py                          # 30 minutes, 32 clients (the long run)
    python scripts/soak.py --duration 120 --json    # the test suite's variant
    python scripts/soak.py --url http://HOST:PORT --pid PID   # a server started elsewhere

Starts its own server (``python -m kvserve serve``, the default model or ``--model``) unless
``--url`` is given. Prints a report (``--json``: one JSON object) and exits 1 on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SYSTEM = (
    "You are the assistant of a small seaside library. You answer questions about its "
    "opening hours, its collections of maritime history, local fishing traditions, the old "
    "lighthouse, tide tables and the reading room's rules. Be brief and friendly. "
) * 6  # ~400 tokens, shared by every chat
QUESTIONS = [
    "When does the library open on Sundays?",
    "Do you have books about the old lighthouse?",
    "Can I bring my dog into the reading room?",
    "What is the best season for fishing here?",
    "Tell me one fact about the tides.",
    "Who built the harbour?",
]
PROBE = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}

# (method, path, body bytes or JSON-able, headers): each must be a 4xx with a JSON error.
_BAD_JSON = [
    b"{",
    b"not json",
    b"[]",
    b'{"prompt": "x", "max_tokens": "ten"}',
    b"\xff\xfe",
]


def malformed(rng: random.Random) -> tuple[str, str, Any, dict[str, str]]:
    kind = rng.randrange(12)
    chat = "/v1/chat/completions"
    if kind == 0:
        return "POST", "/v1/completions", rng.choice(_BAD_JSON), {}
    if kind == 1:
        return "POST", chat, {"messages": "hello", "max_tokens": 4}, {}
    if kind == 2:
        return "POST", chat, {"messages": [], "max_tokens": 4}, {}
    if kind == 3:
        return "POST", "/v1/completions", {"prompt": "x", "max_tokens": -3}, {}
    if kind == 4:
        return "POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, {}
    if kind == 5:
        return "POST", "/v1/completions", {"prompt": "x", "no_such_field": 1}, {}
    if kind == 6:
        return "POST", chat, {"messages": [{"role": "wizard", "content": "x"}]}, {}
    if kind == 7:
        return "GET", "/v1/sessions/bad%0Aid", None, {}
    if kind == 8:
        return "POST", "/v1/no/such/route", {"prompt": "x"}, {}
    if kind == 9:
        return "DELETE", "/v1/completions", None, {}
    if kind == 10:
        return "POST", "/v1/completions", {"prompt": [10**9], "max_tokens": 2}, {}
    return "POST", "/v1/completions", {"prompt": "x", "n": 0}, {}


@dataclass
class Report:
    requests: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds, MiB)
    probe_same: bool = False
    kv_baseline: bool = False
    end_state: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def count(self, kind: str) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + 1

    def bad(self, what: str) -> None:
        if len(self.unexpected) < 200:
            self.unexpected.append(what)
        else:
            self.requests["unexpected_dropped"] = self.requests.get("unexpected_dropped", 0) + 1

    def rss_growth_mb(self) -> float:
        """RSS at the end less RSS half-way (the first half is the warm-up: the K/V pool's
        pages are touched as it fills, up to ``--kv-memory``)."""
        if len(self.rss_mb) < 2:
            return 0.0
        t_end = self.rss_mb[-1][0]
        warm = [m for t, m in self.rss_mb if t >= t_end / 2]
        return self.rss_mb[-1][1] - warm[0]

    def passed(self, rss_slack_mb: float) -> bool:
        return (
            not self.unexpected
            and "unexpected_dropped" not in self.requests
            and self.probe_same
            and self.kv_baseline
            and self.rss_growth_mb() <= rss_slack_mb
        )


def rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) / 1024 if m else float("nan")


def metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


async def stream_chat(
    client: httpx.AsyncClient, rep: Report, rng: random.Random, abandon: bool
) -> None:
    body = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": rng.choice(QUESTIONS)},
        ],
        "max_tokens": rng.randint(8, 48),
        "stream": True,
    }
    kind = "abandoned" if abandon else "stream"
    rep.count(kind)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                rep.bad(f"{kind}: status {r.status_code}: {r.text[:200]}")
                return
            chunks = 0
            last = ""
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line
                if '"error"' in line:
                    rep.bad(f"{kind}: error event {line[:200]}")
                chunks += 1
                if abandon and chunks >= rng.randint(1, 4):
                    return  # leaves: the server must cancel it
            if last != "data: [DONE]":
                rep.bad(f"{kind}: ended without [DONE] (last: {last[:100]!r})")
    except httpx.HTTPError as e:
        rep.bad(f"{kind}: {e!r}")


async def session_chat(client: httpx.AsyncClient, rep: Report, rng: random.Random, n: int) -> None:
    sid = f"soak-{n}-{rng.randrange(10**9)}"
    rep.count("session")
    messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    try:
        for turn in range(2):
            body = {"messages": messages, "max_tokens": 12, "session_id": sid}
            r = await client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                rep.bad(f"session turn {turn}: status {r.status_code}: {r.text[:200]}")
                return
            reply = r.json()["choices"][0]["message"]["content"]
            if turn == 1 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0:
                rep.bad("session: the second turn reused nothing of the first")
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": rng.choice(QUESTIONS)},
            ]
        r = await client.delete(f"/v1/sessions/{sid}")
        if r.status_code != 200:
            rep.bad(f"session delete: status {r.status_code}: {r.text[:200]}")
    except httpx.HTTPError as e:
        rep.bad(f"session: {e!r}")


async def sampled(client: httpx.AsyncClient, rep: Report, rng: random.Random) -> None:
    rep.count("sampled")
    body = {
        "prompt": "Once upon a time, " + rng.choice(QUESTIONS),
        "max_tokens": rng.randint(4, 24),
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": rng.randrange(1000),
    }
    try:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            rep.bad(f"sampled: status {r.status_code}: {r.text[:200]}")
    except httpx.HTTPError as e:
        rep.bad(f"sampled: {e!r}")


async def bad_request(client: httpx.AsyncClient, rep: Report, rng: random.Random) -> None:
    rep.count("malformed")
    method, path, body, headers = malformed(rng)
    try:
        if isinstance(body, bytes):
            r = await client.request(
                method, path, content=body, headers={"Content-Type": "application/json"}
            )
        else:
            r = await client.request(method, path, json=body, headers=headers)
        ok = 400 <= r.status_code < 500
        try:
            error = r.json().get("error")
        except ValueError:
            error = None
        if not ok or not isinstance(error, dict) or "message" not in error:
            rep.bad(f"malformed {method} {path} {body!r:.80}: {r.status_code} {r.text[:200]}")
    except httpx.HTTPError as e:
        rep.bad(f"malformed {method} {path}: {e!r}")


async def client_loop(url: str, n: int, deadline: float, rep: Report, seed: int) -> None:
    rng = random.Random(seed * 1000 + n)
    limits = httpx.Limits(max_connections=2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        while time.monotonic() < deadline:
            x = rng.random()
            if x < 0.35:
                await stream_chat(client, rep, rng, abandon=False)
            elif x < 0.50:
                await stream_chat(client, rep, rng, abandon=True)
            elif x < 0.65:
                await session_chat(client, rep, rng, n)
            elif x < 0.80:
                await sampled(client, rep, rng)
            else:
                await bad_request(client, rep, rng)


async def soak(url: str, pid: int | None, duration: float, clients: int, seed: int) -> Report:
    rep = Report()
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        probe0 = (await c.post("/v1/completions", json=PROBE)).json()["choices"][0]["text"]
        t0 = time.monotonic()
        deadline = t0 + duration
        tasks = [
            asyncio.create_task(client_loop(url, i, deadline, rep, seed)) for i in range(clients)
        ]

        async def sample_rss() -> None:
            while time.monotonic() < deadline:
                if pid is not None:
                    rep.rss_mb.append((time.monotonic() - t0, rss_mb(pid)))
                await asyncio.sleep(max(1.0, duration / 120))

        sampler = asyncio.create_task(sample_rss())
        await asyncio.gather(*tasks)
        await sampler
        if pid is not None:
            rep.rss_mb.append((time.monotonic() - t0, rss_mb(pid)))
        rep.seconds = time.monotonic() - t0
        # The end: every sequence gone (abandoned streams are dropped at the next step).
        for _ in range(200):
            m = metrics((await c.get("/metrics")).text)
            used = m.get('kvserve_kv_blocks{state="used"}', -1)
            if m.get("kvserve_running") == 0 and m.get("kvserve_queue_depth") == 0 and used == 0:
                break
            await asyncio.sleep(0.05)
        rep.end_state = {
            "running": m.get("kvserve_running", -1),
            "waiting": m.get("kvserve_queue_depth", -1),
            "kv_blocks_used": used,
            "sessions": m.get("kvserve_sessions", -1),
        }
        rep.kv_baseline = rep.end_state["running"] == rep.end_state["waiting"] == used == 0
        probe1 = (await c.post("/v1/completions", json=PROBE)).json()["choices"][0]["text"]
        rep.probe_same = probe0 == probe1
    return rep


def start_server(
    args: argparse.Namespace, extra: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m kvserve serve`` on loopback with ``args``' model, port, parallel, threads
    and K/V memory (and ``extra`` flags, which win); returns it and its URL once healthy."""
    cmd = [sys.executable, "-m", "kvserve", "serve", "--port", str(args.port)]
    if args.model:
        cmd += ["--model", args.model]
    cmd += ["--parallel", str(args.parallel), "--ctx-size", "1024", "--max-queue", "256"]
    cmd += ["--kv-memory", args.kv_memory, *(extra or [])]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvserve serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("kvserve serve did not become healthy in 180 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds (default 1800)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", help="soak a running server instead of starting one")
    ap.add_argument("--pid", type=int, help="that server's pid (for its RSS)")
    ap.add_argument("--model", help="GGUF path or registered name (default model otherwise)")
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--kv-memory", default="256MiB")
    ap.add_argument(
        "--rss-slack", type=float, default=32.0, help="MiB of RSS growth allowed after warm-up"
    )
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = ap.parse_args(argv)
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        proc, url = start_server(args)
        pid = proc.pid
    try:
        rep = asyncio.run(soak(url, pid, args.duration, args.clients, args.seed))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    ok = rep.passed(args.rss_slack)
    summary = {
        "passed": ok,
        "seconds": round(rep.seconds, 1),
        "clients": args.clients,
        "requests": rep.requests,
        "total_requests": sum(v for k, v in rep.requests.items() if k != "unexpected_dropped"),
        "unexpected": rep.unexpected,
        "rss_mb_first": rep.rss_mb[0][1] if rep.rss_mb else None,
        "rss_mb_last": rep.rss_mb[-1][1] if rep.rss_mb else None,
        "rss_mb_peak": max(m for _, m in rep.rss_mb) if rep.rss_mb else None,
        "rss_growth_after_warmup_mb": round(rep.rss_growth_mb(), 1),
        "kv_baseline": rep.kv_baseline,
        "end_state": rep.end_state,
        "probe_same": rep.probe_same,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k}: {v}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
