#!/usr/bin/env bash
# Installs what the tests need and is missing, on Debian or Ubuntu: redis-server and redis-cli
# (with TLS; they also run the Sentinel tests' sentinels), a C compiler (mimalloc and ring build C
# code), libfaketime (a daemon's wall clock stepped while its monotonic clock runs on, in
# tests/tests/lease_clock.rs), promtool and prometheus for the alert rules' tests (unpacked, not installed as a
# service), a Python virtual environment with the pinned packages of tests/python/requirements.txt
# (grpcio for the Envoy client tests, schemathesis for the OpenAPI contract test), and
# cargo-nextest. Each step is skipped when its tool is already there, so a second run costs a few
# version checks. Elsewhere, install the same by hand: README.md, "Tests".
#
# The unpacked Prometheus and the virtual environment live in $QUOTAD_TEST_CACHE (default
# ~/.cache/quotad-tests), outside the checkout, so a fresh clone reuses them. Prints two lines
# for the caller's environment: the virtual environment's bin directory (for PATH), then the
# directory holding promtool and prometheus (for QUOTAD_PROMETHEUS_DIR; empty when they are
# on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n==> %s\n' "$*" >&2; }

# Root installs directly; anyone else through sudo.
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=
apt_install() {
    export DEBIAN_FRONTEND=noninteractive
    if [ -z "$apt_updated" ]; then
        as_root apt-get update -qq
        apt_updated=1
    fi
    as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    log "installing redis-server and redis-cli (Debian package redis-server)"
    apt_install redis-server
fi
redis-server --version >&2

if ! command -v cc >/dev/null 2>&1; then
    log "installing a C compiler (Debian package gcc)"
    apt_install gcc libc6-dev
fi

if ! compgen -G '/usr/lib/*/faketime/libfaketimeMT.so.1' >/dev/null; then
    log "installing libfaketime (Debian package libfaketime)"
    apt_install libfaketime
fi

cache="${QUOTAD_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/quotad-tests}"
mkdir -p "$cache"

prometheus_dir=
if ! { command -v promtool && command -v prometheus; } >/dev/null 2>&1; then
    prometheus_dir="$cache/prometheus"
    if [ ! -x "$prometheus_dir/promtool" ] || [ ! -x "$prometheus_dir/prometheus" ]; then
        log "unpacking promtool and prometheus (Debian package prometheus) into $prometheus_dir"
    fi
    scripts/fetch-prometheus.sh "$prometheus_dir" >&2
fi

python_venv="$cache/python-tests"
python_stamp="$python_venv/requirements.sha256"
python_want=$(sha256sum tests/python/requirements.txt | cut -d' ' -f1)
if [ "$(cat "$python_stamp" 2>/dev/null)" != "$python_want" ]; then
    log "installing the tests' Python packages (tests/python/requirements.txt) into $python_venv"
    if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
        apt_install python3 python3-venv
    fi
    rm -rf "$python_venv"
    python3 -m venv "$python_venv"
    "$python_venv/bin/pip" install --quiet --requirement tests/python/requirements.txt >&2
    echo "$python_want" >"$python_stamp"
fi
"$python_venv/bin/st" --version >&2

if ! cargo nextest --version >/dev/null 2>&1; then
    log "installing cargo-nextest (crates.io)"
    cargo install cargo-nextest --locked >&2
fi

echo "$python_venv/bin"
echo "$prometheus_dir"
