#!/usr/bin/env bash
# Coverage-guided fuzzing of kvserve's input readers, bounded in time (see RELIABILITY.md).
#
#   scripts/fuzz.sh [TARGET] [SECONDS]
#
# TARGET: gguf | tokenizer | session_state | request | all (default: all, one after another);
# SECONDS: per target (default 600). One worker per target, on the stable toolchain:
#   - gguf, tokenizer, session_state: cargo-fuzz (libFuzzer through libfuzzer-sys) with
#     `--sanitizer none` (no -Z flag, so no nightly): SanitizerCoverage instrumentation only;
#     panics, hangs (-timeout) and allocations beyond -rss_limit_mb/-malloc_limit_mb are findings;
#   - request: atheris 2.3.0 (libFuzzer for Python) over the server's request parsing.
# Installs cargo-fuzz and atheris when missing. Seeds: fuzz/corpus/<target>/ (committed, read
# only); the corpus a run grows: fuzz/grown/<target>/ (kept between runs); findings:
# fuzz/artifacts/<target>/; logs: fuzz/logs/<target>.log (those three ignored by git). Models:
# KVSERVE_TEST_MODEL (SmolLM2) and KVSERVE_TEST_GEMMA (Gemma 3), else ~/.cache/kvserve/models.
# Prints per target: executions, executions per second, coverage, corpus size and findings.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGETS=(gguf tokenizer session_state request)
WHICH=${1:-all}
SECONDS_EACH=${2:-600}
MODELS=${HOME}/.cache/kvserve/models
export KVSERVE_TEST_MODEL=${KVSERVE_TEST_MODEL:-$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf}
export KVSERVE_TEST_GEMMA=${KVSERVE_TEST_GEMMA:-$MODELS/gemma-3-270m-q4_k_m.gguf}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-1}
PYTHON=${PYTHON:-python3}
# Resident memory and single allocations: anything above is a finding (unbounded allocation).
RSS_MB=2048
MALLOC_MB=1024
TIMEOUT_S=10

if [[ $WHICH == all ]]; then
    run=("${TARGETS[@]}")
else
    [[ " ${TARGETS[*]} " == *" $WHICH "* ]] || { echo "unknown target: $WHICH (${TARGETS[*]})" >&2; exit 2; }
    run=("$WHICH")
fi

mkdir -p "$ROOT/fuzz/logs"
summary=()
for t in "${run[@]}"; do
    seeds=$ROOT/fuzz/corpus/$t
    corpus=$ROOT/fuzz/grown/$t
    artifacts=$ROOT/fuzz/artifacts/$t
    log=$ROOT/fuzz/logs/$t.log
    mkdir -p "$seeds" "$corpus" "$artifacts"
    if [[ -z $(ls -A "$seeds") ]]; then
        PYTHONPATH=$ROOT/python "$PYTHON" "$ROOT/fuzz/make_seeds.py" "$t"
    fi
    before=$(ls "$artifacts" | wc -l)
    flags=(-max_total_time="$SECONDS_EACH" -rss_limit_mb=$RSS_MB -malloc_limit_mb=$MALLOC_MB
           -timeout=$TIMEOUT_S -print_final_stats=1 -artifact_prefix="$artifacts/")
    echo "== $t: ${SECONDS_EACH}s, one worker, log $log"
    if [[ $t == request ]]; then
        "$PYTHON" -c 'import atheris' 2>/dev/null || "$PYTHON" -m pip install --quiet 'atheris==2.3.0'
        (cd "$ROOT" && PYTHONPATH=$ROOT/python "$PYTHON" fuzz/python/fuzz_request.py \
            "${flags[@]}" "$corpus" "$seeds") >"$log" 2>&1 || true
    else
        command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
        (cd "$ROOT/fuzz" && cargo fuzz build --sanitizer none "$t") >>"$log.build" 2>&1
        (cd "$ROOT/fuzz" && cargo fuzz run --sanitizer none "$t" "$corpus" "$seeds" -- \
            "${flags[@]}") >"$log" 2>&1 || true
    fi
    execs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' | tail -1)
    rate=$(grep -Eo 'stat::average_exec_per_sec: *[0-9]+' "$log" | grep -Eo '[0-9]+$' | tail -1)
    cov=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9]+[a-zA-Z]*' "$log" | tail -1)
    found=$(( $(ls "$artifacts" | wc -l) - before ))
    line="$t: ${execs:-?} executions in ${SECONDS_EACH}s (${rate:-?}/s); ${cov:-no coverage line}; findings: $found"
    (( found > 0 )) && line+=" (fuzz/artifacts/$t/: $(ls -t "$artifacts" | head -"$found" | tr '\n' ' '))"
    echo "$line"
    summary+=("$line")
done
echo "== summary"
printf '%s\n' "${summary[@]}"
