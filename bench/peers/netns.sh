# Sourced by the peers' scripts: a network namespace joined to this host by a veth pair, so that
# a peer file system's servers listen only inside it (never on the machine's own addresses).
# Needs: NS (namespace name), IF_HOST, IF_NS, IP_HOST, IP_NS (a /30 of their own).

netns_up() {
    ip netns add "$NS"
    ip link add "$IF_HOST" type veth peer name "$IF_NS"
    ip link set "$IF_NS" netns "$NS"
    ip addr add "$IP_HOST/30" dev "$IF_HOST"
    ip link set "$IF_HOST" up
    ip netns exec "$NS" ip addr add "$IP_NS/30" dev "$IF_NS"
    ip netns exec "$NS" ip link set "$IF_NS" up
    ip netns exec "$NS" ip link set lo up
}

# Kills every process in the namespace, then removes it and the veth pair. Never fails.
netns_down() {
    if ip netns list 2>/dev/null | grep -qw "$NS"; then
        local pids
        pids=$(ip netns pids "$NS" 2>/dev/null || true)
        [ -n "$pids" ] && kill $pids 2>/dev/null || true
        for _ in $(seq 50); do
            pids=$(ip netns pids "$NS" 2>/dev/null || true)
            [ -z "$pids" ] && break
            sleep 0.1
        done
        [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
        ip netns del "$NS" 2>/dev/null || true
    fi
    ip link del "$IF_HOST" 2>/dev/null || true
}

# Waits up to $2 seconds for command $1 (a string) to succeed.
wait_for() {
    local cmd=$1 secs=$2
    for _ in $(seq $((secs * 10))); do
        if eval "$cmd" >/dev/null 2>&1; then return 0; fi
        sleep 0.1
    done
    echo "timed out after ${secs}s waiting for: $cmd" >&2
    return 1
}

# Unmounts $1 if it is a mount point (lazily when busy). Never fails.
unmount_quietly() {
    if mountpoint -q "$1" 2>/dev/null; then
        umount "$1" 2>/dev/null || umount -l "$1" 2>/dev/null || true
    fi
}
