// Layouts from CUDA document maps and pack / unpack on CUDA tensors, checked against the CPU
// path on the same inputs: the layouts must be identical, the packed / unpacked bytes equal,
// and invalid maps must fail with the CPU's error (kind and message).
#include "test_gpu_support.h"

#if MSA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace msa::test {
namespace {

// A map of `rows` rows of `seq` positions: documents of random lengths with padding between
// and after them, ids random and distinct per row (some rows all padding when allowed).
HostTensor random_map(std::mt19937_64& rng, int64_t rows, int64_t seq, int max_len, bool empty_rows = true) {
  HostTensor m(DType::i32, {rows, seq});
  auto* p = m.data<int32_t>();
  std::uniform_int_distribution<int> len(1, max_len), gap(0, 3), id(1, 1 << 20);
  for (int64_t b = 0; b < rows; ++b) {
    if (empty_rows && b % 5 == 4) continue;  // an all-padding row
    int64_t s = (b == 0 || gap(rng) == 0) ? 0 : gap(rng);  // row 0 starts with a document
    int32_t next_id = id(rng);
    while (s < seq) {
      const int64_t n = std::min<int64_t>(len(rng), seq - s);
      for (int64_t i = 0; i < n; ++i) p[b * seq + s + i] = next_id;
      next_id += 1 + gap(rng);
      s += n + (gap(rng) == 0 ? 1 : 0) * gap(rng);
    }
  }
  return m;
}

std::string first_difference(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return "index " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
  return "none";
}

void expect_same_layout(const PackedLayout& got, const PackedLayout& want) {
  EXPECT_EQ(got.padded_batch(), want.padded_batch());
  EXPECT_EQ(got.padded_seq(), want.padded_seq());
  EXPECT_EQ(got.cu_seqlens_q(), want.cu_seqlens_q()) << "got " << describe(got.cu_seqlens_q()) << ", want "
                                                     << describe(want.cu_seqlens_q());
  EXPECT_EQ(got.cu_seqlens_k(), want.cu_seqlens_k());
  EXPECT_TRUE(got.packed_row_of_padded() == want.packed_row_of_padded())
      << "packed_row_of_padded differs at " << first_difference(got.packed_row_of_padded(), want.packed_row_of_padded());
  EXPECT_TRUE(got.document_padded_start() == want.document_padded_start())
      << "document_padded_start differs at "
      << first_difference(got.document_padded_start(), want.document_padded_start());
}

// The message and kind of the msa::Error `call` throws ("" when it does not throw).
std::string error_of(const std::function<void()>& call, ErrorKind* kind = nullptr) {
  try {
    call();
  } catch (const Error& e) {
    if (kind) *kind = e.kind();
    return e.what();
  }
  return "";
}

TEST(GpuLayout, DocumentMapMatchesCpu) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  struct Shape {
    int64_t rows, seq;
    int max_len;
  };
  for (const Shape sh : {Shape{1, 1, 1}, Shape{3, 8, 3}, Shape{4, 600, 300}, Shape{16, 4096, 900}, Shape{2, 70000, 5}}) {
    SCOPED_TRACE("map [" + std::to_string(sh.rows) + ", " + std::to_string(sh.seq) + "]");
    const HostTensor map = random_map(rng, sh.rows, sh.seq, sh.max_len, sh.rows > 3);
    const PackedLayout want = PackedLayout::from_document_map(map.view());
    const DeviceTensor dmap(map);
    synchronize(kGpu);
    const PackedLayout got = PackedLayout::from_document_map(dmap.view());
    expect_same_layout(got, want);
  }
  // The fixed map of the CPU test, and a strided (transposed) view of a device map.
  const HostTensor fixed = int_tensor({1, 1, 0, 2, 2, 2, 0, 0, 7, 7, 7, 4, 0, 0, 0, 0, 0, 0, 5, 5, 5, 5, 5, 0}, {3, 8});
  const DeviceTensor dfixed(fixed);
  synchronize(kGpu);
  expect_same_layout(PackedLayout::from_document_map(dfixed.view()), PackedLayout::from_document_map(fixed.view()));
  // Transposed: the [8, 3] map read with strides (1, 8).
  const TensorView host_t = TensorView::strided(fixed.view().data, DType::i32, {8, 3}, {1, 8});
  const TensorView dev_t = TensorView::strided(dfixed.view().data, DType::i32, {8, 3}, {1, 8}, kGpu);
  expect_same_layout(PackedLayout::from_document_map(dev_t), PackedLayout::from_document_map(host_t));
}

