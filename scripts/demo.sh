#!/usr/bin/env bash
# Show the main job on a default image: make a 64 MiB ext4 image with mkfs.ext4,
# put a few files in it with debugfs, then read it back with rext4 (no mount, no root).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v mkfs.ext4 >/dev/null || { echo "needs e2fsprogs (apt-get install e2fsprogs)"; exit 1; }
cargo build --release -q -p rext4-cli
R=target/release/rext4
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
img=$dir/demo.img
mkfs.ext4 -q -F "$img" 64M
echo "hello from inside an ext4 image" > "$dir/hello.txt"
debugfs -w "$img" >/dev/null 2>&1 <<DBG
mkdir docs
write $dir/hello.txt docs/hello.txt
symlink latest /docs/hello.txt
ea_set docs/hello.txt user.origin demo
DBG
set -x
$R info "$img" | head -12
$R ls -l "$img":/
$R cat "$img":/latest
$R stat "$img":/docs/hello.txt
$R cp -r "$img":/docs "$dir/out"
ls -l "$dir/out"
