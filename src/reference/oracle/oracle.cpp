// Brute-force float64 reference of the MSA operations; see oracle.h for the conventions.
#include "oracle/oracle.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace msa::oracle {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The oracle's hot loops are compiled twice, for AVX2 machines and a generic x86-64, and
// picked at load time: the brute-force float64 work of a full backward is large, and the
// library's build flags do not apply to the tests.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MSA_ORACLE_HOT __attribute__((target_clones("avx2", "default")))
#else
#define MSA_ORACLE_HOT
#endif
#define MSA_ORACLE_INLINE inline __attribute__((always_inline))

// Double-precision dot products. `omp simd` lets the compiler split the sum into lanes; in
// double that reordering is far below the tolerances we test.
template <typename A, typename B>
MSA_ORACLE_INLINE double dot_simd(const A* a, const B* b, int n) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += double(a[i]) * double(b[i]);
  return s;
}
MSA_ORACLE_INLINE double dot(const float* a, const float* b, int n) { return dot_simd(a, b, n); }
MSA_ORACLE_INLINE double dot(const double* a, const float* b, int n) { return dot_simd(a, b, n); }
MSA_ORACLE_INLINE double dot(const double* a, const double* b, int n) { return dot_simd(a, b, n); }

// dst += alpha * src
MSA_ORACLE_INLINE void axpy(double alpha, const float* src, double* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] += alpha * double(src[i]);
}

MSA_ORACLE_INLINE void axpy(double alpha, const double* src, double* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] += alpha * src[i];
}

// Packed query row -> (document, query index inside it), for every row of every document.
struct QueryRef {
  int doc;
  int64_t i;
};
std::vector<QueryRef> all_queries(const std::vector<Doc>& docs) {
  std::vector<QueryRef> refs;
  for (size_t b = 0; b < docs.size(); ++b)
    for (int64_t i = 0; i < docs[b].q_len; ++i) refs.push_back({int(b), i});
  return refs;
}

// Document-local keys seen by query position p through the selection `ids` (one top-k row):
// the dense boolean block mask AND t <= p AND t < k_len, in ascending order.
std::vector<int64_t> visible_keys(const Topology& topo, const Doc& d, int64_t p, const int32_t* ids) {
  const int64_t B = topo.block_size;
  const int64_t num_blocks = (d.k_len + B - 1) / B;
  std::vector<char> selected(size_t(num_blocks), 0);
  for (int s = 0; s < topo.topk; ++s)
    if (ids[s] >= 0 && ids[s] < num_blocks) selected[size_t(ids[s])] = 1;
  std::vector<int64_t> keys;
  const int64_t last = std::min(p, d.k_len - 1);
  for (int64_t t = 0; t <= last; ++t)
    if (selected[size_t(t / B)]) keys.push_back(t);
  return keys;
}

// Inside an enclosing parallel region a nested team has one thread, so size per-thread
// buffers for one.
int threads() { return omp_in_parallel() ? 1 : std::max(1, omp_get_max_threads()); }

}  // namespace

std::vector<Doc> documents(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                           const std::vector<int32_t>& fragment) {
  std::vector<Doc> docs;
  for (size_t b = 0; b + 1 < cu_q.size(); ++b) {
    Doc d;
    d.q_start = cu_q[b];
    d.q_len = cu_q[b + 1] - cu_q[b];
    d.k_start = fragment.empty() ? cu_k[b] : cu_k[size_t(fragment[b])];
    d.k_len = cu_k[b + 1] - d.k_start;
    docs.push_back(d);
  }
  return docs;
}

int64_t total_queries(const std::vector<Doc>& docs) {
  int64_t n = 0;
  for (const Doc& d : docs) n = std::max(n, d.q_start + d.q_len);
  return n;
}

double attention_scale(const Topology& topo) {
  return topo.softmax_scale > 0 ? double(topo.softmax_scale) : 1.0 / std::sqrt(double(topo.head_dim));
}

double index_scale(const Topology& topo) {
  return topo.index_scale > 0 ? double(topo.index_scale) : 1.0 / std::sqrt(double(topo.index_head_dim));
}

