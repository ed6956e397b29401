// The inference operations on the GPU against the CPU backend on the same inputs: norm + RoPE,
// cache insertion in every format, NVFP4 -> FP8, the paged indexer (equal selections, or
// near-ties checked against the float64 oracle), paged prefill / decode attention over every
// cache format (relative L2 and LSE within docs/semantics.md §10), strided cache views, CUDA-graph capture
// and replay of a decode step, the automatic split count on the device, and bitwise repeatability.
#include "../src/core/decode_splits.h"
#include "inference_support.h"
#include "test_gpu_support.h"

#if MSA_WITH_CUDA
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>
#include <utility>
#include <cuda_runtime.h>
#endif

namespace msa::test {
namespace {

const Topology kSmall = Topology::minimax_m3(4);  // Hq 16, Hkv 1, Hi 1

InferencePlan gpu_plan(const PagedCase& c, int splits = 0, void* stream = nullptr) {
  const HostTensor sl = int_tensor(c.seq_lens, {int64_t(c.seq_lens.size())});
  const HostTensor pt = int_tensor(c.page_table, {int64_t(c.seq_lens.size()), c.max_pages});
  InferencePlanOptions o;
  o.num_kv_splits = splits;
  o.device = kGpu;
  o.stream = stream;
  if (c.phase == InferencePhase::decode) {
    DecodeMetadata m;
    m.seq_lens = sl.view();
    m.page_table = pt.view();
    m.q_len_per_req = c.q_len_per_req;
    return plan_decode(c.topo, m, o);
  }
  const HostTensor cu = int_tensor(c.cu_seqlens_q, {int64_t(c.cu_seqlens_q.size())});
  PagedPrefillMetadata m;
  m.cu_seqlens_q = cu.view();
  m.seq_lens = sl.view();
  m.page_table = pt.view();
  return plan_paged_prefill(c.topo, m, o);
}

// Device copies of a case's caches and inputs.
struct DeviceCase {
  DeviceTensor k, v, k_sf, v_sf, k_scale, v_scale, index_k_cache, q, index_q;
  KvFormat format = KvFormat::bf16;
  explicit DeviceCase(const PagedCase& c)
      : k(c.k), v(c.v), index_k_cache(c.index_k_cache), q(c.q), index_q(c.index_q), format(c.format) {
    if (c.format == KvFormat::nvfp4) {
      k_sf = DeviceTensor(c.k_sf);
      v_sf = DeviceTensor(c.v_sf);
    }
    if (c.k_scale.numel()) {
      k_scale = DeviceTensor(c.k_scale);
      v_scale = DeviceTensor(c.v_scale);
    }
  }
  PagedKvCache cache() const {
    PagedKvCache kv;
    kv.format = format;
    kv.k = k.view();
    kv.v = v.view();
    if (format == KvFormat::nvfp4) {
      kv.k_block_scale = k_sf.view();
      kv.v_block_scale = v_sf.view();
    }
    if (k_scale.view().data) {
      kv.k_scale = k_scale.view();
      kv.v_scale = v_scale.view();
    }
    return kv;
  }
};

struct GpuOutputs {
  DeviceTensor topk, out, lse;
  GpuOutputs(const PagedCase& c, DType out_dtype)
      : topk(DType::i32, {c.topo.num_index_heads, c.total_q(), 16}),
        out(out_dtype, {c.total_q(), c.topo.num_q_heads, 128}),
        lse(DType::f32, {c.total_q(), c.topo.num_q_heads}) {
    topk.poison();
    out.poison();
    lse.poison();
  }
  PagedOutputs host() const { return {topk.host(), out.host(), lse.host()}; }
};

// paged_forward's parameters for a device case writing into `o`.
std::pair<PagedIndexerParams, PagedAttentionParams> paged_forward_params(const DeviceCase& d, const GpuOutputs& o) {
  PagedIndexerParams ip;
  ip.index_q = d.index_q.view();
  ip.index_k_cache = d.index_k_cache.view();
  ip.topk = o.topk.view();
  PagedAttentionParams ap;
  ap.q = d.q.view();
  ap.kv = d.cache();
  ap.out = o.out.view();
  ap.lse = o.lse.view();
  return {ip, ap};
}

// GPU indexer + attention (paged_forward) into `o`.
void gpu_paged_forward(const InferencePlan& plan, const DeviceCase& d, GpuOutputs& o, const RunOptions& opt = {}) {
  const auto [ip, ap] = paged_forward_params(d, o);
  paged_forward(plan, ip, ap, opt);
}

// GPU indexer only.
HostTensor gpu_indexer(const PagedCase& c, const DeviceCase& d, const InferencePlan& plan) {
  DeviceTensor topk(DType::i32, {c.topo.num_index_heads, c.total_q(), 16});
  topk.poison();
  PagedIndexerParams p;
  p.index_q = d.index_q.view();
  p.index_k_cache = d.index_k_cache.view();
  p.topk = topk.view();
  paged_indexer(plan, p);
  return topk.host();
}

// GPU attention with a given (host) selection.
PagedOutputs gpu_attention(const PagedCase& c, const DeviceCase& d, const InferencePlan& plan, const HostTensor& topk,
                           DType out_dtype, const PagedKvCache* cache = nullptr) {
  GpuOutputs o(c, out_dtype);
  o.topk.upload(topk);
  PagedAttentionParams p;
  p.q = d.q.view();
  p.kv = cache ? *cache : d.cache();
  p.topk = o.topk.view();
  p.out = o.out.view();
  p.lse = o.lse.view();
  paged_attention(plan, p);
  return o.host();
}

// CPU attention with a given selection.
PagedOutputs cpu_attention(const PagedCase& c, const HostTensor& topk, int splits, DType out_dtype) {
  const InferencePlan plan = c.plan(splits);
  PagedOutputs o = make_outputs(c, out_dtype);
  PagedAttentionParams p = attention_params(c, o);
  p.topk = topk.view();
  paged_attention(plan, p);
  return o;
}

HostTensor cpu_indexer(const PagedCase& c) {
  const InferencePlan plan = c.plan();
  PagedOutputs o = make_outputs(c);
  paged_indexer(plan, indexer_params(c, o));
  return o.topk;
}

// Rows of topk [Hi, T, 16] that differ; near-ties are then judged by check_paged_selection.
int64_t rows_differing(const HostTensor& a, const HostTensor& b) {
  const auto x = a.ints(), y = b.ints();
  int64_t n = 0;
  for (size_t r = 0; r < x.size() / 16; ++r)
    n += !std::equal(x.begin() + long(r * 16), x.begin() + long(r * 16 + 16), y.begin() + long(r * 16));
  return n;
}

void expect_selection_matches_cpu(const PagedCase& c, const HostTensor& gpu, const HostTensor& cpu) {
  for (int32_t id : gpu.ints()) ASSERT_NE(id, kIntPoison) << "topk element not written";
  const int64_t differing = rows_differing(gpu, cpu);
  ::testing::Test::RecordProperty("topk_rows_differing", std::to_string(differing));
  if (differing > 0) check_paged_selection(c, gpu);  // differences must be near-ties
  EXPECT_LE(differing, std::max<int64_t>(2, c.total_q() * c.topo.num_index_heads / 100))
      << "too many selection rows differ from the CPU";
}

// GPU attention outputs against the CPU backend's: relative L2 (docs/semantics.md §10: 1e-2), LSE within
// 1e-3, rows without keys exactly 0 / -inf, nothing unwritten.
void expect_attention_matches_cpu(const PagedOutputs& gpu, const PagedOutputs& cpu, double l2 = 1e-2) {
  const auto go = gpu.out.floats(), co = cpu.out.floats(), gl = gpu.lse.floats(), cl = cpu.lse.floats();
  ASSERT_EQ(count_nan(go), 0) << "GPU out holds NaN (unwritten element or a dead cache slot was read)";
  ASSERT_EQ(count_nan(gl), 0) << "GPU lse holds NaN";
  std::vector<float> og, lg;
  std::vector<double> ow, lw;
  int64_t empty_mismatch = 0;
  for (size_t rh = 0; rh < cl.size(); ++rh) {
    if (std::isinf(cl[rh])) {
      bool zero = std::isinf(gl[rh]) && gl[rh] < 0;
      for (int d = 0; d < 128; ++d) zero &= go[rh * 128 + size_t(d)] == 0.0f;
      empty_mismatch += !zero;
      continue;
    }
    lg.push_back(gl[rh]);
    lw.push_back(cl[rh]);
    for (int d = 0; d < 128; ++d) {
      og.push_back(go[rh * 128 + size_t(d)]);
      ow.push_back(co[rh * 128 + size_t(d)]);
    }
  }
  EXPECT_EQ(empty_mismatch, 0) << "(row, head) pairs without keys must give out 0 and lse -inf";
  if (!ow.empty()) {
    expect_rel_l2("out", og, ow, l2);
    expect_close("lse", lg, lw, 1e-3, 1e-3);
  }
}

CaseOptions format_options(const std::string& name) {
  CaseOptions o;
  if (name == "fp8") o.format = KvFormat::fp8_e4m3;
  if (name == "fp8_token") {
    o.format = KvFormat::fp8_e4m3;
    o.per_token_scales = true;
  }
  if (name == "nvfp4") o.format = KvFormat::nvfp4;
  if (name == "nvfp4_global") {
    o.format = KvFormat::nvfp4;
    o.global_scale = true;
  }
  return o;
}

const char* kFormats[] = {"bf16", "fp8", "fp8_token", "nvfp4", "nvfp4_global"};

// ---------------------------------------------------------------------------------------

// Elements of two bf16 tensors of 128-element rows that differ, and whether every difference
// is at most one bf16 step at the row's scale: the rotation y1 c - y2 s cancels, so where it
// lands near zero a one-ulp difference in sin / cos, in the norm's sum or from a contracted
// multiply-add can flip the sign of a value far below the row's other values (many bf16
// steps of that value, but one step of the row).
void expect_bf16_within_one_step(const HostTensor& got, const HostTensor& want, double max_fraction) {
  const auto* g = got.data<uint16_t>();
  const auto* w = want.data<uint16_t>();
  auto step = [](float x) { return std::ldexp(1.0f, std::ilogb(std::max(std::fabs(x), 1e-30f)) - 7); };
  int64_t differ = 0, far = 0;
  for (int64_t row = 0; row < got.numel() / 128; ++row) {
    float scale = 0.f;
    for (int i = 0; i < 128; ++i) scale = std::max(scale, std::fabs(bf16_to_float(w[row * 128 + i])));
    for (int i = 0; i < 128; ++i) {
      const int64_t e = row * 128 + i;
      if (g[e] == w[e]) continue;
      ++differ;
      const float gv = bf16_to_float(g[e]), wv = bf16_to_float(w[e]);
      if (std::fabs(gv - wv) > std::max(step(wv), step(scale))) ++far;
    }
  }
  EXPECT_EQ(far, 0) << far << " elements differ by more than one bf16 step (of the value or of its row's largest)";
  EXPECT_LE(double(differ), max_fraction * double(got.numel()))
      << differ << " of " << got.numel() << " elements differ by one bf16 step (sum-of-squares order, sin/cos)";
}

TEST(GpuInference, NormRopeMatchesCpu) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const int64_t T = 37, H = 5;
  std::vector<int32_t> pos(T);
  std::uniform_int_distribution<int32_t> pick(0, 1 << 20);
  for (auto& p : pos) p = pick(rng);
  const HostTensor positions = int_tensor(pos, {T});
  for (DType wdt : {DType::bf16, DType::f32})
    for (int rotary : {0, 64, 128}) {
      SCOPED_TRACE("rotary_dim " + std::to_string(rotary) + (wdt == DType::f32 ? " f32 weight" : " bf16 weight"));
      const HostTensor x = random_tensor(rng, {T, H, 128}, 1.5f);
      const HostTensor w = random_tensor(rng, {128}, 0.3f, wdt);
      RmsNormRopeParams p;
      p.config.rotary_dim = rotary;
      HostTensor want(DType::bf16, {T, H, 128});
      p.x = x.view();
      p.weight = w.view();
      p.positions = positions.view();
      p.out = want.view();
      rms_norm_rope(p);
      DeviceTensor dx(x), dw(w), dpos(positions), dout(DType::bf16, {T, H, 128});
      dout.poison();
      p.x = dx.view();
      p.weight = dw.view();
      p.positions = dpos.view();
      p.out = dout.view();
      rms_norm_rope(p);
      expect_bf16_within_one_step(dout.host(), want, 0.02);
      p.out = dx.view();  // in place
      rms_norm_rope(p);
      EXPECT_TRUE(bitwise_equal(dx.host(), dout.host())) << "in-place result differs from the out-of-place one";
    }
}

// insert_kv on both backends from the same initial caches; codes compared byte by byte.
void check_insert(const std::string& format, DType index_dtype, bool norm) {
  SCOPED_TRACE("format " + format + (index_dtype == DType::f8e4m3 ? " fp8 index" : " bf16 index") + (norm ? " norm" : ""));
  MSA_SEEDED_RNG(rng);
  CaseOptions o = format_options(format);
  o.index_dtype = index_dtype;
  PagedCase c = make_decode_case(rng, kSmall, {300, 130}, 1, o);
  const int64_t P = c.physical_pages, T = 50;
  // Token t goes to a random distinct slot; every 7th token is skipped (-1).
  std::vector<int32_t> slots(size_t(P * 128));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(T);
  for (int64_t t = 0; t < T; t += 7) slots[size_t(t)] = -1;
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(t * 977);
  const HostTensor slot_t = int_tensor(slots, {T}), pos_t = int_tensor(pos, {T});
  const HostTensor k = random_tensor(rng, {T, 1, 128}, 2.0f), v = random_tensor(rng, {T, 1, 128}, 0.7f),
                   ik = random_tensor(rng, {T, 1, 128}, 0.5f);
  const HostTensor kn = random_tensor(rng, {128}, 0.2f), ikn = random_tensor(rng, {128}, 0.2f, DType::f32);

  DeviceCase d(c);
  // The same call twice: host tensors into the CPU case, device copies into the GPU case.
  auto params = [&](const TensorView& kk, const TensorView& vv, const TensorView& ikk, const TensorView& slot,
                    const PagedKvCache& cache, const TensorView& ik_cache, const TensorView& pos, const TensorView& knw,
                    const TensorView& iknw) {
    KvInsertParams p;
    p.k = kk;
    p.v = vv;
    p.index_k = ikk;
    p.slot_mapping = slot;
    p.cache = cache;
    p.index_k_cache = ik_cache;
    p.positions = pos;
    if (norm) {
      p.k_norm = knw;
      p.index_k_norm = iknw;
    }
    return p;
  };
  insert_kv(params(k.view(), v.view(), ik.view(), slot_t.view(), c.cache(), c.index_k_cache.view(), pos_t.view(),
                   kn.view(), ikn.view()));
  DeviceTensor dk(k), dv(v), dik(ik), dslot(slot_t), dpos(pos_t), dkn(kn), dikn(ikn);
  insert_kv(params(dk.view(), dv.view(), dik.view(), dslot.view(), d.cache(), d.index_k_cache.view(), dpos.view(),
                   dkn.view(), dikn.view()));

  // Byte comparison of every cache tensor; with norm + RoPE a few rows may differ where the
  // normalised bf16 value differs by one step (reduction order, sin / cos).
  const auto compare = [&](const char* name, const HostTensor& got, const HostTensor& want) {
    const std::vector<unsigned char> g = got.raw(), w = want.raw();
    ASSERT_EQ(g.size(), w.size());
    int64_t differ = 0, first = -1;
    for (size_t i = 0; i < g.size(); ++i)
      if (g[i] != w[i]) {
        ++differ;
        if (first < 0) first = int64_t(i);
      }
    if (!norm) {
      EXPECT_EQ(differ, 0) << name << ": " << differ << " bytes differ, first at byte " << first;
    } else {
      EXPECT_LE(double(differ), 0.02 * double(T * 128 * 2)) << name << ": " << differ << " bytes differ";
    }
  };
  compare("k cache", d.k.host(), c.k);
  compare("v cache", d.v.host(), c.v);
  compare("index-k cache", d.index_k_cache.host(), c.index_k_cache);
  if (c.format == KvFormat::nvfp4) {
    compare("k block scales", d.k_sf.host(), c.k_sf);
    compare("v block scales", d.v_sf.host(), c.v_sf);
  }
  if (c.k_scale.numel()) {
    compare("k scales", d.k_scale.host(), c.k_scale);
    compare("v scales", d.v_scale.host(), c.v_scale);
  }
}

TEST(GpuInference, InsertKvMatchesCpuBitwise) {
  MSA_REQUIRE_GPU();
  for (const char* f : kFormats)
    for (DType idt : {DType::bf16, DType::f8e4m3}) check_insert(f, idt, false);
}

TEST(GpuInference, InsertKvWithNormRopeMatchesCpu) {
  MSA_REQUIRE_GPU();
  for (const char* f : kFormats) check_insert(f, DType::bf16, true);
  check_insert("fp8", DType::f8e4m3, true);
}

TEST(GpuInference, Nvfp4ToFp8Bitwise) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  PagedCase c = make_decode_case(rng, Topology::minimax_m3(2), {700, 200}, 1, format_options("nvfp4"));
  const int64_t P = c.physical_pages, Hkv = 2;
  DeviceTensor packed(c.k), sf(c.k_sf);
  // Whole cache.
  HostTensor want(DType::f8e4m3, {P, Hkv, 128, 128});
  std::fill(want.data<uint8_t>(), want.data<uint8_t>() + want.numel(), uint8_t(0x55));
  DeviceTensor got(want);
  Nvfp4ToFp8Params p;
  p.packed = c.k.view();
  p.block_scale = c.k_sf.view();
  p.out = want.view();
  nvfp4_to_fp8(p);
  p.packed = packed.view();
  p.block_scale = sf.view();
  p.out = got.view();
  nvfp4_to_fp8(p);
  EXPECT_TRUE(bitwise_equal(got.host(), want)) << "whole-cache conversion differs from the CPU";
  // Selected pages, -1 skipped, ids on the host and on the device.
  std::vector<int32_t> ids = {int32_t(P - 1), -1, 0, 3, -1, 2};
  const HostTensor id_t = int_tensor(ids, {int64_t(ids.size())});
  HostTensor want2(DType::f8e4m3, {int64_t(ids.size()), Hkv, 128, 128});
  std::fill(want2.data<uint8_t>(), want2.data<uint8_t>() + want2.numel(), uint8_t(0x33));
  DeviceTensor got_host_ids(want2), got_dev_ids(want2), did(id_t);
  p.packed = c.k.view();
  p.block_scale = c.k_sf.view();
  p.page_ids = id_t.view();
  p.out = want2.view();
  nvfp4_to_fp8(p);
  p.packed = packed.view();
  p.block_scale = sf.view();
  p.out = got_host_ids.view();
  nvfp4_to_fp8(p);
  p.page_ids = did.view();
  p.out = got_dev_ids.view();
  nvfp4_to_fp8(p);
  EXPECT_TRUE(bitwise_equal(got_host_ids.host(), want2)) << "page_ids (host) conversion differs from the CPU";
  EXPECT_TRUE(bitwise_equal(got_dev_ids.host(), want2)) << "page_ids (device) conversion differs from the CPU";
}

