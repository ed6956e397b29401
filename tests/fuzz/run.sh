#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, AddressSanitizer + UBSan; the "fuzz" preset) and runs
# each on a copy of the seed corpus for a share of the given time:
#   tests/fuzz/run.sh [seconds, default 60] [build dir, default build-fuzz]
# Exit 0 when no target found anything, 1 on a finding (the crashing input is left in
# <build dir>/findings/), 0 with a SKIP line when clang or libFuzzer is missing.
# The long run (see docs/fuzzing.md) is the same with more seconds, e.g. 14400.
set -uo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
build_dir=${2:-build-fuzz}

skip() {
  echo "SKIP fuzz: $* (install clang to run the fuzz targets)"
  exit 0
}
command -v clang++ >/dev/null || skip "clang++ not found"
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe/p.cpp"
clang++ -fsanitize=fuzzer "$probe/p.cpp" -o "$probe/p" 2>"$probe/err" || skip "clang++ cannot link libFuzzer ($(head -c 200 "$probe/err"))"

cmake --preset fuzz -B "$build_dir" >"$probe/configure.log" 2>&1 || { cat "$probe/configure.log"; exit 1; }
cmake --build "$build_dir" --target fuzz_safetensors fuzz_run_case -j "$(nproc)" || exit 1

mkdir -p "$build_dir/findings"
status=0
targets=(fuzz_safetensors fuzz_run_case)
share=$((seconds / ${#targets[@]}))
((share > 0)) || share=1
for target in "${targets[@]}"; do
  work="$build_dir/corpus/$target"
  mkdir -p "$work"
  echo "== $target: ${share} s on the seed corpus tests/fuzz/corpus (working corpus $work)"
  # -rss_limit_mb: a hostile length must not make the reader allocate much (the files are
  # at most -max_len bytes); -timeout: nor make it loop.
  "$build_dir/tests/fuzz/$target" -max_total_time="$share" -max_len=65536 -timeout=20 -rss_limit_mb=1024 \
    -print_final_stats=1 -artifact_prefix="$build_dir/findings/$target-" "$work" tests/fuzz/corpus 2>&1 |
    grep -E '^(#[0-9]+.*(INITED|DONE)|Done |stat::number_of_executed_units|stat::average_exec_per_sec|==[0-9]+==ERROR|SUMMARY|.*deadly signal|.*uncaught|.*out-of-memory|.*timeout)' 
  rc=${PIPESTATUS[0]}
  if ((rc != 0)); then
    echo "FAIL fuzz: $target exited with $rc; the input is in $build_dir/findings/"
    status=1
  fi
done
((status == 0)) && echo "fuzz: no findings"
exit $status
