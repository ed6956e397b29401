// build_plan on the device: validates the selection, inverts it into the k2q CSR (rows
// level-major, queries ascending within a row), assigns partial slots and cuts rows into
// work items. The host reads only the layout; nothing here waits for the device, and all
// memory comes from the device allocator (include/msa/tensor.h), so plans can be built
// during CUDA-graph capture.
//
// Edges (head, query, slot) are sorted by (head, row) with a stable radix sort; since they
// are generated in (head, query) order, the queries of every row come out ascending.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cooperative_groups.h>

#include <algorithm>
#include <limits>

#include "backend.h"
#include "msa/constants.h"
#include "plan_records.h"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/device_layout.cuh"
#include "cuda/plan_build.h"
#include "core/buffer_pack.h"
#include "core/walk_order.h"
#include "cuda/scratch.h"
#include "cuda/workspace.h"

namespace msa::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kTopk = model::kTopk;
constexpr int kBlockShift = 7;  // key block of a position: pos >> kBlockShift
static_assert(1 << kBlockShift == model::kBlockSize);
// An edge's value packs (query within its document, the edge's partial slot < kTopk).
constexpr int kSlotBits = 4;
static_assert(1 << kSlotBits == kTopk);

int blocks_for(int64_t n) { return int(std::max<int64_t>(1, ceil_div(n, kThreads))); }

int bits_for(int64_t max_value) {
  int bits = 1;
  while ((int64_t(1) << bits) <= max_value) ++bits;
  return bits;
}

__device__ __forceinline__ int64_t lower_bound(const int32_t* a, int64_t n, int32_t v) {
  int64_t l = 0, r = n;
  while (l < r) {
    const int64_t m = (l + r) >> 1;
    if (a[m] < v) l = m + 1; else r = m;
  }
  return l;
}

__device__ __forceinline__ int64_t upper_bound(const int32_t* a, int64_t n, int32_t v) {
  int64_t l = 0, r = n;
  while (l < r) {
    const int64_t m = (l + r) >> 1;
    if (a[m] <= v) l = m + 1; else r = m;
  }
  return l;
}

// The kTopk edges of (head, query) pair idx = head * total_q + query: validates the ids and
// gives one (key, value) per slot: key = head * rows + row (or `sentinel` = Hkv * rows for an
// unused slot), value = local query * kTopk + the edge's partial slot (number of the query's
// valid blocks with a smaller id). Writes the pair's split count; a bad id flags `status`
// (first one wins) and drops all of the pair's edges.
struct EdgeArgs {
  const int32_t* topk;  // [Hkv, total_q, kTopk]
  int32_t total_q;
  int Hkv, B;
  const int32_t* cu_q;
  const DocInfo* docs;
  const int32_t* doc_row_base;
  const int32_t* row_of;
  int32_t total_rows;
  int32_t* split_counts;  // [total_q, Hkv]
  int32_t* status;        // [4]
};

__device__ __forceinline__ void query_edges(const EdgeArgs& a, int64_t idx, int32_t (&key)[kTopk],
                                            int32_t (&val)[kTopk]) {
  const int h = int(idx / a.total_q);
  const int32_t q = int32_t(idx % a.total_q);
  const int b = find_document(a.cu_q, a.B, q);
  const DocInfo d = a.docs[b];
  const int32_t ql = q - d.q_start;
  const int32_t local = (d.k_len - d.q_len + ql) >> kBlockShift;
  int32_t ids[kTopk];
  const int4* src = reinterpret_cast<const int4*>(a.topk + idx * kTopk);
#pragma unroll
  for (int i = 0; i < kTopk / 4; ++i) {
    const int4 v = src[i];
    ids[4 * i] = v.x; ids[4 * i + 1] = v.y; ids[4 * i + 2] = v.z; ids[4 * i + 3] = v.w;
  }
  int bad = -1, count = 0;
  bool ended = false;
#pragma unroll
  for (int s = 0; s < kTopk; ++s) {
    const int32_t id = ids[s];
    bool wrong = false;
    if (id < 0) {
      wrong = id != -1;
      ended = true;
    } else {
      wrong = ended || id > local;
#pragma unroll
      for (int t = 0; t < s; ++t) wrong |= ids[t] == id;
      ++count;
    }
    if (wrong && bad < 0) bad = s;
  }
  const int32_t sentinel = a.Hkv * a.total_rows;
  if (bad >= 0) {
    if (atomicCAS(a.status, 0, 1) == 0) {
      a.status[1] = h;
      a.status[2] = q;
      a.status[3] = bad;
    }
    count = 0;
  }
  a.split_counts[int64_t(q) * a.Hkv + h] = count;
  const int32_t base = b < a.B ? a.doc_row_base[b] : 0;
#pragma unroll
  for (int s = 0; s < kTopk; ++s) {
    const int32_t id = ids[s];
    key[s] = sentinel, val[s] = 0;
    if (bad < 0 && id >= 0) {
      int rank = 0;
#pragma unroll
      for (int t = 0; t < kTopk; ++t) rank += (ids[t] >= 0 && ids[t] < id) ? 1 : 0;
      key[s] = h * a.total_rows + a.row_of[base + id];
      val[s] = (ql << kSlotBits) + rank;
    }
  }
}

// One thread per (head, query): the pair's edges into keys / vals [Hkv * total_q * kTopk].
__global__ void plan_edges_kernel(const EdgeArgs a, int32_t* __restrict__ keys, int32_t* __restrict__ vals) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(a.Hkv) * a.total_q) return;
  int32_t key[kTopk], val[kTopk];
  query_edges(a, idx, key, val);
#pragma unroll
  for (int s = 0; s < kTopk; ++s) {
    keys[idx * kTopk + s] = key[s];
    vals[idx * kTopk + s] = val[s];
  }
}

__global__ void plan_scatter_kernel(const int32_t* __restrict__ keys, const int32_t* __restrict__ vals, int64_t n,
                                    int32_t total_rows, int32_t sentinel, int64_t edges_per_head,
                                    int32_t* __restrict__ q_indices, int32_t* __restrict__ split_slot) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t key = keys[i];
  if (key >= sentinel) return;
  const int h = key / total_rows;
  const int64_t head_start = lower_bound(keys, n, h * total_rows);
  const int64_t pos = int64_t(h) * edges_per_head + (i - head_start);
  q_indices[pos] = vals[i] >> kSlotBits;
  split_slot[pos] = vals[i] & (kTopk - 1);
}

__global__ void plan_row_ptr_kernel(const int32_t* __restrict__ keys, int64_t n, int Hkv, int32_t total_rows,
                                    int32_t* __restrict__ row_ptr) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(Hkv) * (total_rows + 1)) return;
  const int h = int(i / (total_rows + 1));
  const int32_t r = int32_t(i % (total_rows + 1));
  const int64_t head_start = lower_bound(keys, n, h * total_rows);
  row_ptr[i] = int32_t(lower_bound(keys, n, h * total_rows + r) - head_start);
}

