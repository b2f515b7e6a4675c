#!/usr/bin/env bash
# GPU check on a machine with an NVIDIA GPU, PyTorch and no Rust toolchain: runs binaries built
# elsewhere and produces BENCHMARKS.md's whole "GPU" table in one call. Build them here with
# CUDA (NVRTC kernels) and Vulkan:
#
#   bash scripts/install_llvm.sh      # once: the LLVM cubecl-cuda links, from PyPI
#   cargo build --release --features cuda,vulkan --bin hearth --test parity --bench models
#   mkdir -p .gpu && cp target/release/hearth .gpu/ \
#     && cp "$(ls -t target/release/deps/parity-* | grep -v '\.d$' | head -1)" .gpu/parity \
#     && cp "$(ls -t target/release/deps/models-* | grep -v '\.d$' | head -1)" .gpu/models
#   strip .gpu/* && xz -T2 .gpu/*     # this script unpacks .gpu/*.xz first
#   bash scripts/gpu_check.sh [.gpu] [OUT_DIR]
#
# With CUDA each binary links LLVM: about 220 MB stripped, 53 MB xz-compressed, so the three do
# not fit the device tool's 64 MiB carry together. Carry one per call and name its step group:
# HEARTH_GPU_ONLY=parity (parity), =bench (models; hearth too if it fits, for the autotune
# table), =train (hearth).
#
# To compare cubecl's two CUDA kernel compilers, build a second `hearth` and `models` with
# `--features cuda-ptx,vulkan` (LLVM's PTX back end instead of NVRTC) into another folder and run
# the bench step on each.
#
# Kernels: by default Hearth's convolutions and linear layers take the kernels chosen by rule
# (`hearth_kernels::select`, no autotune); HEARTH_GPU_AUTOTUNE=full runs every step under
# `--autotune full` instead (Burn's autotune), to compare the two on the same GPU.
#
# Steps (each bounded by HEARTH_STEP_TIMEOUT s, default 600; a failed step is reported and the
# script goes on; the exit status says whether any failed):
#   first  0. time to the first training step on a GPU this machine has not tuned: `hearth bench
#             model --model resnet50 --mode train --batch-size 32 --steps 3 --warmup 1` from the
#             process's start to its end, kernels by rule (and, with HEARTH_GPU_FIRST_FULL=1,
#             under --autotune full with an empty cache);
#   parity 1. torchvision parity on each device of HEARTH_GPU_DEVICES (default "cuda wgpu
#             vulkan"; f32 1e-4, CUDA within the TF32 bound);
#   bench  2. the models bench on each device: ResNet-50, DenseNet-121 and VGG-16 at 224,
#             inference batch 1 and 32, training batch 32 and 64, against PyTorch eager on the
#             same GPU in the same run (also channels_last), median and best step, share of the
#             GPU's TF32 peak; autotune's decisions go to OUT/autotune-DEVICE.jsonl and their
#             table to OUT/autotune-DEVICE.md;
#   mixed  3. mixed precision (issue 28): ResNet-50 training at batch 32 and 64 in bf16 and fp16
#             on each device, against PyTorch autocast (fp16 with GradScaler) on the same GPU in
#             the same run, with Hearth's own speed-up over its f32 (`vs f32`); then a short
#             bf16 training run, one process;
#   train  4. a short training run on each device; `hearth train --model resnet50` on a
#             generated 224-pixel image folder, one process, then 2 data-parallel ranks sharing
#             the GPU, with images/s and the gradient exchange's share of a step.
# HEARTH_GPU_ONLY=first|parity|bench|mixed|train runs one step group (a device call is limited to 10
# minutes and 64 MiB of carried files: split the work across calls with it).
#
# Budget (measured 2026-11-26, one H200, fresh machine, CUDA): autotune's first pass is most of
# the time. ResNet-50 inference at batch 1 and 32 took about 7 minutes of tuning, and training
# at batch 32 was still tuning 2.5 minutes later (a second session gave training at batch 32
# alone 13 minutes, 136 decisions, and it was still tuning); parity on CUDA reached 4 of its 6 fixtures in
# 230 s. With 15 minutes of device time per session, ask for one configuration per call
# (HEARTH_BENCH_MODELS=resnet50 HEARTH_BENCH_BATCHES=train:32 HEARTH_BENCH_ROUNDS=1), keep
# HEARTH_STEP_TIMEOUT under the call's limit so that the autotune database is saved to OUT, and
# carry that database back (OUT/cubecl-environment.tar.xz into BIN) for the next call.
# The parity test and the bench read fixtures and the peer script at the path of the checkout
# they were built in ($HEARTH_BUILD_ROOT, default /work/main): this script links it here.
set -u
BIN=$(realpath "${1:-.gpu}")
for packed in "$BIN"/*.xz; do
    [ -e "$packed" ] || continue
    xz -dkf "$packed" && chmod +x "${packed%.xz}"
done
OUT=${2:-${OUT:-/tmp/gpu-check}}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
ROOT=$(pwd)
BUILD_ROOT=${HEARTH_BUILD_ROOT:-/work/main}
if [ "$ROOT" != "$BUILD_ROOT" ] && [ ! -e "$BUILD_ROOT" ]; then
    mkdir -p "$(dirname "$BUILD_ROOT")" && ln -s "$ROOT" "$BUILD_ROOT"
fi
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$(mktemp -d)}
# cubecl-cuda loads libcuda (the driver's) and NVRTC at run time (cudarc, CUDA 13 names such as
# libnvrtc.so.13). A machine with PyTorch but no CUDA toolkit has NVRTC only in the pip wheels
# (site-packages/nvidia/*/lib): put those folders on the library path.
NV_LIBS=$(python3 - 2>/dev/null <<'PY'
import glob, os, site
dirs = set()
for sp in site.getsitepackages() + [site.getusersitepackages()]:
    for lib in glob.glob(os.path.join(sp, "nvidia", "**", "lib"), recursive=True):
        if glob.glob(os.path.join(lib, "libnvrtc*")):
            dirs.add(lib)
print(":".join(sorted(dirs)))
PY
)
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libnvrtc.so" ] || ls "$d"/libnvrtc.so.* >/dev/null 2>&1 && NV_LIBS="${NV_LIBS:+$NV_LIBS:}$d"
done
[ -n "$NV_LIBS" ] && export LD_LIBRARY_PATH="$NV_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
STEPS=${HEARTH_GPU_BENCH_STEPS:-20}
WARMUP=${HEARTH_BENCH_WARMUP:-3}
DEVICES=${HEARTH_GPU_DEVICES:-cuda wgpu vulkan}
FIRST=${DEVICES%% *}
ONLY=${HEARTH_GPU_ONLY:-all}
export HEARTH_AUTOTUNE=${HEARTH_GPU_AUTOTUNE:-off}
status=0
# Autotune's decisions persist in cubecl's environment database, TARGET/environment of the
# outermost Cargo.toml above the working directory (here: this checkout's target/). On a fresh
# machine every shape is tuned first, each candidate kernel compiled by NVRTC: on an H200 that
# took about 7 minutes for ResNet-50 inference at batch 1 and 32, and training at batch 32 had
# not finished its tuning 2.5 minutes later (BENCHMARKS.md). The database is saved to
# OUT/cubecl-environment.tar.xz at the end; carried back beside the binaries (in the BIN
# folder), it is restored first and spares the next call the tuning already done.
# Outside a Cargo project cubecl keeps the same database in ~/.cache/cubecl ($XDG_CACHE_HOME):
# both places are saved and restored.
CUBECL_USER_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}
if [ -f "$BIN/cubecl-environment.tar.xz" ]; then
    unpacked=$(mktemp -d)
    if tar -xJf "$BIN/cubecl-environment.tar.xz" -C "$unpacked"; then
        if [ -d "$unpacked/environment" ]; then
            mkdir -p "$ROOT/target" && rm -rf "$ROOT/target/environment" \
                && mv "$unpacked/environment" "$ROOT/target/environment"
        fi
        if [ -d "$unpacked/cubecl" ]; then
            mkdir -p "$CUBECL_USER_CACHE" && rm -rf "$CUBECL_USER_CACHE/cubecl" \
                && mv "$unpacked/cubecl" "$CUBECL_USER_CACHE/cubecl"
        fi
        echo "autotune: restored $(du -sh "$unpacked" | cut -f1) of earlier decisions and kernels"
    fi
    rm -rf "$unpacked"
