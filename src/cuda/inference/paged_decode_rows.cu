// Decode attention over a bf16, FP8 or NVFP4 paged cache with one warp per query row and only
// the pages that row selected (sm_90a; paged_attention.cu dispatches here).
//
// The warpgroup kernel (paged_decode_wgmma.cu) multiplies a page for 4 rows x 16 heads at once
// whichever of the 4 rows selected it; when a request's rows select different pages (as the
// benchmark's random index queries do) 3 of 4 of its products are for rows that skip the page,
// and FP8's step costs as long as bf16's although it reads half the bytes. Here a consumer warp
// owns one row's 16 heads (the m16 tile of mma.sync) and multiplies only the pages its row
// selected: 1.05 MFLOP a row and page. Rows of a tile with fewer rows than warps get several
// warps, which take turns over the row's pages and combine their states at the end.
//
//   producer (one warp of a  TMA of a page's K and V (FP8 codes 16 KB a side, bf16 32 KB; both
//   warpgroup; one thread)  128-byte swizzled) into a ring of pages;
//   consumers (8 warps)     S = Q K^T on m16n8k16 f16 products: Q in registers (bf16 scaled per
//                           head by a power of two into f16's range, exact), the K codes read
//                           from shared memory 8 at a time and converted in registers
//                           (cvt.f16x2.e4m3x2, exact: f16 holds every E4M3 value); the online
//                           softmax in registers; O += P V with P in f16 and the V codes of 4
//                           keys byte-permuted into (key pair, dim) words and converted likewise.
//
// Per-(head, token) FP8 scales come with the page (the producer warp's cp.async, tracked by the
// page's `full` barrier): the K scale multiplies each logit, the V scale each probability fed to
// P V, divided by the warp's running largest V scale R so that P stays in [0, 1] for f16 (the
// accumulators are kept in units of R and rescaled when R grows, with the softmax's alpha).
//
// NVFP4 pages become the same E4M3 codes in registers: a CTA table holds, per block-scale code,
// the 8 codes E4M3(clamp(m * scale, +-448)) of the E2M1 magnitudes m (the format's rounded
// product, §9.6 of docs/semantics.md), so that 8 E2M1 codes of one 16-element block turn into
// their E4M3 codes with two byte permutes of that entry and two sign-replicating ones; the global scale
// then acts as FP8's per-tensor scale. Codes land with the 64-byte swizzle, block scales by the
// producer warp's cp.async.
//
// bf16 pages take the usual ldmatrix fragments (load_b_nk / load_b_kn, device.cuh) and bf16
// products; the rest of this note is about FP8 codes.
//
// The k order of S's products is permuted so that one 8-byte load gives a thread its codes of
// two k16 steps: k16 step kk, quad q holds logical k 2q, 2q + 1 (+ 8, + 9) = dims 32 (kk / 2) +
// 8q + 4 (kk % 2) + 0, 1 (+ 2, 3); Q's fragments are built in the same order. P V's dims are
// permuted too: n-tile t = 8 hh + i, column n is dim 64 hh + 8n + i, so a thread's 8 codes of a
// key serve 8 n-tiles (the epilogue writes the dims back in order).
//
// Keys past a row's causal limit are removed by selection (-inf scores; their V codes zeroed
// before the conversion: 0 * NaN is NaN): a row never multiplies a page it did not select, so no
// V side needs an inf / NaN check. Those masks cost a quarter of a page's instructions, so a
// page wholly visible to its row (every page of a request but its last) runs a second copy of
// the body compiled for 128 keys (run 29). Splits > 1 write normalised partials that
// merge_states combines (the host launches it).
#include <algorithm>
#include <cstddef>
#include <mutex>
#include <type_traits>

#include "attention_state.h"
#include "core/check.h"
#include "cuda/device.cuh"
#include "cuda/inference/decode_pages.cuh"
#include "cuda/inference/quant.cuh"
#include "cuda/named_barriers.cuh"

