#!/usr/bin/env bash
# One training kernel of `msa bench` under Nsight Compute: its speed-of-light, occupancy,
# scheduler and warp-state sections and the hottest SASS lines by stall samples, printed.
#
#   bench/experiments/training_kernels_ncu.sh build/tools/msa/msa kl_chunks_kernel 16384 > OUT/ncu_kl.txt
#
# The output is long: send it to a file rather than to a log that may keep only its tail. The stall
# table reads ncu's source page as CSV; where its column names differ in another ncu version it
# prints the names it found instead.
#
# KERNEL is a kernel name as ncu matches it (regex:... accepted); the bench runs one
# repetition of every training op at TOKENS tokens, independent selection.
set -u -o pipefail
TOOL=${1:?usage: training_kernels_ncu.sh TOOL KERNEL [TOKENS]} KERNEL=${2:?usage: training_kernels_ncu.sh TOOL KERNEL [TOKENS]}
TOKENS=${3:-16384}
command -v ncu > /dev/null || { echo "ncu (Nsight Compute) is not on PATH" >&2; exit 1; }
REP=$(mktemp -d)/k
ncu --kernel-name "$KERNEL" --launch-count 1 --import-source no \
  --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
  --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats --section SourceCounters \
  -o "$REP" "$TOOL" bench --backend cuda --tokens "$TOKENS" --selection independent --repeats 1 > /dev/null 2>&1 ||
  { echo "ncu failed" >&2; exit 1; }
ncu --import "$REP.ncu-rep" --page details --print-units base 2> /dev/null |
  grep -v -E "^\s*-+\s*$|^\s*$|OPT |INF |WRN " | head -150
# The SASS lines with the most stall samples.
ncu --import "$REP.ncu-rep" --page source --print-source sass --csv 2> /dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
# The page opens with the kernel name on a line of its own; the header of the table is the
# first row that names a "Source" column.
start = next((i for i, r in enumerate(rows) if "Source" in r), None)
if start is None:
    sys.exit("no source table; first rows: " + " | ".join(", ".join(r[:6]) for r in rows[:3]))
head, rows = rows[start], rows[start:]
def col(*names):
    for n in names:
        if n in head:
            return head.index(n)
    return None
samp = col("Warp Stall Sampling (All Samples)", "Sampling Data (All)")
src = col("Source")
if samp is None or src is None:
    sys.exit("columns: " + ", ".join(head[:40]))
body = [r for r in rows[1:] if len(r) > max(samp, src)]
def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0
total = sum(num(r[samp]) for r in body) or 1.0
print(f"{len(body)} SASS lines, {total:.0f} samples; top 40:")
for r in sorted(body, key=lambda r: -num(r[samp]))[:40]:
    print(f"{100 * num(r[samp]) / total:5.1f}%  {r[src][:110]}")
'
