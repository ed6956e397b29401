// Hopper warpgroup MMA (wgmma, sm_90a) for products whose operands both sit in shared memory
// in the swizzled tile layout of device.cuh, "K-major" (the reduction dimension contiguous):
// S = A B^T with A = rows x 128 and B = n x 128 tiles. The accumulator fragment of warp w of
// the warpgroup is the mma.sync C layout of rows 16w..16w+15: d[j][0..1] = (row g, columns
// 8j + 2t, +1), d[j][2..3] = (row g + 8, same columns).
#pragma once

#include <cstdint>

#include "cuda/device.cuh"

namespace msa::cuda {

// Shared-memory matrix descriptor: 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Descriptor of k-step kk (16 columns) of rows row0.. of a tile of `rows` rows.
__device__ __forceinline__ uint64_t tile_desc(uint32_t tile, int rows, int row0, int kk) {
  return sw128_desc(tile + uint32_t((kk >> 2) * rows * 128 + row0 * 128 + (kk & 3) * 32));
}

// What k-step kk adds to the descriptor of a tile's first k-step: tile_desc(t, rows, r0, kk) ==
// tile_desc(t, rows, r0, 0) + tile_desc_step(rows, kk) (shared addresses stay below 256 KB,
// so the 14-bit address field never carries). Loops add it to a base computed once.
__host__ __device__ constexpr uint64_t tile_desc_step(int rows, int kk) {
  return uint64_t(((kk >> 2) * rows * 128 + (kk & 3) * 32) >> 4);
}

// Descriptor of k-step kk of an operand read transposed ("MN-major"): the tile's rows are the
// reduction dimension (rows 16kk..16kk+15) and column half `half` (64 columns) is the M or N
// dimension, e.g. P^T in dV += P^T dO. With 64 columns there is a single 64-wide group, so
// only the 8-row stride matters; both byte offsets are set to it.
__device__ __forceinline__ uint64_t tile_desc_mn(uint32_t tile, int rows, int half, int kk) {
  const uint32_t addr = tile + uint32_t(half * rows * 128 + kk * 16 * 128);
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1024 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Descriptor of k-step kk of a whole 128-column tile read MN-major: the M or N dimension is
// both column halves (the second `rows` * 128 bytes after the first: the leading byte offset),
// rows 16kk..16kk+15 the reduction dimension (8-row groups 1024 bytes apart).
__device__ __forceinline__ uint64_t tile_desc_mn_x128(uint32_t tile, int rows, int kk) {
  const uint32_t addr = tile + uint32_t(kk * 16 * 128);
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((rows * 128) >> 4) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Orders this thread's earlier generic-proxy shared-memory writes (cp.async, st.shared)
// before later reads by the tensor cores; follow with a barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Barrier of the 128 threads of one warpgroup on named barrier `id` (named_barriers.cuh).
__device__ __forceinline__ void warpgroup_barrier(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

// The 64 fp32 accumulators of a 64 x 128 wgmma (d[16][4]) as asm operands %0..%63.
#define MSA_WGMMA_D128_LIST "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define MSA_WGMMA_D128_OPERANDS(d) "+f"((d)[0][0]), "+f"((d)[0][1]), "+f"((d)[0][2]), "+f"((d)[0][3]), "+f"((d)[1][0]), "+f"((d)[1][1]), "+f"((d)[1][2]), "+f"((d)[1][3]), "+f"((d)[2][0]), "+f"((d)[2][1]), "+f"((d)[2][2]), "+f"((d)[2][3]), "+f"((d)[3][0]), "+f"((d)[3][1]), "+f"((d)[3][2]), "+f"((d)[3][3]), "+f"((d)[4][0]), "+f"((d)[4][1]), "+f"((d)[4][2]), "+f"((d)[4][3]), "+f"((d)[5][0]), "+f"((d)[5][1]), "+f"((d)[5][2]), "+f"((d)[5][3]), "+f"((d)[6][0]), "+f"((d)[6][1]), "+f"((d)[6][2]), "+f"((d)[6][3]), "+f"((d)[7][0]), "+f"((d)[7][1]), "+f"((d)[7][2]), "+f"((d)[7][3]), "+f"((d)[8][0]), "+f"((d)[8][1]), "+f"((d)[8][2]), "+f"((d)[8][3]), "+f"((d)[9][0]), "+f"((d)[9][1]), "+f"((d)[9][2]), "+f"((d)[9][3]), "+f"((d)[10][0]), "+f"((d)[10][1]), "+f"((d)[10][2]), "+f"((d)[10][3]), "+f"((d)[11][0]), "+f"((d)[11][1]), "+f"((d)[11][2]), "+f"((d)[11][3]), "+f"((d)[12][0]), "+f"((d)[12][1]), "+f"((d)[12][2]), "+f"((d)[12][3]), "+f"((d)[13][0]), "+f"((d)[13][1]), "+f"((d)[13][2]), "+f"((d)[13][3]), "+f"((d)[14][0]), "+f"((d)[14][1]), "+f"((d)[14][2]), "+f"((d)[14][3]), "+f"((d)[15][0]), "+f"((d)[15][1]), "+f"((d)[15][2]), "+f"((d)[15][3])
// ... and the 32 of a 64 x 64 wgmma (d[8][4]).
#define MSA_WGMMA_D64_LIST "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MSA_WGMMA_D64_OPERANDS(d) "+f"((d)[0][0]), "+f"((d)[0][1]), "+f"((d)[0][2]), "+f"((d)[0][3]), "+f"((d)[1][0]), "+f"((d)[1][1]), "+f"((d)[1][2]), "+f"((d)[1][3]), "+f"((d)[2][0]), "+f"((d)[2][1]), "+f"((d)[2][2]), "+f"((d)[2][3]), "+f"((d)[3][0]), "+f"((d)[3][1]), "+f"((d)[3][2]), "+f"((d)[3][3]), "+f"((d)[4][0]), "+f"((d)[4][1]), "+f"((d)[4][2]), "+f"((d)[4][3]), "+f"((d)[5][0]), "+f"((d)[5][1]), "+f"((d)[5][2]), "+f"((d)[5][3]), "+f"((d)[6][0]), "+f"((d)[6][1]), "+f"((d)[6][2]), "+f"((d)[6][3]), "+f"((d)[7][0]), "+f"((d)[7][1]), "+f"((d)[7][2]), "+f"((d)[7][3])

// d (64 x 128) = (accumulate ? d : 0) + A (64 x 16) B^T (B: 128 x 16), on bf16 operands, or
// on f16 operands with kF16 (e.g. E4M3 codes widened to f16, which holds them exactly).
template <bool kF16 = false>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[16][4], uint64_t da, uint64_t db, int accumulate) {
  if constexpr (kF16)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " MSA_WGMMA_D128_LIST ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : MSA_WGMMA_D128_OPERANDS(d)
                 : "l"(da), "l"(db), "r"(accumulate));
  else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MSA_WGMMA_D128_LIST ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : MSA_WGMMA_D128_OPERANDS(d)
                 : "l"(da), "l"(db), "r"(accumulate));
}

// d (64 x 128) = (accumulate ? d : 0) + A (64 x 32) B^T (B: 128 x 32) on E4M3 codes, both
// K-major (8-bit operands have no transposed form): a k-step is 32 bytes, as a bf16 one, so
// tile_desc(t, rows, r0, kk) for kk < 4 walks the 128 codes of a row in the first column half.
// The products are exact; the tensor core sums them in a narrower adder than fp32.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[16][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MSA_WGMMA_D128_LIST ", %64, %65, p, 1, 1;\n}\n"
               : MSA_WGMMA_D128_OPERANDS(d)
               : "l"(da), "l"(db), "r"(accumulate));
}

