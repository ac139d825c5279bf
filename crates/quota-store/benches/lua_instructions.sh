#!/usr/bin/env bash
# Instructions Redis executes per EVALSHA of lua/token_bucket.lua, of the contract floor and of
# the seed-style baseline (benches/lua/), counted by callgrind inside redis-server's
# evalShaCommand. Deterministic to a fraction of a percent, where the µs of
# `cargo bench -p quota-store --bench store` move with the host's load; the µs ratios follow the
# instruction ratios on a hot key, and on random keys memory adds to the µs.
#
#   crates/quota-store/benches/lua_instructions.sh [calls per run] [another token_bucket.lua]
#       [another sliding_window.lua]
#
# Each run starts redis-server under valgrind on a free loopback port and sends the calls with
# redis-benchmark: the keys and arguments of `benches/store.rs` (a daemon's: cost 1, fallback
# capacity and refill, Redis TIME, the default minimum TTL, the period, a batch of 1), on one
# hot key and on random keys of 100 000 tenants, with each bucket's parameters stored first
# ("stored") or not ("fallback"). Then lua/sliding_window.lua with the daemon's arguments and
# fallback parameters: 100 per second on the hot key (the exact log, full), 5 per 15 minutes
# on random keys (the exact log, mostly new), 1000 per second on the hot key (sub-window
# counters). Needs valgrind, redis-server, redis-cli and redis-benchmark. About 3.5 minutes at
# the default 3000 calls per run.
set -euo pipefail

calls=${1:-3000}
other=${2:-}
other_window=${3:-}
root=$(cd "$(dirname "$0")/../../.." && pwd)
bench=$root/crates/quota-store/benches/lua
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for tool in valgrind redis-server redis-cli redis-benchmark; do
  command -v "$tool" >/dev/null || { echo "lua_instructions.sh: needs $tool" >&2; exit 2; }
done

