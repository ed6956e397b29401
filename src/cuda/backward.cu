// Sparse attention backward, KV-outer over the plan's chunk list (work items of up to 128
// queries of one (kv head, key block) row). The CTA keeps the block's K and V in shared
// memory and dK, dV of its 128 keys in registers (warp w owns keys 16w..16w+15) while it
// walks the chunk's queries 8 at a time (128 rows: warp w = query w, its 16 heads):
//   S = Q K^T, P = exp(S * scale - lse), dP = dO V^T, dS = P (dP - D), D = rowsum(dO * O)
//   dV += P^T dO, dK += scale dS^T Q, dQ (per edge) = scale dS K
// Default mode: dQ, dK, dV go to fp32 accumulators with atomics. Deterministic mode: each
// edge's dQ goes to its partial slot (bf16) and each chunk's dK, dV to its own fp32 slot;
// fixed-order reductions finish both.
#include "backend.h"
#include "cuda/chunk_query.cuh"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/reduce.cuh"
#include "cuda/wgmma.cuh"
#include "cuda/workspace.h"

namespace msa::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 128 * 256;
constexpr int kSmemBytes = 6 * kTile + kWarps * 4 * 4 + 1024;  // + alignment slack
constexpr float kLog2e = 1.4426950408889634f;

struct BackwardArgs {
  const __nv_bfloat16* q;     // [Tq, Hq, 128]
  const __nv_bfloat16* k;     // [Tk, Hkv, 128]
  const __nv_bfloat16* v;     // [Tk, Hkv, 128]
  const __nv_bfloat16* dout;  // [Tq, Hq, 128] bf16 (converted when given as f32)
  const float* lse;           // [Tq, Hq]
  const float* delta;         // [Tq, Hq]
  const int32_t* chunks;      // [capacity, 6]
  const int32_t* chunk_count; // [1]
  const int32_t* q_indices;   // [Hkv, Tq * 16]
  const int32_t* split_slot;  // [Hkv, Tq * 16]
  const DocInfo* docs;
  const int32_t* status;
  float* dq_acc;              // [Tq, Hq, 128] (atomic mode)
  float* dk_acc;              // [Tk, Hkv, 128]
  float* dv_acc;
  __nv_bfloat16* dq_part;     // [16, Tq, Hq, 128] (deterministic)
  float* kv_chunks;           // [chunks, 2, 128, 128] (deterministic)
  int64_t total_q;
  int Hq, Hkv;
  float scale, scale_log2;
  bool deterministic;
};

// dV += P^T dO and dK += dS^T Q for the 64 keys of warpgroup wg (column half wg of the P and
// dS tiles) on wgmma: P^T and dS^T are read transposed from their [rows, keys] tiles and dO,
// Q from their [rows, dims] tiles, in two 64-dim halves. Warp w holds keys 16w..16w+15.
__device__ __forceinline__ void accumulate_dv_dk_wgmma(float (&dv)[16][4], float (&dk)[16][4], uint32_t ps,
                                                       uint32_t dss, uint32_t dos, uint32_t qs, int wg) {
  wgmma_fence();
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float(&dv_half)[8][4] = *reinterpret_cast<float(*)[8][4]>(&dv[8 * hh]);
    float(&dk_half)[8][4] = *reinterpret_cast<float(*)[8][4]>(&dk[8 * hh]);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_m64n64k16<1, 1>(dv_half, tile_desc_mn(ps, 128, wg, kk), tile_desc_mn(dos, 128, hh, kk), 1);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_m64n64k16<1, 1>(dk_half, tile_desc_mn(dss, 128, wg, kk), tile_desc_mn(qs, 128, hh, kk), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
}

// The same on mma.sync: warp w computes its 16 keys from ldmatrix fragments.
__device__ __forceinline__ void accumulate_dv_dk_sync(float (&dv)[16][4], float (&dk)[16][4], uint32_t ps,
                                                      uint32_t dss, uint32_t dos, uint32_t qs, int warp, int lane) {
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    uint32_t pa[4], sa[4];
    load_a_trans(pa, ps, 128, warp * 16, kt * 16, lane);
    load_a_trans(sa, dss, 128, warp * 16, kt * 16, lane);
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      uint32_t bo[4], bq[4];
      load_b_kn(bo, dos, 128, kt * 16, np * 16, lane);
      load_b_kn(bq, qs, 128, kt * 16, np * 16, lane);
      mma_bf16(dv[2 * np], pa, bo[0], bo[1]);
      mma_bf16(dv[2 * np + 1], pa, bo[2], bo[3]);
      mma_bf16(dk[2 * np], sa, bq[0], bq[1]);
      mma_bf16(dk[2 * np + 1], sa, bq[2], bq[3]);
    }
  }
}