// ---------------------------------------------------------------------------------------
// Indexer

std::vector<int32_t> RowSelection::ids() const {
  std::vector<int32_t> out = forced_init;
  out.insert(out.end(), ranked.begin(), ranked.end());
  out.insert(out.end(), forced_local.begin(), forced_local.end());
  return out;
}

RowSelection select_row(const Topology& topo, const Doc& d, int64_t i, int g, const float* index_q,
                        const float* index_k) {
  const int B = topo.block_size, Di = topo.index_head_dim, Hi = topo.num_index_heads;
  const double scale = index_scale(topo);
  RowSelection r;
  r.position = position(d, i);
  r.num_visible = int(r.position / B) + 1;
  const int nvis = r.num_visible;

  // Block score = max over the block's causally visible tokens (NaN if any token is NaN).
  const float* qi = index_q + ((d.q_start + i) * Hi + g) * Di;
  r.block_scores.assign(size_t(nvis), kNegInf);
  for (int64_t t = 0; t <= r.position; ++t) {
    const double s = scale * dot(qi, index_k + (d.k_start + t) * Di, Di);
    double& best = r.block_scores[size_t(t / B)];
    if (std::isnan(s) || std::isnan(best))
      best = std::numeric_limits<double>::quiet_NaN();
    else
      best = std::max(best, s);
  }

  const int count = std::min(topo.topk, nvis);
  const int local_begin = std::max(0, nvis - topo.local_blocks);
  const int init_end = std::min(topo.init_blocks, nvis);
  std::vector<char> forced(size_t(nvis), 0);
  for (int b = local_begin; b < nvis; ++b) {
    r.forced_local.push_back(b);
    forced[size_t(b)] = 1;
  }
  for (int b = 0; b < init_end; ++b)
    if (!forced[size_t(b)]) {
      r.forced_init.push_back(b);
      forced[size_t(b)] = 1;
    }
  r.ranked_slots = count - int(r.forced_init.size() + r.forced_local.size());

  std::vector<int32_t> candidates;
  for (int b = 0; b < nvis; ++b)
    if (!forced[size_t(b)] && (nvis <= topo.topk || !std::isnan(r.block_scores[size_t(b)]))) candidates.push_back(b);
  // (score desc, id asc); NaN only reaches here when every visible block is selected anyway.
  std::stable_sort(candidates.begin(), candidates.end(), [&](int32_t a, int32_t b) {
    const double sa = r.block_scores[size_t(a)], sb = r.block_scores[size_t(b)];
    if (std::isnan(sa) || std::isnan(sb)) return !std::isnan(sa) && std::isnan(sb);
    return sa > sb;
  });
  const size_t take = std::min(candidates.size(), size_t(std::max(0, r.ranked_slots)));
  r.ranked.assign(candidates.begin(), candidates.begin() + int64_t(take));
  return r;
}

std::vector<int32_t> select_blocks(const Topology& topo, const std::vector<Doc>& docs, const float* index_q,
                                   const float* index_k) {
  const int Hi = topo.num_index_heads, K = topo.topk;
  const int64_t total_q = total_queries(docs);
  std::vector<int32_t> out(size_t(Hi * total_q * K), -1);
  const auto refs = all_queries(docs);
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads())
  for (int64_t n = 0; n < int64_t(refs.size()); ++n) {
    const Doc& d = docs[size_t(refs[size_t(n)].doc)];
    const int64_t i = refs[size_t(n)].i;
    for (int g = 0; g < Hi; ++g) {
      const auto ids = select_row(topo, d, i, g, index_q, index_k).ids();
      std::copy(ids.begin(), ids.end(), out.begin() + (g * total_q + d.q_start + i) * K);
    }
  }
  return out;
}

