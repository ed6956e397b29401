// The indexer's selected-block LSE, after the selection: a row keeps 16 of its up to
// thousands of visible blocks, so the exponentials are spent on those 16 only (the indexer
// itself would have to sum every block that enters a running list, ~5x as many at 128k).
//
// Per launch batch of documents the selection's edges (index head g, query row, slot) are
// bucketed by (g, document, key block): count, scan, scatter. The buckets are cut into chunks
// of 64 edges; persistent CTAs walk the chunks in bucket order, so a key block is loaded once
// for all the chunks of a CTA that read it. A chunk's 64 query vectors are gathered, scored
// against the block on wgmma (the indexer's product), and each row's block LSE over its causal
// keys lands in its (g, row, slot) cell. Then one thread per (g, row) combines its slots.
// Every value is computed from its own row alone: the result does not depend on the bucketing.
#include "cuda/selected_lse.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include <cub/block/block_scan.cuh>

#include "attention_state.h"
#include "msa/constants.h"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/scratch.h"
#include "cuda/wgmma.cuh"

namespace msa::cuda {
namespace {

constexpr int kBlock = model::kBlockSize;  // keys of a block
constexpr int kDim = model::kHeadDim;      // index head dim
constexpr int kTopk = model::kTopk;
constexpr int kSlotBits = 4;               // an edge is (row << 4) | slot
static_assert(kTopk == 1 << kSlotBits);
constexpr int kChunk = 64;                 // edges of a chunk: one m64 wgmma tile of query rows
constexpr int kThreads = 128;              // one warpgroup
constexpr int kCtasPerSm = 2;              // shared memory allows two
constexpr int kNFrags = kBlock / 8;        // n8 accumulator fragments across a key block
constexpr int kMaxDocs = 256;              // documents per launch batch (kernel parameter space)
constexpr int kScanThreads = 1024;
constexpr int kBucketRows = 256;  // rows (one index head, one document) of a bucketing CTA
constexpr int kWindow = 4096;     // key blocks a bucketing CTA counts in shared memory (512k
                                  // tokens); later ones go straight to the global counters

// What the epilogue of a chunk needs, written with its gather (its edges go to
// LseStorage::edges): index head, document, key block (bucket = the three together), edges in use.
struct ChunkInfo {
  int32_t bucket, g, di, j, n;
};
// A ring of kStages chunks' query rows (the current one and kAhead gathered ahead) and the
// current key block: a CTA's chunks run through a bucket, so the block changes rarely and is
// then loaded once the ring's earlier chunks are done with the old one.
constexpr int kStages = 4;
constexpr int kAhead = kStages - 1;
struct alignas(1024) KeyTile {
  unsigned char bytes[kBlock * kDim * 2];
};
struct alignas(1024) QueryTile {
  unsigned char bytes[kChunk * kDim * 2];
};
struct LseStorage {
  KeyTile key;
  QueryTile queries[kStages];
  int32_t edges[kStages][kChunk];  // -1 past n
  ChunkInfo info[kStages];
};
constexpr int kSmemBytes = storage_smem_bytes<LseStorage>();
static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024);

// A launch batch: the documents in it, their query rows and key blocks numbered batch-locally.
struct LseDocs {
  int32_t tile_begin[kMaxDocs + 1];   // prefix of bucketing tiles: Hi x ceil(q_len / kBucketRows)
  int32_t q_begin[kMaxDocs + 1];      // prefix of query rows
  int32_t block_begin[kMaxDocs + 1];  // prefix of key blocks, ceil(k_len / 128)
  int32_t q_start[kMaxDocs], q_len[kMaxDocs], k_start[kMaxDocs], k_len[kMaxDocs];
  int32_t count;
};

struct LseArgs {
  const __nv_bfloat16* iq;  // [Tq, Hi, 128]
  const __nv_bfloat16* ik;  // [Tk, 1, 128]
  const int32_t* topk;      // [Hi, Tq, 16]
  float* edge_lse;          // [Hi, Tq, 16]: block LSE of each selected (g, row, slot)
  int64_t total_q, total_k;
  int Hi;
  float lse_scale_log2;  // index scale / temperature * log2(e)
};

// A batch's bucket tables: bucket b = g * blocks + batch-local block.
struct Buckets {
  int32_t* cursor;        // [n]: counts, then the scatter's next free edge
  int32_t* offset;        // [n + 1]: first edge of each bucket
  int32_t* chunk_begin;   // [n + 1]: first chunk of each bucket
  int32_t* edges;         // [edges of the batch]: (row << 4) | slot, grouped by bucket
  int32_t n, blocks;      // buckets, batch key blocks
};

// The last i in [0, n) with v[i] <= x (v ascending, v[0] <= x).
__device__ __forceinline__ int last_at_most(const int32_t* v, int n, int32_t x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (v[mid] <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// count (kScatter false) or scatter the batch's edges. A CTA takes kBucketRows rows of one
// index head and one document and counts its edges per key block in shared memory first: rows
// share their local blocks and often their best ones, and same-address global atomics
// serialise. One global atomic per (CTA, block) then reserves the CTA's range of a bucket.
template <bool kScatter>
__global__ void __launch_bounds__(kBucketRows) lse_bucket_kernel(const LseArgs a, const LseDocs d, const Buckets b) {
  __shared__ int32_t count[kWindow];
  __shared__ int32_t first[kScatter ? kWindow : 1];  // the CTA's first edge in each bucket
  const int tid = threadIdx.x;
  const int di = last_at_most(d.tile_begin, d.count, int32_t(blockIdx.x));
  const int q_tiles = (d.q_len[di] + kBucketRows - 1) / kBucketRows;
  const int local = int(blockIdx.x) - d.tile_begin[di];
  const int g = local / q_tiles, i0 = (local % q_tiles) * kBucketRows;
  const int rows = min(kBucketRows, d.q_len[di] - i0);
  // Blocks this CTA's rows can select: up to its last row's own block.
  const int window = min(kWindow, (d.k_len[di] - d.q_len[di] + i0 + rows - 1) / kBlock + 1);
  for (int x = tid; x < window; x += kBucketRows) count[x] = 0;
  __syncthreads();

  const bool valid = tid < rows;
  const int64_t row = int64_t(d.q_start[di]) + i0 + tid;
  const int32_t base = g * b.blocks + d.block_begin[di];
  int32_t id[kTopk], rank[kTopk];
  const int4* src = reinterpret_cast<const int4*>(a.topk + (int64_t(g) * a.total_q + row) * kTopk);
#pragma unroll
  for (int v = 0; v < kTopk / 4; ++v) {
    const int4 x = valid ? src[v] : make_int4(-1, -1, -1, -1);
    id[4 * v] = x.x;
    id[4 * v + 1] = x.y;
    id[4 * v + 2] = x.z;
    id[4 * v + 3] = x.w;
  }
  const int32_t edge0 = int32_t(row << kSlotBits);
#pragma unroll
  for (int e = 0; e < kTopk; ++e) {
    rank[e] = 0;
    if (id[e] < 0) continue;
    if (id[e] < kWindow) {
      rank[e] = atomicAdd(&count[id[e]], 1);
    } else if constexpr (kScatter) {
      b.edges[atomicAdd(&b.cursor[base + id[e]], 1)] = edge0 | e;
    } else {
      atomicAdd(&b.cursor[base + id[e]], 1);
    }
  }
  __syncthreads();
  for (int x = tid; x < window; x += kBucketRows) {
    const int32_t c = count[x];
    if (c == 0) continue;
    if constexpr (kScatter) {
      first[x] = atomicAdd(&b.cursor[base + x], c);
    } else {
      atomicAdd(&b.cursor[base + x], c);
    }
  }
  if constexpr (kScatter) {
    __syncthreads();
#pragma unroll
    for (int e = 0; e < kTopk; ++e)
      if (id[e] >= 0 && id[e] < kWindow) b.edges[first[id[e]] + rank[e]] = edge0 | e;
  }
}

// One CTA: offsets and chunk starts from the counts; the counts become the scatter cursors.
__global__ void __launch_bounds__(kScanThreads) lse_scan_kernel(const Buckets b) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int32_t carry_edges, carry_chunks;
  if (threadIdx.x == 0) carry_edges = carry_chunks = 0;
  __syncthreads();
  for (int base = 0; base < b.n; base += kScanThreads) {
    const int i = base + int(threadIdx.x);
    const int32_t count = i < b.n ? b.cursor[i] : 0;
    int32_t edge_pos, chunk_pos, edges_total, chunks_total;
    Scan(temp).ExclusiveSum(count, edge_pos, edges_total);
    __syncthreads();
    Scan(temp).ExclusiveSum((count + kChunk - 1) / kChunk, chunk_pos, chunks_total);
    const int32_t e0 = carry_edges, c0 = carry_chunks;
    if (i < b.n) {
      b.offset[i] = e0 + edge_pos;
      b.cursor[i] = e0 + edge_pos;
      b.chunk_begin[i] = c0 + chunk_pos;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry_edges = e0 + edges_total;
      carry_chunks = c0 + chunks_total;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    b.offset[b.n] = carry_edges;
    b.chunk_begin[b.n] = carry_chunks;
  }
}

// A chunk of a bucket: index head g, document di of the batch, its key block j, and edges
// [edge0, edge0 + n) of b.edges. A CTA's chunks are consecutive: `advance` steps to the next
// one from the bucket's end kept here (a search per chunk would put a chain of dependent
// global loads in front of every chunk).
struct Chunk {
  int bucket, g, di, j, edge0, n;
  int chunk, chunk_end, edge_end;  // this chunk's number; its bucket's chunk and edge ends

  __device__ void enter(const LseDocs& d, const Buckets& b, int c, int bk) {
    bucket = bk;
    const int bb = bk % b.blocks;
    g = bk / b.blocks;
    di = last_at_most(d.block_begin, d.count, bb);
    j = bb - d.block_begin[di];
    chunk = c;
    chunk_end = b.chunk_begin[bk + 1];
    edge_end = b.offset[bk + 1];
    edge0 = b.offset[bk] + kChunk * (c - b.chunk_begin[bk]);
    n = min(kChunk, edge_end - edge0);
  }
  // Chunk c: the last bucket starting at or before c holds it (empty buckets start where the
  // next one does).
  __device__ void find(const LseDocs& d, const Buckets& b, int c) { enter(d, b, c, last_at_most(b.chunk_begin, b.n, c)); }
  __device__ void advance(const LseDocs& d, const Buckets& b) {
    if (chunk + 1 < chunk_end) {
      ++chunk;
      edge0 += kChunk;
      n = min(kChunk, edge_end - edge0);
      return;
    }
    int bk = bucket + 1;
    while (b.chunk_begin[bk + 1] <= chunk + 1) ++bk;  // skip empty buckets
    enter(d, b, chunk + 1, bk);
  }
  __device__ ChunkInfo info() const { return {bucket, g, di, j, n}; }
};

// This lane's row (E = 0: row a, E = 2: row b of its quad) of the chunk: the block LSE over its
// causal keys into its edge_lse cell (`edge`: the row's edge, -1 past the chunk's n). Called by
// all 32 lanes (quad shuffles).
template <int E>
__device__ __forceinline__ void row_block_lse(const LseArgs& a, const LseDocs& d, const ChunkInfo& ch,
                                              const float (&s)[kNFrags][4], int32_t edge, int t) {
  const bool on = edge >= 0;
  const int64_t row = edge >> kSlotBits;
  const int pos = d.k_len[ch.di] - d.q_len[ch.di] + int(row - d.q_start[ch.di]);
  const int visible = on ? min(kBlock, pos - ch.j * kBlock + 1) : 0;
  // Keys at or past `visible` as -inf (they change neither the max nor the sum); maxima and
  // sums in four independent chains, so that the SFU and FMA latencies overlap.
  float x[kNFrags][2];
#pragma unroll
  for (int nt = 0; nt < kNFrags; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) x[nt][e] = nt * 8 + 2 * t + e < visible ? s[nt][E + e] : -INFINITY;
  float m4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < kNFrags; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) m4[(nt & 1) * 2 + e] = max_nan(m4[(nt & 1) * 2 + e], x[nt][e]);
  float m = max_nan(max_nan(m4[0], m4[1]), max_nan(m4[2], m4[3]));
  m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 2));
  // The block max (NaN-propagating) scaled; a non-finite one is the block's LSE as it is.
  const float c = a.lse_scale_log2, top = m * c;
  float sum = 0.f;
  if (isfinite(top)) {
    float s4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < kNFrags; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) s4[(nt & 1) * 2 + e] += fast_exp2(x[nt][e] * c - top);
    sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  }
  sum = warp_sum4(sum);
  if (on && t == 0)
    a.edge_lse[(int64_t(ch.g) * a.total_q + row) * kTopk + (edge & (kTopk - 1))] =
        isfinite(top) ? (top + __log2f(sum)) * math::kLn2 : top * math::kLn2;
}

