// Merge of partial attention states by LSE weights (same rules as the CPU backend): one warp
// per (row, head), merge_row.cuh.
#include <type_traits>

#include "attention_state.h"
#include "backend.h"
#include "cuda/common.cuh"
#include "cuda/merge_row.cuh"
#include "cuda/reduce.cuh"

namespace msa::cuda {
namespace {

template <typename Part, typename Out>
__global__ void merge_states_kernel(const Part* __restrict__ parts, const float* __restrict__ lse_parts, int64_t S,
                                    int64_t RH, int64_t D, Out* __restrict__ out, float* __restrict__ lse) {
  const int64_t rh = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (rh >= RH) return;
  merge_row(parts, lse_parts, S, RH, D, rh, out, lse, int(threadIdx.x & 31));
}

// Decode's split counts with one slice of 128 dims: every load of a row in flight at once.
template <int S, typename Part, typename Out>
__global__ void merge_states_preloaded_kernel(const Part* __restrict__ parts, const float* __restrict__ lse_parts,
                                              int64_t RH, Out* __restrict__ out, float* __restrict__ lse) {
  const int64_t rh = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (rh >= RH) return;
  merge_row_preloaded<S>(parts, lse_parts, RH, rh, out, lse, int(threadIdx.x & 31));
}

template <int S, typename Part, typename Out>
void launch_preloaded(const MergeStatesParams& p, int64_t RH, cudaStream_t s) {
  merge_states_preloaded_kernel<S, Part, Out><<<grid_for(RH * 32, 256), 256, 0, s>>>(
      p.out_partials.as<const Part>(), p.lse_partials.as<const float>(), RH, p.out.as<Out>(), p.lse.as<float>());
  MSA_CUDA_CHECK_LAUNCH("merge_states_preloaded_kernel");
}

template <typename Part, typename Out>
void launch(const MergeStatesParams& p, cudaStream_t s) {
  const int64_t S = p.out_partials.shape[0], RH = p.out_partials.shape[1] * p.out_partials.shape[2],
                D = p.out_partials.shape[3];
  if (RH == 0) return;
  if constexpr (std::is_same_v<Part, float>) {  // decode's partials
    if (D == kMergeSlice) {
      if (S == 2) return launch_preloaded<2, Part, Out>(p, RH, s);
      if (S == 4) return launch_preloaded<4, Part, Out>(p, RH, s);
      if (S == 8) return launch_preloaded<8, Part, Out>(p, RH, s);
    }
  }
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
