#!/usr/bin/env bash
# Installs what the tests need and is missing, on Debian or Ubuntu: redis-server and redis-cli
# (with TLS; they also run the Sentinel tests' sentinels), a C compiler (mimalloc and ring build C
# code), promtool and prometheus for the alert rules' tests (unpacked into target/prometheus, not
# installed as a service), a Python virtual environment under target/ with the pinned packages of
# tests/python/requirements.txt (grpcio for the Envoy client tests, schemathesis for the OpenAPI
# contract test), and cargo-nextest. Each step is skipped when its tool is already there, so a
# second run costs a few version checks. Elsewhere, install the same by hand: README.md, "Tests".
#
# Prints the virtual environment's bin directory last, for the caller's PATH.
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

if ! { command -v promtool && command -v prometheus; } >/dev/null 2>&1; then
    log "unpacking promtool and prometheus (Debian package prometheus) into target/prometheus"
    scripts/fetch-prometheus.sh >&2
fi

python_venv="$PWD/target/python-tests"
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
