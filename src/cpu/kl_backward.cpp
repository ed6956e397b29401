// KL backward of the indexer, KV-outer over the plan's CSR, one index head at a time.
// Each task owns one stored key block and every (query, block) edge that reads it:
//   teacher[t] = mean over the group's 16 heads of exp(z_h(t) - lse_h),  z = scale <q_h, k_t>
//   student[t] = exp(s(t) - index_lse),                                    s = index_scale <qi, ki_t>
//   ds = (student - teacher) * grad_scale
// d index_k of the block accumulates in the task (fixed query order, heads in order); the
// d index_q contribution of each edge goes to its plan slot and the slots of a query are
// summed in slot order afterwards, so the result does not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "backend.h"
#include "cpu/attention_common.h"
#include "cpu/common.h"

namespace msa::cpu {

namespace {
constexpr int kChunkQueries = 8;  // queries per step: 128 main-score rows
}

void kl_backward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan, const KlBackwardParams& p,
                 const RunOptions& opt) {
  const int threads = thread_count(opt);
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, Hi = topo.num_index_heads, K = topo.topk;
  const int64_t total_q = L.total_q(), total_k = L.total_k();
  const float scale = topo.attention_scale(), index_scale = topo.indexer_scale();
  const float grad_scale = p.grad_scale > 0 ? p.grad_scale : (total_q > 0 ? 1.0f / float(int64_t(Hi) * total_q) : 0.0f);
  const float* lse = p.lse.as<const float>();              // [total_q, Hq]
  const float* index_lse = p.index_lse.as<const float>();  // [Hi, total_q]
  const auto* split_counts = static_cast<const int32_t*>(plan.split_counts.data());  // [total_q, Hkv]

  const KeyBlocks kb = plan_key_blocks(L);
  const KvTasks work = make_kv_tasks(L, kb, plan);
  const std::vector<float> index_keys_t = gather_blocks(kb, p.index_k, 0, /*transposed=*/true, threads);  // [blocks][d][t]
  const std::vector<float> index_keys = gather_blocks(kb, p.index_k, 0, /*transposed=*/false, threads);   // [blocks][t][d]

  std::vector<float> dindex_k(size_t(total_k * kDim), 0.0f);     // [total_k, 128] fp32 accumulator
  // [total_q, slot, 128], one head at a time; only the slots of valid edges are written and read.
  const std::unique_ptr<float[]> edge_dq(new float[size_t(total_q * K * kDim)]);

  for (int g = 0; g < Hi; ++g) {
    const std::vector<float> keys_t = gather_blocks(kb, p.k, g, /*transposed=*/true, threads);  // [blocks][d][t]
    const int32_t* row_ptr = static_cast<const int32_t*>(plan.row_ptr.data()) + int64_t(g) * (plan.total_rows + 1);
    const int32_t* q_indices = static_cast<const int32_t*>(plan.q_indices.data()) + int64_t(g) * total_q * K;
    const int32_t* slots = static_cast<const int32_t*>(plan.split_slot.data()) + int64_t(g) * total_q * K;

    for (const auto& wave : work.waves) {
      const std::vector<KvTasks::Task> order = work.ordered(L, wave, row_ptr);
#pragma omp parallel num_threads(threads)
      {
        constexpr int rows_max = kChunkQueries * kGroup;
        std::vector<float> q_chunk(size_t(rows_max) * kDim), S(size_t(rows_max) * kBlock);
        std::vector<float> iq_chunk(size_t(kChunkQueries) * kDim), ds(size_t(kChunkQueries) * kBlock);
        std::vector<float> dq_part(size_t(kChunkQueries) * kDim), dk(static_cast<size_t>(kBlockElems));
#pragma omp for schedule(dynamic, 1)
        for (size_t ti = 0; ti < order.size(); ++ti) {
          const KvTasks::Task& t = order[ti];
          const KeyBlocks::Range& range = kb.ranges[size_t(t.range)];
          const int64_t stored = range.first_block + t.block;
          std::fill(dk.begin(), dk.end(), 0.0f);
          for (int b : work.range_docs[size_t(t.range)]) {
            const DocumentSpan& d = L.document(b);
            if (t.block * kBlock >= d.k_len) continue;
            const int32_t r = work.row_of[size_t(work.doc_offset[size_t(b)] + t.block)];
            for (int32_t e = row_ptr[r]; e < row_ptr[r + 1]; e += kChunkQueries) {
              const int nq = std::min(kChunkQueries, row_ptr[r + 1] - e);
              for (int i = 0; i < nq; ++i) {
                const int64_t row = d.q_start + q_indices[e + i];
                load_row(p.q, (row * Hq + int64_t(g) * kGroup) * kDim, kGroup * kDim, q_chunk.data() + i * kGroup * kDim);
                load_row(p.index_q, (row * Hi + g) * kDim, kDim, iq_chunk.data() + i * kDim);
              }
              gemm<false>(nq * kGroup, kBlock, kDim, q_chunk.data(), kDim, 1, keys_t.data() + stored * kBlockElems, kBlock,
                          S.data(), kBlock);
              gemm<false>(nq, kBlock, kDim, iq_chunk.data(), kDim, 1, index_keys_t.data() + stored * kBlockElems, kBlock,
                          ds.data(), kBlock);
              // ds = 0 past the causal limit by assignment (the teacher and student may be NaN
              // there: a NaN key the row does not see).
              int visible[kChunkQueries];
              bool all_visible = true;
              for (int i = 0; i < nq; ++i) {
                const int64_t row = d.q_start + q_indices[e + i];
                visible[i] = visible_keys(int32_t(t.block), d.k_len - d.q_len + q_indices[e + i]);
                all_visible &= visible[i] == kBlock;
                f32x16 teacher[kBlock / kLanes] = {};
                for (int h = 0; h < kGroup; ++h) {
                  const float l = lse[row * Hq + int64_t(g) * kGroup + h];
                  if (l == kNegInf) continue;
                  const float* s = S.data() + (i * kGroup + h) * kBlock;
                  for (int c = 0; c < kBlock / kLanes; ++c) teacher[c] += vexp(vload(s + c * kLanes) * scale - l);
                }
                const float il = index_lse[int64_t(g) * total_q + row];
                float* dsr = ds.data() + i * kBlock;
                for (int c = 0; c < kBlock / kLanes; ++c) {
                  const f32x16 student = il == kNegInf ? f32x16{} : vexp(vload(dsr + c * kLanes) * index_scale - il);
                  vstore(dsr + c * kLanes, (student - teacher[c] * (1.0f / kGroup)) * grad_scale);
                }
                std::fill(dsr + visible[i], dsr + kBlock, 0.0f);
              }
              // This edge's d index_q: ds . ki over the visible keys only (0 times a masked
              // key's NaN would be NaN); index_scale is applied when the slots are summed.
              const float* ki = index_keys.data() + stored * kBlockElems;
              if (all_visible) {
                gemm<false>(nq, kDim, kBlock, ds.data(), kBlock, 1, ki, kDim, dq_part.data(), kDim);
              } else {
                for (int i = 0; i < nq; ++i)
                  gemm<false>(1, kDim, visible[i], ds.data() + i * kBlock, kBlock, 1, ki, kDim,
                              dq_part.data() + i * kDim, kDim);
              }
              for (int i = 0; i < nq; ++i) {
                const int64_t row = d.q_start + q_indices[e + i];
                std::copy(dq_part.data() + i * kDim, dq_part.data() + (i + 1) * kDim,
                          edge_dq.get() + (row * K + slots[e + i]) * kDim);
              }
              gemm<true>(kBlock, kDim, nq, ds.data(), 1, kBlock, iq_chunk.data(), kDim, dk.data(), kDim);
            }
          }
          const int64_t keys_here = std::min<int64_t>(kBlock, range.length - t.block * kBlock);
          for (int64_t k = 0; k < keys_here; ++k) {
            float* acc = dindex_k.data() + (range.start + t.block * kBlock + k) * kDim;
            const float* add = dk.data() + k * kDim;
            for (int c = 0; c < kDim; c += kLanes) vstore(acc + c, vload(acc + c) + vload(add + c) * index_scale);
          }
        }
      }
    }

    // d index_q of head g: its edges' contributions in slot (block id) order.
#pragma omp parallel num_threads(threads)
    {
      float sum[kDim];
#pragma omp for schedule(static)
      for (int64_t row = 0; row < total_q; ++row) {
        const int count = split_counts[row * Hkv + g];
        std::fill(sum, sum + kDim, 0.0f);
        for (int s = 0; s < count; ++s) {
          const float* part = edge_dq.get() + (row * K + s) * kDim;
          for (int c = 0; c < kDim; c += kLanes) vstore(sum + c, vload(sum + c) + vload(part + c));
        }
        for (int c = 0; c < kDim; c += kLanes) vstore(sum + c, vload(sum + c) * index_scale);
        store_row(p.dindex_q, (row * Hi + g) * kDim, kDim, sum);
      }
    }
  }

#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < total_k; ++t) store_row(p.dindex_k, t * kDim, kDim, dindex_k.data() + t * kDim);
}

}  // namespace msa::cpu
