// NaN isolation of the paged caches: a key / value slot that a row does not attend to - the
// unused tail of the last page, slots past seq_len, and keys past the row's causal limit that
// other rows of the same step do attend to - never changes the row, also when it holds NaN or
// inf (engines leave garbage in cache slots). Every case runs twice, once on the random cache
// and once with the future keys of some rows overwritten by NaN / inf (K, V, NVFP4 block scales,
// index-K; per-token scales, which are validated finite, by 1e30 / 3e38); the rows that cannot see those slots must be bitwise equal in
// both runs (topk, out, lse) and finite. The slots past seq_len hold NaN in both runs
// (inference_support.h). CPU and GPU (the GPU tests skip without a device).
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "inference_support.h"
#include "test_gpu_support.h"

namespace msa::test {
namespace {

const Topology kSmall = Topology::minimax_m3(4);  // Hq 16, Hkv 1, Hi 1

// Positions [begin, end) of request `request` whose cache slots get garbage.
struct Poison {
  int request;
  int32_t begin, end;
};

// Overwrites the cache slots of the poisoned positions with NaN / inf garbage in every tensor
// that holds them (alternating NaN and +-inf where the format has an infinity).
void poison_slots(PagedCase& c, const std::vector<Poison>& poisons) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const int Hkv = c.topo.num_kv_heads;
  for (const Poison& p : poisons)
    for (int32_t pos = p.begin; pos < p.end; ++pos) {
      const int64_t page = c.page_table[size_t(p.request) * size_t(c.max_pages) + size_t(pos / 128)];
      const int64_t offset = pos % 128, slot = page * 128 + offset;
      const float garbage = pos % 2 ? nan : (pos % 4 ? -inf : inf);
      for (int h = 0; h < Hkv; ++h) {
        const int64_t row = (page * Hkv + h) * 128 + offset;  // [P, Hkv, 128, *] row index
        if (c.format == KvFormat::nvfp4) {
          for (int e = 0; e < 64; ++e) {
            c.k.data<uint8_t>()[row * 64 + e] = 0xff;
            c.v.data<uint8_t>()[row * 64 + e] = 0x77;
          }
          for (int e = 0; e < 8; ++e) {
            c.k_sf.data<uint8_t>()[row * 8 + e] = 0x7f;  // E4M3 NaN
            c.v_sf.data<uint8_t>()[row * 8 + e] = 0xff;
          }
        } else {
          for (int e = 0; e < 128; ++e) {
            c.k.set(row * 128 + e, garbage);
            c.v.set(row * 128 + e, e % 2 ? nan : garbage);
          }
        }
        if (c.k_scale.numel() > 1) {  // per (head, token) scales [Hkv, P * 128]: validated finite
          c.k_scale.set(h * c.k_scale.shape()[1] + slot, 1e30f);  // > 0, but K / V values overflow
          c.v_scale.set(h * c.v_scale.shape()[1] + slot, 3e38f);
        }
      }
      for (int e = 0; e < 128; ++e) c.index_k_cache.set(slot * 128 + e, garbage);
    }
}

// Rows that see none of the poisoned positions.
std::vector<int64_t> clean_rows(const PagedCase& c, const std::vector<Poison>& poisons) {
  std::vector<int64_t> rows;
  for (size_t b = 0; b + 1 < c.cu_seqlens_q.size(); ++b) {
    const int64_t q0 = c.cu_seqlens_q[b], q_len = c.cu_seqlens_q[b + 1] - q0;
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t pos = c.seq_lens[b] - q_len + i;
      bool clean = true;
      for (const Poison& p : poisons) clean &= !(p.request == int(b) && pos >= p.begin);
      if (clean) rows.push_back(q0 + i);
    }
  }
  return rows;
}

