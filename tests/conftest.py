"""Shared fixtures.

``model_path``: the GGUF model for tests that run the engine: ``$KVSERVE_TEST_MODEL`` if set,
else the default model from :func:`kvserve.models.pull` (cached after the first download).
A test that asks for it fails, never skips, when no model is available.

``gemma_path``: the Gemma 3 270M Q4_K_M GGUF (``$KVSERVE_TEST_GEMMA`` or the pulled copy).

``vocab``: the test model's vocabulary read with ``gguf`` (tests/gguf_vocab.py), an oracle for
token pieces and text.

``cpu_simd_level``: the best SIMD level this CPU has, read from ``/proc/cpuinfo`` (independently
of the engine's own detection). ``simd_report``: where tests record which SIMD levels they ran
the engine at; the run's summary prints one ``simd coverage:`` line per entry.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_vocab import Vocab

_SIMD_REPORT = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def model_path() -> Path:
    env = os.environ.get("KVSERVE_TEST_MODEL")
    if env:
        path = Path(env)
        if not path.is_file():
            pytest.fail(f"KVSERVE_TEST_MODEL={env} is not a file; point it at a GGUF model")
        return path
    from kvserve.models import FetchError, pull

    try:
        return pull(progress=False)
    except FetchError as e:
        pytest.fail(
            f"no test model: KVSERVE_TEST_MODEL is unset and pulling the default model failed "
            f"({e}); set KVSERVE_TEST_MODEL to a GGUF file"
        )


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF: ``$KVSERVE_TEST_GEMMA``, else ``kvserve pull``'s cached
    copy (downloaded once). Fails, never skips, when it is not available."""
    env = os.environ.get("KVSERVE_TEST_GEMMA")
    if env:
        path = Path(env)
        if not path.is_file():
            pytest.fail(f"KVSERVE_TEST_GEMMA={env} is not a file; point it at the Gemma 3 GGUF")
        return path
    from kvserve.models import FetchError, pull

    try:
        return pull("gemma3-270m-q4_k_m", progress=False)
    except FetchError as e:
        pytest.fail(
            f"no Gemma 3 model: KVSERVE_TEST_GEMMA is unset and pulling gemma3-270m-q4_k_m "
            f"failed ({e}); set KVSERVE_TEST_GEMMA to its GGUF file"
        )


@pytest.fixture(scope="session")
def vocab(model_path: Path) -> Vocab:
    return Vocab(model_path)


def _cpuinfo_level() -> str | None:
    """The engine's level name for this CPU's features per /proc/cpuinfo (None without it)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        line = next((ln for ln in text.splitlines() if ln.startswith("Features")), "")
        return "neon" if "asimd" in line.partition(":")[2].split() else "scalar"
    if machine not in ("x86_64", "amd64"):
        return "scalar"
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    if avx512 and "avx512_vnni" in flags:
        return "avx512vnni"
    return "avx512" if avx512 else "avx2" if avx2 else "scalar"


@pytest.fixture(scope="session")
def cpu_simd_level() -> str:
    level = _cpuinfo_level()
    if level is None:  # no /proc/cpuinfo (not Linux): the engine's detection is all there is
        env = {k: v for k, v in os.environ.items() if k != "KVSERVE_SIMD"}
        code = "import kvserve._core as c; print(c.simd_level())"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        level = out.stdout.strip()
    return level


@pytest.fixture
def simd_report(request: pytest.FixtureRequest) -> dict[str, list[str]]:
    """``simd_report[what] = [levels]``: the SIMD levels a test ran the engine at."""
    report: dict[str, list[str]] = request.config.stash.setdefault(_SIMD_REPORT, {})
    return report


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    for what, levels in config.stash.get(_SIMD_REPORT, {}).items():
        terminalreporter.write_line(f"simd coverage: {what}: {', '.join(levels)}")
