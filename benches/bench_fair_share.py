#!/usr/bin/env python3
"""Fair share between tenants (issue 19's proof): tenant A keeps 64 requests queued while
tenant B sends one short request a second. How long does B wait for its first token, and
what does A lose, with fair sharing against first come, first served?

``kvserve.Engine`` (``--parallel`` 16, 2 threads). A runs ``parallel + 64`` request loops
(``--a-tokens`` / 2 to 3 x ``--a-tokens`` / 2 tokens each, so they do not run in lockstep;
``ignore_eos``, distinct prompts of ~40 tokens), so that besides its running requests 64
always wait; once A is saturated, B sends a request of ~12 prompt tokens and ``--b-tokens``
tokens out every second for ``--seconds``. Runs on one engine, with fresh prompts each (no
prefix cache carries over):

- *FCFS*: neither has a tenant: one queue, first come, first served (B waits behind A's 64);
- *fair*: A is tenant ``a``, B tenant ``b`` (weight 1 each): B's request takes a slot from A
  at once (a preemption) and its prompt gets its share of the step's prompt budget.

Reported per mode (``--rounds`` runs each, interleaved): B's time to first token (p50, p95;
every B request of the windows), the same request's on the idle engine (its own prefill and
first token), A's generated tokens per second and per CPU-second of this process over the
window (the CPU time is steadier than the wall clock on a shared machine), the median and p95
step (the engine's own record of its steps' times), and preemptions; then B's p95 less its
idle time to first token, in steps (the target: about one step, not growing with A's queue),
and A's throughput fair / FCFS (the target: a small loss).

  python benches/bench_fair_share.py --write
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    add_idle_args,
    append_section,
    default_model,
    loadavg,
    machine_desc,
    this_command,
    utc_stamp,
    wait_for_idle,
)

from kvserve import Engine

WORDS = " ".join(f"word{i}" for i in range(30))


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``xs``."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


async def idle_ttft(engine: Engine, args: argparse.Namespace) -> float:
    """B's kind of request on the idle engine: its own prefill and first token (median of 5)."""
    out = []
    for r in range(5):
        t0 = time.monotonic()
        async for _ in engine.stream(f"Idle {r}: what is the weather like", args.b_tokens):
            out.append(time.monotonic() - t0)
            break
    return statistics.median(out)


async def run(engine: Engine, args: argparse.Namespace, fair: bool, tag: str) -> dict[str, Any]:
    """One run: A saturated, B's requests for ``--seconds``; ``tag`` makes its prompts new."""
    mode = f"{tag} {'fair' if fair else 'fcfs'}"
    a_tenant, b_tenant = ("a", "b") if fair else (None, None)
    stop = False
    window: list[float] = []  # [start, end] of the measurement
    steps: dict[float, float] = {}  # the engine's steps in the window: end -> seconds
    b_ttft: list[float] = []
    b_pieces: list[float] = []

    async def a_loop(i: int) -> None:
        k = 0
        while not stop:
            prompt = f"A {mode} {i} {k}: {WORDS}"
            # Lengths spread around --a-tokens (1/2 to 3/2 of it), so A's requests do not
            # start and end in lockstep.
            n = args.a_tokens // 2 + (i * 7 + k * 13) % (args.a_tokens + 1)
            k += 1
            async for _ in engine.stream(prompt, n, ignore_eos=True, tenant=a_tenant):
                if stop:
                    break

    def record_steps() -> None:
        # The engine thread's own record of its recent steps (end, tokens, seconds).
        for end, _n, dt in list(engine._loop.recent):
            if window and window[0] <= end <= (window[1] if len(window) > 1 else end):
                steps[end] = dt

    async def b_request(j: int) -> None:
        t0 = time.monotonic()
        first = True
        prompt = f"B {mode} {j}: what is the weather like"
        async for _ in engine.stream(prompt, args.b_tokens, ignore_eos=True, tenant=b_tenant):
            now = time.monotonic()
            if first:
                b_ttft.append(now - t0)
                first = False
            b_pieces.append(now)

    loops = [asyncio.ensure_future(a_loop(i)) for i in range(args.parallel + args.queued)]
    deadline = time.monotonic() + 120
    while not (
        engine.stats()["running"] == args.parallel and engine.stats()["waiting"] >= args.queued
    ):
        if time.monotonic() > deadline:
            raise SystemExit("tenant A did not fill the engine")
        await asyncio.sleep(0.05)
    await asyncio.sleep(2.0)  # past the first prefills: A runs steadily
    st0 = engine.stats()
    cpu0 = time.process_time()
    window.append(time.monotonic())
    bs = []
    for j in range(args.seconds):
        bs.append(asyncio.ensure_future(b_request(j)))
        await asyncio.sleep(max(0.0, window[0] + j + 1 - time.monotonic()))
        record_steps()
    window.append(time.monotonic())
    record_steps()
    st1 = engine.stats()
    cpu = time.process_time() - cpu0
    await asyncio.gather(*bs)  # the last of B's (FCFS: still queued behind A's)
    stop = True
    for t in loops:
        t.cancel()
    await asyncio.gather(*loops, return_exceptions=True)
    start, end = window
    b_in_window = sum(1 for t in b_pieces if start <= t <= end)
    a_tokens = st1["generated_tokens"] - st0["generated_tokens"] - b_in_window
    return {
        "ttft": b_ttft,
        "a_tok_s": a_tokens / (end - start),
        "a_tok_cpu_s": a_tokens / cpu,
        "steps": list(steps.values()),
        "preemptions": st1["preemptions"] - st0["preemptions"],
    }


