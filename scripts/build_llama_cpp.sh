#!/usr/bin/env bash
# Build the llama.cpp anchor that kvserve's benchmarks and fixture recordings compare against.
#
#   scripts/build_llama_cpp.sh [DIR]          # DIR: argument, else $LLAMA_DIR, else ./llama-build
#   scripts/build_llama_cpp.sh --no-binding [DIR]    # llama.cpp only, no Python binding
#   scripts/build_llama_cpp.sh --binding-only [DIR]  # only (re)install the binding (another env)
#
# What it does:
#  1. downloads the llama-cpp-python 0.3.36 sdist with pip (its vendored llama.cpp is commit
#     0c1e57098bba43ac29e6e3b677cdceebdd22334f) into DIR and unpacks it there (once);
#  2. builds that llama.cpp with cmake, Release, shared libraries, GGML_NATIVE=OFF and the x86
#     ISA options spelled out: each of SSE4.2, AVX, AVX2, FMA, F16C, BMI2, AVX-VNNI, AVX-512
#     (F/CD/VL/DQ/BW), AVX512-VBMI, AVX512-VNNI and AVX512-BF16 is ON exactly when this CPU's
#     /proc/cpuinfo lists it; AMX is always OFF (some of our machines advertise AMX, and its
#     instructions fault there). Targets: llama-bench, llama-batched-bench, llama-server,
#     llama-tokenize, llama-cli (those this tree has) and the shared libraries;
#  3. installs the llama-cpp-python binding into the Python that runs as $PYTHON (default:
#     python3 on PATH, i.e. the active virtualenv if any) WITHOUT building llama.cpp again
#     (CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"), plus its runtime dependencies; the
#     binding finds the libraries through LLAMA_CPP_LIB_PATH;
#  4. checks the result (the binding's system-info line must show every ISA turned on and no
#     AMX) and writes DIR/env.sh, which exports LLAMA_CPP_BIN_DIR and LLAMA_CPP_LIB_PATH.
#
# Needs: a C/C++ compiler, python3 with pip (cmake and ninja are installed with pip when absent).
# Environment: JOBS (parallel build jobs, default: the number of CPUs), PYTHON, LLAMA_DIR.
# Re-running is incremental: the sdist is not downloaded or unpacked again, cmake rebuilds
# only what changed.
set -euo pipefail

VERSION=0.3.36
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"

do_build=1
do_binding=1
dir=""
while [ $# -gt 0 ]; do
    case "$1" in
        --no-binding) do_binding=0 ;;
        --binding-only) do_build=0 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        -*)
            echo "build_llama_cpp.sh: unknown option $1 (see --help)" >&2
            exit 2
            ;;
        *) dir="$1" ;;
    esac
    shift
done
dir="${dir:-${LLAMA_DIR:-$REPO_ROOT/llama-build}}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

say() { echo "build_llama_cpp.sh: $*" >&2; }
die() {
    say "error: $*"
    exit 1
}

SDIST_DIR="$dir/llama_cpp_python-$VERSION"
SRC="$SDIST_DIR/vendor/llama.cpp"
BUILD="$SRC/build"
BIN="$BUILD/bin"

# ---- 1. sources ---------------------------------------------------------------------------
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    tarball="$dir/llama_cpp_python-$VERSION.tar.gz"
    if [ ! -f "$tarball" ]; then
        say "downloading the llama-cpp-python $VERSION sdist into $dir"
        # --no-binary for this package only: its build requirements come as wheels (an
        # ':all:' would build cmake itself from source just to read the sdist's metadata).
        "$PYTHON" -m pip download --disable-pip-version-check --no-deps \
            --no-binary llama-cpp-python --dest "$dir" "llama-cpp-python==$VERSION" >&2
    fi
    [ -f "$tarball" ] || die "pip did not produce $tarball"
    say "unpacking $tarball"
    tar -xzf "$tarball" -C "$dir"
    [ -f "$SRC/CMakeLists.txt" ] || die "no vendored llama.cpp at $SRC"
fi

# ---- 2. llama.cpp -------------------------------------------------------------------------
if [ "$do_build" = 1 ]; then
    [ "$(uname -m)" = x86_64 ] || die "the ISA selection here is for x86_64 (this is $(uname -m))"
    if ! command -v cmake >/dev/null 2>&1; then
        say "cmake not found; installing cmake and ninja with pip"
        "$PYTHON" -m pip install --disable-pip-version-check "cmake>=3.21" ninja >&2
        hash -r
    fi
    command -v cmake >/dev/null 2>&1 || die "cmake is still not on PATH"

    cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    has() { # has FLAG... : every flag is in /proc/cpuinfo
        local f
        for f in "$@"; do
            case "$cpu_flags" in *" $f "*) ;; *) return 1 ;; esac
        done
    }
    isa_args=()
    enabled=()
    disabled=()
    # option  /proc/cpuinfo flags it needs  (names checked against ggml/CMakeLists.txt and
    # ggml/src/ggml-cpu/CMakeLists.txt of this tree: GGML_AVX512 adds -mavx512f/cd/vl/dq/bw)
    while read -r opt flags; do
        # shellcheck disable=SC2086
        if has $flags; then
            isa_args+=("-DGGML_$opt=ON")
            enabled+=("$opt")
        else
            isa_args+=("-DGGML_$opt=OFF")
            disabled+=("$opt")
        fi
    done <<'EOF'
