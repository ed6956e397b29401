// Quantised caches: FP8 E4M3 K/V (per-tensor and per-(head, token) scales), FP8 index-K,
// NVFP4 K/V (E2M1 codes + E4M3 block scales, optional global scale) and NVFP4 -> FP8
// conversion, first on hand-computed values, then on random caches against the oracle.
#include "inference_support.h"

namespace msa::test {
namespace {

const Topology kSmall = Topology::minimax_m3(4);

// One request with one token: the query attends exactly that key, so out = the dequantised
// V row and lse = <q, k> / sqrt(128) with the dequantised K row.
PagedCase single_token_case(std::mt19937_64& rng, const CaseOptions& o) {
  PagedCase c = make_prefill_case(rng, kSmall, {0}, {1}, o);
  for (int64_t e = 0; e < c.q.numel(); ++e) c.q.set(e, 1.0f);
  return c;
}

int64_t slot_row(const PagedCase& c, int64_t width) { return int64_t(c.page_table[0]) * c.topo.num_kv_heads * 128 * width; }

TEST(InferenceQuant, OracleDecodersOnHandValues) {
  EXPECT_EQ(oracle::e4m3_value(0x38), 1.0);
  EXPECT_EQ(oracle::e4m3_value(0x40), 2.0);
  EXPECT_EQ(oracle::e4m3_value(0xB8), -1.0);
  EXPECT_EQ(oracle::e4m3_value(0x01), std::ldexp(1.0, -9));
  EXPECT_EQ(oracle::e4m3_value(0x7E), 448.0);
  EXPECT_TRUE(std::isnan(oracle::e4m3_value(0x7F)));
  EXPECT_EQ(oracle::e2m1_value(0x7), 6.0);
  EXPECT_EQ(oracle::e2m1_value(0xB), -1.5);
  EXPECT_EQ(oracle::round_to_e4m3(1.6875), 1.75);  // tie between 1.625 and 1.75 -> even mantissa
  EXPECT_EQ(oracle::round_to_e4m3(5.625), 5.5);
  EXPECT_EQ(oracle::round_to_e4m3(1000.0), 448.0);
  EXPECT_EQ(oracle::nvfp4_value(0x7, 0x38), 6.0);
  EXPECT_EQ(oracle::nvfp4_value(0x7, 0x7E), 448.0);   // 6 * 448 clamps
  EXPECT_EQ(oracle::nvfp4_value(0x3, 0x39), 1.75);    // 1.5 * 1.125 = 1.6875 -> 1.75
  EXPECT_EQ(oracle::nvfp4_value(0x1, 0x01), 0.0);     // 0.5 * 2^-9 = 2^-10: tie -> 0
  EXPECT_EQ(oracle::round_to_bf16(1.00390625), 1.0);  // tie -> even
  EXPECT_EQ(oracle::round_to_bf16(1.01171875), 1.015625);
}

TEST(InferenceQuant, Fp8PerTensorScalesOnHandValues) {
  MSA_SEEDED_RNG(rng);
  PagedCase c = single_token_case(rng, {.format = KvFormat::fp8_e4m3});
  c.k_scale.set(0, 0.25f);
  c.v_scale.set(0, 0.5f);
  uint8_t* k = c.k.data<uint8_t>() + slot_row(c, 128);
  uint8_t* v = c.v.data<uint8_t>() + slot_row(c, 128);
  std::fill(k, k + 128, uint8_t(0));
  std::fill(v, v + 128, uint8_t(0));
  k[0] = 0x40;  // 2.0 -> 0.5
  k[5] = 0xB8;  // -1.0 -> -0.25
  const uint8_t v_codes[5] = {0x38, 0x40, 0xB8, 0x01, 0x7E};
  const float v_want[5] = {0.5f, 1.0f, -0.5f, std::ldexp(1.0f, -10), 224.0f};
  std::copy(v_codes, v_codes + 5, v);
  const PagedOutputs o = run_paged(c, 0, DType::f32);
  const auto out = o.out.floats();
  for (int h = 0; h < 16; ++h) {
    for (int d = 0; d < 5; ++d) EXPECT_EQ(out[size_t(h * 128 + d)], v_want[d]) << "head " << h << " dim " << d;
    EXPECT_EQ(out[size_t(h * 128 + 5)], 0.0f);
    EXPECT_NEAR(o.lse.floats()[size_t(h)], 0.25 / std::sqrt(128.0), 1e-7);
  }
}

TEST(InferenceQuant, Fp8PerTokenScalesUsePhysicalSlots) {
  MSA_SEEDED_RNG(rng);
  // Two tokens; the second one's scale lives at column physical_page * 128 + 1.
  PagedCase c = make_prefill_case(rng, kSmall, {1}, {1}, {.format = KvFormat::fp8_e4m3, .per_token_scales = true});
  const int64_t page = c.page_table[0];
  uint8_t* v = c.v.data<uint8_t>() + page * 128 * 128;
  uint8_t* k = c.k.data<uint8_t>() + page * 128 * 128;
  std::fill(k, k + 2 * 128, uint8_t(0));  // equal logits: out = mean of the two V rows
  std::fill(v, v + 2 * 128, uint8_t(0x38));  // code 1.0
  c.v_scale.set(page * 128 + 0, 0.25f);
  c.v_scale.set(page * 128 + 1, 0.75f);
  const PagedOutputs o = run_paged(c, 0, DType::f32);
  const auto out = o.out.floats();
  // The query is at position 1 and sees both tokens.
  for (int h = 0; h < 16; ++h) EXPECT_FLOAT_EQ(out[size_t(h * 128 + 3)], 0.5f);
  EXPECT_NEAR(o.lse.floats()[0], std::log(2.0), 1e-6);
}

TEST(InferenceQuant, Nvfp4DequantisationOnHandValues) {
  MSA_SEEDED_RNG(rng);
  for (bool global : {false, true}) {
    SCOPED_TRACE(global ? "with global scale" : "no global scale");
    PagedCase c = single_token_case(rng, {.format = KvFormat::nvfp4, .global_scale = global});
    uint8_t* k = c.k.data<uint8_t>() + slot_row(c, 64);
    uint8_t* v = c.v.data<uint8_t>() + slot_row(c, 64);
    uint8_t* ksf = c.k_sf.data<uint8_t>() + slot_row(c, 8);
    uint8_t* vsf = c.v_sf.data<uint8_t>() + slot_row(c, 8);
    std::fill(k, k + 64, uint8_t(0));
    std::fill(v, v + 64, uint8_t(0));
    std::fill(ksf, ksf + 8, uint8_t(0x38));
    // Group 0 (scale 1.0): element 0 = 6, element 1 = -6.  Group 1 (scale 448): element 16 = 6*448 -> 448.
    // Group 2 (scale 1.125): element 32 = 1.5*1.125 = 1.6875 -> 1.75.  Group 3 (scale 1.875):
    // element 49 = 3*1.875 = 5.625 -> 5.5.  Group 4 (scale 2^-9): element 64 = 0.5*2^-9 -> 0,
    // element 65 = 1*2^-9.
    const uint8_t scales[8] = {0x38, 0x7E, 0x39, 0x3F, 0x01, 0x38, 0x38, 0x38};
    std::copy(scales, scales + 8, vsf);
    v[0] = 0x7 | (0xF << 4);
    v[8] = 0x7;
    v[16] = 0x3;
    v[24] = 0x5 << 4;
    v[32] = 0x1 | (0x2 << 4);
    k[0] = 0x5;  // K element 0 = 3 (scale 1)
    const float g_v = global ? c.v_scale.at(0) : 1.0f, g_k = global ? c.k_scale.at(0) : 1.0f;
    const PagedOutputs o = run_paged(c, 0, DType::f32);
    const auto out = o.out.floats();
    const std::pair<int, float> want[] = {{0, 6.0f}, {1, -6.0f}, {16, 448.0f}, {32, 1.75f}, {49, 5.5f},
                                          {64, 0.0f}, {65, std::ldexp(1.0f, -9)}, {2, 0.0f}};
    for (int h = 0; h < 16; ++h) {
      for (auto [d, value] : want) EXPECT_EQ(out[size_t(h * 128 + d)], value * g_v) << "head " << h << " dim " << d;
      EXPECT_NEAR(o.lse.floats()[size_t(h)], 3.0 * g_k / std::sqrt(128.0), 1e-6);
    }
  }
}

TEST(InferenceQuant, Nvfp4ToFp8WholeCacheAndSelectedPages) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_prefill_case(rng, kSmall, {300, 20}, {5, 5}, {.format = KvFormat::nvfp4});
  const int64_t P = c.physical_pages;
  const int Hkv = c.topo.num_kv_heads;
  HostTensor whole(DType::f8e4m3, {P, Hkv, 128, 128});
  Nvfp4ToFp8Params p;
  p.packed = c.v.view();
  p.block_scale = c.v_sf.view();
  p.out = whole.view();
  nvfp4_to_fp8(p);
  int64_t mismatches = 0;
  for (int64_t page = 0; page < P; ++page)
    for (int64_t t = 0; t < 128; ++t) {
      const auto want = oracle::cache_row(c.cache(), true, page, 0, t);
      for (int d = 0; d < 128; ++d) {
        const double got = oracle::e4m3_value(whole.data<uint8_t>()[((page * Hkv) * 128 + t) * 128 + d]);
        mismatches += !(got == want[size_t(d)] || (std::isnan(got) && std::isnan(want[size_t(d)])));
      }
    }
  EXPECT_EQ(mismatches, 0);

