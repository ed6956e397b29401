// Sparse attention forward, KV-outer: one task = (schedule item, up to 8 of its queries).
// The CTA loads the item's key block (K, V: 128 keys x 128) once; warp w takes query w of
// the task, whose 16 heads are the 16 rows of one m16 MMA tile, so each warp applies its own
// causal limit. Each (query, block) edge writes a normalised bf16 partial output and its
// LSE into slot split_slot; a second kernel merges the slots of every (query, head) by LSE.
//
// The CTA is persistent (one per SM) and prefetches the next task's K, V and Q with
// cp.async while computing the current one (two shared-memory stages of 96 KB).
#include "backend.h"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/wgmma.cuh"
#include "cuda/workspace.h"

namespace msa::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTileBytes = 128 * 256;                       // 128 rows of 128 bf16
constexpr int kStageBytes = 3 * kTileBytes;                 // K, V, Q (warp w: rows 16w..16w+15)
constexpr int kMetaBytes = 2 * kWarps * 4 * 4;
constexpr int kSmemBytes = 2 * kStageBytes + kMetaBytes + 1024;  // + alignment slack

struct ForwardArgs {
  const __nv_bfloat16* q;  // [Tq, Hq, 128]
  const __nv_bfloat16* k;  // [Tk, Hkv, 128]
  const __nv_bfloat16* v;  // [Tk, Hkv, 128]
  const int32_t* schedule;    // [capacity, 6]
  const int32_t* work_count;  // [1]
  const int32_t* q_indices;   // [Hkv, Tq * 16]
  const int32_t* split_slot;  // [Hkv, Tq * 16]
  const DocInfo* docs;        // [B]
  const int32_t* status;      // [4]
  __nv_bfloat16* part_o;      // [16, Tq, Hq, 128]
  float* part_lse;            // [16, Tq, Hq]
  int64_t total_q;
  int Hq, Hkv;
  int nsub;                   // tasks per schedule item: ceil(q_per_cta / 8)
  float scale_log2;           // softmax scale * log2(e)
  int use_wgmma;              // S = Q K^T on wgmma (else mma.sync)
};

// Issues the cp.async loads of one task into a stage and records per-warp metadata:
// meta[w] = (packed query row or -1, partial slot, last visible key index in the block).
__device__ void load_task(const ForwardArgs& a, int64_t task, uint32_t stage, int* meta, int tid) {
  const int64_t item = task / a.nsub;
  const int sub = int(task % a.nsub);
  const int32_t* it = a.schedule + item * 6;
  const int g = it[0], q_begin = it[2], q_count = it[3], b = it[4], j = it[5];
  const DocInfo d = a.docs[b];
  const int key0 = j * 128;
  const int nkeys = min(128, d.k_len - key0);
  const int64_t kv_off = (int64_t(d.k_start + key0) * a.Hkv + g) * 128;
  load_tile_async(stage, 128, 0, a.k + kv_off, int64_t(a.Hkv) * 128, 128, nkeys, tid, kThreads);
  load_tile_async(stage + kTileBytes, 128, 0, a.v + kv_off, int64_t(a.Hkv) * 128, 128, nkeys, tid, kThreads);
  const int w = tid >> 5, lane = tid & 31;
  const int qi = sub * 8 + w;
  if (qi < q_count) {
    const int64_t e = int64_t(g) * a.total_q * 16 + q_begin + qi;
    const int ql = a.q_indices[e];
    const int row = d.q_start + ql;
    load_tile_async(stage + 2 * kTileBytes, 128, 16 * w, a.q + (int64_t(row) * a.Hq + 16 * g) * 128, 128, 16, 16, lane,
                    32);
    if (lane == 0) {
      meta[4 * w] = row;
      meta[4 * w + 1] = a.split_slot[e];
      meta[4 * w + 2] = d.k_len - d.q_len + ql - key0;
      meta[4 * w + 3] = g;
    }
  } else {
    // Zero rows keep the warpgroup's S product finite; the warp's results are not used.
    load_tile_async(stage + 2 * kTileBytes, 128, 16 * w, a.q, 128, 16, 0, lane, 32);
    if (lane == 0) meta[4 * w] = -1;
  }
}

