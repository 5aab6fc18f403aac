#!/bin/bash
# A MooseFS cluster for `citronfs bench compare`, from Debian's moosefs-master,
# moosefs-chunkserver and moosefs-client: a master and one chunkserver in a network namespace of
# their own, reached over a veth pair (the chunkserver refuses a loopback master), with their
# data under WORKDIR; mfsmount mounts it (FUSE) on MOUNTPOINT with goal 1 (one copy per chunk).
#
#   moosefs.sh up   WORKDIR MOUNTPOINT   # exits 0 once mounted and the chunkserver is registered
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
    rm -rf "$work/master" "$work/chunks" "$work/cs"
    mkdir -p "$work/master" "$work/chunks" "$work/cs" "$mnt"
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
    echo "$work/chunks" > "$work/mfshdd.cfg"
    cat > "$work/mfschunkserver.cfg" <<CFG
WORKING_USER = root
WORKING_GROUP = root
DATA_PATH = $work/cs
HDD_CONF_FILENAME = $work/mfshdd.cfg
HDD_LEAVE_SPACE_DEFAULT = 64MiB
MASTER_HOST = $IP_NS
BIND_HOST = $IP_NS
CSSERV_LISTEN_HOST = $IP_NS
NICE_LEVEL = 0
CFG
    netns_up
    ip netns exec "$NS" mfsmaster -c "$work/mfsmaster.cfg" start >"$work/master.log" 2>&1
    ip netns exec "$NS" mfschunkserver -c "$work/mfschunkserver.cfg" start >"$work/cs.log" 2>&1
    mfsmount "$mnt" -H "$IP_NS" >"$work/mount.log" 2>&1 || { cat "$work/mount.log" >&2; false; }
    # Writes fail until the chunkserver has registered: wait for its space to show.
    wait_for "mountpoint -q '$mnt' && [ \$(stat -f -c %b '$mnt') -gt 0 ]" 30
    mfssetgoal -r 1 "$mnt" >/dev/null 2>&1 || true
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