__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    lse_blocks_kernel(const LseArgs a, const LseDocs d, const Buckets b) {
  extern __shared__ __align__(128) unsigned char smem[];
  LseStorage& sm = shared_storage<LseStorage>(smem);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3;
  const int total = b.chunk_begin[b.n];
  const int c_begin = int(int64_t(total) * blockIdx.x / gridDim.x);
  const int c_end = int(int64_t(total) * (blockIdx.x + 1) / gridDim.x);
  if (c_begin >= c_end) return;

  // Chunk c is gathered (query rows by cp.async, its edges and info into the ring) kAhead
  // iterations before it is scored, and its edges are read from global memory one chunk before
  // that: neither latency sits in front of a product.
  constexpr int kGatherRows = kChunk * 16 / kThreads;  // rows a thread copies a 16-byte column of
  int32_t ahead_edges[kGatherRows];                     // rows (tid >> 4) + 8k of `ahead`
  Chunk ahead;  // the next chunk to gather
  auto load_edges = [&] {
#pragma unroll
    for (int k = 0; k < kGatherRows; ++k) {
      const int r = (tid >> 4) + k * (kThreads / 16);
      ahead_edges[k] = r < ahead.n ? b.edges[ahead.edge0 + r] : -1;
    }
  };
  auto gather = [&](int c) {  // chunk c (== ahead.chunk) into its stage; an empty group past the end
    if (c < c_end) {
      const int stage = (c - c_begin) % kStages;
      const uint32_t q = smem_addr(&sm.queries[stage]);
#pragma unroll
      for (int k = 0; k < kGatherRows; ++k) {
        const int r = (tid >> 4) + k * (kThreads / 16), c16 = tid & 15;
        const bool ok = ahead_edges[k] >= 0;
        const int64_t row = ok ? ahead_edges[k] >> kSlotBits : 0;
        cp_async16(q + tile_offset(kChunk, r, c16), a.iq + (row * a.Hi + ahead.g) * kDim + c16 * 8, ok ? 16 : 0);
        if (c16 == 0) sm.edges[stage][r] = ahead_edges[k];
      }
      if (tid == 0) sm.info[stage] = ahead.info();
      if (c + 1 < c_end) {
        ahead.advance(d, b);
        load_edges();
      }
    }
    cp_async_commit();  // every iteration then waits on the same number of newer groups
  };

  ahead.find(d, b, c_begin);
  load_edges();
#pragma unroll
  for (int i = 0; i < kAhead; ++i) gather(c_begin + i);
  int key_bucket = -1;
  const int ra = 16 * warp + (lane >> 2);
  float s[kNFrags][4];
  for (int c = c_begin; c < c_end; ++c) {
    gather(c + kAhead);  // into the stage chunk c - 1 used
    const int stage = (c - c_begin) % kStages;
    cp_async_wait<kAhead>();
    fence_proxy_async();
    __syncthreads();
    const ChunkInfo ch = sm.info[stage];
    if (ch.bucket != key_bucket) {  // every chunk before c is done with the old block
      const int64_t k0 = int64_t(d.k_start[ch.di]) + int64_t(ch.j) * kBlock;
      load_tile_async(smem_addr(&sm.key), kBlock, 0, a.ik + k0 * kDim, kDim, kBlock,
                      a.total_k - k0 < kBlock ? int(a.total_k - k0) : kBlock, tid, kThreads);
      cp_async_commit();
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();
      key_bucket = ch.bucket;
    }
    const uint32_t q = smem_addr(&sm.queries[stage]), k = smem_addr(&sm.key);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_m64n128k16(s, tile_desc(q, kChunk, 0, kk), tile_desc(k, kBlock, 0, kk), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    row_block_lse<0>(a, d, ch, s, sm.edges[stage][ra], t);
    row_block_lse<2>(a, d, ch, s, sm.edges[stage][ra + 8], t);
    __syncthreads();  // the next gather rewrites this stage, a block change the key tile
  }
}

// One thread per (g, row): the LSE of its selected slots' block LSEs, in slot order.
__global__ void lse_combine_kernel(const LseArgs a, float* __restrict__ sel_lse) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(a.Hi) * a.total_q) return;
  const int4* ids = reinterpret_cast<const int4*>(a.topk + idx * kTopk);
  const float4* cells = reinterpret_cast<const float4*>(a.edge_lse + idx * kTopk);
  LogSumExp acc;
