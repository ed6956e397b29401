// The demo: select_blocks -> build_plan -> forward -> backward -> kl_backward on a packed
// batch of random bf16 inputs, on the chosen device, then a float64 oracle check.
//
// The oracle is exact but slow, so it sees two kinds of small sub-problems cut from the pack,
// each a single document whose keys are the original document's keys:
//   * sampled query rows (first/last rows of documents, block edges, random rows), each on
//     its own: selection, indexer LSE, out, LSE, dq and dindex_q depend only on the row;
//   * the tail of every document (its last rows): the keys at or after the tail's first
//     position are attended only by tail rows, so their dk, dv and dindex_k are complete.
// Attention and KL use the library's own selection so that near-tie differences in the
// indexer do not leak into the other checks (docs/semantics.md §10).
#include "demo.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <iostream>
#include <random>
#include <set>
#include <sstream>

#include "case_io.h"
#include "demo_decode.h"
#include "metrics.h"
#include "msa/msa.h"
#include "oracle/oracle.h"
#include "step_buffers.h"
#include "table.h"
#include "workload.h"

namespace msa::tool {

namespace {

[[noreturn]] void invalid(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }

void progress(const std::string& line) { std::cerr << "[msa demo] " << line << std::endl; }

// Spec §7 tolerances.
constexpr double kOutTol = 3e-2, kLseTol = 1e-3, kIndexLseTol = 2e-3, kMinCosine = 0.99, kNearTie = 5e-3;
// The relative L2 error a bf16 output may have (bf16 rounding alone gives ~2e-3-4e-3);
// guards against outputs so small that the absolute tolerance would accept anything.
constexpr double kMaxOutRelL2 = 1e-2;
// Per-row relative L2 error allowed for out and the gradients (bf16 rounding gives ~2e-3).
constexpr double kMaxRowError = 2e-2;

struct Unit {
  int doc = 0;
  int64_t first = 0, end = 0;  // query rows [first, end) of the document
  bool tail = false;           // the document's last rows: key-side gradients are complete
};

// Oracle results for a list of units solved as one problem: unit u becomes a document of
// rows [offset[u], offset[u] + n) whose keys are its original document's keys (same packed
// rows) up to its last query. Units of one call must not share keys where key-side gradients
// are read (tails of different documents do not).
struct OracleRun {
  std::vector<oracle::Doc> docs;
  std::vector<int64_t> offset;
  int64_t rows = 0;
  oracle::AttentionResult attention;  // query side by reduced row; dk, dv by packed key row
  oracle::KlResult kl;                // dindex_q by reduced row; dindex_k by packed key row
  std::vector<double> index_lse;      // [Hi, rows]
  std::vector<float> index_q;         // [rows, Hi, Di] the units' index queries
  std::vector<float> dout;            // [rows, Hq, D] the units' output gradients
  std::vector<double> p_times_k;      // [rows, Hq, D] sum_t P_t k_t (the forward with V = K)
};

// bf16 rows [row0, row0 + n) of a [rows, width] tensor as floats.
std::vector<float> gather_rows(const StTensor& t, int64_t row0, int64_t n) {
  const int64_t width = t.numel() / std::max<int64_t>(1, t.shape[0]);
  std::vector<float> out(size_t(n * width));
  const auto* src = reinterpret_cast<const uint16_t*>(t.bytes.data()) + row0 * width;
  for (int64_t i = 0; i < n * width; ++i) out[size_t(i)] = bf16_to_float(src[i]);
  return out;
}

std::vector<float> all_floats(const StTensor& t) { return gather_rows(t, 0, t.shape[0]); }

double bf16_at(const StTensor& t, int64_t i) { return bf16_to_float(reinterpret_cast<const uint16_t*>(t.bytes.data())[i]); }

std::string id_list(std::vector<int32_t> ids) {
  std::sort(ids.begin(), ids.end());
  std::string s = "{";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s + "}";
}

// Structural contract of every selection row (ops.h): valid prefix, unique ids, all visible,
// count = min(topk, nvis), the query's own block last. Returns the number of bad rows.
int64_t check_selection_structure(const Topology& topo, const PackedLayout& layout, const std::vector<int32_t>& topk,
                                  std::string& first_problem) {
  const int H = topo.num_index_heads, K = topo.topk;
  const int64_t total_q = layout.total_q();
  int64_t bad = 0;
  for (const DocumentSpan& d : layout.documents()) {
    for (int64_t i = 0; i < d.q_len; ++i) {
      const int64_t row = d.q_start + i, p = d.k_len - d.q_len + i, local = p / topo.block_size;
      const int64_t want = std::min<int64_t>(K, local + 1);
      for (int g = 0; g < H; ++g) {
        const int32_t* r = topk.data() + (int64_t(g) * total_q + row) * K;
        int64_t count = 0;
        while (count < K && r[count] >= 0) ++count;
        std::string problem;
        for (int64_t s = count; s < K && problem.empty(); ++s)
          if (r[s] != -1) problem = "slot " + std::to_string(s) + " holds " + std::to_string(r[s]) + " after the valid prefix";
        if (problem.empty() && count != want)
          problem = std::to_string(count) + " valid ids, expected min(16, visible blocks) = " + std::to_string(want);
        if (problem.empty() && r[count - 1] != local)
          problem = "last valid id is " + std::to_string(r[count - 1]) + ", expected the local block " + std::to_string(local);
        std::set<int32_t> seen;
        for (int64_t s = 0; s < count && problem.empty(); ++s)
          if (r[s] > local || !seen.insert(r[s]).second) problem = "id " + std::to_string(r[s]) + " is repeated or not visible";
        if (!problem.empty()) {
          if (bad++ == 0) first_problem = "row " + std::to_string(row) + " head " + std::to_string(g) + ": " + problem;
        }
      }
    }
  }
  return bad;
}

struct SelectionTally {
  int64_t exact = 0, near_tie = 0, wrong = 0;
  std::string first_problem;
};

// Sets equal, or equal up to near-ties: same size, every forced block present, and every
// ranked block the library chose scores within 5e-3 of the oracle's weakest ranked block.
void judge_selection(const oracle::RowSelection& ref, const int32_t* row, int K, const std::string& where,
                     SelectionTally& tally) {
  std::vector<int32_t> mine;
  for (int s = 0; s < K && row[s] >= 0; ++s) mine.push_back(row[s]);
  std::vector<int32_t> want = ref.ids();
  std::set<int32_t> a(mine.begin(), mine.end()), b(want.begin(), want.end());
  if (a == b && a.size() == mine.size()) {
    ++tally.exact;
    return;
  }
  bool ok = a.size() == mine.size() && mine.size() == want.size() && !ref.ranked.empty();
  std::set<int32_t> forced(ref.forced_init.begin(), ref.forced_init.end());
  forced.insert(ref.forced_local.begin(), ref.forced_local.end());
  for (int32_t f : forced) ok = ok && a.count(f);
  double threshold = INFINITY;
  for (int32_t r : ref.ranked) threshold = std::min(threshold, ref.block_scores[size_t(r)]);
  for (int32_t m : mine) {
    if (forced.count(m)) continue;
    ok = ok && m >= 0 && m < ref.num_visible && ref.block_scores[size_t(m)] >= threshold - kNearTie;
  }
  if (ok) {
    ++tally.near_tie;
  } else if (tally.wrong++ == 0) {
    tally.first_problem = where + ": msa selected " + id_list(mine) + ", the oracle " + id_list(want);
  }
}

// Query rows to check one by one: the first and last row of every document, rows at block
// edges, and random rows up to `wanted` in total.
std::vector<Unit> choose_units(const PackedLayout& layout, int wanted, uint64_t seed) {
  std::set<std::pair<int, int64_t>> rows;
  for (int b = 0; b < layout.num_documents(); ++b) {
    const int64_t n = layout.document(b).q_len;
    for (int64_t i : {int64_t(0), int64_t(127), int64_t(128), int64_t(2047), int64_t(2048), int64_t(2049), n - 1})
      if (i >= 0 && i < n) rows.insert({b, i});
  }
  std::mt19937_64 rng(seed ^ 0x6a09e667f3bcc908ull);
  const auto& query_doc = layout.query_document();
  for (int attempts = 0; int(rows.size()) < wanted && attempts < 100 * wanted; ++attempts) {
    const int64_t row = int64_t(rng() % uint64_t(layout.total_q()));
    const int b = query_doc[size_t(row)];
    rows.insert({b, row - layout.document(b).q_start});
  }
  std::vector<Unit> units;
  for (auto [b, i] : rows) units.push_back({b, i, i + 1, false});
  // Tails: about 16k (query, key) pairs each so that the oracle stays quick; short
  // documents are checked whole.
  for (int b = 0; b < layout.num_documents(); ++b) {
    const DocumentSpan& d = layout.document(b);
    int64_t n = d.q_len <= 160 ? d.q_len : std::clamp<int64_t>(16384 / std::min<int64_t>(d.k_len, 2048), 1, d.q_len);
    units.push_back({b, d.q_len - n, d.q_len, true});
  }
  return units;
}

struct StepReport {
  std::string name;
  double seconds = 0;
  double flops = 0;
  double bytes = 0;  // memory-bound steps (decode) report GB/s instead of FLOP/s
  std::string check;
  bool ok = true;
};

}  // namespace

int run_demo(const DemoOptions& o) {
  if (o.tp != 1 && o.tp != 2 && o.tp != 4) invalid("--tp must be 1, 2 or 4, got " + std::to_string(o.tp));
  if (o.samples < 1) invalid("--samples must be >= 1, got " + std::to_string(o.samples));
  const Device dev = resolve_backend(o.backend);
  const Topology topo = Topology::minimax_m3(o.tp);
  const std::vector<int64_t> lengths =
      o.docs.empty() ? demo_document_lengths(o.tokens > 0 ? o.tokens : default_demo_tokens(dev))
                     : parse_size_list(o.docs, "--docs");
  const PackedLayout layout = layout_of_documents(lengths);
  const int64_t T = layout.total_q();
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, Hi = topo.num_index_heads, D = topo.head_dim,
            Di = topo.index_head_dim, K = topo.topk;

  std::ostringstream docs_text;
  for (size_t i = 0; i < lengths.size(); ++i) docs_text << (i ? " + " : "") << lengths[i];
  std::cout << "msa " << kVersion << " demo on " << to_string(dev) << (dev.is_cuda() ? "" : " (exact CPU backend)")
            << "\n  documents: " << docs_text.str() << " = " << T << " tokens"
            << "\n  heads: " << Hq << " query / " << Hkv << " kv / " << Hi << " index, head dim " << D
            << ", blocks of " << topo.block_size << ", top-" << K << "\n  inputs: random bf16, normal x 0.2, seed " << o.seed
            << "\n\n";

  // ---- inputs (host, then device) ----
  progress("generating random inputs (" + std::to_string(T) + " tokens)");
  StTensor q = make_tensor("q", DType::bf16, {T, Hq, D}), k = make_tensor("k", DType::bf16, {T, Hkv, D}),
           v = make_tensor("v", DType::bf16, {T, Hkv, D}), qi = make_tensor("index_q", DType::bf16, {T, Hi, Di}),
           ki = make_tensor("index_k", DType::bf16, {T, 1, Di}), dout = make_tensor("grad_out", DType::bf16, {T, Hq, D});
  uint64_t stream = 0;
  for (StTensor* t : {&q, &k, &v, &qi, &ki, &dout})
    fill_normal_bf16(reinterpret_cast<uint16_t*>(t->bytes.data()), t->numel(), 0.2f, o.seed, ++stream);

  DeviceArena arena(dev);
  StepBuffers buf;
  buf.q = arena.upload(q.view());
  buf.k = arena.upload(k.view());
  buf.v = arena.upload(v.view());
  buf.index_q = arena.upload(qi.view());
  buf.index_k = arena.upload(ki.view());
  buf.dout = arena.upload(dout.view());
  buf.allocate_outputs(arena, topo, T, T);
  RunOptions run;
  run.num_threads = o.threads;

  // ---- the five steps ----
  std::vector<StepReport> steps(5);
  steps[0].name = "select_blocks";
  steps[1].name = "build_plan";
  steps[2].name = "forward";
  steps[3].name = "backward";
  steps[4].name = "kl_backward";

  progress("1/6 select_blocks: indexer + top-" + std::to_string(K) + " over " + std::to_string(T) + " tokens x " +
           std::to_string(Hi) + " index heads");
  steps[0].seconds = time_once(dev, [&] { select_blocks(topo, layout, buf.select_blocks_params(), run); });

  SparsePlan plan;
  progress("2/6 build_plan: k2q CSR and schedule");
  steps[1].seconds = time_once(dev, [&] { plan = build_plan(topo, layout, buf.topk.view(), PlanOptions{}, run); });
  for (const Buffer* b : {&plan.rows, &plan.row_ptr, &plan.q_indices, &plan.split_slot, &plan.split_counts, &plan.schedule})
    arena.count_external(b->bytes());

  progress("3/6 forward: sparse attention, " + std::to_string(Hq) + " heads");
  steps[2].seconds = time_once(dev, [&] { sparse_attention_forward(topo, layout, plan, buf.forward_params(), run); });

  progress("4/6 backward: dq, dk, dv");
  steps[3].seconds = time_once(dev, [&] { sparse_attention_backward(topo, layout, plan, buf.backward_params(), run); });

  progress("5/6 kl_backward: indexer gradients");
  steps[4].seconds = time_once(dev, [&] { kl_backward(topo, layout, plan, buf.kl_params(), run); });

  // ---- results back on the host ----
  const std::vector<int32_t> topk = to_host_ints(buf.topk.view());
  const std::vector<float> index_lse = to_host_floats(buf.index_lse.view());
  const std::vector<float> lse = to_host_floats(buf.lse.view());
  const StTensor out = arena.download("out", buf.out.view()), dq = arena.download("dq", buf.dq.view());
  const std::vector<float> dk = to_host_floats(buf.dk.view()), dv = to_host_floats(buf.dv.view());
  const std::vector<float> dqi = to_host_floats(buf.dindex_q.view()), dki = to_host_floats(buf.dindex_k.view());

  steps[0].flops = indexer_flops(topo, layout);
  steps[2].flops = forward_flops(topo, layout, topk.data());
  steps[3].flops = 2.5 * steps[2].flops;

  // ---- checks against the float64 oracle ----
  const std::vector<Unit> units = choose_units(layout, o.samples, o.seed);
  int64_t sampled_rows = 0, tail_rows = 0;
  for (const Unit& u : units) (u.tail ? tail_rows : sampled_rows) += u.end - u.first;
  progress("checking " + std::to_string(sampled_rows) + " sampled rows and " + std::to_string(tail_rows) +
           " document-tail rows against the float64 oracle");

  const std::vector<float> k_f = all_floats(k), v_f = all_floats(v), ki_f = all_floats(ki);
  const double kl_scale = 1.0 / (double(Hi) * double(T));
  // The oracle parallelises inside each call.
  auto solve = [&](bool tails) {
    OracleRun run;
    for (const Unit& unit : units) {
      if (unit.tail != tails) continue;
      const DocumentSpan& d = layout.document(unit.doc);
      run.offset.push_back(run.rows);
      run.docs.push_back({run.rows, unit.end - unit.first, d.k_start, d.k_len - d.q_len + unit.end});
      run.rows += unit.end - unit.first;
    }
    const int64_t n = run.rows;
    std::vector<float> q_u;
    std::vector<float>& dout_u = run.dout;
    std::vector<int32_t> topk_u(size_t(Hi * n * K));
    size_t u = 0;
    for (const Unit& unit : units) {
      if (unit.tail != tails) continue;
      const int64_t row0 = layout.document(unit.doc).q_start + unit.first, len = unit.end - unit.first;
      for (auto [dst, src] : {std::pair{&q_u, &q}, std::pair{&dout_u, &dout}, std::pair{&run.index_q, &qi}}) {
        const std::vector<float> rows = gather_rows(*src, row0, len);
        dst->insert(dst->end(), rows.begin(), rows.end());
      }
      for (int g = 0; g < Hi; ++g)
        std::copy_n(topk.begin() + (int64_t(g) * T + row0) * K, len * K, topk_u.begin() + (int64_t(g) * n + run.offset[u]) * K);
      ++u;
    }
    run.attention = oracle::attention_backward(topo, run.docs, q_u.data(), k_f.data(), v_f.data(), topk_u.data(),
                                               dout_u.data(), layout.total_k());
    run.p_times_k = oracle::attention_forward(topo, run.docs, q_u.data(), k_f.data(), k_f.data(), topk_u.data(),
                                              layout.total_k())
                        .out;
    run.index_lse = oracle::selected_lse(topo, run.docs, run.index_q.data(), ki_f.data(), topk_u.data(), 1.0);
    const std::vector<float> lse_u(run.attention.lse.begin(), run.attention.lse.end());
    const std::vector<float> index_lse_u(run.index_lse.begin(), run.index_lse.end());
    run.kl = oracle::kl_backward(topo, run.docs, q_u.data(), k_f.data(), lse_u.data(), run.index_q.data(), ki_f.data(),
                                 index_lse_u.data(), topk_u.data(), layout.total_k(), kl_scale);
    return run;
  };
  const OracleRun sampled = solve(false), tails = solve(true);

  // Selection: structure of every row, oracle sets on the sampled rows; indexer LSE.
  std::string structure_problem;
  const int64_t bad_structure = check_selection_structure(topo, layout, topk, structure_problem);
  SelectionTally tally;
  ErrorStats index_lse_err(kIndexLseTol, kIndexLseTol), out_err(kOutTol, kOutTol), lse_err(kLseTol, kLseTol);
  ErrorStats dq_err, dk_err, dv_err, dqi_err, dki_err;
  // Natural sizes: inputs are normal x 0.2, so a row of 128 has norm r = 0.2 sqrt(128); dq and
  // dk rows scale like scale r^3, out and dv rows like r, the KL gradients like
  // grad_scale * index_scale * r. Differences below 1e-5 of these are rounding noise.
  const double scale = topo.attention_scale(), r = 0.2 * std::sqrt(double(D)), noise = 1e-5;
  RowErrors out_rows(noise * r), dq_rows(noise * scale * r * r * r), dk_rows(noise * scale * r * r * r),
      dv_rows(noise * r), dqi_rows(noise * kl_scale * topo.indexer_scale() * r),
      dki_rows(noise * kl_scale * topo.indexer_scale() * r);
  for (const OracleRun* run : {&sampled, &tails}) {
    size_t u = 0;
    for (const Unit& unit : units) {
      if (unit.tail != (run == &tails)) continue;
      const DocumentSpan& d = layout.document(unit.doc);
      const oracle::Doc& doc = run->docs[u];
      const int64_t n = unit.end - unit.first, row0 = d.q_start + unit.first, base = run->offset[u++];
      if (!unit.tail)
        for (int g = 0; g < Hi; ++g)
          judge_selection(oracle::select_row(topo, doc, 0, g, run->index_q.data(), ki_f.data()),
                          topk.data() + (int64_t(g) * T + row0) * K, K,
                          "row " + std::to_string(row0) + " head " + std::to_string(g), tally);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t row = row0 + j, ref_row = base + j;
        for (int g = 0; g < Hi; ++g)
          index_lse_err.add(index_lse[size_t(g * T + row)], run->index_lse[size_t(g * run->rows + ref_row)]);
        for (int h = 0; h < Hq; ++h) {
          lse_err.add(lse[size_t(row * Hq + h)], run->attention.lse[size_t(ref_row * Hq + h)]);
          // The backward receives the forward's bf16 out; its rowsum(dO o out) enters dq as
          // -scale * delta * sum_t P_t k_t. Move the oracle's dq (exact out) to the given out so
          // rows with few keys (dq = 0 for one key) are compared like for like.
          const int64_t mine0 = (row * Hq + h) * D, ref0 = (ref_row * Hq + h) * D;
          double delta_exact = 0, delta_given = 0;
          for (int c = 0; c < D; ++c) {
            const double g = run->dout[size_t(ref0 + c)];
            delta_exact += g * run->attention.out[size_t(ref0 + c)];
            delta_given += g * bf16_at(out, mine0 + c);
          }
          for (int c = 0; c < D; ++c) {
            const double ref_dq = run->attention.dq[size_t(ref0 + c)] -
                                  scale * (delta_given - delta_exact) * run->p_times_k[size_t(ref0 + c)];
            out_err.add(bf16_at(out, mine0 + c), run->attention.out[size_t(ref0 + c)]);
            out_rows.add(bf16_at(out, mine0 + c), run->attention.out[size_t(ref0 + c)]);
            dq_err.add(bf16_at(dq, mine0 + c), ref_dq);
            dq_rows.add(bf16_at(dq, mine0 + c), ref_dq);
          }
          out_rows.end_row();
          dq_rows.end_row();
        }
        for (int g = 0; g < Hi; ++g) {
          for (int c = 0; c < Di; ++c) {
            const size_t mine = size_t((row * Hi + g) * Di + c), ref = size_t((ref_row * Hi + g) * Di + c);
            dqi_err.add(dqi[mine], run->kl.dindex_q[ref]);
            dqi_rows.add(dqi[mine], run->kl.dindex_q[ref]);
          }
          dqi_rows.end_row();
        }
      }
      if (unit.tail) {
        // Keys at or after the tail's first position are attended only by tail queries.
        for (int64_t t = d.k_len - d.q_len + unit.first; t < d.k_len - d.q_len + unit.end; ++t) {
          const int64_t key = d.k_start + t;
          for (int g = 0; g < Hkv; ++g) {
            for (int c = 0; c < D; ++c) {
              const size_t at = size_t((key * Hkv + g) * D + c);
              dk_err.add(dk[at], run->attention.dk[at]);
              dk_rows.add(dk[at], run->attention.dk[at]);
              dv_err.add(dv[at], run->attention.dv[at]);
              dv_rows.add(dv[at], run->attention.dv[at]);
            }
            dk_rows.end_row();
            dv_rows.end_row();
          }
          for (int c = 0; c < Di; ++c) {
            dki_err.add(dki[size_t(key * Di + c)], run->kl.dindex_k[size_t(key * Di + c)]);
            dki_rows.add(dki[size_t(key * Di + c)], run->kl.dindex_k[size_t(key * Di + c)]);
          }
          dki_rows.end_row();
        }
      }
    }
  }

