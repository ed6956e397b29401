// GPU benchmark of the training path: indexer, plan, forward, backward and KL on one
// document of T tokens, for both selection distributions of the architecture notes:
//   independent: index vectors i.i.d. normal * 0.2 (bf16), selected by the library's indexer;
//   coherent:    index queries drift slowly along the sequence, so neighbours select
//                mostly the same blocks.
// Timing: CUDA events around each call on one stream, warm-up excluded, median of --reps
// (the plan: host clock from the call to the end of its device work; "plan" with one
// workspace given to every plan, as a training loop keeps one, "+alloc" with the plan
// allocating its own workspace, as without PlanOptions::workspace).
// Useful FLOPs: forward 4 * Hq * 128 * (visible (query, key) pairs), backward 2.5x forward,
// indexer 2 * 128 * Hi * causal pairs, KL 8 * 128 * (group-16 main scores + index scores)
// per visible pair counted as in docs/performance-design.md §1.
//
// usage: msa_gpu_bench [--tokens 4096,8192,...] [--reps 10] [--out results.csv]
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "msa/msa.h"

using namespace msa;

namespace {

#define BENCH_CUDA(call)                                                                 \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// normal * scale as bf16, in parallel (Box-Muller on a per-chunk counter-based generator).
std::vector<uint16_t> random_bf16(int64_t n, float scale, uint64_t seed) {
  std::vector<uint16_t> out(static_cast<size_t>(n));
  const int64_t chunk = 1 << 16;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < (n + chunk - 1) / chunk; ++c) {
    uint64_t s = seed * 0x100000001b3ull + uint64_t(c);
    for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); i += 2) {
      const double u1 = (double(splitmix(s) >> 11) + 1.0) * 0x1.0p-53, u2 = double(splitmix(s) >> 11) * 0x1.0p-53;
      const double r = std::sqrt(-2.0 * std::log(u1));
      out[size_t(i)] = float_to_bf16(float(r * std::cos(6.283185307179586 * u2)) * scale);
      if (i + 1 < n) out[size_t(i + 1)] = float_to_bf16(float(r * std::sin(6.283185307179586 * u2)) * scale);
    }
  }
  return out;
}

// Index queries that drift slowly: q_t = 0.2 (u cos a_t + w sin a_t) + small noise,
// a_t = 2 pi t / 8192 per head.
std::vector<uint16_t> coherent_queries(int64_t T, int H, uint64_t seed) {
  const auto basis = random_bf16(int64_t(H) * 2 * 128, 1.0f, seed);
  const auto noise = random_bf16(T * H * 128, 0.02f, seed + 1);
  std::vector<uint16_t> out(size_t(T * H * 128));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      const double a = 6.283185307179586 * double(t) / 8192.0;
      for (int d = 0; d < 128; ++d) {
        const float u = bf16_to_float(basis[size_t((h * 2) * 128 + d)]), w = bf16_to_float(basis[size_t((h * 2 + 1) * 128 + d)]);
        const float x = 0.2f * float(u * std::cos(a) + w * std::sin(a)) + bf16_to_float(noise[size_t((t * H + h) * 128 + d)]);
        out[size_t((t * H + h) * 128 + d)] = float_to_bf16(x);
      }
    }
  return out;
}

struct DeviceBuf {
  Buffer buf;
  TensorView view;
  DeviceBuf() = default;
  DeviceBuf(DType t, std::vector<int64_t> shape) : buf(Device::cuda(0), t, shape), view(buf.view()) {}
  void upload(const void* host) { BENCH_CUDA(cudaMemcpy(buf.data(), host, size_t(buf.bytes()), cudaMemcpyHostToDevice)); }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : (v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]));
}

// Median milliseconds of `reps` timed calls after `warmup` untimed ones.
double time_ms(cudaStream_t s, int warmup, int reps, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) fn();
  BENCH_CUDA(cudaStreamSynchronize(s));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA(cudaEventRecord(a, s));
    fn();
    BENCH_CUDA(cudaEventRecord(b, s));
    BENCH_CUDA(cudaEventSynchronize(b));
    float t = 0;
    BENCH_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  BENCH_CUDA(cudaEventDestroy(a));
  BENCH_CUDA(cudaEventDestroy(b));
  return median(ms);
}

double used_gib() {
  size_t free_b = 0, total_b = 0;
  BENCH_CUDA(cudaMemGetInfo(&free_b, &total_b));
  return double(total_b - free_b) / double(1ull << 30);
}

