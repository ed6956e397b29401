// Helpers of the inference tests: paged cases with scattered, unordered page tables, caches of
// every format filled with random contents (NaN in every slot no request may read), runs of
// the library, and checks against the float64 inference oracle.
#pragma once

#include <algorithm>
#include <numeric>
#include <set>

#include "msa/inference.h"
#include "oracle/inference_oracle.h"
#include "test_support.h"

namespace msa::test {

// One paged step: requests, page table, caches and per-layer inputs.
struct PagedCase {
  Topology topo;
  InferencePhase phase = InferencePhase::prefill;
  int q_len_per_req = 0;               // decode
  std::vector<int32_t> cu_seqlens_q;   // [B + 1]
  std::vector<int32_t> seq_lens;       // [B]
  std::vector<int32_t> page_table;     // [B, max_pages]
  int64_t max_pages = 0;
  int64_t physical_pages = 0;
  KvFormat format = KvFormat::bf16;
  bool per_token_scales = false;
  HostTensor k, v;                 // main caches (bf16 / fp8 [P, Hkv, 128, 128], nvfp4 [P, Hkv, 128, 64])
  HostTensor k_sf, v_sf;           // nvfp4 block scales [P, Hkv, 128, 8]
  HostTensor k_scale, v_scale;     // fp8 / nvfp4 scales ([1] or [Hkv, P * 128])
  HostTensor index_k_cache;        // [P, 128, 128] bf16 or fp8
  HostTensor q, index_q;           // [total_q, Hq, 128] bf16, [total_q, Hi, 128] bf16

  int64_t total_q() const { return cu_seqlens_q.back(); }
  PagedKvCache cache() const {
    PagedKvCache c;
    c.format = format;
    c.k = k.view();
    c.v = v.view();
    if (format == KvFormat::nvfp4) {
      c.k_block_scale = k_sf.view();
      c.v_block_scale = v_sf.view();
    }
    if (k_scale.numel()) {
      c.k_scale = k_scale.view();
      c.v_scale = v_scale.view();
    }
    return c;
  }
  oracle::PagedRequests requests() const { return {cu_seqlens_q, seq_lens, page_table, max_pages}; }
  InferencePlan plan(int num_kv_splits = 0) const {
    const HostTensor sl = int_tensor(seq_lens, {int64_t(seq_lens.size())});
    const HostTensor pt = int_tensor(page_table, {int64_t(seq_lens.size()), max_pages});
    InferencePlanOptions o;
    o.num_kv_splits = num_kv_splits;
    if (phase == InferencePhase::decode) {
      DecodeMetadata m;
      m.seq_lens = sl.view();
      m.page_table = pt.view();
      m.q_len_per_req = q_len_per_req;
      return plan_decode(topo, m, o);
    }
    const HostTensor cu = int_tensor(cu_seqlens_q, {int64_t(cu_seqlens_q.size())});
    PagedPrefillMetadata m;
    m.cu_seqlens_q = cu.view();
    m.seq_lens = sl.view();
    m.page_table = pt.view();
    return plan_paged_prefill(topo, m, o);
  }
};

struct CaseOptions {
  KvFormat format = KvFormat::bf16;
  bool per_token_scales = false;    // fp8: [Hkv, max_kv_tokens] scales instead of one per tensor
  bool global_scale = false;        // nvfp4: per-tensor global scales
  DType index_dtype = DType::bf16;  // index-K cache and index_q
  int64_t spare_pages = 3;          // physical pages no request uses
  int64_t extra_table_width = 2;    // page_table columns past the longest request
};

namespace detail_inference {

inline uint8_t random_e4m3(std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  return float_to_e4m3(normal(rng) * scale);
}

// Writes random contents into every cache slot; slots no request reads get NaN.
inline void fill_caches(std::mt19937_64& rng, PagedCase& c, const CaseOptions& o) {
  const int Hkv = c.topo.num_kv_heads;
  const int64_t P = c.physical_pages;
  std::vector<char> live(size_t(P * 128), 0);  // slot -> read by some request
  for (size_t b = 0; b < c.seq_lens.size(); ++b)
    for (int64_t t = 0; t < c.seq_lens[b]; ++t) live[size_t(c.page_table[b * size_t(c.max_pages) + size_t(t / 128)] * 128 + t % 128)] = 1;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.02f, 0.08f);
  const float nan = std::numeric_limits<float>::quiet_NaN();

