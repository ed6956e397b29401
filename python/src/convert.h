// Conversion of DLPack arrays (NumPy, PyTorch, CuPy, JAX ... through nanobind::ndarray) to
// msa::TensorView without copying, and of call options to msa::RunOptions.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>

#include "msa/ops.h"

namespace msa::python {

namespace nb = nanobind;

using InArray = nb::ndarray<nb::ro>;  // read by the operation
using OutArray = nb::ndarray<>;       // written by the operation

// dtype, shape, element strides and device of `a`; `name` appears in error messages.
// A uint16 array is taken as bf16 bits (NumPy has no bfloat16).
TensorView to_view(const InArray& a, const char* name);
TensorView to_view(const OutArray& a, const char* name);
// An absent optional array gives an absent view.
TensorView to_view(const std::optional<InArray>& a, const char* name);
TensorView to_view(const std::optional<OutArray>& a, const char* name);

// "cpu", "cuda" or "cuda:N".
Device parse_device(const std::string& s);

// `stream` is a cudaStream_t as an integer (0 = the legacy default stream).
RunOptions run_options(bool deterministic, int num_threads, uintptr_t stream);

}  // namespace msa::python
