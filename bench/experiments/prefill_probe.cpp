// Prefill timing probe beside the product (not built by CMake): plan_paged_prefill +
// paged_indexer + paged_attention through the public C++ API for a few single-request shapes
// (bf16 and FP8 caches, FP8 index), CUDA events, median of 5 (the plan: host clock, median of 7);
// docs/performance.md runs 16 and 19.
// Build against a CUDA build of msa, e.g.:
//   nvcc -O2 -std=c++20 -Iinclude bench/experiments/prefill_probe.cpp build/src/libmsa.a
//     -Xcompiler -fopenmp -lcuda -o prefill_probe
//   ./prefill_probe [shape name, e.g. 16k/48k]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "msa/inference.h"
#include "msa/msa.h"

using namespace msa;

static void fill_random(const Buffer& b, uint64_t seed, int kind) {
  // kind 0: bf16 ~U(-2,2); 1: fp8 codes (small magnitudes); 2: raw bytes; 3: f32 0.02..0.08
  const int64_t n = b.bytes();
  std::vector<uint8_t> h(size_t(std::min<int64_t>(n, int64_t(64) << 20)));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&] { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x; };
  if (kind == 0) {
    for (size_t i = 0; i + 1 < h.size(); i += 2) {
      float f = float(int(next() % 4001) - 2000) / 1000.f;
      uint32_t u; std::memcpy(&u, &f, 4);
      h[i] = uint8_t(u >> 16); h[i + 1] = uint8_t(u >> 24);
    }
  } else if (kind == 1) {
    for (auto& c : h) { c = uint8_t(next() % 0x70); if (next() & 1) c |= 0x80; }
  } else if (kind == 3) {
    for (size_t i = 0; i + 3 < h.size(); i += 4) { float f = 0.02f + float(next() % 1000) * 6e-5f; std::memcpy(&h[i], &f, 4); }
  } else {
    for (auto& c : h) c = uint8_t(next());
  }
  for (int64_t off = 0; off < n; off += int64_t(h.size())) {
    const int64_t len = std::min<int64_t>(int64_t(h.size()), n - off);
    cudaMemcpy(static_cast<uint8_t*>(b.data()) + off, h.data(), size_t(len), cudaMemcpyHostToDevice);
  }
}

struct Shape { int64_t q, prefix; const char* name; };