__device__ void compute_task(const ForwardArgs& a, uint32_t stage, const int* meta, int warp, int lane) {
  const int row = meta[4 * warp];
  const int slot = meta[4 * warp + 1], limit = meta[4 * warp + 2], g = meta[4 * warp + 3];
  const uint32_t ks = stage, vs = stage + kTileBytes, qs = stage + 2 * kTileBytes;
  const int r16 = 16 * warp;

  float s[16][4];
  if (a.use_wgmma) {
    // The warpgroup's 4 queries (64 rows) against the 128 keys, all warps take part.
    wgmma_rows_x128(s, qs, 128, 64 * (warp >> 2), ks, 128, 0);
    warpgroup_barrier(warp >> 2);  // every warp's Q rows are read before any warp reuses them
    if (row < 0) return;
  } else {
    if (row < 0) return;
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      uint32_t af[4];
      load_a(af, qs, 128, r16, kt * 16, lane);
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t bf[4];
        load_b_nk(bf, ks, 128, np * 16, kt * 16, lane);
        mma_bf16(s[2 * np], af, bf[0], bf[1]);
        mma_bf16(s[2 * np + 1], af, bf[2], bf[3]);
      }
    }
  }
  const int t = lane & 3;
  if (limit < 127) {
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (nt * 8 + 2 * t + (e & 1) > limit) s[nt][e] = -INFINITY;
  }
  float m0 = -INFINITY, m1 = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    m0 = fmaxf(m0, fmaxf(s[nt][0], s[nt][1]));
    m1 = fmaxf(m1, fmaxf(s[nt][2], s[nt][3]));
  }
  m0 = warp_max4(m0);
  m1 = warp_max4(m1);
  const float ms0 = m0 * a.scale_log2, ms1 = m1 * a.scale_log2;
  float l0 = 0.f, l1 = 0.f;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    s[nt][0] = exp2f(s[nt][0] * a.scale_log2 - ms0);
    s[nt][1] = exp2f(s[nt][1] * a.scale_log2 - ms0);
    s[nt][2] = exp2f(s[nt][2] * a.scale_log2 - ms1);
    s[nt][3] = exp2f(s[nt][3] * a.scale_log2 - ms1);
    l0 += s[nt][0] + s[nt][1];
    l1 += s[nt][2] + s[nt][3];
  }
  l0 = warp_sum4(l0);
  l1 = warp_sum4(l1);

  float o[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    uint32_t af[4];
    af[0] = pack_bf16(s[2 * kt][0], s[2 * kt][1]);
    af[1] = pack_bf16(s[2 * kt][2], s[2 * kt][3]);
    af[2] = pack_bf16(s[2 * kt + 1][0], s[2 * kt + 1][1]);
    af[3] = pack_bf16(s[2 * kt + 1][2], s[2 * kt + 1][3]);
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      uint32_t bf[4];
      load_b_kn(bf, vs, 128, kt * 16, np * 16, lane);
      mma_bf16(o[2 * np], af, bf[0], bf[1]);
      mma_bf16(o[2 * np + 1], af, bf[2], bf[3]);
    }
  }
  // Normalise, stage through this warp's Q tile (no longer needed) and write 16-byte rows.
  const float inv0 = 1.f / l0, inv1 = 1.f / l1;
  const int r0 = lane >> 2;
  __syncwarp();
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    st_shared_u32(qs + tile_offset(128, r16 + r0, nt) + 4 * t, pack_bf16(o[nt][0] * inv0, o[nt][1] * inv0));
    st_shared_u32(qs + tile_offset(128, r16 + r0 + 8, nt) + 4 * t, pack_bf16(o[nt][2] * inv1, o[nt][3] * inv1));
  }
  __syncwarp();
  const int64_t out_row = (int64_t(slot) * a.total_q + row) * a.Hq + 16 * g;
  __nv_bfloat16* dst = a.part_o + out_row * 128;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int c = i * 32 + lane, r = c >> 4, ch = c & 15;
    *reinterpret_cast<uint4*>(dst + r * 128 + ch * 8) = ld_shared_v4(qs + tile_offset(128, r16 + r, ch));
  }
  if (t == 0) {
    constexpr float kLn2 = 0.6931471805599453f;
    a.part_lse[out_row + r0] = (ms0 + __log2f(l0)) * kLn2;
    a.part_lse[out_row + r0 + 8] = (ms1 + __log2f(l1)) * kLn2;
  }
}

__global__ void __launch_bounds__(kThreads, 1) forward_tasks_kernel(const ForwardArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (a.status[0] != 0) return;
  const int64_t tasks = int64_t(*a.work_count) * a.nsub;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const uint32_t base = align1024(smem_addr(smem));
  int* meta = reinterpret_cast<int*>(smem + (base - smem_addr(smem)) + 2 * kStageBytes);
  int64_t task = blockIdx.x;
  if (task >= tasks) return;
  load_task(a, task, base, meta, tid);
  cp_async_commit();
  int stage = 0;
  for (; task < tasks; task += gridDim.x) {
    const int64_t next = task + gridDim.x;
    if (next < tasks) load_task(a, next, base + (stage ^ 1) * kStageBytes, meta + (stage ^ 1) * 4 * kWarps, tid);
    cp_async_commit();
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    compute_task(a, base + stage * kStageBytes, meta + stage * 4 * kWarps, warp, lane);
    __syncthreads();
    stage ^= 1;
  }
}

