// Sparse attention forward and backward on the GPU against the CPU backend, on the same
// selection (the CPU indexer's) and, for the backward, the same forward outputs.
#include <algorithm>

#include "../src/core/walk_order.h"
#include "test_gpu_shapes.h"
#include "test_gpu_support.h"

namespace msa::test {
namespace {

// Forward: out relative L2 < 1e-2 against the CPU output, LSE atol = rtol = 1e-3, rows
// without keys exactly (0, -inf), every element written.
void check_forward_against_cpu(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L,
                               DType out_dtype = DType::bf16, int q_per_cta = 8, HostTensor topk_in = {}) {
  AttentionCase c = make_case(rng, topo, L, std::move(topk_in));
  const ForwardOutputs want = run_forward(c, out_dtype);
  DeviceTensor q(c.q), k(c.k), v(c.v), topk(c.topk);
  PlanOptions options;
  options.q_per_cta = q_per_cta;
  const SparsePlan plan = build_plan(topo, L, topk.view(), options);
  const ForwardOutputs got = gpu_forward(c, plan, q, k, v, topk, out_dtype);
  const auto go = got.out.floats(), gl = got.lse.floats(), wo = want.out.floats(), wl = want.lse.floats();
  ASSERT_EQ(count_nan(go), 0) << "out holds NaN: not every element was written";
  ASSERT_EQ(count_nan(gl), 0) << "lse holds NaN: not every element was written";
  std::vector<float> lg;
  std::vector<double> lw;
  int64_t empty = 0;
  for (size_t i = 0; i < wl.size(); ++i) {
    if (std::isinf(wl[i])) {
      ++empty;
      ASSERT_TRUE(std::isinf(gl[i]) && gl[i] < 0) << "row-head " << i << " has no keys: lse must be -inf, got " << gl[i];
      for (int e = 0; e < 128; ++e) ASSERT_EQ(go[i * 128 + size_t(e)], 0.0f) << "row-head " << i << " has no keys";
      continue;
    }
    lg.push_back(gl[i]);
    lw.push_back(wl[i]);
  }
  ::testing::Test::RecordProperty("empty_rows", std::to_string(empty));
  expect_rel_l2("out", go, doubles(wo), 1e-2);
  expect_close("out", go, doubles(wo), 3e-2, 3e-2, 128);
  expect_close("lse", lg, lw, 1e-3, 1e-3);
}

TEST(GpuForward, EdgeCaseLayouts) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const auto& s : edge_layouts()) {
    SCOPED_TRACE(s.name);
    check_forward_against_cpu(rng, Topology(), s.layout);
  }
}

TEST(GpuForward, RealShapes) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const auto& s : real_layouts(3072, 4096)) {
    SCOPED_TRACE(s.name);
    check_forward_against_cpu(rng, Topology(), s.layout);
  }
}

// The selection of the window tests, for a one-document layout: every query its 16 most recent
// visible blocks, except the queries in `far`, which take block 0 instead of their oldest (the
// last item of block 0's row then holds queries of windows far apart).
HostTensor recent_blocks_and_far_ones(const Topology& topo, const PackedLayout& L, const std::vector<int64_t>& far) {
  const int64_t T = L.total_q(), prefix = L.total_k() - T;
  HostTensor topk(DType::i32, {topo.num_index_heads, T, topo.topk});
  int32_t* ids = topk.data<int32_t>();
  for (int g = 0; g < topo.num_index_heads; ++g)
    for (int64_t q = 0; q < T; ++q) {
      const int32_t nvis = int32_t((prefix + q) / 128 + 1), first = std::max(0, nvis - 16);
      int32_t* row = ids + (g * T + q) * 16;
      for (int s = 0; s < 16; ++s) row[s] = first + s < nvis ? first + s : -1;
      if (std::find(far.begin(), far.end(), q) != far.end()) row[0] = 0;
    }
  return topk;
}

