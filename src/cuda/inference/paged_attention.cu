// Decode attention over the paged K/V caches on the GPU (split-K): the host side for every
// format, and the mma.sync kernel that NVFP4 caches run on; bf16 and FP8 caches run on the
// wgmma kernel (paged_decode_wgmma.cu). Paged prefill runs on the training forward instead
// (paged_prefill.cu); paged_attention hands prefill plans to it.
//
// CTA = (a tile of R <= 8 query rows, KV head g, split s): step 1, the split's distinct pages,
// is decode_pages.cuh's. Pages arrive by TMA (one thread, one box a side, an mbarrier per
// stage) into a ring of 2-4 stages, so the next pages are in flight while one is used, and the
// two pages after them are prefetched into L2; the NVFP4 codes are widened to exact bf16
// values in shared memory through a per-CTA table of the 256 x 16 (block scale, code) values
// (block scales, 8 bytes a row, come by cp.async).
//
// The work of a page is spread over all 16 warps whatever rows selected it (at long contexts
// most pages are selected by one row of a step): for each selecting row, warp w computes the
// logits of tokens 8w .. 8w + 7 (S = Q K^T, m16n8k16 on tensor cores, the 16 heads of the row
// are the m16 tile), the warps exchange their maxima, write the probabilities P as a bf16 tile,
// and warp w accumulates output dims 8w .. 8w + 7 of O += P V. The online-softmax max of a
// (row, head) is shared (shared memory), the sums are per warp and added at the end. Scales:
// the per-tensor (global) K scale and the softmax scale multiply the logits, per-token K
// scales each logit column, per-token V scales the probabilities fed to P V, the per-tensor V
// scale the output. Splits > 1 write normalised partial states that merge_states combines by
// LSE; the plan picks the split count (src/core/decode_splits.h).
#include <algorithm>
#include <cstddef>
#include <mutex>

#include "attention_state.h"
#include "backend.h"
#include "core/check.h"
#include "core/decode_splits.h"
#include "cuda/device.cuh"
#include "cuda/inference/decode_pages.cuh"
#include "cuda/inference/quant.cuh"
#include "cuda/kv_source.cuh"
#include "cuda/plan_streams.h"
#include "cuda/tensor_map.h"

