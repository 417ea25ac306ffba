#!/usr/bin/env python3
"""Prefill and decode speed with the model's block pool full of cached blocks vs an empty pool.

Every context of a model shares one block pool. When the pool is full of cached (unreferenced,
prefix-indexed) blocks, every new block of a prefill or decode evicts the least recently used
one; this measures what that costs against a fresh model whose pool is empty. Both sides run
in one process, interleaved over --rounds rounds; medians are reported with their ratio.

    python benches/bench_kv_pool.py --model MODEL [--threads 2] [--rounds 5] [--write]

`--write` appends the table to BENCHMARKS.md. The target: within 5% (ratio >= 0.95).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvserve import _core
from kvserve.models import pull

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, append_section, machine_desc  # noqa: E402

HEADING = "## KV core for many users (issue #4)"


def fill_with_cached(model: _core.Model, n_ctx: int, rng: np.random.Generator) -> dict:
    """Decodes distinct random prompts and drops them until the pool is all cached blocks."""
    ctx = model.new_context(n_ctx)
    total = int(ctx.stats()["blocks_total"])
    seq = 0
    while int(ctx.stats()["blocks_cached"]) < total - 2:
        toks = [int(t) for t in rng.integers(100, model.n_vocab, size=512)]
        ctx.decode(toks, list(range(512)), [seq] * 512, [False] * 511 + [True])
        ctx.seq_rm(seq)
        seq += 1
    return ctx.stats()


def measure(model: _core.Model, n_ctx: int, rng: np.random.Generator) -> tuple[float, float]:
    ctx = model.new_context(n_ctx)
    toks = [int(t) for t in rng.integers(100, model.n_vocab, size=512 + 128)]
    t0 = time.perf_counter()
    ctx.decode(toks[:512], list(range(512)), [0] * 512, [False] * 511 + [True])
    pp = 512 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(128):
        ctx.decode([toks[512 + i]], [512 + i], [0], [True])
    tg = 128 / (time.perf_counter() - t0)
    ctx.seq_rm(0)
    return pp, tg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-ctx", type=int, default=8192, help="pool size in tokens")
    ap.add_argument("--write", action="store_true", help="append the table to BENCHMARKS.md")
    a = ap.parse_args()
    path = a.model or pull(quiet=True)
    rng = np.random.default_rng(1)
    full = _core.Model(path, threads=a.threads)
    empty_pp, empty_tg, full_pp, full_tg = [], [], [], []
    for r in range(a.rounds):
        st = fill_with_cached(full, a.n_ctx, rng)
        # A fresh model each round: its pool is empty.
        empty = _core.Model(path, threads=a.threads)
        measure(empty, a.n_ctx, rng)  # warm-up: page in the weights
        sides = [(empty, empty_pp, empty_tg), (full, full_pp, full_tg)]
        for model, pps, tgs in sides if r % 2 == 0 else sides[::-1]:
            pp, tg = measure(model, a.n_ctx, rng)
            pps.append(pp)
            tgs.append(tg)
        print(
            f"round {r}: cached blocks {st['blocks_cached']}/{st['blocks_total']}; "
            f"empty pp {empty_pp[-1]:.1f} tg {empty_tg[-1]:.1f}; "
            f"full pp {full_pp[-1]:.1f} tg {full_tg[-1]:.1f} tok/s"
        )
        del empty
    med = statistics.median
    rows = [
        ("pp512", med(empty_pp), med(full_pp)),
        ("tg128", med(empty_tg), med(full_tg)),
    ]
    table = [
        "| test | empty pool (tok/s) | pool full of cached blocks (tok/s) | full / empty |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, e, f in rows:
        table.append(f"| {name} | {e:.1f} | {f:.1f} | {f / e:.3f} |")
    print("\n".join(table))
    if a.write:
        text = [
            f"### Pool full of cached blocks vs empty ({dt.date.today().isoformat()})",
            "",
            f"- Machine: {machine_desc()}, {a.threads} threads; {a.rounds} interleaved rounds, "
            f"medians; pool of {a.n_ctx} tokens.",
            f"- Command: `python benches/bench_kv_pool.py --model MODEL --threads {a.threads} "
            f"--rounds {a.rounds} --write`",
            "- Target: within 5% (full / empty >= 0.95).",
            "",
            *table,
            "",
        ]
        command = "python benches/bench_kv_pool.py --write"
        append_section(REPO_ROOT / "BENCHMARKS.md", HEADING, "\n".join(text), command)


if __name__ == "__main__":
    main()
