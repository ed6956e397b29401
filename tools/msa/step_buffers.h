// The device buffers of one training step (indexer, plan, forward, backward, KL) and the
// wiring of those buffers into each op's parameters, shared by `msa demo`, `msa bench` and
// `msa run-case` so that the three run the same step.
#pragma once

#include "case_io.h"
#include "msa/ops.h"
#include "msa/tensor.h"

namespace msa::tool {

struct StepBuffers {
  Buffer q, k, v;             // [total_q, Hq, 128], [total_k, Hkv, 128] x 2 bf16
  Buffer index_q, index_k;    // [total_q, Hi, Di], [total_k, 1, Di] bf16
  Buffer topk;                // [Hi, total_q, 16] int32, written by select_blocks
  Buffer index_lse;           // [Hi, total_q] f32, select_blocks' selected LSE, read by kl_backward
  Buffer out, lse;            // [total_q, Hq, 128], [total_q, Hq] f32: the forward's outputs
  Buffer dout;                // [total_q, Hq, 128]
  Buffer dq, dk, dv;          // backward outputs, shaped as q, k, v
  Buffer dindex_q, dindex_k;  // KL outputs, shaped as index_q, index_k

  // Allocates every output of the step on the arena's device: topk, index_lse, out, lse and
  // bf16 gradients (dq, dk, dv, dindex_q, dindex_k).
  void allocate_outputs(DeviceArena& arena, const Topology& topo, int64_t total_q, int64_t total_k);

  // Views of the buffers above; other fields keep their defaults. The attention and KL params
  // leave topk empty, so the library reads the selection the plan holds.
  SelectBlocksParams select_blocks_params() const;
  AttentionForwardParams forward_params() const;
  AttentionBackwardParams backward_params() const;
  KlBackwardParams kl_params() const;
};

}  // namespace msa::tool
