#!/usr/bin/env bash
# Set-up-and-go: install dependencies, build, and run `msa demo` (GPU when present, else CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh -DMSA_BUILD_TESTS=OFF
exec "${MSA_BUILD_DIR:-build}/tools/msa/msa" demo "$@"
