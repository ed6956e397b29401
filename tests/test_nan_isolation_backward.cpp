// NaN isolation in the backward and KL backward: a key or value that a row does not attend
// to (masked by causality, past its document, or in a block it did not select) must not
// change that row's gradients, and a key no row attends gets exactly zero gradient. Each
// case runs the pass twice on the CPU, on clean inputs and with NaN written into K, V or
// the index keys at chosen keys (the forward outputs and LSEs come from the clean inputs:
// they do not depend on unattended keys), and compares; the GPU tests compare CUDA with the
// CPU backend on the same poisoned inputs.
#include <algorithm>
#include <cmath>
#include <limits>

#include "test_gpu_support.h"

namespace msa::test {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Token `t`, KV head `g`: all 128 dims of row (t, g) of a [T, H, 128] tensor set to NaN.
void poison_row(HostTensor& x, int64_t t, int g) {
  const int64_t H = x.shape()[1], D = x.shape()[2];
  for (int64_t e = 0; e < D; ++e) x.set((t * H + g) * D + e, kNaN);
}

// Whether query row `r` attends key token `t` through KV head g's selection.
bool attends(const Topology& topo, const PackedLayout& L, const std::vector<int32_t>& ids, int64_t r, int64_t t, int g) {
  const int b = L.query_document()[size_t(r)];
  const DocumentSpan& d = L.document(b);
  const int64_t local_t = t - d.k_start, pos = d.k_len - d.q_len + (r - d.q_start);
  if (local_t < 0 || local_t >= d.k_len || local_t > pos) return false;
  for (int s = 0; s < topo.topk; ++s)
    if (ids[size_t((g * L.total_q() + r) * topo.topk + s)] == local_t / topo.block_size) return true;
  return false;
}

// A selection where every row takes its local block, and rows at positions >= `skip_from`
// of each document skip block `skip_block` (so that its keys past `skip_from` are seen by
// no row). Other blocks: all, up to the topk.
HostTensor local_selection(const Topology& topo, const PackedLayout& L, int64_t skip_from, int32_t skip_block) {
  HostTensor topk(DType::i32, {topo.num_index_heads, L.total_q(), topo.topk});
  int32_t* ids = topk.data<int32_t>();
  std::fill(ids, ids + topk.numel(), -1);
  for (int g = 0; g < topo.num_index_heads; ++g)
    for (const DocumentSpan& d : L.documents())
      for (int64_t i = 0; i < d.q_len; ++i) {
        const int64_t pos = d.k_len - d.q_len + i;
        const int32_t local = int32_t(pos / topo.block_size);
        int n = 0;
        int32_t* row = ids + (g * L.total_q() + d.q_start + i) * topo.topk;
        for (int32_t j = std::max<int32_t>(0, local - topo.topk + 1); j <= local; ++j)
          if (!(pos >= skip_from && j == skip_block)) row[n++] = j;
      }
  return topk;
}

struct Poison {
  int64_t token;  // packed key token
  bool k, v;
};

HostTensor poisoned(const HostTensor& x, const std::vector<Poison>& at, bool Poison::*which, int Hkv) {
  HostTensor y = x;
  for (const Poison& p : at)
    if (p.*which)
      for (int g = 0; g < Hkv; ++g) poison_row(y, p.token, g);
  return y;
}

// Backward of `c` with the poison applied, out / lse from the clean forward.
BackwardOutputs poisoned_backward(const AttentionCase& c, const ForwardOutputs& fwd, const HostTensor& dout,
                                  const std::vector<Poison>& at) {
  AttentionCase p{c.topo, c.layout, c.q, poisoned(c.k, at, &Poison::k, c.topo.num_kv_heads),
                  poisoned(c.v, at, &Poison::v, c.topo.num_kv_heads), c.topk, c.plan};
  return run_backward(p, fwd, dout, DType::f32);
}

// Rows (query, KV head group) and keys the poison may reach, and the checks against the clean run.
void expect_isolated(const AttentionCase& c, const BackwardOutputs& clean, const BackwardOutputs& got,
                     const std::vector<Poison>& at) {
  const Topology& topo = c.topo;
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, G = Hq / Hkv, D = topo.head_dim;
  const auto ids = c.topk.ints();
  const auto dq0 = clean.dq.floats(), dq1 = got.dq.floats();
  int64_t changed_rows = 0, nan_rows = 0, reached_rows = 0;
  for (int64_t r = 0; r < c.layout.total_q(); ++r)
    for (int g = 0; g < Hkv; ++g) {
      bool reached = false;
      for (const Poison& p : at) reached |= attends(topo, c.layout, ids, r, p.token, g);
      for (int h = g * G; h < (g + 1) * G; ++h) {
        const size_t o = size_t((r * Hq + h) * D);
        if (reached) {
          nan_rows += std::isnan(dq1[o]);
        } else if (!std::equal(dq0.begin() + o, dq0.begin() + o + D, dq1.begin() + o)) {
          if (changed_rows++ < 3) ADD_FAILURE() << "dq of row " << r << " head " << h << " changed by keys it does not attend";
        }
        reached_rows += reached;
      }
    }
  EXPECT_EQ(changed_rows, 0) << "rows whose dq a poisoned key they do not attend changed";
  EXPECT_EQ(nan_rows, reached_rows) << "rows attending a NaN key must get NaN dq";
  // Keys: every key but the poisoned ones keeps its clean gradient (their contributions come
  // from finite scores); a poisoned key no row attends gets exactly zero.
  const auto dk0 = clean.dk.floats(), dk1 = got.dk.floats(), dv0 = clean.dv.floats(), dv1 = got.dv.floats();
  int64_t changed_keys = 0, nonzero_unattended = 0;
  for (int64_t t = 0; t < c.layout.total_k(); ++t)
    for (int g = 0; g < Hkv; ++g) {
      const size_t o = size_t((t * Hkv + g) * D);
      const bool is_poisoned = std::any_of(at.begin(), at.end(), [&](const Poison& p) { return p.token == t; });
      if (!is_poisoned) {
        changed_keys += !std::equal(dk0.begin() + o, dk0.begin() + o + D, dk1.begin() + o) ||
                        !std::equal(dv0.begin() + o, dv0.begin() + o + D, dv1.begin() + o);
        continue;
      }
      bool attended = false;
      for (int64_t r = 0; r < c.layout.total_q() && !attended; ++r) attended = attends(topo, c.layout, ids, r, t, g);
      if (!attended)
        for (int e = 0; e < D; ++e) nonzero_unattended += dk1[o + size_t(e)] != 0.f || dv1[o + size_t(e)] != 0.f;
    }
  EXPECT_EQ(changed_keys, 0) << "(key, head) pairs whose dk / dv the poison changed";
  EXPECT_EQ(nonzero_unattended, 0) << "dk / dv of a poisoned key no row attends must be exactly 0";
}

struct BackwardNanCase {
  AttentionCase c;
  ForwardOutputs fwd;
  HostTensor dout;
  std::vector<Poison> at;
};

// Two documents of 200 and 300 tokens. Poison: key 150 of the first (masked for its rows
// 128..149, unseen by rows < 128), key 70 of the second (masked for its rows 0..69), and, with
// `skip`, key 290 of the second in block 2, which rows >= 260 do not select (rows 256..259
// mask it): that key is attended by no row.
BackwardNanCase make_nan_case(std::mt19937_64& rng, bool k, bool v) {
  const Topology topo = Topology::minimax_m3(4);
  const PackedLayout L = layout_of({200, 300});
  HostTensor topk = local_selection(topo, L, 260, 2);
  AttentionCase c = make_case(rng, topo, L, std::move(topk));
  ForwardOutputs fwd = run_forward(c);
  HostTensor dout = random_tensor(rng, {L.total_q(), topo.num_q_heads, topo.head_dim});
  std::vector<Poison> at{{150, k, v}, {200 + 70, k, v}, {200 + 290, k, v}};
  return {std::move(c), std::move(fwd), std::move(dout), std::move(at)};
}

void check_cpu_backward_isolation(bool k, bool v) {
  MSA_SEEDED_RNG(rng);
  const BackwardNanCase n = make_nan_case(rng, k, v);
  const BackwardOutputs clean = run_backward(n.c, n.fwd, n.dout, DType::f32);
  expect_isolated(n.c, clean, poisoned_backward(n.c, n.fwd, n.dout, n.at), n.at);
}

TEST(NanIsolationBackward, NanValueAtMaskedKeys) { check_cpu_backward_isolation(false, true); }
TEST(NanIsolationBackward, NanKeyAtMaskedKeys) { check_cpu_backward_isolation(true, false); }
TEST(NanIsolationBackward, NanKeyAndValueAtMaskedKeys) { check_cpu_backward_isolation(true, true); }

// ---- KL backward ---------------------------------------------------------------------------

struct KlNanCase {
  AttentionCase c;
  HostTensor iq, ik, lse, index_lse;
  std::vector<Poison> at;  // k: main key, v: index key
};

KlNanCase make_kl_nan_case(std::mt19937_64& rng, bool main_key, bool index_key) {
  BackwardNanCase b = make_nan_case(rng, main_key, index_key);
  const Topology& topo = b.c.topo;
  const PackedLayout& L = b.c.layout;
  HostTensor iq = random_tensor(rng, {L.total_q(), topo.num_index_heads, topo.index_head_dim});
  HostTensor ik = random_tensor(rng, {L.total_k(), 1, topo.index_head_dim});
  // Index LSEs of the clean index keys over the selected, visible keys (temperature 1).
  HostTensor index_lse(DType::f32, {topo.num_index_heads, L.total_q()});
  const auto ids = b.c.topk.ints();
  const float scale = topo.indexer_scale();
  for (int g = 0; g < topo.num_index_heads; ++g)
    for (int64_t r = 0; r < L.total_q(); ++r) {
      double m = -INFINITY, s = 0;
      std::vector<double> z;
      for (int64_t t = 0; t < L.total_k(); ++t) {
        if (!attends(topo, L, ids, r, t, g)) continue;
        double dot = 0;
        for (int e = 0; e < topo.index_head_dim; ++e)
          dot += double(iq.at((r * topo.num_index_heads + g) * topo.index_head_dim + e)) * ik.at(t * topo.index_head_dim + e);
        z.push_back(dot * scale);
        m = std::max(m, z.back());
      }
      for (double x : z) s += std::exp(x - m);
      index_lse.set(g * L.total_q() + r, z.empty() ? -INFINITY : float(m + std::log(s)));
    }
  return {std::move(b.c), std::move(iq), std::move(ik), std::move(b.fwd.lse), std::move(index_lse), std::move(b.at)};
}

struct KlGradients {
  HostTensor dq, dk;
};

KlGradients run_kl_on(const KlNanCase& n, const HostTensor& k, const HostTensor& ik, Device device = Device::cpu(),
                      bool deterministic = false) {
  const AttentionCase& c = n.c;
  const Topology& topo = c.topo;
  KlGradients out{HostTensor(DType::f32, {c.layout.total_q(), topo.num_index_heads, topo.index_head_dim}),
                  HostTensor(DType::f32, {c.layout.total_k(), 1, topo.index_head_dim})};
  poison(out.dq);
  poison(out.dk);
  auto fill = [&](KlBackwardParams& p, auto& t) {
    p.q = t.q.view();
    p.k = t.k.view();
    p.lse = t.lse.view();
    p.index_q = t.iq.view();
    p.index_k = t.ik.view();
    p.index_lse = t.ilse.view();
    p.topk = t.topk.view();
    p.dindex_q = t.dq.view();
    p.dindex_k = t.dk.view();
  };
  KlBackwardParams p;
  if (!device.is_cuda()) {
    struct {
      const HostTensor &q, &k, &lse, &iq, &ik, &ilse, &topk;
      HostTensor &dq, &dk;
    } t{c.q, k, n.lse, n.iq, ik, n.index_lse, c.topk, out.dq, out.dk};
    fill(p, t);
    kl_backward(topo, c.layout, c.plan, p);
    return out;
  }
  struct {
    DeviceTensor q, k, lse, iq, ik, ilse, topk, dq, dk;
  } t{DeviceTensor(c.q), DeviceTensor(k), DeviceTensor(n.lse), DeviceTensor(n.iq), DeviceTensor(ik),
      DeviceTensor(n.index_lse), DeviceTensor(c.topk), DeviceTensor(out.dq), DeviceTensor(out.dk)};
  fill(p, t);
  const SparsePlan plan = build_plan(topo, c.layout, t.topk.view());
  RunOptions opt;
  opt.deterministic = deterministic;
  kl_backward(topo, c.layout, plan, p, opt);
  return {t.dq.host(), t.dk.host()};
}

void check_cpu_kl_isolation(bool main_key, bool index_key) {
  MSA_SEEDED_RNG(rng);
  const KlNanCase n = make_kl_nan_case(rng, main_key, index_key);
  const Topology& topo = n.c.topo;
  const KlGradients clean = run_kl_on(n, n.c.k, n.ik);
  const KlGradients got = run_kl_on(n, poisoned(n.c.k, n.at, &Poison::k, topo.num_kv_heads),
                                    poisoned(n.ik, n.at, &Poison::v, 1));
  const int Hi = topo.num_index_heads, D = topo.index_head_dim;
  const auto ids = n.c.topk.ints();
  const auto q0 = clean.dq.floats(), q1 = got.dq.floats();
  int64_t changed = 0, nan_rows = 0, reached_rows = 0;
  for (int64_t r = 0; r < n.c.layout.total_q(); ++r)
    for (int g = 0; g < Hi; ++g) {
      bool reached = false;
      for (const Poison& p : n.at) reached |= attends(topo, n.c.layout, ids, r, p.token, g);
      const size_t o = size_t((r * Hi + g) * D);
      if (reached) {
        ++reached_rows;
        nan_rows += std::isnan(q1[o]);
      } else {
        changed += !std::equal(q0.begin() + o, q0.begin() + o + D, q1.begin() + o);
      }
    }
  EXPECT_EQ(changed, 0) << "d index_q of rows that do not attend a poisoned key changed";
  EXPECT_EQ(nan_rows, reached_rows) << "rows attending a NaN key must get NaN d index_q";
  const auto k0 = clean.dk.floats(), k1 = got.dk.floats();
  int64_t changed_keys = 0;
  for (int64_t t = 0; t < n.c.layout.total_k(); ++t) {
    const bool is_poisoned = std::any_of(n.at.begin(), n.at.end(), [&](const Poison& p) { return p.token == t; });
    const size_t o = size_t(t * D);
    if (!is_poisoned) changed_keys += !std::equal(k0.begin() + o, k0.begin() + o + D, k1.begin() + o);
  }
  EXPECT_EQ(changed_keys, 0) << "d index_k of keys that are not poisoned changed";
  // Key 490 (the last poison) is attended by no row: exactly zero.
  for (int e = 0; e < D; ++e) EXPECT_EQ(k1[size_t(n.at.back().token * D + e)], 0.f) << "dim " << e;
}

TEST(NanIsolationKl, NanIndexKeyAtMaskedKeys) { check_cpu_kl_isolation(false, true); }
TEST(NanIsolationKl, NanMainKeyAtMaskedKeys) { check_cpu_kl_isolation(true, false); }

// ---- GPU against CPU -----------------------------------------------------------------------

// Same NaN pattern as the CPU, finite elements close to it (spec §7 gradient metrics).
void expect_same_nans_and_close(const std::string& what, const HostTensor& got, const HostTensor& want) {
  const auto g = got.floats(), w = want.floats();
  ASSERT_EQ(g.size(), w.size());
  std::vector<float> gf;
  std::vector<double> wf;
  int64_t nan_mismatch = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(w[i]) != std::isnan(g[i])) {
      ++nan_mismatch;
      continue;
    }
    if (!std::isnan(w[i])) {
      gf.push_back(g[i]);
      wf.push_back(w[i]);
    }
  }
  EXPECT_EQ(nan_mismatch, 0) << what << ": elements NaN on one backend only";
  expect_gradient(what, gf, wf);
}