// Work items of at most `per_item` queries: per (head, row) the full items, then the tail.
__global__ void items_count_kernel(const int32_t* __restrict__ row_ptr, int Hkv, int32_t total_rows, int per_item,
                                   int32_t* __restrict__ nfull, int32_t* __restrict__ tail_key,
                                   int32_t* __restrict__ tail_val) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= int64_t(Hkv) * total_rows) return;
  const int h = int(n / total_rows);
  const int32_t r = int32_t(n % total_rows);
  const int32_t* rp = row_ptr + int64_t(h) * (total_rows + 1);
  const int32_t count = rp[r + 1] - rp[r];
  nfull[n] = count / per_item;
  const int32_t tail = count % per_item;
  tail_key[n] = tail > 0 ? per_item - tail : per_item;
  tail_val[n] = int32_t(n);
}

__device__ __forceinline__ void write_item(WorkItem* item, int h, int32_t r, int32_t q_begin, int32_t q_count,
                                           const int32_t* rows) {
  *item = WorkItem{.head_kv = h,
                   .row = r,
                   .q_begin = q_begin,
                   .q_count = q_count,
                   .document = rows[2 * r],
                   .kv_block = rows[2 * r + 1]};
}

__global__ void items_fill_full_kernel(const int32_t* __restrict__ row_ptr, const int32_t* __restrict__ nfull,
                                       const int32_t* __restrict__ full_pos, int64_t N, int32_t total_rows,
                                       int per_item, int64_t capacity, const int32_t* __restrict__ rows,
                                       WorkItem* __restrict__ items) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= capacity || N == 0) return;
  const int64_t total_full = int64_t(full_pos[N - 1]) + nfull[N - 1];
  if (i >= total_full) return;
  const int64_t n = upper_bound(full_pos, N, int32_t(i)) - 1;
  const int h = int(n / total_rows);
  const int32_t r = int32_t(n % total_rows);
  const int32_t c = int32_t(i - full_pos[n]);
  const int32_t begin = row_ptr[int64_t(h) * (total_rows + 1) + r] + c * per_item;
  write_item(items + i, h, r, begin, per_item, rows);
}

__global__ void items_fill_tail_kernel(const int32_t* __restrict__ row_ptr, const int32_t* __restrict__ nfull,
                                       const int32_t* __restrict__ full_pos, const int32_t* __restrict__ sorted_key,
                                       const int32_t* __restrict__ sorted_val, int64_t N, int32_t total_rows,
                                       int per_item, const int32_t* __restrict__ rows, WorkItem* __restrict__ items,
                                       int32_t* __restrict__ tail_index, int32_t* __restrict__ work_count,
                                       int32_t* __restrict__ full_count) {
  const int64_t P = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (P >= N) return;
  const int64_t total_full = int64_t(full_pos[N - 1]) + nfull[N - 1];
  if (P == 0) {
    *work_count = int32_t(total_full + lower_bound(sorted_key, N, per_item));
    if (full_count) *full_count = int32_t(total_full);
  }
  const int32_t key = sorted_key[P];
  if (key >= per_item) return;
  const int64_t n = sorted_val[P];
  const int h = int(n / total_rows);
  const int32_t r = int32_t(n % total_rows);
  const int32_t begin = row_ptr[int64_t(h) * (total_rows + 1) + r] + nfull[n] * per_item;
  const int64_t index = total_full + P;
  write_item(items + index, h, r, begin, per_item - key, rows);
  if (tail_index) tail_index[n] = int32_t(index);
}

// ---- the whole schedule in one cluster -----------------------------------------------------
// A small step spends its schedule build on launch latencies: six memsets and a dozen kernels
// (edges, radix sort, scatter, row pointers, item count / scan / sort / fill), ~75 us for 182
// queries on an H200, for a few thousand edges. One cluster of one CTA per KV head does the
// same work in shared memory and writes the same schedule: CTA h takes the edges of head h's
// queries, its row pointers (an exclusive scan of the per-row counts), its rows' queries in
// ascending order (every edge placed in its row, then ranked by query within it) and its items;
// the heads' item counts are exchanged through distributed shared memory, so that the full items
// come in (head, row) order, then the partial items by size descending and (head, row) order.
constexpr int kSmallThreads = 1024;
constexpr int kSmallWarps = kSmallThreads / 32;
constexpr int64_t kSmallMaxEdges = 32768;  // a head's edges held in shared memory: 2048 queries
constexpr int64_t kSmallMaxRows = 8192;    // a head's row counters
constexpr int kSmallMaxHeads = 8;          // CTAs of the cluster (the portable cluster size)
constexpr int kSmallMaxPerItem = 64;       // partial item sizes ranked per warp
constexpr int kSmallLongRow = 16;          // rows with more edges are ranked by a warp through a bitmap
constexpr int kSmallEdgesPerThread = int(kSmallMaxEdges / kSmallThreads);
// An edge in one int: its row key within the head (<= kSmallMaxRows, the sentinel included)
// above its value (local query * kTopk + slot; local queries < kSmallMaxEdges / kTopk).
constexpr int kSmallValueBits = 15;
constexpr int kSmallBitmapWords = int(kSmallMaxEdges / kTopk / 32);  // a warp's bitmap of local queries
static_assert(kSmallMaxEdges <= (1 << kSmallValueBits) && kSmallMaxRows < (1 << (31 - kSmallValueBits)));
static_assert(kSmallWarps == 32 && kSmallBitmapWords % 32 == 0);
__device__ __forceinline__ int32_t small_key(int32_t edge) { return edge >> kSmallValueBits; }
// From the item counts on, a row's first edge and its edge count share one int (a row has at
// most one edge a local query).
constexpr int kSmallLenBits = 12;
static_assert(kSmallMaxEdges / kTopk < (1 << kSmallLenBits) && kSmallMaxEdges < (1 << (31 - kSmallLenBits)));
__device__ __forceinline__ int32_t pack_row(int32_t start, int32_t len) { return start << kSmallLenBits | len; }
__device__ __forceinline__ int32_t row_len(int32_t packed) { return packed & ((1 << kSmallLenBits) - 1); }
__device__ __forceinline__ int32_t row_start(int32_t packed) { return packed >> kSmallLenBits; }
__device__ __forceinline__ int32_t small_value(int32_t edge) { return edge & ((1 << kSmallValueBits) - 1); }

struct SmallScheduleArgs {
  EdgeArgs edges;
  const int32_t* rows;   // [total_rows, 2]: (document, block) of a row
  int per_item;
  int64_t capacity;      // schedule items
  int32_t* q_indices;    // [Hkv, total_q * kTopk]
  int32_t* split_slot;
  int32_t* row_ptr;      // [Hkv, rows + 1]
  WorkItem* items;       // [capacity]
  int32_t* work_count;
  int32_t* full_count;
};

bool small_schedule_fits(int Hkv, int64_t total_q, int64_t rows, int per_item) {
  return total_q > 0 && Hkv >= 1 && Hkv <= kSmallMaxHeads && total_q * kTopk <= kSmallMaxEdges &&
         rows <= kSmallMaxRows && per_item <= kSmallMaxPerItem;
}

