#!/usr/bin/env bash
# SEEDS lesson D (block-bitmap prefetch on huge filesystems): the kernel's ext4 and
# `rext4 bench firstwrite` on the same sparse, 90% full, fragmented image.
#
# For each SIZE: truncate -s SIZE a sparse image in FW_DIR, mkfs.ext4, fill it with the
# kernel (FW_FILES fallocated files, a FW_PUNCH_HOLE hole punched every FW_PUNCH_STRIDE),
# then
#   kernel: cold `mount -o noinit_itable` (timed) and a new 4 KiB write+fsync, then a
#           second cold mount and a new FW_LARGE write+fsync (extents counted with
#           filefrag); reads and KiB read from /sys/block/loopN/stat at mount, during the
#           first write, and over the whole mounted session (the prefetch runs in the
#           background); with dm-delay (reads delayed FW_LATENCY_MS) if the kernel has it;
#   e2fsck -fn (must be clean), then
#   rext4:  `rext4 bench firstwrite IMG` with --latency-ms FW_LATENCY_MS, with 0, and with
#           FW_LATENCY_MS and -s FW_LARGE;
#   e2fsck -fn again, and a summary table at the end.
# The kernel writes its files first (k4k, klarge, kdelay4k; they stay); rext4 then runs
# on the same image, whose free space is smaller by those ~FW_LARGE bytes only.
#
# Usage (root): scripts/bench-firstwrite.sh [SIZE ...]        (default: 1T 16T)
# Env: FW_DIR=/dev/shm FW_LATENCY_MS=5 FW_FILL_PCT=90 FW_FILES=8 FW_PUNCH_STRIDE=64M
#      FW_PUNCH_HOLE=256K FW_LARGE=64M REXT4=target/release/rext4 FW_KEEP=0
#      FW_SETTLE_S=0: if > 0, the kernel's first trial stays mounted that many seconds after
#      its first write and counts the reads meanwhile (ext4's background block-bitmap
#      prefetch, prefetch_block_bitmaps, starts a few seconds after mount)
# Output: RESULT|label|firstwrite|metric|value|unit lines (labels image-SIZE, kernel-SIZE,
# kernel-SIZE-LARGE, kernel-SIZE-dmdelay, rext4-SIZE, rext4-SIZE-lat0, rext4-SIZE-LARGE;
# the kernel's metrics are named as rext4's, open = mount), NOTE lines, a summary table,
# and every command that matters echoed as "+ command". Needs a rext4 binary with
# `bench firstwrite` (without one the rext4 part is skipped with a NOTE); it builds nothing.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=lib/bench.sh
source scripts/lib/bench.sh   # BIN (scripts/bench-helpers' firstwrite, punchholes), ensure_built, runc, ...

[[ $(id -u) -eq 0 ]] || die "$0 needs root (loop devices, mount, drop_caches, dmsetup)"

