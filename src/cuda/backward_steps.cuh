// The steps that the attention backward and the KL backward share on the chunk walker
// (chunk_walker.cuh), so that each kernel reads as its algorithm:
//   WalkerThread       where a thread sits: its query of the sub-chunk, its keys, its fragments
//   KeyBlockRows       load_block: a chunk's keys of one head into a block tile
//   QueryHeadRows      load_queries: the 16 heads of a warp's query into its tile rows
//   head_rows          a thread's two (query, head) rows of a sub-chunk: LSE, visible keys
//   softmax_p          P = exp(S scale - lse) of a score
//   store_query_grad   an edge's query gradient: its partial slot, or the fp32 accumulator
//   store_key_grads    flush: a chunk's key gradients, its slot or atomics into the key rows
// and, on the host, ChunkPass: what both passes set up, launch and reduce alike.
//
// The two store steps read the kernel's arguments (the mode, pointers, scales, head counts;
// named by member pointers) where they use them, as a kernel body does: a copy taken ahead
// into a parameter changes what the compiler makes of their loops (the generated code of both
// kernels was compared instruction by instruction).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/chunk_walker.cuh"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/reduce.cuh"
#include "cuda/workspace.h"
#include "msa/constants.h"

namespace msa::cuda {

// Where a thread sits: warp w loads query w of a sub-chunk into tile rows r16 = 16w.. (its 16
// heads; the wgmma products of its warpgroup start at row wg_row) and holds keys 16w..16w+15
// of the block in the key-side accumulators. In an accumulator fragment the thread holds
// columns 2t, 2t + 1 of rows r0 and r0 + 8.
struct WalkerThread {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3, r0 = lane >> 2;
  const int r16 = model::kGroupSize * warp, wg_row = 64 * (warp >> 2);
};

// The chunk's keys of head `head` in [Tk, heads, kHeadDim] tensors (K, V, index keys):
// load() is a cp.async into a block tile, rows past ch.nkeys zero. All threads.
struct KeyBlockRows {
  int64_t off, stride;
  int nkeys;

  __device__ __forceinline__ KeyBlockRows(const Chunk& ch, int heads, int head)
      : off((ch.key_token(0) * heads + head) * model::kHeadDim), stride(int64_t(heads) * model::kHeadDim),
        nkeys(ch.nkeys) {}
  __device__ __forceinline__ void load(uint32_t tile, const __nv_bfloat16* src, const WalkerThread& th) const {
    load_tile_async(tile, model::kBlockSize, 0, src + off, stride, model::kBlockSize, nkeys, th.tid, kWalkerThreads);
  }
};

// The 16 heads of KV head ch.head_kv of the warp's query in [Tq, Hq, kHeadDim] tensors (Q,
// dO): load() is a cp.async into the warp's rows of a sub-chunk tile, zeros for an empty
// slot. One warp.
struct QueryHeadRows {
  int64_t off;
  int valid;

