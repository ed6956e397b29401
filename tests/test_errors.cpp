// Every rejected call names the culprit (docs/semantics.md §13) and leaves its outputs
// untouched: outputs are poisoned before the call and compared byte for byte after it.
#include "test_support.h"

namespace msa::test {
namespace {

class Errors : public ::testing::Test {
 protected:
  // Two documents of 3 and 200 tokens: total_q = total_k = 203.
  Topology topo;
  PackedLayout L = layout_of({3, 200});
  std::mt19937_64 rng{12345};
  // Values do not matter for validation: zeros keep the fixture cheap.
  HostTensor q{DType::bf16, {203, 64, 128}}, k{DType::bf16, {203, 4, 128}}, v{DType::bf16, {203, 4, 128}};
  HostTensor index_q{DType::bf16, {203, 4, 128}}, index_k{DType::bf16, {203, 1, 128}};
  HostTensor topk = all_visible(topo, L);
  HostTensor lse{DType::f32, {203, 64}}, index_lse{DType::f32, {4, 203}};
  HostTensor out{DType::bf16, {203, 64, 128}}, dout{DType::bf16, {203, 64, 128}};
  SparsePlan plan = build_plan(topo, L, topk.view());

  // Outputs, poisoned.
  HostTensor topk_out{DType::i32, {4, 203, 16}}, lse_out{DType::f32, {4, 203}};
  HostTensor o{DType::bf16, {203, 64, 128}}, o_lse{DType::f32, {203, 64}};
  HostTensor dq{DType::bf16, {203, 64, 128}}, dk{DType::bf16, {203, 4, 128}}, dv{DType::bf16, {203, 4, 128}};
  HostTensor diq{DType::f32, {203, 4, 128}}, dik{DType::f32, {203, 1, 128}};

  void SetUp() override {
    for (HostTensor* t : {&topk_out, &lse_out, &o, &o_lse, &dq, &dk, &dv, &diq, &dik}) poison(*t);
  }

  // Every visible block, ascending (documents here have at most 2 blocks).
  static HostTensor all_visible(const Topology& topo, const PackedLayout& L) {
    HostTensor t(DType::i32, {topo.num_kv_heads, L.total_q(), topo.topk});
    int32_t* ids = t.data<int32_t>();
    std::fill(ids, ids + t.numel(), -1);
    for (const DocumentSpan& d : L.documents())
      for (int64_t i = 0; i < d.q_len; ++i)
        for (int g = 0; g < topo.num_kv_heads; ++g)
          for (int b = 0; b <= (d.k_len - d.q_len + i) / 128; ++b) ids[(g * L.total_q() + d.q_start + i) * 16 + b] = b;
    return t;
  }

  SelectBlocksParams select_params() const {
    SelectBlocksParams p;
    p.index_q = index_q.view();
    p.index_k = index_k.view();
    p.topk = topk_out.view();
    p.selected_lse = lse_out.view();
    return p;
  }
  AttentionForwardParams forward_params() const {
    AttentionForwardParams p;
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.topk = topk.view();
    p.out = o.view();
    p.lse = o_lse.view();
    return p;
  }
  AttentionBackwardParams backward_params() const {
    AttentionBackwardParams p;
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.topk = topk.view();
    p.out = out.view();
    p.lse = lse.view();
    p.dout = dout.view();
    p.dq = dq.view();
    p.dk = dk.view();
    p.dv = dv.view();
    return p;
  }
  KlBackwardParams kl_params() const {
    KlBackwardParams p;
    p.q = q.view();
    p.k = k.view();
    p.lse = lse.view();
    p.index_q = index_q.view();
    p.index_k = index_k.view();
    p.index_lse = index_lse.view();
    p.topk = topk.view();
    p.dindex_q = diq.view();
    p.dindex_k = dik.view();
    return p;
  }

