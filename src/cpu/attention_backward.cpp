// Sparse attention backward in two deterministic passes per kv group:
//   dq   query-outer: one task per query row recomputes P and dS over its selected blocks;
//   dk/dv KV-outer over the plan's CSR: one task per stored key block gathers every query
//        that selected it (all documents sharing that storage) in a fixed order, so no two
//        tasks write the same key rows and no result depends on the thread count.
// dP = dO . V^T, dS = P * (dP - D), D = rowsum(dO * O); dq = scale dS . K,
// dk = scale dS^T . Q, dv = P^T . dO (dk, dv summed over the group's 16 heads).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend.h"
#include "cpu/attention_common.h"
#include "cpu/common.h"

namespace msa::cpu {

namespace {

constexpr int kChunkQueries = 8;  // queries per KV-outer step: 128 score rows

// P = exp(S - lse) in place over `width` columns (0 where lse is -inf: a row without keys).
inline void probabilities(float* row, int width, float lse) {
  if (lse == kNegInf) {
    std::fill(row, row + width, 0.0f);
    return;
  }
  for (int c = 0; c < width; c += kLanes) vstore(row + c, vexp(vload(row + c) - lse));
}

// dS = P * (dP - D) into dP.
inline void score_gradient(const float* P, float* dP, int width, float D) {
  for (int c = 0; c < width; c += kLanes) vstore(dP + c, vload(P + c) * (vload(dP + c) - D));
}

void zero_tensor(const TensorView& t, int threads) {
  const int64_t bytes = t.numel() * dtype_size(t.dtype);
  const int64_t chunk = int64_t(1) << 20;
  char* base = static_cast<char*>(t.data);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < (bytes + chunk - 1) / chunk; ++c)
    std::memset(base + c * chunk, 0, size_t(std::min(chunk, bytes - c * chunk)));
}

}  // namespace

