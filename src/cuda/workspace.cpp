#include "cuda/workspace.h"

#include <algorithm>

#include "backend.h"

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

WorkspaceLayout forward_workspace_layout(int64_t Tq, int Hkv) {
  const int64_t Hq = 16 * int64_t(Hkv);
  WorkspaceLayout w;
  Cursor fwd;
  w.part_o = fwd.take(16 * Tq * Hq * 128 * 2);
  w.part_ml = fwd.take(16 * Tq * Hq * 8);
  w.total = fwd.at;
  return w;
}

// Regions used by modes that never run together overlap:
//   [0, A): forward partials | deterministic dQ partials | atomic dQ/dK/dV accumulators | KL
//   [A, ...): delta, per-chunk and per-row dK/dV (backward, KL).
WorkspaceLayout workspace_layout(int64_t Tq, int64_t Tk, int Hkv, int64_t rows, int64_t chunks) {
  const int64_t Hq = 16 * int64_t(Hkv), Hi = Hkv;
  WorkspaceLayout w = forward_workspace_layout(Tq, Hkv);
  Cursor fwd{w.total};
  Cursor det;
  w.dq_part = det.take(16 * Tq * Hq * 128 * 2);
  Cursor atomic;
  w.dq_acc = atomic.take(Tq * Hq * 128 * 4);
  w.dk_acc = atomic.take(Tk * Hkv * 128 * 4);
  w.dv_acc = atomic.take(Tk * Hkv * 128 * 4);
  Cursor kl;
  w.dqi_part = kl.take(16 * Tq * Hi * 128 * 4);
  w.dqi_acc = kl.take(Tq * Hi * 128 * 4);
  w.dki_acc = kl.take(Tk * 128 * 4);
  Cursor shared{std::max({fwd.at, det.at, atomic.at, kl.at})};
  w.delta = shared.take(Tq * Hq * 4);
  w.dout16 = shared.take(Tq * Hq * 128 * 2);
  w.kv_chunks = shared.take(chunks * 2 * 128 * 128 * 4);
  w.kv_rows = shared.take(Hkv * rows * 2 * 128 * 128 * 4);
  w.total = std::max({fwd.at, shared.at, int64_t(256)});
  return w;
}

int64_t chunk_capacity(const Topology& topo, const PackedLayout& L) {
  return topo.num_kv_heads * (L.total_rows(topo.block_size) + ceil_div(L.total_q() * topo.topk, kChunkQueries));
}

WorkspaceLayout workspace_layout(const Topology& topo, const PackedLayout& L) {
  return workspace_layout(L.total_q(), L.total_k(), topo.num_kv_heads, L.total_rows(topo.block_size),
                          chunk_capacity(topo, L));
}

int64_t plan_workspace_bytes(const Topology& topo, const PackedLayout& L) { return workspace_layout(topo, L).total; }

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
