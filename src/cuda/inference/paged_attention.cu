// Decode attention over the paged K/V caches on the GPU (split-K). Paged prefill runs on the
// training forward instead (paged_prefill.cu); paged_attention hands prefill plans to it.
//
// CTA = (the Q <= 16 query rows of one request, KV head g, split s). The CTA gathers the union
// of the logical pages its rows selected in split s (slots s * 16 / S ..), keyed by
// (request, page), and streams each distinct page of K and V once: cp.async into a double-
// buffered shared-memory stage (16-byte copies; the next page is in flight while the current
// one is used), FP8 / NVFP4 codes widened to exact bf16 values in shared memory. Rows of the
// tile that did not select a page skip it; tokens past a row's position are masked.
//
// Warps: NW = 8 (Q <= 8) or 16. Warp w serves row w / kw and the token slice (w % kw) * 128 / kw
// of every page, kw = the largest power of two with Q * kw <= NW; its 16 query heads are one
// m16 tile: S = Q K^T and O += P V run on tensor cores (mma.sync m16n8k16, fp32 accumulation)
// with an fp32 online softmax over chunks of 16 tokens. Scales: per-tensor K scales (FP8, NVFP4
// global) and the softmax scale multiply the logits, per-token K scales each logit column,
// per-token V scales the probabilities fed to P V, per-tensor V scales the output. At the end
// the kw partial states of a row are merged in shared memory; splits > 1 write normalised
// partial states that merge_states combines by LSE. The plan picks the split count
// (src/core/decode_splits.h) from the CTAs that run at once (decode_attention_concurrency).
#include <algorithm>
#include <cstddef>
#include <mutex>

#include "attention_state.h"
#include "backend.h"
#include "core/check.h"
#include "cuda/device.cuh"
#include "cuda/inference/quant.cuh"