  // The call must throw msa::Error with all `pieces` and leave every output as it was.
  void expect_rejected(const std::function<void()>& call, const std::vector<std::string>& pieces,
                       ErrorKind kind = ErrorKind::invalid_argument) {
    std::vector<HostTensor*> outputs = {&topk_out, &lse_out, &o, &o_lse, &dq, &dk, &dv, &diq, &dik};
    std::vector<std::vector<unsigned char>> before;
    for (HostTensor* t : outputs) before.push_back(t->raw());
    expect_error(call, pieces, kind);
    for (size_t n = 0; n < outputs.size(); ++n)
      EXPECT_TRUE(outputs[n]->raw() == before[n]) << "output " << n << " was written by a rejected call";
  }

  void select(const SelectBlocksParams& p, const Topology& t) { select_blocks(t, L, p); }
  void select(const SelectBlocksParams& p) { select_blocks(topo, L, p); }
  void forward(const AttentionForwardParams& p) { sparse_attention_forward(topo, L, plan, p); }
  void backward(const AttentionBackwardParams& p) { sparse_attention_backward(topo, L, plan, p); }
  void kl(const KlBackwardParams& p) { kl_backward(topo, L, plan, p); }
};

// A non-contiguous view with the expected shape: every other row of a buffer twice as long.
TensorView every_other_row(const HostTensor& big, std::vector<int64_t> shape) {
  std::vector<int64_t> stride(shape.size(), 1);
  for (size_t i = shape.size() - 1; i-- > 0;) stride[i] = stride[i + 1] * shape[i + 1];
  stride[0] *= 2;
  return TensorView::strided(big.view().data, big.dtype(), shape, stride);
}

// ---- dtype / shape / contiguity / presence ---------------------------------------------------

TEST_F(Errors, WrongDtype) {
  const HostTensor iq32(DType::f32, {203, 4, 128});
  auto p = select_params();
  p.index_q = iq32.view();
  expect_rejected([&] { select(p); }, {"index_q must be bf16 or fp8_e4m3, got f32"});
  const HostTensor ik16(DType::f16, {203, 1, 128});
  p = select_params();
  p.index_k = ik16.view();
  expect_rejected([&] { select(p); }, {"index_k must be bf16 or fp8_e4m3, got f16"});

  const HostTensor q16(DType::f16, {203, 64, 128});
  auto f = forward_params();
  f.q = q16.view();
  expect_rejected([&] { forward(f); }, {"q must be bf16, got f16"});

  const HostTensor v8(DType::f8e4m3, {203, 4, 128});
  f = forward_params();
  f.v = v8.view();
  expect_rejected([&] { forward(f); }, {"v must be bf16, got fp8_e4m3"});

  HostTensor out_i32(DType::i32, {203, 64, 128});
  f = forward_params();
  f.out = out_i32.view();
  expect_rejected([&] { forward(f); }, {"out must be bf16 or f32, got int32"});

  const HostTensor topk_f(DType::f32, {4, 203, 16});
  expect_rejected([&] { build_plan(topo, L, topk_f.view()); }, {"topk must be int32, got f32"});

  const HostTensor lse16(DType::bf16, {203, 64});
  auto b = backward_params();
  b.lse = lse16.view();
  expect_rejected([&] { backward(b); }, {"lse must be f32, got bf16"});

  const HostTensor ilse16(DType::bf16, {4, 203});
  auto k2 = kl_params();
  k2.index_lse = ilse16.view();
  expect_rejected([&] { kl(k2); }, {"index_lse must be f32, got bf16"});
}

TEST_F(Errors, WrongShapeNamesArgumentExpectedAndActual) {
  const HostTensor iq(DType::bf16, {203, 4, 64});
  auto p = select_params();
  p.index_q = iq.view();
  expect_rejected([&] { select(p); }, {"index_q must have shape [total_q=203, Hi=4, 128], got [203, 4, 64]"});

  const HostTensor ik(DType::bf16, {203, 4, 128});
  p = select_params();
  p.index_k = ik.view();
  expect_rejected([&] { select(p); }, {"index_k must have shape [total_k=203, 1, 128], got [203, 4, 128]"});

  HostTensor small_topk(DType::i32, {4, 203, 8});
  p = select_params();
  p.topk = small_topk.view();
  expect_rejected([&] { select(p); }, {"topk must have shape [Hi=4, total_q=203, 16], got [4, 203, 8]"});

  const HostTensor q(DType::bf16, {203, 64, 64});
  auto f = forward_params();
  f.q = q.view();
  expect_rejected([&] { forward(f); }, {"q must have shape [total_q=203, Hq=64, 128], got [203, 64, 64]"});

  const HostTensor k(DType::bf16, {202, 4, 128});
  f = forward_params();
  f.k = k.view();
  expect_rejected([&] { forward(f); }, {"k must have shape [total_k=203, Hkv=4, 128], got [202, 4, 128]"});

  HostTensor lse_bad(DType::f32, {64, 203});
  f = forward_params();
  f.lse = lse_bad.view();
  expect_rejected([&] { forward(f); }, {"lse must have shape [total_q=203, Hq=64], got [64, 203]"});

  const HostTensor dout_bad(DType::bf16, {203, 64});
  auto b = backward_params();
  b.dout = dout_bad.view();
  expect_rejected([&] { backward(b); }, {"dout must have shape [total_q=203, Hq=64, 128], got [203, 64]"});

  HostTensor dk_bad(DType::bf16, {203, 64, 128});
  b = backward_params();
  b.dk = dk_bad.view();
  expect_rejected([&] { backward(b); }, {"dk must have shape [total_k=203, Hkv=4, 128], got [203, 64, 128]"});

  HostTensor dik_bad(DType::f32, {203, 4, 128});
  auto k2 = kl_params();
  k2.dindex_k = dik_bad.view();
  expect_rejected([&] { kl(k2); }, {"dindex_k must have shape [total_k=203, 1, 128], got [203, 4, 128]"});

  const HostTensor topk_bad(DType::i32, {203, 4, 16});
  expect_rejected([&] { build_plan(topo, L, topk_bad.view()); }, {"topk must have shape [Hi=4, total_q=203, 16], got [203, 4, 16]"});
}

TEST_F(Errors, NonContiguous) {
  const HostTensor big(DType::bf16, {406, 4, 128});
  auto p = select_params();
  p.index_q = every_other_row(big, {203, 4, 128});
  expect_rejected([&] { select(p); }, {"index_q must be contiguous"});

  const HostTensor bigq(DType::bf16, {406, 64, 128});
  auto f = forward_params();
  f.q = every_other_row(bigq, {203, 64, 128});
  expect_rejected([&] { forward(f); }, {"q must be contiguous"});

  HostTensor bigo(DType::bf16, {406, 64, 128});
  auto b = backward_params();
  b.dq = every_other_row(bigo, {203, 64, 128});
  expect_rejected([&] { backward(b); }, {"dq must be contiguous"});
}

TEST_F(Errors, MissingTensor) {
  auto p = select_params();
  p.index_k = {};
  expect_rejected([&] { select(p); }, {"index_k is required but was not given"});
  auto f = forward_params();
  f.out = {};
  expect_rejected([&] { forward(f); }, {"out is required but was not given"});
  auto k2 = kl_params();
  k2.index_lse = {};
  expect_rejected([&] { kl(k2); }, {"index_lse is required but was not given"});
}

TEST_F(Errors, TensorsOnDifferentDevices) {
  auto p = select_params();
  p.index_k.device = Device::cuda(0);
  expect_rejected([&] { select(p); }, {"index_k must be on cpu", "cuda:0"});
}

// The CUDA forward moves q, k and v rows with TMA: on CUDA they must start at 16-byte
// aligned addresses. Refused in validation (with or without the CUDA backend built), before
// any device work; the pointers here are never dereferenced.
TEST_F(Errors, MisalignedCudaForwardInputs) {
  SparsePlan cuda_plan = plan;
  cuda_plan.device = Device::cuda(0);
  for (const char* name : {"q", "k", "v"}) {
    auto p = forward_params();
    for (TensorView* t : {&p.q, &p.k, &p.v, &p.topk, &p.out, &p.lse}) t->device = Device::cuda(0);
    TensorView& bad = std::string(name) == "q" ? p.q : std::string(name) == "k" ? p.k : p.v;
    bad.data = static_cast<char*>(bad.data) + 2;
    expect_rejected([&] { sparse_attention_forward(topo, L, cuda_plan, p); },
                    {std::string(name) + " on CUDA must have every row start at a 16-byte aligned address",
                     "offset 2 mod 16"});
  }
}

// The CUDA indexer, backward and KL backward copy rows of their inputs with TMA or 16-byte
// asynchronous copies: each such input is refused, named, when a row is not 16-byte aligned.
TEST_F(Errors, MisalignedCudaTrainingInputs) {
  SparsePlan cuda_plan = plan;
  cuda_plan.device = Device::cuda(0);
  auto misalign = [](TensorView& t) { t.data = static_cast<char*>(t.data) + 2; };
  auto expect_misaligned = [&](const std::function<void()>& call, const std::string& name) {
    expect_rejected(call, {name + " on CUDA must have every row start at a 16-byte aligned address", "offset 2 mod 16"});
  };
  for (const std::string name : {"index_q", "index_k"}) {
    auto p = select_params();
    for (TensorView* t : {&p.index_q, &p.index_k, &p.topk, &p.selected_lse}) t->device = Device::cuda(0);
    misalign(name == "index_q" ? p.index_q : p.index_k);
    expect_misaligned([&] { select(p); }, name);
  }
  for (const std::string name : {"q", "k", "v", "dout"}) {
    auto p = backward_params();
    for (TensorView* t : {&p.q, &p.k, &p.v, &p.topk, &p.out, &p.lse, &p.dout, &p.dq, &p.dk, &p.dv})
      t->device = Device::cuda(0);
    misalign(name == "q" ? p.q : name == "k" ? p.k : name == "v" ? p.v : p.dout);
    expect_misaligned([&] { sparse_attention_backward(topo, L, cuda_plan, p); }, name);
  }
  for (const std::string name : {"q", "k", "index_q", "index_k"}) {
    auto p = kl_params();
    for (TensorView* t : {&p.q, &p.k, &p.lse, &p.index_q, &p.index_k, &p.index_lse, &p.topk, &p.dindex_q, &p.dindex_k})
      t->device = Device::cuda(0);
    misalign(name == "q" ? p.q : name == "k" ? p.k : name == "index_q" ? p.index_q : p.index_k);
    expect_misaligned([&] { kl_backward(topo, L, cuda_plan, p); }, name);
  }
}

#if !MSA_WITH_CUDA
TEST_F(Errors, CudaTensorsWithoutCudaBackend) {
  auto p = select_params();
  for (TensorView* t : {&p.index_q, &p.index_k, &p.topk, &p.selected_lse}) t->device = Device::cuda(0);
  expect_rejected([&] { select(p); }, {"built without the CUDA backend"}, ErrorKind::unsupported);
}
#endif

// ---- layouts (cu_seqlens, fragments) ---------------------------------------------------------

TEST_F(Errors, CuSeqlens) {
  expect_error([] { PackedLayout::from_cu_seqlens({0, 3, 5}, {0, 5}); },
               {"cu_seqlens_q and cu_seqlens_k must have the same shape", "[3] and [2]"});
  expect_error([] { PackedLayout::from_cu_seqlens({0}, {0}); }, {"batch >= 1"});
  expect_error([] { PackedLayout::from_cu_seqlens({}, {}); }, {"batch >= 1"});
  expect_error([] { PackedLayout::from_cu_seqlens({0, 5, 3}, {0, 5, 9}); },
               {"cu_seqlens_q must be non-decreasing", "cu_seqlens_q[1] = 5 > cu_seqlens_q[2] = 3"});
  expect_error([] { PackedLayout::from_cu_seqlens({0, 2, 3}, {0, 4, 3}); }, {"cu_seqlens_k must be non-decreasing"});
  expect_error([] { PackedLayout::from_cu_seqlens({1, 3}, {0, 3}); }, {"cu_seqlens_q[0] must be 0, got 1"});
  expect_error([] { PackedLayout::from_cu_seqlens({0, 3}, {2, 3}); }, {"cu_seqlens_k[0] must be 0, got 2"});
  const HostTensor f32(DType::f32, {3}), i2(DType::i32, {1, 3}), ok = int_tensor({0, 1, 2}, {3});
  expect_error([&] { PackedLayout::from_tensors(f32.view(), ok.view()); }, {"cu_seqlens_q must be int32, got f32"});
  expect_error([&] { PackedLayout::from_tensors(ok.view(), i2.view()); },
               {"cu_seqlens_k must have shape [batch + 1], got [1, 3]"});
}

TEST_F(Errors, FragmentIndices) {
  expect_error([] { PackedLayout::from_cu_seqlens({0, 3, 6}, {0, 3, 6}, {0}); },
               {"fragment_indices must be contiguous with shape [B] = [2], got [1]"});
  expect_error([] { PackedLayout::from_cu_seqlens({0, 3, 6}, {0, 3, 6}, {1, 1}); }, {"fragment_indices[0] must be in [0, 0]", "got 1"});
  expect_error([] { PackedLayout::from_cu_seqlens({0, 3, 6}, {0, 3, 6}, {0, -1}); }, {"fragment_indices[1] must be in [0, 1]", "got -1"});
  const HostTensor cu = int_tensor({0, 3, 6}, {3}), f32(DType::f32, {2});
  expect_error([&] { PackedLayout::from_tensors(cu.view(), cu.view(), f32.view()); }, {"fragment_indices must be int32"});
}

TEST_F(Errors, MoreQueriesThanKeys) {
  expect_error([] { PackedLayout::from_cu_seqlens({0, 2, 7}, {0, 2, 5}); },
               {"document 1 has 5 queries but only 3 keys", "q_len <= k_len"});
}

// ---- selections (build_plan validates top-k against the layout) ------------------------------

TEST_F(Errors, TopkContents) {
  // Row 10 of the 200-token document (position 7, local block 0) and row 200 (position 197,
  // local block 1); valid rows read [0, -1, ...] and [0, 1, -1, ...].
  auto with = [&](int64_t row, std::vector<int32_t> ids, int head = 1) {
    HostTensor t = all_visible(topo, L);
    int32_t* r = t.data<int32_t>() + (head * 203 + row) * 16;
    std::fill(r, r + 16, -1);
    std::copy(ids.begin(), ids.end(), r);
    return t;
  };
  const HostTensor future = with(10, {1});
  expect_rejected([&] { build_plan(topo, L, future.view()); }, {"topk[1, 10, 0] = 1 is not a visible block", "sees blocks 0..0"});
  const HostTensor out_of_range = with(200, {0, 7});
  expect_rejected([&] { build_plan(topo, L, out_of_range.view()); }, {"topk[1, 200, 1] = 7 is not a visible block"});
  const HostTensor duplicate = with(200, {1, 1});
  expect_rejected([&] { build_plan(topo, L, duplicate.view()); }, {"topk[1, 200, :] holds block 1 twice"});
  const HostTensor hole = with(200, {0, -1, 1});
  expect_rejected([&] { build_plan(topo, L, hole.view()); }, {"valid block ids must form a prefix followed by -1"});
  const HostTensor negative = with(200, {0, -3}, 3);
  expect_rejected([&] { build_plan(topo, L, negative.view()); }, {"topk[3, 200, 1] must be a block id or -1, got -3"});
  PlanOptions zero;
  zero.q_per_cta = 0;
  expect_rejected([&] { build_plan(topo, L, topk.view(), zero); }, {"q_per_cta must be >= 1, got 0"});
}

TEST_F(Errors, PlanWorkspace) {
  EXPECT_EQ(plan_workspace_bytes(topo, L, Device::cpu()), 0);
  HostTensor bytes(DType::u8, {1 << 20}), wrong_dtype(DType::f32, {1024}), two_d(DType::u8, {2, 512});
  PlanOptions given;
  given.workspace = bytes.view();
  expect_rejected([&] { build_plan(topo, L, topk.view(), given); },
                  {"options.workspace is used by CUDA plans only, but topk is on cpu"});

  // CUDA views of host memory: validation rejects them before anything reads them.
  TensorView cuda_topk = topk.view();
  cuda_topk.device = Device::cuda(0);
  auto on_cuda = [](TensorView t, int index = 0) {
    t.device = Device::cuda(index);
    return t;
  };
  given.workspace = on_cuda(wrong_dtype.view());
  expect_rejected([&] { build_plan(topo, L, cuda_topk, given); }, {"options.workspace must be uint8, got f32"});
  given.workspace = on_cuda(two_d.view());
  expect_rejected([&] { build_plan(topo, L, cuda_topk, given); }, {"options.workspace must be 1-D", "got shape [2, 512]"});
  given.workspace = on_cuda(bytes.view(), 1);
  expect_rejected([&] { build_plan(topo, L, cuda_topk, given); }, {"options.workspace", "cuda:1", "cuda:0"});
#if MSA_WITH_CUDA
  // The forward's partial outputs alone take 16 slots of bf16 [total_q, Hq, 128].
  const int64_t needed = plan_workspace_bytes(topo, L, Device::cuda(0));
  EXPECT_GE(needed, 16 * L.total_q() * topo.num_q_heads * 128 * 2);
  HostTensor too_small(DType::u8, {needed - 1});
  given.workspace = on_cuda(too_small.view());
  expect_rejected([&] { build_plan(topo, L, cuda_topk, given); },
                  {"options.workspace must hold at least plan_workspace_bytes = " + std::to_string(needed),
                   "got " + std::to_string(needed - 1)});
  HostTensor large(DType::u8, {needed + 512});
  TensorView shifted = on_cuda(large.view());
  shifted.data = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(shifted.data) + 255) / 256 * 256 + 16);
  shifted.shape[0] = needed;
  given.workspace = shifted;
  expect_rejected([&] { build_plan(topo, L, cuda_topk, given); }, {"options.workspace must start at a 256-byte aligned address"});