// The clean rows of two runs are bitwise equal and finite.
void expect_rows_unchanged(const PagedCase& c, const PagedOutputs& clean, const PagedOutputs& poisoned,
                           const std::vector<int64_t>& rows) {
  ASSERT_FALSE(rows.empty());
  const int Hq = c.topo.num_q_heads, Hi = c.topo.num_index_heads;
  const int64_t T = c.total_q();
  const auto ids0 = clean.topk.ints(), ids1 = poisoned.topk.ints();
  const auto out0 = clean.out.floats(), out1 = poisoned.out.floats();
  const auto lse0 = clean.lse.floats(), lse1 = poisoned.lse.floats();
  int reported = 0;
  for (int64_t r : rows) {
    std::ostringstream err;
    for (int g = 0; g < Hi; ++g)
      for (int s = 0; s < 16; ++s) {
        const size_t i = size_t((g * T + r) * 16 + s);
        if (ids0[i] != ids1[i]) err << "topk[" << g << ", " << s << "] " << ids0[i] << " -> " << ids1[i] << "; ";
      }
    for (int h = 0; h < Hq; ++h) {
      const size_t rh = size_t(r * Hq + h);
      if (!std::isfinite(lse1[rh]) && !(std::isinf(lse1[rh]) && lse1[rh] < 0)) err << "head " << h << " lse " << lse1[rh] << "; ";
      else if (std::memcmp(&lse0[rh], &lse1[rh], sizeof(float)) != 0)
        err << "head " << h << " lse " << lse0[rh] << " -> " << lse1[rh] << "; ";
      for (int d = 0; d < 128; ++d) {
        const float a = out0[rh * 128 + size_t(d)], b = out1[rh * 128 + size_t(d)];
        if (!std::isfinite(b) || std::memcmp(&a, &b, sizeof(float)) != 0) {
          err << "head " << h << " out[" << d << "] " << a << " -> " << b << "; ";
          break;
        }
      }
    }
    if (!err.str().empty() && reported++ < 5) ADD_FAILURE() << "row " << r << " sees no poisoned slot but changed: " << err.str();
  }
  EXPECT_EQ(reported, 0) << "rows changed by cache slots they do not attend to";
}

CaseOptions format_options(const std::string& name) {
  CaseOptions o;
  if (name == "fp8") o.format = KvFormat::fp8_e4m3;
  if (name == "fp8_token") {
    o.format = KvFormat::fp8_e4m3;
    o.per_token_scales = true;
  }
  if (name == "nvfp4") {
    o.format = KvFormat::nvfp4;
    o.global_scale = true;
  }
  return o;
}

const char* kFormats[] = {"bf16", "fp8", "fp8_token", "nvfp4"};

// Paged prefill: chunks whose later tokens share a page with earlier rows (the rows of one
// 16-row tile see different prefixes of the local page), one request long enough to rank pages.
PagedCase prefill_case(std::mt19937_64& rng, const CaseOptions& o, std::vector<Poison>& poisons) {
  poisons = {{0, 137, 150}, {1, 330, 340}, {2, 2250, 2266}};
  return make_prefill_case(rng, kSmall, {100, 300, 2236}, {50, 40, 30}, o);
}

// Decode with Q queries per request: the last queries' own keys are the earlier queries'
// future (also across a page boundary: 126..129).
PagedCase decode_case(std::mt19937_64& rng, int q, const CaseOptions& o, std::vector<Poison>& poisons) {
  if (q == 16) {
    poisons = {{0, 692, 700}, {1, 2300, 2306}};
    return make_decode_case(rng, kSmall, {700, 2306}, 16, o);
  }
  poisons = {{0, 2563, 2565}, {1, 128, 130}, {2, 2561, 2562}};
  return make_decode_case(rng, kSmall, {2565, 130, 2562}, q, o);
}

// ---------------------------------------------------------------------------------------
// CPU

PagedOutputs cpu_run(const PagedCase& c, int splits) { return run_paged(c, splits, DType::f32); }

TEST(InferenceNanIsolation, PrefillRowsIgnoreFutureAndUnusedSlots) {
  MSA_SEEDED_RNG(rng);
  for (const char* f : kFormats) {
    SCOPED_TRACE(f);
    std::vector<Poison> poisons;
    PagedCase c = prefill_case(rng, format_options(f), poisons);
    const PagedOutputs clean = cpu_run(c, 0);
    poison_slots(c, poisons);
    expect_rows_unchanged(c, clean, cpu_run(c, 0), clean_rows(c, poisons));
  }
}

TEST(InferenceNanIsolation, DecodeRowsIgnoreFutureAndUnusedSlots) {
  MSA_SEEDED_RNG(rng);
  for (const char* f : kFormats)
    for (int q : {2, 4, 16}) {
      SCOPED_TRACE(std::string(f) + " Q " + std::to_string(q));
      std::vector<Poison> poisons;
      PagedCase c = decode_case(rng, q, format_options(f), poisons);
      const PagedCase before = c;
      poison_slots(c, poisons);
      for (int splits : {1, 4}) {
        SCOPED_TRACE("splits " + std::to_string(splits));
        expect_rows_unchanged(c, cpu_run(before, splits), cpu_run(c, splits), clean_rows(c, poisons));
      }
    }
}