// d (64 x 64) = (accumulate ? d : 0) + A (64 x 16) B^T (B: 64 x 16). kTransA / kTransB: the
// operand's descriptor is MN-major (tile_desc_mn) instead of K-major.
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[8][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MSA_WGMMA_D64_LIST ", %32, %33, p, 1, 1, %35, %36;\n}\n"
      : MSA_WGMMA_D64_OPERANDS(d)
      : "l"(da), "l"(db), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

// d (64 x 128) = (accumulate ? d : 0) + A (64 x 16) B^T (B: 128 x 16), A from registers in the
// mma.sync A-fragment layout of each warp's 16 rows (a[0..3] as in device.cuh), which is
// also what packing this warp's rows of an accumulator d[2k], d[2k + 1] to bf16 gives.
// kTransB: B read MN-major (tile_desc_mn_x128: the tile's rows are the reduction dimension),
// e.g. O = P V with V's tokens as rows of both column halves.
template <int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db,
                                                    int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MSA_WGMMA_D128_LIST ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
               : MSA_WGMMA_D128_OPERANDS(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(kTransB));
}

// d (64 x 64) = d + A (64 x 16) B (16 x 64), A from registers as in wgmma_m64n128k16_rs and B
// read MN-major (tile_desc_mn: the tile's rows are the reduction dimension), e.g. O += P V with
// V's tokens as rows; bf16 operands, or f16 with kF16.
template <bool kF16 = false>
__device__ __forceinline__ void wgmma_m64n64k16_rs_mn(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (kF16)
    asm volatile("{\n.reg .pred p;\nsetp.eq.b32 p, 1, 1;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " MSA_WGMMA_D64_LIST ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : MSA_WGMMA_D64_OPERANDS(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  else
    asm volatile("{\n.reg .pred p;\nsetp.eq.b32 p, 1, 1;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MSA_WGMMA_D64_LIST ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : MSA_WGMMA_D64_OPERANDS(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

}  // namespace msa::cuda