namespace msa::cuda {

namespace {

using namespace inference;
using namespace decode;
using model::kGroupSize;
using model::kHeadDim;
using model::kPageSize;
using model::kTopk;

constexpr int kWarps = 16;                          // a CTA's warps: token slices of S, dim slices of O
constexpr int kThreads = kWarps * 32;
constexpr int kSlice = kPageSize / kWarps;          // tokens of a page (and dims of O) per warp: 8
constexpr int kChunk = 16;                          // bytes of one cp.async / ld.shared.v4
constexpr int kKeySteps = kHeadDim / 16;            // k16 steps of S = Q K^T
constexpr int kTokenSteps = kPageSize / 16;         // k16 steps of O += P V
constexpr int kBf16RowChunks = kHeadDim * 2 / kChunk;      // 16-byte chunks of a bf16 128-row
constexpr int kFp4RowChunks = kNvfp4RowBytes / kChunk;     // ... of an NVFP4 row (two codes a byte)
constexpr int kSharedLimit = 227 * 1024;
constexpr int kPrefetchPages = 2;                   // pages past the ring's newest brought into L2
static_assert(kSlice == 8, "a warp's token slice is one n8 tile of S, its dim slice one of O");
static_assert(2 * kPageSize <= kThreads, "one thread per (side, token) of a page's per-token scales");
static_assert(kMaxEntries <= kThreads, "one thread per selection of the tile");

// A [Rows, 128] bf16 tile in the swizzled layout of tile_offset (device.cuh).
template <int Rows>
struct Bf16Tile {
  uint8_t bytes[Rows * kHeadDim * 2];
};
using PageTile = Bf16Tile<kPageSize>;  // one side (K or V) of a page
using HeadTile = Bf16Tile<kGroupSize>; // the 16 heads of a row: its queries, or its P over a page
constexpr int kPageTileBytes = int(sizeof(PageTile));
constexpr int kHeadTileBytes = int(sizeof(HeadTile));


// One page of the cache (K and V of one KV head) as it arrives from global memory: side 0 = K,
// side 1 = V; the NVFP4 codes land row-major (one TMA box a side) and are widened into PageTiles.
struct KvStage {
  static constexpr int kBoxBytes = kPageSize * kNvfp4RowBytes;
  uint8_t codes[2][kPageSize][kNvfp4RowBytes];
  uint8_t block_scales[2][kPageSize][kNvfp4RowScales];  // one 8-byte copy a row
  static __device__ __forceinline__ uint32_t chunk(int side, int t, int c) {
    return side * (kPageSize * kNvfp4RowBytes) + t * kNvfp4RowBytes + c * kChunk;
  }
  static __device__ __forceinline__ uint32_t scales(int side, int t) {
    return int(offsetof(KvStage, block_scales)) + side * (kPageSize * kNvfp4RowScales) + t * kNvfp4RowScales;
  }
};
static_assert(kNvfp4RowScales == 8, "an NVFP4 row's block scales are one 8-byte copy");
constexpr uint32_t kStageTmaBytes = 2 * KvStage::kBoxBytes;

// Per tile row, the softmax bookkeeping the warps share (the split's pages: SplitPages).
struct alignas(16) PageSet {
  uint64_t full[4];                    // per stage: the page's TMA bytes have landed
  int32_t row_position[kMaxTileRows];  // of the tile's rows (-1: none)
  float token_scale[2][2][kPageSize];  // [page parity][K, V] per-token scales (zero past the tokens read)
  float row_max[2][kMaxTileRows][kGroupSize];          // [page parity] running max of a (row, head), log2 units
  float part[kMaxTileRows][kGroupSize][kWarps];        // per-warp maxima of a page, then per-warp sums
};

struct WidenedPage {
  PageTile side[2];
};
// NVFP4 values by (block scale code, E2M1 code): bf16 bits of E4M3(e2m1 * scale), the value the
// format defines; built once per CTA, so widening a code is one shared-memory load.
struct Nvfp4Table {
  uint16_t value[256][16];
};

// Stages of the page ring for a tile size: as many (up to 4) as shared memory holds.
template <int R>
constexpr int fixed_shared_bytes() {
  return 1024 + int(sizeof(WidenedPage)) + int(sizeof(Nvfp4Table)) +
         2 * R * kHeadTileBytes + int(sizeof(PageSet)) + 16;
}
template <int R>
constexpr int stage_count() {
  int s = 4;
  while (s > 2 && fixed_shared_bytes<R>() + s * int(sizeof(KvStage)) > kSharedLimit) --s;
  return s;
}

// Shared memory of paged_attention_kernel (from a 1024-byte aligned base).
template <int R>
struct SharedStorage {
  static constexpr int kStages = stage_count<R>();
  KvStage stage[kStages];
  HeadTile q[R];  // queries of each row
  HeadTile p[R];  // probabilities of each row over the page in use
  WidenedPage converted;  // K, V widened from the stage in use
  Nvfp4Table nvfp4;
  SplitPages pages;
  PageSet set;
};

template <int R>
constexpr int smem_bytes() {
  using S = SharedStorage<R>;
  static_assert(sizeof(KvStage) % 1024 == 0 && offsetof(S, converted) % 1024 == 0 && offsetof(S, q) % 1024 == 0 &&
                    offsetof(S, p) % 1024 == 0,
                "paged_attention_kernel: swizzled tiles must be 1024-byte aligned");
  static_assert(S::kStages <= 4, "PageSet::full holds 4 stages");
  return 1024 + int(sizeof(S));
}

__device__ __forceinline__ uint2 ld_shared_v2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

// B fragments of one n-tile (rows n0.. of a tile that stores B transposed, e.g. K) over two
// k16 steps k0, k0 + 16: b[0], b[1] for the first, b[2], b[3] for the second.
__device__ __forceinline__ void load_b_nk_2k(uint32_t (&b)[4], uint32_t tile, int rows, int n0, int k0, int lane) {
  ldmatrix_x4(b, tile + tile_offset(rows, n0 + (lane & 7), (k0 >> 3) + (lane >> 3)));
}
// B fragments of one n-tile (columns n0.. of a tile that stores B as rows = k, e.g. V) over
// two k16 steps k0, k0 + 16, same order.
__device__ __forceinline__ void load_b_kn_2k(uint32_t (&b)[4], uint32_t tile, int rows, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, tile + tile_offset(rows, k0 + (lane & 7) + 8 * (lane >> 3), n0 >> 3));
}

// The copies of one page (both sides) into a stage: TMA boxes of the K and V maps by thread 0,
// signalling the stage's barrier; NVFP4 block scales by cp.async from threads (side, token),
// zero past the tokens read.
__device__ __forceinline__ void issue_page(const AttnArgs& a, const CUtensorMap* k_map, const CUtensorMap* v_map,
                                           uint32_t stage, uint32_t full, int32_t phys, int g, int nmax) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    const uint64_t policy = l2_evict_first();
    mbar_arrive_expect_tx(full, kStageTmaBytes);
#pragma unroll
    for (int side = 0; side < 2; ++side)
      tma_load_4d(stage + uint32_t(side * KvStage::kBoxBytes), side ? v_map : k_map, 0, 0, g, phys, full, policy);
  }
  if (tid < 2 * kPageSize) {
    const int side = tid / kPageSize, t = tid % kPageSize;
    const bool ok = t < nmax;
    const uint8_t* ks = a.kv.k_block_scale + phys * a.kv.ksf_page + g * a.kv.ksf_head;
    const uint8_t* vs = a.kv.v_block_scale + phys * a.kv.vsf_page + g * a.kv.vsf_head;
    const uint8_t* src = side ? vs + t * a.kv.vsf_row : ks + t * a.kv.ksf_row;
    cp_async8(stage + KvStage::scales(side, t), ok ? src : ks, ok ? kNvfp4RowScales : 0);
  }
}

