#!/usr/bin/env bash
# Context parallelism on a GPU machine with several GPUs (NCCL):
#   1. builds the Python package with its CUDA backend (as scripts/device-check.sh does);
#   2. runs the NCCL test of tests/python/test_context_parallel.py (2+ GPUs vs one GPU);
#   3. runs bench/cp_scaling.py over the world sizes in MSA_CP_WORLDS (default: 1 and every
#      power of two up to the GPU count) on real 192k-token packs, writing cp_scaling.jsonl.
# usage: scripts/device-cp.sh OUTDIR
set -u -o pipefail
OUT=${1:?usage: scripts/device-cp.sh OUTDIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${MSA_BUILD_DIR:-/tmp/msa-device-build}
SITE=$BUILD/python-site
mkdir -p "$OUT"
T0=$(date +%s)
note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/summary.txt"; }
export PATH=/usr/local/cuda/bin:$PATH
# NVLink multicast stays off (shared machines).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
note "GPUs: $GPUS x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++ timeout 400 python3 -m pip install -q --no-build-isolation \
  --no-deps --upgrade --target "$SITE" -C cmake.define.MSA_ENABLE_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a \
  -C build-dir="$BUILD/python-build" "$ROOT" > "$OUT/python_build.log" 2>&1
note "python package build: rc $?"
PYTHONPATH=$SITE PYTHONUNBUFFERED=1 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider \
  "$ROOT/tests/python/test_context_parallel.py" > "$OUT/pytest_cp.log" 2>&1
note "context-parallel tests: rc $? ($(tail -1 "$OUT/pytest_cp.log"))"
grep -E "PASSED|FAILED|SKIPPED|nccl" "$OUT/pytest_cp.log" | head -10
WORLDS=${MSA_CP_WORLDS:-}
if [ -z "$WORLDS" ]; then w=1; while [ "$w" -le "$GPUS" ]; do WORLDS="$WORLDS $w"; w=$((w * 2)); done; fi
cd "$ROOT"
PYTHONPATH=$SITE PYTHONUNBUFFERED=1 timeout 400 python3 bench/cp_scaling.py --launch $WORLDS \
  --json "$OUT/cp_scaling.jsonl" ${MSA_CP_ARGS:-} > "$OUT/cp_scaling.log" 2>&1
note "scaling benchmark ($WORLDS): rc $?"
tail -30 "$OUT/cp_scaling.log"
