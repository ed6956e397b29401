// Decode attention over a bf16 or FP8 paged cache on warpgroup MMAs (sm_90a); paged_attention.cu
// dispatches here and keeps its mma.sync kernel for NVFP4 caches.
//
// A tile's query rows and their 16 heads are the M dimension of the products: a consumer
// warpgroup computes 4 rows x 16 heads = 64 M-rows (warp w: row 4 wg + w, one m16 slice), so
// one CTA of 8 rows has two consumer warpgroups, and every page the union holds is multiplied
// once per warpgroup whose rows selected it: S = Q K^T on wgmma (Q and K from shared memory),
// the online softmax in registers (a row's heads are whole in its warp: no exchange), then
// O += P V on wgmma with P from registers. Rows of the warpgroup that did not select the page
// (and keys past a row's causal limit) get P = 0. The (split of the) union is step 1, shared
// with the mma.sync kernel (decode_pages.cuh). Scales: the per-tensor K scale and the softmax
// scale multiply the logits, per-token K scales each logit column, per-token V scales the
// probabilities fed to P V (not the sums), the per-tensor V scale the output.
//
// Producer warps feed a ring of 16-bit sides (one side, K or V, of a page: 32 KB):
//   issuer (one thread)     TMA of a side into a free slot: bf16 sides straight into the ring
//                           (two column-half boxes), FP8 codes into a staging ring of raw sides;
//   scanners (3 warps, 7    per side: FP8 codes widened into the ring exactly (K to f16, the
//    for FP8 caches)        query tile then f16 too; V to f16 without per-token scales, else
//                           bf16) with the side's per-token scales;
//                           rows past the most tokens any row reads zeroed (cache slots not
//                           written yet: garbage);
//                           V sides flagged when a row that some row reads holds inf / NaN.
// A row that gets P = 0 on a key must not get 0 * inf = NaN from it (the NaN-isolation
// contract), so a flagged V side is multiplied per row on mma.sync with the keys past each
// row's limit zeroed, rows that did not select the page skipped (the mma.sync kernel's rule).
// bf16 caches first run the split's pages without the V check (optimistic pass): 0 * inf and
// 0 * NaN are NaN, so a row with P = 0 on keys of a page sees its accumulator turn non-finite
// exactly when the check would have flagged a key of that page (or it was already
// non-finite). The consumers test those rows' accumulators after each such page; if any
// did, the CTA runs its pages again with the check (checked pass). FP8 V sides are checked
// while they are widened, at no extra cost.
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
#include "cuda/wgmma.cuh"