namespace msa::cuda::decode {

namespace {

using model::kGroupSize;
using model::kHeadDim;

constexpr int kRowWarps = 8;                          // consumer warps
// + a producer warpgroup: one of its warps issues the pages. Registers are allocated per SM
// sub-partition (warp w on sub-partition w % 4, 512 registers a lane each): 9 warps of 224 do
// not launch, 12 of 168 do, and setmaxnreg then moves the producers' registers to the consumers.
constexpr int kThreads = 32 * (kRowWarps + 4);
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
static_assert(kProducerRegisters + 2 * kConsumerRegisters <= 512, "a sub-partition's registers");
constexpr int kRingBytes = 192 * 1024;                // the page ring (NVFP4: 128 KB, for its block scales)
constexpr int32_t kRoundsFromPosition = 32 * 1024;    // NVFP4 pages in rounds from this position on
static_assert(kMaxTileRows <= kRowWarps, "a warp (at least) per tile row");

// The page bodies of an instance: the masked one (keys past a row's causal limit at -inf), alone
// or with a copy compiled for a wholly visible page, faster where a CTA holds many pages (run 29:
// NVFP4 0.8x, FP8 0.9x at 128 x 128k). The two copies outgrow the SM's instruction cache, and a
// small step fetches its kernels' code cold: a step whose CTAs hold at most kMaskedBodyMaxPages
// runs the instance with the masked body only (run 49: 8 x 4k, Q8 NVFP4 -18 us, Q1 bf16 -4.5).
enum class PageBodies : uint8_t { masked, masked_and_whole };
constexpr int64_t kMaskedBodyMaxPages = kRowWarps;

// A page of the format: side 0 = K, 1 = V. FP8: token t's 128 codes at 128 t, 16-byte chunk c at
// c ^ (t % 8); NVFP4: token t's 64 bytes at 64 t, chunk c at c ^ ((t / 2) % 4); bf16: two column
// halves of 128 x 128 bytes each, as tile_offset (device.cuh).
template <KvFormat F>
struct RowsPage {
  static constexpr bool kFp4 = F == KvFormat::nvfp4;
  static constexpr int kSideBytes = F == KvFormat::bf16 ? kPageSize * kHeadDim * 2 : kFp4 ? kPageSize * kNvfp4RowBytes : kPageSize * kHeadDim;
  static constexpr int kBoxes = F == KvFormat::bf16 ? 2 : 1;  // TMA boxes a side
  static constexpr int kRing = kFp4 ? 128 * 1024 : kRingBytes;
  static constexpr int kStages = kRing / (2 * kSideBytes);
};

// Shared memory from a 1024-byte aligned base. Barriers per stage:
//   full   the page's TMA boxes have landed (1 arrival + bytes), and with per-token scales the
//          producer lanes' copies of them (32 more arrivals)
//   empty  every consumer warp is done with it (kRowWarps arrivals)
// After the pages, the ring holds the warps' states for the combination of a row's warps.
template <KvFormat F>
struct RowsStorage {
  static constexpr int kStages = RowsPage<F>::kStages;
  static constexpr bool kFp4 = RowsPage<F>::kFp4;
  alignas(1024) uint8_t ring[RowsPage<F>::kRing];
  float token_scale[F == KvFormat::fp8_e4m3 ? kStages : 0][2][kPageSize];  // FP8 per-token scales of K, V
  uint8_t block_scale[kFp4 ? kStages : 0][2][kPageSize][kNvfp4RowScales];  // NVFP4: of K, V
  uint2 fp4_codes[kFp4 ? 256 : 0];  // NVFP4: block-scale code -> E4M3 codes of m * scale, m = 0, .5, .., 6
  SplitPages pages;
  TableRow table;
  uint64_t full[kStages];
  uint64_t empty[kStages];
  int32_t row_position[kMaxTileRows];
};
template <KvFormat F>
constexpr int storage_bytes() {
  return storage_smem_bytes<RowsStorage<F>>();  // checked against the sm_90 limit (device.cuh)
}
static_assert(storage_bytes<KvFormat::bf16>() > 0 && storage_bytes<KvFormat::fp8_e4m3>() > 0 &&
                  storage_bytes<KvFormat::nvfp4>() > 0,
              "paged_decode_rows_kernel: every instance's shared-memory plan, checked at compile time");

// A warp's state in the ring for the combination: per lane, 64 accumulators, 2 maxima, 2 sums.
constexpr int kStateFloats = 68;
static_assert(kRowWarps * kStateFloats * 32 * 4 <= 128 * 1024, "the states fit in the ring");

// Byte b of token t's row in a side.
__device__ __forceinline__ uint32_t code_offset(int t, int b) {
  return uint32_t(t * 128 + ((((b >> 4) ^ (t & 7))) << 4) + (b & 15));
}

__device__ __forceinline__ uint2 ld_codes8(const uint8_t* side, int t, int b) {
  return *reinterpret_cast<const uint2*>(side + code_offset(t, b));
}

// NVFP4: byte b of token t's 64-byte row in a side.
__device__ __forceinline__ uint32_t fp4_offset(int t, int b) {
  return uint32_t(t * 64 + ((((b >> 4) ^ ((t >> 1) & 3))) << 4) + (b & 15));
}

// prmt.b32 with the selector as given: a selector nibble with bit 3 set writes the selected
// byte's bit 7 replicated (0x00 / 0xff) instead of the byte (__byte_perm documents only bits 0-2).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// The E4M3 codes of 8 E2M1 codes (element 2i in the low nibble of byte i) of one block whose
// scale's table entry is `entry`: magnitudes by byte permutes of the entry (bit 3 of each
// selector nibble cleared), signs by sign-replicating permutes (element 2i's sign is bit 3 of
// byte i, bit 7 once shifted by 4; element 2i + 1's is bit 7), XORed in as 0x80.
__device__ __forceinline__ uint2 fp4_to_e4m3x8(uint32_t codes, uint2 entry) {
  const uint32_t magnitude = codes & 0x77777777u;
  const uint32_t mx = prmt(entry.x, entry.y, magnitude), my = prmt(entry.x, entry.y, magnitude >> 16);
  const uint32_t even = codes << 4;
  const uint32_t sx = prmt(even, codes, 0xD9C8u);  // elements 0..3: bytes 0, 4, 1, 5 of (even, codes), sign-replicated
  const uint32_t sy = prmt(even, codes, 0xFBEAu);  // elements 4..7: bytes 2, 6, 3, 7
  return make_uint2(mx ^ (sx & 0x80808080u), my ^ (sy & 0x80808080u));
}

// The 8 E4M3 codes of dims d0 .. d0 + 7 of token t (d0 % 8 == 0), whatever the side's format.
struct Fp8Codes {
  const uint8_t* side;
  __device__ __forceinline__ uint2 operator()(int t, int d0) const { return ld_codes8(side, t, d0); }
};
struct Fp4Codes {
  const uint8_t* side;
  const uint8_t (*scales)[kNvfp4RowScales];  // the side's block scales [128][8]
  const uint2* table;                        // RowsStorage::fp4_codes
  __device__ __forceinline__ uint2 operator()(int t, int d0) const {
    const uint32_t codes = *reinterpret_cast<const uint32_t*>(side + fp4_offset(t, d0 / 2));
    return fp4_to_e4m3x8(codes, table[scales[t][d0 / kNvfp4GroupSize]]);
  }
};

// Producer warp: the split's pages in order, K and V of KV head g (lane 0's TMA), with
// per-token scales every lane's share of the page's 2 x 128 scales (4-byte cp.async: a scale
// row's stride need not be a multiple of 4).
template <KvFormat F, bool PerToken>
__device__ __forceinline__ void issue_pages(const AttnArgs& a, RowsStorage<F>& sm, uint32_t base,
                                            const CUtensorMap* k_map, const CUtensorMap* v_map, int g, int pages,
                                            int lane) {
  using Page = RowsPage<F>;
  constexpr int S = Page::kStages, kBoxBytes = Page::kSideBytes / Page::kBoxes;
  const uint64_t policy = l2_evict_first();
#pragma unroll 1  // asynchronous copies: unrolling would only lengthen the code
  for (int u = 0; u < pages; ++u) {
    const int s = u % S;
    if (!PerToken && !Page::kFp4 && lane > 0) break;
    if (u >= S) mbar_wait(smem_addr(&sm.empty[s]), ((u / S) - 1) & 1);
    const uint32_t full = smem_addr(&sm.full[s]);
    const int32_t phys = sm.pages.page_physical[u];
    if constexpr (Page::kFp4) {
#pragma unroll
      for (int i = lane; i < 2 * kPageSize; i += 32) {
        const int side = i / kPageSize, t = i % kPageSize;
        const uint8_t* src = side ? a.kv.v_block_scale + phys * a.kv.vsf_page + g * a.kv.vsf_head + t * a.kv.vsf_row
                                  : a.kv.k_block_scale + phys * a.kv.ksf_page + g * a.kv.ksf_head + t * a.kv.ksf_row;
        inference::cp_async8(smem_addr(&sm.block_scale[s][side][t][0]), src, kNvfp4RowScales);
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full) : "memory");
    }
    if constexpr (PerToken) {
      const int64_t slot0 = int64_t(phys) * kPageSize;
#pragma unroll
      for (int i = lane; i < 2 * kPageSize; i += 32) {
        const int side = i / kPageSize, t = i % kPageSize;
        const float* src = side ? a.kv.v_token_scale + g * a.kv.v_token_stride : a.kv.k_token_scale + g * a.kv.k_token_stride;
        cp_async4(smem_addr(&sm.token_scale[s][side][t]), src + slot0 + t);
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full) : "memory");
    }
    if (lane > 0) continue;
    mbar_arrive_expect_tx(full, 2 * Page::kSideBytes);
    const uint32_t dst = base + uint32_t(offsetof(RowsStorage<F>, ring) + s * 2 * Page::kSideBytes);
#pragma unroll
    for (int box = 0; box < Page::kBoxes; ++box) {
      tma_load_4d(dst + box * kBoxBytes, k_map, box * 64, 0, g, phys, full, policy);
      tma_load_4d(dst + Page::kSideBytes + box * kBoxBytes, v_map, box * 64, 0, g, phys, full, policy);
    }
  }
}