TEST(GpuInference, IndexerMatchesCpu) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (DType idt : {DType::bf16, DType::f8e4m3}) {
    CaseOptions o;
    o.index_dtype = idt;
    SCOPED_TRACE(idt == DType::f8e4m3 ? "fp8 index" : "bf16 index");
    for (int Q : {1, 3, 8, 16}) {
      SCOPED_TRACE("decode Q " + std::to_string(Q));
      // 4300 / 4400 tokens: 32 and 33 history pages around the last row, the two sides of the
      // selection's one-page-a-lane path.
      const PagedCase c = make_decode_case(rng, Topology::minimax_m3(), {5000, 0, 2100, 16, 130, 9000, 4300, 4400}, Q, o);
      DeviceCase d(c);
      expect_selection_matches_cpu(c, gpu_indexer(c, d, gpu_plan(c)), cpu_indexer(c));
    }
    const PagedCase c = make_prefill_case(rng, Topology::minimax_m3(2), {2500, 0, 100}, {300, 2100, 45}, o);
    DeviceCase d(c);
    SCOPED_TRACE("prefill");
    expect_selection_matches_cpu(c, gpu_indexer(c, d, gpu_plan(c)), cpu_indexer(c));
  }
  // Other init / local settings.
  Topology t = kSmall;
  t.init_blocks = 2;
  t.local_blocks = 3;
  const PagedCase c = make_decode_case(rng, t, {4000, 2300, 20}, 4);
  DeviceCase d(c);
  SCOPED_TRACE("init 2, local 3");
  expect_selection_matches_cpu(c, gpu_indexer(c, d, gpu_plan(c)), cpu_indexer(c));
}

