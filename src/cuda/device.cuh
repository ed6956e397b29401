// Device-side building blocks: bf16 tensor-core MMA (m16n8k16), ldmatrix, cp.async and the
// swizzled shared-memory tile of 128 bf16 columns that every attention kernel uses.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A 16x16: a0 (row g, cols 2t..2t+1), a1 (row g+8, cols 2t..), a2 (row g, cols 2t+8..), a3 (row g+8, cols 2t+8..)
//   B 16x8:  b0 (k rows 2t..2t+1, col g), b1 (k rows 2t+8.., col g)
//   C 16x8:  c0 c1 (row g, cols 2t, 2t+1), c2 c3 (row g+8, cols 2t, 2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace msa::cuda {

// d += A B (m16n8k16, fp32 accumulators) on bf16 operands, or on f16 operands with kF16.
template <bool kF16 = false>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kF16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_16816<false>(d, a, b0, b1);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte asynchronous global -> shared copy; bytes beyond `src_bytes` (0 or 16) are zero.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 4-byte asynchronous global -> shared copy (through L1).
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// A tile of `rows` rows of 128 bf16 in shared memory, in the layout wgmma reads with 128-byte
// swizzling: two column halves (elements 0-63 and 64-127), each `rows` x 128 bytes; the
// 16-byte chunk c of row r within a half sits at chunk c ^ (r & 7). Tiles start at a
// multiple of 1024 bytes. The same layout keeps the 8 row addresses of an ldmatrix in 8
// different bank groups.
__device__ __forceinline__ uint32_t tile_offset(int rows, int row, int chunk) {
  return uint32_t((chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// Stores a warp's 16 rows x 16 columns of bf16, held in the mma.sync accumulator layout (the
// bf16 pairs of row g and row g + 8 for column tiles c and c + 1: lo_c, hi_c, lo_c1, hi_c1),
// into rows r16.. and 16-byte chunks 2 * pair, 2 * pair + 1 of a tile: one stmatrix instead of
// four 4-byte stores per thread. The lane addresses mirror load_a.
__device__ __forceinline__ void store_rows_x16(uint32_t tile, int rows, int r16, int pair, int lane, uint32_t lo_c,
                                               uint32_t hi_c, uint32_t lo_c1, uint32_t hi_c1) {
  const uint32_t addr = tile + tile_offset(rows, r16 + (lane & 15), 2 * pair + (lane >> 4));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(lo_c), "r"(hi_c),
               "r"(lo_c1), "r"(hi_c1)
               : "memory");
}

// A fragment (16 rows x 16 columns at (row0, col0)) of a row-major tile.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], uint32_t tile, int rows, int row0, int col0, int lane) {
  const int row = row0 + (lane & 15);
  const int chunk = (col0 >> 3) + (lane >> 4);
  ldmatrix_x4(a, tile + tile_offset(rows, row, chunk));
}

// B fragments of two n-tiles (n0, n0 + 8) over k = col0..col0+15, when the tile stores B
// transposed (rows = n, columns = k), e.g. K for S = Q K^T: b[0], b[1] for n-tile n0 and
// b[2], b[3] for n-tile n0 + 8.
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], uint32_t tile, int rows, int n0, int col0, int lane) {
  const int row = n0 + (lane & 7) + ((lane >> 4) << 3);
  const int chunk = (col0 >> 3) + ((lane >> 3) & 1);
  ldmatrix_x4(b, tile + tile_offset(rows, row, chunk));
}

// B fragments of two n-tiles (col0, col0 + 8) over k = k0..k0+15, when the tile stores B
// as rows = k, columns = n, e.g. V for O = P V.
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], uint32_t tile, int rows, int k0, int col0, int lane) {
  const int row = k0 + (lane & 7) + (((lane >> 3) & 1) << 3);
  const int chunk = (col0 >> 3) + (lane >> 4);
  ldmatrix_x4_trans(b, tile + tile_offset(rows, row, chunk));
}

