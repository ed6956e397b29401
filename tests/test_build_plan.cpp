// build_plan against the oracle's k2q CSR (docs/semantics.md §5, ops.h SparsePlan): every buffer
// compared exactly, the schedule as a set of work items split by q_per_cta and ordered
// largest first.
#include <algorithm>
#include <map>
#include <numeric>

#include "test_gpu_support.h"

namespace msa::test {
namespace {

std::vector<int32_t> buffer_ints(const Buffer& b) {
  const TensorView v = b.view();
  const auto* p = v.as<const int32_t>();
  return std::vector<int32_t>(p, p + v.numel());
}

// Largest first: either every work item is no larger than the one before it, or the items
// of one (head, row) are consecutive and rows come in non-increasing size.
bool largest_first(const std::vector<std::array<int32_t, 6>>& work, const std::vector<int32_t>& row_ptr,
                   int64_t total_rows) {
  bool by_item = true;
  for (size_t n = 1; n < work.size(); ++n) by_item &= work[n][3] <= work[n - 1][3];
  if (by_item) return true;
  auto row_size = [&](const std::array<int32_t, 6>& w) {
    const int64_t base = int64_t(w[0]) * (total_rows + 1) + w[1];
    return row_ptr[size_t(base + 1)] - row_ptr[size_t(base)];
  };
  std::set<std::pair<int32_t, int32_t>> finished;
  for (size_t n = 0; n < work.size(); ++n) {
    const std::pair<int32_t, int32_t> key{work[n][0], work[n][1]};
    if (n > 0 && key != std::pair<int32_t, int32_t>{work[n - 1][0], work[n - 1][1]}) {
      finished.insert({work[n - 1][0], work[n - 1][1]});
      if (row_size(work[n]) > row_size(work[n - 1])) return false;
    }
    if (finished.count(key)) return false;  // a row's items are split apart
  }
  return true;
}

void check_plan(const Topology& topo, const PackedLayout& L, const HostTensor& topk, int q_per_cta) {
  SCOPED_TRACE("q_per_cta " + std::to_string(q_per_cta));
  PlanOptions options;
  options.q_per_cta = q_per_cta;
  const SparsePlan plan = build_plan(topo, L, topk.view(), options);
  const auto ids = topk.ints();
  const oracle::Plan want = oracle::build_plan(topo, oracle_docs(L), ids.data(), q_per_cta);
  const int Hkv = topo.num_kv_heads;
  const int64_t edges = L.total_q() * topo.topk;

  EXPECT_EQ(plan.device, Device::cpu());
  EXPECT_EQ(plan.total_q, L.total_q());
  EXPECT_EQ(plan.total_rows, want.total_rows);
  EXPECT_EQ(plan.num_kv_heads, Hkv);
  EXPECT_EQ(plan.topk, topo.topk);
  EXPECT_EQ(plan.q_per_cta, q_per_cta);
  ASSERT_EQ(plan.rows.view().shape_vector(), (std::vector<int64_t>{want.total_rows, 2}));
  ASSERT_EQ(plan.row_ptr.view().shape_vector(), (std::vector<int64_t>{Hkv, want.total_rows + 1}));
  ASSERT_EQ(plan.q_indices.view().shape_vector(), (std::vector<int64_t>{Hkv, edges}));
  ASSERT_EQ(plan.split_slot.view().shape_vector(), (std::vector<int64_t>{Hkv, edges}));
  ASSERT_EQ(plan.split_counts.view().shape_vector(), (std::vector<int64_t>{L.total_q(), Hkv}));

  EXPECT_EQ(buffer_ints(plan.rows), want.rows) << "rows must be level-major (document, kv_block) pairs";
  EXPECT_EQ(buffer_ints(plan.row_ptr), want.row_ptr);
  EXPECT_EQ(buffer_ints(plan.q_indices), want.q_indices) << "q_indices: ascending per row, -1 tail";
  EXPECT_EQ(buffer_ints(plan.split_counts), want.split_counts);
  // split_slot is defined on the used edges of each head.
  const auto slots = buffer_ints(plan.split_slot);
  for (int h = 0; h < Hkv; ++h) {
    const auto begin = int64_t(h) * edges;
    const std::vector<int32_t> got(slots.begin() + begin, slots.begin() + begin + want.used_edges[size_t(h)]);
    const std::vector<int32_t> exp(want.split_slot.begin() + begin, want.split_slot.begin() + begin + want.used_edges[size_t(h)]);
    EXPECT_EQ(got, exp) << "split_slot of head " << h;
  }

  // Schedule: the used entries are exactly the oracle's work items, largest first.
  ASSERT_EQ(plan.work_count, int64_t(want.work.size()));
  EXPECT_EQ(buffer_ints(plan.work_count_dev), std::vector<int32_t>{int32_t(want.work.size())});
  const TensorView sched = plan.schedule.view();
  ASSERT_EQ(sched.rank, 2);
  ASSERT_EQ(sched.shape[1], 6);
  ASSERT_GE(sched.shape[0], plan.work_count);
  std::vector<std::array<int32_t, 6>> work(size_t(plan.work_count));
  for (int64_t n = 0; n < plan.work_count; ++n)
    for (int c = 0; c < 6; ++c) work[size_t(n)][size_t(c)] = sched.as<const int32_t>()[n * 6 + c];
  for (const auto& w : work) {
    EXPECT_GT(w[3], 0) << "work item with no queries";
    EXPECT_LE(w[3], q_per_cta) << "work item larger than q_per_cta";
  }
  EXPECT_TRUE(largest_first(work, want.row_ptr, want.total_rows)) << "schedule is not ordered largest first";
  auto sorted = work;
  std::sort(sorted.begin(), sorted.end());
  auto expected = want.work;
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(sorted, expected) << "schedule entries differ from (head, row, q_begin, q_count, document, kv_block) "
                                 "chunks of q_per_cta";
}

TEST(Plan, LibrarySelectionMatchesOracleCsr) {
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({1, 127, 128, 129, 2300, 5});
  const HostTensor topk = library_selection(rng, topo, L);
  for (int q_per_cta : {1, 3, 8, 16, 1000}) check_plan(topo, L, topk, q_per_cta);
}

TEST(Plan, ChunkedPrefillAndDocumentsWithoutQueries) {
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  // Document 1 has keys but no queries (its rows exist and stay empty), document 3 is empty.
  const PackedLayout L = layout_of({50, 0, 200, 0, 7}, {2600, 300, 400, 0, 7});
  const HostTensor topk = library_selection(rng, topo, L);
  for (int q_per_cta : {8, 5}) check_plan(topo, L, topk, q_per_cta);
}

TEST(Plan, FragmentsGetTheirOwnRows) {
  MSA_SEEDED_RNG(rng);
  // Fragments sharing one KV range still count their rows separately (docs/semantics.md §2.3, §5.1).
  const Topology topo;
  const PackedLayout L = PackedLayout::from_cu_seqlens({0, 300, 900, 1300}, {0, 300, 2600, 3000}, {0, 0, 2});
  EXPECT_EQ(L.total_rows(), 3 + 21 + 4);
  const HostTensor topk = library_selection(rng, topo, L);
  check_plan(topo, L, topk, 8);
}

TEST(Plan, TensorParallelAndForcedSelections) {
  MSA_SEEDED_RNG(rng);
  const PackedLayout L = layout_of({2200, 300});
  for (int tp : {2, 4}) {
    Topology topo = Topology::minimax_m3(tp);
    topo.init_blocks = 1;
    topo.local_blocks = 2;
    check_plan(topo, L, library_selection(rng, topo, L), 8);
  }
}

TEST(Plan, UnorderedSparseAndEmptySelections) {
  MSA_SEEDED_RNG(rng);
  // Hand-made selections in any order (ops.h): shuffled ids, the local block anywhere or
  // absent, some rows empty.
  const Topology topo;
  const PackedLayout L = layout_of({130, 2100, 1});
  HostTensor topk(DType::i32, {4, L.total_q(), 16});
  int32_t* ids = topk.data<int32_t>();
  std::fill(ids, ids + topk.numel(), -1);
  std::uniform_int_distribution<int> coin(0, 4);
  for (const DocumentSpan& d : L.documents())
    for (int64_t i = 0; i < d.q_len; ++i)
      for (int g = 0; g < 4; ++g) {
        if (coin(rng) == 0) continue;
        const int local = int(i / 128);
        std::vector<int32_t> history(static_cast<size_t>(local));
        std::iota(history.begin(), history.end(), 0);
        std::shuffle(history.begin(), history.end(), rng);
        history.resize(std::min<size_t>(history.size(), std::min<size_t>(15, size_t(coin(rng) * 4))));
        if (coin(rng) != 0 || history.empty()) history.push_back(local);
        std::shuffle(history.begin(), history.end(), rng);
        std::copy(history.begin(), history.end(), ids + (g * L.total_q() + d.q_start + i) * 16);
      }
  for (int q_per_cta : {1, 8, 64}) check_plan(topo, L, topk, q_per_cta);
}

TEST(Plan, WorkItemsCoverEveryEdgeOnce) {
  MSA_SEEDED_RNG(rng);
  // Independent of the oracle: walking the schedule visits each (head, query, block) edge of
  // the selection exactly once.
  const Topology topo = Topology::minimax_m3(2);
  const PackedLayout L = layout_of({400, 2300});
  const HostTensor topk = library_selection(rng, topo, L);
  const SparsePlan plan = build_plan(topo, L, topk.view());
  const auto qidx = buffer_ints(plan.q_indices);
  const auto sched = buffer_ints(plan.schedule);
  std::map<std::tuple<int, int64_t, int>, int> seen;  // (head, packed row, block) -> visits
  const int64_t edges = L.total_q() * 16;
  for (int64_t n = 0; n < plan.work_count; ++n) {
    const int32_t* w = sched.data() + n * 6;
    const DocumentSpan& d = L.document(w[4]);
    for (int32_t e = w[2]; e < w[2] + w[3]; ++e) ++seen[{w[0], d.q_start + qidx[size_t(w[0] * edges + e)], w[5]}];
  }
  const auto ids = topk.ints();
  size_t expected = 0;
  for (int g = 0; g < 2; ++g)
    for (int64_t r = 0; r < L.total_q(); ++r)
      for (int s = 0; s < 16; ++s) {
        const int32_t b = ids[size_t((g * L.total_q() + r) * 16 + s)];
        if (b < 0) continue;
        ++expected;
        EXPECT_EQ((seen[{g, r, b}]), 1) << "head " << g << " row " << r << " block " << b;
      }
  EXPECT_EQ(seen.size(), expected);
}

// A plan encodes the selection it was built from; forward, backward and KL must refuse any
// other one instead of computing wrong results (and the plan keeps its own copy, so reusing
// the caller's buffer for the next selection cannot fool it).
TEST(PlanSelection, CallsRefuseASelectionThePlanWasNotBuiltFrom) {
  MSA_SEEDED_RNG(rng);
  const Topology topo = Topology::minimax_m3(4);
  const PackedLayout L = layout_of({2300, 129});  // 18 blocks: late queries rank their history
  const HostTensor a = library_selection(rng, topo, L), b = library_selection(rng, topo, L);
  ASSERT_NE(a.ints(), b.ints()) << "the two selections must differ";
  AttentionCase good = make_case(rng, topo, L, HostTensor(a));
  EXPECT_EQ(buffer_ints(good.plan.selection), a.ints()) << "the plan holds a copy of its selection";
  EXPECT_NE(good.plan.selection.data(), good.topk.view().data);

  // The same contents in other memory, the plan's own copy, and no topk at all are accepted
  // and give the same bytes.
  const ForwardOutputs want = run_forward(good);
  AttentionCase own = good;
  own.topk = HostTensor();
  AttentionForwardParams p;
  const ForwardOutputs got{HostTensor(DType::bf16, {L.total_q(), 16, 128}), HostTensor(DType::f32, {L.total_q(), 16})};
  p.q = good.q.view();
  p.k = good.k.view();
  p.v = good.v.view();
  p.out = got.out.view();
  p.lse = got.lse.view();
  for (const TensorView& topk : {good.plan.selection.view(), TensorView{}}) {
    p.topk = topk;
    sparse_attention_forward(topo, L, good.plan, p);
    EXPECT_EQ(got.out.floats(), want.out.floats());
  }

  // Another selection over the same layout: refused by all three, naming the first difference.
  AttentionCase wrong = good;
  wrong.topk = HostTensor(b);
  const std::vector<std::string> pieces = {"topk does not match the selection the plan was built from",
                                           "first difference at topk[", "plan.selection"};
  expect_error([&] { run_forward(wrong); }, pieces);
  const HostTensor dout = random_tensor(rng, {L.total_q(), 16, 128});
  expect_error([&] { run_backward(wrong, want, dout); }, pieces);
  const HostTensor iq = random_tensor(rng, {L.total_q(), 1, 128}), ik = random_tensor(rng, {L.total_k(), 1, 128});
  HostTensor ilse(DType::f32, {1, L.total_q()}), diq(DType::f32, {L.total_q(), 1, 128}), dik(DType::f32, {L.total_k(), 1, 128});
  KlBackwardParams k;
  k.q = good.q.view();
  k.k = good.k.view();
  k.lse = want.lse.view();
  k.index_q = iq.view();
  k.index_k = ik.view();
  k.index_lse = ilse.view();
  k.topk = b.view();
  k.dindex_q = diq.view();
  k.dindex_k = dik.view();
  expect_error([&] { kl_backward(topo, L, good.plan, k); }, pieces);

  // The caller's buffer overwritten in place after build_plan (the same pointer): refused too.
  AttentionCase reused = good;
  reused.topk = HostTensor(a);
  reused.plan = build_plan(topo, L, reused.topk.view());
  const std::vector<int32_t> b_ids = b.ints();
  std::copy(b_ids.begin(), b_ids.end(), reused.topk.data<int32_t>());
  expect_error([&] { run_forward(reused); }, pieces);
}

// The same on CUDA: another device selection is refused (after a copy of both to the host),
// the same contents in other device memory, the plan's own copy and no topk are accepted.
TEST(PlanSelection, CudaCallsRefuseASelectionThePlanWasNotBuiltFrom) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo = Topology::minimax_m3(4);
  const PackedLayout L = layout_of({2300, 129});
  const HostTensor a = library_selection(rng, topo, L), b = library_selection(rng, topo, L);
  ASSERT_NE(a.ints(), b.ints());
  const AttentionCase c = make_case(rng, topo, L, HostTensor(a));
  DeviceTensor q(c.q), k(c.k), v(c.v), topk_a(a), topk_b(b), topk_a2(a);
  const SparsePlan plan = build_plan(topo, L, topk_a.view());
  EXPECT_EQ(plan.selection.view().device, kGpu);
  const ForwardOutputs want = gpu_forward(c, plan, q, k, v, topk_a);
  EXPECT_EQ(gpu_forward(c, plan, q, k, v, topk_a2).out.floats(), want.out.floats());
  expect_error([&] { gpu_forward(c, plan, q, k, v, topk_b); },
               {"topk does not match the selection the plan was built from", "plan.selection"});
  DeviceTensor out(DType::bf16, {L.total_q(), 16, 128}), lse(DType::f32, {L.total_q(), 16});
  AttentionForwardParams p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.out = out.view();
  p.lse = lse.view();
  for (const TensorView& topk : {plan.selection.view(), TensorView{}}) {
    p.topk = topk;
    sparse_attention_forward(topo, L, plan, p);
    EXPECT_EQ(out.host().floats(), want.out.floats());
  }
}

}  // namespace
}  // namespace msa::test
