// Moving tensors between safetensors files, host arrays and device buffers, and reading
// typed values out of a file's string metadata.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "msa/tensor.h"
#include "safetensors.h"

namespace msa::tool {

// "auto" | "cpu" | "cuda" -> a device; auto picks CUDA device 0 when one is usable.
// Throws msa::Error (unsupported) when CUDA is asked for but not available.
Device resolve_backend(const std::string& backend);

// Device buffers that remember how many bytes were allocated through them (the tool's own
// peak-memory figure: inputs, outputs and plans; backend workspaces are not included).
class DeviceArena {
 public:
  explicit DeviceArena(Device device) : device_(device) {}
  Device device() const { return device_; }
  Buffer allocate(DType dtype, std::vector<int64_t> shape);
  // A device copy of a host tensor (contiguous).
  Buffer upload(const TensorView& host);
  // A copy of a device tensor in a new host safetensors tensor.
  StTensor download(const std::string& name, const TensorView& device_tensor) const;
  int64_t bytes_allocated() const { return bytes_; }
  void count_external(int64_t bytes) { bytes_ += bytes; }

 private:
  Device device_;
  int64_t bytes_ = 0;
};

// A host copy of any tensor (CPU or device) as floats.
std::vector<float> to_host_floats(const TensorView& t);
// A host copy of an int32 tensor.
std::vector<int32_t> to_host_ints(const TensorView& t);

// "BF16 [100, 64, 128]"
std::string describe(const StTensor& t);

// Requires `name` in `file` with one of the dtypes and the given rank; -1 in `dims` means any.
// Messages name the file, the tensor, what was expected and what came.
const StTensor& require_tensor(const SafetensorsFile& file, const std::string& name, DType dtype,
                               const std::vector<int64_t>& dims);
const StTensor* optional_tensor(const SafetensorsFile& file, const std::string& name, DType dtype,
                                const std::vector<int64_t>& dims);

// A cu_seqlens tensor (I32 [batch + 1], batch >= 1) checked against the token count of the
// tensors it indexes, before anything is sized from it: starts at 0, never decreases, ends at
// exactly `tokens` (named `tokens_name` in the message, e.g. "q.shape[0]").
void check_cu_seqlens(const std::string& path, const StTensor& cu, int64_t tokens, const std::string& tokens_name);

// Typed access to "__metadata__" values (strings by the format); the whole string must parse.
class Metadata {
 public:
  Metadata(const std::map<std::string, std::string>& values, std::string file) : values_(values), file_(std::move(file)) {}
  // Throws naming the first key that is not in `known`.
  void require_known(const std::vector<std::string>& known) const;
  std::optional<std::string> text(const std::string& key) const;
  std::optional<int64_t> integer(const std::string& key, int64_t min_value, int64_t max_value) const;
  std::optional<double> number(const std::string& key) const;

 private:
  const std::map<std::string, std::string>& values_;
  std::string file_;
};

}  // namespace msa::tool
