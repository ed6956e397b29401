#!/usr/bin/env bash
# ctest.skip_reasons: a skipped GPU test's reason must reach the skip summary that
# scripts/test.sh prints after ctest. Runs a private ctest (its own folder and log) on one
# GPU test of msa_tests, then tests/ctest_skips.py on that log.
#   ctest_skips_test.sh <msa_tests binary> <work dir>
set -uo pipefail
tests_bin=$1
work=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work" || exit 1
# The output is captured first: grep -q may exit before the binary has written everything,
# and with pipefail the SIGPIPE that gives it would read as "nothing was skipped".
probe_out=$("$tests_bin" --gtest_filter='GpuGraph.*' 2>&1)
if ! grep -q '\[  SKIPPED \]' <<<"$probe_out"; then
  echo "SKIP: a GPU is present here, nothing is skipped"
  exit 77
fi
cat >"$work/CTestTestfile.cmake" <<CTEST
add_test(gpu_probe "$tests_bin" "--gtest_filter=GpuGraph.*")
set_tests_properties(gpu_probe PROPERTIES SKIP_REGULAR_EXPRESSION "\\\\[  SKIPPED \\\\]")
CTEST
ctest --test-dir "$work" >"$work/ctest.txt" 2>&1
cat "$work/ctest.txt"
python3 "$here/ctest_skips.py" "$work" | tee "$work/summary.txt"
grep -q '1 x .*GPU.*: gpu_probe' "$work/summary.txt" || { echo "FAIL: the skip reason is not in the summary"; exit 1; }
echo PASS
