// sparse_attention_forward against the float64 oracle (docs/semantics.md §4, §10), on the library's
// own selection so that selection near-ties cannot leak into attention results.
#include <algorithm>
#include <numeric>

#include "test_support.h"

namespace msa::test {
namespace {

// A custom selection: for every (head, query) row `pick(position, nvis)` returns the ids.
template <typename Pick>
HostTensor custom_selection(const Topology& topo, const PackedLayout& L, Pick pick) {
  HostTensor t(DType::i32, {topo.num_kv_heads, L.total_q(), topo.topk});
  int32_t* ids = t.data<int32_t>();
  std::fill(ids, ids + t.numel(), -1);
  for (const DocumentSpan& d : L.documents())
    for (int64_t i = 0; i < d.q_len; ++i) {
      const int64_t p = d.k_len - d.q_len + i;
      for (int g = 0; g < topo.num_kv_heads; ++g) {
        const std::vector<int32_t> row = pick(p, int(p / topo.block_size) + 1, g);
        std::copy(row.begin(), row.end(), ids + (g * L.total_q() + d.q_start + i) * topo.topk);
      }
    }
  return t;
}

TEST(AttentionForward, SmallPackDefaultTopology) {
  MSA_SEEDED_RNG(rng);
  const AttentionCase c = make_case(rng, Topology{}, layout_of({1, 127, 128, 129, 300}));
  check_forward(c, run_forward(c));
}

TEST(AttentionForward, SharpSoftmax) {
  MSA_SEEDED_RNG(rng);
  // q, k of scale 1.5: logits with standard deviation ~2.3, so the running maximum of an online
  // softmax moves often and by a lot.
  const PackedLayout L = layout_of({120, 1, 300}, {2400, 1, 300});
  const AttentionCase c = make_case(rng, Topology{}, L, {}, 1.5f);
  check_forward(c, run_forward(c));
}

TEST(AttentionForward, ChunkedPrefillWithRankedSelection) {
  MSA_SEEDED_RNG(rng);
  // Queries at positions k_len - q_len + i: the first document's queries see 19-21 blocks.
  const AttentionCase c = make_case(rng, Topology{}, layout_of({200, 50, 1, 0}, {2600, 700, 1500, 300}));
  check_forward(c, run_forward(c));
}

TEST(AttentionForward, MixedPackSampledRows) {
  MSA_SEEDED_RNG(rng);
  // Documents of 1, 127, 128, 129, 2047, 2048 and 2049 tokens in one pack; the oracle checks
  // the edge rows of every document and block plus random rows.
  const PackedLayout L = layout_of({1, 127, 128, 129, 2047, 2048, 2049});
  const AttentionCase c = make_case(rng, Topology::minimax_m3(4), L);
  check_forward(c, run_forward(c), sample_rows(L, 300, rng));
}

TEST(AttentionForward, FragmentsShareOneKvRange) {
  MSA_SEEDED_RNG(rng);
  // Document A (2300 tokens) stored once as keys [0, 2300); this rank holds its queries
  // [0, 200) and [2100, 2300) as fragments reading from fragment 0's start; document B plain.
  const PackedLayout L = PackedLayout::from_cu_seqlens({0, 200, 400, 530}, {0, 200, 2300, 2430}, {0, 0, 2});
  const AttentionCase c = make_case(rng, Topology{}, L);
  check_forward(c, run_forward(c));
}

TEST(AttentionForward, TensorParallelTopologies) {
  MSA_SEEDED_RNG(rng);
  const PackedLayout L = layout_of({150, 1, 300}, {2500, 1, 300});
  for (int tp : {2, 4}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const AttentionCase c = make_case(rng, Topology::minimax_m3(tp), L);
    check_forward(c, run_forward(c));
  }
}

TEST(AttentionForward, InitAndLocalForcedSelections) {
  MSA_SEEDED_RNG(rng);
  const PackedLayout L = layout_of({100, 200}, {2400, 200});
  for (auto [init, local] : {std::pair{2, 3}, std::pair{1, 2}}) {
    SCOPED_TRACE("init_blocks " + std::to_string(init) + " local_blocks " + std::to_string(local));
    Topology topo;
    topo.init_blocks = init;
    topo.local_blocks = local;
    const AttentionCase c = make_case(rng, topo, L);
    check_forward(c, run_forward(c));
  }
}

TEST(AttentionForward, Float32Output) {
  MSA_SEEDED_RNG(rng);
  const AttentionCase c = make_case(rng, Topology{}, layout_of({64, 20}, {2200, 20}));
  check_forward(c, run_forward(c, DType::f32));
}

TEST(AttentionForward, HistoryInAnyOrderWithLocalLast) {
  MSA_SEEDED_RNG(rng);
  // Consumers take the valid prefix as a set: shuffled history, the local block last.
  const Topology topo;
  const PackedLayout L = layout_of({100, 130}, {2700, 130});
  HostTensor topk = custom_selection(topo, L, [&](int64_t, int nvis, int) {
    std::vector<int32_t> history(size_t(nvis - 1));
    std::iota(history.begin(), history.end(), 0);
    std::shuffle(history.begin(), history.end(), rng);
    history.resize(std::min<size_t>(history.size(), 15));
    history.push_back(nvis - 1);
    return history;
  });
  const AttentionCase c = make_case(rng, topo, L, std::move(topk));
  check_forward(c, run_forward(c));
}

// Any valid prefix (ops.h build_plan): the local block anywhere in it, or absent.
HostTensor any_order_selection(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L) {
  std::bernoulli_distribution drop_local(0.3);
  return custom_selection(topo, L, [&](int64_t, int nvis, int) {
    std::vector<int32_t> ids(static_cast<size_t>(nvis));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end() - 1, rng);
    ids.resize(std::min<size_t>(ids.size() - 1, 15));
    if (!drop_local(rng) || ids.empty()) ids.push_back(nvis - 1);
    std::shuffle(ids.begin(), ids.end(), rng);
    return ids;
  });
}

TEST(AttentionForward, AnyOrderAndRowsWithoutTheLocalBlock) {
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({100, 130, 1}, {2700, 130, 1});
  const AttentionCase c = make_case(rng, topo, L, any_order_selection(rng, topo, L));
  check_forward(c, run_forward(c));
}

TEST(AttentionForward, PartialSelectionsAndEmptyRows) {
  MSA_SEEDED_RNG(rng);
  // Spec §8.4: a row with no selected block gives out = 0 and lse = -inf. Other rows take a
  // few history blocks (fewer than allowed) plus the local block.
  const Topology topo;
  const PackedLayout L = layout_of({90, 1, 257}, {2400, 1, 257});
  std::uniform_int_distribution<int> coin(0, 3);
  HostTensor topk = custom_selection(topo, L, [&](int64_t, int nvis, int) {
    std::vector<int32_t> row;
    if (coin(rng) == 0) return row;  // empty
    for (int b = 0; b + 1 < nvis; b += 3) row.push_back(b);
    if (row.size() > 15) row.resize(15);
    row.push_back(nvis - 1);
    return row;
  });
  const AttentionCase c = make_case(rng, topo, L, std::move(topk));
  check_forward(c, run_forward(c));
}

TEST(AttentionForward, AllRowsEmpty) {
  const Topology topo;
  std::mt19937_64 rng(7);
  const PackedLayout L = layout_of({3, 200});
  HostTensor topk = custom_selection(topo, L, [](int64_t, int, int) { return std::vector<int32_t>{}; });
  const AttentionCase c = make_case(rng, topo, L, std::move(topk));
  const ForwardOutputs o = run_forward(c);
  for (float x : o.out.floats()) ASSERT_EQ(x, 0.0f);
  for (float x : o.lse.floats()) ASSERT_TRUE(std::isinf(x) && x < 0) << x;
}

TEST(AttentionForward, NoQueriesAtAll) {
  // Keys but no queries anywhere: every op accepts the empty tensors and writes nothing.
  std::mt19937_64 rng(11);
  const Topology topo;
  const PackedLayout L = layout_of({0, 0}, {5, 300});
  ASSERT_EQ(L.total_q(), 0);
  const AttentionCase c = make_case(rng, topo, L);
  EXPECT_EQ(c.plan.work_count, 0);
  const ForwardOutputs o = run_forward(c);
  EXPECT_EQ(o.out.numel(), 0);
  const HostTensor dout(DType::bf16, {0, 64, 128});
  const BackwardOutputs g = run_backward(c, o, dout);
  for (float x : g.dk.floats()) ASSERT_EQ(x, 0.0f) << "keys nobody attends get zero gradient";
  for (float x : g.dv.floats()) ASSERT_EQ(x, 0.0f) << "keys nobody attends get zero gradient";
}

TEST(AttentionForward, RepeatedRunsAreBitwiseIdentical) {
  MSA_SEEDED_RNG(rng);
  const AttentionCase c = make_case(rng, Topology{}, layout_of({100, 40}, {2200, 40}));
  const ForwardOutputs a = run_forward(c), b = run_forward(c);
  EXPECT_EQ(a.out.raw(), b.out.raw());
  EXPECT_EQ(a.lse.raw(), b.lse.raw());
}

}  // namespace
}  // namespace msa::test