// One consumer warp's row state: heads gid and gid + 8 of its lane, P V's n-tiles.
struct RowState {
  float o[16][4];  // n-tile t = 8 hh + i: C fragment (dims 64 hh + 16 q + i, + 8)
  float m[2];      // running max, log2 units
  float l[2];      // this lane's share of the sums
};

// The row's queries as f16 A fragments of S's 8 k16 steps in the permuted k order, each head
// scaled by f16_query_scale (decode_pages.cuh); qk[h]: the logit factor that undoes it.
__device__ __forceinline__ void load_query(const AttnArgs& a, int64_t r, int g, int lane, float logit_scale,
                                           uint32_t (&qa)[8][4], float (&qk)[2]) {
  const int quad = lane & 3, gid = lane >> 2;
  uint4 raw[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const __nv_bfloat16* src = a.q + r * a.q_s0 + int64_t(g * kGroupSize + gid + 8 * h) * a.q_s1;
#pragma unroll
    for (int p = 0; p < 4; ++p) raw[h][p] = *reinterpret_cast<const uint4*>(src + 32 * p + 8 * quad);
  }
  float v[2][4][8];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = 0.0f;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t w[4] = {raw[h][p].x, raw[h][p].y, raw[h][p].z, raw[h][p].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        v[h][p][2 * e] = __uint_as_float(w[e] << 16);
        v[h][p][2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
        // inf / NaN do not set the scale (they stay as they are and decide the logits either
        // way), so that the finite values of their head do not overflow f16.
        if (fabsf(v[h][p][2 * e]) < INFINITY) mx = fmaxf(mx, fabsf(v[h][p][2 * e]));
        if (fabsf(v[h][p][2 * e + 1]) < INFINITY) mx = fmaxf(mx, fabsf(v[h][p][2 * e + 1]));
      }
    }
    mx = warp_max4(mx);
    const float scale = f16_query_scale(mx);
    qk[h] = logit_scale / scale;
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int i = 0; i < 8; ++i) v[h][p][i] *= scale;
  }
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int p = kk / 2, o = 4 * (kk % 2);
    qa[kk][0] = pack_f16(v[0][p][o], v[0][p][o + 1]);
    qa[kk][1] = pack_f16(v[1][p][o], v[1][p][o + 1]);
    qa[kk][2] = pack_f16(v[0][p][o + 2], v[0][p][o + 3]);
    qa[kk][3] = pack_f16(v[1][p][o + 2], v[1][p][o + 3]);
  }
}

