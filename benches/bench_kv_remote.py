#!/usr/bin/env python3
"""The shared K/V tier (issue 21, L3): time to first token of prompts of 256, 1,024 and 4,096
tokens computed cold, served from the local prefix cache (RAM), and fetched from Redis by a
replica that never computed them; and the break-even prompt length below which fetching is not
faster than computing.

Two ``kvserve.Engine`` "replicas" in one process, each on its own model instance (its own K/V
pool, index and tier, as separate processes have), 2 threads, one sequence at a time, both with
``kv_remote`` on a Redis server this script starts on a loopback port (Debian's
``redis-server``, ``maxmemory`` with LRU eviction). Each of ``--rounds`` rounds, per length:

- cold: replica A computes a prompt nobody computed (``max_tokens=1``: the time is the time to
  first token), writing its blocks through to Redis;
- RAM: replica A again (its blocks are in its pool);
- Redis: once A's writes are sent, replica B gets the same prompt: it fetches the prompt's
  leading blocks (one pipelined existence check, then ``MGET`` batches) before queueing it and
  computes only the tail; the script checks that every cached token came from Redis.

The short lengths (``--short``) find the break-even: the shortest length whose median Redis
time beats its median cold time. Reported p50 and p95 (with 5 rounds the p95 is about the
slowest round).

  python benches/bench_kv_remote.py --write
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

from _common import (
    REPO_ROOT,
    RedisServer,
    add_idle_args,
    append_section,
    default_model,
    first_token,
    loadavg,
    machine_desc,
    tagged_ids,
    this_command,
    utc_stamp,
    wait_for_idle,
)

from kvserve import Engine, Model

BLOCK = 16


Samples = dict[str, list[float]]


async def measure(args: argparse.Namespace, a: Engine, b: Engine) -> dict[int, Samples]:
    lengths = [*args.tokens, *args.short]
    out: dict[int, Samples] = {n: {"cold": [], "ram": [], "redis": []} for n in lengths}
    for e in (a, b):  # first-use costs, not counted
        await first_token(e, tagged_ids(a.model, f"warm-up {id(e)}", min(300, max(args.tokens))))
    for r in range(args.rounds):
        for n in lengths:
            ids = tagged_ids(a.model, f"{r}-{n}", n)
            dt, res = await first_token(a, ids)
            assert res.cached_tokens == 0, "a cold prompt"
            out[n]["cold"].append(dt)
            dt, res = await first_token(a, ids)
            assert res.cached_tokens == (n - 1) // BLOCK * BLOCK
            out[n]["ram"].append(dt)
            a._loop.kv.flush_remote()
            before = b.stats()["kv_remote_hit_tokens"]
            dt, res = await first_token(b, ids)
            fetched = b.stats()["kv_remote_hit_tokens"] - before
            want = (n - 1) // BLOCK * BLOCK
            assert res.cached_tokens == fetched == want, (n, res.cached_tokens, fetched)
            out[n]["redis"].append(dt)
        line = ", ".join(
            f"{n}: cold {out[n]['cold'][-1] * 1e3:.0f} / redis {out[n]['redis'][-1] * 1e3:.0f} ms"
            for n in args.tokens
        )
        print(f"round {r}: {line}", flush=True)
    return out


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--tokens",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[256, 1024, 4096],
        help="prompt lengths (comma-separated)",
    )
    ap.add_argument(
        "--short",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[17, 33, 65, 129],
        help="short prompt lengths for the break-even (comma-separated)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", action="store_true")
    add_idle_args(ap)
    args = ap.parse_args()
    args.model = args.model or default_model()
    if not args.model:
        raise SystemExit("no model: pass --model or run `python -m kvserve pull` first")
    ctx = max(args.tokens) + 64
    redis = RedisServer(maxmemory="2gb")
    url = redis.url
    busy = wait_for_idle(args.wait_idle, args.wait_max)
    load_before = f"{loadavg()}, CPUs {busy:.0f}% busy before"
    try:
        kw = {"parallel": 1, "ctx_size": ctx, "kv_remote": url, "kv_remote_min_tokens": 0}
        with (
            Engine(Model(args.model, threads=2), **kw) as a,
            Engine(Model(args.model, threads=2), **kw) as b,
        ):
            out = asyncio.run(measure(args, a, b))
            st = b.stats()
            per_fetch = st["kv_remote_fetch_latency_s"]
            blocks = st["kv_remote_fetched_blocks"]
            fetch_s = st["kv_remote_fetch_seconds"]
            bytes_read = st["kv_remote_bytes_read"]
            errors = st["kv_remote_errors"] + a.stats()["kv_remote_errors"]
    finally:
        redis.stop()
    ms = 1e3
    rows = []
    for n in args.tokens:
        o = out[n]
        c50, r50, m50 = (statistics.median(o[k]) for k in ("cold", "redis", "ram"))
        rows.append(
            f"| {n} | {c50 * ms:.0f} / {_p(o['cold'], 0.95) * ms:.0f} ms"
            f" | {m50 * ms:.0f} / {_p(o['ram'], 0.95) * ms:.0f} ms"
            f" | {r50 * ms:.0f} / {_p(o['redis'], 0.95) * ms:.0f} ms"
            f" | {m50 / c50:.3f} | {r50 / c50:.3f} |\n"
        )
    short_rows = []
    break_even = None
    for n in args.short:
        c, r = statistics.median(out[n]["cold"]), statistics.median(out[n]["redis"])
        short_rows.append(f"| {n} | {c * ms:.1f} ms | {r * ms:.1f} ms | {r / c:.2f} |\n")
        if break_even is None and r < c:
            break_even = n
    mib = bytes_read / 2**20
    table = (
        f"{utc_stamp()}, {machine_desc()}, load {load_before}; SmolLM2-135M Q4_1 f16 K/V,"
        f" two Engines (replicas) on their own model instances, threads 2, parallel 1, Redis"
        f" 7 on loopback; {args.rounds} rounds; {errors} store errors\n\n"
        "| prompt tokens | cold p50 / p95 | RAM hit p50 / p95 | Redis hit p50 / p95"
        " | RAM / cold | Redis / cold |\n|---:|---:|---:|---:|---:|---:|\n"
        + "".join(rows)
        + f"\nFetches: {blocks} blocks, {mib:.0f} MiB in {fetch_s:.2f} s"
        f" ({mib / fetch_s:.0f} MiB/s; {per_fetch * ms:.1f} ms per fetch on average), both"
        " round trips and verification included.\n\n"
        "| prompt tokens | cold | from Redis | Redis / cold |\n|---:|---:|---:|---:|\n"
        + "".join(short_rows)
        + "\nBreak-even: "
        + (
            f"a fetch is faster from {break_even} tokens on"
            + (" (the shortest prompt that maps a block)" if break_even == args.short[0] else "")
            if break_even is not None
            else "a fetch was not faster at any measured length"
        )
        + ".\n"
    )
    print(table)
    if args.write:
        cmd = this_command("bench_kv_remote.py", args.model)
        append_section(
            Path(REPO_ROOT) / "BENCHMARKS.md",
            "## Shared K/V tier on Redis (issue 21)",
            table,
            cmd,
            intro=(
                "Time to first token of a prompt computed cold, served from the local prefix"
                " cache, and fetched from Redis (`--kv-remote`) by a replica that never computed"
                " it; the target (issue 21) is Redis-hit p50 ≤ 0.5x cold from 1,024 tokens. The"
                " break-even table sets the tier's default `kv_remote_min_tokens`"
                " (`kv::remote::DEFAULT_MIN_TOKENS`). The machine is shared (each table gives"
                " its load): absolute times move with it, the ratios of one run are what to"
                f" compare. Command: `{cmd}` (benches/bench_kv_remote.py)."
            ),
        )


if __name__ == "__main__":
    main()