  // Selected pages into a small workspace; -1 leaves the destination page untouched.
  HostTensor work(DType::f8e4m3, {3, Hkv, 128, 128});
  std::fill(work.data<uint8_t>(), work.data<uint8_t>() + work.numel(), uint8_t(0x55));
  const HostTensor ids = int_tensor({c.page_table[1], -1, c.page_table[0]}, {3});
  p.page_ids = ids.view();
  p.out = work.view();
  nvfp4_to_fp8(p);
  const int64_t page_bytes = int64_t(Hkv) * 128 * 128;
  EXPECT_TRUE(std::equal(work.data<uint8_t>(), work.data<uint8_t>() + page_bytes,
                         whole.data<uint8_t>() + c.page_table[1] * page_bytes));
  EXPECT_TRUE(std::all_of(work.data<uint8_t>() + page_bytes, work.data<uint8_t>() + 2 * page_bytes,
                          [](uint8_t b) { return b == 0x55; }));
  EXPECT_TRUE(std::equal(work.data<uint8_t>() + 2 * page_bytes, work.data<uint8_t>() + 3 * page_bytes,
                         whole.data<uint8_t>() + c.page_table[0] * page_bytes));
}

TEST(InferenceQuant, ConvertedFp8CacheGivesTheSameAttention) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c4 = make_decode_case(rng, kSmall, {2100, 50}, 2, {.format = KvFormat::nvfp4, .global_scale = true});
  PagedCase c8 = c4;
  c8.format = KvFormat::fp8_e4m3;
  c8.k = HostTensor(DType::f8e4m3, {c4.physical_pages, 1, 128, 128});
  c8.v = HostTensor(DType::f8e4m3, {c4.physical_pages, 1, 128, 128});
  for (bool value_side : {false, true}) {
    Nvfp4ToFp8Params p;
    p.packed = (value_side ? c4.v : c4.k).view();
    p.block_scale = (value_side ? c4.v_sf : c4.k_sf).view();
    p.out = (value_side ? c8.v : c8.k).view();
    nvfp4_to_fp8(p);
  }
  const PagedOutputs a = run_paged(c4, 4, DType::f32), b = run_paged(c8, 4, DType::f32);
  EXPECT_EQ(a.out.raw(), b.out.raw());
  EXPECT_EQ(a.lse.raw(), b.lse.raw());
}

