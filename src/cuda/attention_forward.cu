// Sparse attention forward, KV-outer: one task = (schedule item, up to 8 of its queries).
// Warpgroup wg of the CTA computes queries 4wg..4wg+3 of the task; warp w owns one query, whose
// 16 heads are its 16 rows of the warpgroup's m64 tiles, so each warp applies its own causal
// limit. S = Q K^T and O = P V both run on wgmma (P straight from registers). Each
// (query, block) edge writes its unnormalised bf16 partial output (TMA store) with the row's
// max and sum of exponentials into slot split_slot; a second kernel merges the slots of every
// (query, head), dividing once.
//
// The CTA is persistent (one per SM). With the plan's token-major walk (build_forward_order),
// the CTAs take runs of kRunTasks consecutive tasks in turn, so the whole grid moves through
// the sequence one chunk of queries at a time and a chunk's Q rows are read from L2; within a
// chunk the items of a (head, block) row are consecutive, so K and V stay in shared memory for
// most of a run. Without it (small schedules) a CTA walks a contiguous share of the full items'
// tasks and the partial items that follow are dealt out round robin (CtaTasks). A producer
// warpgroup reads the schedule and streams each task's Q rows through four shared-memory
// stages with TMA (mbarrier hand-off), so the two computing warpgroups never wait on metadata
// loads; it gives most of its registers to them (setmaxnreg), which lets each computing
// warpgroup issue S of the next task before the current task's epilogue.
//
// Key blocks of bf16 sources land by TMA: the producer loads the K tile of the next block into
// a second K tile while the consumers still work on the current one; the consumers request V
// when they switch blocks and wait for it only before the first P V (V is read MN-major, as
// stored). Quantised sources are widened by the consumers when the block changes, into the same
// tile layout: FP8 codes from a raw stage the producer has TMA fill ahead of use, NVFP4 from
// global memory.
//
// The key blocks come from a KvSource (kv_source.cuh): the packed K / V of training, or a paged
// cache (bf16, FP8, NVFP4) for paged prefill; the kernel is the same, the source its policy.
//
// Non-finite isolation: a key a row does not attend to never changes it. Masked scores are
// set to -inf by selection; inf / NaN values in V are kept out of the shared V tile and
// added back only to the rows that see their keys (scrub_values, widen_side_from_global).
#include <cfloat>
#include <cstddef>

#include "attention_state.h"
#include "backend.h"
#include "core/check.h"
#include "msa/constants.h"
#include "plan_records.h"
#include "cuda/attention_forward.h"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/kv_source.cuh"
#include "cuda/named_barriers.cuh"
#include "cuda/tensor_map.h"
#include "cuda/wgmma.cuh"
#include "cuda/workspace.h"

