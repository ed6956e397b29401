#!/usr/bin/env bash
# Set-up-and-go: install dependencies, build everything, run the C++ tests (ctest) and the
# Python tests (pytest). GPU tests skip with a visible reason on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh -DMSA_BUILD_TESTS=ON
build_dir=${MSA_BUILD_DIR:-build}
status=0
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" || status=$?
# ctest lists skipped tests without their reasons; print them (GPU tests without a GPU, ...).
python3 tests/ctest_skips.py "$build_dir" || true
# A short coverage-guided fuzz run of the file reader and run-case (clang/libFuzzer; skipped
# with the reason when they are missing). The long run is documented in docs/fuzzing.md.
bash tests/fuzz/run.sh "${MSA_FUZZ_SECONDS:-60}" "${build_dir}-fuzz" || status=1
((status == 0)) || exit $status
if ! (command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1); then
  echo "note: the Gpu* tests above were skipped: no CUDA device on this machine" \
       "(they run on a GPU machine through scripts/device-check.sh)"
fi
if [ -f scripts/test-python.sh ]; then
  bash scripts/test-python.sh
  # The README's and docs' Python / sh examples need the package that test-python.sh has just
  # installed into .venv-ci: run them again now (the ctest run above skips them on a fresh
  # checkout, where that environment did not exist yet, or ran them against an older install).
  ctest --test-dir "$build_dir" -R '^docs\.python_sh$' --output-on-failure
fi
