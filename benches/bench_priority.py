#!/usr/bin/env python3
"""A high-priority request arriving while every slot is busy with low-priority streams: how
long until its first token, against the engine's step time (the service-core issue's proof).

``kvserve.Engine`` (``--parallel`` 16, 2 threads) runs ``--parallel`` low-priority streams
(``ignore_eos``, long); once all generate, a request of priority 10 with a short prompt
(~``--prompt-tokens`` tokens) arrives, ``--rounds`` times (each after the last finished). The
engine preempts the latest low-priority stream for it. Reported: its time to first token
(median over rounds), the median step time of the running streams just before (the gaps
between one stream's tokens), and their ratio; the target is about one step plus its own
prefill, so the table gives the time to first token less the same request's on the idle
engine (its own prefill), in steps. Without preemption it would wait for a stream to end
(``--tokens`` of steps).

  python benches/bench_priority.py --write
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from _common import (
    REPO_ROOT,
    append_section,
    default_model,
    loadavg,
    machine_desc,
    this_command,
    utc_stamp,
)

from kvserve import Engine


async def main_async(args: argparse.Namespace, engine: Engine) -> list[tuple[float, float]]:
    words = " ".join(f"word{i}" for i in range(args.prompt_tokens))
    # The same kind of request on the idle engine: its own prefill and first token.
    idle = []
    for r in range(3):
        t0 = time.monotonic()
        async for _ in engine.stream(f"Idle {r}: {words}", max_tokens=2, priority=10):
            idle.append(time.monotonic() - t0)
            break
    args.idle_ttft = statistics.median(idle)
    stamps: list[list[float]] = [[] for _ in range(args.parallel)]

    async def low(i: int) -> None:
        prompt = f"Stream {i}: tell me a long story about the sea."
        async for _ in engine.stream(prompt, max_tokens=args.tokens, ignore_eos=True):
            stamps[i].append(time.monotonic())

    tasks = [asyncio.ensure_future(low(i)) for i in range(args.parallel)]
    deadline = time.monotonic() + 120
    while min(len(s) for s in stamps) < 10:
        if time.monotonic() > deadline:
            raise SystemExit("the low-priority streams did not all start")
        await asyncio.sleep(0.01)
    out = []
    for r in range(args.rounds):
        # A stream gets one token a step: its mean gap over its last 8 tokens.
        step = statistics.median((s[-1] - s[-9]) / 8 for s in stamps if len(s) >= 9)
        t0 = time.monotonic()
        async for _ in engine.stream(f"Urgent {r}: {words}", max_tokens=2, priority=10):
            ttft = time.monotonic() - t0
            break
        out.append((ttft, step))
        await asyncio.sleep(0.3)  # the preempted stream resumes
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    args.model = args.model or default_model()
    if not args.model:
        raise SystemExit("no model: pass --model or run `python -m kvserve pull` first")
    with Engine(args.model, threads=2, parallel=args.parallel, ctx_size=2048) as engine:
        rows = asyncio.run(main_async(args, engine))
        preempted = engine.stats()["preemptions"]
    for ttft, step in rows:
        print(f"ttft {ttft * 1000:.0f} ms, step {step * 1000:.0f} ms")
    ttft = statistics.median(t for t, _ in rows)
    step = statistics.median(s for _, s in rows)
    extra = statistics.median((t - args.idle_ttft) / s for t, s in rows)
    table = (
        f"{utc_stamp()}, {machine_desc()}, load {loadavg()}; Engine parallel={args.parallel}, "
        f"threads 2; {args.parallel} low-priority streams, a priority-10 request of "
        f"~{args.prompt_tokens} prompt tokens, {args.rounds} rounds, {preempted} preemptions\n\n"
        "| time to first token | the same on an idle engine | step of the running streams"
        " | (ttft - idle ttft) / step, median of rounds |\n|---|---|---|---|\n"
        f"| {ttft * 1000:.0f} ms | {args.idle_ttft * 1000:.0f} ms | {step * 1000:.0f} ms"
        f" | {extra:.2f} |\n"
    )
    print(table)
    if args.write:
        cmd = this_command("bench_priority.py", args.model)
        append_section(
            Path(REPO_ROOT) / "BENCHMARKS.md",
            "## A high-priority request on a full engine",
            table,
            cmd,
        )


if __name__ == "__main__":
    main()
