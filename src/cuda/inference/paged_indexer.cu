// Paged indexer on the GPU, in two kernels per chunk of query rows:
//   1. a score kernel: CTA = (tile of query rows, run of logical pages). The rows' index-q
//      vectors sit in shared memory as a bf16 tile, every history page of the run is read once
//      per CTA and S = q . k^T runs on tensor cores (fp32 accumulation). The page score
//      max_t S (NaN if any token's score is NaN) goes to the plan's scratch [rows, Hi, pages].
//      Pages are read by TMA into a ring of stages that warps consume independently:
//      decode_scores_kernel (decode tiles, one request's Q rows, mma.sync; bf16 index-K) and
//      prefill_scores_kernel (256 (row, index head) vectors on wgmma; FP8 index-K pages widened
//      in shared memory), whose tiles may span several requests (handled one after another).
//      Decode over an FP8 index-K cache goes through index_scores_kernel, which widens each
//      page in registers (16-byte loads, the next page in flight while the current one is
//      multiplied). Runs are shorter when the step is small, so that the grid fills the GPU:
//      a CTA's pages are a chain of dependent loads, and a small grid of long chains costs
//      their latency however little it reads.
//   2. select_kernel: one warp per (row, index head) applies the selection rule of the CPU's
//      select_row in one pass over the page scores: init pages, the best history pages by
//      (score desc, page id asc) with NaN never chosen, then the local pages; -1 padding;
//      padding rows all -1.
// FP8 index-q / index-K codes are widened to bf16 exactly (E4M3 values are bf16 values).
#include <algorithm>
#include <climits>
#include <cstddef>

#include "backend.h"
#include "core/check.h"
#include "cuda/device.cuh"
#include "cuda/inference/quant.cuh"
#include "cuda/named_barriers.cuh"
#include "cuda/plan_streams.h"
#include "cuda/tensor_map.h"
#include "cuda/wgmma.cuh"

namespace msa::cuda {

namespace {

using namespace inference;

constexpr int kThreads = 256;      // select_kernel
constexpr int kList = kTopk - 1;   // ranked history slots at most (local_blocks >= 1)
constexpr int kChunk = 16;                             // bytes of one 16-byte load / store
constexpr int kBf16RowChunks = kHeadDim * 2 / kChunk;  // 16-byte chunks of a bf16 128-row
constexpr int kFp8RowChunks = kHeadDim / kChunk;       // ... of an E4M3 row

// The shape of index_scores_kernel (decode over an FP8 index-K cache): a tile is one request's
// Q <= 16 rows (<= 64 vectors): 4 m-tiles of 16 vectors x 2 token halves of a page = 8 warps
// on mma.sync, runs of up to 8 pages.
template <int MTiles, int Halves, int MaxPages>
struct ScoreShape {
  static constexpr int kMTiles = MTiles;
  static constexpr int kHalves = Halves;                      // token slices of a page
  static constexpr int kVectors = 16 * MTiles;                // (row, index head) vectors of a tile
  static constexpr int kThreads = 32 * MTiles * Halves;
  static constexpr int kFrags = kPageSize / Halves / 8;       // n8 fragments of a warp's tokens
  static constexpr int kMaxPagesPerCta = MaxPages;
};
using DecodeScores = ScoreShape<4, 2, 8>;

// A [Rows, 128] bf16 tile in the swizzled layout of tile_offset (device.cuh).
template <int Rows>
struct Bf16Tile {
  uint8_t bytes[Rows * kHeadDim * 2];
};

// Shared memory of index_scores_kernel (from a 1024-byte aligned base): the index-K page in
// use, the segment's index-q vectors, and each token slice's page maxima of each vector.
template <class Shape>
struct ScoresStorage {
  Bf16Tile<kPageSize> k;
  Bf16Tile<Shape::kVectors> q;
  float partial[Shape::kHalves][Shape::kVectors];
};
static_assert(offsetof(ScoresStorage<DecodeScores>, q) % 1024 == 0,
              "index_scores_kernel: swizzled tiles must be 1024-byte aligned");

struct ScoreArgs {
  const uint8_t* q;        // bf16 or fp8
  int64_t q_s0, q_s1;
  const uint8_t* k;        // bf16 or fp8 [pages, 128, 128]
  int64_t k_s0, k_s1;
  const int32_t* positions;
  const int32_t* request;
  const int32_t* page_table;
  int64_t max_pages;
  int64_t row_begin, row_end;
  int tile_rows;           // query rows of a CTA (rows x index heads <= the shape's vectors)
  int pages_per_cta;       // logical pages of a run (<= kMaxPagesPerCta)
  int hi;
  int topk;
  float* scores;           // [rows, hi, score_stride]
  int64_t score_stride;
};

// Pages whose scores the row needs: [0, local) when it sees more than topk pages, else none.
__device__ __forceinline__ int64_t scored_pages(int32_t pos, int topk) {
  if (pos < 0) return 0;
  const int64_t local = pos / kPageSize;
  return local + 1 > topk ? local : 0;
}

template <bool QFp8>
__device__ __forceinline__ void load_q_chunk(const ScoreArgs& a, int64_t row, int head, int chunk, uint4& out) {
  const int64_t at = row * a.q_s0 + head * a.q_s1 + chunk * (kChunk / 2);  // 8 elements a chunk
  float v[8];
  if constexpr (QFp8) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = e4m3_to_f32(a.q[at + i]);
  } else {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(a.q) + at;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __uint_as_float(uint32_t(p[i]) << 16);
  }
  out = make_uint4(bf16x2_bits(v[0], v[1]), bf16x2_bits(v[2], v[3]), bf16x2_bits(v[4], v[5]), bf16x2_bits(v[6], v[7]));
}

// The same chunk of E4M3 index-q codes as f16 (exact).
__device__ __forceinline__ uint4 load_q_chunk_f16(const ScoreArgs& a, int64_t row, int head, int chunk) {
  const uint8_t* p = a.q + row * a.q_s0 + head * a.q_s1 + chunk * (kChunk / 2);  // 8 codes a chunk
  uint32_t h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = e4m3x2_to_f16x2(uint32_t(p[2 * i]) | uint32_t(p[2 * i + 1]) << 8);
  return make_uint4(h[0], h[1], h[2], h[3]);
}

// Writes the index-q vectors of rows first_row.. (vector v = row v / hi, head v % hi; nv of
// them, zeros after) into a [kVectors, 128] bf16 tile; threads [0, NT) take part.
// A thread's loads all go out before its stores: the stores are volatile, so a load behind one
// would wait for it (a round trip per chunk instead of one for the tile).
template <int kVectors, int NT, bool QFp8>
__device__ __forceinline__ void store_q_tile(const ScoreArgs& a, uint32_t q_tile, int64_t first_row, int nv) {
  constexpr int kTotal = kVectors * kBf16RowChunks, kItems = (kTotal + NT - 1) / NT;
  uint4 val[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int i = int(threadIdx.x) + k * NT, vec = i / kBf16RowChunks;
    val[k] = make_uint4(0, 0, 0, 0);
    if (i < kTotal && vec < nv) load_q_chunk<QFp8>(a, first_row + vec / a.hi, vec % a.hi, i % kBf16RowChunks, val[k]);
  }
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int i = int(threadIdx.x) + k * NT;
    if (i < kTotal)
      st_shared_v4(q_tile + tile_offset(kVectors, i / kBf16RowChunks, i % kBf16RowChunks), val[k].x, val[k].y, val[k].z,
                   val[k].w);
  }
}

