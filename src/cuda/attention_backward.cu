// Sparse attention backward, KV-outer over the plan's chunk list (chunk_walker.cuh). The CTA
// keeps the block's K and V in shared memory and dK, dV of its keys in registers (warpgroup
// wg owns keys 64wg..64wg+63, warp w keys 16w..16w+15) while it walks the chunk's queries 8 at
// a time (a sub-chunk of 128 rows: row 16w + h = query w, head h). The products are computed
// transposed, keys as the M dimension, so that P^T and dS^T stay in registers as the A operand
// of the key-gradient products (no round trip of P through shared memory, no CTA barrier
// between the scores and dK, dV). Per half of 64 sub-chunk rows, on wgmma (sm_90a):
//   S^T = K Q^T, dP^T = V dO^T, P^T = exp(S^T * scale - lse), dS^T = P^T (dP^T - D),
//   D = rowsum(dO * O); dV += P^T dO and dK += scale dS^T Q with P^T, dS^T from registers.
// dS^T goes to shared memory, and after one barrier dQ (per edge) = scale dS K, warpgroup wg
// taking rows 64wg.. (its warps' queries). The next half's scores are issued behind this
// half's key-gradient products, so the tensor cores go from one to the other without a gap.
// Masked keys (past a query's causal limit) get P = dS = 0 by selection, never by a product
// with 0, so a non-finite K or V there cannot reach the query's gradients; dQ reads a copy of
// K with non-finite values zeroed when a masked block holds one (finite_copy).
// Default mode: dK, dV go to fp32 accumulators with atomics, and each edge's dQ (16 head rows
// of one query) through a staging tile into the fp32 dQ accumulator by TMA reductions (two
// boxes of 16 rows x 32 columns a warp and 64-dim half): the L2 adds whole lines instead of
// the threads' 8-byte atomics. Deterministic mode: each edge's dQ goes to its partial slot
// (bf16) and each chunk's dK, dV to its own fp32 slot; reduce_gradients finishes both in a
// fixed order.
#include "backend.h"
#include "cuda/backward_steps.cuh"
#include "cuda/chunk_walker.cuh"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/reduce.cuh"
#include "cuda/tensor_map.h"
#include "cuda/wgmma.cuh"
#include "cuda/workspace.h"

#include <cstddef>

