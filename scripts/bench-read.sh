#!/usr/bin/env bash
# Read benchmark (not a test): rext4 against the kernel (loop mount) and fuse2fs, in one run.
#
#   sudo ./scripts/bench-read.sh                 # defaults: 1 GiB file, 20,000 entries, 3 runs
#   sudo FILE_MB=256 DIR_ENTRIES=5000 RUNS=5 ./scripts/bench-read.sh
#
# What it does:
#   1. builds target/release/rext4 (cargo, no-op when up to date);
#   2. makes an ext4 image (mkfs.ext4 defaults, 4 KiB blocks) in a temp dir, loop-mounts it
#      read-write, writes FILE_MB MiB from /dev/urandom to /big.bin and DIR_ENTRIES empty
#      files to /dir, unmounts;
#   3. checks correctness once: sha256 of `rext4 cat` = sha256 through the kernel mount,
#      and `rext4 ls` names = kernel `ls` names;
#   4. for each reader (rext4, kernel ro loop mount, fuse2fs ro mount) and each workload
#      (cat the file, ls the dir, ls -l the dir, stat-all the dir, open/mount) times RUNS
#      cold runs (remount for kernel/fuse2fs, then `sync; echo 3 > /proc/sys/vm/drop_caches`,
#      then the timed program's binary is read back in so exec is not what is measured)
#      and RUNS warm runs (same mount, nothing dropped), and reports medians;
#   5. prints RESULT|label|workload|metric|value|unit lines, ratios rext4/kernel and
#      rext4/fuse2fs, and a summary table.
#
# Workload commands (stdout goes to /dev/null in the timed runs):
#   cat     rext4 cat IMG:/big.bin        | cat MNT/big.bin
#   ls      rext4 ls IMG:/dir             | ls MNT/dir                  (LC_ALL=C, no stat)
#   ls-l    rext4 ls -l IMG:/dir          | ls -l MNT/dir               (statx + 2 getxattr per entry)
#   stat    (rext4: same as ls-l)         | find MNT/dir -mindepth 1 -printf ...  (one stat per entry)
#   open    rext4 info IMG                | mount -o ro / fuse2fs start until mounted (cold only)
#
# Knobs (env): FILE_MB=1024 DIR_ENTRIES=20000 RUNS=3 IMG_MB=max(2048,FILE_MB+1024)
#   WORK_DIR=/tmp (where the temp image lives)  READERS="rext4 kernel fuse2fs"
#   REXT4=path/to/rext4 (skip the cargo build)  WORKLOADS="cat ls ls-l stat open"
# Needs root (loop mount, drop_caches), e2fsprogs, fuse2fs, fuse3, util-linux.
# Everything it creates (mounts, loop device, fuse2fs daemon, temp dir with the image) is
# removed on exit, including on failure or Ctrl-C.
set -euo pipefail
export LC_ALL=C

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FILE_MB=${FILE_MB:-1024}
DIR_ENTRIES=${DIR_ENTRIES:-20000}
RUNS=${RUNS:-3}
IMG_MB=${IMG_MB:-$((FILE_MB + 1024 > 2048 ? FILE_MB + 1024 : 2048))}
WORK_DIR=${WORK_DIR:-/tmp}
READERS=${READERS:-rext4 kernel fuse2fs}
WORKLOADS=${WORKLOADS:-cat ls ls-l stat open}

case "${1:-}" in
-h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
esac

log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() {
    printf 'ERROR: %s\n' "$*" >&2
    exit 1
}
# Shell-quote a command line readably, print it with "+ ", run it.
shq() {
    local a out=""
    for a in "$@"; do
        if [[ $a =~ ^[A-Za-z0-9_./=:,+%@-]+$ ]]; then out+="$a "; else out+="'${a//\'/\'\\\'\'}' "; fi
    done
    printf '%s' "${out% }"
}
runc() {
    printf '+ %s\n' "$(shq "$@")"
    "$@"
}
result() { printf 'RESULT|%s|%s|%s|%s|%s\n' "$@"; }
note() { printf 'NOTE|%s|%s\n' "$1" "$2"; }
calc() { awk "BEGIN{printf \"${2:-%.1f}\", ($1)}"; }
# a / b with two decimals, or four when the ratio is below 0.1.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{ r = a / b; printf (r < 0.1 ? "%.4f" : "%.2f"), r }'; }
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END{ if (NR % 2) printf "%.1f", a[(NR+1)/2]; else printf "%.1f", (a[NR/2]+a[NR/2+1])/2 }'; }

