// select_blocks on the GPU against the CPU backend. Selections must be equal; a row may
// differ only at a near-tie of block scores (fp32 sums in another order), which is checked
// against the float64 oracle's scores. The selected LSE is compared where the rows agree.
#include <cstring>

#include "test_gpu_shapes.h"
#include "test_gpu_support.h"

namespace msa::test {
namespace {

struct IndexerInputs {
  HostTensor iq, ik;
};

IndexerInputs random_inputs(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L) {
  return {random_tensor(rng, {L.total_q(), topo.num_index_heads, topo.index_head_dim}),
          random_tensor(rng, {L.total_k(), 1, topo.index_head_dim})};
}

// Compares GPU and CPU selections row by row; `same` marks the rows that are identical.
// At most `max_differing` of the rows (1 %, at least 2) may differ: fp32 sums in another order
// move a score by a few ulps; the FP8 kernel's narrower tensor-core sums by more.
void compare_selections(const Topology& topo, const PackedLayout& L, const IndexerInputs& in, const HostTensor& got,
                        const HostTensor& want, double tie_tolerance, std::vector<char>& same,
                        double max_differing = 0.01) {
  const int K = topo.topk, Hi = topo.num_index_heads;
  const auto g = got.ints(), w = want.ints();
  same.assign(size_t(Hi * L.total_q()), 1);
  int64_t differing = 0;
  std::vector<float> iqf, ikf;
  const auto docs = oracle_docs(L);
  for (int h = 0; h < Hi; ++h)
    for (int b = 0; b < L.num_documents(); ++b) {
      const DocumentSpan& d = L.document(b);
      for (int64_t i = 0; i < d.q_len; ++i) {
        const int64_t r = int64_t(h) * L.total_q() + d.q_start + i;
        const std::vector<int32_t> gr(g.begin() + r * K, g.begin() + (r + 1) * K), wr(w.begin() + r * K, w.begin() + (r + 1) * K);
        for (int32_t x : gr) ASSERT_NE(x, kIntPoison) << "topk row " << r << " was not written";
        if (gr == wr) continue;
        same[size_t(r)] = 0;
        ++differing;
        // A near-tie: same forced blocks, and every block the GPU ranked scores within the
        // tolerance of the weakest block the CPU ranked (scores from the float64 oracle).
        if (iqf.empty()) {
          iqf = in.iq.floats();
          ikf = in.ik.floats();
        }
        const oracle::RowSelection sel = oracle::select_row(topo, docs[size_t(b)], i, h, iqf.data(), ikf.data());
        double weakest = std::numeric_limits<double>::infinity();
        for (int32_t id : sel.ranked) weakest = std::min(weakest, sel.block_scores[size_t(id)]);
        const size_t ni = sel.forced_init.size(), nr = sel.ranked.size(), nl = sel.forced_local.size();
        ASSERT_EQ(std::vector<int32_t>(gr.begin(), gr.begin() + long(ni)), sel.forced_init) << "row " << r;
        ASSERT_EQ(std::vector<int32_t>(gr.begin() + long(ni + nr), gr.begin() + long(ni + nr + nl)), sel.forced_local)
            << "row " << r << ": local blocks must close the valid prefix";
        std::set<int32_t> seen;
        for (size_t s = ni; s < ni + nr; ++s) {
          const int32_t id = gr[s];
          ASSERT_TRUE(id >= 0 && seen.insert(id).second) << "row " << r << " slot " << s << " id " << id;
          EXPECT_GE(sel.block_scores[size_t(id)], weakest - tie_tolerance)
              << "row " << r << ": block " << id << " is not a near-tie of the CPU's selection";
        }
      }
    }
  ::testing::Test::RecordProperty("rows_differing_at_ties", std::to_string(differing));
  EXPECT_LE(differing, std::max<int64_t>(2, int64_t(max_differing * double(Hi * L.total_q()))))
      << "too many rows differ from the CPU";
}

void compare_lse(const HostTensor& got, const HostTensor& want, const std::vector<char>& same) {
  const auto g = got.floats(), w = want.floats();
  std::vector<float> gs;
  std::vector<double> ws;
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_FALSE(std::isnan(g[i]) && !std::isnan(w[i])) << "selected_lse[" << i << "] not written or NaN";
    if (!same[i] || std::isnan(w[i])) continue;
    gs.push_back(g[i]);
    ws.push_back(w[i]);
  }
  expect_close("selected_lse", gs, ws, 2e-3, 2e-3);
}

void check_indexer(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L, float temperature = 1.0f) {
  const IndexerInputs in = random_inputs(rng, topo, L);
  const Selection gpu = gpu_select(topo, L, in.iq, in.ik, true, temperature);
  const Selection cpu = cpu_select(topo, L, in.iq, in.ik, true, temperature);
  std::vector<char> same;
  compare_selections(topo, L, in, gpu.topk, cpu.topk, 5e-3, same);
  compare_lse(gpu.lse, cpu.lse, same);
}

TEST(GpuIndexer, EdgeCaseLayouts) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const auto& s : edge_layouts()) {
    SCOPED_TRACE(s.name);
    check_indexer(rng, Topology(), s.layout);
  }
}