// dq = dS K for dims 64hh..64hh+63 of the warpgroup's 64 rows (from wg_row) on wgmma: dS is
// K-major, the K tile (rows = keys) is read transposed.
__device__ __forceinline__ void dq_half_wgmma(float (&dq)[8][4], uint32_t dss, uint32_t ks, int wg_row, int hh) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    wgmma_m64n64k16<0, 1>(dq, tile_desc(dss, 128, wg_row, kk), tile_desc_mn(ks, 128, hh, kk), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
}

// kWgmma: every product on wgmma (sm_90a), else on mma.sync (kept to compare the two).
template <bool kWgmma>
__global__ void __launch_bounds__(kThreads, 1) backward_chunks_kernel(const BackwardArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (a.status[0] != 0) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3, r0 = lane >> 2;
  const uint32_t ks = align1024(smem_addr(smem)), vs = ks + kTile, qs = ks + 2 * kTile, dos = ks + 3 * kTile,
                 ps = ks + 4 * kTile, dss = ks + 5 * kTile;
  int* meta = reinterpret_cast<int*>(smem + (ks - smem_addr(smem)) + 6 * kTile);
  const int r16 = 16 * warp, wg_row = 64 * (warp >> 2);
  const int nchunks = *a.chunk_count;

  for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int32_t* it = a.chunks + int64_t(c) * 6;
    const int g = it[0], q_begin = it[2], q_count = it[3], b = it[4], j = it[5];
    const DocInfo d = a.docs[b];
    const int key0 = j * 128;
    const int nkeys = min(128, d.k_len - key0);
    const int64_t kv_off = (int64_t(d.k_start + key0) * a.Hkv + g) * 128;
    const int64_t edge0 = int64_t(g) * a.total_q * 16 + q_begin;
    auto load_sub = [&](int sub) {
      int row;
      const bool valid =
          chunk_query(a.q_indices, a.split_slot, edge0, sub * 8 + warp, q_count, d, key0, meta, warp, lane, row);
      const int64_t off = (int64_t(row) * a.Hq + 16 * g) * 128;
      load_tile_async(qs, 128, r16, a.q + off, 128, 16, valid ? 16 : 0, lane, 32);
      load_tile_async(dos, 128, r16, a.dout + off, 128, 16, valid ? 16 : 0, lane, 32);
    };
    load_tile_async(ks, 128, 0, a.k + kv_off, int64_t(a.Hkv) * 128, 128, nkeys, tid, kThreads);
    load_tile_async(vs, 128, 0, a.v + kv_off, int64_t(a.Hkv) * 128, 128, nkeys, tid, kThreads);
    load_sub(0);
    cp_async_commit();

    float dk[16][4], dv[16][4];
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;

    const int nsub = (q_count + 7) / 8;
    for (int sub = 0; sub < nsub; ++sub) {
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();
      const int row = meta[4 * warp], slot = meta[4 * warp + 1], limit = meta[4 * warp + 2];
      const int64_t hrow = int64_t(max(row, 0)) * a.Hq + 16 * g + r0;
      const float lse_a = row >= 0 ? a.lse[hrow] : 0.f, lse_b = row >= 0 ? a.lse[hrow + 8] : 0.f;
      const float del_a = row >= 0 ? a.delta[hrow] : 0.f, del_b = row >= 0 ? a.delta[hrow + 8] : 0.f;
      // S and P for the warp's 16 rows, in two halves of 64 keys; P (bf16) goes to shared
      // memory, where dS (and dV on the wgmma path) reads it back. An empty slot (row < 0),
      // keys past the causal limit and rows whose LSE is -inf get P = 0.
      {
        const float la = lse_a == -INFINITY ? INFINITY : lse_a * kLog2e;
        const float lb = lse_b == -INFINITY ? INFINITY : lse_b * kLog2e;
        const int lim = row < 0 ? -1 : limit;
        auto write_p = [&](const float(&sh)[8][4], int hh) {
          uint32_t pk[8][2];  // bf16 pairs of rows r0 and r0 + 8
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int col = (8 * hh + i) * 8 + 2 * t;
            float p0 = fast_exp2(sh[i][0] * a.scale_log2 - la), p1 = fast_exp2(sh[i][1] * a.scale_log2 - la);
            float p2 = fast_exp2(sh[i][2] * a.scale_log2 - lb), p3 = fast_exp2(sh[i][3] * a.scale_log2 - lb);
            if (lim < 127) {
              if (col > lim) p0 = p2 = 0.f;
              if (col + 1 > lim) p1 = p3 = 0.f;
            }
            pk[i][0] = pack_bf16(p0, p1);
            pk[i][1] = pack_bf16(p2, p3);
          }
#pragma unroll
          for (int k = 0; k < 4; ++k)
            store_rows_x16(ps, 128, r16, 4 * hh + k, lane, pk[2 * k][0], pk[2 * k][1], pk[2 * k + 1][0], pk[2 * k + 1][1]);
        };
        if constexpr (kWgmma) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            float sh[8][4];
            wgmma_rows_x64(sh, qs, 128, wg_row, ks, 128, 64 * hh);
            write_p(sh, hh);
          }
        } else {
          float sf[16][4];
          product_rows_x128(sf, qs, ks, wg_row, r16, lane, false, row >= 0);
          write_p(*reinterpret_cast<const float(*)[8][4]>(&sf[0]), 0);
          write_p(*reinterpret_cast<const float(*)[8][4]>(&sf[8]), 1);
        }
      }
      // dP = dO V^T in two halves of 64 keys; dS = P (dP - D) to shared memory.
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float dp[8][4];
        if (kWgmma) {
          wgmma_rows_x64(dp, dos, 128, wg_row, vs, 128, 64 * hh);
        } else {
          mma_sync_rows_x16<64, true>(dp, dos, vs, r16, 64 * hh, lane);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          // The warp reads back its own rows of P (0 for an empty slot) in the accumulator
          // layout: pr = (row r0, tile 2k), (row r0 + 8, tile 2k), then tile 2k + 1.
          uint32_t pr[4], dsr[4];
          load_a(pr, ps, 128, r16, (8 * hh + 2 * k) * 8, lane);
#pragma unroll
          for (int h = 0; h < 4; ++h) {
            const float(&dph)[4] = dp[2 * k + (h >> 1)];
            const float del = (h & 1) ? del_b : del_a;
            const __nv_bfloat162 pv = *reinterpret_cast<const __nv_bfloat162*>(&pr[h]);
            const int e = (h & 1) * 2;
            dsr[h] = pack_bf16(__low2float(pv) * (dph[e] - del), __high2float(pv) * (dph[e + 1] - del));
          }
          store_rows_x16(dss, 128, r16, 4 * hh + k, lane, dsr[0], dsr[1], dsr[2], dsr[3]);
        }
      }
      fence_proxy_async();  // P and dS are read by wgmma next
      __syncthreads();
      // dV += P^T dO and dK += dS^T Q over the 128 rows (warp w: keys 16w..16w+15).
      if (kWgmma) accumulate_dv_dk_wgmma(dv, dk, ps, dss, dos, qs, warp >> 2);
      else accumulate_dv_dk_sync(dv, dk, ps, dss, dos, qs, warp, lane);
      __syncthreads();
      if (sub + 1 < nsub) load_sub(sub + 1);  // Q and dO tiles are free now
      cp_async_commit();
      // dQ of this warp's edge = scale dS K, in two halves of 64 dims.
      if (kWgmma || row >= 0) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float dq[8][4];
          if (kWgmma) dq_half_wgmma(dq, dss, ks, wg_row, hh);
          else mma_sync_rows_x16<64, false>(dq, dss, ks, r16, 64 * hh, lane);
          if (row < 0) continue;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int dim = hh * 64 + i * 8 + 2 * t;
            if (a.deterministic) {
              __nv_bfloat16* dst = a.dq_part + (int64_t(slot) * a.total_q * a.Hq + hrow) * 128 + dim;
              *reinterpret_cast<uint32_t*>(dst) = pack_bf16(dq[i][0] * a.scale, dq[i][1] * a.scale);
              *reinterpret_cast<uint32_t*>(dst + 8 * 128) = pack_bf16(dq[i][2] * a.scale, dq[i][3] * a.scale);
            } else {
              atomicAdd(reinterpret_cast<float2*>(a.dq_acc + hrow * 128 + dim),
                        make_float2(dq[i][0] * a.scale, dq[i][1] * a.scale));
              atomicAdd(reinterpret_cast<float2*>(a.dq_acc + (hrow + 8) * 128 + dim),
                        make_float2(dq[i][2] * a.scale, dq[i][3] * a.scale));
            }
          }
        }
      }
    }
    // Flush this chunk's dK, dV.
    const int key_a = warp * 16 + r0, key_b = key_a + 8;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int dim = nt * 8 + 2 * t;
      if (a.deterministic) {
        float* base = a.kv_chunks + int64_t(c) * 2 * 128 * 128;
        *reinterpret_cast<float2*>(base + key_a * 128 + dim) = make_float2(dk[nt][0] * a.scale, dk[nt][1] * a.scale);
        *reinterpret_cast<float2*>(base + key_b * 128 + dim) = make_float2(dk[nt][2] * a.scale, dk[nt][3] * a.scale);
        *reinterpret_cast<float2*>(base + 128 * 128 + key_a * 128 + dim) = make_float2(dv[nt][0], dv[nt][1]);
        *reinterpret_cast<float2*>(base + 128 * 128 + key_b * 128 + dim) = make_float2(dv[nt][2], dv[nt][3]);
      } else {
        if (key_a < nkeys) {
          const int64_t o = (int64_t(d.k_start + key0 + key_a) * a.Hkv + g) * 128 + dim;
          atomicAdd(reinterpret_cast<float2*>(a.dk_acc + o), make_float2(dk[nt][0] * a.scale, dk[nt][1] * a.scale));
          atomicAdd(reinterpret_cast<float2*>(a.dv_acc + o), make_float2(dv[nt][0], dv[nt][1]));
        }
        if (key_b < nkeys) {
          const int64_t o = (int64_t(d.k_start + key0 + key_b) * a.Hkv + g) * 128 + dim;
          atomicAdd(reinterpret_cast<float2*>(a.dk_acc + o), make_float2(dk[nt][2] * a.scale, dk[nt][3] * a.scale));
          atomicAdd(reinterpret_cast<float2*>(a.dv_acc + o), make_float2(dv[nt][2], dv[nt][3]));
        }
      }
    }
    __syncthreads();
  }
}