// S = Q K^T over a page's 128 keys (n-tile j: keys 8j ..; this lane's key 8j + gid); `codes`:
// Fp8Codes or Fp4Codes of the K side.
template <typename Codes>
__device__ __forceinline__ void page_scores(const Codes& codes, const uint32_t (&qa)[8][4], float (&s)[16][4],
                                            int lane) {
  const int quad = lane & 3, gid = lane >> 2;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint2 w = codes(8 * j + gid, 32 * p + 8 * quad);
      mma_16816<true>(s[j], qa[2 * p], inference::e4m3x2_to_f16x2(w.x), inference::e4m3x2_to_f16x2(w.x >> 16));
      mma_16816<true>(s[j], qa[2 * p + 1], inference::e4m3x2_to_f16x2(w.y), inference::e4m3x2_to_f16x2(w.y >> 16));
    }
  }
}

// bf16 pages: the row's queries as bf16 A fragments in the usual k order.
__device__ __forceinline__ void load_query_bf16(const AttnArgs& a, int64_t r, int g, int lane, float logit_scale,
                                                uint32_t (&qa)[8][4], float (&qk)[2]) {
  const int quad = lane & 3, gid = lane >> 2;
  const uint32_t* h0 = reinterpret_cast<const uint32_t*>(a.q + r * a.q_s0 + int64_t(g * kGroupSize + gid) * a.q_s1);
  const uint32_t* h1 = reinterpret_cast<const uint32_t*>(a.q + r * a.q_s0 + int64_t(g * kGroupSize + gid + 8) * a.q_s1);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    qa[kk][0] = h0[8 * kk + quad];
    qa[kk][1] = h1[8 * kk + quad];
    qa[kk][2] = h0[8 * kk + 4 + quad];
    qa[kk][3] = h1[8 * kk + 4 + quad];
  }
  qk[0] = qk[1] = logit_scale;
}

__device__ __forceinline__ void page_scores_bf16(uint32_t k_tile, const uint32_t (&qa)[8][4], float (&s)[16][4],
                                                 int lane) {
#pragma unroll
  for (int j = 0; j < 16; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
  for (int jj = 0; jj < 8; ++jj)
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      uint32_t b[4];
      load_b_nk(b, k_tile, kPageSize, 16 * jj, 16 * kk, lane);
      mma_16816<false>(s[2 * jj], qa[kk], b[0], b[1]);
      mma_16816<false>(s[2 * jj + 1], qa[kk], b[2], b[3]);
    }
}

