// Sparse attention forward, KV-outer: one task = (schedule item, up to 8 of its queries).
// Warpgroup wg of the CTA computes queries 4wg..4wg+3 of the task; warp w owns one query, whose
// 16 heads are its 16 rows of the warpgroup's m64 tiles, so each warp applies its own causal
// limit. S = Q K^T and O = P V both run on wgmma (P straight from registers). Each
// (query, block) edge writes its unnormalised bf16 partial output (TMA store) with the row's
// max and sum of exponentials into slot split_slot; a second kernel merges the slots of every
// (query, head), dividing once.
//
// The CTA is persistent (one per SM) and walks a contiguous share of the full items' tasks, so
// consecutive tasks almost always read the same key block (the schedule lists the full items
// of a (head, block) row one after another): K and V^T stay in shared memory until the block
// changes. The partial items that follow are dealt out round robin (CtaTasks). A producer warpgroup reads the schedule and streams each task's Q rows through four
// shared-memory stages with TMA (mbarrier hand-off), so the two computing warpgroups
// never wait on metadata loads; it gives most of its registers to them (setmaxnreg), which
// lets each computing warpgroup issue S of the next task before the current task's epilogue.
#include "backend.h"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/tensor_map.h"
#include "cuda/wgmma.cuh"
#include "cuda/workspace.h"