// Dynamic shared memory of a head's CTA: its edges, two counters a row, the warps' tails and bitmaps.
int64_t small_schedule_smem(int64_t head_edges, int64_t rows) {
  return (head_edges + 2 * rows + int64_t(kSmallWarps) * (kSmallMaxPerItem + 2 * kSmallBitmapWords)) * 4;
}

// Inclusive prefix sum of v over the lanes of a warp.
__device__ __forceinline__ int32_t warp_inclusive_scan(int32_t v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t x = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += x;
  }
  return v;
}

// Exclusive scan of in[0, n) into out (they may alias) by the whole CTA; returns the total.
// Thread t scans a run of consecutive elements, then the runs' sums are scanned.
__device__ int32_t block_exclusive_scan(const int32_t* in, int32_t* out, int n, int32_t* warp_sums) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (n + kSmallThreads - 1) / kSmallThreads;
  const int begin = min(n, tid * per), end = min(n, begin + per);
  int32_t sum = 0;
  for (int i = begin; i < end; ++i) sum += in[i];
  const int32_t incl = warp_inclusive_scan(sum, lane);
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int32_t w = warp_sums[lane], wincl = warp_inclusive_scan(w, lane);
    warp_sums[lane] = wincl - w;  // exclusive prefix of the warps
    if (lane == 31) warp_sums[32] = wincl;
  }
  __syncthreads();
  int32_t run = warp_sums[warp] + incl - sum;
  for (int i = begin; i < end; ++i) {
    const int32_t v = in[i];
    out[i] = run;
    run += v;
  }
  const int32_t total = warp_sums[32];
  __syncthreads();  // warp_sums free again
  return total;
}

// Lanes of a warp taking places from shared-memory counters in lane order: `same` holds the
// lanes that use this lane's counter (__match_any_sync); an active lane gets the counter plus
// the number of those lanes below it, and the counter moves past the whole group.
__device__ __forceinline__ int32_t take_in_lane_order(int32_t* counter, uint32_t same, bool active,
                                                      uint32_t lanes_below) {
  const int32_t place = active ? *counter + __popc(same & lanes_below) : 0;
  __syncwarp();
  if (active && (same & lanes_below) == 0) *counter += __popc(same);
  __syncwarp();
  return place;
}