// O += P V for bf16 pages: n-tile t is dims 8t.. (the usual order).
__device__ __forceinline__ void page_values_bf16(RowState& st, uint32_t v_tile, const uint32_t (&pa)[8][4], int limit,
                                                 int lane) {
  const int quad = lane & 3;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    if (c * 16 >= limit) break;
    uint2 keep = make_uint2(0xffffffffu, 0xffffffffu);
    if (c * 16 + 16 > limit) keep = keys_below(c, limit, quad);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      uint32_t b[4];
      load_b_kn(b, v_tile, kPageSize, 16 * c, 16 * jj, lane);
      mma_16816<false>(st.o[2 * jj], pa[c], b[0] & keep.x, b[1] & keep.y);
      mma_16816<false>(st.o[2 * jj + 1], pa[c], b[2] & keep.x, b[3] & keep.y);
    }
  }
}

// V weights of online_softmax_page (decode_pages.cuh) for per-token V scales: divided by the
// warp's running largest scale of the keys it read (`run`, 0 before any), so that P stays in
// [0, 1] for f16; the accumulators stay in its units and are rescaled when it grows. Keys past
// the limit feed P V nothing: their scale slots may hold garbage (0 * inf is NaN).
struct RunningVWeights {
  const float* v_scale;
  float& run;
  int limit;
  float vmax = 0.0f, inv = 0.0f;
  __device__ __forceinline__ void see(int t) {
    const float2 vs = *reinterpret_cast<const float2*>(v_scale + t);
    if (t < limit) vmax = fmaxf(vmax, vs.x);
    if (t + 1 < limit) vmax = fmaxf(vmax, vs.y);
  }
  __device__ __forceinline__ float o_factor() {
    const float grown = fmaxf(run, warp_max4(vmax));
    const float ratio = grown > 0.0f ? run / grown : 0.0f;
    inv = grown > 0.0f ? 1.0f / grown : 0.0f;
    run = grown;
    return ratio;
  }
  __device__ __forceinline__ float2 weight(int t) const {
    const float2 vs = *reinterpret_cast<const float2*>(v_scale + t);
    return make_float2(t < limit ? vs.x * inv : 0.0f, t + 1 < limit ? vs.y * inv : 0.0f);
  }
};

// The online-softmax step over a page. `k_scale` / `v_scale`: the page's per-token scales
// (nullptr without); `v_run`: RunningVWeights' running scale (per-token only).
template <bool kF16>
__device__ __forceinline__ void softmax_page(RowState& st, float (&s)[16][4], uint32_t (&pa)[8][4], int limit,
                                             const float (&qk)[2], int quad, const float* k_scale = nullptr,
                                             const float* v_scale = nullptr, float* v_run = nullptr) {
  if (v_scale) {
    RunningVWeights w{v_scale, *v_run, limit};
    online_softmax_page<kF16>(flat_outputs(st), st.m, st.l, s, pa, limit, qk, k_scale, w, quad);
  } else {
    TokenVWeights w{nullptr};
    online_softmax_page<kF16>(flat_outputs(st), st.m, st.l, s, pa, limit, qk, k_scale, w, quad);
  }
}

// O += P V over the page's keys below `limit` (keys 16c + 2q, + 1, + 8, + 9 of k16 step c for
// quad q; this lane's dims 64 hh + 8 gid + i feed n-tile 8 hh + i).
template <typename Codes>
__device__ __forceinline__ void page_values(RowState& st, const Codes& codes, const uint32_t (&pa)[8][4], int limit,
                                            int lane) {
  const int quad = lane & 3, gid = lane >> 2;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    if (c * 16 >= limit) break;
    const int k0 = 16 * c + 2 * quad;
    uint2 keep = make_uint2(0xffffffffu, 0xffffffffu);
    if (c * 16 + 16 > limit) keep = keys_below(c, limit, quad);  // f16 pairs: the same masks as bf16
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int d0 = 64 * hh + 8 * gid;
      const uint2 w0 = codes(k0, d0), w1 = codes(k0 + 1, d0);
      const uint2 w2 = codes(k0 + 8, d0), w3 = codes(k0 + 9, d0);
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // dims d0 + 4 half + 0 .. 3
        const uint32_t a0 = half ? w0.y : w0.x, a1 = half ? w1.y : w1.x;
        const uint32_t a2 = half ? w2.y : w2.x, a3 = half ? w3.y : w3.x;
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
          // (key k0, key k0 + 1) codes of dims i and i + 1; the same for keys k0 + 8, + 9.
          const uint32_t lo = __byte_perm(a0, a1, uint32_t(i | (i + 4) << 4 | (i + 1) << 8 | (i + 5) << 12));
          const uint32_t hi = __byte_perm(a2, a3, uint32_t(i | (i + 4) << 4 | (i + 1) << 8 | (i + 5) << 12));
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint32_t b0 = inference::e4m3x2_to_f16x2(lo >> (16 * e)) & keep.x;
            const uint32_t b1 = inference::e4m3x2_to_f16x2(hi >> (16 * e)) & keep.y;
            mma_16816<true>(st.o[8 * hh + 4 * half + i + e], pa[c], b0, b1);
          }
        }
      }
    }
  }
}

