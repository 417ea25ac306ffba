"""Per-row cost of kvserve.sampling: one row of float32 logits sampled as the engine samples it
(``Sampler(params, seed)(row, history)``), for several option sets, against plain temperature
sampling of the same rows.

    python benches/bench_sampling.py --model MODEL      # logits of a real model (SmolLM2)
    python benches/bench_sampling.py --random           # random normal logits instead

Rows: with ``--model`` (default ``$KVSERVE_TEST_MODEL``), the logits of 32 greedy steps over two
prompts; each row is also widened to 262144 entries (Gemma 3's vocabulary) by appending values
drawn from that row's own logits below its 99th percentile, so the head of the distribution is
the model's and the tail is as long as Gemma's. ``--random``: N(0, 3^2) logits, whose tails are
much flatter than a language model's (a pessimistic case: typical-p and top-p keep most of the
vocabulary there, so they sort most of it). The history is 512 tokens (the penalty window takes
its last 64, or all with penalty_last_n=-1).

Prints one line per (vocabulary, option set): the median and the fastest microseconds per row
over ``--reps`` calls (cycling through the rows), and the ratio of the medians to plain
temperature sampling. On a shared machine compare lines of one run only.

``--before FILE``: also time another version of the module (a sampling.py file, e.g.
``git show d4c58ae:python/kvserve/sampling.py > /tmp/sampling_before.py``) on the option sets
it knows (temperature, top-k, top-p), beside this one, interleaved call by call.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from types import ModuleType

import numpy as np

from kvserve.sampling import Sampler, SamplingParams, token_logprobs

ALL_ON: dict[str, object] = {
    "temperature": 0.8,
    "top_k": 0,
    "typical_p": 0.95,
    "top_p": 0.95,
    "min_p": 0.05,
    "repeat_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "penalty_last_n": 64,
    "logit_bias": {11: 5.0, 12: -100.0, 13: float("-inf")},
}

CASES: list[tuple[str, dict[str, object], bool]] = [
    ("greedy (argmax)", {}, False),
    ("greedy + bias + penalties", {k: v for k, v in ALL_ON.items() if k != "temperature"}, False),
    ("temperature 0.8 (baseline)", {"temperature": 0.8}, False),
    ("temperature + top_p 0.95", {"temperature": 0.8, "top_p": 0.95}, False),
    (
        "temperature + top_k 40 + top_p 0.95",
        {"temperature": 0.8, "top_k": 40, "top_p": 0.95},
        False,
    ),
    ("all options, top_k 0", ALL_ON, False),
    ("all options, top_k 40", {**ALL_ON, "top_k": 40}, False),
    ("all options, penalty_last_n -1", {**ALL_ON, "penalty_last_n": -1}, False),
    ("all options, top_k 0, + logprobs 5", ALL_ON, True),
]

PROMPTS = [
    "Once upon a time, in a quiet town by the sea,",
    "<|im_start|>user\nWrite a short poem about rivers.<|im_end|>\n<|im_start|>assistant\n",
]


def model_rows(path: str) -> list[np.ndarray]:
    from kvserve import Model

    model = Model.load(path, threads=2)
    out = []
    for prompt in PROMPTS:
        ids = model.tokenize(prompt, add_special=True, parse_special=True)
        ctx = model.new_context(len(ids) + 16)
        n = len(ids)
        logits = ctx.decode(ids, list(range(n)), [0] * n, [False] * (n - 1) + [True])
        for step in range(16):
            row = np.frombuffer(memoryview(logits), dtype=np.float32).copy()
            out.append(row)
            tok = int(np.argmax(row))
            logits = ctx.decode([tok], [n + step], [0], [True])
    return out


def widen(row: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    tail = row[row < np.percentile(row, 99)]
    return np.concatenate([row, rng.choice(tail, size=size - row.size)]).astype(np.float32)


def time_case(
    rows: list[np.ndarray], history: list[int], params: SamplingParams, reps: int, lp: bool
) -> list[float]:
    sampler = Sampler(params, seed=0)
    out = []
    for i in range(reps):
        row = rows[i % len(rows)]
        t0 = time.perf_counter()
        tok = sampler(row, history)
        if lp:
            token_logprobs(row, tok, 5)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def load_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("sampling_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sampling_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


BEFORE_CASES: list[tuple[str, dict[str, object]]] = [
    ("temperature 0.8", {"temperature": 0.8}),
    ("temperature + top_p 0.95", {"temperature": 0.8, "top_p": 0.95}),
    ("temperature + top_k 40 + top_p 0.95", {"temperature": 0.8, "top_k": 40, "top_p": 0.95}),
]


def compare(before: ModuleType, rows: list[np.ndarray], reps: int) -> None:
    import kvserve.sampling as after

    for name, kw in BEFORE_CASES:
        samplers = [m.Sampler(m.SamplingParams(**kw), seed=0) for m in (before, after)]
        times: list[list[float]] = [[], []]
        for i in range(reps):
            for side in (i % 2, 1 - i % 2):  # interleaved, the order flipping each call
                t0 = time.perf_counter()
                samplers[side](rows[i % len(rows)])
                times[side].append((time.perf_counter() - t0) * 1e6)
        b, a = (statistics.median(t) for t in times)
        print(f"  {name:40s} before {b:9.1f} us  after {a:9.1f} us  before/after {b / a:6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("KVSERVE_TEST_MODEL"))
    ap.add_argument("--random", action="store_true", help="random normal logits instead")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--before", metavar="FILE", help="another sampling.py to compare with")
    args = ap.parse_args()
    before = load_module(args.before) if args.before else None
    rng = np.random.default_rng(0)
    if args.random or not args.model:
        sets = {
            n: [(rng.normal(size=n) * 3).astype(np.float32) for _ in range(8)]
            for n in (49152, 262144)
        }
        print("rows: random N(0, 9) logits")
    else:
        real = model_rows(args.model)
        sets = {real[0].size: real, 262144: [widen(r, 262144, rng) for r in real]}
        print(f"rows: {len(real)} greedy steps of the model, and the same widened to 262144")
    for n_vocab, rows in sets.items():
        history = rng.integers(0, n_vocab, size=512).tolist()
        base = None
        print(f"n_vocab={n_vocab}")
        for name, kw, lp in CASES:
            params = SamplingParams(**kw)  # type: ignore[arg-type]
            samples = time_case(rows, history, params, args.reps, lp)
            med = statistics.median(samples)
            if name.endswith("(baseline)"):
                base = med
            ratio = f"{med / base:5.2f}x" if base else "     "
            print(f"  {name:40s} median {med:9.1f} us  min {min(samples):9.1f} us  {ratio}")
        if before is not None:
            print(f"n_vocab={n_vocab}: before (--before) and after (this checkout)")
            compare(before, rows, args.reps)


if __name__ == "__main__":
    main()
