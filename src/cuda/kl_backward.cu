// KL backward of the indexer, KV-outer over the plan's chunk list like the attention
// backward. Per chunk the CTA holds the block's main keys K (head g) and index keys; per 8
// queries (warp w = query w):
//   teacher[t] = mean over the 16 heads of exp(scale <q_h, k_t> - lse_h)   (S = Q K^T, warp w)
//   student[t] = exp(index_scale <qi, ki_t> - index_lse)                    (8 x 128, all warps)
//   ds = (student - teacher) * grad_scale on visible keys (bf16 for the products)
//   d index_q (per edge) = index_scale ds . ki,   d index_k += index_scale ds^T . qi
// Default mode: fp32 atomics. Deterministic mode: per-edge slots for d index_q and per-chunk
// slots for d index_k, reduced in a fixed order.
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
constexpr int kSmall = 16 * 256;
constexpr int kMetaInts = kWarps * 4;  // per query slot: row, partial slot, key limit
// K, index-K, two Q stages, two index-Q stages, ds, the teacher rows, two metadata stages.
constexpr int kSmemBytes = 4 * kTile + 3 * kSmall + 8 * 128 * 4 + 2 * kMetaInts * 4 + 1024;  // + alignment slack
constexpr float kLog2e = 1.4426950408889634f;

struct KlArgs {
  const __nv_bfloat16* q;    // [Tq, Hq, 128]
  const __nv_bfloat16* k;    // [Tk, Hkv, 128]
  const float* lse;          // [Tq, Hq]
  const __nv_bfloat16* iq;   // [Tq, Hi, 128]
  const __nv_bfloat16* ik;   // [Tk, 1, 128]
  const float* index_lse;    // [Hi, Tq]
  const int32_t* chunks;
  const int32_t* chunk_count;
  const int32_t* q_indices;
  const int32_t* split_slot;
  const DocInfo* docs;
  const int32_t* status;
  float* dqi_acc;   // [Tq, Hi, 128]
  float* dki_acc;   // [Tk, 128]
  float* dqi_part;  // [16, Tq, Hi, 128] (deterministic)
  float* ki_chunks; // [chunks, 2, 128, 128] (deterministic; part 0 used)
  int64_t total_q;
  int Hq, Hkv;
  float scale_log2, index_scale, index_scale_log2, grad_scale;
  bool deterministic;
  int use_wgmma;  // teacher scores S = Q K^T on wgmma
};

