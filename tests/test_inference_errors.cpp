// Contract tests of the inference API: every invalid request metadata, shape, dtype, stride,
// scale and id gets its named error (docs/semantics.md §13), and a rejected call leaves
// every output untouched.
#include "inference_support.h"

namespace msa::test {
namespace {

const Topology kSmall = Topology::minimax_m3(4);

// Runs `call`, expects the error, and checks that the given outputs kept their bytes.
void expect_rejected(const std::function<void()>& call, const std::vector<std::string>& pieces,
                     const std::vector<const HostTensor*>& outputs, ErrorKind kind = ErrorKind::invalid_argument) {
  std::vector<std::vector<unsigned char>> before;
  for (const HostTensor* t : outputs) before.push_back(t->raw());
  expect_error(call, pieces, kind);
  for (size_t i = 0; i < outputs.size(); ++i) EXPECT_EQ(outputs[i]->raw(), before[i]) << "output " << i << " was written";
}

// ---- plans -------------------------------------------------------------------------------

struct PrefillInputs {
  std::vector<int32_t> cu = {0, 3, 5}, seq = {3, 130};
  std::vector<int32_t> table = {4, -1, 1, 0};
  int64_t width = 2;
  InferencePlan plan(InferencePlanOptions o = {}, Topology topo = kSmall) const {
    const HostTensor c = int_tensor(cu, {int64_t(cu.size())}), s = int_tensor(seq, {int64_t(seq.size())}),
                     t = int_tensor(table, {int64_t(seq.size()), width});
    PagedPrefillMetadata m{c.view(), s.view(), t.view()};
    return plan_paged_prefill(topo, m, o);
  }
};

TEST(InferenceErrors, PrefillPlan) {
  EXPECT_NO_THROW(PrefillInputs{}.plan());
  {
    PrefillInputs in;
    in.seq = {3, 300};  // needs 3 pages, the table has 2
    expect_error([&] { in.plan(); }, {"page_table capacity is smaller than max_seqlen_k", "max_pages = 2", "seq_lens[1] = 300"});
  }
  {
    PrefillInputs in;
    in.seq = {3, 8193 * 128};
    expect_error([&] { in.plan(); }, {"the maximum page count must be in [1, 8192]", "8193 pages"});
  }
  {
    PrefillInputs in;
    in.seq = {2, 130};
    expect_error([&] { in.plan(); }, {"query position is outside its KV sequence", "request 0 has 3 queries", "seq_lens[0] = 2"});
  }
  {
    PrefillInputs in;
    in.cu = {0, 3, 2};
    expect_error([&] { in.plan(); }, {"cu_seqlens_q must be non-decreasing"});
  }
  {
    PrefillInputs in;
    in.cu = {1, 3, 5};
    expect_error([&] { in.plan(); }, {"cu_seqlens_q[0] must be 0"});
  }
  {
    PrefillInputs in;
    in.cu = {0, 3};
    expect_error([&] { in.plan(); }, {"cu_seqlens_q must have shape [batch + 1=3]", "got [2]"});
  }
  {
    PrefillInputs in;
    in.table = {4, -1, -1, 0};  // request 1 (130 tokens) has no page 0
    expect_error([&] { in.plan(); }, {"page_table[1, 0] = -1 maps a page inside seq_lens[1] = 130"});
  }
  {
    PrefillInputs in;
    in.table = {4, -1, 1, 1 << 24};
    expect_error([&] { in.plan(); }, {"page_table[1, 1] = 16777216", "must fit in int32"});
  }
  {
    const PrefillInputs in;
    const HostTensor c = int_tensor(in.cu, {3}), s = int_tensor(in.seq, {2}), t = int_tensor(in.table, {4});
    expect_error([&] { plan_paged_prefill(kSmall, {c.view(), s.view(), t.view()}); },
                 {"page_table must have shape [batch, max_pages]", "got [4]"});
    HostTensor f(DType::f32, {2});
    expect_error([&] { plan_paged_prefill(kSmall, {c.view(), f.view(), t.view()}); }, {"seq_lens must be int32, got f32"});
    TensorView on_gpu = s.view();
    on_gpu.device = Device::cuda(0);
    expect_error([&] { plan_paged_prefill(kSmall, {c.view(), on_gpu, t.view()}); }, {"seq_lens must be a CPU tensor"});
  }
  expect_error([&] { PrefillInputs{}.plan({.num_kv_splits = 4}); }, {"num_kv_splits applies to decode only"});
  expect_error([&] { PrefillInputs{}.plan({.num_threads = -1}); }, {"num_threads must be in [0, 4096]"});
  Topology bad = kSmall;
  bad.num_q_heads = 24;
  expect_error([&] { PrefillInputs{}.plan({}, bad); }, {"num_q_heads must be 16 * num_kv_heads"});
  bad = kSmall;
  bad.num_index_heads = 2;
  expect_error([&] { PrefillInputs{}.plan({}, bad); }, {"num_index_heads must equal num_kv_heads"});
  bad = kSmall;
  bad.softmax_scale = std::numeric_limits<float>::infinity();
  expect_error([&] { PrefillInputs{}.plan({}, bad); }, {"softmax_scale must be finite"});
#if !MSA_WITH_CUDA
  expect_error([&] { PrefillInputs{}.plan({.device = Device::cuda(0)}); }, {"built without the CUDA backend"},
               ErrorKind::unsupported);
#endif
}

TEST(InferenceErrors, DecodePlan) {
  const HostTensor s = int_tensor({8, 0, 300}, {3}), t = int_tensor({0, -1, -1, -1, -1, -1, 1, 2, 3}, {3, 3});
  auto plan = [&](int q, int splits, const HostTensor& seq) {
    DecodeMetadata m{seq.view(), t.view(), q};
    return plan_decode(kSmall, m, {.num_kv_splits = splits});
  };
  EXPECT_NO_THROW(plan(8, 0, s));
  for (int q : {0, 17, -3})
    expect_error([&] { plan(q, 0, s); }, {"query_length (q_len_per_req) must be an integer in [1, 16], got " + std::to_string(q)});
  expect_error([&] { plan(1, 3, s); }, {"num_kv_splits must be 0 (automatic), 1, 2, 4, 8 or 16, got 3"});
  const HostTensor short_seq = int_tensor({5, 0, 300}, {3});
  expect_error([&] { plan(8, 0, short_seq); }, {"seq_lens[0] = 5 must be 0 (a padding row) or >= q_len_per_req = 8"});
  const HostTensor negative = int_tensor({8, -1, 300}, {3});
  expect_error([&] { plan(1, 0, negative); }, {"seq_lens[1] = -1"});
  const HostTensor empty(DType::i32, {0});
  const HostTensor no_table(DType::i32, {0, 3});
  expect_error([&] { plan_decode(kSmall, {empty.view(), no_table.view(), 1}); }, {"decode requires batch >= 1"});
}

// ---- runs --------------------------------------------------------------------------------

class InferenceRunErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(7);
    c = make_decode_case(rng, kSmall, {200, 3}, 2, {.format = KvFormat::fp8_e4m3});
    plan = c.plan();
    o = make_outputs(c);
  }
  // Runs paged_forward with the (possibly edited) params; checks the named error, untouched outputs.
  void expect_forward_error(const PagedIndexerParams& ip, const PagedAttentionParams& ap,
                            const std::vector<std::string>& pieces, ErrorKind kind = ErrorKind::invalid_argument) {
    expect_rejected([&] { paged_forward(plan, ip, ap); }, pieces, {&o.topk, &o.out, &o.lse}, kind);
  }
  PagedAttentionParams attention() const {
    PagedAttentionParams a = attention_params(c, o);
    a.topk = {};
    return a;
  }
  PagedCase c;
  InferencePlan plan;
  PagedOutputs o;
};

