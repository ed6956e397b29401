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

// `bytes` bytes of 0xff (NaN in bf16 and f32): a workspace whose stale contents a call must
// not read.
inline HostTensor nan_bytes(int64_t bytes) {
  HostTensor t(DType::u8, {bytes});
  std::fill(t.data<uint8_t>(), t.data<uint8_t>() + bytes, uint8_t(0xff));
  return t;
}

// Forward on the GPU with a plan built there from `topk`.
inline ForwardOutputs gpu_forward(const AttentionCase& c, const SparsePlan& gplan, const DeviceTensor& q,
                                  const DeviceTensor& k, const DeviceTensor& v, const DeviceTensor& topk,
                                  DType out_dtype = DType::bf16, const TensorView& workspace = {}) {
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
  p.workspace = workspace;
  sparse_attention_forward(c.topo, c.layout, gplan, p);
  return {out.host(), lse.host()};
}

// Gradients of the GPU backward (outputs poisoned first) with a plan built there from `topk`.
struct GpuGrads {
  HostTensor dq, dk, dv;
};

inline GpuGrads gpu_backward(const AttentionCase& c, const SparsePlan& plan, const DeviceTensor& q, const DeviceTensor& k,
                      const DeviceTensor& v, const DeviceTensor& topk, const DeviceTensor& out, const DeviceTensor& lse,
                      const DeviceTensor& dout, bool deterministic, DType grad_dtype = DType::bf16,
                      const TensorView& workspace = {}) {
  const int64_t Tq = c.layout.total_q(), Tk = c.layout.total_k();
  DeviceTensor dq(grad_dtype, {Tq, c.topo.num_q_heads, c.topo.head_dim}), dk(grad_dtype, {Tk, c.topo.num_kv_heads, c.topo.head_dim}),
      dv(grad_dtype, {Tk, c.topo.num_kv_heads, c.topo.head_dim});
  dq.poison();
  dk.poison();
  dv.poison();
  AttentionBackwardParams p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.topk = topk.view();
  p.out = out.view();
  p.lse = lse.view();
  p.dout = dout.view();
  p.dq = dq.view();
  p.dk = dk.view();
  p.dv = dv.view();
  p.workspace = workspace;
  RunOptions opt;
  opt.deterministic = deterministic;
  sparse_attention_backward(c.topo, c.layout, plan, p, opt);
  return {dq.host(), dk.host(), dv.host()};
}

// Device buffers of a select_blocks + forward step that a CUDA graph captures once and
// replays with new contents (test_gpu_graph.cpp, test_allocator.cpp).
struct SelectForwardBuffers {
  DeviceTensor iq, ik, topk, sel_lse, q, k, v, out, lse;
  SelectForwardBuffers(const Topology& t, int64_t Tq, int64_t Tk)
      : iq(DType::bf16, {Tq, t.num_index_heads, 128}), ik(DType::bf16, {Tk, 1, 128}),
        topk(DType::i32, {t.num_index_heads, Tq, 16}), sel_lse(DType::f32, {t.num_index_heads, Tq}),
        q(DType::bf16, {Tq, t.num_q_heads, 128}), k(DType::bf16, {Tk, t.num_kv_heads, 128}),
        v(DType::bf16, {Tk, t.num_kv_heads, 128}), out(DType::bf16, {Tq, t.num_q_heads, 128}),
        lse(DType::f32, {Tq, t.num_q_heads}) {}
  SelectBlocksParams select_params(bool with_selected_lse) const {
    SelectBlocksParams p;
    p.index_q = iq.view();
    p.index_k = ik.view();
    p.topk = topk.view();
    if (with_selected_lse) p.selected_lse = sel_lse.view();
    return p;
  }
  AttentionForwardParams forward_params(const TensorView& plan_topk) const {
    AttentionForwardParams p;
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.topk = plan_topk;
    p.out = out.view();
    p.lse = lse.view();
    return p;
  }
  // New inputs for the next replay (index vectors and the case's q, k, v); outputs poisoned.
  void refill(const HostTensor& hiq, const HostTensor& hik, const AttentionCase& c) {
    iq.upload(hiq);
    ik.upload(hik);
    q.upload(c.q);
    k.upload(c.k);
    v.upload(c.v);
    topk.poison();
    out.poison();
    lse.poison();
    synchronize(kGpu);
  }
};

// Relative L2 of a GPU tensor against the CPU backend's (both as floats).
inline double rel_l2(const HostTensor& got, const HostTensor& want) { return relative_l2(got.floats(), doubles(want.floats())); }
inline double cosine(const HostTensor& got, const HostTensor& want) {
  return cosine_similarity(got.floats(), doubles(want.floats()));
}

inline bool bitwise_equal(const HostTensor& a, const HostTensor& b) { return a.raw() == b.raw(); }

}  // namespace msa::test
