#!/usr/bin/env bash
# Same-machine A/B of prefill builds on a GPU: runs `msa bench --prefill` for every build in
# turn, twice, over the prefill issue's chunks and the manifest's small steps
# (bench/data/prefill_issue14_chunks.jsonl, prefill_small_steps.jsonl), bf16 and FP8 caches,
# and prints per case the attention time of each build (the better of the two rounds), its
# ratio to the first build's, and the step times of the first and last builds.
#
#   bench/experiments/prefill_ab.sh OUT base=/path/to/old/msa new=build/tools/msa/msa
#
# A build is NAME=BINARY: an msa tool built elsewhere (e.g. on the development machine, then
# carried to the GPU machine), so that no GPU time goes into building. PREFILL_AB_FORMATS
# (default bf16,fp8), PREFILL_AB_REPEATS (default 5), PREFILL_AB_SETS (case lists
# bench/data/prefill_SET.jsonl; default "issue14_chunks small_steps"; mid_steps: the manifest's
# 1.4k-2.3k-query steps). JSON per build, round and set in OUT.
set -u -o pipefail
source "$(dirname "$0")/ab_builds.sh"
for round in 1 2; do
  for i in "${!names[@]}"; do
    for set in ${PREFILL_AB_SETS:-issue14_chunks small_steps}; do
      timeout "${PREFILL_AB_TIMEOUT:-300}" "${bins[$i]}" bench --backend cuda --prefill "$ROOT/bench/data/prefill_$set.jsonl" \
        --formats "${PREFILL_AB_FORMATS:-bf16,fp8}" --repeats "${PREFILL_AB_REPEATS:-5}" \
        --json "$OUT/ab_${names[$i]}_${round}_$set.json" > /dev/null 2>&1 || note "bench ${names[$i]} round $round $set failed"
    done
  done
  note "round $round"
done
python3 "$ROOT/bench/experiments/prefill_ab_compare.py" "$OUT" "${names[@]}"
