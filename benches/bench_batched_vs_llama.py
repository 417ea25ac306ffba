#!/usr/bin/env python3
"""Compare kvserve's batched prefill/decode throughput with llama.cpp's llama-batched-bench.

Runs, interleaved for ``--rounds`` rounds (the order flips each round so neither engine always
runs on a "warmer" or quieter machine):

  llama-batched-bench -m MODEL -t THREADS -c CTX -b 2048 -ub 512 -npp P -ntg N -npl B1,B2,..
      --output-format jsonl
  kvserve bench --model MODEL --threads THREADS --batch B1,B2,.. -p P -n N --json

Both serve B independent sequences together: each gets its own P-token prompt (llama-batched-bench
without ``-pps``, so prompts are not shared), then all B decode N tokens in lockstep. Per B the
script takes the median over rounds of each engine's prefill and decode tokens/s (llama.cpp's
S_PP and S_TG columns, ``speed_pp``/``speed_tg`` in its jsonl; kvserve's ``prefill_tok_s`` and
``decode_tok_s``), and prints a markdown table with the kvserve/llama.cpp ratios, date, machine,
load average, both commands and the raw samples. ``--write`` appends it to BENCHMARKS.md under
the heading "Batched decode (issue #3)", with the decode targets of issues #3 (B = 32) and #7
(B = 4 and 8, and the aim of 2x at every B) marked met or not.

llama-batched-bench is looked up in --llama-bin-dir, else $LLAMA_CPP_BIN_DIR, else the output
of ``scripts/build_llama_cpp.sh`` run with its default directory (as in bench_vs_llama.py); the
table records that build's ISA options. The kvserve command is $KVSERVE_BIN if set, else
``kvserve`` on PATH, else ``python -m kvserve``; it must print ``{"batches": [{"batch": B,
"prefill_tok_s": .., "decode_tok_s": ..}, ..]}`` (the last such JSON object on stdout is used).
The model is --model, else $KVSERVE_TEST_MODEL, else the default model (``kvserve pull``). The
recorded commands use the placeholders ``MODEL``, ``$LLAMA_CPP_BIN_DIR/`` and ``kvserve``.

Example:
  python benches/bench_batched_vs_llama.py --rounds 3 --write
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO_ROOT,
    BenchError,
    add_idle_args,
    append_section,
    default_llama_bin_dir,
    default_model,
    display_cmd,
    fmt,
    interleaved,
    kvserve_base,
    llama_build_flags,
    loadavg,
    machine_desc,
    median,
    ratio,
    run,
    scrub,
    utc_stamp,
    wait_for_idle,
)

HEADING = "## Batched decode (issue #3)"
# Decode tok/s of llama.cpp at B = 1, 4, 16, 32 quoted in issue #6, measured with a build that has
# AVX-512/VNNI (for context only; compare against the medians of the same run).
ISSUE_REFERENCE = "issue #6"
ISSUE_REFERENCE_TG = {1: 157.0, 4: 200.0, 16: 318.0, 32: 332.0}
# (B, minimum kvserve/llama.cpp decode ratio, where it was asked): issue #3 at B = 32; issue #7
# ("Speed": decode of 2-8 sequences) at B = 4 and 8. Issue #7 also aims at AIM_RATIO at every B.
TARGETS = [(32, 1.5, "issue #3"), (4, 1.5, "issue #7"), (8, 1.5, "issue #7")]
AIM_RATIO = 2.0


def parse_batches(s: str) -> list[int]:
    try:
        bs = [int(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {s!r}") from e
    if not bs or any(b < 1 for b in bs):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1: {s!r}")
    return bs


def llama_exe(args) -> Path:
    return Path(args.llama_bin_dir) / "llama-batched-bench"


def llama_cmd(args) -> list[str]:
    # No -pps: every sequence gets its own prompt (not shared), like kvserve bench --batch.
    return [
        str(llama_exe(args)), "-m", args.model, "-t", str(args.threads), "-c", str(args.ctx),
        "-b", "2048", "-ub", "512", "-npp", str(args.p), "-ntg", str(args.n),
        "-npl", ",".join(map(str, args.batch)), "--output-format", "jsonl",
    ]  # fmt: skip


def kvserve_cmd(args) -> list[str]:
    return kvserve_base() + [
        "bench", "--model", args.model, "--threads", str(args.threads),
        "--batch", ",".join(map(str, args.batch)), "-p", str(args.p), "-n", str(args.n), "--json",
    ]  # fmt: skip


def llama_commit(args) -> str:
    try:
        p = subprocess.run(
            [str(llama_exe(args)), "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    m = re.search(r"commit ([0-9a-f]+)", p.stdout + p.stderr)
    return m.group(1) if m else "?"


def parse_llama(out: str, p: int, n: int) -> dict[int, tuple[float, float]]:
    """{B: (S_PP, S_TG)} from llama-batched-bench's jsonl rows."""
    res: dict[int, tuple[float, float]] = {}
    for line in out.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
            if r.get("pp") != p or r.get("tg") != n or r.get("is_pp_shared"):
                continue
            res[int(r["pl"])] = (float(r["speed_pp"]), float(r["speed_tg"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    if not res:
        raise BenchError(f"llama-batched-bench printed no jsonl rows for pp {p}, tg {n}")
    return res


def _batches_from(d: object) -> dict[int, tuple[float, float]]:
    if not isinstance(d, dict) or not isinstance(d.get("batches"), list):
        raise ValueError("no 'batches' list")
    return {
        int(e["batch"]): (float(e["prefill_tok_s"]), float(e["decode_tok_s"])) for e in d["batches"]
    }


def parse_kvserve(out: str) -> dict[int, tuple[float, float]]:
    """{B: (prefill tok/s, decode tok/s)} from kvserve bench --batch --json."""
    for line in reversed(out.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return _batches_from(json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    try:  # a pretty-printed object over several lines
        return _batches_from(json.loads(out))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise BenchError(
            "kvserve bench did not print {'batches': [{batch, prefill_tok_s, decode_tok_s}]}"
        ) from e


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="GGUF file (default: $KVSERVE_TEST_MODEL or the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=parse_batches, default=[1, 2, 4, 8, 16, 32], help="B1,B2,..")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("-n", type=int, default=64, help="generated tokens per sequence")
    ap.add_argument("--ctx", type=int, default=8192, help="llama-batched-bench -c (total KV)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--llama-bin-dir",
        default=default_llama_bin_dir(),
        help="llama.cpp binaries (default: $LLAMA_CPP_BIN_DIR or scripts/build_llama_cpp.sh's)",
    )
    ap.add_argument("--skip-kvserve", action="store_true", help="only run llama-batched-bench")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    ap.add_argument("--write", action="store_true", help="append the table to BENCHMARKS.md")
    add_idle_args(ap)
    args = ap.parse_args()

    args.model = args.model or default_model()
    if not args.model or not os.path.exists(args.model):
        print(f"error: model not found: {args.model}", file=sys.stderr)
        return 2
    if not llama_exe(args).exists():
        print(
            f"error: no llama-batched-bench in {args.llama_bin_dir}: build it with "
            "scripts/build_llama_cpp.sh, or set LLAMA_CPP_BIN_DIR",
            file=sys.stderr,
        )
        return 2
    need = max(args.batch) * (args.p + args.n)
    if need > args.ctx:
        print(f"error: --ctx {args.ctx} < max batch x (p + n) = {need}", file=sys.stderr)
        return 2
    lcmd, kcmd = llama_cmd(args), kvserve_cmd(args)
    commit = llama_commit(args)
    load_before = loadavg()
    # samples[engine][B] = ([pp per round], [tg per round])
    samples: dict[str, dict[int, tuple[list[float], list[float]]]] = {
        eng: {b: ([], []) for b in args.batch} for eng in ("llama", "kvserve")
    }
    errors: list[str] = []
    busy: list[str] = []  # CPU busy % just before each measurement
    for r, eng in interleaved(args.rounds, ["llama", "kvserve"]):
        if eng == "kvserve" and args.skip_kvserve:
            continue
        busy.append(f"{wait_for_idle(args.wait_idle, args.wait_max):.0f}")
        print(f"round {r + 1} {eng}: CPUs {busy[-1]}% busy before", file=sys.stderr)
        try:
            if eng == "llama":
                res = parse_llama(run(lcmd, args.timeout), args.p, args.n)
            else:
                res = parse_kvserve(run(kcmd, args.timeout))
        except BenchError as e:
            errors.append(f"{eng}: {e}")
            print(f"round {r + 1} {eng}: FAILED: {e}", file=sys.stderr)
            continue
        for b in args.batch:
            if b not in res:
                errors.append(f"{eng}: round {r + 1}: no result for B = {b}")
                continue
            pp, tg = res[b]
            samples[eng][b][0].append(pp)
            samples[eng][b][1].append(tg)
            print(f"round {r + 1} {eng:8s} B {b:3d}  pp {pp:8.1f}  tg {tg:8.1f} tok/s",
                  file=sys.stderr)  # fmt: skip
    load_after = loadavg()

    def rounded(xs: list[float]) -> list[float]:
        return [round(x, 1) for x in xs]

    now = utc_stamp()
    ref = ", ".join(f"{v:.0f}" for v in ISSUE_REFERENCE_TG.values())
    ref_bs = ", ".join(map(str, ISSUE_REFERENCE_TG))
    lines = [
        f"### {now}: {os.path.basename(args.model)}, {args.threads} threads, "
        f"B x (pp{args.p} + tg{args.n})",
        "",
        f"- machine: {machine_desc()}; load average before {load_before}, after {load_after}",
        f"- medians of {args.rounds} interleaved rounds (tokens/s summed over the B sequences; "
        "prompts not shared); CPUs busy before each measurement, in run order: "
        f"{', '.join(busy)} %"
        + (f" (waited for < {args.wait_idle:.0f}%)" if args.wait_idle > 0 else ""),
        f"- llama.cpp ({commit}; {llama_build_flags(args.llama_bin_dir)}): "
        f"`{display_cmd(lcmd, args, 1)}`",
        f"- kvserve: `{display_cmd(kcmd, args, len(kvserve_base()))}`"
        + (" (skipped)" if args.skip_kvserve else ""),
        f"- {ISSUE_REFERENCE} reference (AVX-512 build): llama.cpp tg {ref} tok/s at "
        f"B = {ref_bs}; targets: kvserve tg >= "
        + ", ".join(f"{x}x llama.cpp at B = {b} ({who})" for b, x, who in TARGETS)
        + f"; issue #7 aims at {AIM_RATIO}x at every B",
        "",
        "| B | llama.cpp pp | llama.cpp tg | kvserve pp | kvserve tg | pp ratio | tg ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in args.batch:
        lp, lt = (median(x) for x in samples["llama"][b])
        kp, kt = (median(x) for x in samples["kvserve"][b])
        lines.append(
            f"| {b} | {fmt(lp)} | {fmt(lt)} | {fmt(kp)} | {fmt(kt)} | {ratio(kp, lp)} "
            f"| {ratio(kt, lt)} |"
        )
    lines.append("")
    tg_ratios: dict[int, float] = {}
    for b in args.batch:
        lt, kt = median(samples["llama"][b][1]), median(samples["kvserve"][b][1])
        if lt is not None and kt is not None and lt > 0:
            tg_ratios[b] = kt / lt
    for b, x, who in TARGETS:
        if b in tg_ratios:
            met = "met" if tg_ratios[b] >= x else "NOT met"
            lines.append(f"- target (tg >= {x}x at B = {b}, {who}): {met}")
    if tg_ratios:
        short = [str(b) for b, r in tg_ratios.items() if r < AIM_RATIO]
        aim = "reached at every B" if not short else f"not reached at B = {', '.join(short)}"
        lines += [f"- aim (tg >= {AIM_RATIO}x at every B, issue #7): {aim}", ""]
    lines.append("samples (pp / tg per round):")
    lines.append("")
    for b in args.batch:
        (lpp, ltg), (kpp, ktg) = samples["llama"][b], samples["kvserve"][b]
        lines.append(
            f"- B {b}: llama.cpp pp {rounded(lpp)} tg {rounded(ltg)}; "
            f"kvserve pp {rounded(kpp)} tg {rounded(ktg)}"
        )
    lines.append("")
    if errors:
        lines += ["errors:", ""] + [f"- {scrub(e.splitlines()[0], args)}" for e in errors] + [""]
    table = "\n".join(lines)
    print(table)
    if args.write:
        path = REPO_ROOT / "BENCHMARKS.md"
        append_section(path, HEADING, table, "python benches/bench_batched_vs_llama.py --write")
        print(f"appended to {path} under {HEADING!r}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