namespace msa::cuda::decode {

namespace {

using model::kGroupSize;
using model::kHeadDim;

constexpr int kRowsPerWarpgroup = 4;                  // warp w of a consumer warpgroup: one row's 16 heads
constexpr int kSideBytes = kPageSize * kHeadDim * 2;  // one bf16 side of a page: 32 KB
constexpr int kBoxBytes = kSideBytes / 2;             // one bf16 TMA box: 64 columns of the 128 rows
constexpr int kFp8SideBytes = kPageSize * kHeadDim;   // one FP8 side: one box of 16 KB
static_assert(kRowsPerWarpgroup * kGroupSize == 64, "a warpgroup's wgmma rows are 4 query rows x 16 heads");
constexpr int32_t kNoRow = INT32_MIN;                 // row_position of a CTA row past the tile's

// The CTA's shape by its consumer warpgroups (1: tiles of <= 4 rows, 2: of <= 8) and the
// cache format: as many ring slots as shared memory holds; the producers are one warpgroup
// (the issuer and 3 scanner warps) for bf16 and two (7 scanners) for FP8, whose widening is
// the producers' bottleneck: three warps widen a 16 KB side in ~1,300 cycles
// (bench/experiments/fp8_widen_probe.cu), more than the ~1,100 an SM's share of HBM takes to
// bring it.
template <int Consumers, KvFormat F>
struct DecodeShape {
  static constexpr bool kQuantised = F != KvFormat::bf16;
  static constexpr int kProducerGroups = kQuantised ? 2 : 1;
  static constexpr int kThreads = 128 * (Consumers + kProducerGroups);
  static constexpr int kConsumerWarps = 4 * Consumers;
  static constexpr int kScanThreads = 128 * kProducerGroups - 32;  // producer warps 1, 2, ..
  static constexpr int kScanWarps = kScanThreads / 32;
  static constexpr int kSlots = !kQuantised ? (Consumers == 1 ? 6 : 5) : (Consumers == 1 ? 4 : 3);  // bf16 sides
  static constexpr int kRawSlots = !kQuantised ? 1 : (Consumers == 1 ? 4 : 5);                       // FP8 sides
  // setmaxnreg when the launch's share (65536 / kThreads, in steps of 8) is below what the
  // consumers need: the producers give theirs to them; the CTA's pool is that share.
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static constexpr bool kRebalance = kThreads > 256;
  static constexpr int kProducerRegs = kProducerGroups == 1 ? 72 : 48;
  static constexpr int kConsumerRegs = kProducerGroups == 1 ? 216 : (Consumers == 1 ? 232 : 208);
  static_assert(!kRebalance || kProducerRegs * 128 * kProducerGroups + kConsumerRegs * 128 * Consumers <=
                                   kLaunchRegs * kThreads,
                "setmaxnreg: more registers than the CTA's pool");
};

// P V on f16 operands: V sides of an FP8 cache without per-token scales widen to f16 (one
// conversion a pair of codes instead of bf16's four; f16 holds every E4M3 value) and P is
// packed to f16 (p in [0, 1]: f16 keeps 3 more bits than bf16; below 2^-24 of the row's
// maximum it flushes, far under the tolerance). With per-token V scales P carries them, whose
// range f16 may not hold: bf16 there.
template <KvFormat F, bool PerToken>
constexpr bool kF16Values = F == KvFormat::fp8_e4m3 && !PerToken;

// S = Q K^T on f16 operands for FP8 caches: K sides widen to f16 (one conversion a pair of
// codes, exact) and each (row, head) of the query tile is scaled by a power of two into f16's
// range (scale_query_tile), undone on the logits: bf16's four conversions a pair of K codes
// were most of the scanners' work.
template <KvFormat F>
constexpr bool kF16Keys = F == KvFormat::fp8_e4m3;

// bf16 caches run a split's pages first without the V sides' inf / NaN check (see the top).
template <KvFormat F>
constexpr bool kOptimisticPass = F == KvFormat::bf16;

struct alignas(1024) Side {
  uint8_t bytes[kSideBytes];  // 128 tokens x 128 bf16, swizzled (tile_offset), as the TMA boxes land
};
struct alignas(128) RawSide {
  uint8_t bytes[kFp8SideBytes];  // 128 tokens x 128 E4M3 codes, row-major
};
struct alignas(1024) QueryTile {
  uint8_t bytes[64 * kHeadDim * 2];  // M-row 16 w + h = (tile row 4 wg + w, head h)
};

// Shared memory of the kernel, from a 1024-byte aligned base; the barriers per slot:
//   raw_full  FP8: the raw side's TMA bytes have landed (1 arrival + bytes)
//   raw_free  FP8: the scanners have widened it (Shape::kScanThreads arrivals)
//   full      bf16: the side's TMA bytes have landed (1 arrival + bytes)
//   ready     the scanners are done with the side (Shape::kScanThreads arrivals)
//   empty     every consumer warp is done with it (kConsumerWarps arrivals)
//   verdict   bf16, once: every consumer warp voted on the checked pass (kConsumerWarps arrivals)
template <int Consumers, KvFormat F>
struct DecodeStorage {
  using Shape = DecodeShape<Consumers, F>;
  Side slot[Shape::kSlots];
  QueryTile q[Consumers];
  RawSide raw[Shape::kQuantised ? Shape::kRawSlots : 0];
  SplitPages pages;
  TableRow table;
  float token_scale[Shape::kSlots][kPageSize];  // per-token scale of the side's keys (1 without; 0 past the read)
  uint64_t raw_full[Shape::kRawSlots];
  uint64_t raw_free[Shape::kRawSlots];
  uint64_t full[Shape::kSlots];
  uint64_t ready[Shape::kSlots];
  uint64_t empty[Shape::kSlots];
  uint64_t verdict;      // bf16: every consumer warp has voted on the optimistic pass (kConsumerWarps arrivals)
  int32_t checked_pass;  // bf16: some warp saw a suspect accumulator: the CTA runs its pages again, checked
  uint32_t nonfinite[Shape::kSlots][Shape::kScanWarps];  // V side: per scanner warp, a row some tile row reads holds inf / NaN
  int32_t row_position[kMaxTileRows];  // kNoRow past the tile's rows
  uint8_t check_values[kMaxEntries];   // bf16: page u's V side is checked for inf / NaN (values_need_check)
  int32_t last_split;  // splits > 1: this CTA is the (tile, KV head)'s last to finish
  float q_unscale[Consumers][64];  // FP8: per M-row of the query tile, 1 / its power-of-two scale
};

template <int Consumers, KvFormat F>
constexpr int storage_bytes() {
  return storage_smem_bytes<DecodeStorage<Consumers, F>>();  // checked against the sm_90 limit (device.cuh)
}
static_assert(storage_bytes<1, KvFormat::bf16>() > 0 && storage_bytes<2, KvFormat::bf16>() > 0 &&
                  storage_bytes<2, KvFormat::fp8_e4m3>() > 0,
              "paged_decode_wgmma_kernel: every instance's shared-memory plan, checked at compile time");

// Producer warp 0, one thread: the sides of the split's pages, in order (item i = side i % 2 of
// page i / 2; j0 = the items of earlier passes, which the ring's slots and phases count on
// from): bf16 into the ring, FP8 into the staging ring.
template <int Consumers, KvFormat F>
__device__ __forceinline__ void issue_sides(DecodeStorage<Consumers, F>& sm, uint32_t base, const CUtensorMap* k_map,
                                            const CUtensorMap* v_map, int g, int items, int j0) {
  using Shape = DecodeShape<Consumers, F>;
  using Storage = DecodeStorage<Consumers, F>;
  constexpr int S = Shape::kQuantised ? Shape::kRawSlots : Shape::kSlots;
  const uint64_t policy = l2_evict_first();
#pragma unroll 1  // one thread's asynchronous copies: unrolling would only lengthen the code
  for (int i = 0; i < items; ++i) {
    const int j = j0 + i, slot = j % S;  // j: the ring's item count over the passes
    const int32_t phys = sm.pages.page_physical[i / 2];
    const CUtensorMap* map = (i & 1) ? v_map : k_map;
    if constexpr (Shape::kQuantised) {
      if (j >= S) mbar_wait(smem_addr(&sm.raw_free[slot]), ((j / S) - 1) & 1);
      const uint32_t full = smem_addr(&sm.raw_full[slot]);
      mbar_arrive_expect_tx(full, kFp8SideBytes);
      tma_load_4d(base + uint32_t(offsetof(Storage, raw) + slot * sizeof(RawSide)), map, 0, 0, g, phys, full, policy);
    } else {
      if (j >= S) mbar_wait(smem_addr(&sm.empty[slot]), ((j / S) - 1) & 1);
      const uint32_t full = smem_addr(&sm.full[slot]);
      mbar_arrive_expect_tx(full, kSideBytes);
#pragma unroll
      for (int box = 0; box < 2; ++box)
        tma_load_4d(base + uint32_t(offsetof(Storage, slot) + slot * kSideBytes + box * kBoxBytes), map, box * 64, 0, g,
                    phys, full, policy);
    }
  }
}

// Whether page u's V side must be checked for inf / NaN: some row of a warpgroup that
// multiplies the page (warpgroup-wide products) gets P = 0 on keys below `read` (it did not
// select the page, or sees fewer of its keys than the row that sees most), and 0 * inf is NaN.
// Rows past the tile's have no output. Q = 1 never needs it; nor do rows that select alike.
// Computed for every page before the scan starts (in the scanners' loop it would lengthen
// their path, which paces the pages when the check runs).
template <int Consumers, KvFormat F>
__device__ __forceinline__ bool values_need_check(const DecodeStorage<Consumers, F>& sm, int u) {
  const uint32_t selected = sm.pages.page_rows[u];
  const int read = sm.pages.page_tokens[u], logical = sm.pages.page_logical[u];
#pragma unroll
  for (int wg = 0; wg < Consumers; ++wg) {
    if (((selected >> (kRowsPerWarpgroup * wg)) & 0xfu) == 0) continue;  // the warpgroup skips the page
#pragma unroll
    for (int r = kRowsPerWarpgroup * wg; r < kRowsPerWarpgroup * (wg + 1); ++r) {
      const int32_t pos = sm.row_position[r];
      if (pos == kNoRow) continue;  // past the tile's rows (a row of the tile without keys selects nothing)
      if (((selected >> r) & 1u) == 0 || visible_keys(pos, logical) < read) return true;
    }
  }
  return false;
}

// A bf16 V side in the ring (`side`, swizzled): rows from `read` on zeroed (cache slots no row
// reads: garbage, and P = 0 there), rows below checked for inf / NaN when `check`. Scanner `st`
// of kScan takes 16-byte chunks st, st + kScan, .. The checking loop keeps a constant start and
// trip count, so that the compiler unrolls it and several loads are in flight (with a start
// known only at run time it did not: the large bf16 shapes ran 5-10 % slower).
template <int kScan>
__device__ __forceinline__ uint32_t scan_bf16_values(uint32_t side, int st, int read, bool check) {
  constexpr int kChunks = kSideBytes / 16;
  uint32_t bad = 0;
  if (check) {
    for (int i = st; i < kChunks; i += kScan) {
      const int t = i >> 4;
      const uint32_t addr = side + tile_offset(kPageSize, t, i & 15);
      if (t >= read) {
        st_shared_v4_zero(addr);
      } else {
        const uint4 v = ld_shared_v4(addr);
        bad |= nonfinite_bf16x2_signs(v.x) | nonfinite_bf16x2_signs(v.y) | nonfinite_bf16x2_signs(v.z) |
               nonfinite_bf16x2_signs(v.w);
      }
    }
  } else {
    for (int i = read * 16 + st; i < kChunks; i += kScan) st_shared_v4_zero(side + tile_offset(kPageSize, i >> 4, i & 15));
  }
  return bad;
}

// The scanners (producer warps 1, 2, ..): each side ready for a product that every row of a
// warpgroup takes part in (bf16: in place; FP8: widened from the staging ring), with its
// per-token scales. `checked`: bf16 V sides are checked for inf / NaN where values_need_check
// says so (the checked pass; the optimistic one only zeroes rows past `read`).
template <int Consumers, KvFormat F, bool PerToken>
__device__ __forceinline__ void scan_sides(const AttnArgs& a, DecodeStorage<Consumers, F>& sm, uint32_t base, int g,
                                           int items, int j0, bool checked, int st) {
  using Shape = DecodeShape<Consumers, F>;
  using Storage = DecodeStorage<Consumers, F>;
  constexpr int S = Shape::kSlots, RS = Shape::kRawSlots, kScan = Shape::kScanThreads;
  constexpr int kScanBatch = kScan > 128 ? 3 : 4;  // 16-byte chunks a scanner loads at once
  constexpr int kKeysPerThread = (kPageSize + kScan - 1) / kScan;  // of a side's per-token scales
  // The per-token scales of item j's keys st, st + kScan, .. (this thread's), loaded a side ahead.
  auto load_scales = [&](int j, float (&out)[kKeysPerThread]) {
#pragma unroll
    for (int i = 0; i < kKeysPerThread; ++i) out[i] = 1.0f;
    if (!PerToken || j >= items) return;
    const int64_t slot0 = int64_t(sm.pages.page_physical[j / 2]) * kPageSize;
    const float* src = (j & 1) ? a.kv.v_token_scale + g * a.kv.v_token_stride : a.kv.k_token_scale + g * a.kv.k_token_stride;
#pragma unroll
    for (int i = 0; i < kKeysPerThread; ++i)
      if (st + kScan * i < kPageSize) out[i] = src[slot0 + st + kScan * i];
  };
  if (!Shape::kQuantised && checked) {  // bf16: which V sides need the inf / NaN check
    for (int u = st; u < items / 2; u += kScan) sm.check_values[u] = values_need_check<Consumers>(sm, u);
    sync_barrier(DecodeBarrier::kScanners, kScan);
  }
  float scale[kKeysPerThread], next[kKeysPerThread];
  load_scales(0, scale);
  for (int i = 0; i < items; ++i) {
    const int j = j0 + i, slot = j % S;  // j: the ring's item count over the passes
    const int read = sm.pages.page_tokens[i / 2];  // keys past it: no row reads them
    const uint32_t side = base + uint32_t(offsetof(Storage, slot) + slot * kSideBytes);
    load_scales(i + 1, next);
    uint32_t bad = 0;
    if constexpr (Shape::kQuantised) {
      const int r = j % RS;
      mbar_wait(smem_addr(&sm.raw_full[r]), (j / RS) & 1);
      if (j >= S) mbar_wait(smem_addr(&sm.empty[slot]), ((j / S) - 1) & 1);
      const uint32_t raw = base + uint32_t(offsetof(Storage, raw) + r * sizeof(RawSide));
      // A V side's NaN codes flag it (E4M3 has no infinity); K needs none: a score a row must
      // not see becomes -inf whatever it was. V sides widen to f16 when P V runs on f16.
      if (i & 1) bad = inference::widen_fp8_side<kScan, kF16Values<F, PerToken>, true, kScanBatch>(raw, side, st, read);
      else inference::widen_fp8_side<kScan, kF16Keys<F>, false, kScanBatch>(raw, side, st, read);
      mbar_arrive(smem_addr(&sm.raw_free[r]));
    } else {
      mbar_wait(smem_addr(&sm.full[slot]), (j / S) & 1);
      // A bf16 V side: its rows past `read` zeroed, the rows below checked only when a row
      // that multiplies the side gets P = 0 on keys that another row reads.
      if (i & 1) bad = scan_bf16_values<kScan>(side, st, read, checked && sm.check_values[i / 2] != 0);
    }
#pragma unroll
    for (int e = 0; e < kKeysPerThread; ++e) {
      const int t = st + kScan * e;
      if (t < kPageSize) sm.token_scale[slot][t] = t < read ? scale[e] : 0.0f;
      scale[e] = next[e];
    }
    const bool any = __any_sync(0xffffffffu, bad != 0);
    if ((st & 31) == 0) sm.nonfinite[slot][st / 32] = any;
    // The rows the scanners wrote (widened, zeroed) are read by the tensor cores; a side they
    // only read needs no proxy fence (the trace showed K sides ready ~1.8 us after landing).
    const bool wrote = Shape::kQuantised || ((i & 1) && read < kPageSize);
    if (wrote) fence_proxy_async();
    mbar_arrive(smem_addr(&sm.ready[slot]));
  }
}

// One consumer warp's state: row 4 wg + w of the tile, heads gr and gr + 8 of its thread.
struct RowState {
  float o[2][8][4];  // output dims 64 half + 8 j + 2 quad (+1), the wgmma accumulator layout
  float m[2];        // running max, log2 units
  float l[2];        // this thread's share of the sum
};

// Whether every accumulator of the row state is finite: inf or NaN in any of them makes their
// sum non-finite (a finite sum that overflows only costs a checked pass).
__device__ __forceinline__ bool accumulators_finite(const RowState& st) {
  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) sum[e] += st.o[half][j][e];
  return isfinite((sum[0] + sum[1]) + (sum[2] + sum[3]));
}

// Keys of a flagged V side through mma.sync: the keys past the row's limit zeroed (selection,
// not multiplication), P of this warp's row.
template <bool kF16>
__device__ __forceinline__ void pv_masked(RowState& st, const uint32_t (&p)[8][4], uint32_t v, int limit, int lane) {
  const int quad = lane & 3;
#pragma unroll
  for (int c = 0; c < kPageSize / 16; ++c) {
    if (c * 16 >= limit) break;
    // One mask a k16 step (all ones below the limit's step), ANDed into every B fragment: a
    // rarely taken path, kept short (its code sits inside the page loop).
    const uint2 keep = keys_below(c, limit, quad);
#pragma unroll
    for (int jj = 0; jj < kHeadDim / 16; ++jj) {
      uint32_t b[4];
      load_b_kn(b, v, kPageSize, c * 16, jj * 16, lane);
      b[0] &= keep.x, b[1] &= keep.y, b[2] &= keep.x, b[3] &= keep.y;
      const int n0 = 2 * jj, n1 = 2 * jj + 1;  // dim tiles of 8
      mma_16816<kF16>(st.o[n0 / 8][n0 % 8], p[c], b[0], b[1]);
      mma_16816<kF16>(st.o[n1 / 8][n1 % 8], p[c], b[2], b[3]);
    }
  }
}

// The online-softmax step of this warp's row over a page (decode_pages.cuh); qk: the logit
// scale of the thread's heads gr, gr + 8. `k_scale` /
// `v_scale`: the page's per-token scales, nullptr without. Keys past the limit have p = 0 and
// their scale slots hold 0 (scan_sides), so their products stay 0.
template <bool kF16>
__device__ __forceinline__ void softmax_step(RowState& st, float (&s)[16][4], uint32_t (&p)[8][4], int limit,
                                             const float (&qk)[2], const float* k_scale, const float* v_scale, int quad) {
  TokenVWeights w{v_scale};
  online_softmax_page<kF16>(flat_outputs(st), st.m, st.l, s, p, limit, qk, k_scale, w, quad);
}

// 5. Splits > 1: the last of the (tile, KV head)'s split CTAs to finish merges their partials
// into the outputs, and resets the count for the next step. The fence / atomic pair is the
// usual last-block pattern: every partial is visible to it. The partials come into the drained
// ring by cp.async, every split's share of a pass of (row, head) pairs in flight at once (one
// round trip a pass, not one per split: the merge ends the step, so its latency is the step's);
// the arithmetic is merge_row's (merge_row.cuh), spread over the consumer threads. Its loops are
// not unrolled: the last CTA fetches this code cold, at the end of the step.
template <int Consumers, KvFormat F>
__device__ __forceinline__ void merge_if_last(const AttnArgs& a, DecodeStorage<Consumers, F>& sm, int64_t r0, int nrows,
                                              int g, int ct) {
  using Shape = DecodeShape<Consumers, F>;
  constexpr int kThreads = 32 * Shape::kConsumerWarps;
  constexpr int kMaxSplits = 16, kPairs = kMaxTileRows * kGroupSize, kChunks = kHeadDim / 4;  // chunk: 4 dims
  // The ring as floats: lse [split][pair], weight [pair][split] (NaN: not merged), 1 / sum
  // [pair], then the pass's partials [split][pair of the pass][dim].
  constexpr int kRingFloats = Shape::kSlots * kSideBytes / 4, kHeader = 2 * kMaxSplits * kPairs + kPairs;
  static_assert(kRingFloats - kHeader >= kMaxSplits * kHeadDim, "merge: the ring holds a pair of every split");
  sync_barrier(DecodeBarrier::kConsumers, kThreads);  // every thread's partial stores, then
  if (ct == 0) {                                        // one (cumulative) release by one thread
    __threadfence();
    int32_t* count = a.arrivals + int64_t(blockIdx.x) * gridDim.y + g;
    const bool last = atomicAdd(count, 1) == a.splits - 1;
    if (last) *count = 0;
    sm.last_split = last;
  }
  sync_barrier(DecodeBarrier::kConsumers, kThreads);
  if (!sm.last_split) return;
  __threadfence();
  float* lse = reinterpret_cast<float*>(&sm.slot[0]);
  float* weight = lse + kMaxSplits * kPairs;
  float* inverse = weight + kPairs * kMaxSplits;
  float* part = lse + kHeader;
  const int64_t RH = a.total_q * a.hq;
  const int S = a.splits, pairs = nrows * kGroupSize;
  const int pass_pairs = min(pairs, (kRingFloats - kHeader) / (S * kHeadDim));
  auto pair_rh = [&](int pair) { return (r0 + pair / kGroupSize) * a.hq + g * kGroupSize + pair % kGroupSize; };
  // Pairs p0 .. p0 + n of every split into `part` (16-byte pieces; a pair's 128 dims are 32).
  auto fetch = [&](int p0, int n) {
#pragma unroll 1
    for (int i = ct; i < S * n * kChunks; i += kThreads) {
      const int s = i / (n * kChunks), rest = i % (n * kChunks), pp = rest / kChunks, c = rest % kChunks;
      cp_async16(smem_addr(part + (s * n + pp) * kHeadDim + 4 * c),
                 a.part_out + (s * RH + pair_rh(p0 + pp)) * kHeadDim + 4 * c, 16);
    }
  };
  // A row's 16 heads of LSE are 64 contiguous bytes a split.
#pragma unroll 1
  for (int i = ct; i < S * nrows * 4; i += kThreads) {
    const int s = i / (nrows * 4), row = (i / 4) % nrows, c = i % 4;
    cp_async16(smem_addr(lse + s * kPairs + row * kGroupSize + 4 * c), a.part_lse + s * RH + pair_rh(row * kGroupSize) + 4 * c,
               16);
  }
  fetch(0, pass_pairs);
  cp_async_commit();
  cp_async_wait<0>();
  sync_barrier(DecodeBarrier::kConsumers, kThreads);
#pragma unroll 1
  for (int pair = ct; pair < pairs; pair += kThreads) {
    SoftmaxState row = SoftmaxState::empty();
#pragma unroll 1
    for (int s = 0; s < S; ++s) row.m = state_math::max(row.m, SoftmaxState::from_lse(lse[s * kPairs + pair]).m);
#pragma unroll 1
    for (int s = 0; s < S; ++s) {
      const SoftmaxState part_state = SoftmaxState::from_lse(lse[s * kPairs + pair]);
      const float w = row.add_at_max(part_state);
      weight[pair * kMaxSplits + s] = part_state.m > -INFINITY ? w : NAN;
    }
    if (!row.valid())
      for (int s = 0; s < S; ++s) weight[pair * kMaxSplits + s] = NAN;
    inverse[pair] = row.inverse_sum();
    a.lse[pair_rh(pair)] = row.lse();
  }
  sync_barrier(DecodeBarrier::kConsumers, kThreads);
#pragma unroll 1
  for (int p0 = 0; p0 < pairs; p0 += pass_pairs) {
    const int n = min(pass_pairs, pairs - p0);
    if (p0 > 0) {
      fetch(p0, n);
      cp_async_commit();
      cp_async_wait<0>();
      sync_barrier(DecodeBarrier::kConsumers, kThreads);
    }
#pragma unroll 1
    for (int it = ct; it < n * kChunks; it += kThreads) {
      const int pp = it / kChunks, pair = p0 + pp, d = 4 * (it % kChunks);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
      for (int s = 0; s < S; ++s) {
        const float w = weight[pair * kMaxSplits + s];
        if (isnan(w)) continue;  // an empty partial: its values are not read
        const float4 v = *reinterpret_cast<const float4*>(part + (s * n + pp) * kHeadDim + d);
        acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
      }
      const int64_t rh = pair_rh(pair);
      const float inv = inverse[pair];
      if (a.out_f32) {
        *reinterpret_cast<float4*>(static_cast<float*>(a.out) + rh * kHeadDim + d) =
            make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
      } else {
        *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(a.out) + rh * kHeadDim + d) =
            make_uint2(pack_bf16(acc.x * inv, acc.y * inv), pack_bf16(acc.z * inv, acc.w * inv));
      }
    }
    sync_barrier(DecodeBarrier::kConsumers, kThreads);  // the next pass overwrites `part`
  }
}

