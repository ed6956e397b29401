#include "case_io.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "msa/error.h"
#include "msa/version.h"

namespace msa::tool {

namespace {

[[noreturn]] void invalid(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }

std::string dims_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + (dims[i] < 0 ? std::string("*") : std::to_string(dims[i]));
  return s + "]";
}

}  // namespace

Device resolve_backend(const std::string& backend) {
  if (backend == "cpu") return Device::cpu();
  if (backend == "auto") return cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu();
  if (backend == "cuda") {
    if (!built_with_cuda())
      throw Error(ErrorKind::unsupported,
                  "--backend cuda: this msa was built without the CUDA backend (configure with -DMSA_ENABLE_CUDA=ON)");
    if (cuda_device_count() == 0) throw Error(ErrorKind::unsupported, "--backend cuda: no usable CUDA device was found");
    return Device::cuda(0);
  }
  invalid("--backend must be auto, cpu or cuda, got " + quote_short(backend));
}

// ---------------------------------------------------------------------------------------

Buffer DeviceArena::allocate(DType dtype, std::vector<int64_t> shape) {
  Buffer b(device_, dtype, std::move(shape));
  bytes_ += b.bytes();
  return b;
}

Buffer DeviceArena::upload(const TensorView& host) {
  Buffer b = allocate(host.dtype, host.shape_vector());
  copy(host, b.view());
  return b;
}

StTensor DeviceArena::download(const std::string& name, const TensorView& t) const {
  StTensor out = make_tensor(name, t.dtype, t.shape_vector());
  copy(t, out.view());
  return out;
}

std::vector<float> to_host_floats(const TensorView& t) {
  std::vector<uint8_t> bytes(size_t(t.numel() * dtype_size(t.dtype)));
  const TensorView host = TensorView::contiguous(bytes.data(), t.dtype, t.shape_vector());
  copy(t, host);
  std::vector<float> out(size_t(t.numel()));
  const int64_t n = t.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = load_as_float(bytes.data(), t.dtype, i);
  return out;
}

std::vector<int32_t> to_host_ints(const TensorView& t) {
  if (t.dtype != DType::i32) invalid("internal: to_host_ints needs an int32 tensor");
  std::vector<int32_t> out(size_t(t.numel()));
  copy(t, TensorView::contiguous(out.data(), DType::i32, t.shape_vector()));
  return out;
}

std::string describe(const StTensor& t) { return safetensors_dtype_name(t.dtype) + " " + dims_text(t.shape); }

const StTensor* optional_tensor(const SafetensorsFile& file, const std::string& name, DType dtype,
                                const std::vector<int64_t>& dims) {
  const StTensor* t = file.find(name);
  if (!t) return nullptr;
  bool shape_ok = t->shape.size() == dims.size();
  for (size_t i = 0; shape_ok && i < dims.size(); ++i) shape_ok = dims[i] < 0 || dims[i] == t->shape[i];
  if (t->dtype != dtype || !shape_ok)
    invalid(file.path + ": tensor '" + name + "' must be " + safetensors_dtype_name(dtype) + " " + dims_text(dims) +
            ", got " + describe(*t));
  return t;
}

const StTensor& require_tensor(const SafetensorsFile& file, const std::string& name, DType dtype,
                               const std::vector<int64_t>& dims) {
  const StTensor* t = optional_tensor(file, name, dtype, dims);
  if (!t) invalid(file.path + " has no tensor '" + name + "' (" + safetensors_dtype_name(dtype) + " " + dims_text(dims) + ")");
  return *t;
}

// A cu_seqlens tensor from the file, checked against the token count of the tensors it
// indexes before anything is sized from it (the library's layout allocates per token):
// starts at 0, never decreases, ends at exactly `tokens`.
void check_cu_seqlens(const std::string& path, const StTensor& cu, int64_t tokens, const std::string& tokens_name) {
  const int64_t n = cu.numel();
  const std::string where = path + ": " + cu.name + " ";
  if (n < 2)
    invalid(where + "must have shape [batch + 1] with batch >= 1, got " + describe(cu));
  const auto* v = reinterpret_cast<const int32_t*>(cu.bytes.data());
  if (v[0] != 0) invalid(where + "must start at 0, got " + cu.name + "[0] = " + std::to_string(v[0]));
  for (int64_t i = 1; i < n; ++i)
    if (v[i] < v[i - 1])
      invalid(where + "must be non-decreasing, got " + cu.name + "[" + std::to_string(i - 1) + "] = " +
              std::to_string(v[i - 1]) + " > " + cu.name + "[" + std::to_string(i) + "] = " + std::to_string(v[i]));
  if (v[n - 1] != tokens)
    invalid(where + "must end at the token count " + tokens_name + " = " + std::to_string(tokens) + ", got " + cu.name +
            "[" + std::to_string(n - 1) + "] = " + std::to_string(v[n - 1]));
}

// ---------------------------------------------------------------------------------------

void Metadata::require_known(const std::vector<std::string>& known) const {
  for (const auto& [key, value] : values_) {
    (void)value;
    bool found = false;
    for (const std::string& k : known) found = found || k == key;
    if (!found) {
      std::string list;
      for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
      invalid(file_ + ": unknown __metadata__ key " + quote_short(key) + " (known keys: " + list + ")");
    }
  }
}

std::optional<std::string> Metadata::text(const std::string& key) const {
  auto it = values_.find(key);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::optional<int64_t> Metadata::integer(const std::string& key, int64_t min_value, int64_t max_value) const {
  const auto s = text(key);
  if (!s) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s->c_str(), &end, 10);
  if (s->empty() || *end != '\0' || errno == ERANGE || std::isspace(static_cast<unsigned char>((*s)[0])))
    invalid(file_ + ": __metadata__ '" + key + "' must be an integer, got " + quote_short(*s));
  if (v < min_value || v > max_value)
    invalid(file_ + ": __metadata__ '" + key + "' must be in [" + std::to_string(min_value) + ", " +
            std::to_string(max_value) + "], got " + quote_short(*s));
  return int64_t(v);
}

std::optional<double> Metadata::number(const std::string& key) const {
  const auto s = text(key);
  if (!s) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s->c_str(), &end);
  if (s->empty() || *end != '\0' || errno == ERANGE || std::isspace(static_cast<unsigned char>((*s)[0])))
    invalid(file_ + ": __metadata__ '" + key + "' must be a number, got " + quote_short(*s));
  return v;
}

}  // namespace msa::tool
