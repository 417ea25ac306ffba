#!/usr/bin/env python3
"""KV block size sweep (issue #3: "block size configurable, default 16 or 32 - measure and
choose"): B = 16 sequences, a 128-token prompt each (one batch), then 32 decode steps of all 16.

  python benches/bench_block_size.py [MODEL]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from kvserve import _core


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("KVSERVE_TEST_MODEL", "")
    if not path:
        print("bench_block_size: pass a model path or set KVSERVE_TEST_MODEL", file=sys.stderr)
        return 2
    m = _core.Model(path, threads=2)
    b, p, g = 16, 128, 32
    rng = np.random.default_rng(0)
    for _rep in range(2):
        for bs in (8, 16, 32, 64):
            ctx = m.new_context(b * (p + g) + 64, block_size=bs)
            toks = [int(x) for x in rng.integers(0, m.n_vocab, b * p)]
            pos = [q for _ in range(b) for q in range(p)]
            seq = [s for s in range(b) for _ in range(p)]
            t = time.perf_counter()
            ctx.decode(toks, pos, seq, [False] * (b * p))
            pp = b * p / (time.perf_counter() - t)
            t = time.perf_counter()
            for i in range(g):
                step = [int(x) for x in rng.integers(0, m.n_vocab, b)]
                ctx.decode(step, [p + i] * b, list(range(b)), [True] * b)
            tg = b * g / (time.perf_counter() - t)
            st = ctx.stats()
            print(
                f"block {bs:3d}: pp {pp:6.1f} tg {tg:6.1f} tok/s, "
                f"blocks {st['blocks_referenced']}, unused slots {st['unused_slots']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
