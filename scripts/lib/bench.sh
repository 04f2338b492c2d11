# Helpers for scripts/bench-*.sh (source it). Output conventions:
#   RESULT|<label>|<workload>|<metric>|<value>|<unit>   one measured figure
#   NOTE|<label>|<text>                                   something a reader must know
#   + <command line>                                      each command that matters
# BIN is where scripts/bench-helpers/build.sh puts the C helpers (target/bench-helpers).

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=$REPO/target/bench-helpers

log() { printf '[%s] %s\n' "$(date +%T)" "$*"; }
die() { printf 'ERROR: %s\n' "$*" >&2; exit 1; }
# need CMD...: fail at once, naming the first missing tool.
need() { local c; for c in "$@"; do command -v "$c" >/dev/null 2>&1 || die "missing tool: $c"; done; }
# Quote a command line for the "+ " echo: bare words stay bare.
shq() {
  local a s=""
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./=:,+%@-]+$ ]]; then s+="$a "; else s+="'${a//\'/\'\\\'\'}' "; fi
  done
  printf '%s' "${s% }"
}
# runc CMD...: echo the command, then run it.
runc() { printf '+ %s\n' "$(shq "$@")"; "$@"; }
# Seconds since the epoch with microseconds (no fork), and milliseconds between two.
now() { printf '%s' "$EPOCHREALTIME"; }
ms_between() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.1f", (b-a)*1000}'; }
# calc EXPR [FORMAT]: an awk expression, printed with FORMAT (default %.1f).
calc() { awk "BEGIN{printf \"${2:-%.1f}\", ($1)}"; }
# kv KEY TEXT: the value of KEY=VALUE in TEXT.
kv() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p" <<<"$2" | head -1; }
# Write back and drop the host's caches (root), so a cold phase starts cold.
drop_caches() { [[ $(id -u) -eq 0 ]] || return 0; sync; echo 3 >/proc/sys/vm/drop_caches; }
# Build the C helpers into $BIN (only what changed).
ensure_built() { "$REPO/scripts/bench-helpers/build.sh" >/dev/null || die "building the bench helpers failed"; }
# The anchors' scripts (kernel, xfs, fuse2fs runs of the seed workloads) live outside
# this repository: `anchors DIR` prints their bench/ directory when REXT4_SHARED names a
# checkout holding them, else says once (a NOTE) that only rext4's side runs, and fails.
anchors() {
  local d=${REXT4_SHARED:+$REXT4_SHARED/bench}
  if [[ -n $d && -d $d ]]; then printf '%s' "$d"; return 0; fi
  printf 'NOTE|anchors|the anchors'"'"' scripts are not here (set REXT4_SHARED to their checkout): %s\n' "$1" >&2
  return 1
}
