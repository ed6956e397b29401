// Pre-processing: Gemma RMSNorm + partial NeoX RoPE on hand-computed values and against the
// oracle, per-request and per-document positions, and cache insertion through a slot mapping
// into bf16 / FP8 / NVFP4 caches and the index-K cache.
#include "inference_support.h"

namespace msa::test {
namespace {

HostTensor filled(DType dt, std::vector<int64_t> shape, float value) {
  HostTensor t(dt, std::move(shape));
  for (int64_t e = 0; e < t.numel(); ++e) t.set(e, value);
  return t;
}

HostTensor run_norm_rope(const HostTensor& x, const HostTensor& w, const std::vector<int32_t>& positions,
                         NormRopeConfig config = {}) {
  HostTensor out(DType::bf16, x.shape());
  poison(out);
  const HostTensor pos = int_tensor(positions, {int64_t(positions.size())});
  RmsNormRopeParams p;
  p.x = x.view();
  p.weight = w.view();
  p.positions = pos.view();
  p.out = out.view();
  p.config = config;
  rms_norm_rope(p);
  return out;
}

TEST(InferencePreprocess, NormRopeHandValues) {
  // x = 1 everywhere, w = 0: the norm gives bf16(1 / sqrt(1 + 1e-6)) = 1.
  const HostTensor ones = filled(DType::bf16, {2, 1, 128}, 1.0f);
  const HostTensor w0 = filled(DType::f32, {128}, 0.0f);
  const HostTensor o = run_norm_rope(ones, w0, {0, 1});
  for (int d = 0; d < 128; ++d) EXPECT_EQ(o.at(d), 1.0f) << "position 0 is the identity, dim " << d;
  // Position 1, j = 0 (inv_freq 1): x1 = x2 = 1 -> cos 1 - sin 1 = -0.30117 -> bf16 -0.30078125,
  // cos 1 + sin 1 = 1.38177 -> bf16 1.3828125.  j = 1 (inv_freq 5e6^(-1/32) = 0.617548):
  // 0.236450 -> 0.236328125, 1.394290 -> 1.390625.  Dims 64..127 are not rotated.
  EXPECT_EQ(o.at(128 + 0), -0.30078125f);
  EXPECT_EQ(o.at(128 + 32), 1.3828125f);
  EXPECT_EQ(o.at(128 + 1), 0.236328125f);
  EXPECT_EQ(o.at(128 + 33), 1.390625f);
  EXPECT_EQ(o.at(128 + 64), 1.0f);
  EXPECT_EQ(o.at(128 + 127), 1.0f);

  // x = [3, 4, 0, ...], w[0] = 0.5: rms = sqrt(25/128 + 1e-6) = 0.4419441;
  // 3 / rms * 1.5 = 10.18232 -> bf16 10.1875;  4 / rms = 9.050967 -> bf16 9.0625.
  HostTensor x = filled(DType::bf16, {1, 1, 128}, 0.0f);
  x.set(0, 3.0f);
  x.set(1, 4.0f);
  HostTensor w = filled(DType::bf16, {128}, 0.0f);
  w.set(0, 0.5f);
  const HostTensor n = run_norm_rope(x, w, {12345}, {.rotary_dim = 0});
  EXPECT_EQ(n.at(0), 10.1875f);
  EXPECT_EQ(n.at(1), 9.0625f);
  EXPECT_EQ(n.at(2), 0.0f);
}

TEST(InferencePreprocess, NormRopeAgainstOracleUpToMillionTokenPositions) {
  MSA_SEEDED_RNG(rng);
  const int64_t T = 64, H = 5;
  const HostTensor x = random_tensor(rng, {T, H, 128}, 1.5f);
  const HostTensor w = random_tensor(rng, {128}, 0.3f);
  std::vector<int32_t> pos(static_cast<size_t>(T), 0);
  std::uniform_int_distribution<int32_t> any(0, 1 << 20);
  for (auto& p : pos) p = any(rng);
  pos[0] = 0;
  pos[1] = 1;
  const HostTensor got = run_norm_rope(x, w, pos);
  const auto xf = x.floats(), wf = w.floats(), g = got.floats();
  std::vector<double> want;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const auto row = oracle::norm_rope(xf.data() + (t * H + h) * 128, wf.data(), pos[size_t(t)]);
      want.insert(want.end(), row.begin(), row.end());
    }
  // One bf16 rounding of the result plus, rarely, a one-ulp different intermediate rounding.
  expect_close("norm_rope", g, want, 1.6e-2, 4e-3, 128);
  expect_rel_l2("norm_rope", g, want, 3e-3);
}

TEST(InferencePreprocess, InPlaceAndStridedRows) {
  MSA_SEEDED_RNG(rng);
  // q [T, 16, 128] as a strided slice of a fused [T, 18, 128] projection output.
  const int64_t T = 9;
  HostTensor fused = random_tensor(rng, {T, 18, 128}, 0.7f);
  const HostTensor w = random_tensor(rng, {128}, 0.2f, DType::f32);
  std::vector<int32_t> pos(static_cast<size_t>(T), 0);
  for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(300 + 7 * t);
  HostTensor q(DType::bf16, {T, 16, 128});
  for (int64_t t = 0; t < T; ++t)
    std::copy(fused.data<uint16_t>() + t * 18 * 128, fused.data<uint16_t>() + t * 18 * 128 + 16 * 128,
              q.data<uint16_t>() + t * 16 * 128);
  const HostTensor want = run_norm_rope(q, w, pos);

  const TensorView slice = TensorView::strided(fused.data<uint16_t>(), DType::bf16, {T, 16, 128}, {18 * 128, 128, 1});
  const HostTensor positions = int_tensor(pos, {T});
  RmsNormRopeParams p;
  p.x = slice;
  p.weight = w.view();
  p.positions = positions.view();
  p.out = slice;  // in place
  rms_norm_rope(p);
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_TRUE(std::equal(want.data<uint16_t>() + t * 16 * 128, want.data<uint16_t>() + (t + 1) * 16 * 128,
                           fused.data<uint16_t>() + t * 18 * 128))
        << "token " << t;
  }
}