void sparse_attention_backward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan,
                               const AttentionBackwardParams& p, const RunOptions& opt) {
  const int threads = thread_count(opt);
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, K = topo.topk;
  const int64_t total_q = L.total_q(), total_k = L.total_k();
  const float scale = topo.attention_scale();
  const int64_t ld = int64_t(K) * kBlock;
  const KeyBlocks kb = plan_key_blocks(L);
  const int32_t* topk = p.topk.as<const int32_t>();  // [Hkv, total_q, K]
  const float* lse = p.lse.as<const float>();        // [total_q, Hq]

  // D[row, h] = <dO, O>, fp32.
  std::vector<float> Dsum(size_t(total_q * Hq));  // [total_q, Hq]
#pragma omp parallel num_threads(threads)
  {
    float a[kDim], b[kDim];
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < total_q * Hq; ++rh) {
      load_row(p.dout, rh * kDim, kDim, a);
      load_row(p.out, rh * kDim, kDim, b);
      f32x16 s{};
      for (int c = 0; c < kDim; c += kLanes) s += vload(a + c) * vload(b + c);
      Dsum[size_t(rh)] = hsum(s);
    }
  }

  // Keys no query sees keep dk = dv = 0; overlapping key ranges (fragments that start at
  // different rows of shared storage) accumulate in fp32 one range at a time.
  zero_tensor(p.dk, threads);
  zero_tensor(p.dv, threads);
  std::vector<float> dk_all, dv_all;  // [total_k, Hkv, 128], overlapping ranges only
  if (!kb.disjoint) {
    dk_all.assign(size_t(total_k * Hkv * kDim), 0.0f);
    dv_all.assign(size_t(total_k * Hkv * kDim), 0.0f);
  }

  const KvTasks work = make_kv_tasks(L, kb, plan);

  const auto* row_ptr_all = static_cast<const int32_t*>(plan.row_ptr.data());      // [Hkv, total_rows + 1]
  const auto* q_indices_all = static_cast<const int32_t*>(plan.q_indices.data());  // [Hkv, total_q * K]

  for (int g = 0; g < Hkv; ++g) {
    const std::vector<float> keys_t = gather_blocks(kb, p.k, g, /*transposed=*/true, threads);    // [blocks][d][t]
    const std::vector<float> values_t = gather_blocks(kb, p.v, g, /*transposed=*/true, threads);  // [blocks][d][t]
    const std::vector<float> keys = gather_blocks(kb, p.k, g, /*transposed=*/false, threads);     // [blocks][t][d]

    // ---- dq, query-outer ----
#pragma omp parallel num_threads(threads)
    {
      std::vector<float> qf(size_t(kGroup) * kDim), dof(size_t(kGroup) * kDim), acc(size_t(kGroup) * kDim);
      std::vector<float> P(size_t(kGroup) * ld), dP(size_t(kGroup) * ld);
      std::vector<int32_t> blocks(static_cast<size_t>(K));
#pragma omp for schedule(dynamic, 16)
      for (int64_t row = 0; row < total_q; ++row) {
        const QueryPlace at = place_of(L, row);
        const int n = attended_blocks(topk + (int64_t(g) * total_q + row) * K, K, at.pos, blocks.data());
        const int64_t head0 = row * Hq + int64_t(g) * kGroup;
        if (n == 0) {
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int h = 0; h < kGroup; ++h) store_row(p.dq, (head0 + h) * kDim, kDim, acc.data());
          continue;
        }
        load_row(p.q, head0 * kDim, kGroup * kDim, qf.data());
        load_row(p.dout, head0 * kDim, kGroup * kDim, dof.data());
        const int64_t doc_block = kb.doc_block[size_t(at.doc)];
        masked_scores(kGroup, qf.data(), keys_t.data(), doc_block, blocks.data(), n, at.pos, scale, P.data(), ld);
        for (int s = 0; s < n; ++s)
          gemm<false>(kGroup, kBlock, kDim, dof.data(), kDim, 1, values_t.data() + (doc_block + blocks[s]) * kBlockElems,
                      kBlock, dP.data() + s * kBlock, ld);
        const int width = n * kBlock;
        for (int h = 0; h < kGroup; ++h) {
          probabilities(P.data() + h * ld, width, lse[head0 + h]);
          score_gradient(P.data() + h * ld, dP.data() + h * ld, width, Dsum[size_t(head0 + h)]);
        }
        for (int s = 0; s < n; ++s)
          (s == 0 ? gemm<false> : gemm<true>)(kGroup, kDim, kBlock, dP.data() + s * kBlock, ld, 1,
                                              keys.data() + (doc_block + blocks[s]) * kBlockElems, kDim, acc.data(), kDim);
        for (int h = 0; h < kGroup; ++h) {
          float* r = acc.data() + h * kDim;
          for (int c = 0; c < kDim; c += kLanes) vstore(r + c, vload(r + c) * scale);
          store_row(p.dq, (head0 + h) * kDim, kDim, r);
        }
      }
    }

    // ---- dk / dv, KV-outer ----
    const int32_t* row_ptr = row_ptr_all + int64_t(g) * (plan.total_rows + 1);
    const int32_t* q_indices = q_indices_all + int64_t(g) * total_q * K;
    for (const auto& wave : work.waves) {
      const std::vector<KvTasks::Task> order = work.ordered(L, wave, row_ptr);
#pragma omp parallel num_threads(threads)
      {
        constexpr int rows_max = kChunkQueries * kGroup;
        std::vector<float> q_chunk(size_t(rows_max) * kDim), dout_chunk(size_t(rows_max) * kDim);
        std::vector<float> S(size_t(rows_max) * kBlock), dS(size_t(rows_max) * kBlock);
        std::vector<float> dk(static_cast<size_t>(kBlockElems)), dv(static_cast<size_t>(kBlockElems));
#pragma omp for schedule(dynamic, 1)
        for (size_t ti = 0; ti < order.size(); ++ti) {
          const KvTasks::Task& t = order[ti];
          const KeyBlocks::Range& range = kb.ranges[size_t(t.range)];
          const int64_t stored = range.first_block + t.block;
          std::fill(dk.begin(), dk.end(), 0.0f);
          std::fill(dv.begin(), dv.end(), 0.0f);
          for (int b : work.range_docs[size_t(t.range)]) {
            const DocumentSpan& d = L.document(b);
            if (t.block * kBlock >= d.k_len) continue;
            const int32_t r = work.row_of[size_t(work.doc_offset[size_t(b)] + t.block)];
            for (int32_t e = row_ptr[r]; e < row_ptr[r + 1]; e += kChunkQueries) {
              const int nq = std::min(kChunkQueries, row_ptr[r + 1] - e);
              const int rows = nq * kGroup;
              for (int i = 0; i < nq; ++i) {
                const int64_t head0 = (d.q_start + q_indices[e + i]) * Hq + int64_t(g) * kGroup;
                load_row(p.q, head0 * kDim, kGroup * kDim, q_chunk.data() + i * kGroup * kDim);
                load_row(p.dout, head0 * kDim, kGroup * kDim, dout_chunk.data() + i * kGroup * kDim);
              }
              gemm<false>(rows, kBlock, kDim, q_chunk.data(), kDim, 1, keys_t.data() + stored * kBlockElems, kBlock, S.data(),
                          kBlock);
              gemm<false>(rows, kBlock, kDim, dout_chunk.data(), kDim, 1, values_t.data() + stored * kBlockElems, kBlock,
                          dS.data(), kBlock);
              for (int i = 0; i < nq; ++i) {
                const int64_t pos = d.k_len - d.q_len + q_indices[e + i];
                const int visible = visible_keys(int32_t(t.block), pos);
                const int64_t head0 = (d.q_start + q_indices[e + i]) * Hq + int64_t(g) * kGroup;
                for (int h = 0; h < kGroup; ++h) {
                  float* s = S.data() + (i * kGroup + h) * kBlock;
                  for (int c = 0; c < kBlock; c += kLanes) vstore(s + c, vload(s + c) * scale);
                  probabilities(s, kBlock, lse[head0 + h]);
                  for (int k = visible; k < kBlock; ++k) s[k] = 0.0f;
                  score_gradient(s, dS.data() + (i * kGroup + h) * kBlock, kBlock, Dsum[size_t(head0 + h)]);
                }
              }
              gemm<true>(kBlock, kDim, rows, S.data(), 1, kBlock, dout_chunk.data(), kDim, dv.data(), kDim);
              gemm<true>(kBlock, kDim, rows, dS.data(), 1, kBlock, q_chunk.data(), kDim, dk.data(), kDim);
            }
          }
          const int64_t keys_here = std::min<int64_t>(kBlock, range.length - t.block * kBlock);
          for (int64_t k = 0; k < keys_here; ++k) {
            const int64_t at = ((range.start + t.block * kBlock + k) * Hkv + g) * kDim;
            float* dk_row = dk.data() + k * kDim;
            for (int c = 0; c < kDim; c += kLanes) vstore(dk_row + c, vload(dk_row + c) * scale);
            if (kb.disjoint) {
              store_row(p.dk, at, kDim, dk_row);
              store_row(p.dv, at, kDim, dv.data() + k * kDim);
            } else {
              for (int c = 0; c < kDim; ++c) {
                dk_all[size_t(at + c)] += dk_row[c];
                dv_all[size_t(at + c)] += dv[size_t(k * kDim + c)];
              }
            }
          }
        }
      }
    }
  }

  if (!kb.disjoint) {
    const int64_t rows = total_k * Hkv;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      store_row(p.dk, r * kDim, kDim, dk_all.data() + r * kDim);
      store_row(p.dv, r * kDim, kDim, dv_all.data() + r * kDim);
    }
  }
}

}  // namespace msa::cpu
