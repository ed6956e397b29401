// msa._native: the library's operations on DLPack arrays. The Python package `msa` wraps
// these with output allocation (msa.functional) and PyTorch custom ops (msa.torch).
#include <nanobind/nanobind.h>

#include "bindings.h"
#include "msa/msa.h"

namespace nb = nanobind;

NB_MODULE(_native, m) {
  m.doc() = "MiniMax Sparse Attention: native operations on DLPack arrays (CPU and CUDA)";
  m.attr("__version__") = msa::kVersion;
  // Layouts cached by msa.torch live until interpreter exit; that is not a leak.
  nb::set_leak_warnings(false);
  m.def("built_with_cuda", &msa::built_with_cuda, "True when the library was compiled with its CUDA backend.");
  m.def("cuda_device_count", &msa::cuda_device_count, "CUDA devices usable by msa (0 without the CUDA backend).");
  msa::python::bind_errors(m);
  msa::python::bind_types(m);
  msa::python::bind_ops(m);
  msa::python::bind_allocator(m);
  msa::python::bind_inference(m);
}