  if (c.format == KvFormat::nvfp4) {
    c.k = HostTensor(DType::u8, {P, Hkv, 128, 64});
    c.v = HostTensor(DType::u8, {P, Hkv, 128, 64});
    c.k_sf = HostTensor(DType::f8e4m3, {P, Hkv, 128, 8});
    c.v_sf = HostTensor(DType::f8e4m3, {P, Hkv, 128, 8});
    std::uniform_int_distribution<int> byte(0, 255);
    for (HostTensor* t : {&c.k, &c.v})
      for (int64_t e = 0; e < t->numel(); ++e) t->data<uint8_t>()[e] = uint8_t(byte(rng));
    for (HostTensor* t : {&c.k_sf, &c.v_sf})
      for (int64_t e = 0; e < t->numel(); ++e) {
        const int64_t slot = (e / (int64_t(Hkv) * 128 * 8)) * 128 + (e / 8) % 128;
        t->data<uint8_t>()[e] = live[size_t(slot)] ? float_to_e4m3(uniform(rng)) : uint8_t(0x7f);
      }
    if (o.global_scale) {
      c.k_scale = HostTensor(DType::f32, {1});
      c.v_scale = HostTensor(DType::f32, {1});
      c.k_scale.set(0, 1.75f);
      c.v_scale.set(0, 0.625f);
    }
  } else {
    const DType dt = c.format == KvFormat::bf16 ? DType::bf16 : DType::f8e4m3;
    c.k = HostTensor(dt, {P, Hkv, 128, 128});
    c.v = HostTensor(dt, {P, Hkv, 128, 128});
    const float value_scale = c.format == KvFormat::bf16 ? 1.0f : 8.0f;  // fp8 codes are then scaled down
    for (HostTensor* t : {&c.k, &c.v})
      for (int64_t e = 0; e < t->numel(); ++e) {
        const int64_t slot = (e / (int64_t(Hkv) * 128 * 128)) * 128 + (e / 128) % 128;
        t->set(e, live[size_t(slot)] ? normal(rng) * value_scale : nan);
      }
    if (c.format == KvFormat::fp8_e4m3) {
      if (o.per_token_scales) {
        c.k_scale = HostTensor(DType::f32, {Hkv, P * 128});
        c.v_scale = HostTensor(DType::f32, {Hkv, P * 128});
        for (HostTensor* t : {&c.k_scale, &c.v_scale})
          for (int64_t e = 0; e < t->numel(); ++e) t->set(e, uniform(rng));
      } else {
        c.k_scale = HostTensor(DType::f32, {1});
        c.v_scale = HostTensor(DType::f32, {1});
        c.k_scale.set(0, 0.03f);
        c.v_scale.set(0, 0.11f);
      }
    }
  }
  c.index_k_cache = HostTensor(o.index_dtype, {P, 128, 128});
  for (int64_t e = 0; e < c.index_k_cache.numel(); ++e)
    c.index_k_cache.set(e, live[size_t(e / 128)] ? normal(rng) * 0.2f : nan);
}

}  // namespace detail_inference