// The forward holds the partials of one window of its walk at a time (src/core/walk_order.h):
// 13000 queries are 4 windows of 4096. Every query selects its 16 most recent blocks, except
// four far apart (windows 0, 1, 2, 3) that take block 0 instead of their oldest: the last item
// of block 0's row holds those four, and is computed again in each later window it reaches.
TEST(GpuForward, WindowsAndItemsThatStraddleThem) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({13000});
  ASSERT_EQ(detail::forward_window_queries(L), 4096);
  HostTensor topk = recent_blocks_and_far_ones(topo, L, {2100, 5000, 9000, 12500});
  check_forward_against_cpu(rng, topo, L, DType::f32, 8, topk);
  check_forward_against_cpu(rng, topo, L, DType::bf16, 32, std::move(topk));  // items of 32: 4 tasks each
}

// A layout of more than 32k queries whose key blocks the rule's 2048-query chunk gives too few
// queries (33000 over 140000 keys: 30 a block) has no rule chunk, and walks by chunks as large
// as its windows instead (src/core/walk_order.h, forward_walk_chunk): 9 windows of 4096. Every
// query selects its 16 most recent blocks; four far apart take block 0 instead of their oldest.
TEST(GpuForward, LongLayoutsWithoutARuleChunkWalkByWindows) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo = Topology::minimax_m3(4);  // 16 / 1 heads: the CPU reference stays small
  const PackedLayout L = layout_of({33000}, {140000});
  ASSERT_EQ(detail::forward_chunk_queries(L), 0);
  ASSERT_EQ(detail::forward_walk_chunk(L), 4096);
  ASSERT_EQ(detail::forward_window_queries(L), 4096);
  HostTensor topk = recent_blocks_and_far_ones(topo, L, {100, 4100, 20000, 32999});
  check_forward_against_cpu(rng, topo, L, DType::bf16, 8, std::move(topk));
}

TEST(GpuForward, TopologiesOutputTypesAndItemSizes) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const PackedLayout L = layout_of({2500, 700, 33}, {2600, 2000, 33});
  check_forward_against_cpu(rng, Topology::minimax_m3(2), L);
  check_forward_against_cpu(rng, Topology::minimax_m3(4), L, DType::f32);
  check_forward_against_cpu(rng, Topology(), L, DType::bf16, 3);
  check_forward_against_cpu(rng, Topology(), L, DType::f32, 20);
  Topology forced;
  forced.init_blocks = 2;
  forced.local_blocks = 3;
  check_forward_against_cpu(rng, forced, L);
}

// ---- backward ------------------------------------------------------------------------------

void expect_grad(const char* what, const HostTensor& got, const HostTensor& want) {
  expect_gradient(what, got.floats(), doubles(want.floats()));
}

void check_backward_against_cpu(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L,
                                DType grad_dtype = DType::bf16, DType dout_dtype = DType::bf16) {
  AttentionCase c = make_case(rng, topo, L);
  const ForwardOutputs fwd = run_forward(c);
  const HostTensor dout = random_tensor(rng, {L.total_q(), topo.num_q_heads, 128}, 0.2f, dout_dtype);
  const BackwardOutputs want = run_backward(c, fwd, dout, grad_dtype);
  DeviceTensor q(c.q), k(c.k), v(c.v), topk(c.topk), out(fwd.out), lse(fwd.lse), ddout(dout);
  const SparsePlan plan = build_plan(topo, L, topk.view());
  for (bool det : {false, true}) {
    SCOPED_TRACE(det ? "deterministic" : "atomic");
    const GpuGrads got = gpu_backward(c, plan, q, k, v, topk, out, lse, ddout, det, grad_dtype);
    expect_grad("dq", got.dq, want.dq);
    expect_grad("dk", got.dk, want.dk);
    expect_grad("dv", got.dv, want.dv);
  }
}

TEST(GpuBackward, EdgeCaseLayouts) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const auto& s : edge_layouts()) {
    if (s.name == "single token" || s.name == "long document" || s.name == "16 blocks exactly") continue;  // covered elsewhere
    SCOPED_TRACE(s.name);
    check_backward_against_cpu(rng, Topology(), s.layout);
  }
}

TEST(GpuBackward, RealShapes) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const auto shapes = real_layouts(2048, 2048);
  for (size_t i = 0; i < shapes.size(); i += 3) {  // every third shape keeps the CPU reference quick
    SCOPED_TRACE(shapes[i].name);
    check_backward_against_cpu(rng, Topology(), shapes[i].layout);
  }
}

