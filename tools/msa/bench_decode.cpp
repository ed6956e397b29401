// `msa bench --decode`: times one decode step (paged indexer, paged attention, both) per shape
// (batch x context x queries per request Q x K/V cache format), MiniMax-M3 heads. Defaults:
// batch 8 / 32 / 128 x context 4k / 32k / 128k, Q = 8, bf16 caches and one FP8 point (the
// middle batch and context); on the CPU batch 8 x context 4k. Times are medians of CUDA-event
// (CPU: wall-clock) measurements on one stream after warm-up runs; GB/s counts the bytes the
// step actually reads and writes:
//   indexer:   index-K (bf16) of every history page a ranking row scores (the whole context
//              but the local page, once per request) + index_q + topk;
//   attention: for each (request, KV head), the distinct selected pages of its Q rows, only
//              the tokens up to the last row's position, K and V in the cache's format (bf16
//              2 bytes a value, FP8 1 byte, NVFP4 half a byte plus one E4M3 block scale per 16
//              values; FP8's per-tensor scale, 8 bytes a step, is left out) + q + out + lse +
//              topk (split-K partials, which stay in L2 mostly, are not counted);
//   step:      the sum of the two.
// Each rate is also given as a share of the device's copy bandwidth, measured once at the
// start (device-to-device copy of 1 GiB, every byte read and written: the most a streaming
// kernel can expect).
// The caches are a pool of distinct random pages (about 2.5 GB on a GPU, far larger than L2)
// that the requests' page tables map into in scattered order, so long contexts do not need
// their full size in memory. Only the formats a run times are filled.
// Selections (--selection): independent (default) gives every query row its own random index
// query, so the Q rows of a request select mostly different pages (the bench's worst case: a
// page's products serve one row); coherent gives the Q rows of a request the same index query,
// so they select alike (speculative tokens of one request mostly do). Q = 1 has one selection.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "bench_common.h"
#include "case_io.h"
#include "msa/inference.h"
#include "msa/msa.h"
#include "step_timer.h"
#include "table.h"
#include "workload.h"

