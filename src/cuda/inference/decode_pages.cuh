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
#include "cuda/device.cuh"
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

// The CTA's work (grid: row tiles x KV heads x splits): rows r0 .. r0 + nrows - 1 of the step,
// KV head g, split `split`.
struct DecodeTile {
  int64_t r0;
  int nrows, g, split;
};
__device__ __forceinline__ DecodeTile decode_tile(const AttnArgs& a) {
  const int64_t r0 = int64_t(blockIdx.x) * a.rows_per_tile;
  return {r0, int(min64(a.rows_per_tile, a.total_q - r0)), int(blockIdx.y), int(blockIdx.z)};
}

// The power of two by which a query head whose largest finite |q| is `max_abs` becomes f16
// operands: max_abs lands in [2^14, 2^15) (every bf16 value above 2^-17 of it exact), at most
// 2^126 so that the inverse, applied to the logits, is a normal float (heads below 2^-112 keep
// fewer bits). Both decode kernels use it for FP8 / NVFP4 caches.
__device__ __forceinline__ float f16_query_scale(float max_abs) {
  const int e = max_abs > 0.0f ? ilogbf(max_abs) : 0;
  return ldexpf(1.0f, min(14 - e, 126));
}

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

// Where a (row, head) `rh` of split `split` writes its 128 outputs: an fp32 row (a split's
// partial, or an f32 output) or, when `f32` is null, a bf16 row. Both kernels' epilogues store
// through these two variants only (the epilogue's code is fetched cold by every CTA of a small
// step: a copy of the store loop per destination cost it, run 49).
struct OutputRow {
  float* f32;
  __nv_bfloat16* bf16;
};
__device__ __forceinline__ OutputRow output_row(const AttnArgs& a, int64_t rh, int split) {
  float* f32 = a.splits > 1 ? a.part_out + (int64_t(split) * a.total_q * a.hq + rh) * model::kHeadDim
               : a.out_f32  ? static_cast<float*>(a.out) + rh * model::kHeadDim
                            : nullptr;
  return {f32, static_cast<__nv_bfloat16*>(a.out) + rh * model::kHeadDim};
}