TEST(InferencePreprocess, DocumentPositionsRestartPerDocument) {
  EXPECT_EQ(document_positions(layout_of({3, 2, 1})), (std::vector<int32_t>{0, 1, 2, 0, 1, 0}));
  // Chunked layout: 2 new queries at the end of 5 keys.
  EXPECT_EQ(document_positions(layout_of({2}, {5})), (std::vector<int32_t>{3, 4}));
}

// A cache of `pages` pages with Hkv = 1 in the given format, NaN-free zero contents.
PagedKvCache empty_cache(KvFormat f, int64_t pages, std::vector<HostTensor>& store, bool per_token = false,
                         float tensor_scale = 0) {
  const DType dt = f == KvFormat::bf16 ? DType::bf16 : f == KvFormat::fp8_e4m3 ? DType::f8e4m3 : DType::u8;
  const int64_t width = f == KvFormat::nvfp4 ? 64 : 128;
  store.clear();
  store.reserve(6);
  store.emplace_back(dt, std::vector<int64_t>{pages, 1, 128, width});
  store.emplace_back(dt, std::vector<int64_t>{pages, 1, 128, width});
  PagedKvCache c;
  c.format = f;
  c.k = store[0].view();
  c.v = store[1].view();
  if (f == KvFormat::nvfp4) {
    store.emplace_back(DType::f8e4m3, std::vector<int64_t>{pages, 1, 128, 8});
    store.emplace_back(DType::f8e4m3, std::vector<int64_t>{pages, 1, 128, 8});
    c.k_block_scale = store[2].view();
    c.v_block_scale = store[3].view();
  }
  if (per_token || tensor_scale > 0) {
    const std::vector<int64_t> shape = per_token ? std::vector<int64_t>{1, pages * 128} : std::vector<int64_t>{1};
    store.emplace_back(DType::f32, shape);
    store.emplace_back(DType::f32, shape);
    HostTensor& ks = store[store.size() - 2];
    HostTensor& vs = store.back();
    if (!per_token) {
      ks.set(0, tensor_scale);
      vs.set(0, tensor_scale);
    }
    c.k_scale = ks.view();
    c.v_scale = vs.view();
  }
  return c;
}

void insert(const HostTensor& k, const HostTensor& v, const std::vector<int32_t>& slots, const PagedKvCache& cache,
            const HostTensor* index_k = nullptr, const HostTensor* index_cache = nullptr) {
  const HostTensor s = int_tensor(slots, {int64_t(slots.size())});
  KvInsertParams p;
  p.k = k.view();
  p.v = v.view();
  p.slot_mapping = s.view();
  p.cache = cache;
  if (index_k) {
    p.index_k = index_k->view();
    p.index_k_cache = index_cache->view();
  }
  insert_kv(p);
}

