// `msa bench`: the training benchmark. Times indexer, plan (with a given workspace and
// allocating its own), forward, backward (also deterministic) and KL on the standard shapes
// of the architecture's measurement section (one document of 4k..128k tokens, MiniMax-M3
// heads) for both selection distributions; a table on stdout, CSV and JSON on request.
#pragma once

#include <cstdint>
#include <string>

namespace msa::tool {

struct BenchOptions {
  std::string backend = "auto";
  std::string sizes;              // "4096,8192"; empty: 4k, 8k on the CPU, 4k..128k on a GPU
  std::string sizes_option = "--tokens";  // the option that gave `sizes`, for messages
  std::string selection = "both";  // independent | coherent | both
  int repeats = 0;                // timed runs per step after warm-up; 0: 3 on the CPU (decode, prefill 2), 10 on a GPU
  int threads = 0;
  int tp = 1;                     // MiniMax-M3 tensor-parallel shard: Hq = 64 / tp, Hkv = Hi = 4 / tp
  uint64_t seed = 1;
  std::string json_path;          // also write the table as JSON here
  std::string csv_path;           // and as CSV here
  bool memory_only = false;       // GPU: only the peak memory of a layer step, no timing
  bool decode = false;            // time decode steps (bench_decode.cpp) instead of training steps
  // Decode only (empty / 0: the defaults of bench_decode.cpp):
  std::string batches;            // "8,32,128"
  std::string contexts;           // "4096,32k,128k"
  std::string queries;            // queries per request, "1,2,4,8,16"
  std::string formats;            // K/V cache formats, "bf16,fp8,nvfp4"
  int splits = 0;                 // decode split-K count; 0: the plan's automatic choice
  std::string l2 = "flush";       // decode, GPU: flush the L2 cache before every timed call, or keep it
  // Prefill (bench_prefill.cpp): a manifest of step shapes, one JSON object a line, or
  // "long:N:C" (one prompt of N tokens prefilled in chunks of C). `formats` as for decode.
  std::string prefill;
  std::string cases;              // manifest rows: representative | all | a tag; empty: the default
  int sample = 1;                 // long prompts: time one chunk of every `sample`
};

int run_bench(const BenchOptions& options);
int run_bench_decode(const BenchOptions& options);
int run_bench_prefill(const BenchOptions& options);

// Writes `text` to `path` through a temporary file (a reader never sees half a file); the
// benchmarks rewrite their CSV / JSON after every row.
void write_file_whole(const std::string& path, const std::string& text);

}  // namespace msa::tool