template <int Consumers, KvFormat F, bool PerToken>
__device__ __forceinline__ void consume_pages(const AttnArgs& a, DecodeStorage<Consumers, F>& sm, uint32_t slots,
                                              uint32_t q_tile, int pages, int64_t r0, int nrows, int g, int split,
                                              int wg, int w, int lane) {
  using Shape = DecodeShape<Consumers, F>;
  constexpr int S = Shape::kSlots;
  constexpr bool kF16V = kF16Values<F, PerToken>;
  const int quad = lane & 3, gr = lane >> 2;
  const int row = kRowsPerWarpgroup * wg + w;
  const uint32_t wg_rows = ((1u << kRowsPerWarpgroup) - 1u) << (kRowsPerWarpgroup * wg);
  const int32_t pos = sm.row_position[row];
  // bf16 caches have no scales (checked in src/core/inference.cpp).
  const float k_tensor = F != KvFormat::bf16 && a.kv.k_tensor_scale ? *a.kv.k_tensor_scale : 1.0f;
  const float v_tensor = F != KvFormat::bf16 && a.kv.v_tensor_scale ? *a.kv.v_tensor_scale : 1.0f;
  const float qk_scale = a.softmax_scale * k_tensor * math::kLog2e;
  float qk[2] = {qk_scale, qk_scale};
  if constexpr (kF16Keys<F>) {
    qk[0] *= sm.q_unscale[wg][16 * w + gr];
    qk[1] *= sm.q_unscale[wg][16 * w + gr + 8];
  }

  RowState st;
  for (int pass = 0;; ++pass) {  // bf16: the optimistic pass, then the checked one if needed
    const bool checked = !kOptimisticPass<F> || pass > 0;
    const int j0 = 2 * pages * pass;  // the ring's items of earlier passes
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int j = 0; j < 8; ++j) st.o[half][j][0] = st.o[half][j][1] = st.o[half][j][2] = st.o[half][j][3] = 0.0f;
    st.m[0] = st.m[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.0f;
    bool suspect = false;  // an accumulator of a row with P = 0 on some of a page's keys turned non-finite

    for (int u = 0; u < pages; ++u) {
      const uint32_t selected = sm.pages.page_rows[u];
      const bool computes = (selected & wg_rows) != 0;  // warpgroup-uniform
      const bool mine = (selected >> row) & 1u;         // warp-uniform
      const int limit = mine ? visible_keys(pos, sm.pages.page_logical[u]) : 0;

      // S = Q K^T for the warpgroup's 64 rows.
      const int jk = j0 + 2 * u, sk = jk % S;
      mbar_wait(smem_addr(&sm.ready[sk]), (jk / S) & 1);
      float s[16][4];
      if (computes) {
        const uint32_t k_side = slots + uint32_t(sk * kSideBytes);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk)
          wgmma_m64n128k16<kF16Keys<F>>(s, tile_desc(q_tile, 64, 0, kk), tile_desc(k_side, kPageSize, 0, kk), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
      }

      // P (its V scales are the V side's: wait for it first when there are some).
      const int jv = jk + 1, sv = jv % S;
      if constexpr (PerToken) mbar_wait(smem_addr(&sm.ready[sv]), (jv / S) & 1);
      uint32_t p[8][4];
      if (computes) {
        if (mine) {
          const float* k_scale = PerToken ? sm.token_scale[sk] : nullptr;
          const float* v_scale = PerToken ? sm.token_scale[sv] : nullptr;
          // A wholly visible page (all of a request's pages but its last): the step compiled
          // for 128 keys, without the key masks.
          if (limit >= kPageSize)
            softmax_step<kF16V>(st, s, p, std::integral_constant<int, kPageSize>{}, qk, k_scale, v_scale, quad);
          else
            softmax_step<kF16V>(st, s, p, limit, qk, k_scale, v_scale, quad);
        } else {
#pragma unroll
          for (int c = 0; c < 8; ++c) p[c][0] = p[c][1] = p[c][2] = p[c][3] = 0u;
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&sm.empty[sk]));

      // O += P V.
      if constexpr (!PerToken) mbar_wait(smem_addr(&sm.ready[sv]), (jv / S) & 1);
      if (computes) {
        const uint32_t v_side = slots + uint32_t(sv * kSideBytes);
        bool flagged = false;
#pragma unroll
        for (int i = 0; i < Shape::kScanWarps; ++i) flagged |= sm.nonfinite[sv][i] != 0;
        if (!flagged) {
          wgmma_fence();
#pragma unroll
          for (int c = 0; c < kPageSize / 16; ++c)
#pragma unroll
            for (int half = 0; half < 2; ++half)
              wgmma_m64n64k16_rs_mn<kF16V>(st.o[half], p[c], tile_desc_mn(v_side, kPageSize, half, c));
          wgmma_commit();
          wgmma_wait<0>();
        } else if (mine) {
          pv_masked<kF16V>(st, p, v_side, limit, lane);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&sm.empty[sv]));
      // Unchecked V: this row multiplied P = 0 on keys below the page's `read` (warp-uniform).
      if (!checked && computes && row < nrows && limit < sm.pages.page_tokens[u]) suspect |= !accumulators_finite(st);
    }
    if (checked) break;
    // Every consumer warp votes through `verdict` (lane 0 writes and arrives: the release
    // covers its own store); producers and consumers read the verdict after its phase.
    const bool warp_suspect = __any_sync(0xffffffffu, suspect);
    if (lane == 0) {
      if (warp_suspect) sm.checked_pass = 1;
      mbar_arrive(smem_addr(&sm.verdict));
    }
    mbar_wait(smem_addr(&sm.verdict), 0);
    if (!*static_cast<volatile int32_t*>(&sm.checked_pass)) break;
  }

  // 4. The row's state per head, then its outputs (normalised) and LSE, or its partial.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (row >= nrows) break;
    const int head = gr + 8 * h;
    const SoftmaxState state{st.m[h], warp_sum4(st.l[h])};
    const float inv = state.inverse_sum() * v_tensor;
    const int64_t rh = (r0 + row) * a.hq + g * kGroupSize + head;
    if (quad == 0) {
      if (a.splits == 1) a.lse[rh] = state.lse();
      else a.part_lse[int64_t(split) * a.total_q * a.hq + rh] = state.lse();
    }
    const OutputRow dst_row = output_row(a, rh, split);
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int d = 64 * half + 8 * j + 2 * quad;
        const float x0 = st.o[half][j][2 * h] * inv, x1 = st.o[half][j][2 * h + 1] * inv;
        if (dst_row.f32) *reinterpret_cast<float2*>(dst_row.f32 + d) = make_float2(x0, x1);
        else *reinterpret_cast<uint32_t*>(dst_row.bf16 + d) = pack_bf16(x0, x1);
      }
  }
  if (a.splits > 1) merge_if_last(a, sm, r0, nrows, g, 32 * (4 * wg + w) + lane);
}

