// `msa inspect` (list a safetensors file) and `msa compare` (compare two files tensor by
// tensor, e.g. two run-case outputs).
#pragma once

#include <string>
#include <vector>

namespace msa::tool {

int run_inspect(const std::string& path);

struct CompareOptions {
  std::string a, b;
  std::vector<std::string> tensors;  // empty: every tensor of a
  double atol = 0, rtol = 0;         // per element |a - b| <= atol + rtol |b|
};
// Returns 0 when every compared tensor is within tolerance, 1 otherwise.
int run_compare(const CompareOptions& options);

}  // namespace msa::tool
