// `msa demo`: runs the whole training path on a built-in packed batch of random inputs,
// times every step and checks sampled rows against the float64 oracle.
#pragma once

#include <cstdint>
#include <string>

namespace msa::tool {

struct DemoOptions {
  std::string backend = "auto";
  int64_t tokens = 0;    // 0: the default pack for the device
  std::string docs;      // explicit document lengths ("2300,129,1"); overrides tokens
  uint64_t seed = 1;
  int threads = 0;       // CPU threads, 0 = OpenMP default
  int tp = 1;            // tensor-parallel shard of MiniMax-M3: Hq = 64 / tp, Hkv = Hi = 4 / tp
  int samples = 32;      // query rows checked against the oracle (plus every document's tail)
};

// Prints the report to stdout and progress to stderr. Returns 0 on PASS, 1 on FAIL.
int run_demo(const DemoOptions& options);

}  // namespace msa::tool
