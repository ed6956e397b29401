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

// The merged state of S partials from their LSEs (lse_at(s)): the common max first, then the
// sums at it.
template <class LseAt>
__device__ __forceinline__ SoftmaxState merged_state(LseAt lse_at, int64_t S) {
  SoftmaxState row = SoftmaxState::empty();
  for (int64_t s = 0; s < S; ++s) row.m = state_math::max(row.m, SoftmaxState::from_lse(lse_at(s)).m);
  for (int64_t s = 0; s < S; ++s) row.add_at_max(SoftmaxState::from_lse(lse_at(s)));
  return row;
}

// Partial s of (row, head) rh: values parts[(s * RH + rh) * D ..], LSE lse_parts[s * RH + rh].
template <typename Part, typename Out>
__device__ __forceinline__ void merge_row(const Part* __restrict__ parts, const float* __restrict__ lse_parts, int64_t S,
                                          int64_t RH, int64_t D, int64_t rh, Out* __restrict__ out,
                                          float* __restrict__ lse, int lane) {
  // Two passes over the LSEs (max, then sums), then the values of every slice weighted
  // against the common max.
  auto lse_at = [&](int64_t s) { return lse_parts[s * RH + rh]; };
  const SoftmaxState row = merged_state(lse_at, S);
  const bool ok = row.valid();
  const float inv = row.inverse_sum();
  for (int64_t d0 = 0; d0 < D; d0 += kMergeSlice) {
    float acc[kMergePerLane] = {0.f, 0.f, 0.f, 0.f};
    if (ok)
      for (int64_t s = 0; s < S; ++s) {
        const SoftmaxState part = SoftmaxState::from_lse(lse_at(s));
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

// merge_row for S known at compile time and one slice (D = 128, decode's split-K): every LSE
// and value of the row is loaded before any is used, so their loads are in flight together
// (one round trip, where the general loop waits for the LSEs first). Empty partials' values are
// loaded (the buffers hold them) and not used. Same arithmetic, in the same order.
template <int S, typename Part, typename Out>
__device__ __forceinline__ void merge_row_preloaded(const Part* __restrict__ parts, const float* __restrict__ lse_parts,
                                                    int64_t RH, int64_t rh, Out* __restrict__ out,
                                                    float* __restrict__ lse, int lane) {
  float lses[S], v[S][kMergePerLane];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    lses[s] = lse_parts[s * RH + rh];
#pragma unroll
    for (int i = 0; i < kMergePerLane; ++i) v[s][i] = load_f(parts + (s * RH + rh) * kMergeSlice + lane + 32 * i);
  }
  const SoftmaxState row = merged_state([&](int64_t s) { return lses[s]; }, S);
  float acc[kMergePerLane] = {0.f, 0.f, 0.f, 0.f};
  if (row.valid())
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const SoftmaxState part = SoftmaxState::from_lse(lses[s]);
      if (!(part.m > -INFINITY)) continue;
      const float w = part.weight(row.m);
#pragma unroll
      for (int i = 0; i < kMergePerLane; ++i) acc[i] += w * v[s][i];
    }
  const float inv = row.inverse_sum();
#pragma unroll
  for (int i = 0; i < kMergePerLane; ++i) store_f(out + rh * kMergeSlice + lane + 32 * i, acc[i] * inv);
  if (lane == 0) lse[rh] = row.lse();
}

}  // namespace msa::cuda
