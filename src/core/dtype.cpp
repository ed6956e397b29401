#include "msa/dtype.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace msa {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f32: return "f32";
    case DType::f8e4m3: return "fp8_e4m3";
    case DType::i32: return "int32";
    case DType::u8: return "uint8";
  }
  return "?";
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    const float mag = std::ldexp(float(man), -24);  // subnormal (or zero)
    return sign ? -mag : mag;
  }
  return bits_float(sign | (uint32_t(exp - 15 + 127) << 23) | (man << 13));
}

uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal in half precision: value / 2^-24 rounded to nearest even.
    const float mag = bits_float(abs);
    const float q = std::nearbyint(mag * 16777216.0f);  // exact: power-of-two scaling
    return uint16_t(sign | uint16_t(q));
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  const uint32_t exp = (rounded >> 23) - 127 + 15;
  return uint16_t(sign | (exp << 10) | ((rounded >> 13) & 0x3ffu));
}

namespace {
// The 127 non-negative finite E4M3 values, ascending with their code.
const std::array<float, 127>& e4m3_positive_table() {
  static const std::array<float, 127> table = [] {
    std::array<float, 127> t{};
    for (int code = 0; code < 127; ++code) {
      const int exp = code >> 3, man = code & 7;
      t[size_t(code)] = exp == 0 ? std::ldexp(float(man), -9) : std::ldexp(1.0f + man / 8.0f, exp - 7);
    }
    return t;
  }();
  return table;
}
}  // namespace

float e4m3_to_float(uint8_t v) {
  const int code = v & 0x7f;
  if (code == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  const float mag = e4m3_positive_table()[size_t(code)];
  return (v & 0x80) ? -mag : mag;
}

uint8_t float_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float mag = std::fabs(f);
  const auto& t = e4m3_positive_table();
  if (mag >= t[126]) return uint8_t(sign | 126);  // saturate at 448
  // First code whose value is >= mag; choose between it and its predecessor.
  const int hi = int(std::lower_bound(t.begin(), t.end(), mag) - t.begin());
  if (hi == 0) return sign;
  const int lo = hi - 1;
  const float dlo = mag - t[size_t(lo)], dhi = t[size_t(hi)] - mag;
  int code = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);  // ties to even mantissa
  return uint8_t(sign | code);
}

float load_as_float(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::f16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::f8e4m3: return e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::i32: return float(static_cast<const int32_t*>(base)[i]);
    case DType::u8: return float(static_cast<const uint8_t*>(base)[i]);
  }
  return 0;
}

void store_from_float(void* base, DType t, int64_t i, float value) {
  switch (t) {
    case DType::bf16: static_cast<uint16_t*>(base)[i] = float_to_bf16(value); break;
    case DType::f16: static_cast<uint16_t*>(base)[i] = float_to_f16(value); break;
    case DType::f32: static_cast<float*>(base)[i] = value; break;
    case DType::f8e4m3: static_cast<uint8_t*>(base)[i] = float_to_e4m3(value); break;
    case DType::i32: static_cast<int32_t*>(base)[i] = int32_t(value); break;
    case DType::u8: static_cast<uint8_t*>(base)[i] = uint8_t(value); break;
  }
}

}  // namespace msa
