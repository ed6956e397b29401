// sparse_attention_backward against the float64 oracle (docs/semantics.md §6, §10): dq, and dk / dv
// summed over the 16 query heads of a group, on the library's own selection and forward.
#include <algorithm>
#include <numeric>

#include "test_support.h"

namespace msa::test {
namespace {

void forward_backward_check(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L,
                            DType grad_dtype = DType::bf16, DType dout_dtype = DType::bf16,
                            DType out_dtype = DType::bf16, float qk_scale = 0.2f) {
  const AttentionCase c = make_case(rng, topo, L, {}, qk_scale);
  const ForwardOutputs fwd = run_forward(c, out_dtype);
  const HostTensor dout = random_tensor(rng, {L.total_q(), topo.num_q_heads, topo.head_dim}, 0.2f, dout_dtype);
  const BackwardOutputs grads = run_backward(c, fwd, dout, grad_dtype);
  check_backward(c, fwd, dout, grads);
}

TEST(AttentionBackward, MixedPackTensorParallel) {
  MSA_SEEDED_RNG(rng);
  // One pack of documents of 1, 127, 128, 129, 2047, 2048 and 2049 tokens; full forward and
  // gradients with the TP=4 shard (16 query heads, 1 KV head) to keep the oracle affordable.
  forward_backward_check(rng, Topology::minimax_m3(4), layout_of({1, 127, 128, 129, 2047, 2048, 2049}));
}

TEST(AttentionBackward, SmallPackDefaultTopology) {
  MSA_SEEDED_RNG(rng);
  forward_backward_check(rng, Topology{}, layout_of({1, 127, 128, 129, 260}));
}

TEST(AttentionBackward, ChunkedPrefillDefaultTopology) {
  MSA_SEEDED_RNG(rng);
  // Prefix keys no query selects must get exactly zero dk / dv.
  forward_backward_check(rng, Topology{}, layout_of({64, 30, 1}, {2500, 300, 1}));
}

TEST(AttentionBackward, FragmentsShareOneKvRange) {
  MSA_SEEDED_RNG(rng);
  // Both fragments of document A read keys [0, 2200): their dk / dv contributions add up on
  // the one stored copy.
  const PackedLayout L = PackedLayout::from_cu_seqlens({0, 150, 300, 400}, {0, 150, 2200, 2300}, {0, 0, 2});
  forward_backward_check(rng, Topology::minimax_m3(4), L);
  forward_backward_check(rng, Topology{}, PackedLayout::from_cu_seqlens({0, 40, 80}, {0, 300, 400}, {0, 0}));
}

TEST(AttentionBackward, TensorParallelTwoKvHeads) {
  MSA_SEEDED_RNG(rng);
  forward_backward_check(rng, Topology::minimax_m3(2), layout_of({40, 200}, {2300, 200}));
}

TEST(AttentionBackward, InitAndLocalForcedSelections) {
  MSA_SEEDED_RNG(rng);
  Topology topo = Topology::minimax_m3(4);
  topo.init_blocks = 2;
  topo.local_blocks = 3;
  forward_backward_check(rng, topo, layout_of({100, 300}, {2600, 300}));
}

TEST(AttentionBackward, Float32GradientsAndDout) {
  MSA_SEEDED_RNG(rng);
  forward_backward_check(rng, Topology{}, layout_of({30, 150}, {2200, 150}), DType::f32, DType::f32, DType::f32);
}

TEST(AttentionBackward, SharpSoftmax) {
  MSA_SEEDED_RNG(rng);
  // Logits with standard deviation ~2.3 (q, k of scale 1.5).
  forward_backward_check(rng, Topology::minimax_m3(4), layout_of({100, 1, 300}, {2300, 1, 300}), DType::bf16,
                         DType::bf16, DType::bf16, 1.5f);
}

TEST(AttentionBackward, EmptyRowsContributeNothing) {
  MSA_SEEDED_RNG(rng);
  // Rows without keys: dq = 0 and no contribution to dk / dv (checked through the oracle's
  // exact zeros); other rows take the local block only.
  const Topology topo = Topology::minimax_m3(4);
  const PackedLayout L = layout_of({300, 5});
  HostTensor topk(DType::i32, {1, L.total_q(), 16});
  int32_t* ids = topk.data<int32_t>();
  std::fill(ids, ids + topk.numel(), -1);
  for (int64_t r = 0; r < L.total_q(); ++r)
    if (r % 3 != 0) ids[r * 16] = int32_t((r < 300 ? r : r - 300) / 128);
  const AttentionCase c = make_case(rng, topo, L, std::move(topk));
  const ForwardOutputs fwd = run_forward(c);
  const HostTensor dout = random_tensor(rng, {L.total_q(), 16, 128});
  const BackwardOutputs grads = run_backward(c, fwd, dout);
  check_backward(c, fwd, dout, grads);
}

TEST(AttentionBackward, AnyOrderAndRowsWithoutTheLocalBlock) {
  MSA_SEEDED_RNG(rng);
  // Any valid prefix is accepted (ops.h build_plan): shuffled ids, the local block anywhere or
  // absent (then every selected key is visible and no causal mask applies).
  const Topology topo = Topology::minimax_m3(4);
  const PackedLayout L = layout_of({90, 200, 1}, {2500, 200, 1});
  std::bernoulli_distribution drop_local(0.3);
  HostTensor topk(DType::i32, {1, L.total_q(), 16});
  int32_t* ids = topk.data<int32_t>();
  std::fill(ids, ids + topk.numel(), -1);
  for (const DocumentSpan& d : L.documents())
    for (int64_t i = 0; i < d.q_len; ++i) {
      const int nvis = int((d.k_len - d.q_len + i) / 128) + 1;
      std::vector<int32_t> row(static_cast<size_t>(nvis));
      std::iota(row.begin(), row.end(), 0);
      std::shuffle(row.begin(), row.end() - 1, rng);
      row.resize(std::min<size_t>(row.size() - 1, 15));
      if (!drop_local(rng) || row.empty()) row.push_back(nvis - 1);
      std::shuffle(row.begin(), row.end(), rng);
      std::copy(row.begin(), row.end(), ids + (d.q_start + i) * 16);
    }
  const AttentionCase c = make_case(rng, topo, L, std::move(topk));
  const ForwardOutputs fwd = run_forward(c);
  const HostTensor dout = random_tensor(rng, {L.total_q(), 16, 128});
  check_backward(c, fwd, dout, run_backward(c, fwd, dout));
}

TEST(AttentionBackward, RepeatedRunsAreBitwiseIdentical) {
  MSA_SEEDED_RNG(rng);
  const AttentionCase c = make_case(rng, Topology::minimax_m3(4), layout_of({60, 200}, {2100, 200}));
  const ForwardOutputs fwd = run_forward(c);
  const HostTensor dout = random_tensor(rng, {c.layout.total_q(), 16, 128});
  const BackwardOutputs a = run_backward(c, fwd, dout), b = run_backward(c, fwd, dout);
  EXPECT_EQ(a.dq.raw(), b.dq.raw());
  EXPECT_EQ(a.dk.raw(), b.dk.raw());
  EXPECT_EQ(a.dv.raw(), b.dv.raw());
}

TEST(AttentionBackward, ResultsDoNotDependOnTheThreadCount) {
  // The CPU backend promises bitwise determinism, not only across repeats but across
  // thread counts (fixed accumulation order). Overlapping fragments that start at different
  // key rows exercise the shared dk/dv rows.
  MSA_SEEDED_RNG(rng);
  const AttentionCase c = make_case(rng, Topology::minimax_m3(4),
                                    PackedLayout::from_cu_seqlens({0, 100, 200, 300}, {0, 500, 900, 1400}, {0, 0, 1}));
  const ForwardOutputs fwd = run_forward(c);
  const HostTensor dout = random_tensor(rng, {c.layout.total_q(), 16, 128});
  RunOptions one, three;
  one.num_threads = 1;
  three.num_threads = 3;
  const BackwardOutputs a = run_backward(c, fwd, dout, DType::f32, one), b = run_backward(c, fwd, dout, DType::f32, three);
  EXPECT_EQ(a.dq.raw(), b.dq.raw());
  EXPECT_EQ(a.dk.raw(), b.dk.raw());
  EXPECT_EQ(a.dv.raw(), b.dv.raw());
  check_backward(c, fwd, dout, b);
}

}  // namespace
}  // namespace msa::test
