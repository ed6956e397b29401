// The sizes MiniMax-M3's sparse layer fixes, in one place. Every backend (CPU, CUDA training
// and inference kernels), the tool and the tests use these names instead of bare numbers;
// python/msa/constants.py mirrors them (a test checks that the two agree).
#pragma once

namespace msa::model {

inline constexpr int kBlockSize = 128;  // tokens per sparse block (= tokens per cache page)
inline constexpr int kPageSize = kBlockSize;
inline constexpr int kHeadDim = 128;    // head dim of q / k / v and of index q / index k
inline constexpr int kTopk = 16;        // selected blocks per (token, group), own block included
inline constexpr int kGroupSize = 16;   // query heads per KV head (and per index head)

}  // namespace msa::model

namespace msa::math {

inline constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * kLog2e)
inline constexpr float kLn2 = 0.6931471805599453f;    // ln(2):   ln(x)  = log2(x) * kLn2

}  // namespace msa::math