// The distinct pages of a CTA's split. Entry e = (tile row e / 16, slot e % 16).
struct SplitPages {
  int2 entry_key[kMaxEntries];         // (request, logical page); (-1, -1): selects nothing
  int32_t entry_tokens[kMaxEntries];   // keys of the page the entry's row sees
  int32_t warp_firsts[kEntryWarps];    // first appearances per warp of entries
  int32_t warp_valids[kEntryWarps];    // entries that select a page, per warp (PageOrder::in_rounds)
  bool entry_first[kMaxEntries];       // the entry is its page's first appearance (PageOrder::by_page)
  // PageOrder::in_rounds: per row its entries by logical page; per entry its page's rows and
  // the most tokens they see; per row its valid entries.
  int32_t row_sorted[kMaxEntries];
  uint32_t entry_rows[kMaxEntries];
  int32_t entry_most[kMaxEntries];
  int32_t row_count[kMaxTileRows];
  int32_t page_physical[kMaxEntries];  // the split's pages, in union order
  int32_t page_logical[kMaxEntries];
  int32_t page_tokens[kMaxEntries];    // tokens read: the most any selecting row sees
  uint32_t page_rows[kMaxEntries];     // bit i: tile row i selected the page
  // Tiles of one request (collect_pages' map path): per logical page the rows that selected it,
  // the pages some row selected as bits, the rows' positions.
  uint32_t rows_of_page[kTablePages];
  uint32_t page_bits[kTablePages / 32];
  int32_t row_pos[kMaxTileRows];
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

// The physical page of (request, logical page) `key`: from the preloaded page-table row when it
// is that request's and holds the page, else from the plan's table in global memory.
__device__ __forceinline__ int32_t physical_page(const AttnArgs& a, const TableRow* table, int2 key) {
  return table && key.x == table->request && key.y < table->pages
             ? table->physical[key.y]
             : a.kv.page_table[int64_t(key.x) * a.kv.max_pages + key.y];
}

// The order of a split's pages. by_row: entry order, row by row (a page comes where its first
// selecting row has it; a row's order then depends only on the rows before it): a split's share
// holds few rows' pages, and the wgmma kernel's warpgroups skip the pages none of their rows
// selected. by_page: by logical page, then request: the rows' pages interleave, so that a
// window of the row-warp kernel's ring holds pages of most rows and their warps work at the
// same time (row by row, a row's warps worked while the others waited on the ring: 1.2-1.8x
// slower from 4 rows a tile where rows select apart, run 26). in_rounds: every row takes its
// own pages by logical page, one a round, and a page shared by several rows comes in the first
// round where it is next for all of them (within a round, by row): the rows interleave evenly,
// but the rounds run one after another on one warp (run 27: worth it on long NVFP4 requests
// whose rows select apart only). by_page and in_rounds keep each row's own pages in page order
// whatever the other rows selected (docs/semantics.md §4.4: the rows' rounding too; run 25's
// slot order broke that).
enum class PageOrder { by_row, by_page, in_rounds };

// The rounds of PageOrder::in_rounds, by warp 0 (lane = tile row): each round every row with
// pages left proposes its next one; a page proposed by every row that selected it is taken
// (by its lowest row). The smallest page left is always taken, so each round takes at least
// one. Writes this split's share [u0, u1) of the order.
__device__ __forceinline__ void order_pages_in_rounds(const AttnArgs& a, SplitPages& ctl, int nrows, int u0, int u1,
                                                      const TableRow* table) {
  const int lane = threadIdx.x & 31;
  const int count = lane < nrows ? ctl.row_count[lane] : 0;
  int next = 0, taken = 0;
  while (__any_sync(0xffffffffu, next < count)) {
    const bool active = next < count;
    const int e = active ? ctl.row_sorted[lane * kTopk + next] : 0;
    const int2 key = active ? ctl.entry_key[e] : make_int2(-2 - lane, 0);  // an idle lane matches no other
    const uint32_t rows = active ? ctl.entry_rows[e] : 0u;
    const uint32_t same =
        __match_any_sync(0xffffffffu, (static_cast<unsigned long long>(uint32_t(key.x)) << 32) | uint32_t(key.y));
    const bool ready = active && same == rows;
    const bool taker = ready && lane == __ffs(same) - 1;
    const uint32_t takers = __ballot_sync(0xffffffffu, taker);
    const int u = taken + __popc(takers & ((1u << lane) - 1u));
    if (taker && u >= u0 && u < u1) {
      ctl.page_physical[u - u0] = physical_page(a, table, key);
      ctl.page_logical[u - u0] = key.y;
      ctl.page_tokens[u - u0] = ctl.entry_most[e];
      ctl.page_rows[u - u0] = rows;
    }
    taken += __popc(takers);
    if (ready)  // past the page and any repeat of it in the row
      do ++next;
      while (next < count && ctl.entry_key[ctl.row_sorted[lane * kTopk + next]].y == key.y);
  }
}

// collect_pages for a tile of one request (every thread of the CTA, after its first barrier;
// `key` = this thread's entry, (-1, -1) for none): the same pages in the same order and shares
// as the pairwise path. A page's rows come from the map, its first appearance is its lowest
// row's entry (a row's ids are unique), the most tokens any of its rows sees is its highest
// row's (a request's rows sit at increasing positions); by_page ranks a page among the map's
// set bits below it.
__device__ __forceinline__ int collect_pages_by_map(const AttnArgs& a, SplitPages& ctl, int2 key, int split,
                                                    PageOrder order, const TableRow& table, int map_words) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, warps = int(blockDim.x) >> 5;
  const bool valid = key.x >= 0;
  const int row = tid / kTopk;
  if (valid) atomicOr(&ctl.rows_of_page[key.y], 1u << row);
  __syncthreads();
  const uint32_t rows = valid ? ctl.rows_of_page[key.y] : 0u;
  const bool first = valid && __ffs(int(rows)) - 1 == row;
  const uint32_t firsts = __ballot_sync(0xffffffffu, first);  // by_row: this warp's first appearances
  if (order == PageOrder::by_page) {
    for (int w = warp; w < map_words; w += warps) {
      const uint32_t bits = __ballot_sync(0xffffffffu, ctl.rows_of_page[32 * w + lane] != 0u);
      if (lane == 0) ctl.page_bits[w] = bits;
    }
  } else if (lane == 0 && warp < kEntryWarps) {
    ctl.warp_firsts[warp] = __popc(firsts);
  }
  __syncthreads();
  int unique = 0, before = 0;
  if (order == PageOrder::by_page) {
    for (int w = 0; w < map_words; ++w) {
      const uint32_t bits = ctl.page_bits[w];
      unique += __popc(bits);
      if (first) before += w < key.y / 32 ? __popc(bits) : w == key.y / 32 ? __popc(bits & ((1u << (key.y % 32)) - 1u)) : 0;
    }
  } else {
    before = __popc(firsts & ((1u << lane) - 1u));
#pragma unroll
    for (int w = 0; w < kEntryWarps; ++w) {
      const int n = ctl.warp_firsts[w];
      unique += n;
      if (w < warp) before += n;
    }
  }
  const int u0 = int(int64_t(split) * unique / a.splits), u1 = int(int64_t(split + 1) * unique / a.splits);
  if (first && before >= u0 && before < u1) {
    const int u = before - u0;
    ctl.page_physical[u] = physical_page(a, &table, key);
    ctl.page_logical[u] = key.y;
    ctl.page_tokens[u] = visible_keys(ctl.row_pos[31 - __clz(int(rows))], key.y);
    ctl.page_rows[u] = rows;
  }
  return u1 - u0;
}

