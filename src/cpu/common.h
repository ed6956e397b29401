// Small shared pieces of the CPU backend: threading and dtype-converting row access.
#pragma once

#include <omp.h>

#include <array>
#include <cstdint>
#include <vector>

#include "msa/ops.h"

namespace msa::cpu {

// Threads to use for one call.
inline int thread_count(const RunOptions& opt) { return opt.num_threads > 0 ? opt.num_threads : omp_get_max_threads(); }

// e4m3_to_float of every code (NaN for 0x7f / 0xff), built once: an FP8 row reads through it
// instead of calling the conversion per element.
inline const float* e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[size_t(c)] = e4m3_to_float(uint8_t(c));
    return t;
  }();
  return table.data();
}

// Converts `n` consecutive elements starting at element offset `offset` of `t` to fp32.
inline void load_row(const TensorView& t, int64_t offset, int n, float* dst) {
  if (t.dtype == DType::f32) {
    const float* s = t.as<const float>() + offset;
    for (int i = 0; i < n; ++i) dst[i] = s[i];
  } else if (t.dtype == DType::bf16) {
    const uint16_t* s = t.as<const uint16_t>() + offset;
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
  } else if (t.dtype == DType::f8e4m3) {
    const uint8_t* s = t.as<const uint8_t>() + offset;
    const float* values = e4m3_values();
    for (int i = 0; i < n; ++i) dst[i] = values[s[i]];
  } else {
    for (int i = 0; i < n; ++i) dst[i] = load_as_float(t.data, t.dtype, offset + i);
  }
}

// Writes `n` fp32 values to element offset `offset` of `t`, converting to its dtype.
inline void store_row(const TensorView& t, int64_t offset, int n, const float* src) {
  if (t.dtype == DType::f32) {
    float* d = t.as<float>() + offset;
    for (int i = 0; i < n; ++i) d[i] = src[i];
  } else if (t.dtype == DType::bf16) {
    uint16_t* d = t.as<uint16_t>() + offset;
    for (int i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
  } else {
    for (int i = 0; i < n; ++i) store_from_float(t.data, t.dtype, offset + i, src[i]);
  }
}

// Whole tensor to fp32 (contiguous), in parallel.
inline std::vector<float> to_float(const TensorView& t, int threads) {
  const int64_t n = t.numel();
  std::vector<float> out(static_cast<size_t>(n));
  const int64_t chunk = 4096;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < (n + chunk - 1) / chunk; ++c) {
    const int64_t b = c * chunk, e = std::min(n, b + chunk);
    load_row(t, b, int(e - b), out.data() + b);
  }
  return out;
}

}  // namespace msa::cpu
