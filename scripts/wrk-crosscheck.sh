#!/usr/bin/env bash
# Cross-check of the load bench with external C load generators: wrk against the release quotad,
# redis-benchmark against the same Redis (EVALSHA of the same script), alternating, at
# concurrency 1 and 64, two rounds. Needs wrk, redis-server, redis-benchmark, curl, python3 and
# `cargo build --release -p quotad`. Ports: QUOTAD_XC_PORT (default 17811) and the next two.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
P=${QUOTAD_XC_PORT:-17811}; API=$((P + 1)); PEER=$((P + 2))
D=$(mktemp -d)
redis-server --port $P --save "" --appendonly no --daemonize yes --pidfile $D/r.pid >/dev/null
sleep 0.3
SHA=$(redis-cli -p $P SCRIPT LOAD "$(cat $ROOT/lua/token_bucket.lua)")
QUOTAD_ADMIN_TOKEN=t QUOTAD_REDIS_URL=redis://127.0.0.1:$P QUOTAD_DATA_DIR=$D/data QUOTAD_API_LISTEN=127.0.0.1:$API QUOTAD_PEER_LISTEN=127.0.0.1:$PEER $ROOT/target/release/quotad run > $D/q.log 2>&1 &
QP=$!
for i in $(seq 50); do curl -sf localhost:$API/readyz >/dev/null && break; sleep 0.1; done
for i in $(seq 0 63); do
  curl -sf -X PUT -H 'authorization: Bearer t' -H 'content-type: application/json' \
    localhost:$API/v1/tenants/wrk-$i/policies/bench -d '{"limit":1000000,"window_ms":1000,"burst":100000000}' >/dev/null || echo "put failed"
done
cat > $D/check.lua <<'LUA'
local n = 0
request = function()
  n = n + 1
  local body = string.format('{"tenant":"wrk-%d","policy":"bench","cost":1}', n % 64)
  return wrk.format("POST", "/v1/check", {["content-type"] = "application/json"}, body)
end
LUA
for round in 1 2; do
  for c in 1 64; do
    w=$(wrk -t1 -c$c -d5s --latency -s $D/check.lua http://127.0.0.1:$API 2>&1)
    wr=$(echo "$w" | awk '/Requests\/sec/{print $2}'); wp=$(echo "$w" | awk '/ 50%/{print $2}')
    non2xx=$(echo "$w" | grep -c "Non-2xx")
    n=$(python3 -c "print(int(float('$wr')*5))")
    r=$(redis-benchmark -p $P -c $c -n $n -r 64 --csv EVALSHA $SHA 3 'qd:v1:{rb-__rand_int__}:bench:1:b' 'qd:v1:{rb-__rand_int__}:bench:1:p' 'qd:v1:active' 1 100000000000000 1000000000000 "" 2>/dev/null | tail -1)
    rr=$(echo "$r" | awk -F'","' '{print $2}'); rp=$(echo "$r" | awk -F'","' '{print $5}')
    python3 -c "print(f'round $round c=$c  quotad(wrk) {float(\"$wr\"):9.0f}/s p50 $wp   redis-benchmark {float(\"$rr\"):9.0f}/s p50 {float(\"$rp\")*1000:.0f}us   ratio {float(\"$wr\")/float(\"$rr\"):.2f}  non2xx=$non2xx')"
  done
done
kill $QP; wait $QP 2>/dev/null
redis-cli -p $P shutdown nosave >/dev/null 2>&1
rm -rf $D
