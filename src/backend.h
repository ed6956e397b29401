// The backend interface: each backend implements these entry points for inputs that
// src/core has already validated. Backends never see unchecked user input.
#pragma once

#include <memory>

#include "msa/ops.h"

namespace msa {

namespace detail {
// A plan's public buffers (include/msa/ops.h) sized for total_q queries and `rows` CSR rows,
// allocated in one piece on `device` (CUDA: for work on `stream`, given back as `release`
// says); the selection copy only with with_selection. The size fields are set; the contents
// are the backend's to fill.
SparsePlan allocate_plan(const Topology& topo, int64_t total_q, int64_t rows, int q_per_cta, Device device,
                         void* stream, bool with_selection, Release release = Release::device_wait);
}  // namespace detail

namespace cpu {
void select_blocks(const Topology&, const PackedLayout&, const SelectBlocksParams&, const RunOptions&);
// Fills every plan buffer (already allocated on the CPU with the sizes in `plan`).
void build_plan(const Topology&, const PackedLayout&, const TensorView& topk, SparsePlan& plan);
void sparse_attention_forward(const Topology&, const PackedLayout&, const SparsePlan&,
                              const AttentionForwardParams&, const RunOptions&);
void sparse_attention_backward(const Topology&, const PackedLayout&, const SparsePlan&,
                               const AttentionBackwardParams&, const RunOptions&);
void kl_backward(const Topology&, const PackedLayout&, const SparsePlan&, const KlBackwardParams&,
                 const RunOptions&);
void merge_states(const MergeStatesParams&, const RunOptions&);
}  // namespace cpu

// Defined only in builds with the CUDA backend (MSA_WITH_CUDA). src/core reaches the operations
// through detail::dispatch (core/dispatch.h), which calls none of them in other builds.
namespace cuda {
void* allocate(int64_t bytes, int device);
void release(void* ptr, int device);
// cudaMemcpyKind-style copy of `bytes` bytes; either side may be host memory.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, int64_t bytes, void* stream);
void memset_zero(void* dst, int device, int64_t bytes, void* stream);
void synchronize(int device);
// The streams of an inference plan made on `home` (InferencePlan::streams, plan_streams.cpp):
// its uploads were just queued on `home`. When the last owner goes, `home` waits on the device
// for the plan's runs on other streams, so buffers given back on `home` afterwards are not
// reused before those runs end.
std::shared_ptr<void> plan_streams(int device, void* home);
// The plan's tables were just rewritten on `stream` (update_decode_plan): runs elsewhere wait
// for these copies, and the plan's release waits for them. Runs: cuda/plan_streams.h.
void plan_uploaded(const std::shared_ptr<void>& streams, void* stream);
int device_count();
void select_blocks(const Topology&, const PackedLayout&, const SelectBlocksParams&, const RunOptions&);
// `workspace`: the caller's scratch (checked: large enough, aligned) or empty to allocate one;
// `workspace_per_call`: none at all (every call passes its own).
void build_plan(const Topology&, const PackedLayout&, const TensorView& topk, const TensorView& workspace,
                bool workspace_per_call, SparsePlan& plan, const RunOptions&);
int64_t plan_workspace_bytes(const Topology&, const PackedLayout&);
int64_t call_workspace_bytes(const Topology&, const PackedLayout&, WorkspaceCall, bool deterministic);
void sparse_attention_forward(const Topology&, const PackedLayout&, const SparsePlan&,
                              const AttentionForwardParams&, const RunOptions&);
void sparse_attention_backward(const Topology&, const PackedLayout&, const SparsePlan&,
                               const AttentionBackwardParams&, const RunOptions&);
void kl_backward(const Topology&, const PackedLayout&, const SparsePlan&, const KlBackwardParams&,
                 const RunOptions&);
void merge_states(const MergeStatesParams&, const RunOptions&);
// Index of the first element where two contiguous int32 tensors of the same shape on this
// device differ, or -1; waits for `opt.stream` (reads back 8 bytes). kSelectionNotReadable
// while `opt.stream` is being captured into a graph (nothing is compared then).
inline constexpr int64_t kSelectionNotReadable = -2;
int64_t first_selection_difference(const TensorView& a, const TensorView& b, const RunOptions&);
}  // namespace cuda

}  // namespace msa