__device__ __forceinline__ uint32_t ld_shared_u16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr) : "memory");
  return v;
}

// Widens an NVFP4 stage into the bf16 K and V tiles (`tiles`: the converted PageTile pair;
// `table`: the Nvfp4Table).
__device__ __forceinline__ void convert_page(uint32_t stage, uint32_t tiles, uint32_t table) {
  const int tid = threadIdx.x;
  for (int i = tid; i < 2 * kPageSize * kFp4RowChunks; i += kThreads) {
    const int side = i / (kPageSize * kFp4RowChunks), t = (i / kFp4RowChunks) % kPageSize,
              c = i % kFp4RowChunks;  // elements 32c .. 32c + 31: block scales 2c, 2c + 1
    const uint4 raw = ld_shared_v4(stage + KvStage::chunk(side, t, c));
    const uint2 sf = ld_shared_v2(stage + KvStage::scales(side, t));
    const uint32_t scales = (c < 2 ? sf.x : sf.y) >> (16 * (c & 1));  // codes of blocks 2c, 2c + 1
    const uint32_t block[2] = {table + (scales & 0xffu) * 32u, table + ((scales >> 8) & 0xffu) * 32u};
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    uint32_t o[16];
#pragma unroll
    for (int j = 0; j < 4; ++j)  // word j: elements 32c + 8j .. + 7, block 2c for j < 2
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t byte = (w[j] >> (8 * e)) & 0xffu;
        o[4 * j + e] = ld_shared_u16(block[j / 2] + (byte & 0xfu) * 2) | (ld_shared_u16(block[j / 2] + (byte >> 4) * 2) << 16);
      }
    const uint32_t tile = tiles + side * kPageTileBytes;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      st_shared_v4(tile + tile_offset(kPageSize, t, 4 * c + q), o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
  }
}

