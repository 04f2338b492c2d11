#!/usr/bin/env bash
# Resize benchmark (not a test; issue 39): `rext4 resize IMG min` against
# `resize2fs -M` on copies of the same populated image, in one run.
#
#   ./scripts/bench-resize.sh                 # defaults: 1.5 GiB image, ~300 MiB tree, RUNS=3
#   RUNS=5 IMG_MB=2048 FILES=6000 ./scripts/bench-resize.sh
#
# What it does:
#   1. builds target/release/rext4;
#   2. makes a tree (DIRS directories, FILES files of 0 B to 256 KiB, random bytes),
#      an image of IMG_MB MiB with mkfs.ext4 -d (4 KiB blocks), then adds a second
#      copy of part of the tree through rext4 (the engine's allocator spreads it over
#      the groups) and removes every third file of the first (holes to fill);
#   3. RUNS times: both tools on fresh sparse copies (resize2fs after `e2fsck -fy`,
#      which it demands and which is not timed), wall time of each, the sizes reached,
#      e2fsck -fn of both results;
#   4. prints each run and the median time ratio rext4 / resize2fs.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=${RUNS:-3}
IMG_MB=${IMG_MB:-1536}
DIRS=${DIRS:-40}
FILES=${FILES:-4000}
WORK_DIR=${WORK_DIR:-/tmp}
echo "+ cargo build --release -p rext4-cli" >&2
(cd "$here" && cargo build --release -q -p rext4-cli)
rext4="$here/target/release/rext4"
dir=$(mktemp -d "$WORK_DIR/rext4-bench-resize.XXXXXX")
trap 'rm -rf "$dir"' EXIT
python3 - "$dir/src" "$DIRS" "$FILES" <<'EOF'
import os, random, sys
root, dirs, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(39)
for d in range(dirs):
    os.makedirs(f"{root}/d{d:03}/sub", exist_ok=True)
for f in range(files):
    d = rng.randrange(dirs)
    n = rng.choice([0, 100, 3000, 20000, 90000, 150000, 262144])
    with open(f"{root}/d{d:03}/{'sub/' if f % 3 == 0 else ''}f{f:05}", "wb") as fh:
        fh.write(os.urandom(n))
EOF
base="$dir/base.img"
truncate -s "${IMG_MB}M" "$base"
echo "+ mkfs.ext4 -q -F -b 4096 -d $dir/src $base" >&2
mkfs.ext4 -q -F -b 4096 -d "$dir/src" "$base"
for d in $(seq 0 7); do
    "$rext4" cp -r "$dir/src/d00$d" "$base:/copy$d" >/dev/null
done
n=0
for f in $("$rext4" ls "$base:/d001" 2>/dev/null | awk '{print $NF}' | grep '^f' || true); do
    n=$((n + 1))
    if [ $((n % 3)) -eq 0 ]; then "$rext4" rm "$base:/d001/$f"; fi
done
e2fsck -fy "$base" >/dev/null 2>&1 || true
used=$(dumpe2fs -h "$base" 2>/dev/null | awk -F: '/^Block count/{b=$2} /^Free blocks/{f=$2} END{print b-f}')
echo "image: ${IMG_MB} MiB, $used blocks in use" >&2
ratios=()
for r in $(seq "$RUNS"); do
    cp --sparse=always "$base" "$dir/a.img"
    cp --sparse=always "$base" "$dir/b.img"
    sync
    t0=$(date +%s.%N)
    said=$("$rext4" resize -v "$dir/a.img" min)
    t1=$(date +%s.%N)
    e2fsck -fy "$dir/b.img" >/dev/null 2>&1 || true
    sync
    t2=$(date +%s.%N)
    resize2fs -M "$dir/b.img" >/dev/null 2>&1
    t3=$(date +%s.%N)
    ra=$(dumpe2fs -h "$dir/a.img" 2>/dev/null | awk -F: '/^Block count/{print $2+0}')
    rb=$(dumpe2fs -h "$dir/b.img" 2>/dev/null | awk -F: '/^Block count/{print $2+0}')
    ca=$(e2fsck -fn "$dir/a.img" >/dev/null 2>&1 && echo clean || echo NOT-CLEAN)
    cb=$(e2fsck -fn "$dir/b.img" >/dev/null 2>&1 && echo clean || echo NOT-CLEAN)
    ta=$(echo "$t1 - $t0" | bc)
    tb=$(echo "$t3 - $t2" | bc)
    ratio=$(echo "scale=3; $ta / $tb" | bc)
    ratios+=("$ratio")
    echo "rext4: $said" >&2
    echo "RESULT run=$r rext4_s=$ta rext4_blocks=$ra rext4_fsck=$ca resize2fs_s=$tb resize2fs_blocks=$rb resize2fs_fsck=$cb time_ratio=$ratio size_ratio=$(echo "scale=3; $ra / $rb" | bc)"
done
printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR]=$1} END{print "median time ratio rext4/resize2fs: " a[int((NR+1)/2)]}'
