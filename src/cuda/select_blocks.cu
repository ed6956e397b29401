// Indexer: causal index scores on tensor cores, max-pooled per 128-key block, with a running
// top list per (query, index head) kept in registers while the key blocks stream past; no
// [T, blocks] score buffer exists.
//
// A CTA owns a tile of 256 (query, head) vectors: 256 / Hi consecutive queries of one
// document x Hi index heads (a key block crosses from L2 once per tile); consumer warp w
// holds 16 consecutive queries of head w % Hi as the rows of its m16 MMA tiles (its
// warpgroup's 64 rows are one wgmma; four consumer warpgroups). One thread of a
// producer warpgroup brings the document's key blocks by TMA into a ring of kStages stages;
// each consumer warpgroup multiplies a block as soon as it has landed and its warps hand the
// stage back through an `empty` mbarrier once S is in registers: no CTA-wide barrier in the
// block loop, so one warpgroup's list updates overlap the others' products and the loads run
// ahead. A warpgroup issues the next block's product as soon as it has read S out (its block
// maxima), so its own list updates overlap it too. The selected LSE is computed afterwards
// from the selection (selected_lse.cu): inside the loop it would be spent on every block that
// enters a list, ~5x the blocks finally kept at 128k.
// In every quad of lanes, lane 0 owns the list of row g and lane 1 the list of row g + 8.
//
// Inputs: bf16, or E4M3 codes on both sides, multiplied by FP8 wgmma (k32 steps, key tiles of
// 128-byte rows: half the bytes and twice the tensor rate of bf16). The E4M3 products are exact
// but the tensor core adds them in a narrower sum than fp32, so the FP8 kernel's scores can
// differ from the exact ones in their last bits: its selection equals the exact one except at
// near-ties (docs/semantics.md §3.1, §10). With only one side in E4M3 that side is widened
// to a bf16 copy first (exact) and the bf16 kernel runs.
// Selection (as the CPU backend): with nvis <= 16 visible blocks all of them ascending;
// else the init blocks ascending, the best slots = 16 - init - local blocks of the rest by
// (score desc, id asc), then the local blocks ascending (the query's own block last). A
// block whose visible scores hold a NaN scores NaN and is never ranked.
#include <algorithm>
#include <numeric>

#include "backend.h"
#include "msa/constants.h"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/inference/quant.cuh"  // e4m3_to_f32
#include "cuda/named_barriers.cuh"
#include "cuda/selected_lse.h"
#include "cuda/tensor_map.h"
#include "cuda/wgmma.cuh"

