// Experiment (not part of the library): can the forward's bf16 partials make their round trip
// through L2 instead of memory? At 16k tokens the tasks write 4.29 GB of partials and the merge
// reads them back: ~1.3 ms of stores and ~1.8 ms of merge on an H100 (docs/performance.md runs
// 46-47). If the partials of a short stretch of the walk were read back while still in L2, and
// their lines dropped afterwards (`discard.global.L2`, so that the dirty lines are never written
// to memory), both halves would run at L2 rather than memory speed.
//
// The probe moves the same 4.29 GB through a buffer with plain 16-byte stores and loads, 132
// CTAs of 1024 threads a kernel:
//   memory          all stored, then all read back (today's order)
//   l2-<S>MB        in segments of S MB: a segment stored, then read back, before the next
//   l2-<S>MB-drop   the same, each line discarded from L2 once read
// Prints the median of 5 whole round trips (CUDA events) and the rate of stored + loaded bytes.
// The DRAM bytes each mode really moves are for `ncu --metrics dram__bytes_read.sum,
// dram__bytes_write.sum` on this binary.
//
// build: nvcc -O3 -std=c++20 -arch=sm_90a bench/experiments/partials_l2_roundtrip_probe.cu -o /tmp/partials_l2_roundtrip_probe
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "probe_timing.cuh"

namespace {

constexpr size_t kBytes = size_t(1) << 32;  // ~ the 16k forward's partials (4.29 GB)
constexpr int kCtas = 132, kThreads = 1024;

__global__ void __launch_bounds__(kThreads) store_kernel(uint4* dst, size_t n, uint32_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t x = uint32_t(i) ^ seed;
    asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"l"(dst + i), "r"(x), "r"(x + 1), "r"(x + 2), "r"(x + 3)
                 : "memory");
  }
}

// Sums the segment (so that the loads are used); with `drop`, lane 8k of a warp discards the
// 128-byte line that it and the next 7 lanes have just read.
__global__ void __launch_bounds__(kThreads) read_kernel(const uint4* src, size_t n, bool drop, uint32_t* sink) {
  uint32_t acc = 0;
  const int lane = threadIdx.x & 31;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint4 v;
    asm volatile("ld.global.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src + i));
    acc += v.x ^ v.y ^ v.z ^ v.w;
    if (drop) {
      __syncwarp();  // the line's 8 lanes have their values
      if ((lane & 7) == 0) asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(src + i) : "memory");
    }
  }
  if (acc == 0x12345678u) *sink = acc;  // never in practice: keeps the loads
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  uint4* buf;
  uint32_t* sink;
  CHECK(cudaMalloc(&buf, kBytes));
  CHECK(cudaMalloc(&sink, 4));
  // One round trip of the whole buffer in segments of `seg` bytes.
  auto round_trip = [&](size_t seg, bool drop) {
    for (size_t at = 0; at < kBytes; at += seg) {
      const size_t n = std::min(seg, kBytes - at) / sizeof(uint4);
      store_kernel<<<kCtas, kThreads>>>(buf + at / sizeof(uint4), n, uint32_t(at));
      read_kernel<<<kCtas, kThreads>>>(buf + at / sizeof(uint4), n, drop, sink);
    }
    CHECK(cudaGetLastError());
  };
  auto report = [&](const char* name, float t) {
    std::printf("%-16s %8.3f ms  %7.0f GB/s\n", name, t, 2.0 * double(kBytes) / t / 1e6);
  };
  report("memory", median_ms([&] { round_trip(kBytes, false); }, 2, 5));
  for (size_t mb : {8, 16, 32, 48}) {
    char name[32];
    std::snprintf(name, sizeof name, "l2-%zuMB", mb);
    report(name, median_ms([&] { round_trip(mb << 20, false); }, 2, 5));
    std::snprintf(name, sizeof name, "l2-%zuMB-drop", mb);
    report(name, median_ms([&] { round_trip(mb << 20, true); }, 2, 5));
  }
  CHECK(cudaFree(buf));
  CHECK(cudaFree(sink));
  return 0;
}