  __device__ __forceinline__ QueryHeadRows(const Chunk& ch, SlotQuery query, int Hq)
      : off((int64_t(query.row) * Hq + model::kGroupSize * ch.head_kv) * model::kHeadDim),
        valid(query.valid ? model::kGroupSize : 0) {}
  __device__ __forceinline__ void load(uint32_t tile, const __nv_bfloat16* src, const WalkerThread& th) const {
    load_tile_async(tile, kSubRows, th.r16, src + off, model::kHeadDim, model::kGroupSize, valid, th.lane, 32);
  }
};

// begin_chunk: a key-side accumulator (16 fragments) to zero.
__device__ __forceinline__ void zero(float (&acc)[kHeadFrags][4]) {
#pragma unroll
  for (int i = 0; i < kHeadFrags; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// masked_block_ready: the tile that products summing over the block's keys read, `copy` when
// finite_copy had to zero non-finite values of `src` into it, else `src`. Every thread.
template <int kRows>
__device__ __forceinline__ uint32_t finite_operand(uint32_t src, uint32_t copy) {
  return finite_copy<kRows>(src, copy) ? copy : src;
}

// A thread's two rows of a sub-chunk: heads r0 and r0 + 8 of the warp's query.
struct HeadRows {
  int row;       // packed query row; -1 for an empty slot
  int slot;      // the edge's partial slot
  int lim;       // last key of the block the query sees; -1 for an empty slot (it sees none)
  int64_t hrow;  // [Tq, Hq] index of head r0 (head r0 + 8: hrow + 8); row 0 for an empty slot
};
__device__ __forceinline__ HeadRows head_rows(const QueryMeta& m, int Hq, const Chunk& ch, const WalkerThread& th) {
  const int row = m.row, slot = m.slot, lim = row < 0 ? -1 : m.limit;
  const int64_t hrow = int64_t(max(row, 0)) * Hq + model::kGroupSize * ch.head_kv + th.r0;
  return {row, slot, lim, hrow};
}

// The rows' values of a [Tq, Hq] array (a: head r0, b: head r0 + 8), `empty` for an empty slot.
struct HeadPair {
  float a, b;
};
__device__ __forceinline__ HeadPair head_values(const float* v, const HeadRows& r, float empty) {
  return {r.row >= 0 ? v[r.hrow] : empty, r.row >= 0 ? v[r.hrow + 8] : empty};
}

// The LSE as softmax_p subtracts it (log2 units); +inf for a row without keys (lse = -inf),
// so that its P is exp2(x - inf) = 0.
__device__ __forceinline__ float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * math::kLog2e; }
__device__ __forceinline__ float softmax_p(float s, float scale_log2, float lse_log2) {
  return fast_exp2(s * scale_log2 - lse_log2);
}

__device__ __forceinline__ void store_pair(float* p, float2 v) { *reinterpret_cast<float2*>(p) = v; }
__device__ __forceinline__ void store_pair(__nv_bfloat16* p, float2 v) {
  *reinterpret_cast<uint32_t*>(p) = pack_bf16(v.x, v.y);
}

// The (query, head) row `query` * heads + `head` of a [Tq, heads, ...] array, for
// store_query_grad to form where it uses it.
struct QueryHead {
  const int& query;
  int head;
};

// Writes an edge's gradient of its query: a.*kScale times the thread's kN fragments f,
// fragment i to columns col0 + 8i + 2t, +1 of (query, head) row `row` (f[i][0..1]; an index
// or a QueryHead) and, with kRows == 2, of the row 8 heads on (f[i][2..3]: head r0 + 8).
// Deterministic mode: into the edge's partial slot `slot` of a.*kParts ([kTopk, Tq, a.*kHeads,
// kHeadDim]); default mode: atomically into the fp32 accumulator a.*kAcc ([Tq, a.*kHeads,
// kHeadDim]).
template <auto kParts, auto kAcc, auto kScale, auto kHeads, int kRows, class Args, int kN, class Row>
__device__ __forceinline__ void store_query_grad(const Args& a, const WalkerThread& th, const float (&f)[kN][4],
                                                 const int& slot, const Row& row, int col0) {
  static_assert(kRows == 1 || kRows == 2, "a fragment holds rows r0 and r0 + 8");
  constexpr int64_t k8 = 8 * model::kHeadDim;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int dim = col0 + i * 8 + 2 * th.t;
    int64_t rowhead;
    if constexpr (std::is_same_v<Row, QueryHead>) rowhead = int64_t(row.query) * a.*kHeads + row.head;
    else rowhead = row;
    const float2 v = make_float2(f[i][0] * (a.*kScale), f[i][1] * (a.*kScale));
    const float2 v8 = make_float2(f[i][2] * (a.*kScale), f[i][3] * (a.*kScale));
    if (a.deterministic) {
      auto* dst = a.*kParts + (int64_t(slot) * a.chunks.total_q * a.*kHeads + rowhead) * model::kHeadDim + dim;
      store_pair(dst, v);
      if constexpr (kRows == 2) store_pair(dst + k8, v8);
    } else {
      float* dst = a.*kAcc + rowhead * model::kHeadDim + dim;
      atomicAdd(reinterpret_cast<float2*>(dst), v);
      if constexpr (kRows == 2) atomicAdd(reinterpret_cast<float2*>(dst + k8), v8);
    }
  }
}

// A gradient of the chunk's keys held in the thread's fragments (fragment nt: columns
// 8nt + 2t, +1 of keys 16w + r0 and 16w + r0 + 8), times the kernel argument kScale (none
// when null), with its fp32 accumulator kAcc ([Tk, heads, kHeadDim]).
template <auto kAcc, auto kScale = nullptr>
struct KeyGradient {
  static constexpr auto acc = kAcc;
  const float (&frag)[kHeadFrags][4];

