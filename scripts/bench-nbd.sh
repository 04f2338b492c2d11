#!/usr/bin/env bash
# Images on an NBD server (issue 41), against nbdkit. Root (loop mount for the fill).
#   1. latency: a sparse N_SIZE image (default 1T) filled to 90% by the kernel
#      (N_FILES files fallocated, a 256 KiB hole punched every 64 MiB in each, so free
#      space is in small pieces in every group), served by nbdkit's file plugin with
#      N_DELAY (default 5ms) added to every read, write and trim (delay filter);
#      `rext4 cp` of a 4 KiB file into it: open (journal, bitmaps over the network),
#      the first 4 KiB write, the commit with its flushes, close — wall time, twice.
#   2. throughput: an N_COPY (default 1G) file copied into and out of an ext4 image
#      served by nbdkit (no delay) with `rext4 cp`, against `nbdcopy` of a raw export of
#      the same size (into it with --flush, out of it to a file), same run, caches
#      dropped before each copy out; ratios = nbdcopy's time / rext4's (>= 1: rext4
#      as fast or faster).
# Output: RESULT|nbd|...|VALUE|UNIT lines and the commands (+ ...).
# Env: N_SIZE=1T N_DIR=/tmp N_DELAY=5ms N_FILES=8 N_COPY=1G (0: latency only)
#      REXT4=target/release/rext4
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/bench.sh
source scripts/lib/bench.sh
[[ $(id -u) -eq 0 ]] || die "$0 needs root (loop mount, drop_caches)"
need nbdkit nbdcopy mkfs.ext4 fallocate xfs_io numfmt df mount umount
N_SIZE=${N_SIZE:-1T}
N_DIR=${N_DIR:-/tmp}
N_DELAY=${N_DELAY:-5ms}
N_FILES=${N_FILES:-8}
N_COPY=${N_COPY:-1G}
REXT4=$(realpath "${REXT4:-target/release/rext4}")
[[ -x $REXT4 ]] || die "no rext4 binary at $REXT4 (cargo build --release -p rext4-cli)"
result() { printf 'RESULT|nbd|%s|%s|%s|%s\n' "$1" "$2" "$3" "$4"; }

work=$(mktemp -d "$N_DIR/rext4-nbdbench.XXXXXX")
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  mountpoint -q "$work/mnt" && umount "$work/mnt"
  rm -rf "$work"
}
trap cleanup EXIT
# serve SOCKET NBDKIT-ARGS...: nbdkit on SOCKET until the script ends.
serve() {
  local sock=$1 i
  shift
  printf '+ %s\n' "$(shq nbdkit -f --unix "$sock" "$@")"
  nbdkit -f --exit-with-parent --unix "$sock" "$@" &
  pids+=($!)
  for i in $(seq 400); do [[ -S $sock ]] && return 0; sleep 0.05; done
  die "nbdkit did not start"
}
# timed LABEL CMD...: run CMD, print its wall time in seconds.
timed() {
  local t0 t1
  t0=$(now)
  # (errexit does not reach into the command substitution this runs in)
  "${@:2}" >/dev/null || die "failed: $(shq "${@:2}")"
  t1=$(now)
  calc "$t1 - $t0" %.3f
}

log "latency: $N_SIZE image, 90% full, $N_DELAY per request"
img=$work/d.img
runc truncate -s "$N_SIZE" "$img"
runc mkfs.ext4 -q -F "$img"
mkdir "$work/mnt"
runc mount -o loop "$img" "$work/mnt"
avail=$(df -B1 --output=avail "$work/mnt" | tail -1)
per=$((avail * 90 / 100 / N_FILES / 4096 * 4096))
stride=$((64 << 20)) hole=$((256 << 10))
for i in $(seq "$N_FILES"); do
  f=$work/mnt/fill$i
  fallocate -l "$per" "$f"
  cmds=()
  for ((o = stride; o + hole < per; o += stride)); do cmds+=(-c "fpunch $o $hole"); done
  # In slices: one xfs_io per 4,000 punches keeps the command line short.
  for ((k = 0; k < ${#cmds[@]}; k += 8000)); do xfs_io "${cmds[@]:k:8000}" "$f"; done
done
df -h "$work/mnt" | tail -1
runc umount "$work/mnt"
serve "$work/d.sock" --filter=delay file "file=$img" "delay-read=$N_DELAY" \
  "delay-write=$N_DELAY" "delay-trim=$N_DELAY"
uri="nbd+unix:///?socket=$work/d.sock"
head -c 4096 /dev/urandom >"$work/4k"
for n in 1 2; do
  drop_caches
  printf '+ %s\n' "$(shq "$REXT4" cp "$work/4k" "$uri:/new$n")"
  s=$(timed x "$REXT4" cp "$work/4k" "$uri:/new$n")
  result seedD_nbd "open_first_4k_write_fsync_close_$n" "$s" s
done

[[ $N_COPY != 0 ]] || exit 0
log "throughput: $N_COPY in and out, rext4 cp vs nbdcopy"
bytes=$(numfmt --from=iec "$N_COPY")
src=$work/src.bin
printf '+ %s\n' "head -c $bytes /dev/urandom >$src"
head -c "$bytes" /dev/urandom >"$src"
fsimg=$work/fs.img raw=$work/raw.img
runc truncate -s $((bytes * 3 / 2 + (256 << 20))) "$fsimg"
runc mkfs.ext4 -q -F "$fsimg"
runc truncate -s "$bytes" "$raw"
serve "$work/fs.sock" file "file=$fsimg"
serve "$work/raw.sock" file "file=$raw"
fsuri="nbd+unix:///?socket=$work/fs.sock" rawuri="nbd+unix:///?socket=$work/raw.sock"
drop_caches
printf '+ %s\n' "$(shq nbdcopy --flush "$src" "$rawuri")"
in_nbd=$(timed x nbdcopy --flush "$src" "$rawuri")
drop_caches
printf '+ %s\n' "$(shq "$REXT4" cp "$src" "$fsuri:/big")"
in_rext4=$(timed x "$REXT4" cp "$src" "$fsuri:/big")
drop_caches
printf '+ %s\n' "$(shq nbdcopy "$rawuri" "$work/out1")"
out_nbd=$(timed x nbdcopy "$rawuri" "$work/out1")
rm -f "$work/out1"
drop_caches
printf '+ %s\n' "$(shq "$REXT4" cp "$fsuri:/big" "$work/out2")"
out_rext4=$(timed x "$REXT4" cp "$fsuri:/big" "$work/out2")
cmp "$src" "$work/out2" || die "rext4 cp out returned other bytes"
rm -f "$work/out2"
result copy_in nbdcopy "$in_nbd" s
result copy_in rext4_cp "$in_rext4" s
result copy_in ratio "$(calc "$in_nbd / $in_rext4" %.2f)" x
result copy_out nbdcopy "$out_nbd" s
result copy_out rext4_cp "$out_rext4" s
result copy_out ratio "$(calc "$out_nbd / $out_rext4" %.2f)" x