// Runs of many pages per CTA: 12 requests of 24k tokens leave each of the decode score
// kernel's CTAs 17 pages, almost three laps of its 6-stage ring (the step's small cases above
// stay within one lap).
TEST(GpuInference, IndexerLongRunsMatchCpu) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_decode_case(rng, kSmall, std::vector<int32_t>(12, 24000), 1);
  DeviceCase d(c);
  expect_selection_matches_cpu(c, gpu_indexer(c, d, gpu_plan(c)), cpu_indexer(c));
}

// Prefill runs of many pages per CTA: 1,300 queries over a 9k prefix (64-row tiles of four
// index heads, ~13 pages a CTA) lap the 4-stage page ring of the prefill score kernel three
// times (and, for an FP8 index-K cache, its 2-stage ring of raw pages six times), and a
// 40-query request shares the last tile with it (two segments in one CTA). Index formats:
// bf16, FP8, and FP8 index-K with bf16 index-q (the same values widened).
TEST(GpuInference, IndexerPrefillLongRunsMatchCpu) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const char* name : {"bf16", "fp8", "fp8 index-K, bf16 index-q"}) {
    SCOPED_TRACE(name);
    CaseOptions o;
    o.index_dtype = std::string(name) == "bf16" ? DType::bf16 : DType::f8e4m3;
    PagedCase c = make_prefill_case(rng, Topology::minimax_m3(), {9000, 3000}, {1300, 40}, o);
    if (std::string(name).find("bf16 index-q") != std::string::npos) {
      HostTensor q(DType::bf16, c.index_q.shape());
      for (int64_t e = 0; e < q.numel(); ++e)
        q.data<uint16_t>()[e] = float_to_bf16(e4m3_to_float(c.index_q.data<uint8_t>()[e]));
      c.index_q = std::move(q);
    }
    DeviceCase d(c);
    expect_selection_matches_cpu(c, gpu_indexer(c, d, gpu_plan(c)), cpu_indexer(c));
  }
}