SSE42 sse4_2
AVX avx
AVX2 avx avx2
FMA fma
F16C f16c
BMI2 bmi2
AVX_VNNI avx_vnni
AVX512 avx512f avx512cd avx512vl avx512dq avx512bw
AVX512_VBMI avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi
AVX512_VNNI avx512f avx512cd avx512vl avx512dq avx512bw avx512_vnni
AVX512_BF16 avx512f avx512cd avx512vl avx512dq avx512bw avx512_bf16
EOF
    isa_args+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    say "ISA on (this CPU has them): ${enabled[*]:-none}"
    say "ISA off (this CPU lacks them): ${disabled[*]:-none}; AMX off always"

    generator=()
    if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
    if [ -f "$BUILD/CMakeCache.txt" ] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=${generator[1]:-Unix Makefiles}\$" "$BUILD/CMakeCache.txt"; then
        say "removing $BUILD (configured with another generator)"
        rm -rf "$BUILD"
    fi
    # No network during the build: no prebuilt web UI download, no OpenSSL (HTTPS) support.
    cmake -S "$SRC" -B "$BUILD" "${generator[@]}" \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DGGML_NATIVE=OFF "${isa_args[@]}" \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >&2

    known="$(cmake --build "$BUILD" --target help 2>/dev/null)"
    targets=()
    for t in llama-bench llama-batched-bench llama-server llama-tokenize llama-cli llama ggml ggml-base ggml-cpu; do
        if grep -Eq "(^|[[:space:]])$t(:|[[:space:]]|$)" <<<"$known"; then
            targets+=("$t")
        else
            say "target $t not in this tree; skipped"
        fi
    done
    say "building ${targets[*]} with $JOBS jobs"
    cmake --build "$BUILD" -j "$JOBS" --target "${targets[@]}" >&2
    [ -x "$BIN/llama-bench" ] || die "no $BIN/llama-bench after the build"
    [ -f "$BIN/libllama.so" ] || die "no $BIN/libllama.so after the build"
fi

# ---- 3. Python binding --------------------------------------------------------------------
if [ "$do_binding" = 1 ]; then
    [ -f "$BIN/libllama.so" ] || die "no $BIN/libllama.so: build llama.cpp first (without --binding-only)"
    say "installing the llama-cpp-python binding into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
    # The binding's own CMake would build llama.cpp again; LLAMA_BUILD=OFF keeps only the
    # Python package, which loads the libraries built above through LLAMA_CPP_LIB_PATH.
    (cd "$SDIST_DIR" && CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \
        "$PYTHON" -m pip install --disable-pip-version-check --no-deps . >&2)
    "$PYTHON" -m pip install --disable-pip-version-check \
        "typing-extensions>=4.5.0" "numpy>=1.20.0" "diskcache>=5.6.1" "jinja2>=2.11.3" >&2
fi

# ---- 4. check and env.sh ------------------------------------------------------------------
if [ -f "$BIN/libllama.so" ]; then
    cat >"$dir/env.sh" <<EOF
# Written by scripts/build_llama_cpp.sh: source it to use this llama.cpp build.
export LLAMA_CPP_BIN_DIR="$BIN"
export LLAMA_CPP_LIB_PATH="$BIN"
EOF
    if [ "$do_binding" = 1 ]; then
        info="$(LLAMA_CPP_LIB_PATH="$BIN" "$PYTHON" -c \
            'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())')" ||
            die "import llama_cpp failed with LLAMA_CPP_LIB_PATH=$BIN"
        say "system info: $info"
        if [ "$do_build" = 1 ]; then
            for opt in "${enabled[@]}"; do
                name="$opt"
                [ "$opt" = SSE42 ] && continue # not reported by ggml's system info
                grep -q "$name = 1" <<<"$info" || die "the build does not report $name = 1"
            done
        fi
        if grep -q "AMX" <<<"$info"; then die "the build reports AMX; it must be off"; fi
    fi
    say "done. To use this build:"
    echo "source $dir/env.sh    # LLAMA_CPP_BIN_DIR=$BIN, LLAMA_CPP_LIB_PATH=$BIN"
fi
