#!/usr/bin/env bash
# Set-up-and-go: install dependencies, build everything, run the C++ tests (ctest) and the
# Python tests (pytest). GPU tests skip with a visible reason on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh -DMSA_BUILD_TESTS=ON
build_dir=${MSA_BUILD_DIR:-build}
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"
if ! (command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1); then
  echo "note: the Gpu* tests above were skipped: no CUDA device on this machine" \
       "(they run on a GPU machine through scripts/device-check.sh)"
fi
if [ -f scripts/test-python.sh ]; then bash scripts/test-python.sh; fi