[[ $(id -u) -eq 0 ]] || die "run as root (loop mounts and drop_caches need it): sudo $0"
for c in mkfs.ext4 losetup mount umount mountpoint fuse2fs fusermount3 sha256sum find awk; do
    command -v "$c" >/dev/null 2>&1 || die "missing tool: $c (apt-get install e2fsprogs fuse2fs fuse3 util-linux)"
done
[[ $RUNS =~ ^[1-9][0-9]*$ && $FILE_MB =~ ^[1-9][0-9]*$ && $DIR_ENTRIES =~ ^[0-9]+$ ]] ||
    die "RUNS, FILE_MB and DIR_ENTRIES must be positive integers"

# ---- cleanup: always unmount, stop the daemon, detach the loop device, remove the image ----
TMP="" LOOP="" FUSE_PID="" MNT_K="" MNT_F=""
cleanup() {
    local rc=$?
    set +e
    trap - EXIT INT TERM
    if [[ -n $MNT_F ]] && mountpoint -q "$MNT_F"; then
        fusermount3 -u "$MNT_F" 2>/dev/null || umount "$MNT_F" 2>/dev/null || umount -l "$MNT_F"
    fi
    if [[ -n $FUSE_PID ]] && kill -0 "$FUSE_PID" 2>/dev/null; then
        kill "$FUSE_PID" 2>/dev/null
        wait "$FUSE_PID" 2>/dev/null
    fi
    if [[ -n $MNT_K ]] && mountpoint -q "$MNT_K"; then umount "$MNT_K" || umount -l "$MNT_K"; fi
    [[ -n $LOOP ]] && losetup -d "$LOOP"
    [[ -n $TMP && -d $TMP ]] && rm -rf "$TMP"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- build ----
if [[ -z ${REXT4:-} ]]; then
    command -v cargo >/dev/null 2>&1 || die "cargo not found (or set REXT4=/path/to/rext4)"
    (cd "$REPO" && runc cargo build --release -q -p rext4-cli)
    REXT4=$REPO/target/release/rext4
fi
[[ -x $REXT4 ]] || die "no rext4 binary at $REXT4"

TMP=$(mktemp -d "$WORK_DIR/bench-read.XXXXXX")
IMG=$TMP/read.img
MNT_K=$TMP/mnt-kernel
MNT_F=$TMP/mnt-fuse2fs
mkdir "$MNT_K" "$MNT_F"
avail_mb=$(df -Pm "$TMP" | awk 'NR==2{print $4}')
((avail_mb > IMG_MB + 64)) || die "$TMP has ${avail_mb} MiB free, the image needs ${IMG_MB} MiB"

note machine "nproc=$(nproc) mem=$(free -g | awk '/^Mem:/{print $2}')GiB kernel=$(uname -r) image_on=$(df -PT "$TMP" | awk 'NR==2{print $2" "$1}') cpu=$(awk -F': ' '/model name/{print $2; exit}' /proc/cpuinfo)"
note config "source=$(git -C "$REPO" describe --always --dirty 2>/dev/null || echo '?') FILE_MB=$FILE_MB DIR_ENTRIES=$DIR_ENTRIES RUNS=$RUNS IMG_MB=$IMG_MB rext4=$REXT4 fuse2fs=$(dpkg-query -W -f='${Version}' fuse2fs 2>/dev/null || echo '?')"

# ---- make the image ----
log "making a ${IMG_MB} MiB image in $TMP"
runc truncate -s "${IMG_MB}M" "$IMG"
# Initialise inode tables and journal now so no ext4lazyinit thread writes during the timings.
runc mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$IMG"
LOOP=$(losetup --find --show "$IMG")
printf '+ losetup --find --show %s   # -> %s\n' "$IMG" "$LOOP"
backing=$(df -P "$TMP" | awk 'NR==2{print $1}')
note config "read_ahead_kb: $LOOP=$(cat "/sys/block/${LOOP#/dev/}/queue/read_ahead_kb") $backing=$(cat "/sys/block/${backing#/dev/}/queue/read_ahead_kb" 2>/dev/null || echo '?') (loop device uses buffered I/O on the image file)"
runc mount "$LOOP" "$MNT_K"
log "writing ${FILE_MB} MiB of random data and ${DIR_ENTRIES} empty files"
printf '+ head -c %sM /dev/urandom > %s\n' "$FILE_MB" "$MNT_K/big.bin"
head -c "${FILE_MB}M" /dev/urandom >"$MNT_K/big.bin"
runc mkdir "$MNT_K/dir"
printf '+ for i in 1..%s: : > %s/dir/file-NNNNNN\n' "$DIR_ENTRIES" "$MNT_K"
for ((i = 1; i <= DIR_ENTRIES; i++)); do
    printf -v name 'file-%06d' "$i"
    : >"$MNT_K/dir/$name"
done
runc sync
runc umount "$MNT_K"

# ---- correctness, once ----
log "verifying rext4 against the kernel"
runc mount -o ro "$LOOP" "$MNT_K"
sha_k=$(sha256sum <"$MNT_K/big.bin" | cut -d' ' -f1)
ls "$MNT_K/dir" >"$TMP/names.kernel"
runc umount "$MNT_K"
sha_r=$("$REXT4" cat "$IMG:/big.bin" | sha256sum | cut -d' ' -f1)
"$REXT4" ls "$IMG:/dir" >"$TMP/names.rext4"
printf '+ sha256: kernel %s  rext4 %s\n' "$sha_k" "$sha_r"
[[ $sha_k == "$sha_r" ]] || die "rext4 cat differs from the kernel's read of big.bin"
cmp -s "$TMP/names.kernel" "$TMP/names.rext4" || die "rext4 ls names differ from the kernel's ls"
n_names=$(wc -l <"$TMP/names.rext4")
((n_names == DIR_ENTRIES)) || die "rext4 ls lists $n_names names, expected $DIR_ENTRIES"
note verify "sha256 of rext4 cat = kernel ($sha_r); ls names identical ($n_names)"

# ---- mounting helpers ----
drop_caches() {
    sync
    echo 3 >/proc/sys/vm/drop_caches
}
kernel_mount() { mount -o ro "$LOOP" "$MNT_K"; }
kernel_umount() { if mountpoint -q "$MNT_K"; then umount "$MNT_K"; fi; }
fuse_mount() {
    fuse2fs "$IMG" "$MNT_F" -f -o ro,fakeroot >>"$TMP/fuse2fs.log" 2>&1 &
    FUSE_PID=$!
    local i
    for ((i = 0; i < 6000; i++)); do
        mountpoint -q "$MNT_F" && return 0
        kill -0 "$FUSE_PID" 2>/dev/null || die "fuse2fs exited: $(cat "$TMP/fuse2fs.log")"
        sleep 0.005
    done
    die "fuse2fs did not mount within 30 s"
}
fuse_umount() {
    if mountpoint -q "$MNT_F"; then fusermount3 -u "$MNT_F" || umount "$MNT_F"; fi
    if [[ -n $FUSE_PID ]]; then
        wait "$FUSE_PID" 2>/dev/null || true
        FUSE_PID=""
    fi
}
# CPU time (ms) the fuse2fs daemon has used so far; 0 when none runs.
CLK_TCK=$(getconf CLK_TCK)
fuse_cpu_ms() {
    if [[ -n $FUSE_PID && -r /proc/$FUSE_PID/stat ]]; then
        awk -v hz="$CLK_TCK" '{sub(/^.*\) /, ""); printf "%.0f", ($12 + $13) * 1000 / hz}' "/proc/$FUSE_PID/stat"
    else
        echo 0
    fi
}

# The command for READER and WORKLOAD, as words in CMD (empty when not applicable).
set_cmd() {
    local mnt
    CMD=()
    case $1 in
    rext4)
        case $2 in
        cat) CMD=("$REXT4" cat "$IMG:/big.bin") ;;
        ls) CMD=("$REXT4" ls "$IMG:/dir") ;;
        ls-l | stat) CMD=("$REXT4" ls -l "$IMG:/dir") ;;
        open) CMD=("$REXT4" info "$IMG") ;;
        esac
        return
        ;;
    kernel) mnt=$MNT_K ;;
    fuse2fs) mnt=$MNT_F ;;
    esac
    case $2 in
    cat) CMD=(cat "$mnt/big.bin") ;;
    ls) CMD=(ls "$mnt/dir") ;;
    ls-l) CMD=(ls -l "$mnt/dir") ;;
    stat) CMD=(find "$mnt/dir" -mindepth 1 -maxdepth 1 -printf '%M %n %U %G %s %T@ %f\n') ;;
    esac
}