TEST_F(InferenceRunErrors, ValidCallsRun) {
  EXPECT_NO_THROW(paged_forward(plan, indexer_params(c, o), attention()));
  EXPECT_NO_THROW(paged_attention(plan, attention_params(c, o)));
}

TEST_F(InferenceRunErrors, IndexerTensors) {
  const PagedAttentionParams a = attention();
  PagedIndexerParams ip = indexer_params(c, o);
  HostTensor wrong_q(DType::bf16, {4, 2, 128});
  ip.index_q = wrong_q.view();
  expect_forward_error(ip, a, {"index_q must have shape [batch * Q=4, Hi=1, 128], got [4, 2, 128]"});
  HostTensor f32_q(DType::f32, {4, 1, 128});
  ip.index_q = f32_q.view();
  expect_forward_error(ip, a, {"index_q must be bf16 or fp8_e4m3, got f32"});
  ip = indexer_params(c, o);
  HostTensor wrong_cache(DType::bf16, {c.physical_pages, 1, 128, 128});
  ip.index_k_cache = wrong_cache.view();
  expect_forward_error(ip, a, {"index_k_cache must have shape [physical_pages, 128, 128], got"});
  HostTensor few_pages(DType::bf16, {1, 128, 128});
  ip.index_k_cache = few_pages.view();
  expect_forward_error(ip, a, {"index_k_cache has 1 physical pages but the plan's page_table refers to physical page"});
  ip = indexer_params(c, o);
  HostTensor wrong_topk(DType::i32, {1, 4, 8});
  ip.topk = wrong_topk.view();
  expect_forward_error(ip, a, {"topk must have shape [Hi=1, batch * Q=4, 16], got [1, 4, 8]"});
  ip = indexer_params(c, o);
  ip.index_q = TensorView::strided(c.index_q.view().data, DType::bf16, {4, 1, 64}, {128, 128, 2});
  expect_forward_error(ip, a, {"index_q must have shape"});
  ip.index_q = TensorView::strided(c.index_q.view().data, DType::bf16, {4, 1, 128}, {128, 128, 2});
  expect_forward_error(ip, a, {"index_q must have a contiguous last dimension"});
  ip = indexer_params(c, o);
  TensorView gpu = ip.index_q;
  gpu.device = Device::cuda(0);
  ip.index_q = gpu;
  expect_forward_error(ip, a, {"the plan was built for cpu but the inputs are on cuda:0"});
  ip = indexer_params(c, o);
  PagedAttentionParams other = attention_params(c, o);
  HostTensor other_topk(DType::i32, {1, 4, 16});
  other.topk = other_topk.view();
  expect_forward_error(ip, other, {"attention.topk must be absent or the same tensor as indexer.topk"});
}

