// The KV-outer sparse attention forward (attention_forward.cu) as the two paths that run it
// see it: one launch over a built schedule (a plan's k2q CSR and work items), with the key
// blocks read from a KvSource. Training passes its packed K / V; paged prefill its cache.
#pragma once

#include <cstdint>

#include "msa/tensor.h"
#include "plan_records.h"
#include "cuda/common.cuh"
#include "cuda/kv_source.cuh"

namespace msa::cuda {

struct ForwardLaunch {
  KvSourceKind kind = KvSourceKind::packed_bf16;
  KvSource kv;
  int64_t k_extent = 0, v_extent = 0;  // TMA extents (bf16, FP8 sources): packed K / V tokens, or cache pages
  TensorView q;                       // [Tq, Hq, 128] bf16; token / head strides multiples of 8
  // The schedule (SparsePlan's buffers, include/msa/ops.h):
  const WorkItem* schedule = nullptr;  // [capacity]
  int64_t schedule_capacity = 0;
  const int32_t* work_count = nullptr;    // [1]
  const int32_t* full_items = nullptr;    // [1]: leading items with q_per_cta queries
  const int32_t* q_indices = nullptr;     // [Hkv, Tq * 16]
  const int32_t* split_slot = nullptr;    // [Hkv, Tq * 16]
  const int32_t* split_counts = nullptr;  // [Tq, Hkv]
  const int32_t* status = nullptr;        // [4]: non-zero -> NaN outputs
  const DocInfo* docs = nullptr;          // [B]
  const int32_t* order = nullptr;         // [capacity]: items in walking order (PlanState::forward_order);
                                          //   nullptr: the schedule's order, in contiguous shares
  int q_per_cta = 8;
  // The windows of the walk (PlanState::forward_window): the partials of one window's queries
  // at a time. One window (the default) is every query.
  int64_t window = 0;                       // queries a window: the partial scratch's rows (0: Tq)
  const int32_t* window_begin = nullptr;    // [windows + 1]: window w's own items in `order`
  const int32_t* straddle_begin = nullptr;  // [windows + 1]: its straddling items in straddle_items
  const int32_t* straddle_items = nullptr;
  // Scratch (workspace.h's forward regions): one partial state per (query, head, selected block)
  // of a window.
  void* part_o = nullptr;   // bf16 [16, window, Hq, 128]
  void* part_ml = nullptr;  // f32x2 [16, window, Hq]
  int64_t total_q = 0;
  int Hq = 0, Hkv = 0;
  float softmax_scale = 0;
  TensorView out;  // [Tq, Hq, 128] bf16 or f32, contiguous
  TensorView lse;  // [Tq, Hq] f32
};

void run_sparse_forward(const ForwardLaunch& f, cudaStream_t stream);

// The window fields of `f` from a plan's state.
void set_forward_windows(ForwardLaunch& f, const PlanState& state);

}  // namespace msa::cuda
