// merge_states on the GPU against the CPU backend, with empty (-inf) and NaN partials.
#include "test_gpu_support.h"

namespace msa::test {
namespace {

void check_merge(std::mt19937_64& rng, int64_t S, int64_t R, int64_t H, int64_t D, DType part_dtype, DType out_dtype) {
  SCOPED_TRACE("S " + std::to_string(S) + " R " + std::to_string(R) + " H " + std::to_string(H) + " D " + std::to_string(D));
  const HostTensor parts = random_tensor(rng, {S, R, H, D}, 1.0f, part_dtype);
  HostTensor lse = random_tensor(rng, {S, R, H}, 3.0f, DType::f32);
  std::uniform_int_distribution<int> pick(0, 9);
  for (int64_t i = 0; i < lse.numel(); ++i) {
    const int u = pick(rng);
    if (u == 0) lse.set(i, -std::numeric_limits<float>::infinity());
    if (u == 1 && S > 1) lse.set(i, std::numeric_limits<float>::quiet_NaN());
  }
  for (int64_t h = 0; h < H; ++h) lse.set(h, -std::numeric_limits<float>::infinity());  // row 0 of slot 0
  HostTensor want_out(out_dtype, {R, H, D}), want_lse(DType::f32, {R, H});
  MergeStatesParams p;
  p.out_partials = parts.view();
  p.lse_partials = lse.view();
  p.out = want_out.view();
  p.lse = want_lse.view();
  merge_states(p);
  DeviceTensor dparts(parts), dlse(lse), out(out_dtype, {R, H, D}), olse(DType::f32, {R, H});
  out.poison();
  olse.poison();
  MergeStatesParams g;
  g.out_partials = dparts.view();
  g.lse_partials = dlse.view();
  g.out = out.view();
  g.lse = olse.view();
  merge_states(g);
  const auto go = out.host().floats(), gl = olse.host().floats();
  EXPECT_EQ(count_nan(go), 0);
  EXPECT_EQ(count_nan(gl), 0);
  expect_close("out", go, doubles(want_out.floats()), 1e-5, out_dtype == DType::bf16 ? 1e-2 : 1e-5);
  expect_close("lse", gl, doubles(want_lse.floats()), 1e-5, 1e-5);
}

TEST(GpuMergeStates, MatchesCpu) {
  MSA_REQUIRE_GPU();
  MSA_SEEDED_RNG(rng);
  check_merge(rng, 1, 50, 3, 128, DType::bf16, DType::bf16);
  check_merge(rng, 4, 300, 64, 128, DType::bf16, DType::f32);
  check_merge(rng, 7, 33, 5, 200, DType::f32, DType::f32);
  check_merge(rng, 2, 17, 2, 64, DType::f32, DType::bf16);
  // fp32 partials of 128 dims with 2, 4 or 8 splits (decode's): the kernel that loads a row at once.
  check_merge(rng, 2, 41, 16, 128, DType::f32, DType::f32);
  check_merge(rng, 4, 300, 64, 128, DType::f32, DType::bf16);
  check_merge(rng, 8, 29, 16, 128, DType::f32, DType::f32);
}

}  // namespace
}  // namespace msa::test
