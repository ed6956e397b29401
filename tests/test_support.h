// Shared helpers of the test suite: seeded random inputs, owning host tensors, layouts,
// poisoning and the comparison metrics (relative L2 error, cosine similarity, allclose).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "msa/msa.h"
#include "oracle/oracle.h"

namespace msa::test {

// ---- randomness --------------------------------------------------------------------------

// Seed of a test: MSA_TEST_SEED if set (to replay a failure), else fresh. Printed so that a
// failing run can be reproduced.
inline uint64_t test_seed() {
  if (const char* env = std::getenv("MSA_TEST_SEED")) return std::strtoull(env, nullptr, 10);
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

// Declares `rng` seeded by test_seed() and attaches the seed to every failure message.
#define MSA_SEEDED_RNG(rng)                                                                   \
  const uint64_t rng##_seed = ::msa::test::test_seed();                                       \
  std::mt19937_64 rng(rng##_seed);                                                            \
  SCOPED_TRACE("seed " + std::to_string(rng##_seed) + " (rerun with MSA_TEST_SEED=" +         \
               std::to_string(rng##_seed) + ")");                                             \
  ::testing::Test::RecordProperty("seed", std::to_string(rng##_seed))

// ---- host tensors ------------------------------------------------------------------------

// An owning, contiguous CPU tensor.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    numel_ = n;
    bytes_.assign(size_t(n * dtype_size(dtype)) + 1, 0);  // +1: never a null pointer, even when empty
  }
  TensorView view() const {
    return TensorView::contiguous(const_cast<unsigned char*>(bytes_.data()), dtype_, shape_);
  }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  template <typename T> T* data() { return reinterpret_cast<T*>(bytes_.data()); }
  template <typename T> const T* data() const { return reinterpret_cast<const T*>(bytes_.data()); }
  // Element e as float (exact for bf16 / f16 / f32 / e4m3).
  float at(int64_t e) const { return load_as_float(bytes_.data(), dtype_, e); }
  void set(int64_t e, float v) { store_from_float(bytes_.data(), dtype_, e, v); }
  std::vector<float> floats() const {
    std::vector<float> f(static_cast<size_t>(numel_));
    for (int64_t e = 0; e < numel_; ++e) f[size_t(e)] = at(e);
    return f;
  }
  std::vector<int32_t> ints() const {
    const auto* p = data<int32_t>();
    return std::vector<int32_t>(p, p + numel_);
  }
  // Raw bytes (for "left untouched" checks).
  std::vector<unsigned char> raw() const { return {bytes_.begin(), bytes_.begin() + numel_ * dtype_size(dtype_)}; }

 private:
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  std::vector<unsigned char> bytes_;
};

// normal(0, 1) * scale, rounded to the tensor dtype (bf16 by default).
inline HostTensor random_tensor(std::mt19937_64& rng, std::vector<int64_t> shape, float scale = 0.2f,
                                DType dtype = DType::bf16) {
  HostTensor t(dtype, std::move(shape));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t e = 0; e < t.numel(); ++e) t.set(e, normal(rng) * scale);
  return t;
}

// The same values in another dtype (exact where every value fits it, as E4M3 in bf16).
inline HostTensor converted(const HostTensor& t, DType dtype) {
  HostTensor out(dtype, t.shape());
  for (int64_t e = 0; e < t.numel(); ++e) out.set(e, t.at(e));
  return out;
}

inline HostTensor int_tensor(const std::vector<int32_t>& values, std::vector<int64_t> shape) {
  HostTensor t(DType::i32, std::move(shape));
  std::memcpy(t.data<int32_t>(), values.data(), values.size() * sizeof(int32_t));
  return t;
}

// Sentinel written into outputs before a run: NaN for floating tensors, INT32_MIN for ints.
inline constexpr int32_t kIntPoison = std::numeric_limits<int32_t>::min();
inline void poison(HostTensor& t) {
  if (t.dtype() == DType::i32) {
    for (int64_t e = 0; e < t.numel(); ++e) t.data<int32_t>()[e] = kIntPoison;
  } else {
    for (int64_t e = 0; e < t.numel(); ++e) t.set(e, std::numeric_limits<float>::quiet_NaN());
  }
}

inline int64_t count_nan(const std::vector<float>& v) {
  int64_t n = 0;
  for (float x : v) n += std::isnan(x);
  return n;
}

// ---- layouts -----------------------------------------------------------------------------

inline std::vector<int32_t> cumulative(const std::vector<int64_t>& lengths) {
  std::vector<int32_t> cu{0};
  for (int64_t n : lengths) cu.push_back(int32_t(cu.back() + n));
  return cu;
}

// Queries and keys are the same tokens (training).
inline PackedLayout layout_of(const std::vector<int64_t>& lengths) {
  return PackedLayout::from_cu_seqlens(cumulative(lengths), cumulative(lengths));
}

// Chunked prefill: document b has q_lens[b] new queries at the end of k_lens[b] keys.
inline PackedLayout layout_of(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens) {
  return PackedLayout::from_cu_seqlens(cumulative(q_lens), cumulative(k_lens));
}

inline std::vector<oracle::Doc> oracle_docs(const PackedLayout& L) {
  return oracle::documents(L.cu_seqlens_q(), L.cu_seqlens_k(), L.fragment_indices());
}

inline std::string describe(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << ']';
  return os.str();
}

inline std::string describe(const std::vector<int32_t>& v) {
  return describe(std::vector<int64_t>(v.begin(), v.end()));
}

// ---- metrics -----------------------------------------------------------------------------

// ||a - ref|| / ||ref|| (0 when both are zero).
inline double relative_l2(const std::vector<float>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(a[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  if (den == 0) return num == 0 ? 0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

inline double cosine_similarity(const std::vector<float>& a, const std::vector<double>& ref) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ab += double(a[i]) * ref[i];
    aa += double(a[i]) * double(a[i]);
    bb += ref[i] * ref[i];
  }
  if (aa == 0 && bb == 0) return 1;
  return ab / std::sqrt(aa * bb);
}

// Elements where |a - ref| > atol + rtol |ref| (NaN counts as a mismatch); the first few
// are described in `detail`.
inline int64_t count_not_close(const std::vector<float>& a, const std::vector<double>& ref, double atol, double rtol,
                               std::string* detail = nullptr, int64_t inner = 1) {
  int64_t bad = 0;
  std::ostringstream os;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double x = a[i], y = ref[i];
    const bool same_inf = std::isinf(x) && std::isinf(y) && (x > 0) == (y > 0);
    if (same_inf) continue;
    if (!(std::fabs(x - y) <= atol + rtol * std::fabs(y))) {
      if (bad < 5)
        os << " [element " << i << " (row " << int64_t(i) / inner << ")] got " << x << " want " << y << ";";
      ++bad;
    }
  }
  if (detail) *detail = os.str();
  return bad;
}

// gtest assertions of the docs/semantics.md §10 metrics on one tensor.
inline void expect_close(const std::string& what, const std::vector<float>& got, const std::vector<double>& want,
                         double atol, double rtol, int64_t inner = 1) {
  ASSERT_EQ(got.size(), want.size()) << what;
  std::string detail;
  const int64_t bad = count_not_close(got, want, atol, rtol, &detail, inner);
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " elements outside atol=" << atol
                    << " rtol=" << rtol << ":" << detail;
}

inline void expect_rel_l2(const std::string& what, const std::vector<float>& got, const std::vector<double>& want,
                          double limit) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(count_nan(got), 0) << what << " holds NaN (an element was not written?)";
  const double err = relative_l2(got, want);
  ::testing::Test::RecordProperty(what + "_rel_l2", std::to_string(err));
  EXPECT_LT(err, limit) << what << ": relative L2 error " << err;
}

inline void expect_gradient(const std::string& what, const std::vector<float>& got, const std::vector<double>& want) {
  expect_rel_l2(what, got, want, 1e-2);
  const double cos = cosine_similarity(got, want);
  ::testing::Test::RecordProperty(what + "_cosine", std::to_string(cos));
  EXPECT_GT(cos, 0.99) << what << ": cosine similarity " << cos;
}

// Runs `call`, expects msa::Error whose message contains every piece of `pieces`.
inline void expect_error(const std::function<void()>& call, const std::vector<std::string>& pieces,
                         ErrorKind kind = ErrorKind::invalid_argument) {
  try {
    call();
    ADD_FAILURE() << "expected msa::Error containing \"" << (pieces.empty() ? "" : pieces[0]) << "\", nothing thrown";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& piece : pieces)
      EXPECT_NE(msg.find(piece), std::string::npos) << "message \"" << msg << "\" lacks \"" << piece << "\"";
    EXPECT_EQ(int(e.kind()), int(kind)) << "message: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected msa::Error, got another exception: " << e.what();
  }
}


// ---- the training pipeline on CPU tensors --------------------------------------------------

// Inputs of one attention check: q/k/v, the selection (normally the library's own, docs/semantics.md §10)
// and its plan.
struct AttentionCase {
  Topology topo;
  PackedLayout layout;
  HostTensor q, k, v;  // [total_q, Hq, 128], [total_k, Hkv, 128] x2, bf16
  HostTensor topk;     // [Hkv, total_q, 16] int32
  SparsePlan plan;
};

// The library's selection for random index vectors (normal * 0.2, bf16).
inline HostTensor library_selection(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L) {
  const HostTensor iq = random_tensor(rng, {L.total_q(), topo.num_index_heads, topo.index_head_dim});
  const HostTensor ik = random_tensor(rng, {L.total_k(), 1, topo.index_head_dim});
  HostTensor topk(DType::i32, {topo.num_index_heads, L.total_q(), topo.topk});
  SelectBlocksParams p;
  p.index_q = iq.view();
  p.index_k = ik.view();
  p.topk = topk.view();
  select_blocks(topo, L, p);
  return topk;
}

// `qk_scale` scales q and k (0.2 gives near-uniform attention; ~2 gives sharp softmax rows).
inline AttentionCase make_case(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L,
                               HostTensor topk = {}, float qk_scale = 0.2f) {
  AttentionCase c{topo, L, random_tensor(rng, {L.total_q(), topo.num_q_heads, topo.head_dim}, qk_scale),
                  random_tensor(rng, {L.total_k(), topo.num_kv_heads, topo.head_dim}, qk_scale),
                  random_tensor(rng, {L.total_k(), topo.num_kv_heads, topo.head_dim}),
                  topk.numel() ? std::move(topk) : library_selection(rng, topo, L), SparsePlan{}};
  c.plan = build_plan(topo, L, c.topk.view());
  return c;
}

struct ForwardOutputs {
  HostTensor out;  // [total_q, Hq, 128]
  HostTensor lse;  // [total_q, Hq] f32
};

inline ForwardOutputs run_forward(const AttentionCase& c, DType out_dtype = DType::bf16) {
  ForwardOutputs o{HostTensor(out_dtype, {c.layout.total_q(), c.topo.num_q_heads, c.topo.head_dim}),
                   HostTensor(DType::f32, {c.layout.total_q(), c.topo.num_q_heads})};
  poison(o.out);
  poison(o.lse);
  AttentionForwardParams p;
  p.q = c.q.view();
  p.k = c.k.view();
  p.v = c.v.view();
  p.topk = c.topk.view();
  p.out = o.out.view();
  p.lse = o.lse.view();
  sparse_attention_forward(c.topo, c.layout, c.plan, p);
  return o;
}

// Rows worth checking in a long pack: every row of short documents, the edges of each
// document and of its blocks (positions 0, 127, 128, 2047, 2048, ...) and `extra` random rows.
inline std::vector<int64_t> sample_rows(const PackedLayout& L, int extra, std::mt19937_64& rng) {
  std::set<int64_t> rows;
  for (const DocumentSpan& d : L.documents()) {
    if (d.q_len <= 130) {
      for (int64_t i = 0; i < d.q_len; ++i) rows.insert(d.q_start + i);
      continue;
    }
    for (int64_t i = 0; i < d.q_len; ++i) {
      const int64_t p = d.k_len - d.q_len + i;
      if (i < 2 || i + 2 >= d.q_len || p % 128 == 0 || p % 128 == 127) rows.insert(d.q_start + i);
    }
  }
  if (L.total_q() > 0) {
    std::uniform_int_distribution<int64_t> pick(0, L.total_q() - 1);
    for (int n = 0; n < extra; ++n) rows.insert(pick(rng));
  }
  return {rows.begin(), rows.end()};
}

// Spec §7 forward checks on `rows` (all rows when empty): out relative L2 < 1e-2 and
// atol = rtol = 3e-2; LSE atol = rtol = 1e-3 on finite rows; rows without keys exactly -inf
// with zero output. Every element of every row must have been written.
inline void check_forward(const AttentionCase& c, const ForwardOutputs& o, std::vector<int64_t> rows = {}) {
  const int Hq = c.topo.num_q_heads, D = c.topo.head_dim;
  const auto got_out = o.out.floats(), got_lse = o.lse.floats();
  EXPECT_EQ(count_nan(got_out), 0) << "out holds NaN: not every element was written";
  EXPECT_EQ(count_nan(got_lse), 0) << "lse holds NaN: not every element was written";
  const auto q = c.q.floats(), k = c.k.floats(), v = c.v.floats();
  const auto ids = c.topk.ints();
  const auto want = oracle::attention_forward(c.topo, oracle_docs(c.layout), q.data(), k.data(), v.data(), ids.data(),
                                              c.layout.total_k(), rows);
  if (rows.empty())
    for (int64_t r = 0; r < c.layout.total_q(); ++r) rows.push_back(r);

  std::vector<float> out_got, lse_got;
  std::vector<double> out_want, lse_want;
  int64_t empty_rows = 0;
  for (int64_t r : rows)
    for (int h = 0; h < Hq; ++h) {
      const double wl = want.lse[size_t(r * Hq + h)];
      const float gl = got_lse[size_t(r * Hq + h)];
      if (std::isinf(wl)) {
        ++empty_rows;
        EXPECT_TRUE(std::isinf(gl) && gl < 0) << "row " << r << " head " << h << " has no keys: lse must be -inf, got " << gl;
        for (int e = 0; e < D; ++e)
          if (got_out[size_t((r * Hq + h) * D + e)] != 0) {
            ADD_FAILURE() << "row " << r << " head " << h << " has no keys: out must be 0";
            break;
          }
        continue;
      }
      lse_got.push_back(gl);
      lse_want.push_back(wl);
      for (int e = 0; e < D; ++e) {
        out_got.push_back(got_out[size_t((r * Hq + h) * D + e)]);
        out_want.push_back(want.out[size_t((r * Hq + h) * D + e)]);
      }
    }
  ::testing::Test::RecordProperty("empty_rows", std::to_string(empty_rows));
  expect_rel_l2("out", out_got, out_want, 1e-2);
  expect_close("out", out_got, out_want, 3e-2, 3e-2, D);
  expect_close("lse", lse_got, lse_want, 1e-3, 1e-3);
}

// [total_k, Hkv]: 1 where some query attends the key through head g's selection (the
// selected block AND t <= p), computed directly from the layout and the top-k ids.
inline std::vector<char> attended_keys(const Topology& topo, const PackedLayout& L, const std::vector<int32_t>& ids) {
  const int Hkv = topo.num_kv_heads, B = topo.block_size, K = topo.topk;
  std::vector<char> attended(size_t(L.total_k() * Hkv), 0);
  for (const DocumentSpan& d : L.documents())
    for (int64_t i = 0; i < d.q_len; ++i)
      for (int g = 0; g < Hkv; ++g)
        for (int s = 0; s < K; ++s) {
          const int32_t b = ids[size_t((g * L.total_q() + d.q_start + i) * K + s)];
          for (int64_t t = int64_t(b) * B; b >= 0 && t < std::min<int64_t>((b + 1) * int64_t(B), d.k_len); ++t)
            if (t <= d.k_len - d.q_len + i) attended[size_t((d.k_start + t) * Hkv + g)] = 1;
        }
  return attended;
}

struct BackwardOutputs {
  HostTensor dq, dk, dv;
};

inline BackwardOutputs run_backward(const AttentionCase& c, const ForwardOutputs& fwd, const HostTensor& dout,
                                    DType grad_dtype = DType::bf16, const RunOptions& opt = {}) {
  const int64_t Tq = c.layout.total_q(), Tk = c.layout.total_k();
  BackwardOutputs g{HostTensor(grad_dtype, {Tq, c.topo.num_q_heads, c.topo.head_dim}),
                    HostTensor(grad_dtype, {Tk, c.topo.num_kv_heads, c.topo.head_dim}),
                    HostTensor(grad_dtype, {Tk, c.topo.num_kv_heads, c.topo.head_dim})};
  poison(g.dq);
  poison(g.dk);
  poison(g.dv);
  AttentionBackwardParams p;
  p.q = c.q.view();
  p.k = c.k.view();
  p.v = c.v.view();
  p.topk = c.topk.view();
  p.out = fwd.out.view();
  p.lse = fwd.lse.view();
  p.dout = dout.view();
  p.dq = g.dq.view();
  p.dk = g.dk.view();
  p.dv = g.dv.view();
  sparse_attention_backward(c.topo, c.layout, c.plan, p, opt);
  return g;
}

// Gradients against the oracle: relative L2 < 1e-2 and cosine > 0.99 per tensor; elements the
// oracle leaves exactly 0 (keys no query attends, queries without keys) must be exactly 0.
// Also checks the forward outputs on every row (the oracle computes them anyway).
inline void check_backward(const AttentionCase& c, const ForwardOutputs& fwd, const HostTensor& dout,
                           const BackwardOutputs& got) {
  const auto q = c.q.floats(), k = c.k.floats(), v = c.v.floats(), g = dout.floats();
  const auto ids = c.topk.ints();
  const auto want = oracle::attention_backward(c.topo, oracle_docs(c.layout), q.data(), k.data(), v.data(), ids.data(),
                                               g.data(), c.layout.total_k());
  const struct {
    const char* name;
    const HostTensor& got;
    const std::vector<double>& want;
  } grads[] = {{"dq", got.dq, want.dq}, {"dk", got.dk, want.dk}, {"dv", got.dv, want.dv}};
  for (const auto& t : grads) expect_gradient(t.name, t.got.floats(), t.want);

  // Structural zeros: dq of (row, head) pairs without keys, dk / dv of keys no query attends.
  const int D = c.topo.head_dim;
  const std::vector<char> attended = attended_keys(c.topo, c.layout, ids);
  const auto dq = got.dq.floats(), dk = got.dk.floats(), dv = got.dv.floats();
  int64_t dq_nonzero = 0, dkv_nonzero = 0;
  for (size_t x = 0; x < want.lse.size(); ++x)
    if (std::isinf(want.lse[x]))
      for (int e = 0; e < D; ++e) dq_nonzero += dq[x * size_t(D) + size_t(e)] != 0.0f;
  for (size_t x = 0; x < attended.size(); ++x)
    if (!attended[x])
      for (int e = 0; e < D; ++e) dkv_nonzero += dk[x * size_t(D) + size_t(e)] != 0.0f || dv[x * size_t(D) + size_t(e)] != 0.0f;
  EXPECT_EQ(dq_nonzero, 0) << "dq of queries without keys must be exactly 0";
  EXPECT_EQ(dkv_nonzero, 0) << "dk / dv of keys no query attends must be exactly 0";
  // Forward on all rows, from the same oracle pass.
  const int Hq = c.topo.num_q_heads;
  const auto out = fwd.out.floats(), lse = fwd.lse.floats();
  std::vector<float> lse_finite;
  std::vector<double> lse_want;
  for (size_t e = 0; e < want.lse.size(); ++e) {
    if (std::isinf(want.lse[e])) {
      EXPECT_TRUE(std::isinf(lse[e]) && lse[e] < 0) << "row " << e / size_t(Hq) << " head " << e % size_t(Hq);
      continue;
    }
    lse_finite.push_back(lse[e]);
    lse_want.push_back(want.lse[e]);
  }
  expect_rel_l2("out", out, want.out, 1e-2);
  expect_close("out", out, want.out, 3e-2, 3e-2, c.topo.head_dim);
  expect_close("lse", lse_finite, lse_want, 1e-3, 1e-3);
}

}  // namespace msa::test
