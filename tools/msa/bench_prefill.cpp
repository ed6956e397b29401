// `msa bench --prefill FILE`: times paged (chunked) prefill steps over the shapes of a
// production manifest, one JSON object a line (batch_size, query_lens, prefix_lens,
// final_kv_lens; optional case_id, tags, representative_weight, stratum, count), MiniMax-M3
// heads. Per case and K/V cache format: plan_paged_prefill (host work and its device copies),
// paged_indexer, paged_attention, and the whole step (plan + indexer + attention), medians of
// CUDA-event (CPU: wall-clock) measurements after warm-up runs; then production-weighted totals
// per stratum. `--prefill long:N:C` prefills one prompt of N tokens in chunks of C instead
// (chunk c: prefix c * C), timing every --sample-th chunk's worth.
//
// Inputs are random and built once per case: q, index_q (bf16) and page tables that map each
// request's logical pages to distinct pages of one pool, in scattered random order. The pool
// holds as many pages as the largest case reads (a few GB on a GPU for the production
// manifest), filled only for the formats the run times.
//
// Rates (useful FLOPs; the attention's counted exactly from the top-k the indexer produced,
// copied back once outside the timed runs):
//   attention: 4 * 128 * (Hq / Hkv) * attended pairs, a pair being (KV head, query row, key)
//              with the key in one of the row's selected pages and at or before its position;
//   indexer:   2 * 128 * Hi * keys scored, a row scoring every key of the pages before its own
//              page when it sees more than topk pages (rows that see fewer select them all).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>
#include <random>
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

constexpr int kPage = 128, kDim = 128;
// The library's limit: 8192 pages (1,048,576 tokens) per request.
constexpr int64_t kMaxKv = int64_t(8192) * kPage;


void progress(const std::string& line) { std::cerr << "[msa bench] prefill: " << line << std::endl; }

int64_t pages_of(int64_t tokens) { return (tokens + kPage - 1) / kPage; }

// One prefill step: a manifest row, or one chunk of a long prompt.
struct PrefillCase {
  std::string id;  // the manifest's case_id ("line N" without one); "chunk N" for a long prompt
  int64_t line = 0;  // line in the manifest; 0 for a chunk
  std::vector<std::string> tags;
  std::string stratum;  // empty: none
  // Manifest: the production weight (see weight_of). Long prompt: the chunks this one stands for.
  double weight = 1;
  int64_t chunk = -1;  // long prompt: the chunk's index
  std::vector<int64_t> query_lens, prefix_lens;

  int64_t batch() const { return int64_t(query_lens.size()); }
  int64_t total_q() const { return std::accumulate(query_lens.begin(), query_lens.end(), int64_t(0)); }
  int64_t kv_len(size_t b) const { return prefix_lens[b] + query_lens[b]; }
  int64_t max_kv() const {
    int64_t m = 0;
    for (size_t b = 0; b < query_lens.size(); ++b) m = std::max(m, kv_len(b));
    return m;
  }
  int64_t pages() const {
    int64_t n = 0;
    for (size_t b = 0; b < query_lens.size(); ++b) n += pages_of(kv_len(b));
    return n;
  }
};

// ---- the manifest ----

// The rows a run times, and how they were chosen (for the report).
struct Workload {
  std::vector<PrefillCase> cases;
  std::string source;     // the manifest path, or "long:N:C"
  std::string selection;  // "representative (66 of 128 rows)", ...
  int64_t manifest_rows = 0;
  // Long prompt only:
  bool long_prompt = false;
  int64_t tokens = 0, chunk = 0, chunks = 0, sample = 1;
};

// Errors name the file, the line and the field.
struct RowReader {
  const std::string& path;
  int64_t line;
  const nlohmann::json& row;

  [[noreturn]] void fail(const std::string& what) const {
    invalid("--prefill " + path + ": line " + std::to_string(line) + ": " + what);
  }
  static std::string shown(const nlohmann::json& v) {
    std::string text = v.dump();
    return text.size() > 40 ? text.substr(0, 37) + "..." : text;
  }
  bool has(const char* field) const { return row.contains(field) && !row[field].is_null(); }
  int64_t integer(const nlohmann::json& v, const std::string& name, int64_t lo, int64_t hi) const {
    if (!v.is_number_integer())
      fail(name + " must be an integer, got " + shown(v));
    // Non-negative numbers parse as unsigned; those above INT64_MAX would read as negative.
    if ((v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) || v.get<int64_t>() < lo ||
        v.get<int64_t>() > hi)
      fail(name + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + shown(v));
    return v.get<int64_t>();
  }
  int64_t integer(const char* field, int64_t lo, int64_t hi) const {
    if (!has(field)) fail("field '" + std::string(field) + "' is missing");
    return integer(row[field], field, lo, hi);
  }
  std::vector<int64_t> integers(const char* field, int64_t count, int64_t lo, int64_t hi) const {
    if (!has(field)) fail("field '" + std::string(field) + "' is missing");
    const nlohmann::json& v = row[field];
    if (!v.is_array()) fail(std::string(field) + " must be an array of integers, got " + shown(v));
    if (int64_t(v.size()) != count)
      fail(std::string(field) + " must have batch_size = " + std::to_string(count) + " entries, got " +
           std::to_string(v.size()));
    std::vector<int64_t> values;
    for (size_t i = 0; i < v.size(); ++i)
      values.push_back(integer(v[i], std::string(field) + "[" + std::to_string(i) + "]", lo, hi));
    return values;
  }
  std::string text(const char* field) const {
    if (!has(field)) return "";
    if (!row[field].is_string()) fail(std::string(field) + " must be a string or null, got " + shown(row[field]));
    return row[field].get<std::string>();
  }
};

