#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what the tests need and is missing
# (scripts/install-test-deps.sh), then runs every test of the workspace with nextest's `ci`
# profile. Extra arguments go to nextest (a filter, `-p quota-core`, `--no-fail-fast`, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
venv_bin=$(scripts/install-test-deps.sh)
export PATH="$venv_bin:$PATH"
exec cargo nextest run --workspace --profile ci --locked "$@"