fi
save_autotune() {
    local parts=()
    [ -d "$ROOT/target/environment" ] && parts+=(-C "$ROOT/target" environment)
    [ -d "$CUBECL_USER_CACHE/cubecl" ] && parts+=(-C "$CUBECL_USER_CACHE" cubecl)
    [ ${#parts[@]} -gt 0 ] || return 0
    tar -cJf "$OUT/cubecl-environment.tar.xz" "${parts[@]}" \
        && echo "autotune: decisions and compiled kernels saved to $OUT/cubecl-environment.tar.xz"
}
step() { echo; echo "=== $* ($(date +%T))"; }
run() {
    # Runs a step (at most $HEARTH_STEP_TIMEOUT s), records its exit status, and carries on.
    timeout "${HEARTH_STEP_TIMEOUT:-600}" "$@"
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAILED (exit $rc): $*"
        status=1
    fi
}
wants() { [ "$ONLY" = all ] || [ "$ONLY" = "$1" ]; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
ldconfig -p | grep -q libvulkan || echo "no libvulkan: Vulkan/wgpu steps will fail"
python3 -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' 2>&1
echo "NVRTC: $( (ldconfig -p | grep -o 'libnvrtc\.so[.0-9]*' | head -1; for d in ${NV_LIBS//:/ }; do ls "$d" | grep '^libnvrtc\.so'; done) | tr '\n' ' ')(library path: ${NV_LIBS:-system only})"
[ -x "$BIN/hearth" ] && "$BIN/hearth" devices 2>&1

if wants first; then
    modes=off
    [ "${HEARTH_GPU_FIRST_FULL:-0}" = 1 ] && modes="off full"
    for mode in $modes; do
        step "time to the first ResNet-50 training steps on $FIRST, --autotune $mode"
        started=$(date +%s.%N)
        run "$BIN/hearth" --device "$FIRST" --autotune "$mode" bench model --model resnet50 \
            --mode train --batch-size 32 --steps 3 --warmup 1
        echo "first steps, --autotune $mode: $(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s from the process's start (device start, kernel compilation, 1 warm-up and 3 timed steps)"
    done
fi

if wants parity; then
    step "torchvision parity on $DEVICES"
    run env HEARTH_REQUIRE_GPU=1 HEARTH_PARITY_DEVICES="${DEVICES// /,}" \
        "$BIN/parity" --exact torchvision_parity_on_named_devices --nocapture
fi

if wants bench; then
    for d in $DEVICES; do
        step "models against PyTorch on $d (autotune log: $OUT/autotune-$d.jsonl)"
        rm -f "$OUT/autotune-$d.jsonl"
        run env HEARTH_DEVICE="$d" HEARTH_TORCH_PYTHON=${HEARTH_TORCH_PYTHON:-python3} \
            HEARTH_BENCH_MODELS=${HEARTH_BENCH_MODELS:-resnet50,densenet121,vgg16} \
            HEARTH_BENCH_STEPS="$STEPS" HEARTH_BENCH_WARMUP="$WARMUP" \
            HEARTH_AUTOTUNE_LOG="$OUT/autotune-$d.jsonl" \
            "$BIN/models" --bench
        if [ -s "$OUT/autotune-$d.jsonl" ] && [ -x "$BIN/hearth" ]; then
            "$BIN/hearth" autotune-report "$OUT/autotune-$d.jsonl" > "$OUT/autotune-$d.md" 2>&1
            head -c 4000 "$OUT/autotune-$d.md"
        fi
    done
fi

if wants mixed; then
    for d in $DEVICES; do
        for p in bf16 fp16; do
            step "ResNet-50 training in $p on $d against PyTorch autocast"
            run env HEARTH_DEVICE="$d" HEARTH_TORCH_PYTHON=${HEARTH_TORCH_PYTHON:-python3} \
                HEARTH_BENCH_MODELS=resnet50 HEARTH_BENCH_BATCHES=train:32,train:64 \
                HEARTH_BENCH_STEPS="$STEPS" HEARTH_BENCH_WARMUP="$WARMUP" \
                "$BIN/models" --bench --precision "$p"
        done
    done
    step "hearth train --precision bf16 on $FIRST, one process"
    run "$BIN/hearth" --device "$FIRST" train --precision bf16 --epochs 3 \
        --run-dir "$OUT/run-bf16-$FIRST"
fi

if wants train; then
    for d in $DEVICES; do
        step "training run on $d"
        run "$BIN/hearth" --device "$d" train --epochs 3 --run-dir "$OUT/run-$d"
    done
    DATA=$OUT/data224
    if [ ! -d "$DATA" ]; then
        step "generating a 224-pixel image folder"
        run "$BIN/hearth" data synth --out "$DATA" --classes 10 --per-class 100 --size 224
    fi
    step "hearth train --model resnet50 on $FIRST, one process"
    run "$BIN/hearth" --device "$FIRST" train --data "$DATA" --model resnet50 --size 224 \
        --batch-size 32 --epochs 2 --run-dir "$OUT/train-resnet50-$FIRST"
    step "2 data-parallel ranks sharing $FIRST:0, ResNet-50 (global batch 64)"
    run "$BIN/hearth" --device "$FIRST:0" train --nproc 2 --data "$DATA" --model resnet50 \
        --size 224 --batch-size 64 --epochs 2 --run-dir "$OUT/train-resnet50-ddp-$FIRST"
    for r in "$OUT/train-resnet50-$FIRST" "$OUT/train-resnet50-ddp-$FIRST"; do
        [ -f "$r/metrics.csv" ] && { echo "$r/metrics.csv:"; cat "$r/metrics.csv"; }
    done
fi
save_autotune
exit $status