  // A call's own workspace: the forward's partials; the default backward's fp32 accumulators
  // (dQ, dK, dV) beside delta and a bf16 dO; the default KL's (d index_q, d index_k). The plan's
  // is the largest of the calls in either mode.
  const int64_t Tq = L.total_q(), Tk = L.total_k(), Hq = topo.num_q_heads, Hkv = topo.num_kv_heads;
  auto rounded = [](int64_t b) { return (b + 255) / 256 * 256; };
  auto bytes_of = [&](WorkspaceCall call, bool det) { return call_workspace_bytes(topo, L, Device::cuda(0), call, det); };
  EXPECT_EQ(bytes_of(WorkspaceCall::forward, false), rounded(16 * Tq * Hq * 128 * 2) + rounded(16 * Tq * Hq * 8));
  EXPECT_EQ(bytes_of(WorkspaceCall::forward, true), bytes_of(WorkspaceCall::forward, false));
  // A long document's forward holds the partials of one 4096-query window of its walk at a
  // time (src/core/walk_order.h): 1.1 GB at 16k tokens instead of 4.4.
  EXPECT_EQ(call_workspace_bytes(topo, layout_of({16384}), Device::cuda(0), WorkspaceCall::forward, false),
            rounded(16 * 4096 * Hq * 128 * 2) + rounded(16 * 4096 * Hq * 8));
  EXPECT_EQ(bytes_of(WorkspaceCall::backward, false), rounded(Tq * Hq * 4) + rounded(Tq * Hq * 128 * 2) +
                                                          rounded(Tq * Hq * 128 * 4) + 2 * rounded(Tk * Hkv * 128 * 4));
  EXPECT_EQ(bytes_of(WorkspaceCall::kl_backward, false), rounded(Tq * Hkv * 128 * 4) + rounded(Tk * 128 * 4));
  int64_t most = 0;
  for (WorkspaceCall call : {WorkspaceCall::forward, WorkspaceCall::backward, WorkspaceCall::kl_backward})
    for (bool det : {false, true}) most = std::max(most, bytes_of(call, det));
  EXPECT_EQ(most, needed);
  EXPECT_EQ(call_workspace_bytes(topo, L, Device::cpu(), WorkspaceCall::backward, true), 0);
  expect_rejected([&] { call_workspace_bytes(topo, L, Device::cuda(0), WorkspaceCall(7), false); },
                  {"call_workspace_bytes: call must be forward, backward or kl_backward, got 7"});
#else
  expect_rejected([&] { plan_workspace_bytes(topo, L, Device::cuda(0)); }, {"built without the CUDA backend"},
                  ErrorKind::unsupported);
#endif
}

