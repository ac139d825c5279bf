#!/usr/bin/env bash
# Loading many policies: one PUT at a time against POST /v1/policies/batch, side by side in one
# run, on three regions on loopback (config/three-regions-*.toml, each with its own
# redis-server) and on one region with Redis. Prints seconds and policies a second for each.
# Needs redis-server, curl, python3 and `cargo build --release -p quotad`.
# QUOTAD_LOAD_N policies per way (default 10000), QUOTAD_LOAD_BATCH per batch (default 500).
# Uses the config files' ports 7450-7471 and Redis on 6380-6383: stop anything on them first.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
N=${QUOTAD_LOAD_N:-10000}
BATCH=${QUOTAD_LOAD_BATCH:-500}
BIN=$ROOT/target/release/quotad
D=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT

redis() {
  redis-server --port "$1" --save "" --appendonly no --daemonize no >/dev/null &
  PIDS+=($!)
}

ready() {
  for _ in $(seq 200); do curl -sf "localhost:$1/readyz" >/dev/null && return 0; sleep 0.1; done
  echo "quotad on $1 did not become ready" >&2; exit 1
}

# Loads $N policies into the API on port $1 with tenants named $2-<i>, one PUT at a time
# ("single") or $BATCH at a time ("batch"), on one keep-alive connection; prints the timing.
load() {
  python3 - "$1" "$2" "$3" "$N" "$BATCH" <<'PY'
import http.client, json, sys, time
port, prefix, way, n, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
c = http.client.HTTPConnection("127.0.0.1", int(port))
h = {"authorization": "Bearer load-token", "content-type": "application/json"}
spec = {"limit": 100, "window_ms": 60000}
t = time.monotonic()
if way == "single":
    for i in range(n):
        c.request("PUT", f"/v1/tenants/{prefix}-{i}/policies/writes", json.dumps(spec), h)
        r = c.getresponse(); r.read()
        assert r.status == 200, r.status
else:
    for start in range(0, n, batch):
        items = [dict(spec, tenant=f"{prefix}-{i}", policy="writes") for i in range(start, min(n, start + batch))]
        c.request("POST", "/v1/policies/batch", json.dumps({"policies": items}), h)
        r = c.getresponse(); body = r.read()
        assert r.status == 200, (r.status, body[:300])
s = time.monotonic() - t
print(f"  {way:6} {n} policies in {s:6.1f} s  ({n / s:7.0f} policies/s)")
PY
}

export QUOTAD_ADMIN_TOKEN=load-token QUOTAD_PEER_TOKEN=load-peer-token-0123456789
echo "three regions on loopback (release build), $N policies each way, batches of $BATCH:"
for r in a b c; do
  port=$((6380 + $(printf '%d' "'$r") - 97))
  redis $port
  sed -e "s|^data_dir = .*|data_dir = \"$D/data-$r\"|" \
      -e 's|^log_format = .*|log_format = "text"|' -e 's|^log_level = .*|log_level = "warn"|' \
      -e 's|^body_limit_bytes = .*||' \
      "$ROOT/config/three-regions-$r.toml" > "$D/$r.toml"
  # Batches larger than the default 64 KiB body limit.
  sed -i 's|^\[api\]|[api]\nbody_limit_bytes = 1048576|' "$D/$r.toml"
done
sleep 0.3
for r in a b c; do
  "$BIN" run --config "$D/$r.toml" > "$D/$r.log" 2>&1 &
  PIDS+=($!)
done
for p in 7450 7460 7470; do ready $p; done
load 7450 single single
load 7450 batch batch

echo "one region with Redis:"
redis 6383
sleep 0.3
QUOTAD_REDIS_URL=redis://127.0.0.1:6383 QUOTAD_DATA_DIR=$D/solo QUOTAD_API_LISTEN=127.0.0.1:7480 \
  QUOTAD_PEER_LISTEN=127.0.0.1:7481 QUOTAD_LOG_LEVEL=warn \
  "$BIN" run --config <(printf '[api]\nbody_limit_bytes = 1048576\n') > "$D/solo.log" 2>&1 &
PIDS+=($!)
ready 7480
load 7480 single single
load 7480 batch batch