TEST(InferencePreprocess, InsertBf16AndIndexKThroughSlotMapping) {
  MSA_SEEDED_RNG(rng);
  std::vector<HostTensor> store;
  const PagedKvCache cache = empty_cache(KvFormat::bf16, 3, store);
  HostTensor index_bf16(DType::bf16, {3, 128, 128}), index_fp8(DType::f8e4m3, {3, 128, 128});
  const HostTensor k = random_tensor(rng, {4, 1, 128}), v = random_tensor(rng, {4, 1, 128}),
                   ik = random_tensor(rng, {4, 1, 128});
  const std::vector<int32_t> slots = {2 * 128 + 5, -1, 0, 1 * 128 + 127};
  insert(k, v, slots, cache, &ik, &index_bf16);
  insert(k, v, slots, cache, &ik, &index_fp8);
  for (int t = 0; t < 4; ++t) {
    if (slots[size_t(t)] < 0) continue;
    const int64_t s = slots[size_t(t)];
    EXPECT_TRUE(std::equal(k.data<uint16_t>() + t * 128, k.data<uint16_t>() + (t + 1) * 128, store[0].data<uint16_t>() + s * 128));
    EXPECT_TRUE(std::equal(v.data<uint16_t>() + t * 128, v.data<uint16_t>() + (t + 1) * 128, store[1].data<uint16_t>() + s * 128));
    EXPECT_TRUE(std::equal(ik.data<uint16_t>() + t * 128, ik.data<uint16_t>() + (t + 1) * 128, index_bf16.data<uint16_t>() + s * 128));
    for (int d = 0; d < 128; ++d) EXPECT_EQ(index_fp8.data<uint8_t>()[s * 128 + d], float_to_e4m3(ik.at(t * 128 + d)));
  }
  // Only the three mapped slots were written.
  int64_t nonzero_rows = 0;
  for (int64_t s = 0; s < 3 * 128; ++s)
    nonzero_rows += std::any_of(store[0].data<uint16_t>() + s * 128, store[0].data<uint16_t>() + (s + 1) * 128,
                                [](uint16_t b) { return b != 0; });
  EXPECT_EQ(nonzero_rows, 3);
}

TEST(InferencePreprocess, InsertWithNormEqualsNormThenInsert) {
  MSA_SEEDED_RNG(rng);
  const int64_t T = 6;
  const HostTensor k = random_tensor(rng, {T, 1, 128}, 2.0f), v = random_tensor(rng, {T, 1, 128}),
                   ik = random_tensor(rng, {T, 1, 128}, 3.0f);
  const HostTensor kw = random_tensor(rng, {128}, 0.2f), ikw = random_tensor(rng, {128}, 0.2f);
  const std::vector<int32_t> pos = {0, 1, 127, 128, 4000, 70000}, slots = {7, 300, 129, 0, 255, 42};
  std::vector<HostTensor> a_store, b_store;
  const PagedKvCache a = empty_cache(KvFormat::bf16, 3, a_store), b = empty_cache(KvFormat::bf16, 3, b_store);
  HostTensor a_index(DType::bf16, {3, 128, 128}), b_index(DType::bf16, {3, 128, 128});

  const HostTensor positions = int_tensor(pos, {T}), s = int_tensor(slots, {T});
  KvInsertParams p;
  p.k = k.view();
  p.v = v.view();
  p.index_k = ik.view();
  p.slot_mapping = s.view();
  p.cache = a;
  p.index_k_cache = a_index.view();
  p.k_norm = kw.view();
  p.index_k_norm = ikw.view();
  p.positions = positions.view();
  insert_kv(p);

  const HostTensor kn = run_norm_rope(k, kw, pos), ikn = run_norm_rope(ik, ikw, pos);
  insert(kn, v, slots, b, &ikn, &b_index);
  EXPECT_EQ(a_store[0].raw(), b_store[0].raw());
  EXPECT_EQ(a_store[1].raw(), b_store[1].raw());
  EXPECT_EQ(a_index.raw(), b_index.raw());
}

TEST(InferencePreprocess, InsertFp8HandValues) {
  std::vector<HostTensor> store;
  const PagedKvCache cache = empty_cache(KvFormat::fp8_e4m3, 1, store, false, 0.5f);
  HostTensor k = filled(DType::bf16, {1, 1, 128}, 0.0f), v = filled(DType::bf16, {1, 1, 128}, 0.0f);
  k.set(0, 1.0f);      // 1 / 0.5 = 2 -> 0x40
  k.set(1, -0.75f);    // -1.5 -> 0xBC
  k.set(2, 1000.0f);   // 2000 saturates -> 448 = 0x7E
  v.set(0, 0.0078125f);  // 2^-7 / 0.5 = 2^-6 -> 0x08 (smallest normal)
  insert(k, v, {5}, cache);
  const uint8_t* kc = store[0].data<uint8_t>() + 5 * 128;
  EXPECT_EQ(kc[0], 0x40);
  EXPECT_EQ(kc[1], 0xBC);
  EXPECT_EQ(kc[2], 0x7E);
  EXPECT_EQ(kc[3], 0x00);
  EXPECT_EQ(store[1].data<uint8_t>()[5 * 128], 0x08);
}

