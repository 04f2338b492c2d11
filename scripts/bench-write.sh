#!/usr/bin/env bash
# Write-path benchmarks (not tests), each compared in the same run with the kernel:
#   1. mkfs -d: `rext4 mkfs -d SRC` vs `mkfs.ext4 -d SRC` (SRC default /usr/share/doc)
#   2. create/stat/unlink of N files (default 100000): `rext4 bench mdtest` (API, no
#      mount) vs scripts/bench-helpers/mdtest.c on a kernel ext4 loop mount of the
#      same-size image
#   3. sequential write of SIZE (default 1g) in 1 MiB requests + fsync: `rext4 bench
#      seqwrite` vs `dd bs=1M conv=fsync` on the kernel loop mount
#   4. journaling on/off; 5. small fsynced files
#   6. SEEDS lesson B: pwrite 4 KiB + ftruncate 2 KiB loop (plain and with fallocate):
#      `rext4 bench pwtrunc` vs scripts/bench-helpers/pwrite_trunc.c on the kernel loop mount
#   7. SEEDS lesson C: create+unlink of one name alone and while a thread stats a
#      16-deep path and a symlink: `rext4 bench churn` vs scripts/bench-helpers/churn.c
#      (the same phases, through the kernel's system calls) on the kernel loop mount
# Everything it runs is in this repository (the C helpers are built into
# target/bench-helpers by scripts/bench-helpers/build.sh).
# Usage (root, for the loop mount): scripts/bench-write.sh [RUNS]
# Env: SRC=/usr/share/doc N=100000 SIZE=1g IMG_SIZE=4G
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
SRC=${SRC:-/usr/share/doc}
N=${N:-100000}
SIZE=${SIZE:-1g}
IMG_SIZE=${IMG_SIZE:-4G}
[ "$(id -u)" = 0 ] || { echo "run as root (loop mounts, drop_caches)"; exit 1; }
source scripts/lib/bench.sh
cargo build --release -q -p rext4-cli
R=$PWD/target/release/rext4
ensure_built
W=$(mktemp -d /tmp/rext4-bench-write.XXXXXX)
MNT=$W/mnt; mkdir -p "$MNT"
cleanup() { mountpoint -q "$MNT" && umount "$MNT"; rm -rf "$W"; }
trap cleanup EXIT INT TERM
MDTEST=$BIN/mdtest
med() { sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
t() { local s=$EPOCHREALTIME; "$@" >/dev/null 2>&1; awk -v a="$s" -v b="$EPOCHREALTIME" 'BEGIN{printf "%.3f\n", b-a}'; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }

echo "+ machine: $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB, kernel $(uname -r)"
echo "## 1. mkfs -d $SRC ($(du -sh "$SRC" | cut -f1), $(find "$SRC" | wc -l) entries), $RUNS runs, median"
for tool in rext4 mkfs.ext4; do
  for i in $(seq "$RUNS"); do
    rm -f "$W/d.img"; truncate -s "$IMG_SIZE" "$W/d.img"; drop
    if [ $tool = rext4 ]; then t "$R" mkfs -q -d "$SRC" "$W/d.img" "$IMG_SIZE"; else t mkfs.ext4 -q -F -d "$SRC" "$W/d.img" "$IMG_SIZE"; fi
  done | med | sed "s/^/RESULT|$tool|mkfs_d|secs|/;s/$/|s/"
done

echo "## 2. mdtest $N files (create, stat, unlink), median of $RUNS"
for i in $(seq "$RUNS"); do
  rm -f "$W/m.img"; mkfs.ext4 -q -F "$W/m.img" "$IMG_SIZE" >/dev/null; drop
  "$R" bench mdtest -n "$N" "$W/m.img" | grep '^phase=' | sed 's/^/rext4 /'
  mount -o loop "$W/m.img" "$MNT"; mkdir "$MNT/d"; drop
  "$MDTEST" "$MNT/d" "$N" | sed 's/^/kernel /'
  umount "$MNT"
done > "$W/md.txt"
for who in rext4 kernel; do for ph in create stat unlink; do
  v=$(grep "^$who phase=$ph " "$W/md.txt" | sed 's/.*ops_per_s=//' | med)
  echo "RESULT|$who|mdtest|${ph}_ops_per_s|$v|ops/s"
done; done

echo "## 3. sequential write $SIZE (1 MiB requests + fsync), median of $RUNS"
for i in $(seq "$RUNS"); do
  rm -f "$W/s.img"; mkfs.ext4 -q -F "$W/s.img" "$IMG_SIZE" >/dev/null; drop
  "$R" bench seqwrite -s "$SIZE" "$W/s.img" | grep '^phase=' | sed 's/^/rext4 /'
  rm -f "$W/s.img"; mkfs.ext4 -q -F "$W/s.img" "$IMG_SIZE" >/dev/null; mount -o loop "$W/s.img" "$MNT"; drop
  cnt=$(( $(numfmt --from=iec "${SIZE^^}") / 1048576 ))
  s=$EPOCHREALTIME; dd if=/dev/zero of="$MNT/f" bs=1M count=$cnt conv=fsync status=none
  awk -v a="$s" -v b="$EPOCHREALTIME" -v m=$cnt 'BEGIN{printf "kernel phase=seqwrite MiB_per_s=%.1f\n", m/(b-a)}'
  umount "$MNT"
done > "$W/sw.txt"
for who in rext4 kernel; do
  v=$(grep "^$who phase=seqwrite" "$W/sw.txt" | sed 's/.*MiB_per_s=//' | med)
  echo "RESULT|$who|seqwrite|MiB_per_s|$v|MiB/s"
done

echo "## 4. journaling: $SIZE sequential write with and without a journal (rext4), median of $RUNS"
for j in journal nojournal; do
  for i in $(seq "$RUNS"); do
    rm -f "$W/j.img"
    if [ $j = journal ]; then mkfs.ext4 -q -F "$W/j.img" "$IMG_SIZE" >/dev/null; else mkfs.ext4 -q -F -O ^has_journal "$W/j.img" "$IMG_SIZE" >/dev/null; fi
    drop
    "$R" bench seqwrite -s "$SIZE" "$W/j.img" | sed -n 's/^phase=seqwrite.*MiB_per_s=//p'
  done | med | sed "s/^/RESULT|rext4-$j|seqwrite|MiB_per_s|/;s/$/|MiB\/s/"
done

echo "## 5. $((N / 10)) small files each written (4 KiB) and fsynced: rext4 API vs kernel, median of $RUNS"
cat > "$W/smallfsync.c" <<'C'
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
int main(int c, char **v) {
    long n = atol(v[2]); char p[4096], buf[4096]; memset(buf, 0x5a, sizeof buf);
    struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        snprintf(p, sizeof p, "%s/f%06ld", v[1], i);
        int fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0644);
        if (fd < 0 || write(fd, buf, sizeof buf) != sizeof buf || fsync(fd)) { perror(p); return 1; }
        close(fd);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
    printf("phase=write_fsync ops=%ld secs=%.3f ops_per_s=%.1f\n", n, s, n / s);
    return 0;
}
C
gcc -O2 -o "$W/smallfsync" "$W/smallfsync.c"
for i in $(seq "$RUNS"); do
  rm -f "$W/f.img"; mkfs.ext4 -q -F "$W/f.img" "$IMG_SIZE" >/dev/null; drop
  "$R" bench smallfsync -n $((N / 10)) "$W/f.img" | grep '^phase=' | sed 's/^/rext4 /'
  mount -o loop "$W/f.img" "$MNT"; mkdir "$MNT/d"; drop
  "$W/smallfsync" "$MNT/d" $((N / 10)) | sed 's/^/kernel /'
  umount "$MNT"