TEST_F(InferenceRunErrors, CacheTensors) {
  const PagedIndexerParams ip = indexer_params(c, o);
  PagedAttentionParams a = attention();
  HostTensor short_k(DType::f8e4m3, {c.physical_pages, 1, 64, 128});
  a.kv.k = short_k.view();
  expect_forward_error(ip, a, {"k_cache must have shape [physical_pages, Hkv, 128, 128] (Hkv = 1), got"});
  a = attention();
  HostTensor short_v(DType::f8e4m3, {c.physical_pages - 1, 1, 128, 128});
  a.kv.v = short_v.view();
  expect_forward_error(ip, a, {"v_cache must have the same shape as k_cache"});
  a = attention();
  a.kv.format = KvFormat::bf16;
  expect_forward_error(ip, a, {"k_cache must be bf16 for kv format bf16, got fp8_e4m3"});
  a = attention();
  a.kv.format = KvFormat::nvfp4;
  expect_forward_error(ip, a, {"k_cache must be uint8 for kv format nvfp4, got fp8_e4m3"});
  a = attention();
  HostTensor one_page_k(DType::f8e4m3, {1, 1, 128, 128}), one_page_v(DType::f8e4m3, {1, 1, 128, 128});
  a.kv.k = one_page_k.view();
  a.kv.v = one_page_v.view();
  expect_forward_error(ip, a, {"k_cache has 1 physical pages but the plan's page_table refers to physical page"});
  a = attention();
  a.kv.v_scale = {};
  expect_forward_error(ip, a, {"k_scale and v_scale must be both provided or both absent"});
  a = attention();
  HostTensor per_token(DType::f32, {1, 16});
  a.kv.k_scale = per_token.view();
  a.kv.v_scale = per_token.view();
  expect_forward_error(ip, a, {"per-token/head KV scales must have shape [num_kv_heads, max_kv_tokens]",
                               "max_kv_tokens >= physical_pages * 128"});
  HostTensor rank3(DType::f32, {1, 1, 1});
  a.kv.k_scale = rank3.view();
  a.kv.v_scale = rank3.view();
  expect_forward_error(ip, a, {"KV scales must be per-tensor scalars ([] or [1]) or per-(head, token) scales"});
  HostTensor big(DType::f32, {1, c.physical_pages * 128});
  a.kv.k_scale = big.view();
  a.kv.v_scale = c.v_scale.view();
  expect_forward_error(ip, a, {"k_scale and v_scale must have the same form"});
  HostTensor bad_value(DType::f32, {1});
  bad_value.set(0, -1.0f);
  a.kv.k_scale = bad_value.view();
  a.kv.v_scale = c.v_scale.view();
  expect_forward_error(ip, a, {"k_scale must be finite and > 0, got -1"});
  HostTensor f16_scale(DType::f16, {1});
  a.kv.k_scale = f16_scale.view();
  expect_forward_error(ip, a, {"k_scale must be f32, got f16"});
}

