// Experiment (not part of the library): can the forward add each edge's output into an fp32
// accumulator in L2 instead of writing a bf16 partial to memory for a merge kernel to read back?
//
// The 16k forward (64 / 4 heads, 16 blocks a query) has 1,048,576 edges; an edge's output is a
// warp's 16 head rows x 128 dims. Today each edge writes 4 KB of bf16 (4.3 GB, then read again
// by the merge). With a per-row reference maximum fixed before the tasks run, an edge's
// contribution could instead be added in fp32: 8 KB of reductions an edge, 8.6 GB in all, into
// an accumulator whose live part (one 2048-query chunk of one KV head, 16.8 MB, as the walk
// orders the tasks) stays in L2.
//
// The probe mimics only the epilogue's traffic: 132 persistent CTAs of 8 warps take runs of 16
// tasks of 8 queries in turn through 32 segments (8 chunks x 4 heads) of 4096 tasks; the queries
// of a task are random within its chunk. Each warp delivers its edge by:
//   store-bf16   16-byte stores of the bf16 partial into its own slot (today's bytes)
//   red-v2       red.global.add.v2.f32 from the MMA fragment (32 a lane)
//   red-v4       pairs of lanes swap halves, then red.global.add.v4.f32 (16 a lane)
//   bulk-8k      the fp32 rows staged in shared memory (two 8 KB buffers a warp), one
//                cp.reduce.async.bulk add of 8 KB a warp
//   bulk-4k-x2   one 4 KB staging buffer a warp (the size of its Q rows): two halves, a read
//                wait between them
// Prints the median of 10 timed launches (CUDA events) and the rate in GB/s of delivered bytes.
//
// build: nvcc -O3 -std=c++20 -arch=sm_90a -Iinclude -Isrc bench/experiments/forward_reduce_probe.cu \
//          -o /tmp/forward_reduce_probe
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/device.cuh"  // smem_addr, pack_bf16
#include "probe_timing.cuh"

using msa::cuda::pack_bf16;
using msa::cuda::smem_addr;

namespace {

constexpr int kQueries = 16384, kHeadsKv = 4, kGroup = 16, kDim = 128, kTopk = 16;
constexpr int kChunk = 2048, kChunks = kQueries / kChunk;
constexpr int64_t kEdges = int64_t(kQueries) * kHeadsKv * kTopk;
constexpr int kTaskQueries = 8;
constexpr int64_t kTasks = kEdges / kTaskQueries;
constexpr int kSegments = kChunks * kHeadsKv;
constexpr int64_t kSegmentTasks = kTasks / kSegments;
constexpr int kRun = 16, kCtas = 132, kThreads = 256;

enum Mode { store_bf16, red_v2, red_v4, bulk_8k, bulk_4k_x2 };
const char* kNames[] = {"store-bf16", "red-v2", "red-v4", "bulk-8k", "bulk-4k-x2"};

__device__ __forceinline__ uint32_t mix(uint32_t x) {
  x ^= x >> 16, x *= 0x7feb352du, x ^= x >> 15, x *= 0x846ca68bu, x ^= x >> 16;
  return x;
}

template <Mode M>
__global__ void __launch_bounds__(kThreads, 1) epilogue(float* acc, uint16_t* partial, float seed) {
  extern __shared__ __align__(128) float stage[];  // bulk modes: 2 x 8 KB (or 4 KB) a warp
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t rounds = kTasks / (int64_t(kCtas) * kRun);
  float o[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[i][e] = seed * float(lane + i + e);
  int buf = 0;
  for (int64_t n = 0; n < rounds * kRun; ++n) {
    const int64_t task = (n / kRun) * kCtas * kRun + int64_t(blockIdx.x) * kRun + n % kRun;
    const int seg = int(task / kSegmentTasks), chunk = seg / kHeadsKv, head = seg % kHeadsKv;
    const int q = chunk * kChunk + int(mix(uint32_t(task * kTaskQueries + warp)) % kChunk);
    // acc [query][kv head][16 rows][128 dims] fp32: a query's 16 rows of a head are contiguous.
    float* rows = acc + (int64_t(q) * kHeadsKv + head) * kGroup * kDim;
    const int g = lane >> 2, t = lane & 3;
    if constexpr (M == store_bf16) {
      // Slot of the edge: (task, warp); the lane writes 16-byte pieces of the 4 KB.
      uint4* dst = reinterpret_cast<uint4*>(partial + (task * kTaskQueries + warp) * kGroup * kDim);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        dst[i * 32 + lane] = make_uint4(pack_bf16(o[2 * i][0], o[2 * i][1]), pack_bf16(o[2 * i][2], o[2 * i][3]),
                                        pack_bf16(o[2 * i + 1][0], o[2 * i + 1][1]),
                                        pack_bf16(o[2 * i + 1][2], o[2 * i + 1][3]));
    } else if constexpr (M == red_v2) {
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        float* p0 = rows + g * kDim + 8 * nt + 2 * t;
        float* p1 = p0 + 8 * kDim;
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p0), "f"(o[nt][0]), "f"(o[nt][1]) : "memory");
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p1), "f"(o[nt][2]), "f"(o[nt][3]) : "memory");
      }
    } else if constexpr (M == red_v4) {
      // Lanes t and t ^ 1: the even one takes row g's four columns 8nt + 4(t/2) .. +3, the odd
      // one row g + 8's.
      const bool odd = t & 1;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        const float give0 = odd ? o[nt][0] : o[nt][2], give1 = odd ? o[nt][1] : o[nt][3];
        const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1), got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
        float v[4];
        if (!odd) v[0] = o[nt][0], v[1] = o[nt][1], v[2] = got0, v[3] = got1;
        else v[0] = got0, v[1] = got1, v[2] = o[nt][2], v[3] = o[nt][3];
        float* p = rows + (g + (odd ? 8 : 0)) * kDim + 8 * nt + 4 * (t >> 1);
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v[0]), "f"(v[1]), "f"(v[2]),
                     "f"(v[3])
                     : "memory");
      }
    } else {
      constexpr int kHalves = M == bulk_8k ? 1 : 2;
      constexpr int kCols = kDim / kHalves;
      float* mine = stage + (warp * 2 + (M == bulk_8k ? buf : 0)) * kGroup * kDim;
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        if (lane == 0) {
          if (M == bulk_8k) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
          else asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        }
        __syncwarp();
#pragma unroll
        for (int nt = 0; nt < 16 / kHalves; ++nt) {
          const int c = 8 * nt + 2 * t;
          const int ntg = nt + h * (16 / kHalves);
          *reinterpret_cast<float2*>(mine + g * kCols + c) = make_float2(o[ntg][0], o[ntg][1]);
          *reinterpret_cast<float2*>(mine + (g + 8) * kCols + c) = make_float2(o[ntg][2], o[ntg][3]);
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncwarp();
        if (lane == 0) {
          if (M == bulk_8k) {
            asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(rows),
                         "r"(smem_addr(mine)), "r"(kGroup * kDim * 4)
                         : "memory");
          } else {
            // A half's 16 rows are 512-byte pieces of the accumulator (one 256-byte half-row a
            // row): 16 reductions of 256 bytes.
            for (int r = 0; r < kGroup; ++r)
              asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                               rows + r * kDim + h * kCols),
                           "r"(smem_addr(mine + r * kCols)), "r"(kCols * 4)
                           : "memory");
          }
          asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
      }
      buf ^= 1;
    }
  }
  if (M == bulk_8k || M == bulk_4k_x2)
    if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