// The selection keeps the pages ranking at or above a threshold (the `slots`-th best of its 32
// lanes' own bests) and ranks only those. Request 0 is built so that the best pages crowd into a
// few lanes (index-q = e0, a page's index keys = f(page) e0, every page whose id is 0..11 mod 32
// above all others): ~400 pages pass the threshold, more than a warp keeps, and the selection
// takes its exact lists instead. Request 1 (random values) takes the threshold with 256 + 1 ..
// 256 + 4 history pages a row (prefill), a last round of loads that only some lanes fill.
// Request 0's scores are exact (one nonzero product each): its rows must equal the CPU's. The
// decode case (4 rows a request) takes the same paths over the decode score kernel's pages.
TEST(GpuInference, IndexerSelectionWhenTheBestPagesShareLanes) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  CaseOptions o;
  o.index_dtype = DType::bf16;
  for (const bool decode : {false, true}) {
    SCOPED_TRACE(decode ? "decode, Q 4" : "prefill");
    PagedCase c = decode ? make_decode_case(rng, Topology::minimax_m3(4), {140000, 33000 + 260}, 4, o)
                         : make_prefill_case(rng, Topology::minimax_m3(4), {140000, 33000}, {40, 400}, o);
    const int64_t hi = c.topo.num_index_heads;
    for (int64_t row = c.cu_seqlens_q[0]; row < c.cu_seqlens_q[1]; ++row)
      for (int64_t e = row * hi * 128; e < (row + 1) * hi * 128; ++e) c.index_q.set(e, e % 128 == 0 ? 1.f : 0.f);
    for (int64_t p = 0; p * 128 < c.seq_lens[0]; ++p) {
      const int64_t page = c.page_table[size_t(p)];
      const float f = p % 32 < 12 ? float(2048 + p) : float(p % 251);  // stored in bf16, as both backends read it
      for (int64_t e = page * 128 * 128; e < (page + 1) * 128 * 128; ++e)
        c.index_k_cache.set(e, e % 128 == 0 ? f : 0.f);
    }
    DeviceCase d(c);
    const HostTensor gpu = gpu_indexer(c, d, gpu_plan(c)), cpu = cpu_indexer(c);
    expect_selection_matches_cpu(c, gpu, cpu);
    const std::vector<int32_t> g = gpu.ints(), w = cpu.ints();
    for (int64_t r = c.cu_seqlens_q[0]; r < c.cu_seqlens_q[1]; ++r)
      EXPECT_TRUE(std::equal(g.begin() + r * 16, g.begin() + r * 16 + 16, w.begin() + r * 16)) << "request 0, row " << r;
  }
}

TEST(GpuInference, DecodeAttentionMatchesCpuEveryFormat) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  // Q = 9: two tiles of 5 rows a request, so a tile holds rows of two requests.
  for (const char* f : kFormats)
    for (int Q : {1, 2, 4, 8, 9, 16}) {
      SCOPED_TRACE(std::string("format ") + f + ", Q " + std::to_string(Q));
      const PagedCase c = make_decode_case(rng, Topology::minimax_m3(2), {2400, 0, 16, 300, 129}, Q, format_options(f));
      const HostTensor topk = cpu_indexer(c);
      DeviceCase d(c);
      for (int splits : {1, 4, 16}) {
        SCOPED_TRACE("splits " + std::to_string(splits));
        const DType out_dtype = splits == 4 ? DType::f32 : DType::bf16;
        expect_attention_matches_cpu(gpu_attention(c, d, gpu_plan(c, splits), topk, out_dtype),
                                     cpu_attention(c, topk, splits, out_dtype));
      }
    }
}