// Consumer warpgroup wg's query tile (thread wt of its 128): M-row m = 16 (row in the
// warpgroup) + head, rows past the tile's zeros; cp.async, committed, not waited for.
__device__ __forceinline__ void load_query_tile(const AttnArgs& a, uint32_t q_tile, int64_t r0, int nrows, int g, int wg,
                                                int wt) {
  for (int i = wt; i < 64 * (kHeadDim * 2 / 16); i += 128) {
    const int m = i >> 4, c = i & 15;
    const int row = kRowsPerWarpgroup * wg + m / kGroupSize, h = m % kGroupSize;
    const bool ok = row < nrows;
    const __nv_bfloat16* src = a.q + (ok ? (r0 + row) * a.q_s0 + int64_t(g * kGroupSize + h) * a.q_s1 + c * 8 : 0);
    cp_async16(q_tile + tile_offset(64, m, c), src, ok ? 16 : 0);
  }
  cp_async_commit();
}

// FP8: the query tile in place from bf16 to f16, each M-row (a row's head) scaled by
// f16_query_scale of its largest finite |q|; `unscale`: the warpgroup's 64 inverses. Warp w takes
// its 16 M-rows, two lanes a row, 8 chunks each. inf / NaN stay as they are (they decide the
// logits either way), and do not set the scale: the finite values of their row do not overflow.
__device__ __forceinline__ void scale_query_tile(uint32_t q_tile, float* unscale, int w, int lane) {
  const int m = 16 * w + lane / 2, c0 = 8 * (lane % 2);
  float v[8][8];
  float mx = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const uint4 raw = ld_shared_v4(q_tile + tile_offset(64, m, c0 + c));
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      v[c][2 * e] = __uint_as_float(words[e] << 16);
      v[c][2 * e + 1] = __uint_as_float(words[e] & 0xffff0000u);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (fabsf(v[c][i]) < INFINITY) mx = fmaxf(mx, fabsf(v[c][i]));
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  const float scale = f16_query_scale(mx);
  if (lane % 2 == 0) unscale[m] = 1.0f / scale;
#pragma unroll
  for (int c = 0; c < 8; ++c)
    st_shared_v4(q_tile + tile_offset(64, m, c0 + c), pack_f16(v[c][0] * scale, v[c][1] * scale),
                 pack_f16(v[c][2] * scale, v[c][3] * scale), pack_f16(v[c][4] * scale, v[c][5] * scale),
                 pack_f16(v[c][6] * scale, v[c][7] * scale));
}

