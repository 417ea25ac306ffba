#!/usr/bin/env python3
"""Many users of one model in one process: kvserve's Engine against llama-cpp-python's Llama.

The scenario (issue #5): ``--users`` users (16) share a ``--system-tokens`` (~800-token) system
prompt; each has a two-turn conversation (ChatML, the default model's format), ``--max-tokens``
(48) new tokens a turn, greedy; turn 2's prompt is turn 1's prompt + answer + a new question.
All users start at once. Measured per side: total wall time until every user has both answers,
and time to first token (TTFT: from a user sending a turn to the first text of its answer,
including any wait in a queue), median and 90th percentile over all turns.

- kvserve: one ``Engine(parallel=users)``, each user an asyncio task streaming its turns with
  ``engine.stream`` (continuous batching). "reuse on": the default prefix cache (the system
  prompt's blocks are computed once, turn 2 reuses turn 1's blocks); "off": ``prefix_cache=False``.
- llama-cpp-python: one ``Llama``, each user a thread; ``Llama`` serves one call at a time, so
  calls take a lock (what an application must do). "reuse on": Llama's own reuse of the longest
  common prefix with the previous call's tokens; "off": ``llm.reset()`` before each call.

Each side runs in its own child process (llama-cpp-python's under ``--llama-python``, which must
import ``llama_cpp``; it loads libllama from ``$LLAMA_CPP_LIB_PATH`` when set), the order
flipping each round; medians over ``--rounds``. The answers of both sides are compared (greedy:
they should agree). ``--write`` appends the table to BENCHMARKS.md.

  python benches/bench_users.py --rounds 3 --llama-python /path/to/python-with-llama_cpp --write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO_ROOT,
    add_idle_args,
    append_section,
    default_model,
    interleaved,
    loadavg,
    machine_desc,
    utc_stamp,
    wait_for_idle,
)

HEADING = "## Many users in one process (issue #5)"

TOPICS = [
    "shipping times", "refund rules", "warranty claims", "account security", "gift cards",
    "bulk orders", "store hours", "product recalls", "price matching", "loyalty points",
    "damaged parcels", "international orders", "student discounts", "repairs", "privacy",
    "payment methods", "returns without receipt", "preorders", "subscriptions", "accessibility",
]  # fmt: skip


def system_prompt(words: int) -> str:
    """A deterministic policy text of about ``words`` words (~1.3 tokens a word)."""
    parts = ["You are the support assistant of Northwind Outfitters. Follow these rules."]
    i = 0
    while sum(len(p.split()) for p in parts) < words:
        t = TOPICS[i % len(TOPICS)]
        parts.append(
            f"Rule {i + 1}: when a customer asks about {t}, answer politely, mention policy "
            f"section {i + 3}, keep the answer short, and offer to connect them with a human "
            f"agent if the question about {t} needs an account lookup."
        )
        i += 1
    return " ".join(parts)


def chatml(system: str, turns: list[tuple[str, str | None]]) -> str:
    out = f"<|im_start|>system\n{system}<|im_end|>\n"
    for user, answer in turns:
        out += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        if answer is not None:
            out += f"{answer}<|im_end|>\n"
    return out


def questions(u: int) -> tuple[str, str]:
    t = TOPICS[u % len(TOPICS)]
    return (f"Hi, I am customer {u}. What is your policy on {t}?", "Can you say that in one line?")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- the two sides (each in a child process) -------------------------------------------------


def run_kvserve(args: argparse.Namespace, system: str) -> dict[str, Any]:
    from kvserve import Engine, Model

    model = Model(args.model, threads=args.threads)
    engine = Engine(model, parallel=args.users, ctx_size=args.ctx, prefix_cache=args.reuse == "on")
    ttft: list[float] = []
    answers: dict[str, str] = {}

    async def user(u: int) -> None:
        q1, q2 = questions(u)
        turns: list[tuple[str, str | None]] = [(q1, None)]
        for k in range(2):
            if k == 1:
                turns = [(q1, answers[f"{u}.0"]), (q2, None)]
            t0 = time.perf_counter()
            first = True
            text = ""
            async for piece in engine.stream(chatml(system, turns), max_tokens=args.max_tokens):
                if first:
                    ttft.append(time.perf_counter() - t0)
                    first = False
                text += piece
            answers[f"{u}.{k}"] = text

    async def main() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(user(u) for u in range(args.users)))
        return time.perf_counter() - t0

    # Warm-up (the model's pages, the pool): one short request, then forget its blocks.
    engine.generate("Hello", max_tokens=2)
    st0 = engine.stats()
    total = asyncio.run(main())
    st = {k: v - st0[k] for k, v in engine.stats().items()}
    engine.close()
    prompt_tokens = model.tokenize(chatml(system, [("x", None)]), parse_special=True)
    return {
        "total_s": total,
        "ttft": ttft,
        "answers": answers,
        "prompt_tokens": st["prompt_tokens"],
        "cached_prompt_tokens": st["cached_prompt_tokens"],
        "generated_tokens": st["generated_tokens"],
        "system_tokens": len(prompt_tokens),
    }


def run_llama(args: argparse.Namespace, system: str) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(
        model_path=args.model,
        n_ctx=args.ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=512,
        verbose=False,
    )
    lock = threading.Lock()
    ttft: list[float] = []
    answers: dict[str, str] = {}
    generated = [0]

    def call(prompt: str) -> tuple[float, str]:
        t0 = time.perf_counter()
        with lock:
            if args.reuse == "off":
                llm.reset()
            first = None
            text = ""
            for chunk in llm.create_completion(
                prompt, max_tokens=args.max_tokens, temperature=0.0, stream=True
            ):
                if first is None:
                    first = time.perf_counter() - t0
                text += chunk["choices"][0]["text"]
                generated[0] += 1
        return (first if first is not None else time.perf_counter() - t0), text

    def user(u: int) -> None:
        q1, q2 = questions(u)
        t, a1 = call(chatml(system, [(q1, None)]))
        ttft.append(t)
        answers[f"{u}.0"] = a1
        t, a2 = call(chatml(system, [(q1, a1), (q2, None)]))
        ttft.append(t)
        answers[f"{u}.1"] = a2

    llm.create_completion("Hello", max_tokens=2, temperature=0.0)  # warm-up
    llm.reset()
    threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    total = time.perf_counter() - t0
    return {"total_s": total, "ttft": ttft, "answers": answers, "generated_chunks": generated[0]}


# -- the parent ------------------------------------------------------------------------------


def child(args: argparse.Namespace, side: str, reuse: str) -> dict[str, Any]:
    py = args.llama_python if side == "llama" else sys.executable
    cmd = [py, __file__, "--child", side, "--reuse", reuse, "--model", args.model]
    cmd += ["--threads", str(args.threads), "--users", str(args.users)]
    cmd += ["--max-tokens", str(args.max_tokens), "--system-words", str(args.system_words)]
    cmd += ["--ctx", str(args.ctx)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise RuntimeError(f"exit {p.returncode}: {shlex.join(cmd)}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--system-words", type=int, default=600, help="~1.3 tokens a word")
    ap.add_argument("--ctx", type=int, default=2048, help="tokens per sequence (both sides)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-python", default=sys.executable)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--child", choices=["kvserve", "llama"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reuse", choices=["on", "off"], default="on", help=argparse.SUPPRESS)
    add_idle_args(ap)
    args = ap.parse_args()
    system = system_prompt(args.system_words)
    if args.child is not None:
        res = run_kvserve(args, system) if args.child == "kvserve" else run_llama(args, system)
        print(json.dumps(res))
        return 0
    args.model = args.model or default_model()
    if not args.model:
        print("error: no model (--model or KVSERVE_TEST_MODEL)", file=sys.stderr)
        return 2

    configs = [("kvserve", "on"), ("kvserve", "off"), ("llama", "on"), ("llama", "off")]
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {c: [] for c in configs}
    busy: list[float] = []
    load_before = loadavg()
    for r, (side, reuse) in interleaved(args.rounds, configs):
        if args.wait_idle > 0:
            busy.append(wait_for_idle(args.wait_idle, args.wait_max))
        res = child(args, side, reuse)
        samples[(side, reuse)].append(res)
        print(
            f"round {r + 1} {side} reuse {reuse}: total {res['total_s']:.2f} s, TTFT median "
            f"{statistics.median(res['ttft']):.2f} s p90 {pct(res['ttft'], 0.9):.2f} s",
            file=sys.stderr,
        )

    def med(side: str, reuse: str, f: Any) -> float:
        return statistics.median(f(s) for s in samples[(side, reuse)])

    rows = []
    for reuse in ("on", "off"):
        row = {}
        for side in ("kvserve", "llama"):
            row[side] = (
                med(side, reuse, lambda s: s["total_s"]),
                med(side, reuse, lambda s: statistics.median(s["ttft"])),
                med(side, reuse, lambda s: pct(s["ttft"], 0.9)),
            )
        rows.append((reuse, row))
    kv_on = samples[("kvserve", "on")][-1]
    agree = {}
    for reuse in ("on", "off"):
        a, b = samples[("kvserve", reuse)][-1]["answers"], samples[("llama", reuse)][-1]["answers"]
        agree[reuse] = sum(a[k] == b.get(k) for k in a)
    n_turns = 2 * args.users
    date = utc_stamp()
    cmd = "python benches/bench_users.py " + " ".join(
        f"--{k} {v}"
        for k, v in (
            ("rounds", args.rounds), ("users", args.users), ("max-tokens", args.max_tokens),
            ("system-words", args.system_words), ("threads", args.threads),
        )
    )  # fmt: skip
    lines = [
        f"### {date}: {args.users} users, shared system prompt, two turns each",
        "",
        f"- machine: {machine_desc()}; load average before {load_before}, after {loadavg()}",
        f"- command: `{cmd} --llama-python PYTHON_WITH_LLAMA_CPP`; model "
        f"{Path(args.model).name}; {args.threads} threads both sides",
        f"- system prompt {kv_on['system_tokens']} tokens (with the ChatML frame); "
        f"{args.max_tokens} new tokens a turn at most, greedy; llama-cpp-python "
        f"{llama_version(args)} serving one call at a time behind a lock",
        f"- kvserve with reuse: {kv_on['cached_prompt_tokens']} of {kv_on['prompt_tokens']} "
        f"prompt tokens reused, {kv_on['generated_tokens']} tokens generated",
        f"- answers identical on both sides: {agree['on']}/{n_turns} turns (reuse on), "
        f"{agree['off']}/{n_turns} (reuse off)",
        "",
        "| prefix reuse | side | total s | TTFT median s | TTFT p90 s |",
        "|---|---|---:|---:|---:|",
    ]
    for reuse, row in rows:
        for side, name in (("kvserve", "kvserve Engine"), ("llama", "llama-cpp-python")):
            t, m, p = row[side]
            lines.append(f"| {reuse} | {name} | {t:.2f} | {m:.2f} | {p:.2f} |")
        t_ratio = row["llama"][0] / row["kvserve"][0]
        m_ratio = row["llama"][1] / row["kvserve"][1]
        ratio_row = f"| {reuse} | llama-cpp-python / kvserve | {t_ratio:.2f}x | {m_ratio:.2f}x | |"
        lines.append(ratio_row)
    lines += ["", "samples (total s per round):", ""]
    for (side, reuse), ss in samples.items():
        lines.append(f"- {side} reuse {reuse}: {[round(s['total_s'], 2) for s in ss]}")
    if busy:
        lines.append(f"- CPU busy before each run (%): {[round(b, 1) for b in busy]}")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write:
        append_section(REPO_ROOT / "BENCHMARKS.md", HEADING, table, "benches/bench_users.py")
    return 0


def llama_version(args: argparse.Namespace) -> str:
    code = "import llama_cpp; print(llama_cpp.__version__)"
    p = subprocess.run([args.llama_python, "-c", code], capture_output=True, text=True)
    return p.stdout.strip() or "unknown"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
