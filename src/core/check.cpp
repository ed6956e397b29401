#include "core/check.h"

namespace msa::detail {

void check_present(const TensorView& t, const char* name) {
  require(t.present(), concat(name, " is required but was not given"));
}

void check_shape(const TensorView& t, const char* name, const std::vector<Dim>& dims) {
  bool ok = t.rank == int(dims.size());
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = t.shape[i] == dims[i].value;
  if (ok) return;
  std::ostringstream want;
  want << '[';
  for (size_t i = 0; i < dims.size(); ++i) {
    want << (i ? ", " : "") << dims[i].name;
    if (dims[i].name != std::to_string(dims[i].value)) want << '=' << dims[i].value;
  }
  want << ']';
  fail(concat(name, " must have shape ", want.str(), ", got ", t.shape_string()));
}

void check_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::string list;
  for (DType d : allowed) list += (list.empty() ? "" : " or ") + std::string(dtype_name(d));
  fail(concat(name, " must be ", list, ", got ", dtype_name(t.dtype)));
}

void check_contiguous(const TensorView& t, const char* name) {
  if (t.is_contiguous()) return;
  std::ostringstream strides;
  for (int i = 0; i < t.rank; ++i) strides << (i ? ", " : "") << t.stride[size_t(i)];
  fail(concat(name, " must be contiguous (row-major), got strides (", strides.str(), ") for shape ", t.shape_string()));
}

void check_inner_contiguous(const TensorView& t, const char* name) {
  require(t.rank == 0 || t.stride[size_t(t.rank - 1)] == 1 || t.shape[size_t(t.rank - 1)] == 1,
          concat(name, " must have a contiguous last dimension (stride 1), got stride ", t.stride[size_t(t.rank - 1)]));
}

void check_device(const TensorView& t, const char* name, Device device) {
  require(t.device == device, concat(name, " must be on ", to_string(device), " like the other inputs, got ", to_string(t.device)));
}

void check_rows_aligned(const TensorView& t, const char* name, int bytes) {
  if (!t.device.is_cuda()) return;
  const int64_t elem = dtype_size(t.dtype);
  const auto address = reinterpret_cast<uintptr_t>(t.data);
  bool ok = address % uintptr_t(bytes) == 0;
  std::string strides;
  for (int d = 0; d + 1 < t.rank; ++d) {
    ok = ok && (t.stride[d] * elem) % bytes == 0;
    strides += concat(d ? ", " : "", t.stride[d]);
  }
  require(ok, concat(name, " on CUDA must have every row start at a ", bytes, "-byte aligned address (data pointer and "
                     "every row stride a multiple of ", bytes, " bytes), got a data pointer at offset ",
                     address % uintptr_t(bytes), " mod ", bytes, " and row strides [", strides, "] of ", elem,
                     "-byte elements"));
}

void check_run_options(const RunOptions& opt) {
  require(opt.num_threads >= 0 && opt.num_threads <= kMaxThreads,
          concat("options.num_threads must be in [0, ", kMaxThreads, "] (0 = OpenMP's default), got ", opt.num_threads));
}

void check_tensor(const TensorView& t, const char* name, std::initializer_list<DType> allowed,
                  const std::vector<Dim>& dims, Device device) {
  check_present(t, name);
  check_dtype(t, name, allowed);
  check_shape(t, name, dims);
  check_device(t, name, device);
  check_contiguous(t, name);
}

}  // namespace msa::detail
