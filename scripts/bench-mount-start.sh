#!/usr/bin/env bash
# A cold mount, started directly: drop caches, start the mount, wait until statfs on
# it answers (scripts/bench-helpers/mountwait.c); the kernel's ext4 on a loop device and
# rext4's mount of the same image, alternating, N rounds, medians. Root.
# Usage: scripts/bench-mount-start.sh IMAGE [MOUNTPOINT]   env: N=8, REXT4
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "needs root (loop devices, drop_caches)" >&2; exit 1; }
IMG=$(realpath "$1")
MNT=${2:-/mnt/rext4-start}
N=${N:-8}
REXT4=$(realpath "${REXT4:-target/release/rext4}")
WAIT="$(scripts/bench-helpers/build.sh)/mountwait"
mkdir -p "$MNT"
LOOP=""; PID=""
cleanup() {
  mountpoint -q "$MNT" && umount "$MNT"
  [ -n "$PID" ] && wait "$PID" 2>/dev/null
  [ -n "$LOOP" ] && losetup -d "$LOOP"
  true
}
trap cleanup EXIT
now() { date +%s%N; }
K=(); R=()
for i in $(seq "$N"); do
  LOOP=$(losetup -f --show "$IMG")
  sync; echo 3 >/proc/sys/vm/drop_caches
  t0=$(now); mount -t ext4 "$LOOP" "$MNT"; "$WAIT" "$MNT" 30 >/dev/null; t1=$(now)
  K+=($(( (t1 - t0) / 1000 )))
  umount "$MNT"; losetup -d "$LOOP"; LOOP=""
  sync; echo 3 >/proc/sys/vm/drop_caches
  t0=$(now); "$REXT4" mount -f "$IMG" "$MNT" >/dev/null 2>&1 & PID=$!
  "$WAIT" "$MNT" 30 >/dev/null; t1=$(now)
  R+=($(( (t1 - t0) / 1000 )))
  umount "$MNT"; wait "$PID"; PID=""
  echo "round $i: kernel ${K[-1]} us, rext4 ${R[-1]} us"
done
python3 -c "
import statistics as s
k = [int(x) for x in '${K[*]}'.split()]; r = [int(x) for x in '${R[*]}'.split()]
print(f'cold mount, median of {len(k)}: kernel {s.median(k)/1000:.1f} ms, rext4 {s.median(r)/1000:.1f} ms, ratio {s.median(r)/s.median(k):.2f}')
print(f'RESULT|ratio|mount-start|cold_mount|{s.median(r)/s.median(k):.2f}|x')"
