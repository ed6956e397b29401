// The merge of one (row, head)'s partial attention states by LSE weights, by one warp (the
// head dimension in slices of 128, 4 values a lane): merge_states_kernel runs it per (row,
// head), and the decode attention kernel's last split CTA of a tile runs it for the tile's
// rows. The rules and arithmetic are src/attention_state.h's (those of the CPU backend).
#pragma once

#include "attention_state.h"
#include "cuda/reduce.cuh"

namespace msa::cuda {

inline constexpr int kMergePerLane = 4;                 // values of a slice each lane owns
inline constexpr int kMergeSlice = 32 * kMergePerLane;  // values of the (any-sized) head dimension a warp takes at once

// Partial s of (row, head) rh: values parts[(s * RH + rh) * D ..], LSE lse_parts[s * RH + rh].
template <typename Part, typename Out>
__device__ __forceinline__ void merge_row(const Part* __restrict__ parts, const float* __restrict__ lse_parts, int64_t S,
                                          int64_t RH, int64_t D, int64_t rh, Out* __restrict__ out,
                                          float* __restrict__ lse, int lane) {
  // Two passes over the LSEs (max, then sums), then the values of every slice weighted
  // against the common max.
  SoftmaxState row = SoftmaxState::empty();
  for (int64_t s = 0; s < S; ++s) row.m = state_math::max(row.m, SoftmaxState::from_lse(lse_parts[s * RH + rh]).m);
  for (int64_t s = 0; s < S; ++s) row.add_at_max(SoftmaxState::from_lse(lse_parts[s * RH + rh]));
  const bool ok = row.valid();
  const float inv = row.inverse_sum();
  for (int64_t d0 = 0; d0 < D; d0 += kMergeSlice) {
    float acc[kMergePerLane] = {0.f, 0.f, 0.f, 0.f};
    if (ok)
      for (int64_t s = 0; s < S; ++s) {
        const SoftmaxState part = SoftmaxState::from_lse(lse_parts[s * RH + rh]);
        if (!(part.m > -INFINITY)) continue;  // empty partial: its values are never read
        const float w = part.weight(row.m);
        const Part* values = parts + (s * RH + rh) * D;
#pragma unroll
        for (int i = 0; i < kMergePerLane; ++i) {
          const int64_t d = d0 + lane + 32 * i;
          if (d < D) acc[i] += w * load_f(values + d);
        }
      }
#pragma unroll
    for (int i = 0; i < kMergePerLane; ++i) {
      const int64_t d = d0 + lane + 32 * i;
      if (d < D) store_f(out + rh * D + d, acc[i] * inv);
    }
  }
  if (lane == 0) lse[rh] = row.lse();
}

}  // namespace msa::cuda