// A workspace per call: refused beside a plan workspace, and on the CPU (which needs none),
// where a workspace_per_call plan is an ordinary plan.
TEST_F(Errors, WorkspacePerCall) {
  HostTensor bytes(DType::u8, {1 << 20});
  PlanOptions both;
  both.workspace_per_call = true;
  both.workspace = bytes.view();
  expect_rejected([&] { build_plan(topo, L, topk.view(), both); },
                  {"options.workspace_per_call means the plan holds no scratch", "pass the workspace to each call"});
  PlanOptions per_call;
  per_call.workspace_per_call = true;
  const SparsePlan cpu_plan = build_plan(topo, L, topk.view(), per_call);
  EXPECT_FALSE(cpu_plan.workspace_per_call);
  auto f = forward_params();
  f.workspace = bytes.view();
  expect_rejected([&] { forward(f); }, {"sparse_attention_forward workspace is used by CUDA plans only, but q is on cpu"});
  auto b = backward_params();
  b.workspace = bytes.view();
  expect_rejected([&] { backward(b); }, {"sparse_attention_backward workspace is used by CUDA plans only"});
  auto kp = kl_params();
  kp.workspace = bytes.view();
  expect_rejected([&] { kl(kp); }, {"kl_backward workspace is used by CUDA plans only"});
  // Without one the CPU plan runs as any other.
  sparse_attention_forward(topo, L, cpu_plan, forward_params());
  EXPECT_EQ(count_nan(o_lse.floats()), 0);
}