// A fragments of the transpose of a tile: A = T^T (16 x 16 at A-rows m0, A-cols k0), where T
// stores rows = k, columns = m (e.g. P^T from a [query rows, keys] tile of P).
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], uint32_t tile, int rows, int m0, int k0, int lane) {
  // a0: m 0-7, k 0-7; a1: m 8-15, k 0-7; a2: m 0-7, k 8-15; a3: m 8-15, k 8-15.
  const int mat = lane >> 3;
  const int row = k0 + (lane & 7) + ((mat >> 1) << 3);
  const int chunk = (m0 >> 3) + (mat & 1);
  ldmatrix_x4_trans(a, tile + tile_offset(rows, row, chunk));
}

// Copies `count` rows of 128 elements of T (bf16, or 8-bit codes: a row then fills only the
// first column half; row stride `src_stride` elements) into rows row0.. of a tile of `rows`
// rows; rows at or beyond `valid` (counted from row0) are zero-filled. Threads [0, nthreads)
// take part.
template <typename T>
__device__ __forceinline__ void load_tile_async(uint32_t tile, int rows, int row0, const T* src, int64_t src_stride,
                                                int count, int valid, int tid, int nthreads) {
  constexpr int kChunks = 128 * int(sizeof(T)) / 16, kPerChunk = 16 / int(sizeof(T));
  for (int i = tid; i < count * kChunks; i += nthreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool ok = r < valid;
    const T* s = src + (ok ? int64_t(r) * src_stride + c * kPerChunk : 0);
    cp_async16(tile + tile_offset(rows, row0 + r, c), s, ok ? 16 : 0);
  }
}

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ void st_shared_v4_zero(uint32_t addr) {
  asm volatile("st.shared.v4.b32 [%0], {%1,%1,%1,%1};\n" ::"r"(addr), "r"(0) : "memory");
}

// 2^x on the SFU without exp2f's denormal rescaling (results below 2^-126 flush to 0, far
// under bf16 resolution relative to the row maximum that softmax subtracts).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 16-byte global store (one STG.128 whatever the compiler knows about the pointer).
__device__ __forceinline__ void st_global_v4(void* ptr, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Shared-memory mbarriers (producer / consumer hand-off inside a CTA).
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "MSA_MBAR_WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra MSA_MBAR_WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Arrives on the barrier and raises the bytes its current phase waits for by `bytes` (TMA).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// L2 policies for the copies below: evict_last for data read again soon (it outlives the
// streams around it), evict_first for data written once and not read back while cached,
// evict_normal for data read a few times by whichever SM comes next.
__device__ __forceinline__ uint64_t l2_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t l2_evict_normal() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

// TMA copies of one box of a 2-D tensor map (tensor_map.h) at column c0, row c1, with an L2
// policy. The load signals `bar` with its bytes; stores form bulk groups (commit, then wait
// until the source has been read).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint32_t bar,
                                            uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
      "%3}], [%4], %5;\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
      : "memory");
}
// The same for a 3-D map (tensor_map.h's head tiles): column c0, head c1, token c2.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar,
                                            uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
      "%3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(policy)
      : "memory");
}
// The same for a 4-D map (tensor_map.h's cache pages): column c0, row c1, head c2, page c3.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* map, int c0, int c1, int c2, int c3, uint32_t bar,
                                            uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
      "%3, %4, %5}], [%6], %7;\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(policy)
      : "memory");
}
// Brings `bytes` (a multiple of 16, from a 16-byte aligned address) of global memory into L2.
// One operation of the SM's TMA unit: its address is a uniform operand, so a warp whose lanes
// give different addresses issues one operation per lane, one after the other.
__device__ __forceinline__ void prefetch_l2_bulk(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
// Brings the 128-byte line holding `src` into L2 (a per-thread load-store instruction).
__device__ __forceinline__ void prefetch_l2_line(const void* src) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(src));
}
// ... into L1 as well (read later by this SM).
__device__ __forceinline__ void prefetch_l1_line(const void* src) {
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(src));
}
__device__ __forceinline__ void tma_store_2d(const void* map, int c0, int c1, uint32_t src, uint64_t policy) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group.L2::cache_hint [%0, {%1, %2}], [%3], %4;\n" ::"l"(
                   map),
               "r"(c0), "r"(c1), "r"(src), "l"(policy)
               : "memory");
}
// Adds a box of shared memory into the global tensor of `map` at (c0, c1), element by element
// in L2 (the tensor's dtype; no atomics from the SM's threads).
__device__ __forceinline__ void tma_reduce_add_2d(const void* map, int c0, int c1, uint32_t src) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   map),
               "r"(c0), "r"(c1), "r"(src)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// ... and until their writes to global memory are done.
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1,%2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