template <int Consumers, KvFormat F, bool PerToken>
__global__ void __launch_bounds__(DecodeShape<Consumers, F>::kThreads, 1)
    paged_decode_wgmma_kernel(const AttnArgs a, const __grid_constant__ CUtensorMap k_map,
                              const __grid_constant__ CUtensorMap v_map) {
  using Shape = DecodeShape<Consumers, F>;
  using Storage = DecodeStorage<Consumers, F>;
  extern __shared__ uint8_t smem_raw[];
  Storage& sm = shared_storage<Storage>(smem_raw);
  const uint32_t base = smem_addr(&sm);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const auto [r0, nrows, g, split] = decode_tile(a);

  // 1. Barriers, row positions, the split's distinct pages.
  if (tid == 0) {
    for (int i = 0; i < Shape::kSlots; ++i) {
      mbar_init(smem_addr(&sm.full[i]), 1);
      mbar_init(smem_addr(&sm.ready[i]), Shape::kScanThreads);
      mbar_init(smem_addr(&sm.empty[i]), Shape::kConsumerWarps);
    }
    for (int i = 0; i < Shape::kRawSlots; ++i) {
      mbar_init(smem_addr(&sm.raw_full[i]), 1);
      mbar_init(smem_addr(&sm.raw_free[i]), Shape::kScanThreads);
    }
    mbar_init(smem_addr(&sm.verdict), Shape::kConsumerWarps);
    sm.checked_pass = 0;
  }
  if (tid < kMaxTileRows) sm.row_position[tid] = tid < nrows ? a.positions[r0 + tid] : kNoRow;
  preload_page_table(a, sm.table, r0, nrows);
  griddep_wait();  // the selection (the previous kernel when it is the indexer's) and the inputs
  // The consumers' query tiles are requested first: behind the pages' TMA burst they would
  // wait for it (microseconds at small batches).
  const int wg = warp / 4, wt = tid % 128;
  const uint32_t q_tile = base + uint32_t(offsetof(Storage, q)) + uint32_t(wg * sizeof(QueryTile));
  if (warp < Shape::kConsumerWarps) load_query_tile(a, q_tile, r0, nrows, g, wg, wt);
  const int pages = collect_pages(a, sm.pages, r0, nrows, g, split, PageOrder::by_row, &sm.table);
  __syncthreads();  // the page list
  const int items = 2 * pages;

  if (warp >= Shape::kConsumerWarps) {  // 2. the producer warpgroups, one or two passes
    if constexpr (Shape::kRebalance) setmaxnreg_dec<Shape::kProducerRegs>();
    const int pt = tid - 32 * Shape::kConsumerWarps;
    for (int pass = 0;; ++pass) {
      const bool checked = !kOptimisticPass<F> || pass > 0;
      if (pt == 0) issue_sides(sm, base, &k_map, &v_map, g, items, pass * items);
      else if (pt >= 32) scan_sides<Consumers, F, PerToken>(a, sm, base, g, items, pass * items, checked, pt - 32);
      if (checked) break;
      mbar_wait(smem_addr(&sm.verdict), 0);
      if (!*static_cast<volatile int32_t*>(&sm.checked_pass)) break;
    }
    return;
  }
  if constexpr (Shape::kRebalance) setmaxnreg_inc<Shape::kConsumerRegs>();

  // 3. The consumer warpgroup's query tile landed, then its pages.
  cp_async_wait<0>();
  if constexpr (kF16Keys<F>) {  // every thread's copies, then each warp rewrites its rows
    sync_barrier(wg == 0 ? DecodeBarrier::kWarpgroup0 : DecodeBarrier::kWarpgroup1, 128);
    scale_query_tile(q_tile, sm.q_unscale[wg], warp % 4, lane);
  }
  fence_proxy_async();
  sync_barrier(wg == 0 ? DecodeBarrier::kWarpgroup0 : DecodeBarrier::kWarpgroup1, 128);
  consume_pages<Consumers, F, PerToken>(a, sm, base + uint32_t(offsetof(Storage, slot)), q_tile, pages, r0, nrows, g,
                                        split, wg, warp % 4, lane);
}