namespace msa::cuda {
namespace {

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kProducerWarps = 4;         // one warpgroup: 12 warps cost no registers over 9
constexpr int kQueriesPerProducer = kConsumerWarps / kProducerWarps;
constexpr int kThreads = kConsumers + 32 * kProducerWarps;
constexpr int kTileBytes = 128 * 256;      // 128 rows of 128 bf16
constexpr int kQStages = 4;                // Q tiles in flight (query w: rows 16w..16w+15)
constexpr int kMetaInts = 4 * kConsumerWarps + 4;  // per query: row, slot, key limit, head; task: head, doc, block
constexpr int kSmemBytes = (2 + kQStages) * kTileBytes + kQStages * kMetaInts * 4 + 2 * kQStages * 8 + 1024;
constexpr int kKvBarrier = 3;
// Register budgets per thread after the split (65536 per SM): the producers need few, the
// consumers hold S of the next task, O and P of the current one at once.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 32 * kProducerWarps + kConsumerRegs * kConsumers <= 65536);              // named barrier of the consumers (1, 2: warpgroups)

struct ForwardArgs {
  const __nv_bfloat16* q;  // [Tq, Hq, 128]
  const __nv_bfloat16* k;  // [Tk, Hkv, 128]
  const __nv_bfloat16* v;  // [Tk, Hkv, 128]
  const int32_t* schedule;    // [capacity, 6]
  const int32_t* work_count;  // [1]
  const int32_t* full_items;  // [1]: the schedule's leading items with q_per_cta queries
  const int32_t* q_indices;   // [Hkv, Tq * 16]
  const int32_t* split_slot;  // [Hkv, Tq * 16]
  const DocInfo* docs;        // [B]
  const int32_t* status;      // [4]
  float2* part_ml;            // [16, Tq, Hq]: (max of S * scale * log2(e), sum of 2^(that - max))
  int64_t total_q;
  int Hq, Hkv;
  int nsub;                   // tasks per schedule item: ceil(q_per_cta / 8)
  float scale_log2;           // softmax scale * log2(e)
};

// The tasks of this CTA: an equal share of the full items' tasks, consecutive so that the key
// block rarely changes, then every gridDim.x-th task of the partial items that follow them.
// Each partial item reads a key block of its own; spread out, no CTA loads them all.
struct CtaTasks {
  int64_t first = 0, nfirst = 0, tail0 = 0, ntail = 0;
  int stride = 1;
  __device__ int64_t count() const { return nfirst + ntail; }
  __device__ int64_t task(int64_t n) const { return n < nfirst ? first + n : tail0 + (n - nfirst) * stride; }
};

__device__ CtaTasks cta_tasks(const ForwardArgs& a) {
  const int64_t total = int64_t(*a.work_count) * a.nsub, full = int64_t(*a.full_items) * a.nsub;
  const int64_t G = gridDim.x, c = blockIdx.x;
  CtaTasks r;
  r.first = full * c / G;
  r.nfirst = full * (c + 1) / G - r.first;
  r.tail0 = full + c;
  r.ntail = total > r.tail0 ? (total - r.tail0 + G - 1) / G : 0;
  r.stride = int(G);
  return r;
}

// What producer warp pw needs about one task: its key block and, for each of its queries, the
// packed row (-1: absent), partial slot and last visible key of the block.
struct TaskMeta {
  int g = 0, b = 0, j = 0;
  int row[kQueriesPerProducer], slot[kQueriesPerProducer], limit[kQueriesPerProducer];
};

// Reads the metadata of task `task` for producer warp pw (one lane per task: the loads of 32
// tasks are in flight together, two dependent round trips per 32 tasks).
__device__ TaskMeta fetch_task(const ForwardArgs& a, int64_t task, int pw) {
  TaskMeta m;
  const int32_t* it = a.schedule + (task / a.nsub) * 6;
  m.g = it[0], m.b = it[4], m.j = it[5];
  const int q_begin = it[2], q_count = it[3];
  const DocInfo d = a.docs[m.b];
#pragma unroll
  for (int i = 0; i < kQueriesPerProducer; ++i) {
    const int qi = int(task % a.nsub) * 8 + pw * kQueriesPerProducer + i;
    m.row[i] = -1, m.slot[i] = 0, m.limit[i] = 127;
    if (qi < q_count) {
      const int64_t e = int64_t(m.g) * a.total_q * 16 + q_begin + qi;
      const int ql = a.q_indices[e];
      m.row[i] = d.q_start + ql;
      m.slot[i] = a.split_slot[e];
      m.limit[i] = d.k_len - d.q_len + ql - m.j * 128;
    }
  }
  return m;
}

// Producer warp pw: writes the metadata of lane `src`'s task and has TMA copy its queries' 16
// Q rows (two 64-column boxes each) into `stage`; `full` completes when every producer warp
// has arrived and all bytes have landed. Rows of absent queries are read past the end of Q,
// i.e. as zeros (they keep the warpgroup's products finite; their results are not written).
__device__ void produce_task(const ForwardArgs& a, const CUtensorMap* q_map, const TaskMeta& mine, int src,
                             uint32_t stage, int* meta, uint32_t full, int pw, int lane) {
  const int g = __shfl_sync(0xffffffffu, mine.g, src);
  const int b = __shfl_sync(0xffffffffu, mine.b, src);
  const int j = __shfl_sync(0xffffffffu, mine.j, src);
  int q_row[kQueriesPerProducer];
#pragma unroll
  for (int i = 0; i < kQueriesPerProducer; ++i) {
    const int r = __shfl_sync(0xffffffffu, mine.row[i], src);
    const int slot = __shfl_sync(0xffffffffu, mine.slot[i], src);
    const int limit = __shfl_sync(0xffffffffu, mine.limit[i], src);
    if (lane == 0) *reinterpret_cast<int4*>(meta + 4 * (pw * kQueriesPerProducer + i)) = make_int4(r, slot, limit, g);
    q_row[i] = r >= 0 ? r * a.Hq + 16 * g : int(a.total_q) * a.Hq;
  }
  if (lane != 0) return;
  if (pw == 0) *reinterpret_cast<int4*>(meta + 4 * kConsumerWarps) = make_int4(g, b, j, 0);
  mbar_arrive_expect_tx(full, kQueriesPerProducer * 16 * 256);  // after the metadata stores
  // A query's Q rows come back once per selected block: let them outlive the output stream.
  const uint64_t keep = l2_evict_last();
#pragma unroll
  for (int i = 0; i < kQueriesPerProducer; ++i) {
    const uint32_t rows = stage + 16 * (pw * kQueriesPerProducer + i) * 128;
    tma_load_2d(rows, q_map, 0, q_row[i], full, keep);
    tma_load_2d(rows + 128 * 128, q_map, 64, q_row[i], full, keep);
  }
}

// Loads key block j of head g into the K tile (rows = keys) and V transposed into the V^T
// tile (rows = dims, columns = keys), so that both products read K-major operands. Keys past
// the document end are zero. Runs (by the consumers) once per block change.
__device__ void load_key_block(const ForwardArgs& a, int g, int b, int j, uint32_t ks, uint32_t vts, int tid) {
  const DocInfo d = a.docs[b];
  const int key0 = j * 128;
  const int nkeys = min(128, d.k_len - key0);
  const int64_t stride = int64_t(a.Hkv) * 128;
  const __nv_bfloat16* kb = a.k + (int64_t(d.k_start + key0) * a.Hkv + g) * 128;
  const __nv_bfloat16* vb = a.v + (int64_t(d.k_start + key0) * a.Hkv + g) * 128;
  for (int c = tid; c < 128 * 16; c += kConsumers) {
    const int key = c >> 4, ch = c & 15;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (key < nkeys) x = __ldg(reinterpret_cast<const uint4*>(kb + key * stride + ch * 8));
    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(ks + tile_offset(128, key, ch)), "r"(x.x), "r"(x.y),
                 "r"(x.z), "r"(x.w)
                 : "memory");
  }
  // A warp covers 32 consecutive keys of one 8-dim chunk: its 2-byte stores hit one row.
  for (int c = tid; c < 128 * 16; c += kConsumers) {
    const int key = c & 127, ch = c >> 7;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (key < nkeys) x = __ldg(reinterpret_cast<const uint4*>(vb + key * stride + ch * 8));
    const uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint32_t addr = vts + tile_offset(128, ch * 8 + e, key >> 3) + (key & 7) * 2;
      const uint16_t h = uint16_t(words[e >> 1] >> (16 * (e & 1)));
      asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(h) : "memory");
    }
  }
}