TEST(InferenceErrorsCache, FormatSpecificTensors) {
  std::mt19937_64 rng(11);
  const PagedCase bf = make_decode_case(rng, kSmall, {10}, 1);
  const PagedCase fp4 = make_decode_case(rng, kSmall, {10}, 1, {.format = KvFormat::nvfp4});
  for (const PagedCase* c : {&bf, &fp4}) {
    const InferencePlan plan = c->plan();
    PagedOutputs o = make_outputs(*c);
    const PagedIndexerParams ip = indexer_params(*c, o);
    PagedAttentionParams a = attention_params(*c, o);
    a.topk = {};
    auto rejected = [&](const PagedAttentionParams& p, const std::vector<std::string>& pieces) {
      expect_rejected([&] { paged_forward(plan, ip, p); }, pieces, {&o.topk, &o.out, &o.lse});
    };
    HostTensor s(DType::f32, {1});
    s.set(0, 1.0f);
    if (c->format == KvFormat::bf16) {
      a.kv.k_scale = s.view();
      a.kv.v_scale = s.view();
      rejected(a, {"k_scale / v_scale apply to fp8_e4m3 and nvfp4 caches only"});
      a = attention_params(*c, o);
      a.topk = {};
      a.kv.k_block_scale = fp4.k_sf.view();
      rejected(a, {"k_block_scale / v_block_scale belong to nvfp4 caches"});
    } else {
      a.kv.v_block_scale = {};
      rejected(a, {"v_block_scale is required but was not given"});
      a = attention_params(*c, o);
      a.topk = {};
      HostTensor wrong_sf(DType::f8e4m3, {c->physical_pages, 1, 128, 16});
      a.kv.k_block_scale = wrong_sf.view();
      rejected(a, {"k_block_scale must have shape [physical_pages, Hkv, 128, 8]"});
      a = attention_params(*c, o);
      a.topk = {};
      HostTensor per_token(DType::f32, {1, c->physical_pages * 128});
      a.kv.k_scale = per_token.view();
      a.kv.v_scale = per_token.view();
      rejected(a, {"k_scale of an nvfp4 cache must be a per-tensor global scale ([] or [1])"});
    }
  }
}

