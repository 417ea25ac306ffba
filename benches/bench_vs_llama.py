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
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Where scripts/build_llama_cpp.sh puts the binaries when run without a directory argument.
DEFAULT_LLAMA_BIN_DIR = str(
    REPO_ROOT / "llama-build" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"
)
# --write appends the table at the end of this section of BENCHMARKS.md.
HEADING = "## Prefill and decode, one sequence (issue #2)"
# The x86 ISA options of ggml that scripts/build_llama_cpp.sh sets (in its order).
ISA_OPTIONS = (
    "SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI", "AVX512", "AVX512_VBMI",
    "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16",
)  # fmt: skip


class BenchError(RuntimeError):
    pass


def machine_desc() -> str:
    model = "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        nproc = str(os.cpu_count())
    return f"{model}, nproc {nproc}"


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_busy(seconds: float = 2.0) -> float:
    """Percent of all CPUs busy over ``seconds`` (from /proc/stat; 0 where it is missing)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        return sum(vals), idle

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 100.0 * (1.0 - (i1 - i0) / max(t1 - t0, 1))


def wait_for_idle(max_busy: float, max_wait: float) -> float:
    """With ``max_busy`` > 0, wait (up to ``max_wait`` seconds) until the other processes on
    the machine keep less than ``max_busy`` percent of the CPUs busy; return the last reading."""
    busy = cpu_busy()
    if max_busy <= 0:
        return busy
    deadline = time.monotonic() + max_wait
    while busy >= max_busy and time.monotonic() < deadline:
        time.sleep(3)
        busy = cpu_busy()
    return busy


def add_idle_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="PCT",
        help="before each measurement wait until the CPUs are less than PCT%% busy "
        "(a shared machine); 0: do not wait (default)",
    )
    ap.add_argument(
        "--wait-max", type=float, default=600, help="seconds to wait for --wait-idle at most"
    )


def run(cmd: list[str], timeout: float) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise BenchError(f"cannot run {cmd[0]}: {e}") from e
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"timed out after {timeout:.0f}s: {shlex.join(cmd)}") from e
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        raise BenchError(f"exit {p.returncode}: {shlex.join(cmd)}\n" + "\n".join(tail))
    return p.stdout


def default_llama_bin_dir() -> str:
    return os.environ.get("LLAMA_CPP_BIN_DIR") or DEFAULT_LLAMA_BIN_DIR


def default_model() -> str | None:
    """$KVSERVE_TEST_MODEL, else the default model's path from ``kvserve pull --quiet``."""
    env = os.environ.get("KVSERVE_TEST_MODEL")
    if env:
        return env
    try:
        out = run(kvserve_base() + ["pull", "--quiet"], timeout=600)
    except BenchError as e:
        print(f"cannot find the default model with kvserve pull: {e}", file=sys.stderr)
        return None
    lines = out.strip().splitlines()
    return lines[-1].strip() if lines else None


def llama_build_flags(bin_dir: str) -> str:
    """The ISA options the llama.cpp build in ``bin_dir`` was configured with (CMakeCache.txt)."""
    cache = Path(bin_dir).parent / "CMakeCache.txt"
    try:
        text = cache.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "build flags unknown (no CMakeCache.txt beside the binaries)"
    vals = dict(re.findall(r"^(GGML_[A-Z0-9_]+):BOOL=(\S+)$", text, flags=re.M))
    on = [o for o in ISA_OPTIONS if vals.get(f"GGML_{o}", "").upper() in ("ON", "TRUE", "1")]
    native = vals.get("GGML_NATIVE", "?")
    amx = "AMX on" if any(o.startswith("AMX") for o in on) else "AMX off"
    isa = ", ".join(o for o in on if not o.startswith("AMX")) or "none"
    return f"GGML_NATIVE={native}, ISA on: {isa}; {amx}"


def display_cmd(cmd: list[str], args, n_exe: int) -> str:
    """``cmd`` with this machine's paths replaced by placeholders, for the recorded table:
    the first ``n_exe`` words (the program) become ``$LLAMA_CPP_BIN_DIR/NAME`` or ``kvserve``,
    and the model path becomes ``MODEL``."""
    exe = cmd[0]
    if Path(exe).parent == Path(args.llama_bin_dir):
        head = [f"$LLAMA_CPP_BIN_DIR/{Path(exe).name}"]
    else:
        head = ["kvserve"]
    rest = ["MODEL" if w == args.model else w for w in cmd[n_exe:]]
    return " ".join(head + [shlex.quote(w) for w in rest])


def scrub(text: str, args) -> str:
    """``text`` with the model path and the llama.cpp bin dir replaced by placeholders."""
    return text.replace(args.model, "MODEL").replace(args.llama_bin_dir, "$LLAMA_CPP_BIN_DIR")


def llama_cmd(args) -> list[str]:
    exe = Path(args.llama_bin_dir) / "llama-bench"
    return [
        str(exe), "-m", args.model, "-t", str(args.threads), "-p", str(args.p),
        "-n", str(args.n), "-r", str(args.llama_reps), "-o", "json",
    ]  # fmt: skip


def kvserve_base() -> list[str]:
    env = os.environ.get("KVSERVE_BIN")
    if env:
        return shlex.split(env)
    exe = shutil.which("kvserve")
    return [exe] if exe else [sys.executable, "-m", "kvserve"]


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


def append_section(path: Path, heading: str, table: str, command: str) -> None:
    """Append ``table`` at the end of the ``heading`` section of ``path``; a missing section is
    added at the end (saying it is appended by ``command``), a missing file is created."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n\n"
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == heading)
    except StopIteration:
        body = text.rstrip("\n") + "\n\n" + heading + "\n\n"
        body += f"Appended by `{command}`.\n\n"
        path.write_text(body + table + "\n", encoding="utf-8")
        return
    end = next(
        (i for i in range(start + 1, len(lines)) if re.match(r"^#{1,2} ", lines[i])), len(lines)
    )
    before = "\n".join(lines[:end]).rstrip("\n")
    after = "\n".join(lines[end:])
    new = before + "\n\n" + table.rstrip("\n") + "\n"
    if after:
        new += "\n" + after + "\n"
    path.write_text(new, encoding="utf-8")


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


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
    for r in range(args.rounds):
        order = ["llama", "kvserve"] if r % 2 == 0 else ["kvserve", "llama"]
        for eng in order:
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

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    lp, lt, kp, kt = med(l_pp), med(l_tg), med(k_pp), med(k_tg)
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
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
