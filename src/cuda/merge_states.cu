// Merge of partial attention states by LSE weights (same rules as the CPU backend): one warp
// per (row, head), the head dimension in slices of 128 (4 values a lane).
#include "attention_state.h"
#include "backend.h"
#include "cuda/common.cuh"
#include "cuda/reduce.cuh"

namespace msa::cuda {
namespace {

constexpr int kPerLane = 4;             // values of a slice each lane owns
constexpr int kSlice = 32 * kPerLane;   // values of the (any-sized) head dimension a warp takes at once

template <typename Part, typename Out>
__global__ void merge_states_kernel(const Part* __restrict__ parts, const float* __restrict__ lse_parts, int64_t S,
                                    int64_t RH, int64_t D, Out* __restrict__ out, float* __restrict__ lse) {
  const int64_t rh = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (rh >= RH) return;
  // Two passes over the LSEs (max, then sums), then the values of every kSlice-wide slice
  // weighted against the common max; rules and arithmetic are src/attention_state.h's.
  SoftmaxState row = SoftmaxState::empty();
  for (int64_t s = 0; s < S; ++s) row.m = state_math::max(row.m, SoftmaxState::from_lse(lse_parts[s * RH + rh]).m);
  for (int64_t s = 0; s < S; ++s) row.add_at_max(SoftmaxState::from_lse(lse_parts[s * RH + rh]));
  const bool ok = row.valid();
  const float inv = row.inverse_sum();
  for (int64_t d0 = 0; d0 < D; d0 += kSlice) {
    float acc[kPerLane] = {0.f, 0.f, 0.f, 0.f};
    if (ok)
      for (int64_t s = 0; s < S; ++s) {
        const SoftmaxState part = SoftmaxState::from_lse(lse_parts[s * RH + rh]);
        if (!(part.m > -INFINITY)) continue;  // empty partial: its values are never read
        const float w = part.weight(row.m);
        const Part* values = parts + (s * RH + rh) * D;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int64_t d = d0 + lane + 32 * i;
          if (d < D) acc[i] += w * load_f(values + d);
        }
      }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t d = d0 + lane + 32 * i;
      if (d < D) store_f(out + rh * D + d, acc[i] * inv);
    }
  }
  if (lane == 0) lse[rh] = row.lse();
}

template <typename Part, typename Out>
void launch(const MergeStatesParams& p, cudaStream_t s) {
  const int64_t S = p.out_partials.shape[0], RH = p.out_partials.shape[1] * p.out_partials.shape[2],
                D = p.out_partials.shape[3];
  if (RH == 0) return;
  merge_states_kernel<Part, Out><<<grid_for(RH * 32, 256), 256, 0, s>>>(
      p.out_partials.as<const Part>(), p.lse_partials.as<const float>(), S, RH, D, p.out.as<Out>(), p.lse.as<float>());
  MSA_CUDA_CHECK_LAUNCH("merge_states_kernel");
}

}  // namespace

void merge_states(const MergeStatesParams& p, const RunOptions& opt) {
  DeviceGuard guard(p.out_partials.device.index);
  const cudaStream_t s = as_stream(opt);
  const bool pf = p.out_partials.dtype == DType::f32, of = p.out.dtype == DType::f32;
  if (pf && of) launch<float, float>(p, s);
  else if (pf) launch<float, __nv_bfloat16>(p, s);
  else if (of) launch<__nv_bfloat16, float>(p, s);
  else launch<__nv_bfloat16, __nv_bfloat16>(p, s);
}

}  // namespace msa::cuda
