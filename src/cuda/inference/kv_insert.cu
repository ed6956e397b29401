// Writing new tokens into the paged caches on the GPU (bf16, FP8 with per-tensor or
// per-(head, token) scales, NVFP4 with an optional global scale; index-K bf16 / FP8), with the
// optional Gemma RMSNorm + RoPE of k / index_k on the way in. One warp per (token, row) where
// the rows of a token are its Hkv K heads, its Hkv V heads and its index-K vector; a lane owns
// 4 consecutive elements, so an NVFP4 group of 16 is a quad of lanes.
#include "cuda/inference/quant.cuh"

namespace msa::cuda {

namespace {

using namespace inference;

constexpr int kWarps = 8;
constexpr int kLaneElements = kHeadDim / 32;                      // a lane's consecutive elements
constexpr int kLanesPerGroup = kNvfp4GroupSize / kLaneElements;   // lanes of an NVFP4 group (a quad)
static_assert(kLaneElements == 4 && kLanesPerGroup == 4, "load_row4: 4 elements a lane, a quad per NVFP4 group");

struct CacheSide {
  uint8_t* data;             // element type by format
  int64_t s0, s1, s2;        // element strides of [page, head, token]
  uint8_t* block_scale;      // nvfp4
  int64_t bs0, bs1, bs2;
  const float* tensor_scale; // per-tensor / global (nullptr: 1)
  float* token_scale;        // fp8 per-(head, token) (written)
  int64_t token_stride;
};

struct InsertArgs {
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  const __nv_bfloat16* index_k;  // nullptr: none
  int64_t k_s0, k_s1, v_s0, v_s1, ik_s0;
  const int32_t* slots;
  int64_t tokens;
  int hkv;
  KvFormat format;
  CacheSide side[2];             // K, V
  uint8_t* index_cache;          // bf16 or fp8
  bool index_fp8;
  int64_t ic_s0, ic_s1;
  const void* k_norm;            // nullptr: no norm
  bool k_norm_f32;
  const void* ik_norm;
  bool ik_norm_f32;
  const int32_t* positions;      // nullptr: position 0 (rotary_dim = 0)
  int rotary_dim;
  float eps;
  RopeTable rope;
};

__device__ __forceinline__ void write_main(const CacheSide& c, KvFormat format, int64_t page, int head, int offset,
                                           const float (&x)[4], int lane) {
  const int64_t base = page * c.s0 + int64_t(head) * c.s1 + int64_t(offset) * c.s2;
  switch (format) {
    case KvFormat::bf16: {
      uint16_t* d = reinterpret_cast<uint16_t*>(c.data) + base + lane * kLaneElements;
#pragma unroll
      for (int i = 0; i < 4; ++i) d[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
      return;
    }
    case KvFormat::fp8_e4m3: {
      float scale = c.tensor_scale ? *c.tensor_scale : 1.0f;
      if (c.token_scale) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(x[i]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        scale = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
        if (lane == 0) c.token_scale[head * c.token_stride + page * kPageSize + offset] = scale;
      }
      uint8_t* d = c.data + base + lane * kLaneElements;
      uint32_t packed = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) packed |= uint32_t(f32_to_e4m3(__fdiv_rn(x[i], scale))) << (8 * i);
#pragma unroll
      for (int i = 0; i < 4; ++i) d[i] = uint8_t(packed >> (8 * i));
      return;
    }
    case KvFormat::nvfp4: {
      const float global = c.tensor_scale ? *c.tensor_scale : 1.0f;
      float y[4], amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        y[i] = __fdiv_rn(x[i], global);
        amax = fmaxf(amax, fabsf(y[i]));
      }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      const uint8_t scale_code = f32_to_e4m3(__fdiv_rn(amax, 6.0f));
      const float scale = e4m3_to_f32(scale_code);
      uint32_t q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) q[i] = scale > 0.0f ? f32_to_e2m1(__fdiv_rn(y[i], scale)) : 0u;
      uint8_t* d = c.data + base + lane * (kLaneElements / 2);
      d[0] = uint8_t(q[0] | (q[1] << 4));
      d[1] = uint8_t(q[2] | (q[3] << 4));
      if (lane % kLanesPerGroup == 0)
        c.block_scale[page * c.bs0 + int64_t(head) * c.bs1 + int64_t(offset) * c.bs2 + lane / kLanesPerGroup] = scale_code;
      return;
    }
  }
}

