#!/usr/bin/env bash
# A long fuzz and crash campaign, for a nightly job or a spare machine: random seeds of
# the read fuzz (tests/fuzz.rs), the write and journal-replay fuzz (tests/fuzz_write.rs)
# and the crash sweep of random operations (tests/crash.rs, crash_random_ops), until the
# time is up (the run in progress then finishes: a few minutes each). CI runs a few hundred cases of each with fixed seeds; the bugs these
# found (a stack overflow on a directory loop, a leaf written with an empty name,
# allocator counters wrapping) each needed a seed CI never ran.
#
#   scripts/fuzz-campaign.sh [MINUTES] [OUTDIR]      # defaults: 60, target/fuzz-campaign
#
# Built in release with debug assertions and overflow checks (their own target dir, so
# the normal release build stays as it was): a wrapped counter or a broken invariant
# fails the run instead of writing a wrong value. One line per run goes to
# OUTDIR/summary; a failing run keeps its log (OUTDIR/<test>-<seed>.log) and prints the
# command that repeats it. Exit 1 when any run failed, 0 otherwise.
set -euo pipefail

minutes=${1:-60}
cd "$(dirname "$0")/.."
out=${2:-target/fuzz-campaign}
mkdir -p "$out"
out=$(cd "$out" && pwd)
target=${CARGO_TARGET_DIR:-target}/fuzz-campaign-build

echo "building the fuzz and crash tests (release, debug assertions, overflow checks)"
bins=$(CARGO_TARGET_DIR=$target \
    CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true \
    CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true \
    cargo test --release -p rext4 --test fuzz --test fuzz_write --test crash --no-run \
    --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')
bin_of() { echo "$bins" | grep "/deps/$1-" | head -1; }
fuzz=$(bin_of fuzz)
fuzz_write=$(bin_of fuzz_write)
crash=$(bin_of crash)
for b in "$fuzz" "$fuzz_write" "$crash"; do
    [ -x "$b" ] || { echo "fuzz-campaign: a test binary was not built" >&2; exit 1; }
done

deadline=$(($(date +%s) + minutes * 60))
failed=0
runs=0
# run NAME SEED TIMEOUT ENV... -- BINARY ARGS...: one seed of one test, logged.
run() {
    local name=$1 seed=$2 limit=$3
    shift 3
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local log="$out/$name-$seed.log"
    runs=$((runs + 1))
    local rc=0
    env "${envs[@]}" timeout "$limit" "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -eq 0 ]; then
        echo "$(date -u +%FT%TZ) $name $seed ok" >>"$out/summary"
        rm -f "$log"
    else
        failed=$((failed + 1))
        echo "$(date -u +%FT%TZ) $name $seed FAIL (exit $rc) $log" >>"$out/summary"
        echo "FAIL: $name seed $seed; repeat with: ${envs[*]} $* (log: $log)"
    fi
}

echo "running seeds for $minutes minutes; summary in $out/summary"
while [ "$(date +%s)" -lt "$deadline" ]; do
    seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
    run fuzz_write "$seed" 1800 REXT4_FUZZ_SEED="$seed" REXT4_FUZZ_CASES=2000 -- "$fuzz_write"
    [ "$(date +%s)" -lt "$deadline" ] || break
    run fuzz "$seed" 1800 REXT4_FUZZ_SEED="$seed" REXT4_FUZZ_CASES=3000 -- "$fuzz"
    [ "$(date +%s)" -lt "$deadline" ] || break
    run crash_random_ops "$seed" 1800 REXT4_CRASH_SEED="$seed" REXT4_CRASH_STEPS=120 \
        -- "$crash" --exact crash_random_ops
done
echo "fuzz-campaign: $runs runs, $failed failed (summary: $out/summary)"
[ "$failed" -eq 0 ]
