// Experiment (not part of the library): how fast can 96 threads of a producer warpgroup widen
// an FP8 page side (128 x 128 E4M3 codes, 16 KB) into the 16-bit swizzled tile the tensor
// cores read? Both the decode attention's scanners and the prefill indexer's wideners do this
// per page; at an SM's share of HBM (~29 B/ns) a 16 KB side arrives every ~1,100 cycles, so
// widening must take less for the kernels to stay memory-bound.
//
// Prints, per variant, SM cycles per side (clock64, one CTA an SM, 200 sides, median CTA):
//   loop-1    one chunk per iteration (the kernels' loop before widen_fp8_side)
//   batch-bf16 / batch-bf16-nan / batch-f16   widen_fp8_side (quant.cuh)
//   batch-bf16-prmt  the same with the bf16 pair taken from the f32 halves by a byte permute
// and the conversion throughput of the pair conversions alone (pairs per SM per cycle).
//
// build: nvcc -O3 -std=c++20 -arch=sm_90a -DMSA_WITH_CUDA=1 -Iinclude -Isrc \
//          bench/experiments/fp8_widen_probe.cu -o /tmp/fp8_widen_probe
#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <vector>

#include "cuda/inference/quant.cuh"
#include "probe_timing.cuh"

using namespace msa::cuda;
using namespace msa::cuda::inference;

namespace {

constexpr int kThreads = 96;
constexpr int kSides = 200;

// bf16 pair from the two f32 values of the f16 pair: their high halves (exact, E4M3 values
// have at most 4 significant bits).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2_prmt(uint32_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  return __byte_perm(__float_as_uint(f.x), __float_as_uint(f.y), 0x7632);
}

template <int V>
__device__ __forceinline__ uint32_t convert(uint32_t w) {
  if constexpr (V == 0) return e4m3x2_to_bf16x2(w);
  else if constexpr (V == 1) return e4m3x2_to_bf16x2_prmt(w);
  else return e4m3x2_to_f16x2(w);
}

template <int V>
__global__ void conversion_throughput(const uint32_t* in, uint32_t* out, int iters, long long* cycles) {
  uint32_t w[8], acc = 0;
  for (int i = 0; i < 8; ++i) w[i] = in[(threadIdx.x * 8 + i) & 1023];
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc ^= convert<V>(w[i] ^ uint32_t(it));
  const long long t1 = clock64();
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

__device__ void loop_one(uint32_t raw, uint32_t tile, int w) {
  for (int c = w; c < kPageSize * 8; c += kThreads) {
    const int t = c / 8, col = c % 8;
    uint32_t o[8];
    e4m3x16_widen<false>(ld_shared_v4(raw + uint32_t(c * 16)), o);
    st_shared_v4(tile + tile_offset(kPageSize, t, 2 * col), o[0], o[1], o[2], o[3]);
    st_shared_v4(tile + tile_offset(kPageSize, t, 2 * col + 1), o[4], o[5], o[6], o[7]);
  }
}

__device__ void batch_prmt(uint32_t raw, uint32_t tile, int w) {
  constexpr int kBatch = 6, kChunks = kPageSize * 8;
#pragma unroll 1
  for (int round = 0; round < 2; ++round) {
    uint4 codes[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = w + kThreads * (kBatch * round + i);
      if (c < kChunks) codes[i] = ld_shared_v4(raw + uint32_t(16 * c));
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = w + kThreads * (kBatch * round + i);
      if (c >= kChunks) break;
      const int t = c / 8, col = c % 8;
      const uint32_t x[4] = {codes[i].x, codes[i].y, codes[i].z, codes[i].w};
      uint32_t o[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) o[2 * j] = e4m3x2_to_bf16x2_prmt(x[j]), o[2 * j + 1] = e4m3x2_to_bf16x2_prmt(x[j] >> 16);
      st_shared_v4(tile + tile_offset(kPageSize, t, 2 * col), o[0], o[1], o[2], o[3]);
      st_shared_v4(tile + tile_offset(kPageSize, t, 2 * col + 1), o[4], o[5], o[6], o[7]);
    }
  }
}

template <int L>
__global__ void __launch_bounds__(128, 1) widen_sides(long long* cycles, uint32_t* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t base = align1024(smem_addr(smem));
  const uint32_t raw = base, tile = base + 16384;
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) st_shared_u32(raw + 4 * i, 0x3c3a3830u ^ uint32_t(i * 2654435761u) & 0x77777777u);
  __syncthreads();
  if (threadIdx.x >= kThreads) return;
  bool any = false;
  const long long t0 = clock64();
  for (int s = 0; s < kSides; ++s) {
    if constexpr (L == 0) loop_one(raw, tile, threadIdx.x);
    else if constexpr (L == 1) widen_fp8_side<kThreads, false, false>(raw, tile, threadIdx.x);
    else if constexpr (L == 2) any |= widen_fp8_side<kThreads, false, true>(raw, tile, threadIdx.x, 120);
    else if constexpr (L == 3) widen_fp8_side<kThreads, true, false>(raw, tile, threadIdx.x);
    else batch_prmt(raw, tile, threadIdx.x);
    named_barrier(1, kThreads);  // the next side is not widened before every thread is done with this one
  }
  const long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
  if (any) sink[threadIdx.x] = ld_shared_u32(tile + 4 * threadIdx.x);
}

