// Brute-force float64 reference of the inference path; see inference_oracle.h.
#include "oracle/inference_oracle.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace msa::oracle {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr int64_t kPage = 128;
constexpr int kDim = 128;

// Byte address of element [i0, i1, i2, 0] (rank 4) or [i0, i1, 0] (rank 3) of a view.
const uint8_t* row_bytes(const TensorView& t, int64_t i0, int64_t i1, int64_t i2 = 0) {
  int64_t e = i0 * t.stride[0] + i1 * t.stride[1];
  if (t.rank == 4) e += i2 * t.stride[2];
  return static_cast<const uint8_t*>(t.data) + e * dtype_size(t.dtype);
}

double scalar_f32(const TensorView& t) {
  float v;
  std::memcpy(&v, t.data, 4);
  return v;
}

}  // namespace

// ---- decoders ----------------------------------------------------------------------------

double bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double e4m3_value(uint8_t code) {
  const int sign = code >> 7, exp = (code >> 3) & 0xf, man = code & 7;
  if (exp == 0xf && man == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = exp == 0 ? std::ldexp(double(man), -9) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return sign ? -mag : mag;
}

double e2m1_value(uint8_t code) {
  static const double mags[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  const double m = mags[code & 7];
  return (code & 8) ? -m : m;
}

double round_to_e4m3(double x) {
  if (std::isnan(x)) return x;
  const double mag = std::min(std::fabs(x), 448.0);
  double best = 0;
  int best_code = 0;
  for (int c = 0; c < 127; ++c) {  // every non-negative finite code
    const double v = e4m3_value(uint8_t(c));
    const double d = std::fabs(v - mag), db = std::fabs(best - mag);
    if (d < db || (d == db && c % 2 == 0 && best_code % 2 == 1)) best = v, best_code = c;
  }
  return x < 0 ? -best : best;
}

double round_to_bf16(double x) {
  if (x == 0 || !std::isfinite(x)) return x;
  int e;
  const double m = std::frexp(x, &e);             // |m| in [0.5, 1)
  const double r = std::nearbyint(std::ldexp(m, 8));  // 8 significant bits, ties to even
  return std::ldexp(r, e - 8);
}

double nvfp4_value(uint8_t code, uint8_t scale_code) {
  // All 16 x 256 values, computed once by the brute-force rounding above (NaN scales stay NaN).
  static const std::vector<double> table = [] {
    std::vector<double> t(16 * 256);
    for (int sc = 0; sc < 256; ++sc)
      for (int c = 0; c < 16; ++c) {
        const double p = e2m1_value(uint8_t(c)) * e4m3_value(uint8_t(sc));
        t[size_t(sc * 16 + c)] = std::isnan(p) ? p : round_to_e4m3(std::clamp(p, -448.0, 448.0));
      }
    return t;
  }();
  return table[size_t(scale_code) * 16 + (code & 0xf)];
}

// ---- pre-processing ----------------------------------------------------------------------

std::array<double, 128> norm_rope(const float* x, const float* weight, int64_t position, int rotary_dim, double eps,
                                  double theta) {
  double ss = 0;
  for (int d = 0; d < kDim; ++d) ss += double(x[d]) * x[d];
  const double inv_rms = 1.0 / std::sqrt(ss / kDim + eps);
  std::array<double, 128> y{};
  for (int d = 0; d < kDim; ++d) y[size_t(d)] = round_to_bf16(double(x[d]) * inv_rms * (1.0 + double(weight[d])));
  const int half = rotary_dim / 2;
  std::array<double, 128> out = y;
  for (int j = 0; j < half; ++j) {
    const float inv_freq = float(1.0 / std::pow(theta, 2.0 * j / rotary_dim));
    const float angle = float(double(position) * double(inv_freq));
    const double c = std::cos(double(angle)), s = std::sin(double(angle));
    const double x1 = y[size_t(j)], x2 = y[size_t(j + half)];
    out[size_t(j)] = x1 * c - x2 * s;
    out[size_t(j + half)] = x2 * c + x1 * s;
  }
  return out;
}

// ---- requests and caches -----------------------------------------------------------------

int64_t PagedRequests::request_of(int64_t row) const {
  for (int64_t b = 0; b < batch(); ++b)
    if (row < cu_seqlens_q[size_t(b) + 1]) return b;
  return -1;
}

int64_t PagedRequests::position(int64_t row) const {
  const int64_t b = request_of(row);
  const int64_t q_len = cu_seqlens_q[size_t(b) + 1] - cu_seqlens_q[size_t(b)];
  return int64_t(seq_lens[size_t(b)]) - q_len + (row - cu_seqlens_q[size_t(b)]);
}

PagedRequests decode_requests(const std::vector<int32_t>& seq_lens, const std::vector<int32_t>& page_table,
                              int64_t max_pages, int q_len_per_req) {
  PagedRequests r;
  r.seq_lens = seq_lens;
  r.page_table = page_table;
  r.max_pages = max_pages;
  r.cu_seqlens_q.push_back(0);
  for (size_t b = 0; b < seq_lens.size(); ++b) r.cu_seqlens_q.push_back(int32_t((b + 1) * size_t(q_len_per_req)));
  return r;
}

std::array<double, 128> cache_row(const PagedKvCache& c, bool value_side, int64_t page, int64_t head, int64_t offset) {
  const TensorView& data = value_side ? c.v : c.k;
  const TensorView& scale_t = value_side ? c.v_scale : c.k_scale;
  std::array<double, 128> row{};
  const uint8_t* bytes = row_bytes(data, page, head, offset);
  double scale = 1;
  if (scale_t.data != nullptr) {
    if (scale_t.rank == 2) {  // [Hkv, max_kv_tokens], token slot = page * 128 + offset
      float v;
      std::memcpy(&v, static_cast<const float*>(scale_t.data) + head * scale_t.stride[0] + page * kPage + offset, 4);
      scale = v;
    } else {
      scale = scalar_f32(scale_t);
    }
  }
  switch (c.format) {
    case KvFormat::bf16:
      for (int d = 0; d < kDim; ++d) {
        uint16_t b;
        std::memcpy(&b, bytes + 2 * d, 2);
        row[size_t(d)] = bf16_value(b);
      }
      break;
    case KvFormat::fp8_e4m3:
      for (int d = 0; d < kDim; ++d) row[size_t(d)] = e4m3_value(bytes[d]) * scale;
      break;
    case KvFormat::nvfp4: {
      const uint8_t* sf = row_bytes(value_side ? c.v_block_scale : c.k_block_scale, page, head, offset);
      for (int d = 0; d < kDim; ++d) {
        const uint8_t code = (d % 2 == 0) ? (bytes[d / 2] & 0xf) : (bytes[d / 2] >> 4);
        row[size_t(d)] = nvfp4_value(code, sf[d / 16]) * scale;
      }
      break;
    }
  }
  return row;
}

std::array<double, 128> index_cache_row(const TensorView& cache, int64_t page, int64_t offset) {
  std::array<double, 128> row{};
  const uint8_t* bytes = row_bytes(cache, page, offset);
  for (int d = 0; d < kDim; ++d) {
    if (cache.dtype == DType::bf16) {
      uint16_t b;
      std::memcpy(&b, bytes + 2 * d, 2);
      row[size_t(d)] = bf16_value(b);
    } else {
      row[size_t(d)] = e4m3_value(bytes[d]);
    }
  }
  return row;
}

// ---- indexer -----------------------------------------------------------------------------

PagedRowSelection paged_select_row(const Topology& topo, const PagedRequests& req, int64_t row, int head,
                                   const float* index_q, const TensorView& index_k_cache) {
  PagedRowSelection sel;
  const int64_t b = req.request_of(row);
  sel.position = req.position(row);
  if (sel.position < 0) return sel;
  sel.local = sel.position / kPage;
  const int64_t nvis = sel.local + 1;
  if (nvis <= topo.topk) {
    for (int64_t j = 0; j < nvis; ++j) sel.ids.push_back(int32_t(j));
    return sel;
  }
  sel.ranked = true;
  const float* qi = index_q + (row * topo.num_index_heads + head) * kDim;
  const double scale = 1.0 / std::sqrt(double(topo.index_head_dim));
  for (int64_t j = 0; j < sel.local; ++j) {  // history pages are fully visible
    const int64_t page = req.physical_page(b, j);
    double best = kNegInf;
    bool nan = false;
    for (int64_t t = 0; t < kPage; ++t) {
      const auto k = index_cache_row(index_k_cache, page, t);
      double s = 0;
      for (int d = 0; d < kDim; ++d) s += double(qi[d]) * k[size_t(d)];
      if (std::isnan(s)) nan = true;
      else best = std::max(best, s * scale);
    }
    sel.page_scores.push_back(nan ? std::numeric_limits<double>::quiet_NaN() : best);
  }
  // Spec §3.2 forcing: init range [0, min(I, nvis)), local range [max(0, nvis - L), nvis);
  // a page in both counts as local. The rest of the 16 slots take the best other pages.
  const int64_t local_begin = std::max<int64_t>(0, nvis - topo.local_blocks);
  const int64_t init_end = std::min<int64_t>(std::min<int64_t>(topo.init_blocks, nvis), local_begin);
  std::vector<int32_t> order;
  for (int64_t j = init_end; j < local_begin; ++j)
    if (!std::isnan(sel.page_scores[size_t(j)])) order.push_back(int32_t(j));
  const auto& s = sel.page_scores;
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t c) { return s[size_t(a)] > s[size_t(c)] || (s[size_t(a)] == s[size_t(c)] && a < c); });
  const size_t slots = size_t(topo.topk) - size_t(init_end) - size_t(nvis - local_begin);
  const size_t keep = std::min(order.size(), slots);
  sel.init_end = init_end;
  sel.local_begin = local_begin;
  for (int64_t j = 0; j < init_end; ++j) sel.ids.push_back(int32_t(j));
  for (size_t i = 0; i < keep; ++i) sel.ids.push_back(order[i]);
  sel.threshold = keep > 0 ? s[size_t(order[keep - 1])] : kNegInf;
  for (int64_t j = local_begin; j < nvis; ++j) sel.ids.push_back(int32_t(j));
  return sel;
}

