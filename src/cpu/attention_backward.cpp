// Sparse attention backward, KV-outer over the plan's CSR, one kv group at a time, in one
// pass that computes every gradient from a single P / dS per (query, block) edge:
//   dP = dO . V^T, dS = P * (dP - D), D = rowsum(dO * O);
//   dq = scale dS . K, dk = scale dS^T . Q, dv = P^T . dO (dk, dv summed over the 16 heads).
// Work proceeds level by level (kv block 0 of every range, then block 1, ...). Within a level
// a query row meets at most one edge, so dq accumulates without conflicts and in ascending
// block order; a level's (range, block) rows are cut into fixed chunks of queries whose dk/dv
// partials are summed in chunk order. Nothing depends on the thread count or timing.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend.h"
#include "cpu/attention_common.h"
#include "cpu/common.h"

namespace msa::cpu {

namespace {

constexpr int kStepQueries = 8;    // queries per GEMM step: 128 score rows
constexpr int kChunkQueries = 64;  // queries per parallel work item

// P = exp(S - lse) in place over `width` columns (0 where lse is -inf: a row without keys).
inline void probabilities(float* row, int width, float lse) {
  if (lse == kNegInf) {
    std::fill(row, row + width, 0.0f);
    return;
  }
  for (int c = 0; c < width; c += kLanes) vstore(row + c, vexp(vload(row + c) - lse));
}

void zero_tensor(const TensorView& t, int threads) {
  const int64_t bytes = t.numel() * dtype_size(t.dtype);
  const int64_t chunk = int64_t(1) << 20;
  char* base = static_cast<char*>(t.data);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < (bytes + chunk - 1) / chunk; ++c)
    std::memset(base + c * chunk, 0, size_t(std::min(chunk, bytes - c * chunk)));
}

// One level of one wave: the chunks of queries that read kv block `level` of each range.
// A stored block read by one chunk is finished by that chunk; otherwise each chunk leaves
// its dk / dv in a partial slot and the block's owner sums them in chunk order.
struct Level {
  struct Chunk {
    int doc;
    int32_t begin, end;  // CSR entries [begin, end) of the (document, level) row
    int owner;
    int slot;  // partial slot, or -1 when the chunk is its block's only one
  };
  struct Owner {
    int range;
    int first_slot = 0, num_slots = 0;
  };
  std::vector<Chunk> chunks;
  std::vector<Owner> owners;
  int slots = 0;
};

std::vector<Level> make_levels(const PackedLayout& L, const KvTasks& work, const std::vector<KvTasks::Task>& wave,
                               const int32_t* row_ptr) {
  std::vector<Level> levels;
  for (const KvTasks::Task& t : wave) {
    if (size_t(t.block) >= levels.size()) levels.resize(size_t(t.block) + 1);
    Level& level = levels[size_t(t.block)];
    const int owner = int(level.owners.size());
    const size_t first = level.chunks.size();
    for (int b : work.range_docs[size_t(t.range)]) {
      if (t.block * kBlock >= L.document(b).k_len) continue;
      const int32_t r = work.row_of[size_t(work.doc_offset[size_t(b)] + t.block)];
      for (int32_t e = row_ptr[r]; e < row_ptr[r + 1]; e += kChunkQueries)
        level.chunks.push_back({b, e, std::min(row_ptr[r + 1], e + kChunkQueries), owner, -1});
    }
    Level::Owner o{t.range};
    if (level.chunks.size() - first > 1) {
      o.first_slot = level.slots;
      for (size_t c = first; c < level.chunks.size(); ++c) level.chunks[c].slot = level.slots++;
      o.num_slots = level.slots - o.first_slot;
    }
    level.owners.push_back(o);
  }
  return levels;
}

}  // namespace