TEST(GpuBackward, TopologiesAndFloat32) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const PackedLayout L = layout_of({2300, 400}, {2300, 1900});
  check_backward_against_cpu(rng, Topology::minimax_m3(2), L, DType::f32, DType::f32);
  Topology forced;
  forced.init_blocks = 1;
  forced.local_blocks = 2;
  check_backward_against_cpu(rng, forced, L);
}

TEST(GpuBackward, LongDocumentsWalkedByQueryWindows) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  // Long enough that the default mode walks its chunks by query windows (src/core/walk_order.h),
  // with a short second document and a window boundary inside a 128-query chunk item.
  const PackedLayout L = layout_of({9000, 300});
  ASSERT_GT(detail::backward_window_queries(L), 0);
  check_backward_against_cpu(rng, Topology::minimax_m3(4), L);
}

TEST(GpuBackward, DeterministicModeIsBitwiseReproducible) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({2500, 700, 3});
  AttentionCase c = make_case(rng, topo, L);
  const ForwardOutputs fwd = run_forward(c);
  const HostTensor dout = random_tensor(rng, {L.total_q(), 64, 128});
  DeviceTensor q(c.q), k(c.k), v(c.v), topk(c.topk), out(fwd.out), lse(fwd.lse), ddout(dout);
  const SparsePlan plan = build_plan(topo, L, topk.view());
  const GpuGrads first = gpu_backward(c, plan, q, k, v, topk, out, lse, ddout, true, DType::f32);
  for (int i = 0; i < 10; ++i) {
    const GpuGrads again = gpu_backward(c, plan, q, k, v, topk, out, lse, ddout, true, DType::f32);
    ASSERT_TRUE(bitwise_equal(again.dq, first.dq)) << "repeat " << i;
    ASSERT_TRUE(bitwise_equal(again.dk, first.dk)) << "repeat " << i;
    ASSERT_TRUE(bitwise_equal(again.dv, first.dv)) << "repeat " << i;
  }
}

TEST(GpuForward, RepeatedRunsAreBitwiseIdentical) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({2500, 900});
  AttentionCase c = make_case(rng, topo, L);
  DeviceTensor q(c.q), k(c.k), v(c.v), topk(c.topk);
  const SparsePlan plan = build_plan(topo, L, topk.view());
  const ForwardOutputs first = gpu_forward(c, plan, q, k, v, topk);
  for (int i = 0; i < 10; ++i) {
    const ForwardOutputs again = gpu_forward(c, plan, q, k, v, topk);
    ASSERT_TRUE(bitwise_equal(again.out, first.out));
    ASSERT_TRUE(bitwise_equal(again.lse, first.lse));
  }
}

// Two plans on one caller-given workspace (PlanOptions::workspace), their operations in order
// on one stream: results bitwise equal to a plan with its own workspace, even though the
// workspace starts as NaN bytes and the other plan's forward runs in between.
TEST(GpuPlanWorkspace, SharedByTwoPlansGivesTheSameResults) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  // 20 blocks in the first document: its late queries rank their history, so the two
  // random selections differ.
  const PackedLayout L = layout_of({2500, 300, 3});
  const AttentionCase c = make_case(rng, topo, L), other = make_case(rng, topo, L);
  DeviceTensor q(c.q), k(c.k), v(c.v), topk(c.topk), other_topk(other.topk);
  const HostTensor dout = random_tensor(rng, {L.total_q(), 64, 128});
  const SparsePlan own = build_plan(topo, L, topk.view());
  const ForwardOutputs want_fwd = gpu_forward(c, own, q, k, v, topk);
  DeviceTensor out(want_fwd.out), lse(want_fwd.lse), ddout(dout);
  const GpuGrads want = gpu_backward(c, own, q, k, v, topk, out, lse, ddout, true, DType::f32);

  const int64_t bytes = plan_workspace_bytes(topo, L, kGpu);
  const DeviceTensor workspace(nan_bytes(bytes));
  PlanOptions shared;
  shared.workspace = workspace.view();
  const SparsePlan a = build_plan(topo, L, topk.view(), shared), b = build_plan(topo, L, other_topk.view(), shared);
  const ForwardOutputs got_fwd = gpu_forward(c, a, q, k, v, topk);
  const ForwardOutputs other_fwd = gpu_forward(other, b, q, k, v, other_topk);
  EXPECT_FALSE(bitwise_equal(other_fwd.out, got_fwd.out)) << "the second plan must select other blocks";
  const GpuGrads got = gpu_backward(c, a, q, k, v, topk, out, lse, ddout, true, DType::f32);
  EXPECT_TRUE(bitwise_equal(got_fwd.out, want_fwd.out));
  EXPECT_TRUE(bitwise_equal(got_fwd.lse, want_fwd.lse));
  EXPECT_TRUE(bitwise_equal(got.dq, want.dq));
  EXPECT_TRUE(bitwise_equal(got.dk, want.dk));
  EXPECT_TRUE(bitwise_equal(got.dv, want.dv));
}

