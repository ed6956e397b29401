// `msa bench --decode`: times one decode step (paged indexer, paged attention, both) on the
// standard serving shapes: batch 8 / 32 / 128 x context 4k / 32k / 128k, 8 queries per
// request, MiniMax-M3 heads, bf16 caches (and one FP8 point). Times are medians of CUDA-event
// (CPU: wall-clock) measurements after warm-up runs; GB/s counts the bytes the step actually
// reads and writes:
//   indexer:   index-K of every history page a ranking row scores (the whole context but the
//              local page, once per request) + index_q + topk;
//   attention: for each (request, KV head), the distinct selected pages of its Q rows, only
//              the tokens up to the last row's position (K and V, plus FP8 / NVFP4 scales) +
//              q + out + lse (split-K partials, which stay in L2 mostly, are not counted).
// The caches are a pool of distinct random pages (about 2.5 GB on a GPU, far larger than L2)
// that the requests' page tables map into in scattered order, so long contexts do not need
// their full size in memory.
#include <algorithm>
#include <chrono>
#include <iostream>
#include <set>
#include <sstream>

#include "bench.h"
#include "case_io.h"
#include "msa/inference.h"
#include "msa/msa.h"
#include "table.h"
#include "workload.h"

#if MSA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace msa::tool {

namespace {

constexpr int kPage = 128, kDim = 128, kQ = 8;

struct DecodePoint {
  int64_t batch = 0, context = 0;
  KvFormat format = KvFormat::bf16;
};

// Cheap reproducible contents: bf16 values uniform in about [-1, 1] (or E4M3 codes without NaN).
void fill_bytes(StTensor& t, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  if (t.dtype == DType::bf16) {
    auto* p = reinterpret_cast<uint16_t*>(t.bytes.data());
    for (int64_t i = 0; i < t.numel(); ++i) {
      const uint64_t r = next();
      // sign, exponent 2^-7 .. 2^0, random mantissa
      p[i] = uint16_t(((r >> 63) << 15) | ((120 + (r >> 40) % 7) << 7) | (r & 0x7f));
    }
  } else {
    auto* p = reinterpret_cast<uint8_t*>(t.bytes.data());
    for (int64_t i = 0; i < int64_t(t.bytes.size()); ++i) p[i] = uint8_t(next() >> 56) & 0xf7;  // no 0x7f / 0xff
  }
}

// Median seconds of `repeats` runs after `warmup` runs.
double time_median(Device dev, int warmup, int repeats, const std::function<void()>& work) {
  for (int i = 0; i < warmup; ++i) work();
  std::vector<double> t;
#if MSA_WITH_CUDA
  if (dev.is_cuda()) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (int i = 0; i < repeats; ++i) {
      cudaEventRecord(a, nullptr);
      work();
      cudaEventRecord(b, nullptr);
      cudaEventSynchronize(b);
      float ms = 0;
      cudaEventElapsedTime(&ms, a, b);
      t.push_back(ms * 1e-3);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return median(t);
  }
#endif
  for (int i = 0; i < repeats; ++i) t.push_back(time_once(dev, work));
  return median(t);
}

std::string gbps(double bytes, double seconds) {
  if (seconds <= 0) return "-";
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(0);
  s << bytes / seconds * 1e-9 << " GB/s";
  return s.str();
}

}  // namespace

