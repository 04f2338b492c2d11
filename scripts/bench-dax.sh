#!/usr/bin/env bash
# DAX benchmark (not a test; SEEDS lesson E): rext4's DAX data path against the copy
# limits of the same tmpfs, in one run.
#
#   ./scripts/bench-dax.sh                   # defaults: 1 GiB file, RUNS=3, /dev/shm
#   RUNS=5 SIZE=512m CHUNKS="1m 16k" ./scripts/bench-dax.sh
#
# What it does:
#   1. builds target/release/rext4, and scripts/bench-helpers/daxcopy.c;
#   2. makes an ext4 image (4 KiB blocks, IMG_MB MiB) on WORK_DIR (tmpfs);
#   3. RUNS times, back to back: `daxcopy WORK_DIR/daxcopy.tmp 4 1024` (16 KiB chunks
#      over a 1 GiB region: cached, cached+clwb, cached+clflushopt, nt) and, for each
#      request size in CHUNKS, `rext4 bench dax IMG -s SIZE --chunk C` (limits on a
#      scratch file beside the image, then write/read bandwidth through the API and
#      fsync's cost against dirty bytes and against file size);
#   4. prints every RESULT line and the median of each metric over the runs.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=${RUNS:-3}
SIZE=${SIZE:-1g}
CHUNKS=${CHUNKS:-"1m 16k"}
WORK_DIR=${WORK_DIR:-/dev/shm}
IMG_MB=${IMG_MB:-2560}
echo "+ cargo build --release -p rext4-cli" >&2
(cd "$here" && cargo build --release -q -p rext4-cli)
rext4="$here/target/release/rext4"
dir=$(mktemp -d "$WORK_DIR/rext4-bench-dax.XXXXXX")
trap 'rm -rf "$dir"' EXIT
daxcopy="$("$here/scripts/bench-helpers/build.sh")/daxcopy"
img="$dir/dax.img"
truncate -s "${IMG_MB}M" "$img"
echo "+ mkfs.ext4 -q -F -b 4096 -E lazy_itable_init=0,lazy_journal_init=0 $img" >&2
mkfs.ext4 -q -F -b 4096 -E lazy_itable_init=0,lazy_journal_init=0 "$img"
all="$dir/results"
: > "$all"
for r in $(seq "$RUNS"); do
    echo "+ $daxcopy $dir/daxcopy.tmp 4 1024" >&2
    "$daxcopy" "$dir/daxcopy.tmp" 4 1024 | tee -a "$all"
    for c in $CHUNKS; do
        echo "+ rext4 bench dax $img -s $SIZE --chunk $c --label rext4-$c" >&2
        "$rext4" bench dax "$img" -s "$SIZE" --chunk "$c" --label "rext4-$c" | tee -a "$all"
    done
done
echo "== medians over $RUNS runs"
grep '^RESULT|' "$all" | awk -F'|' '
    { k = $2 "|" $3 "|" $4; v[k] = v[k] " " $5; u[k] = $6; if (!(k in seen)) { seen[k] = 1; order[n++] = k } }
    END {
        for (i = 0; i < n; i++) {
            k = order[i]; m = split(substr(v[k], 2), a, " ");
            for (x = 1; x <= m; x++) for (y = x + 1; y <= m; y++) if (a[y] + 0 < a[x] + 0) { t = a[x]; a[x] = a[y]; a[y] = t }
            printf "RESULT|%s|%s|%s\n", k, a[int((m + 1) / 2)], u[k]
        }
    }'
