// The scratch memory a CUDA plan holds, and where each operation finds its part in it.
// Forward, backward and KL share one region: operations on the same plan must be ordered
// (one stream), which is how training uses a plan.
#pragma once

#include <cstdint>

#include "cuda/common.cuh"

namespace msa::cuda {

struct WorkspaceLayout {
  // forward
  int64_t part_o = 0;    // bf16 [16, Tq, Hq, 128]: partial output of each (query, block) edge
  int64_t part_ml = 0;   // f32x2 [16, Tq, Hq]: its row max (log2 units) and sum of exponentials
  // backward
  int64_t delta = 0;     // f32 [Tq, Hq]: rowsum(dO * O)
  int64_t dout16 = 0;    // bf16 [Tq, Hq, 128]: dO when it comes as f32
  int64_t dq_acc = 0;    // f32 [Tq, Hq, 128] (atomic mode)
  int64_t dq_part = 0;   // bf16 [16, Tq, Hq, 128] (deterministic mode; aliases part_o)
  int64_t dk_acc = 0;    // f32 [Tk, Hkv, 128]
  int64_t dv_acc = 0;    // f32 [Tk, Hkv, 128]
  int64_t kv_chunks = 0; // f32 [chunks, 2, 128, 128] (deterministic: per-chunk dK, dV)
  int64_t kv_rows = 0;   // f32 [Hkv, rows, 2, 128, 128] (deterministic: per-row sums)
  // KL
  int64_t dqi_acc = 0;   // f32 [Tq, Hi, 128]
  int64_t dki_acc = 0;   // f32 [Tk, 128]
  int64_t dqi_part = 0;  // f32 [16, Tq, Hi, 128] (deterministic)
  int64_t total = 0;     // bytes
};

WorkspaceLayout workspace_layout(int64_t total_q, int64_t total_k, int Hkv, int64_t total_rows, int64_t chunk_capacity);
// Only the forward's regions (part_o, part_ml; total = their size): what paged prefill holds.
WorkspaceLayout forward_workspace_layout(int64_t total_q, int Hkv);
// The layout for a plan of `L` (what every operation on such a plan uses).
WorkspaceLayout workspace_layout(const Topology& topo, const PackedLayout& L);

// Backward / KL work items a plan may hold (the size of PlanState::chunks).
int64_t chunk_capacity(const Topology& topo, const PackedLayout& L);

// Sets the plan's workspace: the caller's `given` (already checked: large enough, aligned) or,
// when it is empty, a buffer of plan_workspace_bytes (backend.h: workspace_layout's total)
// from the device allocator for work on `stream`.
void attach_workspace(const Topology& topo, const PackedLayout& L, const TensorView& given, PlanState& state,
                      Device dev, void* stream);

// A call's scratch: the params' workspace when given (checked in src/core), else the plan's.
inline void* call_workspace(const PlanState& s, const TensorView& given) {
  return given.present() ? given.data : s.workspace;
}

// Typed pointer into a workspace.
template <typename T>
T* ws(void* base, int64_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace msa::cuda
