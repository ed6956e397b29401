// Shared pieces of the CUDA backend: error checking, device selection, the per-document
// table that kernels read, and small numeric helpers. Included by every .cu file.
#pragma once

#include <utility>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "msa/error.h"
#include "msa/layout.h"
#include "msa/ops.h"

namespace msa::cuda {

[[noreturn]] void throw_cuda_error(const char* call, cudaError_t err, const char* file, int line);

// Every CUDA runtime call goes through this: a failure becomes msa::Error(runtime) naming the
// call, the CUDA message and the place.
#define MSA_CUDA_CHECK(call)                                                          \
  do {                                                                                \
    cudaError_t msa_cuda_err_ = (call);                                               \
    if (msa_cuda_err_ != cudaSuccess) ::msa::cuda::throw_cuda_error(#call, msa_cuda_err_, __FILE__, __LINE__); \
  } while (0)

// After every kernel launch: catches bad launch configurations at once (execution errors
// surface at the next synchronising call, which is checked too).
#define MSA_CUDA_CHECK_LAUNCH(name)                                                   \
  do {                                                                                \
    cudaError_t msa_cuda_err_ = cudaGetLastError();                                   \
    if (msa_cuda_err_ != cudaSuccess) ::msa::cuda::throw_cuda_error(name " launch", msa_cuda_err_, __FILE__, __LINE__); \
  } while (0)

// Makes `device` current for the scope and restores the previous device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// DeviceGuard for release paths (called from destructors): never throws; ok() is false when the
// current device could not be read, and then nothing was switched.
class QuietDeviceGuard {
 public:
  explicit QuietDeviceGuard(int device) noexcept;
  ~QuietDeviceGuard();
  QuietDeviceGuard(const QuietDeviceGuard&) = delete;
  QuietDeviceGuard& operator=(const QuietDeviceGuard&) = delete;
  bool ok() const { return previous_ >= 0; }

 private:
  int previous_ = -1;
  int device_ = -1;
};

// Whether `s` is being captured into a CUDA graph (a checked call).
bool capturing(cudaStream_t s);

inline cudaStream_t as_stream(const RunOptions& opt) { return static_cast<cudaStream_t>(opt.stream); }

// Launches `kernel` so that it may start before the previous kernel of `stream` has finished
// (programmatic stream serialization): the kernel must call griddep_wait (device.cuh) before it
// reads anything that kernel wrote. Under stream capture the dependency becomes a programmatic
// graph edge.
template <typename... Params, typename... Args>
void launch_programmatic(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) throw_cuda_error(name, err, __FILE__, __LINE__);
}

// Multiprocessors of the current device (cached per device).
int sm_count();

// One document as the kernels see it.
struct DocInfo {
  int32_t q_start, q_len, k_start, k_len;
};

// Host copy of the layout's documents in kernel form.
std::vector<DocInfo> doc_table(const PackedLayout& layout);

// The device-side state a CUDA plan carries besides its public buffers (plan.backend).
struct PlanState {
  Buffer docs;            // [B, 4] int32: DocInfo per document
  Buffer cu_q;            // [B + 1] int32: cu_seqlens_q (query -> document by binary search)
  Buffer doc_row_base;    // [B] int32: offset of document b in row_of
  Buffer row_of;          // [total_rows] int32: row id of (b, j) at row_of[doc_row_base[b] + j]
  Buffer chunks;          // [capacity, 6] int32: backward / KL work items (as schedule), up to
                          //   kChunkQueries queries each, largest first
  Buffer chunk_count;     // [1] int32
  Buffer schedule_full;   // [1] int32: leading schedule items that hold q_per_cta queries (the
                          //   partial items of the rows follow, one per row)
  Buffer chunk_first;     // [Hkv, total_rows] int32: first full chunk of a row
  Buffer chunk_nfull;     // [Hkv, total_rows] int32: full chunks of a row
  Buffer chunk_tail;      // [Hkv, total_rows] int32: index of the row's partial chunk or -1
  Buffer forward_order;   // [schedule capacity] int32: schedule items in the order the forward walks
                          //   them (token-major, see build_forward_order); valid if forward_ordered
  Buffer own_workspace;   // the workspace, unless the caller gave one (PlanOptions::workspace)
  void* workspace = nullptr;  // scratch shared by forward / backward / KL (one op at a time)
  int64_t chunk_capacity = 0;
  int64_t schedule_capacity = 0;
  int num_documents = 0;
  bool keys_overlap = false;  // some key token belongs to several documents (fragments)
  bool forward_ordered = false;  // forward_order holds the walk (else the schedule's own order)
  int forward_chunk = 0;         // queries a chunk of that walk; 0: the schedule's order
  // The forward's windows (src/core/walk_order.h, forward_window_queries): packed queries
  // [w * forward_window, (w + 1) * forward_window) are window w; one window without a walk.
  int64_t forward_window = 0;
  int forward_windows = 1;
  Buffer window_begin;    // [windows + 1] int32: window w's own items (first query in it) are
                          //   forward_order[window_begin[w] .. window_begin[w + 1])
  Buffer straddle_begin;  // [windows + 1] int32: window w's straddling items (an earlier window's
                          //   items with queries in w) are straddle_items[straddle_begin[w] ..]
  Buffer straddle_items;  // [straddle capacity] int32: schedule slots
  int64_t straddle_capacity = 0;
  Buffer chunk_order;            // [chunk capacity] int32: the chunk list in the backward's walking order
  bool chunks_ordered = false;   // chunk_order holds that walk (else the list's own order)
  int backward_window = 0;       // queries a window of that walk; 0: the list's order
};

inline constexpr int kChunkQueries = 128;  // queries per backward / KL work item

const PlanState& plan_state(const SparsePlan& plan);

inline int32_t* i32(const Buffer& b) { return static_cast<int32_t*>(b.data()); }
inline const DocInfo* doc_ptr(const PlanState& s) { return static_cast<const DocInfo*>(s.docs.data()); }
// The forward's walking order, or nullptr when it walks the schedule in its own order.
inline const int32_t* forward_order_ptr(const PlanState& s) {
  return s.forward_ordered ? i32(s.forward_order) : nullptr;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace msa::cuda