// ---- scalar parameters -------------------------------------------------------------------------

TEST_F(Errors, LseTemperature) {
  for (float t : {0.0f, -1.0f, NAN, INFINITY}) {
    auto p = select_params();
    p.lse_temperature = t;
    expect_rejected([&] { select(p); }, {"lse_temperature must be finite and > 0"});
  }
}

TEST_F(Errors, GradScale) {
  for (float s : {-1.0f, NAN, INFINITY}) {
    auto p = kl_params();
    p.grad_scale = s;
    expect_rejected([&] { kl(p); }, {"grad_scale must be finite and >= 0"});
  }
}

// ---- topology ------------------------------------------------------------------------------------

TEST_F(Errors, UnsupportedTopology) {
  struct Case {
    void (*edit)(Topology&);
    std::string message;
  };
  const Case cases[] = {
      {[](Topology& t) { t.head_dim = 64; }, "topology.head_dim must be 128, got 64"},
      {[](Topology& t) { t.index_head_dim = 64; }, "topology.index_head_dim must be 128, got 64"},
      {[](Topology& t) { t.num_q_heads = 32; }, "only qhead_per_kv=16 is supported"},
      {[](Topology& t) { t.block_size = 64; }, "only block_size=128 is supported"},
      {[](Topology& t) { t.topk = 8; }, "topology.topk must be 16, got 8"},
      {[](Topology& t) { t.num_kv_heads = 3; }, "topology.num_kv_heads must be 1, 2 or 4, got 3"},
      {[](Topology& t) { t.num_index_heads = 2; }, "topology.num_index_heads must equal num_kv_heads = 4, got 2"},
      {[](Topology& t) { t.local_blocks = 0; }, "topology.local_blocks must be >= 1"},
      {[](Topology& t) { t.init_blocks = -1; }, "topology.init_blocks/local_blocks must be >= 0"},
      {[](Topology& t) { t.init_blocks = 10, t.local_blocks = 7; }, "init_blocks + local_blocks must be <= topk = 16, got 17"},
      {[](Topology& t) { t.softmax_scale = -1; }, "topology.softmax_scale must be finite"},
      {[](Topology& t) { t.index_scale = NAN; }, "topology.index_scale must be finite"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    Topology t;
    c.edit(t);
    expect_rejected([&] { select(select_params(), t); }, {c.message});
    expect_rejected([&] { sparse_attention_forward(t, L, plan, forward_params()); }, {c.message});
    expect_rejected([&] { sparse_attention_backward(t, L, plan, backward_params()); }, {c.message});
    expect_rejected([&] { kl_backward(t, L, plan, kl_params()); }, {c.message});
    expect_rejected([&] { build_plan(t, L, topk.view()); }, {c.message});
  }
}

// ---- plans -------------------------------------------------------------------------------------

TEST_F(Errors, PlanFromAnotherMicroBatch) {
  const PackedLayout other = layout_of({3, 100});
  HostTensor other_topk = all_visible(topo, other);
  const SparsePlan stale = build_plan(topo, other, other_topk.view());
  const std::vector<std::string> pieces = {"plan does not match this micro-batch", "rebuild it with build_plan"};
  expect_rejected([&] { sparse_attention_forward(topo, L, stale, forward_params()); }, pieces);
  expect_rejected([&] { sparse_attention_backward(topo, L, stale, backward_params()); }, pieces);
  expect_rejected([&] { kl_backward(topo, L, stale, kl_params()); }, pieces);
  // A plan for other head counts.
  const Topology tp4 = Topology::minimax_m3(4);
  HostTensor topk1 = all_visible(tp4, L);
  const SparsePlan one_head = build_plan(tp4, L, topk1.view());
  expect_rejected([&] { sparse_attention_forward(topo, L, one_head, forward_params()); }, pieces);
}

// ---- merge_states --------------------------------------------------------------------------------

TEST_F(Errors, MergeStates) {
  const HostTensor parts = random_tensor(rng, {2, 5, 3, 128}, 1.0f, DType::f32);
  const HostTensor plse = random_tensor(rng, {2, 5, 3}, 1.0f, DType::f32);
  HostTensor mo(DType::f32, {5, 3, 128}), ml(DType::f32, {5, 3});
  poison(mo);
  poison(ml);
  auto run = [&](TensorView a, TensorView b, TensorView c, TensorView d) {
    MergeStatesParams p;
    p.out_partials = a;
    p.lse_partials = b;
    p.out = c;
    p.lse = d;
    merge_states(p);
  };
  const auto before_o = mo.raw(), before_l = ml.raw();
  const HostTensor empty(DType::f32, {0, 5, 3, 128});
  expect_error([&] { run(empty.view(), plse.view(), mo.view(), ml.view()); }, {"S >= 1"});
  const HostTensor rank3(DType::f32, {5, 3, 128});
  expect_error([&] { run(rank3.view(), plse.view(), mo.view(), ml.view()); }, {"out_partials must have shape [S, rows, H, D], got [5, 3, 128]"});
  const HostTensor bad_lse(DType::f32, {2, 5, 4});
  expect_error([&] { run(parts.view(), bad_lse.view(), mo.view(), ml.view()); }, {"lse_partials must have shape [S=2, rows=5, H=3], got [2, 5, 4]"});
  HostTensor bad_out(DType::f32, {5, 3, 64});
  expect_error([&] { run(parts.view(), plse.view(), bad_out.view(), ml.view()); }, {"out must have shape [rows=5, H=3, D=128], got [5, 3, 64]"});
  const HostTensor parts16(DType::f16, {2, 5, 3, 128});
  expect_error([&] { run(parts16.view(), plse.view(), mo.view(), ml.view()); }, {"out_partials must be bf16 or f32, got f16"});
  // A thread count OpenMP cannot give is refused by name instead of failing in the runtime.
  for (int threads : {-1, 1000000000}) {
    MergeStatesParams p{parts.view(), plse.view(), mo.view(), ml.view()};
    RunOptions opt;
    opt.num_threads = threads;
    expect_error([&] { merge_states(p, opt); }, {"options.num_threads must be in [0, 4096]", std::to_string(threads)});
  }
  EXPECT_TRUE(mo.raw() == before_o);
  EXPECT_TRUE(ml.raw() == before_l);
}

}  // namespace
}  // namespace msa::test
