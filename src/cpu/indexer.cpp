// Indexer: block-max index scores and the top-k block selection of every (query, index
// head), plus the optional LSE of the index scores over the selected causal keys.
//
// The scores are a causal GEMM: a tile of query rows (all index heads, 64 vectors) times
// one 128-key block at a time, max-pooled per block in the epilogue. Only per-thread
// scratch of [64 vectors, blocks] block scores is kept.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend.h"
#include "cpu/common.h"
#include "cpu/key_blocks.h"
#include "cpu/simd.h"

namespace msa::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kTileVectors = 64;  // query rows x index heads per tile

// max with NaN winning: a block holding a NaN score scores NaN and is never ranked.
inline f32x16 nan_max(f32x16 m, f32x16 s) { return (s > m) | (s != s) ? s : m; }

struct Ranked {
  float score;
  int32_t id;
};

// Writes the selection of one (query, index head) from its visible block scores.
// Order: init blocks ascending, ranked history best first, local blocks ascending (the
// query's own block last); unused slots -1.
void select_row(const float* score, int64_t nvis, const Topology& topo, int32_t* out, Ranked* ranked) {
  const int K = topo.topk;
  int n = 0;
  if (nvis <= K) {
    for (; n < nvis; ++n) out[n] = int32_t(n);
  } else {
    const int64_t local_begin = nvis - topo.local_blocks;  // > 0 since nvis > K >= local_blocks
    const int64_t init_end = std::min<int64_t>(topo.init_blocks, local_begin);
    const int slots = K - int(init_end) - topo.local_blocks;
    for (int64_t b = 0; b < init_end; ++b) out[n++] = int32_t(b);
    // Best `slots` of [init_end, local_begin) by (score desc, id asc), kept sorted.
    int count = 0;
    for (int64_t b = init_end; b < local_begin && slots > 0; ++b) {
      const float s = score[b];
      if (s != s) continue;
      int pos;
      if (count < slots) {
        pos = count++;
      } else {
        if (!(s > ranked[slots - 1].score)) continue;
        pos = slots - 1;
      }
      while (pos > 0 && s > ranked[pos - 1].score) {  // ids arrive ascending: equal scores stay behind
        ranked[pos] = ranked[pos - 1];
        --pos;
      }
      ranked[pos] = {s, int32_t(b)};
    }
    for (int i = 0; i < count; ++i) out[n++] = ranked[i].id;
    for (int64_t b = local_begin; b < nvis; ++b) out[n++] = int32_t(b);
  }
  for (; n < K; ++n) out[n] = -1;
}

}  // namespace