std::vector<double> selected_lse(const Topology& topo, const std::vector<Doc>& docs, const float* index_q,
                                 const float* index_k, const int32_t* topk, double temperature) {
  const int Hi = topo.num_index_heads, Di = topo.index_head_dim, K = topo.topk;
  const double scale = index_scale(topo);
  const int64_t total_q = total_queries(docs);
  std::vector<double> lse(size_t(Hi * total_q), kNegInf);
  const auto refs = all_queries(docs);
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads())
  for (int64_t n = 0; n < int64_t(refs.size()); ++n) {
    const Doc& d = docs[size_t(refs[size_t(n)].doc)];
    const int64_t i = refs[size_t(n)].i, row = d.q_start + i;
    for (int g = 0; g < Hi; ++g) {
      const auto keys = visible_keys(topo, d, position(d, i), topk + (g * total_q + row) * K);
      if (keys.empty()) continue;
      std::vector<double> s(keys.size());
      for (size_t j = 0; j < keys.size(); ++j)
        s[j] = scale * dot(index_q + (row * Hi + g) * Di, index_k + (d.k_start + keys[j]) * Di, Di) / temperature;
      const double m = *std::max_element(s.begin(), s.end());
      double sum = 0;
      for (double x : s) sum += std::exp(x - m);
      lse[size_t(g * total_q + row)] = m + std::log(sum);
    }
  }
  return lse;
}

// ---------------------------------------------------------------------------------------
// Attention

