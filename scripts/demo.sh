#!/usr/bin/env bash
# rext4's main job in a minute: make an ext4 image from a directory (rext4 mkfs -d),
# look inside it, copy files in and out, write with the xfs_io-like shell, and, where
# FUSE allows, mount it and use ordinary tools on it. Needs only cargo; e2fsprogs
# (e2fsck) is used, when installed, for the final check of the image.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p rext4-cli
R=$(realpath -m "${CARGO_TARGET_DIR:-target}")/release/rext4
dir=$(mktemp -d)
mnt=$dir/mnt
cleanup() {
    mountpoint -q "$mnt" 2>/dev/null && { "$R" umount "$mnt" || fusermount3 -u "$mnt"; }
    rm -rf "$dir"
}
trap cleanup EXIT
img=$dir/demo.img

# A real directory to put in the image: bash's documentation, or a small tree.
src=/usr/share/doc/bash
if [ ! -d "$src" ]; then
    src=$dir/src
    mkdir -p "$src/notes"
    echo "hello from inside an ext4 image" > "$src/hello.txt"
    seq 1 1000 > "$src/notes/numbers"
    ln -s hello.txt "$src/latest"
fi
# A small text file of it to show.
first=$(cd "$src" && find . -type f ! -name '*.gz' -size -4k | sort | head -1)
first=${first#./}

set -x
$R mkfs -q -d "$src" "$img" 64M            # mkfs.ext4 -d, no root needed
$R info "$img" | head -8                   # the superblock, like dumpe2fs -h
$R ls -l "$img":/
$R stat "$img:/$first"
$R cat "$img:/$first"
echo "written by rext4 cp" > "$dir/note.txt"
$R cp -v "$dir/note.txt" "$img":/           # a copy in...
$R cp -r "$img":/ "$dir/out"               # ...and the whole tree out again
diff -r "$src" "$dir/out" --exclude=lost+found --exclude=note.txt && echo "same tree"
$R io -f -c 'pwrite -S 0x61 0 64k' -c fsync -c 'fiemap -v' "$img":/io.bin
{ set +x; } 2>/dev/null

# A FUSE mount, used with ordinary tools: needs /dev/fuse, and root or fusermount3.
if [ -w /dev/fuse ] && { [ "$(id -u)" = 0 ] || command -v fusermount3 >/dev/null; }; then
    mkdir "$mnt"
    set -x
    $R mount "$img" "$mnt"
    ls "$mnt"
    cat "$mnt/note.txt"
    cp "$dir/note.txt" "$mnt/copy-through-the-mount.txt"
    df -h "$mnt"
    $R umount "$mnt"                       # returns once the image is closed and clean
    $R ls "$img":/
    { set +x; } 2>/dev/null
else
    echo "skipping the mount: /dev/fuse is not usable here (or no fusermount3 without root)"
fi

if command -v e2fsck >/dev/null || [ -x /sbin/e2fsck ]; then
    PATH=$PATH:/sbin:/usr/sbin e2fsck -fn "$img"
else
    echo "skipping e2fsck -fn: e2fsprogs is not installed"
fi
