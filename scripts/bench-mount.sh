#!/usr/bin/env bash
# The anchors' general_fio_meta.sh (fio seq 1M write/read, 4k random read/write with
# 2 jobs, 20,000-file create/stat/unlink) on three mounts of fresh 4 GiB mkfs.ext4
# images, in one run: the kernel (loop), `rext4 mount`, and fuse2fs. e2fsck -fn after.
# Then tar -x of a source tree (TAR_SRC, default /usr/include) until syncfs returns,
# and, when WORKLOADS names them, the SEEDS lessons' anchor scripts (seedA: concurrent
# unaligned O_DIRECT overwrites, seedB: pwrite/truncate loop + stale-data check, seedC:
# create/unlink with a lookup storm) on the same three mounts. KINDS may add "raw": the
# fio workloads on a plain file in the host filesystem, the anchors' physical ceiling,
# "kernel-dio": the kernel on a loop device with --direct-io=on, "xfs": the kernel's
# xfs on a loop device (checked with xfs_repair -n),
# and "rext4-devfuse": rext4 over /dev/fuse alone (`-o nouring`), "rext4-nowb" and
# "rext4-nowb-devfuse": the same two without the kernel's writeback cache, and "rext4-base":
# the `rext4` binary REXT4_BASE names (a build of an earlier commit, for before/after
# ratios measured in the same run). `rext4` uses
# FUSE-over-io_uring when the kernel offers it (set URING=Y to turn the fuse module's
# enable_uring on first; the run prints the setting it ran with).
# Usage (root): scripts/bench-mount.sh
# Env: WORKLOADS (default "general tar"; also seedA seedB seedC) KINDS (default
#      "kernel rext4 fuse2fs") G_SIZE_PER_JOB G_RUNTIME G_SEQ_CAP G_MD_FILES TAR_SRC and
#      the seed scripts' knobs (A_SIZE A_RUNTIME ..., see the anchors' bench/README.md)
#      REXT4_SHARED: the anchors' checkout (general_fio_meta.sh and the seed scripts are
#      theirs); without it only the tar workload runs, on every kind, and a NOTE says so
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/bench.sh
B=$(anchors "general, seedA, seedB and seedC are left out; the tar workload runs") || B=""
cargo build --release -q -p rext4-cli
R=$PWD/target/release/rext4
export G_SIZE_PER_JOB=${G_SIZE_PER_JOB:-256M} G_RUNTIME=${G_RUNTIME:-8} G_SEQ_CAP=${G_SEQ_CAP:-20} G_MD_FILES=${G_MD_FILES:-20000}
W=$(mktemp -d /tmp/rext4-bench-mount.XXXXXX)
cleanup() {
  for m in "$W"/mnt-*; do mountpoint -q "$m" && { umount "$m" 2>/dev/null || fusermount3 -u "$m" || umount -l "$m"; }; done
  [[ -n ${LOOP:-} ]] && losetup -d "$LOOP" 2>/dev/null
  sleep 1; rm -rf "$W"
}
LOOP=""
trap cleanup EXIT INT TERM
U=/sys/module/fuse/parameters/enable_uring
if [[ -n ${URING:-} && -w $U ]]; then echo "$URING" > "$U"; fi
echo "NOTE|all|fuse enable_uring=$(cat "$U" 2>/dev/null || echo absent)"
TAR_SRC=${TAR_SRC:-/usr/include}
tar -C "$(dirname "$TAR_SRC")" -cf "$W/tree.tar" "$(basename "$TAR_SRC")"
TAR_FILES=$(tar -tf "$W/tree.tar" | wc -l); TAR_MB=$(( $(stat -c %s "$W/tree.tar") >> 20 ))
WORKLOADS=${WORKLOADS:-general tar}
[[ -n $B ]] || WORKLOADS=$([[ " $WORKLOADS " == *" tar "* ]] && echo tar)
has() { [[ " $WORKLOADS " == *" $1 "* ]]; }
export A_SIZE=${A_SIZE:-256M} A_RUNTIME=${A_RUNTIME:-8} A_SHORT_RUNTIME=${A_SHORT_RUNTIME:-4}
export A_VARIANTS=${A_VARIANTS:-2k:write:8 2k:randwrite:8 4k:randwrite:8 4k:randwrite:1}
export C_SECONDS=${C_SECONDS:-5}
for kind in ${KINDS:-kernel rext4 fuse2fs}; do
  if [[ $kind == raw ]]; then
    has general && BENCH_LABEL=raw "$B/general_fio_meta.sh" "$W/raw.dat" 2>&1 | grep -E '^(RESULT|NOTE)'
    continue
  fi
  img=$W/$kind.img; mnt=$W/mnt-$kind; mkdir -p "$mnt"
  if [[ $kind == xfs ]]; then
    truncate -s 4G "$img" && mkfs.xfs -q -f "$img" >/dev/null
  else
    mkfs.ext4 -q -F "$img" 4G >/dev/null
  fi
  case $kind in
    kernel|xfs) mount -o loop "$img" "$mnt" ;;
    kernel-dio) LOOP=$(losetup -f --show --direct-io=on "$img") && mount "$LOOP" "$mnt" ;;
    rext4) "$R" mount "$img" "$mnt" ;;
    rext4-devfuse) "$R" mount -o nouring "$img" "$mnt" ;;
    rext4-nowb) "$R" mount -o nowriteback_cache "$img" "$mnt" ;;
    rext4-nowb-devfuse) "$R" mount -o nowriteback_cache,nouring "$img" "$mnt" ;;
    rext4-base) "${REXT4_BASE:?REXT4_BASE names the rext4 binary to compare with}" mount "$img" "$mnt" ;;
    fuse2fs) fuse2fs -o fakeroot "$img" "$mnt"; sleep 1 ;;
  esac
  has general && BENCH_LABEL=$kind "$B/general_fio_meta.sh" "$mnt" 2>&1 | grep -E '^(RESULT|NOTE)'
  if has tar; then
    # tar -x of a source tree, timed until syncfs returns.
    sync; echo 3 > /proc/sys/vm/drop_caches
    t0=$(date +%s.%N)
    mkdir "$mnt/tarx" && tar -xf "$W/tree.tar" -C "$mnt/tarx" && sync -f "$mnt/tarx"
    t1=$(date +%s.%N)
    echo "RESULT|$kind|tar_x|wall|$(echo "$t1 - $t0" | bc -l | xargs printf %.2f)|s ($TAR_FILES files, $TAR_MB MiB)"
    rm -rf "$mnt/tarx"
  fi
  for seed in seedA_dio_overwrite seedB_pwrite_trunc seedC_create_unlink_lookup; do
    has "${seed%%_*}" && BENCH_LABEL=$kind "$B/$seed.sh" "$mnt" 2>&1 | grep -E '^(RESULT|NOTE)'
  done
  case $kind in
    rext4*) "$R" umount "$mnt" 2>/dev/null || umount "$mnt" 2>/dev/null || fusermount3 -u "$mnt" ;;
    *) umount "$mnt" 2>/dev/null || fusermount3 -u "$mnt" ;;
  esac
  [[ -n $LOOP ]] && { losetup -d "$LOOP"; LOOP=""; }
  sleep 1
  if [[ $kind == xfs ]]; then
    if xfs_repair -n "$img" >/dev/null 2>&1; then echo "NOTE|$kind|xfs_repair -n clean"; else echo "NOTE|$kind|xfs_repair -n NOT clean"; fi
  elif e2fsck -fn "$img" >/dev/null 2>&1; then echo "NOTE|$kind|e2fsck -fn clean"; else echo "NOTE|$kind|e2fsck -fn NOT clean"; fi
  rm -f "$img"
done