#if MSA_WITH_CUDA
TEST(GpuLayout, DocumentMapOnAStream) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const HostTensor map = random_map(rng, 8, 1000, 200);
  Buffer dmap(kGpu, DType::i32, {8, 1000});
  copy(map.view(), dmap.view(), stream);  // ordered on `stream` only: the layout must wait for it
  const PackedLayout got = PackedLayout::from_document_map(dmap.view(), stream);
  expect_same_layout(got, PackedLayout::from_document_map(map.view()));
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

#else
TEST(GpuLayout, DocumentMapOnAStream) { GTEST_SKIP() << "built without CUDA: GPU test skipped"; }
#endif

TEST(GpuLayout, DocumentMapErrorsMatchCpu) {
  MSA_REQUIRE_GPU();
  const std::vector<std::pair<std::vector<int32_t>, std::vector<int64_t>>> bad = {
      {{1, 1, 2, 1, 0, 0}, {1, 6}},                    // document 1 split by document 2
      {{3, 3, 0, 0, 5, 5, 0, 5}, {2, 4}},              // document 5 split by padding
      {{1, -2}, {1, 2}},                               // negative id
      {{1, 1, 1, 0, 0, 0, 0, -7, 2, 2, 1, 2}, {3, 4}}, // negative id before a split document
      {{4, 4, 0, 9, 9, 4}, {1, 6}},                    // split document after another
      {{0, 0, 0}, {1, 3}},                             // all padding
  };
  for (const auto& [values, shape] : bad) {
    const HostTensor map = int_tensor(values, shape);
    SCOPED_TRACE("map " + describe(values));
    ErrorKind want_kind{}, got_kind{};
    const std::string want = error_of([&] { PackedLayout::from_document_map(map.view()); }, &want_kind);
    ASSERT_FALSE(want.empty()) << "the CPU accepted an invalid map";
    const DeviceTensor dmap(map);
    synchronize(kGpu);
    const std::string got = error_of([&] { PackedLayout::from_document_map(dmap.view()); }, &got_kind);
    EXPECT_EQ(got, want);
    EXPECT_EQ(int(got_kind), int(want_kind));
  }
  // Wrong dtype / rank are refused before anything runs, with the CPU's messages.
  DeviceTensor f(DType::f32, {2, 3}), r1(DType::i32, {6});
  expect_error([&] { PackedLayout::from_document_map(f.view()); }, {"document_map must be int32", "f32"});
  expect_error([&] { PackedLayout::from_document_map(r1.view()); }, {"document_map must have shape [batch, seq]", "[6]"});
}

// pack then unpack on the GPU against the CPU, bitwise, outputs poisoned first.
void check_pack_roundtrip(const PackedLayout& L, const HostTensor& padded) {
  std::vector<int64_t> packed_shape = padded.shape();
  packed_shape.erase(packed_shape.begin(), packed_shape.begin() + 2);
  packed_shape.insert(packed_shape.begin(), L.total_q());
  HostTensor want_packed(padded.dtype(), packed_shape), want_back(padded.dtype(), padded.shape());
  pack(L, padded.view(), want_packed.view());
  unpack(L, want_packed.view(), want_back.view());

  const DeviceTensor dpadded(padded);
  DeviceTensor dpacked(padded.dtype(), packed_shape), dback(padded.dtype(), padded.shape());
  dpacked.poison();
  dback.poison();
  synchronize(kGpu);
  pack(L, dpadded.view(), dpacked.view());
  unpack(L, dpacked.view(), dback.view());
  const HostTensor got_packed = dpacked.host(), got_back = dback.host();
  const auto gp = got_packed.raw(), wp = want_packed.raw(), gb = got_back.raw(), wb = want_back.raw();
  const auto mismatch = [](const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) {
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i] != b[i]) return "byte " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
    return std::string("none");
  };
  EXPECT_TRUE(gp == wp) << "packed differs from the CPU's at " << mismatch(gp, wp);
  EXPECT_TRUE(gb == wb) << "unpacked differs from the CPU's at " << mismatch(gb, wb);
}

