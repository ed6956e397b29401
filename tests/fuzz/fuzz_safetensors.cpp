// libFuzzer target: the safetensors reader of the msa tool on arbitrary bytes. Any outcome but
// a parsed file or an msa::Error (a crash, a sanitizer report, another exception, a hang or a
// large allocation) is a finding.
#include <cstddef>
#include <cstdint>
#include <span>

#include "msa/error.h"
#include "safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const msa::tool::SafetensorsFile file = msa::tool::SafetensorsFile::parse(std::span(data, size), "fuzz.safetensors");
    // Every tensor read must have the bytes its dtype and shape say.
    for (const auto& [name, t] : file.tensors)
      if (int64_t(t.bytes.size()) != t.numel() * msa::dtype_size(t.dtype)) __builtin_trap();
  } catch (const msa::Error&) {
  }
  return 0;
}