namespace {

// One (query row, KV group): softmax over the group's keys for its query heads, and with
// `dout` the gradients. Keys are visited in the outer loop so that each K / V row is read once
// for all heads of the group.
struct GroupBuffers {
  std::vector<double> q, dout, p, o, dq, dk_row, dv_row, delta;
};

MSA_ORACLE_HOT void attend_group(const Topology& topo, const Doc& d, int64_t row, int g, const std::vector<int64_t>& keys,
                                 const float* q, const float* k, const float* v, const float* dout, GroupBuffers& w,
                                 AttentionResult& r, double* dk_acc, double* dv_acc) {
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, D = topo.head_dim;
  const int G = Hq / Hkv, h0 = g * G;
  const double scale = attention_scale(topo);
  const size_t nk = keys.size();
  auto key_row = [&](const float* base, size_t j) { return base + ((d.k_start + keys[j]) * Hkv + g) * D; };

  w.q.resize(size_t(G * D));
  for (int e = 0; e < G * D; ++e) w.q[size_t(e)] = q[(row * Hq + h0) * D + e];
  // p[h][j] = z, then the softmax probabilities.
  w.p.resize(size_t(G) * nk);
  for (size_t j = 0; j < nk; ++j) {
    const float* kj = key_row(k, j);
    for (int h = 0; h < G; ++h) w.p[size_t(h) * nk + j] = scale * dot(w.q.data() + h * D, kj, D);
  }
  for (int h = 0; h < G; ++h) {
    double* ph = w.p.data() + size_t(h) * nk;
    const double m = *std::max_element(ph, ph + nk);
    double l = 0;
    for (size_t j = 0; j < nk; ++j) l += (ph[j] = std::exp(ph[j] - m));
    for (size_t j = 0; j < nk; ++j) ph[j] /= l;
    r.lse[size_t(row * Hq + h0 + h)] = m + std::log(l);
  }
  w.o.assign(size_t(G * D), 0.0);
  for (size_t j = 0; j < nk; ++j) {
    const float* vj = key_row(v, j);
    for (int h = 0; h < G; ++h) axpy(w.p[size_t(h) * nk + j], vj, w.o.data() + h * D, D);
  }
  std::copy(w.o.begin(), w.o.end(), r.out.begin() + (row * Hq + h0) * D);
  if (!dout) return;

  // dS = P (dP - rowsum(dO o O)), dP = dO V^T; dQ = scale dS K; dK = scale dS^T Q; dV = P^T dO.
  w.dout.resize(size_t(G * D));
  for (int e = 0; e < G * D; ++e) w.dout[size_t(e)] = dout[(row * Hq + h0) * D + e];
  w.delta.resize(size_t(G));
  for (int h = 0; h < G; ++h) w.delta[size_t(h)] = dot(w.dout.data() + h * D, w.o.data() + h * D, D);
  w.dq.assign(size_t(G * D), 0.0);
  w.dk_row.resize(size_t(D));
  w.dv_row.resize(size_t(D));
  for (size_t j = 0; j < nk; ++j) {
    const float* kj = key_row(k, j);
    const float* vj = key_row(v, j);
    std::fill(w.dk_row.begin(), w.dk_row.end(), 0.0);
    std::fill(w.dv_row.begin(), w.dv_row.end(), 0.0);
    for (int h = 0; h < G; ++h) {
      const double pj = w.p[size_t(h) * nk + j];
      const double ds = pj * (dot(w.dout.data() + h * D, vj, D) - w.delta[size_t(h)]);
      axpy(scale * ds, kj, w.dq.data() + h * D, D);
      axpy(scale * ds, w.q.data() + h * D, w.dk_row.data(), D);
      axpy(pj, w.dout.data() + h * D, w.dv_row.data(), D);
    }
    const int64_t key = (d.k_start + keys[j]) * Hkv + g;
    axpy(1.0, w.dk_row.data(), dk_acc + key * D, D);
    axpy(1.0, w.dv_row.data(), dv_acc + key * D, D);
  }
  std::copy(w.dq.begin(), w.dq.end(), r.dq.begin() + (row * Hq + h0) * D);
}

AttentionResult attention(const Topology& topo, const std::vector<Doc>& docs, const float* q, const float* k,
                          const float* v, const int32_t* topk, const float* dout, int64_t total_k,
                          const std::vector<int64_t>& rows) {
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, D = topo.head_dim, K = topo.topk;
  const int64_t total_q = total_queries(docs);
  const bool backward = dout != nullptr;

  AttentionResult r;
  r.out.assign(size_t(total_q * Hq * D), 0.0);
  r.lse.assign(size_t(total_q * Hq), kNegInf);
  if (backward) {
    r.dq.assign(size_t(total_q * Hq * D), 0.0);
    r.dk.assign(size_t(total_k * Hkv * D), 0.0);
    r.dv.assign(size_t(total_k * Hkv * D), 0.0);
  }

  std::vector<QueryRef> refs;
  if (rows.empty()) {
    refs = all_queries(docs);
  } else {
    for (int64_t row : rows)
      for (size_t b = 0; b < docs.size(); ++b)
        if (row >= docs[b].q_start && row < docs[b].q_start + docs[b].q_len) refs.push_back({int(b), row - docs[b].q_start});
  }

  const int nthreads = threads();
  // dK / dV receive contributions from many queries: one accumulator per thread.
  std::vector<std::vector<double>> dk_part(backward ? size_t(nthreads) : 0), dv_part(backward ? size_t(nthreads) : 0);

#pragma omp parallel num_threads(nthreads)
  {
    const int tid = omp_get_thread_num();
    double* dk_acc = nullptr;
    double* dv_acc = nullptr;
    if (backward) {
      dk_part[size_t(tid)].assign(size_t(total_k * Hkv * D), 0.0);
      dv_part[size_t(tid)].assign(size_t(total_k * Hkv * D), 0.0);
      dk_acc = dk_part[size_t(tid)].data();
      dv_acc = dv_part[size_t(tid)].data();
    }
    GroupBuffers work;
#pragma omp for schedule(dynamic, 4)
    for (int64_t n = 0; n < int64_t(refs.size()); ++n) {
      const Doc& d = docs[size_t(refs[size_t(n)].doc)];
      const int64_t i = refs[size_t(n)].i, row = d.q_start + i;
      for (int g = 0; g < Hkv; ++g) {
        const auto keys = visible_keys(topo, d, position(d, i), topk + (g * total_q + row) * K);
        if (keys.empty()) continue;  // out 0, lse -inf, no gradient
        attend_group(topo, d, row, g, keys, q, k, v, dout, work, r, dk_acc, dv_acc);
      }
    }
  }
  if (backward)
    for (int t = 0; t < nthreads; ++t)
      for (size_t e = 0; e < r.dk.size(); ++e) {
        r.dk[e] += dk_part[size_t(t)][e];
        r.dv[e] += dv_part[size_t(t)][e];
      }
  return r;
}

}  // namespace

