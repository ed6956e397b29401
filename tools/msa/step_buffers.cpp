#include "step_buffers.h"

namespace msa::tool {

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
  p.topk = topk.view();
  p.out = out.view();
  p.lse = lse.view();
  return p;
}

AttentionBackwardParams StepBuffers::backward_params() const {
  AttentionBackwardParams p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.topk = topk.view();
  p.out = out.view();
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
  p.index_lse = index_lse.view();
  p.topk = topk.view();
  p.dindex_q = dindex_q.view();
  p.dindex_k = dindex_k.view();
  return p;
}

}  // namespace msa::tool