int run_bench_decode(const BenchOptions& o) {
  const Device dev = resolve_backend(o.backend);
  const Topology topo = Topology::minimax_m3(o.tp);
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, Hi = topo.num_index_heads;
  const bool gpu = dev.is_cuda();
  const int repeats = o.repeats > 0 ? o.repeats : (gpu ? 10 : 2);
  std::vector<DecodePoint> points;
  const std::vector<int64_t> batches = gpu ? std::vector<int64_t>{8, 32, 128} : std::vector<int64_t>{8};
  const std::vector<int64_t> contexts = gpu ? std::vector<int64_t>{4096, 32768, 131072} : std::vector<int64_t>{4096};
  for (int64_t b : batches)
    for (int64_t c : contexts) points.push_back({b, c, KvFormat::bf16});
  points.push_back({gpu ? 32 : 8, gpu ? 32768 : 4096, KvFormat::fp8_e4m3});

  // Page pool (shared by every point): ~1 GB per K / V cache on a GPU.
  const int64_t pool = gpu ? std::max<int64_t>(64, (int64_t(1) << 30) / (int64_t(Hkv) * kPage * kDim * 2)) : 256;
  std::cerr << "[msa bench] decode: filling a pool of " << pool << " pages" << std::endl;
  DeviceArena arena(dev);
  StTensor kh = make_tensor("k", DType::bf16, {pool, Hkv, kPage, kDim}), vh = make_tensor("v", DType::bf16, {pool, Hkv, kPage, kDim}),
           ih = make_tensor("ik", DType::bf16, {pool, kPage, kDim});
  fill_bytes(kh, 1);
  fill_bytes(vh, 2);
  fill_bytes(ih, 3);
  Buffer k_bf16 = arena.upload(kh.view()), v_bf16 = arena.upload(vh.view()), index_k = arena.upload(ih.view());
  kh.bytes = {};
  vh.bytes = {};
  StTensor k8 = make_tensor("k8", DType::f8e4m3, {pool, Hkv, kPage, kDim}), v8 = make_tensor("v8", DType::f8e4m3, {pool, Hkv, kPage, kDim});
  fill_bytes(k8, 4);
  fill_bytes(v8, 5);
  Buffer k_fp8 = arena.upload(k8.view()), v_fp8 = arena.upload(v8.view());
  k8.bytes = {};
  v8.bytes = {};
  StTensor sc = make_tensor("scale", DType::f32, {1});
  *reinterpret_cast<float*>(sc.bytes.data()) = 0.05f;
  Buffer scale = arena.upload(sc.view());

  Table table({"batch", "context", "cache", "splits", "indexer", "indexer GB/s", "attention", "attention GB/s", "step"});
  for (const DecodePoint& pt : points) {
    const int64_t B = pt.batch, rows = B * kQ, pages_per_req = (pt.context + kPage - 1) / kPage;
    std::cerr << "[msa bench] decode: batch " << B << ", context " << pt.context << std::endl;
    std::vector<int32_t> seq(size_t(B), int32_t(pt.context)), table_ids(size_t(B * pages_per_req));
    uint64_t h = 12345;
    for (auto& id : table_ids) {
      h = h * 6364136223846793005ull + 1442695040888963407ull;
      id = int32_t((h >> 33) % uint64_t(pool));
    }
    const TensorView seq_v = TensorView::contiguous(seq.data(), DType::i32, {B});
    const TensorView table_v = TensorView::contiguous(table_ids.data(), DType::i32, {B, pages_per_req});
    DecodeMetadata meta;
    meta.seq_lens = seq_v;
    meta.page_table = table_v;
    meta.q_len_per_req = kQ;
    InferencePlanOptions po;
    po.device = dev;
    po.num_threads = o.threads;
    const InferencePlan plan = plan_decode(topo, meta, po);

    StTensor qh = make_tensor("q", DType::bf16, {rows, Hq, kDim}), qih = make_tensor("qi", DType::bf16, {rows, Hi, kDim});
    fill_bytes(qh, 10 + uint64_t(B));
    fill_bytes(qih, 20 + uint64_t(B));
    Buffer q = arena.upload(qh.view()), qi = arena.upload(qih.view());
    Buffer topk = arena.allocate(DType::i32, {Hi, rows, 16}), out = arena.allocate(DType::bf16, {rows, Hq, kDim}),
           lse = arena.allocate(DType::f32, {rows, Hq});
    PagedKvCache cache;
    cache.format = pt.format;
    const bool fp8 = pt.format == KvFormat::fp8_e4m3;
    cache.k = fp8 ? k_fp8.view() : k_bf16.view();
    cache.v = fp8 ? v_fp8.view() : v_bf16.view();
    if (fp8) {
      cache.k_scale = scale.view();
      cache.v_scale = scale.view();
    }
    PagedIndexerParams ip;
    ip.index_q = qi.view();
    ip.index_k_cache = index_k.view();
    ip.topk = topk.view();
    PagedAttentionParams ap;
    ap.q = q.view();
    ap.kv = cache;
    ap.topk = topk.view();
    ap.out = out.view();
    ap.lse = lse.view();
    RunOptions run;
    run.num_threads = o.threads;
    const int warmup = gpu ? 3 : 1;
    const double t_index = time_median(dev, warmup, repeats, [&] { paged_indexer(plan, ip, run); });
    const double t_attn = time_median(dev, warmup, repeats, [&] { paged_attention(plan, ap, run); });
    PagedAttentionParams fwd = ap;
    fwd.topk = {};
    const double t_step = time_median(dev, warmup, repeats, [&] { paged_forward(plan, ip, fwd, run); });

    // Bytes actually read / written.
    const double elem = fp8 ? 1.0 : 2.0;
    const int64_t local = (pt.context - 1) / kPage;
    const double index_bytes = double(B) * double(local + 1 > 16 ? local : 0) * kPage * kDim * 2 +
                               double(rows) * Hi * kDim * 2 + double(Hi) * rows * 16 * 4;
    StTensor ids = arena.download("topk", topk.view());
    const auto* id = reinterpret_cast<const int32_t*>(ids.bytes.data());
    double kv_tokens = 0;
    for (int g = 0; g < Hkv; ++g)
      for (int64_t b = 0; b < B; ++b) {
        std::set<int32_t> pages;
        for (int i = 0; i < kQ; ++i)
          for (int s = 0; s < 16; ++s) {
            const int32_t p = id[(int64_t(g) * rows + b * kQ + i) * 16 + s];
            if (p >= 0) pages.insert(p);
          }
        for (int32_t p : pages) kv_tokens += double(std::min<int64_t>(kPage, pt.context - int64_t(p) * kPage));
      }
    const double attn_bytes = kv_tokens * kDim * elem * 2 + double(rows) * Hq * kDim * 2 * 2 + double(rows) * Hq * 4 +
                              double(Hkv) * rows * 16 * 4;
    table.add_row({std::to_string(B), std::to_string(pt.context / 1024) + "k", fp8 ? "fp8" : "bf16",
                   std::to_string(plan.num_kv_splits), format_time(t_index), gbps(index_bytes, t_index),
                   format_time(t_attn), gbps(attn_bytes, t_attn), format_time(t_step)});
  }
  std::cout << "decode step on " << to_string(dev) << " (MiniMax-M3 tp " << o.tp << ": Hq " << Hq << ", Hkv " << Hkv
            << ", " << kQ << " queries per request; medians of " << repeats << " runs)\n";
  table.print(std::cout);
  return 0;
}

}  // namespace msa::tool
