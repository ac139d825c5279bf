#!/usr/bin/env bash
# Instructions the server runs per check: quotad's POST /v1/check against the bench's bare
# axum + redis-rs endpoint, counted by callgrind on the load bench (crates/quotad/benches/load.rs).
# Unlike checks per second, the count is the same whatever else the machine is doing, so it
# shows what a change to the check path costs even on a noisy machine.
#
#   scripts/instructions.sh            # needs valgrind; about 3 minutes
#
# What is counted: every task the server runtime's worker thread polls (the HTTP connections, the
# Redis connection's driver, and the daemon's own background tasks, which add little), divided by
# the checks made; start-up is left out. Whole-program optimisation inlines across crates, so the
# count is taken at the scheduler, where no task's frames are merged away.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "instructions.sh: valgrind is not installed" >&2; exit 1; }
bin=$(cargo bench -p quotad --bench load --no-run --message-format=json 2>/dev/null \
  | sed -n 's/.*"executable":"\([^"]*\/load-[^"]*\)".*/\1/p' | tail -1)
[ -x "$bin" ] || { echo "instructions.sh: could not build the load bench" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
conc=${QUOTAD_BENCH_CONCURRENCY:-16}

# inclusive FILE PATTERN: the largest inclusive count of a function whose line matches PATTERN.
inclusive() {
  callgrind_annotate --auto=no --inclusive=yes --threshold=100 "$1" \
    | grep -F -- "$2" | head -1 | awk '{gsub(",", "", $1); print $1 + 0}'
}

printf '%-7s %8s %16s\n' what checks "per check"
for who in bare quotad; do
  QUOTAD_BENCH_SECS=${QUOTAD_BENCH_SECS:-20} QUOTAD_BENCH_CONCURRENCY=$conc QUOTAD_BENCH_ONLY=$who \
    valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out/$who.%p" \
    "$bin" --bench >"$out/$who.log" 2>&1
  ops=$(awk -v w="$who" '$2 == w && $4 == "ops" {print $5}' "$out/$who.log")
  # The server runtime's worker is the busiest thread.
  f=$(ls -S "$out/$who".*-* | head -1)
  polls=$(inclusive "$f" 'tokio::runtime::scheduler::multi_thread::worker::Context::run_task')
  awk -v w="$who" -v n="$ops" -v p="$polls" 'BEGIN {printf "%-7s %8d %16.0f\n", w, n, p / n}'
done