// A page of one request that some of its rows selected and others did not (the case's index
// queries are independent per row): logical page `page` of request 0, or -1 when no full,
// non-local page is split that way.
int64_t page_selected_by_some_rows(const PagedCase& c, const PagedOutputs& o) {
  const int q = c.q_len_per_req;
  const auto ids = o.topk.ints();  // [Hi = 1, T, 16], request 0's rows first
  const int64_t full_pages = (c.seq_lens[0] - q) / 128;  // pages before the first row's own
  for (int64_t page = 1; page < full_pages; ++page) {
    int rows = 0;
    for (int r = 0; r < q; ++r)
      for (int s = 0; s < 16; ++s) rows += ids[size_t(r * 16 + s)] == page;
    if (rows > 0 && rows < q) return page;
  }
  return -1;
}

// The V values of every slot of request 0's logical page `page`: NaN, +inf and -inf (NaN
// block scales for NVFP4, whose codes have no infinity). K and index-K stay, so the selection
// does not change.
void poison_values(PagedCase& c, int64_t page) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const int64_t phys = c.page_table[size_t(page)];
  for (int h = 0; h < c.topo.num_kv_heads; ++h)
    for (int64_t t = 0; t < 128; ++t) {
      const int64_t row = (phys * c.topo.num_kv_heads + h) * 128 + t;
      if (c.format == KvFormat::nvfp4) {
        for (int e = 0; e < 8; ++e) c.v_sf.data<uint8_t>()[row * 8 + e] = 0x7f;
      } else {
        for (int e = 0; e < 128; ++e) c.v.set(row * 128 + e, e % 3 == 0 ? nan : (e % 3 == 1 ? inf : -inf));
      }
    }
}

// Rows of request 0 that selected `page`, and the other rows of the case.
void split_rows(const PagedCase& c, const PagedOutputs& o, int64_t page, std::vector<int64_t>& selecting,
                std::vector<int64_t>& others) {
  const auto ids = o.topk.ints();
  for (int64_t r = 0; r < c.total_q(); ++r) {
    bool sel = false;
    for (int s = 0; s < 16; ++s) sel |= r < c.q_len_per_req && ids[size_t(r * 16 + s)] == page;
    (sel ? selecting : others).push_back(r);
  }
}

// A poisoned page that some rows of a request attend to and others of the same step do not:
// the others are bitwise unchanged and finite; the rows that attend to it keep their LSE (V
// does not enter it) and, with `against_cpu`, are non-finite where the CPU backend's run is.
// This is the case the decode kernel's V check exists for (P = 0 against inf / NaN values).
template <typename Run>
void check_values_of_a_page_some_rows_skip(std::mt19937_64& rng, Run run, bool against_cpu) {
  for (const char* f : kFormats)
    for (int q : {2, 8, 16}) {
      SCOPED_TRACE(std::string(f) + " Q " + std::to_string(q));
      PagedCase c = make_decode_case(rng, kSmall, {3000, 1500}, q, format_options(f));
      const PagedCase before = c;
      const PagedOutputs first = run(before, 1);
      const int64_t page = page_selected_by_some_rows(c, first);
      ASSERT_GE(page, 0) << "no page of request 0 is selected by some of its rows and not others";
      poison_values(c, page);
      std::vector<int64_t> selecting, others;
      split_rows(c, first, page, selecting, others);
      for (int splits : {1, 4}) {
        SCOPED_TRACE("splits " + std::to_string(splits));
        const PagedOutputs clean = run(before, splits), got = run(c, splits);
        expect_rows_unchanged(c, clean, got, others);
        const PagedOutputs want = against_cpu ? cpu_run(c, splits) : got;
        const auto lse0 = clean.lse.floats(), lse1 = got.lse.floats();
        const auto out1 = got.out.floats(), out_want = want.out.floats();
        int reported = 0, nonfinite = 0;
        for (int64_t r : selecting)
          for (int h = 0; h < c.topo.num_q_heads; ++h) {
            const size_t rh = size_t(r * c.topo.num_q_heads + h);
            if (std::memcmp(&lse0[rh], &lse1[rh], sizeof(float)) != 0 && reported++ < 5)
              ADD_FAILURE() << "row " << r << " head " << h << " lse " << lse0[rh] << " -> " << lse1[rh];
            for (int d = 0; d < 128; ++d) {
              const float a = out1[rh * 128 + size_t(d)], b = out_want[rh * 128 + size_t(d)];
              nonfinite += !std::isfinite(a);
              if (std::isfinite(a) != std::isfinite(b) && reported++ < 5)
                ADD_FAILURE() << "row " << r << " head " << h << " out[" << d << "] " << a << ", the CPU's " << b;
            }
          }
        EXPECT_EQ(reported, 0);
        EXPECT_GT(nonfinite, 0) << "the rows that attend to the poisoned page stayed finite";
      }
    }
}

