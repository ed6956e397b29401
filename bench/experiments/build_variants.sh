#!/usr/bin/env bash
# Builds the tool and the GPU tests of this tree and of the tree with patches applied, each
# into OUT/NAME/{msa,msa_tests} (stripped; `gzip -1` with VARIANTS_GZIP=1), for the A/B
# scripts that take prebuilt tools (training_ab.sh, prefill_ab.sh). One build directory is
# reused, so that a variant recompiles only what its patches touch; the tree is restored
# after each variant (`git checkout` of the patched files), so start from a clean tree.
#
#   bench/experiments/build_variants.sh OUT base= c256=chunk_256.patch both=chunk_256.patch+other.patch
#
# NAME= (no patch) is the tree as it is. Patch names are files in bench/experiments/.
# VARIANTS_BUILD (default build-variants) is the build directory; CUDA and the project's
# dependencies as for scripts/build.sh.
set -euo pipefail
OUT=${1:?usage: build_variants.sh OUT NAME=[PATCH[+PATCH...]] ...}; shift
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${VARIANTS_BUILD:-$ROOT/build-variants}
cd "$ROOT"
mkdir -p "$OUT"
[ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "the tree has uncommitted changes" >&2; exit 2; }
export PATH=/usr/local/cuda/bin:$PATH
[ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSA_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DMSA_BUILD_PYTHON=OFF > /dev/null
for spec in "$@"; do
  name=${spec%%=*} patches=${spec#*=}
  IFS=+ read -r -a list <<< "$patches"
  for p in "${list[@]}"; do [ -n "$p" ] && git apply "bench/experiments/$p"; done
  status=0
  ninja -C "$BUILD" msa_tests msa_tool > "$OUT/$name.build.log" 2>&1 || status=$?
  git checkout -q -- .
  [ "$status" = 0 ] || { echo "$name: build failed (see $OUT/$name.build.log)" >&2; exit 1; }
  mkdir -p "$OUT/$name"
  cp "$BUILD/tools/msa/msa" "$BUILD/tests/msa_tests" "$OUT/$name/"
  strip "$OUT/$name/msa" "$OUT/$name/msa_tests"
  [ "${VARIANTS_GZIP:-0}" = 1 ] && gzip -1 -f "$OUT/$name/msa" "$OUT/$name/msa_tests"
  echo "$name: $(du -sh "$OUT/$name" | cut -f1)"
done
