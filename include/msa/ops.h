// Training-path operations: indexer (block selection), the k2q plan, sparse attention
// forward / backward, the indexer's KL backward and merge of partial attention states.
//
// Every operation takes one params struct whose pointers carry a shape comment, is
// validated in one place (src/core) and then runs on the backend that owns the tensors'
// memory (CPU, or CUDA when msa was built with it). A call that throws msa::Error has not
// written to any output.
#pragma once

#include <cstdint>
#include <memory>

#include "msa/layout.h"
#include "msa/tensor.h"
#include "msa/topology.h"

namespace msa {

struct RunOptions {
  void* stream = nullptr;      // cudaStream_t for CUDA tensors; ignored on the CPU
  bool deterministic = false;  // bitwise reproducible accumulation (the CPU always is)
  int num_threads = 0;         // CPU threads; 0 = OpenMP's default
};

// ---------------------------------------------------------------------------------------
// Indexer: per (query token, index head) the 16 blocks to attend.
// Valid ids are document-local block ids, form a prefix, are unique, and the query's own
// (local) block is the last valid entry; unused slots are -1. With init_blocks = 0 and
// local_blocks = 1: all visible blocks when there are at most 16, else the 15 best earlier
// blocks by (block-max score desc, block id asc) and then the local block. With other
// forcing settings (init range [0, min(I, nvis)), local range [max(0, nvis - L), nvis), a
// block in both counts as local) the order is: init blocks ascending, the ranked history
// blocks in rank order, the other local blocks ascending, the query's own block last.
// NaN scores (a block with any NaN token score) are never ranked.
struct SelectBlocksParams {
  TensorView index_q;       // [total_q, Hi, Di] bf16 or f8e4m3 (FP8 E4M3, scale 1)
  TensorView index_k;       // [total_k, 1, Di] bf16 or f8e4m3 (one key head shared by all index heads)
  TensorView topk;          // out: [Hi, total_q, topk] int32
  TensorView selected_lse;  // optional out: [Hi, total_q] f32, natural-log LSE over the
                            // selected causal keys of s / lse_temperature (s = index score);
                            // on CUDA for total_q < 2^27 (else ErrorKind::unsupported)
  float lse_temperature = 1.0f;
};
void select_blocks(const Topology& topo, const PackedLayout& layout, const SelectBlocksParams& p,
                   const RunOptions& opt = {});

// ---------------------------------------------------------------------------------------
// Plan: the key-to-query (k2q) CSR of a selection plus the work schedule. Built once per
// layer and micro-batch, reused by forward, backward and KL.
//
// A CSR row is one (document b, kv block j) pair, j < ceil(k_len_b / 128), numbered
// level-major: every document's block 0 (in document order), then every block 1, ...
struct PlanOptions {
  int q_per_cta = 8;  // largest number of queries one work item takes from a row
  // CUDA plans only, optional: uint8 [n >= plan_workspace_bytes(...)], contiguous, on the plan's
  // device, 256-byte aligned. The plan uses it as its scratch instead of allocating its own,
  // so that a training loop can allocate it once instead of on every build_plan (large
  // allocations cost up to hundreds of ms). The caller keeps it alive as long as the plan,
  // and orders every operation of every plan sharing it (one stream), as for one plan.
  TensorView workspace;
  // CUDA plans only (a CPU plan needs no scratch and ignores it): the plan holds no scratch,
  // and every forward / backward / KL call on it passes its own in the params' `workspace`,
  // of call_workspace_bytes for that call. Kept between calls, such a plan costs only its CSR
  // and schedule (a plan's own scratch at 16k tokens, 64 heads, is ~5.8 GB: the deterministic
  // backward's), so one plan can serve a layer's forward, backward and KL, each call holding
  // only its own scratch for its duration (forward ~1.1 GB, default backward ~0.9 GB, default
  // KL ~42 MB at 16k). Not with `workspace`.
  bool workspace_per_call = false;
};

// Bytes of scratch a CUDA plan for this layout uses (forward partials, backward and KL
// accumulators): enough for every call on it in either mode; 0 for a CPU plan, which needs none.
int64_t plan_workspace_bytes(const Topology& topo, const PackedLayout& layout, Device device);

// The call a workspace passed in a call's params serves. Each call needs only its own regions:
// the forward its partial outputs (~264 KB a query token with 64 heads, for the queries of one
// window at a time: 4096 of them at 16k tokens, at most 1/16 of a long document), the default-mode
// backward and KL their fp32 accumulators (~50 KB and ~2.5 KB), the deterministic modes their
// per-edge and per-chunk partials; a plan's own workspace (plan_workspace_bytes) is the largest.
enum class WorkspaceCall { forward, backward, kl_backward };
const char* to_string(WorkspaceCall call);

// Bytes of scratch one call of `call` on a CUDA plan for this layout uses (its params'
// `workspace` must hold at least this many), with RunOptions::deterministic = `deterministic`;
// 0 on the CPU. Never more than plan_workspace_bytes.
int64_t call_workspace_bytes(const Topology& topo, const PackedLayout& layout, Device device, WorkspaceCall call,
                             bool deterministic = false);

struct SparsePlan {
  Device device{};
  int64_t total_q = 0;
  int64_t total_rows = 0;
  int num_kv_heads = 0;
  int topk = 16;
  int q_per_cta = 8;
  int64_t work_count = 0;  // host copy of the number of schedule entries in use
  Buffer rows;             // [total_rows, 2] int32: (document, kv_block)
  Buffer row_ptr;          // [Hkv, total_rows + 1] int32: exclusive prefix sum of row sizes
  Buffer q_indices;        // [Hkv, total_q * topk] int32: document-local query ids of each
                           //   row, ascending within a row; unused tail -1
  Buffer split_slot;       // [Hkv, total_q * topk] int32: partial slot of each (query, block)
                           //   edge = number of the query's valid blocks with a smaller id;
                           //   aligned with q_indices, unused tail -1
  Buffer split_counts;     // [total_q, Hkv] int32: valid selected blocks per (query, head)
  Buffer schedule;         // [capacity, 6] int32: (head_kv, row, q_begin, q_count, document,
                           //   kv_block); q_begin indexes q_indices[head_kv]; work items
                           //   ordered by q_count descending, ties in (head, row, chunk) order
  Buffer work_count_dev;   // [1] int32: entries of `schedule` in use
  // [Hi, total_q, topk] int32 on the plan's device: the plan's own copy of the selection it
  // was built from (one device copy in build_plan). The CSR and schedule encode that
  // selection, so forward / backward / KL refuse a `topk` argument with other contents
  // ("topk does not match the selection the plan was built from"). Passing selection.view()
  // (or leaving the params' topk empty, which means the same) is accepted without reading
  // any contents; any other tensor is compared: a memcmp on the CPU, on CUDA a compare kernel
  // on opt.stream whose 8-byte result is read back (one synchronisation of opt.stream: pass
  // selection.view() in a loop that must not wait). During CUDA graph capture contents
  // cannot be read, so there only this plan's own selection is verified.
  Buffer selection;
  // CUDA plans only. build_plan does not wait for the device, so an invalid topk is found
  // there: status is [4] int32, all 0 when topk was valid, else (1, head, row, slot) of the
  // first invalid entry seen; the invalid entries are left out of the CSR, work_count is -1
  // (read work_count_dev), and forward / backward / KL run on such a plan write NaN to all
  // their outputs.
  Buffer status;
  bool workspace_per_call = false;  // a CUDA plan built with PlanOptions::workspace_per_call
  std::shared_ptr<void> backend;  // backend-private metadata and scratch (CUDA)
};

// Validates `topk` against the layout (valid ids form a prefix, are unique and lie in
// [0, local block]; any order is accepted) and builds the
// plan on the device that holds `topk`.
SparsePlan build_plan(const Topology& topo, const PackedLayout& layout, const TensorView& topk,
                      const PlanOptions& options = {}, const RunOptions& opt = {});

// ---------------------------------------------------------------------------------------
// Sparse attention forward. For query token p of document b, head h, group g = h / 16:
// keys = tokens t <= p of the blocks selected by index head g; softmax scale 1/sqrt(128).
// Rows with no keys give out = 0 and lse = -inf.
struct AttentionForwardParams {
  TensorView q;     // [total_q, Hq, 128] bf16
  TensorView k;     // [total_k, Hkv, 128] bf16
  TensorView v;     // [total_k, Hkv, 128] bf16
  TensorView topk;  // [Hkv, total_q, 16] int32: the selection the plan was built from
                    //   (checked; empty = the plan's own, plan.selection)
  TensorView out;   // out: [total_q, Hq, 128] bf16 or f32
  TensorView lse;   // out: [total_q, Hq] f32, natural log
  TensorView workspace;  // optional, CUDA: uint8 [n >= call_workspace_bytes(this call)], 256-byte aligned:
                         //   this call's scratch instead of the plan's (required by a workspace_per_call plan)
};
void sparse_attention_forward(const Topology& topo, const PackedLayout& layout, const SparsePlan& plan,
                              const AttentionForwardParams& p, const RunOptions& opt = {});

// Sparse attention backward: dq, dk, dv of the forward above (dk/dv summed over the 16
// query heads of a group); fp32 accumulation.
struct AttentionBackwardParams {
  TensorView q;     // [total_q, Hq, 128] bf16
  TensorView k;     // [total_k, Hkv, 128] bf16
  TensorView v;     // [total_k, Hkv, 128] bf16
  TensorView topk;  // [Hkv, total_q, 16] int32: the plan's selection (checked; empty = plan.selection)
  TensorView out;   // [total_q, Hq, 128] bf16 or f32 (forward output)
  TensorView lse;   // [total_q, Hq] f32 (forward LSE)
  TensorView dout;  // [total_q, Hq, 128] bf16 or f32
  TensorView dq;    // out: [total_q, Hq, 128] bf16 or f32
  TensorView dk;    // out: [total_k, Hkv, 128] bf16 or f32
  TensorView dv;    // out: [total_k, Hkv, 128] bf16 or f32
  TensorView workspace;  // optional, CUDA: uint8 [n >= call_workspace_bytes(this call)], 256-byte aligned:
                         //   this call's scratch instead of the plan's (required by a workspace_per_call plan)
};
void sparse_attention_backward(const Topology& topo, const PackedLayout& layout, const SparsePlan& plan,
                               const AttentionBackwardParams& p, const RunOptions& opt = {});

// ---------------------------------------------------------------------------------------
// KL backward for the indexer. Per (query p, index head g), over the selected causal keys:
// teacher = mean over the group's 16 heads of the main softmax exp(z - lse);
// student = softmax of the index scores s = index_scale * <index_q, index_k>
//           (= exp(s - index_lse), index_lse from select_blocks at temperature 1);
// d s = (student - teacher) * grad_scale;  d index_q = d s . index_k * index_scale;
// d index_k = d s^T . index_q * index_scale.  grad_scale = 0 means 1 / (Hi * total_q),
// i.e. the gradient of the KL(teacher || student) averaged over index heads and tokens.
struct KlBackwardParams {
  TensorView q;          // [total_q, Hq, 128] bf16
  TensorView k;          // [total_k, Hkv, 128] bf16
  TensorView lse;        // [total_q, Hq] f32 (forward LSE of the main attention)
  TensorView index_q;    // [total_q, Hi, Di] bf16
  TensorView index_k;    // [total_k, 1, Di] bf16
  TensorView index_lse;  // [Hi, total_q] f32 (select_blocks' selected_lse, temperature 1)
  TensorView topk;       // [Hi, total_q, 16] int32: the plan's selection (checked; empty = plan.selection)
  TensorView dindex_q;   // out: [total_q, Hi, Di] bf16 or f32
  TensorView dindex_k;   // out: [total_k, 1, Di] bf16 or f32
  float grad_scale = 0;
  TensorView workspace;  // optional, CUDA: uint8 [n >= call_workspace_bytes(this call)], 256-byte aligned:
                         //   this call's scratch instead of the plan's (required by a workspace_per_call plan)
};
void kl_backward(const Topology& topo, const PackedLayout& layout, const SparsePlan& plan,
                 const KlBackwardParams& p, const RunOptions& opt = {});

// ---------------------------------------------------------------------------------------
// Merge of partial attention states (split-K, context parallelism):
// m = max_s lse_s; w_s = exp(lse_s - m); out = Σ w_s out_s / Σ w_s; lse = m + ln Σ w_s.
// A row whose partials are all -inf gives out = 0, lse = -inf.
struct MergeStatesParams {
  TensorView out_partials;  // [S, rows, H, D] bf16 or f32
  TensorView lse_partials;  // [S, rows, H] f32, natural log
  TensorView out;           // out: [rows, H, D] bf16 or f32
  TensorView lse;           // out: [rows, H] f32
};
void merge_states(const MergeStatesParams& p, const RunOptions& opt = {});

}  // namespace msa
