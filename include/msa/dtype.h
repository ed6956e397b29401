// Element types understood by msa and exact host conversions between them and fp32.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace msa {

enum class DType : uint8_t { bf16, f16, f32, f8e4m3, i32, u8 };

// Bytes per element.
constexpr int dtype_size(DType t) {
  switch (t) {
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::f32: return 4;
    case DType::f8e4m3: return 1;
    case DType::i32: return 4;
    case DType::u8: return 1;
  }
  return 0;
}

// Lower-case name used in messages ("bf16", "fp8_e4m3", ...).
std::string_view dtype_name(DType t);

// ---- scalar conversions (round to nearest even; NaN stays NaN) ----

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
// Rounds an fp32 value to the nearest bf16 value (kept in fp32).
inline float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

float f16_to_float(uint16_t h);
uint16_t float_to_f16(float f);

// FP8 E4M3 (OCP "fn" variant: no infinities, max finite 448, NaN = S.1111.111).
float e4m3_to_float(uint8_t v);
// Saturating conversion: |x| > 448 gives ±448; NaN gives NaN.
uint8_t float_to_e4m3(float f);

// Reads element `i` (element offset, not bytes) of a buffer of type `t` as float.
float load_as_float(const void* base, DType t, int64_t i);
// Writes `value` converted to type `t` at element offset `i`.
void store_from_float(void* base, DType t, int64_t i, float value);

}  // namespace msa
