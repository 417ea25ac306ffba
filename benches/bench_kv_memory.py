#!/usr/bin/env python3
"""KV memory with a shared prefix (issue #3): N sequences share a P-token prompt prefix and
each adds U unique tokens. kvserve stores the prefix once (blocks shared by `seq_cp`, copy-on-write
of the partly filled tail only); llama.cpp's unified cache stores N * (P + U) cells when each
sequence is prefilled on its own (as a server does for separate requests).

Prints blocks used, the issue's bound ceil(P/b) + N * (ceil(U/b) + 1), and bytes for both.

  python benches/bench_kv_memory.py [--model M] [-N 16] [-P 768] [-U 64] [--write]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import sys
from pathlib import Path

from kvserve import _core

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, append_section  # noqa: E402

HEADING = "## KV memory and block size (issue #3)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("KVSERVE_TEST_MODEL"))
    ap.add_argument("-N", type=int, default=16, help="sequences")
    ap.add_argument("-P", type=int, default=768, help="shared prefix tokens")
    ap.add_argument("-U", type=int, default=64, help="unique tokens per sequence")
    ap.add_argument("--write", action="store_true", help="append the table to BENCHMARKS.md")
    args = ap.parse_args(argv)
    if not args.model:
        print("bench_kv_memory: pass --model or set KVSERVE_TEST_MODEL", file=sys.stderr)
        return 2
    n, p, u = args.N, args.P, args.U
    model = _core.Model(args.model, threads=2)
    ctx = model.new_context(p + n * u + 64)
    vocab = model.n_vocab
    prefix = [(i * 7919 + 13) % vocab for i in range(p)]
    for start in range(0, p, 256):  # prefill in 256-token batches
        chunk = prefix[start : start + 256]
        ctx.decode(
            chunk, list(range(start, start + len(chunk))), [0] * len(chunk), [False] * len(chunk)
        )
    for s in range(1, n):
        ctx.seq_cp(0, s)
    for i in range(u):
        toks = [(s * 104729 + i * 31 + 7) % vocab for s in range(n)]
        ctx.decode(toks, [p + i] * n, list(range(n)), [False] * n)
    st = ctx.stats()
    b = st["block_size"]
    used = st["blocks_referenced"]
    bound = math.ceil(p / b) + n * (math.ceil(u / b) + 1)
    per_block = st["bytes_per_block"]
    per_cell = per_block // b
    ours = used * per_block
    llama = n * (p + u) * per_cell
    lines = [
        f"### {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC: shared-prefix KV memory",
        "",
        f"- `python benches/bench_kv_memory.py -N {n} -P {p} -U {u}` "
        f"(model {Path(args.model).name}, f16 K/V, block size {b})",
        f"- kvserve: {used} blocks used (bound ceil(P/b) + N(ceil(U/b)+1) = {bound}), "
        f"{st['tokens_stored']} cells stored, {st['unused_slots']} unused slots",
        "",
        "| | cells | bytes |",
        "|---|---:|---:|",
        f"| llama.cpp unified cache, N(P+U) | {n * (p + u)} | {llama:,} |",
        f"| kvserve blocks x block bytes | {used * b} | {ours:,} |",
        f"| ratio llama.cpp / kvserve | | {llama / ours:.2f}x |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if used > bound:
        print(f"bench_kv_memory: {used} blocks exceed the bound {bound}", file=sys.stderr)
        return 1
    if args.write:
        command = "python benches/bench_kv_memory.py --write"
        append_section(REPO_ROOT / "BENCHMARKS.md", HEADING, text, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
