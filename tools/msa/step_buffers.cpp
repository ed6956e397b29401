#include "step_buffers.h"

namespace msa::tool {

void StepBuffers::allocate_outputs(DeviceArena& arena, const Topology& topo, int64_t total_q, int64_t total_k) {
  const int64_t Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, Hi = topo.num_index_heads, D = topo.head_dim,
                Di = topo.index_head_dim, K = topo.topk;
  topk = arena.allocate(DType::i32, {Hi, total_q, K});
  index_lse = arena.allocate(DType::f32, {Hi, total_q});
  out = arena.allocate(DType::bf16, {total_q, Hq, D});
  lse = arena.allocate(DType::f32, {total_q, Hq});
  dq = arena.allocate(DType::bf16, {total_q, Hq, D});
  dk = arena.allocate(DType::bf16, {total_k, Hkv, D});
  dv = arena.allocate(DType::bf16, {total_k, Hkv, D});
  dindex_q = arena.allocate(DType::bf16, {total_q, Hi, Di});
  dindex_k = arena.allocate(DType::bf16, {total_k, 1, Di});
}

SelectBlocksParams StepBuffers::select_blocks_params() const {
  SelectBlocksParams p;
  p.index_q = index_q.view();
  p.index_k = index_k.view();
  p.topk = topk.view();
  p.selected_lse = index_lse.view();
  return p;
}

AttentionForwardParams StepBuffers::forward_params() const {
  AttentionForwardParams p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  // topk stays empty: the library then reads the plan's own copy of the selection, which
  // needs no comparison (another tensor would be compared with it: a sync on CUDA).
  p.out = out.view();
  p.lse = lse.view();
  return p;
}

AttentionBackwardParams StepBuffers::backward_params() const {
  AttentionBackwardParams p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.out = out.view();  // topk empty: the plan's own selection (see forward_params)
  p.lse = lse.view();
  p.dout = dout.view();
  p.dq = dq.view();
  p.dk = dk.view();
  p.dv = dv.view();
  return p;
}

KlBackwardParams StepBuffers::kl_params() const {
  KlBackwardParams p;
  p.q = q.view();
  p.k = k.view();
  p.lse = lse.view();
  p.index_q = index_q.view();
  p.index_k = index_k.view();
  p.index_lse = index_lse.view();  // topk empty: the plan's own selection
  p.dindex_q = dindex_q.view();
  p.dindex_k = dindex_k.view();
  return p;
}

}  // namespace msa::tool