template <int Consumers, KvFormat F, bool PerToken>
void configure() {
  static std::once_flag once;
  std::call_once(once, [] {
    MSA_CUDA_CHECK(cudaFuncSetAttribute(paged_decode_wgmma_kernel<Consumers, F, PerToken>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, storage_bytes<Consumers, F>()));
  });
}

template <int Consumers, KvFormat F, bool PerToken>
void launch(const AttnArgs& a, const CUtensorMap& k_map, const CUtensorMap& v_map, dim3 grid, cudaStream_t stream) {
  configure<Consumers, F, PerToken>();
  // Programmatic: its CTAs may start (barriers, row positions) while the selection finishes.
  launch_programmatic("paged_decode_wgmma_kernel launch", paged_decode_wgmma_kernel<Consumers, F, PerToken>, grid,
                      dim3(DecodeShape<Consumers, F>::kThreads), size_t(storage_bytes<Consumers, F>()), stream, a, k_map,
                      v_map);
}

template <int Consumers, KvFormat F, bool PerToken>
int ctas_per_sm() {
  configure<Consumers, F, PerToken>();
  int n = 0;
  MSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, paged_decode_wgmma_kernel<Consumers, F, PerToken>,
                                                               DecodeShape<Consumers, F>::kThreads,
                                                               storage_bytes<Consumers, F>()));
  return n;
}

}  // namespace