// D = rowsum(dO * O) per (query, head), and dO as bf16 when it comes as f32. One warp per row.
template <typename O, typename DO>
__global__ void backward_prepare_kernel(const O* __restrict__ out, const DO* __restrict__ dout, int64_t rows,
                                        float* __restrict__ delta, __nv_bfloat16* __restrict__ dout16) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= rows) return;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t e = w * 128 + lane * 4 + i;
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
  DeviceGuard guard(p.q.device.index);
  const PlanState& st = plan_state(plan);
  const cudaStream_t s = as_stream(opt);
  const int64_t Tq = L.total_q(), Tk = L.total_k();
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads;
  const WorkspaceLayout w = workspace_layout(topo, L);
  const int32_t* status = i32(plan.status);

  BackwardArgs a{};
  a.q = p.q.as<const __nv_bfloat16>();
  a.k = p.k.as<const __nv_bfloat16>();
  a.v = p.v.as<const __nv_bfloat16>();
  a.lse = p.lse.as<const float>();
  a.delta = ws<float>(st, w.delta);
  a.chunks = i32(st.chunks);
  a.chunk_count = i32(st.chunk_count);
  a.q_indices = i32(plan.q_indices);
  a.split_slot = i32(plan.split_slot);
  a.docs = doc_ptr(st);
  a.status = status;
  a.dq_acc = ws<float>(st, w.dq_acc);
  a.dk_acc = ws<float>(st, w.dk_acc);
  a.dv_acc = ws<float>(st, w.dv_acc);
  a.dq_part = ws<__nv_bfloat16>(st, w.dq_part);
  a.kv_chunks = ws<float>(st, w.kv_chunks);
  a.total_q = Tq;
  a.Hq = Hq;
  a.Hkv = Hkv;
  a.scale = topo.attention_scale();
  a.scale_log2 = a.scale * kLog2e;
  a.deterministic = opt.deterministic;

  // D and a bf16 dO.
  __nv_bfloat16* dout16 = p.dout.dtype == DType::f32 ? ws<__nv_bfloat16>(st, w.dout16) : nullptr;
  a.dout = dout16 ? dout16 : p.dout.as<const __nv_bfloat16>();
  const int64_t rows = Tq * Hq;
  float* delta = ws<float>(st, w.delta);
  if (rows > 0) {
    const bool of = p.out.dtype == DType::f32, df = p.dout.dtype == DType::f32;
    if (of && df) launch_prepare<float, float>(p, rows, delta, dout16, s);
    else if (of) launch_prepare<float, __nv_bfloat16>(p, rows, delta, dout16, s);
    else if (df) launch_prepare<__nv_bfloat16, float>(p, rows, delta, dout16, s);
    else launch_prepare<__nv_bfloat16, __nv_bfloat16>(p, rows, delta, dout16, s);
  }
  if (!opt.deterministic) {
    MSA_CUDA_CHECK(cudaMemsetAsync(a.dq_acc, 0, size_t(Tq * Hq * 128 * 4), s));
    MSA_CUDA_CHECK(cudaMemsetAsync(a.dk_acc, 0, size_t(Tk * Hkv * 128 * 4), s));
    MSA_CUDA_CHECK(cudaMemsetAsync(a.dv_acc, 0, size_t(Tk * Hkv * 128 * 4), s));
  }
  if (st.chunk_capacity > 0) {
    const auto kernel = use_wgmma() ? backward_chunks_kernel<true> : backward_chunks_kernel<false>;
    MSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    const int grid = int(std::min<int64_t>(st.chunk_capacity, sm_count()));
    kernel<<<grid, kThreads, kSmemBytes, s>>>(a);
    MSA_CUDA_CHECK_LAUNCH("backward_chunks_kernel");
  }
  if (!opt.deterministic) {
    convert_out(a.dq_acc, p.dq, status, s);
    convert_out(a.dk_acc, p.dk, status, s);
    convert_out(a.dv_acc, p.dv, status, s);
    return;
  }
  // Deterministic: dQ slots in slot order; dK, dV chunks in chunk order, then documents in order.
  const int64_t n = Tq * Hq * 128;
  if (n > 0) {
    if (p.dq.dtype == DType::f32)
      sum_slots_kernel<__nv_bfloat16, float><<<grid_for(n, 256), 256, 0, s>>>(a.dq_part, i32(plan.split_counts), status,
                                                                             Tq, Hq, Hkv, 16, 1.f, p.dq.as<float>());
    else
      sum_slots_kernel<__nv_bfloat16, __nv_bfloat16><<<grid_for(n, 256), 256, 0, s>>>(
          a.dq_part, i32(plan.split_counts), status, Tq, Hq, Hkv, 16, 1.f, p.dq.as<__nv_bfloat16>());
    MSA_CUDA_CHECK_LAUNCH("sum_slots_kernel");
  }
  float* kv_rows = ws<float>(st, w.kv_rows);
  if (plan.total_rows > 0) {
    sum_chunks_kernel<<<int(Hkv * plan.total_rows), 256, 0, s>>>(a.kv_chunks, i32(st.chunk_first), i32(st.chunk_nfull),
                                                                 i32(st.chunk_tail), 2, kv_rows);
    MSA_CUDA_CHECK_LAUNCH("sum_chunks_kernel");
  }
  if (Tk > 0) {
    if (p.dk.dtype == DType::f32)
      gather_keys_kernel<float><<<int(Tk), 128, 0, s>>>(kv_rows, doc_ptr(st), st.num_documents, i32(st.doc_row_base),
                                                        i32(st.row_of), plan.total_rows, Hkv, 2, false, status,
                                                        p.dk.as<float>(), p.dv.as<float>());
    else
      gather_keys_kernel<__nv_bfloat16><<<int(Tk), 128, 0, s>>>(
          kv_rows, doc_ptr(st), st.num_documents, i32(st.doc_row_base), i32(st.row_of), plan.total_rows, Hkv, 2, false,
          status, p.dk.as<__nv_bfloat16>(), p.dv.as<__nv_bfloat16>());
    MSA_CUDA_CHECK_LAUNCH("gather_keys_kernel");
  }
}

}  // namespace msa::cuda