namespace msa::cuda {
namespace {

// The model's sizes as the kernel's tiles see them.
constexpr int kBlock = model::kBlockSize;  // keys of a block: rows of the K tile, columns of S
constexpr int kDim = model::kHeadDim;      // head dim: columns of the Q / K tiles and of O
constexpr int kGroup = model::kGroupSize;  // heads of a query: the 16 rows a warp owns in m64 tiles
constexpr int kSlots = model::kTopk;       // partial slots (selected blocks) per (query, head)

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kProducerWarps = 4;         // one warpgroup: 12 warps cost no registers over 9
constexpr int kQueriesPerTask = kConsumerWarps;  // one query per consumer warp
constexpr int kQueriesPerProducer = kQueriesPerTask / kProducerWarps;
constexpr int kThreads = kConsumers + 32 * kProducerWarps;
constexpr int kQStages = 4;                // Q tiles in flight (query w: rows 16w..16w+15)

// Tile geometry: 128 rows of 128 bf16, stored as two 64-column boxes (the 128-byte swizzle
// atom of TMA and wgmma), so a row is 128 bytes within a box.
constexpr int kTileRows = 128;
constexpr int kBoxRowBytes = 128;                   // 64 bf16
constexpr int kBoxBytes = kTileRows * kBoxRowBytes;  // one 64-column half of a tile
constexpr int kTileBytes = 2 * kBoxBytes;
constexpr int kRowBytes = kDim * 2;                 // one Q / K / V row in global memory
constexpr int kRowChunks = kRowBytes / 16;          // 16-byte (8 bf16) chunks of a row
static_assert(kBlock == kTileRows && kDim == kTileRows, "the K, V and S tiles are 128 x 128");
static_assert(kQueriesPerTask * kGroup == kTileRows, "a Q stage holds the 16 head rows of 8 queries");
static_assert(kDim * 2 == 2 * kBoxRowBytes, "a row is two 64-column boxes");
// MMA fragment geometry (m64nNk16 wgmma, mma.sync C layout per warp).
constexpr int kNFrags = kTileRows / 8;  // n8 column fragments of an S or O row block
constexpr int kKSteps = kTileRows / 16;  // k16 steps of a product over 128

// Register budgets per thread after the split (65536 per SM): the producers need few, the
// consumers hold S of the next task, O and P of the current one at once.
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
static_assert(kProducerRegs * 32 * kProducerWarps + kConsumerRegs * kConsumers <= 65536);

// What a consumer warp needs about its query of a task (written by the producers into the
// task's metadata stage; one 16-byte vector).
struct alignas(16) QueryMeta {
  int32_t row;      // packed query row; -1: absent (the task has fewer queries)
  int32_t slot;     // partial slot of the (query, block) edge
  int32_t limit;    // last key of the block the query sees (>= kBlock - 1: all of them)
  int32_t head_kv;  // KV head of the task
};
// The key block of a task; `source` locates it for TMA: the packed row of its key 0, or its
// physical page.
struct alignas(16) TaskBlock {
  int32_t head_kv, document, kv_block, source;
  __device__ bool same(const TaskBlock& o) const {
    return head_kv == o.head_kv && document == o.document && kv_block == o.kv_block;
  }
};
struct alignas(16) MetaStage {
  QueryMeta query[kQueriesPerTask];
  TaskBlock block;
};
static_assert(sizeof(QueryMeta) == sizeof(int4) && sizeof(TaskBlock) == sizeof(int4));

__device__ __forceinline__ void store_meta(QueryMeta* dst, const QueryMeta& m) {
  *reinterpret_cast<int4*>(dst) = make_int4(m.row, m.slot, m.limit, m.head_kv);
}
__device__ __forceinline__ QueryMeta load_meta(const QueryMeta* src) {
  const int4 v = *reinterpret_cast<const int4*>(src);
  return {v.x, v.y, v.z, v.w};
}
__device__ __forceinline__ void store_block(TaskBlock* dst, const TaskBlock& b) {
  *reinterpret_cast<int4*>(dst) = make_int4(b.head_kv, b.document, b.kv_block, b.source);
}
__device__ __forceinline__ TaskBlock load_block(const TaskBlock* src) {
  const int4 v = *reinterpret_cast<const int4*>(src);
  return {v.x, v.y, v.z, v.w};
}

// The kernel's shared memory. Tiles are 1024-byte aligned (swizzle atoms).
struct alignas(1024) Tile {
  unsigned char bytes[kTileBytes];
};
// The tiles of one kernel instance, in this order: K tiles, the V tile, the Q stages, raw
// stages. Key block u (the u-th block change of the CTA's task walk, counted alike by producer
// and consumers) has its K in K tile u % KTiles: bf16 sources keep two (the next block's K lands
// while the current one is in use), widened sources one. FP8 sources add one raw stage, where
// the producer has TMA land the next block's codes (K rows, then V rows: 128 bytes a key each,
// unswizzled: a warp's 16-byte reads of consecutive chunks hit every bank once) for the
// consumers to widen at the block change.
template <KvSourceKind Kind>
struct TilePlan {
  static constexpr int kKTiles = kTmaSource<Kind> ? 2 : 1;
  static constexpr int kRawStages = kRawStagedSource<Kind> ? 1 : 0;
  static constexpr int kV = kKTiles, kQ = kKTiles + 1, kRaw = kQ + kQStages;
  static constexpr int kTiles = kRaw + kRawStages;
};
constexpr int kRawSideBytes = kBlock * model::kHeadDim;  // one side's FP8 codes in a raw stage

template <int NTiles>
struct SharedStorage {
  Tile tiles[NTiles];     // TilePlan's order
  MetaStage meta[kQStages];
  uint64_t full[kQStages];   // mbarrier: stage s holds a task (the producers' TMA bytes landed)
  uint64_t empty[kQStages];  // mbarrier: the consumers are done with stage s
  uint64_t k_full[2];        // mbarrier: K tile b landed (TMA sources)
  uint64_t k_empty[2];       // mbarrier: the consumers are done with K tile b (TMA sources)
  uint64_t v_full;           // mbarrier: the V tile landed (TMA sources)
  uint64_t raw_full;         // mbarrier: the raw stage holds the next block's codes (raw-staged sources)
  uint64_t raw_empty;        // mbarrier: the consumers have widened the raw stage's block
  uint32_t nonfinite_keys[kBlock / 32];  // keys of the resident block with an inf / NaN value
  float key_scale[kBlock];    // FP8 per-token scales of the resident block's keys (K, V)
  float value_scale[kBlock];
};
template <KvSourceKind Kind>
using StorageOf = SharedStorage<TilePlan<Kind>::kTiles>;
static_assert(offsetof(SharedStorage<7>, full) % 8 == 0 && sizeof(MetaStage) % 16 == 0);
static_assert(alignof(SharedStorage<7>) == 1024);
template <KvSourceKind Kind>
inline constexpr int kSmemBytes = int(sizeof(StorageOf<Kind>)) + 1024;  // + slack to align the base
static_assert(kSmemBytes<KvSourceKind::paged_bf16> <= 227 * 1024, "over the 227 KB of shared memory a CTA can have");
static_assert(kSmemBytes<KvSourceKind::paged_fp8> <= 227 * 1024, "over the 227 KB of shared memory a CTA can have");

// The shared storage at a 1024-aligned shared address: TMA, wgmma descriptors and mbarriers
// take 32-bit shared addresses, the metadata is read through the pointer.
template <KvSourceKind Kind>
struct Smem {
  using Plan = TilePlan<Kind>;
  using Storage = StorageOf<Kind>;
  uint32_t base;
  Storage* ptr;
  __device__ uint32_t tile(int i) const { return base + i * kTileBytes; }
  __device__ uint32_t k(int b) const { return tile(b % Plan::kKTiles); }
  __device__ uint32_t v() const { return tile(Plan::kV); }
  __device__ uint32_t q(int stage) const { return tile(Plan::kQ + stage); }
  __device__ uint32_t raw() const { return tile(Plan::kRaw); }
  __device__ uint32_t bar(size_t offset) const { return base + uint32_t(offset); }
  __device__ uint32_t full(int stage) const { return bar(offsetof(Storage, full)) + 8 * stage; }
  __device__ uint32_t empty(int stage) const { return bar(offsetof(Storage, empty)) + 8 * stage; }
  __device__ uint32_t k_full(int b) const { return bar(offsetof(Storage, k_full)) + 8 * b; }
  __device__ uint32_t k_empty(int b) const { return bar(offsetof(Storage, k_empty)) + 8 * b; }
  __device__ uint32_t v_full() const { return bar(offsetof(Storage, v_full)); }
  __device__ uint32_t raw_full() const { return bar(offsetof(Storage, raw_full)); }
  __device__ uint32_t raw_empty() const { return bar(offsetof(Storage, raw_empty)); }
  __device__ MetaStage& meta(int stage) const { return ptr->meta[stage]; }
  __device__ uint32_t* nonfinite_keys() const { return ptr->nonfinite_keys; }
  __device__ float* key_scale() const { return ptr->key_scale; }
  __device__ float* value_scale() const { return ptr->value_scale; }
};

struct ForwardArgs {
  KvSource kv;             // K / V: packed [Tk, Hkv, 128] bf16 or a paged cache
  const WorkItem* schedule;   // [capacity]
  const int32_t* work_count;  // [1]
  const int32_t* full_items;  // [1]: the schedule's leading items with q_per_cta queries
  const int32_t* q_indices;   // [Hkv, Tq * 16]
  const int32_t* split_slot;  // [Hkv, Tq * 16]
  const DocInfo* docs;        // [B]
  const int32_t* order;       // [capacity]: schedule items in walking order, or nullptr
  const int32_t* status;      // [4]
  float2* part_ml;            // [16, window, Hq]: (max of S * scale * log2(e), sum of 2^(that - max))
  // The window this launch computes: queries [q_lo, q_hi) (a task's other queries are absent),
  // their partials at row - q_lo of the `window` rows of part_o / part_ml; with several windows,
  // its own items and straddling ones (ForwardLaunch).
  int64_t q_lo, q_hi, window;
  const int32_t* window_begin;
  const int32_t* straddle_begin;
  const int32_t* straddle_items;
  int window_index;
  int64_t total_q;
  int Hq, Hkv;
  int nsub;                   // tasks per schedule item: ceil(q_per_cta / kQueriesPerTask)
  float scale_log2;           // softmax scale * log2(e)
};

// The tasks of this CTA. Walking order (a.order): positions n < nruns * kRunTasks are the
// CTA's runs, run r at r * G * kRunTasks + c * kRunTasks, so all CTAs work on neighbouring runs
// of the list at any time; the positions past the last whole round are shared contiguously.
// A position p is sub-task p % nsub of item order[p / nsub]. Schedule order: an equal share of
// the full items' tasks, consecutive so that the key block rarely changes, then every
// gridDim.x-th task of the partial items that follow them (each partial item reads a key
// block of its own; spread out, no CTA loads them all).
constexpr int kRunTasks = 16;  // faster than 4 at 16k tokens (performance.md, run 40)
struct CtaTasks {
  int64_t first = 0, nfirst = 0, tail0 = 0, ntail = 0;
  int stride = 1;
  const int32_t* order = nullptr;
  int64_t run_stride = 0, nruns_tasks = 0;  // walking order: G * kRunTasks, the CTA's tasks in whole runs
  int nsub = 1, cta = 0;
  // Walking order: the launch's items are order[own0 ..][.. own) then straddle[.. ] (a window's).
  int64_t own0 = 0, own = 0;
  const int32_t* straddle = nullptr;
  __device__ int64_t item_at(int64_t i) const { return i < own ? order[own0 + i] : straddle[i - own]; }
  __device__ int64_t count() const { return order ? nruns_tasks + ntail : nfirst + ntail; }
  __device__ int64_t task(int64_t n) const {
    if (order == nullptr) return n < nfirst ? first + n : tail0 + (n - nfirst) * stride;
    const int64_t p = n < nruns_tasks ? (n / kRunTasks) * run_stride + int64_t(cta) * kRunTasks + n % kRunTasks
                                      : tail0 + (n - nruns_tasks);
    return item_at(p / nsub) * nsub + p % nsub;
  }
};

__device__ CtaTasks cta_tasks(const ForwardArgs& a) {
  int64_t total = int64_t(*a.work_count) * a.nsub;
  const int64_t full = int64_t(*a.full_items) * a.nsub;
  const int64_t G = gridDim.x, c = blockIdx.x;
  CtaTasks r;
  if (a.order != nullptr) {
    r.order = a.order, r.nsub = a.nsub, r.cta = int(c);
    r.own = *a.work_count;
    if (a.window_begin != nullptr) {
      const int w = a.window_index;
      const int64_t s0 = a.straddle_begin[w];
      r.own0 = a.window_begin[w];
      r.own = a.window_begin[w + 1] - r.own0;
      r.straddle = a.straddle_items + s0;
      total = (r.own + a.straddle_begin[w + 1] - s0) * a.nsub;
    }
    r.run_stride = G * kRunTasks;
    const int64_t rounds = total / r.run_stride, rest = total - rounds * r.run_stride;
    r.nruns_tasks = rounds * kRunTasks;
    r.tail0 = rounds * r.run_stride + rest * c / G;
    r.ntail = rest * (c + 1) / G - rest * c / G;
    return r;
  }
  r.first = full * c / G;
  r.nfirst = full * (c + 1) / G - r.first;
  r.tail0 = full + c;
  r.ntail = total > r.tail0 ? (total - r.tail0 + G - 1) / G : 0;
  r.stride = int(G);
  return r;
}

// ---- producer -----------------------------------------------------------------------------

// What producer warp pw needs about one task: its key block and, for each of its queries, the
// packed row (-1: absent), partial slot and last visible key of the block.
struct TaskMeta {
  int g = 0, b = 0, j = 0, src = 0;
  int row[kQueriesPerProducer], slot[kQueriesPerProducer], limit[kQueriesPerProducer];
};

// Reads the metadata of task `task` for producer warp pw (one lane per task: the loads of 32
// tasks are in flight together, two dependent round trips per 32 tasks). For a bf16 source,
// warp 0, which has TMA load the key blocks, also locates the task's block in it.
template <KvSourceKind Kind>
__device__ TaskMeta fetch_task(const ForwardArgs& a, int64_t task, int pw) {
  TaskMeta m;
  const WorkItem& it = a.schedule[task / a.nsub];
  m.g = it.head_kv, m.b = it.document, m.j = it.kv_block;
  const int q_begin = it.q_begin, q_count = it.q_count;
  const DocInfo d = a.docs[m.b];
  if (kProducerCopiedSource<Kind> && pw == 0) {
    if constexpr (Kind == KvSourceKind::packed_bf16) m.src = d.k_start + m.j * kBlock;
    else m.src = a.kv.page_table[int64_t(m.b) * a.kv.max_pages + m.j];
  }
#pragma unroll
  for (int i = 0; i < kQueriesPerProducer; ++i) {
    const int qi = int(task % a.nsub) * kQueriesPerTask + pw * kQueriesPerProducer + i;
    m.row[i] = -1, m.slot[i] = 0, m.limit[i] = kBlock - 1;
    if (qi < q_count) {
      const int64_t e = int64_t(m.g) * a.total_q * kSlots + q_begin + qi;
      const int ql = a.q_indices[e];
      if (d.q_start + ql < a.q_lo || d.q_start + ql >= a.q_hi) continue;  // another window's
      m.row[i] = d.q_start + ql;
      m.slot[i] = a.split_slot[e];
      m.limit[i] = d.k_len - d.q_len + ql - m.j * kBlock;
    }
  }
  return m;
}

// Producer warp pw: writes the metadata of lane `src`'s task and has TMA copy its queries' 16
// Q rows (two 64-column boxes each) into `stage`; `full` completes when every producer warp
// has arrived and all bytes have landed. Rows of absent queries are read past the last token
// of Q, i.e. as zeros (they keep the warpgroup's products finite; their results are not written).
__device__ void produce_task(const ForwardArgs& a, const CUtensorMap* q_map, const TaskMeta& mine, int src,
                             uint32_t stage, MetaStage& meta, uint32_t full, int pw, int lane) {
  const int g = __shfl_sync(0xffffffffu, mine.g, src);
  const int b = __shfl_sync(0xffffffffu, mine.b, src);
  const int j = __shfl_sync(0xffffffffu, mine.j, src);
  const int source = __shfl_sync(0xffffffffu, mine.src, src);
  int q_token[kQueriesPerProducer];
#pragma unroll
  for (int i = 0; i < kQueriesPerProducer; ++i) {
    const int r = __shfl_sync(0xffffffffu, mine.row[i], src);
    const int slot = __shfl_sync(0xffffffffu, mine.slot[i], src);
    const int limit = __shfl_sync(0xffffffffu, mine.limit[i], src);
    if (lane == 0) store_meta(&meta.query[pw * kQueriesPerProducer + i], QueryMeta{r, slot, limit, g});
    q_token[i] = r >= 0 ? r : int(a.total_q);
  }
  if (lane != 0) return;
  if (pw == 0) store_block(&meta.block, TaskBlock{g, b, j, source});
  mbar_arrive_expect_tx(full, kQueriesPerProducer * kGroup * kRowBytes);  // after the metadata stores
  // A query's Q rows come back once per selected block: let them outlive the output stream.
  const uint64_t keep = l2_evict_last();
#pragma unroll
  for (int i = 0; i < kQueriesPerProducer; ++i) {
    const uint32_t rows = stage + kGroup * (pw * kQueriesPerProducer + i) * kBoxRowBytes;
    tma_load_3d(rows, q_map, 0, kGroup * g, q_token[i], full, keep);
    tma_load_3d(rows + kBoxBytes, q_map, kDim / 2, kGroup * g, q_token[i], full, keep);
  }
}

// Has TMA copy one side (K or V, `map`) of a key block of a bf16 source into `tile`, both
// column halves, signalling `bar`: packed rows source.. of head g (rows past the tensor read
// as zero, rows of the next document as they are: the causal limits mask them), or page
// `source` of head g.
template <KvSourceKind Kind>
__device__ __forceinline__ void load_block_side(uint32_t tile, const CUtensorMap* map, const TaskBlock& blk,
                                                uint32_t bar) {
  const uint64_t policy = l2_evict_normal();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (Kind == KvSourceKind::packed_bf16)
      tma_load_3d(tile + h * kBoxBytes, map, h * (kDim / 2), blk.head_kv, blk.source, bar, policy);
    else
      tma_load_4d(tile + h * kBoxBytes, map, h * (kDim / 2), 0, blk.head_kv, blk.source, bar, policy);
  }
}

// Producer warp 0 at the first task of key block u. A bf16 source's K lands in tile u % 2 once
// the consumers are done with block u - 2 (the tile's previous block), while they still work on
// block u - 1; its V goes to L2 for the consumers' TMA load at the block change. An FP8
// source's codes of both sides land in the raw stage once the consumers have widened block
// u - 1 from it (they do so when they enter it); its L2 prefetch, issued first, covers that
// wait. NVFP4 K and V go to L2 for the consumers' widening loads.
template <KvSourceKind Kind>
__device__ void stage_key_block(const ForwardArgs& a, const CUtensorMap* k_map, const CUtensorMap* v_map,
                                const Smem<Kind>& sm, const TaskBlock& blk, int u, int lane) {
  const DocInfo d = a.docs[blk.document];
  const int nkeys = min(kBlock, d.k_len - blk.kv_block * kBlock);
  prefetch_key_block<Kind>(a.kv, key_block_rows<Kind>(a.kv, blk.document, d.k_start, blk.head_kv, blk.kv_block), nkeys,
                           lane, !kTmaSource<Kind>);
  if (lane != 0) return;
  if constexpr (kTmaSource<Kind>) {
    const int b = u & 1;
    if (u >= 2) mbar_wait(sm.k_empty(b), ((u - 2) >> 1) & 1);
    mbar_arrive_expect_tx(sm.k_full(b), kTileBytes);
    load_block_side<Kind>(sm.k(b), k_map, blk, sm.k_full(b));
  } else if constexpr (kRawStagedSource<Kind>) {
    if (u >= 1) mbar_wait(sm.raw_empty(), (u - 1) & 1);
    mbar_arrive_expect_tx(sm.raw_full(), 2 * kRawSideBytes);
    const uint64_t policy = l2_evict_normal();
    tma_load_4d(sm.raw(), k_map, 0, 0, blk.head_kv, blk.source, sm.raw_full(), policy);
    tma_load_4d(sm.raw() + kRawSideBytes, v_map, 0, 0, blk.head_kv, blk.source, sm.raw_full(), policy);
  }
}

// Producer warp pw's whole share: the CTA's tasks in order, four stages ahead of the consumers.
// Warp 0 also stages each new key block (stage_key_block) after its first task's Q rows.
template <KvSourceKind Kind>
__device__ void run_producer(const ForwardArgs& a, const CUtensorMap* q_map, const CUtensorMap* k_map,
                             const CUtensorMap* v_map, const CtaTasks& tasks, int64_t ntasks, const Smem<Kind>& sm,
                             int pw, int lane) {
  TaskBlock staged{-1, -1, -1, 0};
  int u = -1;  // key blocks staged so far, minus one
  for (int64_t n0 = 0; n0 < ntasks; n0 += 32) {
    TaskMeta mine;
    if (n0 + lane < ntasks) mine = fetch_task<Kind>(a, tasks.task(n0 + lane), pw);
    const int count = int(ntasks - n0 < 32 ? ntasks - n0 : 32);
#pragma unroll 1
    for (int k = 0; k < count; ++k) {
      const int n = int(n0 + k), stage = n % kQStages, use = n / kQStages;
      if (use > 0) mbar_wait(sm.empty(stage), (use - 1) & 1);
      produce_task(a, q_map, mine, k, sm.q(stage), sm.meta(stage), sm.full(stage), pw, lane);
      // The task's Q rows go first: staging a new block may wait for the consumers to leave an
      // older one, and when every task has a block of its own (small steps) that wait would
      // otherwise hold the next tasks' Q loads back to one task ahead.
      if (pw == 0) {
        const TaskBlock blk{__shfl_sync(0xffffffffu, mine.g, k), __shfl_sync(0xffffffffu, mine.b, k),
                            __shfl_sync(0xffffffffu, mine.j, k), __shfl_sync(0xffffffffu, mine.src, k)};
        if (!blk.same(staged)) {
          stage_key_block<Kind>(a, k_map, v_map, sm, blk, ++u, lane);
          staged = blk;
        }
      }
    }
  }
}

// ---- consumer: key block, S = Q K^T, softmax, O = P V -------------------------------------

// Non-finite values: a key past a row's causal limit gets P = 0, but 0 * inf or NaN in the
// shared V tile would still reach the row (the tile serves queries with different limits).
// So an inf or NaN value is stored as 0, its key is marked in `nonfinite_keys` (cleared
// beforehand), and the rows that do see the key add P * value for it afterwards
// (add_nonfinite_values). A K value needs no care: a masked score is replaced by -inf,
// whatever it was.
//
// Every source's tiles have the same layout: rows = keys, 128-byte swizzle (as TMA lands a bf16
// block), so S reads K K-major and P V reads V MN-major.

// The FP8 per-token scales of a key block's keys (0 past the end), read by threads 0..127 into
// registers first (`fetch`) and stored after the widening (`store`), so that their latency
// overlaps it.
struct TokenScales {
  float k = 0.f, v = 0.f;
  __device__ void fetch(const KvSource& kv, const KeyBlockRows& rows, int g, int nkeys, int tid) {
    if (kv.k_token_scale != nullptr && tid < kBlock && tid < nkeys) {
      k = kv.k_token_scale[g * kv.k_token_stride + rows.slot0 + tid];
      v = kv.v_token_scale[g * kv.v_token_stride + rows.slot0 + tid];
    }
  }
  template <KvSourceKind Kind>
  __device__ void store(const KvSource& kv, const Smem<Kind>& sm, int tid) const {
    if (kv.k_token_scale != nullptr && tid < kBlock) sm.key_scale()[tid] = k, sm.value_scale()[tid] = v;
  }
};

// Widens one side of a key block of an NVFP4 source from global memory into `tile` (keys past
// nkeys zero). With kValues, inf / NaN values are zeroed and their keys marked (see above);
// returns whether this thread met one.
template <KvSourceKind Kind, bool kValues>
__device__ bool widen_side_from_global(const Smem<Kind>& sm, const uint8_t* rows, int64_t row_stride,
                                       const uint8_t* scales, int64_t scale_row, uint32_t tile, int nkeys, int tid) {
  static_assert(Kind == KvSourceKind::paged_nvfp4, "FP8 blocks come through the raw stage, bf16 ones by TMA");
  constexpr int kChunks = kSourceChunks<Kind>;      // 16-byte source chunks of a row
  constexpr int kOut = kWidened<Kind> / 8;          // 16-byte bf16 chunks one source chunk gives
  static_assert(kChunks * kOut == kRowChunks);
  // All of this thread's chunks are requested before any is stored (the shared-memory stores
  // are ordered after earlier loads): one wait on memory per side, not one per chunk.
  constexpr int kPerThread = kBlock * kChunks / kConsumers;
  static_assert(kBlock * kChunks % kConsumers == 0);
  Nvfp4Chunk raw[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int c = tid + i * kConsumers;
    const int key = c / kChunks, ch = c % kChunks;
    raw[i] = load_nvfp4_chunk(rows + key * row_stride, scales + key * scale_row, ch, key < nkeys);
  }
  bool any_nonfinite = false;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int c = tid + i * kConsumers;
    const int key = c / kChunks, ch = c % kChunks;
    uint32_t x[kWidened<Kind> / 2];
    widen_nvfp4_chunk(raw[i], x);
    if constexpr (kValues) {
      uint32_t signs = 0;
#pragma unroll
      for (int w = 0; w < kWidened<Kind> / 2; ++w) signs |= nonfinite_bf16x2_signs(x[w]);
      if (signs != 0) {  // rare: masking and shared-memory atomics only then
#pragma unroll
        for (int w = 0; w < kWidened<Kind> / 2; ++w) x[w] &= ~nonfinite_bf16x2(x[w]);
        atomicOr(&sm.nonfinite_keys()[key >> 5], 1u << (key & 31));
        any_nonfinite = true;
      }
    }
#pragma unroll
    for (int o = 0; o < kOut; ++o)
      st_shared_v4(tile + tile_offset(kTileRows, key, kOut * ch + o), x[4 * o], x[4 * o + 1], x[4 * o + 2], x[4 * o + 3]);
  }
  return any_nonfinite;
}