// The production weight of a row: representative_weight when the row has one; 0 when it is
// null (the benchmark-case set's diagnostic rows: hot, batch_anchor, stress, which the
// production aggregate leaves out); without the field, the row's call count (the shape
// manifest's call weight), else 1.
double weight_of(const RowReader& r) {
  if (r.row.contains("representative_weight")) {
    const nlohmann::json& w = r.row["representative_weight"];
    if (w.is_null()) return 0;
    if (!w.is_number() || !std::isfinite(w.get<double>()) || w.get<double>() < 0)
      r.fail("representative_weight must be a number >= 0 or null, got " + RowReader::shown(w));
    return w.get<double>();
  }
  if (r.has("count")) return double(r.integer("count", 0, INT64_MAX));
  return 1;
}

PrefillCase read_row(const std::string& path, int64_t line, const nlohmann::json& row) {
  const RowReader r{path, line, row};
  if (!row.is_object()) r.fail("expected a JSON object, got " + RowReader::shown(row));
  PrefillCase c;
  c.line = line;
  c.id = r.text("case_id");
  if (c.id.empty()) c.id = "line " + std::to_string(line);
  c.stratum = r.text("stratum");
  if (r.has("tags")) {
    if (!row["tags"].is_array()) r.fail("tags must be an array of strings or null, got " + RowReader::shown(row["tags"]));
    for (const auto& t : row["tags"]) {
      if (!t.is_string()) r.fail("tags must be an array of strings, got the entry " + RowReader::shown(t));
      c.tags.push_back(t.get<std::string>());
    }
  }
  c.weight = weight_of(r);
  const int64_t batch = r.integer("batch_size", 1, 1 << 20);
  c.query_lens = r.integers("query_lens", batch, 1, kMaxKv);
  c.prefix_lens = r.integers("prefix_lens", batch, 0, kMaxKv);
  for (size_t b = 0; b < size_t(batch); ++b)
    if (c.kv_len(b) > kMaxKv)
      r.fail("prefix_lens[" + std::to_string(b) + "] + query_lens[" + std::to_string(b) + "] = " +
             std::to_string(c.kv_len(b)) + " exceeds " + std::to_string(kMaxKv) +
             " tokens (8192 pages, the most a request may have)");
  if (r.has("final_kv_lens")) {
    const std::vector<int64_t> kv = r.integers("final_kv_lens", batch, 0, INT64_MAX);
    for (size_t b = 0; b < size_t(batch); ++b)
      if (kv[b] != c.kv_len(b))
        r.fail("final_kv_lens[" + std::to_string(b) + "] = " + std::to_string(kv[b]) + " must equal prefix_lens[" +
               std::to_string(b) + "] + query_lens[" + std::to_string(b) + "] = " + std::to_string(c.kv_len(b)));
  }
  if (c.total_q() > INT32_MAX) r.fail("the query lengths add up to more than 2^31 - 1 rows");
  // Physical page ids: slot ids page * 128 + offset must fit in int32.
  if (c.pages() > (int64_t(1) << 31) / kPage)
    r.fail("the requests need " + std::to_string(c.pages()) + " pages, more than the " +
           std::to_string((int64_t(1) << 31) / kPage) + " page ids a cache may have");
  return c;
}

