#!/usr/bin/env python3
"""Decode speed beside a busy Python thread (issue 6: "a barrier that parks"; see BENCHMARKS.md).

A server runs decode next to an asyncio event loop that keeps a core busy now and then. This
script measures, in one process, decode tokens/s with the machine quiet and decode tokens/s
while a Python thread of the same process is busy ``--busy-ms`` of every ``--period-ms``
(default 2 of 10 ms: busy-loops, then sleeps), and reports busy/quiet. Quiet prefill (ppP) is
measured too, to check that a barrier change does not cost anything when nothing else runs.

Each round measures quiet (``_core.bench(model, P, N, reps)``: ppP and tgN) and busy
(``_core.bench(model, 0, N, reps)`` with the neighbour running); the order flips each round.
Medians over ``--rounds`` rounds; the ratio is median busy tgN / median quiet tgN, and beside
it the median over pairs of busy tgN / quiet tgN of the same pair (adjacent in time, so the
host's slow swings cancel).

``--build LABEL=DIR`` (repeatable) compares builds: DIR is a directory holding a ``kvserve``
package (e.g. a copy of an installed one) put first on PYTHONPATH; an empty DIR means the
installed ``kvserve``. Each round then runs one child process per build (the order flips each
round), so builds are interleaved and each build's quiet and busy runs share a process.

  python benches/bench_busy_neighbor.py --rounds 5
  python benches/bench_busy_neighbor.py --build before=/tmp/kvserve-before --build after= \\
      --rounds 7 --write                    # and append the table to BENCHMARKS.md
"""

from __future__ import annotations

import argparse
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

from _common import REPO_ROOT, append_section, loadavg, machine_desc, utc_stamp  # noqa: E402

SECTION = "## Decode beside a busy Python thread (issue #6)"


class BusyNeighbor:
    """A thread that, while switched on, busy-loops (holding the GIL, as Python code does) for
    ``busy_s`` of every ``period_s`` seconds and sleeps the rest. Records its busy time."""

    def __init__(self, busy_s: float, period_s: float) -> None:
        self.busy_s, self.period_s = busy_s, period_s
        self._on = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="busy-neighbor", daemon=True)
        self.busy_total = self.on_total = 0.0

    def _run(self) -> None:
        while True:
            self._on.wait()
            if self._stop:
                return
            next_start = time.perf_counter()
            while self._on.is_set() and not self._stop:
                start = time.perf_counter()
                end = start + self.busy_s
                x = 0
                while time.perf_counter() < end:
                    x += 1
                self.busy_total += time.perf_counter() - start
                next_start += self.period_s
                delay = next_start - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                else:
                    next_start = time.perf_counter()

    def __enter__(self) -> BusyNeighbor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._on.set()
        self._thread.join()

    def on(self) -> None:
        self._t_on = time.perf_counter()
        self._on.set()

    def off(self) -> None:
        self._on.clear()
        self.on_total += time.perf_counter() - self._t_on

    def duty(self) -> float:
        return self.busy_total / self.on_total if self.on_total > 0 else 0.0


def cpu_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all CPUs), from /proc/stat."""
    with open("/proc/stat", encoding="utf-8") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """Measures how many CPUs other processes kept busy during a ``with`` block: machine busy
    time minus this process's own CPU time, over wall time. The machines this runs on are
    shared; a sample taken while someone else's build ran says nothing about the barrier."""

    def __enter__(self) -> ForeignLoad:
        t = os.times()
        self.wall, self.own, self.busy = time.perf_counter(), t.user + t.system, cpu_busy_s()
        return self

    def __exit__(self, *exc: object) -> None:
        t = os.times()
        wall = time.perf_counter() - self.wall
        own = t.user + t.system - self.own
        self.cpus = max(0.0, cpu_busy_s() - self.busy - own) / wall if wall > 0 else 0.0


