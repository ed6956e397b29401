// merge_states against the oracle: LSE-weighted merge of partial states, empty partials
// (lse = -inf) ignored, rows whose partials are all empty give out = 0 and lse = -inf.
#include "test_support.h"

namespace msa::test {
namespace {

struct Partials {
  HostTensor out;  // [S, rows, H, D]
  HostTensor lse;  // [S, rows, H]
};

// Random partial states; each (partial, row, head) is empty with probability `empty_rate`
// (lse = -inf, out = 0), and every partial of row 0 is empty.
Partials random_partials(std::mt19937_64& rng, int64_t S, int64_t R, int64_t H, int64_t D, DType dtype,
                         double empty_rate) {
  Partials p{random_tensor(rng, {S, R, H, D}, 1.0f, dtype), HostTensor(DType::f32, {S, R, H})};
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::bernoulli_distribution empty(empty_rate);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t x = (s * R + r) * H + h;
        if (r == 0 || empty(rng)) {
          p.lse.data<float>()[x] = -INFINITY;
          for (int64_t e = 0; e < D; ++e) p.out.set(x * D + e, 0.0f);
        } else {
          p.lse.data<float>()[x] = normal(rng);
        }
      }
  return p;
}

struct Merged {
  HostTensor out;  // [rows, H, D], the partials' dtype
  HostTensor lse;  // [rows, H] f32
};

// merge_states of `in` into poisoned outputs.
Merged merge(const Partials& in) {
  const std::vector<int64_t>& shape = in.out.shape();  // [S, rows, H, D]
  Merged m{HostTensor(in.out.dtype(), {shape[1], shape[2], shape[3]}), HostTensor(DType::f32, {shape[1], shape[2]})};
  poison(m.out);
  poison(m.lse);
  MergeStatesParams p;
  p.out_partials = in.out.view();
  p.lse_partials = in.lse.view();
  p.out = m.out.view();
  p.lse = m.lse.view();
  merge_states(p);
  return m;
}

void check_merge(std::mt19937_64& rng, int64_t S, int64_t R, int64_t H, int64_t D, DType dtype, double empty_rate) {
  SCOPED_TRACE("S " + std::to_string(S) + " rows " + std::to_string(R) + " dtype " + std::string(dtype_name(dtype)));
  const Partials in = random_partials(rng, S, R, H, D, dtype, empty_rate);
  const Merged got = merge(in);

  const auto parts = in.out.floats(), plse = in.lse.floats();
  const auto want = oracle::merge_states(parts.data(), plse.data(), S, R, H, D);
  const auto got_out = got.out.floats(), got_lse = got.lse.floats();
  EXPECT_EQ(count_nan(got_out), 0) << "out holds NaN";
  EXPECT_EQ(count_nan(got_lse), 0) << "lse holds NaN";
  const double tol = dtype == DType::f32 ? 1e-5 : 1e-2;
  expect_close("out", got_out, want.out, tol, tol, D);
  expect_close("lse", got_lse, want.lse, 1e-5, 1e-5);
  // Row 0 has only empty partials.
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_TRUE(std::isinf(got_lse[size_t(h)]) && got_lse[size_t(h)] < 0) << "head " << h;
    for (int64_t e = 0; e < D; ++e) ASSERT_EQ(got_out[size_t(h * D + e)], 0.0f) << "head " << h;
  }
}

TEST(MergeStates, MatchesOracle) {
  MSA_SEEDED_RNG(rng);
  for (DType dtype : {DType::f32, DType::bf16}) {
    check_merge(rng, 1, 9, 3, 128, dtype, 0.2);
    check_merge(rng, 2, 33, 4, 128, dtype, 0.3);
    check_merge(rng, 16, 17, 2, 64, dtype, 0.5);
  }
}

TEST(MergeStates, AllPartialsEmpty) {
  MSA_SEEDED_RNG(rng);
  check_merge(rng, 4, 5, 2, 128, DType::bf16, 1.0);
}

TEST(MergeStates, SinglePartialIsIdentity) {
  MSA_SEEDED_RNG(rng);
  const Partials in = random_partials(rng, 1, 20, 4, 128, DType::f32, 0.0);
  const Merged got = merge(in);
  const auto a = in.out.floats(), b = got.out.floats();
  for (size_t e = 4 * 128; e < a.size(); ++e) ASSERT_NEAR(b[e], a[e], 1e-6 * (1 + std::fabs(a[e]))) << e;
  const auto la = in.lse.floats(), lb = got.lse.floats();
  for (size_t e = 4; e < la.size(); ++e) ASSERT_NEAR(lb[e], la[e], 1e-6 * (1 + std::fabs(la[e]))) << e;
}

}  // namespace
}  // namespace msa::test
