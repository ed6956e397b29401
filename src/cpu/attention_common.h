// Pieces shared by the CPU attention forward, backward and KL backward: where a query sits,
// which of its selected blocks are attended, and the masked, scaled scores of one query's
// 16 heads against those blocks.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "cpu/key_blocks.h"
#include "cpu/simd.h"
#include "msa/ops.h"

namespace msa::cpu {

inline constexpr int kGroup = 16;  // query heads per kv head
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct QueryPlace {
  int doc;
  int64_t local_index;  // query index inside its document
  int64_t pos;          // causal position: keys t <= pos are visible
};

inline QueryPlace place_of(const PackedLayout& L, int64_t row) {
  const int b = L.query_document()[size_t(row)];
  const DocumentSpan& d = L.document(b);
  const int64_t i = row - d.q_start;
  return {b, i, d.k_len - d.q_len + i};
}

// Attended blocks of one top-k row: valid ids (in [0, pos / 128]), each once, in slot order.
inline int attended_blocks(const int32_t* sel, int K, int64_t pos, int32_t* out) {
  const int64_t local = pos / kBlock;
  int n = 0;
  for (int s = 0; s < K; ++s) {
    const int32_t id = sel[s];
    if (id < 0 || id > local) continue;
    bool seen = false;
    for (int t = 0; t < n; ++t) seen |= out[t] == id;
    if (!seen) out[n++] = id;
  }
  return n;
}

// Keys of block `id` visible from `pos` (128 except in the local block).
inline int visible_keys(int32_t id, int64_t pos) {
  const int64_t v = pos - int64_t(id) * kBlock + 1;
  return v >= kBlock ? kBlock : int(v);
}

// S[m, s * 128 + t] = scale * <a_m, key t of block blocks[s]> for the `rows` vectors a
// ([rows][128] fp32), masked to -inf past `pos`. keys_t: transposed fp32 blocks [d][t];
// block ids are relative to `doc_block`. S has leading dimension `ld`.
inline void masked_scores(int rows, const float* a, const float* keys_t, int64_t doc_block, const int32_t* blocks,
                          int n, int64_t pos, float scale, float* S, int64_t ld) {
  for (int s = 0; s < n; ++s) {
    float* out = S + s * kBlock;
    gemm<false>(rows, kBlock, kDim, a, kDim, 1, keys_t + (doc_block + blocks[s]) * kBlockElems, kBlock, out, ld);
    const int visible = visible_keys(blocks[s], pos);
    for (int m = 0; m < rows; ++m) {
      float* r = out + m * ld;
      for (int c = 0; c < kBlock; c += kLanes) vstore(r + c, vload(r + c) * scale);
      for (int t = visible; t < kBlock; ++t) r[t] = kNegInf;
    }
  }
}

}  // namespace msa::cpu
