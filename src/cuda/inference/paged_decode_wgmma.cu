// Decode attention over a bf16 paged cache on warpgroup MMAs (sm_90a), for caches without
// scales; paged_attention.cu dispatches here and keeps its mma.sync kernel for FP8 / NVFP4.
//
// A tile's query rows and their 16 heads are the M dimension of the products: a consumer
// warpgroup computes 4 rows x 16 heads = 64 M-rows (warp w: row 4 wg + w, one m16 slice), so
// one CTA of 8 rows has two consumer warpgroups, and every page the union holds is multiplied
// once per warpgroup whose rows selected it: S = Q K^T on wgmma (Q and K from shared memory),
// the online softmax in registers (a row's heads are whole in its warp: no exchange), then
// O += P V on wgmma with P from registers. Rows of the warpgroup that did not select the page
// (and keys past a row's causal limit) get P = 0. The (split of the) union is step 1, shared
// with the mma.sync kernel (decode_pages.cuh).
//
// A producer warpgroup feeds a ring of half pages (one side, K or V, of a page: 32 KB):
//   issuer (one thread)     waits for a free slot, TMA of the two column-half boxes;
//   scanners (3 warps)      wait for a V side to land, zero its rows past the most tokens any
//                           row reads (cache slots not written yet: garbage), and flag the slot
//                           when a row that some row reads holds inf / NaN; then release it.
// A row that gets P = 0 on a key must not get 0 * inf = NaN from it (the NaN-isolation
// contract), so a flagged V side is multiplied per row on mma.sync with the keys past each
// row's limit zeroed, rows that did not select the page skipped (the mma.sync kernel's rule).
#include <cstddef>
#include <mutex>

#include "attention_state.h"
#include "core/check.h"
#include "cuda/device.cuh"
#include "cuda/inference/decode_pages.cuh"
#include "cuda/named_barriers.cuh"
#include "cuda/wgmma.cuh"