struct QuantVariant {
  const char* name;
  CaseOptions options;
};

void PrintTo(const QuantVariant& v, std::ostream* os) { *os << v.name; }

class InferenceQuantOracle : public ::testing::TestWithParam<QuantVariant> {};

TEST_P(InferenceQuantOracle, PrefillAndDecode) {
  MSA_SEEDED_RNG(rng);
  const CaseOptions& o = GetParam().options;
  const PagedCase p = make_prefill_case(rng, kSmall, {0, 129, 2050}, {70, 3, 40}, o);
  const PagedOutputs op = run_paged(p);
  check_paged_selection(p, op.topk);
  check_paged_attention(p, op, paged_sample_rows(p, 10, rng));
  const PagedCase d = make_decode_case(rng, kSmall, {2200, 0, 5}, 5, o);
  const PagedOutputs od = run_paged(d);
  check_paged_selection(d, od.topk);
  check_paged_attention(d, od);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, InferenceQuantOracle,
    ::testing::Values(QuantVariant{"fp8_per_tensor", {.format = KvFormat::fp8_e4m3}},
                      QuantVariant{"fp8_per_token", {.format = KvFormat::fp8_e4m3, .per_token_scales = true}},
                      QuantVariant{"nvfp4", {.format = KvFormat::nvfp4}},
                      QuantVariant{"nvfp4_global", {.format = KvFormat::nvfp4, .global_scale = true}},
                      QuantVariant{"fp8_index", {.index_dtype = DType::f8e4m3}}),
    [](const ::testing::TestParamInfo<QuantVariant>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace msa::test
