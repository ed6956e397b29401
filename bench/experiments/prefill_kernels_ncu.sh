#!/usr/bin/env bash
# Per-kernel device times of prefill steps under Nsight Compute: every kernel of a
# `msa bench --prefill` run is timed on its own (serialised, caches flushed between kernels,
# so small kernels read from memory), and the last N are printed: with --repeats 1 the last
# step's plan upload, indexer (score and select kernels), schedule build, forward tasks and merge.
#
#   sed -n 2p bench/data/prefill_small_steps.jsonl > /tmp/one.jsonl   # one case of a manifest
#   NCU_LAST=8 bench/experiments/prefill_kernels_ncu.sh build/tools/msa/msa /tmp/one.jsonl [FORMAT]
#
# Run 35 (docs/performance.md) located a small step's fixed costs with it.
set -u -o pipefail
TOOL=${1:?usage: prefill_kernels_ncu.sh TOOL CASES.jsonl [FORMAT]} CASES=${2:?usage: prefill_kernels_ncu.sh TOOL CASES.jsonl [FORMAT]}
FORMAT=${3:-bf16}
command -v ncu > /dev/null || { echo "ncu (Nsight Compute) is not on PATH" >&2; exit 1; }
ncu --csv --print-units base --metrics gpu__time_duration.sum \
  "$TOOL" bench --backend cuda --prefill "$CASES" --formats "$FORMAT" --repeats 1 2> /dev/null |
  NCU_LAST=${NCU_LAST:-16} python3 -c '
import csv, os, sys
rows = [r for r in csv.reader(sys.stdin) if len(r) > 5]
if not rows:
    sys.exit("no kernels were profiled")
head = rows[0]
name, value, ident = head.index("Kernel Name"), head.index("Metric Value"), head.index("ID")
print("id    ns        kernel")
for r in rows[1:][-int(os.environ["NCU_LAST"]):]:
    print(f"{r[ident]:<5} {r[value]:>9} {r[name][:90]}")
'