namespace msa::cuda::decode {

namespace {

using model::kGroupSize;
using model::kHeadDim;

constexpr int kRowsPerWarpgroup = 4;                  // warp w of a consumer warpgroup: one row's 16 heads
constexpr int kSideBytes = kPageSize * kHeadDim * 2;  // one side of a page: 32 KB
constexpr int kBoxBytes = kSideBytes / 2;             // one TMA box: 64 columns of the 128 rows
constexpr int kScanThreads = 96;                      // producer warps 1-3
constexpr int kSideChunks = kPageSize * kHeadDim * 2 / 16;  // 16-byte chunks of a side
constexpr int kSharedLimit = 227 * 1024;
// setmaxnreg with two consumer warpgroups: the producer warpgroup gives registers to them
// (they need more than 65536 / 384).
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
static_assert(kRowsPerWarpgroup * kGroupSize == 64, "a warpgroup's wgmma rows are 4 query rows x 16 heads");

// The CTA's shape by its consumer warpgroups (1: tiles of <= 4 rows, 2: of <= 8).
template <int Consumers>
struct DecodeShape {
  static constexpr int kThreads = 128 * (Consumers + 1);
  static constexpr int kConsumerWarps = 4 * Consumers;
  static constexpr int kSlots = Consumers == 1 ? 6 : 5;  // half pages in the ring: as many as shared memory holds
};

struct alignas(1024) Side {
  uint8_t bytes[kSideBytes];  // 128 tokens x 128 bf16, swizzled (tile_offset), as the TMA boxes land
};
struct alignas(1024) QueryTile {
  uint8_t bytes[64 * kHeadDim * 2];  // M-row 16 w + h = (tile row 4 wg + w, head h)
};

// Shared memory of the kernel, from a 1024-byte aligned base; the barriers per slot:
//   full   the slot's TMA bytes have landed (1 arrival + bytes)
//   ready  the scanners are done with it (kScanThreads arrivals; K sides pass straight through)
//   empty  every consumer warp is done with it (kConsumerWarps arrivals)
template <int Consumers>
struct DecodeStorage {
  using Shape = DecodeShape<Consumers>;
  Side slot[Shape::kSlots];
  QueryTile q[Consumers];
  SplitPages pages;
  uint64_t full[Shape::kSlots];
  uint64_t ready[Shape::kSlots];
  uint64_t empty[Shape::kSlots];
  uint32_t nonfinite[Shape::kSlots];  // V side: a row some tile row reads holds inf / NaN
  int32_t row_position[kMaxTileRows];
};

template <int Consumers>
constexpr int storage_bytes() {
  return 1024 + int(sizeof(DecodeStorage<Consumers>));
}
static_assert(storage_bytes<1>() <= kSharedLimit && storage_bytes<2>() <= kSharedLimit,
              "paged_decode_wgmma_kernel: shared memory");

// Producer warp 0, one thread: the sides of the split's pages into the ring, in order (item
// j = side j % 2 of page j / 2).
template <int Consumers>
__device__ __forceinline__ void issue_sides(DecodeStorage<Consumers>& sm, uint32_t slots, const CUtensorMap* k_map,
                                            const CUtensorMap* v_map, int g, int items) {
  constexpr int S = DecodeShape<Consumers>::kSlots;
  const uint64_t policy = l2_evict_first();
  for (int j = 0; j < items; ++j) {
    const int slot = j % S;
    if (j >= S) mbar_wait(smem_addr(&sm.empty[slot]), ((j / S) - 1) & 1);
    sm.nonfinite[slot] = 0;
    const uint32_t full = smem_addr(&sm.full[slot]);
    mbar_arrive_expect_tx(full, kSideBytes);
    const int32_t phys = sm.pages.page_physical[j / 2];
#pragma unroll
    for (int box = 0; box < 2; ++box)
      tma_load_4d(slots + uint32_t(slot * kSideBytes + box * kBoxBytes), (j & 1) ? v_map : k_map, box * 64, 0, g, phys,
                  full, policy);
  }
}

// Producer warps 1-3: V sides made safe for a product that every row of a warpgroup takes part in.
template <int Consumers>
__device__ __forceinline__ void scan_sides(DecodeStorage<Consumers>& sm, uint32_t slots, int items, int st) {
  constexpr int S = DecodeShape<Consumers>::kSlots;
  for (int j = 0; j < items; ++j) {
    const int slot = j % S;
    mbar_wait(smem_addr(&sm.full[slot]), (j / S) & 1);
    if (j & 1) {
      const int read = sm.pages.page_tokens[j / 2];  // keys past it: no row reads them
      const uint32_t side = slots + uint32_t(slot * kSideBytes);
      uint32_t bad = 0;
      for (int i = st; i < kSideChunks; i += kScanThreads) {
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
      if (__any_sync(0xffffffffu, bad != 0) && (st & 31) == 0) atomicOr(&sm.nonfinite[slot], 1u);
      fence_proxy_async();  // the zeroed rows are read by the tensor cores
    }
    mbar_arrive(smem_addr(&sm.ready[slot]));
  }
}

// One consumer warp's state: row 4 wg + w of the tile, heads gr and gr + 8 of its thread.
struct RowState {
  float o[2][8][4];  // output dims 64 half + 8 j + 2 quad (+1), the wgmma accumulator layout
  float m[2];        // running max, log2 units
  float l[2];        // this thread's share of the sum
};

// Keys of a flagged V side through mma.sync: the keys past the row's limit zeroed (selection,
// not multiplication), P of this warp's row.
__device__ __forceinline__ void pv_masked(RowState& st, const uint32_t (&p)[8][4], uint32_t v, int limit, int lane) {
  const int quad = lane & 3;
#pragma unroll
  for (int c = 0; c < kPageSize / 16; ++c) {
    if (c * 16 >= limit) break;
#pragma unroll
    for (int jj = 0; jj < kHeadDim / 16; ++jj) {
      uint32_t b[4];
      load_b_kn(b, v, kPageSize, c * 16, jj * 16, lane);
      if (c * 16 + 16 > limit) {
        const int t0 = c * 16 + 2 * quad;
        const uint32_t lo = (t0 < limit ? 0x0000ffffu : 0u) | (t0 + 1 < limit ? 0xffff0000u : 0u);
        const uint32_t hi = (t0 + 8 < limit ? 0x0000ffffu : 0u) | (t0 + 9 < limit ? 0xffff0000u : 0u);
        b[0] &= lo, b[1] &= hi, b[2] &= lo, b[3] &= hi;
      }
      const int n0 = 2 * jj, n1 = 2 * jj + 1;  // dim tiles of 8
      mma_bf16(st.o[n0 / 8][n0 % 8], p[c], b[0], b[1]);
      mma_bf16(st.o[n1 / 8][n1 % 8], p[c], b[2], b[3]);
    }
  }
}

// The online-softmax step of this warp's row over a page: S (log2 units after the scale,
// keys past `limit` at -inf) -> the rescaled state and P as bf16 A fragments.
__device__ __forceinline__ void softmax_step(RowState& st, float (&s)[16][4], uint32_t (&p)[8][4], int limit,
                                             float qk_scale, int quad) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = 8 * j + 2 * quad + (e & 1);
      const float x = t < limit ? s[j][e] * qk_scale : -INFINITY;
      s[j][e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  float use[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float mnew = fmaxf(st.m[h], warp_max4(mx[h]));
    use[h] = mnew == -INFINITY ? 0.0f : mnew;
    const float alpha = fast_exp2(st.m[h] - use[h]);
    st.m[h] = mnew;
    st.l[h] *= alpha;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        st.o[half][j][2 * h] *= alpha;
        st.o[half][j][2 * h + 1] *= alpha;
      }
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float p0 = fast_exp2(s[j][0] - use[0]), p1 = fast_exp2(s[j][1] - use[0]);
    const float p2 = fast_exp2(s[j][2] - use[1]), p3 = fast_exp2(s[j][3] - use[1]);
    st.l[0] += p0 + p1;
    st.l[1] += p2 + p3;
    p[j / 2][2 * (j & 1)] = pack_bf16(p0, p1);      // A fragment: (head gr, keys 16c + 2q ..) then + 8 keys
    p[j / 2][2 * (j & 1) + 1] = pack_bf16(p2, p3);  // (head gr + 8, same keys)
  }
}

template <int Consumers>
__device__ __forceinline__ void consume_pages(const AttnArgs& a, DecodeStorage<Consumers>& sm, uint32_t slots,
                                              uint32_t q_tile, int pages, int64_t r0, int nrows, int g, int split,
                                              int wg, int w, int lane) {
  constexpr int S = DecodeShape<Consumers>::kSlots;
  const int quad = lane & 3, gr = lane >> 2;
  const int row = kRowsPerWarpgroup * wg + w;
  const uint32_t wg_rows = ((1u << kRowsPerWarpgroup) - 1u) << (kRowsPerWarpgroup * wg);
  const int32_t pos = sm.row_position[row];
  const float qk_scale = a.softmax_scale * math::kLog2e;

  RowState st;
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int j = 0; j < 8; ++j) st.o[half][j][0] = st.o[half][j][1] = st.o[half][j][2] = st.o[half][j][3] = 0.0f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.0f;