template <int R>
__global__ void __launch_bounds__(kThreads, 1)
    paged_attention_kernel(const AttnArgs a, const __grid_constant__ CUtensorMap k_map,
                           const __grid_constant__ CUtensorMap v_map) {
  using Storage = SharedStorage<R>;
  constexpr int kStages = Storage::kStages;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = align1024(smem_addr(smem_raw));
  Storage& smem = *reinterpret_cast<Storage*>(smem_raw + (base - smem_addr(smem_raw)));
  PageSet& ctl = smem.set;
  SplitPages& list = smem.pages;
  const uint32_t stage0 = base + uint32_t(offsetof(Storage, stage));
  const uint32_t converted = base + uint32_t(offsetof(Storage, converted));
  const uint32_t q_tiles = base + uint32_t(offsetof(Storage, q));
  const uint32_t p_tiles = base + uint32_t(offsetof(Storage, p));
  const uint32_t full0 = smem_addr(&ctl.full[0]);
  const uint32_t table = base + uint32_t(offsetof(Storage, nvfp4));
  auto stage_at = [&](int u) { return stage0 + uint32_t((u % kStages) * int(sizeof(KvStage))); };
  auto full_at = [&](int u) { return full0 + uint32_t((u % kStages) * 8); };

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int quad = lane & 3, gr = lane >> 2;
  const int64_t r0 = int64_t(blockIdx.x) * a.rows_per_tile;
  const int nrows = int(min64(a.rows_per_tile, a.total_q - r0));
  const int g = blockIdx.y, split = blockIdx.z;

  // 1. The split's distinct pages.
  if (tid < kStages) mbar_init(full0 + 8 * tid, 1);
  if (tid < R * kGroupSize) ctl.row_max[0][tid / kGroupSize][tid % kGroupSize] = -INFINITY;
  if (tid < R) ctl.row_position[tid] = tid < nrows ? a.positions[r0 + tid] : -1;
  for (int i = tid; i < 256 * 16; i += kThreads) {
    const float value = e4m3_to_f32(nvfp4_to_e4m3(uint32_t(i % 16), e4m3_to_f32(uint8_t(i / 16))));
    smem.nvfp4.value[i / 16][i % 16] = uint16_t(bf16x2_bits(value, 0.0f));
  }
  const int pages = collect_pages(a, list, r0, nrows, g, split);

  // 2. Query tiles of the rows (16 heads x 128 each): the first cp.async group.
  for (int i = tid; i < nrows * kGroupSize * kBf16RowChunks; i += kThreads) {
    const int row = i / (kGroupSize * kBf16RowChunks), h = (i / kBf16RowChunks) % kGroupSize, c = i % kBf16RowChunks;
    const __nv_bfloat16* src = a.q + (r0 + row) * a.q_s0 + int64_t(g * kGroupSize + h) * a.q_s1 + c * 8;
    cp_async16(q_tiles + row * kHeadTileBytes + tile_offset(kGroupSize, h, c), src, kChunk);
  }
  cp_async_commit();
  __syncthreads();  // the page set and the barriers are complete

  // 3. Pages.
  const float k_tensor = a.kv.k_tensor_scale ? *a.kv.k_tensor_scale : 1.0f;
  const float v_tensor = a.kv.v_tensor_scale ? *a.kv.v_tensor_scale : 1.0f;
  const float qk_scale = a.softmax_scale * k_tensor * math::kLog2e;  // logits in log2 units
  const bool per_token = a.kv.k_token_scale != nullptr;

  // Per-token scales of page u: thread (side, token) loads one, a page ahead of its use.
  const int scale_side = tid / kPageSize, scale_token = tid % kPageSize;
  const bool scale_thread = per_token && tid < 2 * kPageSize;
  auto load_token_scale = [&](int u) {
    if (!scale_thread || u >= pages || scale_token >= list.page_tokens[u]) return 0.0f;
    const int64_t slot = int64_t(list.page_physical[u]) * kPageSize + scale_token;
    return scale_side ? a.kv.v_token_scale[g * a.kv.v_token_stride + slot]
                      : a.kv.k_token_scale[g * a.kv.k_token_stride + slot];
  };
  if (scale_thread) ctl.token_scale[0][scale_side][scale_token] = load_token_scale(0);

  float o[R][4];  // rows' outputs: heads gr / gr + 8, dims 8 warp + 2 quad (+1)
  float l[R][2];  // rows' sums of 2^(x - m) over this warp's tokens, heads gr / gr + 8
#pragma unroll
  for (int i = 0; i < R; ++i) l[i][0] = l[i][1] = o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

  // Page u into its stage, and the kPrefetchPages pages after it into L2: the ring holds 2-4
  // pages, too few bytes in flight per SM to cover the memory latency under load on its own.
  auto issue = [&](int u) {
    issue_page(a, &k_map, &v_map, stage_at(u), full_at(u), list.page_physical[u], g, list.page_tokens[u]);
    if (tid == 0) {
      const int first = u == 0 ? 1 : u + kPrefetchPages, last = min(u + kPrefetchPages, pages - 1);
      for (int j = first; j <= last; ++j)
#pragma unroll
        for (int side = 0; side < 2; ++side) tma_prefetch_4d(side ? &v_map : &k_map, 0, 0, g, list.page_physical[j]);
    }
  };
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    if (j < pages) issue(j);
    cp_async_commit();
  }
  for (int u = 0; u < pages; ++u) {
    if (u + kStages - 1 < pages) issue(u + kStages - 1);  // into the stage the previous page freed
    cp_async_commit();
    const float next_scale = load_token_scale(u + 1);
    cp_async_wait<kStages - 1>();  // the query tiles; NVFP4: page u's block scales
    mbar_wait(full_at(u), (u / kStages) & 1);
    __syncthreads();
    const uint32_t stage = stage_at(u);
    convert_page(stage, converted, table);
    __syncthreads();
    const uint32_t k_tile = converted;
    const uint32_t v_tile = k_tile + kPageTileBytes;
    const uint32_t selected = list.page_rows[u];
    const int32_t logical = list.page_logical[u];
    const float* k_scale = ctl.token_scale[u & 1][0];
    const float* v_scale = ctl.token_scale[u & 1][1];
    auto row_limit = [&](int i) {  // keys of the page row i sees
      return visible_keys(ctl.row_position[i], logical);
    };

    // 3a. Logits of this warp's 8 tokens for each selecting row, and their maxima per head.
    uint32_t kb[kKeySteps / 2][4];
#pragma unroll
    for (int j = 0; j < kKeySteps / 2; ++j) load_b_nk_2k(kb[j], k_tile, kPageSize, warp * kSlice, j * 32, lane);
    float s[R][4];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (!((selected >> i) & 1u)) continue;
      const int n_row = row_limit(i);
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kKeySteps; ++kk) {
        uint32_t qa[4];
        load_a(qa, q_tiles + i * kHeadTileBytes, kGroupSize, 0, kk * 16, lane);
        mma_bf16(s[i], qa, kb[kk / 2][2 * (kk % 2)], kb[kk / 2][2 * (kk % 2) + 1]);
      }
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = warp * kSlice + 2 * quad + (e & 1);
        float x = s[i][e] * qk_scale;
        if (per_token) x *= k_scale[t];
        if (t >= n_row) x = -INFINITY;
        s[i][e] = x;
        if (e < 2) mx0 = fmaxf(mx0, x);
        else mx1 = fmaxf(mx1, x);
      }
      mx0 = warp_max4(mx0);
      mx1 = warp_max4(mx1);
      if (quad == 0) {
        ctl.part[i][gr][warp] = mx0;
        ctl.part[i][gr + 8][warp] = mx1;
      }
    }
    __syncthreads();

    // 3b. The page max of each (row, head), the rescaled state and P. The online softmax in
    // log2 units by the SoftmaxState rules, written out (l stays in registers). The running
    // maxima are double-buffered by page: every warp computes the same new max from the same
    // values, warp 0 stores it in the other buffer (and carries the rows the page skips).
    const int cur = u & 1;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float m0 = ctl.row_max[cur][i][gr], m1 = ctl.row_max[cur][i][gr + 8];
      if (!((selected >> i) & 1u)) {
        if (warp == 0 && quad == 0) {
          ctl.row_max[cur ^ 1][i][gr] = m0;
          ctl.row_max[cur ^ 1][i][gr + 8] = m1;
        }
        continue;
      }
      const int n_row = row_limit(i);
      float mx0 = m0, mx1 = m1;