// One warp per (query, head): merges the query's partial states for that head.
template <typename Out>
__global__ void forward_merge_kernel(const __nv_bfloat16* __restrict__ part_o, const float* __restrict__ part_lse,
                                     const int32_t* __restrict__ split_counts, const int32_t* __restrict__ status,
                                     int64_t total_q, int Hq, int Hkv, Out* __restrict__ out, float* __restrict__ lse) {
  const int64_t wid = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (wid >= total_q * Hq) return;
  const int64_t q = wid / Hq;
  const int h = int(wid % Hq);
  const int C = split_counts[q * Hkv + h / 16];
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float m = -INFINITY, z = 0.f;
  if (status[0] != 0) {
    m = NAN;
    acc[0] = acc[1] = acc[2] = acc[3] = NAN;
  } else if (C > 0) {
    const float mine = lane < C ? part_lse[(int64_t(lane) * total_q + q) * Hq + h] : -INFINITY;
    m = mine;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    const float wmine = (lane < C && m > -INFINITY) ? __expf(mine - m) : 0.f;
    z = wmine;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) z += __shfl_xor_sync(0xffffffffu, z, off);
    for (int s = 0; s < C; ++s) {
      const float ws = __shfl_sync(0xffffffffu, wmine, s);
      const uint2 raw = *reinterpret_cast<const uint2*>(part_o + ((int64_t(s) * total_q + q) * Hq + h) * 128 + lane * 4);
      acc[0] += ws * bf16_bits_to_float(uint16_t(raw.x & 0xffff));
      acc[1] += ws * bf16_bits_to_float(uint16_t(raw.x >> 16));
      acc[2] += ws * bf16_bits_to_float(uint16_t(raw.y & 0xffff));
      acc[3] += ws * bf16_bits_to_float(uint16_t(raw.y >> 16));
    }
    if (m > -INFINITY && z > 0.f && isfinite(z)) {
      const float inv = 1.f / z;
      for (float& x : acc) x *= inv;
      m = m + logf(z);
    } else {
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
      m = -INFINITY;
    }
  }
  Out* dst = out + wid * 128 + lane * 4;
  if constexpr (sizeof(Out) == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  } else {
    uint2 packed;
    packed.x = pack_bf16(acc[0], acc[1]);
    packed.y = pack_bf16(acc[2], acc[3]);
    *reinterpret_cast<uint2*>(dst) = packed;
  }
  if (lane == 0) lse[wid] = m;
}

}  // namespace

void sparse_attention_forward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan,
                              const AttentionForwardParams& p, const RunOptions& opt) {
  DeviceGuard guard(p.q.device.index);
  const PlanState& st = plan_state(plan);
  const cudaStream_t s = as_stream(opt);
  const WorkspaceLayout w = workspace_layout(L.total_q(), L.total_k(), topo.num_kv_heads, plan.total_rows, st.chunk_capacity);
  const int64_t Tq = L.total_q();
  if (Tq == 0) return;
  ForwardArgs a{};
  a.q = p.q.as<const __nv_bfloat16>();
  a.k = p.k.as<const __nv_bfloat16>();
  a.v = p.v.as<const __nv_bfloat16>();
  a.schedule = i32(plan.schedule);
  a.work_count = i32(plan.work_count_dev);
  a.q_indices = i32(plan.q_indices);
  a.split_slot = i32(plan.split_slot);
  a.docs = doc_ptr(st);
  a.status = i32(plan.status);
  a.part_o = ws<__nv_bfloat16>(st, w.part_o);
  a.part_lse = ws<float>(st, w.part_lse);
  a.total_q = Tq;
  a.Hq = topo.num_q_heads;
  a.Hkv = topo.num_kv_heads;
  a.nsub = int(ceil_div(plan.q_per_cta, 8));
  a.scale_log2 = topo.attention_scale() * 1.4426950408889634f;
  a.use_wgmma = use_wgmma() ? 1 : 0;
  const int64_t max_tasks = st.schedule_capacity * a.nsub;
  if (max_tasks > 0) {
    MSA_CUDA_CHECK(cudaFuncSetAttribute(forward_tasks_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    const int grid = int(std::min<int64_t>(max_tasks, sm_count()));
    forward_tasks_kernel<<<grid, kThreads, kSmemBytes, s>>>(a);
    MSA_CUDA_CHECK_LAUNCH("forward_tasks_kernel");
  }
  const int64_t warps = Tq * topo.num_q_heads;
  const int blocks = int(ceil_div(warps * 32, 256));
  if (p.out.dtype == DType::f32) {
    forward_merge_kernel<float><<<blocks, 256, 0, s>>>(a.part_o, a.part_lse, i32(plan.split_counts), a.status, Tq,
                                                       a.Hq, a.Hkv, p.out.as<float>(), p.lse.as<float>());
  } else {
    forward_merge_kernel<__nv_bfloat16><<<blocks, 256, 0, s>>>(a.part_o, a.part_lse, i32(plan.split_counts), a.status,
                                                               Tq, a.Hq, a.Hkv, p.out.as<__nv_bfloat16>(),
                                                               p.lse.as<float>());
  }
  MSA_CUDA_CHECK_LAUNCH("forward_merge_kernel");
}

}  // namespace msa::cuda