template <KvFormat F, bool PerToken, PageBodies Bodies>
__global__ void __launch_bounds__(kThreads, 1)
    paged_decode_rows_kernel(const AttnArgs a, const __grid_constant__ CUtensorMap k_map,
                             const __grid_constant__ CUtensorMap v_map) {
  using Page = RowsPage<F>;
  using Storage = RowsStorage<F>;
  constexpr bool kCodes = F != KvFormat::bf16;  // FP8 codes, or NVFP4 made E4M3 codes
  extern __shared__ uint8_t smem_raw[];
  Storage& sm = shared_storage<Storage>(smem_raw);
  const uint32_t base = smem_addr(&sm);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const auto [r0, nrows, g, split] = decode_tile(a);

  // 1. Barriers, row positions, the split's distinct pages.
  if (tid == 0) {
    for (int i = 0; i < Page::kStages; ++i) {
      mbar_init(smem_addr(&sm.full[i]), PerToken || Page::kFp4 ? 1 + 32 : 1);
      mbar_init(smem_addr(&sm.empty[i]), kRowWarps);
    }
  }
  if (tid < kMaxTileRows) sm.row_position[tid] = tid < nrows ? a.positions[r0 + tid] : -1;
  if constexpr (Page::kFp4) {  // the table of E4M3 codes per block-scale code (published by collect_pages' barriers)
    if (tid < 256) {
      const float scale = inference::e4m3_to_f32(uint8_t(tid));
      uint8_t c[8];
#pragma unroll
      for (int m = 0; m < 8; ++m) c[m] = inference::f32_to_e4m3(inference::e2m1_to_f32(uint32_t(m)) * scale);
      sm.fp4_codes[tid] = make_uint2(uint32_t(c[0]) | uint32_t(c[1]) << 8 | uint32_t(c[2]) << 16 | uint32_t(c[3]) << 24,
                                     uint32_t(c[4]) | uint32_t(c[5]) << 8 | uint32_t(c[6]) << 16 | uint32_t(c[7]) << 24);
    }
  }
  preload_page_table(a, sm.table, r0, nrows);
  griddep_wait();
  // Pages in page order from 4 rows a tile (tiles of 1 or 2 rows: row by row measured as fast or
  // faster); NVFP4 tiles of long requests in rounds where their rows select apart (run 27: their
  // pages cost enough to repay the rounds; FP8 tiles and short requests lost 3-10 %). Both
  // orders keep each row's pages in page order, so no row's rounding depends on the choice.
  const bool long_request = a.positions[r0 + nrows - 1] >= kRoundsFromPosition;
  const PageOrder order = nrows < 4 ? PageOrder::by_row
                          : Page::kFp4 && long_request ? PageOrder::in_rounds
                                                       : PageOrder::by_page;
  const int pages = collect_pages(a, sm.pages, r0, nrows, g, split, order, &sm.table);
  __syncthreads();

  if (warp >= kRowWarps) {  // 2. the producer
    setmaxnreg_dec<kProducerRegisters>();
    if (warp == kRowWarps) {
      issue_pages<F, PerToken>(a, sm, base, &k_map, &v_map, g, pages, lane);
      // Its scale copies complete before the lanes exit (the consumers wait for them through `full`).
      if constexpr (PerToken || Page::kFp4) asm volatile("cp.async.wait_all;\n" ::: "memory");
    }
    return;
  }
  setmaxnreg_inc<kConsumerRegisters>();

  // 3. The consumer warps: warp c serves row c / W, its pages k = c % W, k + W, .. of them.
  const int rows_pow2 = nrows <= 1 ? 1 : nrows <= 2 ? 2 : nrows <= 4 ? 4 : 8;
  const int W = kRowWarps / rows_pow2, row = warp / W, turn = warp % W;
  const bool active = row < nrows;
  const int32_t pos = active ? sm.row_position[row] : -1;
  // bf16 caches have no scales (checked in src/core/inference.cpp); NVFP4's global scales are
  // per-tensor scales of its E4M3 values.
  const float k_tensor = kCodes && a.kv.k_tensor_scale ? *a.kv.k_tensor_scale : 1.0f;
  const float v_tensor = kCodes && a.kv.v_tensor_scale ? *a.kv.v_tensor_scale : 1.0f;
  uint32_t qa[8][4];
  float qk[2] = {0.0f, 0.0f};
  if (active) {
    if constexpr (kCodes) load_query(a, r0 + row, g, lane, a.softmax_scale * k_tensor * math::kLog2e, qa, qk);
    else load_query_bf16(a, r0 + row, g, lane, a.softmax_scale * math::kLog2e, qa, qk);
  }

  RowState st;
#pragma unroll
  for (int t = 0; t < 16; ++t) st.o[t][0] = st.o[t][1] = st.o[t][2] = st.o[t][3] = 0.0f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.0f;
  float v_run = 0.0f;  // per-token V scales: the largest this warp has read (the accumulators' unit)
  int seen = 0;        // pages of the split this row selected so far
  const uint8_t* ring = sm.ring;
  const uint32_t ring_addr = base + uint32_t(offsetof(Storage, ring));
  // A CTA of a few pages keeps to the masked body even in the instance with both (run 29: NVFP4;
  // run 49: every format): its warps would fetch both copies cold.
  const bool whole_page_body = Bodies == PageBodies::masked_and_whole && pages >= kRowWarps;
  for (int u = 0; u < pages; ++u) {
    const int s = u % Page::kStages;
    const bool mine = active && ((sm.pages.page_rows[u] >> row) & 1u);
    const bool computes = mine && (seen++ % W) == turn;  // warp-uniform
    mbar_wait(smem_addr(&sm.full[s]), (u / Page::kStages) & 1);
    // One page for this warp; `limit` keys visible. A page wholly visible (all of a request's
    // pages but its last) takes a copy of the body compiled for 128 keys, without the key masks.
    auto page_body = [&](auto limit) {
      float sc[16][4];
      uint32_t pa[8][4];
      if constexpr (F == KvFormat::fp8_e4m3) {
        const uint8_t* page = ring + s * 2 * Page::kSideBytes;
        page_scores(Fp8Codes{page}, qa, sc, lane);
        if constexpr (PerToken)
          softmax_page<true>(st, sc, pa, limit, qk, lane & 3, sm.token_scale[s][0], sm.token_scale[s][1], &v_run);
        else
          softmax_page<true>(st, sc, pa, limit, qk, lane & 3);
        page_values(st, Fp8Codes{page + Page::kSideBytes}, pa, limit, lane);
      } else if constexpr (Page::kFp4) {
        const uint8_t* page = ring + s * 2 * Page::kSideBytes;
        page_scores(Fp4Codes{page, sm.block_scale[s][0], sm.fp4_codes}, qa, sc, lane);
        softmax_page<true>(st, sc, pa, limit, qk, lane & 3);
        page_values(st, Fp4Codes{page + Page::kSideBytes, sm.block_scale[s][1], sm.fp4_codes}, pa, limit, lane);
      } else {
        const uint32_t page = ring_addr + uint32_t(s * 2 * Page::kSideBytes);
        page_scores_bf16(page, qa, sc, lane);
        softmax_page<false>(st, sc, pa, limit, qk, lane & 3);
        page_values_bf16(st, page + Page::kSideBytes, pa, limit, lane);
      }
    };
    if (computes) {
      const int limit = visible_keys(pos, sm.pages.page_logical[u]);
      if (whole_page_body && limit >= kPageSize) page_body(std::integral_constant<int, kPageSize>{});
      else page_body(limit);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_addr(&sm.empty[s]));
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) st.l[h] = warp_sum4(st.l[h]);
  if constexpr (PerToken) {  // the accumulators back from units of v_run
#pragma unroll
    for (int t = 0; t < 16; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) st.o[t][e] *= v_run;
  }

  // 4. A row's W warps combine their states through the drained ring (the first warp of the
  // row holds the result).
  if (W > 1) {
    float* states = reinterpret_cast<float*>(const_cast<uint8_t*>(ring));
    sync_barrier(RowsBarrier::kConsumers, 32 * kRowWarps);  // every warp is past the ring's pages
    float* mine_state = states + warp * kStateFloats * 32;
    if (turn > 0) {
#pragma unroll
      for (int t = 0; t < 16; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) mine_state[(4 * t + e) * 32 + lane] = st.o[t][e];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mine_state[(64 + h) * 32 + lane] = st.m[h];
        mine_state[(66 + h) * 32 + lane] = st.l[h];
      }
    }
    sync_barrier(RowsBarrier::kConsumers, 32 * kRowWarps);
    if (turn > 0) return;
    for (int k = 1; k < W; ++k) {
      const float* other = states + (warp + k) * kStateFloats * 32;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m2 = other[(64 + h) * 32 + lane], l2 = other[(66 + h) * 32 + lane];
        const float mnew = fmaxf(st.m[h], m2);
        const float use = mnew == -INFINITY ? 0.0f : mnew;
        const float a1 = fast_exp2(st.m[h] - use), a2 = fast_exp2(m2 - use);
        st.m[h] = mnew;
        st.l[h] = st.l[h] * a1 + l2 * a2;
#pragma unroll
        for (int t = 0; t < 16; ++t) {
          st.o[t][2 * h] = st.o[t][2 * h] * a1 + other[(4 * t + 2 * h) * 32 + lane] * a2;
          st.o[t][2 * h + 1] = st.o[t][2 * h + 1] * a1 + other[(4 * t + 2 * h + 1) * 32 + lane] * a2;
        }
      }
    }
  }
  if (!active) return;

  // 5. The row's outputs (normalised) and LSE, or its split's partial. A lane's dims for head
  // gid + 8h: FP8, 64 hh + 16 q + i (n-tile 8 hh + i, column 2q) and + 8 (column 2q + 1), runs
  // of 8; bf16, 8t + 2q and + 1 (n-tile t), pairs.
  const int quad = lane & 3, gid = lane >> 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = gid + 8 * h;
    const SoftmaxState state{st.m[h], st.l[h]};
    const float inv = state.inverse_sum() * v_tensor;
    const int64_t rh = (r0 + row) * a.hq + g * kGroupSize + head;
    if (quad == 0) {
      if (a.splits == 1) a.lse[rh] = state.lse();
      else a.part_lse[int64_t(split) * a.total_q * a.hq + rh] = state.lse();
    }
    const OutputRow dst_row = output_row(a, rh, split);
    if constexpr (!kCodes) {
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        const int d = 8 * t + 2 * quad;
        const float x0 = st.o[t][2 * h] * inv, x1 = st.o[t][2 * h + 1] * inv;
        if (dst_row.f32) *reinterpret_cast<float2*>(dst_row.f32 + d) = make_float2(x0, x1);
        else *reinterpret_cast<uint32_t*>(dst_row.bf16 + d) = pack_bf16(x0, x1);
      }
    } else {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int col = 0; col < 2; ++col) {
          const int d0 = 64 * hh + 16 * quad + 8 * col;
          float x[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) x[i] = st.o[8 * hh + i][2 * h + col] * inv;
          if (dst_row.f32) {
            float4* dst = reinterpret_cast<float4*>(dst_row.f32 + d0);
            dst[0] = make_float4(x[0], x[1], x[2], x[3]);
            dst[1] = make_float4(x[4], x[5], x[6], x[7]);
          } else {
            *reinterpret_cast<uint4*>(dst_row.bf16 + d0) =
                make_uint4(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]), pack_bf16(x[4], x[5]), pack_bf16(x[6], x[7]));
          }
        }
    }
  }
}