#pragma unroll
  for (int v = 0; v < kTopk / 4; ++v) {
    const int4 id = ids[v];
    const float4 x = cells[v];
    if (id.x >= 0) acc.add(x.x);
    if (id.y >= 0) acc.add(x.y);
    if (id.z >= 0) acc.add(x.z);
    if (id.w >= 0) acc.add(x.w);
  }
  sel_lse[idx] = acc.result();
}

}  // namespace

void check_selected_lse_size(const PackedLayout& L) {
  if (L.total_q() >= (int64_t(1) << (31 - kSlotBits)))
    throw Error(ErrorKind::unsupported, "select_blocks: selected_lse on CUDA supports total_q below 2^27, got " +
                                            std::to_string(L.total_q()));
}

void selected_lse(const Topology& topo, const PackedLayout& L, const SelectBlocksParams& p, cudaStream_t s) {
  LseArgs a{};
  a.iq = p.index_q.as<const __nv_bfloat16>();
  a.ik = p.index_k.as<const __nv_bfloat16>();
  a.topk = p.topk.as<const int32_t>();
  a.total_q = L.total_q();
  a.total_k = p.index_k.shape[0];
  a.Hi = topo.num_index_heads;
  a.lse_scale_log2 = topo.indexer_scale() / p.lse_temperature * math::kLog2e;
  if (a.total_q == 0) return;

  // Launch batches of documents, each with fewer than 2^30 edges and buckets (int32 offsets).
  std::vector<LseDocs> batches(1);
  int64_t max_buckets = 0, max_edges = 0;
  auto batch_sizes = [&](const LseDocs& d) {
    return std::pair<int64_t, int64_t>(int64_t(a.Hi) * d.block_begin[d.count], int64_t(a.Hi) * d.q_begin[d.count] * kTopk);
  };
  for (int doc = 0; doc < L.num_documents(); ++doc) {
    const DocumentSpan& span = L.document(doc);
    if (span.q_len == 0) continue;
    const int64_t blocks = ceil_div(span.k_len, kBlock);
    LseDocs* d = &batches.back();
    const auto [nb, ne] = batch_sizes(*d);
    if (d->count == kMaxDocs || nb + a.Hi * blocks >= (int64_t(1) << 30) ||
        ne + a.Hi * span.q_len * kTopk >= (int64_t(1) << 30)) {
      batches.emplace_back();
      d = &batches.back();
    }
    const int i = d->count++;
    d->q_start[i] = int32_t(span.q_start);
    d->q_len[i] = int32_t(span.q_len);
    d->k_start[i] = int32_t(span.k_start);
    d->k_len[i] = int32_t(span.k_len);
    d->q_begin[i + 1] = d->q_begin[i] + int32_t(span.q_len);
    d->tile_begin[i + 1] = d->tile_begin[i] + int32_t(a.Hi * ceil_div(span.q_len, kBucketRows));
    d->block_begin[i + 1] = d->block_begin[i] + int32_t(blocks);
  }
  for (const LseDocs& d : batches) {
    const auto [nb, ne] = batch_sizes(d);
    max_buckets = std::max(max_buckets, nb);
    max_edges = std::max(max_edges, ne);
  }
  if (max_edges == 0) return;

  StreamScratch edge_lse(int64_t(a.Hi) * a.total_q * kTopk * 4, s);
  StreamScratch tables(3 * (max_buckets + 1) * 4, s), edges(max_edges * 4, s);
  a.edge_lse = edge_lse.as<float>();
  Buckets b{};
  b.cursor = tables.as<int32_t>();
  b.offset = b.cursor + (max_buckets + 1);
  b.chunk_begin = b.offset + (max_buckets + 1);
  b.edges = edges.as<int32_t>();

  MSA_CUDA_CHECK(cudaFuncSetAttribute(lse_blocks_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const int max_ctas = kCtasPerSm * sm_count();
  for (const LseDocs& d : batches) {
    if (d.count == 0) continue;
    const auto [nb, ne] = batch_sizes(d);
    b.n = int32_t(nb);
    b.blocks = d.block_begin[d.count];
    const int grid = d.tile_begin[d.count];
    MSA_CUDA_CHECK(cudaMemsetAsync(b.cursor, 0, size_t(nb) * 4, s));
    lse_bucket_kernel<false><<<grid, kBucketRows, 0, s>>>(a, d, b);
    MSA_CUDA_CHECK_LAUNCH("lse_bucket_kernel<count>");
    lse_scan_kernel<<<1, kScanThreads, 0, s>>>(b);
    MSA_CUDA_CHECK_LAUNCH("lse_scan_kernel");
    lse_bucket_kernel<true><<<grid, kBucketRows, 0, s>>>(a, d, b);
    MSA_CUDA_CHECK_LAUNCH("lse_bucket_kernel<scatter>");
    // Chunks at most: one per 64 edges plus a partial one per bucket.
    const int64_t chunks = ne / kChunk + nb;
    lse_blocks_kernel<<<int(std::min<int64_t>(chunks, max_ctas)), kThreads, kSmemBytes, s>>>(a, d, b);
    MSA_CUDA_CHECK_LAUNCH("lse_blocks_kernel");
  }
  const int64_t vectors = int64_t(a.Hi) * a.total_q;
  lse_combine_kernel<<<int(ceil_div(vectors, 256)), 256, 0, s>>>(a, p.selected_lse.as<float>());
  MSA_CUDA_CHECK_LAUNCH("lse_combine_kernel");
}

}  // namespace msa::cuda