__global__ void __launch_bounds__(kThreads, 1) kl_chunks_kernel(const KlArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (a.status[0] != 0) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3, r0 = lane >> 2;
  // The 8 queries of sub-chunk sub + 1 load into stage (sub + 1) & 1 while sub is computed.
  const uint32_t ks = align1024(smem_addr(smem)), iks = ks + kTile, qs0 = ks + 2 * kTile, iqs0 = ks + 4 * kTile,
                 dst = iqs0 + 2 * kSmall;
  unsigned char* tail = smem + (ks - smem_addr(smem)) + 4 * kTile + 3 * kSmall;
  float* teacher = reinterpret_cast<float*>(tail);  // [8][128]
  int* meta0 = reinterpret_cast<int*>(tail + 8 * 128 * 4);
  const int r16 = 16 * warp;
  // Rows 8..15 of the index-query and ds tiles stay zero (m16 tiles with 8 queries).
  for (int i = tid; i < 8 * 16; i += kThreads) {
    const int r = 8 + (i >> 4), c = i & 15;
    st_shared_v4_zero(iqs0 + tile_offset(16, r, c));
    st_shared_v4_zero(iqs0 + kSmall + tile_offset(16, r, c));
    st_shared_v4_zero(dst + tile_offset(16, r, c));
  }
  const int nchunks = *a.chunk_count;
  const int Hi = a.Hkv;

  for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int32_t* it = a.chunks + int64_t(c) * 6;
    const int g = it[0], q_begin = it[2], q_count = it[3], b = it[4], j = it[5];
    const DocInfo d = a.docs[b];
    const int key0 = j * 128;
    const int nkeys = min(128, d.k_len - key0);
    const int64_t edge0 = int64_t(g) * a.total_q * 16 + q_begin;
    load_tile_async(ks, 128, 0, a.k + (int64_t(d.k_start + key0) * a.Hkv + g) * 128, int64_t(a.Hkv) * 128, 128, nkeys,
                    tid, kThreads);
    load_tile_async(iks, 128, 0, a.ik + int64_t(d.k_start + key0) * 128, 128, 128, nkeys, tid, kThreads);
    // Loads the 8 queries of sub-chunk sub into its stage: Q (16 heads) and the index query of
    // warp w's query, and their metadata.
    auto load_sub = [&](int sub) {
      const int st = sub & 1;
      int row;
      const bool valid = chunk_query(a.q_indices, a.split_slot, edge0, sub * 8 + warp, q_count, d, key0,
                                     meta0 + st * kMetaInts, warp, lane, row);
      load_tile_async(qs0 + st * kTile, 128, r16, a.q + (int64_t(row) * a.Hq + 16 * g) * 128, 128, 16, valid ? 16 : 0,
                      lane, 32);
      if (lane < 16) {
        const __nv_bfloat16* src = a.iq + (int64_t(row) * Hi + g) * 128 + lane * 8;
        cp_async16(iqs0 + st * kSmall + tile_offset(16, warp, lane), valid ? src : a.iq, valid ? 16 : 0);
      }
    };
    float dki[16][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) dki[i][0] = dki[i][1] = dki[i][2] = dki[i][3] = 0.f;

    const int nsub = (q_count + 7) / 8;
    load_sub(0);
    cp_async_commit();
    for (int sub = 0; sub < nsub; ++sub) {
      // The other stage was released by the barrier that ended sub - 1.
      if (sub + 1 < nsub) load_sub(sub + 1);
      cp_async_commit();
      cp_async_wait<1>();  // everything but the group just issued: sub's queries (and K)
      fence_proxy_async();
      __syncthreads();
      const uint32_t qs = qs0 + (sub & 1) * kTile, iqs = iqs0 + (sub & 1) * kSmall;
      const int* meta = meta0 + (sub & 1) * kMetaInts;
      // Teacher of warp w's query: column sums of exp(S scale - lse) over its 16 heads.
      {
        const int row = meta[4 * warp], limit = meta[4 * warp + 2];
        float colsum[16][2];
        float s[16][4];
        product_rows_x128(s, qs, ks, 64 * (warp >> 2), r16, lane, a.use_wgmma, row >= 0);
        if (row >= 0) {
          const int64_t hrow = int64_t(row) * a.Hq + 16 * g + r0;
          const float la = a.lse[hrow] * kLog2e, lb = a.lse[hrow + 8] * kLog2e;
#pragma unroll
          for (int nt = 0; nt < 16; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const bool vis = nt * 8 + 2 * t + e <= limit;
              float v = 0.f;
              if (vis && la != -INFINITY) v += fast_exp2(s[nt][e] * a.scale_log2 - la);
              if (vis && lb != -INFINITY) v += fast_exp2(s[nt][2 + e] * a.scale_log2 - lb);
              colsum[nt][e] = v;
            }
        } else {
#pragma unroll
          for (int nt = 0; nt < 16; ++nt) colsum[nt][0] = colsum[nt][1] = 0.f;
        }
#pragma unroll
        for (int nt = 0; nt < 16; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = colsum[nt][e];
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 16);
            if (r0 == 0) teacher[warp * 128 + nt * 8 + 2 * t + e] = v * (1.f / 16.f);
          }
      }
      __syncthreads();
      // Student and ds for all 8 queries on keys 16w..16w+15 (row r0 = query r0).
      {
        float si[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int kt = 0; kt < 8; ++kt) {
          uint32_t af[4], bf[4];
          load_a(af, iqs, 16, 0, kt * 16, lane);
          load_b_nk(bf, iks, 128, warp * 16, kt * 16, lane);
          mma_bf16(si[0], af, bf[0], bf[1]);
          mma_bf16(si[1], af, bf[2], bf[3]);
        }
        const int row = meta[4 * r0], limit = meta[4 * r0 + 2];
        const float il = row >= 0 ? a.index_lse[int64_t(g) * a.total_q + row] * kLog2e : -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          float ds[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = warp * 16 + nt * 8 + 2 * t + e;
            float v = 0.f;
            if (row >= 0 && col <= limit) {
              const float student = il == -INFINITY ? 0.f : fast_exp2(si[nt][e] * a.index_scale_log2 - il);
              v = (student - teacher[r0 * 128 + col]) * a.grad_scale;
            }
            ds[e] = v;
          }
          st_shared_u32(dst + tile_offset(16, r0, warp * 2 + nt) + 4 * t, pack_bf16(ds[0], ds[1]));
        }
      }
      __syncthreads();
      // d index_q of the 8 edges: dims 16w..16w+15.
      {
        float dq[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int kt = 0; kt < 8; ++kt) {
          uint32_t af[4], bf[4];
          load_a(af, dst, 16, 0, kt * 16, lane);
          load_b_kn(bf, iks, 128, kt * 16, warp * 16, lane);
          mma_bf16(dq[0], af, bf[0], bf[1]);
          mma_bf16(dq[1], af, bf[2], bf[3]);
        }
        const int row = meta[4 * r0], slot = meta[4 * r0 + 1];
        if (row >= 0) {
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const int dim = warp * 16 + nt * 8 + 2 * t;
            const float2 v = make_float2(dq[nt][0] * a.index_scale, dq[nt][1] * a.index_scale);
            if (a.deterministic)
              *reinterpret_cast<float2*>(a.dqi_part + ((int64_t(slot) * a.total_q + row) * Hi + g) * 128 + dim) = v;
            else
              atomicAdd(reinterpret_cast<float2*>(a.dqi_acc + (int64_t(row) * Hi + g) * 128 + dim), v);
          }
        }
      }
      // d index_k += ds^T qi (warp w: keys 16w..16w+15; k = the 16 query rows).
      {
        uint32_t af[4];
        load_a_trans(af, dst, 16, warp * 16, 0, lane);
#pragma unroll
        for (int np = 0; np < 8; ++np) {
          uint32_t bf[4];
          load_b_kn(bf, iqs, 16, 0, np * 16, lane);
          mma_bf16(dki[2 * np], af, bf[0], bf[1]);
          mma_bf16(dki[2 * np + 1], af, bf[2], bf[3]);
        }
      }
      __syncthreads();
    }
    const int key_a = warp * 16 + r0, key_b = key_a + 8;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int dim = nt * 8 + 2 * t;
      const float2 va = make_float2(dki[nt][0] * a.index_scale, dki[nt][1] * a.index_scale);
      const float2 vb = make_float2(dki[nt][2] * a.index_scale, dki[nt][3] * a.index_scale);
      if (a.deterministic) {
        float* base = a.ki_chunks + int64_t(c) * 128 * 128;
        *reinterpret_cast<float2*>(base + key_a * 128 + dim) = va;
        *reinterpret_cast<float2*>(base + key_b * 128 + dim) = vb;
      } else {
        if (key_a < nkeys) atomicAdd(reinterpret_cast<float2*>(a.dki_acc + int64_t(d.k_start + key0 + key_a) * 128 + dim), va);
        if (key_b < nkeys) atomicAdd(reinterpret_cast<float2*>(a.dki_acc + int64_t(d.k_start + key0 + key_b) * 128 + dim), vb);
      }
    }
  }
}

}  // namespace

