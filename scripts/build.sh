#!/usr/bin/env bash
# Configures and builds msa into ${MSA_BUILD_DIR:-build}. The CUDA backend is compiled
# (for sm_90a) whenever nvcc is found, even on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${MSA_BUILD_DIR:-build}
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then export PATH=/usr/local/cuda/bin:$PATH; fi
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$build_dir" -j "$(nproc)"
