#!/usr/bin/env bash
# GPU check of the CUDA backend, meant for a machine with an H100/H200 (sm_90a):
#   1. configures and builds msa with the CUDA backend (Ninja, CMAKE_CUDA_ARCHITECTURES=90a);
#   2. runs the GPU tests (GoogleTest filter Gpu*);
#   3. runs compute-sanitizer memcheck on small GPU cases;
#   4. runs the training benchmark (msa bench --backend cuda) at 4k..128k tokens, the decode
#      benchmark (msa bench --decode), the prefill benchmark over the production manifest
#      (msa bench --prefill bench/data/prefill_benchmark_cases.jsonl, bf16 and FP8 caches),
#      msa demo and the independent run-case check with --backend cuda;
#   5. with MSA_PYTHON=1: builds the Python package with its CUDA backend, runs the Python
#      tests (GPU ones included) and bench/peers.py at MSA_PEERS_TOKENS (default 4096,16384).
# Logs go to OUTDIR; a short summary table is printed last.
#
# usage: scripts/device-check.sh OUTDIR
# environment (optional):
#   MSA_BUILD_DIR      build directory (default /tmp/msa-device-build)
#   MSA_PREBUILT       directory of an existing build to use instead of building
#   MSA_JOBS           parallel build jobs (default 16)
#   MSA_TEST_FILTER    GoogleTest filter (default Gpu*)
#   MSA_TEST_TIMEOUT   seconds the GPU tests may take (default 300). The whole Gpu* suite takes
#                      longer than one such run (its CPU-reference tests take 15-50 s each): split
#                      it with GoogleTest's own sharding, e.g. GTEST_TOTAL_SHARDS=3 GTEST_SHARD_INDEX=0
#                      (then 1, 2) in the environment of three runs
#   MSA_BENCH_TOKENS   comma-separated token counts (default 4096,...,131072; "none" skips)
#   MSA_BENCH_REPS     timed repetitions per op (default 10)
#   MSA_SANITIZE       0 skips the memcheck step
#   MSA_DECODE_BENCH   0 skips msa bench --decode and msa demo
#   MSA_PREFILL_BENCH  0 skips msa bench --prefill
#   MSA_INDEPENDENT    0 skips the independent run-case check (tests/independent) on cuda
#   MSA_PYTEST_PATHS   what pytest runs with MSA_PYTHON=1 (default: all of tests/python)
#   MSA_TRANSFORMERS   0 skips the transformers check with MSA_PYTHON=1 (bench/transformers_bench.py --check)
#   MSA_PACK_LOGS      1 packs every log of OUTDIR into OUTDIR/logs.tar.gz at the end
# Dependencies: CUDA toolkit, CMake >= 3.25, Ninja, GoogleTest (installed, or its sources in
# .deps/googletest or /usr/src/googletest, built here), and the header-only nlohmann_json
# and CLI11 (installed, or a prefix in .deps/prefix).
set -u -o pipefail
OUT=${1:?usage: scripts/device-check.sh OUTDIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${MSA_BUILD_DIR:-/tmp/msa-device-build}
JOBS=${MSA_JOBS:-16}
FILTER=${MSA_TEST_FILTER:-Gpu*}
TOKENS=${MSA_BENCH_TOKENS:-4096,8192,16384,32768,65536,131072}
REPS=${MSA_BENCH_REPS:-10}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
T0=$(date +%s)
note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$SUMMARY"; }
export PATH=/usr/local/cuda/bin:$PATH

note "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1)"
note "nvcc: $(nvcc --version 2>/dev/null | tail -1), cmake: $(cmake --version | head -1)"

BIN=""
if [ -n "${MSA_PREBUILT:-}" ]; then
  BIN=$MSA_PREBUILT
  note "using the prebuilt tree $BIN"
else
  PREFIXES=""
  [ -d "$ROOT/.deps/prefix" ] && PREFIXES="$ROOT/.deps/prefix"
  if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then
    GTEST_SRC=""
    for d in "${GTEST_SOURCE_DIR:-}" "$ROOT/.deps/googletest" /usr/src/googletest; do
      if [ -n "$d" ] && [ -f "$d/CMakeLists.txt" ]; then GTEST_SRC=$d; break; fi
    done
    if [ -z "$GTEST_SRC" ]; then note "FAIL: GoogleTest is neither installed nor available as source"; exit 1; fi
    note "building GoogleTest from $GTEST_SRC"
    cmake -S "$GTEST_SRC" -B "$BUILD/gtest-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
      -DCMAKE_INSTALL_PREFIX="$BUILD/gtest-install" > "$OUT/build.log" 2>&1 &&
      ninja -C "$BUILD/gtest-build" -j "$JOBS" install >> "$OUT/build.log" 2>&1 ||
      { note "FAIL: GoogleTest build (see build.log)"; tail -20 "$OUT/build.log"; exit 1; }
    PREFIXES="$PREFIXES;$BUILD/gtest-install"
  fi
  note "configuring"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSA_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DMSA_BUILD_PYTHON=OFF -DCMAKE_PREFIX_PATH="$PREFIXES" >> "$OUT/build.log" 2>&1 ||
    { note "FAIL: configure (see build.log)"; tail -30 "$OUT/build.log"; exit 1; }
  note "building msa_tests and msa with $JOBS jobs"
  ninja -C "$BUILD" -j "$JOBS" msa_tests msa_tool >> "$OUT/build.log" 2>&1 ||
    { note "FAIL: build (see build.log)"; grep -E "error|FAILED" "$OUT/build.log" | head -30; exit 1; }
  BIN=$BUILD
  note "built"
fi
TESTS="$BIN/tests/msa_tests"
TOOL="$BIN/tools/msa/msa"

# GPU tests (from the repository root, where tests/data lives).
cd "$ROOT"
timeout "${MSA_TEST_TIMEOUT:-300}" "$TESTS" --gtest_filter="$FILTER" --gtest_output="xml:$OUT/gpu_tests.xml" \
  > "$OUT/gpu_tests.log" 2>&1
TEST_RC=$?
[ "$TEST_RC" = 124 ] && note "GPU tests: stopped by MSA_TEST_TIMEOUT (${MSA_TEST_TIMEOUT:-300} s); the counts below are partial"
# "N passed, N failed, N skipped" of a GoogleTest log.
gtest_counts() {
  echo "$(grep -c "^\[       OK \]" "$1") passed, $(grep -c "^\[  FAILED  \] [A-Za-z]*\.[A-Za-z]* (" "$1") failed," \
    "$(grep -c "^\[  SKIPPED \] [A-Za-z]*\." "$1") skipped"
}
note "GPU tests: rc $TEST_RC, $(gtest_counts "$OUT/gpu_tests.log")"
grep -E "^\[  FAILED  \]|Failure|error:" "$OUT/gpu_tests.log" | head -20 | tee -a "$SUMMARY"
# Memory checker on small cases.
if [ "${MSA_SANITIZE:-1}" != "0" ] && command -v compute-sanitizer > /dev/null; then
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 "$TESTS" \
    --gtest_filter='GpuForward.TopologiesOutputTypesAndItemSizes:GpuBackward.TopologiesAndFloat32:GpuKl.TopologiesGradScaleAndBf16:GpuIndexer.TiesPreferLowerBlockIds:GpuPlan.InvalidSelectionIsFlaggedAndPoisonsOutputs:GpuMergeStates.*:GpuInference.StridedCombinedKvCache:GpuInference.DecodeAttentionMatchesCpuEveryFormat:GpuInference.DecodeGraphReplaysTheNextStepAfterUpdate:GpuInference.PrefillStepGraphReplayWithNewContents:GpuInference.Nvfp4ToFp8Bitwise:GpuLayout.PackUnpackMatchCpuBitwise' \
    > "$OUT/memcheck.log" 2>&1
  note "compute-sanitizer memcheck: rc $? ($(grep -m1 "ERROR SUMMARY" "$OUT/memcheck.log"))"
fi

# Training benchmark: the table of bench.log from its "tokens" header on is printed at the end.
if [ "$TOKENS" != "none" ]; then
  timeout 300 "$TOOL" bench --backend cuda --tokens "$TOKENS" --reps "$REPS" --out "$OUT/bench.csv" > "$OUT/bench.log" 2>&1
  note "benchmark: rc $?"
fi
if [ "${MSA_DECODE_BENCH:-1}" != "0" ]; then
  timeout 240 "$TOOL" bench --decode --backend cuda --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1
  note "decode benchmark: rc $?"
  timeout 120 "$TOOL" demo > "$OUT/demo.log" 2>&1
  note "msa demo: rc $?"
fi
if [ "${MSA_PREFILL_BENCH:-1}" != "0" ]; then
  timeout 300 "$TOOL" bench --prefill "$ROOT/bench/data/prefill_benchmark_cases.jsonl" --formats bf16,fp8 --reps 3 \
    --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
  note "prefill benchmark (production manifest): rc $?"
fi
# Cases written by independent programs (tests/independent: NumPy float64 oracle from the
# spec) through `msa run-case --backend cuda`, each also run with --backend cpu and the two
# results compared directly.
if [ "${MSA_INDEPENDENT:-1}" != "0" ]; then
  timeout 600 python3 "$ROOT/tests/independent/check_cases.py" --msa "$TOOL" --backend cuda --compare-with cpu --work "$BUILD/independent" \
    > "$OUT/independent.log" 2>&1
  note "independent run-case check on cuda: rc $? ($(tail -1 "$OUT/independent.log"))"
fi
# Python package on the GPU. The package is built with the system compiler: a toolchain
# that links libstdc++ statically into shared objects gives a module that crashes in its
# first std::ostringstream (seen with the GPU image's /opt/gcc).
if [ "${MSA_PYTHON:-0}" = "1" ]; then
  SITE=$BUILD/python-site
  CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++ timeout 300 python3 -m pip install -q --no-build-isolation \
    --no-deps --upgrade --target "$SITE" -C cmake.define.MSA_ENABLE_CUDA=ON -C build-dir="$BUILD/python-build" \
    "$ROOT" > "$OUT/python_build.log" 2>&1
  note "python package build: rc $?"
  PYTHONPATH=$SITE PYTHONUNBUFFERED=1 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider ${MSA_PYTEST_PATHS:-"$ROOT/tests/python"} \
    > "$OUT/pytest.log" 2>&1
  note "python tests: rc $? ($(tail -1 "$OUT/pytest.log"))"
  PYTHONPATH=$SITE PYTHONUNBUFFERED=1 timeout 200 python3 "$ROOT/bench/peers.py" \
    --seqlens $(echo "${MSA_PEERS_TOKENS:-4096,16384}" | tr , ' ') --repeats 5 --json "$OUT/peers.json" > "$OUT/peers.log" 2>&1
  note "peers benchmark: rc $?"
  # transformers integration: a random MiniMax-M3 model with sparse layers through "msa",
  # logits against "sdpa" where it fits, a training step and generation at 64k tokens.
  if [ "${MSA_TRANSFORMERS:-1}" != "0" ]; then
    PYTHONPATH=$SITE PYTHONUNBUFFERED=1 timeout 500 python3 "$ROOT/bench/transformers_bench.py" --check \
      > "$OUT/transformers_check.log" 2>&1
    note "transformers check: rc $? ($(tail -1 "$OUT/transformers_check.log"))"
  fi
fi
note "done"
echo
cat "$SUMMARY"
echo
[ -f "$OUT/bench.log" ] && sed -n '/^ *tokens/,$p' "$OUT/bench.log"
[ -f "$OUT/decode.log" ] && { echo; grep -v "^\[msa" "$OUT/decode.log" | tail -25; }
[ -f "$OUT/prefill.log" ] && { echo; sed -n '/^Production-weighted/,$p' "$OUT/prefill.log" | grep -E "^(stratum|all|Production)" ; }
# The peer table goes to stdout too: only a few files of OUTDIR may come back from a remote run.
[ -f "$OUT/peers.log" ] && { echo; tail -30 "$OUT/peers.log"; }
# With MSA_PACK_LOGS=1 every log goes into one logs.tar.gz beside summary.txt and bench.csv
# (for runners that bring back only a few files).
if [ "${MSA_PACK_LOGS:-0}" = "1" ]; then
  (cd "$OUT" && tar czf /tmp/msa-device-logs.tar.gz --exclude=./summary.txt --exclude=./bench.csv . &&
    find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name bench.csv -exec rm -rf {} + &&
    mv /tmp/msa-device-logs.tar.gz logs.tar.gz)
fi
exit $TEST_RC