Workload read_manifest(const std::string& path, const std::string& cases_option) {
  if (std::filesystem::is_directory(path)) invalid("--prefill " + path + ": is a directory, expected a manifest file");
  std::ifstream in(path);
  if (!in) invalid("--prefill " + path + ": no such file (or it cannot be read)");
  std::vector<PrefillCase> rows;
  bool any_tags = false;
  std::string text;
  for (int64_t line = 1; std::getline(in, text); ++line) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json row;
    try {
      row = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      std::string why = e.what();
      // "[json.exception.parse_error.101] parse error at line 1, column 5: ...": the line is ours.
      if (why.find("] ") != std::string::npos) why = why.substr(why.find("] ") + 2);
      if (why.find("at line 1, ") != std::string::npos) why.erase(why.find("at line 1, ") + 3, 8);
      invalid("--prefill " + path + ": line " + std::to_string(line) + " is not valid JSON (" + why + ")");
    }
    any_tags = any_tags || (row.is_object() && row.contains("tags") && !row["tags"].is_null());
    rows.push_back(read_row(path, line, row));
  }
  if (rows.empty()) invalid("--prefill " + path + ": the manifest has no rows");

  Workload w;
  w.source = path;
  w.manifest_rows = int64_t(rows.size());
  // Without --cases: the representative rows, or every row of a manifest without tags.
  const std::string which = !cases_option.empty() ? cases_option : any_tags ? "representative" : "all";
  for (PrefillCase& c : rows)
    if (which == "all" || std::find(c.tags.begin(), c.tags.end(), which) != c.tags.end()) w.cases.push_back(std::move(c));
  if (w.cases.empty()) {
    std::set<std::string> tags;
    for (const PrefillCase& c : rows) tags.insert(c.tags.begin(), c.tags.end());
    std::string known;
    for (const std::string& t : tags) known += (known.empty() ? "" : ", ") + t;
    invalid("--cases " + which + ": no row of " + path + " is tagged '" + which + "' (" +
            (known.empty() ? std::string("its rows have no tags; --cases all times every row") : "its tags: " + known) +
            ")");
  }
  w.selection = which + " (" + std::to_string(w.cases.size()) + " of " + std::to_string(rows.size()) + " rows" +
                (cases_option.empty() && !any_tags ? ", the manifest has no tags" : "") + ")";
  return w;
}

// ---- a long prompt ----

// long:N:C with N, C token counts (4096, 16k, 1m). Chunk c has prefix c * C. With --sample K
// the chunks fall into groups of K consecutive ones; the middle chunk of each group is timed
// and stands for the group: for costs that grow linearly along the prompt (the indexer's) the
// middle chunk's cost is the group's mean. With an even K it is the lower of the two middle
// chunks, which undercounts such a cost by half a chunk's growth per group.
Workload long_prompt(const std::string& spec, int64_t sample) {
  const std::string usage = "--prefill long:N:C (a prompt of N tokens in chunks of C, e.g. long:1m:16k)";
  const size_t colon = spec.find(':', 5);
  if (colon == std::string::npos || spec.find(':', colon + 1) != std::string::npos)
    invalid(usage + " must have two token counts after 'long:', got '" + spec + "'");
  // 4096, 16k, 1m in [1, kMaxKv].
  auto token_count = [&](const std::string& text, const char* name) {
    std::string digits = text;
    int64_t unit = 1;
    if (!digits.empty() && (digits.back() == 'k' || digits.back() == 'K')) unit = 1024, digits.pop_back();
    else if (!digits.empty() && (digits.back() == 'm' || digits.back() == 'M')) unit = 1024 * 1024, digits.pop_back();
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos)
      invalid(usage + ": " + name + " must be a token count (e.g. 16384 or 16k), got '" + text + "'");
    const int64_t value = std::stoll(digits) * unit;
    if (value < 1 || value > kMaxKv)
      invalid(usage + ": " + name + " must be in [1, " + std::to_string(kMaxKv) +
              "] tokens (8192 pages, the most a request may have), got '" + text + "'");
    return value;
  };
  const int64_t tokens = token_count(spec.substr(5, colon - 5), "N");
  const int64_t chunk = token_count(spec.substr(colon + 1), "C");
  Workload w;
  w.long_prompt = true;
  w.source = spec;
  w.tokens = tokens;
  w.chunk = std::min(chunk, tokens);
  w.chunks = (tokens + w.chunk - 1) / w.chunk;
  w.sample = std::min(sample, w.chunks);
  for (int64_t first = 0; first < w.chunks; first += w.sample) {
    const int64_t group = std::min(w.sample, w.chunks - first), c = first + (group - 1) / 2;
    PrefillCase pc;
    pc.id = "chunk " + std::to_string(c);
    pc.chunk = c;
    pc.weight = double(group);
    pc.prefix_lens = {c * w.chunk};
    pc.query_lens = {std::min(w.chunk, tokens - c * w.chunk)};
    w.cases.push_back(pc);
  }
  w.selection = w.sample == 1 ? "every chunk timed"
                              : std::to_string(w.cases.size()) + " of " + std::to_string(w.chunks) +
                                    " chunks timed (--sample " + std::to_string(sample) +
                                    ": the middle chunk of each group of " + std::to_string(w.sample) +
                                    " consecutive chunks" + (w.sample % 2 == 0 ? " (the lower of the two)" : "") +
                                    ", standing for the group)";
  return w;
}