# After a cache drop, read the program about to be timed (binary, and the libraries
# `--version` loads) back into the page cache: cold runs measure the filesystem, not exec.
warm_program() {
    local bin
    bin=$(command -v "${CMD[0]}")
    cat "$bin" >/dev/null
    "$bin" --version >/dev/null 2>&1 || true
}

# Make READER ready for a cold run: (re)mounted, then every clean cache dropped, then
# the program to be timed read back in.
prep_cold() {
    case $1 in
    kernel)
        kernel_umount
        kernel_mount
        ;;
    fuse2fs)
        fuse_umount
        fuse_mount
        ;;
    esac
    drop_caches
    warm_program
}
ensure_mounted() {
    case $1 in
    kernel) mountpoint -q "$MNT_K" || kernel_mount ;;
    fuse2fs) mountpoint -q "$MNT_F" || fuse_mount ;;
    esac
}
unmount_reader() {
    case $1 in
    kernel) kernel_umount ;;
    fuse2fs) fuse_umount ;;
    esac
}

# Time CMD once; sets T_MS (wall), C_MS (user+sys of the command), D_MS (fuse2fs daemon CPU).
time_cmd() {
    local TIMEFORMAT='%3U %3S' t0 t1 d0 d1 u s
    d0=$(fuse_cpu_ms)
    t0=$EPOCHREALTIME
    if ! { time "${CMD[@]}" >/dev/null 2>"$TMP/cmd.err"; } 2>"$TMP/time.out"; then
        cat "$TMP/cmd.err" >&2
        die "failed: $(shq "${CMD[@]}")"
    fi
    t1=$EPOCHREALTIME
    d1=$(fuse_cpu_ms)
    read -r u s <"$TMP/time.out"
    T_MS=$(calc "($t1 - $t0) * 1000")
    C_MS=$(calc "($u + $s) * 1000")
    D_MS=$((d1 - d0))
}
# Time READER's open/mount step (cold only); sets T_MS, C_MS, D_MS.
time_open() {
    local t0 t1
    case $1 in
    rext4)
        drop_caches
        warm_program
        time_cmd
        return
        ;;
    kernel)
        kernel_umount
        drop_caches
        CMD=(mount) && warm_program
        t0=$EPOCHREALTIME
        kernel_mount
        t1=$EPOCHREALTIME
        ;;
    fuse2fs)
        fuse_umount
        drop_caches
        CMD=(fuse2fs) && warm_program
        t0=$EPOCHREALTIME
        fuse_mount
        t1=$EPOCHREALTIME
        ;;
    esac
    T_MS=$(calc "($t1 - $t0) * 1000")
    C_MS=0 D_MS=0
}