namespace msa::cuda {
namespace {

using model::kBlockSize;
using model::kGroupSize;
using model::kHeadDim;

struct BackwardArgs {
  ChunkList chunks;
  const __nv_bfloat16* q;     // [Tq, Hq, kHeadDim]
  const __nv_bfloat16* k;     // [Tk, Hkv, kHeadDim]
  const __nv_bfloat16* v;     // [Tk, Hkv, kHeadDim]
  const __nv_bfloat16* dout;  // [Tq, Hq, kHeadDim] bf16 (converted when given as f32)
  const float* lse;           // [Tq, Hq]
  const float* delta;         // [Tq, Hq]
  float* dq_acc;              // [Tq, Hq, kHeadDim] (atomic mode)
  float* dk_acc;              // [Tk, Hkv, kHeadDim]
  float* dv_acc;
  __nv_bfloat16* dq_part;     // [kTopk, Tq, Hq, kHeadDim] (deterministic)
  float* kv_chunks;           // [chunks, 2, kBlockSize, kHeadDim] (deterministic: dK, then dV)
  int Hq, Hkv;
  float scale, scale_log2;
  bool deterministic;
  CUtensorMap dq_map;         // dq_acc as [Tq * Hq, 128] fp32 in 16 x 32 boxes (default mode)
};

struct BackwardStorage {
  BlockTile k, v;        // the key block, rows = keys
  BlockTile q, dout;     // the sub-chunk: row 16w + h = query w, head h
  BlockTile ds_t;        // dS^T of the sub-chunk: rows = keys, columns = the sub-chunk's rows
  BlockTile dq_staging;  // each warp's 4 KB of dQ boxes for the TMA reductions
  BlockTile k_finite;    // K without non-finite values, for dQ when a masked block holds one
  float lse[kSubRows];   // the LSE and D of the sub-chunk's rows, loaded with Q and dO
  float delta[kSubRows];
  QueryMeta meta[1][kWalkerWarps];
};
constexpr int kSmemBytes = storage_smem_bytes<BackwardStorage>();

// The steps of a sub-chunk, in order. In the transposed products warp w holds keys 16w + r0
// and 16w + r0 + 8 of the block; fragment j of a half h holds sub-chunk rows
// 64h + 8j + 2t, +1 (query 4h + j / 2). `hh` of dQ picks a half of 64 dims.
constexpr int kHalfRows = kSubRows / 2;
constexpr int kHalfFrags = kHalfRows / 8;  // n8 fragments of a 64-row half
constexpr int kHalfKSteps = kHalfRows / 16;
// What a k-step of 16 rows adds to an MN-major descriptor (tile_desc_mn, tile_desc_mn_x128).
constexpr uint64_t kMnStep = (16 * 128) >> 4;

// Issues the product of the warpgroup's 64 keys (key_row.. of `keys`) with the 64 sub-chunk
// rows of half h of `rows` as one commit group, S^T = K Q^T or dP^T = V dO^T; does not wait.
__device__ __forceinline__ void issue_transposed(float (&d)[kHalfFrags][4], uint32_t keys, uint32_t rows, int key_row,
                                                int h) {
  const uint64_t a0 = tile_desc(keys, kBlockSize, key_row, 0), b0 = tile_desc(rows, kSubRows, kHalfRows * h, 0);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    wgmma_m64n64k16(d, a0 + tile_desc_step(kBlockSize, kk), b0 + tile_desc_step(kSubRows, kk), kk > 0);
  wgmma_commit();
}

// The causal limits of the 4 queries of half h (-1 for an empty slot: it sees no key).
__device__ __forceinline__ void half_limits(int (&lim)[4], const QueryMeta (&meta)[kWalkerWarps], int h) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const QueryMeta& m = meta[4 * h + i];
    lim[i] = m.row < 0 ? -1 : m.limit;
  }
}

// P^T = exp(S^T scale - lse) as the bf16 A fragments of dV += P^T dO, 0 where the key is
// past the row's limit. Fragment pair k holds columns 16k.. of the half: a[0] (key_a, n8
// tile 2k), a[1] (key_a + 8, tile 2k), a[2], a[3] the same of tile 2k + 1.
__device__ __forceinline__ void probabilities_t(uint32_t (&pa)[kHalfKSteps][4], const float (&s)[kHalfFrags][4],
                                                uint32_t lse, const int (&lim)[4], int key_a, int h, int t,
                                                float scale_log2) {
#pragma unroll
  for (int j = 0; j < kHalfFrags; ++j) {
    const int col = kHalfRows * h + 8 * j + 2 * t;
    const float2 l = ld_shared_f32x2(lse + 4 * col);
    const float l0 = lse_log2(l.x), l1 = lse_log2(l.y);
    const int q = j >> 1;
    const bool in_a = key_a <= lim[q], in_b = key_a + 8 <= lim[q];
    pa[j >> 1][2 * (j & 1)] = pack_bf16(in_a ? softmax_p(s[j][0], scale_log2, l0) : 0.f,
                                        in_a ? softmax_p(s[j][1], scale_log2, l1) : 0.f);
    pa[j >> 1][2 * (j & 1) + 1] = pack_bf16(in_b ? softmax_p(s[j][2], scale_log2, l0) : 0.f,
                                            in_b ? softmax_p(s[j][3], scale_log2, l1) : 0.f);
  }
}

