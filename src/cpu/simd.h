// Portable 16-lane fp32 vectors (GCC/Clang vector extensions: AVX-512 registers under
// -march=native, pairs of AVX2 or SSE registers elsewhere), a vector exp and the small
// fp32 matrix-multiply kernel every CPU op is built from.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace msa::cpu {

inline constexpr int kLanes = 16;
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 vload(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
inline f32x16 vsplat(float x) { return f32x16{} + x; }

inline f32x16 vmax(f32x16 a, f32x16 b) { return a > b ? a : b; }

inline float hmax(f32x16 v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
inline float hsum(f32x16 v) {
  // Pairwise, in a fixed order.
  float s[8];
  for (int i = 0; i < 8; ++i) s[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) s[i] += s[i + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// exp(x) to about 2 ulp for x in [-87, 88.37]; below that 0 (no denormals), above +inf,
// NaN stays NaN.
inline f32x16 vexp(f32x16 x) {
  const f32x16 lo = vsplat(-87.0f), hi = vsplat(88.37f);
  const f32x16 xc = x < lo ? lo : (x > hi ? hi : x);
  // n = round(x / ln 2) by the 1.5 * 2^23 shifter; r = x - n ln 2 in two parts.
  const float shifter = 12582912.0f;
  const f32x16 t = xc * 1.44269504088896341f + shifter;
  const f32x16 n = t - shifter;
  f32x16 r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  // Minimax polynomial for e^r on [-ln2/2, ln2/2].
  f32x16 p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const i32x16 bits = ((i32x16)t - (i32x16)vsplat(shifter) + 127) << 23;
  f32x16 y = p * (f32x16)bits;
  y = x < lo ? vsplat(0.0f) : y;
  y = x > hi ? vsplat(std::numeric_limits<float>::infinity()) : y;
  return x != x ? x : y;
}

// C[M, N] = (or +=) A[M, K] . B[K, N], fp32. Element (m, k) of A is a[m * a_m + k * a_k]
// (any strides: A is read by broadcasts, so transposed operands cost nothing); row k of B
// starts at b + k * ldb and row m of C at c + m * ldc. N must be a multiple of 64.
namespace detail {
template <int MR, bool kAccumulate>
inline void gemm_tile(int K, const float* a, int64_t a_m, int64_t a_k, const float* b, int64_t ldb, float* c,
                      int64_t ldc) {
  f32x16 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = kAccumulate ? vload(c + i * ldc + 16 * j) : f32x16{};
  for (int k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    const f32x16 b0 = vload(bk), b1 = vload(bk + 16), b2 = vload(bk + 32), b3 = vload(bk + 48);
    const float* ak = a + k * a_k;
    for (int i = 0; i < MR; ++i) {
      const float ai = ak[i * a_m];
      acc[i][0] += b0 * ai;
      acc[i][1] += b1 * ai;
      acc[i][2] += b2 * ai;
      acc[i][3] += b3 * ai;
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) vstore(c + i * ldc + 16 * j, acc[i][j]);
}
}  // namespace detail

template <bool kAccumulate>
inline void gemm(int M, int N, int K, const float* a, int64_t a_m, int64_t a_k, const float* b, int64_t ldb, float* c,
                 int64_t ldc) {
  constexpr int MR = 6;
  for (int n0 = 0; n0 < N; n0 += 64) {
    int m0 = 0;
    for (; m0 + MR <= M; m0 += MR)
      detail::gemm_tile<MR, kAccumulate>(K, a + m0 * a_m, a_m, a_k, b + n0, ldb, c + m0 * ldc + n0, ldc);
    const float* ar = a + m0 * a_m;
    float* cr = c + m0 * ldc + n0;
    switch (M - m0) {
      case 5: detail::gemm_tile<5, kAccumulate>(K, ar, a_m, a_k, b + n0, ldb, cr, ldc); break;
      case 4: detail::gemm_tile<4, kAccumulate>(K, ar, a_m, a_k, b + n0, ldb, cr, ldc); break;
      case 3: detail::gemm_tile<3, kAccumulate>(K, ar, a_m, a_k, b + n0, ldb, cr, ldc); break;
      case 2: detail::gemm_tile<2, kAccumulate>(K, ar, a_m, a_k, b + n0, ldb, cr, ldc); break;
      case 1: detail::gemm_tile<1, kAccumulate>(K, ar, a_m, a_k, b + n0, ldb, cr, ldc); break;
      default: break;
    }
  }
}

}  // namespace msa::cpu
