// Where the KV-outer attention forward (attention_forward.cu) reads a key block from: the
// packed K / V tensors of training, or a paged K / V cache through the page table (paged
// prefill) in bf16, FP8 E4M3 or NVFP4. The kernel is one; the source is its template policy.
//
// A key block is (document / request b, KV head g, block j) = keys j*128 .. j*128 + 127 of b.
// Packed: rows k_start_b + j*128 .. of k[Tk, Hkv, 128]. Paged: logical page j of request b,
// physical page page_table[b, j], rows of k_cache[page, g]. Quantised pages are widened to the
// bf16 tiles the tensor cores read; their values are exact in bf16 (E4M3 codes, NVFP4's
// E4M3-rounded products), and the scales are applied like the other paged kernels do:
// per-tensor K scale and per-token K scales multiply the logits, per-token V scales the
// probabilities, the per-tensor V scale the output.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/inference/quant.cuh"
#include "msa/constants.h"

namespace msa::cuda {

enum class KvSourceKind { packed_bf16, paged_bf16, paged_fp8, paged_nvfp4 };

template <KvSourceKind Kind>
inline constexpr bool kQuantisedSource = Kind == KvSourceKind::paged_fp8 || Kind == KvSourceKind::paged_nvfp4;
// bf16 sources: their blocks are the kernels' tiles as stored, so TMA can copy them.
template <KvSourceKind Kind>
inline constexpr bool kTmaSource = !kQuantisedSource<Kind>;
// FP8 pages: TMA copies a block's codes (one 128-byte row a key) into shared memory ahead of
// use, and the kernel widens them from there. NVFP4 blocks are widened from global memory.
template <KvSourceKind Kind>
inline constexpr bool kRawStagedSource = Kind == KvSourceKind::paged_fp8;
// Sources whose blocks the kernel's producer copies with TMA, and so locates.
template <KvSourceKind Kind>
inline constexpr bool kProducerCopiedSource = kTmaSource<Kind> || kRawStagedSource<Kind>;

// Addresses of one source (byte strides). Packed: page stride unused, head stride = one row
// of 128 bf16, row stride = Hkv rows.
struct KvSource {
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  int64_t k_page = 0, k_head = 0, k_row = 0;
  int64_t v_page = 0, v_head = 0, v_row = 0;
  const uint8_t* k_block_scale = nullptr;  // NVFP4: [pages, Hkv, 128, 8] E4M3
  const uint8_t* v_block_scale = nullptr;
  int64_t ksf_page = 0, ksf_head = 0, ksf_row = 0;
  int64_t vsf_page = 0, vsf_head = 0, vsf_row = 0;
  const float* k_tensor_scale = nullptr;  // nullptr: 1
  const float* v_tensor_scale = nullptr;
  const float* k_token_scale = nullptr;   // FP8 per-(head, slot) scales; nullptr: none
  const float* v_token_scale = nullptr;
  int64_t k_token_stride = 0, v_token_stride = 0;  // elements between heads
  const int32_t* page_table = nullptr;    // [B, max_pages]
  int64_t max_pages = 0;
};

// A validated paged cache as a key-block source through `plan`'s page table (strides in bytes;
// NVFP4 block scales and the scales of side_scales). Paged prefill and decode read it.
inline KvSource paged_kv_source(const InferencePlan& plan, const PagedKvCache& c) {
  const int64_t elem = c.format == KvFormat::bf16 ? 2 : 1;
  KvSource s;
  s.k = static_cast<const uint8_t*>(c.k.data);
  s.v = static_cast<const uint8_t*>(c.v.data);
  s.k_page = c.k.stride[0] * elem, s.k_head = c.k.stride[1] * elem, s.k_row = c.k.stride[2] * elem;
  s.v_page = c.v.stride[0] * elem, s.v_head = c.v.stride[1] * elem, s.v_row = c.v.stride[2] * elem;
  if (c.format == KvFormat::nvfp4) {
    s.k_block_scale = static_cast<const uint8_t*>(c.k_block_scale.data);
    s.v_block_scale = static_cast<const uint8_t*>(c.v_block_scale.data);
    s.ksf_page = c.k_block_scale.stride[0], s.ksf_head = c.k_block_scale.stride[1], s.ksf_row = c.k_block_scale.stride[2];
    s.vsf_page = c.v_block_scale.stride[0], s.vsf_head = c.v_block_scale.stride[1], s.vsf_row = c.v_block_scale.stride[2];
  }
  const inference::KvSideScales ks = inference::side_scales(c, false), vs = inference::side_scales(c, true);
  s.k_tensor_scale = ks.tensor, s.v_tensor_scale = vs.tensor;
  s.k_token_scale = ks.token, s.v_token_scale = vs.token;
  s.k_token_stride = ks.token_stride, s.v_token_stride = vs.token_stride;
  s.page_table = static_cast<const int32_t*>(plan.page_table.data());
  s.max_pages = plan.max_pages;
  return s;
}

// One key block of one head, resolved: where its rows start and what its scales are.
struct KeyBlockRows {
  const uint8_t* k;
  const uint8_t* v;
  const uint8_t* ksf;  // NVFP4 block scales of row 0
  const uint8_t* vsf;
  int64_t slot0;       // paged: physical page * 128 (token slot of row 0)
};

template <KvSourceKind Kind>
__device__ __forceinline__ KeyBlockRows key_block_rows(const KvSource& s, int b, int k_start, int g, int j) {
  KeyBlockRows r{};
  if constexpr (Kind == KvSourceKind::packed_bf16) {
    const int64_t row0 = int64_t(k_start) + int64_t(j) * model::kBlockSize;
    r.k = s.k + row0 * s.k_row + g * s.k_head;
    r.v = s.v + row0 * s.v_row + g * s.v_head;
  } else {
    const int64_t page = s.page_table[int64_t(b) * s.max_pages + j];
    r.k = s.k + page * s.k_page + g * s.k_head;
    r.v = s.v + page * s.v_page + g * s.v_head;
    r.slot0 = page * model::kPageSize;
    if constexpr (Kind == KvSourceKind::paged_nvfp4) {
      r.ksf = s.k_block_scale + page * s.ksf_page + g * s.ksf_head;
      r.vsf = s.v_block_scale + page * s.vsf_page + g * s.vsf_head;
    }
  }
  return r;
}

// Bytes of one stored row (128 values) and the 16-byte chunks it is read in.
template <KvSourceKind Kind>
inline constexpr int kSourceRowBytes = Kind == KvSourceKind::paged_fp8     ? model::kHeadDim
                                       : Kind == KvSourceKind::paged_nvfp4 ? model::kHeadDim / 2
                                                                            : model::kHeadDim * 2;
template <KvSourceKind Kind>
inline constexpr int kSourceChunks = kSourceRowBytes<Kind> / 16;
// bf16 values (16-byte bf16 chunks: 8 values) one source chunk widens to.
template <KvSourceKind Kind>
inline constexpr int kWidened = 8 * model::kHeadDim / (8 * kSourceChunks<Kind>);

// One 16-byte chunk of an NVFP4 row (32 values) with the two E4M3 block scales of its values,
// as read from global memory. Split from the widening so that a thread can have all its chunks
// of a key block in flight before it converts and stores any of them. (FP8 blocks come through
// the forward's raw stage, bf16 blocks by TMA: only NVFP4 is widened from global memory.)
struct Nvfp4Chunk {
  uint4 codes;
  uint32_t scales;
};

// Reads chunk c of a stored NVFP4 row; keys a block does not hold read as zeros.
__device__ __forceinline__ Nvfp4Chunk load_nvfp4_chunk(const uint8_t* row, const uint8_t* row_scales, int c,
                                                       bool present) {
  Nvfp4Chunk r{make_uint4(0, 0, 0, 0), 0};
  if (present) {
    r.codes = __ldg(reinterpret_cast<const uint4*>(row + c * 16));
    r.scales = __ldg(reinterpret_cast<const uint16_t*>(row_scales) + c);
  }
  return r;
}

// Widens chunk c to bf16 pairs: out[i] holds values 32c + 2i, +1 (low half first).
__device__ __forceinline__ void widen_nvfp4_chunk(const Nvfp4Chunk& raw, uint32_t (&out)[16]) {
  const uint32_t w[4] = {raw.codes.x, raw.codes.y, raw.codes.z, raw.codes.w};
  // Block scales 2c (words 0, 1) and 2c + 1 (words 2, 3).
  const float s0 = inference::e4m3_to_f32(uint8_t(raw.scales)), s1 = inference::e4m3_to_f32(uint8_t(raw.scales >> 8));
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float s = j < 2 ? s0 : s1;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t byte = (w[j] >> (8 * e)) & 0xffu;
      out[4 * j + e] = inference::bf16x2_bits(inference::e4m3_to_f32(inference::nvfp4_to_e4m3(byte & 0xfu, s)),
                                              inference::e4m3_to_f32(inference::nvfp4_to_e4m3(byte >> 4, s)));
    }
  }
}