namespace msa::cuda {

namespace {

using namespace inference;
using model::kGroupSize;
using model::kHeadDim;
using model::kPageSize;
using model::kTopk;

constexpr int kMaxTileRows = 16;                    // query rows of a CTA (decode Q <= 16)
constexpr int kMaxEntries = kMaxTileRows * kTopk;   // (row, slot) selections of a CTA in one split
constexpr int kChunk = 16;                          // bytes of one cp.async / ld.shared.v4
constexpr int kHeadFrags = kHeadDim / 8;            // n8 output fragments across the head dim
constexpr int kBf16RowChunks = kHeadDim * 2 / kChunk;      // 16-byte chunks of a bf16 128-row
constexpr int kFp8RowChunks = kHeadDim / kChunk;           // ... of an E4M3 row
constexpr int kFp4RowChunks = kNvfp4RowBytes / kChunk;     // ... of an NVFP4 row (two codes a byte)

// A [Rows, 128] bf16 tile in the swizzled layout of tile_offset (device.cuh).
template <int Rows>
struct Bf16Tile {
  uint8_t bytes[Rows * kHeadDim * 2];
};
using PageTile = Bf16Tile<kPageSize>;  // one side (K or V) of a page
using QTile = Bf16Tile<kGroupSize>;    // the 16 query heads of a row
constexpr int kPageTileBytes = int(sizeof(PageTile));
constexpr int kQTileBytes = int(sizeof(QTile));

struct AttnArgs {
  const __nv_bfloat16* q;
  int64_t q_s0, q_s1;                 // elements
  const uint8_t* k;
  const uint8_t* v;
  int64_t k_s0, k_s1, k_s2;           // bytes
  int64_t v_s0, v_s1, v_s2;
  const uint8_t* ksf;
  const uint8_t* vsf;
  int64_t ksf_s0, ksf_s1, ksf_s2;     // bytes
  int64_t vsf_s0, vsf_s1, vsf_s2;
  const float* k_tensor_scale;        // nullptr: 1
  const float* v_tensor_scale;
  const float* k_token_scale;         // nullptr: none
  const float* v_token_scale;
  int64_t k_token_stride, v_token_stride;
  const int32_t* topk;                // [Hkv, T, 16]
  const int32_t* positions;
  const int32_t* request;
  const int32_t* page_table;
  int64_t max_pages;
  int64_t total_q;
  int hq;
  int rows_per_tile;
  int kw;                             // warps per row
  int splits;
  float softmax_scale;
  void* out;                          // splits == 1: [T, Hq, 128] bf16 / f32
  bool out_f32;
  float* lse;                         // splits == 1: [T, Hq]
  float* part_out;                    // splits > 1: [S, T, Hq, 128]
  float* part_lse;                    // splits > 1: [S, T, Hq]
};

__device__ __forceinline__ int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

// One page of the cache (K and V of one KV head) as it arrives from global memory: side 0 = K,
// side 1 = V. bf16 rows land directly in the swizzled tiles the MMAs read; FP8 / NVFP4 codes
// land row-major and are widened into PageTiles afterwards.
template <KvFormat F>
struct KvStage;
template <>
struct KvStage<KvFormat::bf16> {
  PageTile side[2];
  // Byte offset of 16-byte chunk c of row t of a side.
  static __device__ __forceinline__ uint32_t chunk(int side, int t, int c) {
    return side * kPageTileBytes + tile_offset(kPageSize, t, c);
  }
};
template <>
struct KvStage<KvFormat::fp8_e4m3> {
  uint8_t codes[2][kPageSize][kHeadDim];
  static __device__ __forceinline__ uint32_t chunk(int side, int t, int c) {
    return side * (kPageSize * kHeadDim) + t * kHeadDim + c * kChunk;
  }
};
template <>
struct KvStage<KvFormat::nvfp4> {
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

// The page loop's buffers: two stages (the next page in flight while the current one is
// used), the bf16 K and V tiles widened from a quantised stage, and one query tile per warp
// (a CTA has at most as many rows as warps).
template <int NW, KvFormat F>
struct PageBuffers {
  KvStage<F> stage[2];
  PageTile converted[2];
  QTile q[NW];
};
template <int NW>
struct PageBuffers<NW, KvFormat::bf16> {  // the MMAs read the stage itself
  KvStage<KvFormat::bf16> stage[2];
  QTile q[NW];
};

// A warp's online-softmax state of its 16 heads (SoftmaxState {m, l} and the unnormalised
// output of src/attention_state.h), written for the merge of the kw warps of a row.
struct WarpState {
  float o[kGroupSize][kHeadDim];  // sum of 2^(x - m) v
  float m[kGroupSize];            // running max of the logits x (log2 units); -inf: empty
  float l[kGroupSize];            // sum of 2^(x - m)
};

// The distinct pages of the tile's selections in one split. Entry e = (row e / slots, slot
// e % slots) of the tile; unique page u in order of first appearance.
struct PageSet {
  float k_token_scale[kPageSize], v_token_scale[kPageSize];  // per-token scales of the page in use
  int32_t entry_request[kMaxEntries];  // -1: the entry selects nothing
  int32_t entry_page[kMaxEntries];     // logical page id
  int32_t entry_first[kMaxEntries];    // 1 when the entry is its page's first appearance
  int32_t entry_unique[kMaxEntries];   // unique index of a first entry
  int32_t page_physical[kMaxEntries];
  int32_t page_logical[kMaxEntries];
  int32_t page_tokens[kMaxEntries];    // tokens read: the most any selecting row sees
  uint32_t page_rows[kMaxEntries];     // bit r: tile row r selected the page
  int32_t count;
};

// Shared memory of paged_attention_kernel (from a 1024-byte aligned base): the page loop's
// buffers, reused for the merge of the warp states once the loop is over, then the page set.
template <int NW, KvFormat F>
struct SharedStorage {
  union {
    PageBuffers<NW, F> pages;
    WarpState merge[NW];
  };
  PageSet set;
};

// Every swizzled tile starts at a multiple of 1024 bytes of the aligned base.
template <int NW, KvFormat F>
constexpr bool tiles_aligned() {
  using P = PageBuffers<NW, F>;
  using S = SharedStorage<NW, F>;
  bool ok = offsetof(S, pages) == 0 && sizeof(KvStage<F>) % 1024 == 0 && offsetof(P, q) % 1024 == 0 && sizeof(QTile) % 1024 == 0;
  if constexpr (F != KvFormat::bf16) ok = ok && offsetof(P, converted) % 1024 == 0 && sizeof(PageTile) % 1024 == 0;
  return ok;
}

template <int NW, KvFormat F>
constexpr int smem_bytes() {
  static_assert(tiles_aligned<NW, F>(), "paged_attention_kernel: swizzled tiles must be 1024-byte aligned");
  return 1024 + int(sizeof(SharedStorage<NW, F>));
}


__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ uint2 ld_shared_v2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

// Issues the copies of one page (both sides) into a stage; rows t >= nmax are zero-filled, so
// no slot past the tile's causal limit (or past seq_len) is ever read.
template <int NT, KvFormat F>
__device__ __forceinline__ void issue_page(const AttnArgs& a, uint32_t stage, int32_t phys, int g, int nmax) {
  using Stage = KvStage<F>;
  constexpr int kRowChunks = F == KvFormat::bf16 ? kBf16RowChunks : F == KvFormat::fp8_e4m3 ? kFp8RowChunks : kFp4RowChunks;
  const int tid = threadIdx.x;
  const uint8_t* kp = a.k + phys * a.k_s0 + g * a.k_s1;
  const uint8_t* vp = a.v + phys * a.v_s0 + g * a.v_s1;
  for (int i = tid; i < 2 * kPageSize * kRowChunks; i += NT) {
    const int side = i / (kPageSize * kRowChunks), t = (i / kRowChunks) % kPageSize, c = i % kRowChunks;
    const bool ok = t < nmax;
    const uint8_t* src = side ? vp + t * a.v_s2 : kp + t * a.k_s2;
    cp_async16(stage + Stage::chunk(side, t, c), ok ? src + c * kChunk : kp, ok ? kChunk : 0);
  }
  if constexpr (F == KvFormat::nvfp4) {
    constexpr int kScaleBytes = kNvfp4RowScales;
    const uint8_t* ks = a.ksf + phys * a.ksf_s0 + g * a.ksf_s1;
    const uint8_t* vs = a.vsf + phys * a.vsf_s0 + g * a.vsf_s1;
    for (int i = tid; i < 2 * kPageSize; i += NT) {
      const int side = i / kPageSize, t = i % kPageSize;
      const bool ok = t < nmax;
      const uint8_t* src = side ? vs + t * a.vsf_s2 : ks + t * a.ksf_s2;
      cp_async8(stage + Stage::scales(side, t), ok ? src : ks, ok ? kScaleBytes : 0);
    }
  }
}

// Widens a quantised stage into the bf16 K and V tiles (`tiles`: the converted PageTile pair).
template <int NT, KvFormat F>
__device__ __forceinline__ void convert_page(uint32_t stage, uint32_t tiles) {
  using Stage = KvStage<F>;
  const int tid = threadIdx.x;
  if constexpr (F == KvFormat::fp8_e4m3) {
    for (int i = tid; i < 2 * kPageSize * kFp8RowChunks; i += NT) {
      const int side = i / (kPageSize * kFp8RowChunks), t = (i / kFp8RowChunks) % kPageSize, c = i % kFp8RowChunks;
      const uint4 raw = ld_shared_v4(stage + Stage::chunk(side, t, c));
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      uint32_t o[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        o[2 * j] = bf16x2_bits(e4m3_to_f32(uint8_t(w[j])), e4m3_to_f32(uint8_t(w[j] >> 8)));
        o[2 * j + 1] = bf16x2_bits(e4m3_to_f32(uint8_t(w[j] >> 16)), e4m3_to_f32(uint8_t(w[j] >> 24)));
      }
      const uint32_t tile = tiles + side * kPageTileBytes;  // 16 codes -> bf16 chunks 2c, 2c + 1
      st_shared_v4(tile + tile_offset(kPageSize, t, 2 * c), o[0], o[1], o[2], o[3]);
      st_shared_v4(tile + tile_offset(kPageSize, t, 2 * c + 1), o[4], o[5], o[6], o[7]);
    }
  } else if constexpr (F == KvFormat::nvfp4) {
    for (int i = tid; i < 2 * kPageSize * kFp4RowChunks; i += NT) {
      const int side = i / (kPageSize * kFp4RowChunks), t = (i / kFp4RowChunks) % kPageSize,
                c = i % kFp4RowChunks;  // elements 32c .. 32c + 31: block scales 2c, 2c + 1
      const uint4 raw = ld_shared_v4(stage + Stage::chunk(side, t, c));
      const uint2 sf = ld_shared_v2(stage + Stage::scales(side, t));
      const uint32_t scales = c < 2 ? sf.x : sf.y;
      const float s0 = e4m3_to_f32(uint8_t(scales >> (16 * (c & 1)))), s1 = e4m3_to_f32(uint8_t(scales >> (16 * (c & 1) + 8)));
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      uint32_t o[16];
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // word j: elements 32c + 8j .. + 7, block scale s0 for j < 2
        const float s = j < 2 ? s0 : s1;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t byte = (w[j] >> (8 * e)) & 0xffu;
          o[4 * j + e] = bf16x2_bits(e4m3_to_f32(nvfp4_to_e4m3(byte & 0xfu, s)), e4m3_to_f32(nvfp4_to_e4m3(byte >> 4, s)));
        }
      }
      const uint32_t tile = tiles + side * kPageTileBytes;
#pragma unroll
      for (int q = 0; q < 4; ++q)
        st_shared_v4(tile + tile_offset(kPageSize, t, 4 * c + q), o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
    }
  }
}

template <int NW, KvFormat F>
__global__ void __launch_bounds__(NW * 32, 1) paged_attention_kernel(const AttnArgs a) {
  constexpr int NT = NW * 32;
  using Storage = SharedStorage<NW, F>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = align1024(smem_addr(smem_raw));
  Storage& smem = *reinterpret_cast<Storage*>(smem_raw + (base - smem_addr(smem_raw)));
  PageSet& ctl = smem.set;
  using Pages = PageBuffers<NW, F>;  // at offset 0 of the storage
  const uint32_t stage0 = base + uint32_t(offsetof(Pages, stage));
  const uint32_t stage1 = stage0 + uint32_t(sizeof(KvStage<F>));
  uint32_t tiles = 0;  // the converted K tile, V tile right after it
  if constexpr (F != KvFormat::bf16) tiles = base + uint32_t(offsetof(Pages, converted));
  const uint32_t q_tiles = base + uint32_t(offsetof(Pages, q));

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int R = a.rows_per_tile;
  const int64_t r0 = int64_t(blockIdx.x) * R;
  const int nrows = int(min64(R, a.total_q - r0));
  const int g = blockIdx.y, split = blockIdx.z;
  const int slot0 = split * kTopk / a.splits, spp = kTopk / a.splits;
  const int entries = R * spp;

  // 1. Distinct pages of the tile's selections in this split, keyed by (request, page).
  int32_t my_req = -1, my_id = -1, my_n = 0, my_row = 0;
  if (tid < kMaxEntries) {
    ctl.page_rows[tid] = 0u;
    ctl.page_tokens[tid] = 0;
  }
  if (tid < entries) {
    my_row = tid / spp;
    if (my_row < nrows) {
      const int64_t r = r0 + my_row;
      const int32_t id = a.topk[(int64_t(g) * a.total_q + r) * kTopk + slot0 + tid % spp];
      const int32_t pos = a.positions[r];
      if (id >= 0 && pos >= 0 && int64_t(id) * kPageSize <= pos) {
        my_req = a.request[r];
        my_id = id;
        my_n = int(min64(kPageSize, int64_t(pos) - int64_t(id) * kPageSize + 1));
      }
    }
    ctl.entry_request[tid] = my_req;
    ctl.entry_page[tid] = my_id;
  }
  __syncthreads();
  int owner = -1;
  if (tid < entries && my_req >= 0)
    for (int e = 0; e <= tid; ++e)
      if (ctl.entry_request[e] == my_req && ctl.entry_page[e] == my_id) {
        owner = e;
        break;
      }
  const bool first = owner == tid && owner >= 0;
  if (tid < kMaxEntries) ctl.entry_first[tid] = first ? 1 : 0;
  const int unique = __syncthreads_count(first);
  if (first) {
    int idx = 0;  // distinct pages first seen before this entry
    for (int e = 0; e < tid; ++e) idx += ctl.entry_first[e];
    ctl.entry_unique[tid] = idx;
    ctl.page_physical[idx] = a.page_table[int64_t(my_req) * a.max_pages + my_id];
    ctl.page_logical[idx] = my_id;
  }
  __syncthreads();
  if (owner >= 0) {
    const int u = ctl.entry_unique[owner];
    atomicOr(&ctl.page_rows[u], 1u << my_row);
    atomicMax(&ctl.page_tokens[u], my_n);
  }

  // 2. Query tiles of the rows (16 heads x 128 each).
  for (int i = tid; i < nrows * kGroupSize * kBf16RowChunks; i += NT) {
    const int row = i / (kGroupSize * kBf16RowChunks), h = (i / kBf16RowChunks) % kGroupSize, c = i % kBf16RowChunks;
    const __nv_bfloat16* src = a.q + (r0 + row) * a.q_s0 + int64_t(g * kGroupSize + h) * a.q_s1 + c * 8;
    cp_async16(q_tiles + row * kQTileBytes + tile_offset(kGroupSize, h, c), src, kChunk);
  }
  cp_async_commit();
  __syncthreads();

  // 3. Pages.
  const int kw = a.kw, tw = kPageSize / kw;
  const int my_tile_row = warp / kw, t_begin = (warp % kw) * tw;
  const bool active = my_tile_row < nrows;
  const int32_t row_pos = active ? a.positions[r0 + my_tile_row] : -1;
  const float k_tensor = a.k_tensor_scale ? *a.k_tensor_scale : 1.0f;
  const float v_tensor = a.v_tensor_scale ? *a.v_tensor_scale : 1.0f;
  const float qk_scale = a.softmax_scale * k_tensor * math::kLog2e;  // logits in log2 units
  const bool per_token = a.k_token_scale != nullptr;
  const uint32_t q_tile = q_tiles + my_tile_row * kQTileBytes;
  const int quad = lane & 3, gr = lane >> 2;
  constexpr bool kEarlyV = NW <= 8 && F == KvFormat::bf16;

  float o[kHeadFrags][4];
#pragma unroll
  for (int n = 0; n < kHeadFrags; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // softmax states of heads gr, gr + 8

  if (unique > 0) issue_page<NT, F>(a, stage0, ctl.page_physical[0], g, ctl.page_tokens[0]);
  cp_async_commit();
  for (int u = 0; u < unique; ++u) {
    if (u + 1 < unique)
      issue_page<NT, F>(a, (u + 1) & 1 ? stage1 : stage0, ctl.page_physical[u + 1], g, ctl.page_tokens[u + 1]);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint32_t stage = u & 1 ? stage1 : stage0;
    const int nmax = ctl.page_tokens[u];
    if (per_token && tid < 2 * kPageSize) {
      const int side = tid / kPageSize, t = tid % kPageSize;
      const int64_t slot = int64_t(ctl.page_physical[u]) * kPageSize + t;
      const float s = t < nmax ? (side ? a.v_token_scale[g * a.v_token_stride + slot] : a.k_token_scale[g * a.k_token_stride + slot]) : 0.0f;
      (side ? ctl.v_token_scale : ctl.k_token_scale)[t] = s;
    }
    if constexpr (F != KvFormat::bf16) convert_page<NT, F>(stage, tiles);
    if (per_token || F != KvFormat::bf16) __syncthreads();
    const uint32_t k_tile = F == KvFormat::bf16 ? stage : tiles;
    const uint32_t v_tile = k_tile + kPageTileBytes;

    if (active && ((ctl.page_rows[u] >> my_tile_row) & 1u)) {
      const int n_row = int(min64(kPageSize, int64_t(row_pos) - int64_t(ctl.page_logical[u]) * kPageSize + 1));
      const int t_end = min(t_begin + tw, n_row);
      for (int c0 = t_begin; c0 < t_end; c0 += 16) {
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          uint32_t qa[4], kb[4];
          load_a(qa, q_tile, kGroupSize, 0, kk * 16, lane);
          load_b_nk(kb, k_tile, kPageSize, c0, kk * 16, lane);
          mma_bf16(s[0], qa, kb[0], kb[1]);
          mma_bf16(s[1], qa, kb[2], kb[3]);
        }
        // The chunk's V fragments, loaded before the softmax so that their latency hides
        // behind it (two warps per scheduler have little else to switch to). With 16 warps
        // (128 registers a thread) they would spill: loaded right before their MMAs. Only for
        // bf16 pages: the converted FP8 / NVFP4 tile path is already at its register limit.
        uint32_t vb[kEarlyV ? 8 : 1][4];
        if constexpr (kEarlyV)
#pragma unroll
          for (int dn = 0; dn < 8; ++dn) load_b_kn(vb[dn], v_tile, kPageSize, c0, dn * 16, lane);
        float cmax0 = -INFINITY, cmax1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int t = c0 + nt * 8 + 2 * quad + (e & 1);
            float x = s[nt][e] * qk_scale;
            if (per_token) x *= ctl.k_token_scale[t];
            if (t >= n_row) x = -INFINITY;
            s[nt][e] = x;
            if (e < 2) cmax0 = fmaxf(cmax0, x);
            else cmax1 = fmaxf(cmax1, x);
          }
        cmax0 = warp_max4(cmax0);
        cmax1 = warp_max4(cmax1);
        // The online softmax of heads gr / gr + 8 in log2 units (the SoftmaxState rules, written
        // out: the hot loop keeps m and l in registers). fast_exp2 is one SFU instruction;
        // exp2f's denormal rescaling would add a predicated chain to each of the ten exps.
        const float new0 = fmaxf(m0, cmax0), new1 = fmaxf(m1, cmax1);
        const float use0 = new0 == -INFINITY ? 0.0f : new0, use1 = new1 == -INFINITY ? 0.0f : new1;
        const float alpha0 = fast_exp2(m0 - use0), alpha1 = fast_exp2(m1 - use1);
        m0 = new0;
        m1 = new1;
        l0 *= alpha0;
        l1 *= alpha1;
        // Once the maxima settle, most chunks leave every head's max as it was (alpha = 1,
        // exactly): the warp then skips the 64 multiplications of its output fragments.
        if (__any_sync(0xffffffffu, alpha0 != 1.0f || alpha1 != 1.0f))
#pragma unroll
          for (int n = 0; n < kHeadFrags; ++n) {
            o[n][0] *= alpha0;
            o[n][1] *= alpha0;
            o[n][2] *= alpha1;
            o[n][3] *= alpha1;
          }
        float pv[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float pr = fast_exp2(s[nt][e] - (e < 2 ? use0 : use1));
            if (e < 2) l0 += pr;
            else l1 += pr;
            const int t = c0 + nt * 8 + 2 * quad + (e & 1);
            pv[nt][e] = per_token ? pr * ctl.v_token_scale[t] : pr;
          }
        uint32_t pa[4] = {bf16x2_bits(pv[0][0], pv[0][1]), bf16x2_bits(pv[0][2], pv[0][3]),
                          bf16x2_bits(pv[1][0], pv[1][1]), bf16x2_bits(pv[1][2], pv[1][3])};
        // The chunk crosses the row's causal limit (warp-uniform; at most one chunk of a page).
        // Keys t >= n_row have p = 0, but their V rows and per-token V scales (another row's
        // keys, or garbage of the cache) may hold NaN / inf, and 0 * NaN is NaN: their halves of
        // the P and V fragments are zeroed instead (selection, not multiplication). a0 / a1 and
        // b0 / b2 hold keys c0 + 2 quad + {0, 1} (low / high 16 bits), a2 / a3 and b1 / b3 the
        // keys 8 further.
        const bool partial = c0 + 16 > n_row;
        uint32_t keep_lo = ~0u, keep_hi = ~0u;
        if (partial) {
          const int t0 = c0 + 2 * quad;
          keep_lo = (t0 < n_row ? 0x0000ffffu : 0u) | (t0 + 1 < n_row ? 0xffff0000u : 0u);
          keep_hi = (t0 + 8 < n_row ? 0x0000ffffu : 0u) | (t0 + 9 < n_row ? 0xffff0000u : 0u);
          pa[0] &= keep_lo;
          pa[1] &= keep_lo;
          pa[2] &= keep_hi;
          pa[3] &= keep_hi;
        }
        if constexpr (kEarlyV) {
          if (partial)
#pragma unroll
            for (int dn = 0; dn < 8; ++dn) {
              vb[dn][0] &= keep_lo;
              vb[dn][1] &= keep_hi;
              vb[dn][2] &= keep_lo;
              vb[dn][3] &= keep_hi;
            }
#pragma unroll
          for (int dn = 0; dn < 8; ++dn) {
            mma_bf16(o[2 * dn], pa, vb[dn][0], vb[dn][1]);
            mma_bf16(o[2 * dn + 1], pa, vb[dn][2], vb[dn][3]);
          }
        } else if (!partial) {  // each fragment dies after its two MMAs
#pragma unroll
          for (int dn = 0; dn < 8; ++dn) {
            uint32_t v[4];
            load_b_kn(v, v_tile, kPageSize, c0, dn * 16, lane);
            mma_bf16(o[2 * dn], pa, v[0], v[1]);
            mma_bf16(o[2 * dn + 1], pa, v[2], v[3]);
          }
        } else {
#pragma unroll
          for (int dn = 0; dn < 8; ++dn) {
            uint32_t v[4];
            load_b_kn(v, v_tile, kPageSize, c0, dn * 16, lane);
            mma_bf16(o[2 * dn], pa, v[0] & keep_lo, v[1] & keep_hi);
            mma_bf16(o[2 * dn + 1], pa, v[2] & keep_lo, v[3] & keep_hi);
          }
        }
      }
    }
    __syncthreads();  // the stage may be refilled
  }
  cp_async_wait<0>();
  __syncthreads();