// The row-warp kernel's instance follows the plan's capacity (a plan for short contexts runs
// the one with the masked page body only; src/cuda/inference/paged_decode_rows.cu), not its
// arithmetic: a step of <= 8 pages a request gives the same bits through a plan made for it
// and through a plan made for 4k contexts and updated to it (whose CTAs of 8 pages then take
// the body compiled for whole pages).
TEST(GpuInference, DecodeAttentionIsTheSameWhateverThePlansCapacity) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const char* f : kFormats)
    for (int Q : {1, 2}) {
      SCOPED_TRACE(std::string("format ") + f + ", Q " + std::to_string(Q));
      const PagedCase capacity = make_decode_case(rng, Topology::minimax_m3(2), {4000, 3000, 4096}, Q, format_options(f));
      PagedCase step = capacity;
      step.seq_lens = {1000, 1024, 700};
      const HostTensor topk = cpu_indexer(step);
      DeviceCase d(step);
      const PagedOutputs own = gpu_attention(step, d, gpu_plan(step, 1), topk, DType::f32);
      InferencePlan updated = gpu_plan(capacity, 1);
      const HostTensor sl = int_tensor(step.seq_lens, {3}), pt = int_tensor(step.page_table, {3, step.max_pages});
      DecodeMetadata m;
      m.seq_lens = sl.view();
      m.page_table = pt.view();
      m.q_len_per_req = Q;
      update_decode_plan(updated, m);
      const PagedOutputs other = gpu_attention(step, d, updated, topk, DType::f32);
      EXPECT_TRUE(bitwise_equal(own.out, other.out)) << "out differs";
      EXPECT_TRUE(bitwise_equal(own.lse, other.lse)) << "lse differs";
      expect_attention_matches_cpu(own, cpu_attention(step, topk, 1, DType::f32));
    }
}

// FP8 and NVFP4 caches multiply f16 queries: each (row, head) is scaled by its own power of two
// into f16's range and the logits undo it. Heads whose magnitudes span bf16's range (down to
// 2^-120, where the scale is capped) and heads mixing values 2^40 apart must still match the
// CPU backend. (Large magnitudes make the softmax one-hot, where any two summation orders may
// pick different keys: the largest scale here is 2^4.)
TEST(GpuInference, DecodeQueriesAcrossTheBf16Range) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const int exponents[] = {-120, -60, -20, -6, 0, 4};
  for (const char* f : {"bf16", "fp8", "fp8_token", "nvfp4"})
    for (int Q : {1, 8}) {
      SCOPED_TRACE(std::string("format ") + f + ", Q " + std::to_string(Q));
      PagedCase c = make_decode_case(rng, Topology::minimax_m3(2), {2400, 300, 129}, Q, format_options(f));
      const int64_t T = c.q.shape()[0], H = c.q.shape()[1], D = c.q.shape()[2];
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
          const int e = exponents[(t + h) % 6];
          for (int64_t d = 0; d < D; ++d) {
            const int64_t i = (t * H + h) * D + d;
            const int mix = h % 4 == 3 && d % 2 ? -40 : 0;  // every fourth head: half its dims 2^40 smaller
            c.q.set(i, std::ldexp(c.q.at(i), e + mix));
          }
        }
      const HostTensor topk = cpu_indexer(c);
      DeviceCase d(c);
      for (int splits : {1, 4}) {
        SCOPED_TRACE("splits " + std::to_string(splits));
        expect_attention_matches_cpu(gpu_attention(c, d, gpu_plan(c, splits), topk, DType::f32),
                                     cpu_attention(c, topk, splits, DType::f32));
      }
    }
}

// A row's result does not depend on what the other rows of its tile select
// (docs/semantics.md §4.4): with one split, changing one selected page of each request's last
// row leaves every other row bit for bit. A 40k request's NVFP4 tiles take their pages in
// rounds, the 2.4k request's by page; tiles of 2 rows and the wgmma kernel's go row by row,
// where a row's order depends only on the rows before it.
TEST(GpuInference, DecodeRowsIgnoreOtherRowsSelections) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const char* f : kFormats)
    for (int Q : {2, 4, 8, 16}) {
      SCOPED_TRACE(std::string("format ") + f + ", Q " + std::to_string(Q));
      const PagedCase c = make_decode_case(rng, Topology::minimax_m3(2), {40000, 2400}, Q, format_options(f));
      HostTensor topk = cpu_indexer(c);
      DeviceCase d(c);
      const InferencePlan plan = gpu_plan(c, 1);
      const PagedOutputs before = gpu_attention(c, d, plan, topk, DType::f32);
      const int64_t T = c.total_q();
      const int Hi = c.topo.num_index_heads, Hq = c.topo.num_q_heads;
      std::vector<bool> changed(size_t(T), false);
      const auto ids = topk.ints();
      for (size_t b = 0; b < c.seq_lens.size(); ++b) {
        const int64_t r = c.cu_seqlens_q[b + 1] - 1;  // the request's last row
        const int32_t local = (c.seq_lens[b] - 1) / 128;
        for (int g = 0; g < Hi; ++g) {
          const int64_t row0 = (int64_t(g) * T + r) * 16;
          std::vector<int32_t> own(ids.begin() + row0, ids.begin() + row0 + 16);
          int32_t other = 1;  // a visible history page the row did not select
          while (other < local && std::find(own.begin(), own.end(), other) != own.end()) ++other;
          ASSERT_LT(other, local) << "request " << b << " selects every page";
          ASSERT_GE(own[1], 0);
          ASSERT_NE(own[1], local);
          topk.set(row0 + 1, float(other));  // slot 1: a history page (the local page comes last)
        }
        changed[size_t(r)] = true;
      }
      const PagedOutputs after = gpu_attention(c, d, plan, topk, DType::f32);
      const auto o0 = before.out.floats(), o1 = after.out.floats(), l0 = before.lse.floats(), l1 = after.lse.floats();
      int64_t differing = 0, moved = 0;
      for (int64_t r = 0; r < T; ++r)
        for (int64_t e = r * Hq * 128; e < (r + 1) * Hq * 128; ++e) {
          const bool same = std::memcmp(&o0[size_t(e)], &o1[size_t(e)], sizeof(float)) == 0;
          if (changed[size_t(r)]) {
            moved += !same;
          } else if (!same && differing++ < 3) {
            ADD_FAILURE() << "row " << r << " element " << e % (Hq * 128) << ": " << o0[size_t(e)] << " -> " << o1[size_t(e)];
          }
        }
      for (int64_t i = 0; i < T * Hq; ++i) {
        if (!changed[size_t(i / Hq)]) {
          EXPECT_EQ(std::memcmp(&l0[size_t(i)], &l1[size_t(i)], sizeof(float)), 0) << "lse of row " << i / Hq;
        }
      }
      EXPECT_EQ(differing, 0) << "rows changed by another row's selection";
      EXPECT_GT(moved, 0) << "the changed rows' own results did not change: the test changed nothing";
    }
}

