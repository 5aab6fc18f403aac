#!/bin/bash
# Creates per second through `citronfs up` (default TTLs) from 4 bash processes: all in one
# shared directory, against one directory each, and one process alone; the same on tmpfs
# (/dev/shm). Two rounds. Each process makes N empty files with `: > name` (open with O_CREAT,
# close).
#
#   bench/experiments/shared-dir-creates.sh [CITRONFS_BINARY] [N]
#
# docs/BENCHMARKS.md ("a sixth session") has figures from a 16-core and the 2-core machine.
set -u
B=${1:-citronfs}
N=${2:-3000}
M=$(mktemp -d /tmp/cfs-creates-XXXXXX)
LOG=$(mktemp /tmp/cfs-creates-up-XXXXXX.log)
"$B" up "$M" > "$LOG" 2>&1 &
UP=$!
cleanup() {
    kill -TERM "$UP" 2>/dev/null
    wait "$UP" 2>/dev/null
    rmdir "$M" 2>/dev/null
    rm -f "$LOG"
}
trap cleanup EXIT
for _ in $(seq 1 300); do mountpoint -q "$M" && break; sleep 0.1; done
mountpoint -q "$M" || { echo "citronfs up did not mount:"; cat "$LOG"; exit 1; }

mk() { local d=$1 p=$2 n=$3 i; for ((i = 0; i < n; i++)); do : > "$d/$p-$i"; done; }
# Runs `mk` in 4 processes, into DIR/shared or DIR/d1..d4, and prints creates per second.
four() {
    local dir=$1 each=$2 s e p pids=()
    s=$(date +%s%N)
    for p in 1 2 3 4; do
        if [ "$each" = yes ]; then mk "$dir/d$p" p "$N" & else mk "$dir/shared" "p$p" "$N" & fi
        pids+=($!)
    done
    wait "${pids[@]}"
    e=$(date +%s%N)
    echo $((4 * N * 1000000000 / (e - s)))
}
for round in 1 2; do
    for base in "$M" /dev/shm; do
        R=$(mktemp -d "$base/cr-XXXXXX")
        mkdir "$R/one" "$R/shared" "$R/d1" "$R/d2" "$R/d3" "$R/d4"
        s=$(date +%s%N); mk "$R/one" p "$N"; e=$(date +%s%N)
        one=$((N * 1000000000 / (e - s)))
        shared=$(four "$R" no)
        each=$(four "$R" yes)
        echo "round $round $base: 1 process $one/s; 4 processes, one directory $shared/s; 4 processes, a directory each $each/s"
        rm -rf "$R"
    done
done
