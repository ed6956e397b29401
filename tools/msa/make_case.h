// `msa make-case`: writes a run-case input file of random inputs (documents of given lengths,
// MiniMax-M3 heads or a tensor-parallel shard), optionally edited to exercise error paths.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace msa::tool {

struct MakeCaseOptions {
  std::string out_path;
  std::string docs = "300,129,1";      // document lengths (queries = keys)
  int tp = 1;                          // Hq = 64 / tp, Hkv = Hi = 4 / tp (as demo and bench)
  uint64_t seed = 1;
  bool grad = false;                   // include grad_out
  std::string topk_from;               // copy the "topk" tensor of this file
  std::vector<std::string> set;        // KEY=VALUE metadata entries
  std::vector<std::string> omit;       // tensors to leave out
  std::vector<std::string> retype;     // NAME=DTYPE conversions (safetensors dtype names)
  std::vector<std::string> ints;       // NAME=V1,V2,... 1-D I32 tensors to store or replace
};

int run_make_case(const MakeCaseOptions& options);

}  // namespace msa::tool
