// Training-indexer timing probe beside the product (not built by CMake): select_blocks through
// the public C++ API on one document of T tokens (64 / 4 heads, random bf16 index q / k as
// `msa bench --selection independent` draws them, and their E4M3 roundings for the FP8 kernel),
// with and without the selected blocks' LSE, CUDA events, median of 5. docs/performance.md runs
// 30, 31 and 39.
// Build against a CUDA build of msa, e.g.:
//   nvcc -O2 -std=c++20 -Iinclude bench/experiments/indexer_probe.cpp build/src/libmsa.a
//     -Xcompiler -fopenmp -lcuda -o indexer_probe
//   ./indexer_probe [T ...]          (default 16384 131072)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "msa/msa.h"

using namespace msa;

// FNV-1a of a device buffer: equal results of two builds print equal hashes.
static uint64_t hash_of(const Buffer& b) {
  std::vector<uint8_t> h(size_t(b.bytes()));
  cudaMemcpy(h.data(), b.data(), h.size(), cudaMemcpyDeviceToHost);
  uint64_t x = 1469598103934665603ull;
  for (uint8_t c : h) x = (x ^ c) * 1099511628211ull;
  return x;
}

static void fill_bf16(const Buffer& b, uint64_t seed) {  // ~U(-2, 2)
  std::vector<uint16_t> h(size_t(b.bytes() / 2));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : h) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    const float f = float(int(x % 4001) - 2000) / 1000.f;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    v = uint16_t(u >> 16);
  }
  cudaMemcpy(b.data(), h.data(), size_t(b.bytes()), cudaMemcpyHostToDevice);
}

static void fill_e4m3(const Buffer& b, uint64_t seed) {  // the same values rounded to E4M3
  std::vector<uint8_t> h(size_t(b.bytes()));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : h) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    v = float_to_e4m3(float(int(x % 4001) - 2000) / 1000.f);
  }
  cudaMemcpy(b.data(), h.data(), h.size(), cudaMemcpyHostToDevice);
}

int main(int argc, char** argv) {
  std::vector<int64_t> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atoll(argv[i]));
  if (sizes.empty()) sizes = {16384, 131072};
  const Device dev = Device::cuda(0);
  const Topology topo = Topology::minimax_m3(1);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::printf("%-8s %-5s %-8s %10s %10s %18s %18s\n", "T", "in", "lse", "ms", "TFLOP/s", "topk hash", "lse hash");
  for (const int64_t T : sizes) {
    const PackedLayout layout = PackedLayout::from_cu_seqlens({0, int32_t(T)}, {0, int32_t(T)});
    Buffer iq(dev, DType::bf16, {T, 4, 128}), ik(dev, DType::bf16, {T, 1, 128});
    Buffer topk(dev, DType::i32, {4, T, 16}), sel(dev, DType::f32, {4, T});
    Buffer iq8(dev, DType::f8e4m3, {T, 4, 128}), ik8(dev, DType::f8e4m3, {T, 1, 128});
    fill_bf16(iq, 5);
    fill_bf16(ik, 6);
    fill_e4m3(iq8, 5);
    fill_e4m3(ik8, 6);
    const double flops = 2.0 * 128 * 4 * double(T) * double(T + 1) / 2;
    for (const bool fp8 : {false, true})
    for (const bool lse : {false, true}) {
      SelectBlocksParams p;
      p.index_q = fp8 ? iq8.view() : iq.view();
      p.index_k = fp8 ? ik8.view() : ik.view();
      p.topk = topk.view();
      if (lse) p.selected_lse = sel.view();
      RunOptions ro;
      ro.stream = s;
      for (int i = 0; i < 2; ++i) select_blocks(topo, layout, p, ro);
      std::vector<float> t;
      for (int i = 0; i < 5; ++i) {
        cudaEventRecord(e0, s);
        select_blocks(topo, layout, p, ro);
        cudaEventRecord(e1, s);
        cudaEventSynchronize(e1);
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        t.push_back(ms);
      }
      std::sort(t.begin(), t.end());
      const double ms = t[t.size() / 2];
      cudaMemset(topk.data(), 0xff, size_t(topk.bytes()));
      cudaMemset(sel.data(), 0, size_t(sel.bytes()));
      select_blocks(topo, layout, p, ro);
      cudaStreamSynchronize(s);
      std::printf("%-8lld %-5s %-8s %10.3f %10.1f %18llx %18llx\n", static_cast<long long>(T), fp8 ? "e4m3" : "bf16", lse ? "yes" : "no", ms,
                  flops / ms * 1e-9, static_cast<unsigned long long>(hash_of(topk)),
                  static_cast<unsigned long long>(lse ? hash_of(sel) : 0));
    }
  }
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