// Step 1 of both kernels: the union of the tile's selections and this split's share of it.
// Every thread of the CTA calls it (it holds two CTA barriers; threads 0 .. 127 hold the
// entries). `table`: preload_page_table's, when it ran before. Returns the split's page count.
__device__ __forceinline__ int collect_pages(const AttnArgs& a, SplitPages& ctl, int64_t r0, int nrows, int g, int split,
                                             PageOrder order, const TableRow* table = nullptr) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int entries = nrows * kTopk;
  // Tiles of more than 2 rows of one request (the preloaded page-table row is that request's)
  // whose pages all fit the map (at most kTablePages): the union through a map from logical
  // page to the rows that selected it, instead of comparing every pair of entries (6 us of an
  // 8-row tile's step, run 42). The rounds keep the pairwise path.
  const bool map_path = table && order != PageOrder::in_rounds && nrows > 2 && a.kv.max_pages <= kTablePages;
  const int map_words = int((a.kv.max_pages + 31) / 32);
  if (map_path)
    for (int i = tid; i < map_words * 32; i += blockDim.x) ctl.rows_of_page[i] = 0u;
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
    if (tid % kTopk == 0) ctl.row_pos[tid / kTopk] = pos;
  }
  if (table) cp_async_wait<0>();  // this thread's copies of the preloaded row
  __syncthreads();
  if (map_path && table->request >= 0) return collect_pages_by_map(a, ctl, key, split, order, *table, map_words);
  // The entry's page: first appearance, the rows that selected it, the most tokens they see;
  // its rank among its row's entries by page (a repeat right after the first).
  const bool valid = key.x >= 0;
  bool first = valid;
  uint32_t rows = 0;
  int rank = 0;
  if (valid) {
#pragma unroll 4
    for (int e = 0; e < entries; ++e) {
      const int2 other = ctl.entry_key[e];
      if (other.x == key.x && other.y == key.y) {
        if (e < tid) first = false;
        rows |= 1u << (e / kTopk);
        tokens = max(tokens, ctl.entry_tokens[e]);
      }
      if (order == PageOrder::in_rounds)
        rank += e / kTopk == tid / kTopk && other.x >= 0 && (other.y < key.y || (other.y == key.y && e < tid));
    }
  }
  const uint32_t ballot = __ballot_sync(0xffffffffu, first);
  const uint32_t valids = __ballot_sync(0xffffffffu, valid);
  if (lane == 0 && warp < kEntryWarps) ctl.warp_firsts[warp] = __popc(ballot);
  if (order != PageOrder::by_row && tid < entries) ctl.entry_first[tid] = first;
  if (order == PageOrder::in_rounds && lane == 0 && warp < kEntryWarps) ctl.warp_valids[warp] = __popc(valids);
  if (order == PageOrder::in_rounds && tid < entries) {
    if (valid) {
      ctl.row_sorted[(tid / kTopk) * kTopk + rank] = tid;
      ctl.entry_rows[tid] = rows;
      ctl.entry_most[tid] = tokens;
    }
    if (tid % kTopk == 0) ctl.row_count[tid / kTopk] = __popc((valids >> (lane & 16)) & 0xffffu);
  }
  __syncthreads();
  int unique = 0, valid_entries = 0, before = __popc(ballot & ((1u << lane) - 1u));
