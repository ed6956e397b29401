// The decode step of `msa demo`: a batch of requests with scattered cache pages and 8 queries
// per request (speculative decoding), run through the paged indexer and split-K decode
// attention and checked against the float64 inference oracle.
#pragma once

#include <cstdint>
#include <string>

#include "msa/tensor.h"
#include "msa/topology.h"

namespace msa::tool {

struct DecodeStepResult {
  double seconds = 0;
  double bytes = 0;      // K/V pages read per query (16 blocks x Hkv heads) + index keys per request
  std::string check;     // vs the oracle, for the demo's table
  bool ok = false;
  std::string workload;  // "8 requests x 8 queries, contexts ..."
};

// Runs on `device` (the CPU or a CUDA device); the check runs on the host.
DecodeStepResult run_decode_step(const Topology& topo, Device device, uint64_t seed, int threads);

}  // namespace msa::tool
