// `msa inspect` (list a safetensors file) and `msa compare` (compare two files tensor by
// tensor, e.g. two run-case outputs).
#pragma once

#include <string>
#include <vector>

namespace msa::tool {

int run_inspect(const std::string& path);

struct CompareOptions {
  std::string a, b;
  std::vector<std::string> tensors;  // empty: every tensor of either file (one side only = different)
  // Per element |a - b| <= atol + rtol |b|; NaN equals NaN at the same place. Negative (not
  // given): each tensor's documented tolerance (see `msa compare --help`).
  double atol = -1, rtol = -1;
};
// Returns 0 when every compared tensor is within tolerance, 1 otherwise.
int run_compare(const CompareOptions& options);

}  // namespace msa::tool