  // 4. Merge the kw states of each row and write.
  l0 = warp_sum4(l0);
  l1 = warp_sum4(l1);
  WarpState& ws = smem.merge[warp];  // C fragment: rows gr, gr + 8 (heads), columns 8n + 2 quad (dims)
#pragma unroll
  for (int n = 0; n < kHeadFrags; ++n) {
    const int d = n * 8 + 2 * quad;
    ws.o[gr][d] = o[n][0];
    ws.o[gr][d + 1] = o[n][1];
    ws.o[gr + 8][d] = o[n][2];
    ws.o[gr + 8][d + 1] = o[n][3];
  }
  if (quad == 0) {
    ws.m[gr] = m0;
    ws.m[gr + 8] = m1;
    ws.l[gr] = l0;
    ws.l[gr + 8] = l1;
  }
  __syncthreads();
  // Two passes over the kw states of (row, head) - the max, then the sums and values - with
  // the rules of src/attention_state.h (an empty state is skipped, a row that is not valid
  // gives 0 / -inf).
  for (int idx = tid; idx < nrows * kGroupSize * kHeadDim; idx += NT) {
    const int row = idx / (kGroupSize * kHeadDim), h = (idx / kHeadDim) % kGroupSize, d = idx % kHeadDim;
    const WarpState* states = smem.merge + row * kw;
    AttentionState<1> merged = AttentionState<1>::empty();
    for (int k = 0; k < kw; ++k) merged.s.m = state_math::max(merged.s.m, states[k].m[h]);
    for (int k = 0; k < kw; ++k) {
      const SoftmaxState part{states[k].m[h], states[k].l[h]};
      if (!(part.m > -INFINITY)) continue;  // empty: its values are never read
      merged.add_at_max(part, {states[k].o[h][d]});
    }
    float normalised[1];
    const float lse = merged.normalise(normalised);
    const float value = normalised[0] * v_tensor;
    const int64_t r = r0 + row, rh = r * a.hq + g * kGroupSize + h;
    if (a.splits == 1) {
      if (a.out_f32) static_cast<float*>(a.out)[rh * kHeadDim + d] = value;
      else static_cast<__nv_bfloat16*>(a.out)[rh * kHeadDim + d] = __float2bfloat16_rn(value);
      if (d == 0) a.lse[rh] = lse;
    } else {
      const int64_t at = int64_t(split) * a.total_q * a.hq + rh;
      a.part_out[at * kHeadDim + d] = value;
      if (d == 0) a.part_lse[at] = lse;
    }
  }
}

// Lets the kernel take its shared memory (once per process).
template <int NW, KvFormat F>
void configure() {
  constexpr int smem = smem_bytes<NW, F>();
  static_assert(smem <= 227 * 1024, "shared memory of paged_attention_kernel");
  static bool configured = false;
  if (!configured) {
    MSA_CUDA_CHECK(cudaFuncSetAttribute(paged_attention_kernel<NW, F>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    configured = true;
  }
}

template <int NW, KvFormat F>
void launch(const AttnArgs& a, dim3 grid, cudaStream_t stream) {
  configure<NW, F>();
  paged_attention_kernel<NW, F><<<grid, NW * 32, smem_bytes<NW, F>(), stream>>>(a);
  MSA_CUDA_CHECK_LAUNCH("paged_attention_kernel");
}

template <int NW, KvFormat F>
int ctas_per_sm() {
  configure<NW, F>();
  int n = 0;
  MSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, paged_attention_kernel<NW, F>, NW * 32, smem_bytes<NW, F>()));
  return n;
}

// The fewest CTAs per SM over the formats (the plan does not know the cache's format).
template <int NW>
int min_ctas_per_sm() {
  return std::min({ctas_per_sm<NW, KvFormat::bf16>(), ctas_per_sm<NW, KvFormat::fp8_e4m3>(), ctas_per_sm<NW, KvFormat::nvfp4>()});
}

// Warps of a CTA of `rows` query rows: one per row and token slice.
int warps_for_rows(int rows) { return rows > 8 ? 16 : 8; }

template <int NW>
void launch_format(KvFormat f, const AttnArgs& a, dim3 grid, cudaStream_t stream) {
  switch (f) {
    case KvFormat::bf16: return launch<NW, KvFormat::bf16>(a, grid, stream);
    case KvFormat::fp8_e4m3: return launch<NW, KvFormat::fp8_e4m3>(a, grid, stream);
    case KvFormat::nvfp4: return launch<NW, KvFormat::nvfp4>(a, grid, stream);
  }
}

}  // namespace

