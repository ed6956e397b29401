// Validation helpers: the only place that turns bad input into msa::Error messages.
// Every message names the argument, what was expected and what came.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "msa/error.h"
#include "msa/ops.h"
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

// For checks outside hot loops: the message is built even when `ok` holds. Inside loops
// over elements write `if (!ok) fail(concat(...))` so messages cost nothing on success.
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

// Most CPU threads a call may ask for: OpenMP reserves a stack per thread, so a huge count
// fails inside the runtime instead of with a message.
inline constexpr int kMaxThreads = 4096;
// RunOptions of every operation: num_threads in [0, kMaxThreads] (0 = OpenMP's default).
void check_run_options(const RunOptions& opt);
void check_present(const TensorView& t, const char* name);
// Innermost dimension contiguous (stride 1) so rows can be read as vectors.
void check_inner_contiguous(const TensorView& t, const char* name);
// All present tensors live on `device`.
void check_device(const TensorView& t, const char* name, Device device);
// The CUDA kernels copy rows in 16-byte pieces (TMA, cp.async; NVFP4 block scales in 8-byte
// pieces): on CUDA, every row of `t` must start at such an aligned address. No-op on the CPU.
void check_rows_aligned(const TensorView& t, const char* name, int bytes);

// Full check of a required tensor: present, dtype, shape, device, contiguous.
void check_tensor(const TensorView& t, const char* name, std::initializer_list<DType> allowed,
                  const std::vector<Dim>& dims, Device device);

// One row of a top-k selection: ids are -1 or in [0, local], valid ids form a prefix and are
// unique. `unit` is "block" or "page"; `why_not_visible()` (called only on failure) explains
// which ids the row may hold.
template <typename WhyNotVisible>
void check_selection_row(const char* name, int head, int64_t row, const int32_t* ids, int k, int64_t local,
                         const char* unit, WhyNotVisible why_not_visible) {
  bool ended = false;
  for (int s = 0; s < k; ++s) {
    if (ids[s] < 0) {
      if (ids[s] != -1) fail(concat(name, "[", head, ", ", row, ", ", s, "] must be a ", unit, " id or -1, got ", ids[s]));
      ended = true;
      continue;
    }
    if (ended)
      fail(concat(name, "[", head, ", ", row, ", :]: valid ", unit, " ids must form a prefix followed by -1, got id ", ids[s],
                  " in slot ", s, " after a -1"));
    if (ids[s] > local) fail(concat(name, "[", head, ", ", row, ", ", s, "] = ", ids[s], why_not_visible()));
    for (int t = 0; t < s; ++t)
      if (ids[t] == ids[s])
        fail(concat(name, "[", head, ", ", row, ", :] holds ", unit, " ", ids[s], " twice (slots ", t, " and ", s, ")"));
  }
}

}  // namespace msa::detail