template <KvFormat F, bool PerToken, PageBodies Bodies>
void configure() {
  static std::once_flag once;
  std::call_once(once, [] {
    MSA_CUDA_CHECK(cudaFuncSetAttribute(paged_decode_rows_kernel<F, PerToken, Bodies>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, storage_bytes<F>()));
  });
}

template <KvFormat F, bool PerToken, PageBodies Bodies>
void launch(const AttnArgs& a, const CUtensorMap& k_map, const CUtensorMap& v_map, dim3 grid, cudaStream_t stream) {
  configure<F, PerToken, Bodies>();
  launch_programmatic("paged_decode_rows_kernel launch", paged_decode_rows_kernel<F, PerToken, Bodies>, grid, dim3(kThreads),
                      size_t(storage_bytes<F>()), stream, a, k_map, v_map);
}

template <KvFormat F, bool PerToken, PageBodies Bodies>
int ctas_per_sm() {
  configure<F, PerToken, Bodies>();
  int n = 0;
  MSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, paged_decode_rows_kernel<F, PerToken, Bodies>, kThreads,
                                                               storage_bytes<F>()));
  return n;
}

template <PageBodies Bodies>
void launch_format(KvFormat f, const AttnArgs& a, const CUtensorMap& k_map, const CUtensorMap& v_map, dim3 grid,
                   cudaStream_t stream) {
  if (f == KvFormat::bf16) launch<KvFormat::bf16, false, Bodies>(a, k_map, v_map, grid, stream);
  else if (f == KvFormat::nvfp4) launch<KvFormat::nvfp4, false, Bodies>(a, k_map, v_map, grid, stream);
  else if (a.kv.k_token_scale) launch<KvFormat::fp8_e4m3, true, Bodies>(a, k_map, v_map, grid, stream);
  else launch<KvFormat::fp8_e4m3, false, Bodies>(a, k_map, v_map, grid, stream);
}

template <PageBodies Bodies>
int ctas_per_sm_any_format() {
  return std::min({ctas_per_sm<KvFormat::bf16, false, Bodies>(), ctas_per_sm<KvFormat::fp8_e4m3, false, Bodies>(),
                   ctas_per_sm<KvFormat::fp8_e4m3, true, Bodies>(), ctas_per_sm<KvFormat::nvfp4, false, Bodies>()});
}

}  // namespace

void launch_rows(KvFormat f, int64_t max_cta_pages, const AttnArgs& a, const CUtensorMap& k_map,
                 const CUtensorMap& v_map, dim3 grid, cudaStream_t stream) {
  if (max_cta_pages <= kMaskedBodyMaxPages) launch_format<PageBodies::masked>(f, a, k_map, v_map, grid, stream);
  else launch_format<PageBodies::masked_and_whole>(f, a, k_map, v_map, grid, stream);
}

int rows_ctas_per_sm() {
  return std::min(ctas_per_sm_any_format<PageBodies::masked>(), ctas_per_sm_any_format<PageBodies::masked_and_whole>());
}

}  // namespace msa::cuda::decode