__global__ void __launch_bounds__(kWarps * 32) insert_kv_kernel(const InsertArgs a) {
  __shared__ float work[kWarps][kHeadDim];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rows_per_token = 2 * a.hkv + 1;
  const int64_t job = int64_t(blockIdx.x) * kWarps + warp;
  if (job >= a.tokens * rows_per_token) return;
  const int64_t t = job / rows_per_token;
  const int r = int(job % rows_per_token);
  const int32_t slot = a.slots[t];
  if (slot < 0) return;
  const int64_t page = slot / kPageSize;
  const int offset = slot % kPageSize;
  const int32_t pos = a.positions ? a.positions[t] : 0;
  float x[4], w1p[4];
  if (r < a.hkv) {  // K head r
    load_row4(a.k + t * a.k_s0 + r * a.k_s1, lane, x);
    if (a.k_norm) {
      load_weight4(a.k_norm, a.k_norm_f32, lane, w1p);
      norm_rope_warp(x, w1p, a.rope, a.rotary_dim, a.eps, pos, work[warp], lane);
    }
    write_main(a.side[0], a.format, page, r, offset, x, lane);
  } else if (r < 2 * a.hkv) {  // V head r - hkv
    load_row4(a.v + t * a.v_s0 + (r - a.hkv) * a.v_s1, lane, x);
    write_main(a.side[1], a.format, page, r - a.hkv, offset, x, lane);
  } else {  // index K
    if (!a.index_k) return;
    load_row4(a.index_k + t * a.ik_s0, lane, x);
    if (a.ik_norm) {
      load_weight4(a.ik_norm, a.ik_norm_f32, lane, w1p);
      norm_rope_warp(x, w1p, a.rope, a.rotary_dim, a.eps, pos, work[warp], lane);
    }
    const int64_t base = page * a.ic_s0 + int64_t(offset) * a.ic_s1 + lane * kLaneElements;
    if (a.index_fp8) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a.index_cache[base + i] = f32_to_e4m3(x[i]);
    } else {
      uint16_t* d = reinterpret_cast<uint16_t*>(a.index_cache) + base;
#pragma unroll
      for (int i = 0; i < 4; ++i) d[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
    }
  }
}

CacheSide cache_side(const PagedKvCache& c, bool value_side) {
  const TensorView& d = value_side ? c.v : c.k;
  CacheSide s{};
  s.data = static_cast<uint8_t*>(d.data);
  s.s0 = d.stride[0];
  s.s1 = d.stride[1];
  s.s2 = d.stride[2];
  if (c.format == KvFormat::nvfp4) {
    const TensorView& b = value_side ? c.v_block_scale : c.k_block_scale;
    s.block_scale = static_cast<uint8_t*>(b.data);
    s.bs0 = b.stride[0];
    s.bs1 = b.stride[1];
    s.bs2 = b.stride[2];
  }
  const KvSideScales sc = side_scales(c, value_side);
  s.tensor_scale = sc.tensor;
  s.token_scale = const_cast<float*>(sc.token);
  s.token_stride = sc.token_stride;
  return s;
}

}  // namespace

void insert_kv(const KvInsertParams& p, const RunOptions& opt) {
  DeviceGuard guard(p.k.device.index);
  InsertArgs a{};
  a.k = p.k.as<const __nv_bfloat16>();
  a.v = p.v.as<const __nv_bfloat16>();
  a.k_s0 = p.k.stride[0];
  a.k_s1 = p.k.stride[1];
  a.v_s0 = p.v.stride[0];
  a.v_s1 = p.v.stride[1];
  if (p.index_k.present()) {
    a.index_k = p.index_k.as<const __nv_bfloat16>();
    a.ik_s0 = p.index_k.stride[0];
    a.index_cache = static_cast<uint8_t*>(p.index_k_cache.data);
    a.index_fp8 = p.index_k_cache.dtype == DType::f8e4m3;
    a.ic_s0 = p.index_k_cache.stride[0];
    a.ic_s1 = p.index_k_cache.stride[1];
  }
  a.slots = p.slot_mapping.as<const int32_t>();
  a.tokens = p.k.shape[0];
  a.hkv = int(p.k.shape[1]);
  a.format = p.cache.format;
  a.side[0] = cache_side(p.cache, false);
  a.side[1] = cache_side(p.cache, true);
  const bool norm = p.k_norm.present() || p.index_k_norm.present();
  if (p.k_norm.present()) {
    a.k_norm = p.k_norm.data;
    a.k_norm_f32 = p.k_norm.dtype == DType::f32;
  }
  if (p.index_k_norm.present()) {
    a.ik_norm = p.index_k_norm.data;
    a.ik_norm_f32 = p.index_k_norm.dtype == DType::f32;
  }
  if (norm) {
    a.positions = p.config.rotary_dim > 0 ? p.positions.as<const int32_t>() : nullptr;
    a.rotary_dim = p.config.rotary_dim;
    a.eps = p.config.eps;
    a.rope = rope_table(p.config);
  }
  const int64_t jobs = a.tokens * (2 * a.hkv + 1);
  if (jobs == 0) return;
  insert_kv_kernel<<<unsigned(ceil_div(jobs, kWarps)), kWarps * 32, 0, as_stream(opt)>>>(a);
  MSA_CUDA_CHECK_LAUNCH("insert_kv_kernel");
}

}  // namespace msa::cuda
