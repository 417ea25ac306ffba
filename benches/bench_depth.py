#!/usr/bin/env python3
"""Decode at every context depth against llama.cpp, with a roofline (issue #24).

For each model, batch size B and depth D, in ``--rounds`` interleaved rounds (the engine order
flips each round), decode N tokens per sequence after D tokens of context:

  B = 1: llama-bench -m MODEL -t T -p 0 -n N -d D -r 1 -o json
         kvserve bench --model MODEL --threads T -p 0 -n N -d D -r 1 --json
  B > 1: llama-batched-bench -m MODEL -t T -c CTX -b 2048 -ub 512 -npp D -ntg N -npl B
             --output-format jsonl
         kvserve bench --model MODEL --threads T --batch B -p D -n N --json

(with B > 1 the depth is each sequence's prompt; D = 0 runs as a 1-token prompt there). The
table gives the median tok/s of each engine, the median of the per-round ratios (this host's
speed drifts between minutes: a ratio within one round cancels most of it), and the roofline:

* bytes a decode step must read: every weight once (the token embeddings only when they are the
  output head too; one row otherwise) plus, per sequence, its K/V at the step's depth (each
  layer group's bytes per cell from ``kvserve bench``'s ``kv_groups``; a window group reads at
  most its window), at the average depth of the timed steps (D + N/2);
* the host's read bandwidth with T threads over a buffer of the weights' size
  (``cargo bench -p kvserve-core --bench bandwidth``, rust/core/benches/bandwidth.rs; its best
  pass, so the ceiling is an upper bound), hence the ceiling B * bandwidth / bytes in tok/s,
  and the fraction of it each engine reaches.

Models: ``--model`` (repeatable), else $KVSERVE_TEST_MODEL and $KVSERVE_TEST_GEMMA when set,
else the default model. llama.cpp binaries as in bench_vs_llama.py. ``--write`` appends the
tables to BENCHMARKS.md under "## Decode at depth, with a roofline (issue #24)".

Example:
  python benches/bench_depth.py --rounds 2 --write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO_ROOT,
    BenchError,
    append_section,
    default_llama_bin_dir,
    default_model,
    kvserve_base,
    llama_build_flags,
    loadavg,
    machine_desc,
    median,
    run,
    utc_stamp,
)
from bench_batched_vs_llama import parse_kvserve as parse_kvserve_batched  # noqa: E402
from bench_batched_vs_llama import parse_llama as parse_llama_batched  # noqa: E402

HEADING = "## Decode at depth, with a roofline (issue #24)"


def weight_bytes(model: str) -> tuple[int, int]:
    """(bytes a decode step reads of the weights, the file's tensor bytes)."""
    from gguf import GGUFReader

    r = GGUFReader(model)
    names = {t.name for t in r.tensors}
    total = sum(int(t.n_bytes) for t in r.tensors)
    embd = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
    read = total
    if embd is not None and "output.weight" in names:
        # Only the tokens' rows of the embeddings are read: one row per token.
        read -= int(embd.n_bytes) - int(embd.n_bytes) // int(embd.shape[-1])
    return read, total


def bandwidth(threads: int, nbytes: int) -> tuple[float, float]:
    """(best, median) GB/s of `threads` threads reading a buffer of `nbytes` bytes."""
    cmd = [
        "cargo", "bench", "-q", "-p", "kvserve-core", "--bench", "bandwidth", "--",
        "--threads", str(threads), "--json", str(nbytes),
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    d = json.loads(out.strip().splitlines()[-1])
    return float(d["gb_s"]), float(d["median_gb_s"])


def kv_bytes_per_seq(groups: list[dict], depth: float) -> float:
    """K/V bytes one sequence's decode step reads at `depth` cells."""
    total = 0.0
    for g in groups:
        cells = depth if g.get("window") is None else min(depth, float(g["window"]))
        total += g["bytes_per_block"] / g["block_size"] * cells
    return total


def llama_tg(args, model: str, b: int, d: int) -> float:
    bin_dir = Path(args.llama_bin_dir)
    if b == 1:
        cmd = [
            str(bin_dir / "llama-bench"), "-m", model, "-t", str(args.threads), "-p", "0",
            "-n", str(args.n), "-d", str(d), "-r", "1", "-o", "json",
        ]  # fmt: skip
        rows = json.loads(run(cmd, args.timeout))
        tg = [r["avg_ts"] for r in rows if r.get("n_gen") == args.n]
        if not tg:
            raise BenchError(f"llama-bench printed no tg{args.n} row")
        return float(tg[0])
    p = max(d, 1)
    cmd = [
        str(bin_dir / "llama-batched-bench"), "-m", model, "-t", str(args.threads),
        "-c", str(b * (p + args.n) + 64), "-b", "2048", "-ub", "512", "-npp", str(p),
        "-ntg", str(args.n), "-npl", str(b), "--output-format", "jsonl",
    ]  # fmt: skip
    return parse_llama_batched(run(cmd, args.timeout), p, args.n)[b][1]


def kvserve_tg(args, model: str, b: int, d: int) -> tuple[float, list[dict] | None]:
    base = kvserve_base() + ["bench", "--model", model, "--threads", str(args.threads)]
    if b == 1:
        cmd = base + ["-p", "0", "-n", str(args.n), "-d", str(d), "-r", "1", "--json"]
        out = run(cmd, args.timeout)
        obj = json.loads(out.strip().splitlines()[-1])
        return float(obj["decode_tok_s"]), obj["kv_groups"]
    cmd = base + ["--batch", str(b), "-p", str(max(d, 1)), "-n", str(args.n), "--json"]
    return parse_kvserve_batched(run(cmd, args.timeout))[b][1], None


def kv_groups(args, model: str) -> list[dict]:
    """The model's K/V layer groups (`kvserve bench`'s ``kv_groups``) from a one-token run."""
    base = kvserve_base() + ["bench", "--model", model, "--threads", str(args.threads)]
    out = run(base + ["-p", "1", "-n", "0", "-r", "1", "--json"], args.timeout)
    return json.loads(out.strip().splitlines()[-1])["kv_groups"]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", action="append", help="GGUF file (repeatable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depths", default="0,512,4096")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("-n", type=int, default=32, help="tokens decoded per sequence")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-bin-dir", default=default_llama_bin_dir())
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    ap.add_argument("--write", action="store_true", help="append the tables to BENCHMARKS.md")
    args = ap.parse_args()

    models = args.model or [
        m for m in (os.environ.get("KVSERVE_TEST_MODEL"), os.environ.get("KVSERVE_TEST_GEMMA")) if m
    ]
    models = models or [default_model() or ""]
    for m in models:
        if not os.path.exists(m):
            print(f"error: model not found: {m!r}", file=sys.stderr)
            return 2
    for exe in ("llama-bench", "llama-batched-bench"):
        if not (Path(args.llama_bin_dir) / exe).exists():
            print(f"error: no {exe} in {args.llama_bin_dir}", file=sys.stderr)
            return 2
    depths = [int(x) for x in args.depths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    load_before = loadavg()
    sections = [f"### {utc_stamp()}: decode at depth, {args.threads} threads", ""]
    failed = False
    for model in models:
        w_read, w_file = weight_bytes(model)
        bw_best, bw_median = bandwidth(args.threads, w_read)
        cases = [(b, d) for b in batches for d in depths]
        res: dict[tuple[int, int], dict[str, list[float]]] = {
            c: {"llama": [], "kvserve": [], "ratio": []} for c in cases
        }
        groups: list[dict] | None = None
        for r in range(args.rounds):
            order = ("llama", "kvserve") if r % 2 == 0 else ("kvserve", "llama")
            for b, d in cases:
                got: dict[str, float] = {}
                for eng in order:
                    try:
                        if eng == "llama":
                            got[eng] = llama_tg(args, model, b, d)
                        else:
                            got[eng], g = kvserve_tg(args, model, b, d)
                            groups = g or groups
                    except BenchError as e:
                        failed = True
                        print(f"{Path(model).name} B={b} d={d} {eng}: FAILED: {e}", file=sys.stderr)
                        continue
                    res[(b, d)][eng].append(got[eng])
                    print(
                        f"round {r + 1} {Path(model).name} B={b} d={d} {eng}: {got[eng]:.1f} tok/s",
                        file=sys.stderr,
                    )
                if len(got) == 2:
                    res[(b, d)]["ratio"].append(got["kvserve"] / got["llama"])
        if groups is None:
            # Only batched cases ran (their output has no K/V layout): one tiny run for it, so
            # that the K/V bytes at depth are counted in the ceiling.
            groups = kv_groups(args, model)
        lines = [
            f"#### {Path(model).name}",
            "",
            f"- weights read per step: {w_read / 1e6:.1f} MB (tensors in the file: "
            f"{w_file / 1e6:.1f} MB); read bandwidth, {args.threads} threads, a buffer of that "
            f"size: best {bw_best:.1f} GB/s, median {bw_median:.1f} GB/s "
            "(`cargo bench -p kvserve-core --bench bandwidth`)",
            "",
            "| B | depth | bytes/step | ceiling tok/s | llama.cpp tok/s | kvserve tok/s "
            "| kvserve / llama.cpp | kvserve of ceiling | llama.cpp of ceiling |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for b, d in cases:
            kv = kv_bytes_per_seq(groups or [], d + args.n / 2) * b
            step = w_read + kv
            ceiling = b * bw_best * 1e9 / step
            lt, kt = median(res[(b, d)]["llama"]), median(res[(b, d)]["kvserve"])
            rt = median(res[(b, d)]["ratio"])

            def pct(x: float | None, ceiling: float = ceiling) -> str:
                return "-" if x is None else f"{100 * x / ceiling:.0f}%"

            lines.append(
                f"| {b} | {d} | {step / 1e6:.1f} MB | {ceiling:.0f} | "
                f"{'-' if lt is None else f'{lt:.1f}'} | {'-' if kt is None else f'{kt:.1f}'} | "
                f"{'-' if rt is None else f'{rt:.2f}x'} | {pct(kt)} | {pct(lt)} |"
            )
        lines += [
            "",
            "samples (tok/s, per round): "
            + "; ".join(
                f"B{b} d{d}: llama.cpp {[round(x, 1) for x in res[(b, d)]['llama']]} "
                f"kvserve {[round(x, 1) for x in res[(b, d)]['kvserve']]}"
                for b, d in cases
            ),
            "",
        ]
        sections += lines
    sections[1:1] = [
        f"- machine: {machine_desc()}; load average before {load_before}, after {loadavg()}",
        f"- llama.cpp: {llama_build_flags(args.llama_bin_dir)}; {args.rounds} interleaved "
        f"rounds, {args.n} tokens decoded per sequence; ratio = median of the per-round ratios",
        "- commands: see benches/bench_depth.py (llama-bench -d for B = 1, "
        "llama-batched-bench -npp D for B > 1; kvserve bench -d / --batch -p D)",
        "",
    ]
    table = "\n".join(sections)
    print(table)
    if args.write:
        path = REPO_ROOT / "BENCHMARKS.md"
        append_section(path, HEADING, table, "python benches/bench_depth.py --write")
        print(f"appended to {path} under {HEADING!r}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