  template <class Kernel>
  __device__ __forceinline__ float2 pair(const Kernel& k, int nt, int e) const {
    if constexpr (kScale == nullptr) return make_float2(frag[nt][e], frag[nt][e + 1]);
    else return make_float2(frag[nt][e] * (k.a.*kScale), frag[nt][e + 1] * (k.a.*kScale));
  }
};

// flush: writes the chunk's key gradients g... of kernel k (a WalkerThread with arguments
// k.a). Deterministic mode: to parts 0, 1 of the chunk's slot in k.a.*kSlots ([chunks, parts,
// kBlockSize, kHeadDim]). Default mode: atomically into their accumulators, keys inside the
// block only, at the key's row of the chunk's KV head among k.a.*kHeads heads, or at the
// key's token when kHeads is null (one row per token).
template <auto kSlots, auto kHeads, class Kernel, class... Grads>
__device__ __forceinline__ void store_key_grads(const Kernel& k, const Chunk& ch, const Grads&... g) {
  constexpr int kN = sizeof...(Grads);
  static_assert(kN == 1 || kN == 2, "a chunk's slot holds dK and dV, or d index_k");
  constexpr int64_t kPart = int64_t(model::kBlockSize) * model::kHeadDim;
  const int key_a = k.warp * 16 + k.r0, key_b = key_a + 8;
  auto row = [&](int key) {
    if constexpr (kHeads == nullptr) return ch.key_token(key);
    else return ch.key_token(key) * k.a.*kHeads + ch.head_kv;
  };
#pragma unroll
  for (int nt = 0; nt < kHeadFrags; ++nt) {
    const int dim = nt * 8 + 2 * k.t;
    const float2 v[kN][2] = {{g.pair(k, nt, 0), g.pair(k, nt, 2)}...};  // keys key_a, key_b
    if (k.a.deterministic) {
      // The parts written out: as a loop over them the compiler lays out the flush otherwise.
      float* slot = k.a.*kSlots + int64_t(ch.index) * kN * kPart;
      store_pair(slot + key_a * model::kHeadDim + dim, v[0][0]);
      store_pair(slot + key_b * model::kHeadDim + dim, v[0][1]);
      if constexpr (kN == 2) {
        float* part = slot + kPart;
        store_pair(part + key_a * model::kHeadDim + dim, v[1][0]);
        store_pair(part + key_b * model::kHeadDim + dim, v[1][1]);
      }
    } else {
      if (key_a < ch.nkeys) {
        const int64_t o = row(key_a) * model::kHeadDim + dim;
        int m = 0;
        (atomicAdd(reinterpret_cast<float2*>(k.a.*Grads::acc + o), v[m++][0]), ...);
      }
      if (key_b < ch.nkeys) {
        const int64_t o = row(key_b) * model::kHeadDim + dim;
        int m = 0;
        (atomicAdd(reinterpret_cast<float2*>(k.a.*Grads::acc + o), v[m++][1]), ...);
      }
    }
  }
}

// The host side of a pass over the chunk list: the device, the plan's state and workspace,
// the stream and sizes; the default mode's accumulators zeroed, the launch, and the reduction
// of what the kernel wrote into the outputs (reduce.cuh).
struct ChunkPass {
  DeviceGuard guard;
  const SparsePlan& plan;
  const PackedLayout& layout;
  const PlanState& st;
  const cudaStream_t stream;
  const int64_t total_q, total_k;
  const WorkspaceLayout w;
  const bool deterministic;
  const ChunkList chunks;
  void* const scratch;  // the call's workspace, else the plan's

  ChunkPass(const TensorView& q, const Topology& topo, const PackedLayout& L, const SparsePlan& plan_,
            const RunOptions& opt, const TensorView& workspace, WorkspaceCall call)
      : guard(q.device.index), plan(plan_), layout(L), st(plan_state(plan_)), stream(as_stream(opt)),
        total_q(L.total_q()), total_k(L.total_k()), w(workspace_layout(topo, L, call, opt.deterministic)),
        deterministic(opt.deterministic),
        // The window walk keeps the fp32 dQ reductions in L2; it measured no gain for the
        // deterministic mode's bf16 partials or for the KL (src/core/walk_order.h).
        chunks(chunk_list(plan_, st, total_q, call == WorkspaceCall::backward && !opt.deterministic)),
        scratch(call_workspace(st, workspace)) {}

  template <typename T>
  T* ws(int64_t offset) const {
    return cuda::ws<T>(scratch, offset);
  }
  // The fp32 accumulators that the default mode's atomics add into start at zero.
  void zero_accumulator(float* acc, int64_t elems) const {
    if (!deterministic) MSA_CUDA_CHECK(cudaMemsetAsync(acc, 0, size_t(elems) * sizeof(float), stream));
  }
  template <class Args>
  void launch(void (*kernel)(Args), const Args& args, int smem_bytes, const char* name) const {
    launch_chunk_walker(kernel, args, smem_bytes, st, stream, name);
  }
  void reduce(int num_kv_heads, const QueryGradients& query, const KeyGradients& keys) const {
    reduce_gradients({.plan = &plan, .state = &st, .total_q = total_q, .total_k = total_k,
                      .num_kv_heads = num_kv_heads, .deterministic = deterministic,
                      .key_rows = ws<float>(w.kv_rows), .query = query, .keys = keys},
                     stream);
  }
};

}  // namespace msa::cuda