struct Row {
  int64_t T;
  std::string dist;
  double union8, sel_ms, plan_ms, plan_alloc_ms, fwd_ms, bwd_ms, bwd_det_ms, kl_ms, fwd_tf, bwd_tf, sel_tf, kl_tf, peak_gib;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes{4096, 8192, 16384, 32768, 65536, 131072};
  int reps = 10;
  std::string out_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tokens" && i + 1 < argc) {
      sizes.clear();
      std::string list = argv[++i];
      size_t pos = 0;
      while (pos <= list.size()) {
        const size_t comma = list.find(',', pos);
        sizes.push_back(std::stoll(list.substr(pos, comma - pos)));
        if (comma == std::string::npos) break;
        pos = comma + 1;
      }
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--out" && i + 1 < argc) {
      out_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--tokens 4096,8192] [--reps 10] [--out file.csv]\n", argv[0]);
      return 1;
    }
  }
  if (cuda_device_count() == 0) {
    std::printf("no CUDA device: benchmark skipped\n");
    return 0;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, %.0f MB L2\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6);
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const Topology topo;
  std::vector<Row> rows;
  FILE* csv = out_path.empty() ? nullptr : std::fopen(out_path.c_str(), "w");
  if (csv)
    std::fprintf(csv, "tokens,selection,union8,indexer_ms,plan_ms,forward_ms,backward_ms,backward_det_ms,kl_ms,"
                      "forward_tflops,backward_tflops,indexer_tflops,kl_tflops,peak_gib,plan_alloc_ms\n");

  for (const int64_t T : sizes) {
    const PackedLayout L = PackedLayout::from_cu_seqlens({0, int32_t(T)}, {0, int32_t(T)});
    const auto hq = random_bf16(T * 64 * 128, 0.2f, 11), hk = random_bf16(T * 4 * 128, 0.2f, 12),
               hv = random_bf16(T * 4 * 128, 0.2f, 13), hdo = random_bf16(T * 64 * 128, 0.2f, 14),
               hik = random_bf16(T * 128, 0.2f, 15);
    DeviceBuf q(DType::bf16, {T, 64, 128}), k(DType::bf16, {T, 4, 128}), v(DType::bf16, {T, 4, 128}),
        dout(DType::bf16, {T, 64, 128}), iq(DType::bf16, {T, 4, 128}), ik(DType::bf16, {T, 1, 128}),
        topk(DType::i32, {4, T, 16}), sel_lse(DType::f32, {4, T}), out(DType::bf16, {T, 64, 128}),
        lse(DType::f32, {T, 64}), dq(DType::bf16, {T, 64, 128}), dk(DType::bf16, {T, 4, 128}),
        dv(DType::bf16, {T, 4, 128}), diq(DType::f32, {T, 4, 128}), dik(DType::f32, {T, 1, 128});
    q.upload(hq.data());
    k.upload(hk.data());
    v.upload(hv.data());
    dout.upload(hdo.data());
    ik.upload(hik.data());
    for (const char* dist : {"independent", "coherent"}) {
      const bool coherent = std::strcmp(dist, "coherent") == 0;
      const auto hiq = coherent ? coherent_queries(T, 4, 21) : random_bf16(T * 4 * 128, 0.2f, 21);
      iq.upload(hiq.data());
      RunOptions opt;
      opt.stream = s;
      Row r{};
      r.T = T;
      r.dist = dist;
      SelectBlocksParams sp;
      sp.index_q = iq.view;
      sp.index_k = ik.view;
      sp.topk = topk.view;
      sp.selected_lse = sel_lse.view;
      r.sel_ms = time_ms(s, 2, reps, [&] { select_blocks(topo, L, sp, opt); });
      // Plan: each build is timed from its call to the end of its device work; the plan is
      // freed outside the timed window (its allocations are inside it).
      const DeviceBuf workspace(DType::u8, {plan_workspace_bytes(topo, L, Device::cuda(0))});
      PlanOptions reuse;
      reuse.workspace = workspace.view;
      auto time_plans = [&](const PlanOptions& options) {
        std::vector<double> plan_ms;
        for (int i = 0; i < std::min(reps, 5) + 1; ++i) {
          BENCH_CUDA(cudaStreamSynchronize(s));
          const auto h0 = std::chrono::steady_clock::now();
          SparsePlan p = build_plan(topo, L, topk.view, options, opt);
          BENCH_CUDA(cudaStreamSynchronize(s));
          const auto h1 = std::chrono::steady_clock::now();
          if (i > 0) plan_ms.push_back(std::chrono::duration<double, std::milli>(h1 - h0).count());
        }
        return median(plan_ms);
      };
      r.plan_ms = time_plans(reuse);
      r.plan_alloc_ms = time_plans({});
      SparsePlan plan = build_plan(topo, L, topk.view, reuse, opt);
      BENCH_CUDA(cudaStreamSynchronize(s));

      // Useful work from the selection.
      std::vector<int32_t> ids(size_t(4 * T * 16));
      BENCH_CUDA(cudaMemcpy(ids.data(), topk.buf.data(), ids.size() * 4, cudaMemcpyDeviceToHost));
      double pairs = 0, union_sum = 0;
      int64_t union_n = 0;
      for (int g = 0; g < 4; ++g)
        for (int64_t t = 0; t < T; ++t) {
          const int32_t* row = ids.data() + (g * T + t) * 16;
          for (int s2 = 0; s2 < 16 && row[s2] >= 0; ++s2) pairs += double(std::min<int64_t>(128, t - int64_t(row[s2]) * 128 + 1));
          if (t % 8 == 7) {
            std::vector<int32_t> u;
            for (int64_t x = t - 7; x <= t; ++x)
              for (int s2 = 0; s2 < 16; ++s2)
                if (ids[size_t((g * T + x) * 16 + s2)] >= 0) u.push_back(ids[size_t((g * T + x) * 16 + s2)]);
            std::sort(u.begin(), u.end());
            union_sum += double(std::unique(u.begin(), u.end()) - u.begin());
            ++union_n;
          }
        }
      r.union8 = union_n ? union_sum / double(union_n) : 0;
      const double fwd_flops = 4.0 * 16 * 128 * pairs;  // 16 query heads per (token, group) pair
      const double sel_flops = 2.0 * 128 * 4 * (double(T) * double(T + 1) / 2);
      const double kl_flops = 2.0 * 128 * pairs * 16 + 6.0 * 128 * pairs;

      AttentionForwardParams fp;
      fp.q = q.view;
      fp.k = k.view;
      fp.v = v.view;
      // The plan's own copy of the selection: no comparison with another tensor (ops.h).
      fp.topk = plan.selection.view();
      fp.out = out.view;
      fp.lse = lse.view;
      r.fwd_ms = time_ms(s, 2, reps, [&] { sparse_attention_forward(topo, L, plan, fp, opt); });
      AttentionBackwardParams bp;
      bp.q = q.view;
      bp.k = k.view;
      bp.v = v.view;
      bp.topk = plan.selection.view();
      bp.out = out.view;
      bp.lse = lse.view;
      bp.dout = dout.view;
      bp.dq = dq.view;
      bp.dk = dk.view;
      bp.dv = dv.view;
      r.bwd_ms = time_ms(s, 2, reps, [&] { sparse_attention_backward(topo, L, plan, bp, opt); });
      RunOptions det = opt;
      det.deterministic = true;
      r.bwd_det_ms = time_ms(s, 1, std::max(3, reps / 3), [&] { sparse_attention_backward(topo, L, plan, bp, det); });
      KlBackwardParams kp;
      kp.q = q.view;
      kp.k = k.view;
      kp.lse = lse.view;
      kp.index_q = iq.view;
      kp.index_k = ik.view;
      kp.index_lse = sel_lse.view;
      kp.topk = plan.selection.view();
      kp.dindex_q = diq.view;
      kp.dindex_k = dik.view;
      r.kl_ms = time_ms(s, 2, reps, [&] { kl_backward(topo, L, plan, kp, opt); });
      r.peak_gib = used_gib();
      r.fwd_tf = fwd_flops / (r.fwd_ms * 1e9);
      r.bwd_tf = 2.5 * fwd_flops / (r.bwd_ms * 1e9);
      r.sel_tf = sel_flops / (r.sel_ms * 1e9);
      r.kl_tf = kl_flops / (r.kl_ms * 1e9);
      rows.push_back(r);
      std::printf("T=%-7lld %-11s union8 %5.1f | indexer %8.3f ms %6.1f TF/s | plan %7.3f ms (+alloc %7.3f) | fwd %8.3f ms %6.1f TF/s | "
                  "bwd %8.3f ms %6.1f TF/s (det %8.3f) | kl %8.3f ms | mem %.1f GiB\n",
                  (long long)T, dist, r.union8, r.sel_ms, r.sel_tf, r.plan_ms, r.plan_alloc_ms, r.fwd_ms, r.fwd_tf, r.bwd_ms, r.bwd_tf,
                  r.bwd_det_ms, r.kl_ms, r.peak_gib);
      std::fflush(stdout);
      if (csv)
        std::fprintf(csv, "%lld,%s,%.2f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.1f,%.1f,%.1f,%.1f,%.2f,%.4f\n", (long long)T,
                     dist, r.union8, r.sel_ms, r.plan_ms, r.fwd_ms, r.bwd_ms, r.bwd_det_ms, r.kl_ms, r.fwd_tf, r.bwd_tf,
                     r.sel_tf, r.kl_tf, r.peak_gib, r.plan_alloc_ms);
    }
  }
  if (csv) std::fclose(csv);
  std::printf("\n%8s %-11s %6s %9s %8s %8s %9s %7s %9s %7s %9s %9s %6s\n", "tokens", "selection", "union8", "index ms",
              "plan ms", "+alloc", "fwd ms", "fwd TF", "bwd ms", "bwd TF", "bwd det", "kl ms", "GiB");
  for (const Row& r : rows)
    std::printf("%8lld %-11s %6.1f %9.3f %8.3f %8.3f %9.3f %7.1f %9.3f %7.1f %9.3f %9.3f %6.1f\n", (long long)r.T,
                r.dist.c_str(), r.union8, r.sel_ms, r.plan_ms, r.plan_alloc_ms, r.fwd_ms, r.fwd_tf, r.bwd_ms, r.bwd_tf,
                r.bwd_det_ms, r.kl_ms, r.peak_gib);
  return 0;
}
