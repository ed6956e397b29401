// Device helpers shared by the CUDA inference kernels: FP8 E4M3 / NVFP4 (E2M1) conversions
// with exactly the rounding of the CPU backend (src/cpu/inference/common.h, src/core/dtype.cpp),
// small cp.async variants, and the host-side facts of a checked cache view.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend_inference.h"
#include "cuda/common.cuh"
#include "cuda/device.cuh"

namespace msa::cuda::inference {

// The model constants (include/msa/constants.h).
using model::kHeadDim;
using model::kPageSize;
using model::kTopk;

// E4M3 code -> fp32 (exact; 0x7f / 0xff are NaN).
__device__ __forceinline__ float e4m3_to_f32(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(code), __NV_E4M3);
  return __half2float(__half(h));
}

// fp32 -> E4M3 code: round to nearest even, saturating at +-448; NaN -> 0x7f (as the CPU).
__device__ __forceinline__ uint8_t f32_to_e4m3(float x) {
  if (isnan(x)) return 0x7f;
  return uint8_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// E2M1 magnitudes by the low three bits of a code; bit 3 is the sign.
__device__ __forceinline__ float e2m1_to_f32(uint32_t code) {
  const uint32_t m = code & 7u;
  // 0, 0.5, 1, 1.5, 2, 3, 4, 6
  const float mag = m < 4u ? 0.5f * float(m) : float(1u << (((m - 4u) >> 1) + 1u)) * (m & 1u ? 1.5f : 1.0f);
  return (code & 8u) ? -mag : mag;
}

// Nearest E2M1 code of v, ties to the even code, magnitudes above 6 clamp to 6, NaN -> 0
// (the CPU's float_to_e2m1).
__device__ __forceinline__ uint32_t f32_to_e2m1(float v) {
  const float m = fabsf(v);
  if (!(m >= 0.0f)) return 0u;
  uint32_t c;
  if (m <= 0.25f) c = 0;
  else if (m < 0.75f) c = 1;
  else if (m <= 1.25f) c = 2;
  else if (m < 1.75f) c = 3;
  else if (m <= 2.5f) c = 4;
  else if (m < 3.5f) c = 5;
  else if (m <= 5.0f) c = 6;
  else c = 7;
  if (c == 0) return 0u;
  return (signbit(v) ? 8u : 0u) | c;
}

// NVFP4 element: E4M3(e2m1 * block scale) (the product is exact in fp32).
__device__ __forceinline__ uint8_t nvfp4_to_e4m3(uint32_t code, float block_scale) {
  return f32_to_e4m3(e2m1_to_f32(code) * block_scale);
}

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The two E4M3 codes of the low 16 bits of `codes` (low byte first) -> their f16 pair, exactly
// (f16 holds every E4M3 value, subnormals included; NaN stays NaN): one conversion.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes & 0xffffu), __NV_E4M3);
  return uint32_t(h.x) | uint32_t(h.y) << 16;
}

// The same two codes -> their bf16 pair, exactly (E4M3 values are bf16 values): the same values
// as bf16x2_bits(e4m3_to_f32(lo), e4m3_to_f32(hi)).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  return bf16x2_bits(f.x, f.y);
}

// The 16 E4M3 codes of a 16-byte chunk (low byte first) -> 8 words of value pairs, exactly:
// out[2j], out[2j + 1] are the pairs of word j's low and high halves; bf16, or f16 with F16.
template <bool F16 = false>
__device__ __forceinline__ void e4m3x16_widen(const uint4& codes, uint32_t (&out)[8]) {
  const uint32_t w[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    out[2 * j] = F16 ? e4m3x2_to_f16x2(w[j]) : e4m3x2_to_bf16x2(w[j]);
    out[2 * j + 1] = F16 ? e4m3x2_to_f16x2(w[j] >> 16) : e4m3x2_to_bf16x2(w[j] >> 16);
  }
}