// Register stage of one index-K page (NT threads): 16-byte chunks of the page's rows.
template <bool KFp8, int NT>
struct PageRegs {
  static constexpr int kRowChunks = KFp8 ? kFp8RowChunks : kBf16RowChunks;
  static constexpr int kChunks = kPageSize * kRowChunks / NT;
  static_assert(kPageSize * kRowChunks % NT == 0, "whole chunks a thread");
  uint4 r[kChunks];
};

template <bool KFp8, int NT>
__device__ __forceinline__ void fetch_page(const ScoreArgs& a, int32_t phys, PageRegs<KFp8, NT>& regs) {
  const uint8_t* page = a.k + int64_t(phys) * a.k_s0 * (KFp8 ? 1 : 2);
  const int64_t row_bytes = a.k_s1 * (KFp8 ? 1 : 2);
#pragma unroll
  for (int i = 0; i < PageRegs<KFp8, NT>::kChunks; ++i) {
    const int c = threadIdx.x + i * NT;  // 16-byte chunk: row c / 8 (fp8) or c / 16 (bf16)
    const int per_row = PageRegs<KFp8, NT>::kRowChunks;
    const int t = c / per_row, col = c % per_row;
    regs.r[i] = __ldg(reinterpret_cast<const uint4*>(page + t * row_bytes + col * kChunk));
  }
}

template <bool KFp8, int NT>
__device__ __forceinline__ void store_page(uint32_t tile, const PageRegs<KFp8, NT>& regs) {
#pragma unroll
  for (int i = 0; i < PageRegs<KFp8, NT>::kChunks; ++i) {
    const int c = threadIdx.x + i * NT;
    if constexpr (KFp8) {
      const int t = c / kFp8RowChunks, col = c % kFp8RowChunks;  // 16 codes -> bf16 chunks 2 col, 2 col + 1
      const uint32_t w[4] = {regs.r[i].x, regs.r[i].y, regs.r[i].z, regs.r[i].w};
      uint32_t o[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        o[2 * j] = bf16x2_bits(e4m3_to_f32(uint8_t(w[j])), e4m3_to_f32(uint8_t(w[j] >> 8)));
        o[2 * j + 1] = bf16x2_bits(e4m3_to_f32(uint8_t(w[j] >> 16)), e4m3_to_f32(uint8_t(w[j] >> 24)));
      }
      const uint32_t d0 = tile + tile_offset(kPageSize, t, 2 * col), d1 = tile + tile_offset(kPageSize, t, 2 * col + 1);
      st_shared_v4(d0, o[0], o[1], o[2], o[3]);
      st_shared_v4(d1, o[4], o[5], o[6], o[7]);
    } else {
      const int t = c / kBf16RowChunks, col = c % kBf16RowChunks;
      const uint32_t d = tile + tile_offset(kPageSize, t, col);
      st_shared_v4(d, regs.r[i].x, regs.r[i].y, regs.r[i].z, regs.r[i].w);
    }
  }
}