TEST(GpuInference, PagedForwardAgainstOracle) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_decode_case(rng, kSmall, {1, 130, 2400, 0, 128, 129, 0}, 1);
  DeviceCase d(c);
  const InferencePlan plan = gpu_plan(c, 2);
  GpuOutputs o(c, DType::bf16);
  gpu_paged_forward(plan, d, o);
  const PagedOutputs h = o.host();
  check_paged_selection(c, h.topk);
  check_paged_attention(c, h);
}

TEST(GpuInference, PrefillAttentionMatchesCpu) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const char* f : kFormats) {
    SCOPED_TRACE(std::string("format ") + f);
    // Cached prefixes of 0..2500 tokens, chunks of 1..700 rows, shuffled page tables.
    const PagedCase c = make_prefill_case(rng, Topology::minimax_m3(2), {2500, 0, 100, 1200}, {300, 700, 45, 1}, format_options(f));
    const HostTensor topk = cpu_indexer(c);
    DeviceCase d(c);
    for (DType out_dtype : {DType::bf16, DType::f32})
      expect_attention_matches_cpu(gpu_attention(c, d, gpu_plan(c), topk, out_dtype), cpu_attention(c, topk, 1, out_dtype));
  }
}

// A per-tensor K scale outside the contract (negative: a device scalar is not checked on the
// host) still scales every logit: prefill applies such a scale per logit instead of folding it
// into the softmax scale, which would take the row maximum of the unscaled logits. Negating the
// scale and every K code leaves the logits as they were.
TEST(GpuInference, PrefillNegativeDeviceKScaleScalesEachLogit) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_prefill_case(rng, Topology::minimax_m3(2), {2500, 300}, {200, 100}, format_options("fp8"));
  const HostTensor topk = cpu_indexer(c);
  PagedCase negated = c;
  for (int64_t e = 0; e < negated.k.numel(); ++e) negated.k.data<uint8_t>()[e] ^= 0x80;  // E4M3 sign bit: K -> -K
  ASSERT_EQ(negated.k_scale.numel(), 1);
  negated.k_scale.set(0, -c.k_scale.at(0));
  const PagedOutputs want = gpu_attention(c, DeviceCase(c), gpu_plan(c), topk, DType::f32);
  const PagedOutputs got = gpu_attention(negated, DeviceCase(negated), gpu_plan(negated), topk, DType::f32);
  expect_attention_matches_cpu(got, want, 2e-3);
}

// An invalid device top-k (a repeated page id) reaching prefill attention: its schedule build
// flags it and every output is NaN, as for the training path's invalid selections.
TEST(GpuInference, PrefillInvalidTopkPoisonsEveryOutput) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_prefill_case(rng, Topology::minimax_m3(2), {2500, 300}, {40, 20}, format_options("bf16"));
  HostTensor topk = cpu_indexer(c);
  int32_t* row = topk.data<int32_t>() + (int64_t(1) * c.total_q() + 7) * 16;  // head 1, row 7
  ASSERT_GE(row[1], 0);
  row[1] = row[0];
  DeviceCase d(c);
  const PagedOutputs got = gpu_attention(c, d, gpu_plan(c), topk, DType::f32);
  for (int64_t i = 0; i < got.out.numel(); ++i)
    ASSERT_TRUE(std::isnan(got.out.data<float>()[i])) << "out element " << i;
  for (int64_t i = 0; i < got.lse.numel(); ++i)
    ASSERT_TRUE(std::isnan(got.lse.data<float>()[i])) << "lse element " << i;
}

// A chunk long enough that many queries share each selected page (the attention's work items
// then hold 8 queries) over a prefix of more than 16 pages, on the full MiniMax-M3 topology.
TEST(GpuInference, LongPrefillChunkMatchesCpu) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const char* f : {"bf16", "fp8_token"}) {
    SCOPED_TRACE(std::string("format ") + f);
    const PagedCase c = make_prefill_case(rng, Topology::minimax_m3(1), {3000, 200}, {2100, 600}, format_options(f));
    const HostTensor topk = cpu_indexer(c);
    DeviceCase d(c);
    expect_attention_matches_cpu(gpu_attention(c, d, gpu_plan(c), topk, DType::f32), cpu_attention(c, topk, 1, DType::f32));
  }
}

TEST(GpuInference, StridedCombinedKvCache) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const char* f : {"bf16", "fp8", "prefill bf16", "prefill fp8"}) {
    SCOPED_TRACE(std::string("format ") + f);
    const std::string name(f);
    const bool prefill = name.rfind("prefill ", 0) == 0;
    const CaseOptions opts = format_options(prefill ? name.substr(8) : name);
    const PagedCase c = prefill ? make_prefill_case(rng, Topology::minimax_m3(2), {2300, 0}, {200, 150}, opts)
                                : make_decode_case(rng, Topology::minimax_m3(2), {2300, 140, 0}, 4, opts);
    const HostTensor topk = cpu_indexer(c);
    const int splits = prefill ? 1 : 2;
    const PagedOutputs want = cpu_attention(c, topk, splits, DType::f32);
    // K and V as the halves of one [P, Hkv, 128, 256] cache.
    const int64_t P = c.physical_pages, Hkv = 2, es = c.k.dtype() == DType::bf16 ? 2 : 1;
    HostTensor combined(c.k.dtype(), {P, Hkv, 128, 256});
    for (int64_t row = 0; row < P * Hkv * 128; ++row) {
      std::memcpy(combined.data<uint8_t>() + row * 256 * es, c.k.data<uint8_t>() + row * 128 * es, size_t(128 * es));
      std::memcpy(combined.data<uint8_t>() + (row * 256 + 128) * es, c.v.data<uint8_t>() + row * 128 * es, size_t(128 * es));
    }
    DeviceCase d(c);
    DeviceTensor dc(combined);
    PagedKvCache kv = d.cache();
    const TensorView all = dc.view();
    kv.k = TensorView::strided(all.data, all.dtype, {P, Hkv, 128, 128}, {Hkv * 128 * 256, 128 * 256, 256, 1}, all.device);
    kv.v = TensorView::strided(static_cast<uint8_t*>(all.data) + 128 * es, all.dtype, {P, Hkv, 128, 128},
                               {Hkv * 128 * 256, 128 * 256, 256, 1}, all.device);
    expect_attention_matches_cpu(gpu_attention(c, d, gpu_plan(c, splits), topk, DType::f32, &kv), want);
  }
}

