#!/usr/bin/env bash
# Python package benchmark (not a test): rext4's Python API against a kernel loop mount
# read with Python's own open()/os.walk, in one run; thread scaling through one image.
#
#   sudo ./scripts/bench-python.sh
#
# Installs the package as a user does (pip install ./bindings/python, a release build)
# into target/pyvenv-bench, then runs bindings/python/bench/bench.py on a 3 GiB image in
# a temp dir (WORK_DIR, default /tmp): a 1 GiB file (cold and warm reads in 1 MiB
# reads), a directory of 20,000 entries (walk + lstat of each, cold and warm), two
# 256 MiB files read by one thread then by two. Prints Markdown tables
# (docs/BENCHMARKS.md keeps a run). Needs root (loop mounts, drop_caches), e2fsprogs.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/pyvenv-bench
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check ./bindings/python
work=$(mktemp -d "${WORK_DIR:-/tmp}/rext4-pybench.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" bindings/python/bench/bench.py "$work"
