#!/usr/bin/env bash
# SEEDS lesson D over the mount: scripts/seedD.sh for the kernel's ext4 and for rext4's
# mount, alternating, N rounds each, then the median of every metric and rext4's ratio
# to the kernel. Root (loop devices, drop caches).
# Usage: scripts/bench-seedD.sh [MOUNTPOINT]   env: N=8, REXT4, and seedD.sh's D_* knobs
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "needs root (loop devices, drop_caches)" >&2; exit 1; }
MNT=${1:-/mnt/rext4-seedD}
N=${N:-8}
REXT4=$(realpath "${REXT4:-target/release/rext4}")
mkdir -p "$MNT"
out=$(mktemp -d)
cleanup() {
  mountpoint -q "$MNT" && umount "$MNT"
  rm -rf "$out"
}
trap cleanup EXIT
for i in $(seq "$N"); do
  echo "+ round $i/$N: scripts/seedD.sh $MNT ext4, then rext4"
  bash scripts/seedD.sh "$MNT" ext4 2>&1 | grep '^RESULT' >>"$out/kernel"
  REXT4=$REXT4 bash scripts/seedD.sh "$MNT" rext4 2>&1 | grep '^RESULT' >>"$out/rext4"
done
python3 - "$out/kernel" "$out/rext4" <<'PY'
import statistics, sys
def load(path):
    d = {}
    for line in open(path):
        f = line.strip().split('|')
        try:
            d.setdefault(f[3], []).append(float(f[4]))
        except (IndexError, ValueError):
            pass
    return d
k, r = load(sys.argv[1]), load(sys.argv[2])
print(f"{'metric':30s} {'kernel':>9s} {'rext4':>9s} {'ratio':>6s}")
for m in k:
    if m in r and m not in ('image_size', 'fill_level', 'mkfs_time'):
        km, rm = statistics.median(k[m]), statistics.median(r[m])
        print(f"{m:30s} {km:9.2f} {rm:9.2f} {rm / km:6.2f}")
        print(f"RESULT|ratio|seedD|{m}|{rm / km:.2f}|x")
PY
