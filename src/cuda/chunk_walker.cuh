// The loop that the attention backward and the KL backward share: a CTA walks the plan's
// chunk list (msa::WorkItem records of up to kChunkQueries queries of one (KV head, key
// block) row). Per chunk it loads the key block, walks the chunk's queries kSubQueries at a
// time (warp w loads query w of the sub-chunk and writes its QueryMeta), hands each
// sub-chunk to the kernel's body, and lets the kernel flush what it accumulated.
//
// A kernel is a struct with
//   load_block(chunk)                      cp.async of the key block into shared memory
//   load_queries(chunk, query, stage)      cp.async of one warp's query into a stage
//   begin_chunk(chunk)                     zero the chunk's accumulators
//   masked_block_ready(chunk)              when the chunk masks keys: the key block is visible
//   sub_chunk(chunk, stage, meta, release) the algorithm; calls release() exactly once,
//                                          after a barrier that follows its last read of
//                                          the stage's query tiles
//   flush(chunk)                           write the chunk's accumulators
// With kStages == 1 release() refills the only stage with the next sub-chunk; with a ring of
// kStages > 1 the next kStages - 1 sub-chunks are already loading into the other stages and
// release() refills this one with the sub-chunk kStages on.
// The steps that the two kernels share inside these hooks: backward_steps.cuh.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/wgmma.cuh"  // fence_proxy_async
#include "msa/constants.h"
#include "plan_records.h"

namespace msa::cuda {

inline constexpr int kWalkerWarps = 8;                         // one query of a sub-chunk per warp
inline constexpr int kWalkerThreads = kWalkerWarps * 32;
inline constexpr int kSubQueries = kWalkerWarps;               // queries per sub-chunk
inline constexpr int kSubRows = kSubQueries * model::kGroupSize;  // (query, head) rows of a sub-chunk

// The swizzled tiles of device.cuh hold rows of exactly 128 bf16.
static_assert(model::kHeadDim == 128 && model::kBlockSize == 128, "tiles are rows of 128 bf16");
inline constexpr int kTileRowBytes = model::kHeadDim * 2;
// n8 accumulator fragments of an m64 x 128 product: across a head dim, across a key block.
inline constexpr int kHeadFrags = model::kHeadDim / 8;
inline constexpr int kKeyFrags = model::kBlockSize / 8;

// A swizzled tile of kRows rows (device.cuh tile_offset); 1024-byte aligned as wgmma needs.
template <int kRows>
struct alignas(1024) SwizzledTile {
  static constexpr int kRowCount = kRows;
  unsigned char bytes[kRows * kTileRowBytes];
};
using BlockTile = SwizzledTile<model::kBlockSize>;  // a key block, or the kSubRows rows of a sub-chunk
static_assert(kSubRows == model::kBlockSize, "a sub-chunk's rows fill one block-sized tile");

// What a sub-chunk slot holds, written by lane 0 of the warp that loads the query.
struct QueryMeta {
  int32_t row;    // packed query row; -1 when the slot holds no query
  int32_t slot;   // the edge's partial slot (split_slot): its place in the query's fixed-order sum
  int32_t limit;  // last key of the block the query sees (causal); later keys are masked
  int32_t unused;
};

// The plan's chunk list as the kernels read it.
struct ChunkList {
  const WorkItem* items;      // [capacity]
  const int32_t* count;       // [1] items in use
  const int32_t* q_indices;   // [Hkv, total_q * kTopk] document-local query of each edge
  const int32_t* split_slot;  // [Hkv, total_q * kTopk]
  const DocInfo* docs;
  const int32_t* status;      // nonzero: invalid plan, the kernels do nothing
  int64_t total_q;
  const int32_t* order;       // [capacity] the walk by query windows, or nullptr: the list's order
};

// `windowed`: walk by the plan's query windows where it built them (the default-mode backward).
inline ChunkList chunk_list(const SparsePlan& plan, const PlanState& st, int64_t total_q, bool windowed) {
  return {reinterpret_cast<const WorkItem*>(st.chunks.data()), i32(st.chunk_count), i32(plan.q_indices),
          i32(plan.split_slot), doc_ptr(st), i32(plan.status), total_q,
          windowed && st.chunks_ordered ? i32(st.chunk_order) : nullptr};
}

// One chunk as the kernels see it.
struct Chunk {
  int index;        // place in the chunk list (its slot for per-chunk partials)
  int head_kv;
  DocInfo doc;
  int key0;         // first key of the block, document-local
  int nkeys;        // keys of the block inside the document (tile rows past it are zero)
  int64_t edge0;    // first edge of the chunk in q_indices / split_slot
  int q_count;
  int nsub;         // sub-chunks
  bool masked;      // some query of the chunk masks keys of the block (the causal diagonal)