TEST(GpuLayout, PackUnpackMatchCpuBitwise) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const HostTensor map = random_map(rng, 6, 700, 250);
  const PackedLayout L = PackedLayout::from_document_map(map.view());
  struct Case {
    DType dtype;
    std::vector<int64_t> rest;
  };
  // Row sizes of 16-byte multiples, 8, 4, 2 and odd byte counts (each copy width).
  for (const Case& c : {Case{DType::bf16, {4, 128}}, Case{DType::f32, {2}}, Case{DType::f32, {}},
                        Case{DType::bf16, {}}, Case{DType::bf16, {3, 5}}, Case{DType::u8, {3}}, Case{DType::i32, {}}}) {
    std::vector<int64_t> shape{6, 700};
    shape.insert(shape.end(), c.rest.begin(), c.rest.end());
    SCOPED_TRACE(std::string(dtype_name(c.dtype)) + " padded " + describe(shape));
    HostTensor padded(c.dtype, shape);
    std::uniform_int_distribution<int> byte(0, 255);
    auto* p = padded.data<unsigned char>();
    for (int64_t i = 0; i < padded.numel() * dtype_size(c.dtype); ++i) p[i] = static_cast<unsigned char>(byte(rng));
    check_pack_roundtrip(L, padded);
  }
}

TEST(GpuLayout, PackUnpackManyDocumentsAndNoPadding) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  // More documents than one launch carries (documents of 1-3 tokens).
  const HostTensor many = random_map(rng, 4, 6000, 3, false);
  const PackedLayout L = PackedLayout::from_document_map(many.view());
  ASSERT_GT(L.num_documents(), 5000);
  check_pack_roundtrip(L, random_tensor(rng, {4, 6000, 8}, 1.0f, DType::f32));
  // No padding at all: unpack writes every position itself.
  std::vector<int32_t> full(3 * 500);
  for (size_t i = 0; i < full.size(); ++i) full[i] = int32_t(1 + i / 200);
  const PackedLayout dense = PackedLayout::from_document_map(int_tensor(full, {3, 500}).view());
  ASSERT_EQ(dense.total_q(), 1500);
  check_pack_roundtrip(dense, random_tensor(rng, {3, 500, 64}, 1.0f, DType::bf16));
}

TEST(GpuLayout, PackRejectsMixedDevices) {
  MSA_REQUIRE_GPU();
  const HostTensor map = int_tensor({1, 1, 0}, {1, 3});
  const PackedLayout L = PackedLayout::from_document_map(map.view());
  HostTensor host_padded(DType::f32, {1, 3, 2});
  DeviceTensor dev_packed(DType::f32, {2, 2});
  expect_error([&] { pack(L, host_padded.view(), dev_packed.view()); }, {"packed must be on the device of padded", "cpu",
                                                                        "cuda:0"});
}

#if MSA_WITH_CUDA
TEST(GpuLayout, PackAndUnpackCaptureInAGraph) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const HostTensor map = random_map(rng, 5, 900, 300);
  const PackedLayout L = PackedLayout::from_document_map(map.view());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  DeviceTensor padded(DType::bf16, {5, 900, 64}), packed(DType::bf16, {L.total_q(), 64}), back(DType::bf16, {5, 900, 64});
  synchronize(kGpu);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  pack(L, padded.view(), packed.view(), stream);
  unpack(L, packed.view(), back.view(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    const HostTensor h = random_tensor(rng, {5, 900, 64}, 1.0f, DType::bf16);
    padded.upload(h);
    packed.poison();
    back.poison();
    synchronize(kGpu);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    HostTensor want_packed(DType::bf16, {L.total_q(), 64}), want_back(DType::bf16, {5, 900, 64});
    pack(L, h.view(), want_packed.view());
    unpack(L, want_packed.view(), want_back.view());
    EXPECT_TRUE(packed.host().raw() == want_packed.raw()) << "the replayed pack did not use the new contents";
    EXPECT_TRUE(back.host().raw() == want_back.raw()) << "the replayed unpack differs from the CPU's";
  }
  // A CUDA document map cannot be read during capture: a clear error, and the capture is
  // left intact.
  const DeviceTensor dmap(map);
  synchronize(kGpu);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  expect_error([&] { PackedLayout::from_document_map(dmap.view(), stream); }, {"CUDA-graph capture"},
               ErrorKind::unsupported);
  cudaGraph_t unused;
  ASSERT_EQ(cudaStreamEndCapture(stream, &unused), cudaSuccess);
  if (unused) cudaGraphDestroy(unused);
  ASSERT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}
#else
TEST(GpuLayout, PackAndUnpackCaptureInAGraph) { GTEST_SKIP() << "built without CUDA: GPU test skipped"; }
#endif

}  // namespace
}  // namespace msa::test
