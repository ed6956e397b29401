// Pieces shared by the CPU attention forward, backward and KL backward: where a query sits,
// which of its selected blocks are attended, the masked, scaled scores of one query's 16
// heads against those blocks, and the KV-outer task list over the plan's CSR.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu/key_blocks.h"
#include "cpu/simd.h"
#include "msa/constants.h"
#include "msa/layout.h"
#include "msa/ops.h"

namespace msa::cpu {

inline constexpr int kGroup = model::kGroupSize;  // query heads per kv head
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

// KV-outer work over the plan's CSR: one task per stored key block, holding every CSR row
// (document, block) that reads it. Tasks of one wave write disjoint key rows; ranges that
// overlap (fragments starting at different rows of shared storage) get one wave each.
struct KvTasks {
  struct Task {
    int range;
    int64_t block;  // block index inside the range
    int64_t cost = 0;
  };
  std::vector<int64_t> doc_offset;           // [B + 1] first (document, block) slot of each document
  std::vector<int32_t> row_of;               // [total_rows] CSR row of (document b, block j) at doc_offset[b] + j
  std::vector<std::vector<int>> range_docs;  // documents of each range, in document order
  std::vector<std::vector<Task>> waves;

  // Tasks of `wave`, largest first by the number of (query, block) edges of kv head
  // `row_ptr` (ties keep block order).
  std::vector<Task> ordered(const PackedLayout& L, const std::vector<Task>& wave, const int32_t* row_ptr) const {
    std::vector<Task> order = wave;
    for (Task& t : order) {
      t.cost = 0;
      for (int b : range_docs[size_t(t.range)]) {
        if (t.block * kBlock >= L.document(b).k_len) continue;
        const int32_t r = row_of[size_t(doc_offset[size_t(b)] + t.block)];
        t.cost += row_ptr[r + 1] - row_ptr[r];
      }
    }
    std::stable_sort(order.begin(), order.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
    return order;
  }
};

inline KvTasks make_kv_tasks(const PackedLayout& L, const KeyBlocks& kb, const SparsePlan& plan) {
  KvTasks w;
  const int B = L.num_documents();
  w.doc_offset.assign(static_cast<size_t>(B) + 1, 0);
  for (int b = 0; b < B; ++b)
    w.doc_offset[size_t(b) + 1] = w.doc_offset[size_t(b)] + (L.document(b).k_len + kBlock - 1) / kBlock;
  w.row_of.assign(static_cast<size_t>(plan.total_rows), 0);
  const auto* rows = static_cast<const int32_t*>(plan.rows.data());  // [total_rows, 2]
  for (int64_t r = 0; r < plan.total_rows; ++r)
    w.row_of[size_t(w.doc_offset[size_t(rows[2 * r])] + rows[2 * r + 1])] = int32_t(r);
  w.range_docs.resize(kb.ranges.size());
  for (int b = 0; b < B; ++b) w.range_docs[size_t(kb.doc_range[size_t(b)])].push_back(b);
  if (kb.disjoint) w.waves.emplace_back();
  for (size_t r = 0; r < kb.ranges.size(); ++r) {
    if (!kb.disjoint) w.waves.emplace_back();
    for (int64_t j = 0; j < kb.blocks_of(kb.ranges[r]); ++j) w.waves.back().push_back({int(r), j});
  }
  return w;
}

}  // namespace msa::cpu
