// KL backward of the indexer, KV-outer over the plan's chunk list like the attention
// backward (chunk_walker.cuh). Per chunk the CTA holds the block's main keys K (head g) and
// index keys; per sub-chunk of 8 queries (warp w = query w):
//   teacher[t] = mean over the 16 heads of exp(scale <q_h, k_t> - lse_h)   (S = Q K^T, wgmma)
//   student[t] = exp(index_scale <qi, ki_t> - index_lse)                    (8 x 128, all warps)
//   ds = (student - teacher) * grad_scale on visible keys, 0 (by selection) on masked ones
//   d index_q (per edge) = index_scale ds . ki,   d index_k += index_scale ds^T . qi
// The 8-query products run on mma.sync (m16 tiles, rows 8..15 zero). d index_q reads a copy
// of the index keys without non-finite values when a masked block holds one (finite_copy).
// No lane-dependent branch may hold a shuffle, ldmatrix or mma.sync (teacher_row): the
// compiler's divergent form of one kept warps split through the rest of a sub-chunk.
// Default mode: fp32 atomics. Deterministic mode: per-edge slots for d index_q and per-chunk
// slots for d index_k, reduced in a fixed order by reduce_gradients.
#include "backend.h"
#include "cuda/backward_steps.cuh"
#include "cuda/chunk_walker.cuh"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/reduce.cuh"
#include "cuda/wgmma.cuh"
#include "cuda/workspace.h"

namespace msa::cuda {
namespace {

using model::kBlockSize;
using model::kGroupSize;
using model::kHeadDim;
constexpr int kStages = 2;  // the next sub-chunk loads while this one is computed
using QueryTile = SwizzledTile<16>;  // m16 operand: row r = query r of the sub-chunk, rows 8..15 zero
static_assert(kSubQueries <= QueryTile::kRowCount, "one row per query of a sub-chunk");

struct KlArgs {
  ChunkList chunks;
  const __nv_bfloat16* q;    // [Tq, Hq, kHeadDim]
  const __nv_bfloat16* k;    // [Tk, Hkv, kHeadDim]
  const float* lse;          // [Tq, Hq]
  const __nv_bfloat16* iq;   // [Tq, Hi, kHeadDim]
  const __nv_bfloat16* ik;   // [Tk, 1, kHeadDim]
  const float* index_lse;    // [Hi, Tq]
  float* dqi_acc;   // [Tq, Hi, kHeadDim]
  float* dki_acc;   // [Tk, kHeadDim]
  float* dqi_part;  // [kTopk, Tq, Hi, kHeadDim] (deterministic)
  float* ki_chunks; // [chunks, kBlockSize, kHeadDim] (deterministic)
  int Hq, Hkv;
  float scale_log2, index_scale, index_scale_log2, grad_scale;
  bool deterministic;
};

struct KlStorage {
  BlockTile k;                  // main keys of head g, rows = keys
  BlockTile ik;                 // index keys
  BlockTile q[kStages];         // row 16w + h = query w, head h
  QueryTile iq[kStages];        // index queries
  QueryTile ds;                 // ds of the sub-chunk, row = query
  BlockTile ik_finite;          // index keys without non-finite values (finite_copy)
  float teacher[kSubQueries][kBlockSize];
  QueryMeta meta[kStages][kWalkerWarps];
};
constexpr int kSmemBytes = storage_smem_bytes<KlStorage>();

// One step of a butterfly sum over lanes: lanes l and l ^ kHalf both hold v[0 .. 2 kHalf);
// afterwards each holds in v[0 .. kHalf) the pair's sums of the half that its lane bit kHalf
// selects (upper half when set). kHalf shuffles instead of 2 kHalf.
// The selects are PTX selp: as C++ `?:` the compiler turns them into a branch on the lane
// bit with the shuffles inside, which then run divergent (the slow collective path).
__device__ __forceinline__ float select_lane(uint32_t upper, float if_upper, float if_lower) {
  float r;
  asm("{\n .reg .pred p;\n setp.ne.u32 p, %3, 0;\n selp.f32 %0, %1, %2, p;\n}" : "=f"(r)
      : "f"(if_upper), "f"(if_lower), "r"(upper));
  return r;
}
template <int kHalf>
__device__ __forceinline__ void fold_half(float (&v)[32], int lane) {
  const uint32_t upper = uint32_t(lane) & kHalf;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float send = select_lane(upper, v[i], v[i + kHalf]);
    const float keep = select_lane(upper, v[i + kHalf], v[i]);
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kHalf);
  }
}

