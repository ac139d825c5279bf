#!/usr/bin/env bash
# Unpacks promtool and prometheus from Debian's `prometheus` package into the directory named as
# the first argument (default target/prometheus), for the alert rules' tests
# (tests/tests/alerts.rs; scripts/install-test-deps.sh passes its cache directory). Only unpacked, not installed: installing the
# package would also start a Prometheus service. Elsewhere, put any Prometheus 2.x's promtool
# and prometheus on PATH, or name their directory in QUOTAD_PROMETHEUS_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-target/prometheus}
if [ -x "$dest/promtool" ] && [ -x "$dest/prometheus" ]; then
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1); then
    apt-get update -qq
    (cd "$tmp" && apt-get download prometheus >/dev/null)
fi
dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root"
mkdir -p "$dest"
cp "$tmp/root/usr/bin/promtool" "$tmp/root/usr/bin/prometheus" "$dest/"
"$dest/promtool" --version | head -1