// ---- timing ----

struct PrefillRow {
  PrefillCase c;
  KvFormat format = KvFormat::bf16;
  double plan = 0, indexer = 0, attention = 0, step = 0;  // seconds
  double attended_pairs = 0, attention_flops = 0, indexer_flops = 0;
  double attention_tflops() const { return attention > 0 ? attention_flops / attention * 1e-12 : 0; }
  double indexer_tflops() const { return indexer > 0 ? indexer_flops / indexer * 1e-12 : 0; }
  double indexer_share() const { return step > 0 ? indexer / step : 0; }
};

// Keys of logical page `page` that position `pos` attends.
int64_t visible_keys(int64_t page, int64_t pos) {
  return std::clamp<int64_t>(pos + 1 - page * kPage, 0, kPage);
}

// The case's physical pages, request by request: a prefix of a random permutation of the pool.
std::vector<int32_t> scattered_pages(int64_t needed, int64_t pool_pages, uint64_t seed) {
  std::vector<int32_t> ids(size_t(pool_pages), 0);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 random(seed);
  std::shuffle(ids.begin(), ids.end(), random);
  ids.resize(size_t(needed));
  return ids;
}

struct CaseSetup {
  const Topology& topo;
  Device dev;
  const PagePool& pool;
  int repeats = 1, warmup = 1, threads = 0;
  uint64_t seed = 1;
};

// Times one case in every format: plan and indexer once (they do not read the K / V cache),
// attention and the whole step per format.
std::vector<PrefillRow> bench_case(const PrefillCase& c, const std::vector<int32_t>& physical,
                                   const std::vector<KvFormat>& formats, const CaseSetup& s, StepTimer& timer) {
  const Topology& topo = s.topo;
  const int Hq = topo.num_q_heads, Hi = topo.num_index_heads, K = topo.topk;
  const int64_t B = c.batch(), rows = c.total_q();
  int64_t max_pages = 0;
  for (size_t b = 0; b < size_t(B); ++b) max_pages = std::max(max_pages, pages_of(c.kv_len(b)));

  std::vector<int32_t> cu_q(size_t(B + 1), 0), seq(size_t(B), 0), table(size_t(B * max_pages), 0);
  size_t next_page = 0;
  for (size_t b = 0; b < size_t(B); ++b) {
    cu_q[b + 1] = int32_t(cu_q[b] + c.query_lens[b]);
    seq[b] = int32_t(c.kv_len(b));
    for (int64_t j = 0; j < pages_of(c.kv_len(b)); ++j) table[b * size_t(max_pages) + size_t(j)] = physical[next_page++];
  }
  PagedPrefillMetadata meta;
  meta.cu_seqlens_q = TensorView::contiguous(cu_q.data(), DType::i32, {B + 1});
  meta.seq_lens = TensorView::contiguous(seq.data(), DType::i32, {B});
  meta.page_table = TensorView::contiguous(table.data(), DType::i32, {B, max_pages});
  InferencePlanOptions po;
  po.device = s.dev;
  po.num_threads = s.threads;

  DeviceArena arena(s.dev);
  StTensor qh = make_tensor("q", DType::bf16, {rows, Hq, kDim}), qih = make_tensor("qi", DType::bf16, {rows, Hi, kDim});
  fill_bytes(qh, s.seed * 1000003 + 10);
  fill_bytes(qih, s.seed * 1000003 + 20);
  const Buffer q = arena.upload(qh.view()), qi = arena.upload(qih.view());
  const Buffer topk = arena.allocate(DType::i32, {Hi, rows, K}), out = arena.allocate(DType::bf16, {rows, Hq, kDim}),
               lse = arena.allocate(DType::f32, {rows, Hq});
  PagedIndexerParams ip;
  ip.index_q = qi.view();
  ip.index_k_cache = s.pool.index_k.view();
  ip.topk = topk.view();
  RunOptions run;
  run.num_threads = s.threads;
  run.stream = timer.stream();
  // The uploads went through the legacy stream, which the timer's non-blocking stream does
  // not wait for.
  synchronize(s.dev);

  // A plan's device copies go through the legacy stream: the step waits for the device before
  // its kernels. Plans are freed before a timed call starts (freeing device memory waits for
  // the device too).
  InferencePlan plan;
  auto make_plan = [&] {
    plan = plan_paged_prefill(topo, meta, po);
    synchronize(s.dev);
  };
  std::vector<double> plan_times;
  for (int i = 0; i < s.warmup + s.repeats; ++i) {
    plan = InferencePlan();
    const double seconds = timer.host_seconds(make_plan);
    if (i >= s.warmup) plan_times.push_back(seconds);
  }
  PrefillRow first;
  first.c = c;
  first.plan = median(plan_times);
  first.indexer = timer.median_seconds(s.warmup, s.repeats, [&] { paged_indexer(plan, ip, run); });
  timer.sync();

  // Useful FLOPs from the top-k the indexer produced (header of this file).
  const std::vector<int32_t> ids = to_host_ints(topk.view());
  double pairs = 0, scored = 0;
  for (size_t b = 0; b < size_t(B); ++b)
    for (int64_t i = 0; i < c.query_lens[b]; ++i) {
      const int64_t pos = c.prefix_lens[b] + i, row = cu_q[b] + i, local = pos / kPage;
      if (local + 1 > K) scored += double(local) * kPage;
      for (int g = 0; g < Hi; ++g) {
        const int32_t* sel = ids.data() + (int64_t(g) * rows + row) * K;
        for (int j = 0; j < K; ++j)
          if (sel[j] >= 0) pairs += double(visible_keys(sel[j], pos));
      }
    }
  first.attended_pairs = pairs;
  first.attention_flops = 4.0 * kDim * topo.group_size() * pairs;
  first.indexer_flops = 2.0 * kDim * Hi * scored;

  std::vector<PrefillRow> result;
  for (KvFormat f : formats) {
    PrefillRow r = first;
    r.format = f;
    PagedAttentionParams ap;
    ap.q = q.view();
    ap.kv = s.pool.cache(f);
    ap.topk = topk.view();
    ap.out = out.view();
    ap.lse = lse.view();
    r.attention = timer.median_seconds(s.warmup, s.repeats, [&] { paged_attention(plan, ap, run); });
    r.step = timer.median_seconds(
        s.warmup, s.repeats,
        [&] {
          make_plan();
          paged_indexer(plan, ip, run);
          paged_attention(plan, ap, run);
        },
        [&](const std::string&) {
          timer.sync();
          plan = InferencePlan();
        });
    timer.sync();
    result.push_back(r);
  }
  return result;
}