#pragma unroll
      for (int w = 0; w < kWarps; w += 4) {
        const float4 p0 = *reinterpret_cast<const float4*>(&ctl.part[i][gr][w]);
        const float4 p1 = *reinterpret_cast<const float4*>(&ctl.part[i][gr + 8][w]);
        mx0 = fmaxf(fmaxf(mx0, fmaxf(p0.x, p0.y)), fmaxf(p0.z, p0.w));
        mx1 = fmaxf(fmaxf(mx1, fmaxf(p1.x, p1.y)), fmaxf(p1.z, p1.w));
      }
      const float use0 = mx0 == -INFINITY ? 0.0f : mx0, use1 = mx1 == -INFINITY ? 0.0f : mx1;
      const float alpha0 = fast_exp2(m0 - use0), alpha1 = fast_exp2(m1 - use1);
      if (warp == 0 && quad == 0) {
        ctl.row_max[cur ^ 1][i][gr] = mx0;
        ctl.row_max[cur ^ 1][i][gr + 8] = mx1;
      }
      l[i][0] *= alpha0;
      l[i][1] *= alpha1;
      o[i][0] *= alpha0;
      o[i][1] *= alpha0;
      o[i][2] *= alpha1;
      o[i][3] *= alpha1;
      float pv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pr = fast_exp2(s[i][e] - (e < 2 ? use0 : use1));
        if (e < 2) l[i][0] += pr;
        else l[i][1] += pr;
        const int t = warp * kSlice + 2 * quad + (e & 1);
        // Keys past the row's limit: p is 0, and so is what it feeds P V (a per-token V
        // scale there may be another row's, or garbage: 0 * NaN would be NaN).
        pv[e] = t >= n_row ? 0.0f : per_token ? pr * v_scale[t] : pr;
      }
      const uint32_t p_tile = p_tiles + i * kHeadTileBytes;
      st_shared_u32(p_tile + tile_offset(kGroupSize, gr, warp) + 4 * quad, bf16x2_bits(pv[0], pv[1]));
      st_shared_u32(p_tile + tile_offset(kGroupSize, gr + 8, warp) + 4 * quad, bf16x2_bits(pv[2], pv[3]));
    }
    __syncthreads();

    // 3c. O += P V over this warp's 8 dims. The V fragments of the page serve every row; a
    // row reads only the 16-key steps below its limit, and in the step that crosses it the
    // keys past the limit are zeroed in V (selection, not multiplication: they may hold NaN).
    uint32_t vb[kTokenSteps / 2][4];
