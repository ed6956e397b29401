// Sparse attention forward, query-outer: each task is one query row and one kv group, whose
// 16 heads share the K/V blocks the group selected. Scores of all selected blocks are kept
// (16 x 2048 fp32), so the softmax is exact two-pass and O = P . V accumulates in place. Keys
// a row does not attend to (unselected blocks, keys past its causal position) are never
// read into its result, so non-finite values there leave it unchanged.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend.h"
#include "cpu/attention_common.h"
#include "cpu/common.h"

namespace msa::cpu {

void sparse_attention_forward(const Topology& topo, const PackedLayout& L, const SparsePlan&,
                              const AttentionForwardParams& p, const RunOptions& opt) {
  const int threads = thread_count(opt);
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, K = topo.topk;
  const int64_t total_q = L.total_q();
  const float scale = topo.attention_scale();
  const int64_t ld = int64_t(K) * kBlock;  // leading dimension of the score rows

  const KeyBlocks kb = plan_key_blocks(L);
  const uint16_t* q = p.q.as<const uint16_t>();  // [total_q, Hq, 128] bf16
  const int32_t* topk = p.topk.as<const int32_t>();
  float* lse = p.lse.as<float>();  // [total_q, Hq]

  for (int g = 0; g < Hkv; ++g) {
    const std::vector<float> keys_t = gather_blocks(kb, p.k, g, /*transposed=*/true, threads);  // [blocks][d][t]
    const std::vector<float> values = gather_blocks(kb, p.v, g, /*transposed=*/false, threads);  // [blocks][t][d]
#pragma omp parallel num_threads(threads)
    {
      std::vector<float> qf(size_t(kGroup) * kDim), o(size_t(kGroup) * kDim), S(size_t(kGroup) * ld);
      std::vector<int32_t> blocks(static_cast<size_t>(K));
#pragma omp for schedule(dynamic, 16)
      for (int64_t row = 0; row < total_q; ++row) {
        const QueryPlace at = place_of(L, row);
        const int n = attended_blocks(topk + (int64_t(g) * total_q + row) * K, K, at.pos, blocks.data());
        const int64_t head0 = row * Hq + int64_t(g) * kGroup;
        if (n == 0) {
          std::fill(o.begin(), o.end(), 0.0f);
          for (int h = 0; h < kGroup; ++h) {
            store_row(p.out, (head0 + h) * kDim, kDim, o.data());
            lse[head0 + h] = kNegInf;
          }
          continue;
        }
        for (int i = 0; i < kGroup * kDim; ++i) qf[size_t(i)] = bf16_to_float(q[head0 * kDim + i]);
        const int64_t doc_block = kb.doc_block[size_t(at.doc)];
        masked_scores(kGroup, qf.data(), keys_t.data(), doc_block, blocks.data(), n, at.pos, scale, S.data(), ld);

        const int width = n * kBlock;
        float inv_sum[kGroup];
        for (int h = 0; h < kGroup; ++h) {
          float* r = S.data() + h * ld;
          f32x16 m = vsplat(kNegInf);
          for (int c = 0; c < width; c += kLanes) m = vmax(m, vload(r + c));
          const float mx = hmax(m);
          f32x16 sum{};
          for (int c = 0; c < width; c += kLanes) {
            const f32x16 e = vexp(vload(r + c) - mx);
            vstore(r + c, e);
            sum += e;
          }
          const float l = hsum(sum);
          inv_sum[h] = 1.0f / l;
          lse[head0 + h] = mx + std::log(l);
        }
        // O = P V over the visible keys of each block only: a masked key's P is 0, but
        // 0 * (NaN or inf in its value row) would still reach the row (non-finite isolation).
        for (int s = 0; s < n; ++s)
          (s == 0 ? gemm<false> : gemm<true>)(kGroup, kDim, visible_keys(blocks[s], at.pos), S.data() + s * kBlock, ld,
                                              1, values.data() + (doc_block + blocks[s]) * kBlockElems, kDim, o.data(),
                                              kDim);
        for (int h = 0; h < kGroup; ++h) {
          float* r = o.data() + h * kDim;
          for (int c = 0; c < kDim; c += kLanes) vstore(r + c, vload(r + c) * inv_sum[h]);
          store_row(p.out, (head0 + h) * kDim, kDim, r);
        }
      }
    }
  }
}

}  // namespace msa::cpu
