#!/usr/bin/env bash
# Builds kvserve's release wheel: one abi3 wheel (every CPython >= 3.10) for manylinux2014 on
# this machine's architecture, linked with zig so that it runs on glibc 2.17 and later whatever
# this machine's glibc is; then checks it with `auditwheel show`.
#
#   scripts/build_wheel.sh                # into dist/
#   scripts/build_wheel.sh -o DIR         # into DIR
#
# Installs maturin, ziglang (zig as the linker) and auditwheel from PyPI into the current Python
# (`python` on PATH, or $PYTHON) when missing. Needs a Rust toolchain (rustup). Prints the
# wheel's path as the last line of stdout. Test it with scripts/test_wheel.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python}"
out=dist
while [ $# -gt 0 ]; do
    case "$1" in
        -o)
            out="$2"
            shift 2
            ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "scripts/build_wheel.sh: unknown argument $1 (see --help)" >&2
            exit 2
            ;;
    esac
done

say() { echo "scripts/build_wheel.sh: $*" >&2; }
die() {
    say "error: $*"
    exit 1
}

command -v cargo >/dev/null 2>&1 || die "cargo not found; install Rust with https://rustup.rs"
PYTHON="$(command -v "$PYTHON")" || die "$PYTHON not found (set PYTHON to a Python >= 3.10)"

missing=()
"$PYTHON" -m maturin --version >/dev/null 2>&1 || missing+=("maturin>=1.5,<2")
"$PYTHON" -m ziglang version >/dev/null 2>&1 || missing+=("ziglang")
"$PYTHON" -m auditwheel --version >/dev/null 2>&1 || missing+=("auditwheel")
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check "${missing[@]}"
fi

# maturin's --zig runs `zig` from PATH: a `zig` that is this Python's ziglang.
bindir="$(mktemp -d)"
trap 'rm -rf "$bindir"' EXIT
printf '#!/bin/sh\nexec "%s" -m ziglang "$@"\n' "$PYTHON" >"$bindir/zig"
chmod +x "$bindir/zig"
export PATH="$bindir:$PATH"

mkdir -p "$out"
arch="$(uname -m)"
# maturin names the wheel it built on its last line ("📦 Built wheel ... to PATH").
log="$(mktemp)"
"$PYTHON" -m maturin build --release --zig --compatibility manylinux2014 -i "$PYTHON" \
    -o "$out" 2>&1 | tee "$log" >&2
wheel="$(sed -n 's/.*Built wheel.* to \(.*\.whl\)$/\1/p' "$log" | tail -1)"
rm -f "$log"
[ -f "$wheel" ] || die "maturin built no wheel"
case "$(basename "$wheel")" in
    *-cp310-abi3-manylinux*_"$arch".whl) ;;
    *) die "$wheel is not an abi3 manylinux $arch wheel" ;;
esac

say "auditwheel show $wheel"
show="$("$PYTHON" -m auditwheel show "$wheel" 2>&1)" || die "auditwheel show failed: $show"
echo "$show" >&2
# "... is consistent with the following platform tag: "manylinux_2_17_x86_64"": the newest glibc
# the wheel needs, which manylinux2014 (glibc 2.17) must cover.
# (auditwheel wraps its lines: read them as one).
glibc_minor="$(tr '\n' ' ' <<<"$show" |
    sed -n 's/.*consistent with the following platform tag: *"manylinux_2_\([0-9]*\)_.*/\1/p')"
[ -n "$glibc_minor" ] && [ "$glibc_minor" -le 17 ] ||
    die "auditwheel does not place $wheel in manylinux2014 (glibc <= 2.17)"
say "built $wheel"
echo "$wheel"
