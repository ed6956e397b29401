// Paged (chunked) prefill against the float64 inference oracle: cached prefixes of 0, 1, 127,
// 128, 129 and more tokens, contexts shorter than one page, several requests per call,
// scattered and unordered page tables, strided views of a combined K|V cache, and equality
// with the packed training forward when there is no prefix.
#include "inference_support.h"

namespace msa::test {
namespace {

const Topology kSmall = Topology::minimax_m3(4);  // Hq 16, Hkv 1: the oracle stays fast

TEST(InferencePrefill, PrefixEdgesAgainstOracle) {
  MSA_SEEDED_RNG(rng);
  // prefix 0 / 1 / 127 / 128 / 129 tokens with chunks crossing page edges, a context shorter
  // than one page, and one request long enough (19 pages) for the ranking to matter.
  const PagedCase c = make_prefill_case(rng, kSmall, {0, 1, 127, 128, 129, 0, 2200},
                                        {200, 50, 3, 130, 1, 60, 230});
  const PagedOutputs o = run_paged(c);
  check_paged_selection(c, o.topk);
  check_paged_attention(c, o, paged_sample_rows(c, 20, rng));
}

TEST(InferencePrefill, FullTopologyGroupsSelectIndependently) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_prefill_case(rng, Topology::minimax_m3(), {2050, 5}, {40, 100});
  const PagedOutputs o = run_paged(c);
  check_paged_selection(c, o.topk);
  check_paged_attention(c, o, paged_sample_rows(c, 4, rng));
  // Four index heads with independent random index queries should not all pick the same pages.
  const auto ids = o.topk.ints();
  const int64_t T = c.total_q();
  int differing = 0;
  for (int64_t r = 0; r < 40; ++r)
    for (int g = 1; g < 4; ++g)
      differing += !std::equal(ids.begin() + (g * T + r) * 16, ids.begin() + (g * T + r + 1) * 16,
                               ids.begin() + r * 16);
  EXPECT_GT(differing, 0);
}

TEST(InferencePrefill, OrderOfOutputRows) {
  MSA_SEEDED_RNG(rng);
  // Short contexts: every visible page in ascending order, the local page last, -1 after.
  const PagedCase c = make_prefill_case(rng, kSmall, {0, 300}, {1, 2});
  const PagedOutputs o = run_paged(c);
  const auto ids = o.topk.ints();
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + 16),
            (std::vector<int32_t>{0, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1}));
  // Request 1: positions 300 and 301, pages 0..2.
  for (int r = 1; r <= 2; ++r)
    EXPECT_EQ(std::vector<int32_t>(ids.begin() + r * 16, ids.begin() + r * 16 + 4), (std::vector<int32_t>{0, 1, 2, -1}));
  check_paged_attention(c, o);
}

TEST(InferencePrefill, F32OutputAndSeparateHalvesMatchForward) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_prefill_case(rng, kSmall, {2100, 7}, {80, 9});
  const InferencePlan plan = c.plan();
  PagedOutputs a = make_outputs(c, DType::f32);
  paged_indexer(plan, indexer_params(c, a));
  paged_attention(plan, attention_params(c, a));
  const PagedOutputs b = run_paged(c, 0, DType::f32);
  EXPECT_EQ(a.topk.ints(), b.topk.ints());
  EXPECT_EQ(a.out.raw(), b.out.raw());
  EXPECT_EQ(a.lse.raw(), b.lse.raw());
  check_paged_attention(c, a, paged_sample_rows(c, 4, rng));
}

TEST(InferencePrefill, StridedViewsOfACombinedCache) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_prefill_case(rng, kSmall, {130, 0}, {20, 30});
  // Copy K and V into the two halves of one [pages, Hkv, 128, 256] cache.
  const int Hkv = c.topo.num_kv_heads;
  HostTensor kv(DType::bf16, {c.physical_pages, Hkv, 128, 256});
  for (int64_t row = 0; row < c.physical_pages * Hkv * 128; ++row)
    for (int d = 0; d < 128; ++d) {
      kv.data<uint16_t>()[row * 256 + d] = c.k.data<uint16_t>()[row * 128 + d];
      kv.data<uint16_t>()[row * 256 + 128 + d] = c.v.data<uint16_t>()[row * 128 + d];
    }
  const std::vector<int64_t> shape = {c.physical_pages, Hkv, 128, 128};
  const std::vector<int64_t> stride = {int64_t(Hkv) * 128 * 256, 128 * 256, 256, 1};
  const InferencePlan plan = c.plan();
  PagedOutputs o = make_outputs(c);
  PagedAttentionParams a = attention_params(c, o);
  a.topk = {};
  a.kv.k = TensorView::strided(kv.data<uint16_t>(), DType::bf16, shape, stride);
  a.kv.v = TensorView::strided(kv.data<uint16_t>() + 128, DType::bf16, shape, stride);
  paged_forward(plan, indexer_params(c, o), a);
  const PagedOutputs want = run_paged(c);
  EXPECT_EQ(o.out.raw(), want.out.raw());
  EXPECT_EQ(o.lse.raw(), want.lse.raw());
  check_paged_attention(c, o);
}