TEST(InferencePreprocess, InsertFp8PerTokenScales) {
  MSA_SEEDED_RNG(rng);
  std::vector<HostTensor> store;
  const PagedKvCache cache = empty_cache(KvFormat::fp8_e4m3, 2, store, true);
  HostTensor k = random_tensor(rng, {2, 1, 128}, 0.3f), v = random_tensor(rng, {2, 1, 128}, 5.0f);
  for (int d = 0; d < 128; ++d) k.set(128 + d, 0.0f);  // an all-zero row gets scale 1
  insert(k, v, {130, 7}, cache);
  const HostTensor& ks = store[2];
  const HostTensor& vs = store[3];
  float amax = 0;
  for (int d = 0; d < 128; ++d) amax = std::max(amax, std::fabs(k.at(d)));
  EXPECT_FLOAT_EQ(ks.at(130), amax / 448.0f);
  EXPECT_EQ(ks.at(7), 1.0f);
  // The largest element becomes +-448; every element dequantises within E4M3 precision.
  for (int t = 0; t < 2; ++t) {
    const int64_t slot = t == 0 ? 130 : 7;
    const float scale = vs.at(slot);
    float max_code = 0;
    for (int d = 0; d < 128; ++d) {
      const float x = v.at(t * 128 + d), back = e4m3_to_float(store[1].data<uint8_t>()[slot * 128 + d]) * scale;
      max_code = std::max(max_code, std::fabs(e4m3_to_float(store[1].data<uint8_t>()[slot * 128 + d])));
      EXPECT_NEAR(back, x, std::fabs(x) / 16 + scale * std::ldexp(1.0f, -9)) << "token " << t << " dim " << d;
    }
    EXPECT_EQ(max_code, 448.0f);
  }
}

TEST(InferencePreprocess, InsertNvfp4HandValues) {
  for (float global : {0.0f, 2.0f}) {
    SCOPED_TRACE(global > 0 ? "global scale 2" : "no global scale");
    std::vector<HostTensor> store;
    const PagedKvCache cache = empty_cache(KvFormat::nvfp4, 1, store, false, global);
    const float g = global > 0 ? global : 1.0f;
    HostTensor k = filled(DType::bf16, {1, 1, 128}, 0.0f), v = filled(DType::bf16, {1, 1, 128}, 0.0f);
    // Group 0: exact E2M1 values with max 6 -> block scale 1 (0x38), codes exact.
    const float exact[8] = {6, -3, 0.5f, 1.5f, 0, 2, 4, -1};
    const uint8_t codes[8] = {0x7, 0xD, 0x1, 0x3, 0x0, 0x4, 0x6, 0xA};
    for (int i = 0; i < 8; ++i) k.set(i, exact[i] * g);
    // Group 1: max 6 again, then 0.74 -> 0.5 (nearest) and 0.75 -> 1.0 (tie to the even code).
    k.set(16, 6 * g);
    k.set(17, 0.74f * g);
    k.set(18, 0.75f * g);
    // Group 2: max 12 -> block scale 2 (0x40); 5 / 2 = 2.5 is a tie between 2 and 3 -> 2 (even code 4).
    k.set(32, 12 * g);
    k.set(33, 5 * g);
    insert(k, v, {9}, cache);
    const uint8_t* kc = store[0].data<uint8_t>() + 9 * 64;
    const uint8_t* sf = store[2].data<uint8_t>() + 9 * 8;
    EXPECT_EQ(sf[0], 0x38);
    for (int i = 0; i < 8; i += 2) EXPECT_EQ(kc[i / 2], codes[i] | (codes[i + 1] << 4)) << "elements " << i << ", " << i + 1;
    EXPECT_EQ(sf[1], 0x38);
    EXPECT_EQ(kc[8], 0x7 | (0x1 << 4));
    EXPECT_EQ(kc[9] & 0xf, 0x2);
    EXPECT_EQ(sf[2], 0x40);
    EXPECT_EQ(kc[16], 0x7 | (0x4 << 4));
    EXPECT_EQ(sf[7], 0x00);  // an all-zero group: scale 0, codes 0
    EXPECT_EQ(kc[63], 0x00);
  }
}

}  // namespace
}  // namespace msa::test
