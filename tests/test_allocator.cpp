// The process-wide device allocator (set_device_allocator): installing, querying and resetting
// it on any machine; on a GPU, that every CUDA allocation of a plan goes through it with the
// caller's stream and comes back, and that with a capture-safe allocator a whole step (indexer,
// plan, forward) can be captured in a CUDA graph and replayed with new contents.
#include "test_gpu_support.h"

#if MSA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace msa::test {
namespace {

struct Counting {
  int allocations = 0, releases = 0;
  int64_t live_bytes = 0;
  void* expected_stream = nullptr;
  int wrong_stream = 0;
};

void* counting_allocate(int64_t bytes, int device, void* stream, void* context) {
  auto* c = static_cast<Counting*>(context);
  ++c->allocations;
  c->live_bytes += bytes;
  if (stream != c->expected_stream) ++c->wrong_stream;
#if MSA_WITH_CUDA
  void* p = nullptr;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  const cudaError_t err = cudaMalloc(&p, size_t(bytes));
  cudaSetDevice(previous);
  return err == cudaSuccess ? p : nullptr;
#else
  (void)device;
  return nullptr;
#endif
}

void counting_deallocate(void* ptr, int64_t bytes, int, void*, void* context) {
  auto* c = static_cast<Counting*>(context);
  ++c->releases;
  c->live_bytes -= bytes;
#if MSA_WITH_CUDA
  cudaFree(ptr);
#else
  (void)ptr;
#endif
}

// Resets the allocator when a test ends, whatever happens.
struct AllocatorScope {
  ~AllocatorScope() { reset_device_allocator(); }
};

// The plan's small buffers are slices of one allocation (core/buffer_pack.h).
TEST(Allocator, BufferSlicesShareOwnershipAndStayInBounds) {
  Buffer piece;
  {
    const Buffer whole(Device::cpu(), DType::u8, {1024});
    std::memset(whole.data(), 7, 1024);
    piece = whole.slice(256, DType::i32, {4, 8});
    EXPECT_EQ(piece.data(), static_cast<char*>(whole.data()) + 256);
    EXPECT_EQ(piece.bytes(), 128);
    EXPECT_EQ(piece.view().shape_vector(), (std::vector<int64_t>{4, 8}));
    EXPECT_EQ(piece.view().dtype, DType::i32);
    expect_error([&] { (void)whole.slice(1000, DType::i32, {8}); }, {"32 bytes at offset 1000 do not fit a buffer of 1024"});
    expect_error([&] { (void)whole.slice(2, DType::i32, {1}); }, {"not a multiple of the int32 size"});
  }
  // The whole buffer is gone from scope; the slice still owns its memory.
  EXPECT_EQ(static_cast<const unsigned char*>(piece.data())[127], 7);
}

TEST(Allocator, InstallQueryAndReset) {
  AllocatorScope scope;
  EXPECT_TRUE(device_allocator().is_default());
  Counting c;
  set_device_allocator({counting_allocate, counting_deallocate, &c});
  const DeviceAllocator a = device_allocator();
  EXPECT_FALSE(a.is_default());
  EXPECT_EQ(a.allocate, &counting_allocate);
  EXPECT_EQ(a.deallocate, &counting_deallocate);
  EXPECT_EQ(a.context, &c);
  {
    Buffer host(Device::cpu(), DType::f32, {1000});  // host memory never uses it
    EXPECT_FALSE(host.empty());
  }
  EXPECT_EQ(c.allocations, 0);
  reset_device_allocator();
  EXPECT_TRUE(device_allocator().is_default());
  // Both functions or neither.
  DeviceAllocator half;
  half.allocate = counting_allocate;
  expect_error([&] { set_device_allocator(half); }, {"set_device_allocator", "both allocate and deallocate"});
  EXPECT_TRUE(device_allocator().is_default());
  set_device_allocator({counting_allocate, counting_deallocate, &c});
  set_device_allocator(DeviceAllocator{});  // an empty allocator is the default
  EXPECT_TRUE(device_allocator().is_default());
}

#if MSA_WITH_CUDA
#define CHECK_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

TEST(GpuAllocator, PlanMemoryComesFromTheAllocatorOnTheCallersStream) {
  MSA_REQUIRE_GPU();
  AllocatorScope scope;
  MSA_SEEDED_RNG(rng);
  const Topology topo = Topology::minimax_m3(4);
  // 2,700 queries x 1 KV head x 16 = 43,200 edges: over the one-CTA schedule's 32,768, so the
  // plan also takes its sort scratch from the allocator.
  const PackedLayout L = layout_of({2400, 300});
  const AttentionCase c = make_case(rng, topo, L);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const DeviceTensor topk(c.topk);
  synchronize(kGpu);
  Counting counts;
  counts.expected_stream = stream;
  set_device_allocator({counting_allocate, counting_deallocate, &counts});
  RunOptions opt;
  opt.stream = stream;
  {
    const SparsePlan plan = build_plan(topo, L, topk.view(), {}, opt);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    EXPECT_GT(counts.allocations, 10) << "plan buffers, workspace and scratch";
    EXPECT_GT(counts.live_bytes, 0);
    EXPECT_EQ(counts.wrong_stream, 0) << "allocations for another stream than RunOptions::stream";
    // The forward on that plan agrees with the CPU.
    const DeviceTensor q(c.q), k(c.k), v(c.v);
    synchronize(kGpu);
    const ForwardOutputs got = gpu_forward(c, plan, q, k, v, topk);
    expect_rel_l2("out", got.out.floats(), doubles(run_forward(c).out.floats()), 1e-2);
  }
  EXPECT_EQ(counts.allocations, counts.releases) << "every allocation is given back when the plan goes";
  EXPECT_EQ(counts.live_bytes, 0);
  // Memory given out before a reset goes back to the allocator that gave it.
  Counting second;
  second.expected_stream = nullptr;
  set_device_allocator({counting_allocate, counting_deallocate, &second});
  {
    Buffer b(kGpu, DType::f32, {256});
    reset_device_allocator();
  }
  EXPECT_EQ(second.allocations, 1);
  EXPECT_EQ(second.releases, 1);
  CHECK_CUDA(cudaStreamDestroy(stream));
}

// A bump allocator over one cudaMalloc'ed block: no CUDA call per allocation, so it works
// during stream capture; memory is never reused, so a captured graph may keep using it.
struct Arena {
  char* base = nullptr;
  size_t size = 0, used = 0;
  int allocations = 0;
};

void* arena_allocate(int64_t bytes, int, void*, void* context) {
  auto* a = static_cast<Arena*>(context);
  const size_t at = (a->used + 255) / 256 * 256;
  if (at + size_t(bytes) > a->size) return nullptr;
  a->used = at + size_t(bytes);
  ++a->allocations;
  return a->base + at;
}
void arena_deallocate(void*, int64_t, int, void*, void*) {}

TEST(GpuAllocator, IndexerPlanAndForwardCaptureInOneGraph) {
  MSA_REQUIRE_GPU();
  AllocatorScope scope;
  MSA_SEEDED_RNG(rng);
  const Topology topo = Topology::minimax_m3(4);  // 16 query heads, one KV group
  const PackedLayout L = layout_of({2500, 700, 33});
  const int64_t Tq = L.total_q(), Tk = L.total_k();
  Arena arena;
  arena.size = size_t(1) << 30;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&arena.base), arena.size));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RunOptions opt;
  opt.stream = stream;

  SelectForwardBuffers b(topo, Tq, Tk);
  const SelectBlocksParams sp = b.select_params(false);
  const AttentionForwardParams fp = b.forward_params(b.topk.view());
  synchronize(kGpu);

  set_device_allocator({arena_allocate, arena_deallocate, &arena});
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  try {
    select_blocks(topo, L, sp, opt);
    const SparsePlan plan = build_plan(topo, L, b.topk.view(), {}, opt);  // planned on every replay
    sparse_attention_forward(topo, L, plan, fp, opt);
  } catch (const std::exception& e) {
    cudaGraph_t broken;
    cudaStreamEndCapture(stream, &broken);
    FAIL() << "capture failed: " << e.what();
  }
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  reset_device_allocator();
  EXPECT_GT(arena.allocations, 10);
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    const HostTensor hiq = random_tensor(rng, {Tq, 1, 128}), hik = random_tensor(rng, {Tk, 1, 128});
    AttentionCase c{topo, L, random_tensor(rng, {Tq, 16, 128}), random_tensor(rng, {Tk, 1, 128}),
                    random_tensor(rng, {Tk, 1, 128}), HostTensor(), SparsePlan{}};
    b.refill(hiq, hik, c);
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    // The CPU forward on the selection the replay made (near-ties may pick other blocks than
    // the CPU indexer would; the attention must match for the selection used).
    c.topk = b.topk.host();
    c.plan = build_plan(topo, L, c.topk.view());
    const ForwardOutputs want = run_forward(c);
    const auto go = b.out.host().floats();
    ASSERT_EQ(count_nan(go), 0) << "NaN in the replayed output (invalid plan or unwritten rows)";
    expect_rel_l2("out", go, doubles(want.out.floats()), 1e-2);
    expect_close("lse", b.lse.host().floats(), doubles(want.lse.floats()), 1e-3, 1e-3);
  }
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
  CHECK_CUDA(cudaFree(arena.base));
}
#else
TEST(GpuAllocator, PlanMemoryComesFromTheAllocatorOnTheCallersStream) {
  GTEST_SKIP() << "built without CUDA: GPU test skipped";
}
TEST(GpuAllocator, IndexerPlanAndForwardCaptureInOneGraph) { GTEST_SKIP() << "built without CUDA: GPU test skipped"; }
#endif

}  // namespace
}  // namespace msa::test
