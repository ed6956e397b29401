// Indexer: causal index scores on tensor cores, max-pooled per 128-key block, with a running
// top list per (query, index head) kept in registers while the key blocks stream past; no
// [T, blocks] score buffer exists.
//
// A CTA owns a tile of 192 (query, head) vectors: 192 / Hi consecutive queries of one
// document x Hi index heads (a key block crosses from L2 once per tile); consumer warp w
// holds 16 consecutive queries of head w % Hi as the rows of its m16 MMA tiles (its
// warpgroup's 64 rows are one wgmma; three consumer warpgroups). One thread of a
// producer warpgroup brings the document's key blocks by TMA into a ring of kStages stages;
// each consumer warpgroup multiplies a block as soon as it has landed and its warps hand the
// stage back through an `empty` mbarrier once S is in registers: no CTA-wide barrier in the
// block loop, so one warpgroup's list updates overlap the others' products and the loads run
// ahead. A warpgroup issues the next block's product as soon as it has read S out (maxima,
// and the scores of rows that need the block's LSE), so its own list updates overlap it too.
// In every quad of lanes, lane 0 owns the list of row g and lane 1 the list of row g + 8.
//
// Selection (as the CPU backend): with nvis <= 16 visible blocks all of them ascending;
// else the init blocks ascending, the best slots = 16 - init - local blocks of the rest by
// (score desc, id asc), then the local blocks ascending (the query's own block last). A
// block whose visible scores hold a NaN scores NaN and is never ranked.
#include <algorithm>
#include <numeric>

#include "attention_state.h"
#include "backend.h"
#include "msa/constants.h"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/named_barriers.cuh"
#include "cuda/tensor_map.h"
#include "cuda/wgmma.cuh"