  for (int u = 0; u < pages; ++u) {
    const uint32_t selected = sm.pages.page_rows[u];
    const bool computes = (selected & wg_rows) != 0;  // warpgroup-uniform
    const bool mine = (selected >> row) & 1u;         // warp-uniform
    const int limit = mine ? visible_keys(pos, sm.pages.page_logical[u]) : 0;

    // S = Q K^T for the warpgroup's 64 rows.
    const int jk = 2 * u, sk = jk % S;
    mbar_wait(smem_addr(&sm.ready[sk]), (jk / S) & 1);
    float s[16][4];
    if (computes) {
      const uint32_t k_side = slots + uint32_t(sk * kSideBytes);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk)
        wgmma_m64n128k16(s, tile_desc(q_tile, 64, 0, kk), tile_desc(k_side, kPageSize, 0, kk), kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_addr(&sm.empty[sk]));

    uint32_t p[8][4];
    if (computes) {
      if (mine) {
        softmax_step(st, s, p, limit, qk_scale, quad);
      } else {
#pragma unroll
        for (int c = 0; c < 8; ++c) p[c][0] = p[c][1] = p[c][2] = p[c][3] = 0u;
      }
    }

    // O += P V.
    const int jv = 2 * u + 1, sv = jv % S;
    mbar_wait(smem_addr(&sm.ready[sv]), (jv / S) & 1);
    if (computes) {
      const uint32_t v_side = slots + uint32_t(sv * kSideBytes);
      if (sm.nonfinite[sv] == 0) {
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < kPageSize / 16; ++c)
#pragma unroll
          for (int half = 0; half < 2; ++half) wgmma_m64n64k16_rs_mn(st.o[half], p[c], tile_desc_mn(v_side, kPageSize, half, c));
        wgmma_commit();
        wgmma_wait<0>();
      } else if (mine) {
        pv_masked(st, p, v_side, limit, lane);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_addr(&sm.empty[sv]));
  }