// ---- reporting ----

std::string ms_cell(double seconds) { return fixed(seconds * 1e3, 3); }
// TFLOP/s cell ('-' when there is no useful work: a row set whose rows all see at most topk
// pages does not rank).
std::string tf_cell(double tflops) { return tflops_cell(tflops); }
std::string weight_cell(double w) { return w == std::floor(w) && w < 1e15 ? fixed(w, 0) : fixed(w, 2); }

// "prefill_4469427d069d9467c4ec" -> "4469427d".
std::string short_id(const std::string& id) {
  const std::string prefix = "prefill_";
  const std::string rest = id.rfind(prefix, 0) == 0 ? id.substr(prefix.size()) : id;
  return rest.size() > 12 ? rest.substr(0, 8) : rest;
}

std::string row_line(const PrefillRow& r) {
  std::ostringstream s;
  s << short_id(r.c.id) << ", " << format_label(r.format) << ": plan " << ms_cell(r.plan) << " ms | indexer "
    << ms_cell(r.indexer) << " ms " << tf_cell(r.indexer_tflops()) << " TF/s | attention " << ms_cell(r.attention)
    << " ms " << tf_cell(r.attention_tflops()) << " TF/s | step " << ms_cell(r.step) << " ms";
  return s.str();
}

// Weighted sums of a set of rows of one format.
struct Total {
  std::string stratum;  // "all" for the whole run
  KvFormat format = KvFormat::bf16;
  int64_t cases = 0;
  double weight = 0, plan = 0, indexer = 0, attention = 0, step = 0;  // Σ weight * seconds
  void add(const PrefillRow& r) {
    ++cases;
    weight += r.c.weight;
    plan += r.c.weight * r.plan;
    indexer += r.c.weight * r.indexer;
    attention += r.c.weight * r.attention;
    step += r.c.weight * r.step;
  }
};

// Manifest: per (stratum, format) in name order, then per format over every row. Long
// prompt: per format (the estimate of the whole prompt).
std::vector<Total> totals_of(const std::vector<PrefillRow>& rows, const std::vector<KvFormat>& formats, bool long_prompt) {
  std::vector<Total> totals;
  for (KvFormat f : formats) {
    std::map<std::string, Total> strata;
    Total all;
    all.stratum = "all";
    all.format = f;
    for (const PrefillRow& r : rows) {
      if (r.format != f) continue;
      all.add(r);
      if (long_prompt) continue;
      Total& t = strata[r.c.stratum.empty() ? "-" : r.c.stratum];
      t.stratum = r.c.stratum.empty() ? "-" : r.c.stratum;
      t.format = f;
      t.add(r);
    }
    if (all.cases == 0) continue;
    // A manifest without strata: the overall row alone.
    if (!(strata.size() == 1 && strata.begin()->first == "-"))
      for (auto& [name, t] : strata) totals.push_back(t);
    totals.push_back(all);
  }
  return totals;
}

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char ch : text) quoted += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return quoted + "\"";
}
std::string csv_number(double v) {
  char text[48];
  std::snprintf(text, sizeof text, "%.6g", v);
  return text;
}

