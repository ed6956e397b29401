// The named barriers (bar.sync id, thread count) of the CUDA kernels, one enum class per
// kernel that uses them, so that a barrier is read by its name and a kernel's ids are listed in
// one place. A CTA has 16 ids; id 0 is __syncthreads(). Only one kernel runs in a CTA, so
// different kernels may use the same ids; within a kernel, barriers that can be waited on at
// the same time by different thread sets need different ids. A kernel that adds named
// barriers adds its enum here.
#pragma once

#include "cuda/device.cuh"

namespace msa::cuda {

// forward_tasks_kernel (attention_forward.cu): two consumer warpgroups and a producer warpgroup.
enum class ForwardBarrier : int {
  kWarpgroup0 = 1,  // consumer warpgroup 0 (128 threads): its Q rows of a stage are read
  kWarpgroup1 = 2,  // consumer warpgroup 1 (kWarpgroup0 + wg)
  kKeyBlock = 3,    // the 256 consumer threads, around a change of the resident K / V tiles
};

// paged_decode_wgmma.cu: one or two consumer warpgroups and a producer warpgroup.
enum class DecodeBarrier : int {
  kWarpgroup0 = 1,  // consumer warpgroup 0 (128 threads): its query tile has landed
  kWarpgroup1 = 2,  // consumer warpgroup 1 (kWarpgroup0 + wg)
  kConsumers = 3,   // every consumer thread, around the split CTAs' arrival count
  kScanners = 4,    // the scanner warps, around their per-page flags
};

// paged_decode_rows_kernel (inference/paged_decode_rows.cu): 8 consumer warps and a producer warpgroup.
enum class RowsBarrier : int {
  kConsumers = 1,  // the 256 consumer threads, around the ring's reuse for a row's warp states
};

// select_blocks_kernel (select_blocks.cu): four consumer warpgroups and a producer warpgroup.
enum class SelectBarrier : int {
  kWarpgroup0 = 1,  // consumer warpgroup 0 (128 threads): its query rows have landed
                    // (warpgroup wg uses kWarpgroup0 + wg)
};

// prefill_scores_kernel (inference/paged_indexer.cu): four consumer warpgroups and a producer warp.
enum class PrefillIndexerBarrier : int {
  kWarpgroup0 = 1,  // consumer warpgroup 0 (128 threads): around the rewrite of its Q rows
                    // (warpgroup wg uses kWarpgroup0 + wg, ids 1..4)
};

// bar.sync on a named barrier of `threads` threads.
template <typename Id>
__device__ __forceinline__ void sync_barrier(Id id, int threads) {
  named_barrier(int(id), threads);
}

// bar.red.or on a named barrier: waits like sync_barrier and returns whether `pred` was true
// in any of the `threads` threads.
template <typename Id>
__device__ __forceinline__ bool sync_barrier_or(Id id, int threads, bool pred) {
  return named_barrier_or(int(id), threads, pred);
}

}  // namespace msa::cuda
