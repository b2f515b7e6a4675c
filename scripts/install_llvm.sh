#!/usr/bin/env bash
# Installs the LLVM that `--features cuda` needs, from PyPI alone, where cubecl-llvm's build
# script looks for it. Run once per machine (idempotent: a second run checks and returns):
#
#   bash scripts/install_llvm.sh && cargo build --release --features cuda
#
# Why: cubecl-cuda 0.11.3 always compiles cubecl-llvm, whose build dependency
# tracel-llvm-bundler 23.1.0-4 downloads an LLVM 23 archive from GitHub unless
# `$XDG_DATA_HOME/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed` exists (XDG_DATA_HOME
# defaults to ~/.local/share); it then runs `bin/llvm-config --link-static ...` in that folder for
# include paths, C++ flags and the static libraries. Debian has LLVM 22 at most. PyPI's
# `mlc-llvm-static` (23.1.1.post0) is LLVM 23.1 as static libraries with an `llvm-config` that
# answers those queries, and `mlc-llvm-static-extra-targets` adds the NVPTX (and AMDGPU) back
# ends to the same tree. A linking build (not `cargo check`) also needs zlib and zstd, as llvm-config
# --system-libs says; this script installs them with apt-get where it can.
#
# Environment: HEARTH_LLVM_WHEELS=DIR uses wheels already downloaded there (offline);
# HEARTH_LLVM_NO_APT=1 skips the apt-get step.
set -euo pipefail

VERSION=23.1.1
WHEEL_VERSION=23.1.1.post0
BUNDLE=tracel-llvm-23.1.0-4
DATA=${XDG_DATA_HOME:-$HOME/.local/share}
DEST=$DATA/tracel/$BUNDLE
MARK=$DEST/.tracel-llvm-installed
# Which wheels the tree came from (23.1.1 itself was yanked on PyPI in favour of .post0).
WHEEL_MARK=$DEST/.hearth-wheel-version
PY=${PYTHON:-python3}

say() { echo "install_llvm: $*"; }

llvm_ok() {
    [ -f "$MARK" ] && [ -x "$DEST/bin/llvm-config" ] \
        && [ "$(cat "$WHEEL_MARK" 2>/dev/null)" = "$WHEEL_VERSION" ] \
        && [ "$("$DEST/bin/llvm-config" --version 2>/dev/null)" = "$VERSION" ] \
        && "$DEST/bin/llvm-config" --targets-built 2>/dev/null | grep -qw NVPTX
}

system_libs() {
    [ "${HEARTH_LLVM_NO_APT:-0}" = 1 ] && return 0
    if ! command -v apt-get >/dev/null 2>&1; then
        say "no apt-get: install zlib and zstd development libraries yourself for a linking build"
        return 0
    fi
    if dpkg -s zlib1g-dev >/dev/null 2>&1 && dpkg -s libzstd-dev >/dev/null 2>&1; then
        return 0
    fi
    say "installing zlib1g-dev and libzstd-dev (LLVM's system libraries)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends zlib1g-dev libzstd-dev >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends zlib1g-dev libzstd-dev >/dev/null; } \
        || say "warning: could not install zlib1g-dev/libzstd-dev; cargo check still works, a link will not"
}

if llvm_ok; then
    say "LLVM $VERSION ($WHEEL_VERSION wheels) with NVPTX already in $DEST"
    system_libs
    exit 0
fi

if ! command -v "$PY" >/dev/null 2>&1; then
    say "error: $PY not found (llvm-config from the wheel is a Python script, and pip fetches it)"
    exit 1
fi

WHEELS=${HEARTH_LLVM_WHEELS:-}
if [ -z "$WHEELS" ]; then
    WHEELS=$(mktemp -d)
    trap 'rm -rf "$WHEELS"' EXIT
    say "downloading mlc-llvm-static $WHEEL_VERSION (+ extra targets, about 90 MB) from PyPI"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
        -d "$WHEELS" "mlc-llvm-static==$WHEEL_VERSION" "mlc-llvm-static-extra-targets==$WHEEL_VERSION"
fi

# Unpack both wheels' `static/` trees into a fresh folder beside the destination, then move it
# into place, so an interrupted run never leaves a half-installed LLVM behind a marker.
mkdir -p "$DATA/tracel"
STAGE=$(mktemp -d "$DATA/tracel/.$BUNDLE.XXXXXX")
chmod 755 "$STAGE"
"$PY" - "$WHEELS" "$STAGE" <<'PYEOF'
import pathlib, stat, sys, zipfile

wheels, stage = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
prefix = "mlc_llvm_static/static/"
found = sorted(wheels.glob("mlc_llvm_static*.whl"))
if len(found) < 2:
    sys.exit(f"install_llvm: expected the two mlc-llvm-static wheels in {wheels}, found {[f.name for f in found]}")
for wheel in found:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if not info.filename.startswith(prefix) or info.is_dir():
                continue
            rel = info.filename[len(prefix):]
            target = stage / rel
            if ".." in pathlib.PurePosixPath(rel).parts:
                sys.exit(f"install_llvm: refusing path {info.filename} in {wheel.name}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            mode = (info.external_attr >> 16) & 0o777
            if mode & 0o111 or rel.startswith("bin/"):
                target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
PYEOF

rm -rf "$DEST"
mv "$STAGE" "$DEST"
echo "$WHEEL_VERSION" > "$WHEEL_MARK"
touch "$MARK"
if ! llvm_ok; then
    say "error: $DEST/bin/llvm-config does not report LLVM $VERSION with NVPTX"
    "$DEST/bin/llvm-config" --version --targets-built || true
    rm -f "$MARK"
    exit 1
fi
say "LLVM $VERSION ($("$DEST/bin/llvm-config" --targets-built | wc -w) targets, NVPTX among them) in $DEST"
system_libs
