// Shared pieces of the CPU inference backend: dequantising cache rows of every format (also
// as transposed pages, the B operand of the score GEMM) and the Gemma RMSNorm + RoPE row
// transform.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "backend_inference.h"
#include "cpu/common.h"

namespace msa::cpu::inference {

// The model constants (include/msa/constants.h).
using model::kHeadDim;
using model::kPageSize;
using model::kTopk;

// E2M1 magnitudes by the low 3 bits of a code; bit 3 is the sign.
inline constexpr float kE2m1Values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

inline float e2m1_to_float(uint8_t code) {
  const float m = kE2m1Values[code & 7];
  return (code & 8) ? -m : m;
}

// NVFP4 element: the product with its block scale rounded to E4M3 (saturating at 448).
inline float nvfp4_element(uint8_t code, uint8_t block_scale) {
  return e4m3_to_float(float_to_e4m3(e2m1_to_float(code) * e4m3_to_float(block_scale)));
}

// nvfp4_element of every (block scale, code): row `block_scale` of 16 values, built once. A
// page's rows read through it instead of rounding every element to E4M3 again.
inline const float* nvfp4_values(uint8_t block_scale) {
  static const std::array<float, 256 * 16> table = [] {
    std::array<float, 256 * 16> t{};
    for (int s = 0; s < 256; ++s)
      for (int c = 0; c < 16; ++c) t[size_t(s * 16 + c)] = nvfp4_element(uint8_t(c), uint8_t(s));
    return t;
  }();
  return table.data() + size_t(block_scale) * 16;
}

// Element offset of [i0, i1, i2, 0] in a rank-4 view.
inline int64_t offset4(const TensorView& t, int64_t i0, int64_t i1, int64_t i2) {
  return i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2];
}

// dst[d * 128 + t] = rows[t * 128 + d] for a [128 tokens, 128 dims] page, in cache-friendly
// 16 x 16 tiles.
inline void transpose_page(const float* rows, float* dst) {
  constexpr int kTile = 16;
  for (int t0 = 0; t0 < kPageSize; t0 += kTile)
    for (int d0 = 0; d0 < kHeadDim; d0 += kTile)
      for (int d = d0; d < d0 + kTile; ++d)
        for (int t = t0; t < t0 + kTile; ++t) dst[d * kPageSize + t] = rows[t * kHeadDim + d];
}

// One side (K or V) of a validated paged cache: its codes, block scales and how its f32
// scales apply. Shared by the row reader and the row writer.
struct KvCacheSide {
  KvCacheSide(const PagedKvCache& cache, bool value_side)
      : format(cache.format),
        data(value_side ? cache.v : cache.k),
        block_scale(value_side ? cache.v_block_scale : cache.k_block_scale),
        mode(kv_scale_mode(cache)) {
    const TensorView& scale = value_side ? cache.v_scale : cache.k_scale;
    if (mode == KvScaleMode::per_tensor) tensor_scale = *scale.as<const float>();
    if (mode == KvScaleMode::per_head_token) {
      token_scale = scale.as<float>();
      token_scale_stride = scale.stride[0];
    }
  }
  // The per-(head, token) scale of (physical page, kv head, offset) (per_head_token only).
  float& token_scale_at(int64_t page, int head, int offset) const {
    return token_scale[head * token_scale_stride + page * kPageSize + offset];
  }

  KvFormat format;
  TensorView data, block_scale;
  KvScaleMode mode;
  float tensor_scale = 1.0f;  // per-tensor scale (fp8) or global scale (nvfp4); 1 when absent
  float* token_scale = nullptr;
  int64_t token_scale_stride = 0;
};

// Reads dequantised rows of one side (K or V) of a validated paged cache.
class KvRowReader {
 public:
  KvRowReader(const PagedKvCache& cache, bool value_side) : side_(cache, value_side) {}

  // Rows [offset, offset + n) of (physical page, kv head) into dst [n, 128] fp32.
  void rows(int64_t page, int head, int offset, int n, float* dst) const {
    for (int t = 0; t < n; ++t) row(page, head, offset + t, dst + int64_t(t) * kHeadDim);
  }

