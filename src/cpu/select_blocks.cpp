// Indexer: block-max index scores and the top-k block selection of every (query, index
// head), plus the optional LSE of the index scores over the selected causal keys.
//
// The scores are a causal GEMM: one 128-key block at a time times a tile of query rows
// (all index heads: 64 vectors, held transposed so each lane is one vector), max-pooled per
// block in the epilogue with vertical vector maxima. Only per-thread scratch of
// [blocks, 64 vectors] block scores is kept.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_state.h"
#include "backend.h"
#include "cpu/common.h"
#include "cpu/key_blocks.h"
#include "cpu/selection.h"
#include "cpu/simd.h"

namespace msa::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kTileVectors = 64;  // query rows x index heads per tile

// max with NaN winning: a block holding a NaN score scores NaN and is never ranked.
inline f32x16 nan_max(f32x16 m, f32x16 s) { return (s > m) | (s != s) ? s : m; }

}  // namespace

void select_blocks(const Topology& topo, const PackedLayout& L, const SelectBlocksParams& p, const RunOptions& opt) {
  const int threads = thread_count(opt);
  const int Hi = topo.num_index_heads, K = topo.topk;
  const int64_t total_q = L.total_q();
  const float scale = topo.indexer_scale();
  const bool want_lse = p.selected_lse.present();
  const float lse_scale = scale / p.lse_temperature;  // index score / temperature per raw dot
  constexpr int kGroups = kTileVectors / kLanes;      // lane groups of a tile

  const KeyBlocks kb = plan_key_blocks(L);
  const std::vector<float> keys = gather_blocks(kb, p.index_k, 0, /*transposed=*/false, threads);  // [blocks][t][d]

  // Tasks: tiles of consecutive query rows of one document, most blocks first.
  const int rows_per_tile = kTileVectors / Hi;
  struct Tile {
    int doc;
    int64_t first;  // document-local query index
    int64_t blocks;
  };
  std::vector<Tile> tiles;
  int64_t max_blocks = 1;
  for (int b = 0; b < L.num_documents(); ++b) {
    const DocumentSpan& d = L.document(b);
    for (int64_t i = 0; i < d.q_len; i += rows_per_tile) {
      const int64_t last = std::min(d.q_len, i + rows_per_tile) - 1;
      const int64_t blocks = (d.k_len - d.q_len + last) / kBlock + 1;
      tiles.push_back({b, i, blocks});
      max_blocks = std::max(max_blocks, blocks);
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.blocks > b.blocks; });

  int32_t* topk = p.topk.as<int32_t>();                 // [Hi, total_q, K]
  float* sel_lse = want_lse ? p.selected_lse.as<float>() : nullptr;

#pragma omp parallel num_threads(threads)
  {
    // Lane v of a tile is query row v / Hi, index head v % Hi.
    std::vector<float> qtile_t(size_t(kDim) * kTileVectors);                    // [d][vectors]
    std::vector<float> scores(size_t(kBlock) * kTileVectors);                   // [t][vectors]
    std::vector<float> block_score(size_t(max_blocks) * kTileVectors);          // [blocks][vectors]
    std::vector<float> block_top(want_lse ? size_t(max_blocks) * kTileVectors : 0);  // max of s / T
    std::vector<float> block_sum(want_lse ? size_t(max_blocks) * kTileVectors : 0);  // Σ exp(s / T - top)
    std::vector<float> lane_score(static_cast<size_t>(max_blocks));              // one lane's block scores
    std::vector<Ranked> ranked(static_cast<size_t>(K));

#pragma omp for schedule(dynamic, 1)
    for (size_t ti = 0; ti < tiles.size(); ++ti) {
      const Tile& tile = tiles[ti];
      const DocumentSpan& d = L.document(tile.doc);
      const int64_t rows = std::min<int64_t>(rows_per_tile, d.q_len - tile.first);
      const int vectors = int(rows) * Hi;
      const int64_t first_row = d.q_start + tile.first;
      const int64_t first_pos = d.k_len - d.q_len + tile.first;
      std::fill(qtile_t.begin(), qtile_t.end(), 0.0f);
      for (int v = 0; v < vectors; ++v) {
        float row[kDim];  // index_q [total_q, Hi, 128], bf16 or E4M3
        load_row(p.index_q, (first_row * Hi + v) * kDim, kDim, row);
        for (int e = 0; e < kDim; ++e) qtile_t[size_t(e * kTileVectors + v)] = row[e];
      }
      // Causal limit of each lane, relative to the tile's first position (unused lanes: -1).
      f32x16 limit[kGroups];
      for (int c = 0; c < kGroups; ++c)
        for (int l = 0; l < kLanes; ++l) {
          const int v = c * kLanes + l;
          limit[c][l] = v < vectors ? float(v / Hi) : -1.0f;
        }

      for (int64_t j = 0; j < tile.blocks; ++j) {
        gemm<false>(kBlock, kTileVectors, kDim, keys.data() + (kb.doc_block[size_t(tile.doc)] + j) * kBlockElems, kDim, 1,
                    qtile_t.data(), kTileVectors, scores.data(), kTileVectors);
        // Key t of this block is masked for lane v when j*128 + t > first_pos + v / Hi.
        const int64_t key0 = j * kBlock - first_pos;
        const bool diagonal = key0 + kBlock - 1 > 0;  // some lane may not see every key
        for (int c = 0; c < kGroups; ++c) {
          f32x16 m = vsplat(kNegInf);
          for (int t = 0; t < kBlock; ++t) {
            f32x16 x = vload(scores.data() + t * kTileVectors + c * kLanes);
            if (diagonal) x = vsplat(float(key0 + t)) > limit[c] ? vsplat(kNegInf) : x;
            m = nan_max(m, x);
          }
          vstore(block_score.data() + j * kTileVectors + c * kLanes, m * scale);
          if (want_lse) {
            const f32x16 top = m * lse_scale;
            const i32x16 finite = top - top == 0.0f;  // not ±inf, not NaN
            const f32x16 shift = finite ? top : vsplat(0.0f);
            f32x16 sum{};
            for (int t = 0; t < kBlock; ++t) {
              f32x16 e = vexp(vload(scores.data() + t * kTileVectors + c * kLanes) * lse_scale - shift);
              if (diagonal) e = vsplat(float(key0 + t)) > limit[c] ? vsplat(0.0f) : e;
              sum += e;
            }
            vstore(block_top.data() + j * kTileVectors + c * kLanes, top);
            vstore(block_sum.data() + j * kTileVectors + c * kLanes, finite ? sum : vsplat(1.0f));
          }
        }
      }

      for (int v = 0; v < vectors; ++v) {
        const int64_t row = first_row + v / Hi;
        const int g = v % Hi;
        const int64_t nvis = (first_pos + v / Hi) / kBlock + 1;
        int32_t* out = topk + (int64_t(g) * total_q + row) * K;
        for (int64_t j = 0; j < nvis; ++j) lane_score[size_t(j)] = block_score[size_t(j * kTileVectors + v)];
        select_row(lane_score.data(), nvis, topo, out, ranked.data());
        if (want_lse) {
          // LSE of the selected blocks from their (top, sum) pairs, with the IEEE rules of
          // src/attention_state.h (NaN wins, then +inf; -inf when nothing is selected).
          LogSumExp acc;
          for (int s = 0; s < K && out[s] >= 0; ++s) {
            const size_t at = size_t(out[s]) * kTileVectors + size_t(v);
            acc.add(block_top[at], block_sum[at]);
          }
          const float lse = acc.result();
          sel_lse[int64_t(g) * total_q + row] = lse;
        }
      }
    }
  }
}

}  // namespace msa::cpu
