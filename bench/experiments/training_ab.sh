#!/usr/bin/env bash
# Same-machine A/B of training builds on a GPU: runs the training benchmark (`msa bench
# --tokens ...`, independent selection) for every build in turn, in rounds, and prints per size and
# op (indexer, forward, backward, deterministic backward, KL) each build's time (the best of
# its rounds) and its ratio to the first build's. Every tool's output goes to OUT, and only
# the short table to stdout, so that it survives a truncated log.
#
#   bench/experiments/training_ab.sh OUT base=/path/to/old/msa new=build/tools/msa/msa
#
# A build is NAME=BINARY (built elsewhere and carried, so that no GPU time goes into building).
# TRAINING_AB_TOKENS (default 16384), TRAINING_AB_REPEATS (default 10), TRAINING_AB_ROUNDS (default 2).
set -u -o pipefail
source "$(dirname "$0")/ab_builds.sh"
for round in $(seq "${TRAINING_AB_ROUNDS:-2}"); do
  for i in "${!names[@]}"; do
    timeout "${TRAINING_AB_TIMEOUT:-300}" "${bins[$i]}" bench --backend cuda --tokens "${TRAINING_AB_TOKENS:-16384}" \
      --selection independent --repeats "${TRAINING_AB_REPEATS:-10}" --json "$OUT/ab_${names[$i]}_$round.json" \
      > "$OUT/ab_${names[$i]}_$round.log" 2>&1 || note "bench ${names[$i]} round $round failed (see its log)"
  done
  note "round $round"
done
python3 "$ROOT/bench/experiments/training_ab_compare.py" "$OUT" "${names[@]}"