TEST_F(InferenceRunErrors, AttentionTensorsAndTopkContents) {
  PagedAttentionParams a = attention_params(c, o);
  paged_indexer(plan, indexer_params(c, o));
  const HostTensor good_topk = o.topk;
  poison(o.out);
  poison(o.lse);
  auto expect_attention_error = [&](const PagedAttentionParams& p, const std::vector<std::string>& pieces) {
    expect_rejected([&] { paged_attention(plan, p); }, pieces, {&o.out, &o.lse});
  };
  HostTensor wrong_q(DType::bf16, {4, 64, 128});
  a.q = wrong_q.view();
  expect_attention_error(a, {"q must have shape [batch * Q=4, Hq=16, 128], got [4, 64, 128]"});
  a = attention_params(c, o);
  HostTensor wrong_out(DType::f16, {4, 16, 128});
  a.out = wrong_out.view();
  expect_attention_error(a, {"out must be bf16 or f32, got f16"});
  a = attention_params(c, o);
  HostTensor wrong_lse(DType::f32, {16, 4});
  a.lse = wrong_lse.view();
  expect_attention_error(a, {"lse must have shape [batch * Q=4, Hq=16], got [16, 4]"});
  a = attention_params(c, o);
  HostTensor wrong_topk(DType::i32, {2, 4, 16});
  a.topk = wrong_topk.view();
  expect_attention_error(a, {"topk must have shape [Hkv=1, batch * Q=4, 16], got [2, 4, 16]"});

  // Contents: rows 0/1 are request 0 at positions 198/199 (pages 0..1), rows 2/3 request 1 at 1/2.
  HostTensor t = good_topk;
  a = attention_params(c, o);
  a.topk = t.view();
  auto edit = [&](int row, std::vector<int32_t> ids) {
    t = good_topk;
    ids.resize(16, -1);
    std::copy(ids.begin(), ids.end(), t.data<int32_t>() + row * 16);
    a.topk = t.view();
  };
  edit(0, {0, -1, 1});
  expect_attention_error(a, {"topk[0, 0, :]: valid page ids must form a prefix followed by -1"});
  edit(0, {1, 2});
  expect_attention_error(a, {"topk[0, 0, 1] = 2 is not a visible page: row 0 (position 198) sees logical pages 0..1"});
  edit(1, {1, 1});
  expect_attention_error(a, {"topk[0, 1, :] holds page 1 twice (slots 0 and 1)"});
  edit(2, {-2});
  expect_attention_error(a, {"topk[0, 2, 0] must be a page id or -1, got -2"});
  edit(3, {0});
  EXPECT_NO_THROW(paged_attention(plan, a));
}

TEST(InferenceErrorsPadding, PaddingRowsNeedEmptySelections) {
  std::mt19937_64 rng(3);
  const PagedCase c = make_decode_case(rng, kSmall, {0, 40}, 1);
  const InferencePlan plan = c.plan();
  PagedOutputs o = make_outputs(c);
  paged_indexer(plan, indexer_params(c, o));
  o.topk.data<int32_t>()[0] = 0;  // row 0 is a padding row
  poison(o.out);
  poison(o.lse);
  expect_rejected([&] { paged_attention(plan, attention_params(c, o)); },
                  {"topk[0, 0, 0] = 0 but row 0 is a padding row (negative causal position): it needs all -1"},
                  {&o.out, &o.lse});
}

// ---- pre-processing, insertion, conversion ----------------------------------------------