  // Rows [0, n) of (physical page, kv head) transposed into dst [128 dims, 128 tokens];
  // tokens n..127 are zero. `rows` [128, 128] is work space.
  void rows_transposed(int64_t page, int head, int n, float* dst, float* rows) const {
    this->rows(page, head, 0, n, rows);
    std::fill(rows + int64_t(n) * kHeadDim, rows + int64_t(kPageSize) * kHeadDim, 0.0f);
    transpose_page(rows, dst);
  }

  // One dequantised row of (physical page, kv head, offset) into dst [128] fp32.
  void row(int64_t page, int head, int offset, float* dst) const {
    const int64_t base = offset4(side_.data, page, head, offset);
    switch (side_.format) {
      case KvFormat::bf16: {
        const uint16_t* s = side_.data.as<const uint16_t>() + base;
        for (int d = 0; d < kHeadDim; ++d) dst[d] = bf16_to_float(s[d]);
        return;
      }
      case KvFormat::fp8_e4m3: {
        const uint8_t* s = side_.data.as<const uint8_t>() + base;
        const float scale =
            side_.mode == KvScaleMode::per_head_token ? side_.token_scale_at(page, head, offset) : side_.tensor_scale;
        const float* values = e4m3_values();
        for (int d = 0; d < kHeadDim; ++d) dst[d] = values[s[d]] * scale;
        return;
      }
      case KvFormat::nvfp4: {
        const uint8_t* s = side_.data.as<const uint8_t>() + base;
        const uint8_t* sf = side_.block_scale.as<const uint8_t>() + offset4(side_.block_scale, page, head, offset);
        for (int d0 = 0; d0 < kHeadDim; d0 += kNvfp4GroupSize) {
          const float* values = nvfp4_values(sf[d0 / kNvfp4GroupSize]);
          for (int d = d0; d < d0 + kNvfp4GroupSize; d += 2) {
            const uint8_t byte = s[d / 2];
            dst[d] = values[byte & 0xf] * side_.tensor_scale;
            dst[d + 1] = values[byte >> 4] * side_.tensor_scale;
          }
        }
        return;
      }
    }
  }

 private:
  KvCacheSide side_;
};

// All 128 index-K rows of a physical page transposed into dst [128 dims, 128 tokens] fp32;
// `rows` [128, 128] is work space.
inline void index_keys_transposed(const TensorView& cache, int64_t page, float* dst, float* rows) {
  for (int t = 0; t < kPageSize; ++t)
    load_row(cache, page * cache.stride[0] + int64_t(t) * cache.stride[1], kHeadDim, rows + t * kHeadDim);
  transpose_page(rows, dst);
}

// Gemma RMSNorm + partial NeoX RoPE of one 128-row (docs/semantics.md §9.7), bf16-rounded results:
// the norm output is rounded to bf16 before the rotation, the rotation result again.
// `weight1p` holds 1 + w (fp32); `inv_freq` the rotary_dim / 2 fp32 inverse frequencies.
inline void norm_rope_row(const float* x, const float* weight1p, const float* inv_freq, int rotary_dim, float eps,
                          int32_t position, float* out) {
  float ss = 0;
  for (int d = 0; d < kHeadDim; ++d) ss += x[d] * x[d];
  const float inv_rms = 1.0f / std::sqrt(ss / float(kHeadDim) + eps);
  for (int d = 0; d < kHeadDim; ++d) out[d] = round_to_bf16(x[d] * inv_rms * weight1p[d]);
  const int half = rotary_dim / 2;
  for (int j = 0; j < half; ++j) {
    const float angle = float(position) * inv_freq[j];
    const float c = std::cos(angle), s = std::sin(angle);
    const float x1 = out[j], x2 = out[j + half];
    out[j] = round_to_bf16(x1 * c - x2 * s);
    out[j + half] = round_to_bf16(x2 * c + x1 * s);
  }
}

// fp32 inverse frequencies theta^(-2j / rotary_dim), computed in double and rounded once.
inline void rope_inv_freq(int rotary_dim, float theta, float* inv_freq) {
  for (int j = 0; j < rotary_dim / 2; ++j)
    inv_freq[j] = float(1.0 / std::pow(double(theta), 2.0 * j / double(rotary_dim)));
}

// 1 + w in fp32 for a validated [128] weight.
inline void gemma_weight(const TensorView& w, float* weight1p) {
  load_row(w, 0, kHeadDim, weight1p);
  for (int d = 0; d < kHeadDim; ++d) weight1p[d] += 1.0f;
}

}  // namespace msa::cpu::inference