def measure(args: argparse.Namespace, rounds: int, first_round: int) -> dict[str, Any]:
    """Samples of the importable kvserve over ``rounds`` rounds. A round: one quiet ppP
    (``_core.bench(model, P, 0, 1)``), then ``--pairs`` pairs of decode runs
    (``_core.bench(model, 0, N, 1)``), one quiet and one beside the busy neighbour, the order
    alternating, so that slow drifts of the machine hit both sides alike."""
    from kvserve import _core

    model = _core.Model(args.model, threads=args.threads)
    out: dict[str, Any] = {
        "core": str(Path(_core.__file__).resolve()),
        "threads": model.threads,
        "pp": [],
        "quiet": [],
        "busy": [],
        "duty": [],
        "foreign": [],
        # Redone matmul tasks (`Model.redone_tasks`, absent in older builds) per decode run.
        "redo_quiet": [],
        "redo_busy": [],
    }
    redone = lambda: getattr(model, "redone_tasks", 0)  # noqa: E731
    with BusyNeighbor(args.busy_ms / 1e3, args.period_ms / 1e3) as nb:
        for r in range(first_round, first_round + rounds):
            with ForeignLoad() as fl:
                out["pp"].append(_core.bench(model, args.p, 0, 1)["prefill_tok_s"])
                for i in range(args.pairs):
                    for busy in (False, True) if (r + i) % 2 == 0 else (True, False):
                        if busy:
                            nb.on()
                        r0 = redone()
                        tg = _core.bench(model, 0, args.n, 1)["decode_tok_s"]
                        if busy:
                            nb.off()
                        out["busy" if busy else "quiet"].append(tg)
                        out["redo_busy" if busy else "redo_quiet"].append(redone() - r0)
            out["foreign"].append(fl.cpus)
        out["duty"].append(nb.duty())
    return out


