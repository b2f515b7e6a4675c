#!/usr/bin/env bash
# Ring allreduce between ranks in network namespaces joined by veth pairs and a bridge, every
# rank's link shaped by tc netem (default 1 Gbit/s, 1 ms), against the bandwidth-optimal bound
# 2(n-1)/n * S / B.
#
#   sudo bash scripts/netns_allreduce.sh [--ranks N] [--size-mb S...] [--rate 1gbit] [--delay 1ms]
#
# Needs root, iproute2 and tc. Creates namespaces hearth-br and hearth-r<i> (addresses
# 10.77.0.<i+1> exist only inside them) and deletes them on exit.
set -euo pipefail

RANKS=2
SIZES=(10 100)
RATE=1gbit
DELAY=1ms
ITERS=3
BIN=${HEARTH_BIN:-}
while [ $# -gt 0 ]; do
    case "$1" in
        --ranks) RANKS=$2; shift 2 ;;
        --size-mb) shift; SIZES=(); while [ $# -gt 0 ] && [[ $1 != --* ]]; do SIZES+=("$1"); shift; done ;;
        --rate) RATE=$2; shift 2 ;;
        --delay) DELAY=$2; shift 2 ;;
        --iters) ITERS=$2; shift 2 ;;
        --bin) BIN=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ "$(id -u)" != 0 ]; then echo "run as root (network namespaces)" >&2; exit 1; fi
command -v ip >/dev/null && command -v tc >/dev/null || { echo "needs iproute2 (ip, tc)" >&2; exit 1; }
if [ -z "$BIN" ]; then
    cd "$(dirname "$0")/.."
    cargo build --release --bin hearth >&2
    BIN="${CARGO_TARGET_DIR:-target}/release/hearth"
fi
BIN=$(readlink -f "$BIN")

. "$(dirname "$(readlink -f "$0")")/netns_lib.sh"
cleanup() { netns_down "$RANKS"; }
trap cleanup EXIT
cleanup
netns_up "$RANKS" "$RATE" "$DELAY"

SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
OUT=$(mktemp)
pids=()
for i in $(seq 0 $((RANKS - 1))); do
    ip netns exec "hearth-r$i" env HEARTH_RANK=$i HEARTH_WORLD_SIZE=$RANKS \
        HEARTH_COORDINATOR=10.77.0.1:29400 HEARTH_JOB_SECRET=$SECRET HEARTH_BIND=10.77.0.$((i + 1)) \
        "$BIN" bench allreduce-rank --iters "$ITERS" --warmup 1 --size-mb "${SIZES[@]}" \
        > "$OUT.$i" 2>&1 &
    pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
if [ $fail != 0 ]; then cat "$OUT".*; exit 1; fi

# Bound: 2(n-1)/n * S / B.
rate_bps=$(python3 -c "import re,sys; s='$RATE'.lower(); m=re.fullmatch(r'([0-9.]+)([kmg]?)bit', s); print(float(m.group(1))*{'':1,'k':1e3,'m':1e6,'g':1e9}[m.group(2)])")
echo "ring allreduce, $RANKS ranks in network namespaces, each link shaped by $SHAPING"
while read -r line; do
    mb=$(sed -E 's/.*size_mb=([^ ]+).*/\1/' <<<"$line")
    ms=$(sed -E 's/.*time_ms=([^ ]+).*/\1/' <<<"$line")
    python3 - "$mb" "$ms" "$RANKS" "$rate_bps" "$line" <<'PY'
import sys
mb, ms, n, bps, line = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
bound_ms = 2 * (n - 1) / n * mb * 1e6 * 8 / bps * 1e3
print(f"{line} bound_ms={bound_ms:.1f} ratio_to_bound={ms / bound_ms:.3f}")
PY
done < <(grep '^size_mb=' "$OUT.0")
if [ -n "${HEARTH_QUIC_DEBUG:-}" ]; then
    grep -h 'burn-dist' "$OUT".* >&2 || true
    for i in $(seq 0 $((RANKS - 1))); do
        echo "rank $i qdisc: $(ip netns exec "hearth-r$i" tc -s qdisc show dev "v$i" | tr '\n' ' ')" >&2
    done
fi
rm -f "$OUT".*
