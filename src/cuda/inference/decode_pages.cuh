// What the two decode attention kernels share: their arguments, and step 1 of both, the
// distinct pages a CTA's split reads.
//
// CTA = (a tile of R <= 8 query rows, KV head g, split s). The CTA builds the union of the
// (request, page) pairs its rows selected, and split s takes the distinct pages
// s * U / S .. (s + 1) * U / S - 1 of that union of U: every distinct page is streamed once per
// (tile, KV head) whatever the split count, and the splits get equal shares of it.
//   paged_decode_rows.cu     row-warp kernel: a warp per row, mma.sync on the pages the row selected
//   paged_decode_wgmma.cu    wgmma kernel for bf16 / FP8 caches (a warpgroup computes 4 rows x 16 heads)
// (paged_attention.cu picks one per format and tile size.)
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "core/decode_splits.h"
#include "cuda/kv_source.cuh"
#include "cuda/tensor_map.h"

namespace msa::cuda::decode {

using model::kPageSize;
using model::kTopk;

inline constexpr int kMaxTileRows = detail::kDecodeTileRows;  // query rows of a CTA
inline constexpr int kMaxEntries = kMaxTileRows * kTopk;      // (row, slot) selections of a CTA
inline constexpr int kEntryWarps = kMaxEntries / 32;          // warps that hold the entries
inline constexpr int kTablePages = 1024;  // page-table entries a CTA preloads (a 128k context's)

struct AttnArgs {
  const __nv_bfloat16* q;
  int64_t q_s0, q_s1;                 // elements
  KvSource kv;                        // the cache: block scales, scales, page table (pages come by TMA)
  const int32_t* topk;                // [Hkv, T, 16]
  const int32_t* positions;
  const int32_t* request;
  int64_t total_q;
  int hq;
  int rows_per_tile;
  int splits;
  float softmax_scale;
  void* out;                          // splits == 1: [T, Hq, 128] bf16 / f32
  bool out_f32;
  float* lse;                         // splits == 1: [T, Hq]
  float* part_out;                    // splits > 1: [S, T, Hq, 128]
  float* part_lse;                    // splits > 1: [S, T, Hq]
  int32_t* arrivals;                  // splits > 1, wgmma kernel: [tiles, Hkv] split CTAs done (the last merges)
};

__device__ __forceinline__ int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

// Keys of logical page `page` that a row at position `pos` sees (<= 0: none).
__device__ __forceinline__ int visible_keys(int32_t pos, int32_t page) {
  return int(min64(kPageSize, int64_t(pos) - int64_t(page) * kPageSize + 1));
}

// The masks that keep, of the B fragments of P V's k16 step c (b0: keys 16c + 2q, + 1; b1: keys
// 16c + 2q + 8, + 9, quad q), the keys below a row's `limit` (x: for b0, y: for b1). Keys past the
// limit are removed by selection, not by multiplying with P = 0: their values may be inf / NaN.
__device__ __forceinline__ uint2 keys_below(int c, int limit, int quad) {
  const int t0 = c * 16 + 2 * quad;
  return make_uint2((t0 < limit ? 0x0000ffffu : 0u) | (t0 + 1 < limit ? 0xffff0000u : 0u),
                    (t0 + 8 < limit ? 0x0000ffffu : 0u) | (t0 + 9 < limit ? 0xffff0000u : 0u));
}

// The distinct pages of a CTA's split. Entry e = (tile row e / 16, slot e % 16).
struct SplitPages {
  int2 entry_key[kMaxEntries];         // (request, logical page); (-1, -1): selects nothing
  int32_t entry_tokens[kMaxEntries];   // keys of the page the entry's row sees
  int32_t warp_firsts[kEntryWarps];    // first appearances per warp of entries
  int32_t page_physical[kMaxEntries];  // the split's pages, in union order
  int32_t page_logical[kMaxEntries];
  int32_t page_tokens[kMaxEntries];    // tokens read: the most any selecting row sees
  uint32_t page_rows[kMaxEntries];     // bit i: tile row i selected the page
};

// The page-table row of a tile's request in shared memory (preload_page_table).
struct TableRow {
  int32_t physical[kTablePages];  // the row's first `pages` entries
  int32_t request;                // -1: none preloaded
  int32_t pages;
};

// Optional step 0, before the selection exists (the page table is the plan's, not a kernel's
// output, so this may run before griddep_wait): the page-table row of the tile's request into
// shared memory, so that the page lookups after the selection cost no global round trip.
// Tiles of rows of two requests (Q > 8, odd) and pages past kTablePages look up globally.
// Every thread calls it; the first barrier of collect_pages publishes it.
__device__ __forceinline__ void preload_page_table(const AttnArgs& a, TableRow& table, int64_t r0, int nrows) {
  const int32_t request = a.request[r0];
  const bool one = a.request[r0 + nrows - 1] == request;
  const int n = one ? int(min64(a.kv.max_pages, kTablePages)) : 0;
  const int32_t* row = a.kv.page_table + int64_t(request) * a.kv.max_pages;
  // cp.async: the loads hold no registers, so the thread goes on to the wait at once;
  // collect_pages waits for them (with the query tile and the top-k) before its barrier.
  for (int i = threadIdx.x; i < n; i += blockDim.x) cp_async4(smem_addr(&table.physical[i]), row + i);
  cp_async_commit();
  if (threadIdx.x == 0) {
    table.request = one ? request : -1;
    table.pages = n;
  }
}

// Step 1 of both kernels: the union of the tile's selections and this split's share of it.
// Every thread of the CTA calls it (it holds two CTA barriers; threads 0 .. 127 hold the
// entries). `table`: preload_page_table's, when it ran before. Returns the split's page count.
__device__ __forceinline__ int collect_pages(const AttnArgs& a, SplitPages& ctl, int64_t r0, int nrows, int g, int split,
                                             const TableRow* table = nullptr) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int entries = nrows * kTopk;
  int2 key = make_int2(-1, -1);
  int tokens = 0;
  if (tid < entries) {
    const int64_t r = r0 + tid / kTopk;
    const int32_t id = a.topk[(int64_t(g) * a.total_q + r) * kTopk + tid % kTopk];
    const int32_t pos = a.positions[r];
    if (id >= 0 && pos >= 0 && int64_t(id) * kPageSize <= pos) {
      key = make_int2(a.request[r], id);
      tokens = visible_keys(pos, id);
    }
    ctl.entry_key[tid] = key;
    ctl.entry_tokens[tid] = tokens;
  }
  if (table) cp_async_wait<0>();  // this thread's copies of the preloaded row
  __syncthreads();
  // The entry's page: first appearance, the rows that selected it, the most tokens they see.
  bool first = key.x >= 0;
  uint32_t rows = 0;
  if (first) {
#pragma unroll 4
    for (int e = 0; e < entries; ++e) {
      const int2 other = ctl.entry_key[e];
      if (other.x == key.x && other.y == key.y) {
        if (e < tid) first = false;
        rows |= 1u << (e / kTopk);
        tokens = max(tokens, ctl.entry_tokens[e]);
      }
    }
  }
  const uint32_t ballot = __ballot_sync(0xffffffffu, first);
  if (lane == 0 && warp < kEntryWarps) ctl.warp_firsts[warp] = __popc(ballot);
  __syncthreads();
  int unique = 0, before = __popc(ballot & ((1u << lane) - 1u));
#pragma unroll
  for (int w = 0; w < kEntryWarps; ++w) {
    const int n = ctl.warp_firsts[w];
    unique += n;
    if (w < warp) before += n;
  }
  const int u0 = int(int64_t(split) * unique / a.splits), u1 = int(int64_t(split + 1) * unique / a.splits);
  if (first && before >= u0 && before < u1) {
    const int u = before - u0;
    ctl.page_physical[u] = table && key.x == table->request && key.y < table->pages
                               ? table->physical[key.y]
                               : a.kv.page_table[int64_t(key.x) * a.kv.max_pages + key.y];
    ctl.page_logical[u] = key.y;
    ctl.page_tokens[u] = tokens;
    ctl.page_rows[u] = rows;
  }
  return u1 - u0;
}

// The wgmma kernel (paged_decode_wgmma.cu): bf16 and FP8 caches (scales of every kind); grid
// = (tiles, Hkv, splits); `k_map` / `v_map` are the caches' 4-D page maps (paged_cache_map).
void launch_wgmma(KvFormat f, const AttnArgs& a, const CUtensorMap& k_map, const CUtensorMap& v_map, dim3 grid,
                  cudaStream_t stream);
// CTAs of that kernel an SM holds at once (the fewest over its formats).
int wgmma_ctas_per_sm(int rows_per_tile);

// The row-warp kernel (paged_decode_rows.cu): every format; the same grid; FP8 / NVFP4 page
// maps swizzled (paged_cache_map(.., swizzled = true)). Splits > 1 leave partials for
// merge_states.
void launch_rows(KvFormat f, const AttnArgs& a, const CUtensorMap& k_map, const CUtensorMap& v_map, dim3 grid,
                 cudaStream_t stream);
int rows_ctas_per_sm();

}  // namespace msa::cuda::decode
