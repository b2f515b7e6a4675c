#!/usr/bin/env bash
# GPU check on a machine with an NVIDIA GPU, PyTorch and no Rust toolchain: runs the `hearth`
# binary built elsewhere and produces BENCHMARKS.md's GPU table (issue 54) in one call, within a
# time budget. Build it here (NVRTC kernels; CUDA 13's driver API names):
#
#   export CUDARC_CUDA_VERSION=13000 CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=true
#   cargo build --release -p hearth-cli --features cuda --bin hearth
#   mkdir -p .gpu && cp target/release/hearth .gpu/ && xz -T2 -f .gpu/hearth
#   # the torchvision parity step's test binary (it reads cli/tests/fixtures/parity from the
#   # checkout it runs in); both fit one carry: 26 + 21 MB xz-compressed
#   cargo test --release -p hearth-cli --features cuda --test parity --no-run 2>&1 \
#     | sed -n 's/.*Executable.*(\(.*\))/\1/p' | xargs -I{} cp {} .gpu/parity && xz -T2 -f .gpu/parity
#   bash scripts/gpu_check.sh [.gpu] [OUT_DIR]      # this script unpacks .gpu/*.xz first
#
# One binary does everything: `hearth bench model` times Hearth, and the PyTorch peer
# (cli/benches/peer/torch_models.py) runs beside it on the same GPU in the same call, so the
# `models` bench binary need not be carried (a CUDA binary is about 125 MB stripped, 26 MB
# xz-compressed, and a device call carries at most 64 MiB).
#
# Kernels: by default Hearth's convolutions and linear layers take the kernels chosen by rule
# (`hearth_kernels::select`, no autotune); HEARTH_GPU_AUTOTUNE=full runs every step under
# `--autotune full` (Burn's autotune) instead, to compare the two on the same GPU.
#
# Steps, in the order they run (most wanted first). HEARTH_GPU_BUDGET (seconds, default 480)
# bounds the whole script: each step gets at most what is left (less a reserve to save the
# cache), and a step that no longer fits is listed as skipped. A failed step is reported and
# the script goes on; the exit status says whether any failed.
#   first  ResNet-50 training at batch 32: the time from `hearth bench model`'s start to the end
#          of its first step on a GPU this machine has never compiled kernels for (the shipped
#          bundle off: HEARTH_SHIPPED_KERNELS=0), then again with the kernels that run compiled
#          in cubecl's cache, then on an emptied cache with the bundle Hearth ships for this
#          architecture (bundles/), each with images/s over the timed steps; the peer in NCHW
#          and channels_last, with PyTorch's own time to its first step; between the cached
#          and the shipped runs, one with HEARTH_PER_IMAGE=0 (each weight gradient in one
#          kernel instead of one product per image) to time that rule;
#   profile where ResNet-50's training step spends its GPU time: cubecl's profiler over 1 warm-up
#          and 2 steps, the top 40 kernels to OUT/profile-resnet50.md;
#   bench  DenseNet-121 and VGG-16 training at batch 32, then ResNet-50, VGG-16 and DenseNet-121
#          at batch 64, each against the peer (NCHW and channels_last);
#   train  `hearth train --model resnet50` on a generated 224-pixel folder: one process, then 2
#          data-parallel ranks sharing the GPU; time to the first step, images/s and the
#          gradient exchange's share of a step, from their logs;
#   mixed  ResNet-50 training at batch 32 in bf16 and fp16 against PyTorch autocast;
#   parity torchvision parity (needs the `parity` test binary in BIN; skipped without it).
# Then (all, or first) `hearth tune --rules-only` writes every kernel the runs compiled to
# OUT/kernels-DEVICE.bundle, for `--kernel-bundle` on other machines with this GPU.
# HEARTH_GPU_ONLY=first|profile|bench|train|mixed|parity runs one group. Every Hearth/peer pair adds a
# row to OUT/table.md; logs go to OUT/logs.tar.xz; cubecl's cache (compiled kernels, any autotune
# decisions) is saved to OUT/cubecl-environment.tar.xz and, carried back in BIN, restored first.
# HEARTH_GPU_FRESH=1 ignores a carried cache (to time a first run again).
# HEARTH_GPU_PEER_DEVICE (default cuda) is the PyTorch peer's device. To check the script itself
# on a machine without a GPU before spending GPU time on it (every group runs, on the CPU):
#   HEARTH_GPU_DEVICE=flex HEARTH_GPU_PEER_DEVICE=cpu HEARTH_GPU_BENCH_STEPS=1 \
#     HEARTH_BENCH_WARMUP=1 bash scripts/gpu_check.sh BIN OUT
#
# The peer script is read from this checkout (cli/benches/peer/torch_models.py).
set -u
BIN=$(realpath "${1:-.gpu}")
for packed in "$BIN"/*.xz; do
    [ -e "$packed" ] || continue
    case "$packed" in *.tar.xz) continue ;; esac
    xz -dkf "$packed" && chmod +x "${packed%.xz}"
done
OUT=${2:-${OUT:-/tmp/gpu-check}}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
# Logs, run folders and the generated data set live here; OUT gets a handful of files (a device
# call brings back at most 8): table.md, logs.tar.xz, profile-*.md, the cache and the bundle.
WORK=$(mktemp -d)
LOGS=$WORK/logs
mkdir -p "$LOGS"
ROOT=$(pwd)
PEER=$ROOT/cli/benches/peer/torch_models.py
HEARTH=$BIN/hearth
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
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
    ls "$d"/libnvrtc.so* >/dev/null 2>&1 && NV_LIBS="${NV_LIBS:+$NV_LIBS:}$d"
done
[ -n "$NV_LIBS" ] && export LD_LIBRARY_PATH="$NV_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
STEPS=${HEARTH_GPU_BENCH_STEPS:-10}
WARMUP=${HEARTH_BENCH_WARMUP:-2}
DEVICE=${HEARTH_GPU_DEVICE:-cuda}
PEER_DEVICE=${HEARTH_GPU_PEER_DEVICE:-cuda}
ONLY=${HEARTH_GPU_ONLY:-all}
AUTOTUNE=${HEARTH_GPU_AUTOTUNE:-off}
BUDGET=${HEARTH_GPU_BUDGET:-480}
RESERVE=25
START_US=${EPOCHREALTIME/./}
status=0
TABLE=$OUT/table.md

# Seconds since the script started, and left of the budget.
elapsed() { echo $(( (${EPOCHREALTIME/./} - START_US) / 1000000 )); }
left() { echo $(( BUDGET - $(elapsed) )); }
step() { echo; echo "=== $* ($(date +%T), $(elapsed) s into the check)"; }
# Prefixes each line with the seconds since the pipeline started (to 0.1 s).
stamp() {
    local t0=${EPOCHREALTIME/./} line
    while IFS= read -r line; do
        local us=$(( ${EPOCHREALTIME/./} - t0 ))
        printf '%4d.%01d s | %s\n' $((us / 1000000)) $(( (us / 100000) % 10 )) "$line"
    done
}
# bounded MAX CMD...: runs CMD for at most MAX seconds and never past the budget; returns 124
# on a timeout, 125 when the budget had no room for it (reported as skipped).
bounded() {
    local max=$1
    shift
    local room=$(( $(left) - RESERVE ))
    [ "$room" -lt "$max" ] && max=$room
    if [ "$max" -lt 10 ]; then
        echo "SKIPPED (out of time, $(elapsed) s of the ${BUDGET} s budget spent): $*"
        return 125
    fi
    timeout "$max" "$@"
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAILED (exit $rc$( [ $rc = 124 ] && echo ", stopped at its $max s limit")): $*"
        status=1
    fi
    return $rc
}
# Pipelines run `bounded` in a subshell: their callers record its exit status here.
failed() { [ "$1" -ne 0 ] && [ "$1" -ne 125 ] && status=1; return 0; }
wants() { [ "$ONLY" = all ] || [ "$ONLY" = "$1" ]; }
field() { grep -o "$1[0-9.]*" "$2" 2>/dev/null | head -1 | sed "s/^$1//"; }

# Restores a carried cubecl cache (compiled kernels, autotune decisions). cubecl keeps it in
# TARGET/environment of the outermost Cargo.toml above the working directory (this checkout's
# target/), else in ~/.cache/cubecl ($XDG_CACHE_HOME): both are saved and restored.
CUBECL_USER_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}
if [ -f "$BIN/cubecl-environment.tar.xz" ] && [ "${HEARTH_GPU_FRESH:-0}" != 1 ]; then
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
        echo "cubecl cache: restored from $BIN/cubecl-environment.tar.xz (not a fresh machine)"
    fi
    rm -rf "$unpacked"
else
    rm -rf "$ROOT/target/environment" "$CUBECL_USER_CACHE/cubecl"
fi
save_cache() {
    local parts=()
    [ -d "$ROOT/target/environment" ] && parts+=(-C "$ROOT/target" environment)
    [ -d "$CUBECL_USER_CACHE/cubecl" ] && parts+=(-C "$CUBECL_USER_CACHE" cubecl)
    [ ${#parts[@]} -gt 0 ] || return 0
    XZ_OPT=-T0 tar -cJf "$OUT/cubecl-environment.tar.xz" "${parts[@]}" \
        && echo "cubecl cache ($(du -sh "$OUT/cubecl-environment.tar.xz" | cut -f1) xz) saved to $OUT/cubecl-environment.tar.xz"
}

# hearth_run LABEL MODEL BATCH PRECISION: one `hearth bench model` training run; prints the
# time from its start to the end of its first step and its images/s, and leaves them in
# H_FIRST, H_MED and H_BEST.
hearth_run() {
    local label=$1 model=$2 batch=$3 precision=$4
    local log=$LOGS/hearth-$label.log
    H_FIRST=- H_MED=- H_BEST=-
    bounded "${HEARTH_STEP_TIMEOUT:-360}" "$HEARTH" --device "$DEVICE" --autotune "$AUTOTUNE" \
        bench model --model "$model" --mode train --batch-size "$batch" --precision "$precision" \
        --steps "$STEPS" --warmup "$WARMUP" 2>&1 | stamp | tee "$log" \
        | grep -v "^ *[0-9.]* s |   step [3-9]\|step [1-9][0-9]"
    failed "${PIPESTATUS[0]}"
    H_FIRST=$(grep -m1 "step 1/" "$log" | awk '{print $1}')
    H_FIRST=${H_FIRST:--}
    H_MED=$(grep -o "images/s at the median step: [0-9.]*" "$log" | awk '{print $NF}')
    H_BEST=$(grep -o "at the best: [0-9.]*" "$log" | awk '{print $NF}')
    H_MED=${H_MED:--} H_BEST=${H_BEST:--}
}
# peer_run LABEL MODEL BATCH PRECISION [--channels-last]: the PyTorch peer; leaves its median
# images/s in P_MED and the seconds from its start to the end of its first step in P_FIRST.
peer_run() {
    local label=$1 model=$2 batch=$3 precision=$4 cl=${5:-}
    local log=$LOGS/torch-$label${cl:+-cl}.log
    local t0=${EPOCHREALTIME/./}
    P_MED=- P_FIRST=-
    bounded 120 python3 "$PEER" --model "$model" --mode train --device "$PEER_DEVICE" \
        --batch-size "$batch" --size 224 --steps "$STEPS" --warmup "$WARMUP" \
        --precision "$precision" $cl > "$log" 2>&1
    cat "$log" | tail -3
    P_MED=$(field median_images_per_s= "$log")
    P_FIRST=$(field first_step_s= "$log")
    P_MED=${P_MED:--} P_FIRST=${P_FIRST:--}
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2fx", a / b; else print "-" }'; }
# pair MODEL BATCH PRECISION [NOTE]: Hearth, then the peer in NCHW and channels_last; one row.
pair() {
    local model=$1 batch=$2 precision=$3 note=${4:-}
    local label=$model-b$batch-$precision${note:+-$note}
    if [ $(( $(left) - RESERVE )) -lt 30 ]; then
        echo "SKIPPED (out of time): $model training, batch $batch, $precision"
        printf '| %s | %s | %s | %s | skipped: out of time | | | | | | |\n' "$model" "$batch" "$precision" "${note:--}" >> "$TABLE"
        return 0
    fi
    step "$model training, batch $batch, $precision, on $DEVICE (--autotune $AUTOTUNE) against PyTorch"
    hearth_run "$label" "$model" "$batch" "$precision"
    local hf=$H_FIRST hm=$H_MED hb=$H_BEST
    peer_run "$label" "$model" "$batch" "$precision"
    local pf=$P_FIRST pm=$P_MED
    local pcl=- 
    if [ "$precision" = fp32 ]; then
        peer_run "$label" "$model" "$batch" "$precision" --channels-last
        pcl=$P_MED
    fi
    printf '| %s | %s | %s | %s | %s s | %s / %s | %s | **%s** | %s | %s | %s s |\n' \
        "$model" "$batch" "$precision" "${note:--}" "$hf" "$hm" "$hb" "$pm" "$(ratio "$hm" "$pm")" \
        "$pcl" "$(ratio "$hm" "$pcl")" "$pf" | tee -a "$TABLE"
}

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' 2>&1
echo "NVRTC library path: ${NV_LIBS:-system only}"
[ -x "$HEARTH" ] || { echo "no hearth binary in $BIN"; exit 1; }
ls -la "$HEARTH" | awk '{print "hearth binary:", $5, "bytes"}'
"$HEARTH" devices 2>&1 | head -20
{
    echo "| model | batch | precision | run | Hearth: start to end of step 1 | Hearth img/s (median / best) | PyTorch img/s | ratio | PyTorch CL img/s | ratio CL | PyTorch: start to end of step 1 |"
    echo "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
} > "$TABLE"

if wants first; then
    # Nothing shipped: what a GPU Hearth has no bundle for costs.
    export HEARTH_SHIPPED_KERNELS=0
    # Every decision autotune still takes on a fresh GPU: none expected (Burn's reductions are
    # written into the cache by rule at the start, fusion's fused ones launched by rule,
    # 2026-12-07); any logged here names what still tunes.
    export HEARTH_AUTOTUNE_LOG=$LOGS/decisions-first.jsonl
    pair resnet50 32 fp32 first
    unset HEARTH_AUTOTUNE_LOG
    echo "autotune decisions in the first run: $(cat "$LOGS/decisions-first.jsonl" 2>/dev/null | wc -l)"
    grep "reductions by rule\|reductions keep autotune" "$LOGS/hearth-resnet50-b32-fp32-first.log" || true
    # The same again in a new process: the kernels compiled by the first run are in cubecl's
    # cache now.
    step "resnet50 again, kernels from cubecl's cache"
    hearth_run resnet50-b32-fp32-cached resnet50 32 fp32
    printf '| resnet50 | 32 | fp32 | cached | %s s | %s / %s | | | | | |\n' "$H_FIRST" "$H_MED" "$H_BEST" | tee -a "$TABLE"
    # The same with each weight gradient in one kernel (HEARTH_PER_IMAGE=0), as before weight
    # gradients over 28x28 positions or more ran as one product per image: what that rule
    # gains or costs on this GPU, in the same call.
    step "resnet50 with each weight gradient in one kernel (HEARTH_PER_IMAGE=0)"
    export HEARTH_PER_IMAGE=0
    hearth_run resnet50-b32-fp32-unsplit resnet50 32 fp32
    unset HEARTH_PER_IMAGE
    printf '| resnet50 | 32 | fp32 | HEARTH_PER_IMAGE=0 | %s s | %s / %s | | | | | |\n' "$H_FIRST" "$H_MED" "$H_BEST" | tee -a "$TABLE"
    unset HEARTH_SHIPPED_KERNELS
    # An empty cache again, with the bundle Hearth ships for this GPU's architecture (if any):
    # what a new user of a GPU Hearth was measured on gets.
    rm -rf "$ROOT/target/environment" "$CUBECL_USER_CACHE/cubecl"
    step "resnet50 on an empty cache with the kernel bundle Hearth ships"
    hearth_run resnet50-b32-fp32-shipped resnet50 32 fp32
    grep -m1 "kernels shipped with Hearth" "$LOGS/hearth-resnet50-b32-fp32-shipped.log" \
        || echo "no bundle shipped for this GPU"
    printf '| resnet50 | 32 | fp32 | shipped bundle | %s s | %s / %s | | | | | |\n' "$H_FIRST" "$H_MED" "$H_BEST" | tee -a "$TABLE"
fi

if wants profile; then
    # cubecl's profiler: every kernel launch timed, summed per kernel. Read from cubecl.toml in
    # the working directory for this run only.
    step "where ResNet-50's training step spends its GPU time (cubecl's profiler, 1 warm-up + 2 steps)"
    [ -e "$ROOT/cubecl.toml" ] && mv "$ROOT/cubecl.toml" "$WORK/cubecl.toml.user"
    printf '[profiling]\nlogger = { level = "basic", file = "%s" }\n' "$LOGS/profile-resnet50.log" > "$ROOT/cubecl.toml"
    bounded 120 "$HEARTH" --device "$DEVICE" --autotune "$AUTOTUNE" bench model --model resnet50 \
        --mode train --batch-size 32 --steps 2 --warmup 1 2>&1 | tail -3
    rm -f "$ROOT/cubecl.toml"
    [ -e "$WORK/cubecl.toml.user" ] && mv "$WORK/cubecl.toml.user" "$ROOT/cubecl.toml"
    if [ ! -s "$LOGS/profile-resnet50.log" ]; then
        echo "profile: cubecl wrote no profile (a CPU device has none, or the run failed)"
    else
    python3 - "$LOGS/profile-resnet50.log" > "$OUT/profile-resnet50.md" <<'PY'
import re, sys
# The summaries are blocks of table rows whose last cells are time, launches and share; the
# last block with a Total row covers the run. Kernel names drop cubecl's generic-argument noise.
noise = {"TensorArgs", "TensorMapArgs", "RuntimeArgs", "DynamicScalar", "DynamicSize"}
blocks, block = [], []
for line in open(sys.argv[1], encoding="utf-8", errors="replace"):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("|"):
        # Rows, and the ruled lines between them (which carry no share).
        if len(cells) >= 4 and cells[-1].endswith("%"):
            block.append(cells)
    elif block:
        blocks.append(block)
        block = []
if block:
    blocks.append(block)
last = [b for b in blocks if any(c[0] == "Total" for c in b)] or blocks
if not last:
    sys.exit("no profile summary in the log")
rows = last[-1]
print("| kernel | time | launches | share |\n| --- | ---: | ---: | ---: |")
kernels = [r for r in rows if r[0] != "Total"]
for c in kernels[:40] + [r for r in rows if r[0] == "Total"][:1]:
    parts = [t for t in c[:-3] if t and t not in noise and not t.startswith("__")]
    name = " ".join(parts)
    if len(name) > 140:
        loads = [t for t in parts if "Loading" in t][:2]
        name = " ".join(parts[:2] + loads) + " ... " + parts[-1]
    print(f"| {name} | {c[-3]} | {c[-2]} | {c[-1]} |")
PY
    head -25 "$OUT/profile-resnet50.md"
    fi
fi

if wants bench; then
    for mb in densenet121:32 vgg16:32 resnet50:64 vgg16:64 densenet121:64; do
        pair "${mb%:*}" "${mb#*:}" fp32
    done
fi

if wants train; then
    DATA=$WORK/data224
    step "generating a 224-pixel image folder"
    bounded 120 "$HEARTH" data synth --out "$DATA" --classes 10 --per-class 64 --val-per-class 16 --size 224 | tail -2
    for n in 1 2; do
        step "hearth train --model resnet50 on $DEVICE, $n process(es), global batch $((32 * n))"
        log=$LOGS/train-resnet50-n$n.log
        extra=()
        dev=$DEVICE
        # Ranks of one job take the GPU of their local rank unless the device names one: both
        # on GPU 0 here (a CPU device has no index).
        if [ $n -gt 1 ]; then
            extra=(--nproc $n)
            case $DEVICE in flex* | ndarray*) ;; *) dev=${DEVICE%%:*}:0 ;; esac
        fi
        bounded 240 "$HEARTH" --device "$dev" --autotune "$AUTOTUNE" train --data "$DATA" \
            --model resnet50 --size 224 --batch-size $((32 * n)) --epochs 2 "${extra[@]}" \
            --run-dir "$LOGS/run-resnet50-n$n" 2>&1 | stamp | tee "$log" | tail -25
        failed "${PIPESTATUS[0]}"
        echo "first progress line (after the first steps): $(grep -m1 "train: [0-9]*/" "$log")"
    done