template <class Shape, bool QFp8, bool KFp8>
__global__ void __launch_bounds__(Shape::kThreads) index_scores_kernel(const ScoreArgs a) {
  constexpr int NT = Shape::kThreads, kVectors = Shape::kVectors, kHalves = Shape::kHalves, kFrags = Shape::kFrags;
  using Storage = ScoresStorage<Shape>;
  extern __shared__ uint8_t smem_raw[];
  Storage& smem = shared_storage<Storage>(smem_raw);
  const uint32_t k_tile = smem_addr(&smem.k), q_tile = smem_addr(&smem.q);  // [128 tokens / kVectors, 128] bf16
  auto& partial = smem.partial;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t tile_begin = a.row_begin + int64_t(blockIdx.x) * a.tile_rows;
  const int64_t tile_end = min(tile_begin + a.tile_rows, a.row_end);
  const int64_t page_begin = int64_t(blockIdx.y) * a.pages_per_cta;

  for (int64_t seg = tile_begin; seg < tile_end;) {
    const int32_t req = a.request[seg];
    int64_t seg_end = seg + 1;
    while (seg_end < tile_end && a.request[seg_end] == req) ++seg_end;
    const int64_t need = scored_pages(a.positions[seg_end - 1], a.topk);  // positions rise within a request
    const int64_t page_end = min(page_begin + a.pages_per_cta, need);
    if (page_begin < page_end) {
      const int nv = int(seg_end - seg) * a.hi;
      __syncthreads();  // the previous segment is done with the Q tile
      store_q_tile<kVectors, NT, QFp8>(a, q_tile, seg, nv);
      const int32_t* table = a.page_table + int64_t(req) * a.max_pages;
      PageRegs<KFp8, NT> regs;
      fetch_page<KFp8, NT>(a, table[page_begin], regs);
      // m-tile of 16 vectors, token slice of the page
      const int mt = warp % Shape::kMTiles, half = warp / Shape::kMTiles;
      for (int64_t j = page_begin; j < page_end; ++j) {
        __syncthreads();  // the previous page's products are done
        store_page<KFp8, NT>(k_tile, regs);
        __syncthreads();
        if (j + 1 < page_end) fetch_page<KFp8, NT>(a, table[j + 1], regs);
        if (mt * 16 < nv) {  // the warp's m-tile is in use
          float acc[kFrags][4];
#pragma unroll
          for (int n = 0; n < kFrags; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
          for (int kk = 0; kk < 8; ++kk) {
            uint32_t qa[4];
            load_a(qa, q_tile, kVectors, mt * 16, kk * 16, lane);
#pragma unroll
            for (int np = 0; np < kFrags / 2; ++np) {
              uint32_t kb[4];
              load_b_nk(kb, k_tile, kPageSize, half * (kPageSize / kHalves) + np * 16, kk * 16, lane);
              mma_bf16(acc[2 * np], qa, kb[0], kb[1]);
              mma_bf16(acc[2 * np + 1], qa, kb[2], kb[3]);
            }
          }
          float best0 = -INFINITY, best1 = -INFINITY;
          bool nan0 = false, nan1 = false;
#pragma unroll
          for (int n = 0; n < kFrags; ++n) {
            nan0 |= isnan(acc[n][0]) || isnan(acc[n][1]);
            nan1 |= isnan(acc[n][2]) || isnan(acc[n][3]);
            best0 = fmaxf(best0, fmaxf(acc[n][0], acc[n][1]));
            best1 = fmaxf(best1, fmaxf(acc[n][2], acc[n][3]));
          }
          best0 = warp_max4(best0);
          best1 = warp_max4(best1);
          // A page score is NaN when any of its token scores is (fmaxf alone would skip it).
          int flags = (nan0 ? 1 : 0) | (nan1 ? 2 : 0);
          flags |= __shfl_xor_sync(0xffffffffu, flags, 1);
          flags |= __shfl_xor_sync(0xffffffffu, flags, 2);
          if ((lane & 3) == 0) {
            const int g = lane >> 2;
            partial[half][mt * 16 + g] = (flags & 1) ? NAN : best0;
            partial[half][mt * 16 + g + 8] = (flags & 2) ? NAN : best1;
          }
        }
        __syncthreads();
        if (threadIdx.x < nv) {
          const int vec = threadIdx.x;
          float s = partial[0][vec];
#pragma unroll
          for (int h = 1; h < kHalves; ++h) {
            const float o = partial[h][vec];
            s = (isnan(s) || isnan(o)) ? NAN : fmaxf(s, o);
          }
          const int64_t row = seg + vec / a.hi;
          a.scores[((row - a.row_begin) * a.hi + vec % a.hi) * a.score_stride + j] = s;
        }
      }
    }
    seg = seg_end;
  }
}

// Lets `kernel` take `smem` bytes of dynamic shared memory and returns how many of its CTAs of
// `threads` an SM holds (at least 1). CTAs per SM are a fact of the kernel and the
// architecture: callers keep the result in a function-local static (found once, thread-safe).
template <class Kernel>
int configure_and_count(Kernel* kernel, int threads, int smem) {
  MSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int n = 0;
  MSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  return std::max(n, 1);
}

// Decode scores over a bf16 index-K cache, streamed: CTA = (one request's Q rows, run of
// logical pages). A producer warp brings the run's pages by TMA into a ring of kStreamStages
// stages; kStreamConsumers warps take whole pages in turn (page n of the run: warp n % 3), each
// multiplying all of the tile's (row, index head) vectors with its page and writing their page
// maxima, and hand the stage back through its `empty` barrier. No CTA-wide barrier in the
// loop: loads run as far ahead as the ring allows, whatever one warp's progress. The ring is a
// whole number of stages per consumer, so a stage only ever serves one warp: a warp waiting for
// a stage's next phase has consumed its previous one, and cannot mistake an older phase of the
// same parity for it (a parity wait only tells the last two phases apart).
constexpr int kStreamConsumers = 3;
constexpr int kStreamThreads = 32 * (kStreamConsumers + 1);
constexpr int kStreamStages = 2 * kStreamConsumers;
static_assert(kStreamStages % kStreamConsumers == 0, "each stage serves one consumer warp");

template <int MTiles>
struct StreamStorage {
  Bf16Tile<kPageSize> stage[kStreamStages];
  Bf16Tile<16 * MTiles> q;
  uint64_t full[kStreamStages];   // the page's TMA bytes have landed
  uint64_t empty[kStreamStages];  // its consumer warp is done with it
};

template <int MTiles, bool QFp8>
__global__ void __launch_bounds__(kStreamThreads, 1)
    decode_scores_kernel(const ScoreArgs a, const __grid_constant__ CUtensorMap k_map) {
  constexpr int kVectors = 16 * MTiles;
  using Storage = StreamStorage<MTiles>;
  extern __shared__ uint8_t smem_raw[];
  Storage& smem = shared_storage<Storage>(smem_raw);
  const uint32_t stage0 = smem_addr(&smem.stage[0]), q_tile = smem_addr(&smem.q);
  const uint32_t full0 = smem_addr(&smem.full[0]), empty0 = smem_addr(&smem.empty[0]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  // The tile is one request's rows (decode); its last row sees the most pages.
  const int64_t tile_begin = a.row_begin + int64_t(blockIdx.x) * a.tile_rows;
  const int64_t tile_end = min(tile_begin + a.tile_rows, a.row_end);
  const int64_t page_begin = int64_t(blockIdx.y) * a.pages_per_cta;
  const int64_t page_end = min(page_begin + a.pages_per_cta, scored_pages(a.positions[tile_end - 1], a.topk));
  if (page_begin >= page_end) return;
  const int count = int(page_end - page_begin);
  const int nv = int(tile_end - tile_begin) * a.hi;
  const int32_t* table = a.page_table + int64_t(a.request[tile_begin]) * a.max_pages;

  if (threadIdx.x < kStreamStages) {
    mbar_init(full0 + 8 * threadIdx.x, 1);
    mbar_init(empty0 + 8 * threadIdx.x, 1);
  }
  // The producer's lanes look up the run's physical pages 32 at a time (lane i: page n0 + i); the
  // first batch is in flight while the query tile loads.
  const bool producer = warp == kStreamConsumers;
  int32_t phys_batch = producer && lane < count ? table[page_begin + lane] : 0;
  store_q_tile<kVectors, kStreamThreads, QFp8>(a, q_tile, tile_begin, nv);
  __syncthreads();

  if (producer) {
    const uint64_t policy = l2_evict_first();
    // Loops not unrolled, here and over a page's halves below: a small step fetches this
    // kernel's code cold (docs/performance.md run 49), and a CTA issues a few pages.
#pragma unroll 1
    for (int n0 = 0; n0 < count; n0 += 32) {
      if (n0 > 0) phys_batch = n0 + lane < count ? table[page_begin + n0 + lane] : 0;
#pragma unroll 1
      for (int n = n0; n < min(n0 + 32, count); ++n) {
        const int32_t phys = __shfl_sync(0xffffffffu, phys_batch, n - n0);
        if (lane == 0) {
          const int s = n % kStreamStages;
          if (n >= kStreamStages) mbar_wait(empty0 + 8 * s, (n / kStreamStages - 1) & 1);
          const uint32_t full = full0 + 8 * s, dst = stage0 + uint32_t(s * int(sizeof(Bf16Tile<kPageSize>)));
          mbar_arrive_expect_tx(full, uint32_t(sizeof(Bf16Tile<kPageSize>)));
          tma_load_4d(dst, &k_map, 0, 0, 0, phys, full, policy);
          tma_load_4d(dst + kPageSize * 128, &k_map, 64, 0, 0, phys, full, policy);
        }
        __syncwarp();
      }
    }
    return;
  }

  const int gr = lane >> 2;
  for (int n = warp; n < count; n += kStreamConsumers) {
    const int s = n % kStreamStages;
    const uint32_t k_tile = stage0 + uint32_t(s * int(sizeof(Bf16Tile<kPageSize>)));
    mbar_wait(full0 + 8 * s, (n / kStreamStages) & 1);
    float best[MTiles][2];
    bool nan[MTiles][2];
#pragma unroll
    for (int mt = 0; mt < MTiles; ++mt) {
      best[mt][0] = best[mt][1] = -INFINITY;
      nan[mt][0] = nan[mt][1] = false;
      if (mt * 16 >= nv) continue;
#pragma unroll 1
      for (int half = 0; half < 2; ++half) {  // 64 tokens at a time: 32 accumulators
        float acc[8][4];
#pragma unroll
        for (int f = 0; f < 8; ++f) acc[f][0] = acc[f][1] = acc[f][2] = acc[f][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          uint32_t qa[4];
          load_a(qa, q_tile, kVectors, mt * 16, kk * 16, lane);
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            uint32_t kb[4];
            load_b_nk(kb, k_tile, kPageSize, half * 64 + np * 16, kk * 16, lane);
            mma_bf16(acc[2 * np], qa, kb[0], kb[1]);
            mma_bf16(acc[2 * np + 1], qa, kb[2], kb[3]);
          }
        }
#pragma unroll
        for (int f = 0; f < 8; ++f) {
          nan[mt][0] |= isnan(acc[f][0]) || isnan(acc[f][1]);
          nan[mt][1] |= isnan(acc[f][2]) || isnan(acc[f][3]);
          best[mt][0] = fmaxf(best[mt][0], fmaxf(acc[f][0], acc[f][1]));
          best[mt][1] = fmaxf(best[mt][1], fmaxf(acc[f][2], acc[f][3]));
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * s);  // the page's products are done
#pragma unroll
    for (int mt = 0; mt < MTiles; ++mt) {
      if (mt * 16 >= nv) continue;
      // A page score is NaN when any of its token scores is (fmaxf alone would skip it).
      const float b0 = warp_max4(best[mt][0]), b1 = warp_max4(best[mt][1]);
      int flags = (nan[mt][0] ? 1 : 0) | (nan[mt][1] ? 2 : 0);
      flags |= __shfl_xor_sync(0xffffffffu, flags, 1);
      flags |= __shfl_xor_sync(0xffffffffu, flags, 2);
      if ((lane & 3) == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int vec = mt * 16 + gr + 8 * h;
          if (vec >= nv) continue;
          const int64_t row = tile_begin + vec / a.hi;
          a.scores[((row - a.row_begin) * a.hi + vec % a.hi) * a.score_stride + page_begin + n] =
              (flags & (1 << h)) ? NAN : (h ? b1 : b0);
        }
      }
    }
  }
  griddep_launch_dependents();  // the selection may start its launch
}

template <int MTiles, bool QFp8>
void launch_stream_scores(const ScoreArgs& args, const CUtensorMap& k_map, int64_t tiles, int64_t history,
                          cudaStream_t stream) {
  constexpr int smem = storage_smem_bytes<StreamStorage<MTiles>>();
  auto* kernel = decode_scores_kernel<MTiles, QFp8>;
  static const int per_sm = configure_and_count(kernel, kStreamThreads, smem);
  // As many runs a tile as keep every tile's runs in one wave (at least one run a tile).
  ScoreArgs a = args;
  const int64_t runs_per_tile = std::max<int64_t>(1, int64_t(sm_count()) * per_sm / tiles);
  a.pages_per_cta = int(ceil_div(history, runs_per_tile));
  const unsigned runs = unsigned(ceil_div(history, a.pages_per_cta));
  kernel<<<dim3(unsigned(tiles), runs), kStreamThreads, smem, stream>>>(a, k_map);
  MSA_CUDA_CHECK_LAUNCH("decode_scores_kernel");
}

template <bool QFp8>
void launch_stream_scores_for(int vectors, const ScoreArgs& a, const CUtensorMap& k_map, int64_t tiles,
                              int64_t history, cudaStream_t stream) {
  if (vectors <= 16) launch_stream_scores<1, QFp8>(a, k_map, tiles, history, stream);
  else if (vectors <= 32) launch_stream_scores<2, QFp8>(a, k_map, tiles, history, stream);
  else launch_stream_scores<4, QFp8>(a, k_map, tiles, history, stream);
}

// Prefill scores, streamed: CTA = (tile of up to 256 (row, index head) vectors, run of
// logical pages). A producer warp brings the run's pages by TMA into a ring of kPrefillStages
// stages; each of the four consumer warpgroups owns 64 vectors (their index-q rows stay in
// shared memory for the run), multiplies every page on wgmma, writes its vectors' page maxima
// and hands the stage back (`empty` counts the 16 consumer warps). The warpgroups meet at no
// CTA-wide barrier, so one's epilogue overlaps the others' products. A tile that spans
// requests is taken one request (segment) at a time; every warpgroup rewrites its own Q rows
// (FP8 index-q widened to bf16 exactly). An FP8 index-K page lands by TMA in a raw ring of
// kPrefillRawStages and three producer warps widen it into the stage exactly, so the product
// and its exactness are a 16-bit cache's: to f16 when index-q is FP8 too (one conversion a
// pair of codes; f16 holds every E4M3 value, and both operands are then f16), else to bf16
// (E4M3 values are bf16 values too, but the bf16 pair takes four conversions). FP8 codes are
// not multiplied on FP8 tensor cores: Hopper's FP8 accumulation truncates (docs/performance.md
// run 20), and the contract's scores are fp32 dot products.
constexpr int kPrefillConsumerWarpgroups = 4;
constexpr int kPrefillConsumerWarps = 4 * kPrefillConsumerWarpgroups;
constexpr int kPrefillThreads = 32 * kPrefillConsumerWarps + 128;  // + the producer warpgroup (one warp works)
constexpr int kPrefillVectors = 64 * kPrefillConsumerWarpgroups;
constexpr int kPrefillMaxPages = 64;  // pages of a run: the Q tile's load is paid once a run
constexpr int kPrefillStages = 4;
constexpr int kPrefillRawStages = 2;                       // FP8 index-K pages as they land
constexpr int kPrefillWideners = 96;                       // producer warps 1-3 widen FP8 pages
constexpr int kFp8PageBytes = kPageSize * kHeadDim;        // one E4M3 page: 128 rows of 128 codes

// Registers a thread: the producer warpgroup gives most of its share to the consumers (fewer
// when it widens FP8 pages). The CTA's pool is what it was launched with (the launch bound's
// share, 96 a thread), so the consumers can only take what the producer gives back
// (setmaxnreg.inc would wait forever).
constexpr int kPrefillLaunchRegs = 65536 / kPrefillThreads / 8 * 8;
template <bool KFp8>
struct PrefillRegs {
  static constexpr int kProducer = KFp8 ? 56 : 24;
  static constexpr int kConsumer = KFp8 ? 104 : 112;
  static_assert(kProducer * 128 + kConsumer * 32 * kPrefillConsumerWarps <= kPrefillLaunchRegs * kPrefillThreads,
                "prefill_scores_kernel: the warpgroups' registers exceed the CTA's");
};

template <bool KFp8>
struct PrefillStreamStorage {
  Bf16Tile<kPageSize> stage[kPrefillStages];
  Bf16Tile<kPrefillVectors> q;
  uint8_t raw[KFp8 ? kPrefillRawStages : 1][kFp8PageBytes];  // unswizzled E4M3 rows (unused for bf16)
  uint64_t full[kPrefillStages];              // the page is in its stage (TMA bytes, or the wideners)
  uint64_t empty[kPrefillStages];             // every consumer warp is done with it
  uint64_t raw_full[kPrefillRawStages];       // an FP8 page's TMA bytes have landed
  uint64_t raw_empty[kPrefillRawStages];      // the wideners are done with it
};

// The segment of a tile that starts at row `seg`: its end (rows of one request) and the end
// of the run's pages that its rows need. Producer and consumer roles walk the same segments.
struct Segment {
  int64_t end;
  int64_t page_end;
  int32_t req;
};
__device__ __forceinline__ Segment tile_segment(const ScoreArgs& a, int64_t seg, int64_t tile_end, int64_t page_begin) {
  Segment s{seg + 1, 0, a.request[seg]};
  while (s.end < tile_end && a.request[s.end] == s.req) ++s.end;
  s.page_end = min(page_begin + a.pages_per_cta, scored_pages(a.positions[s.end - 1], a.topk));  // positions rise
  return s;
}

template <bool QFp8, bool KFp8>
__global__ void __launch_bounds__(kPrefillThreads, 1)
    prefill_scores_kernel(const ScoreArgs a, const __grid_constant__ CUtensorMap k_map) {
  using Storage = PrefillStreamStorage<KFp8>;
  using Regs = PrefillRegs<KFp8>;
  constexpr bool kF16 = QFp8 && KFp8;  // both operands E4M3 codes: multiplied as f16
  constexpr int kStageBytes = int(sizeof(Bf16Tile<kPageSize>));
  extern __shared__ uint8_t smem_raw[];
  Storage& smem = shared_storage<Storage>(smem_raw);
  const uint32_t stage0 = smem_addr(&smem.stage[0]), q_tile = smem_addr(&smem.q);
  const uint32_t full0 = smem_addr(&smem.full[0]), empty0 = smem_addr(&smem.empty[0]);
  const uint32_t raw_full0 = smem_addr(&smem.raw_full[0]), raw_empty0 = smem_addr(&smem.raw_empty[0]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  if (threadIdx.x < kPrefillStages) {
    mbar_init(full0 + 8 * threadIdx.x, KFp8 ? kPrefillWideners : 1);
    mbar_init(empty0 + 8 * threadIdx.x, kPrefillConsumerWarps);
  }
  if (threadIdx.x < kPrefillRawStages) {
    mbar_init(raw_full0 + 8 * threadIdx.x, 1);
    mbar_init(raw_empty0 + 8 * threadIdx.x, kPrefillWideners);
  }
  __syncthreads();

  const int64_t tile_begin = a.row_begin + int64_t(blockIdx.x) * a.tile_rows;
  const int64_t tile_end = min(tile_begin + a.tile_rows, a.row_end);
  const int64_t page_begin = int64_t(blockIdx.y) * a.pages_per_cta;

  // Calls f(n, page table row of the segment, logical page) for the run's pages in order.
  auto for_each_page = [&](auto&& f) {
    int n = 0;
    for (int64_t seg = tile_begin; seg < tile_end;) {
      const Segment sg = tile_segment(a, seg, tile_end, page_begin);
      const int32_t* table = a.page_table + int64_t(sg.req) * a.max_pages;
      for (int64_t j = page_begin; j < sg.page_end; ++j, ++n) f(n, table, j);
      seg = sg.end;
    }
  };

  if (warp >= kPrefillConsumerWarps) {  // producer warpgroup: the pages of every segment, in order
    setmaxnreg_dec<Regs::kProducer>();
    const int pw = warp - kPrefillConsumerWarps;
    const uint64_t policy = l2_evict_last();  // every tile of the step reads these pages
    if (pw == 0 && lane == 0) {  // TMA: into the stage (bf16) or the raw ring (FP8)
      for_each_page([&](int n, const int32_t* table, int64_t j) {
        const int32_t phys = table[j];
        if constexpr (KFp8) {
          const int r = n % kPrefillRawStages;
          if (n >= kPrefillRawStages) mbar_wait(raw_empty0 + 8 * r, (n / kPrefillRawStages - 1) & 1);
          mbar_arrive_expect_tx(raw_full0 + 8 * r, kFp8PageBytes);
          tma_load_4d(smem_addr(smem.raw[r]), &k_map, 0, 0, 0, phys, raw_full0 + 8 * r, policy);
        } else {
          const int s = n % kPrefillStages;
          if (n >= kPrefillStages) mbar_wait(empty0 + 8 * s, (n / kPrefillStages - 1) & 1);
          const uint32_t full = full0 + 8 * s, dst = stage0 + uint32_t(s * kStageBytes);
          mbar_arrive_expect_tx(full, kStageBytes);
          tma_load_4d(dst, &k_map, 0, 0, 0, phys, full, policy);  // the page's two column halves
          tma_load_4d(dst + kPageSize * 128, &k_map, 64, 0, 0, phys, full, policy);
        }
      });
    } else if (KFp8 && pw > 0) {  // wideners: raw page -> 16-bit stage
      const int w = threadIdx.x - 32 * (kPrefillConsumerWarps + 1);
      for_each_page([&](int n, const int32_t*, int64_t) {
        const int r = n % kPrefillRawStages, s = n % kPrefillStages;
        mbar_wait(raw_full0 + 8 * r, (n / kPrefillRawStages) & 1);
        if (n >= kPrefillStages) mbar_wait(empty0 + 8 * s, (n / kPrefillStages - 1) & 1);
        widen_fp8_side<kPrefillWideners, kF16, false>(smem_addr(smem.raw[r]), stage0 + uint32_t(s * kStageBytes), w);
        mbar_arrive(raw_empty0 + 8 * r);
        fence_proxy_async();  // the stage is read by wgmma
        mbar_arrive(full0 + 8 * s);
      });
    }
    return;
  }

  setmaxnreg_inc<Regs::kConsumer>();
  const int wg = warp / 4, wg_thread = threadIdx.x % 128;
  const int row0 = 64 * wg + 16 * (warp % 4);  // this warp's first vector
  const uint64_t q_desc = tile_desc(q_tile, kPrefillVectors, 64 * wg, 0);
  const auto barrier = PrefillIndexerBarrier(int(PrefillIndexerBarrier::kWarpgroup0) + wg);
  int n = 0;
  for (int64_t seg = tile_begin; seg < tile_end;) {
    const Segment sg = tile_segment(a, seg, tile_end, page_begin);
    if (page_begin < sg.page_end) {
      const int nv = int(sg.end - seg) * a.hi;
      const bool active = 64 * wg < nv;  // any of this warpgroup's vectors in use
      if (active) {
        // This warpgroup's 64 Q rows, written by its own threads (no other warpgroup reads them).
        sync_barrier(barrier, 128);  // the previous segment's products are done with them
        for (int i = wg_thread; i < 64 * kBf16RowChunks; i += 128) {
          const int vec = 64 * wg + i / kBf16RowChunks, chunk = i % kBf16RowChunks;
          uint4 val = make_uint4(0, 0, 0, 0);
          if (vec < nv) {
            if constexpr (kF16) val = load_q_chunk_f16(a, seg + vec / a.hi, vec % a.hi, chunk);
            else load_q_chunk<QFp8>(a, seg + vec / a.hi, vec % a.hi, chunk, val);
          }
          st_shared_v4(q_tile + tile_offset(kPrefillVectors, vec, chunk), val.x, val.y, val.z, val.w);
        }
        fence_proxy_async();  // the rows are read by wgmma
        sync_barrier(barrier, 128);
      }
      // Where lanes 0, 4, .. write the page maxima of rows g and g + 8 (null: not written).
      float* out[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int vec = row0 + (lane >> 2) + 8 * h;
        out[h] = (lane & 3) == 0 && vec < nv
                     ? a.scores + ((seg + vec / a.hi - a.row_begin) * a.hi + vec % a.hi) * a.score_stride + page_begin
                     : nullptr;
      }
      const int count = int(sg.page_end - page_begin);
      for (int jj = 0; jj < count; ++jj, ++n) {
        const int s = n % kPrefillStages;
        mbar_wait(full0 + 8 * s, (n / kPrefillStages) & 1);
        float acc[16][4];
        if (active) {
          const uint64_t k_desc = tile_desc(stage0 + uint32_t(s * kStageBytes), kPageSize, 0, 0);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 8; ++kk)
            wgmma_m64n128k16<kF16>(acc, q_desc + tile_desc_step(kPrefillVectors, kk),
                                   k_desc + tile_desc_step(kPageSize, kk), kk > 0);
          wgmma_commit();
          wgmma_wait<0>();
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * s);  // the page's products are done
        if (!active) continue;
        // Rows g and g + 8 of the warp's 16 vectors: max over the page's 128 tokens, NaN
        // propagating, as a tree for independent operations.
        float m0[8], m1[8];
#pragma unroll
        for (int f = 0; f < 8; ++f) {
          m0[f] = max_nan(max_nan(acc[2 * f][0], acc[2 * f][1]), max_nan(acc[2 * f + 1][0], acc[2 * f + 1][1]));
          m1[f] = max_nan(max_nan(acc[2 * f][2], acc[2 * f][3]), max_nan(acc[2 * f + 1][2], acc[2 * f + 1][3]));
        }
#pragma unroll
        for (int w = 4; w > 0; w >>= 1)
#pragma unroll
          for (int f = 0; f < w; ++f) m0[f] = max_nan(m0[f], m0[f + w]), m1[f] = max_nan(m1[f], m1[f + w]);
        float b0 = m0[0], b1 = m1[0];
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
          b0 = max_nan(b0, __shfl_xor_sync(0xffffffffu, b0, o));
          b1 = max_nan(b1, __shfl_xor_sync(0xffffffffu, b1, o));
        }
        if (out[0]) out[0][jj] = b0;
        if (out[1]) out[1][jj] = b1;
      }
    }
    seg = sg.end;
  }
  griddep_launch_dependents();  // the selection may start its launch
}

template <bool QFp8, bool KFp8>
void launch_prefill_scores(ScoreArgs a, const CUtensorMap& k_map, int64_t tiles, int64_t history, cudaStream_t stream) {
  constexpr int smem = storage_smem_bytes<PrefillStreamStorage<KFp8>>();
  auto* kernel = prefill_scores_kernel<QFp8, KFp8>;
  static const int per_sm = configure_and_count(kernel, kPrefillThreads, smem);
  const int64_t resident = int64_t(sm_count()) * per_sm;
  a.pages_per_cta = int(std::clamp<int64_t>(ceil_div(tiles * history, resident), 1, kPrefillMaxPages));
  const unsigned runs = unsigned(ceil_div(history, a.pages_per_cta));
  kernel<<<dim3(unsigned(tiles), runs), kPrefillThreads, smem, stream>>>(a, k_map);
  MSA_CUDA_CHECK_LAUNCH("prefill_scores_kernel");
}

struct SelectArgs {
  const float* scores;
  int64_t score_stride;
  const int32_t* positions;
  int64_t row_begin, row_end, total_q;
  int hi;
  int topk, init_blocks, local_blocks;
  int32_t* out;  // [hi, total_q, topk]
};

// (score desc, id asc) order; invalid candidates (id = INT_MAX) come last.
__device__ __forceinline__ bool ranks_before(float s, int id, float bs, int bid) {
  if (id == INT_MAX) return false;
  if (bid == INT_MAX) return true;
  return s > bs || (s == bs && id < bid);
}

// The place of this lane's (score, id) among the warp's 32: how many lanes hold one that ranks
// before it.
__device__ __forceinline__ int place_among_lanes(float s, int id, int lane) {
  int place = 0;
#pragma unroll 8
  for (int o = 1; o < 32; ++o) {
    const float os = __shfl_sync(0xffffffffu, s, (lane + o) & 31);
    const int oid = __shfl_sync(0xffffffffu, id, (lane + o) & 31);
    place += ranks_before(os, oid, s, id) ? 1 : 0;
  }
  return place;
}

// Page scores are read kSelectBatch pages a lane at a time (pages b0, b0 + 32, ..), so that
// their loads are in flight together; pages at or past `end` read as NaN (never chosen).
constexpr int kSelectBatch = 8;
__device__ __forceinline__ void load_score_batch(const float* score, int64_t b0, int64_t end,
                                                 float (&batch)[kSelectBatch]) {
#pragma unroll
  for (int i = 0; i < kSelectBatch; ++i) batch[i] = b0 + 32 * i < end ? score[b0 + 32 * i] : NAN;
}

// The best `slots` history pages [begin, end) by (score desc, page id asc), NaN never chosen,
// written to out[0 ..] in that order by a warp; returns how many (fewer when fewer pages).
// Exact for any scores, at ~14 compare-and-swaps per page a lane keeps: the path of
// select_history when its threshold leaves too many candidates.
__device__ __forceinline__ int select_history_lists(const float* score, int64_t begin, int64_t end, int slots, int32_t* out,
                                              int lane) {
  int n = 0;
  // One pass over the history pages: lane l keeps the best kList of pages begin + l + 32i
  // in registers, sorted by (score desc, id asc); then `slots` rounds take the best head of
  // the 32 lists (ids are distinct, so exactly one lane pops its head).
  float ls[kList];
  int li[kList];
#pragma unroll
  for (int k = 0; k < kList; ++k) ls[k] = -INFINITY, li[k] = INT_MAX;
  // The list is the same in any order of insertion ((score, id) is a total order).
  // The batch's pages are inserted in a loop that is not unrolled (the batch shifts down a
  // slot a turn, so that it stays in registers): this path is rare, and unrolled it was most of
  // the selection kernel's code, which each step fetches (from memory when L2 is cold).
  for (int64_t b0 = begin + lane; b0 < end; b0 += 32 * kSelectBatch) {
    float batch[kSelectBatch];
    load_score_batch(score, b0, end, batch);
#pragma unroll 1
    for (int i = 0; i < kSelectBatch; ++i) {
      float cs = batch[0];
      int ci = int(b0 + 32 * i);
#pragma unroll
      for (int j = 0; j + 1 < kSelectBatch; ++j) batch[j] = batch[j + 1];
      if (isnan(cs) || !ranks_before(cs, ci, ls[kList - 1], li[kList - 1])) continue;
#pragma unroll
      for (int k = 0; k < kList; ++k)
        if (ranks_before(cs, ci, ls[k], li[k])) {
          const float ts = ls[k];
          const int ti = li[k];
          ls[k] = cs, li[k] = ci, cs = ts, ci = ti;
        }
    }
  }
  for (int k = 0; k < slots; ++k) {
    float bs = ls[0];
    int bid = li[0];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float os = __shfl_xor_sync(0xffffffffu, bs, o);
      const int oid = __shfl_xor_sync(0xffffffffu, bid, o);
      if (ranks_before(os, oid, bs, bid)) {
        bs = os;
        bid = oid;
      }
    }
    if (bid == INT_MAX) break;
    if (lane == 0) out[n] = bid;
    ++n;
    if (li[0] == bid) {
#pragma unroll
      for (int j = 0; j + 1 < kList; ++j) ls[j] = ls[j + 1], li[j] = li[j + 1];
      ls[kList - 1] = -INFINITY, li[kList - 1] = INT_MAX;
    }
  }
  return n;
}

