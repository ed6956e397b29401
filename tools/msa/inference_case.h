// `msa run-case` for the inference modes (`__metadata__` mode = "decode" or "paged_prefill"):
// paged KV caches, page tables and decode-time selection. The training-path modes are handled
// in run_case.cpp; this entry point receives the already-parsed input file.
#pragma once

#include <string>

#include "msa/tensor.h"
#include "safetensors.h"

namespace msa::tool {

struct RunCaseOptions {
  Device device{};             // resolved from --backend (auto / cpu / cuda)
  bool deterministic = false;  // --deterministic: bitwise reproducible accumulation
  int threads = 0;             // --threads: CPU threads, 0 = the OpenMP default
  bool summary = true;         // print the one-line summary on success (stdout)
};

// Runs an inference case and writes its outputs to `out_path` (atomically; nothing is written
// when it is empty, as for the fuzz target). Returns the process exit code (0 on success);
// throws msa::Error on bad input.
int run_inference_case(const SafetensorsFile& in, const std::string& out_path, const RunCaseOptions& options);

}  // namespace msa::tool
