// The scratch memory a CUDA plan holds, and where each operation finds its part in it.
// Forward, backward and KL share one region: operations on the same plan must be ordered
// (one stream), which is how training uses a plan.
#pragma once

#include <cstdint>

#include "msa/ops.h"
#include "cuda/common.cuh"

namespace msa::cuda {

// Byte offsets of one call's regions in its workspace; kAbsent for regions the call does not
// use (ws() turns them into null pointers, so a kernel that touched one would fault, not
// overwrite another region).
struct WorkspaceLayout {
  static constexpr int64_t kAbsent = -1;
  // forward
  int64_t part_o = kAbsent;    // bf16 [16, W, Hq, 128]: partial output of each (query, block) edge of
                               //   the window being computed (W = WorkspaceShape::forward_window)
  int64_t part_ml = kAbsent;   // f32x2 [16, W, Hq]: its row max (log2 units) and sum of exponentials
  // backward
  int64_t delta = kAbsent;     // f32 [Tq, Hq]: rowsum(dO * O)
  int64_t dout16 = kAbsent;    // bf16 [Tq, Hq, 128]: dO when it comes as f32
  int64_t dq_acc = kAbsent;    // f32 [Tq, Hq, 128] (atomic mode)
  int64_t dq_part = kAbsent;   // bf16 [16, Tq, Hq, 128] (deterministic mode)
  int64_t dk_acc = kAbsent;    // f32 [Tk, Hkv, 128] (atomic mode)
  int64_t dv_acc = kAbsent;    // f32 [Tk, Hkv, 128] (atomic mode)
  // backward (2 gradients: dK, dV) and KL (1: d index_k), deterministic mode
  int64_t kv_chunks = kAbsent; // f32 [chunks, gradients, 128, 128]: per-chunk key gradients
  int64_t kv_rows = kAbsent;   // f32 [Hkv, rows, gradients, 128, 128]: their per-row sums
  // KL
  int64_t dqi_acc = kAbsent;   // f32 [Tq, Hi, 128] (atomic mode)
  int64_t dki_acc = kAbsent;   // f32 [Tk, 128] (atomic mode)
  int64_t dqi_part = kAbsent;  // f32 [16, Tq, Hi, 128] (deterministic mode)
  int64_t total = 0;           // bytes
};

// The sizes a layout depends on.
struct WorkspaceShape {
  int64_t total_q = 0, total_k = 0;
  int num_kv_heads = 0;
  int64_t total_rows = 0;      // k2q CSR rows (document, key block)
  int64_t chunk_capacity = 0;  // backward / KL work items (chunk_capacity below)
  int64_t forward_window = 0;  // queries whose partials the forward holds at once (0: total_q)
};

// The regions of one call, packed from offset 0.
WorkspaceLayout workspace_layout(const WorkspaceShape& n, WorkspaceCall call, bool deterministic);
// The same for a plan of `L`.
WorkspaceLayout workspace_layout(const Topology& topo, const PackedLayout& L, WorkspaceCall call, bool deterministic);
// Only the forward's regions: what paged prefill holds (`window`: forward_window_queries).
WorkspaceLayout forward_workspace_layout(int64_t total_q, int Hkv, int64_t window);
// Bytes of one call's workspace; a plan's own workspace (plan_workspace_bytes, backend.h) is
// the largest over calls and modes, since each call lays its regions out from offset 0.
int64_t call_workspace_bytes(const Topology& topo, const PackedLayout& L, WorkspaceCall call, bool deterministic);

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
  return offset == WorkspaceLayout::kAbsent ? nullptr : reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace msa::cuda