// Candidates a warp may keep past the threshold of select_history (shared memory).
constexpr int kSurvivors = 256;
struct Survivor {
  float score;
  int id;
};

// The same selection as select_history_lists, through a threshold: the `slots`-th best of the
// lanes' own best pages is at or below the `slots`-th best page overall (those lanes' bests are
// `slots` distinct pages), so every page of the selection ranks at or above it. One pass finds
// the lanes' bests, a second keeps the pages at or above the threshold (a few dozen for
// scores that are not adversarial) in `kept`, and each kept page's place is the number of kept
// pages that rank before it. More than kSurvivors kept pages (e.g. many equal scores): the
// lists instead.
__device__ int select_history(const float* score, int64_t begin, int64_t end, int slots, int32_t* out,
                              Survivor* kept, int lane) {
  float best = -INFINITY;
  int best_id = INT_MAX;
  for (int64_t base = begin; base < end; base += 32 * kSelectBatch) {  // the same trips for every lane
    const int64_t b0 = base + lane;
    float batch[kSelectBatch];
    load_score_batch(score, b0, end, batch);
#pragma unroll
    for (int i = 0; i < kSelectBatch; ++i)
      if (!isnan(batch[i]) && ranks_before(batch[i], int(b0 + 32 * i), best, best_id))
        best = batch[i], best_id = int(b0 + 32 * i);
  }
  // The threshold: the lanes' best of place slots - 1 among them (none when fewer lanes have a
  // page: every page is kept then).
  const int place = place_among_lanes(best, best_id, lane);
  const uint32_t at_threshold = __ballot_sync(0xffffffffu, best_id != INT_MAX && place == slots - 1);
  float threshold = -INFINITY;
  int threshold_id = INT_MAX;
  if (at_threshold != 0) {
    const int src = __ffs(int(at_threshold)) - 1;
    threshold = __shfl_sync(0xffffffffu, best, src);
    threshold_id = __shfl_sync(0xffffffffu, best_id, src);
  }
  int count = 0;
  for (int64_t base = begin; base < end; base += 32 * kSelectBatch) {  // the same trips for every lane
    const int64_t b0 = base + lane;
    float batch[kSelectBatch];
    load_score_batch(score, b0, end, batch);
#pragma unroll
    for (int i = 0; i < kSelectBatch; ++i) {
      const int id = int(b0 + 32 * i);
      const bool keep = !isnan(batch[i]) && !ranks_before(threshold, threshold_id, batch[i], id);  // at or above it
      const uint32_t keeping = __ballot_sync(0xffffffffu, keep);
      const int at = count + __popc(keeping & ((1u << lane) - 1u));
      if (keep && at < kSurvivors) kept[at] = Survivor{batch[i], id};
      count += __popc(keeping);
    }
  }
  if (count > kSurvivors) return select_history_lists(score, begin, end, slots, out, lane);
  __syncwarp();  // every kept page stored
  for (int i = lane; i < count; i += 32) {
    const Survivor me = kept[i];
    int rank = 0;
    for (int j = 0; j < count; ++j) {
      const Survivor other = kept[j];
      rank += ranks_before(other.score, other.id, me.score, me.id) ? 1 : 0;
    }
    if (rank < slots) out[rank] = me.id;
  }
  __syncwarp();  // the buffer is read before the next row of this warp overwrites it
  return min(count, slots);
}