void kl_backward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan, const KlBackwardParams& p,
                 const RunOptions& opt) {
  DeviceGuard guard(p.q.device.index);
  const PlanState& st = plan_state(plan);
  const cudaStream_t s = as_stream(opt);
  const int64_t Tq = L.total_q(), Tk = L.total_k();
  const int Hkv = topo.num_kv_heads, Hi = topo.num_index_heads;
  const WorkspaceLayout w = workspace_layout(topo, L);
  const int32_t* status = i32(plan.status);
  KlArgs a{};
  a.q = p.q.as<const __nv_bfloat16>();
  a.k = p.k.as<const __nv_bfloat16>();
  a.lse = p.lse.as<const float>();
  a.iq = p.index_q.as<const __nv_bfloat16>();
  a.ik = p.index_k.as<const __nv_bfloat16>();
  a.index_lse = p.index_lse.as<const float>();
  a.chunks = i32(st.chunks);
  a.chunk_count = i32(st.chunk_count);
  a.q_indices = i32(plan.q_indices);
  a.split_slot = i32(plan.split_slot);
  a.docs = doc_ptr(st);
  a.status = status;
  a.dqi_acc = ws<float>(st, w.dqi_acc);
  a.dki_acc = ws<float>(st, w.dki_acc);
  a.dqi_part = ws<float>(st, w.dqi_part);
  a.ki_chunks = ws<float>(st, w.kv_chunks);
  a.total_q = Tq;
  a.Hq = topo.num_q_heads;
  a.Hkv = Hkv;
  a.scale_log2 = topo.attention_scale() * kLog2e;
  a.index_scale = topo.indexer_scale();
  a.index_scale_log2 = a.index_scale * kLog2e;
  a.grad_scale = p.grad_scale > 0 ? p.grad_scale : (Tq > 0 ? 1.0f / float(int64_t(Hi) * Tq) : 0.f);
  a.deterministic = opt.deterministic;
  a.use_wgmma = use_wgmma() ? 1 : 0;
  if (!opt.deterministic) {
    MSA_CUDA_CHECK(cudaMemsetAsync(a.dqi_acc, 0, size_t(Tq * Hi * 128 * 4), s));
    MSA_CUDA_CHECK(cudaMemsetAsync(a.dki_acc, 0, size_t(Tk * 128 * 4), s));
  }
  if (st.chunk_capacity > 0) {
    MSA_CUDA_CHECK(cudaFuncSetAttribute(kl_chunks_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    const int grid = int(std::min<int64_t>(st.chunk_capacity, sm_count()));
    kl_chunks_kernel<<<grid, kThreads, kSmemBytes, s>>>(a);
    MSA_CUDA_CHECK_LAUNCH("kl_chunks_kernel");
  }
  const bool f32q = p.dindex_q.dtype == DType::f32, f32k = p.dindex_k.dtype == DType::f32;
  if (!opt.deterministic) {
    convert_out(a.dqi_acc, p.dindex_q, status, s);
    convert_out(a.dki_acc, p.dindex_k, status, s);
    return;
  }
  const int64_t n = Tq * Hi * 128;
  if (n > 0) {
    if (f32q)
      sum_slots_kernel<float, float><<<grid_for(n, 256), 256, 0, s>>>(a.dqi_part, i32(plan.split_counts), status, Tq, Hi,
                                                                      Hkv, 1, 1.f, p.dindex_q.as<float>());
    else
      sum_slots_kernel<float, __nv_bfloat16><<<grid_for(n, 256), 256, 0, s>>>(
          a.dqi_part, i32(plan.split_counts), status, Tq, Hi, Hkv, 1, 1.f, p.dindex_q.as<__nv_bfloat16>());
    MSA_CUDA_CHECK_LAUNCH("sum_slots_kernel");
  }
  float* rows = ws<float>(st, w.kv_rows);
  if (plan.total_rows > 0) {
    sum_chunks_kernel<<<int(Hkv * plan.total_rows), 256, 0, s>>>(a.ki_chunks, i32(st.chunk_first), i32(st.chunk_nfull),
                                                                 i32(st.chunk_tail), 1, rows);
    MSA_CUDA_CHECK_LAUNCH("sum_chunks_kernel");
  }
  if (Tk > 0) {
    if (f32k)
      gather_keys_kernel<float><<<int(Tk), 128, 0, s>>>(rows, doc_ptr(st), st.num_documents, i32(st.doc_row_base),
                                                        i32(st.row_of), plan.total_rows, Hkv, 1, true, status,
                                                        p.dindex_k.as<float>(), p.dindex_k.as<float>());
    else
      gather_keys_kernel<__nv_bfloat16><<<int(Tk), 128, 0, s>>>(
          rows, doc_ptr(st), st.num_documents, i32(st.doc_row_base), i32(st.row_of), plan.total_rows, Hkv, 1, true,
          status, p.dindex_k.as<__nv_bfloat16>(), p.dindex_k.as<__nv_bfloat16>());
    MSA_CUDA_CHECK_LAUNCH("gather_keys_kernel");
  }
}

}  // namespace msa::cuda