std::string csv_text(const std::vector<PrefillRow>& rows, bool long_prompt) {
  std::string text =
      "case_id,line,stratum,weight,chunk,prefix,stands_for,batch,total_q,max_kv,cache,plan_ms,indexer_ms,attention_ms,"
      "step_ms,attention_tflops,indexer_tflops,indexer_share,attended_pairs,attention_flops,indexer_flops\n";
  for (const PrefillRow& r : rows) {
    const PrefillCase& c = r.c;
    const std::vector<std::string> fields = {
        csv_field(c.id), long_prompt ? "" : std::to_string(c.line), csv_field(c.stratum),
        long_prompt ? "" : csv_number(c.weight), long_prompt ? std::to_string(c.chunk) : "",
        long_prompt ? std::to_string(c.prefix_lens[0]) : "", long_prompt ? csv_number(c.weight) : "",
        std::to_string(c.batch()), std::to_string(c.total_q()), std::to_string(c.max_kv()), format_label(r.format),
        fixed(r.plan * 1e3, 4), fixed(r.indexer * 1e3, 4), fixed(r.attention * 1e3, 4), fixed(r.step * 1e3, 4),
        csv_number(r.attention_tflops()), csv_number(r.indexer_tflops()), fixed(r.indexer_share(), 4),
        csv_number(r.attended_pairs), csv_number(r.attention_flops), csv_number(r.indexer_flops)};
    for (size_t i = 0; i < fields.size(); ++i) text += (i ? "," : "") + fields[i];
    text += '\n';
  }
  return text;
}

const char* kFlopConvention =
    "attention = 4*128*(Hq/Hkv)*attended pairs (KV head, query row, key in a selected page at or before the row's "
    "position), counted from the indexer's top-k; indexer = 2*128*Hi*keys scored (the pages before the row's own "
    "page, for rows that see more than topk pages)";

nlohmann::json part_json(double seconds, double flops = -1) {
  nlohmann::json j = {{"ms", seconds * 1e3}};
  if (flops >= 0) {
    j["useful_flops"] = flops;
    j["tflops_per_s"] = seconds > 0 ? flops / seconds * 1e-12 : 0;
  }
  return j;
}

std::string json_text(const std::vector<PrefillRow>& rows, const Workload& w, const std::vector<KvFormat>& formats,
                      Device dev, const Topology& topo, int repeats, int warmup) {
  nlohmann::json j = {
      {"msa_version", kVersion},
      {"bench", "prefill"},
      {"device", to_string(dev)},
      {"heads", {{"q", topo.num_q_heads}, {"kv", topo.num_kv_heads}, {"index", topo.num_index_heads}}},
      {"repeats", repeats},
      {"warmup", warmup},
      {"timing", dev.is_cuda() ? std::string(timing_label(true)) + "; plan: host clock to the end of its device copies"
                               : std::string(timing_label(false))},
      {"flop_convention", kFlopConvention},
      {"results", nlohmann::json::array()},
      {"totals", nlohmann::json::array()}};
  if (dev.is_cuda()) j["device_name"] = device_description(dev);
  if (w.long_prompt) {
    j["long_prompt"] = {{"tokens", w.tokens},      {"chunk", w.chunk}, {"chunks", w.chunks},
                        {"sample", w.sample},      {"chunks_timed", int64_t(w.cases.size())},
                        {"estimate", "sum over the timed chunks of time x the chunks each stands for"}};
  } else {
    j["manifest"] = {{"path", w.source},
                     {"cases", w.selection},
                     {"rows", w.manifest_rows},
                     {"weight", "representative_weight; 0 when null; without the field the row's count, else 1"}};
  }
  for (const PrefillRow& r : rows) {
    const PrefillCase& c = r.c;
    nlohmann::json row = {{"case_id", c.id},
                          {"batch", c.batch()},
                          {"query_lens", c.query_lens},
                          {"prefix_lens", c.prefix_lens},
                          {"total_q", c.total_q()},
                          {"max_kv", c.max_kv()},
                          {"cache", format_label(r.format)},
                          {"plan", part_json(r.plan)},
                          {"indexer", part_json(r.indexer, r.indexer_flops)},
                          {"attention", part_json(r.attention, r.attention_flops)},
                          {"step", part_json(r.step)},
                          {"attended_pairs", r.attended_pairs},
                          {"indexer_share", r.indexer_share()}};
    if (w.long_prompt) {
      row["chunk"] = c.chunk;
      row["prefix"] = c.prefix_lens[0];
      row["stands_for"] = int64_t(c.weight);
    } else {
      row["line"] = c.line;
      row["tags"] = c.tags;
      row["stratum"] = c.stratum.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.stratum);
      row["weight"] = c.weight;
    }
    j["results"].push_back(row);
  }
  for (const Total& t : totals_of(rows, formats, w.long_prompt)) {
    nlohmann::json total = {{"cache", format_label(t.format)}};
    if (w.long_prompt) {
      total["chunks_timed"] = t.cases;
      total["chunks"] = int64_t(t.weight);
      total["estimated_ms"] = {{"plan", t.plan * 1e3}, {"indexer", t.indexer * 1e3}, {"attention", t.attention * 1e3},
                               {"step", t.step * 1e3}};
      total["indexer_share"] = t.step > 0 ? t.indexer / t.step : 0;
    } else {
      total["stratum"] = t.stratum;
      total["cases"] = t.cases;
      total["weight"] = t.weight;
      total["weighted_ms"] = {{"plan", t.plan * 1e3}, {"indexer", t.indexer * 1e3}, {"attention", t.attention * 1e3},
                              {"step", t.step * 1e3}};
      total["step_ms_per_call"] = t.weight > 0 ? nlohmann::json(t.step / t.weight * 1e3) : nlohmann::json(nullptr);
    }
    j["totals"].push_back(total);
  }
  return j.dump(2) + '\n';
}

