// Helpers of the GPU tests: skipping without a device, device copies of host tensors, and
// running the training ops on CUDA with outputs poisoned first. Every GPU result is checked
// against the CPU backend on the same inputs.
#pragma once

#include "test_support.h"

namespace msa::test {

// Skips the current test, visibly, when this build or machine has no CUDA device.
#define MSA_REQUIRE_GPU()                                                                        \
  do {                                                                                           \
    if (!::msa::built_with_cuda()) GTEST_SKIP() << "built without CUDA: GPU test skipped";       \
    if (::msa::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU test skipped";     \
  } while (0)

inline const Device kGpu = Device::cuda(0);

// A device copy of a host tensor (same dtype and shape).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& h) : buf_(kGpu, h.dtype(), h.shape()), shape_(h.shape()), dtype_(h.dtype()) {
    copy(h.view(), buf_.view());
  }
  DeviceTensor(DType dtype, std::vector<int64_t> shape) : buf_(kGpu, dtype, shape), shape_(std::move(shape)), dtype_(dtype) {}
  TensorView view() const { return buf_.view(); }
  HostTensor host() const {
    HostTensor h(dtype_, shape_);
    copy(buf_.view(), h.view());
    return h;
  }
  // Overwrites the device contents with a host tensor (same dtype and shape).
  void upload(const HostTensor& h) { copy(h.view(), buf_.view()); }
  // Fills with the poison of test_support.h (NaN / INT32_MIN).
  void poison() {
    HostTensor h(dtype_, shape_);
    ::msa::test::poison(h);
    upload(h);
  }

 private:
  Buffer buf_;
  std::vector<int64_t> shape_;
  DType dtype_ = DType::f32;
};

inline std::vector<int32_t> device_ints(const Buffer& b) {
  const TensorView v = b.view();
  HostTensor h(DType::i32, v.shape_vector());
  copy(v, h.view());
  return h.ints();
}

inline std::vector<double> doubles(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// The indexer on the GPU: topk (and selected LSE when asked) as host tensors.
struct Selection {
  HostTensor topk, lse;
};
inline Selection gpu_select(const Topology& topo, const PackedLayout& L, const HostTensor& iq, const HostTensor& ik,
                            bool with_lse = true, float temperature = 1.0f) {
  DeviceTensor diq(iq), dik(ik);
  DeviceTensor topk(DType::i32, {topo.num_index_heads, L.total_q(), topo.topk});
  DeviceTensor lse(DType::f32, {topo.num_index_heads, L.total_q()});
  topk.poison();
  lse.poison();
  SelectBlocksParams p;
  p.index_q = diq.view();
  p.index_k = dik.view();
  p.topk = topk.view();
  if (with_lse) p.selected_lse = lse.view();
  p.lse_temperature = temperature;
  select_blocks(topo, L, p);
  return {topk.host(), with_lse ? lse.host() : HostTensor()};
}

inline Selection cpu_select(const Topology& topo, const PackedLayout& L, const HostTensor& iq, const HostTensor& ik,
                            bool with_lse = true, float temperature = 1.0f) {
  Selection s{HostTensor(DType::i32, {topo.num_index_heads, L.total_q(), topo.topk}),
              HostTensor(DType::f32, {topo.num_index_heads, L.total_q()})};
  SelectBlocksParams p;
  p.index_q = iq.view();
  p.index_k = ik.view();
  p.topk = s.topk.view();
  if (with_lse) p.selected_lse = s.lse.view();
  p.lse_temperature = temperature;
  select_blocks(topo, L, p);
  return s;
}

// Forward on the GPU with a plan built there from `topk`.
inline ForwardOutputs gpu_forward(const AttentionCase& c, const SparsePlan& gplan, const DeviceTensor& q,
                                  const DeviceTensor& k, const DeviceTensor& v, const DeviceTensor& topk,
                                  DType out_dtype = DType::bf16) {
  DeviceTensor out(out_dtype, {c.layout.total_q(), c.topo.num_q_heads, c.topo.head_dim});
  DeviceTensor lse(DType::f32, {c.layout.total_q(), c.topo.num_q_heads});
  out.poison();
  lse.poison();
  AttentionForwardParams p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.topk = topk.view();
  p.out = out.view();
  p.lse = lse.view();
  sparse_attention_forward(c.topo, c.layout, gplan, p);
  return {out.host(), lse.host()};
}

// Relative L2 of a GPU tensor against the CPU backend's (both as floats).
inline double rel_l2(const HostTensor& got, const HostTensor& want) { return relative_l2(got.floats(), doubles(want.floats())); }
inline double cosine(const HostTensor& got, const HostTensor& want) {
  return cosine_similarity(got.floats(), doubles(want.floats()));
}

inline bool bitwise_equal(const HostTensor& a, const HostTensor& b) { return a.raw() == b.raw(); }

}  // namespace msa::test