// dS^T = P^T (dP^T - D) from the bf16 P^T (as the products use it) in the same fragments, 0
// past the row's limit (dP^T may be NaN there).
__device__ __forceinline__ void dscores_t(uint32_t (&da)[kHalfKSteps][4], const uint32_t (&pa)[kHalfKSteps][4],
                                          const float (&dp)[kHalfFrags][4], uint32_t delta, const int (&lim)[4],
                                          int key_a, int h, int t) {
#pragma unroll
  for (int j = 0; j < kHalfFrags; ++j) {
    const int col = kHalfRows * h + 8 * j + 2 * t;
    const float2 d = ld_shared_f32x2(delta + 4 * col);
    const int q = j >> 1;
    const bool in_a = key_a <= lim[q], in_b = key_a + 8 <= lim[q];
    const __nv_bfloat162 pa_a = *reinterpret_cast<const __nv_bfloat162*>(&pa[j >> 1][2 * (j & 1)]);
    const __nv_bfloat162 pa_b = *reinterpret_cast<const __nv_bfloat162*>(&pa[j >> 1][2 * (j & 1) + 1]);
    da[j >> 1][2 * (j & 1)] = pack_bf16(in_a ? __low2float(pa_a) * (dp[j][0] - d.x) : 0.f,
                                        in_a ? __high2float(pa_a) * (dp[j][1] - d.y) : 0.f);
    da[j >> 1][2 * (j & 1) + 1] = pack_bf16(in_b ? __low2float(pa_b) * (dp[j][2] - d.x) : 0.f,
                                            in_b ? __high2float(pa_b) * (dp[j][3] - d.y) : 0.f);
  }
}

// Issues dV += P^T dO and dK += dS^T Q over the 64 rows of half h (P^T, dS^T from registers;
// dO and Q read MN-major, their rows being the reduction dimension) as one commit group.
__device__ __forceinline__ void issue_key_grads(float (&dv)[kHeadFrags][4], float (&dk)[kHeadFrags][4],
                                                const uint32_t (&pa)[kHalfKSteps][4],
                                                const uint32_t (&da)[kHalfKSteps][4], uint32_t dos, uint32_t qs,
                                                int h) {
  const uint64_t do0 = tile_desc_mn_x128(dos, kSubRows, kHalfKSteps * h), q0 = tile_desc_mn_x128(qs, kSubRows, kHalfKSteps * h);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < kHalfKSteps; ++k) wgmma_m64n128k16_rs<1>(dv, pa[k], do0 + kMnStep * k, 1);
#pragma unroll
  for (int k = 0; k < kHalfKSteps; ++k) wgmma_m64n128k16_rs<1>(dk, da[k], q0 + kMnStep * k, 1);
  wgmma_commit();
}

// The warp's dq fragments of one 64-dim half, times `scale`, into its 4 KB of the staging
// tile in the layout of two TMA boxes of 16 rows x 32 fp32 with the 128-byte swizzle
// (f32_row_tile_map): fragment i (columns 8i + 2t, +1) goes to box i / 4, 16-byte chunk
// 2 (i % 4) + t / 2 of rows r0 and r0 + 8, swizzled by r0.
__device__ __forceinline__ void stage_dq_half(uint32_t region, const float (&dq)[8][4], float scale, int r0, int t) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int chunk = (2 * (i & 3) + (t >> 1)) ^ r0;
    const uint32_t at = region + (i >> 2) * 2048 + r0 * 128 + chunk * 16 + 8 * (t & 1);
    st_shared_f32x2(at, scale * dq[i][0], scale * dq[i][1]);
    st_shared_f32x2(at + 8 * 128, scale * dq[i][2], scale * dq[i][3]);
  }
}

