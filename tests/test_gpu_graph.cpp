// select_blocks + forward captured in a CUDA graph with a prebuilt plan, replayed with new
// input contents: the replays must compute on the new contents (nothing baked in but
// pointers and the plan).
#include "test_gpu_support.h"

#if MSA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace msa::test {
namespace {

#if MSA_WITH_CUDA
#define CHECK_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

int64_t rows_differing(const HostTensor& a, const HostTensor& b) {
  const auto x = a.ints(), y = b.ints();
  int64_t n = 0;
  for (size_t r = 0; r < x.size() / 16; ++r)
    n += !std::equal(x.begin() + long(r * 16), x.begin() + long(r * 16 + 16), y.begin() + long(r * 16));
  return n;
}

TEST(GpuGraph, SelectAndForwardReplayWithNewContents) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({3000, 1100, 77});
  const int64_t Tq = L.total_q(), Tk = L.total_k();
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RunOptions opt;
  opt.stream = stream;

  // The plan comes from a first selection; the graph reuses it on every replay.
  const HostTensor iq0 = random_tensor(rng, {Tq, 4, 128}), ik0 = random_tensor(rng, {Tk, 1, 128});
  const Selection sel0 = gpu_select(topo, L, iq0, ik0, false);
  DeviceTensor plan_topk(sel0.topk);
  synchronize(kGpu);  // uploads ran on the legacy stream; the work below runs on `stream`
  const SparsePlan plan = build_plan(topo, L, plan_topk.view(), {}, opt);

  SelectForwardBuffers b(topo, Tq, Tk);
  const SelectBlocksParams sp = b.select_params(true);
  const AttentionForwardParams fp = b.forward_params(plan_topk.view());
  CHECK_CUDA(cudaStreamSynchronize(stream));

  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  select_blocks(topo, L, sp, opt);
  sparse_attention_forward(topo, L, plan, fp, opt);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    const HostTensor hiq = random_tensor(rng, {Tq, 4, 128}), hik = random_tensor(rng, {Tk, 1, 128});
    AttentionCase c{topo, L, random_tensor(rng, {Tq, 64, 128}), random_tensor(rng, {Tk, 4, 128}),
                    random_tensor(rng, {Tk, 4, 128}), HostTensor(sel0.topk), SparsePlan{}};
    c.plan = build_plan(topo, L, c.topk.view());
    b.refill(hiq, hik, c);
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));

    const Selection want_sel = cpu_select(topo, L, hiq, hik, false);
    EXPECT_LE(rows_differing(b.topk.host(), want_sel.topk), 4 * Tq / 100) << "the replayed indexer did not use the new contents";
    const ForwardOutputs want = run_forward(c);
    const auto go = b.out.host().floats(), gl = b.lse.host().floats();
    ASSERT_EQ(count_nan(go), 0);
    expect_rel_l2("out", go, doubles(want.out.floats()), 1e-2);
    expect_close("lse", gl, doubles(want.lse.floats()), 1e-3, 1e-3);
  }
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
}
#else
TEST(GpuGraph, SelectAndForwardReplayWithNewContents) { GTEST_SKIP() << "built without CUDA: GPU test skipped"; }
#endif

}  // namespace
}  // namespace msa::test