std::vector<int32_t> paged_select(const Topology& topo, const PagedRequests& req, const float* index_q,
                                  const TensorView& index_k_cache) {
  const int64_t T = req.total_q();
  const int Hi = topo.num_index_heads, K = topo.topk;
  std::vector<int32_t> topk(size_t(Hi * T * K), -1);
#pragma omp parallel for schedule(dynamic)
  for (int64_t r = 0; r < T; ++r)
    for (int g = 0; g < Hi; ++g) {
      const auto sel = paged_select_row(topo, req, r, g, index_q, index_k_cache);
      for (size_t i = 0; i < sel.ids.size(); ++i) topk[size_t((g * T + r) * K) + i] = sel.ids[i];
    }
  return topk;
}

// ---- attention ---------------------------------------------------------------------------

PagedAttentionResult paged_attention(const Topology& topo, const PagedRequests& req, const float* q,
                                     const PagedKvCache& cache, const int32_t* topk, const std::vector<int64_t>& rows) {
  const int64_t T = req.total_q();
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, G = Hq / Hkv, K = topo.topk;
  const double scale = 1.0 / std::sqrt(double(topo.head_dim));
  PagedAttentionResult res;
  res.out.assign(size_t(T * Hq * kDim), 0.0);
  res.lse.assign(size_t(T * Hq), kNegInf);
  std::vector<int64_t> work = rows;
  if (work.empty())
    for (int64_t r = 0; r < T; ++r) work.push_back(r);

#pragma omp parallel for schedule(dynamic)
  for (int64_t n = 0; n < int64_t(work.size()) * Hkv; ++n) {
    const int64_t r = work[size_t(n / Hkv)];
    const int g = int(n % Hkv);
    const int64_t b = req.request_of(r), pos = req.position(r), seq_len = req.seq_lens[size_t(b)];
    // Dense key list: every token of a selected page that is causally visible and inside seq_len.
    std::vector<std::array<double, 128>> keys, values;
    const int32_t* ids = topk + (g * T + r) * K;
    for (int s = 0; s < K; ++s) {
      if (ids[s] < 0) continue;
      const int64_t page = req.physical_page(b, ids[s]);
      for (int64_t o = 0; o < kPage; ++o) {
        const int64_t t = int64_t(ids[s]) * kPage + o;
        if (t > pos || t >= seq_len) continue;
        keys.push_back(cache_row(cache, false, page, g, o));
        values.push_back(cache_row(cache, true, page, g, o));
      }
    }
    if (keys.empty()) continue;
    for (int h = g * G; h < (g + 1) * G; ++h) {
      const float* qh = q + (r * Hq + h) * kDim;
      std::vector<double> z(keys.size());
      double m = kNegInf;
      for (size_t t = 0; t < keys.size(); ++t) {
        double s = 0;
        for (int d = 0; d < kDim; ++d) s += double(qh[d]) * keys[t][size_t(d)];
        z[t] = s * scale;
        m = std::max(m, z[t]);
      }
      double l = 0;
      std::array<double, 128> acc{};
      for (size_t t = 0; t < keys.size(); ++t) {
        const double w = std::exp(z[t] - m);
        l += w;
        for (int d = 0; d < kDim; ++d) acc[size_t(d)] += w * values[t][size_t(d)];
      }
      for (int d = 0; d < kDim; ++d) res.out[size_t((r * Hq + h) * kDim + d)] = acc[size_t(d)] / l;
      res.lse[size_t(r * Hq + h)] = m + std::log(l);
    }
  }
  return res;
}

}  // namespace msa::oracle