void sparse_attention_backward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan,
                               const AttentionBackwardParams& p, const RunOptions& opt) {
  const int threads = thread_count(opt);
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, K = topo.topk;
  const int64_t total_q = L.total_q(), total_k = L.total_k();
  const float scale = topo.attention_scale();
  const KeyBlocks kb = plan_key_blocks(L);
  const KvTasks work = make_kv_tasks(L, kb, plan);
  const float* lse = p.lse.as<const float>();  // [total_q, Hq]

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
  // different rows of shared storage) accumulate in fp32, one range per wave.
  zero_tensor(p.dk, threads);
  zero_tensor(p.dv, threads);
  std::vector<float> dk_all, dv_all;  // [total_k, Hkv, 128], overlapping ranges only
  if (!kb.disjoint) {
    dk_all.assign(size_t(total_k * Hkv * kDim), 0.0f);
    dv_all.assign(size_t(total_k * Hkv * kDim), 0.0f);
  }
  std::vector<float> dq(size_t(total_q * kGroup * kDim));  // [total_q, 16, 128] fp32, one group at a time

  for (int g = 0; g < Hkv; ++g) {
    const std::vector<float> keys_t = gather_blocks(kb, p.k, g, /*transposed=*/true, threads);    // [blocks][d][t]
    const std::vector<float> values_t = gather_blocks(kb, p.v, g, /*transposed=*/true, threads);  // [blocks][d][t]
    const std::vector<float> keys = gather_blocks(kb, p.k, g, /*transposed=*/false, threads);     // [blocks][t][d]
    const int32_t* row_ptr = static_cast<const int32_t*>(plan.row_ptr.data()) + int64_t(g) * (plan.total_rows + 1);
    const int32_t* q_indices = static_cast<const int32_t*>(plan.q_indices.data()) + int64_t(g) * total_q * K;
    std::fill(dq.begin(), dq.end(), 0.0f);

    for (const auto& wave : work.waves) {
      const std::vector<Level> levels = make_levels(L, work, wave, row_ptr);
      size_t max_slots = 0;
      for (const Level& l : levels) max_slots = std::max(max_slots, size_t(l.slots));
      std::vector<float> dk_part(max_slots * size_t(kBlockElems)), dv_part(max_slots * size_t(kBlockElems));
      // Scales dk and writes (or, for overlapping ranges, adds) block j of a range.
      auto finish_block = [&](int range_index, int64_t j, float* dk, const float* dv) {
        const KeyBlocks::Range& range = kb.ranges[size_t(range_index)];
        const int64_t keys_here = std::min<int64_t>(kBlock, range.length - j * kBlock);
        for (int64_t x = 0; x < keys_here * kDim; x += kLanes) vstore(dk + x, vload(dk + x) * scale);
        for (int64_t k = 0; k < keys_here; ++k) {
          const int64_t at = ((range.start + j * kBlock + k) * Hkv + g) * kDim;
          if (kb.disjoint) {
            store_row(p.dk, at, kDim, dk + k * kDim);
            store_row(p.dv, at, kDim, dv + k * kDim);
          } else {
            for (int x = 0; x < kDim; ++x) {
              dk_all[size_t(at + x)] += dk[k * kDim + x];
              dv_all[size_t(at + x)] += dv[k * kDim + x];
            }
          }
        }
      };

#pragma omp parallel num_threads(threads)
      {
        constexpr int rows_max = kStepQueries * kGroup;
        std::vector<float> q_step(size_t(rows_max) * kDim), dout_step(size_t(rows_max) * kDim);
        std::vector<float> P(size_t(rows_max) * kBlock), dS(size_t(rows_max) * kBlock);
        std::vector<float> dk_own(static_cast<size_t>(kBlockElems)), dv_own(static_cast<size_t>(kBlockElems));
        for (size_t j = 0; j < levels.size(); ++j) {
          const Level& level = levels[j];
#pragma omp for schedule(dynamic, 1)
          for (size_t c = 0; c < level.chunks.size(); ++c) {
            const Level::Chunk& chunk = level.chunks[c];
            const DocumentSpan& d = L.document(chunk.doc);
            const int64_t stored = kb.doc_block[size_t(chunk.doc)] + int64_t(j);
            float* dk = chunk.slot < 0 ? dk_own.data() : dk_part.data() + size_t(chunk.slot) * size_t(kBlockElems);
            float* dv = chunk.slot < 0 ? dv_own.data() : dv_part.data() + size_t(chunk.slot) * size_t(kBlockElems);
            for (int32_t e = chunk.begin; e < chunk.end; e += kStepQueries) {
              const int nq = std::min(kStepQueries, chunk.end - e);
              const int rows = nq * kGroup;
              for (int i = 0; i < nq; ++i) {
                const int64_t head0 = (d.q_start + q_indices[e + i]) * Hq + int64_t(g) * kGroup;
                load_row(p.q, head0 * kDim, kGroup * kDim, q_step.data() + i * kGroup * kDim);
                load_row(p.dout, head0 * kDim, kGroup * kDim, dout_step.data() + i * kGroup * kDim);
              }
              gemm<false>(rows, kBlock, kDim, q_step.data(), kDim, 1, keys_t.data() + stored * kBlockElems, kBlock,
                          P.data(), kBlock);
              gemm<false>(rows, kBlock, kDim, dout_step.data(), kDim, 1, values_t.data() + stored * kBlockElems, kBlock,
                          dS.data(), kBlock);
              // Masked keys (past the causal limit) and rows without keys get P = dS = 0 by
              // assignment: S and dP there may be NaN (a NaN key or value the row does not see).
              int visible[kStepQueries];
              for (int i = 0; i < nq; ++i) {
                const int64_t pos = d.k_len - d.q_len + q_indices[e + i];
                visible[i] = visible_keys(int32_t(j), pos);
                const int64_t head0 = (d.q_start + q_indices[e + i]) * Hq + int64_t(g) * kGroup;
                for (int h = 0; h < kGroup; ++h) {
                  float* pr = P.data() + (i * kGroup + h) * kBlock;
                  float* dsr = dS.data() + (i * kGroup + h) * kBlock;
                  const float l = lse[head0 + h], D = Dsum[size_t(head0 + h)];
                  if (l == kNegInf) {
                    std::fill(pr, pr + kBlock, 0.0f);
                    std::fill(dsr, dsr + kBlock, 0.0f);
                    continue;
                  }
                  for (int k = 0; k < kBlock; k += kLanes) {
                    const f32x16 prob = vexp(vload(pr + k) * scale - l);
                    vstore(pr + k, prob);
                    vstore(dsr + k, prob * (vload(dsr + k) - D));
                  }
                  std::fill(pr + visible[i], pr + kBlock, 0.0f);
                  std::fill(dsr + visible[i], dsr + kBlock, 0.0f);
                }
              }
              const bool first = e == chunk.begin;
              (first ? gemm<false> : gemm<true>)(kBlock, kDim, rows, P.data(), 1, kBlock, dout_step.data(), kDim, dv, kDim);
              (first ? gemm<false> : gemm<true>)(kBlock, kDim, rows, dS.data(), 1, kBlock, q_step.data(), kDim, dk, kDim);
              // dq sums over the visible keys only: 0 times a masked key's NaN would be NaN.
              for (int i = 0; i < nq; ++i)
                gemm<true>(kGroup, kDim, visible[i], dS.data() + i * kGroup * kBlock, kBlock, 1,
                           keys.data() + stored * kBlockElems, kDim, dq.data() + (d.q_start + q_indices[e + i]) * kGroup * kDim,
                           kDim);
            }
            if (chunk.slot < 0) finish_block(level.owners[size_t(chunk.owner)].range, int64_t(j), dk, dv);
          }
          // Stored blocks read by several chunks: partials summed in chunk order.
#pragma omp for schedule(dynamic, 1)
          for (size_t o = 0; o < level.owners.size(); ++o) {
            const Level::Owner& owner = level.owners[o];
            if (owner.num_slots == 0) continue;
            float* dk = dk_part.data() + size_t(owner.first_slot) * size_t(kBlockElems);
            float* dv = dv_part.data() + size_t(owner.first_slot) * size_t(kBlockElems);
            for (int c = 1; c < owner.num_slots; ++c)
              for (int64_t x = 0; x < kBlockElems; x += kLanes) {
                vstore(dk + x, vload(dk + x) + vload(dk + c * kBlockElems + x));
                vstore(dv + x, vload(dv + x) + vload(dv + c * kBlockElems + x));
              }
            finish_block(owner.range, int64_t(j), dk, dv);
          }
        }
      }
    }

    // dq of the group: every row (0 for rows without keys).
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row = 0; row < total_q; ++row) {
      float* r = dq.data() + row * kGroup * kDim;
      for (int x = 0; x < kGroup * kDim; x += kLanes) vstore(r + x, vload(r + x) * scale);
      store_row(p.dq, (row * Hq + int64_t(g) * kGroup) * kDim, kGroup * kDim, r);
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