done > "$W/sf.txt"
for who in rext4 kernel; do
  v=$(grep "^$who phase=write_fsync" "$W/sf.txt" | sed 's/.*ops_per_s=//' | med)
  echo "RESULT|$who|smallfsync|files_per_s|$v|files/s"
  echo "RESULT|$who|smallfsync|fsync_latency_ms|$(awk -v r="$v" 'BEGIN{printf "%.3f", 1000/r}')|ms"
done

echo "## 6. SEEDS B: pwrite 4 KiB + ftruncate 2 KiB, $N iterations (plain, falloc), median of $RUNS"
PWT=$BIN/pwrite_trunc
for i in $(seq "$RUNS"); do
  rm -f "$W/b.img"; mkfs.ext4 -q -F "$W/b.img" "$IMG_SIZE" >/dev/null; drop
  "$R" bench pwtrunc -n "$N" "$W/b.img" | grep '^phase=' | sed 's/^/rext4 /'
  mount -o loop "$W/b.img" "$MNT"; drop
  for m in plain falloc; do
    o=$("$PWT" "$MNT/pt.$m" "$N" "$m" 4096 2048 32768)
    ph=pwrite_trunc; [ $m = falloc ] && ph=falloc_pwrite_trunc
    echo "kernel phase=$ph $(sed 's/.*iters_per_s=/ops_per_s=/;s/ .*//' <<<"$o")"
    rm -f "$MNT/pt.$m"
  done
  umount "$MNT"
done > "$W/b.txt"
for who in rext4 kernel; do for ph in pwrite_trunc falloc_pwrite_trunc; do
  v=$(grep "^$who phase=$ph " "$W/b.txt" | sed 's/.*ops_per_s=//' | med)
  echo "RESULT|$who|pwtrunc|${ph}_iters_per_s|$v|iters/s"
done; done

echo "## 7. SEEDS C: create+unlink alone / with a lookup thread, 5 s phases, median of $RUNS"
for i in $(seq "$RUNS"); do
  rm -f "$W/c.img"; mkfs.ext4 -q -F "$W/c.img" "$IMG_SIZE" >/dev/null; drop
  "$R" bench churn --secs 5 --threads 1 "$W/c.img" | grep '^phase=' | sed 's/^/rext4 /'
  mount -o loop "$W/c.img" "$MNT"; drop
  "$BIN/churn" "$MNT" 5 1 | sed 's/^/kernel /'
  umount "$MNT"
done > "$W/c.txt"
for who in rext4 kernel; do
  for ph in create_unlink_alone lookups_alone create_unlink_with_lookups lookups_with_create_unlink; do
    v=$(grep "^$who phase=$ph " "$W/c.txt" | sed 's/.*ops_per_s=//' | med)
    echo "RESULT|$who|churn|${ph}_per_s|$v|ops/s"
  done
done