// Launched as one cluster of Hkv CTAs (grid = cluster); CTA h builds head h's part.
__global__ void __launch_bounds__(kSmallThreads, 1) small_schedule_kernel(const SmallScheduleArgs a) {
  extern __shared__ int32_t smem[];
  __shared__ int32_t warp_sums[33];
  // What the other heads read of this one (distributed shared memory): [0] its full items,
  // [t] its partial items of t queries; the first invalid top-k entry it met (status layout).
  __shared__ int32_t published[kSmallMaxPerItem];
  __shared__ int32_t head_status[4];
  __shared__ int32_t heads_before[kSmallMaxPerItem], heads_all[kSmallMaxPerItem];  // the same, summed
  cg::cluster_group cluster = cg::this_cluster();
  EdgeArgs e = a.edges;
  e.status = head_status;  // gathered into the plan's status by CTA 0 once every head is done
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int Hkv = e.Hkv, R = e.total_rows, per_item = a.per_item;
  const int h = int(cluster.block_rank());
  const int Tq = e.total_q;
  const int E = Tq * kTopk;        // this head's edge slots
  const int32_t sentinel = R;      // an unused slot's key
  int32_t* edges = smem;           // [E] packed edges (small_key, small_value): by query, then by place
  int32_t* count = edges + E;      // [R] edges per row
  int32_t* cursor = count + R;     // [R] a row's first edge, its end once placed; then full-item positions
  int32_t* tails = cursor + R;     // [kSmallWarps, kSmallMaxPerItem] partial items per (warp, size)
  uint32_t* long_rows = reinterpret_cast<uint32_t*>(tails + kSmallWarps * kSmallMaxPerItem);  // [kSmallWarps, 2 words]

  // What the general path clears with memsets is cleared here only where nothing is written
  // (the ends of the q_indices / split_slot heads and of the schedule, once their lengths are
  // known; split_counts are all written), so no CTA waits for another's clearing. The row table
  // is read when items are written: it is brought to L1 now.
  for (int i = tid; i < R; i += kSmallThreads) count[i] = 0;
  for (int i = tid; i < kSmallWarps * kSmallMaxPerItem; i += kSmallThreads) tails[i] = 0;
  if (tid < 4) head_status[tid] = 0;
  for (int i = tid * 16; i < R; i += kSmallThreads * 16) prefetch_l1_line(a.rows + 2 * i);  // 128-byte lines
  __syncthreads();

  // Edges, and the edge count of every row.
  for (int q = tid; q < Tq; q += kSmallThreads) {
    int32_t key[kTopk], val[kTopk];
    query_edges(e, int64_t(h) * Tq + q, key, val);
#pragma unroll
    for (int s = 0; s < kTopk; ++s) {
      const int32_t row = key[s] < Hkv * R ? key[s] - h * R : sentinel;
      edges[q * kTopk + s] = row << kSmallValueBits | val[s];
      if (row < sentinel) atomicAdd(&count[row], 1);
    }
  }
  __syncthreads();

  // Row pointers from 0; cursor = where the row's next edge goes.
  const int32_t all_edges = block_exclusive_scan(count, cursor, R, warp_sums);
  int32_t* row_ptr = a.row_ptr + int64_t(h) * (R + 1);
  for (int n = tid; n < R; n += kSmallThreads) row_ptr[n] = cursor[n];
  if (tid == 0) row_ptr[R] = all_edges;
  for (int i = all_edges + tid; i < E; i += kSmallThreads) {  // entries past the head's edges
    a.q_indices[int64_t(h) * E + i] = -1;
    a.split_slot[int64_t(h) * E + i] = -1;
  }
  __syncthreads();  // every cursor read before the walk below moves them

  // The rows' queries in ascending order. Every edge first takes a place in its row in any
  // order (atomics on the row cursors), then each place is ranked within its row by local
  // query (a query meets a row at most once, so the ranks are distinct): places of short rows
  // by counting the row's smaller queries, long rows by one warp through a bitmap of their
  // queries.
  {
    int32_t mine[kSmallEdgesPerThread];
#pragma unroll
    for (int i = 0; i < kSmallEdgesPerThread; ++i) {
      const int idx = tid + i * kSmallThreads;
      mine[i] = idx < E ? edges[idx] : sentinel << kSmallValueBits;
    }
    __syncthreads();  // every edge read before any place is written
#pragma unroll
    for (int i = 0; i < kSmallEdgesPerThread; ++i)
      if (small_key(mine[i]) < sentinel) edges[atomicAdd(&cursor[small_key(mine[i])], 1)] = mine[i];
  }
  __syncthreads();  // cursor[n] is now the end of row n's places
  // The output entry of row n's edge of value v, ranked `rank` within the row.
  const int64_t head_base = int64_t(h) * Tq * kTopk;
  auto write_place = [&](int n, int32_t rank, int32_t v) {
    const int64_t dst = head_base + (cursor[n] - count[n]) + rank;
    a.q_indices[dst] = v >> kSlotBits;
    a.split_slot[dst] = v & (kTopk - 1);
  };
  for (int at = tid; at < all_edges; at += kSmallThreads) {
    const int32_t edge = edges[at], n = small_key(edge), len = count[n];
    if (len > kSmallLongRow) continue;
    const int32_t end = cursor[n], v = small_value(edge), q = v >> kSlotBits;
    int32_t rank = 0;
    for (int i = end - len; i < end; ++i) rank += (small_value(edges[i]) >> kSlotBits) < q ? 1 : 0;
    write_place(n, rank, v);
  }
  // A warp's bitmap of a long row's local queries, then the number of queries before each word.
  uint32_t* bits = long_rows + warp * 2 * kSmallBitmapWords;
  uint32_t* before = bits + kSmallBitmapWords;
  for (int n0 = warp * 32; n0 < R; n0 += kSmallThreads) {
    uint32_t longs = __ballot_sync(0xffffffffu, n0 + lane < R && count[n0 + lane] > kSmallLongRow);
    while (longs != 0) {
      const int n = n0 + __ffs(int(longs)) - 1;
      longs &= longs - 1;
      const int32_t end = cursor[n], begin = end - count[n];
      for (int w = lane; w < kSmallBitmapWords; w += 32) bits[w] = 0;
      __syncwarp();
      for (int i = begin + lane; i < end; i += 32) {
        const int32_t q = small_value(edges[i]) >> kSlotBits;
        atomicOr(&bits[q >> 5], 1u << (q & 31));
      }
      __syncwarp();
      int32_t carry = 0;  // an exclusive scan of the words' populations, 32 words a round
      for (int w0 = 0; w0 < kSmallBitmapWords; w0 += 32) {
        const int32_t pop = __popc(bits[w0 + lane]), incl = warp_inclusive_scan(pop, lane);
        before[w0 + lane] = uint32_t(carry + incl - pop);
        carry += __shfl_sync(0xffffffffu, incl, 31);
      }
      __syncwarp();
      for (int i = begin + lane; i < end; i += 32) {
        const int32_t v = small_value(edges[i]), q = v >> kSlotBits;
        write_place(n, int32_t(before[q >> 5]) + __popc(bits[q >> 5] & ((1u << (q & 31)) - 1u)), v);
      }
      __syncwarp();  // the bitmap is cleared for the next row only after every lane has read it
    }
  }
  __syncthreads();

  // Item counts: full items a row (positions by an exclusive scan), partial items per (warp,
  // size), warp w taking the rows [R w / 32, R (w + 1) / 32). From here a row's first edge
  // (its row pointer) travels with its count in count[n], so items are written from shared
  // memory alone.
  for (int n = tid; n < R; n += kSmallThreads) {
    const int32_t len = count[n], start = cursor[n] - len;  // cursor[n]: the row's end since the placing
    count[n] = pack_row(start, len);
    cursor[n] = len / per_item;
  }
  __syncthreads();
  const int32_t head_full = block_exclusive_scan(cursor, cursor, R, warp_sums);
  const int n_begin = int(int64_t(R) * warp / kSmallWarps), n_end = int(int64_t(R) * (warp + 1) / kSmallWarps);
  for (int n = n_begin + lane; n < n_end; n += 32) {
    const int t = row_len(count[n]) % per_item;
    if (t > 0) atomicAdd(&tails[warp * kSmallMaxPerItem + t], 1);
  }
  __syncthreads();
  if (tid < kSmallMaxPerItem) {
    int32_t c = 0;
    if (tid == 0) c = head_full;
    else for (int w = 0; w < kSmallWarps; ++w) c += tails[w * kSmallMaxPerItem + tid];
    published[tid] = c;
  }
  cluster.sync();  // every head's counts (and invalid entries) published
  if (tid < kSmallMaxPerItem) {
    int32_t below = 0, all = 0;
    for (int g = 0; g < Hkv; ++g) {
      const int32_t c = *cluster.map_shared_rank(&published[tid], g);
      all += c;
      below += g < h ? c : 0;
    }
    heads_before[tid] = below, heads_all[tid] = all;
  }
  if (h == 0 && tid == kSmallMaxPerItem) {  // the plan's status: the first head's invalid entry, if any
    int32_t st[4] = {0, 0, 0, 0};
    for (int g = Hkv - 1; g >= 0; --g) {
      const int32_t* hs = cluster.map_shared_rank(head_status, g);
      if (hs[0] != 0)
        for (int i = 0; i < 4; ++i) st[i] = hs[i];
    }
    for (int i = 0; i < 4; ++i) a.edges.status[i] = st[i];
  }
  cluster.sync();  // every CTA is done reading the others' shared memory (none exits before)
  // The schedule's items past the last one written.
  {
    int32_t total = 0;
    for (int t = 0; t < per_item; ++t) total += heads_all[t];
    const int64_t first = int64_t(h) * kSmallThreads + tid, step = int64_t(Hkv) * kSmallThreads;
    for (int64_t i = int64_t(total) * kWorkItemInts + first; i < a.capacity * kWorkItemInts; i += step)
      reinterpret_cast<int32_t*>(a.items)[i] = -1;
  }

  // Full items: the heads before this one's first, then this head's in row order.
  const int32_t full_base = heads_before[0];
  for (int n = tid; n < R; n += kSmallThreads) {
    const int32_t begin = row_start(count[n]), nfull = row_len(count[n]) / per_item;
    for (int c = 0; c < nfull; ++c) {
      const int64_t i = int64_t(full_base) + cursor[n] + c;
      if (i < a.capacity) write_item(a.items + i, h, n, begin + c * per_item, per_item, a.rows);
    }
  }
  // Partial items, by size descending, (head, row) ascending among equal sizes: a size's items
  // start after every larger size's (all heads) and this size's of the heads before this one;
  // lane w of warp 0 places warp w's runs.
  if (warp == 0) {
    int32_t at = heads_all[0];
    for (int t = per_item - 1; t >= 1; --t) {
      const int32_t c = tails[lane * kSmallMaxPerItem + t], incl = warp_inclusive_scan(c, lane);
      tails[lane * kSmallMaxPerItem + t] = at + heads_before[t] + incl - c;
      at += heads_all[t];
    }
    if (h == 0 && lane == 0) {
      *a.work_count = at;
      *a.full_count = heads_all[0];
    }
  }
  __syncthreads();
  const uint32_t lanes_below = (1u << lane) - 1u;
  for (int n0 = n_begin; n0 < n_end; n0 += 32) {
    const int n = n0 + lane;
    const int32_t packed = n < n_end ? count[n] : 0;
    const int t = row_len(packed) % per_item;
    const uint32_t same = __match_any_sync(0xffffffffu, t > 0 ? t : per_item + lane);
    const int64_t i = take_in_lane_order(&tails[warp * kSmallMaxPerItem + t], same, t > 0, lanes_below);
    if (t > 0 && i < a.capacity)
      write_item(a.items + i, h, n, row_start(packed) + (row_len(packed) / per_item) * per_item, t, a.rows);
  }
}