// Requests with `prefix[b]` cached tokens and `chunk[b]` new queries (paged prefill), pages
// scattered over a shuffled physical pool with unused pages in between.
inline PagedCase make_paged_case(std::mt19937_64& rng, const Topology& topo, InferencePhase phase,
                                 const std::vector<int32_t>& seq_lens, const std::vector<int32_t>& q_lens,
                                 const CaseOptions& o = {}) {
  PagedCase c;
  c.topo = topo;
  c.phase = phase;
  c.format = o.format;
  c.per_token_scales = o.per_token_scales;
  c.seq_lens = seq_lens;
  c.cu_seqlens_q = {0};
  for (int32_t n : q_lens) c.cu_seqlens_q.push_back(c.cu_seqlens_q.back() + n);
  if (phase == InferencePhase::decode) c.q_len_per_req = q_lens.empty() ? 1 : q_lens[0];
  int64_t needed = 0, widest = 1;
  for (int32_t n : seq_lens) {
    needed += (n + 127) / 128;
    widest = std::max<int64_t>(widest, (n + 127) / 128);
  }
  c.max_pages = widest + o.extra_table_width;
  c.physical_pages = needed + o.spare_pages;
  std::vector<int32_t> pool(size_t(c.physical_pages));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  c.page_table.assign(seq_lens.size() * size_t(c.max_pages), -1);
  size_t next = 0;
  for (size_t b = 0; b < seq_lens.size(); ++b)
    for (int64_t j = 0; j < (seq_lens[b] + 127) / 128; ++j) c.page_table[b * size_t(c.max_pages) + size_t(j)] = pool[next++];
  detail_inference::fill_caches(rng, c, o);
  c.q = random_tensor(rng, {c.total_q(), topo.num_q_heads, 128});
  c.index_q = random_tensor(rng, {c.total_q(), topo.num_index_heads, 128}, 0.2f, o.index_dtype);
  if (o.index_dtype == DType::f8e4m3)  // wider codes so that fp8 index scores are not all ties
    for (int64_t e = 0; e < c.index_q.numel(); ++e) c.index_q.data<uint8_t>()[e] = detail_inference::random_e4m3(rng, 1.0f);
  return c;
}

inline PagedCase make_prefill_case(std::mt19937_64& rng, const Topology& topo, const std::vector<int32_t>& prefix,
                                   const std::vector<int32_t>& chunk, const CaseOptions& o = {}) {
  std::vector<int32_t> seq_lens;
  for (size_t b = 0; b < prefix.size(); ++b) seq_lens.push_back(prefix[b] + chunk[b]);
  return make_paged_case(rng, topo, InferencePhase::prefill, seq_lens, chunk, o);
}

inline PagedCase make_decode_case(std::mt19937_64& rng, const Topology& topo, const std::vector<int32_t>& seq_lens,
                                  int q_len_per_req, const CaseOptions& o = {}) {
  return make_paged_case(rng, topo, InferencePhase::decode, seq_lens,
                         std::vector<int32_t>(seq_lens.size(), q_len_per_req), o);
}

struct PagedOutputs {
  HostTensor topk;  // [Hi, total_q, 16] int32
  HostTensor out;   // [total_q, Hq, 128]
  HostTensor lse;   // [total_q, Hq] f32
};

inline PagedOutputs make_outputs(const PagedCase& c, DType out_dtype = DType::bf16) {
  PagedOutputs o{HostTensor(DType::i32, {c.topo.num_index_heads, c.total_q(), 16}),
                 HostTensor(out_dtype, {c.total_q(), c.topo.num_q_heads, 128}),
                 HostTensor(DType::f32, {c.total_q(), c.topo.num_q_heads})};
  poison(o.topk);
  poison(o.out);
  poison(o.lse);
  return o;
}

inline PagedIndexerParams indexer_params(const PagedCase& c, const PagedOutputs& o) {
  PagedIndexerParams p;
  p.index_q = c.index_q.view();
  p.index_k_cache = c.index_k_cache.view();
  p.topk = o.topk.view();
  return p;
}

inline PagedAttentionParams attention_params(const PagedCase& c, const PagedOutputs& o) {
  PagedAttentionParams p;
  p.q = c.q.view();
  p.kv = c.cache();
  p.topk = o.topk.view();
  p.out = o.out.view();
  p.lse = o.lse.view();
  return p;
}