void paged_attention(const InferencePlan& plan, const PagedAttentionParams& p, const RunOptions& opt) {
  DeviceGuard guard(p.q.device.index);
  if (plan.phase == InferencePhase::prefill) return paged_prefill_attention(plan, p, opt);
  const cudaStream_t stream = as_stream(opt);
  const int64_t T = plan.total_q;
  if (T == 0) return;
  const Topology& topo = plan.topo;
  const PagedKvCache& c = p.kv;
  const int splits = plan.num_kv_splits;
  const int64_t elem = c.format == KvFormat::bf16 ? 2 : 1;

  // Row alignment (16 bytes, block scales 8) was checked in src/core/inference.cpp.
  AttnArgs a{};
  a.q = p.q.as<const __nv_bfloat16>();
  a.q_s0 = p.q.stride[0];
  a.q_s1 = p.q.stride[1];
  a.k = static_cast<const uint8_t*>(c.k.data);
  a.v = static_cast<const uint8_t*>(c.v.data);
  a.k_s0 = c.k.stride[0] * elem;
  a.k_s1 = c.k.stride[1] * elem;
  a.k_s2 = c.k.stride[2] * elem;
  a.v_s0 = c.v.stride[0] * elem;
  a.v_s1 = c.v.stride[1] * elem;
  a.v_s2 = c.v.stride[2] * elem;
  if (c.format == KvFormat::nvfp4) {
    a.ksf = static_cast<const uint8_t*>(c.k_block_scale.data);
    a.vsf = static_cast<const uint8_t*>(c.v_block_scale.data);
    a.ksf_s0 = c.k_block_scale.stride[0];
    a.ksf_s1 = c.k_block_scale.stride[1];
    a.ksf_s2 = c.k_block_scale.stride[2];
    a.vsf_s0 = c.v_block_scale.stride[0];
    a.vsf_s1 = c.v_block_scale.stride[1];
    a.vsf_s2 = c.v_block_scale.stride[2];
  }
  const KvSideScales ks = side_scales(c, false), vs = side_scales(c, true);
  a.k_tensor_scale = ks.tensor;
  a.v_tensor_scale = vs.tensor;
  a.k_token_scale = ks.token;
  a.v_token_scale = vs.token;
  a.k_token_stride = ks.token_stride;
  a.v_token_stride = vs.token_stride;
  a.topk = p.topk.as<const int32_t>();
  a.positions = static_cast<const int32_t*>(plan.positions.data());
  a.request = static_cast<const int32_t*>(plan.query_request.data());
  a.page_table = static_cast<const int32_t*>(plan.page_table.data());
  a.max_pages = plan.max_pages;
  a.total_q = T;
  a.hq = topo.num_q_heads;
  a.rows_per_tile = plan.q_len_per_req;
  const int nw = warps_for_rows(a.rows_per_tile);
  a.kw = 1;
  while (a.rows_per_tile * a.kw * 2 <= nw) a.kw *= 2;
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
  if (nw == 16) launch_format<16>(c.format, a, grid, stream);
  else launch_format<8>(c.format, a, grid, stream);

  if (splits > 1) {
    const MergeStatesParams merge = split_merge_params(plan, p);
    cuda::merge_states(merge, opt);
  }
}

int64_t decode_attention_concurrency(int device, int q_len_per_req) {
  DeviceGuard guard(device);
  // Per-SM occupancy depends on the kernel and the architecture only (this build targets one),
  // so it is computed once per warp count; the SM count is per device.
  static std::mutex mutex;
  static int per_sm[2] = {0, 0};  // 8 warps, 16 warps
  const int nw = warps_for_rows(q_len_per_req);
  int n = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    int& cached = per_sm[nw == 16 ? 1 : 0];
    if (cached == 0) cached = std::max(1, nw == 16 ? min_ctas_per_sm<16>() : min_ctas_per_sm<8>());
    n = cached;
  }
  return int64_t(sm_count()) * n;
}

}  // namespace msa::cuda
