// What the attention backward and the KL backward share around their kernels on the chunk
// walker (chunk_walker.cuh). On the host, ChunkPass: what both passes set up, launch and
// reduce alike.
#pragma once

#include <cstdint>

#include "cuda/chunk_walker.cuh"
#include "cuda/common.cuh"
#include "cuda/reduce.cuh"
#include "cuda/workspace.h"

namespace msa::cuda {

// The host side of a pass over the chunk list: the device, the plan's state and workspace,
// the stream and sizes; the default mode's accumulators zeroed, the launch, and the reduction
// of what the kernel wrote into the outputs (reduce.cuh).
struct ChunkPass {
  DeviceGuard guard;
  const SparsePlan& plan;
  const PackedLayout& layout;
  const PlanState& st;
  const cudaStream_t stream;
  const int64_t total_q, total_k;
  const WorkspaceLayout w;
  const bool deterministic;
  const ChunkList chunks;

  ChunkPass(const TensorView& q, const Topology& topo, const PackedLayout& L, const SparsePlan& plan_,
            const RunOptions& opt)
      : guard(q.device.index), plan(plan_), layout(L), st(plan_state(plan_)), stream(as_stream(opt)),
        total_q(L.total_q()), total_k(L.total_k()), w(workspace_layout(topo, L)), deterministic(opt.deterministic),
        chunks(chunk_list(plan_, st, total_q)) {}

  template <typename T>
  T* ws(int64_t offset) const {
    return cuda::ws<T>(st, offset);
  }
  // The fp32 accumulators that the default mode's atomics add into start at zero.
  void zero_accumulator(float* acc, int64_t elems) const {
    if (!deterministic) MSA_CUDA_CHECK(cudaMemsetAsync(acc, 0, size_t(elems) * sizeof(float), stream));
  }
  template <class Args>
  void launch(void (*kernel)(Args), const Args& args, int smem_bytes, const char* name) const {
    launch_chunk_walker(kernel, args, smem_bytes, st, stream, name);
  }
  void reduce(int num_kv_heads, const QueryGradients& query, const KeyGradients& keys) const {
    reduce_gradients({.plan = &plan, .state = &st, .total_q = total_q, .total_k = total_k,
                      .num_kv_heads = num_kv_heads, .deterministic = deterministic,
                      .key_rows = ws<float>(w.kv_rows), .query = query, .keys = keys},
                     stream);
  }
};

}  // namespace msa::cuda
