// NVFP4 -> FP8 E4M3 conversion of a cache on the GPU: one thread per (page, head, token,
// group of 16 elements): 8 packed bytes and one block scale in, 16 E4M3 codes out.
#include <algorithm>

#include "cuda/inference/quant.cuh"

namespace msa::cuda {

namespace {

using namespace inference;

constexpr int kThreads = 256;
constexpr int kGroupBytes = kNvfp4GroupSize / 2;  // packed bytes of a group (two codes a byte)
constexpr int kHostIdsPerLaunch = 512;  // page ids from a host tensor travel as kernel arguments

struct ConvertArgs {
  const uint8_t* packed;
  int64_t p0, p1, p2;
  const uint8_t* scale;
  int64_t s0, s1, s2;
  uint8_t* out;
  int64_t o0, o1, o2;
  int64_t hkv;
  int64_t first;        // first out page of this launch
  int64_t count;        // out pages of this launch
  const int32_t* ids;   // device page ids (nullptr: identity, or the host ids below)
  bool host_ids;
  int32_t host[kHostIdsPerLaunch];
};

__global__ void __launch_bounds__(kThreads) nvfp4_to_fp8_kernel(const ConvertArgs a) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t per_page = a.hkv * kPageSize * kNvfp4RowScales;  // one thread per group
  if (i >= a.count * per_page) return;
  const int64_t local = i / per_page, rest = i % per_page;
  const int64_t h = rest / (kPageSize * kNvfp4RowScales);
  const int t = int(rest / kNvfp4RowScales % kPageSize), grp = int(rest % kNvfp4RowScales);
  const int64_t dst = a.first + local;
  const int64_t src = a.host_ids ? a.host[local] : a.ids ? a.ids[dst] : dst;
  if (src < 0) return;
  const uint8_t* codes = a.packed + src * a.p0 + h * a.p1 + t * a.p2 + grp * kGroupBytes;
  const float scale = e4m3_to_f32(a.scale[src * a.s0 + h * a.s1 + t * a.s2 + grp]);
  uint8_t* o = a.out + dst * a.o0 + h * a.o1 + t * a.o2 + grp * kNvfp4GroupSize;
#pragma unroll
  for (int b = 0; b < kGroupBytes; ++b) {
    const uint32_t byte = codes[b];
    o[2 * b] = nvfp4_to_e4m3(byte & 0xfu, scale);
    o[2 * b + 1] = nvfp4_to_e4m3(byte >> 4, scale);
  }
}

}  // namespace

void nvfp4_to_fp8(const Nvfp4ToFp8Params& p, const RunOptions& opt) {
  DeviceGuard guard(p.packed.device.index);
  ConvertArgs a{};
  a.packed = p.packed.as<const uint8_t>();
  a.p0 = p.packed.stride[0];
  a.p1 = p.packed.stride[1];
  a.p2 = p.packed.stride[2];
  a.scale = p.block_scale.as<const uint8_t>();
  a.s0 = p.block_scale.stride[0];
  a.s1 = p.block_scale.stride[1];
  a.s2 = p.block_scale.stride[2];
  a.out = p.out.as<uint8_t>();
  a.o0 = p.out.stride[0];
  a.o1 = p.out.stride[1];
  a.o2 = p.out.stride[2];
  a.hkv = p.packed.shape[1];
  const int64_t n = p.page_ids.present() ? p.page_ids.shape[0] : p.packed.shape[0];
  const bool host_ids = p.page_ids.present() && !p.page_ids.device.is_cuda();
  if (p.page_ids.present() && !host_ids) a.ids = p.page_ids.as<const int32_t>();
  const int64_t chunk = host_ids ? kHostIdsPerLaunch : std::max<int64_t>(n, 1);
  const cudaStream_t stream = as_stream(opt);
  for (int64_t first = 0; first < n; first += chunk) {
    a.first = first;
    a.count = std::min(chunk, n - first);
    a.host_ids = host_ids;
    if (host_ids) {
      const int32_t* ids = p.page_ids.as<const int32_t>();
      for (int64_t i = 0; i < a.count; ++i) a.host[i] = ids[(first + i) * p.page_ids.stride[0]];
    }
    const int64_t threads = a.count * a.hkv * kPageSize * kNvfp4RowScales;
    if (threads == 0) continue;
    nvfp4_to_fp8_kernel<<<unsigned(ceil_div(threads, kThreads)), kThreads, 0, stream>>>(a);
    MSA_CUDA_CHECK_LAUNCH("nvfp4_to_fp8_kernel");
  }
}

}  // namespace msa::cuda
