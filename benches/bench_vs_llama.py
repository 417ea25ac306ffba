#!/usr/bin/env python3
"""Compare kvserve's prefill/decode throughput with llama.cpp's llama-bench, same model/threads.

Runs, interleaved for ``--rounds`` rounds (the order flips each round so neither engine always
runs on a "warmer" or quieter machine):

  llama-bench -m MODEL -t THREADS -p P -n N -r REPS -o json
  kvserve bench --model MODEL --threads THREADS -p P -n N --json

takes the median tokens/s of each engine over the rounds, and prints a markdown table (date,
machine, load average, both commands, llama.cpp ppP/tgN, kvserve ppP/tgN, ratios).
``--write`` appends the table to BENCHMARKS.md at the repository root, at the end of the section
"Prefill and decode, one sequence (issue #2)", or of the section ``--heading`` names (e.g.
"## Gemma 3 270M: prefill and decode (issue #9)" with ``--model`` the Gemma 3 GGUF).

llama-bench is looked up in --llama-bin-dir, else $LLAMA_CPP_BIN_DIR, else the output of
``scripts/build_llama_cpp.sh`` run with its default directory
(``llama-build/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin`` under the repository root).
The table records which ISA options that build was configured with (its CMakeCache.txt). The
kvserve command is $KVSERVE_BIN if set, else ``kvserve`` on PATH, else ``python -m kvserve``; it
must print a JSON object with ``prefill_tok_s`` and ``decode_tok_s`` (the last JSON object on
stdout is used). The model is --model, else $KVSERVE_TEST_MODEL, else the default model as
``kvserve pull --quiet`` finds it (in the cache, or downloaded).

The commands recorded in the table use placeholders, not this machine's paths: ``MODEL`` for the
model file (its name is in the heading), ``$LLAMA_CPP_BIN_DIR/`` for the llama.cpp binaries and
``kvserve`` for the kvserve command.

Example:
  python benches/bench_vs_llama.py --rounds 3 --write
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402, F401 (re-exported: other scripts import these from here)
    DEFAULT_LLAMA_BIN_DIR,
    ISA_OPTIONS,
    REPO_ROOT,
    BenchError,
    add_idle_args,
    append_section,
    cpu_busy,
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

# --write appends the table at the end of this section of BENCHMARKS.md.
HEADING = "## Prefill and decode, one sequence (issue #2)"


def llama_cmd(args) -> list[str]:
    exe = Path(args.llama_bin_dir) / "llama-bench"
    return [
        str(exe), "-m", args.model, "-t", str(args.threads), "-p", str(args.p),
        "-n", str(args.n), "-r", str(args.llama_reps), "-o", "json",
    ]  # fmt: skip


def kvserve_cmd(args) -> list[str]:
    return kvserve_base() + [
        "bench", "--model", args.model, "--threads", str(args.threads),
        "-p", str(args.p), "-n", str(args.n), "--json",
    ]  # fmt: skip


def parse_llama(out: str, p: int, n: int) -> tuple[float, float, str]:
    try:
        rows = json.loads(out)
    except json.JSONDecodeError as e:
        raise BenchError(f"llama-bench did not print JSON: {e}") from e
    pp = [r["avg_ts"] for r in rows if r.get("n_prompt") == p and r.get("n_gen") == 0]
    tg = [r["avg_ts"] for r in rows if r.get("n_prompt") == 0 and r.get("n_gen") == n]
    if not pp or not tg:
        raise BenchError(f"llama-bench output lacks pp{p}/tg{n} rows")
    commit = rows[0].get("build_commit", "?")
    return float(pp[0]), float(tg[0]), str(commit)


def parse_kvserve(out: str) -> tuple[float, float]:
    for line in reversed(out.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                d = json.loads(line)
                return float(d["prefill_tok_s"]), float(d["decode_tok_s"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    try:  # a pretty-printed object over several lines
        d = json.loads(out)
        return float(d["prefill_tok_s"]), float(d["decode_tok_s"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise BenchError(
            "kvserve bench did not print a JSON object with prefill_tok_s/decode_tok_s"
        ) from e


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="GGUF file (default: $KVSERVE_TEST_MODEL or the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512, help="prompt tokens (pp)")
    ap.add_argument("-n", type=int, default=128, help="generated tokens (tg)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-reps", type=int, default=3, help="llama-bench -r per round")
    ap.add_argument(
        "--llama-bin-dir",
        default=default_llama_bin_dir(),
        help="llama.cpp binaries (default: $LLAMA_CPP_BIN_DIR or scripts/build_llama_cpp.sh's)",
    )
    ap.add_argument("--skip-kvserve", action="store_true", help="only run llama-bench")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per command")
    ap.add_argument("--write", action="store_true", help="append the table to BENCHMARKS.md")
    ap.add_argument(
        "--heading",
        default=HEADING,
        help=f"BENCHMARKS.md section --write appends to (default: {HEADING!r}; made if absent)",
    )
    add_idle_args(ap)
    args = ap.parse_args()

    args.model = args.model or default_model()
    if not args.model or not os.path.exists(args.model):
        print(f"error: model not found: {args.model}", file=sys.stderr)
        return 2
    if not (Path(args.llama_bin_dir) / "llama-bench").exists():
        print(
            f"error: no llama-bench in {args.llama_bin_dir}: build it with "
            "scripts/build_llama_cpp.sh, or set LLAMA_CPP_BIN_DIR",
            file=sys.stderr,
        )
        return 2
    lcmd, kcmd = llama_cmd(args), kvserve_cmd(args)
    load_before = loadavg()
    l_pp, l_tg, k_pp, k_tg = [], [], [], []
    busy: list[str] = []  # CPU busy % just before each measurement
    commit = "?"
    errors: list[str] = []
    for r, eng in interleaved(args.rounds, ["llama", "kvserve"]):
        if eng == "kvserve" and args.skip_kvserve:
            continue
        b = wait_for_idle(args.wait_idle, args.wait_max)
        busy.append(f"{b:.0f}")
        try:
            if eng == "llama":
                pp, tg, commit = parse_llama(run(lcmd, args.timeout), args.p, args.n)
                l_pp.append(pp)
                l_tg.append(tg)
            else:
                pp, tg = parse_kvserve(run(kcmd, args.timeout))
                k_pp.append(pp)
                k_tg.append(tg)
            print(f"round {r + 1} {eng:8s} pp{args.p} {pp:8.1f}  tg{args.n} {tg:7.1f} tok/s"
                  f"  (CPUs {b:.0f}% busy before)", file=sys.stderr)  # fmt: skip
        except BenchError as e:
            errors.append(f"{eng}: {e}")
            print(f"round {r + 1} {eng}: FAILED: {e}", file=sys.stderr)
    load_after = loadavg()

    lp, lt, kp, kt = median(l_pp), median(l_tg), median(k_pp), median(k_tg)
    now = utc_stamp()
    p, n = args.p, args.n
    lines = [
        f"### {now}: {os.path.basename(args.model)}, {args.threads} threads",
        "",
        f"- machine: {machine_desc()}; load average before {load_before}, after {load_after}",
        f"- medians of {args.rounds} interleaved rounds (tokens/s); CPUs busy before each "
        f"measurement, in run order: {', '.join(busy)} %"
        + (f" (waited for < {args.wait_idle:.0f}%)" if args.wait_idle > 0 else ""),
        f"- llama.cpp ({commit}; {llama_build_flags(args.llama_bin_dir)}): "
        f"`{display_cmd(lcmd, args, 1)}`",
        f"- kvserve: `{display_cmd(kcmd, args, len(kvserve_base()))}`"
        + (" (skipped)" if args.skip_kvserve else ""),
        "",
        f"| engine | pp{p} tok/s | tg{n} tok/s |",
        "|---|---:|---:|",
        f"| llama.cpp {commit} | {fmt(lp)} | {fmt(lt)} |",
        f"| kvserve | {fmt(kp)} | {fmt(kt)} |",
        f"| kvserve / llama.cpp | {ratio(kp, lp)} | {ratio(kt, lt)} |",
        "",
        f"samples: llama.cpp pp {[round(x, 1) for x in l_pp]} tg {[round(x, 1) for x in l_tg]}; "
        f"kvserve pp {[round(x, 1) for x in k_pp]} tg {[round(x, 1) for x in k_tg]}",
        "",
    ]
    if errors:
        lines += ["errors:", ""] + [f"- {scrub(e.splitlines()[0], args)}" for e in errors] + [""]
    table = "\n".join(lines)
    print(table)
    if args.write:
        path = REPO_ROOT / "BENCHMARKS.md"
        append_section(path, args.heading, table, "python benches/bench_vs_llama.py --write")
        print(f"appended to {path} under {args.heading!r}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