long long median(std::vector<long long> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  long long* cycles;
  uint32_t *in, *out;
  CHECK(cudaMalloc(&cycles, sizeof(long long) * sms));
  CHECK(cudaMalloc(&in, 4096 * 4));
  CHECK(cudaMalloc(&out, size_t(sms) * 1024 * 4));
  CHECK(cudaMemset(in, 0x35, 4096 * 4));
  std::vector<long long> host(static_cast<size_t>(sms));
  auto collect = [&] {
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(host.data(), cycles, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
    return median(host);
  };
  const char* names[] = {"bf16 (cvt, 2 x f16->f32, pack)", "bf16 (cvt, 2 x f16->f32, prmt)", "f16 (cvt)"};
  const int iters = 4096;
  std::printf("pair conversions, 1024 threads an SM:\n");
  for (int v = 0; v < 3; ++v) {
    for (int rep = 0; rep < 2; ++rep) {
      if (v == 0) conversion_throughput<0><<<sms, 1024>>>(in, out, iters, cycles);
      if (v == 1) conversion_throughput<1><<<sms, 1024>>>(in, out, iters, cycles);
      if (v == 2) conversion_throughput<2><<<sms, 1024>>>(in, out, iters, cycles);
      CHECK(cudaGetLastError());
    }
    const long long c = collect();
    std::printf("  %-34s %6.1f pairs / SM / cycle\n", names[v], 1024.0 * 8 * iters / double(c));
  }
  const char* loops[] = {"loop-1 (one chunk an iteration)", "batch-bf16 (widen_fp8_side)", "batch-bf16-nan (V side, 120 rows)",
                         "batch-f16", "batch-bf16-prmt"};
  const int smem = 16384 + 32768 + 1024;
  std::printf("one 16 KB side by 96 threads, one CTA an SM (HBM share: ~1,100 cycles a side):\n");
  for (int l = 0; l < 5; ++l) {
    for (int rep = 0; rep < 2; ++rep) {
      switch (l) {
        case 0: CHECK(cudaFuncSetAttribute(widen_sides<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); widen_sides<0><<<sms, 128, smem>>>(cycles, out); break;
        case 1: CHECK(cudaFuncSetAttribute(widen_sides<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); widen_sides<1><<<sms, 128, smem>>>(cycles, out); break;
        case 2: CHECK(cudaFuncSetAttribute(widen_sides<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); widen_sides<2><<<sms, 128, smem>>>(cycles, out); break;
        case 3: CHECK(cudaFuncSetAttribute(widen_sides<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); widen_sides<3><<<sms, 128, smem>>>(cycles, out); break;
        case 4: CHECK(cudaFuncSetAttribute(widen_sides<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); widen_sides<4><<<sms, 128, smem>>>(cycles, out); break;
      }
      CHECK(cudaGetLastError());
    }
    std::printf("  %-36s %7.0f cycles a side\n", loops[l], double(collect()) / kSides);
  }
  return 0;
}
