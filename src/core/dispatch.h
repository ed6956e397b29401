// The one way src/core hands a validated call to a backend: inputs on a CUDA device go to the
// CUDA backend, all others to the CPU backend. In a build without the CUDA backend, CUDA inputs
// get an `unsupported` error that says how to build one. src/core/ops.cpp and
// src/core/inference.cpp dispatch every operation through here, src/core/tensor.cpp its device
// memory, copies and synchronisation.
//
// The cuda:: entry points are declared in every build (backend.h, backend_inference.h) but
// defined only with MSA_WITH_CUDA; without it, `on_cuda` is never called, so nothing refers to
// them.
#pragma once

#include <type_traits>
#include <utility>

#include "core/check.h"
#include "msa/tensor.h"

namespace msa::detail {

inline constexpr bool kWithCuda = MSA_WITH_CUDA != 0;

[[noreturn]] inline void no_cuda_backend(const char* op) {
  unsupported(concat(op, ": the inputs are CUDA tensors but msa was built without the CUDA backend "
                         "(configure with -DMSA_ENABLE_CUDA=ON on a machine with nvcc)"));
}

// Runs on_cpu() or on_cuda() for inputs on `device`; `op` names the operation in the error.
template <class OnCpu, class OnCuda>
decltype(auto) dispatch(const char* op, Device device, OnCpu&& on_cpu, OnCuda&& on_cuda) {
  if (device.is_cuda()) {
    if constexpr (kWithCuda) return std::forward<OnCuda>(on_cuda)();
    else no_cuda_backend(op);
  }
  return std::forward<OnCpu>(on_cpu)();
}

// Runs on_cuda() for work that exists only with a CUDA device (device memory, copies to or from
// it, synchronising it).
template <class OnCuda>
std::invoke_result_t<OnCuda&> cuda_only(const char* op, OnCuda&& on_cuda) {
  if constexpr (kWithCuda) return std::forward<OnCuda>(on_cuda)();
  else no_cuda_backend(op);
}

}  // namespace msa::detail