// The V tile once it holds bf16 values (landed by TMA, or widened from FP8 codes that include a
// NaN): inf / NaN values become 0 and their keys are marked. Returns whether this thread met one.
template <KvSourceKind Kind>
__device__ bool scrub_values(const Smem<Kind>& sm, int tid) {
  constexpr int kPerThread = kTileBytes / 16 / kConsumers;  // 16-byte chunks of the tile a thread checks
  uint4 w[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) w[i] = ld_shared_v4(sm.v() + 16 * (tid + i * kConsumers));
  bool any_nonfinite = false;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const uint32_t signs = nonfinite_bf16x2_signs(w[i].x) | nonfinite_bf16x2_signs(w[i].y) |
                           nonfinite_bf16x2_signs(w[i].z) | nonfinite_bf16x2_signs(w[i].w);
    if (signs != 0) {  // rare
      const int c = tid + i * kConsumers;
      const int key = (c % (kBoxBytes / 16)) / (kBoxRowBytes / 16);  // a swizzle moves chunks within a row only
      st_shared_v4(sm.v() + 16 * c, w[i].x & ~nonfinite_bf16x2(w[i].x), w[i].y & ~nonfinite_bf16x2(w[i].y),
                   w[i].z & ~nonfinite_bf16x2(w[i].z), w[i].w & ~nonfinite_bf16x2(w[i].w));
      atomicOr(&sm.nonfinite_keys()[key >> 5], 1u << (key & 31));
      any_nonfinite = true;
    }
  }
  return any_nonfinite;
}

