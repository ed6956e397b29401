// Fixed-order reductions and conversions that finish the backward and KL passes.
#pragma once

#include <cuda_bf16.h>

#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "msa/constants.h"

namespace msa::cuda {
// Each translation unit gets its own copies of these small kernels.
namespace {

constexpr int kRowValues = model::kHeadDim;     // values of a (row, head) gradient
constexpr int kBlockKeys = model::kBlockSize;   // keys of a block (rows of a chunk's key partial)
constexpr int64_t kKeyPart = int64_t(kBlockKeys) * kRowValues;  // one part (dK, dV or d index_k) of a chunk

template <typename T> __device__ __forceinline__ float load_f(const T* p);
template <> __device__ __forceinline__ float load_f<float>(const float* p) { return *p; }
template <> __device__ __forceinline__ float load_f<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }
template <typename T> __device__ __forceinline__ void store_f(T* p, float v);
template <> __device__ __forceinline__ void store_f<float>(float* p, float v) { *p = v; }
template <> __device__ __forceinline__ void store_f<__nv_bfloat16>(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// dst[i] = src[i] (f32 accumulator to the output dtype); NaN everywhere on an invalid plan.
template <typename Out>
__global__ void convert_kernel(const float* __restrict__ src, Out* __restrict__ dst, int64_t n,
                               const int32_t* __restrict__ status) {
  const bool bad = status[0] != 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_f(dst + i, bad ? NAN : src[i]);
}

// out[r, h, :] = scale * sum over slots s < count(r, h) of parts[s, r, h, :], slot order.
// count(r, h) = split_counts[r * Hkv + h / heads_per_count].
template <typename Part, typename Out>
__global__ void sum_slots_kernel(const Part* __restrict__ parts, const int32_t* __restrict__ split_counts,
                                 const int32_t* __restrict__ status, int64_t rows, int H, int Hkv, int heads_per_count,
                                 float scale, Out* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // (r, h, d)
  if (i >= rows * H * kRowValues) return;
  const int64_t rh = i / kRowValues;
  const int64_t r = rh / H;
  const int h = int(rh % H);
  const int count = split_counts[r * Hkv + h / heads_per_count];
  float acc = 0.f;
  for (int s = 0; s < count; ++s) acc += load_f(parts + int64_t(s) * rows * H * kRowValues + i);
  store_f(out + i, status[0] != 0 ? NAN : acc * scale);
}

// rows_out[h, row, m] = sum of the row's chunk partials chunks[c, m] in chunk order (its
// full chunks, then its partial one). One CTA per (head, row).
__global__ void sum_chunks_kernel(const float* __restrict__ chunks, const int32_t* __restrict__ first,
                                  const int32_t* __restrict__ nfull, const int32_t* __restrict__ tail, int parts,
                                  float* __restrict__ rows_out) {
  const int64_t hr = blockIdx.x;
  const int64_t elems = int64_t(parts) * kKeyPart;
  const int32_t f = first[hr], n = nfull[hr], tl = tail[hr];
  for (int64_t e = threadIdx.x * 4; e < elems; e += blockDim.x * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int c = 0; c < n; ++c) {
      const float4 v = *reinterpret_cast<const float4*>(chunks + (int64_t(f) + c) * elems + e);
      acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
    if (tl >= 0) {
      const float4 v = *reinterpret_cast<const float4*>(chunks + int64_t(tl) * elems + e);
      acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
    *reinterpret_cast<float4*>(rows_out + hr * elems + e) = acc;
  }
}

// Per key token t: sums the per-row results of every document whose key range holds t, in
// document order (and over heads in order when `sum_heads`), into out ([Tk, Hout, 128] for
// each part m: dk, dv, or d index_k).
template <typename Out>
__global__ void gather_keys_kernel(const float* __restrict__ row_sums, const DocInfo* __restrict__ docs, int B,
                                   const int32_t* __restrict__ doc_row_base, const int32_t* __restrict__ row_of,
                                   int64_t total_rows, int Hkv, int parts, bool sum_heads,
                                   const int32_t* __restrict__ status, Out* __restrict__ out0, Out* __restrict__ out1) {
  const int64_t tk = blockIdx.x;  // key token
  const int d = threadIdx.x;      // kRowValues threads
  const int Hout = sum_heads ? 1 : Hkv;
  const int64_t elems = int64_t(parts) * kKeyPart;
  for (int ho = 0; ho < Hout; ++ho) {
    float acc[2] = {0.f, 0.f};
    for (int b = 0; b < B; ++b) {
      const DocInfo doc = docs[b];
      if (tk < doc.k_start || tk >= int64_t(doc.k_start) + doc.k_len) continue;
      const int64_t local = tk - doc.k_start;
      const int64_t row = row_of[doc_row_base[b] + local / kBlockKeys];
      const int kk = int(local % kBlockKeys);
      const int h_begin = sum_heads ? 0 : ho, h_end = sum_heads ? Hkv : ho + 1;
      for (int h = h_begin; h < h_end; ++h) {
        const float* base = row_sums + (int64_t(h) * total_rows + row) * elems + kk * kRowValues + d;
        acc[0] += base[0];
        if (parts > 1) acc[1] += base[kKeyPart];
      }
    }
    const bool bad = status[0] != 0;
    store_f(out0 + (tk * Hout + ho) * kRowValues + d, bad ? NAN : acc[0]);
    if (parts > 1) store_f(out1 + (tk * Hout + ho) * kRowValues + d, bad ? NAN : acc[1]);
  }
}

inline int grid_for(int64_t n, int threads) { return int(std::min<int64_t>(ceil_div(n, threads), int64_t(1) << 30)); }

// Converts an f32 accumulator into `dst` (bf16 or f32) with convert_kernel.
template <typename Out>
void launch_convert(const float* src, const TensorView& dst, const int32_t* status, cudaStream_t s) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  convert_kernel<Out><<<grid_for(n, 256), 256, 0, s>>>(src, dst.as<Out>(), n, status);
  MSA_CUDA_CHECK_LAUNCH("convert_kernel");
}

inline void convert_out(const float* src, const TensorView& dst, const int32_t* status, cudaStream_t s) {
  if (dst.dtype == DType::f32) launch_convert<float>(src, dst, status, s);
  else launch_convert<__nv_bfloat16>(src, dst, status, s);
}

// What a backward or KL pass accumulated of the gradient of its queries: out [total_q,
// heads, 128] from fp32 accumulators (default mode) or from per-edge partial slots.
struct QueryGradients {
  TensorView out;
  const float* acc = nullptr;   // default mode: [total_q, heads, 128] f32
  const void* parts = nullptr;  // deterministic: [kTopk, total_q, heads, 128] of part_dtype
  DType part_dtype = DType::f32;
  int heads_per_kv_head = 1;    // query heads whose edges one split count numbers
};

// ... and of its keys: `count` outputs [total_k, heads, 128] (dk and dv, or d index_k alone).
struct KeyGradients {
  int count = 1;
  TensorView out[2];
  const float* acc[2] = {nullptr, nullptr};  // default mode: [total_k, heads, 128] f32
  const float* chunks = nullptr;             // deterministic: [chunks, count, 128, 128]
  bool sum_kv_heads = false;                 // one output row per token: the sum over KV heads
};

// How a backward or KL pass turns what its chunk kernel accumulated into the outputs.
// Default mode: fp32 accumulators filled with atomics, converted to the output dtype.
// Deterministic mode: the per-edge query partials summed in slot order, the per-chunk key
// partials summed in chunk order per (KV head, row), then per key token over documents (and
// over KV heads when they share the output) in order.
struct GradientReduction {
  const SparsePlan* plan = nullptr;
  const PlanState* state = nullptr;
  int64_t total_q = 0, total_k = 0;
  int num_kv_heads = 0;
  bool deterministic = false;
  float* key_rows = nullptr;  // deterministic scratch: [Hkv, total_rows, keys.count, 128, 128]
  QueryGradients query;
  KeyGradients keys;
};

template <typename Part>
void launch_sum_slots(const GradientReduction& r, const int32_t* status, cudaStream_t s) {
  const TensorView& out = r.query.out;
  const int64_t n = out.numel();
  if (n == 0) return;
  const auto* parts = static_cast<const Part*>(r.query.parts);
  const int heads = int(out.shape[1]);
  const int32_t* counts = i32(r.plan->split_counts);
  if (out.dtype == DType::f32)
    sum_slots_kernel<Part, float><<<grid_for(n, 256), 256, 0, s>>>(parts, counts, status, r.total_q, heads,
                                                                   r.num_kv_heads, r.query.heads_per_kv_head, 1.f,
                                                                   out.as<float>());
  else
    sum_slots_kernel<Part, __nv_bfloat16><<<grid_for(n, 256), 256, 0, s>>>(
        parts, counts, status, r.total_q, heads, r.num_kv_heads, r.query.heads_per_kv_head, 1.f,
        out.as<__nv_bfloat16>());
  MSA_CUDA_CHECK_LAUNCH("sum_slots_kernel");
}

template <typename Out>
void launch_gather_keys(const GradientReduction& r, const int32_t* status, cudaStream_t s) {
  const PlanState& st = *r.state;
  const KeyGradients& k = r.keys;
  Out* out1 = k.out[k.count > 1 ? 1 : 0].as<Out>();
  gather_keys_kernel<Out><<<int(r.total_k), kRowValues, 0, s>>>(r.key_rows, doc_ptr(st), st.num_documents,
                                                         i32(st.doc_row_base), i32(st.row_of), r.plan->total_rows,
                                                         r.num_kv_heads, k.count, k.sum_kv_heads, status,
                                                         k.out[0].as<Out>(), out1);
  MSA_CUDA_CHECK_LAUNCH("gather_keys_kernel");
}

inline void reduce_gradients(const GradientReduction& r, cudaStream_t s) {
  const int32_t* status = i32(r.plan->status);
  if (!r.deterministic) {
    convert_out(r.query.acc, r.query.out, status, s);
    for (int m = 0; m < r.keys.count; ++m) convert_out(r.keys.acc[m], r.keys.out[m], status, s);
    return;
  }
  if (r.query.part_dtype == DType::bf16) launch_sum_slots<__nv_bfloat16>(r, status, s);
  else launch_sum_slots<float>(r, status, s);
  const PlanState& st = *r.state;
  if (r.plan->total_rows > 0) {
    sum_chunks_kernel<<<int(r.num_kv_heads * r.plan->total_rows), 256, 0, s>>>(
        r.keys.chunks, i32(st.chunk_first), i32(st.chunk_nfull), i32(st.chunk_tail), r.keys.count, r.key_rows);
    MSA_CUDA_CHECK_LAUNCH("sum_chunks_kernel");
  }
  if (r.total_k > 0) {
    if (r.keys.out[0].dtype == DType::f32) launch_gather_keys<float>(r, status, s);
    else launch_gather_keys<__nv_bfloat16>(r, status, s);
  }
}

}  // namespace
}  // namespace msa::cuda
