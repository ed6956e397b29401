// Temporary device memory of one call (plan building, layouts), from the device allocator of
// include/msa/tensor.h: by default cudaMallocAsync / cudaFreeAsync on the call's stream, so
// giving it back never waits for the device; with a custom allocator, its stream-ordered memory.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "core/allocator.h"
#include "cuda/common.cuh"

namespace msa::cuda {

class StreamScratch {
 public:
  StreamScratch(int64_t bytes, cudaStream_t stream) {
    if (bytes > 0) {
      int device = 0;
      MSA_CUDA_CHECK(cudaGetDevice(&device));
      mem_ = detail::allocate_device(bytes, device, stream, Release::in_stream);
    }
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  template <typename T> T* as() const { return static_cast<T*>(mem_.get()); }
  void* get() const { return mem_.get(); }

 private:
  std::shared_ptr<void> mem_;
};

}  // namespace msa::cuda