// Issues S = Q K^T for warpgroup wg's 4 queries of a task (q_desc: rows 64wg.. of the Q
// stage) against the resident key tile; does not wait.
__device__ __forceinline__ void issue_scores(float (&s)[16][4], uint64_t q_desc, uint64_t k_desc) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    wgmma_m64n128k16(s, q_desc + tile_desc_step(128, kk), k_desc + tile_desc_step(128, kk), kk > 0);
  wgmma_commit();
}

// Issues O = P V (P from registers, V^T as the K-major B operand); does not wait.
__device__ __forceinline__ void issue_pv(float (&o)[16][4], const uint32_t (&p)[8][4], uint64_t vt_desc) {
  wgmma_fence();
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) wgmma_m64n128k16_rs(o, p[kt], vt_desc + tile_desc_step(128, kt), kt > 0);
  wgmma_commit();
}

// Max (scaled to the exp2 domain) and sum of exponentials of the two rows a thread holds.
struct RowStats {
  float ms0, ms1, l0, l1;
};

// Softmax numerators of the warp's 16 rows (keys past `limit` masked) as bf16 A fragments.
// Reductions run over four partial accumulators to keep the dependency chains short.
__device__ __forceinline__ RowStats softmax_rows(float (&s)[16][4], uint32_t (&p)[8][4], int limit, float scale_log2,
                                                 int t) {
  if (limit < 127) {
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (nt * 8 + 2 * t + (e & 1) > limit) s[nt][e] = -INFINITY;
  }
  float mx[2][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    mx[0][i] = fmaxf(s[i][0], s[i][1]);
    mx[1][i] = fmaxf(s[i][2], s[i][3]);
  }
#pragma unroll
  for (int nt = 4; nt < 16; ++nt) {
    mx[0][nt & 3] = fmaxf(mx[0][nt & 3], fmaxf(s[nt][0], s[nt][1]));
    mx[1][nt & 3] = fmaxf(mx[1][nt & 3], fmaxf(s[nt][2], s[nt][3]));
  }
  RowStats r;
  r.ms0 = warp_max4(fmaxf(fmaxf(mx[0][0], mx[0][1]), fmaxf(mx[0][2], mx[0][3]))) * scale_log2;
  r.ms1 = warp_max4(fmaxf(fmaxf(mx[1][0], mx[1][1]), fmaxf(mx[1][2], mx[1][3]))) * scale_log2;
  float sum[2][4] = {};
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    float e[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      e[h][0] = fast_exp2(s[2 * kt + h][0] * scale_log2 - r.ms0);
      e[h][1] = fast_exp2(s[2 * kt + h][1] * scale_log2 - r.ms0);
      e[h][2] = fast_exp2(s[2 * kt + h][2] * scale_log2 - r.ms1);
      e[h][3] = fast_exp2(s[2 * kt + h][3] * scale_log2 - r.ms1);
      sum[0][(2 * kt + h) & 3] += e[h][0] + e[h][1];
      sum[1][(2 * kt + h) & 3] += e[h][2] + e[h][3];
    }
    p[kt][0] = pack_bf16(e[0][0], e[0][1]);
    p[kt][1] = pack_bf16(e[0][2], e[0][3]);
    p[kt][2] = pack_bf16(e[1][0], e[1][1]);
    p[kt][3] = pack_bf16(e[1][2], e[1][3]);
  }
  r.l0 = warp_sum4((sum[0][0] + sum[0][1]) + (sum[0][2] + sum[0][3]));
  r.l1 = warp_sum4((sum[1][0] + sum[1][1]) + (sum[1][2] + sum[1][3]));
  return r;
}