TEST(InferenceErrorsPreprocess, NormRopeAndInsert) {
  HostTensor x(DType::bf16, {3, 2, 128}), out(DType::bf16, {3, 2, 128}), w(DType::f32, {128});
  poison(out);
  const HostTensor pos = int_tensor({0, 1, 2}, {3});
  RmsNormRopeParams p;
  p.x = x.view();
  p.weight = w.view();
  p.positions = pos.view();
  p.out = out.view();
  EXPECT_NO_THROW(rms_norm_rope(p));
  poison(out);
  RmsNormRopeParams bad = p;
  bad.config.rotary_dim = 63;
  expect_rejected([&] { rms_norm_rope(bad); }, {"rotary_dim must be even and in [0, 128], got 63"}, {&out});
  bad = p;
  bad.config.eps = 0;
  expect_rejected([&] { rms_norm_rope(bad); }, {"eps must be finite and > 0"}, {&out});
  bad = p;
  bad.positions = {};
  expect_rejected([&] { rms_norm_rope(bad); }, {"positions is required but was not given"}, {&out});
  bad = p;
  HostTensor w64(DType::f32, {64});
  bad.weight = w64.view();
  expect_rejected([&] { rms_norm_rope(bad); }, {"weight must have shape [128], got [64]"}, {&out});
  bad = p;
  HostTensor x2(DType::bf16, {3, 2, 64});
  bad.x = x2.view();
  expect_rejected([&] { rms_norm_rope(bad); }, {"x must have shape [tokens=3, H=2, 128], got [3, 2, 64]"}, {&out});

  // Insertion.
  std::mt19937_64 rng(5);
  PagedCase c = make_prefill_case(rng, kSmall, {0}, {10});  // 1 + 3 spare physical pages
  const HostTensor k = random_tensor(rng, {2, 1, 128}), v = random_tensor(rng, {2, 1, 128});
  auto insert_with = [&](const std::vector<int32_t>& slot_values) {
    const HostTensor slots = int_tensor(slot_values, {2});
    KvInsertParams ip;
    ip.k = k.view();
    ip.v = v.view();
    ip.slot_mapping = slots.view();
    ip.cache = c.cache();
    insert_kv(ip);
  };
  EXPECT_NO_THROW(insert_with({0, -1}));
  expect_rejected([&] { insert_with({5, 4 * 128}); }, {"slot_mapping[1] = 512 must be -1 or a slot in [0, physical_pages * 128 = 512)"},
                  {&c.k, &c.v});
  expect_rejected([&] { insert_with({7, 7}); }, {"slot_mapping[1] = 7 repeats a slot"}, {&c.k, &c.v});
  expect_rejected([&] { insert_with({-2, 7}); }, {"slot_mapping[0] = -2"}, {&c.k, &c.v});
  {
    const HostTensor slots = int_tensor({1, 2}, {2});
    KvInsertParams ip;
    ip.k = k.view();
    ip.v = v.view();
    ip.slot_mapping = slots.view();
    ip.cache = c.cache();
    ip.index_k_cache = c.index_k_cache.view();
    expect_rejected([&] { insert_kv(ip); }, {"index_k_cache / index_k_norm were given without index_k"}, {&c.k, &c.v});
    ip.index_k_cache = {};
    const HostTensor kw(DType::f32, {128});
    ip.k_norm = kw.view();
    expect_rejected([&] { insert_kv(ip); }, {"positions is required but was not given"}, {&c.k, &c.v});
    ip.k_norm = {};
    HostTensor wide_v(DType::bf16, {2, 2, 128});
    ip.v = wide_v.view();
    expect_rejected([&] { insert_kv(ip); }, {"v must have shape [tokens=2, Hkv=1, 128], got [2, 2, 128]"}, {&c.k, &c.v});
  }
}

TEST(InferenceErrorsPreprocess, Nvfp4Conversion) {
  HostTensor packed(DType::u8, {3, 1, 128, 64}), sf(DType::f8e4m3, {3, 1, 128, 8}), out(DType::f8e4m3, {2, 1, 128, 128});
  poison(out);
  const HostTensor ids = int_tensor({2, 3}, {2});
  Nvfp4ToFp8Params p;
  p.packed = packed.view();
  p.block_scale = sf.view();
  p.page_ids = ids.view();
  p.out = out.view();
  expect_rejected([&] { nvfp4_to_fp8(p); }, {"page_ids[1] = 3 must be -1 or a page in [0, 3)"}, {&out});
  p.page_ids = {};
  expect_rejected([&] { nvfp4_to_fp8(p); }, {"out must have shape [physical_pages, Hkv, 128, 128] = [3, 1, 128, 128], got [2, 1, 128, 128]"},
                  {&out});
  HostTensor wrong_packed(DType::u8, {3, 1, 128, 128});
  p.packed = wrong_packed.view();
  expect_rejected([&] { nvfp4_to_fp8(p); }, {"packed must have shape [physical_pages, Hkv, 128, 64]"}, {&out});
}

}  // namespace
}  // namespace msa::test