  {
    StepReport& s = steps[0];
    std::ostringstream c;
    c << "sets " << tally.exact + tally.near_tie << "/" << tally.exact + tally.near_tie + tally.wrong << " ("
      << tally.near_tie << " near-ties), contract " << (bad_structure ? std::to_string(bad_structure) + " bad rows" : "ok")
      << ", LSE err " << sci(index_lse_err.max_abs_error());
    s.ok = bad_structure == 0 && tally.wrong == 0 && index_lse_err.mismatches() == 0;
    if (!structure_problem.empty()) c << " [" << structure_problem << "]";
    if (!tally.first_problem.empty()) c << " [" << tally.first_problem << "]";
    s.check = c.str();
  }
  {
    // The plan against the oracle's CSR; the schedule must tile every row in order.
    const oracle::Plan ref = oracle::build_plan(topo, oracle::documents(layout.cu_seqlens_q(), layout.cu_seqlens_k()),
                                                topk.data(), plan.q_per_cta);
    const std::vector<int32_t> rows = to_host_ints(plan.rows.view()), row_ptr = to_host_ints(plan.row_ptr.view()),
                               q_indices = to_host_ints(plan.q_indices.view()),
                               split_slot = to_host_ints(plan.split_slot.view()),
                               split_counts = to_host_ints(plan.split_counts.view()),
                               schedule = to_host_ints(plan.schedule.view());
    std::string problem;
    if (rows != ref.rows) problem = "rows differ";
    else if (row_ptr != ref.row_ptr) problem = "row_ptr differs";
    else if (q_indices != ref.q_indices) problem = "q_indices differ";
    else if (split_slot != ref.split_slot) problem = "split_slot differs";
    else if (split_counts != ref.split_counts) problem = "split_counts differ";
    // The device copy of the work count: a CUDA plan's host copy may be unknown (-1).
    const int64_t work_count = to_host_ints(plan.work_count_dev.view())[0];
    if (problem.empty() && !plan.status.empty()) {
      const std::vector<int32_t> status = to_host_ints(plan.status.view());
      if (status[0] != 0) problem = "the plan builder flagged topk[" + std::to_string(status[1]) + ", " +
                                    std::to_string(status[2]) + ", " + std::to_string(status[3]) + "] as invalid";
    }
    std::vector<std::array<int32_t, 6>> work;
    for (int64_t w = 0; w < work_count && w < int64_t(schedule.size() / 6); ++w)
      work.push_back({schedule[size_t(6 * w)], schedule[size_t(6 * w + 1)], schedule[size_t(6 * w + 2)],
                      schedule[size_t(6 * w + 3)], schedule[size_t(6 * w + 4)], schedule[size_t(6 * w + 5)]});
    std::sort(work.begin(), work.end());
    // Walk the (head, row) pairs in order: work items must cover [row_ptr[r], row_ptr[r+1]).
    const int64_t R = plan.total_rows;
    size_t next = 0;
    for (int h = 0; h < Hkv && problem.empty(); ++h) {
      for (int64_t r = 0; r < R && problem.empty(); ++r) {
        int64_t at = ref.row_ptr[size_t(h * (R + 1) + r)];
        const int64_t stop = ref.row_ptr[size_t(h * (R + 1) + r + 1)];
        while (problem.empty() && next < work.size() && work[next][0] == h && work[next][1] == r) {
          const auto& w = work[next++];
          if (w[2] != at || w[3] < 1 || w[3] > plan.q_per_cta || w[4] != ref.rows[size_t(2 * r)] ||
              w[5] != ref.rows[size_t(2 * r + 1)])
            problem = "schedule entry (head " + std::to_string(h) + ", row " + std::to_string(r) + ") is malformed";
          at += w[3];
        }
        if (problem.empty() && at != stop)
          problem = "schedule does not cover row " + std::to_string(r) + " of head " + std::to_string(h);
      }
    }
    if (problem.empty() && next != work.size()) problem = "schedule holds entries for no row";
    steps[1].ok = problem.empty();
    steps[1].check = problem.empty() ? "CSR = oracle's, " + std::to_string(work.size()) + " work items tile it" : problem;
  }
  {
    std::ostringstream c;
    c << "out rel L2 " << sci(out_err.relative_l2()) << " (worst row " << sci(out_rows.worst()) << "), LSE err "
      << sci(lse_err.max_abs_error());
    if (out_err.mismatches() || lse_err.mismatches())
      c << " (" << out_err.mismatches() << " out, " << lse_err.mismatches() << " LSE values outside tolerance)";
    steps[2].ok = out_err.mismatches() == 0 && lse_err.mismatches() == 0 && out_err.relative_l2() <= kMaxOutRelL2 &&
                  out_rows.worst() <= kMaxRowError;
    steps[2].check = c.str();
  }
  // "dq 1.8e-03, dk 1.8e-03 (rel L2; cos >= 0.999998, worst row 2.3e-03)"
  struct Grad {
    const char* name;
    const ErrorStats* stats;
    const RowErrors* rows;
  };
  auto grads_ok = [](std::vector<Grad> grads) {
    bool ok = true;
    for (const Grad& g : grads)
      ok = ok && (g.rows->negligible() || g.stats->cosine() > kMinCosine) && g.rows->worst() <= kMaxRowError;
    return ok;
  };
  auto grad_text = [](std::vector<Grad> grads) {
    std::ostringstream c;
    double cos_min = 1, row_max = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      c << (i ? ", " : "") << grads[i].name << " ";
      if (grads[i].rows->negligible()) {
        c << "~0";  // the reference is zero up to rounding: only the row check applies
        continue;
      }
      c << sci(grads[i].stats->relative_l2());
      const double cos = grads[i].stats->cosine();
      cos_min = std::isnan(cos) ? cos : std::min(cos_min, cos);
      row_max = std::max(row_max, grads[i].rows->worst());
    }
    char tail[96];
    std::snprintf(tail, sizeof tail, " (rel L2; cos >= %.6f, worst row %.1e)", cos_min, row_max);
    c << tail;
    return c.str();
  };
  const std::vector<Grad> backward_grads = {{"dq", &dq_err, &dq_rows}, {"dk", &dk_err, &dk_rows}, {"dv", &dv_err, &dv_rows}};
  const std::vector<Grad> kl_grads = {{"dindex_q", &dqi_err, &dqi_rows}, {"dindex_k", &dki_err, &dki_rows}};
  steps[3].ok = grads_ok(backward_grads);
  steps[3].check = grad_text(backward_grads);
  steps[4].ok = grads_ok(kl_grads);
  steps[4].check = grad_text(kl_grads);

  // ---- decode: paged caches, 8 queries per request ----
  progress("6/6 decode: paged indexer + split-K attention, 8 queries per request");
  const DecodeStepResult decode = run_decode_step(topo, dev, o.seed, o.threads);
  StepReport decode_step;
  decode_step.name = "decode";
  decode_step.seconds = decode.seconds;
  decode_step.bytes = decode.bytes;
  decode_step.check = decode.check;
  decode_step.ok = decode.ok;
  steps.push_back(decode_step);

  // ---- report ----
  Table table({"step", "time", "useful FLOPs", "rate", "vs float64 oracle", "result"});
  bool pass = true;
  for (const StepReport& s : steps) {
    pass = pass && s.ok;
    char flops[32] = "-", rate[32] = "-";
    if (s.flops > 0) std::snprintf(flops, sizeof flops, "%.1f GFLOP", s.flops / 1e9);
    if (s.bytes > 0 && s.seconds > 0) std::snprintf(rate, sizeof rate, "%.1f GB/s", s.bytes / s.seconds / 1e9);
    table.add_row({s.name, format_time(s.seconds), flops, s.bytes > 0 ? rate : format_rate(s.flops, s.seconds), s.check,
                   s.ok ? "ok" : "FAIL"});
  }
  table.print(std::cout);
  std::cout << "\nFLOPs: forward = 4 * Hq * 128 * attended (query, key) pairs, backward = 2.5 x forward, indexer = 2 * 128 * Hi"
               " * causal pairs. Tolerances (spec 7): out 3e-2, LSE 1e-3, indexer LSE 2e-3, gradients cosine > 0.99,"
               " selection as sets with near-ties within 5e-3; every row of out and of the gradients within 2e-2"
               " relative L2.\n"
            << "Decode: " << decode.workload << "; rate = K/V pages read per query plus each request's index keys"
            << ".\n"
            << "Checked " << sampled_rows << " sampled query rows and the last " << tail_rows
            << " rows of the documents (with their keys' dk, dv, dindex_k); buffers: " << format_bytes(double(arena.bytes_allocated()))
            << ".\n\n";
  std::cout << (pass ? "PASS" : "FAIL") << ": " << (pass ? "every step matches" : "some steps do not match")
            << " the float64 oracle (" << T << " tokens in " << lengths.size() << " documents on " << to_string(dev) << ")\n";
  return pass ? 0 : 1;
}

}  // namespace msa::tool
