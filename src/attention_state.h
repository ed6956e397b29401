// The attention state of one (query, head) row - running max, sum of exponentials, output -
// and the rules for merging and normalising it. This is the one place that writes that
// arithmetic and its -inf / NaN rules; every kernel that merges states (the CUDA forward
// merge, merge_states on both backends, the paged-attention split merge, the indexer's
// selected LSE on both backends) goes through it. Usable from host C++ and CUDA device code.
//
// Units. Scores are kept in log2 units, x = s * scale * log2(e), so every weight is an exp2.
// A SoftmaxState {m, d} stands for the terms 2^x_k of a row: m = max_k x_k and
// d = sum_k 2^(x_k - m). An AttentionState adds the output o = sum_k 2^(x_k - m) v_k, not yet
// divided by d. A normalised partial given as (out, lse) - merge_states' input - is the state
// {lse * log2(e), 1} with o = out (SoftmaxState::from_lse).
//
// Rules, the same on every backend:
//  - Empty: m = -inf, d = 0 (no term). Merging an empty state changes nothing; a row whose
//    states are all empty normalises to out = 0 and lse = -inf.
//  - valid(): m > -inf and 0 < d < inf. Normalising a state that is not valid gives out = 0
//    and lse = -inf. This is what a row with a NaN score, a +inf score, or a sum that
//    overflowed gives: merging a state whose max is NaN or +inf makes d NaN (the weights are
//    exp2(NaN) or exp2(inf - inf)), i.e. the row not valid.
//  - A partial given by its LSE whose LSE is NaN or -inf is empty (skipped); an LSE of +inf
//    makes the row not valid (zeros and -inf).
//  - NaN in the output values of a valid row is not masked: it carries into out.
//  - LogSumExp (the indexer's selected LSE) is the plain log-sum-exp of a set instead: NaN if
//    any term is NaN, else +inf if any term is +inf, else -inf when empty.
#pragma once

#include <cmath>

#include "msa/constants.h"

#if defined(__CUDACC__)
#define MSA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MSA_HOST_DEVICE inline
#endif
#if defined(__CUDA_ARCH__)  // the device pass only: host compilers warn about the pragma
#define MSA_STATE_UNROLL _Pragma("unroll")
#else
#define MSA_STATE_UNROLL
#endif

namespace msa {

namespace state_math {

inline constexpr float kInf = __builtin_huge_valf();

// The device's exp2f / log2f (as the kernels always used) and the host's std:: versions.
MSA_HOST_DEVICE float exp2(float x) {
#if defined(__CUDA_ARCH__)
  return ::exp2f(x);
#else
  return std::exp2(x);
#endif
}
MSA_HOST_DEVICE float log2(float x) {
#if defined(__CUDA_ARCH__)
  return ::log2f(x);
#else
  return std::log2(x);
#endif
}
// max ignoring NaN (IEEE maxNum): a NaN argument never becomes the max.
MSA_HOST_DEVICE float max(float a, float b) {
#if defined(__CUDA_ARCH__)
  return ::fmaxf(a, b);
#else
  return std::fmax(a, b);
#endif
}
MSA_HOST_DEVICE bool isfinite(float x) {
#if defined(__CUDA_ARCH__)
  return ::isfinite(x);
#else
  return std::isfinite(x);
#endif
}

}  // namespace state_math

// The factors that bring two merged states to their common max: new = a * self + b * other.
struct Rescale {
  float self, other;
};

struct SoftmaxState {
  float m = -state_math::kInf;  // max of the terms' exponents (log2 units); -inf: empty
  float d = 0.f;                // sum of 2^(x_k - m)

  MSA_HOST_DEVICE static SoftmaxState empty() { return {-state_math::kInf, 0.f}; }

  // A normalised partial by its natural-log LSE: NaN or -inf is empty.
  MSA_HOST_DEVICE static SoftmaxState from_lse(float lse) {
    if (!(lse > -state_math::kInf)) return empty();
    return {lse * math::kLog2e, 1.f};
  }

