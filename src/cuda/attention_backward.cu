// Sparse attention backward, KV-outer over the plan's chunk list (chunk_walker.cuh). The CTA
// keeps the block's K and V in shared memory and dK, dV of its keys in registers (warp w
// owns keys 16w..16w+15) while it walks the chunk's queries 8 at a time (a sub-chunk of 128
// rows: warp w = query w, its 16 heads). Every product runs on wgmma (sm_90a):
//   S = Q K^T, P = exp(S * scale - lse), dP = dO V^T, dS = P (dP - D), D = rowsum(dO * O)
//   dV += P^T dO, dK += scale dS^T Q, dQ (per edge) = scale dS K
// Masked keys (past a query's causal limit) get P = dS = 0 by selection, never by a product
// with 0, so a non-finite K or V there cannot reach the query's gradients; dQ reads a copy of
// K with non-finite values zeroed when a masked block holds one (finite_copy).
// Default mode: dK, dV go to fp32 accumulators with atomics, and each edge's dQ (16 head rows
// of one query) through the P tile, free by then, into the fp32 dQ accumulator by TMA
// reductions (two boxes of 16 rows x 32 columns a warp and 64-dim half): the L2 adds whole
// lines instead of the threads' 8-byte atomics. Deterministic mode: each edge's dQ goes to its
// partial slot (bf16) and each chunk's dK, dV to its own fp32 slot; reduce_gradients finishes
// both in a fixed order.
#include "backend.h"
#include "cuda/backward_steps.cuh"
#include "cuda/chunk_walker.cuh"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/reduce.cuh"
#include "cuda/tensor_map.h"
#include "cuda/wgmma.cuh"
#include "cuda/workspace.h"

namespace msa::cuda {
namespace {

using model::kBlockSize;
using model::kGroupSize;
using model::kHeadDim;
constexpr int kLastKey = kBlockSize - 1;

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
  BlockTile k, v;       // the key block, rows = keys
  BlockTile q, dout;    // the sub-chunk: row 16w + h = query w, head h
  BlockTile p, ds;      // P and dS of the sub-chunk, rows as q, columns = keys
  BlockTile k_finite;   // K without non-finite values, for dQ when a masked block holds one
  QueryMeta meta[1][kWalkerWarps];
};
constexpr int kSmemBytes = storage_smem_bytes<BackwardStorage>();

// The steps of a sub-chunk, in order. Warp w holds rows 16w..16w+15 of the sub-chunk (query
// w) in its fragments; `hh` picks a half of 64 keys (P, dS) or of 64 dims (dQ).

// P (bf16) of keys 64hh..64hh+63 of the warp's rows from their scores S, into the P tile; 0
// past the row's limit.
__device__ __forceinline__ void store_p(const WalkerThread& th, uint32_t ps, const float (&s)[8][4], int hh,
                                        float scale_log2, float la, float lb, int lim) {
  uint32_t pk[8][2];  // bf16 pairs of rows r0 and r0 + 8
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int col = (8 * hh + i) * 8 + 2 * th.t;
    float p0 = softmax_p(s[i][0], scale_log2, la), p1 = softmax_p(s[i][1], scale_log2, la);
    float p2 = softmax_p(s[i][2], scale_log2, lb), p3 = softmax_p(s[i][3], scale_log2, lb);
    if (lim < kLastKey) {
      if (col > lim) p0 = p2 = 0.f;
      if (col + 1 > lim) p1 = p3 = 0.f;
    }
    pk[i][0] = pack_bf16(p0, p1);
    pk[i][1] = pack_bf16(p2, p3);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k)
    store_rows_x16(ps, kSubRows, th.r16, 4 * hh + k, th.lane, pk[2 * k][0], pk[2 * k][1], pk[2 * k + 1][0],
                   pk[2 * k + 1][1]);
}

// dS = P (dP - D) of keys 64hh.. into the dS tile, 0 past the row's limit (dP may be NaN there).
__device__ __forceinline__ void store_ds(const WalkerThread& th, uint32_t ps, uint32_t dss, const float (&dp)[8][4],
                                         int hh, HeadPair del, int lim) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    // The warp reads back its own rows of P in the accumulator layout: pr = (row r0, tile
    // 2k), (row r0 + 8, tile 2k), then tile 2k + 1.
    uint32_t pr[4], dsr[4];
    load_a(pr, ps, kSubRows, th.r16, (8 * hh + 2 * k) * 8, th.lane);
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const float(&dph)[4] = dp[2 * k + (h >> 1)];
      const float d = (h & 1) ? del.b : del.a;
      const __nv_bfloat162 pv = *reinterpret_cast<const __nv_bfloat162*>(&pr[h]);
      const int e = (h & 1) * 2, col = (8 * hh + 2 * k + (h >> 1)) * 8 + 2 * th.t;
      float d0 = __low2float(pv) * (dph[e] - d), d1 = __high2float(pv) * (dph[e + 1] - d);
      if (lim < kLastKey) {
        d0 = col <= lim ? d0 : 0.f;
        d1 = col + 1 <= lim ? d1 : 0.f;
      }
      dsr[h] = pack_bf16(d0, d1);
    }
    store_rows_x16(dss, kSubRows, th.r16, 4 * hh + k, th.lane, dsr[0], dsr[1], dsr[2], dsr[3]);
  }
}

