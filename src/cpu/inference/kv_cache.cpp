// Writing tokens into the paged caches (with quantisation) and NVFP4 -> FP8 conversion.
#include <algorithm>
#include <cmath>

#include "cpu/inference/common.h"

namespace msa::cpu {

namespace {

using namespace inference;

// Nearest E2M1 code of v (ties to the even code, magnitudes above 6 clamp to 6).
uint8_t float_to_e2m1(float v) {
  const float m = std::fabs(v);
  int best = 0;
  if (!(m >= 0)) return 0;  // NaN has no E2M1 code; store 0
  for (int c = 1; c < 8; ++c) {
    const float d_new = std::fabs(kE2m1Values[c] - m), d_best = std::fabs(kE2m1Values[best] - m);
    if (d_new < d_best || (d_new == d_best && c % 2 == 0)) best = c;
  }
  return uint8_t(best == 0 ? 0 : (std::signbit(v) ? 8 : 0) | best);
}

// Writes one dequantised 128-row into (page, head, offset) of one side of the cache.
class KvRowWriter {
 public:
  KvRowWriter(const PagedKvCache& cache, bool value_side) : side_(cache, value_side) {}

  void write(int64_t page, int head, int offset, const float* x) const {
    const int64_t base = offset4(side_.data, page, head, offset);
    switch (side_.format) {
      case KvFormat::bf16: {
        uint16_t* d = side_.data.as<uint16_t>() + base;
        for (int i = 0; i < kHeadDim; ++i) d[i] = float_to_bf16(x[i]);
        return;
      }
      case KvFormat::fp8_e4m3: {
        float scale = side_.tensor_scale;
        if (side_.mode == KvScaleMode::per_head_token) {
          float amax = 0;
          for (int i = 0; i < kHeadDim; ++i) amax = std::max(amax, std::fabs(x[i]));
          scale = amax > 0 ? amax / 448.0f : 1.0f;
          side_.token_scale_at(page, head, offset) = scale;
        }
        uint8_t* d = side_.data.as<uint8_t>() + base;
        for (int i = 0; i < kHeadDim; ++i) d[i] = float_to_e4m3(x[i] / scale);
        return;
      }
      case KvFormat::nvfp4: {
        uint8_t* d = side_.data.as<uint8_t>() + base;
        uint8_t* sf = side_.block_scale.as<uint8_t>() + offset4(side_.block_scale, page, head, offset);
        for (int g = 0; g < kNvfp4RowScales; ++g) {
          float y[kNvfp4GroupSize], amax = 0;
          for (int i = 0; i < kNvfp4GroupSize; ++i) {
            y[i] = x[g * kNvfp4GroupSize + i] / side_.tensor_scale;
            amax = std::max(amax, std::fabs(y[i]));
          }
          const uint8_t scale_code = float_to_e4m3(amax / 6.0f);
          const float scale = e4m3_to_float(scale_code);
          sf[g] = scale_code;
          for (int i = 0; i < kNvfp4GroupSize; i += 2) {
            const uint8_t lo = scale > 0 ? float_to_e2m1(y[i] / scale) : 0;
            const uint8_t hi = scale > 0 ? float_to_e2m1(y[i + 1] / scale) : 0;
            d[(g * kNvfp4GroupSize + i) / 2] = uint8_t(lo | (hi << 4));
          }
        }
        return;
      }
    }
  }

 private:
  KvCacheSide side_;
};

}  // namespace

void insert_kv(const KvInsertParams& p, const RunOptions& opt) {
  const int64_t T = p.k.shape[0];
  const int Hkv = int(p.k.shape[1]);
  const KvRowWriter k_writer(p.cache, false), v_writer(p.cache, true);
  float k_weight[kHeadDim], ik_weight[kHeadDim], inv_freq[kHeadDim / 2];
  const bool norm_k = p.k_norm.present(), norm_ik = p.index_k_norm.present();
  if (norm_k) gemma_weight(p.k_norm, k_weight);
  if (norm_ik) gemma_weight(p.index_k_norm, ik_weight);
  rope_inv_freq(p.config.rotary_dim, p.config.rope_theta, inv_freq);
  const int32_t* slots = p.slot_mapping.as<const int32_t>();
  const int32_t* positions = (norm_k || norm_ik) && p.config.rotary_dim > 0 ? p.positions.as<const int32_t>() : nullptr;
#pragma omp parallel for num_threads(thread_count(opt)) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int32_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t page = slot / kPageSize;
    const int offset = slot % kPageSize;
    const int32_t pos = positions ? positions[t] : 0;
    float in[kHeadDim], row[kHeadDim];
    for (int h = 0; h < Hkv; ++h) {
      load_row(p.k, t * p.k.stride[0] + h * p.k.stride[1], kHeadDim, in);
      if (norm_k) {
        norm_rope_row(in, k_weight, inv_freq, p.config.rotary_dim, p.config.eps, pos, row);
        k_writer.write(page, h, offset, row);
      } else {
        k_writer.write(page, h, offset, in);
      }
      load_row(p.v, t * p.v.stride[0] + h * p.v.stride[1], kHeadDim, in);
      v_writer.write(page, h, offset, in);
    }
    if (p.index_k.present()) {
      load_row(p.index_k, t * p.index_k.stride[0], kHeadDim, in);
      const float* src = in;
      if (norm_ik) {
        norm_rope_row(in, ik_weight, inv_freq, p.config.rotary_dim, p.config.eps, pos, row);
        src = row;
      }
      store_row(p.index_k_cache, page * p.index_k_cache.stride[0] + offset * p.index_k_cache.stride[1], kHeadDim, src);
    }
  }
}

void nvfp4_to_fp8(const Nvfp4ToFp8Params& p, const RunOptions& opt) {
  const int64_t pages = p.packed.shape[0], Hkv = p.packed.shape[1];
  const int64_t n = p.page_ids.present() ? p.page_ids.shape[0] : pages;
  const int32_t* ids = p.page_ids.present() ? p.page_ids.as<const int32_t>() : nullptr;
#pragma omp parallel for num_threads(thread_count(opt)) schedule(static)
  for (int64_t i = 0; i < n * Hkv; ++i) {
    const int64_t dst_page = i / Hkv, h = i % Hkv;
    const int64_t src_page = ids ? ids[dst_page] : dst_page;
    if (src_page < 0) continue;
    for (int t = 0; t < kPageSize; ++t) {
      const uint8_t* codes = p.packed.as<const uint8_t>() + offset4(p.packed, src_page, h, t);
      const uint8_t* sf = p.block_scale.as<const uint8_t>() + offset4(p.block_scale, src_page, h, t);
      uint8_t* out = p.out.as<uint8_t>() + offset4(p.out, dst_page, h, t);
      for (int d = 0; d < kHeadDim; d += 2) {
        const float scale = e4m3_to_float(sf[d / kNvfp4GroupSize]);
        out[d] = float_to_e4m3(e2m1_to_float(codes[d / 2] & 0xf) * scale);
        out[d + 1] = float_to_e4m3(e2m1_to_float(codes[d / 2] >> 4) * scale);
      }
    }
  }
}

}  // namespace msa::cpu
