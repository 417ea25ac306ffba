#!/usr/bin/env bash
# Tests a built kvserve wheel (scripts/build_wheel.sh) as a user gets it: for each Python given,
# a fresh virtualenv with the wheel installed from the file (never built: no cargo or rustc on
# PATH), then `kvserve serve` answers a chat request, then the test suite runs against the
# installed package (not python/ of this checkout).
#
#   scripts/test_wheel.sh WHEEL [PYTHON ...]           # fast subset (what .ci/run runs)
#   scripts/test_wheel.sh --full WHEEL [PYTHON ...]    # the whole suite (release check)
#
# PYTHON: interpreters to test with (default: `python` on PATH, or $PYTHON), e.g. the oldest and
# newest the wheel supports: scripts/test_wheel.sh dist/kvserve-*.whl python3.10 python3.13.
# Models: KVSERVE_TEST_MODEL / KVSERVE_TEST_GEMMA when set, else `python -m kvserve pull` (the
# cache, or a download). The full suite needs Debian's redis-server on PATH (as scripts/test.sh).
#
# The fast subset: the binding's surface (tests/test_context.py: the zero-copy Logits buffer,
# decode, the sequence operations) and structured output (tests/test_structured.py:
# llguidance's wheel on this Python, the engine and the server): what differs between one wheel
# and another is the compiled extension and the dependencies resolved for that Python, and
# these exercise both (with the serve check) in about a minute per Python on the 2-core
# development machine, where the whole suite takes ~10.5 minutes per Python.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

full=0
args=()
for arg in "$@"; do
    case "$arg" in
        --full) full=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *) args+=("$arg") ;;
    esac
done
[ ${#args[@]} -ge 1 ] || {
    echo "usage: scripts/test_wheel.sh [--full] WHEEL [PYTHON ...] (see --help)" >&2
    exit 2
}
wheel="$(realpath "${args[0]}")"
pythons=("${args[@]:1}")
[ ${#pythons[@]} -ge 1 ] || pythons=("${PYTHON:-python}")

say() { echo "scripts/test_wheel.sh: $*" >&2; }
die() {
    say "error: $*"
    exit 1
}
[ -f "$wheel" ] || die "no wheel at $wheel"

fast_tests=(test_context.py test_structured.py)

# PATH without any directory that holds cargo or rustc: the wheel must install and run without
# a Rust toolchain.
clean_path=""
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do
    if [ -z "$d" ] || [ -e "$d/cargo" ] || [ -e "$d/rustc" ]; then continue; fi
    clean_path="${clean_path:+$clean_path:}$d"
done

work="$(mktemp -d)"
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

for py in "${pythons[@]}"; do
    py="$(command -v "$py")" || die "$py not found"
    version="$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
    venv="$work/venv-$version"
    say "Python $version ($py): fresh virtualenv $venv"
    "$py" -m venv "$venv"
    run() { env PATH="$venv/bin:$clean_path" VIRTUAL_ENV="$venv" "$@"; }
    if run sh -c 'command -v cargo || command -v rustc' >/dev/null; then
        die "cargo or rustc still on PATH"
    fi

    reqs=("pytest>=7.4" "gguf>=0.10" "openai>=1.40" "httpx>=0.27" "jsonschema>=4")
    if [ "$full" = 1 ]; then reqs+=("schemathesis>=4.1,<5" "ray[serve]>=2.40"); fi
    # --only-binary kvserve: installed from the wheel, never built from a source distribution.
    run python -m pip install --quiet --disable-pip-version-check --only-binary kvserve \
        "$wheel" "${reqs[@]}"

    # The package the tests import is the installed one.
    cd "$work"
    where="$(run env PYTHONPATH="$repo/tests" python -c \
        'import kvserve, kvserve._core; print(kvserve._core.__file__)')"
    case "$where" in
        "$venv"/*) say "kvserve._core from $where" ;;
        *) die "kvserve imported from $where, not from the virtualenv" ;;
    esac

    model="${KVSERVE_TEST_MODEL:-$(run python -m kvserve pull --quiet)}"
    say "kvserve serve -m $model"
    port="$(run python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    run kvserve serve -m "$model" --port "$port" --parallel 2 >"$work/serve.log" 2>&1 &
    server_pid=$!
    if ! run python - "$port" "$server_pid" <<'EOF'; then
import json
import os
import sys
import time
import urllib.request

port, pid = sys.argv[1], int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 120
while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    os.kill(pid, 0)  # the server is still running
    if time.monotonic() > deadline:
        sys.exit("no /health within 120 s")
    time.sleep(0.5)
body = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 24,
    "temperature": 0,
}
req = urllib.request.Request(
    base + "/v1/chat/completions",
    json.dumps(body).encode(),
    {"Content-Type": "application/json"},
)
with urllib.request.urlopen(req, timeout=60) as r:
    reply = json.load(r)
text = reply["choices"][0]["message"]["content"]
print(f"scripts/test_wheel.sh: the server answered {text!r}", file=sys.stderr)
# A 135M model's greedy answer is not reliably right: check the shape of a real reply (text
# generated by the model, its tokens counted, a finish reason) rather than its facts.
choice = reply["choices"][0]
if (
    not isinstance(text, str)
    or not text.strip()
    or reply["usage"]["completion_tokens"] < 1
    or choice["finish_reason"] not in ("stop", "length")
):
    sys.exit(f"unexpected answer: {reply}")
EOF
        cat "$work/serve.log" >&2
        die "kvserve serve failed on Python $version"
    fi
    kill "$server_pid"
    wait "$server_pid" || true
    server_pid=""

    gemma="${KVSERVE_TEST_GEMMA:-}"
    if [ "$full" = 1 ] && [ -z "$gemma" ]; then
        gemma="$(run python -m kvserve pull gemma3-270m-q4_k_m --quiet)"
    fi
    if [ "$full" = 1 ]; then
        targets=("$repo/tests")
    else
        targets=("${fast_tests[@]/#/$repo/tests/}")
    fi
    say "Python $version: pytest ${targets[*]#"$repo/"}"
    # From a temporary directory, with tests/ (the suite's helper modules) on the path and
    # importlib imports: nothing of the checkout's python/ is importable.
    rc=0
    run env PYTHONPATH="$repo/tests" KVSERVE_TEST_MODEL="$model" ${gemma:+KVSERVE_TEST_GEMMA="$gemma"} \
        python -m pytest -q -p no:cacheprovider --import-mode=importlib \
        --rootdir "$repo" -c "$repo/pyproject.toml" "${targets[@]}" || rc=$?
    [ "$rc" = 0 ] || die "pytest failed on Python $version (exit $rc)"
    say "Python $version: passed"
done
say "all passed: $(basename "$wheel") on ${#pythons[@]} Python(s)"
