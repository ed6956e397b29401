// Memory, copies and device queries of the CUDA backend.
#include <cuda_runtime.h>

#include <mutex>
#include <string>
#include <sstream>
#include <vector>

#include "backend.h"
#include "core/allocator.h"
#include "cuda/common.cuh"

namespace msa::cuda {

void throw_cuda_error(const char* call, cudaError_t err, const char* file, int line) {
  std::ostringstream os;
  os << call << " failed: " << cudaGetErrorString(err) << " at " << file << ":" << line;
  throw Error(ErrorKind::runtime, os.str());
}

DeviceGuard::DeviceGuard(int device) {
  MSA_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) MSA_CUDA_CHECK(cudaSetDevice(device));
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_ && previous_ >= 0) cudaSetDevice(previous_);
}

QuietDeviceGuard::QuietDeviceGuard(int device) noexcept : device_(device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  else if (previous_ != device_) cudaSetDevice(device_);
}

QuietDeviceGuard::~QuietDeviceGuard() {
  if (ok() && previous_ != device_) cudaSetDevice(previous_);
}

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MSA_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
  return status != cudaStreamCaptureStatusNone;
}

int sm_count() {
  static std::mutex mutex;
  static std::vector<int> counts;
  int device = 0;
  MSA_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (counts.size() <= size_t(device)) counts.resize(size_t(device) + 1, 0);
  if (counts[size_t(device)] == 0)
    MSA_CUDA_CHECK(cudaDeviceGetAttribute(&counts[size_t(device)], cudaDevAttrMultiProcessorCount, device));
  return counts[size_t(device)];
}

std::vector<DocInfo> doc_table(const PackedLayout& layout) {
  std::vector<DocInfo> docs(size_t(layout.num_documents()));
  for (int b = 0; b < layout.num_documents(); ++b) {
    const DocumentSpan& d = layout.document(b);
    docs[size_t(b)] = {int32_t(d.q_start), int32_t(d.q_len), int32_t(d.k_start), int32_t(d.k_len)};
  }
  return docs;
}

const PlanState& plan_state(const SparsePlan& plan) {
  if (!plan.backend)
    throw Error(ErrorKind::invalid_argument, "plan was not built by the CUDA backend (plan.backend is empty); "
                                             "rebuild it with build_plan on CUDA tensors");
  return *static_cast<const PlanState*>(plan.backend.get());
}

void* allocate(int64_t bytes, int device) {
  DeviceGuard guard(device);
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, size_t(bytes));
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free allocation error so later calls work
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    std::ostringstream os;
    os << "cudaMalloc of " << bytes << " bytes on cuda:" << device << " failed: " << cudaGetErrorString(err) << " ("
       << free_bytes << " of " << total_bytes << " bytes free)";
    throw Error(ErrorKind::runtime, os.str());
  }
  return ptr;
}

void release(void* ptr, int device) {
  // Called from destructors: never throws. cudaFree waits for the device, so memory still
  // in use by queued work is not reused early.
  const QuietDeviceGuard guard(device);
  if (guard.ok()) cudaFree(ptr);
}

void* allocate_async(int64_t bytes, int device, void* stream) {
  DeviceGuard guard(device);
  void* ptr = nullptr;
  const cudaError_t err = cudaMallocAsync(&ptr, size_t(bytes), static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    cudaGetLastError();
    std::ostringstream os;
    os << "cudaMallocAsync of " << bytes << " bytes on cuda:" << device << " failed: " << cudaGetErrorString(err);
    throw Error(ErrorKind::runtime, os.str());
  }
  return ptr;
}

void release_async(void* ptr, int device, void* stream) {
  // Called from destructors: never throws.
  const QuietDeviceGuard guard(device);
  if (guard.ok() && cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream)) != cudaSuccess) cudaGetLastError();
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, int64_t bytes, void* stream) {
  if (bytes <= 0) return;
  const int device = dst_device.is_cuda() ? dst_device.index : src_device.index;
  DeviceGuard guard(device);
  auto s = static_cast<cudaStream_t>(stream);
  if (dst_device.is_cuda() && src_device.is_cuda() && dst_device.index != src_device.index) {
    MSA_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device.index, src, src_device.index, size_t(bytes), s));
  } else {
    MSA_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDefault, s));
  }
  // A copy into host memory is complete when the call returns (the caller reads it next).
  if (!dst_device.is_cuda() && !capturing(s)) MSA_CUDA_CHECK(cudaStreamSynchronize(s));
}

void memset_zero(void* dst, int device, int64_t bytes, void* stream) {
  if (bytes <= 0) return;
  DeviceGuard guard(device);
  MSA_CUDA_CHECK(cudaMemsetAsync(dst, 0, size_t(bytes), static_cast<cudaStream_t>(stream)));
}

void synchronize(int device) {
  DeviceGuard guard(device);
  MSA_CUDA_CHECK(cudaDeviceSynchronize());
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: report none
    return 0;
  }
  return n;
}

}  // namespace msa::cuda
