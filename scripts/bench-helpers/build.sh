#!/usr/bin/env bash
# Build the benchmark helpers (the C programs beside this script) into
# target/bench-helpers/ of the checkout, only those older than their source; prints that
# directory. The bench-*.sh scripts run them against the kernel's mounts, so both sides
# of a comparison come from this repository.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=$here/../../target/bench-helpers
mkdir -p "$out"
out=$(cd "$out" && pwd)
for src in "$here"/*.c; do
  bin=$out/$(basename "$src" .c)
  if [[ ! -x $bin || $src -nt $bin || $here/helpers.h -nt $bin ]]; then
    echo "+ gcc -O2 -Wall -Wextra -pthread -o $bin $src" >&2
    gcc -O2 -Wall -Wextra -pthread -o "$bin" "$src"
  fi
done
echo "$out"