#pragma unroll
    for (int j = 0; j < kTokenSteps / 2; ++j) load_b_kn_2k(vb[j], v_tile, kPageSize, j * 32, warp * kSlice, lane);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (!((selected >> i) & 1u)) continue;
      const int n_row = row_limit(i);
#pragma unroll
      for (int c = 0; c < kTokenSteps; ++c) {
        if (c * 16 >= n_row) break;
        uint32_t pa[4];
        load_a(pa, p_tiles + i * kHeadTileBytes, kGroupSize, 0, c * 16, lane);
        uint32_t b0 = vb[c / 2][2 * (c % 2)], b1 = vb[c / 2][2 * (c % 2) + 1];
        if (c * 16 + 16 > n_row) {
          const uint2 keep = keys_below(c, n_row, quad);
          b0 &= keep.x;
          b1 &= keep.y;
        }
        mma_bf16(o[i], pa, b0, b1);
      }
    }
    if (scale_thread) ctl.token_scale[(u + 1) & 1][scale_side][scale_token] = next_scale;
    __syncthreads();  // the stage may be refilled, P rewritten
  }
  cp_async_wait<0>();

  // 4. Each (row, head)'s sum over the warps' tokens, then this warp's output dims.
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const float l0 = warp_sum4(l[i][0]), l1 = warp_sum4(l[i][1]);
    if (quad == 0) {
      ctl.part[i][gr][warp] = l0;
      ctl.part[i][gr + 8][warp] = l1;
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (i >= nrows) break;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int h = gr + 8 * half;
      SoftmaxState state{ctl.row_max[pages & 1][i][h], 0.0f};
#pragma unroll
      for (int w = 0; w < kWarps; ++w) state.d += ctl.part[i][h][w];
      const float inv = state.inverse_sum() * v_tensor;
      const int64_t rh = (r0 + i) * a.hq + g * kGroupSize + h;
      if (warp == 0 && quad == 0) {
        if (a.splits == 1) a.lse[rh] = state.lse();
        else a.part_lse[int64_t(split) * a.total_q * a.hq + rh] = state.lse();
      }
      const int d = warp * kSlice + 2 * quad;
      const float x0 = o[i][2 * half] * inv, x1 = o[i][2 * half + 1] * inv;
      if (a.splits > 1) {
        float* dst = a.part_out + (int64_t(split) * a.total_q * a.hq + rh) * kHeadDim + d;
        *reinterpret_cast<float2*>(dst) = make_float2(x0, x1);
      } else if (a.out_f32) {
        *reinterpret_cast<float2*>(static_cast<float*>(a.out) + rh * kHeadDim + d) = make_float2(x0, x1);
      } else {
        *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(a.out) + rh * kHeadDim + d) = pack_bf16(x0, x1);
      }
    }
  }
}

