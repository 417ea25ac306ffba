"""The pytest-benchmark suite: ``pytest benches/ --benchmark-only`` (benches/README.md).

Kept out of the normal test run (pyproject's ``testpaths`` is ``tests``). Each run's results
are saved as JSON under ``.benchmarks/`` at the repository root (git-ignored; pytest-benchmark's
``--benchmark-autosave``, on by default here), so a later run can be compared with it:
``--benchmark-compare`` (the last saved run) or ``--benchmark-compare=NNNN``. Rows are sorted
by name unless ``--benchmark-sort`` is given, so a benchmark's saved and new rows sit together
in the comparison table.

Fixtures: ``model_path`` (``$KVSERVE_TEST_MODEL``, else the default model from the cache or a
download): a benchmark whose model cannot be had fails with a message saying so; nothing is
skipped.
``rounds``: how many timed rounds the slow benchmarks (``benchmark.pedantic``) run, from
``--benchmark-min-rounds`` (pytest-benchmark's default 5; ``--benchmark-min-rounds=2`` for a
quick run).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:
    from pytest_benchmark.utils import get_tag
except ImportError:  # a clear message instead of "unrecognized arguments: --benchmark-only"
    raise SystemExit(
        "benches/: the benchmark suite needs pytest-benchmark, which is not installed: "
        "pip install 'pytest-benchmark>=4' (see benches/README.md)"
    ) from None

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Defaults of this suite, applied before pytest-benchmark reads its options: save every
    run under ``<repo>/.benchmarks`` (whatever the working directory), sort rows by name."""
    args = " ".join(str(a) for a in config.invocation_params.args)
    opt = config.option
    if not getattr(opt, "benchmark_disable", False) and "--benchmark-json" not in args:
        opt.benchmark_autosave = get_tag()  # what --benchmark-autosave stores: commit_date
    if "--benchmark-storage" not in args:
        opt.benchmark_storage = f"file://{REPO_ROOT / '.benchmarks'}"
    if "--benchmark-sort" not in args:
        opt.benchmark_sort = "name"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session):  # a hook wrapper: yields once
    """A run whose benchmarks all failed saves nothing, so pytest-benchmark's "Not saving
    anything" warning (an error under the project's filterwarnings=error, raised before the
    failures are summarized) is not issued: autosave is dropped for that run."""
    bench = getattr(session.config, "_benchmarksession", None)
    if bench is not None and not bench.benchmarks:
        bench.autosave = None
    yield


@pytest.fixture(scope="session")
def model_path() -> Path:
    value = os.environ.get("KVSERVE_TEST_MODEL")
    if value:
        path = Path(value)
        if not path.is_file():
            pytest.fail(f"KVSERVE_TEST_MODEL={value} is not a file; point it at a GGUF model")
        return path
    from kvserve.models import FetchError, pull

    try:
        return pull(progress=False)
    except FetchError as e:
        pytest.fail(
            f"no model: KVSERVE_TEST_MODEL is unset and pulling the default model failed ({e});"
            " set KVSERVE_TEST_MODEL to a GGUF file"
        )


@pytest.fixture(scope="session")
def rounds(pytestconfig: pytest.Config) -> int:
    return max(1, int(pytestconfig.getoption("benchmark_min_rounds")))
