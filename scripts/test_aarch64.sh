#!/usr/bin/env bash
# Cross-builds kvserve-core for aarch64 Linux and runs its tests under qemu-user: the NEON
# kernels against their scalar twins, bit for bit (quant::neon::tests, the quant matmul tests at
# the neon level, simd::tests), on an x86-64 machine without an ARM one.
#
#   scripts/test_aarch64.sh                  # the quant and SIMD tests (~15 s under qemu)
#   scripts/test_aarch64.sh --install        # first apt-get install the packages below
#   scripts/test_aarch64.sh model::tests     # other cargo test filters instead (any number)
#   scripts/test_aarch64.sh --all            # the whole kvserve-core unit test suite
#
# Needs (Debian/Ubuntu package names; --install runs `apt-get install -y` for them, with sudo
# when not root):
#   gcc-aarch64-linux-gnu        the linker (aarch64-linux-gnu-gcc)
#   libc6-dev-arm64-cross        the aarch64 glibc to link against and run with
#   qemu-user                    qemu-aarch64, which runs the test binary
# and the Rust target (`rustup target add aarch64-unknown-linux-gnu`, done here when missing).
# A missing tool is an error naming the package; nothing is skipped silently.
#
# The real-model tests (model::tests, tokenizer::tests) read KVSERVE_TEST_MODEL and
# KVSERVE_TEST_GEMMA like scripts/test.sh; under qemu they are slow (minutes), so the default
# run leaves them out. Timings under qemu say nothing about NEON speed: measure on ARM hardware.
#
# Cargo builds into target/ (CARGO_TARGET_DIR to change it); the linker and runner are passed
# through the environment (CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_{LINKER,RUNNER}), nothing is
# written to a cargo config.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TARGET=aarch64-unknown-linux-gnu
SYSROOT=/usr/aarch64-linux-gnu
filters=()
install=0
all=0
for arg in "$@"; do
    case "$arg" in
        --install) install=1 ;;
        --all) all=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        -*)
            echo "test_aarch64.sh: unknown option $arg (see --help)" >&2
            exit 2
            ;;
        *) filters+=("$arg") ;;
    esac
done

die() {
    echo "test_aarch64.sh: $*" >&2
    exit 1
}

if [ "$install" = 1 ]; then
    sudo_=""
    if [ "$(id -u)" != 0 ]; then sudo_="sudo"; fi # a CI runner's user, not root
    $sudo_ apt-get update -qq
    $sudo_ apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
fi
command -v aarch64-linux-gnu-gcc >/dev/null ||
    die "aarch64-linux-gnu-gcc not found: apt-get install gcc-aarch64-linux-gnu (or pass --install)"
[ -e "$SYSROOT/lib/ld-linux-aarch64.so.1" ] ||
    die "no aarch64 glibc in $SYSROOT: apt-get install libc6-dev-arm64-cross (or pass --install)"
command -v qemu-aarch64 >/dev/null ||
    die "qemu-aarch64 not found: apt-get install qemu-user (or pass --install)"
if ! rustup target list --installed 2>/dev/null | grep -qx "$TARGET"; then
    rustup target add "$TARGET" || die "the Rust target $TARGET is missing and could not be added"
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L $SYSROOT"

if [ "$all" = 1 ]; then
    filters=()
elif [ "${#filters[@]}" = 0 ]; then
    filters=(quant:: simd)
fi
echo "test_aarch64.sh: cargo test --release -p kvserve-core --target $TARGET --lib ${filters[*]:-(all)}"
cargo test --release -p kvserve-core --target "$TARGET" --lib -- "${filters[@]}"