void print_report(const std::vector<PrefillRow>& rows, const Workload& w, const std::vector<KvFormat>& formats,
                  Device dev, const BenchOptions& o, const Topology& topo, int repeats) {
  const bool gpu = dev.is_cuda();
  std::cout << "prefill step on " << to_string(dev);
  if (gpu) std::cout << " (" << device_description(dev) << ")";
  std::cout << ": MiniMax-M3 tp " << o.tp << " (Hq " << topo.num_q_heads << ", Hkv " << topo.num_kv_heads << ", Hi "
            << topo.num_index_heads << "); medians of " << repeats << " runs\n";
  if (w.long_prompt)
    std::cout << "long prompt: " << w.tokens << " tokens in chunks of " << w.chunk << " (" << w.chunks
              << " chunks); " << w.selection << "\n\n";
  else
    std::cout << "manifest " << w.source << ", cases: " << w.selection << "\n\n";

  std::vector<std::string> header = {"case", "stratum", "weight", "batch", "queries", "max kv"};
  if (w.long_prompt) header = {"chunk", "prefix", "queries", "stands for"};
  for (const char* h : {"cache", "plan ms", "indexer ms", "attn ms", "step ms", "attn TF/s", "idx TF/s", "idx %"})
    header.push_back(h);
  Table table(header);
  std::vector<bool> right(header.size(), true);
  if (!w.long_prompt) right[0] = right[1] = false;
  right[header.size() - 8] = false;  // cache
  table.align_right(right);
  for (const PrefillRow& r : rows) {
    const PrefillCase& c = r.c;
    std::vector<std::string> cells;
    if (w.long_prompt)
      cells = {std::to_string(c.chunk), std::to_string(c.prefix_lens[0]), std::to_string(c.total_q()),
               weight_cell(c.weight)};
    else
      cells = {short_id(c.id),          c.stratum.empty() ? "-" : c.stratum, weight_cell(c.weight),
               std::to_string(c.batch()), std::to_string(c.total_q()),       std::to_string(c.max_kv())};
    for (const std::string& cell :
         {std::string(format_label(r.format)), ms_cell(r.plan), ms_cell(r.indexer), ms_cell(r.attention), ms_cell(r.step),
          tf_cell(r.attention_tflops()), tf_cell(r.indexer_tflops()), fixed(100 * r.indexer_share(), 1)})
      cells.push_back(cell);
    table.add_row(cells);
  }
  table.print(std::cout);

  const std::vector<Total> totals = totals_of(rows, formats, w.long_prompt);
  if (w.long_prompt) {
    std::cout << "\nWhole prompt (" << w.tokens << " tokens, " << w.chunks << " chunks), "
              << (w.sample == 1 ? "sum over every chunk" : "estimate: sum over the timed chunks of time x the chunks it stands for")
              << ":\n";
    Table t({"cache", "chunks timed", "plan ms", "indexer ms", "attn ms", "step ms", "idx %"});
    t.align_right({false, true, true, true, true, true, true});
    for (const Total& s : totals)
      t.add_row({format_label(s.format), std::to_string(s.cases), ms_cell(s.plan), ms_cell(s.indexer),
                 ms_cell(s.attention), ms_cell(s.step), fixed(s.step > 0 ? 100 * s.indexer / s.step : 0, 1)});
    t.print(std::cout);
  } else {
    std::cout << "\nProduction-weighted totals per stratum (weight: representative_weight; 0 when null, the row's "
                 "count without the field, else 1):\n";
    Table t({"stratum", "cache", "cases", "weight", "sum w*step ms", "ms per call"});
    t.align_right({false, false, true, true, true, true});
    for (const Total& s : totals)
      t.add_row({s.stratum, format_label(s.format), std::to_string(s.cases), weight_cell(s.weight), ms_cell(s.step),
                 s.weight > 0 ? ms_cell(s.step / s.weight) : "-"});
    t.print(std::cout);
  }
  std::cout << "\nTimes: medians, " << timing_label(gpu)
            << "; plan: host clock from the call to the end of its device copies; plan and indexer do not read the K/V "
               "cache and are timed once per case; step = plan + indexer + attention (the plan's host work included).\n"
               "attn TF/s: 4 * 128 * (Hq / Hkv) * attended pairs (a selected page's keys at or before the row's "
               "position, counted from the indexer's top-k) / attention time. idx TF/s: 2 * 128 * Hi * keys scored (the "
               "pages before a row's own page, for rows that see more than "
            << topo.topk << " pages) / indexer time. idx %: indexer / step.\n";
  if (!w.long_prompt)
    std::cout << "ms per call: sum of weight * step / sum of weight (the production mean of one prefill call).\n";
  if (!o.csv_path.empty()) std::cout << "wrote " << o.csv_path << "\n";
  if (!o.json_path.empty()) std::cout << "wrote " << o.json_path << "\n";
}

}  // namespace

