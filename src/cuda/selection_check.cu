// Where two selections first differ, compared on the device: the check that binds a call's
// topk to the plan it was built from (src/core/ops.cpp) reads back 8 bytes instead of both
// selections.
#include <cstdint>
#include <limits>

#include "backend.h"
#include "cuda/common.cuh"
#include "cuda/scratch.h"

namespace msa::cuda {
namespace {

constexpr int kThreads = 256;

// first = min over i of { i : a[i] != b[i] } (left at INT64_MAX when the two are equal).
__global__ void first_difference_kernel(const int32_t* __restrict__ a, const int32_t* __restrict__ b, int64_t n,
                                        unsigned long long* first) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (a[i] != b[i]) {
      atomicMin(first, static_cast<unsigned long long>(i));
      return;  // later differences of this thread are larger
    }
}

}  // namespace

int64_t first_selection_difference(const TensorView& a, const TensorView& b, const RunOptions& opt) {
  DeviceGuard guard(a.device.index);
  const cudaStream_t s = as_stream(opt);
  const int64_t n = a.numel();
  if (n == 0) return -1;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &capture) != cudaSuccess) {
    (void)cudaGetLastError();  // a stream that cannot say is treated as not capturing
    capture = cudaStreamCaptureStatusNone;
  }
  if (capture != cudaStreamCaptureStatusNone) return kSelectionNotReadable;
  StreamScratch first(sizeof(unsigned long long), s);
  MSA_CUDA_CHECK(cudaMemsetAsync(first.get(), 0xff, sizeof(unsigned long long), s));
  const int blocks = int(std::min<int64_t>(ceil_div(n, kThreads), 4 * int64_t(sm_count())));
  first_difference_kernel<<<blocks, kThreads, 0, s>>>(a.as<const int32_t>(), b.as<const int32_t>(), n,
                                                      first.as<unsigned long long>());
  MSA_CUDA_CHECK_LAUNCH("first_difference_kernel");
  unsigned long long host = 0;
  MSA_CUDA_CHECK(cudaMemcpyAsync(&host, first.get(), sizeof(host), cudaMemcpyDeviceToHost, s));
  MSA_CUDA_CHECK(cudaStreamSynchronize(s));
  return host == std::numeric_limits<unsigned long long>::max() ? -1 : int64_t(host);
}

}  // namespace msa::cuda
