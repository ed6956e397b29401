// The query-major walks of the CUDA training kernels (src/cuda/build_plan.cu,
// build_walk_order): the forward's chunk and the backward's window.
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
inline constexpr int kForwardChunkMax = 2048;  // 4096: +6 % at 64k (performance.md run 41)
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

// The forward's partial outputs (one per (query, head, selected block): ~269 KB a query with
// 64 heads) are held for one window of its walk at a time: the window's tasks, then its merge,
// then the next window in the same space. A window is whole chunks of the walk, at least
// kForwardWindowMin queries, and at most kForwardWindows windows a call: at 16k tokens 4
// windows of 4096 queries (1.1 GB of partials instead of 4.4), at 128k 16 of 8192 (2.2 GB
// instead of 35). Each window costs a launch pair and a wave's tail (≈ 27 µs on the H200, run
// 43; 4096-query windows halve the count at 16k), so layouts of up to kForwardWindowedAbove
// queries (2.2 GB of partials) keep one window, as does a layout without a walk (chunk 0).
inline constexpr int64_t kForwardWindows = 16;
inline constexpr int64_t kForwardWindowedAbove = 8192;
inline constexpr int64_t kForwardWindowMin = 4096;

inline int64_t forward_window_queries(int64_t total_q, int chunk) {
  if (chunk <= 0 || total_q <= std::max<int64_t>(chunk, kForwardWindowedAbove)) return total_q;
  const int64_t chunks = (total_q + chunk - 1) / chunk;
  const int64_t least = (kForwardWindowMin + chunk - 1) / chunk * chunk;
  return std::min(total_q, std::max(least, (chunks + kForwardWindows - 1) / kForwardWindows * chunk));
}

// The chunk the forward walks by: forward_chunk_queries' where it gives one; else, for a layout
// of more than kForwardWindowedQueries queries (a 256k-token document gives its key blocks only
// 16 queries a 2048-query chunk), chunks as large as its windows, so that the forward still
// holds one window's partials at a time (4.4 GB at 256k tokens instead of 71) at the price of
// loading each key block once per window. 0: the schedule's own order, one window.
inline constexpr int64_t kForwardWindowedQueries = 32768;

inline int forward_walk_chunk(const PackedLayout& L) {
  const int chunk = forward_chunk_queries(L);
  if (chunk > 0 || L.total_q() <= kForwardWindowedQueries) return chunk;
  return int(forward_window_queries(L.total_q(), kForwardChunkMin));
}

// The same for `L` and its walk: what the plan's window tables and the forward's workspace are
// both sized by.
inline int64_t forward_window_queries(const PackedLayout& L) {
  return forward_window_queries(L.total_q(), forward_walk_chunk(L));
}

// The backward (default mode: fp32 dQ reductions) walks its 128-query chunk items by windows
// of kBackwardWindow packed queries, so that a window's dQ accumulator lines (1024 x 16 heads
// x 512 B = 8 MB a KV head), Q and dO stay in L2 while the window's chunks reduce into them.
// Measured on long documents only: -9 % at 16k, +4 % at 4k (docs/performance.md, run 41), so
// the walk needs documents of at least kBackwardWindowMinQueries queries on average (weighted
// by queries, as above); 0: the chunk list's own order. The KL backward keeps the list order
// (+2 % at 16k with the window walk): its chunks share key blocks, not query rows.
inline constexpr int kBackwardWindow = 1024;
inline constexpr int64_t kBackwardWindowMinQueries = 8192;

inline int backward_window_queries(const PackedLayout& L) {
  double weighted = 0, queries = 0;
  for (int b = 0; b < L.num_documents(); ++b) {
    const double q = double(L.document(b).q_len);
    weighted += q * q;
    queries += q;
  }
  return queries > 0 && weighted >= double(kBackwardWindowMinQueries) * queries ? kBackwardWindow : 0;
}

}  // namespace msa::detail