// dq = dS K for dims 64hh..64hh+63 of warpgroup wg's 64 rows: dS read from the dS^T tile
// (MN-major: its columns are the rows), the K tile (rows = keys) read transposed.
__device__ __forceinline__ void dq_half(float (&dq)[8][4], uint32_t ds_t, uint32_t ks, int wg, int hh) {
  const uint64_t a0 = tile_desc_mn(ds_t, kBlockSize, wg, 0), b0 = tile_desc_mn(ks, kBlockSize, hh, 0);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) wgmma_m64n64k16<1, 1>(dq, a0 + kMnStep * kk, b0 + kMnStep * kk, kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
}

// The backward of one CTA as the chunk walker drives it. Shared-memory addresses are the
// storage's base plus constant offsets (one register instead of one per tile).
struct BackwardChunks : WalkerThread {
  const BackwardArgs& a;
  const uint32_t base;
  uint32_t k_dq = 0;  // the K tile dQ reads: ks(), or kfs()
  float dk[kHeadFrags][4], dv[kHeadFrags][4];

  __device__ BackwardChunks(const BackwardArgs& args, const BackwardStorage& s) : a(args), base(smem_addr(&s)) {}

#define MSA_SMEM_OFFSET(name, field) \
  __device__ __forceinline__ uint32_t name(uint32_t at) const { return at + uint32_t(offsetof(BackwardStorage, field)); }
#define MSA_SMEM_AT(name, field) \
  MSA_SMEM_OFFSET(name, field)   \
  __device__ __forceinline__ uint32_t name() const { return name(base); }
  MSA_SMEM_AT(ks, k)
  MSA_SMEM_AT(vs, v)
  MSA_SMEM_AT(qs, q)
  MSA_SMEM_AT(dos, dout)
  MSA_SMEM_OFFSET(ds_t, ds_t)  // these two only at a sub-chunk buffer (sb)
  MSA_SMEM_OFFSET(staging_tile, dq_staging)
  MSA_SMEM_AT(kfs, k_finite)
  MSA_SMEM_AT(lse_rows, lse)
  MSA_SMEM_AT(delta_rows, delta)
#undef MSA_SMEM_AT
#undef MSA_SMEM_OFFSET

  __device__ void load_block(const Chunk& ch) {
    k_dq = ks();
    const KeyBlockRows keys(ch, a.Hkv, ch.head_kv);
    keys.load(ks(), a.k, *this);
    keys.load(vs(), a.v, *this);
  }
  // The warp's query: its 16 heads of Q and dO, and their LSE (lanes 0-15) and D (16-31). An
  // empty slot's LSE and D stay stale: its rows see no key, so they are never used.
  __device__ void load_queries(const Chunk& ch, SlotQuery query, int) {
    const QueryHeadRows heads(ch, query, a.Hq);
    heads.load(qs(), a.q, *this);
    heads.load(dos(), a.dout, *this);
    if (query.valid) {
      const int h = lane & 15;
      const int64_t hrow = int64_t(query.row) * a.Hq + model::kGroupSize * ch.head_kv + h;
      cp_async4((lane < 16 ? lse_rows() : delta_rows()) + 4 * (r16 + h), (lane < 16 ? a.lse : a.delta) + hrow);
    }
  }
  __device__ void begin_chunk(const Chunk&) {
    zero(dk);
    zero(dv);
  }
  __device__ void masked_block_ready(const Chunk&) { k_dq = finite_operand<kBlockSize>(ks(), kfs()); }