// The steps of a sub-chunk, in order.

// Teacher of warp w's query: column sums of exp(S scale - lse) over its 16 heads, visible
// keys only (selected, never multiplied: S may be NaN on a masked key). Branch-free: the
// exponentials are not duplicated per condition. S comes in two halves of 64 keys, the
// second still on the tensor cores while the first half's exponentials run.
__device__ __forceinline__ void teacher_row(const KlArgs& a, const WalkerThread& th, const Chunk& ch, uint32_t qs,
                                            uint32_t ks, const QueryMeta& m, float (&teacher)[kBlockSize]) {
  // The LSE loads go ahead of the products, whose time covers their latency.
  const HeadRows rows = head_rows(m, a.Hq, ch, th);
  const HeadPair lse = head_values(a.lse, rows, -INFINITY);
  float s[2][kKeyFrags / 2][4], colsum[2 * kKeyFrags];  // colsum[2 nt + e]: column nt * 8 + 2t + e, this lane's 2 heads
  wgmma_fence();
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_m64n64k16(s[hh], tile_desc(qs, kSubRows, th.wg_row, kk), tile_desc(ks, kBlockSize, 64 * hh, kk), kk > 0);
    wgmma_commit();
  }
  const float la = lse_log2(lse.a), lb = lse_log2(lse.b);
  auto column_sums = [&](int hh) {
#pragma unroll
    for (int i = 0; i < kKeyFrags / 2; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int nt = (kKeyFrags / 2) * hh + i;
        const bool vis = nt * 8 + 2 * th.t + e <= rows.lim;
        const float pa = softmax_p(s[hh][i][e], a.scale_log2, la), pb = softmax_p(s[hh][i][2 + e], a.scale_log2, lb);
        colsum[2 * nt + e] = vis ? pa + pb : 0.f;
      }
  };
  wgmma_wait<1>();
  column_sums(0);
  wgmma_wait<0>();
  column_sums(1);
  // Sum over the 8 lanes of a column group (r0 = lane bits 2..4) by halving: per lane bit,
  // a lane keeps the half of its values that the bit selects and adds its partner's copy of
  // it, so that lane r0 ends with columns 2 r0 and 2 r0 + 1 of every t (colsum[0..3]). Every
  // lane stores: no lane-dependent branch around the shuffles, whose divergent form (the
  // compiler unswitched an `if (r0 == 0)` store over them) kept the warp split through the
  // rest of the sub-chunk.
  fold_half<16>(colsum, th.lane);
  fold_half<8>(colsum, th.lane);
  fold_half<4>(colsum, th.lane);
  constexpr float kMean = 1.f / kGroupSize;
  const int col = 16 * th.r0 + 2 * th.t;  // column (2 r0) * 8 + 2t
  *reinterpret_cast<float2*>(&teacher[col]) = make_float2(colsum[0] * kMean, colsum[1] * kMean);
  *reinterpret_cast<float2*>(&teacher[col + 8]) = make_float2(colsum[2] * kMean, colsum[3] * kMean);
}

// Student and ds of all 8 queries on keys 16w..16w+15 (row r0 = query r0, meta m) into the
// ds tile.
__device__ __forceinline__ void student_ds(const KlArgs& a, const WalkerThread& th, const Chunk& ch, uint32_t iqs,
                                           uint32_t iks, uint32_t dst, const QueryMeta& m,
                                           const float (&teacher)[kSubQueries][kBlockSize]) {
  // The index LSE load goes ahead of the products, whose time covers its latency.
  const float il = m.row >= 0 ? a.index_lse[int64_t(ch.head_kv) * a.chunks.total_q + m.row] * math::kLog2e : -INFINITY;
  float si[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    uint32_t af[4], bf[4];
    load_a(af, iqs, 16, 0, kt * 16, th.lane);
    load_b_nk(bf, iks, kBlockSize, th.warp * 16, kt * 16, th.lane);
    mma_bf16(si[0], af, bf[0], bf[1]);
    mma_bf16(si[1], af, bf[2], bf[3]);
  }
  const int limit = m.row >= 0 ? m.limit : -1;  // an empty slot sees no key
  // ds selected by visibility: a masked key's score may be NaN and is never used.
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    float ds[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = th.warp * 16 + nt * 8 + 2 * th.t + e;
      const float student = il == -INFINITY ? 0.f : fast_exp2(si[nt][e] * a.index_scale_log2 - il);
      const float v = (student - teacher[th.r0][col]) * a.grad_scale;
      ds[e] = col <= limit ? v : 0.f;
    }
    st_shared_u32(dst + tile_offset(16, th.r0, th.warp * 2 + nt) + 4 * th.t, pack_bf16(ds[0], ds[1]));
  }
}

