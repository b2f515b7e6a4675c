#!/usr/bin/env bash
# GPU check on a machine with a GPU, PyTorch and no Rust toolchain: runs binaries built
# elsewhere (see BENCHMARKS.md, "GPU"). Build with `--features vulkan` (add `cuda` where the
# build machine can download cubecl-cuda's LLVM bundle, then set HEARTH_GPU_DEVICES to
# "cuda wgpu vulkan"):
#
#   cargo build --release --features vulkan --bin hearth --test parity --bench models
#   mkdir -p .gpu && cp target/release/hearth .gpu/ && cp target/release/deps/parity-<hash> .gpu/parity \
#     && cp target/release/deps/models-<hash> .gpu/models
#   bash scripts/gpu_check.sh [.gpu] [OUT_DIR]
#
# 1. torchvision parity (1e-4) on each device of HEARTH_GPU_DEVICES (default "wgpu vulkan");
# 2. a training run (small ResNet, synthetic data) on each of them, and 2 data-parallel ranks
#    sharing the GPU over QUIC;
# 3. ResNet-50 throughput against PyTorch (CUDA) on the same GPU (ratio printed by the bench).
# HEARTH_GPU_ONLY=check runs 1-2, =bench runs 3.
# The parity test and the bench read fixtures and the peer script at the path of the checkout
# they were built in ($HEARTH_BUILD_ROOT, default /work/main): this script links it here.
set -u
BIN=$(realpath "${1:-.gpu}")
OUT=${2:-${OUT:-/tmp/gpu-check}}
mkdir -p "$OUT"
ROOT=$(pwd)
BUILD_ROOT=${HEARTH_BUILD_ROOT:-/work/main}
if [ "$ROOT" != "$BUILD_ROOT" ] && [ ! -e "$BUILD_ROOT" ]; then
    mkdir -p "$(dirname "$BUILD_ROOT")" && ln -s "$ROOT" "$BUILD_ROOT"
fi
STEPS=${HEARTH_GPU_BENCH_STEPS:-20}
DEVICES=${HEARTH_GPU_DEVICES:-wgpu vulkan}
FIRST=${DEVICES%% *}
status=0
step() { echo; echo "=== $* ($(date +%T))"; }
run() {
    # Runs a step (at most $HEARTH_STEP_TIMEOUT s), records its exit status, and carries on.
    timeout "${HEARTH_STEP_TIMEOUT:-300}" "$@"
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAILED (exit $rc): $*"
        status=1
    fi
}

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
ldconfig -p | grep -q libvulkan || echo "no libvulkan: Vulkan/wgpu steps will fail"
"$BIN/hearth" devices 2>&1

ONLY=${HEARTH_GPU_ONLY:-all}
if [ "$ONLY" != bench ]; then
step "torchvision parity on $DEVICES"
run env HEARTH_PARITY_DEVICES="${DEVICES// /,}" \
    "$BIN/parity" --exact torchvision_parity_on_named_devices --nocapture

for d in $DEVICES; do
    step "training run on $d"
    run "$BIN/hearth" train --device "$d" --epochs 3 --run-dir "$OUT/run-$d"
done

step "2 data-parallel ranks sharing $FIRST:0"
run "$BIN/hearth" train --device "$FIRST:0" --nproc 2 --epochs 2 --run-dir "$OUT/run-ddp-$FIRST"

fi
if [ "$ONLY" != check ]; then
step "ResNet-50 against PyTorch on the GPU"
for d in $DEVICES; do
    run env HEARTH_DEVICE="$d" HEARTH_TORCH_PYTHON=${HEARTH_TORCH_PYTHON:-python3} \
        HEARTH_BENCH_MODELS=${HEARTH_BENCH_MODELS:-resnet50} HEARTH_BENCH_STEPS="$STEPS" \
        HEARTH_BENCH_WARMUP=${HEARTH_BENCH_WARMUP:-3} HEARTH_BENCH_BATCH=${HEARTH_BENCH_BATCH:-32} \
        "$BIN/models" --bench
done
fi
exit $status