declare -A TIMES CPU DCPU
record() { # key
    TIMES[$1]+="$T_MS "
    CPU[$1]+="$C_MS "
    DCPU[$1]+="$D_MS "
    printf 'RUN|%s|wall_ms=%s cmd_cpu_ms=%s fuse2fs_cpu_ms=%s\n' "$1" "$T_MS" "$C_MS" "$D_MS"
}

# ---- the measurements ----
note load "before: $(cut -d' ' -f1-3 /proc/loadavg) (1/5/15-min load average; other work on the machine skews timings)"
for reader in $READERS; do
    case $reader in rext4 | kernel | fuse2fs) ;; *) die "unknown reader $reader" ;; esac
    for wl in $WORKLOADS; do
        case $wl in cat | ls | ls-l | stat | open) ;; *) die "unknown workload $wl" ;; esac
        set_cmd "$reader" "$wl"
        if [[ $wl == open ]]; then
            case $reader in
            rext4) printf '+ %s   # cold, x%s\n' "$(shq "${CMD[@]}")" "$RUNS" ;;
            kernel) printf '+ mount -o ro %s %s   # cold, x%s\n' "$LOOP" "$MNT_K" "$RUNS" ;;
            fuse2fs) printf '+ fuse2fs %s %s -f -o ro,fakeroot   # until mounted, cold, x%s\n' "$IMG" "$MNT_F" "$RUNS" ;;
            esac
            for ((r = 1; r <= RUNS; r++)); do
                time_open "$reader"
                record "$reader|$wl|cold"
            done
            continue
        fi
        log "$reader $wl"
        printf '+ %s > /dev/null   # cold and warm, x%s each\n' "$(shq "${CMD[@]}")" "$RUNS"
        for ((r = 1; r <= RUNS; r++)); do
            prep_cold "$reader"
            time_cmd
            record "$reader|$wl|cold"
        done
        ensure_mounted "$reader" # the last cold run warmed the caches
        for ((r = 1; r <= RUNS; r++)); do
            time_cmd
            record "$reader|$wl|warm"
        done
    done
    unmount_reader "$reader"