  __device__ __forceinline__ int64_t key_token(int key) const { return int64_t(doc.k_start) + key0 + key; }
};

__device__ __forceinline__ Chunk open_chunk(const ChunkList& list, int c) {
  const WorkItem it = list.items[c];
  Chunk ch;
  ch.index = c;
  ch.head_kv = it.head_kv;
  ch.doc = list.docs[it.document];
  ch.key0 = it.kv_block * model::kBlockSize;
  ch.nkeys = min(model::kBlockSize, ch.doc.k_len - ch.key0);
  ch.edge0 = int64_t(it.head_kv) * list.total_q * model::kTopk + it.q_begin;
  ch.q_count = it.q_count;
  ch.nsub = (it.q_count + kSubQueries - 1) / kSubQueries;
  // Queries are ascending within a row: the first one sees the fewest keys.
  ch.masked = ch.doc.k_len - ch.doc.q_len + list.q_indices[ch.edge0] - ch.key0 < ch.nkeys - 1;
  return ch;
}

// The query a warp loads: its packed row (0 for an empty slot, so that the caller's loads
// stay in bounds; they zero-fill) and whether the slot holds one.
struct SlotQuery {
  int row;
  bool valid;
};

// The plan's record of query qi of a chunk (read when walk_chunks' RecordFetch says).
struct QueryRecord {
  int local;  // document-local query; -1 when qi is past the chunk's queries
  int slot;   // the edge's partial slot
};
__device__ __forceinline__ QueryRecord fetch_query(const ChunkList& list, const Chunk& ch, int qi) {
  if (qi >= ch.q_count) return {-1, 0};
  return {list.q_indices[ch.edge0 + qi], list.split_slot[ch.edge0 + qi]};
}

// Places a fetched query in a slot: writes its QueryMeta (lane 0) and returns it for the loads.
__device__ __forceinline__ SlotQuery place_query(const Chunk& ch, QueryRecord rec, QueryMeta& meta, int lane) {
  SlotQuery q{0, rec.local >= 0};
  if (q.valid) {
    q.row = ch.doc.q_start + rec.local;
    if (lane == 0) {
      meta.row = q.row;
      meta.slot = rec.slot;
      meta.limit = ch.doc.k_len - ch.doc.q_len + rec.local - ch.key0;
    }
  } else if (lane == 0) {
    meta.row = -1;
  }
  return q;
}

// When the walker reads the plan records of the sub-chunk that release() loads: inside
// release(), or one sub-chunk ahead, before the body whose time then covers the loads'
// latency. Measured at 16k (run 38): ahead took 5 % off the KL and added 2 % to the
// backward, whose registers are at their limit.
enum class RecordFetch { in_release, ahead };

template <int kStages, RecordFetch kFetch = RecordFetch::in_release, class Kernel>
__device__ __forceinline__ void walk_chunks(const ChunkList& list, QueryMeta (&meta)[kStages][kWalkerWarps],
                                            Kernel& kernel) {
  static_assert(kStages >= 1 && kStages <= 4, "one stage refilled mid-body, or a ring of stages");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nchunks = *list.count;
  for (int n = blockIdx.x; n < nchunks; n += gridDim.x) {
    const int c = list.order ? list.order[n] : n;
    const Chunk ch = open_chunk(list, c);
    auto fetch = [&](int sub) { return fetch_query(list, ch, sub * kSubQueries + warp); };
    auto load_queries = [&](int sub, QueryRecord rec) {
      const int stage = sub % kStages;
      kernel.load_queries(ch, place_query(ch, rec, meta[stage][warp], lane), stage);
    };
    kernel.load_block(ch);
#pragma unroll
    for (int first = 0; first < kStages; ++first) {  // the key block goes with the first group
      if (first < ch.nsub) load_queries(first, fetch(first));
      cp_async_commit();
    }
    kernel.begin_chunk(ch);
    if (ch.masked) {  // CTA-uniform: waits for the key block ahead of the first sub-chunk
      cp_async_wait<kStages - 1>();
      fence_proxy_async();
      __syncthreads();
      kernel.masked_block_ready(ch);
    }
    int sub = 0;
    do {  // a chunk holds at least one query
      QueryRecord ahead{};
      if constexpr (kFetch == RecordFetch::ahead) ahead = fetch(sub + kStages);
      cp_async_wait<kStages - 1>();  // this sub-chunk's group (and the key block with the first)
      fence_proxy_async();
      __syncthreads();
      const int stage = sub % kStages;
      kernel.sub_chunk(ch, stage, meta[stage], [&] {
        if (sub + kStages < ch.nsub)
          load_queries(sub + kStages, kFetch == RecordFetch::ahead ? ahead : fetch(sub + kStages));
        cp_async_commit();  // one group per sub-chunk, empty or not, keeps the wait counts right
      });
    } while (++sub < ch.nsub);
    kernel.flush(ch);
    __syncthreads();  // the next chunk's loads overwrite tiles the last sub-chunk read
  }
}

// 2-bf16 word with its non-finite halves (exponent all ones: Inf or NaN) replaced by 0.
__device__ __forceinline__ uint32_t finite_bf16x2(uint32_t w) {
  const uint32_t lo = (w & 0x7F80u) == 0x7F80u ? 0u : 0xFFFFu;
  const uint32_t hi = (w & 0x7F800000u) == 0x7F800000u ? 0u : 0xFFFF0000u;
  return w & (lo | hi);
}

// Products that sum over the keys of a block (dQ = dS K, d index_q = ds index_K) run on
// tensor cores, where a masked key's 0 times a non-finite key would still give NaN. When a
// chunk masks keys and the block holds a non-finite value, this writes `src` with those
// values zeroed into `dst` and returns true (CTA-uniform; every thread must call it); the
// rows that do attend such a key get NaN through their scores anyway. Ends with the writes
// fenced for wgmma; the caller's next barrier publishes them.
template <int kRows>
__device__ __forceinline__ bool finite_copy(uint32_t src, uint32_t dst) {
  constexpr int kChunks = kRows * kTileRowBytes / 16;
  bool bad = false;
  for (int i = threadIdx.x; i < kChunks; i += kWalkerThreads) {
    const uint4 v = ld_shared_v4(src + 16 * i);
    bad |= finite_bf16x2(v.x) != v.x || finite_bf16x2(v.y) != v.y || finite_bf16x2(v.z) != v.z ||
           finite_bf16x2(v.w) != v.w;
  }
  if (!__syncthreads_or(bad)) return false;
  for (int i = threadIdx.x; i < kChunks; i += kWalkerThreads) {
    const uint4 v = ld_shared_v4(src + 16 * i);
    st_shared_v4(dst + 16 * i, finite_bf16x2(v.x), finite_bf16x2(v.y), finite_bf16x2(v.z), finite_bf16x2(v.w));
  }
  fence_proxy_async();
  return true;
}

// Launches a kernel that walks the plan's chunk list: one persistent CTA per SM, no more CTAs
// than chunks, `smem_bytes` of dynamic shared memory.
template <class Args>
void launch_chunk_walker(void (*kernel)(Args), const Args& args, int smem_bytes, const PlanState& st,
                         cudaStream_t stream, const char* name) {
  if (st.chunk_capacity == 0) return;
  MSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  const int grid = int(std::min<int64_t>(st.chunk_capacity, sm_count()));
  kernel<<<grid, kWalkerThreads, smem_bytes, stream>>>(args);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_cuda_error(name, err, __FILE__, __LINE__);
}

}  // namespace msa::cuda
