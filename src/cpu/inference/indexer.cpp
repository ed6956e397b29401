// Paged indexer: per (query row, index head) the 16 logical pages to attend, scored against
// the index-K cache. Rows are processed in tiles of consecutive rows of one request so that
// each history page is dequantised once per tile.
#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/inference/common.h"
#include "cpu/selection.h"
#include "cpu/simd.h"

namespace msa::cpu {

namespace {

using namespace inference;

constexpr int kRowTile = 8;

int64_t pages_in_use(const InferencePlan& plan) { return std::max<int64_t>(1, (plan.max_seqlen_k + kPageSize - 1) / kPageSize); }

}  // namespace

int64_t inference_scratch_f32(const InferencePlan& plan) {
  const int64_t Hi = plan.topo.num_index_heads;
  const int64_t indexer =
      kRowTile * Hi * kHeadDim + 2 * kPageSize * kHeadDim + kRowTile * Hi * kPageSize + kRowTile * Hi * pages_in_use(plan);
  // Attention: q of one group, K (rows and transposed) and V of one page, an output row, the
  // scores, maxima, sums and accumulators of the group's heads.
  const int64_t group = plan.topo.group_size();
  const int64_t attention = group * kHeadDim * 3 + 3 * kPageSize * kHeadDim + kHeadDim + group * kPageSize + 2 * group;
  return std::max(indexer, attention);
}


void paged_indexer(const InferencePlan& plan, const PagedIndexerParams& p, const RunOptions& opt) {
  const int Hi = plan.topo.num_index_heads;
  const int64_t T = plan.total_q, max_pages = plan.max_pages, npages = pages_in_use(plan);
  const auto* cu_q = static_cast<const int32_t*>(plan.cu_seqlens_q.data());
  const auto* request = static_cast<const int32_t*>(plan.query_request.data());
  const auto* positions = static_cast<const int32_t*>(plan.positions.data());
  const auto* page_table = static_cast<const int32_t*>(plan.page_table.data());
  const int64_t f32_stride = plan.scratch_f32.view().shape[1];
  int32_t* topk = p.topk.as<int32_t>();
  const int threads = std::min(thread_count(opt), plan.num_threads);

#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    float* q = static_cast<float*>(plan.scratch_f32.data()) + tid * f32_stride;  // [R, Hi, 128]
    float* keys = q + kRowTile * Hi * kHeadDim;                                   // [128 dims, 128 tokens]
    float* key_rows = keys + kPageSize * kHeadDim;                                // [128 tokens, 128 dims]
    float* token_scores = key_rows + kPageSize * kHeadDim;                        // [R, Hi, 128]
    float* scores = token_scores + kRowTile * Hi * kPageSize;                     // [R, Hi, npages]
    Ranked ranked[kTopk];

#pragma omp for schedule(dynamic)
    for (int64_t r0 = 0; r0 < T; ++r0) {
      const int b = request[r0];
      if ((r0 - cu_q[b]) % kRowTile != 0) continue;  // not the first row of a tile
      const int64_t r1 = std::min<int64_t>(cu_q[b + 1], r0 + kRowTile);
      const int32_t* pages = page_table + b * max_pages;

      // Rows that see more than 16 pages need scores of their history pages.
      int64_t scored_pages = 0;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t local = positions[r] < 0 ? -1 : positions[r] / kPageSize;
        if (local + 1 > kTopk) scored_pages = std::max(scored_pages, local);
        for (int g = 0; g < Hi; ++g)
          load_row(p.index_q, r * p.index_q.stride[0] + g * p.index_q.stride[1], kHeadDim,
                   q + ((r - r0) * Hi + g) * kHeadDim);
      }
      for (int64_t j = 0; j < scored_pages; ++j) {
        index_keys_transposed(p.index_k_cache, pages[j], keys, key_rows);
        gemm<false>(int(r1 - r0) * Hi, kPageSize, kHeadDim, q, kHeadDim, 1, keys, kPageSize, token_scores, kPageSize);
        for (int64_t r = r0; r < r1; ++r) {
          if (positions[r] < 0 || j >= positions[r] / kPageSize || positions[r] / kPageSize + 1 <= kTopk) continue;
          for (int g = 0; g < Hi; ++g) {
            const float* ts = token_scores + ((r - r0) * Hi + g) * kPageSize;
            float best = -std::numeric_limits<float>::infinity();
            bool nan = false;
            for (int t = 0; t < kPageSize; ++t) {
              nan |= std::isnan(ts[t]);
              best = std::max(best, ts[t]);
            }
            scores[((r - r0) * Hi + g) * npages + j] = nan ? std::numeric_limits<float>::quiet_NaN() : best;
          }
        }
      }

      for (int64_t r = r0; r < r1; ++r) {
        const int64_t local = positions[r] < 0 ? -1 : positions[r] / kPageSize;
        for (int g = 0; g < Hi; ++g) {
          // Rows with a negative position (padding) see no page: all -1.
          select_row(scores + ((r - r0) * Hi + g) * npages, local + 1, plan.topo, topk + (int64_t(g) * T + r) * kTopk,
                     ranked);
        }
      }
    }
  }
}

}  // namespace msa::cpu