// d index_q = index_scale ds ki of the 8 edges (row r0 = query r0, meta m), dims 16w..16w+15.
__device__ __forceinline__ void index_q_grad(const KlArgs& a, const WalkerThread& th, const Chunk& ch, uint32_t dst,
                                             uint32_t ik_dq, const QueryMeta& m) {
  float dq[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    uint32_t af[4], bf[4];
    load_a(af, dst, 16, 0, kt * 16, th.lane);
    load_b_kn(bf, ik_dq, kBlockSize, kt * 16, th.warp * 16, th.lane);
    mma_bf16(dq[0], af, bf[0], bf[1]);
    mma_bf16(dq[1], af, bf[2], bf[3]);
  }
  // Stores of the slots that hold a query; no early return: d index_k's ldmatrix / mma.sync
  // follow in sub_chunk and need the whole warp.
  if (m.row >= 0) {
    store_query_grad<&KlArgs::dqi_part, &KlArgs::dqi_acc, &KlArgs::index_scale, &KlArgs::Hkv, 1>(
        a, th, dq, m.slot, QueryHead{m.row, ch.head_kv}, th.warp * 16);
  }
  __syncwarp();
}

// d index_k += ds^T qi (warp w: keys 16w..16w+15; k = the 16 query rows).
__device__ __forceinline__ void accumulate_index_k(float (&dki)[kHeadFrags][4], const WalkerThread& th, uint32_t dst,
                                                   uint32_t iqs) {
  uint32_t af[4];
  load_a_trans(af, dst, 16, th.warp * 16, 0, th.lane);
#pragma unroll
  for (int np = 0; np < 8; ++np) {
    uint32_t bf[4];
    load_b_kn(bf, iqs, 16, 0, np * 16, th.lane);
    mma_bf16(dki[2 * np], af, bf[0], bf[1]);
    mma_bf16(dki[2 * np + 1], af, bf[2], bf[3]);
  }
}

// The KL backward of one CTA as the chunk walker drives it.
struct KlChunks : WalkerThread {
  const KlArgs& a;
  const uint32_t ks, iks, qs0, iqs0, dst, ikfs;
  float (&teacher)[kSubQueries][kBlockSize];
  uint32_t ik_dq = 0;  // the index-key tile d index_q reads: iks, or ikfs
  float dki[kHeadFrags][4];

  __device__ KlChunks(const KlArgs& args, KlStorage& s)
      : a(args), ks(smem_addr(&s.k)), iks(smem_addr(&s.ik)), qs0(smem_addr(&s.q[0])), iqs0(smem_addr(&s.iq[0])),
        dst(smem_addr(&s.ds)), ikfs(smem_addr(&s.ik_finite)), teacher(s.teacher) {
    // Rows 8..15 of the index-query and ds tiles stay zero.
    for (int i = tid; i < 8 * 16; i += kWalkerThreads) {
      const int r = 8 + (i >> 4), c = i & 15;
      for (int st = 0; st < kStages; ++st) st_shared_v4_zero(iqs0 + st * sizeof(QueryTile) + tile_offset(16, r, c));
      st_shared_v4_zero(dst + tile_offset(16, r, c));
    }
  }

  __device__ void load_block(const Chunk& ch) {
    ik_dq = iks;
    KeyBlockRows(ch, a.Hkv, ch.head_kv).load(ks, a.k, *this);
    KeyBlockRows(ch, 1, 0).load(iks, a.ik, *this);  // one index key per token
  }
  // Q (16 heads) and the index query of warp w's query.
  __device__ void load_queries(const Chunk& ch, SlotQuery query, int st) {
    QueryHeadRows(ch, query, a.Hq).load(qs0 + st * sizeof(BlockTile), a.q, *this);
    if (lane < 16) {
      const __nv_bfloat16* src = a.iq + (int64_t(query.row) * a.Hkv + ch.head_kv) * kHeadDim + lane * 8;
      cp_async16(iqs0 + st * sizeof(QueryTile) + tile_offset(16, warp, lane), query.valid ? src : a.iq,
                 query.valid ? 16 : 0);
    }
  }
  __device__ void begin_chunk(const Chunk&) { zero(dki); }
  __device__ void masked_block_ready(const Chunk&) { ik_dq = finite_operand<kBlockSize>(iks, ikfs); }