TEST(GpuIndexer, RealShapes) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  for (const auto& s : real_layouts(8192, 8192)) {
    SCOPED_TRACE(s.name);
    check_indexer(rng, Topology(), s.layout);
  }
}

TEST(GpuIndexer, ManyDocumentsSpanLaunchBatches) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  // More documents than one launch takes (the indexer's and the selected LSE's batches), of
  // lengths from 1 token to a few blocks, some with a cached prefix.
  std::vector<int64_t> q, k;
  for (int i = 0; i < 400; ++i) {
    const int64_t len = 1 + int64_t(rng() % 300);
    q.push_back(len);
    k.push_back(i % 3 == 0 ? len + int64_t(rng() % 2000) : len);
  }
  check_indexer(rng, Topology(), layout_of(q, k));
}

TEST(GpuIndexer, TensorParallelTopologiesAndTemperature) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const PackedLayout L = layout_of({3000, 2200, 90});
  for (int tp : {1, 2, 4}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    check_indexer(rng, Topology::minimax_m3(tp), L, tp == 2 ? 0.5f : 1.0f);
  }
}

TEST(GpuIndexer, InitAndLocalForcing) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const PackedLayout L = layout_of({4000, 300}, {4000, 2500});
  for (auto [init, local] : {std::pair{0, 2}, std::pair{2, 1}, std::pair{3, 4}, std::pair{8, 8}, std::pair{0, 16}}) {
    SCOPED_TRACE("init " + std::to_string(init) + " local " + std::to_string(local));
    Topology topo;
    topo.init_blocks = init;
    topo.local_blocks = local;
    check_indexer(rng, topo, L);
  }
}

TEST(GpuIndexer, TiesPreferLowerBlockIds) {
  MSA_REQUIRE_GPU();
  // All-zero index vectors: every score ties, so the 15 lowest ids win (docs/semantics.md §3.4).
  const Topology topo;
  const PackedLayout L = layout_of({2304, 700});
  HostTensor iq(DType::bf16, {L.total_q(), 4, 128}), ik(DType::bf16, {L.total_k(), 1, 128});
  const Selection gpu = gpu_select(topo, L, iq, ik);
  const Selection cpu = cpu_select(topo, L, iq, ik);
  EXPECT_EQ(gpu.topk.ints(), cpu.topk.ints());
  const auto ids = gpu.topk.ints();
  const std::vector<int32_t> last(ids.begin() + 2303 * 16, ids.begin() + 2304 * 16);
  EXPECT_EQ(last, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 17}));
  compare_lse(gpu.lse, cpu.lse, std::vector<char>(size_t(4 * L.total_q()), 1));
}

TEST(GpuIndexer, NanScoresAreNeverSelected) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({4000});
  IndexerInputs in = random_inputs(rng, topo, L);
  // NaN keys in a few blocks; those blocks score NaN for every query that sees the key.
  for (int64_t t : {130, 1000, 1001, 2600, 3999}) in.ik.set(t * 128 + 7, std::numeric_limits<float>::quiet_NaN());
  const Selection gpu = gpu_select(topo, L, in.iq, in.ik);
  const Selection cpu = cpu_select(topo, L, in.iq, in.ik);
  std::vector<char> same;
  compare_selections(topo, L, in, gpu.topk, cpu.topk, 5e-3, same);
  const auto g = gpu.lse.floats(), w = cpu.lse.floats();
  for (size_t i = 0; i < g.size(); ++i) {
    if (same[i]) {
      ASSERT_EQ(std::isnan(g[i]), std::isnan(w[i])) << "selected_lse NaN pattern differs at " << i;
    }
  }
  compare_lse(gpu.lse, cpu.lse, same);
}

// The FP8 kernel's rows that may differ from the exact selection, all at near-ties (on an H100
// about 1.8 % of the rows of random unit-scale codes did).
constexpr double kFp8Differing = 0.05;

