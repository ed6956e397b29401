// Reading and writing the safetensors format: 8-byte little-endian header length, a JSON
// header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then the
// little-endian tensor bytes. Used by `msa run-case` and its tests.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "msa/tensor.h"

namespace msa::tool {

struct StTensor {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // row-major, little-endian

  // CPU view of the bytes (mutable so outputs can be written in place).
  TensorView view() const;
  int64_t numel() const;
};

// Allocates a zero-filled tensor of the given dtype and shape.
StTensor make_tensor(std::string name, DType dtype, std::vector<int64_t> shape);

struct SafetensorsFile {
  std::map<std::string, StTensor> tensors;
  std::map<std::string, std::string> metadata;  // the "__metadata__" object

  // Throws msa::Error naming the file and what is wrong (bad header, unknown dtype,
  // offsets out of range, truncated data, ...).
  // Every length, offset and nesting level is checked against the file before it is used, and
  // messages quote at most a short prefix of any name or value taken from the file.
  static SafetensorsFile read(const std::string& path);
  // The same for a file already in memory; `path` only names it in messages.
  static SafetensorsFile parse(std::span<const uint8_t> bytes, const std::string& path);
  const StTensor* find(const std::string& name) const;
  // Throws msa::Error "<path> has no tensor '<name>'" when absent.
  const StTensor& get(const std::string& name) const;

  std::string path;
};

// `text` in single quotes for an error message, cut after `max_chars` characters (the message
// then says how long it was) and with control / non-ASCII bytes written as \xNN: names and
// values come from files that may be hostile, and a message must stay one readable line.
std::string quote_short(std::string_view text, size_t max_chars = 64);

// "BF16", "F16", "F32", "I32", "U8", "F8_E4M3" <-> DType.
std::string safetensors_dtype_name(DType t);
DType parse_safetensors_dtype(const std::string& name);  // throws msa::Error on unknown names

// Writes all tensors (sorted by name in the header, data in that order) to `path`
// atomically: a temporary file in the same folder renamed into place, so a failed run
// never leaves a half-written output.
void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace msa::tool
