#!/usr/bin/env bash
# Same-machine A/B of decode builds on a GPU: builds each source tree's msa tool, then runs
# `msa bench --decode` for every build in turn, twice, and prints per shape the attention time
# of each build (the better of the two rounds) and its ratio to the first build's.
#
#   git archive -o base.tar main           # on the development machine: the trees to compare
#   bench/experiments/decode_ab.sh OUT base=base.tar new=.     # on the GPU machine
#
# A build is NAME=TARBALL (a `git archive` of some revision) or NAME=. (this tree). The shapes
# are msa bench's options, from DECODE_AB_SHAPES (default: NVFP4 / FP8 / bf16 at 8 x 4k and at
# 32 and 128 x 32k and 128k, Q 1, 4, 8, 16, both selections). JSON per build and round in OUT.
set -u -o pipefail
OUT=${1:?usage: decode_ab.sh OUT NAME=TARBALL|. ...}; shift
(($# >= 2)) || { echo "give at least two builds" >&2; exit 2; }
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export PATH=/usr/local/cuda/bin:$PATH
T0=$(date +%s)
note() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
SHAPES=${DECODE_AB_SHAPES:-"--batches 8 --contexts 4k --queries 1,4,8 --formats bf16,fp8,nvfp4;--batches 32,128 --contexts 32k,128k --queries 1,4,8,16 --formats bf16,fp8,nvfp4"}
names=()
for spec in "$@"; do
  name=${spec%%=*} src=${spec#*=}
  names+=("$name")
  if [ "$src" != . ]; then
    mkdir -p "/tmp/decode_ab/src-$name" && tar -xf "$src" -C "/tmp/decode_ab/src-$name" || exit 1
    src=/tmp/decode_ab/src-$name
  else
    src=$ROOT
  fi
  build=/tmp/decode_ab/build-$name
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSA_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DMSA_BUILD_PYTHON=OFF -DMSA_BUILD_TESTS=OFF > "$OUT/configure-$name.log" 2>&1 &&
    ninja -C "$build" -j "${MSA_JOBS:-16}" msa_tool > "$OUT/build-$name.log" 2>&1 ||
    { note "build $name failed"; grep -E "error" "$OUT/build-$name.log" | head; exit 1; }
  note "built $name"
done
for round in 1 2; do
  for name in "${names[@]}"; do
    IFS=';' read -ra sets <<< "$SHAPES"
    for i in "${!sets[@]}"; do
      # shellcheck disable=SC2086
      timeout "${DECODE_AB_TIMEOUT:-300}" "/tmp/decode_ab/build-$name/tools/msa/msa" bench --decode --backend cuda \
        --selection "${DECODE_AB_SELECTION:-both}" --repeats "${DECODE_AB_REPEATS:-5}" ${sets[$i]} \
        --json "$OUT/ab_${name}_${round}_${i}.json" > /dev/null 2>&1 || note "bench $name round $round set $i failed"
    done
  done
  note "round $round"
done
python3 "$ROOT/bench/experiments/decode_ab_compare.py" "$OUT" "${names[@]}"