namespace msa::tool {

namespace {

constexpr int kPage = 128, kDim = 128, kDefaultQ = 8;
constexpr int64_t kCopyBytes = int64_t(1) << 30;
constexpr int kCopyRepeats = 5;


void progress(const std::string& line) { std::cerr << "[msa bench] decode: " << line << std::endl; }

struct DecodeShape {
  int64_t batch = 0, context = 0;
  int queries = kDefaultQ;
  KvFormat format = KvFormat::bf16;
  Selection selection = Selection::independent;  // coherent: the Q rows of a request share their index query
};

// K + V bytes of one token of one KV head.
double kv_token_bytes(KvFormat f) {
  switch (f) {
    case KvFormat::bf16: return 2.0 * kDim * 2;
    case KvFormat::fp8_e4m3: return 2.0 * kDim;
    case KvFormat::nvfp4: return 2.0 * (kDim / 2 + kDim / 16);
  }
  return 0;
}

// "8,32,128": integers in [lo, hi].
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& option, int64_t lo, int64_t hi,
                                    const std::string& what) {
  std::vector<int64_t> values;
  for (const std::string& item : split_list(text)) {
    if (item.empty() || item.size() > 9 || item.find_first_not_of("0123456789") != std::string::npos)
      invalid(option + " must be a comma-separated list of " + what + ", got '" + item + "'");
    const int64_t v = std::stoll(item);
    if (v < lo || v > hi)
      invalid(option + " entries must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + item + "'");
    values.push_back(v);
  }
  return values;
}

// The shapes of the run, in table order: per Q, per format, batch-major. Everything is
// checked here, before the caches are filled.
std::vector<DecodeShape> decode_shapes(const BenchOptions& o, bool gpu) {
  const std::vector<int64_t> batches =
      !o.batches.empty() ? parse_int_list(o.batches, "--batches", 1, 1 << 20, "integers (requests per step)")
                         : gpu ? std::vector<int64_t>{8, 32, 128} : std::vector<int64_t>{8};
  const std::vector<int64_t> contexts = !o.contexts.empty() ? parse_size_list(o.contexts, "--contexts")
                                        : gpu ? std::vector<int64_t>{4096, 32768, 131072} : std::vector<int64_t>{4096};
  const std::vector<int64_t> queries = !o.queries.empty()
                                           ? parse_int_list(o.queries, "--queries", 1, 16, "integers (queries per request)")
                                           : std::vector<int64_t>{kDefaultQ};
  const int64_t most_q = *std::max_element(queries.begin(), queries.end());
  for (int64_t c : contexts)
    if (c < most_q)
      invalid("--contexts entries must be at least the largest --queries value (" + std::to_string(most_q) +
              ": the step's queries are part of the context), got " + std::to_string(c));
  const std::vector<Selection> selections = parse_selections(o.selection);
  std::vector<DecodeShape> shapes;
  const bool default_formats = o.formats.empty();
  const std::vector<KvFormat> formats = default_formats ? std::vector<KvFormat>{KvFormat::bf16} : parse_formats(o.formats);
  for (int64_t q : queries)
    for (Selection sel : selections) {
      // One row a request: the two selections are one.
      if (q == 1 && sel == Selection::coherent && selections.size() > 1) continue;
      for (KvFormat f : formats)
        for (int64_t b : batches)
          for (int64_t c : contexts) shapes.push_back({b, c, int(q), f, sel});
      // The default run's one FP8 point: the middle batch and context (32 x 32k on a GPU).
      if (default_formats) {
        const int64_t b = batches[(batches.size() - 1) / 2], c = contexts[(contexts.size() - 1) / 2];
        shapes.push_back({b, c, int(q), KvFormat::fp8_e4m3, sel});
      }
    }
  return shapes;
}

struct Part {
  double seconds = 0, bytes = 0;
  double rate() const { return seconds > 0 ? bytes / seconds : 0; }
};

struct DecodeRow {
  DecodeShape shape;
  int splits = 0;  // used by the plan
  Part indexer, attention, step;
  Part graph_step;  // GPU: the step captured in a CUDA graph and replayed (no host launch costs)
  // What the rows' selections share: distinct pages a (request, KV head) reads, and how many of
  // its rows select each of them on average (1: disjoint selections; Q: all rows alike). A
  // kernel that multiplies a page for a tile of rows does the more redundant work the lower
  // the second is.
  double pages_per_request_head = 0, rows_per_page = 0;
};

DecodeRow bench_shape(const DecodeShape& pt, const Topology& topo, Device dev, const PagePool& pool, int splits,
                      int repeats, int threads, StepTimer& timer) {
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, Hi = topo.num_index_heads, Q = pt.queries;
  const bool gpu = dev.is_cuda();
  const int64_t B = pt.batch, rows = B * Q, pages_per_req = (pt.context + kPage - 1) / kPage;
  DeviceArena arena(dev);
  std::vector<int32_t> seq(size_t(B), int32_t(pt.context)), table_ids(size_t(B * pages_per_req));
  uint64_t h = 12345;
  for (auto& id : table_ids) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    id = int32_t((h >> 33) % uint64_t(pool.pages));
  }
  DecodeMetadata meta;
  meta.seq_lens = TensorView::contiguous(seq.data(), DType::i32, {B});
  meta.page_table = TensorView::contiguous(table_ids.data(), DType::i32, {B, pages_per_req});
  meta.q_len_per_req = Q;
  InferencePlanOptions po;
  po.device = dev;
  po.num_kv_splits = splits;
  po.num_threads = threads;
  const InferencePlan plan = plan_decode(topo, meta, po);

  StTensor qh = make_tensor("q", DType::bf16, {rows, Hq, kDim}), qih = make_tensor("qi", DType::bf16, {rows, Hi, kDim});
  fill_bytes(qh, 10 + uint64_t(B));
  fill_bytes(qih, 20 + uint64_t(B));
  if (pt.selection == Selection::coherent) {  // every row of a request takes its first row's index query
    const size_t row_bytes = qih.bytes.size() / size_t(rows);
    for (int64_t b = 0; b < B; ++b)
      for (int i = 1; i < Q; ++i)
        std::copy_n(qih.bytes.begin() + ptrdiff_t(size_t(b * Q) * row_bytes), row_bytes,
                    qih.bytes.begin() + ptrdiff_t(size_t(b * Q + i) * row_bytes));
  }
  Buffer q = arena.upload(qh.view()), qi = arena.upload(qih.view());
  Buffer topk = arena.allocate(DType::i32, {Hi, rows, 16}), out = arena.allocate(DType::bf16, {rows, Hq, kDim}),
         lse = arena.allocate(DType::f32, {rows, Hq});
  PagedIndexerParams ip;
  ip.index_q = qi.view();
  ip.index_k_cache = pool.index_k.view();
  ip.topk = topk.view();
  PagedAttentionParams ap;
  ap.q = q.view();
  ap.kv = pool.cache(pt.format);
  ap.topk = topk.view();
  ap.out = out.view();
  ap.lse = lse.view();
  PagedAttentionParams fwd = ap;
  fwd.topk = {};
  RunOptions run;
  run.num_threads = threads;
  run.stream = timer.stream();
  // The plan and the uploads went through the legacy stream, which the timer's non-blocking
  // stream does not wait for.
  synchronize(dev);

  const int warmup = gpu ? 3 : 1;
  DecodeRow row;
  row.shape = pt;
  row.splits = plan.num_kv_splits;
  row.indexer.seconds = timer.median_seconds(warmup, repeats, [&] { paged_indexer(plan, ip, run); });
  row.attention.seconds = timer.median_seconds(warmup, repeats, [&] { paged_attention(plan, ap, run); });
  row.step.seconds = timer.median_seconds(warmup, repeats, [&] { paged_forward(plan, ip, fwd, run); });
  if (gpu) row.graph_step.seconds = timer.graph_median_seconds(warmup, repeats, [&] { paged_forward(plan, ip, fwd, run); });
  timer.sync();

  // Bytes actually read / written (header of this file).
  const int64_t local = (pt.context - 1) / kPage;
  row.indexer.bytes = double(B) * double(local + 1 > 16 ? local : 0) * kPage * kDim * 2 + double(rows) * Hi * kDim * 2 +
                      double(Hi) * rows * 16 * 4;
  const std::vector<int32_t> ids = to_host_ints(topk.view());
  double kv_tokens = 0, union_pages = 0, selections = 0;
  for (int g = 0; g < Hkv; ++g)
    for (int64_t b = 0; b < B; ++b) {
      std::set<int32_t> pages;
      for (int i = 0; i < Q; ++i)
        for (int s = 0; s < 16; ++s) {
          const int32_t p = ids[size_t((int64_t(g) * rows + b * Q + i) * 16 + s)];
          if (p < 0) continue;
          pages.insert(p);
          selections += 1;
        }
      for (int32_t p : pages) kv_tokens += double(std::min<int64_t>(kPage, pt.context - int64_t(p) * kPage));
      union_pages += double(pages.size());
    }
  row.pages_per_request_head = union_pages / double(B * Hkv);
  row.rows_per_page = union_pages > 0 ? selections / union_pages : 0.0;
  row.attention.bytes = kv_tokens * kv_token_bytes(pt.format) + double(rows) * Hq * kDim * 2 * 2 +
                        double(rows) * Hq * 4 + double(Hkv) * rows * 16 * 4;
  row.step.bytes = row.indexer.bytes + row.attention.bytes;
  row.graph_step.bytes = row.step.bytes;
  return row;
}


std::string context_cell(int64_t context) {
  return context % 1024 == 0 ? std::to_string(context / 1024) + "k" : std::to_string(context);
}
// Whole numbers from 100 on, one decimal from 10, two below (the CPU's and small shapes' rates).
std::string number_cell(double v) { return fixed(v, v >= 100 ? 0 : v >= 10 ? 1 : 2); }
std::string gbps_cell(const Part& p) { return p.seconds > 0 ? number_cell(p.rate() * 1e-9) : "-"; }
std::string copy_cell(const Part& p, double copy_rate) {
  return p.seconds > 0 && copy_rate > 0 ? number_cell(100 * p.rate() / copy_rate) : "-";
}

// The row as one line, printed as soon as it is measured (a run cut short keeps its rows).
std::string row_line(const DecodeRow& r, double copy_rate) {
  std::ostringstream s;
  s << "batch " << r.shape.batch << ", context " << r.shape.context << ", Q " << r.shape.queries << ", "
    << format_label(r.shape.format) << ", " << to_string(r.shape.selection) << ", " << r.splits << " splits:";
  const std::pair<const char*, const Part*> parts[] = {{"indexer", &r.indexer}, {"attention", &r.attention}, {"step", &r.step}};
  for (const auto& [name, p] : parts) {
    s << (p == &r.indexer ? " " : " | ") << name << " " << format_time(p->seconds) << " " << gbps_cell(*p) << " GB/s";
    if (copy_rate > 0) s << " (" << copy_cell(*p, copy_rate) << " % of copy)";
  }
  if (r.graph_step.seconds > 0) s << " | step in a CUDA graph " << format_time(r.graph_step.seconds);
  return s.str();
}

const char* kBytesConvention =
    "indexer: bf16 index-K of the history pages a ranking row scores (context but the local page, once per request) + "
    "index_q + topk; attention: per (request, KV head) the distinct selected pages' tokens up to the last row's "
    "position, K and V in the cache format (bf16 512, fp8 256, nvfp4 144 bytes a token and head: packed codes + E4M3 "
    "block scales) + q + out + lse + topk; step: indexer + attention";

nlohmann::json part_json(const Part& p, double copy_rate) {
  nlohmann::json j = {{"us", p.seconds * 1e6}, {"bytes", int64_t(std::llround(p.bytes))}, {"gb_per_s", p.rate() * 1e-9}};
  if (copy_rate > 0) j["percent_of_copy"] = 100 * p.rate() / copy_rate;
  return j;
}

// L2 handling of the timed calls, as the report states it.
std::string l2_label(bool gpu, int64_t flush_bytes) {
  if (!gpu) return "not applicable (CPU)";
  if (flush_bytes == 0) return "kept (--l2 keep): repeated calls may read their data from L2";
  return "flushed: " + std::to_string(flush_bytes >> 20) +
         " MiB written before every timed call, untimed (data from memory; host launches hidden behind the write)";
}

std::string json_text(const std::vector<DecodeRow>& rows, Device dev, const Topology& topo, int repeats, int splits,
                      double copy_rate, int64_t flush_bytes) {
  nlohmann::json j = {{"msa_version", kVersion},
                      {"bench", "decode"},
                      {"device", to_string(dev)},
                      {"heads", {{"q", topo.num_q_heads}, {"kv", topo.num_kv_heads}, {"index", topo.num_index_heads}}},
                      {"repeats", repeats},
                      {"timing", timing_label(dev.is_cuda())},
                      {"l2", l2_label(dev.is_cuda(), flush_bytes)},
                      {"bytes_convention", kBytesConvention},
                      {"splits_requested", splits},
                      {"results", nlohmann::json::array()}};
  if (dev.is_cuda()) {
    j["device_name"] = device_description(dev);
    j["copy_bandwidth"] = {{"gb_per_s", copy_rate * 1e-9},
                           {"copy_bytes", kCopyBytes},
                           {"copies", kCopyRepeats},
                           {"convention", "device-to-device cudaMemcpyAsync, median; 2 x bytes (read + written) / time"}};
  }
  for (const DecodeRow& r : rows)
    j["results"].push_back({{"batch", r.shape.batch},
                            {"context", r.shape.context},
                            {"queries_per_request", r.shape.queries},
                            {"cache", format_label(r.shape.format)},
                            {"selection", to_string(r.shape.selection)},
                            {"splits", r.splits},
                            {"pages_per_request_head", r.pages_per_request_head},
                            {"rows_per_page", r.rows_per_page},
                            {"indexer", part_json(r.indexer, copy_rate)},
                            {"attention", part_json(r.attention, copy_rate)},
                            {"step", part_json(r.step, copy_rate)}});
  if (dev.is_cuda())
    for (size_t i = 0; i < rows.size(); ++i) j["results"][i]["step_graph"] = part_json(rows[i].graph_step, copy_rate);
  return j.dump(2) + '\n';
}

}  // namespace

