#!/usr/bin/env bash
# Nsight Compute summary of one kernel of the training benchmark (msa bench) on the GPU machine.
# usage: scripts/profile-kernel.sh OUTDIR KERNEL_REGEX [TOKENS]
# Builds like scripts/device-check.sh (same build directory), then profiles the first launch
# of the matching kernel (clocks left alone) with the throughput, stall and source sections.
set -u -o pipefail
OUT=${1:?usage: scripts/profile-kernel.sh OUTDIR KERNEL_REGEX [TOKENS]}
KERNEL=${2:?kernel name regex}
TOKENS=${3:-16384}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${MSA_BUILD_DIR:-/tmp/msa-device-build}
mkdir -p "$OUT"
MSA_TEST_FILTER='GpuRuntime.DeviceCountAndRoundTrip' MSA_SANITIZE=0 MSA_BENCH_TOKENS=none \
  bash "$ROOT/scripts/device-check.sh" "$OUT" > "$OUT/build_summary.txt" 2>&1 || { cat "$OUT/build_summary.txt"; exit 1; }
ncu --clock-control none --kernel-name "regex:$KERNEL" --launch-count 1 --import-source yes \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
  --section SourceCounters --section LaunchStats --section InstructionStats -o "$OUT/profile" -f \
  "$BUILD/tools/msa/msa" bench --backend cuda --tokens "$TOKENS" --reps 1 > "$OUT/ncu_run.txt" 2>&1
echo "ncu rc $?"
ncu -i "$OUT/profile.ncu-rep" --page details --print-details all > "$OUT/ncu.txt" 2>&1
ncu -i "$OUT/profile.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" 2>&1
gzip -f "$OUT/sass.csv"; rm -f "$OUT/profile.ncu-rep"
grep -E "Duration|Throughput|Registers|Achieved|Stall|stall|Warp Cycles|Issued|Hit Rate|Eligible|smsp__pcsamp|Bank" "$OUT/ncu.txt" | head -80