// paged_forward (indexer + attention) with a fresh plan.
inline PagedOutputs run_paged(const PagedCase& c, int num_kv_splits = 0, DType out_dtype = DType::bf16) {
  const InferencePlan plan = c.plan(num_kv_splits);
  PagedOutputs o = make_outputs(c, out_dtype);
  PagedAttentionParams a = attention_params(c, o);
  a.topk = {};
  paged_forward(plan, indexer_params(c, o), a);
  return o;
}

// The library's selection against the oracle (docs/semantics.md §10): valid prefix, local page last, the
// exact set, or, at near-ties, ranked pages whose oracle score reaches the oracle's threshold
// within `tie`; forced init pages first and forced local pages last, both ascending; ranked
// pages in non-increasing score order.
inline void check_paged_selection(const PagedCase& c, const HostTensor& topk, double tie = 1e-4) {
  const auto req = c.requests();
  const auto iq = c.index_q.floats();
  const auto ids = topk.ints();
  const int64_t T = c.total_q();
  const int Hi = c.topo.num_index_heads;
  std::vector<std::string> problems(size_t(T * Hi));
#pragma omp parallel for schedule(dynamic)
  for (int64_t n = 0; n < T * Hi; ++n) {
    const int64_t r = n / Hi;
    const int g = int(n % Hi);
    const auto want = oracle::paged_select_row(c.topo, req, r, g, iq.data(), c.index_k_cache.view());
    const int32_t* got = ids.data() + (g * T + r) * 16;
    std::ostringstream err;
    int count = 0;
    while (count < 16 && got[count] >= 0) ++count;
    for (int s = count; s < 16; ++s)
      if (got[s] != -1) err << "slot " << s << " = " << got[s] << " after the valid prefix (want -1); ";
    if (count != int(want.ids.size())) err << count << " valid ids, want " << want.ids.size() << "; ";
    if (count > 0 && got[count - 1] != want.local) err << "last valid id " << got[count - 1] << " is not the local page " << want.local << "; ";
    std::set<int32_t> got_set(got, got + count), want_set(want.ids.begin(), want.ids.end());
    if (int(got_set.size()) != count) err << "duplicate ids; ";
    if (got_set != want_set) {
      if (!want.ranked) {
        err << "set differs from all visible pages; ";
      } else {
        // Forced pages must all be there; the others must reach the ranking threshold.
        for (int32_t id : want.ids)
          if ((id < want.init_end || id >= want.local_begin) && !got_set.count(id)) err << "forced page " << id << " missing; ";
        for (int s = 0; s < count; ++s) {
          const int32_t id = got[s];
          if (id < want.init_end || id >= want.local_begin) continue;
          if (id < 0 || id > want.local) {
            err << "id " << id << " is not visible; ";
          } else if (!(want.page_scores[size_t(id)] >= want.threshold - tie)) {
            err << "page " << id << " (score " << want.page_scores[size_t(id)] << ") is below the threshold "
                << want.threshold << "; ";
          }
        }
      }
    }
    if (want.ranked && count == int(want.ids.size())) {
      // Order: forced init pages ascending first, forced local pages ascending last.
      const int64_t locals = want.local - want.local_begin + 1;
      for (int64_t j = 0; j < want.init_end; ++j)
        if (got[j] != j) err << "slot " << j << " = " << got[j] << ", want init page " << j << "; ";
      for (int64_t j = 0; j < locals; ++j)
        if (got[count - locals + j] != want.local_begin + j)
          err << "slot " << count - locals + j << " = " << got[count - locals + j] << ", want local page " << want.local_begin + j << "; ";
    }
    if (want.ranked) {
      // Ranked pages come in non-increasing score order.
      int32_t previous = -1;
      for (int s = 0; s < count; ++s) {
        const int32_t id = got[s];
        if (id < want.init_end || id >= want.local_begin || id < 0) continue;
        if (previous >= 0 && want.page_scores[size_t(previous)] < want.page_scores[size_t(id)] - tie)
          err << "ranked pages not in score order at slot " << s << "; ";
        previous = id;
      }
    }
    problems[size_t(n)] = err.str();
  }
  int reported = 0;
  for (int64_t n = 0; n < T * Hi && reported < 5; ++n)
    if (!problems[size_t(n)].empty()) {
      ADD_FAILURE() << "topk[" << n % Hi << ", " << n / Hi << "]: " << problems[size_t(n)];
      ++reported;
    }
}

