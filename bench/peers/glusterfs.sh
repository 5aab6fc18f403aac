#!/bin/bash
# A GlusterFS volume for `citronfs bench compare`, from Debian's glusterfs-server: glusterd and
# its bricks run in a network namespace of their own (reached over a veth pair), with their
# state under WORKDIR; the volume is mounted (FUSE, mount.glusterfs) on MOUNTPOINT.
# CFSB_REPLICAS=N (default 1) makes it a `replica N` volume of N bricks (all on this glusterd,
# hence `force`); 1 is a plain one-brick volume.
#
#   glusterfs.sh up   WORKDIR MOUNTPOINT   # exits 0 once the volume is mounted
#   glusterfs.sh down WORKDIR MOUNTPOINT   # unmounts, stops every process, removes the namespace
#
# `up` cleans up after itself when it fails; `down` never fails and may be run any number of
# times. Needs root, iproute2, glusterfs-server.
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
NS=cfsb-gluster IF_HOST=cfsbg0 IF_NS=cfsbg1 IP_HOST=10.213.7.1 IP_NS=10.213.7.2
VOLUME=cfsb
. "$here/netns.sh"

action=${1:?usage: glusterfs.sh up|down WORKDIR MOUNTPOINT}
work=$(readlink -f "${2:?WORKDIR missing}")
mnt=${3:?MOUNTPOINT missing}
replicas=${CFSB_REPLICAS:-1}
case "$replicas" in
'' | *[!0-9]* | 0*) echo "CFSB_REPLICAS must be a count from 1: '$replicas'" >&2; exit 2 ;;
esac
# glusterd's command socket is machine-wide (/var/run/glusterd.socket): one such volume at a time.
cli() { ip netns exec "$NS" gluster --mode=script "$@"; }

down() {
    unmount_quietly "$mnt"
    netns_down
}

case "$action" in
up)
    command -v glusterd >/dev/null || { echo "glusterd not found: apt-get install glusterfs-server" >&2; exit 2; }
    down
    if ps -C glusterd -o stat= | grep -qv '^Z'; then
        echo "a glusterd is running already (its command socket is machine-wide): stop it first" >&2
        exit 2
    fi
    trap 'down' ERR
    rm -rf "$work/state" "$work/brick" "$work"/brick[0-9]*
    if [ "$replicas" -eq 1 ]; then
        bricks=("$work/brick")
    else
        bricks=()
        for i in $(seq "$replicas"); do bricks+=("$work/brick$i"); done
    fi
    mkdir -p "$work/state" "${bricks[@]}" "$work/log" "$mnt"
    cat > "$work/glusterd.vol" <<VOL
volume management
    type mgmt/glusterd
    option working-directory $work/state
    option transport-type socket
    option transport.socket.bind-address $IP_NS
    option transport.socket.listen-port 24007
    option ping-timeout 0
    option event-threads 1
end-volume
VOL
    netns_up
    ip netns exec "$NS" glusterd -f "$work/glusterd.vol" -p "$work/glusterd.pid" \
        -l "$work/log/glusterd.log" --log-level=WARNING
    wait_for "cli volume list" 30
    if [ "$replicas" -eq 1 ]; then
        cli volume create "$VOLUME" "$IP_NS:${bricks[0]}" force >/dev/null
    else
        # --mode=script answers the split-brain question of `replica 2` with yes.
        cli volume create "$VOLUME" replica "$replicas" "${bricks[@]/#/$IP_NS:}" force >/dev/null
    fi
    cli volume start "$VOLUME" >/dev/null
    wait_for "mount -t glusterfs -o log-file=$work/log/mount.log $IP_NS:/$VOLUME $mnt" 30
    trap - ERR
    ;;
down)
    down
    ;;
*)
    echo "usage: glusterfs.sh up|down WORKDIR MOUNTPOINT" >&2
    exit 2
    ;;
esac
