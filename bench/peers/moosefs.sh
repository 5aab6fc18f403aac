#!/bin/bash
# A MooseFS cluster for `citronfs bench compare`, from Debian's moosefs-master,
# moosefs-chunkserver and moosefs-client: a master and N chunkservers (CFSB_REPLICAS=N, default
# 1) in a network namespace of their own, reached over a veth pair (the chunkserver refuses a
# loopback master), with their data under WORKDIR; mfsmount mounts it (FUSE) on MOUNTPOINT with
# goal N (N copies of every chunk, one per chunkserver).
#
#   moosefs.sh up   WORKDIR MOUNTPOINT   # exits 0 once mounted and every chunkserver registered
#   moosefs.sh down WORKDIR MOUNTPOINT   # unmounts, stops every process, removes the namespace
#
# `up` cleans up after itself when it fails; `down` never fails. Needs root, iproute2.
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
NS=cfsb-moosefs IF_HOST=cfsbm0 IF_NS=cfsbm1 IP_HOST=10.213.8.1 IP_NS=10.213.8.2
. "$here/netns.sh"

action=${1:?usage: moosefs.sh up|down WORKDIR MOUNTPOINT}
work=$(readlink -f "${2:?WORKDIR missing}")
mnt=${3:?MOUNTPOINT missing}
replicas=${CFSB_REPLICAS:-1}
case "$replicas" in
'' | *[!0-9]* | 0*) echo "CFSB_REPLICAS must be a count from 1: '$replicas'" >&2; exit 2 ;;
esac

down() {
    unmount_quietly "$mnt"
    netns_down
}

case "$action" in
up)
    for tool in mfsmaster mfschunkserver mfsmount; do
        command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install moosefs-master moosefs-chunkserver moosefs-client" >&2; exit 2; }
    done
    down
    trap 'down' ERR
    rm -rf "$work/master" "$work/chunks" "$work/cs" "$work"/chunks[0-9]* "$work"/cs[0-9]*
    mkdir -p "$work/master" "$mnt"
    cp /usr/share/doc/moosefs-master/examples/metadata.mfs.empty "$work/master/metadata.mfs" 2>/dev/null \
        || cp /var/lib/mfs/metadata.mfs.empty "$work/master/metadata.mfs"
    cat > "$work/mfsexports.cfg" <<CFG
*  /  rw,alldirs,maproot=0:0
*  .  rw
CFG
    cat > "$work/mfsmaster.cfg" <<CFG
WORKING_USER = root
WORKING_GROUP = root
DATA_PATH = $work/master
EXPORTS_FILENAME = $work/mfsexports.cfg
TOPOLOGY_FILENAME = $work/mfstopology.cfg
MATOML_LISTEN_HOST = $IP_NS
MATOCS_LISTEN_HOST = $IP_NS
MATOCL_LISTEN_HOST = $IP_NS
NICE_LEVEL = 0
CFG
    touch "$work/mfstopology.cfg"
    # Chunkserver i (from 1) keeps its chunks in chunks$i and listens on port 9421+i; the first
    # keeps today's names (chunks, cs, the default port 9422).
    cs_dir() { if [ "$1" -eq 1 ]; then echo "$work/$2"; else echo "$work/$2$1"; fi; }
    for i in $(seq "$replicas"); do
        chunks=$(cs_dir "$i" chunks) cs=$(cs_dir "$i" cs) suffix=${cs#"$work/cs"}
        mkdir -p "$chunks" "$cs"
        echo "$chunks" > "$work/mfshdd$suffix.cfg"
        cat > "$work/mfschunkserver$suffix.cfg" <<CFG
WORKING_USER = root
WORKING_GROUP = root
DATA_PATH = $cs
HDD_CONF_FILENAME = $work/mfshdd$suffix.cfg
HDD_LEAVE_SPACE_DEFAULT = 64MiB
MASTER_HOST = $IP_NS
BIND_HOST = $IP_NS
CSSERV_LISTEN_HOST = $IP_NS
CSSERV_LISTEN_PORT = $((9421 + i))
NICE_LEVEL = 0
CFG
    done
    netns_up
    ip netns exec "$NS" mfsmaster -c "$work/mfsmaster.cfg" start >"$work/master.log" 2>&1
    for i in $(seq "$replicas"); do
        suffix=$(cs_dir "$i" cs) suffix=${suffix#"$work/cs"}
        ip netns exec "$NS" mfschunkserver -c "$work/mfschunkserver$suffix.cfg" start \
            >"$work/cs$suffix.log" 2>&1
    done
    mfsmount "$mnt" -H "$IP_NS" >"$work/mount.log" 2>&1 || { cat "$work/mount.log" >&2; false; }
    # Writes fail until a chunkserver has registered (and are under goal until all have): wait
    # for the space of all of them to show. Each reports the space of the file system its chunks
    # are on (all the same one), less HDD_LEAVE_SPACE_DEFAULT, so N registered report more than
    # N-1 times that file system's size.
    size_of() { echo $(( $(stat -f -c '%b * %S' "$1") )); }
    least=$(( (replicas - 1) * $(size_of "$work/chunks") ))
    wait_for "mountpoint -q '$mnt' && [ \$(size_of '$mnt') -gt $least ]" 30
    if [ "$replicas" -eq 1 ]; then
        mfssetgoal -r 1 "$mnt" >/dev/null 2>&1 || true
    else
        mfssetgoal -r "$replicas" "$mnt" >/dev/null
        mfsgetgoal "$mnt" | grep -q ": $replicas\$" \
            || { echo "goal of $mnt is not $replicas: $(mfsgetgoal "$mnt")" >&2; false; }
    fi
    trap - ERR
    ;;
down)
    down
    ;;
*)
    echo "usage: moosefs.sh up|down WORKDIR MOUNTPOINT" >&2
    exit 2
    ;;
esac
