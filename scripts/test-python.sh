#!/usr/bin/env bash
# Python tests: builds the package into a local virtual environment and runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash python/run_tests.sh "$@"
