#!/usr/bin/env bash
# Install the tools the tests use (as root, via apt) and run every check:
# formatting, clippy, and the test suite. Tests that need root, loop devices,
# /dev/fuse or a tool print "SKIP: reason" where the machine cannot run them, and
# the end of the run lists them. With REXT4_REQUIRE_ALL=1 (CI) a skip fails its test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each skip appends "test<TAB>reason" here (rext4_testkit::skip): cargo test shows
# nothing of a passing test, so this is how the skips are counted.
skip_log=$(mktemp "${TMPDIR:-/tmp}/rext4-skips.XXXXXX")
export REXT4_SKIP_LOG=$skip_log
skip_summary() {
  local status=$? n tests
  n=$(wc -l <"$skip_log")
  tests=$(cut -f1 "$skip_log" | sort -u | wc -l)
  echo
  if [ "$n" -eq 0 ]; then
    echo "skipped: 0 tests"
  else
    echo "skipped: $tests tests ($n skips; REXT4_REQUIRE_ALL=1 makes them failures, except a capability this machine withholds):"
    sort "$skip_log" | uniq -c | sed 's/^ *\([0-9]*\) \([^	]*\)	\(.*\)$/  \2: \3 (x\1)/; s/ (x1)$//'
  fi
  rm -f "$skip_log"
  return "$status"
}
trap skip_summary EXIT

need=()
for cmd_pkg in mkfs.ext4:e2fsprogs fuse2fs:fuse2fs setfacl:acl setfattr:attr xfs_io:xfsprogs fusermount3:fuse3 \
    fio:fio rsync:rsync git:git cc:gcc make:make setpriv:util-linux bc:bc jq:jq python3:python3 \
    valgrind:valgrind sfdisk:fdisk qemu-img:qemu-utils zstd:zstd xz:xz-utils tar:tar gzip:gzip \
    sha256sum:coreutils nbdkit:nbdkit nbdcopy:libnbd-bin; do
  cmd=${cmd_pkg%%:*} pkg=${cmd_pkg##*:}
  command -v "$cmd" >/dev/null 2>&1 || need+=("$pkg")
done
# NBD images load libnbd at run time (the NBD tests serve images with nbdkit).
if ! ldconfig -p 2>/dev/null | grep -q 'libnbd\.so\.0'; then
  need+=(libnbd0)
fi
# The Python package's tests build it in a venv (python3 -m venv needs ensurepip).
if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
  need+=(python3-venv)
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "+ apt-get install ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "missing packages (${need[*]}); tests that need them will skip" >&2
  fi
fi

# The mount serves through FUSE-over-io_uring when the kernel offers it (Linux 6.14+,
# off by default): turn it on as root so the tests run that transport (the suites
# still run a /dev/fuse mount too). REXT4_TEST_URING=0 leaves the setting alone (the
# io_uring tests then skip, which REXT4_REQUIRE_ALL=1 makes failures).
uring=/sys/module/fuse/parameters/enable_uring
if [ "${REXT4_TEST_URING:-1}" = 1 ] && [ -w "$uring" ] && [ "$(cat "$uring")" != Y ]; then
  echo "+ echo Y > $uring  (FUSE over io_uring for the mounts under test)"
  echo Y > "$uring"
fi

# The C API's header (bindings/c/include/rext4.h) is checked against what this
# cbindgen generates (test c_api::header_is_current); another version may word it
# differently, so this one is installed when missing (a few minutes, once a machine).
cbindgen_version=0.29.4
if [ "$(cbindgen --version 2>/dev/null)" != "cbindgen $cbindgen_version" ]; then
  echo "+ cargo install cbindgen --version $cbindgen_version --locked"
  cargo install -q cbindgen --version "$cbindgen_version" --locked --force
fi
case ":$PATH:" in *":${CARGO_HOME:-$HOME/.cargo}/bin:"*) ;; *) PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH" ;; esac

# The repository stands alone (a clone with nothing beside it): no test, fixture or
# script may reach outside it for what it needs.
echo "+ no reference to a ../shared checkout"
if grep -rnI --exclude-dir=target --exclude=test.sh -e '\.\./shared' crates bindings scripts .ci; then
  echo "the lines above reach outside the repository (../shared): bring what they need in" >&2
  exit 1
fi

# The vendored fuser (vendor/fuser) is a workspace member: these three cover it too.
echo "+ cargo fmt --check"
cargo fmt --all -- --check
echo "+ cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
# cargo test builds no cdylib: the C API's test links the example against it.
echo "+ cargo build -p rext4-c"
cargo build -q -p rext4-c
echo "+ cargo test"
cargo test --workspace -- --test-threads=2

# The Python package (bindings/python), installed as a user installs it — `pip install
# ./bindings/python` (maturin builds it in this workspace's target/) — into a fresh
# venv under target/, then its pytest suite (differential checks against the kernel,
# e2fsck, every error mapped). A missing python3 fails here under REXT4_REQUIRE_ALL.
echo "+ python bindings: pip install ./bindings/python; pytest bindings/python/tests"
if command -v python3 >/dev/null 2>&1; then
  venv=target/pyvenv-test
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check pytest
  "$venv/bin/pip" install -q --disable-pip-version-check ./bindings/python
  "$venv/bin/python" -m pytest -q -p no:cacheprovider bindings/python/tests
elif [ "${REXT4_REQUIRE_ALL:-0}" != 0 ]; then
  echo "python3 missing: the Python bindings cannot be tested" >&2
  exit 1
else
  printf 'bindings/python\tpython3 not installed\n' >>"$skip_log"
  echo "SKIP: python3 not installed (Python bindings untested)"
fi