// Widens key block `blk` of a quantised source into the K tile `k_tile` and the V tile, by the
// consumers at the block change: FP8 codes from the raw stage (once they have landed; the stage
// goes back to the producer here), NVFP4 from global memory. FP8 per-token scales go to
// key_scale / value_scale. Returns whether the block holds a non-finite value (CTA-uniform);
// the tiles are then visible to the tensor cores.
template <KvSourceKind Kind>
__device__ bool widen_key_block(const ForwardArgs& a, const TaskBlock& blk, const Smem<Kind>& sm, uint32_t k_tile,
                                int u, int tid) {
  const DocInfo d = a.docs[blk.document];
  const int nkeys = min(kBlock, d.k_len - blk.kv_block * kBlock);
  const KeyBlockRows rows = key_block_rows<Kind>(a.kv, blk.document, d.k_start, blk.head_kv, blk.kv_block);
  if constexpr (kRawStagedSource<Kind>) {
    TokenScales scales;
    scales.fetch(a.kv, rows, blk.head_kv, nkeys, tid);
    mbar_wait(sm.raw_full(), u & 1);
    inference::widen_fp8_side<kConsumers, false, false>(sm.raw(), k_tile, tid, nkeys);
    const bool nan = inference::widen_fp8_side<kConsumers, false, true>(sm.raw() + kRawSideBytes, sm.v(), tid, nkeys);
    scales.store(a.kv, sm, tid);
    fence_proxy_async();  // the widened tiles are read by wgmma
    const bool any_nan = sync_barrier_or(ForwardBarrier::kKeyBlock, kConsumers, nan);
    if (tid == 0) mbar_arrive(sm.raw_empty());  // every consumer has read the raw stage
    if (!any_nan) return false;
    const bool mine = scrub_values(sm, tid);  // rare: a NaN code among the values
    fence_proxy_async();
    return sync_barrier_or(ForwardBarrier::kKeyBlock, kConsumers, mine);
  } else {
    widen_side_from_global<Kind, false>(sm, rows.k, a.kv.k_row, rows.ksf, a.kv.ksf_row, k_tile, nkeys, tid);
    const bool mine =
        widen_side_from_global<Kind, true>(sm, rows.v, a.kv.v_row, rows.vsf, a.kv.vsf_row, sm.v(), nkeys, tid);
    fence_proxy_async();
    return sync_barrier_or(ForwardBarrier::kKeyBlock, kConsumers, mine);
  }
}