struct HostRows {
  std::vector<int32_t> rows;           // [total_rows, 2]
  std::vector<int32_t> doc_row_base;   // [B]
  std::vector<int32_t> row_of;         // [total_rows]
};

// Level-major numbering: every document's block 0 (in document order), then every block 1...
HostRows number_rows(const PackedLayout& L) {
  const int B = L.num_documents();
  HostRows h;
  std::vector<int64_t> nblk(static_cast<size_t>(B));
  int64_t total = 0;
  for (int b = 0; b < B; ++b) {
    nblk[size_t(b)] = ceil_div(L.document(b).k_len, model::kBlockSize);
    h.doc_row_base.push_back(int32_t(total));
    total += nblk[size_t(b)];
  }
  h.rows.reserve(size_t(2 * total));
  h.row_of.assign(size_t(total), 0);
  std::vector<int> active;
  for (int b = 0; b < B; ++b)
    if (nblk[size_t(b)] > 0) active.push_back(b);
  int32_t next = 0;
  for (int64_t j = 0; !active.empty(); ++j) {
    size_t keep = 0;
    for (int b : active) {
      h.rows.push_back(b);
      h.rows.push_back(int32_t(j));
      h.row_of[size_t(h.doc_row_base[size_t(b)] + j)] = next++;
      if (nblk[size_t(b)] > j + 1) active[keep++] = b;
    }
    active.resize(keep);
  }
  return h;
}

bool key_ranges_overlap(const PackedLayout& L) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const auto& d : L.documents())
    if (d.k_len > 0) ranges.emplace_back(d.k_start, d.k_start + d.k_len);
  std::sort(ranges.begin(), ranges.end());
  int64_t end = std::numeric_limits<int64_t>::min();
  for (const auto& [s, e] : ranges) {
    if (s < end) return true;
    end = std::max(end, e);
  }
  return false;
}

// Host metadata reaches the device as kernel arguments rather than through cudaMemcpy from
// pageable memory: the launch copies them, so nothing waits for the device and the upload can
// be captured in a CUDA graph (the values are part of the graph). One launch carries up to
// kUploadInts values for up to kUploadSegments destinations (32 KB of kernel parameters,
// CUDA 12.1 or newer).
constexpr int kUploadInts = 7936;
constexpr int kUploadSegments = 8;

struct UploadArgs {
  int32_t* dst[kUploadSegments];
  int32_t end[kUploadSegments];  // exclusive end of each destination's values in v
  int32_t segments;
  int32_t count;
  int32_t v[kUploadInts];
};
static_assert(sizeof(UploadArgs) <= 32764, "kernel parameters are limited to 32764 bytes");

__global__ void upload_kernel(const __grid_constant__ UploadArgs a) {
  for (int i = int(blockIdx.x * blockDim.x + threadIdx.x); i < a.count; i += int(gridDim.x * blockDim.x)) {
    int seg = 0;
    while (a.end[seg] <= i) ++seg;
    const int begin = seg > 0 ? a.end[seg - 1] : 0;
    a.dst[seg][i - begin] = a.v[i];
  }
}

class Uploader {
 public:
  explicit Uploader(cudaStream_t s) : s_(s) { args_.segments = args_.count = 0; }
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;

  void add(int32_t* dst, const int32_t* src, int64_t n) {
    while (n > 0) {
      if (args_.segments == kUploadSegments || args_.count == kUploadInts) flush();
      const int take = int(std::min<int64_t>(n, kUploadInts - args_.count));
      std::copy(src, src + take, args_.v + args_.count);
      args_.dst[args_.segments] = dst;
      args_.count += take;
      args_.end[args_.segments++] = args_.count;
      dst += take;
      src += take;
      n -= take;
    }
  }
  void add(const Buffer& dst, const std::vector<int32_t>& src) { add(i32(dst), src.data(), int64_t(src.size())); }

  void flush() {
    if (args_.count > 0) {
      upload_kernel<<<blocks_for(args_.count), kThreads, 0, s_>>>(args_);
      MSA_CUDA_CHECK_LAUNCH("upload_kernel");
    }
    args_.segments = args_.count = 0;
  }

 private:
  UploadArgs args_;
  cudaStream_t s_;
};

// Cuts every (head, row) of the CSR into items of at most `per_item` queries: full items in
// (head, row) order first, then the partial items by size descending, (head, row) order
// among equal sizes. Writes `items` ([capacity]) and `work_count` ([1]); optionally the
// per-row index arrays the deterministic reductions use.
void build_items(const int32_t* row_ptr, int Hkv, int32_t total_rows, int per_item, int64_t capacity,
                 const int32_t* rows, WorkItem* items, int32_t* work_count, int32_t* full_count, int32_t* first,
                 int32_t* nfull_out, int32_t* tail_index, cudaStream_t s) {
  const int64_t N = int64_t(Hkv) * total_rows;
  if (N == 0) {
    MSA_CUDA_CHECK(cudaMemsetAsync(work_count, 0, sizeof(int32_t), s));
    if (full_count) MSA_CUDA_CHECK(cudaMemsetAsync(full_count, 0, sizeof(int32_t), s));
    return;
  }
  StreamScratch nfull_s(N * 4, s), pos_s(N * 4, s), key_in(N * 4, s), key_out(N * 4, s), val_in(N * 4, s),
      val_out(N * 4, s);
  int32_t* nfull = nfull_out ? nfull_out : nfull_s.as<int32_t>();
  int32_t* full_pos = first ? first : pos_s.as<int32_t>();
  items_count_kernel<<<blocks_for(N), kThreads, 0, s>>>(row_ptr, Hkv, total_rows, per_item, nfull,
                                                        key_in.as<int32_t>(), val_in.as<int32_t>());
  MSA_CUDA_CHECK_LAUNCH("items_count_kernel");
  size_t scan_bytes = 0, sort_bytes = 0;
  MSA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, nfull, full_pos, int(N), s));
  MSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, key_in.as<int32_t>(), key_out.as<int32_t>(),
                                                 val_in.as<int32_t>(), val_out.as<int32_t>(), int(N), 0,
                                                 bits_for(per_item), s));
  StreamScratch temp(int64_t(std::max(scan_bytes, sort_bytes)), s);
  MSA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp.get(), scan_bytes, nfull, full_pos, int(N), s));
  MSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.get(), sort_bytes, key_in.as<int32_t>(), key_out.as<int32_t>(),
                                                 val_in.as<int32_t>(), val_out.as<int32_t>(), int(N), 0,
                                                 bits_for(per_item), s));
  if (tail_index) MSA_CUDA_CHECK(cudaMemsetAsync(tail_index, 0xff, size_t(N) * 4, s));
  if (capacity > 0) {
    items_fill_full_kernel<<<blocks_for(capacity), kThreads, 0, s>>>(row_ptr, nfull, full_pos, N, total_rows, per_item,
                                                                    capacity, rows, items);
    MSA_CUDA_CHECK_LAUNCH("items_fill_full_kernel");
  }
  items_fill_tail_kernel<<<blocks_for(N), kThreads, 0, s>>>(row_ptr, nfull, full_pos, key_out.as<int32_t>(),
                                                            val_out.as<int32_t>(), N, total_rows, per_item, rows, items,
                                                            tail_index, work_count, full_count);
  MSA_CUDA_CHECK_LAUNCH("items_fill_tail_kernel");
}

