// Document maps and pack / unpack on the device.
//
// document_map_runs: one thread per map position flags the start of a run (s = 0 or a value
// different from its left neighbour); an exclusive scan numbers the starts and a scatter
// writes (position, value) of each start straight into mapped pinned host memory, with the
// count. The host waits once and reads the compact list.
//
// pack / unpack: a document occupies one contiguous span of its padded row, so the document
// table (each document's padded start and packed rows) is all a kernel needs; it travels as
// kernel arguments, in launches of up to kPackDocs documents. No device metadata, no
// allocation, no synchronisation: the copies are stream-ordered and graph-capturable.
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <mutex>

#include "cuda/common.cuh"
#include "cuda/layout.h"
#include "cuda/scratch.h"

namespace msa::cuda {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n, int64_t cap) { return int(std::clamp<int64_t>(ceil_div(n, kThreads), 1, cap)); }

// ---- document-map runs ----------------------------------------------------------------------

__device__ __forceinline__ int32_t map_at(const int32_t* map, int64_t sb, int64_t ss, int32_t S, int32_t i) {
  const int32_t b = i / S, s = i % S;
  return map[int64_t(b) * sb + int64_t(s) * ss];
}

__global__ void run_flags_kernel(const int32_t* __restrict__ map, int64_t sb, int64_t ss, int32_t S, int32_t n,
                                 int32_t* __restrict__ flags) {
  const int32_t i = int32_t(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  const int32_t s = i % S;
  flags[i] = (s == 0 || map_at(map, sb, ss, S, i) != map_at(map, sb, ss, S, i - 1)) ? 1 : 0;
}

__global__ void run_scatter_kernel(const int32_t* __restrict__ map, int64_t sb, int64_t ss, int32_t S, int32_t n,
                                   const int32_t* __restrict__ flags, const int32_t* __restrict__ pos,
                                   MapRun* __restrict__ runs, int32_t* __restrict__ count) {
  const int32_t i = int32_t(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  if (flags[i]) runs[pos[i]] = MapRun{i, map_at(map, sb, ss, S, i)};
  if (i == n - 1) *count = pos[i] + flags[i];
}

// Mapped pinned host memory the scatter writes into, kept for the process and grown when a
// larger map comes (growing frees the old block, which waits for the device once).
struct PinnedRuns {
  std::mutex mutex;
  void* host = nullptr;
  size_t bytes = 0;
};

PinnedRuns& pinned_runs() {
  static PinnedRuns* p = new PinnedRuns;  // never destroyed: may be used until exit
  return *p;
}

// ---- pack / unpack --------------------------------------------------------------------------

constexpr int kPackDocs = 2560;

struct PackArgs {
  int64_t padded_start[kPackDocs];  // padded position of each document's first token
  int32_t cu[kPackDocs + 1];        // packed rows of document d: [cu[d], cu[d + 1])
  int32_t docs;
};
static_assert(sizeof(PackArgs) + 4 * sizeof(void*) <= 32764, "kernel parameters are limited to 32764 bytes");

// Copies `units` elements of V per packed row, for the packed rows of the launch's documents.
template <typename V, bool kPack>
__global__ void pack_kernel(const __grid_constant__ PackArgs a, const V* __restrict__ src, V* __restrict__ dst,
                            int64_t units) {
  const int32_t row0 = a.cu[0];
  const int64_t total = int64_t(a.cu[a.docs] - row0) * units;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < total; w += int64_t(gridDim.x) * blockDim.x) {
    const int32_t t = row0 + int32_t(w / units);
    const int64_t u = w % units;
    int l = 0, r = a.docs;  // last d with cu[d] <= t
    while (r - l > 1) {
      const int m = (l + r) >> 1;
      if (a.cu[m] <= t) l = m; else r = m;
    }
    const int64_t p = a.padded_start[l] + (t - a.cu[l]);
    if (kPack) dst[int64_t(t) * units + u] = src[p * units + u];
    else dst[p * units + u] = src[int64_t(t) * units + u];
  }
}

template <bool kPack>
void launch_rows(const PackedLayout& L, const void* src, void* dst, int64_t row_bytes, cudaStream_t s) {
  const auto aligned = [&](size_t v) {
    return row_bytes % int64_t(v) == 0 && reinterpret_cast<uintptr_t>(src) % v == 0 &&
           reinterpret_cast<uintptr_t>(dst) % v == 0;
  };
  const size_t width = aligned(16) ? 16 : aligned(8) ? 8 : aligned(4) ? 4 : aligned(2) ? 2 : 1;
  const int64_t units = row_bytes / int64_t(width);
  const int cap = sm_count() * 16;
  const auto& starts = L.document_padded_start();
  const auto& cu = L.cu_seqlens_q();
  const int B = L.num_documents();
  PackArgs a;
  for (int d0 = 0; d0 < B; d0 += kPackDocs) {
    a.docs = std::min(kPackDocs, B - d0);
    for (int d = 0; d < a.docs; ++d) {
      a.padded_start[d] = starts[size_t(d0 + d)];
      a.cu[d] = cu[size_t(d0 + d)];
    }
    a.cu[a.docs] = cu[size_t(d0 + a.docs)];
    const int64_t work = int64_t(a.cu[a.docs] - a.cu[0]) * units;
    if (work == 0) continue;
    const int blocks = blocks_for(work, cap);
    switch (width) {
#define MSA_PACK_CASE(W, V)                                                                                          \
  case W:                                                                                                            \
    pack_kernel<V, kPack><<<blocks, kThreads, 0, s>>>(a, static_cast<const V*>(src), static_cast<V*>(dst), units); \
    break;
      MSA_PACK_CASE(16, uint4)
      MSA_PACK_CASE(8, uint2)
      MSA_PACK_CASE(4, uint32_t)
      MSA_PACK_CASE(2, uint16_t)
      default:
        pack_kernel<uint8_t, kPack><<<blocks, kThreads, 0, s>>>(a, static_cast<const uint8_t*>(src),
                                                                static_cast<uint8_t*>(dst), units);
#undef MSA_PACK_CASE
    }
    MSA_CUDA_CHECK_LAUNCH("pack_kernel");
  }
}

}  // namespace