TEST(InferenceNanIsolation, DecodeRowsThatSkipAPageIgnoreItsValues) {
  MSA_SEEDED_RNG(rng);
  check_values_of_a_page_some_rows_skip(rng, [](const PagedCase& c, int splits) { return cpu_run(c, splits); }, false);
}

// ---------------------------------------------------------------------------------------
// GPU

// paged_forward on the GPU (plan, caches and outputs on the device), results on the host.
PagedOutputs gpu_run(const PagedCase& c, int splits) {
  const HostTensor sl = int_tensor(c.seq_lens, {int64_t(c.seq_lens.size())});
  const HostTensor pt = int_tensor(c.page_table, {int64_t(c.seq_lens.size()), c.max_pages});
  const HostTensor cu = int_tensor(c.cu_seqlens_q, {int64_t(c.cu_seqlens_q.size())});
  InferencePlanOptions o;
  o.num_kv_splits = splits;
  o.device = kGpu;
  InferencePlan plan;
  if (c.phase == InferencePhase::decode) {
    DecodeMetadata m;
    m.seq_lens = sl.view();
    m.page_table = pt.view();
    m.q_len_per_req = c.q_len_per_req;
    plan = plan_decode(c.topo, m, o);
  } else {
    PagedPrefillMetadata m;
    m.cu_seqlens_q = cu.view();
    m.seq_lens = sl.view();
    m.page_table = pt.view();
    plan = plan_paged_prefill(c.topo, m, o);
  }
  const DeviceTensor k(c.k), v(c.v), index_k(c.index_k_cache), q(c.q), index_q(c.index_q);
  DeviceTensor k_sf, v_sf, k_scale, v_scale;
  PagedKvCache kv;
  kv.format = c.format;
  kv.k = k.view();
  kv.v = v.view();
  if (c.format == KvFormat::nvfp4) {
    k_sf = DeviceTensor(c.k_sf);
    v_sf = DeviceTensor(c.v_sf);
    kv.k_block_scale = k_sf.view();
    kv.v_block_scale = v_sf.view();
  }
  if (c.k_scale.numel()) {
    k_scale = DeviceTensor(c.k_scale);
    v_scale = DeviceTensor(c.v_scale);
    kv.k_scale = k_scale.view();
    kv.v_scale = v_scale.view();
  }
  DeviceTensor topk(DType::i32, {c.topo.num_index_heads, c.total_q(), 16});
  DeviceTensor out(DType::f32, {c.total_q(), c.topo.num_q_heads, 128});
  DeviceTensor lse(DType::f32, {c.total_q(), c.topo.num_q_heads});
  topk.poison();
  out.poison();
  lse.poison();
  PagedIndexerParams ip;
  ip.index_q = index_q.view();
  ip.index_k_cache = index_k.view();
  ip.topk = topk.view();
  PagedAttentionParams ap;
  ap.q = q.view();
  ap.kv = kv;
  ap.out = out.view();
  ap.lse = lse.view();
  paged_forward(plan, ip, ap);
  return {topk.host(), out.host(), lse.host()};
}

TEST(GpuInferenceNanIsolation, PrefillRowsIgnoreFutureAndUnusedSlots) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const char* f : kFormats) {
    SCOPED_TRACE(f);
    std::vector<Poison> poisons;
    PagedCase c = prefill_case(rng, format_options(f), poisons);
    const PagedOutputs clean = gpu_run(c, 0);
    poison_slots(c, poisons);
    expect_rows_unchanged(c, clean, gpu_run(c, 0), clean_rows(c, poisons));
  }
}

TEST(GpuInferenceNanIsolation, DecodeRowsIgnoreFutureAndUnusedSlots) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const char* f : kFormats)
    for (int q : {2, 4, 16}) {
      SCOPED_TRACE(std::string(f) + " Q " + std::to_string(q));
      std::vector<Poison> poisons;
      PagedCase c = decode_case(rng, q, format_options(f), poisons);
      const PagedCase before = c;
      poison_slots(c, poisons);
      for (int splits : {1, 4}) {
        SCOPED_TRACE("splits " + std::to_string(splits));
        expect_rows_unchanged(c, gpu_run(before, splits), gpu_run(c, splits), clean_rows(c, poisons));
      }
    }
}

TEST(GpuInferenceNanIsolation, DecodeRowsThatSkipAPageIgnoreItsValues) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  check_values_of_a_page_some_rows_skip(rng, [](const PagedCase& c, int splits) { return gpu_run(c, splits); }, true);
}

}  // namespace
}  // namespace msa::test
