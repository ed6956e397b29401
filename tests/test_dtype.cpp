// Scalar conversions against hand-computed values: round to nearest even, overflow,
// subnormals, saturation of E4M3 at 448, NaN.
#include <cmath>
#include <limits>

#include "test_support.h"

namespace msa::test {
namespace {

float f(uint32_t bits) { return bits_float(bits); }
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::bf16), 2);
  EXPECT_EQ(dtype_size(DType::f16), 2);
  EXPECT_EQ(dtype_size(DType::f32), 4);
  EXPECT_EQ(dtype_size(DType::f8e4m3), 1);
  EXPECT_EQ(dtype_size(DType::i32), 4);
  EXPECT_EQ(dtype_size(DType::u8), 1);
  EXPECT_EQ(dtype_name(DType::bf16), "bf16");
  EXPECT_EQ(dtype_name(DType::f8e4m3), "fp8_e4m3");
  EXPECT_EQ(dtype_name(DType::i32), "int32");
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-2.5f), 0xc020);
  EXPECT_EQ(float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  // 1 + 2^-8 lies halfway between 1 (even mantissa) and 1 + 2^-7: down to 1.
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  // Just above half: up.
  EXPECT_EQ(float_to_bf16(f(0x3f808001)), 0x3f81);
  // Just below half: down.
  EXPECT_EQ(float_to_bf16(f(0x3f807fff)), 0x3f80);
  // The largest float rounds up to infinity; infinity stays.
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(float_to_bf16(kInf), 0x7f80);
  EXPECT_EQ(float_to_bf16(-kInf), 0xff80);
  // The largest bf16 value stays.
  EXPECT_EQ(float_to_bf16(f(0x7f7f0000)), 0x7f7f);
  // Subnormals round like the rest.
  EXPECT_EQ(float_to_bf16(f(0x00018000)), 0x0002);
  EXPECT_EQ(float_to_bf16(f(0x00008000)), 0x0000);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_float(0xc020), -2.5f);
  EXPECT_EQ(round_to_bf16(3.14159265f), 3.140625f);
}

TEST(DType, Bf16KeepsNan) {
  for (uint32_t bits : {0x7fc00000u, 0x7f800001u, 0xffffffffu, 0x7fff0000u}) {
    const uint16_t h = float_to_bf16(f(bits));
    EXPECT_EQ(h & 0x7f80, 0x7f80) << std::hex << bits;
    EXPECT_NE(h & 0x007f, 0) << std::hex << bits << ": NaN must not become infinity";
    EXPECT_TRUE(std::isnan(bf16_to_float(h)));
  }
}

TEST(DType, F16Conversions) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(float_to_f16(65519.0f), 0x7bff);  // below the halfway point to 65536
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);  // halfway: rounds to even = infinity
  EXPECT_EQ(float_to_f16(1e6f), 0x7c00);
  EXPECT_EQ(float_to_f16(-kInf), 0xfc00);
  // Ties to even.
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(float_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Subnormals: 2^-24 is the smallest; half of it ties to 0; 1.5 of it ties to 2 * 2^-24.
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(float_to_f16(3 * std::ldexp(1.0f, -25)), 0x0002);
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -14)), 0x0400);          // smallest normal
  EXPECT_EQ(float_to_f16(std::ldexp(1023.5f, -24)), 0x0400);       // rounds up into the normals
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_float(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(f16_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_float(0x7c00), kInf);
  EXPECT_EQ(f16_to_float(0xbc00), -1.0f);
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(kNan))));
  EXPECT_EQ(float_to_f16(kNan) & 0x7c00, 0x7c00);
  // Every f16 value survives a round trip through float.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;  // NaN payloads
    ASSERT_EQ(float_to_f16(f16_to_float(uint16_t(h))), h) << std::hex << h;
  }
}

TEST(DType, E4m3Conversions) {
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_e4m3(1.0f), 0x38);  // exponent 7 (bias 7), mantissa 0
  EXPECT_EQ(float_to_e4m3(-1.5f), 0xbc);
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);  // largest finite
  // Saturation: no infinities in the "fn" format.
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(1000.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-1000.0f), 0xfe);
  EXPECT_EQ(float_to_e4m3(kInf), 0x7e);
  // Ties to even: 1 + 1/16 between 1 (m=0) and 1.125 (m=1) -> 1; 1 + 3/16 -> 1.25 (m=2).
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);
  EXPECT_EQ(float_to_e4m3(1.07f), 0x39);
  // Subnormals: 2^-9 is the smallest; 2^-10 ties to 0; 3 * 2^-10 ties to 2 * 2^-9.
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -9)), 0x01);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(float_to_e4m3(3 * std::ldexp(1.0f, -10)), 0x02);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -6)), 0x08);  // smallest normal
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x3a), 1.25f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(float_to_e4m3(kNan))));
  for (int v = 0; v < 256; ++v) {
    if ((v & 0x7f) == 0x7f) continue;
    ASSERT_EQ(float_to_e4m3(e4m3_to_float(uint8_t(v))), v) << v;
  }
}

TEST(DType, LoadAndStoreThroughEveryType) {
  unsigned char buffer[64] = {};
  store_from_float(buffer, DType::bf16, 3, 1.5f);
  EXPECT_EQ(reinterpret_cast<uint16_t*>(buffer)[3], 0x3fc0);
  EXPECT_EQ(load_as_float(buffer, DType::bf16, 3), 1.5f);
  store_from_float(buffer, DType::f16, 1, -0.5f);
  EXPECT_EQ(reinterpret_cast<uint16_t*>(buffer)[1], 0xb800);
  EXPECT_EQ(load_as_float(buffer, DType::f16, 1), -0.5f);
  store_from_float(buffer, DType::f8e4m3, 5, 500.0f);
  EXPECT_EQ(buffer[5], 0x7e);
  EXPECT_EQ(load_as_float(buffer, DType::f8e4m3, 5), 448.0f);
  store_from_float(buffer, DType::f32, 2, 0.1f);
  EXPECT_EQ(load_as_float(buffer, DType::f32, 2), 0.1f);
  store_from_float(buffer, DType::i32, 4, -7.0f);
  EXPECT_EQ(reinterpret_cast<int32_t*>(buffer)[4], -7);
  EXPECT_EQ(load_as_float(buffer, DType::i32, 4), -7.0f);
  store_from_float(buffer, DType::u8, 60, 200.0f);
  EXPECT_EQ(load_as_float(buffer, DType::u8, 60), 200.0f);
}

}  // namespace
}  // namespace msa::test