TEST(GpuIndexer, Fp8InputsOnFp8TensorCores) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  // E4M3 index q and K (the FP8 wgmma kernel) against the CPU's exact scores: the same
  // selections up to near-ties. Its selected LSE is computed on bf16 copies of the codes, so on
  // every row where its selection equals that of the bf16 kernel on those copies, the LSE is
  // the same bits. Also 0.05-scaled codes, down among the subnormals.
  const Topology topo;
  const PackedLayout L = layout_of({4000, 300, 1, 129}, {4000, 300, 1, 2500});
  for (const float scale : {1.0f, 0.05f}) {
    SCOPED_TRACE("scale " + std::to_string(scale));
    const IndexerInputs fp8{
        random_tensor(rng, {L.total_q(), topo.num_index_heads, topo.index_head_dim}, scale, DType::f8e4m3),
        random_tensor(rng, {L.total_k(), 1, topo.index_head_dim}, scale, DType::f8e4m3)};
    const Selection gpu = gpu_select(topo, L, fp8.iq, fp8.ik, true);
    const Selection cpu = cpu_select(topo, L, fp8.iq, fp8.ik, true);
    std::vector<char> same;
    compare_selections(topo, L, fp8, gpu.topk, cpu.topk, 5e-3, same, kFp8Differing);
    compare_lse(gpu.lse, cpu.lse, same);
    const Selection wide = gpu_select(topo, L, converted(fp8.iq, DType::bf16), converted(fp8.ik, DType::bf16), true);
    const auto gt = gpu.topk.ints(), wt = wide.topk.ints();
    const auto gl = gpu.lse.floats(), wl = wide.lse.floats();
    int64_t equal_rows = 0;
    for (size_t r = 0; r < gl.size(); ++r) {
      if (!std::equal(gt.begin() + long(r * 16), gt.begin() + long(r * 16 + 16), wt.begin() + long(r * 16))) continue;
      ++equal_rows;
      ASSERT_EQ(std::memcmp(&gl[r], &wl[r], sizeof(float)), 0) << "selected_lse row " << r;
    }
    EXPECT_GE(double(equal_rows), (1.0 - kFp8Differing) * double(gl.size()));
  }
}

TEST(GpuIndexer, OneFp8InputIsWidenedToBf16) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  // One side E4M3 and the other bf16: the E4M3 side is widened (exactly) and the bf16 kernel
  // runs, so the result is bitwise that of bf16 copies on both sides.
  const Topology topo;
  const PackedLayout L = layout_of({3000, 129}, {3000, 2500});
  const HostTensor q8 = random_tensor(rng, {L.total_q(), topo.num_index_heads, topo.index_head_dim}, 1.0f, DType::f8e4m3);
  const HostTensor k8 = random_tensor(rng, {L.total_k(), 1, topo.index_head_dim}, 1.0f, DType::f8e4m3);
  const HostTensor q16 = converted(q8, DType::bf16), k16 = converted(k8, DType::bf16);
  const Selection both_bf16 = gpu_select(topo, L, q16, k16, true);
  for (const auto& [q, k] : {std::pair{&q8, &k16}, std::pair{&q16, &k8}}) {
    const Selection mixed = gpu_select(topo, L, *q, *k, true);
    EXPECT_TRUE(bitwise_equal(mixed.topk, both_bf16.topk));
    EXPECT_TRUE(bitwise_equal(mixed.lse, both_bf16.lse));
  }
}

TEST(GpuIndexer, Fp8TiesAndNans) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  {
    // All-zero codes: every score ties on the FP8 kernel too, and the lowest ids win.
    const PackedLayout L = layout_of({2304, 700});
    HostTensor iq(DType::f8e4m3, {L.total_q(), 4, 128}), ik(DType::f8e4m3, {L.total_k(), 1, 128});
    EXPECT_EQ(gpu_select(topo, L, iq, ik).topk.ints(), cpu_select(topo, L, iq, ik).topk.ints());
  }
  // NaN codes (0x7f) in a few keys: their blocks score NaN for every query that sees them and
  // are never ranked.
  const PackedLayout L = layout_of({4000});
  IndexerInputs in{random_tensor(rng, {L.total_q(), 4, 128}, 1.0f, DType::f8e4m3),
                   random_tensor(rng, {L.total_k(), 1, 128}, 1.0f, DType::f8e4m3)};
  for (int64_t t : {130, 1000, 1001, 2600, 3999}) in.ik.set(t * 128 + 7, std::numeric_limits<float>::quiet_NaN());
  const Selection gpu = gpu_select(topo, L, in.iq, in.ik);
  const Selection cpu = cpu_select(topo, L, in.iq, in.ik);
  std::vector<char> same;
  compare_selections(topo, L, in, gpu.topk, cpu.topk, 5e-3, same, kFp8Differing);
}

TEST(GpuIndexer, RepeatedRunsAreBitwiseIdentical) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({5000, 1234});
  const IndexerInputs in = random_inputs(rng, topo, L);
  const Selection first = gpu_select(topo, L, in.iq, in.ik);
  for (int i = 0; i < 10; ++i) {
    const Selection again = gpu_select(topo, L, in.iq, in.ik);
    ASSERT_TRUE(bitwise_equal(again.topk, first.topk));
    ASSERT_TRUE(bitwise_equal(again.lse, first.lse));
  }
}

}  // namespace
}  // namespace msa::test
