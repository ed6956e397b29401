// The float64 brute-force oracle of the inference path (docs/semantics.md §3, §4, §9), written from
// the specification and independent of the library's backends: its own bit-level decoders
// of bf16 / E4M3 / E2M1, dense key lists per query, double accumulation.
//
// Conventions:
//   * Request b owns query rows [cu_q[b], cu_q[b+1]); row i of it sits at causal position
//     pos = seq_lens[b] - q_len_b + i (bottom-right); pos < 0 attends nothing.
//   * Logical page j of request b is physical page page_table[b * max_pages + j]; token t of
//     the request lives in logical page t / 128 at offset t % 128.
//   * Caches are read through msa::PagedKvCache / TensorView descriptions (element strides).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "msa/inference.h"
#include "msa/topology.h"

namespace msa::oracle {

// ---- element decoders (bit level) --------------------------------------------------------

double bf16_value(uint16_t bits);
double e4m3_value(uint8_t code);                 // NaN for S.1111.111
double e2m1_value(uint8_t code);                 // low 4 bits: sign bit 3, magnitude bits 0-2
double round_to_e4m3(double x);                  // nearest E4M3 value, ties to even, saturating at 448
double round_to_bf16(double x);                  // nearest bf16 value, ties to even
double nvfp4_value(uint8_t code, uint8_t scale_code);  // round_to_e4m3(clamp(e2m1 * scale, ±448))

// ---- pre-processing (docs/semantics.md §9.7) ----------------------------------------------------------

// Gemma RMSNorm (double), rounded to bf16, then partial NeoX RoPE (double) with
// inv_freq_j = fp32(theta^(-2j / rotary_dim)) and angle = fp32(pos * inv_freq_j) as the
// library documents; the result is NOT rounded (compare with a bf16 tolerance).
std::array<double, 128> norm_rope(const float* x, const float* weight, int64_t position, int rotary_dim = 64,
                                  double eps = 1e-6, double theta = 5e6);

// ---- paged caches ------------------------------------------------------------------------

struct PagedRequests {
  std::vector<int32_t> cu_seqlens_q;  // [B + 1]
  std::vector<int32_t> seq_lens;      // [B]
  std::vector<int32_t> page_table;    // [B, max_pages]
  int64_t max_pages = 0;

  int64_t batch() const { return int64_t(seq_lens.size()); }
  int64_t total_q() const { return cu_seqlens_q.back(); }
  int64_t request_of(int64_t row) const;
  int64_t position(int64_t row) const;  // bottom-right causal position (< 0: attends nothing)
  int32_t physical_page(int64_t request, int64_t logical_page) const {
    return page_table[size_t(request * max_pages + logical_page)];
  }
};

// Decode rows: request b owns rows [b*Q, b*Q + Q).
PagedRequests decode_requests(const std::vector<int32_t>& seq_lens, const std::vector<int32_t>& page_table,
                              int64_t max_pages, int q_len_per_req);

// Dequantised main-cache row (K when value_side is false) of (physical page, head, offset),
// following the PagedKvCache contract: bf16 as is; fp8 code * scale (per tensor or per
// (head, page * 128 + offset)); nvfp4 nvfp4_value(code, block scale) * global scale.
std::array<double, 128> cache_row(const PagedKvCache& cache, bool value_side, int64_t page, int64_t head, int64_t offset);
// Index-K cache row (bf16 or fp8, scale 1).
std::array<double, 128> index_cache_row(const TensorView& index_k_cache, int64_t page, int64_t offset);

// ---- indexer (docs/semantics.md §3, §9.3) -------------------------------------------------------------

struct PagedRowSelection {
  int64_t position = 0;
  int64_t local = -1;                // pos / 128 (-1 when pos < 0)
  std::vector<double> page_scores;   // [local] history page scores: index_scale * max_t <qi, ki(t)>; NaN if any is NaN
  std::vector<int32_t> ids;          // valid prefix: init pages, ranked pages (score desc, id asc),
                                     //   local pages ascending (own page last)
  double threshold = 0;              // score of the last ranked page (when ranking happened)
  int64_t init_end = 0;              // forced init pages [0, init_end) (when ranking happened)
  int64_t local_begin = 0;           // forced local pages [local_begin, local] (when ranking happened)
  bool ranked = false;               // nvis > 16
};

PagedRowSelection paged_select_row(const Topology& topo, const PagedRequests& req, int64_t row, int head,
                                   const float* index_q,  // [total_q, Hi, 128]
                                   const TensorView& index_k_cache);

// [Hi, total_q, 16], -1 padded.
std::vector<int32_t> paged_select(const Topology& topo, const PagedRequests& req, const float* index_q,
                                  const TensorView& index_k_cache);

// ---- attention (docs/semantics.md §4, §9.4) -----------------------------------------------------------------

struct PagedAttentionResult {
  std::vector<double> out;  // [total_q, Hq, 128]
  std::vector<double> lse;  // [total_q, Hq], -inf for rows without keys
};

// keys of row r, head h = tokens t <= pos, t < seq_len of the pages in topk[h / G, r] (any
// order, -1 skipped). `rows` restricts the work (others stay 0 / -inf); empty = all rows.
PagedAttentionResult paged_attention(const Topology& topo, const PagedRequests& req,
                                     const float* q,       // [total_q, Hq, 128]
                                     const PagedKvCache& cache,
                                     const int32_t* topk,  // [Hkv, total_q, 16]
                                     const std::vector<int64_t>& rows = {});

}  // namespace msa::oracle
