"""What the side-by-side benchmark scripts share (bench_vs_llama.py, bench_batched_vs_llama.py,
bench_users.py, bench_busy_neighbor.py, bench_kv_pool.py, ...): the machine line, load and CPU
readings of a shared machine, interleaved rounds, medians and ratios, finding the model, the
kvserve command and the llama.cpp build, running a command, and appending a table to
BENCHMARKS.md.

A script imports what it needs: ``from _common import interleaved, machine_desc, median``
(benches/ is on ``sys.path`` when a script there runs; an importing module elsewhere inserts
it first). The pytest-benchmark suite (benches/test_*.py) does not use this module.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from kvserve import Engine, GenerateResult, Model

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
# Where scripts/build_llama_cpp.sh puts the binaries when run without a directory argument.
DEFAULT_LLAMA_BIN_DIR = str(
    REPO_ROOT / "llama-build" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"
)
# The x86 ISA options of ggml that scripts/build_llama_cpp.sh sets (in its order).
ISA_OPTIONS = (
    "SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI", "AVX512", "AVX512_VBMI",
    "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16",
)  # fmt: skip


class BenchError(RuntimeError):
    pass


# -- the machine --------------------------------------------------------------------------------


def machine_desc() -> str:
    """The machine line of a table: CPU model name and ``nproc``."""
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


def utc_stamp() -> str:
    """The date and time a table heading carries: ``2026-11-30 21:05 UTC``."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


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


# -- rounds, medians, ratios ------------------------------------------------------------------


def interleaved(rounds: int, sides: Sequence[T]) -> Iterator[tuple[int, T]]:
    """``(round, side)`` for ``rounds`` rounds over ``sides``, the order reversed every other
    round, so that no side always runs first (on a warmer cache or a quieter machine)."""
    for r in range(rounds):
        for side in sides if r % 2 == 0 else list(reversed(sides)):
            yield r, side


def median(xs: Sequence[float]) -> float | None:
    """The median of ``xs``; None when there is no sample (a side that failed every round)."""
    return statistics.median(xs) if xs else None


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


# -- commands, model, llama.cpp build ---------------------------------------------------------


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


def kvserve_base() -> list[str]:
    """The kvserve command: $KVSERVE_BIN, else ``kvserve`` on PATH, else ``python -m kvserve``."""
    env = os.environ.get("KVSERVE_BIN")
    if env:
        return shlex.split(env)
    exe = shutil.which("kvserve")
    return [exe] if exe else [sys.executable, "-m", "kvserve"]


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


def default_llama_bin_dir() -> str:
    return os.environ.get("LLAMA_CPP_BIN_DIR") or DEFAULT_LLAMA_BIN_DIR


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


def this_command(script: str, model: str | None) -> str:
    """How this bench was run, for the recorded section: ``python benches/SCRIPT`` and its
    arguments, the model path as ``MODEL``."""
    words = ["MODEL" if a == model else a for a in sys.argv[1:]]
    return " ".join([f"python benches/{script}", *words])


def scrub(text: str, args) -> str:
    """``text`` with the model path and the llama.cpp bin dir replaced by placeholders."""
    return text.replace(args.model, "MODEL").replace(args.llama_bin_dir, "$LLAMA_CPP_BIN_DIR")


# -- BENCHMARKS.md ----------------------------------------------------------------------------


def append_section(
    path: Path, heading: str, table: str, command: str, intro: str | None = None
) -> None:
    """Append ``table`` at the end of the ``heading`` section of ``path``; a missing section is
    added at the end (``intro`` under the heading, else a line saying it is appended by
    ``command``), a missing file is created."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n\n"
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == heading)
    except StopIteration:
        body = text.rstrip("\n") + "\n\n" + heading + "\n\n"
        body += (intro.rstrip("\n") if intro else f"Appended by `{command}`.") + "\n\n"
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


# -- prompts, time to first token, a Redis server (the K/V tier benches) -------------------------


def tagged_ids(model: Model, tag: str, n: int) -> list[int]:
    """``n`` token ids of a text that starts with ``tag`` (so its first block is its own)."""
    words = " ".join(f"w{(i * 7919) % 5003}" for i in range(n))
    ids = model.tokenize(f"Document {tag}: {words}", add_special=True, parse_special=False)
    assert len(ids) >= n
    return ids[:n]


async def first_token(engine: Engine, ids: list[int]) -> tuple[float, GenerateResult]:
    """Seconds from the request (``max_tokens=1``) to its first and only token, and the
    result."""
    from kvserve import GenerateResult

    t0 = time.perf_counter()
    result = None
    async for item in engine.events(ids, max_tokens=1):
        if isinstance(item, GenerateResult):
            result = item
    assert result is not None
    return time.perf_counter() - t0, result


class RedisServer:
    """Debian's ``redis-server`` on a free loopback port, no persistence, LRU under
    ``maxmemory``; :meth:`stop` kills it."""

    def __init__(self, maxmemory: str = "1gb") -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server not found (Debian: apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while self.cmd("PING") != "PONG":
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit("redis-server did not answer within 10 s")
            time.sleep(0.05)
        self.url = f"redis://127.0.0.1:{self.port}"

    def cmd(self, *words: str) -> str:
        """One command (inline protocol: words without spaces); its reply line, "" if none."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
                s.sendall((" ".join(words) + "\r\n").encode())
                reply = s.recv(4096).decode(errors="replace").strip()
        except OSError:
            return ""
        return reply.lstrip("+:")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
