#!/usr/bin/env bash
# SEEDS lessons A, B and C in one run (issue #16): the anchors' seedA/B/C scripts over
# the mounts of scripts/bench-mount.sh — the kernel's ext4 on a loop device (default and
# --direct-io=on), xfs, `rext4 mount` and fuse2fs — then rext4 in-process (`rext4 bench
# dio-overwrite` with 1 and 8 threads on both backings, `pwtrunc`, `churn`, and `churn
# --sync-grace`, the design that waits for a grace period at every free), and the
# ratios the issue asks for, each against a figure of the same run.
# Usage (root): scripts/bench-seeds.sh    env: KINDS (default "kernel kernel-dio xfs
#   rext4 fuse2fs"), WORKLOADS (default "seedA seedB seedC": which anchor scripts run
#   over the mounts), A_SIZE A_RUNTIME A_VARIANTS B_N C_SECONDS (the anchors' knobs),
#   SECS (in-process seconds per phase, default 8), OUT (keep the raw lines there)
set -uo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "needs root (loop devices, mounts)" >&2; exit 1; }
cargo build --release -q -p rext4-cli
R=$PWD/target/release/rext4
OUT=${OUT:-$(mktemp /tmp/rext4-seeds.XXXXXX)}
SECS=${SECS:-8}
export A_VARIANTS=${A_VARIANTS:-2k:write:8 2k:write:1 2k:randwrite:8 2k:randwrite:1}
export B_N=${B_N:-50000} B_STALE_ITERS=${B_STALE_ITERS:-200} C_SECONDS=${C_SECONDS:-5}
W=$(mktemp -d /tmp/rext4-seeds.XXXXXX)
trap 'rm -rf "$W"' EXIT INT TERM
{
  KINDS=${KINDS:-kernel kernel-dio xfs rext4 fuse2fs} WORKLOADS=${WORKLOADS:-seedA seedB seedC} \
    scripts/bench-mount.sh
  img=$W/api.img
  for backing in buffered direct; do
    for t in 1 8; do
      for qd in 1 64; do
        mkfs.ext4 -q -F "$img" 4G >/dev/null
        "$R" bench dio-overwrite "$img" --threads "$t" --backing "$backing" -s "${A_SIZE:-256M}" \
          --iodepth "$qd" --secs "$SECS" --label "rext4-api-$backing-${t}j-qd$qd" | grep '^RESULT'
      done
    done
  done
  mkfs.ext4 -q -F "$img" 4G >/dev/null
  "$R" bench pwtrunc "$img" -n "$B_N" --label rext4-api | grep '^RESULT'
  "$R" bench pwtrunc "$img" -n "${B_VERIFY_ITERS:-100000}" --verify --label rext4-api | grep '^RESULT'
  "$R" bench churn "$img" --secs "$C_SECONDS" --label rext4-api | grep '^RESULT'
  "$R" bench churn "$img" --secs "$C_SECONDS" --sync-grace --label rext4-api-sync-grace \
    | grep '^RESULT'
  e2fsck -fn "$img" >/dev/null 2>&1 && echo "NOTE|rext4-api|e2fsck -fn clean" || echo "NOTE|rext4-api|e2fsck -fn NOT clean"
} 2>&1 | tee "$OUT"
echo "raw lines: $OUT"
python3 - "$OUT" <<'PY'
import sys
v = {}
for line in open(sys.argv[1]):
    f = line.strip().split('|')
    if f[0] != 'RESULT' or len(f) < 6:
        continue
    try:
        v[(f[1], f[2], f[3], f[5])] = float(f[4])
    except ValueError:
        pass
def get(label, wl, m, unit=None):
    for (l, w, mm, u), x in v.items():
        if (l, w, mm) == (label, wl, m) and unit in (None, u):
            return x
    return None
def ratio(name, a, b, goal):
    if a is None or b is None or b == 0:
        print(f"{name:60s} n/a")
        return
    r = a / b
    print(f"{name:60s} {a:12.0f} / {b:12.0f} = {r:6.2f}x (goal {goal})")