// Where the warp's P (16 rows x 128 keys, bf16) is staged when the block holds a non-finite
// value: its own rows of the Q stage, free once S is computed and not yet holding the outputs
// (keys 0..63 in the first box, 64..127 in the second, 128 bytes a row).
__device__ __forceinline__ uint32_t staged_p(uint32_t qs, int warp, int row, int key) {
  return qs + (key >= kBlock / 2 ? kBoxBytes : 0) + (kGroup * warp + row) * kBoxRowBytes + (key & (kBlock / 2 - 1)) * 2;
}

__device__ void stage_p(const uint32_t (&p)[kKSteps][4], uint32_t qs, int warp, int lane) {
#pragma unroll
  for (int kt = 0; kt < kKSteps; ++kt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // A fragment: rows g, g + 8; keys 16kt + 2t (+1), 16kt + 8 + 2t (+1)
      const uint32_t addr = staged_p(qs, warp, (lane >> 2) + 8 * (i & 1), 16 * kt + 8 * (i >> 1) + 2 * (lane & 3));
      st_shared_u32(addr, p[kt][i]);
    }
}

// The rare path of a block with non-finite values (widen_key_block, scrub_values): O holds P V
// with those values as 0; each row adds P * value for the non-finite values of the keys it sees
// (its query's limit), read again from the source, which is what P V over the original values
// gives for them (NaN, or +-inf). Keys the query does not see are never touched.
template <KvSourceKind Kind>
__device__ void add_nonfinite_values(const ForwardArgs& a, float (&o)[kNFrags][4], const uint32_t* nonfinite_keys,
                                     const TaskBlock& blk, uint32_t qs, int limit, int warp, int lane) {
  __syncwarp();  // every lane's staged P
  const DocInfo d = a.docs[blk.document];
  const KeyBlockRows rows = key_block_rows<Kind>(a.kv, blk.document, d.k_start, blk.head_kv, blk.kv_block);
  const int t = lane & 3;
  for (int w = 0; w < kBlock / 32; ++w) {
    uint32_t bits = nonfinite_keys[w];
    while (bits != 0) {
      const int key = 32 * w + __ffs(int(bits)) - 1;
      bits &= bits - 1;
      if (key > limit) continue;
      uint16_t pa, pb;
      asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(pa) : "r"(staged_p(qs, warp, lane >> 2, key)) : "memory");
      asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(pb) : "r"(staged_p(qs, warp, (lane >> 2) + 8, key)) : "memory");
      const float p0 = bf16_bits_to_float(pa), p1 = bf16_bits_to_float(pb);
#pragma unroll
      for (int nt = 0; nt < kNFrags; ++nt) {  // dims 8nt + 2t, +1: o[nt][0..1], o[nt][2..3]
        const float2 two = load_value_pair<Kind>(rows.v + key * a.kv.v_row, rows.vsf + key * a.kv.vsf_row, 8 * nt + 2 * t);
        const float v[2] = {two.x, two.y};  // widened values are exact in bf16
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (!isfinite(v[e])) {
            o[nt][e] += p0 * v[e];
            o[nt][2 + e] += p1 * v[e];
          }
        }
      }
    }
  }
  __syncwarp();  // before the output rows overwrite the staged P
}

// Issues S = Q K^T for warpgroup wg's 4 queries of a task (q_desc: rows 64wg.. of the Q
// stage) against the resident key tile; does not wait.
__device__ __forceinline__ void issue_scores(float (&s)[kNFrags][4], uint64_t q_desc, uint64_t k_desc) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk)
    wgmma_m64n128k16(s, q_desc + tile_desc_step(kTileRows, kk), k_desc + tile_desc_step(kTileRows, kk), kk > 0);
  wgmma_commit();
}

// Issues O = P V (P from registers) over the V tile (keys are its rows, read MN-major); does
// not wait.
__device__ __forceinline__ void issue_pv(float (&o)[kNFrags][4], const uint32_t (&p)[kKSteps][4], uint32_t v_tile) {
  wgmma_fence();
#pragma unroll
  for (int kt = 0; kt < kKSteps; ++kt)
    wgmma_m64n128k16_rs<1>(o, p[kt], tile_desc_mn_x128(v_tile, kTileRows, kt), kt > 0);
  wgmma_commit();
}

// Max (scaled to the exp2 domain) and sum of exponentials of the two rows a thread holds: the
// attention state of the (query, head, block) edge as src/attention_state.h defines it.
struct RowStats {
  float ms0, ms1, l0, l1;
};

// Quantised sources: the per-tensor K scale and the keys' per-token K scales (key_scale,
// nullptr: none) multiply the logits, before the max is taken.
__device__ __forceinline__ void scale_scores(float (&s)[kNFrags][4], float k_tensor, const float* key_scale, int t) {
#pragma unroll
  for (int nt = 0; nt < kNFrags; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = nt * 8 + 2 * t + (e & 1);
      s[nt][e] *= key_scale != nullptr ? k_tensor * key_scale[col] : k_tensor;
    }
}