AttentionResult attention_forward(const Topology& topo, const std::vector<Doc>& docs, const float* q, const float* k,
                                  const float* v, const int32_t* topk, int64_t total_k,
                                  const std::vector<int64_t>& rows) {
  return attention(topo, docs, q, k, v, topk, nullptr, total_k, rows);
}

AttentionResult attention_backward(const Topology& topo, const std::vector<Doc>& docs, const float* q, const float* k,
                                   const float* v, const int32_t* topk, const float* dout, int64_t total_k) {
  return attention(topo, docs, q, k, v, topk, dout, total_k, {});
}

// ---------------------------------------------------------------------------------------
// KL backward

namespace {

// One (query row, index head g): ds over the selected keys, accumulated into dindex_q of the
// row and dindex_k of the keys.
MSA_ORACLE_HOT void kl_group(const Topology& topo, const Doc& d, int64_t row, int g, const std::vector<int64_t>& keys,
                             const float* q, const float* k, const float* lse, const float* index_q,
                             const float* index_k, double index_lse, double grad_scale, std::vector<double>& qg,
                             double* dqi, double* dk_acc) {
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, D = topo.head_dim, Di = topo.index_head_dim;
  const int G = Hq / Hkv, h0 = g * G;
  const double sm_scale = attention_scale(topo), ix_scale = index_scale(topo);
  qg.resize(size_t(G * D));
  for (int e = 0; e < G * D; ++e) qg[size_t(e)] = q[(row * Hq + h0) * D + e];
  const float* qi = index_q + (row * topo.num_index_heads + g) * Di;
  for (int64_t t : keys) {
    // teacher = mean over the group's heads of the main softmax probability of key t.
    const float* kt = k + ((d.k_start + t) * Hkv + g) * D;
    double teacher = 0;
    for (int h = 0; h < G; ++h)
      teacher += std::exp(sm_scale * dot(qg.data() + h * D, kt, D) - double(lse[row * Hq + h0 + h]));
    teacher /= G;
    const float* ki = index_k + (d.k_start + t) * Di;
    const double student = std::exp(ix_scale * dot(qi, ki, Di) - index_lse);
    const double ds = (student - teacher) * grad_scale;
    axpy(ds * ix_scale, ki, dqi, Di);
    axpy(ds * ix_scale, qi, dk_acc + (d.k_start + t) * Di, Di);
  }
}

}  // namespace

KlResult kl_backward(const Topology& topo, const std::vector<Doc>& docs, const float* q, const float* k,
                     const float* lse, const float* index_q, const float* index_k, const float* index_lse,
                     const int32_t* topk, int64_t total_k, double grad_scale) {
  const int Hi = topo.num_index_heads, Di = topo.index_head_dim, K = topo.topk;
  const int64_t total_q = total_queries(docs);
  KlResult r;
  r.dindex_q.assign(size_t(total_q * Hi * Di), 0.0);
  r.dindex_k.assign(size_t(total_k * Di), 0.0);
  const auto refs = all_queries(docs);
  const int nthreads = threads();
  std::vector<std::vector<double>> dk_part(static_cast<size_t>(nthreads));

#pragma omp parallel num_threads(nthreads)
  {
    const int tid = omp_get_thread_num();
    dk_part[size_t(tid)].assign(size_t(total_k * Di), 0.0);
    std::vector<double> qg;
#pragma omp for schedule(dynamic, 4)
    for (int64_t n = 0; n < int64_t(refs.size()); ++n) {
      const Doc& d = docs[size_t(refs[size_t(n)].doc)];
      const int64_t i = refs[size_t(n)].i, row = d.q_start + i;
      for (int g = 0; g < Hi; ++g) {
        const auto keys = visible_keys(topo, d, position(d, i), topk + (g * total_q + row) * K);
        if (keys.empty()) continue;
        kl_group(topo, d, row, g, keys, q, k, lse, index_q, index_k, double(index_lse[g * total_q + row]), grad_scale,
                 qg, r.dindex_q.data() + (row * Hi + g) * Di, dk_part[size_t(tid)].data());
      }
    }
  }
  for (int t = 0; t < nthreads; ++t)
    for (size_t e = 0; e < r.dindex_k.size(); ++e) r.dindex_k[e] += dk_part[size_t(t)][e];
  return r;
}