int run_bench_prefill(const BenchOptions& o) {
  if (o.prefill.empty()) invalid("--prefill needs a manifest file (one JSON object a line) or long:N:C");
  if (o.tp != 1 && o.tp != 2 && o.tp != 4) invalid("--tp must be 1, 2 or 4, got " + std::to_string(o.tp));
  if (o.sample < 1) invalid("--sample must be at least 1, got " + std::to_string(o.sample));
  const bool long_mode = o.prefill.rfind("long:", 0) == 0;
  if (long_mode && !o.cases.empty()) invalid("--cases selects manifest rows; --prefill long:N:C has none");
  if (!long_mode && o.sample != 1) invalid("--sample applies to a long prompt (--prefill long:N:C) only");
  // Everything is checked before the pool is filled.
  const std::vector<KvFormat> formats = o.formats.empty() ? std::vector<KvFormat>{KvFormat::bf16} : parse_formats(o.formats);
  const Workload w = long_mode ? long_prompt(o.prefill, o.sample) : read_manifest(o.prefill, o.cases);
  const Device dev = resolve_backend(o.backend);
  const bool gpu = dev.is_cuda();
  const Topology topo = Topology::minimax_m3(o.tp);
  const int repeats = o.repeats > 0 ? o.repeats : (gpu ? 10 : 2);
  const int warmup = gpu ? 3 : 1;
  StepTimer timer(dev);

  int64_t pool_pages = 1;
  for (const PrefillCase& c : w.cases) pool_pages = std::max(pool_pages, c.pages());
  progress("filling a pool of " + std::to_string(pool_pages) + " pages (the largest case's)");
  DeviceArena arena(dev);
  const PagePool pool = fill_pool(arena, pool_pages, topo.num_kv_heads, formats);
  const CaseSetup setup{topo, dev, pool, repeats, warmup, o.threads, o.seed};
  // A long prompt is one request: every chunk reads the first pages of one scattered order.
  const std::vector<int32_t> prompt_pages = long_mode ? scattered_pages(pool_pages, pool_pages, o.seed) : std::vector<int32_t>();

  std::vector<PrefillRow> rows;
  for (size_t i = 0; i < w.cases.size(); ++i) {
    const PrefillCase& c = w.cases[i];
    progress(std::to_string(i + 1) + "/" + std::to_string(w.cases.size()) + " " + c.id +
             (c.stratum.empty() ? "" : " (" + c.stratum + ")") + ": batch " + std::to_string(c.batch()) + ", " +
             std::to_string(c.total_q()) + " queries, max kv " + std::to_string(c.max_kv()));
    const std::vector<int32_t> physical =
        long_mode ? prompt_pages : scattered_pages(c.pages(), pool_pages, o.seed * 7919 + i);
    for (PrefillRow& r : bench_case(c, physical, formats, setup, timer)) {
      progress(row_line(r));
      rows.push_back(std::move(r));
    }
    if (!o.csv_path.empty()) write_file_whole(o.csv_path, csv_text(rows, long_mode));
    if (!o.json_path.empty()) write_file_whole(o.json_path, json_text(rows, w, formats, dev, topo, repeats, warmup));
  }
  print_report(rows, w, formats, dev, o, topo, repeats);
  return 0;
}

}  // namespace msa::tool
