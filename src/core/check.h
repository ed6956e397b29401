// Validation helpers: the only place that turns bad input into msa::Error messages.
// Every message names the argument, what was expected and what came.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "msa/error.h"
#include "msa/tensor.h"

namespace msa::detail {

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

[[noreturn]] inline void fail(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }
[[noreturn]] inline void unsupported(const std::string& message) { throw Error(ErrorKind::unsupported, message); }

inline void require(bool ok, const std::string& message) {
  if (!ok) fail(message);
}

// A symbolic expected shape: each entry has a value and a name ("total_q", "64"); the name
// appears in messages so users see the contract, not just numbers.
struct Dim {
  int64_t value;
  std::string name;
  Dim(int64_t v) : value(v), name(std::to_string(v)) {}  // NOLINT: literal dims read naturally
  Dim(int64_t v, std::string n) : value(v), name(std::move(n)) {}
};

// "<name> must be present" / "<name> must have shape [..], got [..]"
void check_shape(const TensorView& t, const char* name, const std::vector<Dim>& dims);
void check_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed);
void check_contiguous(const TensorView& t, const char* name);
void check_present(const TensorView& t, const char* name);
// Innermost dimension contiguous (stride 1) so rows can be read as vectors.
void check_inner_contiguous(const TensorView& t, const char* name);
// All present tensors live on `device`.
void check_device(const TensorView& t, const char* name, Device device);

// Full check of a required tensor: present, dtype, shape, device, contiguous.
void check_tensor(const TensorView& t, const char* name, std::initializer_list<DType> allowed,
                  const std::vector<Dim>& dims, Device device);

}  // namespace msa::detail