print("--- §A: 2 KiB O_DIRECT overwrites (IOPS)")
# fio's jobs keep 64 writes in flight each (libaio, --iodepth=64); `--iodepth 64` submits
# 64 at a time as one batch, `--iodepth 1` one synchronous write at a time.
for qd in (1, 64):
    for t in (1, 8):
        for backing, kern in (("buffered", "kernel"), ("direct", "kernel-dio")):
            ratio(f"in-process iodepth {qd}, {t} thread(s), {backing} backing / {kern}",
                  get(f"rext4-api-{backing}-{t}j-qd{qd}", "dio-overwrite", "iops"),
                  get(kern, "seedA", f"dio_2k_write_nj{t}", "IOPS"), ">= 1x")
    for backing in ("buffered", "direct"):
        ratio(f"in-process iodepth {qd}, {backing}: 8 threads / 1 thread",
              get(f"rext4-api-{backing}-8j-qd{qd}", "dio-overwrite", "iops"),
              get(f"rext4-api-{backing}-1j-qd{qd}", "dio-overwrite", "iops"), ">= 1x")
for key in ("dio_2k_write_nj8", "dio_2k_randwrite_nj8"):
    a = get("rext4", "seedA", key, "IOPS")
    ratio(f"mount {key} / kernel", a, get("kernel", "seedA", key, "IOPS"), ">= 0.5x")
    ratio(f"mount {key} / fuse2fs", a, get("fuse2fs", "seedA", key, "IOPS"), ">= 10x")
print("--- §B: pwrite 4k + truncate 2k (iterations/s)")
for mode, api in (("plain", "pwrite_trunc"), ("falloc", "falloc_pwrite_trunc")):
    ratio(f"in-process {mode} / kernel", get("rext4-api", "pwtrunc", f"{api}_ops_per_s"),
          get("kernel", "seedB", f"pwrite4k_trunc2k_{mode}"), ">= 2x")
    ratio(f"mount {mode} / fuse2fs", get("rext4", "seedB", f"pwrite4k_trunc2k_{mode}"),
          get("fuse2fs", "seedB", f"pwrite4k_trunc2k_{mode}"), ">= 5x")
for label in ("rext4", "kernel", "xfs", "fuse2fs"):
    for m in ("stale_xfsio_nonzero_past_EOF", "stale_c_nonzero_past_EOF"):
        x = get(label, "seedB", m)
        if x is not None:
            print(f"stale bytes past EOF, {label} ({m}): {x:.0f} (goal 0)")
x = get("rext4-api", "pwtrunc", "stale_bytes")
if x is not None:
    print(f"stale bytes, in-process --verify with reclaim at every step: {x:.0f} (goal 0)")
print("--- §C: create+unlink with a lookup storm")
ratio("in-process with lookups / alone", get("rext4-api", "churn", "create_unlink_with_lookups_ops_per_s"),
      get("rext4-api", "churn", "create_unlink_alone_ops_per_s"), ">= 0.9")
ratio("in-process sync-grace variant: with lookups / alone",
      get("rext4-api-sync-grace", "churn", "create_unlink_with_lookups_ops_per_s"),
      get("rext4-api-sync-grace", "churn", "create_unlink_alone_ops_per_s"), "(comparison)")
ratio("in-process with lookups: cooling / sync-grace variant",
      get("rext4-api", "churn", "create_unlink_with_lookups_ops_per_s"),
      get("rext4-api-sync-grace", "churn", "create_unlink_with_lookups_ops_per_s"), "(comparison)")
ratio("mount with lookups / alone", get("rext4", "seedC", "create_unlink_with_lookups"),
      get("rext4", "seedC", "create_unlink_alone"), ">= 0.9")
ratio("in-process alone / kernel alone", get("rext4-api", "churn", "create_unlink_alone_ops_per_s"),
      get("kernel", "seedC", "create_unlink_alone"), ">= 1x")
ratio("mount alone / fuse2fs alone", get("rext4", "seedC", "create_unlink_alone"),
      get("fuse2fs", "seedC", "create_unlink_alone"), ">= 5x")
PY