fi

if wants mixed; then
    for p in bf16 fp16; do
        pair resnet50 32 "$p"
    done
fi

if wants parity; then
    if [ -x "$BIN/parity" ]; then
        step "torchvision parity on $DEVICE"
        bounded 300 env HEARTH_REQUIRE_GPU=1 HEARTH_PARITY_DEVICES="$DEVICE" \
            "$BIN/parity" --exact torchvision_parity_on_named_devices --nocapture
    else
        echo "parity: skipped (no parity binary in $BIN)"
    fi
fi

if [ "$ONLY" = all ] || [ "$ONLY" = first ]; then
    # Every kernel the runs above compiled, as a bundle that `--kernel-bundle` imports on another
    # machine with this GPU (the tune's own steps find their kernels in the cache already).
    step "kernel bundle of this GPU (hearth tune --rules-only)"
    RESERVE=0 bounded 90 "$HEARTH" --device "$DEVICE" tune --rules-only --model resnet50 \
        --batch-size 32 --out "$WORK/kernels-$DEVICE.bundle" 2>&1 | tail -8
    # SQLite with every kernel's source and binary: about 40 MB for the whole table on an H200,
    # 2 MB compressed.
    [ -f "$WORK/kernels-$DEVICE.bundle" ] && xz -T0 -c "$WORK/kernels-$DEVICE.bundle" \
        > "$OUT/kernels-${DEVICE%%:*}.bundle.xz"
fi

step "table ($(elapsed) s of the ${BUDGET} s budget)"
cat "$TABLE"
tar -cJf "$OUT/logs.tar.xz" -C "$WORK" --exclude='*.bpk' logs 2>/dev/null
save_cache
exit $status
