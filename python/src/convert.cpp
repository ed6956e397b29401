#include "convert.h"

#include <algorithm>
#include <string>

#include "msa/error.h"

namespace msa::python {

namespace {

using nb::dlpack::dtype_code;

std::string dlpack_dtype_name(nb::dlpack::dtype t) {
  const char* base = "?";
  switch (dtype_code(t.code)) {
    case dtype_code::Int: base = "int"; break;
    case dtype_code::UInt: base = "uint"; break;
    case dtype_code::Float: base = "float"; break;
    case dtype_code::Bfloat: base = "bfloat"; break;
    case dtype_code::Complex: base = "complex"; break;
    case dtype_code::Bool: return "bool";
    default: return "dlpack dtype code " + std::to_string(t.code) + " with " + std::to_string(t.bits) + " bits";
  }
  return base + std::to_string(t.bits);
}

DType to_dtype(nb::dlpack::dtype t, const char* name) {
  if (t.lanes == 1) {
    switch (dtype_code(t.code)) {
      case dtype_code::Bfloat: if (t.bits == 16) return DType::bf16; break;
      case dtype_code::Float:
        if (t.bits == 16) return DType::f16;
        if (t.bits == 32) return DType::f32;
        break;
      case dtype_code::Int: if (t.bits == 32) return DType::i32; break;
      case dtype_code::UInt:
        if (t.bits == 8) return DType::u8;
        if (t.bits == 16) return DType::bf16;  // bf16 bits carried in uint16 (NumPy)
        break;
      case dtype_code::Float8_E4M3FN: if (t.bits == 8) return DType::f8e4m3; break;
      default: break;
    }
  }
  throw Error(ErrorKind::invalid_argument,
              std::string(name) + " has dtype " + dlpack_dtype_name(t) +
                  ", which msa does not take (bfloat16 [or uint16 holding bf16 bits], float16, float32, "
                  "float8_e4m3fn, int32, uint8)");
}

Device to_device(int type, int id, const char* name) {
  switch (type) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value: return Device::cpu();
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value: return Device::cuda(id);
    default:
      throw Error(ErrorKind::invalid_argument,
                  std::string(name) + " lives on DLPack device type " + std::to_string(type) +
                      "; msa takes CPU and CUDA arrays");
  }
}

template <typename Array>
TensorView convert(const Array& a, const char* name) {
  if (a.ndim() > size_t(kMaxRank))
    throw Error(ErrorKind::invalid_argument, std::string(name) + " must have at most " + std::to_string(kMaxRank) +
                                                 " dimensions, got " + std::to_string(a.ndim()));
  TensorView v;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.dtype = to_dtype(a.dtype(), name);
  v.device = to_device(a.device_type(), a.device_id(), name);
  v.rank = int(a.ndim());
  bool empty = false;
  for (size_t i = 0; i < a.ndim(); ++i) {
    v.shape[i] = int64_t(a.shape(i));
    v.stride[i] = a.stride(i);
    empty = empty || v.shape[i] == 0;
  }
  // An array without elements has no meaningful strides (exporters give 0s): describe it as
  // row-major so that an empty batch passes the layout checks and yields empty outputs.
  if (empty) {
    int64_t s = 1;
    for (int i = v.rank; i-- > 0;) {
      v.stride[size_t(i)] = s;
      s *= std::max<int64_t>(v.shape[size_t(i)], 1);
    }
  }
  return v;
}

}  // namespace

TensorView to_view(const InArray& a, const char* name) { return convert(a, name); }
TensorView to_view(const OutArray& a, const char* name) { return convert(a, name); }
TensorView to_view(const std::optional<InArray>& a, const char* name) { return a ? convert(*a, name) : TensorView{}; }
TensorView to_view(const std::optional<OutArray>& a, const char* name) { return a ? convert(*a, name) : TensorView{}; }

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  const std::string index = s.rfind("cuda:", 0) == 0 ? s.substr(5) : "";
  if (!index.empty() && index.size() <= 4 && index.find_first_not_of("0123456789") == std::string::npos)
    return Device::cuda(std::stoi(index));
  throw Error(ErrorKind::invalid_argument, "device must be 'cpu', 'cuda' or 'cuda:N', got '" + s + "'");
}

RunOptions run_options(bool deterministic, int num_threads, uintptr_t stream) {
  RunOptions opt;
  opt.deterministic = deterministic;
  opt.num_threads = num_threads;
  opt.stream = reinterpret_cast<void*>(stream);
  return opt;
}

}  // namespace msa::python
