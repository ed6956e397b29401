// The chunk of the CUDA forward's token-major walk (src/cuda/build_plan.cu,
// build_forward_order).
//
// The forward walks its work items by chunks of C packed queries (then KV head, then key
// block), and its CTAs move through that list together, so a chunk's Q rows are re-read from
// L2 instead of once per selected block from memory. The price is one key-block load per
// (head, block, chunk): a chunk must give each key block enough queries, or a long prefix
// loses more to block loads than Q in L2 gains. Within a document, a chunk gives each of its
// key blocks about topk * min(C, q_len) / blocks queries (every block counted as visible,
// which undercounts causal documents). The rule takes the smallest C in
// [kForwardChunkMin, kForwardChunkMax] (powers of two) at which that count, averaged over the
// documents by their queries, reaches kForwardQueriesPerBlock; 0 (the schedule's own order)
// when none does. The bounds keep a chunk's Q of one KV head (C x 16 heads x 256 B) within a
// fraction of the L2: 8 MB at C = 2048.
#pragma once

#include <algorithm>
#include <cstdint>

#include "msa/constants.h"
#include "msa/layout.h"

namespace msa::detail {

inline constexpr int kForwardChunkMin = 2048;
inline constexpr int kForwardChunkMax = 2048;  // 4096 was not measured (performance.md run 40)
inline constexpr double kForwardQueriesPerBlock = 32;  // four 8-query tasks a key-block load

inline int forward_chunk_queries(const PackedLayout& L) {
  for (int chunk = kForwardChunkMin; chunk <= kForwardChunkMax; chunk *= 2) {
    double weighted = 0, queries = 0;
    for (int b = 0; b < L.num_documents(); ++b) {
      const DocumentSpan& d = L.document(b);
      if (d.q_len == 0) continue;
      const double blocks = double(std::max<int64_t>(1, (d.k_len + model::kBlockSize - 1) / model::kBlockSize));
      weighted += double(d.q_len) * model::kTopk * std::min<double>(chunk, double(d.q_len)) / blocks;
      queries += double(d.q_len);
    }
    if (queries > 0 && weighted >= kForwardQueriesPerBlock * queries) return chunk;
  }
  return 0;
}

}  // namespace msa::detail