__global__ void __launch_bounds__(kThreads) select_kernel(const SelectArgs a) {
  __shared__ Survivor kept[kThreads / 32][kSurvivors];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t item = int64_t(blockIdx.x) * (kThreads / 32) + warp;
  const bool in_range = item < (a.row_end - a.row_begin) * a.hi;
  const int64_t row = a.row_begin + item / a.hi;
  // The plan's positions are not a kernel's output: read while the score kernel finishes.
  const int32_t pos = in_range ? a.positions[row] : -1;
  griddep_wait();  // the page scores (launched programmatically after the score kernel)
  if (!in_range) return;
  const int g = int(item % a.hi);
  const int64_t nvis = pos < 0 ? 0 : pos / kPageSize + 1;
  int32_t* out = a.out + (int64_t(g) * a.total_q + row) * a.topk;
  int n = 0;
  if (nvis <= a.topk) {
    for (int s = lane; s < a.topk; s += 32) out[s] = s < nvis ? s : -1;
    return;
  }
  const int64_t local_begin = nvis - a.local_blocks;
  const int64_t init_end = min(int64_t(a.init_blocks), local_begin);
  const int slots = a.topk - int(init_end) - a.local_blocks;
  for (int64_t b = lane; b < init_end; b += 32) out[b] = int32_t(b);
  n = int(init_end);
  const float* score = a.scores + ((row - a.row_begin) * a.hi + g) * a.score_stride;
  if (local_begin - init_end <= 32) {
    // At most one history page a lane: its place in the order is the number of pages that
    // rank before it (31 independent comparisons instead of `slots` rounds of a warp argmax).
    const int64_t b = init_end + lane;
    float cs = -INFINITY;
    int ci = INT_MAX;
    if (b < local_begin && !isnan(score[b])) cs = score[b], ci = int(b);
    const int rank = place_among_lanes(cs, ci, lane);
    if (ci != INT_MAX && rank < slots) out[n + rank] = ci;
    n += min(slots, __popc(__ballot_sync(0xffffffffu, ci != INT_MAX)));
  } else {
    n += select_history(score, init_end, local_begin, slots, out + n, kept[warp], lane);
  }
  for (int64_t b = local_begin + lane; b < nvis; b += 32) out[n + (b - local_begin)] = int32_t(b);
  n += int(nvis - local_begin);
  for (int s = n + lane; s < a.topk; s += 32) out[s] = -1;
  griddep_launch_dependents();  // the attention may start its launch
}

