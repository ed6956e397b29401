// Device memory of the library: every CUDA allocation goes through the process-wide allocator
// of include/msa/tensor.h (set_device_allocator), or the built-in one.
#pragma once

#include <cstdint>
#include <memory>

#include "msa/tensor.h"

namespace msa::detail {

// `bytes` (> 0) bytes on CUDA device `device` for work queued on `stream`. The memory goes
// back to the allocator that gave it when the last copy of the pointer is dropped.
// Release::in_stream (a call's scratch, an inference plan): the built-in allocator then uses
// cudaMallocAsync / cudaFreeAsync on `stream`, so giving it back never waits for the device.
std::shared_ptr<void> allocate_device(int64_t bytes, int device, void* stream, Release release);

}  // namespace msa::detail

// Declared in every build, defined by the CUDA backend only (see core/dispatch.h).
namespace msa::cuda {
// The built-in allocator's Release::in_stream path: cudaMallocAsync / cudaFreeAsync on `stream`.
void* allocate_async(int64_t bytes, int device, void* stream);
void release_async(void* ptr, int device, void* stream);
}  // namespace msa::cuda