namespace msa::cuda {
namespace {

constexpr int kBlock = model::kBlockSize;  // keys of a block: rows of a key tile
constexpr int kDim = model::kHeadDim;      // index head dim: columns of the query and key tiles
constexpr int kTopk = model::kTopk;
constexpr int kTileVectors = 256;  // (query, index head) vectors of a CTA: four m64 warpgroup tiles
constexpr int kWarpRows = 16;      // rows of a warp's m16 MMA tiles (consecutive queries of one head)
constexpr int kNFrags = kBlock / 8;  // n8 accumulator fragments across a key block
constexpr int kWarps = kTileVectors / 16;   // consumer warps (16 vectors each)
constexpr int kThreads = (kWarps + 4) * 32;  // and a producer warpgroup (one thread issues)
// setmaxnreg: the producers give their registers to the consumers (the launch's share,
// 65536 / 640 in steps of 8, is the CTA's pool; the consumers need more than it). Four
// consumer warpgroups at 112 registers spill 20 bytes (the list) and beat three at 160 without
// spills from 16k tokens on (128k: 13.4 against 14.6 ms; 4k: 0.082 against 0.068 ms;
// docs/performance.md run 31).
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 112;
static_assert(kProducerRegs * 128 + kConsumerRegs * 32 * kWarps <= 65536 / kThreads / 8 * 8 * kThreads);
constexpr int kStages = 4;                   // key blocks in flight
static_assert(kWarps * kWarpRows == kTileVectors, "16 rows a warp");

// Shared memory of the kernel on inputs of type In: the key ring and the query tile
// (swizzled, device.cuh's tile layout; 8-bit rows fill the first column half only);
//   full[s]   the TMA bytes of stage s have landed (1 arrival + bytes)
//   empty[s]  every consumer warp is done with stage s (kWarps arrivals)
template <typename In>
struct IndexerStorage {
  static constexpr int kRowBytes = kDim * int(sizeof(In));
  static constexpr int kKeyTileBytes = kBlock * kRowBytes;
  struct alignas(1024) KeyTile {
    unsigned char bytes[kKeyTileBytes];
  };
  KeyTile keys[kStages];
  struct alignas(1024) {
    unsigned char bytes[kTileVectors * kRowBytes];
  } query;
  uint64_t full[kStages];
  uint64_t empty[kStages];
};
constexpr int kMaxDocs = 320;  // documents per launch (kernel parameter space)
constexpr int kList = kTopk - 1;  // ranked history slots at most (local >= 1)

struct IndexerDocs {
  int32_t tile_begin[kMaxDocs + 1];  // prefix of tiles per document (launch-local)
  int32_t q_start[kMaxDocs], q_len[kMaxDocs], k_start[kMaxDocs], k_len[kMaxDocs];
  int32_t count;
};

struct IndexerArgs {
  const void* iq;  // [Tq, Hi, 128] bf16 or E4M3 (the kernel's In)
  const void* ik;  // [Tk, 1, 128] the same type
  int32_t* topk;            // [Hi, Tq, 16 = kTopk]
  int64_t total_q;
  int Hi;
  int tile_queries;  // kTileVectors / Hi
  int init_blocks, local_blocks;
  float scale;  // index score = scale * <qi, ki>
};

template <typename In>
__global__ void __launch_bounds__(kThreads, 1)
    select_blocks_kernel(const IndexerArgs a, const IndexerDocs docs, const __grid_constant__ CUtensorMap k_map) {
  using Storage = IndexerStorage<In>;
  constexpr int kTileBytes = Storage::kKeyTileBytes;
  constexpr bool kFp8 = sizeof(In) == 1;
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

  Storage& sm = shared_storage<Storage>(smem);
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
        if constexpr (!kFp8) tma_load_2d(dst + kTileBytes / 2, &k_map, kDim / 2, k_start + j * kBlock, full(s), keep);
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  // The warp's 16 query rows; its warpgroup's wgmma reads all 64 of the warpgroup's.
  load_tile_async(qs, kTileVectors, kWarpRows * warp,
                  static_cast<const In*>(a.iq) + (int64_t(q_start + q0 + min(wq0, nq - 1)) * a.Hi + g) * kDim, int64_t(a.Hi) * kDim,
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

  // The ranked list, best first; an empty slot scores NaN (no score is >= it, see below).
  float sc[kList];
  int id[kList];
#pragma unroll
  for (int i = 0; i < kList; ++i) { sc[i] = __int_as_float(0x7fffffff); id[i] = -1; }
  int count = 0;
  float threshold = -INFINITY;  // score of the last ranked entry once the list is full

  const int pa = pos0 + wq0 + (lane >> 2), pb = pa + 8;
  // S of block j + 1 goes to the tensor cores as soon as block j's maxima have been read out of
  // S: the list updates of block j run beside the product of j + 1.
  float s[kNFrags][4];
  // Descriptors built once; a block's differ from these by constants (tile_desc_step).
  const uint64_t q_desc = tile_desc(qs, kTileVectors, 64 * (warp >> 2), 0);
  const uint64_t k_desc = tile_desc(keys, kBlock, 0, 0);
  auto issue_scores = [&](int jj) {
    mbar_wait(full(jj % kStages), (jj / kStages) & 1);
    const uint64_t k_stage = k_desc + uint64_t(((jj % kStages) * kTileBytes) >> 4);
    wgmma_fence();
    if constexpr (kFp8) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_m64n128k32_e4m3(s, q_desc + tile_desc_step(kTileVectors, kk), k_stage + tile_desc_step(kBlock, kk),
                              kk > 0);
    } else {
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        wgmma_m64n128k16(s, q_desc + tile_desc_step(kTileVectors, kk), k_stage + tile_desc_step(kBlock, kk), kk > 0);
    }
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
      if (j + 1 < wg_nblk) issue_scores(j + 1);  // S is free (warpgroup-uniform)
      if (candidate) {
        // Insert behind every entry with a score >= this one (ids arrive ascending, so ties
        // keep the lower id first): the slots failing `sc >= score` are a suffix (the list is
        // sorted, empty slots are NaN), and along it the new entry and then each displaced one
        // moves one slot down. Five instructions a slot, with no slot index to compare; an
        // entry pushed past `slots` is never read.
        float carry_s = score;
        int carry_id = j;
#pragma unroll
        for (int i = 0; i < kList; ++i) {
          const bool take = !(sc[i] >= score);
          const float old_s = sc[i];
          const int old_id = id[i];
          sc[i] = take ? carry_s : old_s;
          id[i] = take ? carry_id : old_id;
          carry_s = take ? old_s : carry_s;
          carry_id = take ? old_id : carry_id;
        }
        count = min(count + 1, slots);
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
  }
}

__global__ void widen_e4m3_kernel(const uint8_t* __restrict__ in, __nv_bfloat16* __restrict__ out, int64_t n) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    out[e] = __float2bfloat16_rn(inference::e4m3_to_f32(in[e]));  // exact: 3 mantissa bits fit bf16's 7
}

// A bf16 copy of an E4M3 index input (contiguous, as validated), freed in stream order after
// the indexer's launches; a bf16 input is used as it is.
TensorView bf16_index_input(const TensorView& t, Buffer& holder, cudaStream_t s) {
  if (t.dtype != DType::f8e4m3) return t;
  holder = Buffer(t.device, DType::bf16, t.shape_vector(), s, Release::in_stream);
  const int64_t n = t.numel();
  if (n > 0) {
    widen_e4m3_kernel<<<int(std::min<int64_t>(ceil_div(n, 256), 4096)), 256, 0, s>>>(
        t.as<const uint8_t>(), static_cast<__nv_bfloat16*>(holder.data()), n);
    MSA_CUDA_CHECK_LAUNCH("widen_e4m3_kernel");
  }
  return holder.view();
}

}  // namespace

namespace {

// The selection kernel on index inputs of type In (bf16, or E4M3 codes on both sides) over the
// layout's documents, in launches of up to kMaxDocs documents.
template <typename In>
void launch_selection(const Topology& topo, const PackedLayout& L, const TensorView& iq, const TensorView& ik,
                      const TensorView& topk, cudaStream_t s) {
  IndexerArgs a{};
  a.iq = iq.data;
  a.ik = ik.data;
  a.topk = topk.as<int32_t>();
  a.total_q = L.total_q();
  a.Hi = topo.num_index_heads;
  a.tile_queries = kTileVectors / a.Hi;
  a.init_blocks = topo.init_blocks;
  a.local_blocks = topo.local_blocks;
  a.scale = topo.indexer_scale();

  // Longest documents first, so the heaviest tiles start early.
  std::vector<int> order(size_t(L.num_documents()));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return L.document(x).k_len > L.document(y).k_len; });
  constexpr int kSmemBytes = storage_smem_bytes<IndexerStorage<In>>();
  MSA_CUDA_CHECK(
      cudaFuncSetAttribute(select_blocks_kernel<In>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  // A launch has queries, hence keys: the map is needed (and valid) only when index_k has rows.
  const int64_t k_rows = ik.shape[0];
  CUtensorMap k_map{};
  if (k_rows > 0)
    k_map = sizeof(In) == 1 ? byte_row_tile_map(ik.data, k_rows, kBlock, "index_k")
                            : bf16_row_tile_map(ik.data, k_rows, kBlock, "index_k");
  IndexerDocs docs{};
  auto flush = [&] {
    if (docs.count == 0) return;
    const int tiles = docs.tile_begin[docs.count];
    if (tiles > 0) {
      select_blocks_kernel<In><<<tiles, kThreads, kSmemBytes, s>>>(a, docs, k_map);
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

}  // namespace

void select_blocks(const Topology& topo, const PackedLayout& L, const SelectBlocksParams& given,
                   const RunOptions& opt) {
  if (given.selected_lse.present()) check_selected_lse_size(L);  // before anything is written
  DeviceGuard guard(given.index_q.device.index);
  const cudaStream_t s = as_stream(opt);
  const bool fp8 = given.index_q.dtype == DType::f8e4m3 && given.index_k.dtype == DType::f8e4m3;
  if (fp8) launch_selection<uint8_t>(topo, L, given.index_q, given.index_k, given.topk, s);
  // bf16 views of the inputs: the bf16 kernel's, and the selected LSE's (which reads bf16).
  Buffer wide_q, wide_k;  // live until the launches below are queued
  SelectBlocksParams p = given;
  if (!fp8 || p.selected_lse.present()) {
    p.index_q = bf16_index_input(given.index_q, wide_q, s);
    p.index_k = bf16_index_input(given.index_k, wide_k, s);
  }
  if (!fp8) launch_selection<__nv_bfloat16>(topo, L, p.index_q, p.index_k, p.topk, s);
  if (p.selected_lse.present()) selected_lse(topo, L, p, s);
}

}  // namespace msa::cuda
