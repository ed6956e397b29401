#!/usr/bin/env bash
# Where the time of the KV-outer forward goes, per task: a timeline of every CTA from a build
# with bench/experiments/forward_trace.patch applied (the product tree stays as it is). The
# patch has thread 0 of the producer and of the consumers write the global timer (ns, one
# clock for every SM) at fixed points of each task: Q loads issued, block staged, Q stage full,
# block entered, S + softmax done, V ready, P V done, partial stored; the forward's host code
# writes the last call's timeline to $MSA_FORWARD_TRACE.
#
#   # on the development machine: a traced tool, to be carried to the GPU machine
#   bench/experiments/forward_trace.sh build /tmp/msa-trace      # -> /tmp/msa-trace/build/tools/msa/msa
#   # on the GPU machine: one prefill step per manifest line (one trace each), then the summary
#   bench/experiments/forward_trace.sh run OUT TOOL CASES.jsonl [FORMAT]
#
# FORMAT is a K/V cache format of `msa bench --prefill` (default bf16). Each case is timed once
# after warm-up, so the trace is of a warm step; OUT gets trace_<case_id>.bin and the summary
# (forward_trace_summary.py) is printed.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mode=${1:?usage: forward_trace.sh build DIR | run OUT TOOL CASES.jsonl [FORMAT]}
case "$mode" in
  build)
    DIR=${2:?build DIR}
    rm -rf "$DIR" && mkdir -p "$DIR" || exit 1
    (cd "$ROOT" && git archive HEAD) | tar -x -C "$DIR" || exit 1
    (cd "$DIR" && git apply "$ROOT/bench/experiments/forward_trace.patch") || { echo "the patch no longer applies" >&2; exit 1; }
    export PATH=/usr/local/cuda/bin:$PATH
    (cd "$DIR" && cmake --preset release > "$DIR/configure.log" 2>&1 && ninja -C build msa_tool > "$DIR/build.log" 2>&1) ||
      { tail -20 "$DIR/build.log"; exit 1; }
    echo "$DIR/build/tools/msa/msa"
    ;;
  run)
    OUT=${2:?run OUT TOOL CASES} TOOL=${3:?run OUT TOOL CASES} CASES=${4:?run OUT TOOL CASES} FORMAT=${5:-bf16}
    mkdir -p "$OUT"
    n=0
    while IFS= read -r line; do
      [ -z "$line" ] && continue
      n=$((n + 1))
      id=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1]).get("case_id", "case"))' "$line")
      printf '%s\n' "$line" > "$OUT/case_$n.jsonl"
      MSA_FORWARD_TRACE="$OUT/trace_${n}_$id.bin" timeout 120 "$TOOL" bench --backend cuda --prefill "$OUT/case_$n.jsonl" \
        --formats "$FORMAT" --repeats 1 > "$OUT/bench_$n.log" 2>&1 || echo "case $n ($id): msa bench failed" >&2
    done < "$CASES"
    shopt -s nullglob
    traces=("$OUT"/trace_*.bin)
    ((${#traces[@]} > 0)) || { echo "no trace was written (see $OUT/bench_*.log)" >&2; exit 1; }
    python3 "$ROOT/bench/experiments/forward_trace_summary.py" "${traces[@]}"
    ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