TEST(GpuInference, MisalignedRowsAreRefusedBeforeAnythingIsWritten) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_decode_case(rng, Topology::minimax_m3(2), {700, 140}, 4);
  DeviceCase d(c);
  const InferencePlan plan = gpu_plan(c, 2);
  GpuOutputs o(c, DType::bf16);
  const HostTensor before = o.topk.host();
  auto unchanged = [&] {
    const HostTensor now = o.topk.host();
    return std::memcmp(now.data<int32_t>(), before.data<int32_t>(), size_t(before.numel()) * 4) == 0;
  };
  auto [ip, ap] = paged_forward_params(d, o);
  // V rows starting 2 bytes late (a view one element into the cache): refused by paged_forward
  // before its indexer half writes topk.
  ap.kv.v.data = static_cast<uint8_t*>(ap.kv.v.data) + 2;
  expect_error([&] { paged_forward(plan, ip, ap); },
               {"v_cache on CUDA must have every row start at a 16-byte aligned address", "offset 2 mod 16"});
  EXPECT_TRUE(unchanged()) << "topk was written by a call that threw";
  ap.kv = d.cache();
  ip.index_k_cache.data = static_cast<uint8_t*>(ip.index_k_cache.data) + 2;
  expect_error([&] { paged_indexer(plan, ip); }, {"index_k_cache on CUDA must have every row start at a 16-byte"});
}

#if MSA_WITH_CUDA
#define CHECK_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

// One layer step (indexer + attention, paged_forward) captured in a CUDA graph on a
// non-blocking stream, replayed twice: each replay must give what the CPU computes for the
// step it runs (the plan's per-layer device work, e.g. prefill's schedule built from the new
// top-k, is inside the graph). Before each replay `next` prepares the step (new metadata
// through the plan, say); without it the step gets new q / index_q contents.
using NextStep = std::function<void(PagedCase& c, InferencePlan& plan, const RunOptions& opt)>;
void expect_graph_replays_match_cpu(std::mt19937_64& rng, PagedCase& c, int splits, const NextStep& next = {}) {
  DeviceCase d(c);
  InferencePlan plan = gpu_plan(c, splits);
  GpuOutputs o(c, DType::bf16);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RunOptions opt;
  opt.stream = stream;
  gpu_paged_forward(plan, d, o, opt);  // warm-up outside the capture (kernel attributes)
  CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  gpu_paged_forward(plan, d, o, opt);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("replay " + std::to_string(step));
    if (next) {
      next(c, plan, opt);
    } else {
      c.q = random_tensor(rng, {c.total_q(), c.topo.num_q_heads, 128});
      c.index_q = random_tensor(rng, {c.total_q(), c.topo.num_index_heads, 128}, 0.2f);
      d.q.upload(c.q);
      d.index_q.upload(c.index_q);
    }
    o.out.poison();
    o.lse.poison();
    o.topk.poison();
    synchronize(kGpu);
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    const PagedOutputs got = o.host();
    const HostTensor topk = cpu_indexer(c);
    expect_selection_matches_cpu(c, got.topk, topk);
    expect_attention_matches_cpu(got, cpu_attention(c, got.topk, splits == 0 ? 1 : splits, DType::bf16));
  }
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
}

TEST(GpuInference, DecodeStepGraphReplayWithNewContents) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  PagedCase c = make_decode_case(rng, Topology::minimax_m3(), {3000, 0, 700, 140}, 8, format_options("fp8"));
  expect_graph_replays_match_cpu(rng, c, 2);
}

// An engine's decode loop: a step captured once, then replayed after update_decode_plan has
// written the next step's seq_lens and page table into the plan (on the replay's stream):
// shorter contexts, request 1 (a padding row before) reading request 0's pages.
TEST(GpuInference, DecodeGraphReplaysTheNextStepAfterUpdate) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  PagedCase c = make_decode_case(rng, Topology::minimax_m3(), {3000, 0, 700, 140}, 8, format_options("fp8"));
  expect_graph_replays_match_cpu(rng, c, 2, [](PagedCase& step, InferencePlan& plan, const RunOptions& opt) {
    step.seq_lens = {2999, 130, 0, 139};
    for (int64_t j = 0; j < step.max_pages; ++j) step.page_table[size_t(step.max_pages + j)] = step.page_table[size_t(j)];
    const HostTensor sl = int_tensor(step.seq_lens, {4}), pt = int_tensor(step.page_table, {4, step.max_pages});
    DecodeMetadata m;
    m.seq_lens = sl.view();
    m.page_table = pt.view();
    m.q_len_per_req = step.q_len_per_req;
    update_decode_plan(plan, m, opt);
  });
}

TEST(GpuInference, PrefillStepGraphReplayWithNewContents) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  PagedCase c = make_prefill_case(rng, Topology::minimax_m3(), {2600, 0, 300}, {400, 90, 3}, format_options("fp8_token"));
  expect_graph_replays_match_cpu(rng, c, 0);
}

// A plan's stream and a run stream, both non-blocking; declared before the plans that use them
// (a plan's stream outlives it: its memory goes back there).
struct PlanAndRunStreams {
  cudaStream_t plan = nullptr, run = nullptr;
  PlanAndRunStreams() {  // (ASSERT_* cannot be used in a constructor)
    EXPECT_EQ(cudaStreamCreateWithFlags(&plan, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&run, cudaStreamNonBlocking), cudaSuccess);
  }
  ~PlanAndRunStreams() {
    cudaStreamDestroy(plan);
    cudaStreamDestroy(run);
  }
  PlanAndRunStreams(const PlanAndRunStreams&) = delete;
  PlanAndRunStreams& operator=(const PlanAndRunStreams&) = delete;
  RunOptions run_options() const {
    RunOptions opt;
    opt.stream = run;
    return opt;
  }
};

// The device's indexer and attention outputs `o` against the CPU backend's on case `c`.
void expect_forward_matches_cpu(const PagedCase& c, const GpuOutputs& o, int splits) {
  const PagedOutputs got = o.host();
  expect_selection_matches_cpu(c, got.topk, cpu_indexer(c));
  expect_attention_matches_cpu(got, cpu_attention(c, got.topk, splits == 0 ? 1 : splits, DType::bf16));
}