FW_DIR=${FW_DIR:-/dev/shm}
FW_LATENCY_MS=${FW_LATENCY_MS:-5}
FW_FILL_PCT=${FW_FILL_PCT:-90}
FW_FILES=${FW_FILES:-8}
FW_PUNCH_STRIDE=${FW_PUNCH_STRIDE:-64M}
FW_PUNCH_HOLE=${FW_PUNCH_HOLE:-256K}
FW_LARGE=${FW_LARGE:-64M}
FW_KEEP=${FW_KEEP:-0}
FW_SETTLE_S=${FW_SETTLE_S:-0}
REXT4=${REXT4:-$ROOT/target/release/rext4}
SIZES=("$@"); [[ ${#SIZES[@]} -gt 0 ]] || SIZES=(1T 16T)

STRIDE_B=$(numfmt --from=iec "$FW_PUNCH_STRIDE")
HOLE_B=$(numfmt --from=iec "$FW_PUNCH_HOLE")
LARGE_B=$(numfmt --from=iec "$FW_LARGE")
# The size as rext4's metric names spell it (4k, 64m): first_64m_write_fsync_ms.
sz_name() {
    local n=$1 u d
    for u in g:30 m:20 k:10; do
        d=$((1 << ${u#*:}))
        if ((n >= d && n % d == 0)); then echo "$((n / d))${u%%:*}"; return; fi
    done
    echo "${n}b"
}
LN=$(sz_name "$LARGE_B")
[[ -d $FW_DIR ]] || die "FW_DIR=$FW_DIR is not a directory"
need truncate mkfs.ext4 dumpe2fs e2fsck losetup mount umount fallocate filefrag blockdev numfmt
ensure_built
[[ -x $BIN/firstwrite && -x $BIN/punchholes ]] || die "missing $BIN/firstwrite or $BIN/punchholes"

# ---- state + cleanup (guards, so it is safe at any point and runs on any exit) ----
IMG=""; LOOP=""; DMNAME=fwdelay; DM_CREATED=0
MNT=$(mktemp -d /tmp/rext4-firstwrite.XXXXXX)
WORK=$(mktemp -d /tmp/rext4-firstwrite-out.XXXXXX)
cleanup_size() {
    set +e
    if mountpoint -q "$MNT"; then
        echo "+ umount $MNT   (cleanup)"
        umount "$MNT" 2>/dev/null || umount -l "$MNT"
    fi
    if [[ $DM_CREATED == 1 ]]; then
        echo "+ dmsetup remove $DMNAME   (cleanup)"
        dmsetup remove "$DMNAME" || dmsetup remove --force "$DMNAME"
        DM_CREATED=0
    fi
    if [[ -n $LOOP ]]; then
        echo "+ losetup -d $LOOP   (cleanup)"
        losetup -d "$LOOP"
        LOOP=""
    fi
    if [[ -n $IMG && -e $IMG ]]; then
        if [[ $FW_KEEP == 1 ]]; then echo "NOTE|all|kept image $IMG (FW_KEEP=1)"
        else echo "+ rm -f $IMG   (cleanup)"; rm -f "$IMG"; fi
    fi
    IMG=""
    set -e
}
cleanup() {
    local rc=$?
    set +e
    cleanup_size
    set +e
    rmdir "$MNT" 2>/dev/null
    rm -rf "$WORK"
    exit $rc
}
trap cleanup EXIT
trap 'rc=$?; echo "ERROR: exit $rc at ${BASH_SOURCE[0]##*/}:$LINENO${FUNCNAME:+ (in ${FUNCNAME[0]}, called from line ${BASH_LINENO[0]})}: $BASH_COMMAND" >&2' ERR
trap 'exit 130' INT
trap 'exit 143' TERM

declare -A V   # summary values: V[tool|size|metric]
res() {  # label metric value unit
    printf 'RESULT|%s|firstwrite|%s|%s|%s\n' "$1" "$2" "$3" "$4"
}
# reads completed and sectors read of a block device (fields 1 and 3 of /sys/block/X/stat)
bstat() { local r m s rest; read -r r m s rest < "/sys/block/$1/stat"; echo "$r $s"; }
# dreads "R0 S0" "R1 S1" -> "reads KiB"
dreads() { local a=($1) b=($2); echo "$((b[0] - a[0])) $(((b[1] - a[1]) / 2))"; }
drop() { echo "+ sync; echo 3 > /proc/sys/vm/drop_caches"; sync; echo 3 > /proc/sys/vm/drop_caches; }

# Why dm-delay cannot be used here (empty output: it can).
dm_delay_unavailable() {
    command -v dmsetup >/dev/null || { echo "dmsetup is not installed"; return; }
    if ! grep -qw device-mapper /proc/misc 2>/dev/null; then
        if command -v modprobe >/dev/null; then modprobe dm-delay 2>/dev/null || true; fi
    fi
    if ! grep -qw device-mapper /proc/misc 2>/dev/null; then
        local why="the kernel has no device-mapper (no device-mapper in /proc/misc"
        if [[ -r /proc/config.gz ]]; then
            why+="; /proc/config.gz: $(zcat /proc/config.gz | grep -E '^(# )?CONFIG_(MD|BLK_DEV_DM|DM_DELAY|MODULES)[ =]' | sed 's/^# //' | tr '\n' ' ' | sed 's/ $//' || true)"
        fi
        command -v modprobe >/dev/null || why+="; no modprobe"
        echo "$why)"; return
    fi
    if ! dmsetup targets 2>/dev/null | grep -q '^delay'; then
        if command -v modprobe >/dev/null; then modprobe dm-delay 2>/dev/null || true; fi
        dmsetup targets 2>/dev/null | grep -q '^delay' || { echo "device-mapper has no delay target (modprobe dm-delay failed or unavailable)"; return; }
    fi
    if dmsetup info "$DMNAME" >/dev/null 2>&1; then echo "a device-mapper device named $DMNAME already exists"; return; fi
}

# One cold kernel mount on DEV (its stats under /sys/block/SDEV), a new file NAME of
# BYTES written + fsynced, SETTLE seconds idle, umount. Sets K_MOUNT_MS K_FW_MS K_FW_OUT
# K_R_MOUNT K_KIB_MOUNT K_R_FW K_KIB_FW K_R_SETTLE K_KIB_SETTLE K_R_SESSION K_KIB_SESSION
# K_UMOUNT_MS K_EXTENTS.
kernel_trial() {
    local dev=$1 sdev=$2 name=$3 bytes=$4 settle=${5:-0} s0 s1 s2 s2b s3 t0 t1 d
    drop
    s0=$(bstat "$sdev")
    echo "+ mount -t ext4 -o noinit_itable $dev $MNT   (timed)"
    t0=$(now); mount -t ext4 -o noinit_itable "$dev" "$MNT"; t1=$(now)
    s1=$(bstat "$sdev")
    K_MOUNT_MS=$(ms_between "$t0" "$t1")
    echo "+ $BIN/firstwrite $MNT/$name $bytes"
    K_FW_OUT=$("$BIN/firstwrite" "$MNT/$name" "$bytes"); echo "  $K_FW_OUT"
    s2=$(bstat "$sdev")
    K_FW_MS=$(calc "$(kv total_us "$K_FW_OUT")/1000" %.2f)
    K_EXTENTS=""
    if [[ $bytes -gt 4096 ]]; then
        echo "+ filefrag $MNT/$name"
        local ff; ff=$(filefrag "$MNT/$name"); echo "  $ff"
        K_EXTENTS=$(sed -n 's/.*: \([0-9]*\) extents\? found.*/\1/p' <<<"$ff")
    fi
    s2b=$s2
    if [[ $settle -gt 0 ]]; then
        echo "+ sleep $settle   (mounted, idle: background reads counted)"
        sleep "$settle"; s2b=$(bstat "$sdev")
    fi
    echo "+ umount $MNT   (timed)"
    t0=$(now); umount "$MNT"; t1=$(now)
    s3=$(bstat "$sdev")
    K_UMOUNT_MS=$(ms_between "$t0" "$t1")
    d=($(dreads "$s0" "$s1")); K_R_MOUNT=${d[0]}; K_KIB_MOUNT=${d[1]}
    d=($(dreads "$s1" "$s2")); K_R_FW=${d[0]}; K_KIB_FW=${d[1]}
    d=($(dreads "$s2" "$s2b")); K_R_SETTLE=${d[0]}; K_KIB_SETTLE=${d[1]}
    d=($(dreads "$s0" "$s3")); K_R_SESSION=${d[0]}; K_KIB_SESSION=${d[1]}
}

# The kernel's RESULT lines, named as rext4's (open = mount -o noinit_itable).
kernel_results() {  # label size-name
    res "$1" open_ms "$K_MOUNT_MS" ms
    res "$1" "first_$2_write_fsync_ms" "$K_FW_MS" ms
    res "$1" "open_first_$2_write_fsync_ms" "$(calc "$K_MOUNT_MS+$K_FW_MS" %.2f)" ms
    res "$1" reads_at_open "$K_R_MOUNT" reads
    res "$1" read_kib_at_open "$K_KIB_MOUNT" KiB
    res "$1" reads_first_write "$K_R_FW" reads
    res "$1" read_kib_first_write "$K_KIB_FW" KiB
}

RC=0
if "$REXT4" bench firstwrite --help >/dev/null 2>&1; then HAVE_REXT4=1; else
    HAVE_REXT4=0
    echo "NOTE|all|$REXT4 does not accept 'bench firstwrite' yet (\`$REXT4 bench firstwrite --help\` fails): the rext4 part is skipped"
fi
DM_WHY=$(dm_delay_unavailable)
if [[ -n $DM_WHY ]]; then echo "NOTE|all|dm-delay not usable, the kernel-with-latency part is skipped: $DM_WHY"; fi
log "bench-firstwrite: sizes ${SIZES[*]}, FW_DIR=$FW_DIR, latency ${FW_LATENCY_MS} ms, fill ${FW_FILL_PCT}% in $FW_FILES files, hole $FW_PUNCH_HOLE every $FW_PUNCH_STRIDE, large $FW_LARGE, rext4 $REXT4"

for SIZE in "${SIZES[@]}"; do
    SIZE_B=$(numfmt --from=iec "$SIZE")
    KL=kernel-$SIZE
    IMG=$FW_DIR/rext4-firstwrite-$SIZE.img
    [[ -e $IMG ]] && die "$IMG already exists (left from an earlier run with FW_KEEP=1?); remove it first"

    # ---- room: on tmpfs every written metadata block is RAM. The fill writes about all
    # block bitmaps (SIZE/32768), the group descriptors, extent trees and the journal.
    need_b=$((SIZE_B / 32768 * 2 + (1 << 30)))
    avail_b=$(df -B1 --output=avail "$FW_DIR" | tail -1 | tr -d ' ')
    fstype=$(stat -f -c %T "$FW_DIR")
    memavail_b=$(( $(awk '/^MemAvailable:/{print $2}' /proc/meminfo) * 1024 ))
    log "[$SIZE] room: need ~$(numfmt --to=iec "$need_b") (estimate); $FW_DIR ($fstype) has $(numfmt --to=iec "$avail_b") free, MemAvailable $(numfmt --to=iec "$memavail_b")"
    [[ $avail_b -ge $need_b ]] || die "$FW_DIR has $(numfmt --to=iec "$avail_b") free, ~$(numfmt --to=iec "$need_b") needed for a $SIZE image"
    if [[ $fstype == tmpfs && $memavail_b -lt $need_b ]]; then
        die "$FW_DIR is tmpfs and MemAvailable is $(numfmt --to=iec "$memavail_b"), ~$(numfmt --to=iec "$need_b") needed"
    fi

    # ---- 1. image: sparse file, mkfs, kernel fill, unmount ----
    tb0=$(now)
    runc truncate -s "$SIZE" "$IMG" || die "cannot create a sparse $SIZE file in $FW_DIR"
    mkfs_opts=(-F -q)
    # More than 2^32-1 blocks of 4 KiB need 64bit (default in Debian's mke2fs.conf; say it anyway).
    [[ $SIZE_B -ge $((1 << 44)) ]] && mkfs_opts+=(-O 64bit)
    t0=$(now)
    runc mkfs.ext4 "${mkfs_opts[@]}" "$IMG" || die "mkfs.ext4 refused $SIZE"
    t1=$(now)
    mkfs_ms=$(ms_between "$t0" "$t1")
    res "image-$SIZE" mkfs_ms "$mkfs_ms" ms
    dumpe2fs -h "$IMG" 2>/dev/null | grep -E '^(Filesystem features|Block count|Block size|Inode count|Blocks per group|Flex block group size):' | sed 's/^/  /'

    echo "+ losetup -f --show $IMG"
    LOOP=$(losetup -f --show "$IMG") || die "losetup failed (free loop devices: $(losetup -f 2>&1))"
    LDEV=$(basename "$LOOP")
    runc mount -t ext4 -o noinit_itable "$LOOP" "$MNT"
    avail=$(df -B1 --output=avail "$MNT" | tail -1 | tr -d ' ')
    per=$((avail * FW_FILL_PCT / 100 / FW_FILES / 1048576 * 1048576))
    t0=$(now)
    for ((i = 0; i < FW_FILES; i++)); do
        runc fallocate -l "$per" "$MNT/fill$i"
        runc "$BIN/punchholes" "$MNT/fill$i" "$STRIDE_B" "$HOLE_B" >/dev/null
    done
    t1=$(now)
    fill_ms=$(ms_between "$t0" "$t1")
    res "image-$SIZE" fill_ms "$fill_ms" ms
    runc df -h "$MNT" | sed 's/^/  /'
    res "image-$SIZE" fill_level "$(df --output=pcent "$MNT" | tail -1 | tr -dc 0-9)" %used
    runc umount "$MNT"
    tb1=$(now)
    img_real=$(du -B1 "$IMG" | cut -f1)
    res "image-$SIZE" image_build_ms "$(ms_between "$tb0" "$tb1")" ms
    res "image-$SIZE" image_allocated_mib "$((img_real >> 20))" MiB
    log "[$SIZE] image built in $(calc "($tb1-$tb0)" %.1f) s (mkfs $(calc "$mkfs_ms/1000" %.1f) s, fill $(calc "$fill_ms/1000" %.1f) s); it holds $(numfmt --to=iec "$img_real") of $FW_DIR"
    V[img|$SIZE|build_s]=$(calc "($tb1-$tb0)" %.1f); V[img|$SIZE|mkfs_s]=$(calc "$mkfs_ms/1000" %.1f)
    V[img|$SIZE|fill_s]=$(calc "$fill_ms/1000" %.1f); V[img|$SIZE|mib]=$((img_real >> 20))

    # ---- 2. kernel: cold mount + first 4 KiB write+fsync, then cold mount + FW_LARGE ----
    log "[$SIZE] kernel, trial 1: cold mount + first 4 KiB write+fsync"
    kernel_trial "$LOOP" "$LDEV" k4k 4096 "$FW_SETTLE_S"
    kernel_results "$KL" 4k
    if [[ $FW_SETTLE_S -gt 0 ]]; then
        res "$KL" "reads_idle_${FW_SETTLE_S}s_after_first_write" "$K_R_SETTLE" reads
        res "$KL" "read_kib_idle_${FW_SETTLE_S}s_after_first_write" "$K_KIB_SETTLE" KiB
    fi
    res "$KL" reads_mount_session "$K_R_SESSION" "reads (mount to umount)"
    res "$KL" read_kib_mount_session "$K_KIB_SESSION" "KiB (mount to umount)"
    res "$KL" umount_ms "$K_UMOUNT_MS" ms
    V[k|$SIZE|reads_open]=$K_R_MOUNT; V[k|$SIZE|kib_open]=$K_KIB_MOUNT; V[k|$SIZE|reads_fw]=$K_R_FW
    V[k|$SIZE|ms0]=$(calc "$K_MOUNT_MS+$K_FW_MS" %.1f); V[k|$SIZE|mount_ms]=$K_MOUNT_MS; V[k|$SIZE|fw_ms]=$K_FW_MS
    V[k|$SIZE|reads_sess]=$K_R_SESSION; V[k|$SIZE|kib_sess]=$K_KIB_SESSION

    log "[$SIZE] kernel, trial 2: cold mount + first $FW_LARGE write+fsync"
    kernel_trial "$LOOP" "$LDEV" klarge "$LARGE_B"
    kernel_results "$KL-$FW_LARGE" "$LN"
    res "$KL-$FW_LARGE" first_write_extents "$K_EXTENTS" extents
    V[k|$SIZE|large_ms]=$K_FW_MS; V[k|$SIZE|extents]=$K_EXTENTS

    # ---- kernel under injected read latency (dm-delay), if the kernel has it ----
    if [[ -z $DM_WHY ]]; then
        DL=kernel-$SIZE-dmdelay
        sectors=$(blockdev --getsz "$LOOP")
        table="0 $sectors delay $LOOP 0 $FW_LATENCY_MS $LOOP 0 0"
        echo "+ dmsetup create $DMNAME --table '$table'"
        if dmsetup create "$DMNAME" --table "$table"; then
            DM_CREATED=1
            DDEV=$(basename "$(readlink -f "/dev/mapper/$DMNAME")")
            log "[$SIZE] kernel on dm-delay ($FW_LATENCY_MS ms per read): cold mount + first 4 KiB write+fsync"
            kernel_trial "/dev/mapper/$DMNAME" "$DDEV" kdelay4k 4096
            kernel_results "$DL" 4k
            V[k|$SIZE|msL]=$(calc "$K_MOUNT_MS+$K_FW_MS" %.1f)
            runc dmsetup remove "$DMNAME"; DM_CREATED=0
        else
            echo "NOTE|$KL|dmsetup create failed: the kernel-with-latency part is skipped"
        fi
    else
        # Not a measurement: what FW_LATENCY_MS per read would add if every read were serial.
        echo "NOTE|$KL|no dm-delay: kernel with ${FW_LATENCY_MS} ms reads not measured; serial upper bound for mount + first write = $(calc "${V[k|$SIZE|ms0]}+(${V[k|$SIZE|reads_open]}+${V[k|$SIZE|reads_fw]})*$FW_LATENCY_MS" %.0f) ms (measured time + reads x latency; the kernel overlaps many of these reads)"
    fi
    runc losetup -d "$LOOP"; LOOP=""

    # ---- still clean after the kernel's writes? ----
    t0=$(now)
    echo "+ e2fsck -fn $IMG"
    if fsck_out=$(e2fsck -fn "$IMG" 2>&1); then
        echo "NOTE|$KL|e2fsck -fn clean after the kernel runs ($(ms_between "$t0" "$(now)") ms): $(tail -1 <<<"$fsck_out")"
    else
        sed 's/^/  /' <<<"$fsck_out" | head -40
        die "e2fsck -fn found problems after the kernel runs on $SIZE"
    fi

    # ---- 3. rext4 on the same image ----
    if [[ $HAVE_REXT4 == 1 ]]; then
        echo "NOTE|rext4-$SIZE|same image as the kernel's runs, which left their files k4k and klarge: free space is smaller by $(( (4096 + LARGE_B) >> 20 )) MiB or so than the kernel had (acceptable); rext4 removes its own files after each run"
        runs=("rext4-$SIZE:$FW_LATENCY_MS:" "rext4-$SIZE-lat0:0:" "rext4-$SIZE-$FW_LARGE:$FW_LATENCY_MS:$FW_LARGE")
        for run in "${runs[@]}"; do
            IFS=: read -r lbl lat sz <<<"$run"
            args=(bench firstwrite "$IMG" --latency-ms "$lat" --label "$lbl")
            [[ -n $sz ]] && args+=(-s "$sz")
            drop
            log "[$SIZE] rext4: latency $lat ms${sz:+, $sz}"
            echo "+ $(shq "$REXT4" "${args[@]}")"
            out=$WORK/$lbl.out
            if ! "$REXT4" "${args[@]}" 2>&1 | tee "$out"; then
                echo "NOTE|$lbl|rext4 bench firstwrite failed (exit ${PIPESTATUS[0]})"; RC=1
            fi
        done
        get() { awk -F'|' -v m="$2" '$1=="RESULT" && $4==m {v=$5} END{if (v != "") print v+0}' "$WORK/$1.out" 2>/dev/null; }
        V[r|$SIZE|reads_open]=$(get "rext4-$SIZE" reads_at_open)
        V[r|$SIZE|kib_open]=$(get "rext4-$SIZE" read_kib_at_open)
        V[r|$SIZE|reads_fw]=$(get "rext4-$SIZE" reads_first_write)
        V[r|$SIZE|msL]=$(get "rext4-$SIZE" open_first_4k_write_fsync_ms)
        V[r|$SIZE|ms0]=$(get "rext4-$SIZE-lat0" open_first_4k_write_fsync_ms)
        V[r|$SIZE|extents]=$(get "rext4-$SIZE-$FW_LARGE" first_write_extents)
        V[r|$SIZE|large_ms]=$(get "rext4-$SIZE-$FW_LARGE" "first_${LN}_write_fsync_ms")
        echo "+ e2fsck -fn $IMG"
        if fsck_out=$(e2fsck -fn "$IMG" 2>&1); then
            echo "NOTE|rext4-$SIZE|e2fsck -fn clean after the rext4 runs: $(tail -1 <<<"$fsck_out")"
        else
            sed 's/^/  /' <<<"$fsck_out" | head -40
            echo "NOTE|rext4-$SIZE|e2fsck -fn NOT clean after the rext4 runs"; RC=1
        fi
    fi
    cleanup_size
done

# ---- 4. summary ----
echo
echo "Summary: kernel = mount -o noinit_itable of a loop device, open = mount; rext4 = bench firstwrite (its reads from the"
echo "${FW_LATENCY_MS} ms run); reads = read requests completed; 'lat' = ${FW_LATENCY_MS} ms per read (kernel: dm-delay$([[ -n $DM_WHY ]] && echo ', not available here'))"
fmt='| %-5s | %-6s | %10s | %9s | %12s | %13s | %15s | %20s | %11s |\n'
printf "$fmt" size tool "reads@open" "KiB@open" "reads@1st 4K" "open+4K ms" "open+4K ms, lat" "$FW_LARGE write+fsync ms" "$FW_LARGE extents"
printf "$fmt" ----- ------ ---------- --------- ------------ ------------- --------------- -------------------- -----------
for SIZE in "${SIZES[@]}"; do
    for t in k r; do
        [[ $t == r && $HAVE_REXT4 == 0 ]] && continue
        name=kernel; lt="no lat"; [[ $t == r ]] && { name=rext4; lt="lat"; }
        g() { local x=${V[$t|$SIZE|$1]:-}; echo "${x:-n/a}"; }
        printf "$fmt" "$SIZE" "$name" "$(g reads_open)" "$(g kib_open)" "$(g reads_fw)" "$(g ms0)" "$(g msL)" \
            "$(g large_ms) ($lt)" "$(g extents)"
    done
done
echo
for SIZE in "${SIZES[@]}"; do
    [[ -n ${V[img|$SIZE|build_s]:-} ]] || continue
    echo "$SIZE: image build ${V[img|$SIZE|build_s]} s (mkfs ${V[img|$SIZE|mkfs_s]} s, fill ${V[img|$SIZE|fill_s]} s), ${V[img|$SIZE|mib]} MiB allocated in $FW_DIR;" \
         "kernel mount ${V[k|$SIZE|mount_ms]} ms + first 4K ${V[k|$SIZE|fw_ms]} ms; reads mount..umount ${V[k|$SIZE|reads_sess]} (${V[k|$SIZE|kib_sess]} KiB)"
done
if [[ $HAVE_REXT4 == 0 ]]; then echo "rext4: skipped ($REXT4 has no 'bench firstwrite')"; fi
exit $RC