  // The factor that rescales this state's terms to a common max M >= m (0 when M is -inf:
  // every state is empty).
  MSA_HOST_DEVICE float weight(float common_max) const {
    return common_max > -state_math::kInf ? state_math::exp2(m - common_max) : 0.f;
  }

  // Adds `part` to a state already at the common max (m >= part.m, both passes of a two-pass
  // merge: first the max, then the sums); returns part's weight for its output values.
  MSA_HOST_DEVICE float add_at_max(const SoftmaxState& part) {
    const float w = part.weight(m);
    d += w * part.d;
    return w;
  }

  // Online merge: this becomes the union of this and `other`.
  MSA_HOST_DEVICE Rescale merge(const SoftmaxState& other) {
    const float M = state_math::max(m, other.m);
    if (!(M > -state_math::kInf)) return {1.f, 0.f};  // both empty
    const Rescale r{state_math::exp2(m - M), state_math::exp2(other.m - M)};
    d = d * r.self + other.d * r.other;
    m = M;
    return r;
  }

  MSA_HOST_DEVICE bool valid() const { return m > -state_math::kInf && d > 0.f && state_math::isfinite(d); }

  // 1 / d, or 0 when not valid (the outputs become zeros).
  MSA_HOST_DEVICE float inverse_sum() const { return valid() ? 1.f / d : 0.f; }

  // Natural-log LSE of the terms; -inf when not valid.
  MSA_HOST_DEVICE float lse() const {
    return valid() ? (m + state_math::log2(d)) * math::kLn2 : -state_math::kInf;
  }
};

// A state with N output values (a thread's share of a row's head dimension).
template <int N>
struct AttentionState {
  SoftmaxState s;
  float o[N];

  MSA_HOST_DEVICE static AttentionState empty() {
    AttentionState r;
    r.s = SoftmaxState::empty();
MSA_STATE_UNROLL
    for (int i = 0; i < N; ++i) r.o[i] = 0.f;
    return r;
  }

  // Online merge of a state given as (softmax state, its output values).
  MSA_HOST_DEVICE void merge(const SoftmaxState& other, const float (&v)[N]) {
    const Rescale r = s.merge(other);
MSA_STATE_UNROLL
    for (int i = 0; i < N; ++i) o[i] = o[i] * r.self + v[i] * r.other;
  }
  MSA_HOST_DEVICE void merge(const AttentionState& other) { merge(other.s, other.o); }

  // Two-pass merge, second pass: s.m already holds the max of every part.
  MSA_HOST_DEVICE void add_at_max(const SoftmaxState& part, const float (&v)[N]) {
    const float w = s.add_at_max(part);
MSA_STATE_UNROLL
    for (int i = 0; i < N; ++i) o[i] += w * v[i];
  }

  // out = o / d and returns the natural-log LSE; zeros and -inf when not valid.
  MSA_HOST_DEVICE float normalise(float (&out)[N]) const {
    if (s.valid()) {
      const float inv = 1.f / s.d;
MSA_STATE_UNROLL
      for (int i = 0; i < N; ++i) out[i] = o[i] * inv;
    } else {
MSA_STATE_UNROLL
      for (int i = 0; i < N; ++i) out[i] = 0.f;
    }
    return s.lse();
  }
};

// Log-sum-exp of a set of natural-log terms sum * e^lse (the indexer's selected LSE), with
// IEEE rules rather than the attention rules: NaN if any term's lse is NaN, else +inf if any is
// +inf, else -inf when every term is -inf or there is none.
struct LogSumExp {
  SoftmaxState s;
  bool nan = false, pinf = false;

  MSA_HOST_DEVICE void add(float lse, float sum = 1.f) {
    if (lse != lse) {
      nan = true;
    } else if (lse == state_math::kInf) {
      pinf = true;
    } else if (lse > -state_math::kInf) {
      s.merge(SoftmaxState{lse * math::kLog2e, sum});
    }
  }

  MSA_HOST_DEVICE float result() const {
    if (nan) return __builtin_nanf("");
    if (pinf) return state_math::kInf;
    return s.lse();
  }
};

}  // namespace msa