  template <class Release>
  __device__ void sub_chunk(const Chunk& ch, int, const QueryMeta (&meta)[kWalkerWarps], Release&& release) {
    const int key_a = 16 * warp + r0;
    // The tiles' addresses and descriptors are formed here from a base the compiler cannot
    // hoist, instead of being held across the walk in registers that the products need.
    const uint32_t sb = opaque(base);
    // Per half of the sub-chunk's rows: scores, P^T, dS^T, then dV, dK on the tensor cores
    // while the next half's scores queue behind them.
    float s[kHalfFrags][4], dp[kHalfFrags][4];
    uint32_t pa[kHalfKSteps][4], da[kHalfKSteps][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      issue_transposed(s, ks(sb), qs(sb), wg_row, h);  // S^T
      int lim[4];
      half_limits(lim, meta, h);
      wgmma_wait<0>();  // S^T, and the previous half's dV, dK
      issue_transposed(dp, vs(sb), dos(sb), wg_row, h);  // dP^T, during P^T
      probabilities_t(pa, s, lse_rows(sb), lim, key_a, h, t, a.scale_log2);
      wgmma_wait<0>();  // dP^T
      dscores_t(da, pa, dp, delta_rows(sb), lim, key_a, h, t);
      issue_key_grads(dv, dk, pa, da, dos(sb), qs(sb), h);
#pragma unroll
      for (int k = 0; k < kHalfKSteps; ++k)
        store_rows_x16(ds_t(sb), kBlockSize, r16, kHalfKSteps * h + k, lane, da[k][0], da[k][1], da[k][2], da[k][3]);
    }
    wgmma_wait<0>();
    const HeadRows rows = head_rows(meta[warp], a.Hq, ch, *this);  // the warp's query, whose dQ it writes
    fence_proxy_async();  // dS^T is read by wgmma next
    __syncthreads();      // every warpgroup's dS^T is stored; Q and dO are read
    release();            // the next sub-chunk loads while dQ runs
    // dQ of this warp's edge = scale dS K, in two halves of 64 dims (every warp takes part).
    const uint32_t staging = staging_tile(sb) + warp * 4096;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float dq[8][4];
      dq_half(dq, ds_t(sb), k_dq, warp >> 2, hh);
      if (rows.row < 0) continue;  // an empty slot has no edge (warp-uniform)
      if (a.deterministic) {
        store_query_grad<&BackwardArgs::dq_part, &BackwardArgs::dq_acc, &BackwardArgs::scale, &BackwardArgs::Hq, 2>(
            a, *this, dq, rows.slot, rows.hrow, 64 * hh);
        continue;
      }
      // The warp's previous boxes (this sub-chunk's first half, or the last sub-chunk's
      // second) must have been read out of the staging tile.
      if (lane == 0) bulk_wait_read<0>();
      __syncwarp();
      stage_dq_half(staging, dq, a.scale, r0, t);
      fence_proxy_async();  // the stores, then the TMA's reads
      __syncwarp();
      if (lane == 0) {  // rows.hrow of lane 0 (r0 = 0): the query's first head row
        tma_reduce_add_2d(&a.dq_map, 64 * hh, int(rows.hrow), staging);
        tma_reduce_add_2d(&a.dq_map, 64 * hh + 32, int(rows.hrow), staging + 2048);
        bulk_commit();
      }
    }
  }

  // dK = scale dS^T Q and dV of the chunk's keys.
  __device__ void flush(const Chunk& ch) {
    using Args = BackwardArgs;
    store_key_grads<&Args::kv_chunks, &Args::Hkv>(*this, ch, KeyGradient<&Args::dk_acc, &Args::scale>{dk},
                                                  KeyGradient<&Args::dv_acc>{dv});
  }
};

__global__ void __launch_bounds__(kWalkerThreads, 1) backward_chunks_kernel(const __grid_constant__ BackwardArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (a.chunks.status[0] != 0) return;
  BackwardStorage& s = shared_storage<BackwardStorage>(smem);
  BackwardChunks kernel(a, s);
  walk_chunks<1>(a.chunks, s.meta, kernel);
  if ((threadIdx.x & 31) == 0) bulk_wait<0>();  // the dQ reductions are done before the CTA ends
}

// D = rowsum(dO * O) per (query, head), and dO as bf16 when it comes as f32. One warp per row.
template <typename O, typename DO>
__global__ void backward_prepare_kernel(const O* __restrict__ out, const DO* __restrict__ dout, int64_t rows,
                                        float* __restrict__ delta, __nv_bfloat16* __restrict__ dout16) {
  constexpr int kPerLane = kHeadDim / 32;
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= rows) return;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t e = w * kHeadDim + lane * kPerLane + i;
    const float g = load_f(dout + e);
    acc += g * load_f(out + e);
    if (dout16) dout16[e] = __float2bfloat16_rn(g);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) delta[w] = acc;
}