// Planning queues the plan's uploads on its stream and returns without waiting for the device;
// a step run on another (non-blocking) stream waits for them on the device. The plan's stream
// is held back by a host callback that sleeps, so a planner that waited would return after it
// (the stream would be idle), and a run that did not wait would read the tables unwritten.
TEST(GpuInference, PlanningDoesNotWaitAndRunsOnOtherStreamsWaitForThePlan) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const bool prefill : {true, false}) {
    SCOPED_TRACE(prefill ? "prefill" : "decode");
    PagedCase c = prefill ? make_prefill_case(rng, Topology::minimax_m3(), {2600, 0, 300}, {400, 90, 3}, format_options("fp8"))
                          : make_decode_case(rng, Topology::minimax_m3(), {3000, 0, 700, 140}, 8, format_options("fp8"));
    const int splits = prefill ? 0 : 2;
    const PlanAndRunStreams streams;
    DeviceCase d(c);
    GpuOutputs o(c, DType::bf16);
    CHECK_CUDA(cudaDeviceSynchronize());  // the case's copies and the outputs' poison are done
    CHECK_CUDA(cudaLaunchHostFunc(
        streams.plan, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(500)); }, nullptr));
    const InferencePlan plan = gpu_plan(c, splits, streams.plan);
    EXPECT_EQ(cudaStreamQuery(streams.plan), cudaErrorNotReady) << "planning waited for its stream";
    gpu_paged_forward(plan, d, o, streams.run_options());
    CHECK_CUDA(cudaStreamSynchronize(streams.run));
    CHECK_CUDA(cudaStreamSynchronize(streams.plan));
    expect_forward_matches_cpu(c, o, splits);
  }
}

// An engine makes and drops a plan every step. Dropping one must not wait for the device (the
// run stream below is held by a host gate that opens only after the drop: a wait would stall
// until the gate's timeout), and the memory it gives back must not be reused before its runs
// on other streams are done: the next step's plan, made at once on the plan's stream with the
// same sizes, must not overwrite the tables the gated run has yet to read. The plan goes
// either as the last copy is destroyed or as another plan is assigned over it.
TEST(GpuInference, ReleasingAPlanDoesNotWaitAndIsOrderedAfterItsRuns) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const bool prefill : {true, false}) {
    for (const bool assigned : {false, true}) {
      SCOPED_TRACE(std::string(prefill ? "prefill" : "decode") + (assigned ? ", assigned over" : ", destroyed"));
      auto make = [&] {
        return prefill ? make_prefill_case(rng, Topology::minimax_m3(), {2600, 0, 300}, {400, 90, 3}, format_options("bf16"))
                       : make_decode_case(rng, Topology::minimax_m3(), {3000, 0, 700, 140}, 8, format_options("bf16"));
      };
      const PagedCase c = make(), next = make();
      const int splits = prefill ? 0 : 2;
      const PlanAndRunStreams streams;
      DeviceCase d(c);
      GpuOutputs o(c, DType::bf16);
      CHECK_CUDA(cudaDeviceSynchronize());
      struct Gate {
        std::atomic<bool> open{false}, timed_out{false};
      } gate;
      CHECK_CUDA(cudaLaunchHostFunc(
          streams.run,
          [](void* p) {
            auto* g = static_cast<Gate*>(p);
            const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
            while (!g->open.load()) {
              if (std::chrono::steady_clock::now() > until) {
                g->timed_out = true;
                return;
              }
              std::this_thread::sleep_for(std::chrono::microseconds(100));
            }
          },
          &gate));
      struct OpenAtExit {  // also when an assertion returns early: the callback reads `gate`
        Gate& gate;
        cudaStream_t stream;
        ~OpenAtExit() {
          gate.open = true;
          cudaStreamSynchronize(stream);
        }
      } open_at_exit{gate, streams.run};
      std::optional<InferencePlan> plan(gpu_plan(c, splits, streams.plan));
      gpu_paged_forward(*plan, d, o, streams.run_options());
      if (assigned)
        *plan = gpu_plan(next, splits, streams.plan);  // the old plan's buffers go back on streams.plan
      else
        plan.reset();
      const InferencePlan following = gpu_plan(next, splits, streams.plan);
      plan.reset();
      EXPECT_FALSE(gate.timed_out.load()) << "releasing the plan waited for the device";
      EXPECT_EQ(cudaStreamQuery(streams.run), cudaErrorNotReady) << "the gated run finished before the gate opened";
      gate.open = true;
      CHECK_CUDA(cudaStreamSynchronize(streams.run));
      CHECK_CUDA(cudaStreamSynchronize(streams.plan));
      EXPECT_FALSE(gate.timed_out.load());
      expect_forward_matches_cpu(c, o, splits);
    }
  }
}

TEST(GpuInference, AutomaticSplitCountFollowsTheDevice) {
  MSA_REQUIRE_GPU();
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Topology topo = Topology::minimax_m3();
  for (int64_t batch : {1, 8, 32, 128})
    for (int32_t context : {1000, 4096, 131072}) {
      SCOPED_TRACE("batch " + std::to_string(batch) + ", context " + std::to_string(context));
      const int64_t pages = (context + 127) / 128;
      const std::vector<int32_t> seq(size_t(batch), context);
      std::vector<int32_t> ids(size_t(batch * pages));
      std::iota(ids.begin(), ids.end(), 0);
      const HostTensor sl = int_tensor(seq, {batch}), pt = int_tensor(ids, {batch, pages});
      DecodeMetadata m;
      m.seq_lens = sl.view();
      m.page_table = pt.view();
      m.q_len_per_req = 8;
      InferencePlanOptions o;
      o.device = kGpu;
      const InferencePlan plan = plan_decode(topo, m, o);
      // One attention CTA an SM: every variant takes over 140 KB of shared memory.
      EXPECT_EQ(plan.num_kv_splits, detail::automatic_kv_splits(detail::decode_split_work(seq, 8, topo.num_kv_heads, sms)));
      EXPECT_EQ(plan.partial_out.view().shape[0], plan.num_kv_splits);
    }
}
#endif

// Also the split CTAs' arrival counts of the wgmma kernel (bf16): each step's last split CTA
// resets them for the next.
TEST(GpuInference, DecodeIsBitwiseRepeatable) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const char* f : {"nvfp4_global", "bf16"}) {
    SCOPED_TRACE(f);
    const PagedCase c = make_decode_case(rng, Topology::minimax_m3(), {5000, 300, 2000, 0}, 8, format_options(f));
    DeviceCase d(c);
    const InferencePlan plan = gpu_plan(c, 4);
    PagedOutputs first;
    for (int rep = 0; rep < 10; ++rep) {
      GpuOutputs o(c, DType::bf16);
      gpu_paged_forward(plan, d, o);
      PagedOutputs h = o.host();
      if (rep == 0) {
        first = std::move(h);
        continue;
      }
      EXPECT_TRUE(bitwise_equal(h.topk, first.topk)) << "repeat " << rep << ": topk differs";
      EXPECT_TRUE(bitwise_equal(h.out, first.out)) << "repeat " << rep << ": out differs";
      EXPECT_TRUE(bitwise_equal(h.lse, first.lse)) << "repeat " << rep << ": lse differs";
    }
  }
}

}  // namespace
}  // namespace msa::test