  // The row's state per head, then its outputs (normalised) and LSE.
  if (row >= nrows) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = gr + 8 * h;
    const SoftmaxState state{st.m[h], warp_sum4(st.l[h])};
    const float inv = state.inverse_sum();
    const int64_t rh = (r0 + row) * a.hq + g * kGroupSize + head;
    if (quad == 0) {
      if (a.splits == 1) a.lse[rh] = state.lse();
      else a.part_lse[int64_t(split) * a.total_q * a.hq + rh] = state.lse();
    }
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int d = 64 * half + 8 * j + 2 * quad;
        const float x0 = st.o[half][j][2 * h] * inv, x1 = st.o[half][j][2 * h + 1] * inv;
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

template <int Consumers>
__global__ void __launch_bounds__(DecodeShape<Consumers>::kThreads, 1)
    paged_decode_wgmma_kernel(const AttnArgs a, const __grid_constant__ CUtensorMap k_map,
                              const __grid_constant__ CUtensorMap v_map) {
  using Shape = DecodeShape<Consumers>;
  using Storage = DecodeStorage<Consumers>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = align1024(smem_addr(smem_raw));
  Storage& sm = *reinterpret_cast<Storage*>(smem_raw + (base - smem_addr(smem_raw)));
  const uint32_t slots = base + uint32_t(offsetof(Storage, slot));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t r0 = int64_t(blockIdx.x) * a.rows_per_tile;
  const int nrows = int(min64(a.rows_per_tile, a.total_q - r0));
  const int g = blockIdx.y, split = blockIdx.z;

  // 1. Barriers, row positions, the split's distinct pages.
  if (tid == 0)
    for (int i = 0; i < Shape::kSlots; ++i) {
      mbar_init(smem_addr(&sm.full[i]), 1);
      mbar_init(smem_addr(&sm.ready[i]), kScanThreads);
      mbar_init(smem_addr(&sm.empty[i]), Shape::kConsumerWarps);
    }
  if (tid < kMaxTileRows) sm.row_position[tid] = tid < nrows ? a.positions[r0 + tid] : -1;
  const int pages = collect_pages(a, sm.pages, r0, nrows, g, split);
  __syncthreads();  // the page list
  const int items = 2 * pages;

  if (warp >= Shape::kConsumerWarps) {  // 2. the producer warpgroup
    if constexpr (Consumers > 1) setmaxnreg_dec<kProducerRegs>();
    const int pt = tid - 32 * Shape::kConsumerWarps;
    if (pt == 0) issue_sides(sm, slots, &k_map, &v_map, g, items);
    else if (pt >= 32) scan_sides(sm, slots, items, pt - 32);
    return;
  }
  if constexpr (Consumers > 1) setmaxnreg_inc<kConsumerRegs>();

  // 3. The consumer warpgroup's query tile (rows past the tile's: zeros), then its pages.
  const int wg = warp / 4, w = warp % 4, wt = tid % 128;
  const uint32_t q_tile = base + uint32_t(offsetof(Storage, q)) + uint32_t(wg * sizeof(QueryTile));
  for (int i = wt; i < 64 * (kHeadDim * 2 / 16); i += 128) {
    const int m = i >> 4, c = i & 15;  // M-row m = 16 (row in warpgroup) + head
    const int row = kRowsPerWarpgroup * wg + m / kGroupSize, h = m % kGroupSize;
    const bool ok = row < nrows;
    const __nv_bfloat16* src = a.q + (ok ? (r0 + row) * a.q_s0 + int64_t(g * kGroupSize + h) * a.q_s1 + c * 8 : 0);
    cp_async16(q_tile + tile_offset(64, m, c), src, ok ? 16 : 0);
  }
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  sync_barrier(wg == 0 ? DecodeBarrier::kWarpgroup0 : DecodeBarrier::kWarpgroup1, 128);
  consume_pages(a, sm, slots, q_tile, pages, r0, nrows, g, split, wg, w, lane);
}

template <int Consumers>
void configure() {
  static std::once_flag once;
  std::call_once(once, [] {
    MSA_CUDA_CHECK(cudaFuncSetAttribute(paged_decode_wgmma_kernel<Consumers>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        storage_bytes<Consumers>()));
  });
}

template <int Consumers>
int ctas_per_sm() {
  configure<Consumers>();
  int n = 0;
  MSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, paged_decode_wgmma_kernel<Consumers>,
                                                               DecodeShape<Consumers>::kThreads, storage_bytes<Consumers>()));
  return n;
}

}  // namespace

void launch_wgmma(const AttnArgs& a, const CUtensorMap& k_map, const CUtensorMap& v_map, dim3 grid, cudaStream_t stream) {
  if (a.rows_per_tile <= kRowsPerWarpgroup) {
    configure<1>();
    paged_decode_wgmma_kernel<1><<<grid, DecodeShape<1>::kThreads, storage_bytes<1>(), stream>>>(a, k_map, v_map);
  } else {
    configure<2>();
    paged_decode_wgmma_kernel<2><<<grid, DecodeShape<2>::kThreads, storage_bytes<2>(), stream>>>(a, k_map, v_map);
  }
  MSA_CUDA_CHECK_LAUNCH("paged_decode_wgmma_kernel");
}

int wgmma_ctas_per_sm(int rows_per_tile) { return rows_per_tile <= kRowsPerWarpgroup ? ctas_per_sm<1>() : ctas_per_sm<2>(); }

}  // namespace msa::cuda::decode
