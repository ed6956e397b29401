// kl_backward against the float64 oracle (docs/semantics.md §7, ops.h KlBackwardParams). The inputs
// come from the library's own pipeline: select_blocks (selection + index LSE at temperature 1),
// build_plan, sparse_attention_forward (main LSE).
#include <algorithm>

#include "test_support.h"

namespace msa::test {
namespace {

struct KlCase {
  AttentionCase attn;
  HostTensor index_q, index_k;  // [total_q, Hi, 128], [total_k, 1, 128] bf16
  HostTensor index_lse;         // [Hi, total_q] f32
  ForwardOutputs fwd;
};

KlCase make_kl_case(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L) {
  HostTensor iq = random_tensor(rng, {L.total_q(), topo.num_index_heads, topo.index_head_dim});
  HostTensor ik = random_tensor(rng, {L.total_k(), 1, topo.index_head_dim});
  HostTensor topk(DType::i32, {topo.num_index_heads, L.total_q(), topo.topk});
  HostTensor lse(DType::f32, {topo.num_index_heads, L.total_q()});
  SelectBlocksParams sp;
  sp.index_q = iq.view();
  sp.index_k = ik.view();
  sp.topk = topk.view();
  sp.selected_lse = lse.view();
  select_blocks(topo, L, sp);
  AttentionCase attn = make_case(rng, topo, L, std::move(topk));
  ForwardOutputs fwd = run_forward(attn);
  return {std::move(attn), std::move(iq), std::move(ik), std::move(lse), std::move(fwd)};
}

struct KlOutputs {
  HostTensor dindex_q, dindex_k;
};

KlOutputs run_kl(const KlCase& c, float grad_scale, DType dtype = DType::f32) {
  const Topology& topo = c.attn.topo;
  KlOutputs o{HostTensor(dtype, {c.attn.layout.total_q(), topo.num_index_heads, topo.index_head_dim}),
              HostTensor(dtype, {c.attn.layout.total_k(), 1, topo.index_head_dim})};
  poison(o.dindex_q);
  poison(o.dindex_k);
  KlBackwardParams p;
  p.q = c.attn.q.view();
  p.k = c.attn.k.view();
  p.lse = c.fwd.lse.view();
  p.index_q = c.index_q.view();
  p.index_k = c.index_k.view();
  p.index_lse = c.index_lse.view();
  p.topk = c.attn.topk.view();
  p.dindex_q = o.dindex_q.view();
  p.dindex_k = o.dindex_k.view();
  p.grad_scale = grad_scale;
  kl_backward(topo, c.attn.layout, c.attn.plan, p);
  return o;
}

oracle::KlResult oracle_kl(const KlCase& c, double grad_scale) {
  const auto q = c.attn.q.floats(), k = c.attn.k.floats(), lse = c.fwd.lse.floats();
  const auto iq = c.index_q.floats(), ik = c.index_k.floats(), ilse = c.index_lse.floats();
  const auto ids = c.attn.topk.ints();
  return oracle::kl_backward(c.attn.topo, oracle_docs(c.attn.layout), q.data(), k.data(), lse.data(), iq.data(),
                             ik.data(), ilse.data(), ids.data(), c.attn.layout.total_k(), grad_scale);
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// The gradients are tiny at the training grad_scale; pick grad_scale so that the largest
// oracle gradient is about 1, then apply atol 2e-3 / rtol 1e-2 (docs/semantics.md §10) and relative L2.
void check_kl(const KlCase& c) {
  const oracle::KlResult unit = oracle_kl(c, 1.0);
  const double peak = std::max(max_abs(unit.dindex_q), max_abs(unit.dindex_k));
  ASSERT_GT(peak, 0);
  const float grad_scale = float(1.0 / peak);
  std::vector<double> want_q = unit.dindex_q, want_k = unit.dindex_k;
  for (double& x : want_q) x *= double(grad_scale);
  for (double& x : want_k) x *= double(grad_scale);
  const KlOutputs got = run_kl(c, grad_scale);
  const auto gq = got.dindex_q.floats(), gk = got.dindex_k.floats();
  expect_rel_l2("dindex_q", gq, want_q, 1e-2);
  expect_rel_l2("dindex_k", gk, want_k, 1e-2);
  expect_close("dindex_q", gq, want_q, 2e-3, 1e-2, c.attn.topo.index_head_dim);
  expect_close("dindex_k", gk, want_k, 2e-3, 1e-2, c.attn.topo.index_head_dim);
  // Keys no query attends (in any head) get exactly zero gradient.
  const int Hi = c.attn.topo.num_index_heads, Di = c.attn.topo.index_head_dim;
  const auto attended = attended_keys(c.attn.topo, c.attn.layout, c.attn.topk.ints());
  int64_t nonzero = 0;
  for (int64_t t = 0; t < c.attn.layout.total_k(); ++t) {
    bool any = false;
    for (int g = 0; g < Hi; ++g) any |= attended[size_t(t * Hi + g)] != 0;
    for (int e = 0; !any && e < Di; ++e) nonzero += gk[size_t(t * Di + e)] != 0.0f;
  }
  EXPECT_EQ(nonzero, 0) << "dindex_k of keys no query attends must be exactly 0";
}

TEST(KlBackward, SmallPackDefaultTopology) {
  MSA_SEEDED_RNG(rng);
  check_kl(make_kl_case(rng, Topology{}, layout_of({1, 127, 129, 300})));
}

TEST(KlBackward, ChunkedPrefillWithRankedSelection) {
  MSA_SEEDED_RNG(rng);
  check_kl(make_kl_case(rng, Topology{}, layout_of({60, 20, 1}, {2400, 200, 1})));
}

TEST(KlBackward, MixedPackTensorParallel) {
  MSA_SEEDED_RNG(rng);
  check_kl(make_kl_case(rng, Topology::minimax_m3(4), layout_of({1, 128, 129, 1000, 2049})));
}

TEST(KlBackward, FragmentsShareOneKvRange) {
  MSA_SEEDED_RNG(rng);
  const PackedLayout L = PackedLayout::from_cu_seqlens({0, 120, 220, 300}, {0, 120, 2200, 2280}, {0, 0, 2});
  check_kl(make_kl_case(rng, Topology::minimax_m3(2), L));
}

TEST(KlBackward, InitAndLocalForcedSelections) {
  MSA_SEEDED_RNG(rng);
  Topology topo = Topology::minimax_m3(4);
  topo.init_blocks = 1;
  topo.local_blocks = 2;
  check_kl(make_kl_case(rng, topo, layout_of({80, 200}, {2500, 200})));
}

TEST(KlBackward, DefaultGradScaleAveragesOverHeadsAndTokens) {
  MSA_SEEDED_RNG(rng);
  // grad_scale = 0 means 1 / (Hi * total_q).
  const KlCase c = make_kl_case(rng, Topology{}, layout_of({50, 140}, {2200, 140}));
  const double scale = 1.0 / (double(c.attn.topo.num_index_heads) * double(c.attn.layout.total_q()));
  const oracle::KlResult want = oracle_kl(c, scale);
  const KlOutputs got = run_kl(c, 0.0f);
  expect_gradient("dindex_q", got.dindex_q.floats(), want.dindex_q);
  expect_gradient("dindex_k", got.dindex_k.floats(), want.dindex_k);
}

TEST(KlBackward, Bf16Gradients) {
  MSA_SEEDED_RNG(rng);
  const KlCase c = make_kl_case(rng, Topology::minimax_m3(4), layout_of({40, 150}, {2300, 150}));
  const oracle::KlResult want = oracle_kl(c, 1000.0);
  const KlOutputs got = run_kl(c, 1000.0f, DType::bf16);
  expect_gradient("dindex_q", got.dindex_q.floats(), want.dindex_q);
  expect_gradient("dindex_k", got.dindex_k.floats(), want.dindex_k);
}

TEST(KlBackward, RepeatedRunsAreBitwiseIdentical) {
  MSA_SEEDED_RNG(rng);
  const KlCase c = make_kl_case(rng, Topology::minimax_m3(4), layout_of({40, 150}, {2300, 150}));
  const KlOutputs a = run_kl(c, 1.0f), b = run_kl(c, 1.0f);
  EXPECT_EQ(a.dindex_q.raw(), b.dindex_q.raw());
  EXPECT_EQ(a.dindex_k.raw(), b.dindex_k.raw());
}

}  // namespace
}  // namespace msa::test