void check_gpu_backward_isolation(bool k, bool v) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const BackwardNanCase n = make_nan_case(rng, k, v);
  const AttentionCase& c = n.c;
  const HostTensor pk = poisoned(c.k, n.at, &Poison::k, c.topo.num_kv_heads);
  const HostTensor pv = poisoned(c.v, n.at, &Poison::v, c.topo.num_kv_heads);
  const BackwardOutputs want = poisoned_backward(c, n.fwd, n.dout, n.at);
  DeviceTensor q(c.q), dk_in(pk), dv_in(pv), topk(c.topk), out(n.fwd.out), lse(n.fwd.lse), dout(n.dout);
  const SparsePlan plan = build_plan(c.topo, c.layout, topk.view());
  for (bool det : {false, true}) {
    SCOPED_TRACE(det ? "deterministic" : "atomic");
    const GpuGrads got = gpu_backward(c, plan, q, dk_in, dv_in, topk, out, lse, dout, det, DType::f32);
    expect_same_nans_and_close("dq", got.dq, want.dq);
    expect_same_nans_and_close("dk", got.dk, want.dk);
    expect_same_nans_and_close("dv", got.dv, want.dv);
    // The key no row attends: exactly zero on the GPU too.
    const auto dkh = got.dk.floats(), dvh = got.dv.floats();
    const int64_t o = n.at.back().token * c.topo.num_kv_heads * c.topo.head_dim;
    for (int64_t e = 0; e < c.topo.num_kv_heads * c.topo.head_dim; ++e)
      ASSERT_TRUE(dkh[size_t(o + e)] == 0.f && dvh[size_t(o + e)] == 0.f) << "element " << e;
  }
}