template <Mode M>
float time_mode(float* acc, uint16_t* partial, int smem) {
  CHECK(cudaFuncSetAttribute(epilogue<M>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return median_ms([&] {
    epilogue<M><<<kCtas, kThreads, smem>>>(acc, partial, 1e-3f);
    CHECK(cudaGetLastError());
  });
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  const size_t acc_bytes = size_t(kQueries) * kHeadsKv * kGroup * kDim * 4;
  const size_t part_bytes = size_t(kEdges) * kGroup * kDim * 2;
  float* acc;
  uint16_t* partial;
  CHECK(cudaMalloc(&acc, acc_bytes));
  CHECK(cudaMalloc(&partial, part_bytes));
  CHECK(cudaMemset(acc, 0, acc_bytes));
  // The accumulator's zeroing, as a step would do it before the tasks.
  const float zero_ms = median_ms([&] { CHECK(cudaMemsetAsync(acc, 0, acc_bytes)); });
  std::printf("%-12s %8.3f ms  %7.0f GB/s  (%zu MB)\n", "memset-acc", zero_ms, acc_bytes / zero_ms / 1e6, acc_bytes >> 20);
  const double red_bytes = double(kEdges) * kGroup * kDim * 4, st_bytes = double(part_bytes);
  auto report = [&](Mode m, float t) {
    const double bytes = m == store_bf16 ? st_bytes : red_bytes;
    std::printf("%-12s %8.3f ms  %7.0f GB/s  (%.2f GB)\n", kNames[m], t, bytes / t / 1e6, bytes / 1e9);
  };
  report(store_bf16, time_mode<store_bf16>(acc, partial, 0));
  report(red_v2, time_mode<red_v2>(acc, partial, 0));
  report(red_v4, time_mode<red_v4>(acc, partial, 0));
  report(bulk_8k, time_mode<bulk_8k>(acc, partial, 8 * 2 * kGroup * kDim * 4));
  report(bulk_4k_x2, time_mode<bulk_4k_x2>(acc, partial, 8 * 2 * kGroup * kDim * 4));
  CHECK(cudaFree(acc));
  CHECK(cudaFree(partial));
  return 0;
}
