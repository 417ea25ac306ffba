"""The binding's hot calls under two builds of kvserve, side by side: the stable-ABI (abi3)
extension against a version-specific one (or any two installs), each in its own Python.

    python benches/bench_binding.py --python A/bin/python --python B/bin/python [--rounds 5]

Each round runs this script once per Python (``--worker``, alternating, so that load on a shared
machine falls on both alike), which times with the installed kvserve and the same model
(``--model``, default ``$KVSERVE_TEST_MODEL``):

- ``decode``: ``Context.decode`` of one token of one sequence (a decode step at batch 1: list
  conversion, the GIL released, the forward pass, the Logits object), µs per call, 128 calls;
- ``logits view``: ``np.frombuffer(memoryview(logits), dtype=np.float32)`` of a 1-row Logits
  (the engine's zero-copy view), ns per call, 200,000 calls;
- ``engine step``: ``kvserve.Engine`` with 16 greedy sequences of 64 tokens at once (16
  threads calling ``generate``, ``ignore_eos``), ms per generated token step (wall / 64).

Prints, per call, the median of the rounds for each Python and the ratio of the second to the
first. On a shared machine compare numbers of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker(model: str) -> dict[str, float]:
    import threading

    import numpy as np

    from kvserve import Engine, _core

    core = _core.Model(model)
    ctx = core.new_context(512)
    toks = core.tokenize("The quick brown fox jumps over the lazy dog", add_special=True)
    ctx.decode(toks, list(range(len(toks))), [0] * len(toks), [False] * (len(toks) - 1) + [True])
    pos, n = len(toks), 128
    t0 = time.perf_counter()
    for i in range(n):
        logits = ctx.decode([toks[i % len(toks)]], [pos + i], [0], [True])
    decode_us = (time.perf_counter() - t0) / n * 1e6

    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        np.frombuffer(memoryview(logits), dtype=np.float32)
    view_ns = (time.perf_counter() - t0) / n * 1e9
    del ctx, core

    engine = Engine(model, parallel=16, ctx_size=512)
    try:
        engine.generate("Hello", max_tokens=4)  # warm up
        prompts = [f"Story number {i}: once upon a time" for i in range(16)]
        steps = 64

        def one(p: str) -> None:
            engine.generate(p, max_tokens=steps, ignore_eos=True, temperature=0)

        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        step_ms = (time.perf_counter() - t0) / steps * 1e3
    finally:
        engine.close()
    return {"decode_us": decode_us, "view_ns": view_ns, "step_ms": step_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", default=[], help="interpreter (twice)")
    ap.add_argument("--model", default=os.environ.get("KVSERVE_TEST_MODEL"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.model:
        ap.error("--model or KVSERVE_TEST_MODEL is required")
    if args.worker:
        print(json.dumps(worker(args.model)))
        return
    if len(args.python) != 2:
        ap.error("give --python twice (first: baseline, second: candidate)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results: dict[str, list[dict[str, float]]] = {p: [] for p in args.python}
    for r in range(args.rounds):
        order = args.python if r % 2 == 0 else args.python[::-1]
        for py in order:
            out = subprocess.run(
                [py, os.path.abspath(__file__), "--worker", "--model", args.model],
                check=True,
                capture_output=True,
                text=True,
                cwd="/",
                env=env,
            ).stdout
            results[py].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1} {py}: {results[py][-1]}", file=sys.stderr)
    a, b = args.python
    print(f"| call | {a} | {b} | ratio |")
    print("| --- | --- | --- | --- |")
    for key, label in [
        ("decode_us", "decode, 1 token (µs)"),
        ("view_ns", "logits view (ns)"),
        ("step_ms", "engine step, 16 seqs (ms)"),
    ]:
        ma = statistics.median(x[key] for x in results[a])
        mb = statistics.median(x[key] for x in results[b])
        print(f"| {label} | {ma:.1f} | {mb:.1f} | {mb / ma:.3f}x |")
    for py in args.python:
        for key in ("decode_us", "view_ns", "step_ms"):
            print(f"samples {py} {key}: {[round(x[key], 1) for x in results[py]]}")


if __name__ == "__main__":
    main()