  template <class Release>
  __device__ void sub_chunk(const Chunk& ch, int st, const QueryMeta (&meta)[kWalkerWarps], Release&& release) {
    const uint32_t qs = qs0 + st * sizeof(BlockTile), iqs = iqs0 + st * sizeof(QueryTile);
    teacher_row(a, *this, ch, qs, ks, meta[warp], teacher[warp]);  // warp w: query w
    __syncthreads();
    student_ds(a, *this, ch, iqs, iks, dst, meta[r0], teacher);  // every warp: its 16 keys of all 8
    __syncthreads();
    index_q_grad(a, *this, ch, dst, ik_dq, meta[r0]);
    accumulate_index_k(dki, *this, dst, iqs);
    __syncthreads();
    release();  // this stage's Q and index queries are free
  }

  // d index_k = index_scale ds^T qi of the chunk's keys (one index key per token).
  __device__ void flush(const Chunk& ch) {
    store_key_grads<&KlArgs::ki_chunks, nullptr>(*this, ch,
                                                 KeyGradient<&KlArgs::dki_acc, &KlArgs::index_scale>{dki});
  }
};

__global__ void __launch_bounds__(kWalkerThreads, 1) kl_chunks_kernel(const __grid_constant__ KlArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (a.chunks.status[0] != 0) return;
  KlStorage& s = shared_storage<KlStorage>(smem);
  KlChunks kernel(a, s);
  walk_chunks<kStages, RecordFetch::ahead>(a.chunks, s.meta, kernel);
}

}  // namespace

void kl_backward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan, const KlBackwardParams& p,
                 const RunOptions& opt) {
  const ChunkPass pass(p.q, topo, L, plan, opt, p.workspace, WorkspaceCall::kl_backward);
  const WorkspaceLayout& w = pass.w;
  const int64_t Tq = pass.total_q, Tk = pass.total_k;
  const int Hkv = topo.num_kv_heads, Hi = topo.num_index_heads;
  const float index_scale = topo.indexer_scale();
  const float grad_scale = p.grad_scale > 0 ? p.grad_scale : (Tq > 0 ? 1.0f / float(int64_t(Hi) * Tq) : 0.f);
  const KlArgs a{
      .chunks = pass.chunks,
      .q = p.q.as<const __nv_bfloat16>(), .k = p.k.as<const __nv_bfloat16>(), .lse = p.lse.as<const float>(),
      .iq = p.index_q.as<const __nv_bfloat16>(), .ik = p.index_k.as<const __nv_bfloat16>(),
      .index_lse = p.index_lse.as<const float>(),
      .dqi_acc = pass.ws<float>(w.dqi_acc), .dki_acc = pass.ws<float>(w.dki_acc),
      .dqi_part = pass.ws<float>(w.dqi_part), .ki_chunks = pass.ws<float>(w.kv_chunks),
      .Hq = topo.num_q_heads, .Hkv = Hkv, .scale_log2 = topo.attention_scale() * math::kLog2e,
      .index_scale = index_scale, .index_scale_log2 = index_scale * math::kLog2e, .grad_scale = grad_scale,
      .deterministic = pass.deterministic};
  pass.zero_accumulator(a.dqi_acc, Tq * Hi * kHeadDim);
  pass.zero_accumulator(a.dki_acc, Tk * kHeadDim);
  pass.launch(kl_chunks_kernel, a, kSmemBytes, "kl_chunks_kernel launch");
  // Index head g belongs to KV head g; one index key per token, read by every index head.
  pass.reduce(Hkv, {.out = p.dindex_q, .acc = a.dqi_acc, .parts = a.dqi_part, .part_dtype = DType::f32},
              {.count = 1, .out = {p.dindex_k}, .acc = {a.dki_acc}, .chunks = a.ki_chunks, .sum_kv_heads = true});
}

}  // namespace msa::cuda
