// Gemma RMSNorm + partial NeoX RoPE of q / index-q style tensors [tokens, H, 128] on the GPU:
// one warp per (token, head) row, 4 elements a lane.
#include <cmath>

#include "cuda/inference/quant.cuh"
#include "cuda/reduce.cuh"

namespace msa::cuda {

namespace inference {

RopeTable rope_table(const NormRopeConfig& c) {
  RopeTable t{};
  for (int j = 0; j < c.rotary_dim / 2; ++j)
    t.inv_freq[j] = float(1.0 / std::pow(double(c.rope_theta), 2.0 * j / double(c.rotary_dim)));
  return t;
}

}  // namespace inference

namespace {

using namespace inference;

constexpr int kWarps = 8;

struct NormRopeArgs {
  const __nv_bfloat16* x;
  __nv_bfloat16* out;
  int64_t x_s0, x_s1, out_s0, out_s1;
  const void* weight;
  bool weight_f32;
  const int32_t* positions;  // nullptr when rotary_dim = 0
  int64_t rows;
  int heads;
  int rotary_dim;
  float eps;
  RopeTable rope;
};

__global__ void __launch_bounds__(kWarps * 32) norm_rope_kernel(const NormRopeArgs a) {
  __shared__ float work[kWarps][kHeadDim];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + warp;
  if (row >= a.rows) return;
  const int64_t t = row / a.heads, h = row % a.heads;
  float x[4], w1p[4];
  load_row4(a.x + t * a.x_s0 + h * a.x_s1, lane, x);
  load_weight4(a.weight, a.weight_f32, lane, w1p);
  const int32_t pos = a.positions ? a.positions[t] : 0;
  norm_rope_warp(x, w1p, a.rope, a.rotary_dim, a.eps, pos, work[warp], lane);
  uint16_t* o = reinterpret_cast<uint16_t*>(a.out + t * a.out_s0 + h * a.out_s1) + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = uint16_t(__float_as_uint(x[i]) >> 16);  // already bf16 values
}

}  // namespace

void rms_norm_rope(const RmsNormRopeParams& p, const RunOptions& opt) {
  DeviceGuard guard(p.x.device.index);
  NormRopeArgs a{};
  a.x = p.x.as<const __nv_bfloat16>();
  a.out = p.out.as<__nv_bfloat16>();
  a.x_s0 = p.x.stride[0];
  a.x_s1 = p.x.stride[1];
  a.out_s0 = p.out.stride[0];
  a.out_s1 = p.out.stride[1];
  a.weight = p.weight.data;
  a.weight_f32 = p.weight.dtype == DType::f32;
  a.positions = p.config.rotary_dim > 0 ? p.positions.as<const int32_t>() : nullptr;
  a.heads = int(p.x.shape[1]);
  a.rows = p.x.shape[0] * a.heads;
  a.rotary_dim = p.config.rotary_dim;
  a.eps = p.config.eps;
  a.rope = rope_table(p.config);
  if (a.rows == 0) return;
  norm_rope_kernel<<<unsigned(ceil_div(a.rows, kWarps)), kWarps * 32, 0, as_stream(opt)>>>(a);
  MSA_CUDA_CHECK_LAUNCH("norm_rope_kernel");
}

}  // namespace msa::cuda