// Softmax numerators of the warp's 16 rows (keys past `limit` masked) as bf16 A fragments.
// Reductions run over four partial accumulators to keep the dependency chains short.
// kValueScales: per-token V scales (value_scale, nullptr: none) multiply the numerators that
// P V reads, not the row's sum; a key past the limit stays 0 whatever its scale.
template <bool kValueScales = false>
__device__ __forceinline__ RowStats softmax_rows(float (&s)[kNFrags][4], uint32_t (&p)[kKSteps][4], int limit,
                                                 float scale_log2, int t, const float* value_scale = nullptr) {
  if (limit < kBlock - 1) {
#pragma unroll
    for (int nt = 0; nt < kNFrags; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (nt * 8 + 2 * t + (e & 1) > limit) s[nt][e] = -INFINITY;  // by selection: a NaN score goes too
  }
  float mx[2][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    mx[0][i] = fmaxf(s[i][0], s[i][1]);
    mx[1][i] = fmaxf(s[i][2], s[i][3]);
  }
#pragma unroll
  for (int nt = 4; nt < kNFrags; ++nt) {
    mx[0][nt & 3] = fmaxf(mx[0][nt & 3], fmaxf(s[nt][0], s[nt][1]));
    mx[1][nt & 3] = fmaxf(mx[1][nt & 3], fmaxf(s[nt][2], s[nt][3]));
  }
  RowStats r;
  r.ms0 = warp_max4(fmaxf(fmaxf(mx[0][0], mx[0][1]), fmaxf(mx[0][2], mx[0][3]))) * scale_log2;
  r.ms1 = warp_max4(fmaxf(fmaxf(mx[1][0], mx[1][1]), fmaxf(mx[1][2], mx[1][3]))) * scale_log2;
  float sum[2][4] = {};
#pragma unroll
  for (int kt = 0; kt < kKSteps; ++kt) {
    float e[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      e[h][0] = fast_exp2(s[2 * kt + h][0] * scale_log2 - r.ms0);
      e[h][1] = fast_exp2(s[2 * kt + h][1] * scale_log2 - r.ms0);
      e[h][2] = fast_exp2(s[2 * kt + h][2] * scale_log2 - r.ms1);
      e[h][3] = fast_exp2(s[2 * kt + h][3] * scale_log2 - r.ms1);
      sum[0][(2 * kt + h) & 3] += e[h][0] + e[h][1];
      sum[1][(2 * kt + h) & 3] += e[h][2] + e[h][3];
      if constexpr (kValueScales) {
        if (value_scale != nullptr) {
          const int c0 = 16 * kt + 8 * h + 2 * t;
          const float v0 = c0 <= limit ? value_scale[c0] : 0.f, v1 = c0 + 1 <= limit ? value_scale[c0 + 1] : 0.f;
          e[h][0] *= v0, e[h][1] *= v1, e[h][2] *= v0, e[h][3] *= v1;
        }
      }
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

// ---- epilogue -----------------------------------------------------------------------------

// Stages the warp's 16 unnormalised output rows in its own (already consumed) Q rows of the
// stage and has TMA write them to partial slot m.slot, with each row's max and sum. Lane 0
// commits one bulk group per task (empty for an absent query), so that the caller can wait for
// the stage to be read before handing it back.
__device__ __forceinline__ void store_partial(const ForwardArgs& a, const CUtensorMap* part_map,
                                              const float (&o)[kNFrags][4], const RowStats& r, const QueryMeta& m,
                                              uint32_t qs, int warp, int lane) {
  if (m.row >= 0) {
    const int r16 = kGroup * warp;
#pragma unroll
    for (int k = 0; k < kNFrags / 2; ++k)
      store_rows_x16(qs, kTileRows, r16, k, lane, pack_bf16(o[2 * k][0], o[2 * k][1]),
                     pack_bf16(o[2 * k][2], o[2 * k][3]), pack_bf16(o[2 * k + 1][0], o[2 * k + 1][1]),
                     pack_bf16(o[2 * k + 1][2], o[2 * k + 1][3]));
    fence_proxy_async();  // the stmatrix writes are read by TMA next
    __syncwarp();
    const int64_t out_row = (m.slot * a.window + (m.row - a.q_lo)) * a.Hq + kGroup * m.head_kv;
    if (lane == 0) {  // partial outputs are read back only by the merge, long after
      const uint64_t stream = l2_evict_first();
      tma_store_2d(part_map, 0, int(out_row), qs + r16 * kBoxRowBytes, stream);
      tma_store_2d(part_map, kDim / 2, int(out_row), qs + kBoxBytes + r16 * kBoxRowBytes, stream);
    }
    if ((lane & 3) == 0) {
      a.part_ml[out_row + (lane >> 2)] = make_float2(r.ms0, r.l0);
      a.part_ml[out_row + (lane >> 2) + 8] = make_float2(r.ms1, r.l1);
    }
  }
  if (lane == 0) bulk_commit();
}

// ---- consumer loop ------------------------------------------------------------------------

// The consumers, software-pipelined over tasks: while task n's outputs are normalised and
// stored, the tensor cores already compute S of task n + 1 (when it reads the same key block,
// or, for a TMA source, the next one, whose K the producer has staged in the other K tile).
template <KvSourceKind Kind>
__device__ void run_consumer(const ForwardArgs& a, const CUtensorMap* part_map, const CUtensorMap* v_map, int ntasks,
                             const Smem<Kind>& sm, int tid) {
  const int warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, t4 = lane & 3;
  TaskBlock loaded{-1, -1, -1, 0};
  int u = -1;                     // key blocks entered so far, minus one: the resident one's K is tile u % 2
  uint64_t k_desc = 0;
  bool loaded_nonfinite = false;  // the resident block holds an inf or NaN value (CTA-uniform)
  bool values_pending = false;    // TMA sources: the resident block's V is not yet landed and scrubbed
  // Waits for task n's Q stage; returns its key block.
  auto wait_task = [&](int n) {
    mbar_wait(sm.full(n % kQStages), (n / kQStages) & 1);
    fence_proxy_async();  // the cp.async rows are read by wgmma next
    return load_block(&sm.meta(n % kQStages).block);
  };
  // Enters key block `blk` (its u-th): a TMA source's K was staged by the producer (the old
  // block's K tile goes back to it) and its V is requested here, waited for before the first
  // P V (finish_values); a quantised source's tiles are widened here.
  auto load_block_tiles = [&](const TaskBlock& blk) {
    sync_barrier(ForwardBarrier::kKeyBlock, kConsumers);  // every consumer is done with the old block
    if (loaded_nonfinite) {  // rare: clear the old block's marks before any new one is set
      if (tid < kBlock / 32) sm.nonfinite_keys()[tid] = 0;
      sync_barrier(ForwardBarrier::kKeyBlock, kConsumers);
    }
    ++u;
    loaded = blk;
    k_desc = sw128_desc(sm.k(u & 1));
    if constexpr (kTmaSource<Kind>) {
      if (tid == 0) {
        if (u > 0) mbar_arrive(sm.k_empty((u - 1) & 1));
        mbar_arrive_expect_tx(sm.v_full(), kTileBytes);
        load_block_side<Kind>(sm.v(), v_map, blk, sm.v_full());
      }
      mbar_wait(sm.k_full(u & 1), (u >> 1) & 1);
      loaded_nonfinite = false;
      values_pending = true;
    } else {
      loaded_nonfinite = widen_key_block<Kind>(a, blk, sm, sm.k(u & 1), u, tid);
    }
  };
  // TMA sources, before the first P V of a block: V has landed; its non-finite values are set
  // aside (scrub_values) before the tensor cores read it.
  auto finish_values = [&] {
    if constexpr (kTmaSource<Kind>) {
      if (values_pending) {
        mbar_wait(sm.v_full(), u & 1);
        const bool mine = scrub_values(sm, tid);
        fence_proxy_async();
        loaded_nonfinite = sync_barrier_or(ForwardBarrier::kKeyBlock, kConsumers, mine);
        values_pending = false;
      }
    }
  };
  float s[kNFrags][4];
  // Quantised sources' scales (kv_source.cuh). A per-tensor K scale that is positive and finite
  // (as the contract asks; a device value is not checked on the host) folds into the softmax's
  // scale, and the merge applies the per-tensor V scale: no work per element. Per-token scales
  // (in shared memory), or an unusable K scale, are applied to each logit and probability.
  float scale_log2 = a.scale_log2, k_tensor = 1.f;
  const float* key_scales = nullptr;
  const float* value_scales = nullptr;
  bool per_element = false;
  if constexpr (kQuantisedSource<Kind>) {
    if (a.kv.k_tensor_scale != nullptr) k_tensor = *a.kv.k_tensor_scale;
    if (a.kv.k_token_scale != nullptr) key_scales = sm.key_scale(), value_scales = sm.value_scale();
    per_element = key_scales != nullptr || !(k_tensor > 0.f && k_tensor <= FLT_MAX);
    if (!per_element) scale_log2 *= k_tensor;
  }
  auto softmax = [&](uint32_t(&p)[kKSteps][4], int limit) {
    if constexpr (kQuantisedSource<Kind>) {
      if (per_element) {
        scale_scores(s, k_tensor, key_scales, t4);
        return softmax_rows<true>(s, p, limit, a.scale_log2, t4, value_scales);
      }
    }
    return softmax_rows(s, p, limit, scale_log2, t4);
  };
  auto q_desc = [&](int n) { return sw128_desc(sm.q(n % kQStages) + (kTileRows / 2) * wg * kBoxRowBytes); };
  load_block_tiles(wait_task(0));
  issue_scores(s, q_desc(0), k_desc);
  for (int n = 0;; ++n) {
    const int stage = n % kQStages;
    const uint32_t qs = sm.q(stage);
    const QueryMeta m = load_meta(&sm.meta(stage).query[warp]);
    wgmma_wait<0>();
    // Every warp's Q rows are read before any warp reuses them.
    warpgroup_barrier(int(ForwardBarrier::kWarpgroup0) + wg);
    uint32_t p[kKSteps][4];
    const RowStats r = softmax(p, m.limit);
    finish_values();
    if (loaded_nonfinite) stage_p(p, qs, warp, lane);
    float o[kNFrags][4];
    issue_pv(o, p, sm.v());
    // S of the next task goes to the tensor cores now if its key block is already resident;
    // otherwise an empty group keeps the wait below the same on every path.
    const bool more = __all_sync(0xffffffffu, n + 1 < ntasks);
    TaskBlock next_blk{-1, -1, -1, 0};
    if (more) next_blk = wait_task(n + 1);
    // (A warp vote: the wgmma below must be seen as taken by whole warps.)
    const bool same_block = __all_sync(0xffffffffu, more && next_blk.same(loaded));
    // A TMA source's next block has its K in the other tile (staged by the producer once the
    // consumers entered this block): its S can start before this task's epilogue too.
    const bool next_k_staged = kTmaSource<Kind> && more && !same_block;
    if (same_block) {
      issue_scores(s, q_desc(n + 1), k_desc);
    } else if (next_k_staged) {
      mbar_wait(sm.k_full((u + 1) & 1), ((u + 1) >> 1) & 1);
      issue_scores(s, q_desc(n + 1), sw128_desc(sm.k((u + 1) & 1)));
    } else {
      wgmma_commit();
    }
    wgmma_wait<1>();  // O of task n is complete
    // Entering the next block now requests its V before this task's partial is stored; the
    // old block's inf / NaN marks (rare) are still needed below, so then it waits.
    const bool enter_now = next_k_staged && !loaded_nonfinite;
    if (enter_now) load_block_tiles(next_blk);
    if (loaded_nonfinite) add_nonfinite_values<Kind>(a, o, sm.nonfinite_keys(), loaded, qs, m.limit, warp, lane);
    store_partial(a, part_map, o, r, m, qs, warp, lane);
    // Task n - 1's stage goes back to the producers once its output rows have been read out.
    if (lane == 0) {
      bulk_wait_read<1>();
      if (n > 0) mbar_arrive(sm.empty((n - 1) % kQStages));
    }
    if (!more) break;
    if (!same_block && !enter_now) {
      load_block_tiles(next_blk);
      if (!next_k_staged) issue_scores(s, q_desc(n + 1), k_desc);
    }
  }
  wgmma_wait<0>();
  if (lane == 0) bulk_wait_read<0>();  // shared memory stays valid until TMA has read it
}

// k_map / v_map: TMA maps of a bf16 source's K and V (unused for quantised sources).
template <KvSourceKind Kind>
__global__ void __launch_bounds__(kThreads, 1)
    forward_tasks_kernel(const ForwardArgs a, const __grid_constant__ CUtensorMap q_map,
                         const __grid_constant__ CUtensorMap part_map, const __grid_constant__ CUtensorMap k_map,
                         const __grid_constant__ CUtensorMap v_map) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (a.status[0] != 0) return;
  const CtaTasks tasks = cta_tasks(a);
  const int64_t ntasks = tasks.count();
  if (ntasks == 0) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const uint32_t base = align1024(smem_addr(smem));
  const Smem<Kind> sm{base, reinterpret_cast<typename Smem<Kind>::Storage*>(smem + (base - smem_addr(smem)))};
  if (tid == 0) {
    for (int i = 0; i < kQStages; ++i) {
      mbar_init(sm.full(i), kProducerWarps);  // lane 0 of each producer warp (with its TMA bytes)
      mbar_init(sm.empty(i), kConsumerWarps);
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(sm.k_full(b), 1);   // the producer's expect_tx, with the TMA bytes
      mbar_init(sm.k_empty(b), 1);  // consumer thread 0, after the consumers' barrier
    }
    mbar_init(sm.v_full(), 1);      // consumer thread 0's expect_tx, with the TMA bytes
    mbar_init(sm.raw_full(), 1);    // the producer's expect_tx, with the TMA bytes
    mbar_init(sm.raw_empty(), 1);   // consumer thread 0, after the consumers' barrier
    for (int i = 0; i < kBlock / 32; ++i) sm.nonfinite_keys()[i] = 0;
  }
  __syncthreads();

  if (warp >= kConsumerWarps) {
    setmaxnreg_dec<kProducerRegs>();
    run_producer<Kind>(a, &q_map, &k_map, &v_map, tasks, ntasks, sm, warp - kConsumerWarps, lane);
    return;
  }
  setmaxnreg_inc<kConsumerRegs>();
  run_consumer<Kind>(a, &part_map, &v_map, int(ntasks), sm, tid);  // ntasks >= 1
}

// Merges the partial states of every (query, head) of a window, queries [q_lo, q_lo + count)
// (their partials at rows 0 .. count - 1 of the window's `window` rows): thread = 8 output dims
// of one (query, head). Partial s is the attention state (m_s, l_s, O_s) of one selected block
// (src/attention_state.h: scores in log2 units, O_s unnormalised); the merge, the division and
// the LSE, and the rules for empty rows and non-finite sums, are that header's. The
// slots are read in batches of 4 (the loads of a batch in flight together), which keeps the
// kernel at 64 registers: 32 resident warps per SM overlap the dependent loads (counts, maxima,
// partials) of many rows, which is what this memory-bound kernel needs. A quantised source's
// per-tensor V scale (value_scale; nullptr: none) multiplies the merged output.
constexpr int kMergeThreads = 256;
constexpr int kMergeChunks = kDim / 8;  // threads per (query, head): 8 dims each
static_assert(kMergeChunks == 16, "the merge's shifts");
template <typename Out>
__global__ void __launch_bounds__(kMergeThreads, 4)
    forward_merge_kernel(const __nv_bfloat16* __restrict__ part_o, const float2* __restrict__ part_ml,
                         const int32_t* __restrict__ split_counts, const int32_t* __restrict__ status, int64_t q_lo,
                         int64_t count, int64_t window, int Hq, int Hkv, const float* __restrict__ value_scale,
                         Out* __restrict__ out, float* __restrict__ lse) {
  const int64_t gid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid >= count * Hq * kMergeChunks) return;
  const int64_t wqh = gid >> 4;  // (query - q_lo) * Hq + head (kMergeChunks threads each)
  const int64_t qh = q_lo * Hq + wqh;
  const int chunk = int(gid & 15);
  const int64_t q = qh / Hq;
  const int h = int(qh % Hq);
  const int C = split_counts[q * Hkv + h / kGroup];
  const int64_t slot_stride = window * Hq;
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  float result_lse = -INFINITY;
  if (status[0] != 0) {
    result_lse = NAN;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = NAN;
  } else if (C > 0) {
    const float2* ml_row = part_ml + wqh;                   // slot s at ml_row[s * slot_stride]
    const __nv_bfloat16* o_row = part_o + wqh * kDim + chunk * 8;  // slot s at o_row[s * slot_stride * kDim]
    // Two passes: the common max first (the maxima are read again with the partials; they are
    // cached), then every slot's sum and values weighted against it.
    SoftmaxState row = SoftmaxState::empty();
#pragma unroll
    for (int s = 0; s < kSlots; ++s)
      if (s < C) row.m = state_math::max(row.m, ml_row[s * slot_stride].x);
#pragma unroll
    for (int batch = 0; batch < kSlots / 4; ++batch) {
      uint4 raw[4];
      float2 ml[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int s = 4 * batch + i;
        if (s < C) {
          raw[i] = *reinterpret_cast<const uint4*>(o_row + s * slot_stride * kDim);
          ml[i] = ml_row[s * slot_stride];
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int s = 4 * batch + i;
        if (s >= C) continue;
        const float w = row.add_at_max(SoftmaxState{ml[i].x, ml[i].y});
        const uint32_t words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc[2 * e] += w * bf16_bits_to_float(uint16_t(words[e] & 0xffff));
          acc[2 * e + 1] += w * bf16_bits_to_float(uint16_t(words[e] >> 16));
        }
      }
    }
    // acc is the unnormalised output of `row`; AttentionState::normalise's rule, written out
    // here: with the wrapper's own accumulators this kernel compiled differently and ran 6 %
    // slower (ncu, docs/performance.md run 15); written so, its SASS is the earlier kernel's.
    if (row.valid()) {
      const float inv = (value_scale != nullptr ? *value_scale : 1.f) / row.d;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= inv;
      result_lse = row.lse();
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    }
  }
  Out* dst = out + qh * kDim + chunk * 8;
  if constexpr (sizeof(Out) == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
  } else {
    st_global_v4(dst, make_uint4(pack_bf16(acc[0], acc[1]), pack_bf16(acc[2], acc[3]), pack_bf16(acc[4], acc[5]),
                                 pack_bf16(acc[6], acc[7])));
  }
  if (chunk == 0) lse[qh] = result_lse;
}

// TMA maps of a source's K and V sides: bf16 packed [tokens, Hkv, 128] in blocks of 128 tokens
// of one head, bf16 or FP8 paged [pages, Hkv, 128, 128] a page of one head at a time (empty
// maps for NVFP4, which the kernel reads without TMA).
struct KvMaps {
  CUtensorMap k{}, v{};
};

KvMaps kv_maps(const ForwardLaunch& f) {
  KvMaps m;
  const KvSource& kv = f.kv;
  if (f.kind == KvSourceKind::packed_bf16) {
    m.k = bf16_head_tile_map(kv.k, f.k_extent, f.Hkv, kv.k_row / 2, kv.k_head / 2, 1, "k", kBlock);
    m.v = bf16_head_tile_map(kv.v, f.v_extent, f.Hkv, kv.v_row / 2, kv.v_head / 2, 1, "v", kBlock);
  } else if (f.kind == KvSourceKind::paged_bf16) {
    m.k = paged_cache_map(kv.k, f.k_extent, f.Hkv, kRowBytes, kv.k_page, kv.k_head, kv.k_row, "k_cache");
    m.v = paged_cache_map(kv.v, f.v_extent, f.Hkv, kRowBytes, kv.v_page, kv.v_head, kv.v_row, "v_cache");
  } else if (f.kind == KvSourceKind::paged_fp8) {  // whole 128-byte rows of codes, unswizzled
    m.k = paged_cache_map(kv.k, f.k_extent, f.Hkv, kDim, kv.k_page, kv.k_head, kv.k_row, "k_cache");
    m.v = paged_cache_map(kv.v, f.v_extent, f.Hkv, kDim, kv.v_page, kv.v_head, kv.v_row, "v_cache");
  }
  return m;
}

template <KvSourceKind Kind>
void launch_tasks(const ForwardArgs& a, const CUtensorMap& q_map, const CUtensorMap& part_map, const KvMaps& kv,
                  int grid, cudaStream_t s) {
  MSA_CUDA_CHECK(
      cudaFuncSetAttribute(forward_tasks_kernel<Kind>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes<Kind>));
  forward_tasks_kernel<Kind><<<grid, kThreads, kSmemBytes<Kind>, s>>>(a, q_map, part_map, kv.k, kv.v);
  MSA_CUDA_CHECK_LAUNCH("forward_tasks_kernel");
}

}  // namespace

void set_forward_windows(ForwardLaunch& f, const PlanState& state) {
  if (state.forward_windows <= 1) return;
  f.window = state.forward_window;
  f.window_begin = i32(state.window_begin);
  f.straddle_begin = i32(state.straddle_begin);
  f.straddle_items = i32(state.straddle_items);
}

// Window by window: its tasks write its queries' partials, its merge reads them, and the next
// window reuses the space (the stream orders the four).
void run_sparse_forward(const ForwardLaunch& f, cudaStream_t s) {
  const int64_t Tq = f.total_q;
  if (Tq == 0) return;
  ForwardArgs a{};
  a.kv = f.kv;
  a.schedule = f.schedule;
  a.work_count = f.work_count;
  a.full_items = f.full_items;
  a.q_indices = f.q_indices;
  a.split_slot = f.split_slot;
  a.docs = f.docs;
  a.order = f.order;
  a.status = f.status;
  a.part_ml = static_cast<float2*>(f.part_ml);
  a.total_q = Tq;
  a.Hq = f.Hq;
  a.Hkv = f.Hkv;
  a.nsub = int(ceil_div(f.q_per_cta, kQueriesPerTask));
  a.scale_log2 = f.softmax_scale * math::kLog2e;
  a.window = f.window > 0 && f.window < Tq ? f.window : Tq;
  const int64_t windows = ceil_div(Tq, a.window);
  const bool windowed = windows > 1;
  detail::require(!windowed || (f.order != nullptr && f.window_begin && f.straddle_begin && f.straddle_items),
                  "the forward's windows need the plan's walking order and window tables");
  if (windowed) {
    a.window_begin = f.window_begin;
    a.straddle_begin = f.straddle_begin;
    a.straddle_items = f.straddle_items;
  }
  const int64_t max_tasks = f.schedule_capacity * a.nsub;
  auto* part_o = static_cast<__nv_bfloat16*>(f.part_o);
  CUtensorMap q_map{}, part_map{};
  KvMaps kv;
  if (max_tasks > 0) {
    q_map = bf16_head_tile_map(f.q.data, Tq, f.Hq, f.q.stride[0], f.q.stride[1], kGroup, "q");
    part_map = bf16_row_tile_map(part_o, kSlots * a.window * a.Hq, kGroup, "the partial-output workspace");
    kv = kv_maps(f);
  }
  const int grid = int(std::min<int64_t>(max_tasks, sm_count()));
  const float* v_scale = f.kv.v_tensor_scale;  // quantised sources only (nullptr otherwise)
  for (int w = 0; w < windows; ++w) {
    a.window_index = w;
    a.q_lo = w * a.window;
    a.q_hi = std::min(Tq, a.q_lo + a.window);
    if (max_tasks > 0) {
      switch (f.kind) {
        case KvSourceKind::packed_bf16: launch_tasks<KvSourceKind::packed_bf16>(a, q_map, part_map, kv, grid, s); break;
        case KvSourceKind::paged_bf16: launch_tasks<KvSourceKind::paged_bf16>(a, q_map, part_map, kv, grid, s); break;
        case KvSourceKind::paged_fp8: launch_tasks<KvSourceKind::paged_fp8>(a, q_map, part_map, kv, grid, s); break;
        case KvSourceKind::paged_nvfp4: launch_tasks<KvSourceKind::paged_nvfp4>(a, q_map, part_map, kv, grid, s); break;
      }
    }
    const int64_t count = a.q_hi - a.q_lo;
    const int blocks = int(ceil_div(count * f.Hq * kMergeChunks, kMergeThreads));
    if (f.out.dtype == DType::f32) {
      forward_merge_kernel<float><<<blocks, kMergeThreads, 0, s>>>(part_o, a.part_ml, f.split_counts, a.status, a.q_lo,
                                                                   count, a.window, a.Hq, a.Hkv, v_scale,
                                                                   f.out.as<float>(), f.lse.as<float>());
    } else {
      forward_merge_kernel<__nv_bfloat16><<<blocks, kMergeThreads, 0, s>>>(
          part_o, a.part_ml, f.split_counts, a.status, a.q_lo, count, a.window, a.Hq, a.Hkv, v_scale,
          f.out.as<__nv_bfloat16>(), f.lse.as<float>());
    }
    MSA_CUDA_CHECK_LAUNCH("forward_merge_kernel");
  }
}

void sparse_attention_forward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan,
                              const AttentionForwardParams& p, const RunOptions& opt) {
  DeviceGuard guard(p.q.device.index);
  const PlanState& st = plan_state(plan);
  const WorkspaceLayout w = workspace_layout(topo, L, WorkspaceCall::forward, false);
  ForwardLaunch f;
  f.kind = KvSourceKind::packed_bf16;
  const int64_t row_bytes = int64_t(topo.num_kv_heads) * kDim * 2;  // one packed token, all KV heads
  f.kv.k = static_cast<const uint8_t*>(p.k.data);
  f.kv.v = static_cast<const uint8_t*>(p.v.data);
  f.kv.k_row = f.kv.v_row = row_bytes;
  f.kv.k_head = f.kv.v_head = kDim * 2;
  f.k_extent = p.k.shape[0];
  f.v_extent = p.v.shape[0];
  f.q = p.q;
  f.schedule = static_cast<const WorkItem*>(plan.schedule.data());
  f.schedule_capacity = st.schedule_capacity;
  f.work_count = i32(plan.work_count_dev);
  f.full_items = i32(st.schedule_full);
  f.q_indices = i32(plan.q_indices);
  f.split_slot = i32(plan.split_slot);
  f.split_counts = i32(plan.split_counts);
  f.status = i32(plan.status);
  f.docs = doc_ptr(st);
  f.order = forward_order_ptr(st);
  f.q_per_cta = plan.q_per_cta;
  set_forward_windows(f, st);
  void* const scratch = call_workspace(st, p.workspace);
  f.part_o = ws<__nv_bfloat16>(scratch, w.part_o);
  f.part_ml = ws<float2>(scratch, w.part_ml);
  f.total_q = L.total_q();
  f.Hq = topo.num_q_heads;
  f.Hkv = topo.num_kv_heads;
  f.softmax_scale = topo.attention_scale();
  f.out = p.out;
  f.lse = p.lse;
  run_sparse_forward(f, as_stream(opt));
}

}  // namespace msa::cuda