int main(int argc, char** argv) {
  const Device dev = Device::cuda(0);
  const Topology topo = Topology::minimax_m3(1);
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  std::vector<Shape> shapes = {{16384, 49152, "16k/48k"}, {16384, 174080, "16k/174k"}, {171, 55168, "171/55k"},
                               {4096, 32768, "4k/32k"}, {8192, 122880, "8k/120k"}, {2, 140000, "2/140k"},
                               {1600, 70000, "1.6k/70k"}, {182, 17536, "182/17k"}};
  const int reps = 5;
  std::printf("%-10s %-6s %10s %10s %10s %10s %8s %8s %11s\n", "shape", "fmt", "plan_ms", "index_ms", "attn_ms", "step_ms",
              "attn_TF", "pipe_ms", "pipe_rel_ms");
  for (const Shape& sh : shapes) {
    if (argc > 1 && std::strcmp(argv[1], sh.name) != 0) continue;
    const int64_t kv = sh.q + sh.prefix, pages = (kv + 127) / 128;
    std::vector<int32_t> table(static_cast<size_t>(pages));
    for (int64_t i = 0; i < pages; ++i) table[size_t(i)] = int32_t(i);
    std::shuffle(table.begin(), table.end(), std::mt19937_64(7));
    std::vector<int32_t> cu = {0, int32_t(sh.q)}, sl = {int32_t(kv)};
    PagedPrefillMetadata m;
    m.cu_seqlens_q = TensorView::contiguous(cu.data(), DType::i32, {2});
    m.seq_lens = TensorView::contiguous(sl.data(), DType::i32, {1});
    m.page_table = TensorView::contiguous(table.data(), DType::i32, {1, pages});
    InferencePlanOptions po; po.device = dev;
    Buffer q(dev, DType::bf16, {sh.q, 64, 128}), iq(dev, DType::bf16, {sh.q, 4, 128});
    Buffer ik(dev, DType::bf16, {pages, 128, 128});
    Buffer topk(dev, DType::i32, {4, sh.q, 16}), out(dev, DType::bf16, {sh.q, 64, 128}), lse(dev, DType::f32, {sh.q, 64});
    fill_random(q, 1, 0); fill_random(iq, 2, 0); fill_random(ik, 3, 0);
    for (const char* fmt : {"bf16", "fp8"}) {
      if (std::strcmp(fmt, "fp8") == 0 && sh.q < 1000) continue;
      const bool f8 = std::strcmp(fmt, "fp8") == 0;
      Buffer k(dev, f8 ? DType::f8e4m3 : DType::bf16, {pages, 4, 128, 128}), v(dev, f8 ? DType::f8e4m3 : DType::bf16, {pages, 4, 128, 128});
      fill_random(k, 4, f8 ? 1 : 0); fill_random(v, 5, f8 ? 1 : 0);
      Buffer ks(dev, DType::f32, {4, pages * 128}), vs(dev, DType::f32, {4, pages * 128});
      PagedKvCache c; c.format = f8 ? KvFormat::fp8_e4m3 : KvFormat::bf16; c.k = k.view(); c.v = v.view();
      if (f8) { fill_random(ks, 6, 3); fill_random(vs, 7, 3); c.k_scale = ks.view(); c.v_scale = vs.view(); }
      PagedIndexerParams ip; ip.index_q = iq.view(); ip.index_k_cache = ik.view(); ip.topk = topk.view();
      PagedAttentionParams ap; ap.q = q.view(); ap.kv = c; ap.topk = topk.view(); ap.out = out.view(); ap.lse = lse.view();
      RunOptions ro; ro.stream = s;
      auto time_it = [&](auto&& fn) {
        for (int i = 0; i < 2; ++i) fn();
        std::vector<float> t;
        for (int i = 0; i < reps; ++i) {
          cudaEventRecord(e0, s); fn(); cudaEventRecord(e1, s); cudaEventSynchronize(e1);
          float ms; cudaEventElapsedTime(&ms, e0, e1); t.push_back(ms);
        }
        std::sort(t.begin(), t.end());
        return double(t[t.size() / 2]);
      };
      InferencePlan plan = plan_paged_prefill(topo, m, po);
      // Plan time: median of 7, each plan kept alive until all are made (so that no release,
      // which gives device memory back, lands in a timing).
      std::vector<double> plan_t;
      {
        std::vector<InferencePlan> alive;
        for (int i = 0; i < 7; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          alive.push_back(plan_paged_prefill(topo, m, po));
          plan_t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
      }
      std::sort(plan_t.begin(), plan_t.end());
      const double plan_ms = plan_t[plan_t.size() / 2];
      const double idx = time_it([&] { paged_indexer(plan, ip, ro); });
      const double att = time_it([&] { paged_attention(plan, ap, ro); });
      const double step = time_it([&] { paged_forward(plan, ip, ap, ro); });
      // Small steps, as an engine runs them from PyTorch's default stream: the step's plan, then
      // its layer, on the legacy default stream, 20 steps queued back to back; host wall time
      // per step. pipe_ms keeps the plans alive, pipe_rel_ms drops each after its layer (as an
      // engine does, with the built-in allocator). A plan that waits for the device, when made
      // or released, adds the step's kernels to it.
      double pipe_ms = 0, pipe_rel_ms = 0;
      if (sh.q <= 2000) {
        for (const bool keep : {true, false}) {
          std::vector<InferencePlan> alive;
          auto run_steps = [&](int n) {
            for (int i = 0; i < n; ++i) {
              InferencePlan step_plan = plan_paged_prefill(topo, m, po);
              paged_forward(step_plan, ip, ap, RunOptions{});
              if (keep) alive.push_back(std::move(step_plan));
            }
            cudaStreamSynchronize(nullptr);
          };
          run_steps(3);
          const auto t0 = std::chrono::steady_clock::now();
          run_steps(20);
          (keep ? pipe_ms : pipe_rel_ms) =
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 20;
        }
      }
      // sparse work: each query attends min(pos + 1, 2048) keys roughly
      double pairs = 0;
      for (int64_t i = 0; i < sh.q; ++i) pairs += double(std::min<int64_t>(sh.prefix + i + 1, 2048));
      const double tf = 4.0 * 128 * 64 * pairs / (att * 1e-3) / 1e12;
      const double iflops = 2.0 * 128 * 4 * double(sh.q) * double(sh.prefix + sh.q / 2);
      std::printf("%-10s %-6s %10.3f %10.3f %10.3f %10.3f %8.1f %8.3f %11.3f  (index TF %.0f)\n", sh.name, fmt, plan_ms, idx,
                  att, step, tf, pipe_ms, pipe_rel_ms, iflops / (idx * 1e-3) / 1e12);
      std::fflush(stdout);
    }
    if (sh.q >= 4096) {  // FP8 index-q and index-K
      Buffer iq8(dev, DType::f8e4m3, {sh.q, 4, 128}), ik8(dev, DType::f8e4m3, {pages, 128, 128});
      fill_random(iq8, 8, 1); fill_random(ik8, 9, 1);
      InferencePlan plan = plan_paged_prefill(topo, m, po);
      PagedIndexerParams ip; ip.index_q = iq8.view(); ip.index_k_cache = ik8.view(); ip.topk = topk.view();
      RunOptions ro; ro.stream = s;
      for (int i = 0; i < 2; ++i) paged_indexer(plan, ip, ro);
      std::vector<float> t;
      for (int i = 0; i < reps; ++i) {
        cudaEventRecord(e0, s); paged_indexer(plan, ip, ro); cudaEventRecord(e1, s); cudaEventSynchronize(e1);
        float ms; cudaEventElapsedTime(&ms, e0, e1); t.push_back(ms);
      }
      std::sort(t.begin(), t.end());
      const double flops = 2.0 * 128 * 4 * double(sh.q) * double(sh.prefix + sh.q / 2);
      std::printf("%-10s %-6s %10s %10.3f   (index TF %.0f)\n", sh.name, "idx-f8", "", t[t.size() / 2], flops / (t[t.size() / 2] * 1e-3) / 1e12);
    }
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) { std::printf("CUDA error %s\n", cudaGetErrorString(err)); return 1; }
  }
  (void)argc; (void)argv;
  return 0;
}
