#include "cuda/workspace.h"

#include <algorithm>

#include "backend.h"
#include "core/walk_order.h"
#include "msa/constants.h"

namespace msa::cuda {

namespace {
struct Cursor {
  int64_t at = 0;
  int64_t take(int64_t bytes) {
    const int64_t here = at;
    at += (bytes + 255) / 256 * 256;
    return here;
  }
};
}  // namespace

WorkspaceLayout workspace_layout(const WorkspaceShape& n, WorkspaceCall call, bool deterministic) {
  const int64_t Tq = n.total_q, Tk = n.total_k, Hkv = n.num_kv_heads, Hq = 16 * Hkv, Hi = Hkv;
  const int64_t edges = int64_t(model::kTopk) * Tq;
  const int64_t window_edges = int64_t(model::kTopk) * (n.forward_window > 0 ? n.forward_window : Tq);
  constexpr int64_t D = model::kHeadDim;
  const int64_t key_grad = int64_t(model::kBlockSize) * D * 4;  // one f32 [block, 128] key gradient tile
  WorkspaceLayout w;
  Cursor c;
  // Per-chunk key gradients and their per-row sums (deterministic modes); `gradients` of them.
  auto key_partials = [&](int64_t gradients) {
    w.kv_chunks = c.take(n.chunk_capacity * gradients * key_grad);
    w.kv_rows = c.take(Hkv * n.total_rows * gradients * key_grad);
  };
  switch (call) {
    case WorkspaceCall::forward:
      w.part_o = c.take(window_edges * Hq * D * 2);
      w.part_ml = c.take(window_edges * Hq * 8);
      break;
    case WorkspaceCall::backward:
      w.delta = c.take(Tq * Hq * 4);
      w.dout16 = c.take(Tq * Hq * D * 2);
      if (deterministic) {
        w.dq_part = c.take(edges * Hq * D * 2);
        key_partials(2);
      } else {
        w.dq_acc = c.take(Tq * Hq * D * 4);
        w.dk_acc = c.take(Tk * Hkv * D * 4);
        w.dv_acc = c.take(Tk * Hkv * D * 4);
      }
      break;
    case WorkspaceCall::kl_backward:
      if (deterministic) {
        w.dqi_part = c.take(edges * Hi * D * 4);
        key_partials(1);
      } else {
        w.dqi_acc = c.take(Tq * Hi * D * 4);
        w.dki_acc = c.take(Tk * D * 4);
      }
      break;
  }
  w.total = std::max(c.at, int64_t(256));
  return w;
}

WorkspaceLayout forward_workspace_layout(int64_t Tq, int Hkv, int64_t window) {
  return workspace_layout(WorkspaceShape{.total_q = Tq, .num_kv_heads = Hkv, .forward_window = window},
                          WorkspaceCall::forward, false);
}

int64_t chunk_capacity(const Topology& topo, const PackedLayout& L) {
  return topo.num_kv_heads * (L.total_rows(topo.block_size) + ceil_div(L.total_q() * topo.topk, kChunkQueries));
}

WorkspaceLayout workspace_layout(const Topology& topo, const PackedLayout& L, WorkspaceCall call, bool deterministic) {
  const WorkspaceShape n{.total_q = L.total_q(), .total_k = L.total_k(), .num_kv_heads = topo.num_kv_heads,
                         .total_rows = L.total_rows(topo.block_size), .chunk_capacity = chunk_capacity(topo, L),
                         .forward_window = detail::forward_window_queries(L)};
  return workspace_layout(n, call, deterministic);
}

int64_t call_workspace_bytes(const Topology& topo, const PackedLayout& L, WorkspaceCall call, bool deterministic) {
  return workspace_layout(topo, L, call, deterministic).total;
}

int64_t plan_workspace_bytes(const Topology& topo, const PackedLayout& L) {
  int64_t most = 0;
  for (WorkspaceCall call : {WorkspaceCall::forward, WorkspaceCall::backward, WorkspaceCall::kl_backward})
    for (bool deterministic : {false, true}) most = std::max(most, call_workspace_bytes(topo, L, call, deterministic));
  return most;
}

void attach_workspace(const Topology& topo, const PackedLayout& L, const TensorView& given, PlanState& state,
                      Device dev, void* stream) {
  if (given.present()) {
    state.workspace = given.data;
  } else {
    state.own_workspace = Buffer(dev, DType::u8, {plan_workspace_bytes(topo, L)}, stream);
    state.workspace = state.own_workspace.data();
  }
}

}  // namespace msa::cuda
