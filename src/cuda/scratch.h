// Stream-ordered temporary device memory for plan building: allocated and freed on the
// stream (cudaMallocAsync / cudaFreeAsync), so freeing it never waits for the device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace msa::cuda {

class StreamScratch {
 public:
  StreamScratch(int64_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) MSA_CUDA_CHECK(cudaMallocAsync(&ptr_, size_t(bytes), stream));
  }
  ~StreamScratch() {
    if (ptr_) cudaFreeAsync(ptr_, stream_);
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  template <typename T> T* as() const { return static_cast<T*>(ptr_); }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace msa::cuda