void select_blocks(const Topology& topo, const PackedLayout& L, const SelectBlocksParams& p, const RunOptions& opt) {
  const int threads = thread_count(opt);
  const int Hi = topo.num_index_heads, K = topo.topk;
  const int64_t total_q = L.total_q();
  const float scale = topo.indexer_scale();
  const bool want_lse = p.selected_lse.present();
  const float lse_scale = scale / p.lse_temperature;  // index score / temperature per raw dot

  const KeyBlocks kb = plan_key_blocks(L);
  const std::vector<float> keys_t = gather_blocks(kb, p.index_k, 0, /*transposed=*/true, threads);  // [blocks][d][t]

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

  const uint16_t* iq = p.index_q.as<const uint16_t>();  // [total_q, Hi, 128] bf16
  int32_t* topk = p.topk.as<int32_t>();                 // [Hi, total_q, K]
  float* sel_lse = want_lse ? p.selected_lse.as<float>() : nullptr;

#pragma omp parallel num_threads(threads)
  {
    std::vector<float> qtile(size_t(kTileVectors) * kDim);          // [vectors][d]
    std::vector<float> scores(size_t(kTileVectors) * kBlock);       // [vectors][t]
    std::vector<float> block_score(size_t(kTileVectors * max_blocks));  // [vectors][blocks]
    std::vector<float> block_lse(want_lse ? size_t(kTileVectors * max_blocks) : 0);
    std::vector<Ranked> ranked(static_cast<size_t>(K));

#pragma omp for schedule(dynamic, 1)
    for (size_t ti = 0; ti < tiles.size(); ++ti) {
      const Tile& tile = tiles[ti];
      const DocumentSpan& d = L.document(tile.doc);
      const int64_t rows = std::min<int64_t>(rows_per_tile, d.q_len - tile.first);
      const int vectors = int(rows) * Hi;
      const int64_t first_row = d.q_start + tile.first;
      const int64_t first_pos = d.k_len - d.q_len + tile.first;
      for (int64_t i = 0; i < int64_t(vectors) * kDim; ++i) qtile[size_t(i)] = bf16_to_float(iq[first_row * Hi * kDim + i]);

      for (int64_t j = 0; j < tile.blocks; ++j) {
        gemm<false>(vectors, kBlock, kDim, qtile.data(), kDim, 1,
                    keys_t.data() + (kb.doc_block[size_t(tile.doc)] + j) * kBlockElems, kBlock, scores.data(), kBlock);
        for (int v = 0; v < vectors; ++v) {
          const int64_t pos = first_pos + v / Hi;
          if (j * kBlock > pos) continue;  // block not visible to this query
          const int64_t visible = std::min<int64_t>(kBlock, pos - j * kBlock + 1);
          const float* s = scores.data() + size_t(v) * kBlock;
          f32x16 m = vsplat(kNegInf);
          for (int c = 0; c < kBlock; c += kLanes) {
            f32x16 x = vload(s + c);
            if (c + kLanes > visible) {
              for (int l = 0; l < kLanes; ++l)
                if (c + l >= visible) x[l] = kNegInf;
            }
            m = nan_max(m, x);
          }
          float mx = m[0];
          for (int l = 1; l < kLanes; ++l) mx = (m[l] > mx || m[l] != m[l]) ? m[l] : mx;
          block_score[size_t(v * max_blocks + j)] = scale * mx;
          if (want_lse) {
            const float top = lse_scale * mx;
            f32x16 sum{};
            if (std::isfinite(top)) {
              for (int c = 0; c < visible; c += kLanes) {
                f32x16 e = vexp(vload(s + c) * lse_scale - top);
                if (c + kLanes > visible)
                  for (int l = 0; l < kLanes; ++l)
                    if (c + l >= visible) e[l] = 0.0f;
                sum += e;
              }
              block_lse[size_t(v * max_blocks + j)] = top + std::log(hsum(sum));
            } else {
              block_lse[size_t(v * max_blocks + j)] = top;  // -inf, +inf or NaN carries through
            }
          }
        }
      }

      for (int v = 0; v < vectors; ++v) {
        const int64_t row = first_row + v / Hi;
        const int g = v % Hi;
        const int64_t nvis = (first_pos + v / Hi) / kBlock + 1;
        int32_t* out = topk + (int64_t(g) * total_q + row) * K;
        select_row(block_score.data() + size_t(v) * max_blocks, nvis, topo, out, ranked.data());
        if (want_lse) {
          const float* bl = block_lse.data() + size_t(v) * max_blocks;
          float m = kNegInf;
          bool nan = false;
          for (int s = 0; s < K && out[s] >= 0; ++s) {
            nan |= std::isnan(bl[out[s]]);
            m = std::max(m, bl[out[s]]);
          }
          float lse = m;
          if (nan) {
            lse = std::numeric_limits<float>::quiet_NaN();
          } else if (std::isfinite(m)) {
            float sum = 0;
            for (int s = 0; s < K && out[s] >= 0; ++s) sum += std::exp(bl[out[s]] - m);
            lse = m + std::log(sum);
          }
          sel_lse[int64_t(g) * total_q + row] = lse;
        }
      }
    }
  }
}

}  // namespace msa::cpu