async def main_async(args: argparse.Namespace, engine: Engine) -> dict[str, dict[str, Any]]:
    """``--rounds`` rounds of a FCFS run and a fair run, alternating which goes first (the
    machine's load drifts); per mode: B's TTFTs and the steps of all its runs, A's tokens/s
    of each run."""
    args.idle_ttft = await idle_ttft(engine, args)
    out: dict[str, dict[str, Any]] = {
        m: {"ttft": [], "a_tok_s": [], "a_tok_cpu_s": [], "steps": [], "preemptions": 0}
        for m in ("FCFS", "fair")
    }
    for r in range(args.rounds):
        for fair in (False, True) if r % 2 == 0 else (True, False):
            if args.wait_idle > 0:
                print(f"CPU busy {wait_for_idle(args.wait_idle, args.wait_max):.0f}%", flush=True)
            got = await run(engine, args, fair, f"r{r}")
            m = out["fair" if fair else "FCFS"]
            m["ttft"] += got["ttft"]
            m["a_tok_s"].append(got["a_tok_s"])
            m["a_tok_cpu_s"].append(got["a_tok_cpu_s"])
            m["steps"] += got["steps"]
            m["preemptions"] += got["preemptions"]
            print(
                f"round {r} {'fair' if fair else 'FCFS'}: B's TTFT p50"
                f" {statistics.median(got['ttft']) * 1000:.0f} ms, A {got['a_tok_s']:.1f} tok/s"
                f" ({got['a_tok_cpu_s']:.1f} per CPU-s),"
                f" step {statistics.median(got['steps']) * 1000:.0f} ms",
                flush=True,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--queued", type=int, default=64, help="A's requests waiting at all times")
    ap.add_argument("--a-tokens", type=int, default=32)
    ap.add_argument("--b-tokens", type=int, default=16)
    ap.add_argument("--seconds", type=int, default=20, help="B's requests, one a second")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each mode, interleaved")
    ap.add_argument("--write", action="store_true")
    add_idle_args(ap)
    args = ap.parse_args()
    args.model = args.model or default_model()
    if not args.model:
        raise SystemExit("no model: pass --model or run `python -m kvserve pull` first")
    t0 = time.monotonic()
    with Engine(args.model, threads=2, parallel=args.parallel, ctx_size=512) as engine:
        rows = asyncio.run(main_async(args, engine))
    took = time.monotonic() - t0
    stats = {
        name: {
            "p50": statistics.median(m["ttft"]),
            "p95": pct(m["ttft"], 0.95),
            "step": statistics.median(m["steps"]),
            "step_p95": pct(m["steps"], 0.95),
            "a_tok_s": statistics.median(m["a_tok_s"]),
            "a_tok_cpu_s": statistics.median(m["a_tok_cpu_s"]),
        }
        for name, m in rows.items()
    }
    fcfs, fair = stats["FCFS"], stats["fair"]
    lines = [
        f"{utc_stamp()}, {machine_desc()}, load {loadavg()}; Engine parallel={args.parallel},"
        f" threads 2, batch_tokens 512; tenant A keeps {args.queued} requests queued (~40"
        f" prompt tokens, {args.a_tokens // 2} to {args.a_tokens * 3 // 2} tokens out), tenant B"
        f" sends a request of ~12 prompt tokens and {args.b_tokens} tokens out every second for"
        f" {args.seconds} s; {args.rounds} runs of each mode, interleaved; B's time to first"
        f" token on the idle engine (its own prefill) {args.idle_ttft * 1000:.0f} ms;"
        f" {took:.0f} s in all",
        "",
        "| run | B's TTFT p50 | B's TTFT p95 | (p95 - idle TTFT) / median step | median step"
        " | p95 step | A's tokens/s (median; each run) | A's tokens per CPU-second"
        " | preemptions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in stats.items():
        runs = ", ".join(f"{x:.0f}" for x in rows[name]["a_tok_s"])
        cpu_runs = ", ".join(f"{x:.0f}" for x in rows[name]["a_tok_cpu_s"])
        lines.append(
            f"| {name} | {r['p50'] * 1000:.0f} ms | {r['p95'] * 1000:.0f} ms"
            f" | {(r['p95'] - args.idle_ttft) / r['step']:.1f}"
            f" | {r['step'] * 1000:.0f} ms | {r['step_p95'] * 1000:.0f} ms"
            f" | {r['a_tok_s']:.0f} ({runs}) | {r['a_tok_cpu_s']:.0f} ({cpu_runs})"
            f" | {rows[name]['preemptions']} |"
        )
    lines += [
        "",
        f"Fair / FCFS: B's TTFT p95 {fair['p95'] / fcfs['p95']:.3f}x, A's throughput"
        f" {fair['a_tok_s'] / fcfs['a_tok_s']:.3f}x per second and"
        f" {fair['a_tok_cpu_s'] / fcfs['a_tok_cpu_s']:.3f}x per CPU-second (this process's"
        " CPU time: steadier than the wall clock on a shared machine), median step"
        f" {fair['step'] / fcfs['step']:.2f}x. Fair: B's p95 is its idle TTFT plus"
        f" {(fair['p95'] - args.idle_ttft) / fair['step_p95']:.1f} p95 steps (a step with"
        " prefill chunks in it takes longer than the median).",
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write:
        cmd = this_command("bench_fair_share.py", args.model)
        append_section(
            Path(REPO_ROOT) / "BENCHMARKS.md",
            "## Fair share between tenants: a flooding tenant and a light one",
            table,
            cmd,
            intro=(
                "Tenant A keeps 64 requests queued while tenant B sends one short request a"
                " second: B's time to first token and A's throughput with fair sharing"
                " (tenants a and b, weight 1 each) against first come, first served (no"
                f" tenants). Command: `{cmd}` (benches/bench_fair_share.py)."
            ),
        )


if __name__ == "__main__":
    main()
