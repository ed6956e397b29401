// Pieces shared by the inference benchmarks (`msa bench --decode`, `msa bench --prefill`):
// list and cache-format parsing, reproducible random contents and the page pool that the
// requests' page tables map into.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "case_io.h"
#include "msa/inference.h"
#include "safetensors.h"

namespace msa::tool {

// "bf16" / "fp8" / "nvfp4": the names --formats takes.
const char* format_label(KvFormat f);

// Splits "a,b,c" at the commas (an empty text is one empty item).
std::vector<std::string> split_list(const std::string& text);

// --formats: a comma-separated list of bf16, fp8, nvfp4; duplicates dropped, order kept.
std::vector<KvFormat> parse_formats(const std::string& text);

// Refuses a benchmark option or input: msa::Error (invalid_argument) with `message`.
[[noreturn]] void invalid(const std::string& message);

// `value` with `decimals` digits after the point (a table or CSV cell).
std::string fixed(double value, int decimals);

// How the benches time a step on the device: "CUDA events on one stream" or "wall clock".
const char* timing_label(bool gpu);

// A TFLOP/s table cell: one decimal from 1 on, three significant digits below (the CPU's
// small rates) without an exponent; '-' when there is no rate (<= 0).
std::string tflops_cell(double tflops);

// Cheap reproducible contents (xorshift64). One generator per tensor: a tensor filled slab by
// slab holds the same bytes as one filled whole.
class RandomBytes {
 public:
  explicit RandomBytes(uint64_t seed) : x_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  // bf16 values uniform in about [-1, 1], E4M3 codes without NaN, any byte for u8 (packed
  // NVFP4 codes).
  void fill(StTensor& t);
  // NVFP4 block scales as an insert of values in [-1, 1] writes them (max / 6): positive E4M3
  // codes of 2^-3 .. 2^-2 with random mantissas.
  void fill_block_scales(StTensor& t);

 private:
  uint64_t next() {
    x_ ^= x_ << 13;
    x_ ^= x_ >> 7;
    x_ ^= x_ << 17;
    return x_;
  }
  uint64_t x_;
};

inline void fill_bytes(StTensor& t, uint64_t seed) { RandomBytes(seed).fill(t); }

// A pool of distinct random cache pages, filled for the formats a run times. Requests map
// their logical pages into it through their page tables.
struct PagePool {
  int64_t pages = 0;
  Buffer index_k;                       // [pages, 128, 128] bf16
  Buffer k_bf16, v_bf16, k_fp8, v_fp8;  // [pages, Hkv, 128, 128]
  Buffer k_fp4, v_fp4, k_sf, v_sf;      // [pages, Hkv, 128, 64] u8, [pages, Hkv, 128, 8] e4m3
  Buffer scale;                         // [1] f32, FP8's per-tensor scale

  PagedKvCache cache(KvFormat f) const;
};

// Fills `pages` pages of index-K and of the K / V caches of `formats`, through host slabs of
// at most 64 MiB (a GPU pool is several GB).
PagePool fill_pool(DeviceArena& arena, int64_t pages, int Hkv, const std::vector<KvFormat>& formats);

}  // namespace msa::tool