// ---- the forward's walk: token-major ---------------------------------------------------------
// The schedule lists items in (head, row) order, so a CTA walking a contiguous share of it
// reads Q rows from all over the sequence: each query's Q tile is read once per selected block
// (16 times a KV head) and almost never from L2. The forward walks the items by chunks of
// packed queries instead (then head, then row, so consecutive items still share key blocks;
// the chunk: src/core/walk_order.h), and its CTAs move through that list together
// (attention_forward.cu, cta_tasks). Measured at 16k tokens: forward -18 % (performance.md,
// run 40). The default-mode backward walks its chunk list by query windows the same way, for
// its dQ reductions' sake (run 41).

// Sort key of every schedule slot: (chunk of the item's first query, head * rows + row), or
// `sentinel` past the items in use; the value is the slot.
__global__ void walk_order_keys_kernel(const WorkItem* __restrict__ items, const int32_t* __restrict__ work_count,
                                       int64_t capacity, const int32_t* __restrict__ q_indices, int64_t total_q,
                                       const DocInfo* __restrict__ docs, int chunk_queries, int32_t rows, int row_bits,
                                       uint64_t sentinel, uint64_t* __restrict__ keys, int32_t* __restrict__ vals) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= capacity) return;
  vals[i] = int32_t(i);
  if (i >= *work_count) {
    keys[i] = sentinel;
    return;
  }
  const WorkItem it = items[i];
  const int32_t local = q_indices[int64_t(it.head_kv) * total_q * kTopk + it.q_begin];
  const int64_t chunk = (int64_t(docs[it.document].q_start) + local) / chunk_queries;
  keys[i] = (uint64_t(chunk) << row_bits) | uint64_t(int64_t(it.head_kv) * rows + it.row);
}

// The forward's windows (PlanState::forward_window): thread w finds where window w's own
// items begin in the sorted keys (their chunk is the window's first or later); the last
// thread, where the items in use end (the sentinel keys follow them).
__global__ void window_begin_kernel(const uint64_t* __restrict__ sorted_keys, int64_t capacity, int row_bits,
                                    int chunks_per_window, int windows, int64_t chunks, int32_t* __restrict__ begin) {
  const int w = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w > windows) return;
  const uint64_t first = uint64_t(w < windows ? int64_t(w) * chunks_per_window : chunks) << row_bits;
  int64_t l = 0, r = capacity;
  while (l < r) {
    const int64_t m = (l + r) >> 1;
    if (sorted_keys[m] < first) l = m + 1; else r = m;
  }
  begin[w] = int32_t(l);
}

// An item's queries are ascending, so the windows they fall in are too: `visit(w)` for every
// window after the item's first that holds one of them.
template <class Visit>
__device__ __forceinline__ void for_later_windows(const WorkItem& it, const int32_t* q_indices, int64_t total_q,
                                                  const DocInfo* docs, int64_t window, Visit visit) {
  const int32_t* local = q_indices + int64_t(it.head_kv) * total_q * kTopk + it.q_begin;
  const int64_t q0 = docs[it.document].q_start;
  int64_t last = (q0 + local[0]) / window;
  for (int k = 1; k < it.q_count; ++k) {
    const int64_t w = (q0 + local[k]) / window;
    if (w != last) visit(int(w));
    last = w;
  }
}

struct StraddleArgs {
  const WorkItem* items;
  const int32_t* work_count;
  const int32_t* q_indices;
  int64_t total_q;
  const DocInfo* docs;
  int64_t window;
  int windows;
  int32_t* counts;          // [windows]: straddling items per window (pass 0), then fill cursors (pass 1)
  int32_t* begin;           // [windows + 1]
  int32_t* straddle_items;  // [capacity]
};

// Pass 0 counts each window's straddling items, pass 1 writes them (in any order: every
// query's partials come out the same whichever CTA computes them, and the merge reads them by
// slot).
__global__ void straddle_kernel(const StraddleArgs a, int pass) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= *a.work_count) return;
  for_later_windows(a.items[i], a.q_indices, a.total_q, a.docs, a.window, [&](int w) {
    if (pass == 0) atomicAdd(&a.counts[w], 1);
    else a.straddle_items[atomicAdd(&a.counts[w], 1)] = int32_t(i);
  });
}

// Between the passes: begin = exclusive sum of the counts, and the counts become the cursors.
__global__ void straddle_begin_kernel(const StraddleArgs a) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int32_t at = 0;
  for (int w = 0; w < a.windows; ++w) {
    a.begin[w] = at;
    const int32_t n = a.counts[w];
    a.counts[w] = at;
    at += n;
  }
  a.begin[a.windows] = at;
}

// Writes `order` ([capacity]): the slots of `items` (`count` in use) sorted by
// walk_order_keys_kernel's key for chunks of `chunk_queries` queries (stable, so a row's
// items keep their order within a chunk); the items in use come first. False: not built.
bool build_walk_order(const SparsePlan& plan, const PlanState& state, const WorkItem* items, const int32_t* count,
                      int64_t capacity, int chunk_queries, int Hkv, int32_t* order, cudaStream_t s,
                      int32_t* window_begin = nullptr, int64_t window_queries = 0, int windows = 1) {
  const int64_t total_q = plan.total_q, rows = plan.total_rows;
  if (capacity == 0 || total_q == 0 || chunk_queries == 0) return false;
  const int row_bits = bits_for(int64_t(Hkv) * rows);
  const int64_t chunks = ceil_div(total_q, chunk_queries);
  const int bits = row_bits + bits_for(chunks);  // chunk index `chunks` is the sentinel's
  if (bits > 64) return false;                   // not reachable under check_schedule_size
  const uint64_t sentinel = uint64_t(chunks) << row_bits;
  StreamScratch keys_in(capacity * 8, s), keys_out(capacity * 8, s), vals_in(capacity * 4, s);
  walk_order_keys_kernel<<<blocks_for(capacity), kThreads, 0, s>>>(
      items, count, capacity, static_cast<const int32_t*>(plan.q_indices.data()), total_q, doc_ptr(state),
      chunk_queries, int32_t(rows), row_bits, sentinel, keys_in.as<uint64_t>(), vals_in.as<int32_t>());
  MSA_CUDA_CHECK_LAUNCH("walk_order_keys_kernel");
  size_t sort_bytes = 0;
  MSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys_in.as<uint64_t>(), keys_out.as<uint64_t>(),
                                                 vals_in.as<int32_t>(), order, int(capacity), 0, bits, s));
  StreamScratch temp(int64_t(sort_bytes), s);
  MSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.get(), sort_bytes, keys_in.as<uint64_t>(),
                                                 keys_out.as<uint64_t>(), vals_in.as<int32_t>(), order, int(capacity),
                                                 0, bits, s));
  if (window_begin) {  // the forward's windows: where each one's items begin in the order
    window_begin_kernel<<<blocks_for(windows + 1), kThreads, 0, s>>>(
        keys_out.as<uint64_t>(), capacity, row_bits, int(window_queries / chunk_queries), windows, chunks, window_begin);
    MSA_CUDA_CHECK_LAUNCH("window_begin_kernel");
  }
  return true;
}