keyspace=100000
# The daemon's arguments for a bucket of 1000 tokens refilling 100 000 a second.
args=(1 1000000000 100000000000 '' 60000 1000 1)
seed_args=(1000.0 100000.5 1700000000.000013 1)

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# measure <script> <hot|random> <stored|fallback> <quotad|seed|multi>: instructions per EVALSHA.
measure() {
  local script=$1 keys=$2 params=$3 shape=$4
  local port out tag sha n ir
  port=$(free_port)
  out=$work/callgrind.out
  rm -f "$out"
  valgrind --tool=callgrind --toggle-collect=evalShaCommand --callgrind-out-file="$out" \
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    >"$work/valgrind.log" 2>&1 &
  local pid=$!
  for _ in $(seq 150); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && break
    sleep 0.2
  done
  redis-cli -p "$port" ping >/dev/null || { cat "$work/valgrind.log" >&2; exit 1; }
  sha=$(redis-cli -p "$port" SCRIPT LOAD "$(cat "$script")")
  # redis-benchmark writes __rand_int__ as 12 digits.
  if [ "$keys" = hot ]; then tag='{hot}'; else tag='{t__rand_int__}'; fi
  if [ "$params" = stored ]; then
    # EVAL, not EVALSHA: not counted.
    redis-cli -p "$port" EVAL "
      local hot = ARGV[3] == 'hot'
      for i = 0, hot and 0 or tonumber(ARGV[4]) - 1 do
        local t = hot and '{hot}' or string.format('{t%012d}', i)
        redis.call('HSET', 'qd:v1:' .. t .. ':writes:1:p', 'cap', ARGV[1], 'rate', ARGV[2])
      end" 0 "${args[1]}" "${args[2]}" "$keys" "$keyspace" >/dev/null
  fi
  if [ "$shape" = seed ]; then
    redis-benchmark -p "$port" -q -n "$calls" -r "$keyspace" -c 8 \
      EVALSHA "$sha" 1 "seed:$tag" "${seed_args[@]}" >/dev/null
  elif [ "${shape%%:*}" = window ]; then
    # window:<limit>:<window ms>
    local wl=${shape#window:}
    redis-benchmark -p "$port" -q -n "$calls" -r "$keyspace" -c 8 \
      EVALSHA "$sha" 3 "qd:v1:$tag:logins:1:w" "qd:v1:$tag:logins:1:p" qd:v1:active \
      1 "${wl%%:*}" "${wl#*:}" '' 60000 >/dev/null
  elif [ "$shape" = multi ]; then
    # The bench's two limits: the one above, and 1 000 000 tokens refilling 100 000 000 a day.
    redis-benchmark -p "$port" -q -n "$calls" -r "$keyspace" -c 8 \
      EVALSHA "$sha" 5 "qd:v1:$tag:writes:1:b" "qd:v1:$tag:writes:1:p" \
      "qd:v1:$tag:daily:1:b" "qd:v1:$tag:daily:1:p" qd:v1:active \
      1 '' 60000 1000000000 100000000000 1000 1000000000000 100000000000000 86400000 >/dev/null
  else
    redis-benchmark -p "$port" -q -n "$calls" -r "$keyspace" -c 8 \
      EVALSHA "$sha" 3 "qd:v1:$tag:writes:1:b" "qd:v1:$tag:writes:1:p" qd:v1:active \
      "${args[@]}" >/dev/null
  fi
  n=$(redis-cli -p "$port" INFO commandstats | tr -d '\r' \
    | sed -n 's/^cmdstat_evalsha:calls=\([0-9]*\),.*/\1/p')
  local errors
  errors=$(redis-cli -p "$port" INFO errorstats | tr -d '\r' | grep -c '^errorstat_' || true)
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  wait "$pid" || true
  if [ "$errors" != 0 ]; then
    echo "lua_instructions.sh: $script answered errors ($keys, $params)" >&2
    exit 1
  fi
  ir=$(sed -n 's/^\(summary\|totals\): *\([0-9]*\).*/\2/p' "$out" | head -1)
  echo $((ir / n))
}

declare -A r
for keys in hot random; do
  for params in stored fallback; do
    r[tb.$keys.$params]=$(measure "$root/lua/token_bucket.lua" "$keys" "$params" quotad)
    r[floor.$keys.$params]=$(measure "$bench/contract_floor.lua" "$keys" "$params" quotad)
    if [ -n "$other" ]; then
      r[other.$keys.$params]=$(measure "$other" "$keys" "$params" quotad)
    fi
  done
  r[seed.$keys]=$(measure "$bench/seed_baseline.lua" "$keys" fallback seed)
done
r[multi]=$(measure "$root/lua/token_buckets.lua" random fallback multi)
windows=("hot window:100:1000" "random window:5:900000" "hot window:1000:1000")
for w in "${windows[@]}"; do
  r[sw.$w]=$(measure "$root/lua/sliding_window.lua" "${w%% *}" fallback "${w#* }")
  if [ -n "$other_window" ]; then
    r[osw.$w]=$(measure "$other_window" "${w%% *}" fallback "${w#* }")
  fi
done

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
row() { printf '  %-44s %10s %12s\n' "$1" "$2" "$3"; }
echo "== Redis instructions per EVALSHA ($calls calls per run, callgrind) =="
row "" "hot key" "random keys"
for params in stored fallback; do
  row "token_bucket.lua, $params" "${r[tb.hot.$params]}" "${r[tb.random.$params]}"
  row "contract floor, $params" "${r[floor.hot.$params]}" "${r[floor.random.$params]}"
  if [ -n "$other" ]; then
    row "compared script, $params" "${r[other.hot.$params]}" "${r[other.random.$params]}"
  fi
done
row "seed-style baseline" "${r[seed.hot]}" "${r[seed.random]}"
for params in stored fallback; do
  row "ratio $params / seed baseline" "$(ratio "${r[tb.hot.$params]}" "${r[seed.hot]}")" \
    "$(ratio "${r[tb.random.$params]}" "${r[seed.random]}")"
  row "ratio $params / its contract floor" \
    "$(ratio "${r[tb.hot.$params]}" "${r[floor.hot.$params]}")" \
    "$(ratio "${r[tb.random.$params]}" "${r[floor.random.$params]}")"
  row "ratio floor $params / seed baseline" \
    "$(ratio "${r[floor.hot.$params]}" "${r[seed.hot]}")" \
    "$(ratio "${r[floor.random.$params]}" "${r[seed.random]}")"
  if [ -n "$other" ]; then
    row "ratio $params / compared script" \
      "$(ratio "${r[tb.hot.$params]}" "${r[other.hot.$params]}")" \
      "$(ratio "${r[tb.random.$params]}" "${r[other.random.$params]}")"
  fi
done
echo "== two limits at once (token_buckets.lua, random keys, fallback) =="
row "token_buckets.lua, 2 limits" "" "${r[multi]}"
row "ratio ÷ 2 calls of token_bucket.lua" "" "$(ratio "${r[multi]}" $((2 * ${r[tb.random.fallback]})))"
echo "== sliding_window.lua (fallback parameters) =="
row "" "per call" "÷ token_bucket.lua"
for w in "${windows[@]}"; do
  keys=${w%% *}
  wl=${w#*:}
  label="${wl%%:*} per ${wl#*:} ms, $keys"
  row "$label" "${r[sw.$w]}" "$(ratio "${r[sw.$w]}" "${r[tb.$keys.fallback]}")"
  if [ -n "$other_window" ]; then
    row "  compared script" "${r[osw.$w]}" "$(ratio "${r[osw.$w]}" "${r[tb.$keys.fallback]}")"
  fi
done