namespace msa::cuda {
namespace {

constexpr int kBlock = model::kBlockSize;  // keys of a block: rows of a key tile
constexpr int kDim = model::kHeadDim;      // index head dim: columns of the query and key tiles
constexpr int kTopk = model::kTopk;
constexpr int kTileVectors = 192;  // (query, index head) vectors of a CTA: three m64 warpgroup tiles
constexpr int kWarpRows = 16;      // rows of a warp's m16 MMA tiles (consecutive queries of one head)
constexpr int kNFrags = kBlock / 8;  // n8 accumulator fragments across a key block
constexpr int kWarps = kTileVectors / 16;   // consumer warps (16 vectors each)
constexpr int kThreads = (kWarps + 4) * 32;  // and a producer warpgroup (one thread issues)
// setmaxnreg: the producers give their registers to the consumers (the launch's share,
// 65536 / 512 in steps of 8, is the CTA's pool; the consumers need more than it). Three
// consumer warpgroups at 160 registers keep S, the lists and the selected-LSE path without
// spills; four at 112 spilled 30 bytes (340 with the LSE) and were slower with the LSE
// (docs/performance.md run 30).
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 160;
static_assert(kProducerRegs * 128 + kConsumerRegs * 32 * kWarps <= 65536 / kThreads / 8 * 8 * kThreads);
constexpr int kStages = 4;                   // key blocks in flight
constexpr int kTileBytes = kBlock * kDim * 2;  // a bf16 key tile
static_assert(kWarps * kWarpRows == kTileVectors, "16 rows a warp");

// Shared memory: the key ring and the query tile (swizzled, device.cuh's tile layout);
//   full[s]   the TMA bytes of stage s have landed (1 arrival + bytes)
//   empty[s]  every consumer warp is done with stage s (kWarps arrivals)
// and, with the selected LSE (kLse), each consumer warp's rows that need a block's LSE.
struct alignas(1024) KeyTile {
  unsigned char bytes[kTileBytes];
};
constexpr int kLseSlots = 4;  // rows of a warp whose block LSEs are gathered, at most
struct LseRounds {
  float score[kLseSlots][kBlock];  // a row's masked scores (any order: they are summed)
  float top[kLseSlots];            // its block max, scaled (log2 units)
  float sum[kLseSlots];            // its sum of 2^(score - top)
};
template <bool kLse>
struct IndexerStorage {
  KeyTile keys[kStages];
  struct alignas(1024) {
    unsigned char bytes[kTileVectors * kDim * 2];
  } query;
  uint64_t full[kStages];
  uint64_t empty[kStages];
  LseRounds lse[kLse ? kWarps : 1];
};
template <bool kLse>
constexpr int kSmemBytes = storage_smem_bytes<IndexerStorage<kLse>>();
constexpr int kMaxDocs = 320;  // documents per launch (kernel parameter space)
constexpr int kList = kTopk - 1;  // ranked history slots at most (local >= 1)

struct IndexerDocs {
  int32_t tile_begin[kMaxDocs + 1];  // prefix of tiles per document (launch-local)
  int32_t q_start[kMaxDocs], q_len[kMaxDocs], k_start[kMaxDocs], k_len[kMaxDocs];
  int32_t count;
};

struct IndexerArgs {
  const __nv_bfloat16* iq;  // [Tq, Hi, 128]
  const __nv_bfloat16* ik;  // [Tk, 1, 128]
  int32_t* topk;            // [Hi, Tq, 16 = kTopk]
  float* sel_lse;           // [Hi, Tq] or null
  int64_t total_q;
  int Hi;
  int tile_queries;  // kTileVectors / Hi
  int init_blocks, local_blocks;
  float scale;           // index score = scale * <qi, ki>
  float lse_scale_log2;  // scale / temperature * log2(e)
};

// Block sums of 2^(score * c - top) over the visible keys (the first `visible` of the block)
// of the rows that need a block LSE. The row's maximum term is 2^0 = 1, so terms that
// fast_exp2 flushes to zero (below 2^-126) would not change the sum.
//
// quad_sum_exp: this lane's share of row a (E = 0) or b (E = 2) of its quad, where `on`.
template <int E, bool kWhole>
__device__ __forceinline__ float quad_sum_exp(const float (&s)[kNFrags][4], bool on, int visible, float top, float c,
                                              int t) {
  float sum = 0.f;
  if (on) {
#pragma unroll
    for (int nt = 0; nt < kNFrags; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (kWhole || nt * 8 + 2 * t + e < visible) sum += fast_exp2(s[nt][E + e] * c - top);
  }
  return sum;
}

// One row's 32 scores of this lane (E = 0: row a, 2: row b) into its slot, keys at or past
// `visible` as -inf.
template <int E>
__device__ __forceinline__ void store_gathered_row(LseRounds& r, int slot, const float (&s)[kNFrags][4], int visible,
                                                   int t) {
  float4* dst = reinterpret_cast<float4*>(&r.score[slot][32 * t]);
#pragma unroll
  for (int nt = 0; nt < kNFrags; nt += 2) {
    const int c0 = nt * 8 + 2 * t;
    dst[nt / 2] = make_float4(c0 < visible ? s[nt][E] : -INFINITY, c0 + 1 < visible ? s[nt][E + 1] : -INFINITY,
                              c0 + 8 < visible ? s[nt + 1][E] : -INFINITY,
                              c0 + 9 < visible ? s[nt + 1][E + 1] : -INFINITY);
  }
}
// gather_rows + sum_gathered_rows: the <= kLseSlots rows of `wanted` (bit 4q: row a of quad q,
// bit 4q + 1: its row b; lanes 4q, 4q + 1 own them and get the sum; `top` is the owner's block
// max times c): each row's quad stores its 4 x 32 scores (keys at or past `visible_a` /
// `visible_b` as -inf) into a slot, which frees S for the next block's product; then 8 lanes
// sum a row. The summation order is not quad_sum_exp's; the LSE's tolerance allows it.
__device__ __forceinline__ void gather_rows(LseRounds& r, uint32_t wanted, const float (&s)[kNFrags][4], int visible_a,
                                            int visible_b, float top, int lane) {
  const int t = lane & 3, bit_a = lane & ~3, bit_b = bit_a + 1;
  const int slot_a = (wanted >> bit_a) & 1 ? __popc(wanted & ((1u << bit_a) - 1)) : -1;
  const int slot_b = (wanted >> bit_b) & 1 ? __popc(wanted & ((1u << bit_b) - 1)) : -1;
  if (slot_a >= 0) {
    store_gathered_row<0>(r, slot_a, s, visible_a, t);
    if (t == 0) r.top[slot_a] = top;
  }
  if (slot_b >= 0) {
    store_gathered_row<2>(r, slot_b, s, visible_b, t);
    if (t == 1) r.top[slot_b] = top;
  }
}
__device__ __forceinline__ float sum_gathered_rows(LseRounds& r, uint32_t wanted, float c, int lane) {
  const int t = lane & 3, bit_a = lane & ~3, bit_b = bit_a + 1;
  const int slot_a = (wanted >> bit_a) & 1 ? __popc(wanted & ((1u << bit_a) - 1)) : -1;
  const int slot_b = (wanted >> bit_b) & 1 ? __popc(wanted & ((1u << bit_b) - 1)) : -1;
  __syncwarp();
  const int row = lane >> 3;
  float sum = 0.f;
  if (row < __popc(wanted)) {
    const float4* src = reinterpret_cast<const float4*>(&r.score[row][16 * (lane & 7)]);
    const float m = r.top[row];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = src[i];
      sum += fast_exp2(v.x * c - m) + fast_exp2(v.y * c - m) + fast_exp2(v.z * c - m) + fast_exp2(v.w * c - m);
    }
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  sum += __shfl_xor_sync(0xffffffffu, sum, 4);
  if ((lane & 7) == 0 && row < __popc(wanted)) r.sum[row] = sum;
  __syncwarp();
  float mine = 0.f;
  if (slot_a >= 0 && t == 0) mine = r.sum[slot_a];
  if (slot_b >= 0 && t == 1) mine = r.sum[slot_b];
  __syncwarp();  // the next block's rows overwrite the slots
  return mine;
}

// kLse: also the selected blocks' LSE (a.sel_lse); without it the lists hold no per-block LSE.
template <bool kLse>
__global__ void __launch_bounds__(kThreads, 1)
    select_blocks_kernel(const IndexerArgs a, const IndexerDocs docs, const __grid_constant__ CUtensorMap k_map) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3;
  // Tile -> document (binary search over the launch's prefix), longest tiles of a document first.
  const int tile_id = blockIdx.x;
  int lo = 0, hi = docs.count;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (docs.tile_begin[mid] <= tile_id) lo = mid; else hi = mid - 1;
  }
  const int di = lo;
  const int ntiles = docs.tile_begin[di + 1] - docs.tile_begin[di];
  const int tile = ntiles - 1 - (tile_id - docs.tile_begin[di]);
  const int q_start = docs.q_start[di], q_len = docs.q_len[di], k_start = docs.k_start[di], k_len = docs.k_len[di];
  const int q0 = tile * a.tile_queries;
  const int nq = min(a.tile_queries, q_len - q0);
  const int pos0 = k_len - q_len + q0;
  const int nblocks = (pos0 + nq - 1) / kBlock + 1;