// state.forward_order: the schedule in the forward's walking order; whether it was written.
// With several forward windows, also state.window_begin and the straddling items.
bool build_forward_order(const SparsePlan& plan, PlanState& state, int Hkv, cudaStream_t s) {
  const bool windowed = state.forward_windows > 1;
  const auto* items = static_cast<const WorkItem*>(plan.schedule.data());
  const auto* count = static_cast<const int32_t*>(plan.work_count_dev.data());
  const bool ordered =
      build_walk_order(plan, state, items, count, state.schedule_capacity, state.forward_chunk, Hkv,
                       i32(state.forward_order), s, windowed ? i32(state.window_begin) : nullptr, state.forward_window,
                       state.forward_windows);
  if (!windowed) return ordered;
  // upload_layout gives a layout several windows only where its rule gives a walk, and the walk
  // is built for every such layout (build_walk_order's false is unreachable then).
  if (!ordered) throw Error(ErrorKind::runtime, "build_plan: the forward's windows need its walking order");
  StreamScratch counts(int64_t(state.forward_windows) * 4, s);
  MSA_CUDA_CHECK(cudaMemsetAsync(counts.get(), 0, size_t(state.forward_windows) * 4, s));
  const StraddleArgs a{items, count, static_cast<const int32_t*>(plan.q_indices.data()), plan.total_q, doc_ptr(state),
                       state.forward_window, state.forward_windows, counts.as<int32_t>(), i32(state.straddle_begin),
                       i32(state.straddle_items)};
  straddle_kernel<<<blocks_for(state.schedule_capacity), kThreads, 0, s>>>(a, 0);
  MSA_CUDA_CHECK_LAUNCH("straddle_kernel (count)");
  straddle_begin_kernel<<<1, 32, 0, s>>>(a);
  MSA_CUDA_CHECK_LAUNCH("straddle_begin_kernel");
  straddle_kernel<<<blocks_for(state.schedule_capacity), kThreads, 0, s>>>(a, 1);
  MSA_CUDA_CHECK_LAUNCH("straddle_kernel (fill)");
  return true;
}

}  // namespace

void check_schedule_size(int Hkv, int64_t total_q, int64_t rows, const char* who) {
  const int64_t edges = int64_t(Hkv) * total_q * kTopk;
  if (edges >= (int64_t(1) << 31) || total_q >= (int64_t(1) << 27) || Hkv * (rows + 1) >= (int64_t(1) << 31))
    throw Error(ErrorKind::unsupported,
                std::string(who) + ": Hkv * total_q * topk (16) must be below 2^31, got " + std::to_string(edges));
}

void upload_layout(const Topology& topo, const PackedLayout& L, SparsePlan& plan, PlanState& state, bool with_chunks,
                   cudaStream_t s, Release release) {
  const int Hkv = topo.num_kv_heads, B = L.num_documents();
  const int64_t rows = plan.total_rows;
  const HostRows host_rows = number_rows(L);
  const std::vector<DocInfo> docs = doc_table(L);
  std::vector<int32_t> docs_flat;
  for (const DocInfo& d : docs) docs_flat.insert(docs_flat.end(), {d.q_start, d.q_len, d.k_start, d.k_len});
  state.num_documents = B;
  state.forward_chunk = detail::forward_walk_chunk(L);
  state.forward_window = detail::forward_window_queries(L);
  state.forward_windows = state.forward_window > 0 ? int(ceil_div(L.total_q(), state.forward_window)) : 1;
  state.backward_window = with_chunks ? detail::backward_window_queries(L) : 0;
  state.schedule_capacity = plan.schedule.view().shape[0];
  // An item of q_per_cta queries straddles at most q_per_cta - 1 later windows.
  state.straddle_capacity =
      state.forward_windows > 1
          ? state.schedule_capacity * std::min<int64_t>(plan.q_per_cta - 1, state.forward_windows - 1)
          : 0;
  state.chunk_capacity = with_chunks ? chunk_capacity(topo, L) : 0;
  const int64_t per_row = with_chunks ? std::max<int64_t>(Hkv * rows, 1) : 1;
  detail::BufferPack buffers;
  buffers.add(&state.docs, DType::i32, {B, 4});
  buffers.add(&state.cu_q, DType::i32, {B + 1});
  buffers.add(&state.doc_row_base, DType::i32, {B});
  buffers.add(&state.row_of, DType::i32, {std::max<int64_t>(rows, 1)});
  buffers.add(&plan.status, DType::i32, {4});
  buffers.add(&state.chunks, DType::i32, {std::max<int64_t>(state.chunk_capacity, 1), 6});
  buffers.add(&state.chunk_count, DType::i32, {1});
  buffers.add(&state.schedule_full, DType::i32, {1});
  buffers.add(&state.chunk_first, DType::i32, {per_row});
  buffers.add(&state.chunk_nfull, DType::i32, {per_row});
  buffers.add(&state.chunk_tail, DType::i32, {per_row});
  // Only a layout whose rule gives a chunk is ever walked by it (build_forward_order).
  buffers.add(&state.forward_order, DType::i32,
              {state.forward_chunk > 0 ? std::max<int64_t>(state.schedule_capacity, 1) : 1});
  buffers.add(&state.window_begin, DType::i32, {int64_t(state.forward_windows) + 1});
  buffers.add(&state.straddle_begin, DType::i32, {int64_t(state.forward_windows) + 1});
  buffers.add(&state.straddle_items, DType::i32, {std::max<int64_t>(state.straddle_capacity, 1)});
  buffers.add(&state.chunk_order, DType::i32,
              {state.backward_window > 0 ? std::max<int64_t>(state.chunk_capacity, 1) : 1});
  buffers.allocate(plan.device, static_cast<void*>(s), release);
  Uploader up(s);
  up.add(state.docs, docs_flat);
  up.add(state.cu_q, L.cu_seqlens_q());
  up.add(state.doc_row_base, host_rows.doc_row_base);
  up.add(state.row_of, host_rows.row_of);
  up.add(plan.rows, host_rows.rows);
  up.flush();
  state.keys_overlap = key_ranges_overlap(L);
}

