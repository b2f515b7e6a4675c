# Network namespaces as hosts, sourced by scripts/netns_*.sh (needs root, iproute2 and tc).
#
#   netns_up RANKS RATE DELAY   namespaces hearth-r<i> (address 10.77.0.<i+1>) on a bridge in
#                               hearth-br, each rank's sending side shaped: netem (rate and
#                               delay) where the kernel has it, else a token bucket (rate only);
#                               sets SHAPING to what was applied
#   netns_down RANKS            deletes them
#
# The addresses exist only inside the namespaces.

netns_down() {
    for i in $(seq 0 $(($1 - 1))); do ip netns del "hearth-r$i" 2>/dev/null || true; done
    ip netns del hearth-br 2>/dev/null || true
}

netns_up() {
    local ranks=$1 rate=$2 delay=$3
    ip netns add hearth-br
    ip -n hearth-br link add br0 type bridge
    ip -n hearth-br link set br0 up
    SHAPING=""
    for i in $(seq 0 $((ranks - 1))); do
        ns="hearth-r$i"
        ip netns add "$ns"
        ip link add "v$i" netns "$ns" type veth peer name "b$i" netns hearth-br
        ip -n hearth-br link set "b$i" master br0 up
        ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev "v$i"
        ip -n "$ns" link set "v$i" up
        ip -n "$ns" link set lo up
        if ! ip netns exec "$ns" tc qdisc add dev "v$i" root netem delay "$delay" rate "$rate" limit 10000 2>/dev/null; then
            ip netns exec "$ns" tc qdisc add dev "v$i" root tbf rate "$rate" burst 256kb latency 50ms
            SHAPING="tbf rate $rate (no sch_netem in this kernel: no added delay)"
        fi
    done
    SHAPING=${SHAPING:-"netem rate $rate delay $delay"}
}