TEST(InferencePrefill, CallerSelectionInAnyOrder) {
  MSA_SEEDED_RNG(rng);
  // paged_attention accepts any valid prefix order (local first here) and fewer pages.
  const PagedCase c = make_prefill_case(rng, kSmall, {600}, {4});
  const InferencePlan plan = c.plan();
  PagedOutputs o = make_outputs(c);
  for (int r = 0; r < 4; ++r) {
    const int32_t row[16] = {4, 0, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    std::copy(row, row + 16, o.topk.data<int32_t>() + r * 16);
  }
  paged_attention(plan, attention_params(c, o));
  check_paged_attention(c, o);
}

TEST(InferencePrefill, ForcedInitAndLocalPages) {
  MSA_SEEDED_RNG(rng);
  Topology topo = kSmall;
  topo.init_blocks = 2;
  topo.local_blocks = 3;
  const PagedCase c = make_prefill_case(rng, topo, {2100, 300}, {60, 5});
  const PagedOutputs o = run_paged(c);
  check_paged_selection(c, o.topk);
  check_paged_attention(c, o, paged_sample_rows(c, 4, rng));
}

class InferencePrefillTraining : public ::testing::TestWithParam<int> {};

TEST_P(InferencePrefillTraining, EmptyPrefixEqualsPackedTrainingForward) {
  MSA_SEEDED_RNG(rng);
  Topology topo = kSmall;
  if (GetParam() == 1) {  // other forcing settings select the same way as select_blocks
    topo.init_blocks = 1;
    topo.local_blocks = 2;
  }
  const std::vector<int64_t> lengths = {2300, 90, 129};
  const PackedLayout L = layout_of(lengths);
  const int64_t T = L.total_q();
  const HostTensor q = random_tensor(rng, {T, topo.num_q_heads, 128}), k = random_tensor(rng, {T, topo.num_kv_heads, 128}),
                   v = random_tensor(rng, {T, topo.num_kv_heads, 128}), iq = random_tensor(rng, {T, topo.num_index_heads, 128}),
                   ik = random_tensor(rng, {T, 1, 128});

  // Training: select_blocks + sparse_attention_forward on the packed tensors.
  HostTensor topk_train(DType::i32, {topo.num_index_heads, T, 16});
  SelectBlocksParams sp;
  sp.index_q = iq.view();
  sp.index_k = ik.view();
  sp.topk = topk_train.view();
  select_blocks(topo, L, sp);
  const SparsePlan splan = build_plan(topo, L, topk_train.view());
  HostTensor out_train(DType::f32, {T, topo.num_q_heads, 128}), lse_train(DType::f32, {T, topo.num_q_heads});
  AttentionForwardParams fp;
  fp.q = q.view();
  fp.k = k.view();
  fp.v = v.view();
  fp.topk = topk_train.view();
  fp.out = out_train.view();
  fp.lse = lse_train.view();
  sparse_attention_forward(topo, L, splan, fp);

  // Inference: the same tokens inserted into scattered pages, then one paged prefill call.
  std::vector<int32_t> seq_lens(lengths.begin(), lengths.end());
  PagedCase c = make_prefill_case(rng, topo, {0, 0, 0}, seq_lens);
  c.q = q;
  c.index_q = iq;
  const InferencePlan plan = c.plan();
  KvInsertParams ins;
  ins.k = k.view();
  ins.v = v.view();
  ins.index_k = ik.view();
  ins.slot_mapping = plan.slot_mapping.view();
  ins.cache = c.cache();
  ins.index_k_cache = c.index_k_cache.view();
  insert_kv(ins);
  const PagedOutputs o = run_paged(c, 0, DType::f32);

  EXPECT_EQ(o.topk.ints(), topk_train.ints());
  const auto out = o.out.floats(), want_out = out_train.floats();
  expect_rel_l2("out vs training", out, std::vector<double>(want_out.begin(), want_out.end()), 1e-5);
  const auto lse = o.lse.floats(), want_lse = lse_train.floats();
  expect_close("lse vs training", lse, std::vector<double>(want_lse.begin(), want_lse.end()), 1e-5, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Forcing, InferencePrefillTraining, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == 0 ? "m3" : "init1_local2");
                         });

}  // namespace
}  // namespace msa::test