#pragma unroll
  for (int w = 0; w < kEntryWarps; ++w) {
    const int n = ctl.warp_firsts[w];
    unique += n;
    if (order == PageOrder::in_rounds) valid_entries += ctl.warp_valids[w];
    if (w < warp) before += n;
  }
  // Rounds only where the rows select apart (fewer than 2 rows a page on average): where they
  // share their pages, by page is nearly the same order and costs no rounds. Either order keeps
  // each row's pages in page order, so the choice changes no row's result with one split.
  if (order == PageOrder::in_rounds && valid_entries >= 2 * unique) order = PageOrder::by_page;
  if (order == PageOrder::by_page) {  // the page's rank among the distinct (page, request)
    before = 0;
    if (first) {
#pragma unroll 4
      for (int e = 0; e < entries; ++e) {
        const int2 other = ctl.entry_key[e];
        before += ctl.entry_first[e] && (other.y < key.y || (other.y == key.y && other.x < key.x));
      }
    }
  }
  const int u0 = int(int64_t(split) * unique / a.splits), u1 = int(int64_t(split + 1) * unique / a.splits);
  if (order == PageOrder::in_rounds) {
    if (warp == 0) order_pages_in_rounds(a, ctl, nrows, u0, u1, table);
  } else if (first && before >= u0 && before < u1) {
    const int u = before - u0;
    ctl.page_physical[u] = physical_page(a, table, key);
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
// merge_states. `max_cta_pages`: the most distinct pages a CTA of the step can hold; it picks
// the kernel's instance (its code), not the arithmetic.
void launch_rows(KvFormat f, int64_t max_cta_pages, const AttnArgs& a, const CUtensorMap& k_map,
                 const CUtensorMap& v_map, dim3 grid, cudaStream_t stream);
int rows_ctas_per_sm();

// The online-softmax step of a consumer warp's row over a page, in both kernels: the row's 16
// heads are the m16 rows of S's C fragments over 16 n8 key tiles (h = 0: head gid of the lane,
// 1: gid + 8). S is scaled in place (qk[h]: softmax scale x log2 e x any per-tensor scale, times
// the per-token K scale; keys past `limit` at -inf), the running max m and sum l updated, the
// lane's 64 output accumulators `o` (any layout whose element 4t + 2h + e belongs to head h)
// multiplied by alpha x w.o_factor(), and P written as A fragments of P V's 8 k16 steps (f16
// with kF16, else bf16), keys t, t + 1 times w.weight(t) (a float2).
// `w`, the V weights: w.see(t) is called for every key pair first (a running scale can grow),
// then w.o_factor() once, then w.weight(t).
template <bool kF16, class VWeights>
__device__ __forceinline__ void online_softmax_page(float (&o)[64], float (&m)[2], float (&l)[2], float (&s)[16][4],
                                                    uint32_t (&p)[8][4], int limit, const float (&qk)[2],
                                                    const float* k_scale, VWeights& w, int quad) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int t = 8 * j + 2 * quad;
    const float2 ks = k_scale ? *reinterpret_cast<const float2*>(k_scale + t) : make_float2(1.0f, 1.0f);
    w.see(t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = t + (e & 1) < limit ? s[j][e] * qk[e >> 1] * ((e & 1) ? ks.y : ks.x) : -INFINITY;
      s[j][e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  }
  const float o_factor = w.o_factor();
  float use[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float mnew = fmaxf(m[h], warp_max4(mx[h]));
    use[h] = mnew == -INFINITY ? 0.0f : mnew;  // a row with no key yet: exp2(-inf - 0) = 0
    const float alpha = fast_exp2(m[h] - use[h]);
    const float o_alpha = alpha * o_factor;
    m[h] = mnew;
    l[h] *= alpha;
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      o[4 * t + 2 * h] *= o_alpha;
      o[4 * t + 2 * h + 1] *= o_alpha;
    }
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int t = 8 * j + 2 * quad;
    const float p0 = fast_exp2(s[j][0] - use[0]), p1 = fast_exp2(s[j][1] - use[0]);
    const float p2 = fast_exp2(s[j][2] - use[1]), p3 = fast_exp2(s[j][3] - use[1]);
    l[0] += p0 + p1;
    l[1] += p2 + p3;
    const float2 v = w.weight(t);
    // A fragment: (head gid, keys 16c + 2q, + 1) then the same keys + 8; then head gid + 8.
    p[j / 2][2 * (j & 1)] = kF16 ? pack_f16(p0 * v.x, p1 * v.y) : pack_bf16(p0 * v.x, p1 * v.y);
    p[j / 2][2 * (j & 1) + 1] = kF16 ? pack_f16(p2 * v.x, p3 * v.y) : pack_bf16(p2 * v.x, p3 * v.y);
  }
}

// V weights of online_softmax_page: the page's per-token V scales as they are (nullptr: 1).
struct TokenVWeights {
  const float* v_scale;
  __device__ __forceinline__ void see(int) {}
  __device__ __forceinline__ float o_factor() const { return 1.0f; }
  __device__ __forceinline__ float2 weight(int t) const {
    return v_scale ? *reinterpret_cast<const float2*>(v_scale + t) : make_float2(1.0f, 1.0f);
  }
};

// The lane's 64 output accumulators of a row state, flat (both kernels' layouts are 16 x 4).
template <class State>
__device__ __forceinline__ float (&flat_outputs(State& st))[64] {
  static_assert(sizeof(st.o) == 64 * sizeof(float), "a lane holds 64 accumulators");
  return reinterpret_cast<float(&)[64]>(st.o);
}

}  // namespace msa::cuda::decode
