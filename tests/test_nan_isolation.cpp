// Non-finite isolation of the attention forward (README, "Non-finite inputs"): a NaN or an
// infinity in k or v at a key that a row does not attend to - a key past the row's causal
// position (also inside its own block), in a block it did not select, or in another
// document - leaves that row exactly as it is without the bad value. CPU and GPU.
#include <cmath>
#include <functional>
#include <limits>

#include "test_gpu_support.h"
#include "test_support.h"

namespace msa::test {
namespace {

struct BadValue {
  const char* name;
  bool in_k;  // else in v
  float value;
};

const BadValue kBadValues[] = {
    {"NaN in v", false, std::numeric_limits<float>::quiet_NaN()},
    {"+inf in v", false, std::numeric_limits<float>::infinity()},
    {"-inf in v", false, -std::numeric_limits<float>::infinity()},
    {"NaN in k", true, std::numeric_limits<float>::quiet_NaN()},
    {"+inf in k", true, std::numeric_limits<float>::infinity()},
    {"-inf in k", true, -std::numeric_limits<float>::infinity()},
};

// Whether row `row` (its heads of kv head g) attends key `key` (a global key row): same key
// range as the row's document, at or before its position, in a block it selected.
bool attends(const AttentionCase& c, int64_t row, int g, int64_t key) {
  const PackedLayout& L = c.layout;
  const int b = L.query_document()[size_t(row)];
  const DocumentSpan& d = L.document(b);
  const int64_t t = key - d.k_start;
  if (t < 0 || t >= d.k_len) return false;
  const int64_t pos = d.k_len - d.q_len + (row - d.q_start);
  if (t > pos) return false;
  const int32_t* sel = c.topk.data<int32_t>() + (int64_t(g) * L.total_q() + row) * c.topo.topk;
  for (int s = 0; s < c.topo.topk; ++s)
    if (sel[s] == t / c.topo.block_size) return true;
  return false;
}

using ForwardFn = std::function<ForwardOutputs(const AttentionCase&)>;

// For every bad value and key in `keys` (kv head g, all 128 dims of that key): the rows that
// do not attend the key keep their output and LSE bit for bit, and finite. `rows_checked`
// counts the (row, head) pairs compared, so that a test cannot pass by checking nothing.
void expect_isolated(const AttentionCase& clean, const std::vector<int64_t>& keys, int g, const ForwardFn& forward) {
  const ForwardOutputs base = forward(clean);
  const auto bo = base.out.floats(), bl = base.lse.floats();
  const int Hq = clean.topo.num_q_heads, group = Hq / clean.topo.num_kv_heads, D = clean.topo.head_dim;
  for (const BadValue& bad : kBadValues) {
    for (int64_t key : keys) {
      SCOPED_TRACE(std::string(bad.name) + " at key " + std::to_string(key) + ", kv head " + std::to_string(g));
      AttentionCase c{clean.topo, clean.layout, clean.q, clean.k, clean.v, clean.topk, SparsePlan{}};
      c.plan = build_plan(c.topo, c.layout, c.topk.view());
      HostTensor& t = bad.in_k ? c.k : c.v;
      for (int e = 0; e < D; ++e) t.set((key * clean.topo.num_kv_heads + g) * D + e, bad.value);
      const ForwardOutputs got = forward(c);
      const auto go = got.out.floats(), gl = got.lse.floats();
      int64_t checked = 0, wrong = 0;
      std::string first;
      for (int64_t row = 0; row < c.layout.total_q(); ++row)
        for (int h = 0; h < Hq; ++h) {
          if (h / group == g && attends(c, row, g, key)) continue;
          ++checked;
          const size_t rh = size_t(row * Hq + h);
          bool same = gl[rh] == bl[rh] && std::isfinite(gl[rh]);
          for (int e = 0; e < D && same; ++e) same = go[rh * D + size_t(e)] == bo[rh * D + size_t(e)];
          if (!same && wrong++ == 0)
            first = "row " + std::to_string(row) + " head " + std::to_string(h) + ": lse " + std::to_string(gl[rh]) +
                    " (want " + std::to_string(bl[rh]) + "), out[0] " + std::to_string(go[rh * D]) + " (want " +
                    std::to_string(bo[rh * D]) + ")";
        }
      EXPECT_GT(checked, 0);
      EXPECT_EQ(wrong, 0) << wrong << " of " << checked << " (row, head) pairs that cannot see the key changed; first: "
                          << first;
    }
  }
}

// Documents of 300 and 2200 tokens (the second with more blocks than the selection holds):
// bad keys in the middle of a block, so that the rows before them in the same block (one
// task on the GPU with the rows after them) cannot see them; in the long document, rows
// after the key that did not select its block cannot either.
struct Scenario {
  AttentionCase c;
  std::vector<int64_t> keys;
};

Scenario scenario(std::mt19937_64& rng, const Topology& topo) {
  const PackedLayout L = layout_of({300, 2200});
  return {make_case(rng, topo, L), {250, 300 + 5 * 128 + 100, 300 + 2199}};
}

ForwardOutputs cpu_forward(const AttentionCase& c) { return run_forward(c); }

TEST(NanIsolation, CpuForward) {
  MSA_SEEDED_RNG(rng);
  const Scenario s = scenario(rng, Topology::minimax_m3(4));
  expect_isolated(s.c, s.keys, 0, cpu_forward);
}

TEST(NanIsolation, CpuForwardOtherKvHeadAndChunkedPrefill) {
  MSA_SEEDED_RNG(rng);
  // Queries at the end of their documents: the bad key sits in the last query block.
  const AttentionCase c = make_case(rng, Topology::minimax_m3(2), layout_of({60, 200}, {190, 2300}));
  expect_isolated(c, {170, 190 + 2250}, 1, cpu_forward);
}

// ---- GPU ----------------------------------------------------------------------------------

ForwardOutputs gpu_forward_of(const AttentionCase& c, int q_per_cta) {
  DeviceTensor q(c.q), k(c.k), v(c.v), topk(c.topk);
  PlanOptions options;
  options.q_per_cta = q_per_cta;
  const SparsePlan plan = build_plan(c.topo, c.layout, topk.view(), options);
  return gpu_forward(c, plan, q, k, v, topk);
}

TEST(GpuNanIsolation, Forward) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Scenario s = scenario(rng, Topology::minimax_m3(4));
  for (int q_per_cta : {8, 3, 20}) {
    SCOPED_TRACE("q_per_cta " + std::to_string(q_per_cta));
    expect_isolated(s.c, s.keys, 0, [&](const AttentionCase& c) { return gpu_forward_of(c, q_per_cta); });
  }
}

TEST(GpuNanIsolation, ForwardOtherKvHeadAndChunkedPrefill) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const AttentionCase c = make_case(rng, Topology::minimax_m3(2), layout_of({60, 200}, {190, 2300}));
  expect_isolated(c, {170, 190 + 2250}, 1, [](const AttentionCase& x) { return gpu_forward_of(x, 8); });
}

}  // namespace
}  // namespace msa::test