void launch_wgmma(KvFormat f, const AttnArgs& a, const CUtensorMap& k_map, const CUtensorMap& v_map, dim3 grid,
                  cudaStream_t stream) {
  const bool one = a.rows_per_tile <= kRowsPerWarpgroup;
  detail::require(f != KvFormat::nvfp4, "paged_decode_wgmma_kernel: NVFP4 caches run on the row-warp kernel (paged_decode_rows.cu)");
  // FP8 tiles of up to 4 rows run on the row-warp kernel (paged_attention.cu's dispatch), so
  // FP8 has no one-warpgroup instance.
  detail::require(f == KvFormat::bf16 || !one,
                  "paged_decode_wgmma_kernel: FP8 tiles of up to 4 rows run on the row-warp kernel (paged_decode_rows.cu)");
  // Per-token scales (FP8 only: bf16 caches have no scales) are a separate instance, so that
  // the others carry no scale code.
  if (f == KvFormat::bf16)
    one ? launch<1, KvFormat::bf16, false>(a, k_map, v_map, grid, stream)
        : launch<2, KvFormat::bf16, false>(a, k_map, v_map, grid, stream);
  else if (a.kv.k_token_scale)
    launch<2, KvFormat::fp8_e4m3, true>(a, k_map, v_map, grid, stream);
  else
    launch<2, KvFormat::fp8_e4m3, false>(a, k_map, v_map, grid, stream);
}

int wgmma_ctas_per_sm(int rows_per_tile) {
  return rows_per_tile <= kRowsPerWarpgroup
             ? ctas_per_sm<1, KvFormat::bf16, false>()
             : std::min({ctas_per_sm<2, KvFormat::bf16, false>(), ctas_per_sm<2, KvFormat::fp8_e4m3, false>(),
                         ctas_per_sm<2, KvFormat::fp8_e4m3, true>()});
}

}  // namespace msa::cuda::decode