def run_child(args: argparse.Namespace, path: str, round_index: int) -> dict[str, Any]:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, __file__, "--child", str(round_index)] + child_args(args)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise RuntimeError(f"exit {p.returncode}: {shlex.join(cmd)}\n{p.stderr.strip()}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def child_args(args: argparse.Namespace) -> list[str]:
    return [
        "--model", args.model, "--threads", str(args.threads), "-p", str(args.p),
        "-n", str(args.n), "--pairs", str(args.pairs), "--busy-ms", str(args.busy_ms),
        "--period-ms", str(args.period_ms),
    ]  # fmt: skip


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=os.environ.get("KVSERVE_TEST_MODEL", ""))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512, help="prompt tokens of the quiet prefill")
    ap.add_argument("-n", type=int, default=128, help="generated tokens per decode run")
    ap.add_argument("--pairs", type=int, default=6, help="quiet/busy decode pairs per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy-ms", type=float, default=2.0)
    ap.add_argument("--period-ms", type=float, default=10.0)
    ap.add_argument("--build", action="append", default=[], metavar="LABEL=DIR")
    ap.add_argument("--note", default="", help="a line to put under the heading")
    ap.add_argument(
        "--max-foreign",
        type=float,
        default=0.1,
        help="repeat a round in which other processes kept more CPUs than this busy",
    )
    ap.add_argument("--max-discards", type=int, default=20, help="rounds repeated at most")
    ap.add_argument("--settle", type=float, default=20, help="seconds to wait after a discard")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per child process")
    ap.add_argument("--write", action="store_true", help="append the table to BENCHMARKS.md")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if not args.model:
        from kvserve.models import pull

        args.model = str(pull(quiet=True))
    if not os.path.exists(args.model):
        print(f"error: model not found: {args.model}", file=sys.stderr)
        return 2
    if args.child is not None:
        print(json.dumps(measure(args, 1, args.child)))
        return 0

    # None: the kvserve this process imports, measured in-process.
    builds: list[tuple[str, str | None]] = [
        (b.split("=", 1)[0], b.split("=", 1)[1] if "=" in b else "") for b in args.build
    ] or [("kvserve", None)]
    load_before = loadavg()
    results: dict[str, dict[str, Any]] = {label: {} for label, _ in builds}
    r = discarded = 0
    while r < args.rounds:
        round_res = {}
        for label, path in builds if r % 2 == 0 else builds[::-1]:
            res = measure(args, 1, r) if path is None else run_child(args, path, r)
            round_res[label] = res
            print(
                f"round {r + 1} {label}: pp{args.p} {res['pp'][0]:.1f}  tg{args.n} quiet "
                f"{med(res['quiet']):.1f}  busy {med(res['busy']):.1f} tok/s  (other processes: "
                f"{max(res['foreign']):.2f} CPUs)",
                file=sys.stderr,
            )
        foreign = max(x for res in round_res.values() for x in res["foreign"])
        if foreign > args.max_foreign and discarded < args.max_discards:
            discarded += 1
            print(f"  discarded: other processes used {foreign:.2f} CPUs", file=sys.stderr)
            time.sleep(args.settle)
            continue
        for label, res in round_res.items():
            for k in ("pp", "quiet", "busy", "duty", "foreign", "redo_quiet", "redo_busy"):
                results[label].setdefault(k, []).extend(res.get(k, []))
        r += 1
    load_after = loadavg()

    now = utc_stamp()
    p, n = args.p, args.n
    cmd = "python benches/bench_busy_neighbor.py " + shlex.join(
        [a for b in args.build for a in ("--build", b.split("=", 1)[0] + "=DIR")]
        + ["--threads", str(args.threads), "-p", str(p), "-n", str(n), "--pairs", str(args.pairs)]
        + ["--rounds", str(args.rounds), "--busy-ms", str(args.busy_ms)]
        + ["--period-ms", str(args.period_ms), "--max-foreign", str(args.max_foreign)]
    )
    lines = [
        f"### {now}: {os.path.basename(args.model)}, {args.threads} threads, "
        f"neighbour busy {args.busy_ms:g} of every {args.period_ms:g} ms",
        "",
    ]
    if args.note:
        lines += [args.note, ""]
    lines += [
        f"- machine: {machine_desc()}; load average before {load_before}, after {load_after}",
        f"- command: `{cmd}`",
        f"- each round: a quiet `_core.bench(model, {p}, 0, 1)`, then {args.pairs} pairs of "
        f"`_core.bench(model, 0, {n}, 1)`, quiet and beside the busy thread (order"
        f" alternating each round{', builds interleaved' if len(builds) > 1 else ''}); medians"
        f" of {args.rounds} rounds; {discarded} rounds repeated because other processes kept"
        f" more than {args.max_foreign:g} CPUs busy",
        "",
        f"| build | pp{p} quiet tok/s | tg{n} quiet tok/s | tg{n} busy tok/s | busy / quiet "
        "| busy / quiet, median of pairs | redone tasks per 1k tokens, quiet / busy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def per_1k(xs: list[float]) -> str:
        # `Model.redone_tasks` is missing in builds without redoable steps.
        return f"{1000 * sum(xs) / (n * len(xs)):.1f}" if xs and any(xs) else "0"

    for label, res in results.items():
        q, b = med(res["quiet"]), med(res["busy"])
        # Each busy run sits next to a quiet one in time: the ratio within a pair cancels the
        # host's slow swings, which the ratio of the two medians does not.
        pairs = med([y / x for x, y in zip(res["quiet"], res["busy"], strict=True)])
        redo = f"{per_1k(res['redo_quiet'])} / {per_1k(res['redo_busy'])}"
        lines.append(
            f"| {label} | {med(res['pp']):.1f} | {q:.1f} | {b:.1f} | {b / q:.2f}x | "
            f"{pairs:.2f}x | {redo} |"
        )
    lines.append("")
    for label, res in results.items():
        lines.append(
            f"samples {label}: pp {[round(x, 1) for x in res['pp']]} "
            f"quiet {[round(x, 1) for x in res['quiet']]} busy {[round(x, 1) for x in res['busy']]}"
            f"; neighbour duty {med(res['duty']):.0%}; other processes "
            f"{max(res['foreign']):.2f} CPUs at most"
        )
    lines.append("")
    table = "\n".join(lines)
    print(table)
    if args.write:
        path = REPO_ROOT / "BENCHMARKS.md"
        intro = (
            "Decode tok/s beside a Python thread of the same process that is busy 2 ms of "
            "every 10 ms (a loaded event loop), over quiet decode. Appended by "
            "`python benches/bench_busy_neighbor.py --write`. Target: busy / quiet >= 0.85x."
        )
        append_section(path, SECTION, table, "python benches/bench_busy_neighbor.py", intro)
        print(f"appended to {path.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
