// The indexer's KL backward on the GPU against the CPU backend (same selection, same LSEs).
#include "test_gpu_shapes.h"
#include "test_gpu_support.h"

namespace msa::test {
namespace {

struct KlInputs {
  AttentionCase c;
  HostTensor iq, ik, lse, index_lse;
};

KlInputs make_kl(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L) {
  const HostTensor iq = random_tensor(rng, {L.total_q(), topo.num_index_heads, 128});
  const HostTensor ik = random_tensor(rng, {L.total_k(), 1, 128});
  Selection sel = cpu_select(topo, L, iq, ik);
  AttentionCase c = make_case(rng, topo, L, std::move(sel.topk));
  const ForwardOutputs fwd = run_forward(c);
  return {std::move(c), iq, ik, fwd.lse, std::move(sel.lse)};
}

struct KlGrads {
  HostTensor dq, dk;
};

KlGrads cpu_kl(const KlInputs& in, DType dtype, float grad_scale) {
  const auto& c = in.c;
  KlGrads g{HostTensor(dtype, {c.layout.total_q(), c.topo.num_index_heads, 128}), HostTensor(dtype, {c.layout.total_k(), 1, 128})};
  KlBackwardParams p;
  p.q = c.q.view();
  p.k = c.k.view();
  p.lse = in.lse.view();
  p.index_q = in.iq.view();
  p.index_k = in.ik.view();
  p.index_lse = in.index_lse.view();
  p.topk = c.topk.view();
  p.dindex_q = g.dq.view();
  p.dindex_k = g.dk.view();
  p.grad_scale = grad_scale;
  kl_backward(c.topo, c.layout, c.plan, p);
  return g;
}

KlGrads gpu_kl(const KlInputs& in, const SparsePlan& plan, DType dtype, float grad_scale, bool deterministic,
               const TensorView& workspace = {}) {
  const auto& c = in.c;
  DeviceTensor q(c.q), k(c.k), lse(in.lse), iq(in.iq), ik(in.ik), ilse(in.index_lse), topk(c.topk);
  DeviceTensor dq(dtype, {c.layout.total_q(), c.topo.num_index_heads, 128}), dk(dtype, {c.layout.total_k(), 1, 128});
  dq.poison();
  dk.poison();
  KlBackwardParams p;
  p.q = q.view();
  p.k = k.view();
  p.lse = lse.view();
  p.index_q = iq.view();
  p.index_k = ik.view();
  p.index_lse = ilse.view();
  p.topk = topk.view();
  p.dindex_q = dq.view();
  p.dindex_k = dk.view();
  p.grad_scale = grad_scale;
  p.workspace = workspace;
  RunOptions opt;
  opt.deterministic = deterministic;
  kl_backward(c.topo, c.layout, plan, p, opt);
  return {dq.host(), dk.host()};
}

void check_kl(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L, DType dtype = DType::f32,
              float grad_scale = 0.f) {
  const KlInputs in = make_kl(rng, topo, L);
  const KlGrads want = cpu_kl(in, dtype, grad_scale);
  DeviceTensor topk(in.c.topk);
  const SparsePlan plan = build_plan(topo, L, topk.view());
  for (bool det : {false, true}) {
    SCOPED_TRACE(det ? "deterministic" : "atomic");
    const KlGrads got = gpu_kl(in, plan, dtype, grad_scale, det);
    expect_gradient("dindex_q", got.dq.floats(), doubles(want.dq.floats()));
    expect_gradient("dindex_k", got.dk.floats(), doubles(want.dk.floats()));
  }
}

TEST(GpuKl, EdgeAndRealShapes) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  std::vector<NamedLayout> shapes;
  for (auto& s : edge_layouts())
    if (s.name != "long document" && s.name != "single token") shapes.push_back(std::move(s));
  const auto real = real_layouts(2048, 2048);
  for (size_t i = 1; i < real.size(); i += 3) shapes.push_back(real[i]);
  for (const auto& s : shapes) {
    SCOPED_TRACE(s.name);
    check_kl(rng, Topology(), s.layout);
  }
}

TEST(GpuKl, TopologiesGradScaleAndBf16) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const PackedLayout L = layout_of({2600, 300}, {2600, 1800});
  check_kl(rng, Topology::minimax_m3(2), L, DType::bf16);
  check_kl(rng, Topology::minimax_m3(4), L, DType::f32, 0.37f);
}

TEST(GpuKl, DeterministicModeIsBitwiseReproducible) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const KlInputs in = make_kl(rng, topo, layout_of({2500, 600}));
  DeviceTensor topk(in.c.topk);
  const SparsePlan plan = build_plan(topo, in.c.layout, topk.view());
  const KlGrads first = gpu_kl(in, plan, DType::f32, 0.f, true);
  for (int i = 0; i < 10; ++i) {
    const KlGrads again = gpu_kl(in, plan, DType::f32, 0.f, true);
    ASSERT_TRUE(bitwise_equal(again.dq, first.dq)) << "repeat " << i;
    ASSERT_TRUE(bitwise_equal(again.dk, first.dk)) << "repeat " << i;
  }
}

// A plan without scratch runs the KL on exactly call_workspace_bytes(kl_backward) of NaN bytes
// in either mode: deterministic, bit for bit the results of a plan with its own workspace; the
// default (fp32 atomics), equal to them to rounding.
TEST(GpuKl, PerCallWorkspaceOfExactlyItsBytes) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const KlInputs in = make_kl(rng, topo, layout_of({2500, 600}));
  DeviceTensor topk(in.c.topk);
  const SparsePlan own = build_plan(topo, in.c.layout, topk.view());
  PlanOptions per_call;
  per_call.workspace_per_call = true;
  const SparsePlan plan = build_plan(topo, in.c.layout, topk.view(), per_call);
  for (bool det : {false, true}) {
    SCOPED_TRACE(det ? "deterministic" : "atomic");
    const int64_t bytes = call_workspace_bytes(topo, in.c.layout, kGpu, WorkspaceCall::kl_backward, det);
    EXPECT_LT(bytes, plan_workspace_bytes(topo, in.c.layout, kGpu));
    const DeviceTensor workspace(nan_bytes(bytes));
    const KlGrads want = gpu_kl(in, own, DType::f32, 0.f, true);
    const KlGrads got = gpu_kl(in, plan, DType::f32, 0.f, det, workspace.view());
    if (det) {
      EXPECT_TRUE(bitwise_equal(got.dq, want.dq));
      EXPECT_TRUE(bitwise_equal(got.dk, want.dk));
    } else {
      expect_gradient("dindex_q", got.dq.floats(), doubles(want.dq.floats()));
      expect_gradient("dindex_k", got.dk.floats(), doubles(want.dk.floats()));
    }
  }
}

}  // namespace
}  // namespace msa::test
