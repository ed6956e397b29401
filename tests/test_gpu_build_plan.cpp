// build_plan on the GPU against the CPU plan of the same selection: every buffer equal,
// including the schedule's order and its -1 tail; invalid selections flagged on the device.
#include "test_gpu_shapes.h"
#include "test_gpu_support.h"

namespace msa::test {
namespace {

std::vector<int32_t> host_ints(const Buffer& b) {
  const TensorView v = b.view();
  const auto* p = v.as<const int32_t>();
  return std::vector<int32_t>(p, p + v.numel());
}

void compare_plans(const Topology& topo, const PackedLayout& L, const HostTensor& topk, int q_per_cta) {
  SCOPED_TRACE("q_per_cta " + std::to_string(q_per_cta));
  PlanOptions options;
  options.q_per_cta = q_per_cta;
  const SparsePlan cpu = build_plan(topo, L, topk.view(), options);
  DeviceTensor dtopk(topk);
  const SparsePlan gpu = build_plan(topo, L, dtopk.view(), options);
  EXPECT_EQ(gpu.device, kGpu);
  EXPECT_EQ(gpu.work_count, -1) << "device plans leave the host work count unknown";
  EXPECT_EQ(device_ints(gpu.status), (std::vector<int32_t>{0, 0, 0, 0}));
  EXPECT_EQ(device_ints(gpu.rows), host_ints(cpu.rows));
  EXPECT_EQ(device_ints(gpu.row_ptr), host_ints(cpu.row_ptr));
  EXPECT_EQ(device_ints(gpu.q_indices), host_ints(cpu.q_indices));
  EXPECT_EQ(device_ints(gpu.split_slot), host_ints(cpu.split_slot));
  EXPECT_EQ(device_ints(gpu.split_counts), host_ints(cpu.split_counts));
  EXPECT_EQ(device_ints(gpu.work_count_dev), host_ints(cpu.work_count_dev));
  EXPECT_EQ(device_ints(gpu.schedule), host_ints(cpu.schedule)) << "schedule entries and order must match the CPU";
}

TEST(GpuPlan, MatchesCpuPlanOnEdgeAndRealShapes) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  std::vector<NamedLayout> shapes = edge_layouts();
  for (auto& s : real_layouts(2048, 3000)) shapes.push_back(std::move(s));
  for (const auto& s : shapes) {
    SCOPED_TRACE(s.name);
    const HostTensor topk = library_selection(rng, topo, s.layout);
    compare_plans(topo, s.layout, topk, 8);
    if (&s == &shapes.back() || s.name == "long document") {
      compare_plans(topo, s.layout, topk, 5);
      compare_plans(topo, s.layout, topk, 64);
      compare_plans(topo, s.layout, topk, 1);
    }
  }
}

// Steps of up to 2048 queries (32768 edges a KV head), 8192 rows and 8 KV heads build their
// schedule in one cluster, a CTA per KV head exchanging item counts (build_plan.cu); larger ones
// through the sort. Both must give the CPU's plan, for every item size the cluster path takes
// (<= 64) and one it leaves to the sort, with rows ranked by counting (<= 16 edges) and through
// a bitmap of local queries (up to 2047).
TEST(GpuPlan, SmallStepsMatchCpuPlanEveryItemSize) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  struct Step {
    const char* name;
    int tp;
    PackedLayout layout;
  };
  const std::vector<Step> steps = {
      {"182 queries over 17.5k keys", 1, layout_of({182}, {17536})},
      {"2 queries over 140k keys", 1, layout_of({2}, {140000})},
      {"three requests, chunk and decode rows", 1, layout_of({100, 1, 37}, {5000, 900, 37})},
      {"1000 queries, one KV head", 4, layout_of({1000}, {4096})},
      {"2048 queries, one KV head: 32768 edges, local queries up to 2047", 4, layout_of({2048}, {2600})},
      {"2048 queries, four KV heads: 32768 edges a head", 1, layout_of({2048}, {2600})},
      {"2049 queries: over the cluster's limit", 1, layout_of({2049}, {9000})},
      {"347 queries over 131k keys: 1028 rows a head", 1, layout_of({347}, {131547})},
      {"two requests over 140k + 126k keys: 2081 rows a head", 1, layout_of({151, 176}, {140055, 125872})},
      {"8192 rows exactly", 1, layout_of({3}, {8192 * 128})},
      {"8193 rows: over the cluster's limit", 1, layout_of({3}, {8192 * 128 + 1})},
  };
  for (const Step& st : steps) {
    SCOPED_TRACE(st.name);
    const Topology topo = Topology::minimax_m3(st.tp);
    const HostTensor topk = library_selection(rng, topo, st.layout);
    for (int q_per_cta : {1, 5, 8, 64, 65}) compare_plans(topo, st.layout, topk, q_per_cta);
  }
  // An invalid id is flagged by the one-CTA path as by the sort: query 5 of 182 (position
  // 17359, block 135) given block 136, its future.
  const Topology topo;
  const PackedLayout L = layout_of({182}, {17536});
  HostTensor topk = library_selection(rng, topo, L);
  topk.data<int32_t>()[(2 * L.total_q() + 5) * 16 + 1] = 136;
  DeviceTensor dtopk(topk);
  const SparsePlan plan = build_plan(topo, L, dtopk.view());
  EXPECT_EQ(device_ints(plan.status), (std::vector<int32_t>{1, 2, 5, 1})) << "status = (1, head, row, slot)";
}

TEST(GpuPlan, HistoryInAnyOrderAndPartialSelections) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  Topology topo = Topology::minimax_m3(2);
  const PackedLayout L = layout_of({3000, 700, 5});
  HostTensor topk = library_selection(rng, topo, L);
  // Shuffle the valid prefix of every row and drop some entries (a valid, shorter prefix).
  auto* ids = topk.data<int32_t>();
  std::uniform_int_distribution<int> coin(0, 3);
  for (int64_t r = 0; r < topo.num_kv_heads * L.total_q(); ++r) {
    int32_t* row = ids + r * 16;
    int n = 0;
    while (n < 16 && row[n] >= 0) ++n;
    std::shuffle(row, row + n, rng);
    if (coin(rng) == 0 && n > 1) row[n - 1] = -1;
  }
  compare_plans(topo, L, topk, 8);
}

TEST(GpuPlan, InvalidSelectionIsFlaggedAndPoisonsOutputs) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({600, 300});
  HostTensor topk = library_selection(rng, topo, L);
  // Query 5 of document 0 sees block 0 only: block 3 is in its future.
  topk.data<int32_t>()[(2 * L.total_q() + 5) * 16 + 1] = 3;
  DeviceTensor dtopk(topk);
  const SparsePlan plan = build_plan(topo, L, dtopk.view());
  EXPECT_EQ(device_ints(plan.status), (std::vector<int32_t>{1, 2, 5, 1})) << "status = (1, head, row, slot)";
  AttentionCase c{topo, L, random_tensor(rng, {L.total_q(), 64, 128}), random_tensor(rng, {L.total_k(), 4, 128}),
                  random_tensor(rng, {L.total_k(), 4, 128}), HostTensor(topk), SparsePlan{}};
  DeviceTensor q(c.q), k(c.k), v(c.v);
  const ForwardOutputs o = gpu_forward(c, plan, q, k, v, dtopk);
  const auto out = o.out.floats(), lse = o.lse.floats();
  EXPECT_EQ(count_nan(out), int64_t(out.size())) << "an invalid plan must give NaN outputs, not a plausible result";
  EXPECT_EQ(count_nan(lse), int64_t(lse.size()));
}

}  // namespace
}  // namespace msa::test
