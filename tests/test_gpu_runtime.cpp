// CUDA memory, copies and errors of the runtime layer.
#include "test_gpu_support.h"

namespace msa::test {
namespace {

TEST(GpuRuntime, DeviceCountAndRoundTrip) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  EXPECT_GE(cuda_device_count(), 1);
  const HostTensor h = random_tensor(rng, {1000, 3, 7});
  DeviceTensor d(h);
  EXPECT_TRUE(d.view().device.is_cuda());
  EXPECT_TRUE(bitwise_equal(d.host(), h));
  // Device to device.
  DeviceTensor e(DType::bf16, h.shape());
  copy(d.view(), e.view());
  EXPECT_TRUE(bitwise_equal(e.host(), h));
  // Zeroing.
  zero(e.view());
  synchronize(kGpu);
  const auto z = e.host().floats();
  for (float x : z) ASSERT_EQ(x, 0.0f);
}

TEST(GpuRuntime, EmptyBuffersAndHugeAllocationErrors) {
  MSA_REQUIRE_GPU();
  Buffer empty(kGpu, DType::f32, {0, 5});
  EXPECT_EQ(empty.bytes(), 0);
  // 1 PiB cannot be allocated: a runtime msa::Error naming cudaMalloc, and later calls work.
  expect_error([] { Buffer huge(kGpu, DType::u8, {int64_t(1) << 50}); }, {"cudaMalloc", "failed"}, ErrorKind::runtime);
  Buffer ok(kGpu, DType::f32, {16});
  EXPECT_EQ(ok.bytes(), 64);
}

}  // namespace
}  // namespace msa::test
