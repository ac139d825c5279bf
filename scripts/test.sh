#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what the tests need and is missing
# (scripts/install-test-deps.sh), then runs every test of the workspace with nextest's `ci`
# profile. Extra arguments go to nextest (a filter, `-p quota-core`, `--no-fail-fast`, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
deps=$(scripts/install-test-deps.sh)
venv_bin=$(sed -n 1p <<<"$deps")
prometheus_dir=$(sed -n 2p <<<"$deps")
export PATH="$venv_bin:$PATH"
if [ -n "$prometheus_dir" ]; then
    export QUOTAD_PROMETHEUS_DIR="$prometheus_dir"
fi
exec cargo nextest run --workspace --profile ci --locked "$@"