// Brings the K (with `keys`) and V rows of a key block (rows 0 .. nkeys - 1; NVFP4 block
// scales not included) into L2, spread over the 32 lanes of a warp: the loads of the block
// that follow find them there instead of waiting on DRAM. A side whose rows are contiguous (a
// paged cache's page of one head) is one bulk prefetch by lane 0; strided rows (packed K / V,
// whose heads interleave) are prefetched line by line from every lane. Per-row bulk
// prefetches would queue one TMA operation per row ahead of the Q tiles' loads.
template <KvSourceKind Kind>
__device__ __forceinline__ void prefetch_key_block(const KvSource& s, const KeyBlockRows& rows, int nkeys, int lane,
                                                   bool keys = true) {
  constexpr int kRow = kSourceRowBytes<Kind>;
  auto side = [&](const uint8_t* base, int64_t stride) {
    if (stride == kRow) {
      if (lane == 0) prefetch_l2_bulk(base, uint32_t(nkeys * kRow));
      return;
    }
    constexpr int kLines = (kRow + 127) / 128;
#pragma unroll 1
    for (int i = lane; i < nkeys * kLines; i += 32) prefetch_l2_line(base + (i / kLines) * stride + (i % kLines) * 128);
  };
  if (keys) side(rows.k, s.k_row);
  side(rows.v, s.v_row);
}

// The widened value pair (dims d, d + 1; d even) of one stored row, for the rare per-value path.
template <KvSourceKind Kind>
__device__ __forceinline__ float2 load_value_pair(const uint8_t* row, const uint8_t* row_scales, int d) {
  if constexpr (Kind == KvSourceKind::paged_fp8) {
    const uint16_t two = __ldg(reinterpret_cast<const uint16_t*>(row + d));
    return make_float2(inference::e4m3_to_f32(uint8_t(two)), inference::e4m3_to_f32(uint8_t(two >> 8)));
  } else if constexpr (Kind == KvSourceKind::paged_nvfp4) {
    const uint32_t byte = __ldg(row + d / 2);
    const float s = inference::e4m3_to_f32(__ldg(row_scales + d / 16));
    return make_float2(inference::e4m3_to_f32(inference::nvfp4_to_e4m3(byte & 0xfu, s)),
                       inference::e4m3_to_f32(inference::nvfp4_to_e4m3(byte >> 4, s)));
  } else {
    const uint32_t two = __ldg(reinterpret_cast<const uint32_t*>(row + 2 * d));
    return make_float2(__uint_as_float(two << 16), __uint_as_float(two & 0xffff0000u));
  }
}

}  // namespace msa::cuda
