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
    fio:fio rsync:rsync git:git cc:gcc make:make setpriv:util-linux bc:bc jq:jq; do
  cmd=${cmd_pkg%%:*} pkg=${cmd_pkg##*:}
  command -v "$cmd" >/dev/null 2>&1 || need+=("$pkg")
done
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

# The vendored fuser (vendor/fuser) is a workspace member: these three cover it too.
echo "+ cargo fmt --check"
cargo fmt --all -- --check
echo "+ cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "+ cargo test"
cargo test --workspace -- --test-threads=2
