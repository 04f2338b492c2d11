#!/usr/bin/env bash
# SEEDS lesson D on a mount: mount time and first allocations on a huge, 90% full,
# fragmented ext4 image, for the kernel's ext4 (KIND=ext4, a loop device) or rext4's
# FUSE mount (KIND=rext4). Root.
#   1. truncate -s D_SIZE a sparse image in D_DIR, mkfs.ext4 (defaults);
#   2. fill it through the kernel: D_FILES files fallocated to D_FILL_PCT of the free
#      space, a D_PUNCH_HOLE hole punched every D_PUNCH_STRIDE in each (free space in
#      small pieces in every group);
#   3. trial 1: drop caches, mount (timed until statfs answers: mountwait), a new 4 KiB
#      write+fsync, a second one, unmount (timed; rext4: until its server has exited);
#   4. trial 2: the same cold mount, a new D_LARGE write+fsync, unmount.
# Output: RESULT|LABEL|seedD|METRIC|VALUE|UNIT lines (mount_cold_trialN, first_4k_write_fsync,
# first_4k_fsync_part, second_4k_write_fsync, first_64M_write_fsync, umount_trialN, ...).
# Usage: scripts/seedD.sh MOUNTPOINT ext4|rext4
# Env: D_SIZE=1T D_DIR=/tmp D_FILL_PCT=90 D_FILES=8 D_PUNCH_STRIDE=64M D_PUNCH_HOLE=256K
#      D_LARGE=64M REXT4=target/release/rext4 BENCH_LABEL (default KIND)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/bench.sh
source scripts/lib/bench.sh
[[ $# == 2 ]] || die "usage: $0 MOUNTPOINT ext4|rext4"
MNT=$1 KIND=$2
[[ $KIND == ext4 || $KIND == rext4 ]] || die "KIND must be ext4 or rext4, not $KIND"
[[ $(id -u) -eq 0 ]] || die "$0 needs root (loop devices, mount, drop_caches)"
need truncate mkfs.ext4 losetup mount umount fallocate numfmt df
LABEL=${BENCH_LABEL:-$KIND}
D_SIZE=${D_SIZE:-1T}
D_DIR=${D_DIR:-/tmp}
D_FILL_PCT=${D_FILL_PCT:-90}
D_FILES=${D_FILES:-8}
STRIDE=$(numfmt --from=iec "${D_PUNCH_STRIDE:-64M}")
HOLE=$(numfmt --from=iec "${D_PUNCH_HOLE:-256K}")
LARGE=$(numfmt --from=iec "${D_LARGE:-64M}")
REXT4=$(realpath "${REXT4:-target/release/rext4}")
[[ $KIND == ext4 || -x $REXT4 ]] || die "no rext4 binary at $REXT4 (cargo build --release -p rext4-cli)"
ensure_built
result() { printf 'RESULT|%s|seedD|%s|%s|%s\n' "$LABEL" "$1" "$2" "$3"; }

IMG=$(mktemp "$D_DIR/rext4-seedD.XXXXXX.img")
LOOP="" PID=""
cleanup() {
  set +e
  mountpoint -q "$MNT" && { umount "$MNT" 2>/dev/null || umount -l "$MNT"; }
  [[ -n $PID ]] && wait "$PID" 2>/dev/null
  [[ -n $LOOP ]] && losetup -d "$LOOP"
  rm -f "$IMG"
}
trap cleanup EXIT INT TERM
mkdir -p "$MNT"

runc truncate -s "$D_SIZE" "$IMG"
runc mkfs.ext4 -F -q "$IMG"
LOOP=$(losetup -f --show "$IMG")
echo "+ losetup -f --show $IMG   ($LOOP)"
runc mount -t ext4 "$LOOP" "$MNT"
avail=$(df -B1 --output=avail "$MNT" | tail -1)
per=$((avail * D_FILL_PCT / 100 / D_FILES / 1048576 * 1048576))
for ((i = 0; i < D_FILES; i++)); do
  runc fallocate -l "$per" "$MNT/fill$i"
  runc "$BIN/punchholes" "$MNT/fill$i" "$STRIDE" "$HOLE" >/dev/null
done
result fill_level "$(df --output=pcent "$MNT" | tail -1 | tr -dc 0-9)" %used
runc umount "$MNT"
if [[ $KIND == rext4 ]]; then losetup -d "$LOOP"; LOOP=""; fi

mount_it() {
  if [[ $KIND == ext4 ]]; then
    mount -t ext4 "$LOOP" "$MNT"
  else
    "$REXT4" mount -f "$IMG" "$MNT" >/dev/null 2>&1 &
    PID=$!
  fi
}
# The unmount ends when the image is closed: for rext4, when its server has exited.
umount_it() {
  umount "$MNT"
  if [[ -n $PID ]]; then wait "$PID"; PID=""; fi
}
for trial in 1 2; do
  drop_caches
  t0=$(now)
  mount_it
  ready=$("$BIN/mountwait" "$MNT" 300) || die "the mount did not answer within 300 s"
  result "mount_cold_trial$trial" "$(ms_between "$t0" "$ready")" ms
  if [[ $trial == 1 ]]; then
    out=$(runc "$BIN/firstwrite" "$MNT/first4k.$$" 4096)
    result first_4k_write_fsync "$(calc "$(kv total_us "$out")/1000" %.2f)" ms
    result first_4k_fsync_part "$(calc "$(kv fsync_us "$out")/1000" %.2f)" ms
    out=$(runc "$BIN/firstwrite" "$MNT/second4k.$$" 4096)
    result second_4k_write_fsync "$(calc "$(kv total_us "$out")/1000" %.2f)" ms
  else
    out=$(runc "$BIN/firstwrite" "$MNT/firstlarge.$$" "$LARGE")
    result "first_$(numfmt --to=iec "$LARGE")_write_fsync" "$(calc "$(kv total_us "$out")/1000" %.1f)" ms
  fi
  t0=$(now)
  umount_it
  result "umount_trial$trial" "$(ms_between "$t0" "$(now)")" ms
done