template <typename O, typename DO>
void launch_prepare(const AttentionBackwardParams& p, int64_t rows, float* delta, __nv_bfloat16* dout16, cudaStream_t s) {
  backward_prepare_kernel<O, DO><<<grid_for(rows * 32, 256), 256, 0, s>>>(p.out.as<const O>(), p.dout.as<const DO>(), rows,
                                                                        delta, dout16);
  MSA_CUDA_CHECK_LAUNCH("backward_prepare_kernel");
}

}  // namespace

void sparse_attention_backward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan,
                               const AttentionBackwardParams& p, const RunOptions& opt) {
  const ChunkPass pass(p.q, topo, L, plan, opt, p.workspace, WorkspaceCall::backward);
  const WorkspaceLayout& w = pass.w;
  const int64_t Tq = pass.total_q, Tk = pass.total_k;
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads;
  // D and a bf16 dO.
  __nv_bfloat16* dout16 = p.dout.dtype == DType::f32 ? pass.ws<__nv_bfloat16>(w.dout16) : nullptr;
  float* delta = pass.ws<float>(w.delta);
  const float scale = topo.attention_scale();
  BackwardArgs a{
      .chunks = pass.chunks,
      .q = p.q.as<const __nv_bfloat16>(), .k = p.k.as<const __nv_bfloat16>(), .v = p.v.as<const __nv_bfloat16>(),
      .dout = dout16 ? dout16 : p.dout.as<const __nv_bfloat16>(),
      .lse = p.lse.as<const float>(), .delta = delta,
      .dq_acc = pass.ws<float>(w.dq_acc), .dk_acc = pass.ws<float>(w.dk_acc), .dv_acc = pass.ws<float>(w.dv_acc),
      .dq_part = pass.ws<__nv_bfloat16>(w.dq_part), .kv_chunks = pass.ws<float>(w.kv_chunks),
      .Hq = Hq, .Hkv = Hkv, .scale = scale, .scale_log2 = scale * math::kLog2e,
      .deterministic = pass.deterministic, .dq_map = {}};
  const int64_t rows = Tq * Hq;
  if (!a.deterministic && rows > 0) a.dq_map = f32_row_tile_map(a.dq_acc, rows, kGroupSize, "the dQ accumulator");
  if (rows > 0) {
    const bool of = p.out.dtype == DType::f32, df = p.dout.dtype == DType::f32;
    if (of && df) launch_prepare<float, float>(p, rows, delta, dout16, pass.stream);
    else if (of) launch_prepare<float, __nv_bfloat16>(p, rows, delta, dout16, pass.stream);
    else if (df) launch_prepare<__nv_bfloat16, float>(p, rows, delta, dout16, pass.stream);
    else launch_prepare<__nv_bfloat16, __nv_bfloat16>(p, rows, delta, dout16, pass.stream);
  }
  pass.zero_accumulator(a.dq_acc, Tq * Hq * kHeadDim);
  pass.zero_accumulator(a.dk_acc, Tk * Hkv * kHeadDim);
  pass.zero_accumulator(a.dv_acc, Tk * Hkv * kHeadDim);
  pass.launch(backward_chunks_kernel, a, kSmemBytes, "backward_chunks_kernel launch");
  pass.reduce(Hkv,
              {.out = p.dq, .acc = a.dq_acc, .parts = a.dq_part, .part_dtype = DType::bf16,
               .heads_per_kv_head = kGroupSize},
              {.count = 2, .out = {p.dk, p.dv}, .acc = {a.dk_acc, a.dv_acc}, .chunks = a.kv_chunks});
}

}  // namespace msa::cuda
