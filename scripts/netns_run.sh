#!/usr/bin/env bash
# Runs one command per rank, each in its own network namespace (a host of its own: its own
# address, its link shaped to RATE), and waits for all of them.
#
#   sudo bash scripts/netns_run.sh --ranks N [--rate 1gbit] [--delay 1ms] [--timeout S] \
#        --logs DIR -- COMMAND [ARGS...]
#
# Rank i runs COMMAND in namespace hearth-r<i> (10.77.0.<i+1>) with Hearth's job variables
# (HEARTH_RANK, HEARTH_WORLD_SIZE, HEARTH_COORDINATOR=10.77.0.1:29400, HEARTH_BIND,
# HEARTH_JOB_SECRET) and torch.distributed's (RANK, WORLD_SIZE, MASTER_ADDR=10.77.0.1,
# MASTER_PORT=29500, GLOO_SOCKET_IFNAME), its output in DIR/rank<i>.log. Exits non-zero if any rank fails or the
# timeout (default 1200 s) passes. The namespaces are deleted on exit.
set -euo pipefail

RANKS=2
RATE=1gbit
DELAY=1ms
TIMEOUT=1200
LOGS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --ranks) RANKS=$2; shift 2 ;;
        --rate) RATE=$2; shift 2 ;;
        --delay) DELAY=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        --logs) LOGS=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ $# = 0 ] || [ -z "$LOGS" ]; then echo "usage: netns_run.sh --ranks N --logs DIR -- COMMAND..." >&2; exit 2; fi
if [ "$(id -u)" != 0 ]; then echo "run as root (network namespaces)" >&2; exit 1; fi
command -v ip >/dev/null && command -v tc >/dev/null || { echo "needs iproute2 (ip, tc)" >&2; exit 1; }
. "$(dirname "$(readlink -f "$0")")/netns_lib.sh"
mkdir -p "$LOGS"
cleanup() { netns_down "$RANKS"; }
trap cleanup EXIT
cleanup
netns_up "$RANKS" "$RATE" "$DELAY"
echo "$RANKS ranks in network namespaces, each link shaped by $SHAPING" >&2

SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
pids=()
for i in $(seq 0 $((RANKS - 1))); do
    ip netns exec "hearth-r$i" env HEARTH_RANK=$i HEARTH_WORLD_SIZE=$RANKS \
        HEARTH_COORDINATOR=10.77.0.1:29400 HEARTH_JOB_SECRET=$SECRET HEARTH_BIND=10.77.0.$((i + 1)) \
        RANK=$i WORLD_SIZE=$RANKS MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 GLOO_SOCKET_IFNAME=v$i \
        timeout "$TIMEOUT" "$@" > "$LOGS/rank$i.log" 2>&1 &
    pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
exit $fail