// Scores of `history` logical pages for `tiles` tiles of rows. Runs of pages per CTA: as long
// as the shape allows, as short as 1, so that tiles x runs reaches the CTAs the GPU holds at
// once (SMs x CTAs per SM) when the step has that much work.
template <class Shape, bool QFp8, bool KFp8>
void launch_scores(ScoreArgs a, int64_t tiles, int64_t history, cudaStream_t stream) {
  constexpr int smem = storage_smem_bytes<ScoresStorage<Shape>>();
  auto* kernel = index_scores_kernel<Shape, QFp8, KFp8>;
  static const int per_sm = configure_and_count(kernel, Shape::kThreads, smem);
  const int64_t resident = int64_t(sm_count()) * per_sm;
  a.pages_per_cta = int(std::clamp<int64_t>(ceil_div(tiles * history, resident), 1, Shape::kMaxPagesPerCta));
  const unsigned runs = unsigned(ceil_div(history, a.pages_per_cta));
  kernel<<<dim3(unsigned(tiles), runs), Shape::kThreads, smem, stream>>>(a);
  MSA_CUDA_CHECK_LAUNCH("index_scores_kernel");
}

template <class Shape>
void launch_scores_for(bool q_fp8, bool k_fp8, const ScoreArgs& a, int64_t tiles, int64_t history, cudaStream_t s) {
  if (q_fp8 && k_fp8) launch_scores<Shape, true, true>(a, tiles, history, s);
  else if (q_fp8) launch_scores<Shape, true, false>(a, tiles, history, s);
  else if (k_fp8) launch_scores<Shape, false, true>(a, tiles, history, s);
  else launch_scores<Shape, false, false>(a, tiles, history, s);
}

}  // namespace

