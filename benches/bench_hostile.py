#!/usr/bin/env python3
"""Running streams beside hostile requests: does one user's bad request slow everyone else?
(the service-core issue's proof).

One ``kvserve serve`` (a fresh process, ``--threads`` 2, ``--parallel`` 16) serves
``--streams`` (8) greedy streaming completions of ``--tokens`` (128) tokens each
(``ignore_eos``), all started at once. Each round runs them twice, in alternating order:

- *quiet*: the streams alone;
- *hostile*: the same streams while three clients each send one kind of request built to
  hurt, again and again (``--rate`` (10) a second each, or with ``--rate 0`` each as soon as
  the last is answered) until the streams finish. The attacking client runs on the same
  machine: on 2 cores, back to back it spends a core of its own sending (a remote attacker's
  CPU would not be the server's). The requests: a
  prompt of ``--big-mb`` (4) megabytes of text; ``--stops`` stop strings of ``--stop-chars``
  characters and ``--bias`` ``logit_bias`` entries (default: the largest the server accepts,
  256 x 512 and 1,024); ``n`` at ``--n`` (16, the server's ``--parallel``). Each is answered
  (a completion, or a 400 that names the limit it broke).

Per stream: the longest gap between two streamed chunks after the first, and the time from
sending to the last chunk. Per run the worst stream's gap and the median time to finish; per
round the ratio hostile / quiet of each; the table gives the medians over rounds. The targets:
the longest gap within 2x the quiet one, the time to finish within 1.5x.

``--pythonpath DIR`` runs the server from another checkout's python/ (with its compiled
extension), to measure an older engine the same way (an old server accepts longer stop
lists: ``--stops 150000``).

  python benches/bench_hostile.py --rounds 3 --write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
from _common import REPO_ROOT, append_section, default_model, loadavg, machine_desc, utc_stamp

SUBJECTS = ["rivers", "bread", "trains", "winter", "gardens", "bridges", "the moon", "music"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    cmd = [sys.executable, "-m", "kvserve", "serve", "--model", args.model, "--threads", "2"]
    cmd += ["--parallel", "16", "--ctx-size", "2048", "--port", str(port)]
    # Its log goes to a file: a pipe nobody reads would fill and stop the server.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            err = log.read().decode(errors="replace")
            raise SystemExit(f"the server did not start: {err[-2000:]}")
        time.sleep(0.2)


async def stream(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> tuple[float, float]:
    """(longest gap between chunks after the first, seconds to the last chunk)."""
    body = {
        "prompt": f"User {i} asks: tell me about {SUBJECTS[i % len(SUBJECTS)]}.",
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.monotonic()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"stream {i}: HTTP {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.monotonic())
    gaps = [b - a for a, b in pairwise(stamps)]
    return (max(gaps) if gaps else 0.0), stamps[-1] - t0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hostile_bodies(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    stops = [
        "".join(rng.choice(letters) for _ in range(args.stop_chars)) for _ in range(args.stops)
    ]
    bias = {str(1000 + i): -1.0 for i in range(args.bias)}
    big = ("All work and no play makes a dull story. " * (args.big_mb * 25_000))[
        : args.big_mb << 20
    ]
    return [
        {"prompt": big, "max_tokens": 4},
        {"prompt": "Write a list of fruits:", "max_tokens": 32, "stop": stops, "logit_bias": bias},
        {"prompt": "Name a colour:", "max_tokens": 8, "n": args.n},
    ]


async def hostile(
    client: httpx.AsyncClient,
    url: str,
    name: str,
    body: dict[str, Any],
    done: asyncio.Event,
    log: dict[str, int],
    rate: float,
) -> None:
    """Sends ``body`` again and again, each as soon as the last is answered, until ``done``
    (encoded once: the client's own work is not what is measured)."""
    content = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    gap = 1.0 / rate if rate > 0 else 0.0
    while not done.is_set():
        t0 = time.monotonic()
        try:
            r = await client.post(
                f"{url}/v1/completions", content=content, headers=headers, timeout=600
            )
            key = f"{name}:{r.status_code}"
        except httpx.HTTPError as e:
            key = f"{name}:{type(e).__name__}"
        log[key] = log.get(key, 0) + 1
        if gap:
            await asyncio.sleep(max(0.0, gap - (time.monotonic() - t0)))


async def run_once(
    args: argparse.Namespace, url: str, with_hostile: bool
) -> tuple[float, float, dict[str, int]]:
    log: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        done = asyncio.Event()
        tasks = []
        if with_hostile:
            names = ["big", "stops+bias", "n"]
            tasks = [
                asyncio.ensure_future(hostile(client, url, name, body, done, log, args.rate))
                for name, body in zip(names, hostile_bodies(args), strict=True)
                if name in args.kinds
            ]
            await asyncio.sleep(0.2)  # the first hostile requests are in flight
        results = await asyncio.gather(
            *[stream(client, url, i, args.tokens) for i in range(args.streams)]
        )
        done.set()
        await asyncio.gather(*tasks)
    gap = max(g for g, _ in results)
    finish = statistics.median(t for _, t in results)
    return gap, finish, log


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big-mb", type=int, default=4)
    ap.add_argument("--stops", type=int, default=256)
    ap.add_argument("--stop-chars", type=int, default=512)
    ap.add_argument("--bias", type=int, default=1024)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument(
        "--rate",
        type=float,
        default=10.0,
        help="requests per second of each hostile kind (0: back to back)",
    )
    ap.add_argument(
        "--kinds",
        type=lambda v: v.split(","),
        default=["big", "stops+bias", "n"],
        help="the hostile requests to send (comma-separated: big, stops+bias, n)",
    )
    ap.add_argument("--pythonpath", default=None, help="run the server from this python/ dir")
    ap.add_argument("--label", default="main")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    args.model = args.model or default_model()
    if not args.model:
        raise SystemExit("no model: pass --model or run `python -m kvserve pull` first")
    port = free_port()
    proc = start_server(args, port)
    url = f"http://127.0.0.1:{port}"
    rows = []
    logs: dict[str, int] = {}
    cpu: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    try:
        asyncio.run(run_once(args, url, False))  # warm-up
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            got: dict[bool, tuple[float, float]] = {}
            for h in order:
                s0, c0, t0 = cpu_seconds(proc.pid), time.process_time(), time.monotonic()
                gap, finish, log = asyncio.run(run_once(args, url, h))
                wall = time.monotonic() - t0
                server_cpu = (cpu_seconds(proc.pid) - s0) / wall
                client_cpu = (time.process_time() - c0) / wall
                cpu[h].append((server_cpu, client_cpu))
                got[h] = (gap, finish)
                for k, v in log.items():
                    logs[k] = logs.get(k, 0) + v
                print(
                    f"round {r} {'hostile' if h else 'quiet'}: longest gap"
                    f" {gap * 1000:.0f} ms, median finish {finish:.2f} s, cores busy: server"
                    f" {server_cpu:.2f}, client {client_cpu:.2f} {log}",
                    flush=True,
                )
            rows.append((got[False], got[True]))
    finally:
        proc.terminate()
        proc.wait(30)

    def cores(xs: list[tuple[float, float]]) -> str:
        server = statistics.median(a for a, _ in xs)
        return f"{server:.2f} / {statistics.median(b for _, b in xs):.2f}"

    q_gap = statistics.median(q[0] for q, _ in rows)
    h_gap = statistics.median(h[0] for _, h in rows)
    q_fin = statistics.median(q[1] for q, _ in rows)
    h_fin = statistics.median(h[1] for _, h in rows)
    r_gap = statistics.median(h[0] / q[0] for q, h in rows)
    r_fin = statistics.median(h[1] / q[1] for q, h in rows)
    table = (
        f"{utc_stamp()}, {machine_desc()}, load {loadavg()}, server: {args.label}; "
        f"{args.streams} streams x {args.tokens} tokens; hostile: {args.big_mb} MB prompt, "
        f"{args.stops} stops x {args.stop_chars} chars + {args.bias} logit_bias, n={args.n}"
        f" (sent: {', '.join(args.kinds)}; {args.rate:g}/s each, 0: back to back); "
        f"{args.rounds} rounds; hostile answers {json.dumps(logs, sort_keys=True)}\n\n"
        "| | quiet | hostile | hostile / quiet (median of rounds) |\n|---|---|---|---|\n"
        f"| longest gap between chunks | {q_gap * 1000:.0f} ms | {h_gap * 1000:.0f} ms"
        f" | {r_gap:.2f}x |\n"
        f"| median time to finish | {q_fin:.2f} s | {h_fin:.2f} s | {r_fin:.2f}x |\n"
        f"| cores busy: server / this client | {cores(cpu[False])} | {cores(cpu[True])} | |\n"
    )
    print(table)
    if args.write:
        shown = [
            "MODEL" if a == args.model else "OLD/python" if a == args.pythonpath else a
            for a in sys.argv[1:]
        ]
        cmd = "python benches/bench_hostile.py " + " ".join(shown)
        append_section(
            Path(REPO_ROOT) / "BENCHMARKS.md", "## Streams beside hostile requests", table, cmd
        )


if __name__ == "__main__":
    main()