int run_bench_decode(const BenchOptions& o) {
  const Device dev = resolve_backend(o.backend);
  const bool gpu = dev.is_cuda();
  if (o.tp != 1 && o.tp != 2 && o.tp != 4) invalid("--tp must be 1, 2 or 4, got " + std::to_string(o.tp));
  if (o.splits != 0 && o.splits != 1 && o.splits != 2 && o.splits != 4 && o.splits != 8 && o.splits != 16)
    invalid("--splits must be 0 (automatic), 1, 2, 4, 8 or 16, got " + std::to_string(o.splits));
  const std::vector<DecodeShape> shapes = decode_shapes(o, gpu);
  const Topology topo = Topology::minimax_m3(o.tp);
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads;
  const int repeats = o.repeats > 0 ? o.repeats : (gpu ? 10 : 2);
  StepTimer timer(dev);

  const double copy_rate = device_copy_rate(dev, timer, kCopyBytes, kCopyRepeats);
  if (gpu) progress("copy bandwidth " + fixed(copy_rate * 1e-9, 0) + " GB/s");
  // Small steps fit in L2 (8 x 4k reads ~40 MB): unflushed, their repeats would be timed from
  // it. Twice the L2's size written before each call evicts the last call's data.
  const int64_t flush_bytes = gpu && o.l2 == "flush" ? std::max<int64_t>(2 * device_l2_bytes(dev), int64_t(64) << 20) : 0;
  timer.flush_l2_before_each(flush_bytes);

  // Page pool (shared by every shape): ~1 GB per bf16 K / V cache on a GPU.
  const int64_t pages = gpu ? std::max<int64_t>(64, (int64_t(1) << 30) / (int64_t(Hkv) * kPage * kDim * 2)) : 256;
  progress("filling a pool of " + std::to_string(pages) + " pages");
  DeviceArena arena(dev);
  std::vector<KvFormat> formats;
  for (const DecodeShape& s : shapes)
    if (std::find(formats.begin(), formats.end(), s.format) == formats.end()) formats.push_back(s.format);
  const PagePool pool = fill_pool(arena, pages, Hkv, formats);

  std::vector<DecodeRow> rows;
  for (const DecodeShape& pt : shapes) {
    progress("batch " + std::to_string(pt.batch) + ", context " + std::to_string(pt.context) + ", Q " +
             std::to_string(pt.queries) + ", " + format_label(pt.format) + ", " + to_string(pt.selection));
    rows.push_back(bench_shape(pt, topo, dev, pool, o.splits, repeats, o.threads, timer));
    progress(row_line(rows.back(), copy_rate));
    if (!o.json_path.empty())
      write_file_whole(o.json_path, json_text(rows, dev, topo, repeats, o.splits, copy_rate, flush_bytes));
  }

  std::cout << "decode step on " << to_string(dev);
  if (gpu) std::cout << " (" << device_description(dev) << ")";
  std::cout << ": MiniMax-M3 tp " << o.tp << " (Hq " << Hq << ", Hkv " << Hkv << "), Q = queries per request; medians of "
            << repeats << " runs\n";
  if (gpu)
    std::cout << "copy bandwidth: " << fixed(copy_rate * 1e-9, 0) << " GB/s (device-to-device copy of 1 GiB, bytes read + "
              << "written, median of " << kCopyRepeats << ")\n";
  std::cout << "\n";
  Table table({"batch", "context", "Q", "cache", "selection", "splits", "indexer", "indexer GB/s", "indexer % copy", "attention",
               "attention GB/s", "attention % copy", "step", "step GB/s", "step % copy", "graph step", "graph % copy"});
  table.align_right({true, true, true, false, false, true, true, true, true, true, true, true, true, true, true, true, true});
  for (const DecodeRow& r : rows)
    table.add_row({std::to_string(r.shape.batch), context_cell(r.shape.context), std::to_string(r.shape.queries),
                   format_label(r.shape.format), to_string(r.shape.selection), std::to_string(r.splits), format_time(r.indexer.seconds),
                   gbps_cell(r.indexer), copy_cell(r.indexer, copy_rate), format_time(r.attention.seconds),
                   gbps_cell(r.attention), copy_cell(r.attention, copy_rate), format_time(r.step.seconds),
                   gbps_cell(r.step), copy_cell(r.step, copy_rate),
                   r.graph_step.seconds > 0 ? format_time(r.graph_step.seconds) : "-", copy_cell(r.graph_step, copy_rate)});
  table.print(std::cout);
  std::cout << "\nTimes: medians, " << timing_label(gpu)
            << "; indexer and attention timed on their own, step = paged_forward (both); graph step: the same step "
               "captured once in a CUDA graph and replayed (the device's time without the host's launch costs; GPU "
               "only).\n"
               "GB/s: bytes read and written / time, the bytes being\n"
               "  indexer    bf16 index-K of the history pages the rows rank (the context but the local page, once per "
               "request) + index_q + topk\n"
               "  attention  per (request, KV head) the distinct selected pages' tokens up to the last row's position, "
               "K + V at 512 (bf16), 256 (fp8) or 144 (nvfp4: codes + block scales) bytes a token, + q + out + lse + topk\n"
               "  step       indexer + attention\n"
            << "% copy: " << (gpu ? "share of the copy bandwidth above" : "GPU only") << ". splits: "
            << (o.splits == 0 ? "the plan's automatic split-K count" : "--splits " + std::to_string(o.splits)) << ".\n";
  if (gpu) std::cout << "L2: " << l2_label(gpu, flush_bytes) << ".\n";
  if (!o.json_path.empty()) std::cout << "wrote " << o.json_path << "\n";
  return 0;
}

}  // namespace msa::tool