void paged_indexer(const InferencePlan& plan, const PagedIndexerParams& p, const RunOptions& opt) {
  DeviceGuard guard(p.index_q.device.index);
  const PlanRun run(plan.streams, opt.stream);  // after the plan's uploads; its release after this run
  const cudaStream_t stream = as_stream(opt);
  const int64_t T = plan.total_q;
  if (T == 0) return;
  const int hi = plan.topo.num_index_heads;
  const bool q_fp8 = p.index_q.dtype == DType::f8e4m3, k_fp8 = p.index_k_cache.dtype == DType::f8e4m3;
  const int64_t pages = std::max<int64_t>(1, (plan.max_seqlen_k + kPageSize - 1) / kPageSize);
  const TensorView scratch = plan.scratch_f32.view();
  const int64_t chunk_rows = scratch.shape[0];
  const int64_t score_stride = scratch.shape[1] / hi;
  // Decode: a tile is one request's Q rows (its pages are its own: rows of other requests
  // would only queue behind it), and chunks hold whole requests. Prefill: as many rows as
  // fill the large tile's vectors.
  const bool decode = plan.phase == InferencePhase::decode;
  const int64_t tile_rows = decode ? plan.q_len_per_req : std::min<int64_t>(kPrefillVectors / hi, chunk_rows);
  detail::require(chunk_rows >= tile_rows && score_stride >= pages - 1,
                  "paged_indexer: the plan's scratch does not fit this plan (build the plan on the CUDA device)");
  // index_k_cache rows are 16-byte aligned (checked in src/core/inference.cpp).

  ScoreArgs sa{};
  sa.q = static_cast<const uint8_t*>(p.index_q.data);
  sa.q_s0 = p.index_q.stride[0];
  sa.q_s1 = p.index_q.stride[1];
  sa.k = static_cast<const uint8_t*>(p.index_k_cache.data);
  sa.k_s0 = p.index_k_cache.stride[0];
  sa.k_s1 = p.index_k_cache.stride[1];
  sa.positions = static_cast<const int32_t*>(plan.positions.data());
  sa.request = static_cast<const int32_t*>(plan.query_request.data());
  sa.page_table = static_cast<const int32_t*>(plan.page_table.data());
  sa.max_pages = plan.max_pages;
  sa.hi = hi;
  sa.topk = plan.topo.topk;
  sa.scores = static_cast<float*>(plan.scratch_f32.data());
  sa.score_stride = score_stride;

  SelectArgs se{};
  se.scores = sa.scores;
  se.score_stride = score_stride;
  se.positions = sa.positions;
  se.total_q = T;
  se.hi = hi;
  se.topk = plan.topo.topk;
  se.init_blocks = plan.topo.init_blocks;
  se.local_blocks = plan.topo.local_blocks;
  se.out = p.topk.as<int32_t>();

  // Pages are read by TMA (rows 16-byte aligned, strides 16-byte multiples: checked in
  // src/core/inference.cpp; the cache has no head axis, so the map's head dimension is one)
  // except in decode over an FP8 index-K cache, whose pages index_scores_kernel widens in
  // registers.
  const bool streamed = !(decode && k_fp8);
  CUtensorMap k_map{};
  if (streamed) {
    const int64_t elem = k_fp8 ? 1 : 2;  // bytes
    k_map = paged_cache_map(p.index_k_cache.data, p.index_k_cache.shape[0], 1, int(kHeadDim * elem),
                            p.index_k_cache.stride[0] * elem, p.index_k_cache.stride[0] * elem,
                            p.index_k_cache.stride[1] * elem, "index_k_cache");
  }
  // Chunks of whole tiles; one chunk when the scratch holds every row (a last partial tile
  // costs less than a second pair of launches).
  const int64_t rows_per_chunk = chunk_rows >= T ? T : chunk_rows / tile_rows * tile_rows;
  sa.tile_rows = int(tile_rows);
  const int64_t history = std::max<int64_t>(1, pages - 1);
  for (int64_t r0 = 0; r0 < T; r0 += rows_per_chunk) {
    const int64_t r1 = std::min(T, r0 + rows_per_chunk);
    sa.row_begin = se.row_begin = r0;
    sa.row_end = se.row_end = r1;
    if (pages - 1 > plan.topo.topk - 1) {  // some row may rank history pages
      const int64_t tiles = ceil_div(r1 - r0, tile_rows);
      if (decode && streamed)
        q_fp8 ? launch_stream_scores_for<true>(int(tile_rows) * hi, sa, k_map, tiles, history, stream)
              : launch_stream_scores_for<false>(int(tile_rows) * hi, sa, k_map, tiles, history, stream);
      else if (decode) launch_scores_for<DecodeScores>(q_fp8, k_fp8, sa, tiles, history, stream);
      else if (k_fp8)
        q_fp8 ? launch_prefill_scores<true, true>(sa, k_map, tiles, history, stream)
              : launch_prefill_scores<false, true>(sa, k_map, tiles, history, stream);
      else
        q_fp8 ? launch_prefill_scores<true, false>(sa, k_map, tiles, history, stream)
              : launch_prefill_scores<false, false>(sa, k_map, tiles, history, stream);
    }
    const int64_t items = (r1 - r0) * hi;
    launch_programmatic("paged_indexer select_kernel", select_kernel, dim3(unsigned(ceil_div(items, kThreads / 32))),
                        dim3(kThreads), 0, stream, se);
  }
}

}  // namespace msa::cuda