TEST(GpuNanIsolation, BackwardNanValueAtMaskedKeys) { check_gpu_backward_isolation(false, true); }
TEST(GpuNanIsolation, BackwardNanKeyAtMaskedKeys) { check_gpu_backward_isolation(true, false); }

void check_gpu_kl_isolation(bool main_key, bool index_key) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  const KlNanCase n = make_kl_nan_case(rng, main_key, index_key);
  const HostTensor pk = poisoned(n.c.k, n.at, &Poison::k, n.c.topo.num_kv_heads);
  const HostTensor pik = poisoned(n.ik, n.at, &Poison::v, 1);
  const KlGradients want = run_kl_on(n, pk, pik);
  for (bool det : {false, true}) {
    SCOPED_TRACE(det ? "deterministic" : "atomic");
    const KlGradients got = run_kl_on(n, pk, pik, kGpu, det);
    expect_same_nans_and_close("dindex_q", got.dq, want.dq);
    expect_same_nans_and_close("dindex_k", got.dk, want.dk);
  }
}

TEST(GpuNanIsolation, KlNanIndexKeyAtMaskedKeys) { check_gpu_kl_isolation(false, true); }
TEST(GpuNanIsolation, KlNanMainKeyAtMaskedKeys) { check_gpu_kl_isolation(true, false); }

}  // namespace
}  // namespace msa::test
