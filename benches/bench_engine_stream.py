#!/usr/bin/env python3
"""One streaming request through ``kvserve.Engine`` against the core's own decode speed (issue #24:
at one running sequence the Python layer should cost almost nothing).

In ``--rounds`` interleaved rounds (the order flips each round), on one loaded model:

* core: ``_core.bench(model, n_prompt=0, n_gen=N, reps=1)``, llama-bench's tgN (N single-token
  decode steps from an empty context, no sampling);
* engine: ``Engine.stream(prompt, max_tokens=N + 1, temperature=0, ignore_eos=True)`` of a short
  prompt, timed from the first text piece to the last: N decode steps, each with the
  engine's scheduling, sampling, detokenization and the asyncio hand-over to the caller.

Prints the medians, the median of the per-round ratios engine / core, and a markdown table;
``--write`` appends it to BENCHMARKS.md under "## Decode at depth, with a roofline (issue #24)".
The model is ``--model``, else $KVSERVE_TEST_MODEL, else the default model.

Example:
  python benches/bench_engine_stream.py --rounds 5 -n 128
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO_ROOT,
    append_section,
    default_model,
    loadavg,
    machine_desc,
    median,
    utc_stamp,
)

HEADING = "## Decode at depth, with a roofline (issue #24)"


async def engine_tok_s(engine, n: int) -> float:
    first = last = 0.0
    pieces = 0
    async for _ in engine.events(
        "Once upon a time", max_tokens=n + 1, temperature=0.0, ignore_eos=True
    ):
        last = time.perf_counter()
        if pieces == 0:
            first = last
        pieces += 1
    if pieces < 2 or last <= first:
        raise RuntimeError(f"the stream gave {pieces} text pieces: nothing to time")
    return n / (last - first)  # n decode steps after the first token's


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="GGUF file (default: $KVSERVE_TEST_MODEL or the default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128, help="decode steps timed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="append the table to BENCHMARKS.md")
    args = ap.parse_args()
    model_path = args.model or default_model()
    if not model_path or not os.path.exists(model_path):
        print(f"error: model not found: {model_path!r}", file=sys.stderr)
        return 2

    from kvserve import Engine, Model, _core

    model = Model(model_path, threads=args.threads)
    load_before = loadavg()
    core: list[float] = []
    eng: list[float] = []
    ratios: list[float] = []
    with Engine(model, parallel=1, ctx_size=512) as engine:
        asyncio.run(engine_tok_s(engine, 8))  # warm-up
        _core.bench(model.core, 0, 8, 1)
        for r in range(args.rounds):
            got: dict[str, float] = {}
            for side in ("core", "engine") if r % 2 == 0 else ("engine", "core"):
                if side == "core":
                    got[side] = float(_core.bench(model.core, 0, args.n, 1)["decode_tok_s"])
                else:
                    got[side] = asyncio.run(engine_tok_s(engine, args.n))
            core.append(got["core"])
            eng.append(got["engine"])
            ratios.append(got["engine"] / got["core"])
            print(
                f"round {r + 1}: core {got['core']:.1f} engine {got['engine']:.1f} tok/s",
                file=sys.stderr,
            )
    mc, me, mr = median(core), median(eng), median(ratios)
    assert mc is not None and me is not None and mr is not None
    table = "\n".join(
        [
            f"### {utc_stamp()}: one streaming request through the Engine vs the core's tg{args.n}",
            "",
            f"- machine: {machine_desc()}; load average before {load_before}, after {loadavg()}",
            f"- {os.path.basename(model_path)}, {args.threads} threads, {args.rounds} "
            "interleaved rounds; `python benches/bench_engine_stream.py`",
            "",
            "| core tok/s | Engine.events tok/s | Engine / core (median of per-round ratios) |",
            "|---:|---:|---:|",
            f"| {mc:.1f} | {me:.1f} | {mr:.3f}x |",
            "",
            f"samples: core {[round(x, 1) for x in core]}; engine {[round(x, 1) for x in eng]}",
            "",
        ]
    )
    print(table)
    if args.write:
        path = REPO_ROOT / "BENCHMARKS.md"
        append_section(path, HEADING, table, "python benches/bench_engine_stream.py --write")
    return 0


if __name__ == "__main__":
    sys.exit(main())