// Stages the warp's 16 unnormalised output rows in its own (already consumed) Q rows of the
// stage and has TMA write them to partial slot m.y, with each row's max and sum. Lane 0
// commits one bulk group per task (empty for an absent query), so that the caller can wait for
// the stage to be read before handing it back.
__device__ __forceinline__ void store_partial(const ForwardArgs& a, const CUtensorMap* part_map, const float (&o)[16][4],
                                              const RowStats& r, int4 m, uint32_t qs, int warp, int lane) {
  const int row = m.x, slot = m.y, g = m.w;
  if (row >= 0) {
    const int r16 = 16 * warp;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      store_rows_x16(qs, 128, r16, k, lane, pack_bf16(o[2 * k][0], o[2 * k][1]), pack_bf16(o[2 * k][2], o[2 * k][3]),
                     pack_bf16(o[2 * k + 1][0], o[2 * k + 1][1]), pack_bf16(o[2 * k + 1][2], o[2 * k + 1][3]));
    fence_proxy_async();  // the stmatrix writes are read by TMA next
    __syncwarp();
    const int out_row = (slot * int(a.total_q) + row) * a.Hq + 16 * g;
    if (lane == 0) {  // partial outputs are read back only by the merge, long after
      const uint64_t stream = l2_evict_first();
      tma_store_2d(part_map, 0, out_row, qs + r16 * 128, stream);
      tma_store_2d(part_map, 64, out_row, qs + 128 * 128 + r16 * 128, stream);
    }
    if ((lane & 3) == 0) {
      a.part_ml[out_row + (lane >> 2)] = make_float2(r.ms0, r.l0);
      a.part_ml[out_row + (lane >> 2) + 8] = make_float2(r.ms1, r.l1);
    }
  }
  if (lane == 0) bulk_commit();
}

