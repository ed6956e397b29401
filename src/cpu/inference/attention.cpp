// Sparse attention over paged K/V caches for paged prefill and decode. One work item is
// (query row, KV group): the 16 query heads of the group share the dequantised pages.
// Decode splits the 16 top-k slots into plan.num_kv_splits groups, writes one normalised
// partial state per group and merges them by LSE (merge_states).
#include <algorithm>
#include <cmath>

#include "attention_state.h"
#include "backend.h"
#include "cpu/inference/common.h"
#include "cpu/simd.h"

namespace msa::cpu {

namespace {

using namespace inference;
using model::kHeadDim;
using model::kPageSize;
using model::kTopk;

// Online-softmax state of the heads of one group over a set of pages: per head a SoftmaxState
// (src/attention_state.h, logits in log2 units) and its unnormalised output.
struct GroupState {
  SoftmaxState* state;  // [G]
  float* acc;           // [G, 128] running sum of 2^(x - m) * v
  int heads;

  void reset() {
    std::fill(state, state + heads, SoftmaxState::empty());
    std::fill(acc, acc + int64_t(heads) * kHeadDim, 0.0f);
  }

  // Adds the keys t < n of a page (kt: transposed keys [128 dims, 128 tokens] with zero
  // tokens past n, v: rows [n, 128]) to every head; tokens past n are never read from z or v,
  // so whatever the cache holds there cannot reach the state. z: [G, 128] scratch.
  void add(const float* q, const float* kt, const float* v, int n, float scale, float* z) {
    gemm<false>(heads, kPageSize, kHeadDim, q, kHeadDim, 1, kt, kPageSize, z, kPageSize);  // z = q . k
    const float scale_log2 = scale * math::kLog2e;
    for (int h = 0; h < heads; ++h) {
      float* zh = z + int64_t(h) * kPageSize;
      SoftmaxState page = SoftmaxState::empty();  // the page's terms, at the page max
      for (int t = 0; t < n; ++t) {
        zh[t] *= scale_log2;
        page.m = state_math::max(page.m, zh[t]);
      }
      const float new_m = state_math::max(state[h].m, page.m);
      if (!(new_m > -state_math::kInf)) {  // only -inf logits: nothing to add
        std::fill(zh, zh + n, 0.0f);
        continue;
      }
      for (int t = 0; t < n; ++t) {
        zh[t] = state_math::exp2(zh[t] - new_m);  // p at the new common max
        page.d += zh[t];
      }
      page.m = new_m;
      // The running state joins the page's at their common max (0 weight while empty).
      const Rescale r = state[h].merge(page);
      float* a = acc + int64_t(h) * kHeadDim;
      for (int d = 0; d < kHeadDim; ++d) a[d] *= r.self;
    }
    gemm<true>(heads, kHeadDim, n, z, kPageSize, 1, v, kHeadDim, acc, kHeadDim);  // acc += p . v
  }

  // Normalised output and natural-log LSE of head h; a state that is not valid (empty) gives
  // 0 and -inf.
  void finish(int h, float* out, float* lse) const {
    const float* a = acc + int64_t(h) * kHeadDim;
    if (state[h].valid()) {
      const float inv = state[h].inverse_sum();
      for (int d = 0; d < kHeadDim; ++d) out[d] = a[d] * inv;
    } else {
      std::fill(out, out + kHeadDim, 0.0f);
    }
    *lse = state[h].lse();
  }
};

}  // namespace

void paged_attention(const InferencePlan& plan, const PagedAttentionParams& p, const RunOptions& opt) {
  const Topology& topo = plan.topo;
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, G = topo.group_size();
  const int64_t T = plan.total_q, max_pages = plan.max_pages;
  const int splits = plan.phase == InferencePhase::decode ? plan.num_kv_splits : 1;
  const float scale = topo.attention_scale();
  const auto* request = static_cast<const int32_t*>(plan.query_request.data());
  const auto* positions = static_cast<const int32_t*>(plan.positions.data());
  const auto* page_table = static_cast<const int32_t*>(plan.page_table.data());
  const int32_t* topk = p.topk.as<const int32_t>();
  const KvRowReader k_reader(p.kv, false), v_reader(p.kv, true);
  const int64_t f32_stride = plan.scratch_f32.view().shape[1];
  float* partial_out = splits > 1 ? static_cast<float*>(plan.partial_out.data()) : nullptr;
  float* partial_lse = splits > 1 ? static_cast<float*>(plan.partial_lse.data()) : nullptr;
  float* lse_out = p.lse.as<float>();
  const int threads = std::min(thread_count(opt), plan.num_threads);

#pragma omp parallel num_threads(threads)
  {
    float* q = static_cast<float*>(plan.scratch_f32.data()) + omp_get_thread_num() * f32_stride;  // [G, 128]
    float* k = q + int64_t(G) * kHeadDim;              // [128 dims, 128 tokens] (transposed)
    float* v = k + int64_t(kPageSize) * kHeadDim;      // [128, 128]
    float* key_rows = v + int64_t(kPageSize) * kHeadDim;  // [128, 128] work space
    float* out_row = key_rows + int64_t(kPageSize) * kHeadDim;  // [128]
    float* z = out_row + kHeadDim;                       // [G, 128]
    // Per head a SoftmaxState (2 floats, the "2 * group" of inference_scratch_f32), then acc.
    float* states = z + int64_t(G) * kPageSize;
    static_assert(sizeof(SoftmaxState) == 2 * sizeof(float) && alignof(SoftmaxState) == alignof(float));
    GroupState state{reinterpret_cast<SoftmaxState*>(states), states + 2 * G, G};  // acc: [G, 128]

#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < T * Hkv; ++item) {
      const int64_t r = item / Hkv;
      const int g = int(item % Hkv);
      const int32_t pos = positions[r];
      const int32_t* pages = page_table + int64_t(request[r]) * max_pages;
      const int32_t* ids = topk + (int64_t(g) * T + r) * kTopk;
      for (int h = 0; h < G; ++h)
        load_row(p.q, r * p.q.stride[0] + int64_t(g * G + h) * p.q.stride[1], kHeadDim, q + int64_t(h) * kHeadDim);
      for (int s = 0; s < splits; ++s) {
        state.reset();
        for (int slot = s * kTopk / splits; slot < (s + 1) * kTopk / splits; ++slot) {
          const int32_t id = ids[slot];
          if (id < 0) continue;
          // Keys t <= pos of the page; only the local page is cut short.
          const int n = int(std::min<int64_t>(kPageSize, int64_t(pos) - int64_t(id) * kPageSize + 1));
          if (n <= 0) continue;
          v_reader.rows(pages[id], g, 0, n, v);
          k_reader.rows_transposed(pages[id], g, n, k, key_rows);
          state.add(q, k, v, n, scale, z);
        }
        for (int h = 0; h < G; ++h) {
          const int64_t row_head = r * Hq + g * G + h;
          if (splits == 1) {
            state.finish(h, out_row, lse_out + row_head);
            store_row(p.out, row_head * kHeadDim, kHeadDim, out_row);
          } else {
            const int64_t at = int64_t(s) * T * Hq + row_head;
            state.finish(h, partial_out + at * kHeadDim, partial_lse + at);
          }
        }
      }
    }
  }

  if (splits > 1) {
    const MergeStatesParams merge = split_merge_params(plan, p);
    RunOptions merge_opt = opt;
    merge_opt.num_threads = threads;
    cpu::merge_states(merge, merge_opt);
  }
}

}  // namespace msa::cpu