// Barrier of `threads` threads on named barrier `id` (0 is __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same barrier that also returns whether `pred` holds in any of the threads. The
// unaligned form (barrier.red, not bar.red = barrier.red.aligned): a warp may reach it with its
// lanes not yet reconverged (after lane-0 work or per-thread mbarrier waits), which the aligned
// form does not allow.
__device__ __forceinline__ bool named_barrier_or(int id, int threads, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbarrier.red.or.pred q, %2, %3, p;\nselp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(uint32_t(pred)), "r"(id), "r"(threads)
      : "memory");
  return any != 0;
}

// Moves registers between the warpgroups of a CTA (sm_90a): a warpgroup gives back down to N
// per thread, or waits until it can take up to N.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Programmatic dependent launch (a kernel launched with launch_programmatic, common.cuh):
// griddep_wait blocks until the previous kernel of the stream has completed and its writes are
// visible (everything read from it must come after); griddep_launch_dependents lets the next
// kernel's CTAs start (their work before griddep_wait overlaps this kernel's tail) once every
// CTA of this one has called it or exited.
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void griddep_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// `v` as a value the compiler cannot see through: what is computed from it stays where it is
// used instead of being hoisted out of a loop and held in registers.
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(v));
  return v;
}

// Rounds a shared-memory address up to a multiple of 1024 bytes (swizzled tiles need it).
__device__ __forceinline__ uint32_t align1024(uint32_t addr) { return (addr + 1023u) & ~1023u; }

// A kernel's shared-memory plan (a struct of its tiles and barriers) at the first 1024-byte
// boundary of its dynamic shared memory, and the bytes to launch it with.
inline constexpr int kSmemAlignSlack = 1024;
inline constexpr int kMaxSmemBytes = 227 * 1024;  // opt-in limit per CTA on sm_90
template <class Storage>
__device__ __forceinline__ Storage& shared_storage(unsigned char* smem) {
  return *reinterpret_cast<Storage*>(smem + (align1024(smem_addr(smem)) - smem_addr(smem)));
}
template <class Storage>
constexpr int storage_smem_bytes() {
  static_assert(sizeof(Storage) + kSmemAlignSlack <= kMaxSmemBytes, "shared storage over the sm_90 limit");
  return int(sizeof(Storage)) + kSmemAlignSlack;
}

// max that returns NaN when either operand is NaN (one instruction): a block or page score is
// NaN when any of its scores is, and fmaxf alone would skip it.
__device__ __forceinline__ float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

__device__ __forceinline__ float warp_max4(float v) {  // over the 4 lanes of a quad
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float warp_sum4(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

// The sign bit (0x8000) of each bf16 half of `w` that is an infinity or a NaN, else 0: one step
// added to an all-ones exponent carries into the sign bit, to any other exponent it does not
// (and never into the next half). Three integer operations; ORed over words, one test.
__device__ __forceinline__ uint32_t nonfinite_bf16x2_signs(uint32_t w) {
  return ((w & 0x7f807f80u) + 0x00800080u) & 0x80008000u;
}

// 0xffff in each bf16 half of `w` that is an infinity or a NaN (exponent all ones), else 0.
__device__ __forceinline__ uint32_t nonfinite_bf16x2(uint32_t w) { return (nonfinite_bf16x2_signs(w) >> 15) * 0xffffu; }

}  // namespace msa::cuda