__global__ void __launch_bounds__(kThreads, 1)
    forward_tasks_kernel(const ForwardArgs a, const __grid_constant__ CUtensorMap q_map,
                         const __grid_constant__ CUtensorMap part_map) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (a.status[0] != 0) return;
  const CtaTasks mine_tasks = cta_tasks(a);
  const int64_t ntasks_cta = mine_tasks.count();
  if (ntasks_cta == 0) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const uint32_t base = align1024(smem_addr(smem));
  unsigned char* base_ptr = smem + (base - smem_addr(smem));
  const uint32_t ks = base, vts = base + kTileBytes, q0 = base + 2 * kTileBytes;
  int* meta0 = reinterpret_cast<int*>(base_ptr + (2 + kQStages) * kTileBytes);
  const uint32_t bars = base + (2 + kQStages) * kTileBytes + kQStages * kMetaInts * 4;  // full[s], then empty[s]
  if (tid == 0) {
    for (int i = 0; i < kQStages; ++i) {
      mbar_init(bars + 8 * i, kProducerWarps);  // lane 0 of each producer warp (with its TMA bytes)
      mbar_init(bars + 8 * (kQStages + i), kConsumerWarps);
    }
  }
  __syncthreads();

  if (warp >= kConsumerWarps) {
    setmaxnreg_dec<kProducerRegs>();
    const int pw = warp - kConsumerWarps;
    for (int64_t n0 = 0; n0 < ntasks_cta; n0 += 32) {
      TaskMeta mine;
      if (n0 + lane < ntasks_cta) mine = fetch_task(a, mine_tasks.task(n0 + lane), pw);
      const int count = int(ntasks_cta - n0 < 32 ? ntasks_cta - n0 : 32);
      for (int k = 0; k < count; ++k) {
        const int n = int(n0 + k), stage = n % kQStages, use = n / kQStages;
        if (use > 0) mbar_wait(bars + 8 * (kQStages + stage), (use - 1) & 1);
        produce_task(a, &q_map, mine, k, q0 + stage * kTileBytes, meta0 + stage * kMetaInts, bars + 8 * stage, pw, lane);
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  // Consumers, software-pipelined over tasks: while task n's outputs are normalised and stored,
  // the tensor cores already compute S of task n + 1 (when it reads the same key block).
  const int wg = warp >> 2, t4 = lane & 3;
  int loaded_g = -1, loaded_b = -1, loaded_j = -1;
  // Waits for task n's Q stage; returns its key block (x: head, y: document, z: block).
  auto wait_task = [&](int n) {
    mbar_wait(bars + 8 * (n % kQStages), (n / kQStages) & 1);
    fence_proxy_async();  // the cp.async rows are read by wgmma next
    return *reinterpret_cast<const int4*>(meta0 + (n % kQStages) * kMetaInts + 4 * kConsumerWarps);
  };
  auto load_block = [&](int4 blk) {
    named_barrier(kKvBarrier, kConsumers);  // every consumer is done with the old block
    load_key_block(a, blk.x, blk.y, blk.z, ks, vts, tid);
    loaded_g = blk.x, loaded_b = blk.y, loaded_j = blk.z;
    fence_proxy_async();
    named_barrier(kKvBarrier, kConsumers);
  };
  const int ntasks = int(ntasks_cta);  // >= 1
  const uint64_t k_desc = sw128_desc(ks), vt_desc = sw128_desc(vts);
  auto q_desc = [&](int n) { return sw128_desc(q0 + (n % kQStages) * kTileBytes + 64 * wg * 128); };
  float s[16][4];
  load_block(wait_task(0));
  issue_scores(s, q_desc(0), k_desc);
  for (int n = 0;; ++n) {
    const int stage = n % kQStages;
    const uint32_t qs = q0 + stage * kTileBytes;
    const int4 m = *reinterpret_cast<const int4*>(meta0 + stage * kMetaInts + 4 * warp);
    wgmma_wait<0>();
    warpgroup_barrier(wg);  // every warp's Q rows are read before any warp reuses them
    uint32_t p[8][4];
    const RowStats r = softmax_rows(s, p, m.z, a.scale_log2, t4);
    float o[16][4];
    issue_pv(o, p, vt_desc);
    // S of the next task goes to the tensor cores now if its key block is already resident;
    // otherwise an empty group keeps the wait below the same on every path.
    const bool more = __all_sync(0xffffffffu, n + 1 < ntasks);
    int4 next_blk = make_int4(-1, -1, -1, 0);
    if (more) next_blk = wait_task(n + 1);
    // (A warp vote: the wgmma below must be seen as taken by whole warps.)
    const bool same_block =
        __all_sync(0xffffffffu, more && next_blk.x == loaded_g && next_blk.y == loaded_b && next_blk.z == loaded_j);
    if (same_block) issue_scores(s, q_desc(n + 1), k_desc);
    else wgmma_commit();
    wgmma_wait<1>();  // O of task n is complete
    store_partial(a, &part_map, o, r, m, qs, warp, lane);
    // Task n - 1's stage goes back to the producers once its output rows have been read out.
    if (lane == 0) {
      bulk_wait_read<1>();
      if (n > 0) mbar_arrive(bars + 8 * (kQStages + (n - 1) % kQStages));
    }
    if (!more) break;
    if (!same_block) {
      load_block(next_blk);
      issue_scores(s, q_desc(n + 1), k_desc);
    }
  }
  wgmma_wait<0>();
  if (lane == 0) bulk_wait_read<0>();  // shared memory stays valid until TMA has read it
}

// Merges the partial states of every (query, head): thread = 8 output dims of one
// (query, head). Partial s holds O_s = sum_k 2^(x_k - m_s) v_k and l_s = sum_k 2^(x_k - m_s)
// (x: scores in log2 units); with M = max_s m_s and w_s = 2^(m_s - M), out = sum w_s O_s /
// sum w_s l_s and LSE = (M + log2 sum w_s l_s) ln 2. No partial, or a sum that is not
// finite (NaN scores), gives zeros and -inf; NaN in the partial values carries into out. The
// slots are read in batches of 4 (the loads of a batch in flight together), which keeps the
// kernel at 64 registers: 32 resident warps per SM overlap the dependent loads (counts, maxima,
// partials) of many rows, which is what this memory-bound kernel needs.
constexpr int kMergeThreads = 256;
template <typename Out>
__global__ void __launch_bounds__(kMergeThreads, 4)
    forward_merge_kernel(const __nv_bfloat16* __restrict__ part_o, const float2* __restrict__ part_ml,
                         const int32_t* __restrict__ split_counts, const int32_t* __restrict__ status, int64_t total_q,
                         int Hq, int Hkv, Out* __restrict__ out, float* __restrict__ lse) {
  const int64_t gid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid >= total_q * Hq * 16) return;
  const int64_t qh = gid >> 4;  // query * Hq + head
  const int chunk = int(gid & 15);
  const int64_t q = qh / Hq;
  const int h = int(qh % Hq);
  const int C = split_counts[q * Hkv + h / 16];
  const int64_t slot_stride = total_q * Hq;
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  float result_lse = -INFINITY;
  if (status[0] != 0) {
    result_lse = NAN;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = NAN;
  } else if (C > 0) {
    const float2* ml_row = part_ml + qh;                   // slot s at ml_row[s * slot_stride]
    const __nv_bfloat16* o_row = part_o + qh * 128 + chunk * 8;  // slot s at o_row[s * slot_stride * 128]
    float m = -INFINITY;  // M (the maxima are read again with the partials; they are cached)
#pragma unroll
    for (int s = 0; s < 16; ++s)
      if (s < C) m = fmaxf(m, ml_row[s * slot_stride].x);
    float z = 0.f;
#pragma unroll
    for (int batch = 0; batch < 4; ++batch) {
      uint4 raw[4];
      float2 ml[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int s = 4 * batch + i;
        if (s < C) {
          raw[i] = *reinterpret_cast<const uint4*>(o_row + s * slot_stride * 128);
          ml[i] = ml_row[s * slot_stride];
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int s = 4 * batch + i;
        if (s >= C) continue;
        const float w = m > -INFINITY ? exp2f(ml[i].x - m) : 0.f;
        z += w * ml[i].y;
        const uint32_t words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc[2 * e] += w * bf16_bits_to_float(uint16_t(words[e] & 0xffff));
          acc[2 * e + 1] += w * bf16_bits_to_float(uint16_t(words[e] >> 16));
        }
      }
    }
    if (m > -INFINITY && z > 0.f && isfinite(z)) {
      const float inv = 1.f / z;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= inv;
      constexpr float kLn2 = 0.6931471805599453f;
      result_lse = (m + log2f(z)) * kLn2;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    }
  }
  Out* dst = out + qh * 128 + chunk * 8;
  if constexpr (sizeof(Out) == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
  } else {
    st_global_v4(dst, make_uint4(pack_bf16(acc[0], acc[1]), pack_bf16(acc[2], acc[3]), pack_bf16(acc[4], acc[5]),
                                 pack_bf16(acc[6], acc[7])));
  }
  if (chunk == 0) lse[qh] = result_lse;
}

}  // namespace