  const int g = warp % a.Hi;
  const int wq0 = kWarpRows * (warp / a.Hi);
  const int wrows = max(0, min(kWarpRows, nq - wq0));
  // Blocks the warpgroup computes (wgmma is collective): up to its last query's local block.
  const int wg_first = kWarpRows * ((warp & ~3) / a.Hi);
  const int wg_last = min(nq, kWarpRows * ((warp | 3) / a.Hi) + kWarpRows) - 1;
  // (Broadcast from lane 0: the compiler then knows it is warp-uniform, and keeps the wgmma
  // in flight across the loop's branches on it.)
  const int wg_nblk = __shfl_sync(0xffffffffu, wg_first < nq ? (pos0 + wg_last) / kBlock + 1 : 0, 0);

  IndexerStorage<kLse>& sm = shared_storage<IndexerStorage<kLse>>(smem);
  const uint32_t keys = smem_addr(&sm.keys[0]), qs = smem_addr(&sm.query);
  auto full = [&](int s) { return smem_addr(&sm.full[s]); };
  auto empty = [&](int s) { return smem_addr(&sm.empty[s]); };
  if (tid < kStages) {
    mbar_init(full(tid), 1);
    mbar_init(empty(tid), kWarps);
  }
  __syncthreads();

  if (warp >= kWarps) {  // the producer: block j into stage j % kStages once its last use is over
    setmaxnreg_dec<kProducerRegs>();
    if (warp == kWarps && lane == 0) {
      // Keys past the document's end (the next document's, or zeros past the tensor's) are
      // past every row's causal limit: masked below like the future keys of a block.
      const uint64_t keep = l2_evict_last();  // the document's other tiles read the blocks again
      for (int j = 0; j < nblocks; ++j) {
        const int s = j % kStages;
        if (j >= kStages) mbar_wait(empty(s), (j / kStages - 1) & 1);
        mbar_arrive_expect_tx(full(s), kTileBytes);
        const uint32_t dst = keys + uint32_t(s * kTileBytes);
        tma_load_2d(dst, &k_map, 0, k_start + j * kBlock, full(s), keep);
        tma_load_2d(dst + kTileBytes / 2, &k_map, kDim / 2, k_start + j * kBlock, full(s), keep);
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  // The warp's 16 query rows; its warpgroup's wgmma reads all 64 of the warpgroup's.
  load_tile_async(qs, kTileVectors, kWarpRows * warp,
                  a.iq + (int64_t(q_start + q0 + min(wq0, nq - 1)) * a.Hi + g) * kDim, int64_t(a.Hi) * kDim,
                  kWarpRows, wrows, lane, 32);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  sync_barrier(SelectBarrier(int(SelectBarrier::kWarpgroup0) + (warp >> 2)), 128);

  // The row this lane owns (lanes 2, 3 of a quad shadow lanes 0, 1).
  const int own_r = wq0 + (lane >> 2) + ((t & 1) << 3);
  const bool own_valid = own_r < nq;
  const int own_pos = pos0 + own_r;
  const int nvis = own_pos / kBlock + 1;
  const bool all_visible = nvis <= kTopk;
  const int local_begin = nvis - a.local_blocks;
  const int init_end = min(a.init_blocks, local_begin);
  const int slots = kTopk - init_end - a.local_blocks;
  constexpr bool want_lse = kLse;

  float sc[kList], bl[kList];
  int id[kList];
#pragma unroll
  for (int i = 0; i < kList; ++i) { sc[i] = -INFINITY; bl[i] = -INFINITY; id[i] = -1; }
  int count = 0;
  float threshold = -INFINITY;  // score of the last ranked entry once the list is full
  LogSumExp lse_acc;  // of the selected blocks' LSEs (the IEEE rules of src/attention_state.h)

  const int pa = pos0 + wq0 + (lane >> 2), pb = pa + 8;
  // S of block j + 1 goes to the tensor cores as soon as block j's scores have been read out of
  // S (its maxima, and the rows that need its LSE gathered into shared memory): the list
  // updates and the gathered exponentials of block j run beside the product of j + 1.
  float s[kNFrags][4];
  auto issue_scores = [&](int jj) {
    mbar_wait(full(jj % kStages), (jj / kStages) & 1);
    const uint32_t k_tile = keys + uint32_t((jj % kStages) * kTileBytes);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_m64n128k16(s, tile_desc(qs, kTileVectors, 64 * (warp >> 2), kk), tile_desc(k_tile, kBlock, 0, kk),
                       kk > 0);
    wgmma_commit();
  };
  if (wg_nblk > 0) issue_scores(0);
  for (int j = 0; j < nblocks; ++j) {
    // Every warp waits for every block (also one its warpgroup skips) before it hands the stage
    // back, so that its arrival counts in the stage's current use.
    const int stage = j % kStages;
    if (j >= wg_nblk) {
      mbar_wait(full(stage), (j / kStages) & 1);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty(stage));
    } else {
      wgmma_wait<0>();
      __syncwarp();
      if (lane == 0) mbar_arrive(empty(stage));  // S is in registers
      const int la = pa - j * kBlock, lb = pb - j * kBlock;  // last visible key of rows a, b
      // Block maxima (NaN-propagating) of rows a, b over their visible keys. A block that the
      // warp's first row already sees whole is seen whole by all 16: no per-key mask there.
      float ma = -INFINITY, mb = -INFINITY;
      const bool whole = pos0 + wq0 >= j * kBlock + kBlock - 1;
      if (whole) {
#pragma unroll
        for (int nt = 0; nt < kNFrags; ++nt) {
          ma = max_nan(ma, max_nan(s[nt][0], s[nt][1]));
          mb = max_nan(mb, max_nan(s[nt][2], s[nt][3]));
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < kNFrags; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = nt * 8 + 2 * t + e;
            if (c <= la) ma = max_nan(ma, s[nt][e]);
            if (c <= lb) mb = max_nan(mb, s[nt][2 + e]);
          }
        }
      }
      ma = max_nan(ma, __shfl_xor_sync(0xffffffffu, ma, 1));
      ma = max_nan(ma, __shfl_xor_sync(0xffffffffu, ma, 2));
      mb = max_nan(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
      mb = max_nan(mb, __shfl_xor_sync(0xffffffffu, mb, 2));

      const float own_m = (t & 1) ? mb : ma;
      const bool visible = own_valid && own_pos >= j * kBlock;
      const float score = a.scale * own_m;
      const bool forced = all_visible || j < init_end || j >= local_begin;
      const bool candidate = visible && !forced && slots > 0 && score == score && (count < slots || score > threshold);
      float block_lse = 0.f;
      if constexpr (!want_lse) {
        if (j + 1 < wg_nblk) issue_scores(j + 1);  // S is free (warpgroup-uniform)
      } else {
        // The block's LSE, only for rows that keep it (forced, or entering the list). A few
        // such rows (<= kLseSlots) are gathered into shared memory and summed by all 32 lanes;
        // more are summed where they are, rows a and b apart (a row needs its quad's lanes).
        const bool need = visible && (forced || candidate);
        const float top = ((t & 1) ? mb : ma) * a.lse_scale_log2;
        const uint32_t wanted = __ballot_sync(0xffffffffu, need && t < 2 && isfinite(top));
        float sum = 0.f;
        const bool gathered = wanted != 0 && __popc(wanted) <= kLseSlots;
        if (gathered) {
          gather_rows(sm.lse[warp], wanted, s, whole ? kBlock : la + 1, whole ? kBlock : lb + 1, top, lane);
        } else if (wanted != 0) {
          const int quad = lane & ~3;
          const float ta = __shfl_sync(0xffffffffu, top, quad), tb = __shfl_sync(0xffffffffu, top, quad + 1);
          const bool fa = (wanted >> quad) & 1, fb = (wanted >> (quad + 1)) & 1;
          float sa = 0.f, sb = 0.f;
          const float c = a.lse_scale_log2;
          if (__any_sync(0xffffffffu, fa))
            sa = warp_sum4(whole ? quad_sum_exp<0, true>(s, fa, kBlock, ta, c, t)
                                 : quad_sum_exp<0, false>(s, fa, la + 1, ta, c, t));
          if (__any_sync(0xffffffffu, fb))
            sb = warp_sum4(whole ? quad_sum_exp<2, true>(s, fb, kBlock, tb, c, t)
                                 : quad_sum_exp<2, false>(s, fb, lb + 1, tb, c, t));
          sum = (t & 1) ? sb : sa;
        }
        if (j + 1 < wg_nblk) issue_scores(j + 1);  // S is free (warpgroup-uniform)
        if (gathered) sum = sum_gathered_rows(sm.lse[warp], wanted, a.lse_scale_log2, lane);
        if (need) block_lse = isfinite(top) ? (top + __log2f(sum)) * math::kLn2 : top * math::kLn2;
      }
      if (visible && forced && want_lse) lse_acc.add(block_lse);
      if (candidate) {
        // Insert behind every entry with a score >= this one (ids arrive ascending).
        int pos = 0;
#pragma unroll
        for (int i = 0; i < kList; ++i) pos += (i < count && sc[i] >= score) ? 1 : 0;
        const int limit = min(count + 1, slots);
#pragma unroll
        for (int i = kList - 1; i > 0; --i) {
          if (i > pos && i < limit) { sc[i] = sc[i - 1]; id[i] = id[i - 1]; bl[i] = bl[i - 1]; }
        }
#pragma unroll
        for (int i = 0; i < kList; ++i) {
          if (i == pos) { sc[i] = score; id[i] = j; bl[i] = block_lse; }
        }
        count = limit;
        if (count == slots) {
#pragma unroll
          for (int i = 0; i < kList; ++i)
            if (i == slots - 1) threshold = sc[i];
        }
      }
    }
  }

  if (t < 2 && own_valid) {
    const int64_t row = q_start + q0 + own_r;
    int out[kTopk];
    if (all_visible) {
#pragma unroll
      for (int s = 0; s < kTopk; ++s) out[s] = s < nvis ? s : -1;
    } else {
      const int n_init = init_end;
#pragma unroll
      for (int s = 0; s < kTopk; ++s) {
        int v = -1;
        if (s < n_init) {
          v = s;
        } else if (s < n_init + count) {
#pragma unroll
          for (int i = 0; i < kList; ++i)
            if (i == s - n_init) v = id[i];
        } else if (s < n_init + count + a.local_blocks) {
          v = local_begin + (s - n_init - count);
        }
        out[s] = v;
      }
    }
    int4* dst = reinterpret_cast<int4*>(a.topk + (int64_t(g) * a.total_q + row) * kTopk);
#pragma unroll
    for (int i = 0; i < kTopk / 4; ++i) dst[i] = make_int4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
    if (want_lse) {
#pragma unroll
      for (int i = 0; i < kList; ++i)
        if (i < count) lse_acc.add(bl[i]);
      a.sel_lse[int64_t(g) * a.total_q + row] = lse_acc.result();
    }
  }
}

}  // namespace

void select_blocks(const Topology& topo, const PackedLayout& L, const SelectBlocksParams& p, const RunOptions& opt) {
  DeviceGuard guard(p.index_q.device.index);
  const cudaStream_t s = as_stream(opt);
  IndexerArgs a{};
  a.iq = p.index_q.as<const __nv_bfloat16>();
  a.ik = p.index_k.as<const __nv_bfloat16>();
  a.topk = p.topk.as<int32_t>();
  a.sel_lse = p.selected_lse.present() ? p.selected_lse.as<float>() : nullptr;
  a.total_q = L.total_q();
  a.Hi = topo.num_index_heads;
  a.tile_queries = kTileVectors / a.Hi;
  a.init_blocks = topo.init_blocks;
  a.local_blocks = topo.local_blocks;
  a.scale = topo.indexer_scale();
  a.lse_scale_log2 = topo.indexer_scale() / p.lse_temperature * math::kLog2e;

  // Longest documents first, so the heaviest tiles start early.
  std::vector<int> order(size_t(L.num_documents()));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return L.document(x).k_len > L.document(y).k_len; });
  const bool lse = a.sel_lse != nullptr;
  const auto kernel = lse ? select_blocks_kernel<true> : select_blocks_kernel<false>;
  const int smem_bytes = lse ? kSmemBytes<true> : kSmemBytes<false>;
  MSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  // A launch has queries, hence keys: the map is needed (and valid) only when index_k has rows.
  const CUtensorMap k_map =
      p.index_k.shape[0] > 0 ? bf16_row_tile_map(a.ik, p.index_k.shape[0], kBlock, "index_k") : CUtensorMap{};
  IndexerDocs docs{};
  auto flush = [&] {
    if (docs.count == 0) return;
    const int tiles = docs.tile_begin[docs.count];
    if (tiles > 0) {
      kernel<<<tiles, kThreads, smem_bytes, s>>>(a, docs, k_map);
      MSA_CUDA_CHECK_LAUNCH("select_blocks_kernel");
    }
    docs = IndexerDocs{};
  };
  for (int b : order) {
    const DocumentSpan& d = L.document(b);
    if (d.q_len == 0) continue;
    const int64_t tiles = ceil_div(d.q_len, a.tile_queries);
    if (docs.count == kMaxDocs || int64_t(docs.tile_begin[docs.count]) + tiles > (int64_t(1) << 30)) flush();
    const int i = docs.count++;
    docs.q_start[i] = int32_t(d.q_start);
    docs.q_len[i] = int32_t(d.q_len);
    docs.k_start[i] = int32_t(d.k_start);
    docs.k_len[i] = int32_t(d.k_len);
    docs.tile_begin[i + 1] = docs.tile_begin[i] + int32_t(tiles);
  }
  flush();
}

}  // namespace msa::cuda