// 0x80 in each byte of `codes` that is an E4M3 NaN (0x7f / 0xff; E4M3 has no infinity), else
// 0: a byte whose low 7 bits are all ones carries into its top bit when 1 is added (and into
// no other byte). Two integer operations a word; ORed over words, one test.
__device__ __forceinline__ uint32_t e4m3x4_nan_bytes(uint32_t codes) {
  return ((codes & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
}

// Widens one side of an FP8 page (kPageSize rows x kHeadDim E4M3 codes, row-major at the
// shared address `raw`) into the 16-bit tile at `tile` (tile_offset(kPageSize, row, chunk):
// source chunk c of a row gives tile chunks 2c and 2c + 1), bf16 or with F16 f16, by the
// Threads threads w = 0 .. Threads - 1. Rows from `rows_read` on are zeroed instead (cache
// slots not written yet). A thread loads kBatch chunks before it converts and stores any: the
// shared-memory accesses are ordered (volatile), so one chunk at a time would pay the load's
// latency per chunk (kBatch: as many as the caller's registers allow). Returns, with CheckNaN,
// whether this thread met a NaN code in a row below rows_read.
template <int Threads, bool F16, bool CheckNaN, int kBatch = 4>
__device__ __forceinline__ bool widen_fp8_side(uint32_t raw, uint32_t tile, int w, int rows_read = kPageSize) {
  constexpr int kRowChunks = kHeadDim / 16;         // 16-byte chunks of an E4M3 row
  constexpr int kChunks = kPageSize * kRowChunks;   // of the side
  constexpr int kRounds = (kChunks + Threads * kBatch - 1) / (Threads * kBatch);
  uint32_t nan_bytes = 0;
#pragma unroll 1
  for (int round = 0; round < kRounds; ++round) {
    uint4 codes[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = w + Threads * (kBatch * round + i);
      if (c < kChunks) codes[i] = ld_shared_v4(raw + uint32_t(16 * c));
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = w + Threads * (kBatch * round + i);
      if (c >= kChunks) break;
      const int t = c / kRowChunks, col = c % kRowChunks;
      const uint32_t dst0 = tile + tile_offset(kPageSize, t, 2 * col), dst1 = tile + tile_offset(kPageSize, t, 2 * col + 1);
      if (t >= rows_read) {
        st_shared_v4_zero(dst0);
        st_shared_v4_zero(dst1);
        continue;
      }
      if constexpr (CheckNaN)
        nan_bytes |= e4m3x4_nan_bytes(codes[i].x) | e4m3x4_nan_bytes(codes[i].y) | e4m3x4_nan_bytes(codes[i].z) |
                     e4m3x4_nan_bytes(codes[i].w);
      uint32_t o[8];
      e4m3x16_widen<F16>(codes[i], o);
      st_shared_v4(dst0, o[0], o[1], o[2], o[3]);
      st_shared_v4(dst1, o[4], o[5], o[6], o[7]);
    }
  }
  return nan_bytes != 0;
}

// 8-byte asynchronous global -> shared copy (zero-filled when src_bytes = 0).
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// The per-tensor scale of a cache side as a device pointer (nullptr: 1) and the per-(head,
// token) scale pointer / head stride (nullptr: none).
struct KvSideScales {
  const float* tensor = nullptr;
  const float* token = nullptr;
  int64_t token_stride = 0;
};
inline KvSideScales side_scales(const PagedKvCache& c, bool value_side) {
  KvSideScales s;
  const TensorView& t = value_side ? c.v_scale : c.k_scale;
  switch (kv_scale_mode(c)) {
    case KvScaleMode::none: break;
    case KvScaleMode::per_tensor: s.tensor = t.as<const float>(); break;
    case KvScaleMode::per_head_token:
      s.token = t.as<const float>();
      s.token_stride = t.stride[0];
      break;
  }
  return s;
}

// fp32 inverse frequencies of the rotary embedding, computed on the host exactly like the CPU
// backend (double pow, rounded once) and passed to kernels by value.
struct RopeTable {
  float inv_freq[kHeadDim / 2];
};

// Loads the 4 elements lane * 4 .. lane * 4 + 3 of a bf16 row (2-byte aligned reads only).
__device__ __forceinline__ void load_row4(const __nv_bfloat16* row, int lane, float (&x)[4]) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + lane * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = __uint_as_float(uint32_t(p[i]) << 16);
}

// 1 + w for the 4 elements of this lane of a [128] bf16 or f32 Gemma weight.
__device__ __forceinline__ void load_weight4(const void* w, bool w_f32, int lane, float (&w1p)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int d = lane * 4 + i;
    const float v = w_f32 ? static_cast<const float*>(w)[d]
                          : __uint_as_float(uint32_t(static_cast<const uint16_t*>(w)[d]) << 16);
    w1p[i] = v + 1.0f;
  }
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Gemma RMSNorm + partial NeoX RoPE of one 128-row held by a warp (4 elements a lane), in the
// operation order of the CPU's norm_rope_row: y = bf16(x * inv_rms * (1 + w)), then the rotation
// y1 c - y2 s / y2 c + y1 s rounded to bf16 (products rounded separately, no FMA). `row` is
// the warp's 128-float shared-memory work space. The sum of squares is a warp reduction, so
// it may differ from the CPU's sequential sum in the last bit.
__device__ __forceinline__ void norm_rope_warp(float (&x)[4], const float (&w1p)[4], const RopeTable& rope,
                                               int rotary_dim, float eps, int32_t position, float* row, int lane) {
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) ss = __fadd_rn(ss, __fmul_rn(x[i], x[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float inv_rms = 1.0f / sqrtf(ss / float(kHeadDim) + eps);
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = round_bf16(__fmul_rn(__fmul_rn(x[i], inv_rms), w1p[i]));
  if (rotary_dim == 0) return;
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) row[lane * 4 + i] = x[i];
  __syncwarp();
  const int half = rotary_dim / 2;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int d = lane * 4 + i;
    if (d >= rotary_dim) continue;
    const int j = d < half ? d : d - half;
    const float angle = __fmul_rn(float(position), rope.inv_freq[j]);
    float s, c;
    sincosf(angle, &s, &c);
    const float x1 = row[j], x2 = row[j + half];
    x[i] = d < half ? round_bf16(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)))
                    : round_bf16(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
  }
  __syncwarp();
}

// The rope table of a config, computed like the CPU's rope_inv_freq.
RopeTable rope_table(const NormRopeConfig& c);

}  // namespace msa::cuda::inference