// dV += P^T dO and dK += dS^T Q for the 64 keys of warpgroup wg (column half wg of the P and
// dS tiles): P^T and dS^T are read transposed from their [rows, keys] tiles and dO, Q from
// their [rows, dims] tiles, in two 64-dim halves. Warp w holds keys 16w..16w+15.
__device__ __forceinline__ void accumulate_dv_dk(float (&dv)[kHeadFrags][4], float (&dk)[kHeadFrags][4], uint32_t ps, uint32_t dss,
                                                 uint32_t dos, uint32_t qs, int wg) {
  wgmma_fence();
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float(&dv_half)[8][4] = *reinterpret_cast<float(*)[8][4]>(&dv[8 * hh]);
    float(&dk_half)[8][4] = *reinterpret_cast<float(*)[8][4]>(&dk[8 * hh]);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_m64n64k16<1, 1>(dv_half, tile_desc_mn(ps, kSubRows, wg, kk), tile_desc_mn(dos, kSubRows, hh, kk), 1);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_m64n64k16<1, 1>(dk_half, tile_desc_mn(dss, kSubRows, wg, kk), tile_desc_mn(qs, kSubRows, hh, kk), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
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

// dq = dS K for dims 64hh..64hh+63 of the warpgroup's 64 rows (from wg_row): dS is K-major,
// the K tile (rows = keys) is read transposed.
__device__ __forceinline__ void dq_half(float (&dq)[8][4], uint32_t dss, uint32_t ks, int wg_row, int hh) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    wgmma_m64n64k16<0, 1>(dq, tile_desc(dss, kSubRows, wg_row, kk), tile_desc_mn(ks, kBlockSize, hh, kk), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
}

// The backward of one CTA as the chunk walker drives it.
struct BackwardChunks : WalkerThread {
  const BackwardArgs& a;
  const uint32_t ks, vs, qs, dos, ps, dss, kfs;
  uint32_t k_dq = 0;  // the K tile dQ reads: ks, or kfs
  float dk[kHeadFrags][4], dv[kHeadFrags][4];

  __device__ BackwardChunks(const BackwardArgs& args, const BackwardStorage& s)
      : a(args), ks(smem_addr(&s.k)), vs(smem_addr(&s.v)), qs(smem_addr(&s.q)), dos(smem_addr(&s.dout)),
        ps(smem_addr(&s.p)), dss(smem_addr(&s.ds)), kfs(smem_addr(&s.k_finite)) {}

  __device__ void load_block(const Chunk& ch) {
    k_dq = ks;
    const KeyBlockRows keys(ch, a.Hkv, ch.head_kv);
    keys.load(ks, a.k, *this);
    keys.load(vs, a.v, *this);
  }
  __device__ void load_queries(const Chunk& ch, SlotQuery query, int) {
    const QueryHeadRows heads(ch, query, a.Hq);
    heads.load(qs, a.q, *this);
    heads.load(dos, a.dout, *this);
  }
  __device__ void begin_chunk(const Chunk&) {
    zero(dk);
    zero(dv);
  }
  __device__ void masked_block_ready(const Chunk&) { k_dq = finite_operand<kBlockSize>(ks, kfs); }

  template <class Release>
  __device__ void sub_chunk(const Chunk& ch, int, const QueryMeta (&meta)[kWalkerWarps], Release&& release) {
    const HeadRows rows = head_rows(meta[warp], a.Hq, ch, *this);
    const HeadPair lse = head_values(a.lse, rows, 0.f), del = head_values(a.delta, rows, 0.f);
    const float la = lse_log2(lse.a), lb = lse_log2(lse.b);
    // S = Q K^T and P, then dP = dO V^T and dS = P (dP - D), each in two halves of 64 keys.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float s[8][4];
      wgmma_rows_x64(s, qs, kSubRows, wg_row, ks, kBlockSize, 64 * hh);
      store_p(*this, ps, s, hh, a.scale_log2, la, lb, rows.lim);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float dp[8][4];
      wgmma_rows_x64(dp, dos, kSubRows, wg_row, vs, kBlockSize, 64 * hh);
      store_ds(*this, ps, dss, dp, hh, del, rows.lim);
    }
    fence_proxy_async();  // P and dS are read by wgmma next
    __syncthreads();
    accumulate_dv_dk(dv, dk, ps, dss, dos, qs, warp >> 2);
    __syncthreads();
    release();  // Q and dO are free: the next sub-chunk loads while dQ runs
    // dQ of this warp's edge = scale dS K, in two halves of 64 dims (every warp takes part).
    const uint32_t staging = ps + warp * 4096;  // P is dead after dV: the warp's 4 KB of it
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float dq[8][4];
      dq_half(dq, dss, k_dq, wg_row, hh);
      if (rows.row < 0) continue;  // an empty slot has no edge (warp-uniform)
      if (a.deterministic) {
        store_query_grad<&BackwardArgs::dq_part, &BackwardArgs::dq_acc, &BackwardArgs::scale, &BackwardArgs::Hq, 2>(
            a, *this, dq, rows.slot, rows.hrow, 64 * hh);
        continue;
      }
      if (hh == 1) {  // the first half's boxes must have been read out of the staging tile
        if (lane == 0) bulk_wait_read<0>();
        __syncwarp();
      }
      stage_dq_half(staging, dq, a.scale, r0, t);
      fence_proxy_async();  // the stores, then the TMA's reads
      __syncwarp();
      if (lane == 0) {  // rows.hrow of lane 0 (r0 = 0): the query's first head row
        tma_reduce_add_2d(&a.dq_map, 64 * hh, int(rows.hrow), staging);
        tma_reduce_add_2d(&a.dq_map, 64 * hh + 32, int(rows.hrow), staging + 2048);
        bulk_commit();
      }
    }
    // The next sub-chunk writes P here after its first barrier: the boxes must be read by then.
    if (lane == 0) bulk_wait_read<0>();
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