// Attention outputs against the oracle run with the library's own selection (docs/semantics.md §10): out
// rel. L2 < 1e-2 and atol = rtol = 3e-2, finite LSE atol = rtol = 1e-3, rows without keys
// exactly 0 / -inf, every element written.
inline void check_paged_attention(const PagedCase& c, const PagedOutputs& o, const std::vector<int64_t>& rows = {}) {
  const int Hq = c.topo.num_q_heads;
  const auto got_out = o.out.floats(), got_lse = o.lse.floats();
  EXPECT_EQ(count_nan(got_out), 0) << "out holds NaN (unwritten element, or a slot past seq_len was read)";
  EXPECT_EQ(count_nan(got_lse), 0) << "lse holds NaN (unwritten element, or a slot past seq_len was read)";
  const auto q = c.q.floats();
  const auto ids = o.topk.ints();
  const auto want = oracle::paged_attention(c.topo, c.requests(), q.data(), c.cache(), ids.data(), rows);
  std::vector<int64_t> all = rows;
  if (all.empty())
    for (int64_t r = 0; r < c.total_q(); ++r) all.push_back(r);
  std::vector<float> out_got, lse_got;
  std::vector<double> out_want, lse_want;
  for (int64_t r : all)
    for (int h = 0; h < Hq; ++h) {
      const size_t rh = size_t(r * Hq + h);
      if (std::isinf(want.lse[rh])) {
        EXPECT_TRUE(std::isinf(got_lse[rh]) && got_lse[rh] < 0) << "row " << r << " head " << h << ": lse " << got_lse[rh];
        for (int d = 0; d < 128; ++d)
          if (got_out[rh * 128 + size_t(d)] != 0.0f) {
            ADD_FAILURE() << "row " << r << " head " << h << " has no keys but out is not 0";
            break;
          }
        continue;
      }
      lse_got.push_back(got_lse[rh]);
      lse_want.push_back(want.lse[rh]);
      for (int d = 0; d < 128; ++d) {
        out_got.push_back(got_out[rh * 128 + size_t(d)]);
        out_want.push_back(want.out[rh * 128 + size_t(d)]);
      }
    }
  if (!out_want.empty()) {
    expect_rel_l2("out", out_got, out_want, 1e-2);
    expect_close("out", out_got, out_want, 3e-2, 3e-2, 128);
    expect_close("lse", lse_got, lse_want, 1e-3, 1e-3);
  }
}

// Rows worth checking against the oracle: every row of short requests, the page edges and
// ends of long ones, and a few random rows.
inline std::vector<int64_t> paged_sample_rows(const PagedCase& c, int extra, std::mt19937_64& rng) {
  std::set<int64_t> rows;
  for (size_t b = 0; b + 1 < c.cu_seqlens_q.size(); ++b) {
    const int64_t q0 = c.cu_seqlens_q[b], q_len = c.cu_seqlens_q[b + 1] - q0;
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t pos = c.seq_lens[b] - q_len + i;
      if (q_len <= 40 || i < 2 || i + 2 >= q_len || pos % 128 == 0 || pos % 128 == 127) rows.insert(q0 + i);
    }
  }
  if (c.total_q() > 0) {
    std::uniform_int_distribution<int64_t> pick(0, c.total_q() - 1);
    for (int n = 0; n < extra; ++n) rows.insert(pick(rng));
  }
  return {rows.begin(), rows.end()};
}

}  // namespace msa::test