// Lets the kernel take its shared memory (once per process).
template <int R>
void configure() {
  constexpr int smem = smem_bytes<R>();
  static_assert(smem <= kSharedLimit, "shared memory of paged_attention_kernel");
  static std::once_flag once;
  std::call_once(once, [] {
    MSA_CUDA_CHECK(cudaFuncSetAttribute(paged_attention_kernel<R>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  });
}

template <int R>
void launch(const AttnArgs& a, const CUtensorMap& k_map, const CUtensorMap& v_map, dim3 grid, cudaStream_t stream) {
  configure<R>();
  paged_attention_kernel<R><<<grid, kThreads, smem_bytes<R>(), stream>>>(a, k_map, v_map);
  MSA_CUDA_CHECK_LAUNCH("paged_attention_kernel");
}

// CTAs per SM of the NVFP4 kernel (decode_attention_concurrency takes the fewer of it and the
// wgmma kernel's: the plan does not know the cache's format).
template <int R>
int nvfp4_ctas_per_sm() {
  configure<R>();
  int n = 0;
  MSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, paged_attention_kernel<R>, kThreads, smem_bytes<R>()));
  return n;
}

// The kernel instance for a tile of `rows` rows: R = the next power of two.
int rows_instance(int rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8; }


}  // namespace

void paged_attention(const InferencePlan& plan, const PagedAttentionParams& p, const RunOptions& opt) {
  DeviceGuard guard(p.q.device.index);
  const PlanRun run(plan.streams, opt.stream);  // after the plan's uploads; its release after this run
  if (plan.phase == InferencePhase::prefill) return paged_prefill_attention(plan, p, opt);
  const cudaStream_t stream = as_stream(opt);
  const int64_t T = plan.total_q;
  if (T == 0) return;
  const Topology& topo = plan.topo;
  const PagedKvCache& c = p.kv;
  const int splits = plan.num_kv_splits;

  // Row alignment (16 bytes, block scales 8) was checked in src/core/inference.cpp.
  AttnArgs a{};
  a.q = p.q.as<const __nv_bfloat16>();
  a.q_s0 = p.q.stride[0];
  a.q_s1 = p.q.stride[1];
  a.kv = paged_kv_source(plan, c);
  // One TMA map per side (strides are 16-byte multiples: checked with the rows' alignment).
  const int row_bytes = c.format == KvFormat::bf16 ? kHeadDim * 2 : c.format == KvFormat::fp8_e4m3 ? kHeadDim : kNvfp4RowBytes;
  // The row-warp kernel: FP8 and NVFP4 (their codes land swizzled), and bf16 tiles of 1 or 2
  // rows (the warpgroup kernel's 64-row products are 3/4 or 7/8 idle).
  const int tile_rows = detail::decode_tile_rows(plan.q_len_per_req);
  const bool rows_kernel = c.format != KvFormat::bf16 || tile_rows <= 2;
  const CUtensorMap k_map = paged_cache_map(a.kv.k, c.k.shape[0], c.k.shape[1], row_bytes, a.kv.k_page, a.kv.k_head,
                                            a.kv.k_row, "k_cache", rows_kernel);
  const CUtensorMap v_map = paged_cache_map(a.kv.v, c.v.shape[0], c.v.shape[1], row_bytes, a.kv.v_page, a.kv.v_head,
                                            a.kv.v_row, "v_cache", rows_kernel);
  a.topk = p.topk.as<const int32_t>();
  a.positions = static_cast<const int32_t*>(plan.positions.data());
  a.request = static_cast<const int32_t*>(plan.query_request.data());
  a.total_q = T;
  a.hq = topo.num_q_heads;
  a.rows_per_tile = detail::decode_tile_rows(plan.q_len_per_req);
  a.splits = splits;
  a.softmax_scale = topo.attention_scale();
  a.out = p.out.data;
  a.out_f32 = p.out.dtype == DType::f32;
  a.lse = p.lse.as<float>();
  if (splits > 1) {
    a.part_out = static_cast<float*>(plan.partial_out.data());
    a.part_lse = static_cast<float*>(plan.partial_lse.data());
  }
  const dim3 grid(unsigned(ceil_div(T, a.rows_per_tile)), unsigned(topo.num_kv_heads), unsigned(splits));
  if (rows_kernel) {
    launch_rows(c.format, a, k_map, v_map, grid, stream);
  } else if (c.format != KvFormat::nvfp4) {  // bf16 / FP8: the wgmma kernel, which merges the splits itself
    a.arrivals = static_cast<int32_t*>(plan.split_arrivals.data());
    detail::require(splits == 1 || a.arrivals, "paged_attention: the decode plan has no split arrival counts (build it on the CUDA device)");
    return launch_wgmma(c.format, a, k_map, v_map, grid, stream);
  } else {
    switch (rows_instance(a.rows_per_tile)) {  // NVFP4
      case 1: launch<1>(a, k_map, v_map, grid, stream); break;
      case 2: launch<2>(a, k_map, v_map, grid, stream); break;
      case 4: launch<4>(a, k_map, v_map, grid, stream); break;
      default: launch<8>(a, k_map, v_map, grid, stream); break;
    }
  }

  if (splits > 1) {
    const MergeStatesParams merge = split_merge_params(plan, p);
    cuda::merge_states(merge, opt);
  }
}

int64_t decode_attention_concurrency(int device, int q_len_per_req) {
  DeviceGuard guard(device);
  // Per-SM occupancy depends on the kernel and the architecture only (this build targets one),
  // so it is computed once per kernel instance; the SM count is per device.
  static std::mutex mutex;
  static int per_sm[4] = {0, 0, 0, 0};  // R = 1, 2, 4, 8
  const int R = rows_instance(detail::decode_tile_rows(q_len_per_req));
  int n = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    int& cached = per_sm[R == 1 ? 0 : R == 2 ? 1 : R == 4 ? 2 : 3];
    if (cached == 0)
      cached = std::max(1, std::min({decode::wgmma_ctas_per_sm(R), decode::rows_ctas_per_sm(),
                                     R == 1   ? nvfp4_ctas_per_sm<1>()
                                     : R == 2 ? nvfp4_ctas_per_sm<2>()
                                     : R == 4 ? nvfp4_ctas_per_sm<4>()
                                              : nvfp4_ctas_per_sm<8>()}));
    n = cached;
  }
  return int64_t(sm_count()) * n;
}

}  // namespace msa::cuda