void build_schedule(const Topology& topo, const TensorView& topk, SparsePlan& plan, PlanState& state, bool with_chunks,
                    cudaStream_t s) {
  const int Hkv = topo.num_kv_heads, B = state.num_documents;
  const int64_t total_q = plan.total_q, rows = plan.total_rows;
  const int64_t edges = int64_t(Hkv) * total_q * kTopk;
  plan.work_count = -1;
  state.forward_ordered = false;
  state.chunks_ordered = false;
  const EdgeArgs edge_args{topk.as<const int32_t>(), int32_t(total_q), Hkv, B, i32(state.cu_q), doc_ptr(state),
                           i32(state.doc_row_base), i32(state.row_of), int32_t(rows),
                           static_cast<int32_t*>(plan.split_counts.data()), static_cast<int32_t*>(plan.status.data())};
  if (small_schedule_fits(Hkv, total_q, rows, plan.q_per_cta)) {
    SmallScheduleArgs a{edge_args,
                        static_cast<const int32_t*>(plan.rows.data()),
                        plan.q_per_cta,
                        state.schedule_capacity,
                        static_cast<int32_t*>(plan.q_indices.data()),
                        static_cast<int32_t*>(plan.split_slot.data()),
                        static_cast<int32_t*>(plan.row_ptr.data()),
                        static_cast<WorkItem*>(plan.schedule.data()),
                        static_cast<int32_t*>(plan.work_count_dev.data()),
                        i32(state.schedule_full)};
    const int smem = int(small_schedule_smem(total_q * kTopk, rows));
    MSA_CUDA_CHECK(cudaFuncSetAttribute(small_schedule_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(unsigned(Hkv));
    config.blockDim = dim3(kSmallThreads);
    config.dynamicSmemBytes = size_t(smem);
    config.stream = s;
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = unsigned(Hkv);
    cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    MSA_CUDA_CHECK(cudaLaunchKernelEx(&config, small_schedule_kernel, a));
    MSA_CUDA_CHECK_LAUNCH("small_schedule_kernel");
  } else {
    MSA_CUDA_CHECK(cudaMemsetAsync(plan.status.data(), 0, size_t(plan.status.bytes()), s));
    MSA_CUDA_CHECK(cudaMemsetAsync(plan.q_indices.data(), 0xff, size_t(plan.q_indices.bytes()), s));
    MSA_CUDA_CHECK(cudaMemsetAsync(plan.split_slot.data(), 0xff, size_t(plan.split_slot.bytes()), s));
    MSA_CUDA_CHECK(cudaMemsetAsync(plan.row_ptr.data(), 0, size_t(plan.row_ptr.bytes()), s));
    MSA_CUDA_CHECK(cudaMemsetAsync(plan.split_counts.data(), 0, size_t(plan.split_counts.bytes()), s));
    MSA_CUDA_CHECK(cudaMemsetAsync(plan.schedule.data(), 0xff, size_t(plan.schedule.bytes()), s));
    if (edges > 0) {
      const int32_t sentinel = int32_t(Hkv * rows);
      StreamScratch keys_in(edges * 4, s), keys_out(edges * 4, s), vals_in(edges * 4, s), vals_out(edges * 4, s);
      plan_edges_kernel<<<blocks_for(Hkv * total_q), kThreads, 0, s>>>(edge_args, keys_in.as<int32_t>(),
                                                                       vals_in.as<int32_t>());
      MSA_CUDA_CHECK_LAUNCH("plan_edges_kernel");
      size_t sort_bytes = 0;
      const int bits = bits_for(sentinel);
      MSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys_in.as<int32_t>(), keys_out.as<int32_t>(),
                                                     vals_in.as<int32_t>(), vals_out.as<int32_t>(), int(edges), 0, bits, s));
      StreamScratch temp(int64_t(sort_bytes), s);
      MSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.get(), sort_bytes, keys_in.as<int32_t>(), keys_out.as<int32_t>(),
                                                     vals_in.as<int32_t>(), vals_out.as<int32_t>(), int(edges), 0, bits, s));
      plan_scatter_kernel<<<blocks_for(edges), kThreads, 0, s>>>(
          keys_out.as<int32_t>(), vals_out.as<int32_t>(), edges, int32_t(rows), sentinel, total_q * kTopk,
          static_cast<int32_t*>(plan.q_indices.data()), static_cast<int32_t*>(plan.split_slot.data()));
      MSA_CUDA_CHECK_LAUNCH("plan_scatter_kernel");
      if (rows > 0) {
        plan_row_ptr_kernel<<<blocks_for(Hkv * (rows + 1)), kThreads, 0, s>>>(
            keys_out.as<int32_t>(), edges, Hkv, int32_t(rows), static_cast<int32_t*>(plan.row_ptr.data()));
        MSA_CUDA_CHECK_LAUNCH("plan_row_ptr_kernel");
      }
    }
    build_items(static_cast<const int32_t*>(plan.row_ptr.data()), Hkv, int32_t(rows), plan.q_per_cta,
                state.schedule_capacity, static_cast<const int32_t*>(plan.rows.data()),
                static_cast<WorkItem*>(plan.schedule.data()), static_cast<int32_t*>(plan.work_count_dev.data()),
                i32(state.schedule_full), nullptr, nullptr, nullptr, s);
    state.forward_ordered = build_forward_order(plan, state, Hkv, s);
  }
  if (with_chunks)
    build_items(static_cast<const int32_t*>(plan.row_ptr.data()), Hkv, int32_t(rows), kChunkQueries,
                state.chunk_capacity, static_cast<const int32_t*>(plan.rows.data()),
                static_cast<WorkItem*>(state.chunks.data()), i32(state.chunk_count), nullptr, i32(state.chunk_first),
                i32(state.chunk_nfull), i32(state.chunk_tail), s);
  if (with_chunks)
    state.chunks_ordered = build_walk_order(plan, state, static_cast<const WorkItem*>(state.chunks.data()),
                                            i32(state.chunk_count), state.chunk_capacity, state.backward_window, Hkv,
                                            i32(state.chunk_order), s);
}

void build_plan(const Topology& topo, const PackedLayout& L, const TensorView& topk, const TensorView& workspace,
                bool workspace_per_call, SparsePlan& plan, const RunOptions& opt) {
  const Device dev = topk.device;
  DeviceGuard guard(dev.index);
  const cudaStream_t s = as_stream(opt);
  check_schedule_size(topo.num_kv_heads, L.total_q(), plan.total_rows, "build_plan (CUDA)");
  // Nothing below allocates outside the device allocator, copies from pageable memory or
  // waits for the device, so a plan can be built during CUDA-graph capture.
  auto state = std::make_shared<PlanState>();
  upload_layout(topo, L, plan, *state, true, s);
  build_schedule(topo, topk, plan, *state, true, s);
  if (!workspace_per_call) attach_workspace(topo, L, workspace, *state, dev, opt.stream);
  plan.backend = state;
}

}  // namespace msa::cuda