std::vector<MapRun> document_map_runs(const TensorView& map, void* stream) {
  DeviceGuard guard(map.device.index);
  const auto s = static_cast<cudaStream_t>(stream);
  if (capturing(s))
    throw Error(ErrorKind::unsupported, "PackedLayout::from_document_map: a CUDA document map is read back to the "
                                        "host, which CUDA-graph capture forbids; build the layout before capturing");
  const int32_t S = int32_t(map.shape[1]), n = int32_t(map.shape[0] * map.shape[1]);
  StreamScratch flags(int64_t(n) * 4, s), pos(int64_t(n) * 4, s);
  size_t scan_bytes = 0;
  MSA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, flags.as<int32_t>(), pos.as<int32_t>(), n, s));
  StreamScratch temp(int64_t(scan_bytes), s);

  PinnedRuns& pinned = pinned_runs();
  std::lock_guard<std::mutex> lock(pinned.mutex);
  const size_t need = (size_t(n) + 1) * sizeof(MapRun);
  if (pinned.bytes < need) {
    if (pinned.host) cudaFreeHost(pinned.host);
    pinned.host = nullptr;
    pinned.bytes = 0;
    const size_t bytes = std::max(need, size_t(1) << 16);
    MSA_CUDA_CHECK(cudaHostAlloc(&pinned.host, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
    pinned.bytes = bytes;
  }
  void* dev = nullptr;
  MSA_CUDA_CHECK(cudaHostGetDevicePointer(&dev, pinned.host, 0));
  auto* count_dev = static_cast<int32_t*>(dev);
  auto* runs_dev = static_cast<MapRun*>(dev) + 1;
  const auto* count_host = static_cast<const volatile int32_t*>(pinned.host);
  const auto* runs_host = static_cast<const MapRun*>(pinned.host) + 1;

  const int blocks = int(ceil_div(n, kThreads));
  const auto* m = map.as<const int32_t>();
  run_flags_kernel<<<blocks, kThreads, 0, s>>>(m, map.stride[0], map.stride[1], S, n, flags.as<int32_t>());
  MSA_CUDA_CHECK_LAUNCH("run_flags_kernel");
  MSA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp.get(), scan_bytes, flags.as<int32_t>(), pos.as<int32_t>(), n, s));
  run_scatter_kernel<<<blocks, kThreads, 0, s>>>(m, map.stride[0], map.stride[1], S, n, flags.as<int32_t>(),
                                                 pos.as<int32_t>(), runs_dev, count_dev);
  MSA_CUDA_CHECK_LAUNCH("run_scatter_kernel");
  MSA_CUDA_CHECK(cudaStreamSynchronize(s));  // the one wait
  const int32_t count = *count_host;
  return std::vector<MapRun>(runs_host, runs_host + count);
}

void pack_rows(const PackedLayout& L, const TensorView& padded, const TensorView& packed, int64_t row_bytes,
               void* stream) {
  DeviceGuard guard(padded.device.index);
  launch_rows<true>(L, padded.data, packed.data, row_bytes, static_cast<cudaStream_t>(stream));
}

void unpack_rows(const PackedLayout& L, const TensorView& packed, const TensorView& padded, int64_t row_bytes,
                 void* stream) {
  DeviceGuard guard(padded.device.index);
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t positions = L.padded_batch() * L.padded_seq();
  if (L.total_q() < positions) MSA_CUDA_CHECK(cudaMemsetAsync(padded.data, 0, size_t(positions * row_bytes), s));
  launch_rows<false>(L, packed.data, padded.data, row_bytes, s);
}

}  // namespace msa::cuda