void sparse_attention_forward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan,
                              const AttentionForwardParams& p, const RunOptions& opt) {
  DeviceGuard guard(p.q.device.index);
  const PlanState& st = plan_state(plan);
  const cudaStream_t s = as_stream(opt);
  const WorkspaceLayout w = workspace_layout(topo, L);
  const int64_t Tq = L.total_q();
  if (Tq == 0) return;
  ForwardArgs a{};
  a.q = p.q.as<const __nv_bfloat16>();
  a.k = p.k.as<const __nv_bfloat16>();
  a.v = p.v.as<const __nv_bfloat16>();
  a.schedule = i32(plan.schedule);
  a.work_count = i32(plan.work_count_dev);
  a.full_items = i32(st.schedule_full);
  a.q_indices = i32(plan.q_indices);
  a.split_slot = i32(plan.split_slot);
  a.docs = doc_ptr(st);
  a.status = i32(plan.status);
  a.part_ml = ws<float2>(st, w.part_ml);
  a.total_q = Tq;
  a.Hq = topo.num_q_heads;
  a.Hkv = topo.num_kv_heads;
  a.nsub = int(ceil_div(plan.q_per_cta, 8));
  a.scale_log2 = topo.attention_scale() * 1.4426950408889634f;
  const int64_t max_tasks = st.schedule_capacity * a.nsub;
  if (max_tasks > 0) {
    MSA_CUDA_CHECK(cudaFuncSetAttribute(forward_tasks_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    __nv_bfloat16* part_o = ws<__nv_bfloat16>(st, w.part_o);
    const CUtensorMap q_map = bf16_row_tile_map(a.q, Tq * a.Hq, 16, "q");
    const CUtensorMap part_map = bf16_row_tile_map(part_o, 16 * Tq * a.Hq, 16, "the partial-output workspace");
    const int grid = int(std::min<int64_t>(max_tasks, sm_count()));
    forward_tasks_kernel<<<grid, kThreads, kSmemBytes, s>>>(a, q_map, part_map);
    MSA_CUDA_CHECK_LAUNCH("forward_tasks_kernel");
  }
  const int blocks = int(ceil_div(Tq * topo.num_q_heads * 16, kMergeThreads));
  if (p.out.dtype == DType::f32) {
    forward_merge_kernel<float><<<blocks, kMergeThreads, 0, s>>>(ws<__nv_bfloat16>(st, w.part_o), a.part_ml, i32(plan.split_counts), a.status, Tq,
                                                       a.Hq, a.Hkv, p.out.as<float>(), p.lse.as<float>());
  } else {
    forward_merge_kernel<__nv_bfloat16><<<blocks, kMergeThreads, 0, s>>>(ws<__nv_bfloat16>(st, w.part_o), a.part_ml, i32(plan.split_counts), a.status,
                                                               Tq, a.Hq, a.Hkv, p.out.as<__nv_bfloat16>(),
                                                               p.lse.as<float>());
  }
  MSA_CUDA_CHECK_LAUNCH("forward_merge_kernel");
}

}  // namespace msa::cuda
