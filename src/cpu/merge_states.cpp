// Merge of partial (out, lse) states by log-sum-exp weights.
#include <cmath>
#include <limits>
#include <vector>

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
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s) m = std::max(m, lse_in[s * R * H + rh]);
      std::fill_n(acc.begin(), D, 0.0f);
      float z = 0;
      if (std::isfinite(m)) {
        for (int64_t s = 0; s < S; ++s) {
          const float l = lse_in[s * R * H + rh];
          if (!(l > -std::numeric_limits<float>::infinity())) continue;  // empty partial (or NaN)
          const float w = std::exp(l - m);
          z += w;
          load_row(p.out_partials, (s * R * H + rh) * D, int(D), row.data());
          for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += w * row[size_t(d)];
        }
      }
      if (z > 0 && std::isfinite(z)) {
        for (int64_t d = 0; d < D; ++d) acc[size_t(d)] /= z;
        lse_out[rh] = m + std::log(z);
      } else {
        std::fill_n(acc.begin(), D, 0.0f);
        lse_out[rh] = -std::numeric_limits<float>::infinity();
      }
      store_row(p.out, rh * D, int(D), acc.data());
    }
  }
}

}  // namespace msa::cpu