// ---------------------------------------------------------------------------------------
// k2q plan

Plan build_plan(const Topology& topo, const std::vector<Doc>& docs, const int32_t* topk, int q_per_cta) {
  const int Hkv = topo.num_kv_heads, K = topo.topk, B = topo.block_size;
  const int64_t total_q = total_queries(docs), edges = total_q * K;
  Plan plan;

  // Rows, level-major: every document's block 0, then every block 1, ...
  int64_t max_blocks = 0;
  for (const Doc& d : docs) max_blocks = std::max(max_blocks, (d.k_len + B - 1) / B);
  for (int64_t j = 0; j < max_blocks; ++j)
    for (size_t b = 0; b < docs.size(); ++b)
      if (j < (docs[b].k_len + B - 1) / B) {
        plan.rows.push_back(int32_t(b));
        plan.rows.push_back(int32_t(j));
      }
  plan.total_rows = int64_t(plan.rows.size() / 2);
  const int64_t R = plan.total_rows;

  plan.row_ptr.assign(size_t(Hkv * (R + 1)), 0);
  plan.q_indices.assign(size_t(Hkv * edges), -1);
  plan.split_slot.assign(size_t(Hkv * edges), -1);
  plan.split_counts.assign(size_t(total_q * Hkv), 0);
  plan.used_edges.assign(size_t(Hkv), 0);

  for (int h = 0; h < Hkv; ++h) {
    const int32_t* sel = topk + h * total_q * K;
    for (int64_t row = 0; row < total_q; ++row) {
      int c = 0;
      for (int s = 0; s < K; ++s) c += sel[row * K + s] >= 0;
      plan.split_counts[size_t(row * Hkv + h)] = c;
    }
    int64_t cursor = 0;
    for (int64_t r = 0; r < R; ++r) {
      const Doc& d = docs[size_t(plan.rows[size_t(2 * r)])];
      const int32_t j = plan.rows[size_t(2 * r + 1)];
      const int64_t begin = cursor;
      for (int64_t i = 0; i < d.q_len; ++i) {
        const int32_t* ids = sel + (d.q_start + i) * K;
        if (std::find(ids, ids + K, j) == ids + K) continue;
        int slot = 0;
        for (int s = 0; s < K; ++s) slot += ids[s] >= 0 && ids[s] < j;
        plan.q_indices[size_t(h * edges + cursor)] = int32_t(i);
        plan.split_slot[size_t(h * edges + cursor)] = slot;
        ++cursor;
      }
      plan.row_ptr[size_t(h * (R + 1) + r + 1)] = int32_t(cursor);
      for (int64_t off = 0; off < cursor - begin; off += q_per_cta)
        plan.work.push_back({h, int32_t(r), int32_t(begin + off), int32_t(std::min<int64_t>(q_per_cta, cursor - begin - off)),
                             plan.rows[size_t(2 * r)], j});
    }
    plan.used_edges[size_t(h)] = cursor;
  }
  return plan;
}

// ---------------------------------------------------------------------------------------
// Merge states

MergeResult merge_states(const float* out_partials, const float* lse_partials, int64_t S, int64_t rows, int64_t H,
                         int64_t D) {
  MergeResult r;
  r.out.assign(size_t(rows * H * D), 0.0);
  r.lse.assign(size_t(rows * H), kNegInf);
  for (int64_t x = 0; x < rows * H; ++x) {
    double m = kNegInf;
    for (int64_t s = 0; s < S; ++s) m = std::max(m, double(lse_partials[s * rows * H + x]));
    if (!std::isfinite(m)) continue;  // every partial empty
    double z = 0;
    for (int64_t s = 0; s < S; ++s) {
      const double w = std::exp(double(lse_partials[s * rows * H + x]) - m);
      z += w;
      axpy(w, out_partials + (s * rows * H + x) * D, r.out.data() + x * D, int(D));
    }
    for (int64_t e = 0; e < D; ++e) r.out[size_t(x * D + e)] /= z;
    r.lse[size_t(x)] = m + std::log(z);
  }
  return r;
}

}  // namespace msa::oracle