done

note load "after: $(cut -d' ' -f1-3 /proc/loadavg)"

# ---- results ----
wl_name() {
    case $1 in
    cat) echo "cat_${FILE_MB}MiB" ;;
    ls) echo "ls_${DIR_ENTRIES}" ;;
    ls-l) echo "ls-l_${DIR_ENTRIES}" ;;
    stat) echo "stat_${DIR_ENTRIES}" ;;
    open) echo "open" ;;
    esac
}
declare -A MED
echo
for reader in $READERS; do
    for wl in $WORKLOADS; do
        for phase in cold warm; do
            k="$reader|$wl|$phase"
            [[ -n ${TIMES[$k]:-} ]] || continue
            # shellcheck disable=SC2086
            m=$(median ${TIMES[$k]})
            MED[$k]=$m
            w=$(wl_name "$wl")
            result "$reader" "$w" "${phase}_wall_median" "$m" ms
            # shellcheck disable=SC2086
            result "$reader" "$w" "${phase}_cmd_cpu_median" "$(median ${CPU[$k]})" ms
            if [[ $reader == fuse2fs && $wl != open ]]; then
                # shellcheck disable=SC2086
                result "$reader" "$w" "${phase}_daemon_cpu_median" "$(median ${DCPU[$k]})" ms
            fi
            if [[ $wl == cat ]]; then
                result "$reader" "$w" "${phase}_throughput" "$(calc "$FILE_MB / ($m / 1000)")" MiB/s
            fi
        done
    done
done
for other in kernel fuse2fs; do
    for wl in $WORKLOADS; do
        for phase in cold warm; do
            a=${MED[rext4|$wl|$phase]:-} b=${MED[$other|$wl|$phase]:-}
            [[ -n $a && -n $b ]] || continue
            result "rext4/$other" "$(wl_name "$wl")" "${phase}_time_ratio" "$(ratio "$a" "$b")" x
        done
    done
done

fmt_cell() { # median_ms workload
    [[ -n $1 ]] || {
        printf -- '-'
        return
    }
    if [[ $2 == cat ]]; then
        printf '%s s (%s MiB/s)' "$(calc "$1 / 1000" %.2f)" "$(calc "$FILE_MB / ($1 / 1000)" %.0f)"
    else
        printf '%s ms' "$1"
    fi
}
echo
echo "Medians of $RUNS runs (wall time; cat also as MiB/s). ratio = rext4 time / other time (>1: rext4 slower)."
printf '%-10s %-6s' workload phase
for reader in $READERS; do printf ' | %-22s' "$reader"; done
for other in kernel fuse2fs; do [[ " $READERS " == *" rext4 "* && " $READERS " == *" $other "* ]] && printf ' | %-14s' "rext4/$other"; done
echo
for wl in $WORKLOADS; do
    for phase in cold warm; do
        [[ $wl == open && $phase == warm ]] && continue
        printf '%-10s %-6s' "$(wl_name "$wl")" "$phase"
        for reader in $READERS; do printf ' | %-22s' "$(fmt_cell "${MED[$reader|$wl|$phase]:-}" "$wl")"; done
        for other in kernel fuse2fs; do
            [[ " $READERS " == *" rext4 "* && " $READERS " == *" $other "* ]] || continue
            a=${MED[rext4|$wl|$phase]:-} b=${MED[$other|$wl|$phase]:-}
            if [[ -n $a && -n $b ]]; then printf ' | %-14s' "$(ratio "$a" "$b")"; else printf ' | %-14s' -; fi
        done
        echo
    done
done
echo "(rext4 stat_ = rext4 ls -l; kernel/fuse2fs stat_ = find -printf, one stat per entry and no xattr calls."
echo " open = rext4 info / mount -o ro / fuse2fs start until mounted."
echo " cmd_cpu = user+sys of the timed command; daemon_cpu = fuse2fs CPU, in ${CLK_TCK} Hz ticks.)"
