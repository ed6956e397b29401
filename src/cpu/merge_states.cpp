// Merge of partial (out, lse) states by log-sum-exp weights.
#include <cmath>
#include <limits>
#include <vector>

#include "attention_state.h"
#include "backend.h"
#include "cpu/common.h"

namespace msa::cpu {

void merge_states(const MergeStatesParams& p, const RunOptions& opt) {
  const int64_t S = p.out_partials.shape[0], R = p.out_partials.shape[1], H = p.out_partials.shape[2],
                D = p.out_partials.shape[3];
  const float* lse_in = p.lse_partials.as<const float>();
  float* lse_out = p.lse.as<float>();
#pragma omp parallel num_threads(thread_count(opt))
  {
    // Per-thread rows kept across calls, so steady-state runs (decode's split-K merge) do
    // not allocate.
    thread_local std::vector<float> acc, row;
    if (acc.size() < size_t(D)) acc.resize(size_t(D));
    if (row.size() < size_t(D)) row.resize(size_t(D));
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < R * H; ++rh) {
      // Max, then sums, then the values weighted against the max when the row is valid
      // (src/attention_state.h's rules: empty or NaN partials are skipped, a row that is not
      // valid gives zeros and -inf).
      SoftmaxState state = SoftmaxState::empty();
      for (int64_t s = 0; s < S; ++s) state.m = state_math::max(state.m, SoftmaxState::from_lse(lse_in[s * R * H + rh]).m);
      for (int64_t s = 0; s < S; ++s) state.add_at_max(SoftmaxState::from_lse(lse_in[s * R * H + rh]));
      std::fill_n(acc.begin(), D, 0.0f);
      if (state.valid()) {
        for (int64_t s = 0; s < S; ++s) {
          const SoftmaxState part = SoftmaxState::from_lse(lse_in[s * R * H + rh]);
          if (!(part.m > -std::numeric_limits<float>::infinity())) continue;  // empty partial
          const float w = part.weight(state.m);
          load_row(p.out_partials, (s * R * H + rh) * D, int(D), row.data());
          for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += w * row[size_t(d)];
        }
        const float inv = state.inverse_sum();
        for (int64_t d = 0; d < D; ++d) acc[size_t(d)] *= inv;
      }
      lse_out[rh] = state.lse();
      store_row(p.out, rh * D, int(D), acc.data());
    }
  }
}

}  // namespace msa::cpu