// A plan without scratch (PlanOptions::workspace_per_call) runs on the workspace each call
// passes, here two different NaN-filled buffers: bit for bit the results of a plan with its
// own; a call without one is refused by name.
TEST(GpuPlanWorkspace, PerCallWorkspaceGivesTheSameResults) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({2500, 300, 3});
  const AttentionCase c = make_case(rng, topo, L);
  DeviceTensor q(c.q), k(c.k), v(c.v), topk(c.topk);
  const HostTensor dout = random_tensor(rng, {L.total_q(), 64, 128});
  const SparsePlan own = build_plan(topo, L, topk.view());
  const ForwardOutputs want_fwd = gpu_forward(c, own, q, k, v, topk);
  DeviceTensor out(want_fwd.out), lse(want_fwd.lse), ddout(dout);
  const GpuGrads want = gpu_backward(c, own, q, k, v, topk, out, lse, ddout, true, DType::f32);

  PlanOptions per_call;
  per_call.workspace_per_call = true;
  const SparsePlan plan = build_plan(topo, L, topk.view(), per_call);
  EXPECT_TRUE(plan.workspace_per_call);
  expect_error([&] { gpu_forward(c, plan, q, k, v, topk); },
               {"sparse_attention_forward: the plan was built with workspace_per_call", "pass workspace"});
  // Each call on exactly its own bytes (call_workspace_bytes), NaN-filled: the forward's and
  // the deterministic backward's are bit for bit the plan's own; the default backward (fp32
  // atomics, not bitwise reproducible) agrees with the deterministic one to rounding.
  const int64_t forward_bytes = call_workspace_bytes(topo, L, kGpu, WorkspaceCall::forward);
  const int64_t det_bytes = call_workspace_bytes(topo, L, kGpu, WorkspaceCall::backward, true);
  const int64_t atomic_bytes = call_workspace_bytes(topo, L, kGpu, WorkspaceCall::backward, false);
  EXPECT_LT(atomic_bytes, forward_bytes);
  EXPECT_EQ(std::max(forward_bytes, det_bytes), plan_workspace_bytes(topo, L, kGpu));
  const DeviceTensor first(nan_bytes(forward_bytes)), second(nan_bytes(det_bytes)), third(nan_bytes(atomic_bytes));
  expect_error([&] { gpu_backward(c, plan, q, k, v, topk, out, lse, ddout, true, DType::f32, third.view()); },
               {"sparse_attention_backward workspace must hold at least call_workspace_bytes(backward, deterministic) = " +
                    std::to_string(det_bytes),
                "got " + std::to_string(atomic_bytes)});
  const ForwardOutputs got_fwd = gpu_forward(c, plan, q, k, v, topk, DType::bf16, first.view());
  const GpuGrads got = gpu_backward(c, plan, q, k, v, topk, out, lse, ddout, true, DType::f32, second.view());
  EXPECT_TRUE(bitwise_equal(got_fwd.out, want_fwd.out));
  EXPECT_TRUE(bitwise_equal(got_fwd.lse, want_fwd.lse));
  EXPECT_TRUE(bitwise_equal(got.dq, want.dq));
  EXPECT_TRUE(bitwise_equal(got.dk, want.dk));
  EXPECT_TRUE(bitwise_equal(got.dv, want.dv));
  const GpuGrads atomic = gpu_backward(c, plan, q, k, v, topk, out, lse, ddout, false, DType::f32, third.view());
  expect_gradient("dq", atomic.dq.floats(), doubles(want.dq.floats()));
  expect_gradient("dk", atomic.dk.floats(), doubles(want.dk.floats()));
  expect_gradient("dv", atomic.dv.floats(), doubles(want.dv.floats()));
}

}  // namespace
}  // namespace msa::test
