// select_blocks against the float64 oracle (docs/semantics.md §3, §10): selection compared as sets with
// the near-tie rule, the valid-prefix / uniqueness / local-last contract, output order, and
// the selected LSE.
#include <algorithm>
#include <set>

#include "test_support.h"

namespace msa::test {
namespace {

constexpr double kNearTie = 5e-3;  // docs/semantics.md §10: selected history score >= threshold - 5e-3

struct IndexerOutputs {
  HostTensor topk;  // [Hi, total_q, 16] int32
  HostTensor lse;   // [Hi, total_q] f32
};

IndexerOutputs run_indexer(const Topology& topo, const PackedLayout& L, const HostTensor& index_q,
                           const HostTensor& index_k, float temperature = 1.0f) {
  IndexerOutputs o{HostTensor(DType::i32, {topo.num_index_heads, L.total_q(), topo.topk}),
                   HostTensor(DType::f32, {topo.num_index_heads, L.total_q()})};
  poison(o.topk);
  poison(o.lse);
  SelectBlocksParams p;
  p.index_q = index_q.view();
  p.index_k = index_k.view();
  p.topk = o.topk.view();
  p.selected_lse = o.lse.view();
  p.lse_temperature = temperature;
  select_blocks(topo, L, p);
  return o;
}

struct Inputs {
  HostTensor index_q, index_k;
};

Inputs random_inputs(std::mt19937_64& rng, const Topology& topo, const PackedLayout& L, float scale = 0.2f) {
  return {random_tensor(rng, {L.total_q(), topo.num_index_heads, topo.index_head_dim}, scale),
          random_tensor(rng, {L.total_k(), 1, topo.index_head_dim}, scale)};
}

// Checks one library selection against the oracle, row by row. `check_rank_order` also
// requires the ranked history to come in non-increasing score order (up to near-ties).
void check_selection(const Topology& topo, const PackedLayout& L, const Inputs& in, const HostTensor& topk,
                     bool check_rank_order = true) {
  const auto docs = oracle_docs(L);
  const auto iq = in.index_q.floats(), ik = in.index_k.floats();
  const auto ids = topk.ints();
  const int Hi = topo.num_index_heads, K = topo.topk;
  const int64_t total_q = L.total_q();

  std::vector<std::pair<int, int64_t>> rows;  // (doc, query in doc)
  for (int b = 0; b < int(docs.size()); ++b)
    for (int64_t i = 0; i < docs[size_t(b)].q_len; ++i) rows.push_back({b, i});
  std::vector<std::string> problems(rows.size() * size_t(Hi));

#pragma omp parallel for schedule(dynamic, 8)
  for (int64_t n = 0; n < int64_t(rows.size()); ++n) {
    const oracle::Doc& d = docs[size_t(rows[size_t(n)].first)];
    const int64_t i = rows[size_t(n)].second, row = d.q_start + i;
    for (int g = 0; g < Hi; ++g) {
      std::ostringstream err;
      const oracle::RowSelection want = oracle::select_row(topo, d, i, g, iq.data(), ik.data());
      const int32_t* got = ids.data() + (g * total_q + row) * K;
      const std::vector<int32_t> got_row(got, got + K);
      const auto want_ids = want.ids();
      // Contract: valid prefix, -1 padding, ids visible, unique, own block last.
      int count = 0;
      while (count < K && got[count] >= 0) ++count;
      bool shape_ok = true;
      for (int s = count; s < K; ++s) shape_ok &= got[s] == -1;
      for (int s = 0; s < count; ++s) shape_ok &= got[s] < want.num_visible;
      std::set<int32_t> got_set(got, got + count);
      shape_ok &= int(got_set.size()) == count;
      if (!shape_ok) err << "not a valid prefix of unique visible ids followed by -1; ";
      if (count != int(want_ids.size())) err << "holds " << count << " ids, expected " << want_ids.size() << "; ";
      if (count > 0 && got[count - 1] != want.num_visible - 1) err << "own block " << want.num_visible - 1 << " is not last; ";

      // Forced blocks: init ascending first, local ascending last.
      const size_t ni = want.forced_init.size(), nl = want.forced_local.size();
      if (size_t(count) >= ni + nl) {
        for (size_t s = 0; s < ni; ++s)
          if (got[s] != want.forced_init[s]) err << "slot " << s << " should hold init block " << want.forced_init[s] << "; ";
        for (size_t s = 0; s < nl; ++s)
          if (got[size_t(count) - nl + s] != want.forced_local[s])
            err << "slot " << size_t(count) - nl + s << " should hold local block " << want.forced_local[s] << "; ";
      }

      // Ranked history: equal sets, or only near-ties (docs/semantics.md §10).
      std::set<int32_t> want_set(want_ids.begin(), want_ids.end());
      if (got_set != want_set && !want.ranked.empty()) {
        const double threshold = want.block_scores[size_t(want.ranked.back())];
        for (int32_t b : got_set) {
          if (want_set.count(b)) continue;
          const bool forced = std::count(want.forced_init.begin(), want.forced_init.end(), b) ||
                              std::count(want.forced_local.begin(), want.forced_local.end(), b);
          const double s = b < want.num_visible ? want.block_scores[size_t(b)] : NAN;
          if (forced || std::isnan(s) || !(s >= threshold - kNearTie))
            err << "selects block " << b << " (score " << s << ") instead of a block scoring >= " << threshold << "; ";
        }
      } else if (got_set != want_set) {
        err << "set differs from the oracle; ";
      }
      if (check_rank_order && want.num_visible > K && size_t(count) >= ni + nl) {
        for (size_t s = ni + 1; s + nl < size_t(count); ++s) {
          const double prev = want.block_scores[size_t(got[s - 1])], cur = want.block_scores[size_t(got[s])];
          if (cur > prev + kNearTie) err << "history not in score order at slot " << s << "; ";
        }
      }
      if (!err.str().empty()) {
        std::ostringstream full;
        full << "head " << g << " row " << row << " (doc " << rows[size_t(n)].first << ", position " << want.position
             << "): got " << describe(got_row) << " want " << describe(want_ids) << ": " << err.str();
        problems[size_t(n) * size_t(Hi) + size_t(g)] = full.str();
      }
    }
  }
  int bad = 0;
  std::string first;
  for (const auto& p : problems)
    if (!p.empty() && bad++ < 5) first += "\n  " + p;
  EXPECT_EQ(bad, 0) << bad << " (row, head) selections disagree with the oracle:" << first;
}

// Selected LSE against the oracle on the library's own selection (atol = rtol = 2e-3).
void check_lse(const Topology& topo, const PackedLayout& L, const Inputs& in, const IndexerOutputs& out,
               double temperature = 1.0) {
  const auto docs = oracle_docs(L);
  const auto iq = in.index_q.floats(), ik = in.index_k.floats();
  const auto ids = out.topk.ints();
  const auto want = oracle::selected_lse(topo, docs, iq.data(), ik.data(), ids.data(), temperature);
  auto got = out.lse.floats();
  // Rows whose selection reaches a NaN index key have no defined LSE: compare the others.
  std::vector<double> want_defined;
  std::vector<float> got_defined;
  for (size_t e = 0; e < want.size(); ++e)
    if (!std::isnan(want[e])) {
      want_defined.push_back(want[e]);
      got_defined.push_back(got[e]);
    }
  expect_close("selected_lse", got_defined, want_defined, 2e-3, 2e-3, 1);
}

void run_and_check(const Topology& topo, const PackedLayout& L, std::mt19937_64& rng) {
  const Inputs in = random_inputs(rng, topo, L);
  const IndexerOutputs out = run_indexer(topo, L, in.index_q, in.index_k);
  check_selection(topo, L, in, out.topk);
  check_lse(topo, L, in, out);
}

TEST(Indexer, DocumentsOfAtMostSixteenBlocksSelectEverything) {
  MSA_SEEDED_RNG(rng);
  run_and_check(Topology{}, layout_of({1, 2, 127, 128, 129, 700, 2047, 2048}), rng);
}

TEST(Indexer, WellSeparatedScoresLeaveNoRoomForNearTies) {
  MSA_SEEDED_RNG(rng);
  // Index vectors of scale 2 spread block scores ~100x wider than at 0.2, so the 5e-3 near-tie
  // allowance practically never applies and the selection must match the oracle's exactly.
  const Topology topo;
  const PackedLayout L = layout_of({2700, 300});
  const Inputs in = random_inputs(rng, topo, L, 2.0f);
  const IndexerOutputs out = run_indexer(topo, L, in.index_q, in.index_k);
  check_selection(topo, L, in, out.topk);
  check_lse(topo, L, in, out);
}

TEST(Indexer, SixteenAndSeventeenBlocks) {
  MSA_SEEDED_RNG(rng);
  run_and_check(Topology{}, layout_of({2048, 2049, 2200}), rng);
}

TEST(Indexer, LongDocumentRanksHistory) {
  MSA_SEEDED_RNG(rng);
  run_and_check(Topology{}, layout_of({3300, 5}), rng);
}

TEST(Indexer, QueryAtPositionZeroAndSingleTokenDocuments) {
  MSA_SEEDED_RNG(rng);
  std::vector<int64_t> lens(40, 1);
  lens.push_back(300);
  lens.push_back(1);
  const PackedLayout L = layout_of(lens);
  const Topology topo;
  const Inputs in = random_inputs(rng, topo, L);
  const IndexerOutputs out = run_indexer(topo, L, in.index_q, in.index_k);
  check_selection(topo, L, in, out.topk);
  check_lse(topo, L, in, out);
  // Every document's first query sees one key: [0, -1 x 15], and its LSE is that key's score.
  const auto ids = out.topk.ints();
  for (int b = 0; b < L.num_documents(); ++b) {
    const int64_t row = L.document(b).q_start;
    for (int g = 0; g < topo.num_index_heads; ++g) {
      const int32_t* r = ids.data() + (g * L.total_q() + row) * topo.topk;
      EXPECT_EQ(r[0], 0) << "doc " << b << " head " << g;
      for (int s = 1; s < topo.topk; ++s) EXPECT_EQ(r[s], -1) << "doc " << b << " head " << g << " slot " << s;
    }
  }
}

TEST(Indexer, DocumentsWithoutQueries) {
  MSA_SEEDED_RNG(rng);
  // Documents 1 and 3 contribute keys but no queries; document 4 is empty altogether.
  const PackedLayout L = layout_of({5, 0, 200, 0, 0, 40}, {5, 300, 2300, 7, 0, 40});
  run_and_check(Topology{}, L, rng);
}

TEST(Indexer, Fp8InputsSelectAsTheirBf16Values) {
  MSA_SEEDED_RNG(rng);
  // FP8 E4M3 index inputs (scale 1) against the oracle, and against bf16 inputs holding the
  // same values: every E4M3 value is exact in bf16, so selection and LSE are bitwise those of
  // the bf16 run, also with only one of the two inputs in FP8.
  const Topology topo;
  const PackedLayout L = layout_of({2700, 300, 1, 129}, {2700, 300, 1, 2500});
  const Inputs fp8{random_tensor(rng, {L.total_q(), topo.num_index_heads, topo.index_head_dim}, 1.0f, DType::f8e4m3),
                   random_tensor(rng, {L.total_k(), 1, topo.index_head_dim}, 1.0f, DType::f8e4m3)};
  const IndexerOutputs out = run_indexer(topo, L, fp8.index_q, fp8.index_k);
  check_selection(topo, L, fp8, out.topk);
  check_lse(topo, L, fp8, out);
  const HostTensor q16 = converted(fp8.index_q, DType::bf16), k16 = converted(fp8.index_k, DType::bf16);
  const IndexerOutputs runs[] = {run_indexer(topo, L, q16, k16), run_indexer(topo, L, fp8.index_q, k16),
                                 run_indexer(topo, L, q16, fp8.index_k)};
  for (const IndexerOutputs& r : runs) {
    EXPECT_EQ(r.topk.ints(), out.topk.ints());
    EXPECT_EQ(r.lse.raw(), out.lse.raw());
  }
}

TEST(Indexer, ChunkedPrefillUsesBottomRightAlignment) {
  MSA_SEEDED_RNG(rng);
  // Queries are the last q_len of k_len tokens: positions k_len - q_len + i.
  const PackedLayout L = layout_of({100, 300, 1, 129}, {2500, 500, 3000, 129});
  run_and_check(Topology{}, L, rng);
}

TEST(Indexer, TiesPreferLowerBlockIds) {
  // Spec §3.3 / §8.8: all-zero index vectors on a 2304-token document; the query at 2303
  // selects exactly [0, 1, ..., 14, 17].
  const Topology topo;
  const PackedLayout L = layout_of({2304});
  const Inputs in{HostTensor(DType::bf16, {2304, 4, 128}), HostTensor(DType::bf16, {2304, 1, 128})};
  const IndexerOutputs out = run_indexer(topo, L, in.index_q, in.index_k);
  const auto ids = out.topk.ints();
  const auto lse = out.lse.floats();
  std::vector<int32_t> expected;
  for (int b = 0; b < 15; ++b) expected.push_back(b);
  expected.push_back(17);
  for (int g = 0; g < 4; ++g) {
    const int32_t* r = ids.data() + (g * 2304 + 2303) * 16;
    EXPECT_EQ(std::vector<int32_t>(r, r + 16), expected) << "head " << g;
    // All scores are 0: the LSE is ln(number of selected keys) = ln(15 * 128 + 128).
    EXPECT_NEAR(lse[size_t(g * 2304 + 2303)], std::log(2048.0), 2e-3 * (1 + std::log(2048.0)));
  }
  // Every query with more than 16 visible blocks: [0..14, own block].
  for (int64_t p = 2048; p < 2304; ++p)
    for (int g = 0; g < 4; ++g) {
      const int32_t* r = ids.data() + (g * 2304 + p) * 16;
      for (int s = 0; s < 15; ++s) ASSERT_EQ(r[s], s) << "position " << p << " head " << g;
      ASSERT_EQ(r[15], p / 128) << "position " << p << " head " << g;
    }
  check_selection(topo, L, in, out.topk);
  check_lse(topo, L, in, out);
}

TEST(Indexer, NanScoresAreNeverSelected) {
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({3072, 300});
  Inputs in = random_inputs(rng, topo, L);
  // Blocks 16 and 18 of the first document have NaN index keys; block 20 has three NaN keys,
  // which makes its block maximum NaN as well (the max propagates NaN, as torch.amax does in the
  // reference). Such blocks can only appear as a query's own (forced) block.
  for (int block : {16, 18})
    for (int64_t t = block * 128; t < (block + 1) * 128; ++t)
      for (int e = 0; e < 128; ++e) in.index_k.set(t * 128 + e, NAN);
  for (int64_t t : {20 * 128 + 5, 20 * 128 + 6, 20 * 128 + 77}) in.index_k.set(t * 128 + 9, NAN);
  const IndexerOutputs out = run_indexer(topo, L, in.index_q, in.index_k);
  const auto ids = out.topk.ints();
  for (int64_t p = 0; p < 3072; ++p)
    for (int g = 0; g < 4; ++g)
      for (int s = 0; s < 16; ++s) {
        const int32_t b = ids[size_t((g * L.total_q() + p) * 16 + s)];
        if ((b == 16 || b == 18 || (b == 20 && p >= 20 * 128 + 77)) && b != p / 128)
          ADD_FAILURE() << "position " << p << " head " << g << " selects NaN block " << b;
      }
  check_selection(topo, L, in, out.topk);
  check_lse(topo, L, in, out);
}

TEST(Indexer, FragmentsShareOneKvRange) {
  MSA_SEEDED_RNG(rng);
  // Context parallelism (docs/semantics.md §2.3): document A (2600 tokens) stored once as keys
  // [0, 2600); this rank holds its queries [0, 300) and [2000, 2600) as two fragments that both
  // start at fragment 0's keys. Document B (400 tokens) is a plain document.
  const PackedLayout L = PackedLayout::from_cu_seqlens({0, 300, 900, 1300}, {0, 300, 2600, 3000}, {0, 0, 2});
  ASSERT_EQ(L.document(1).k_start, 0);
  ASSERT_EQ(L.document(1).k_len, 2600);
  run_and_check(Topology{}, L, rng);
}

TEST(Indexer, InitAndLocalBlockForcing) {
  MSA_SEEDED_RNG(rng);
  const PackedLayout L = layout_of({2600, 1, 130, 300, 1500});
  for (auto [init, local] : {std::pair{1, 2}, std::pair{2, 3}, std::pair{0, 3}, std::pair{2, 1}}) {
    SCOPED_TRACE("init_blocks " + std::to_string(init) + " local_blocks " + std::to_string(local));
    Topology topo;
    topo.init_blocks = init;
    topo.local_blocks = local;
    run_and_check(topo, L, rng);
  }
}

TEST(Indexer, TensorParallelTopologies) {
  MSA_SEEDED_RNG(rng);
  const PackedLayout L = layout_of({2300, 500});
  for (int tp : {2, 4}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    run_and_check(Topology::minimax_m3(tp), L, rng);
  }
}

TEST(Indexer, TemperatureRescalesOnlyTheLse) {
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({2400, 130});
  const Inputs in = random_inputs(rng, topo, L);
  const IndexerOutputs base = run_indexer(topo, L, in.index_q, in.index_k);
  for (float temperature : {0.5f, 2.0f}) {
    SCOPED_TRACE("lse_temperature " + std::to_string(temperature));
    const IndexerOutputs out = run_indexer(topo, L, in.index_q, in.index_k, temperature);
    EXPECT_EQ(out.topk.ints(), base.topk.ints()) << "the temperature changed the selection";
    // lse = log Σ exp(s / T) over the selected causal keys.
    check_lse(topo, L, in, out, temperature);
  }
}

TEST(Indexer, IndexScaleChangesOnlyTheLse) {
  MSA_SEEDED_RNG(rng);
  Topology topo;
  const PackedLayout L = layout_of({2300});
  const Inputs in = random_inputs(rng, topo, L);
  const IndexerOutputs base = run_indexer(topo, L, in.index_q, in.index_k);
  topo.index_scale = 1.0f;  // as in the inference indexers
  const IndexerOutputs out = run_indexer(topo, L, in.index_q, in.index_k);
  check_selection(topo, L, in, out.topk);
  check_lse(topo, L, in, out);
  // Ranking is scale-invariant up to rounding: the selections agree as sets up to near-ties,
  // which check_selection has verified against the same oracle for both.
  check_selection(Topology{}, L, in, base.topk);
}

TEST(Indexer, SelectedLseIsOptional) {
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({2100, 40});
  const Inputs in = random_inputs(rng, topo, L);
  const IndexerOutputs with_lse = run_indexer(topo, L, in.index_q, in.index_k);
  HostTensor topk(DType::i32, {4, L.total_q(), 16});
  poison(topk);
  SelectBlocksParams p;
  p.index_q = in.index_q.view();
  p.index_k = in.index_k.view();
  p.topk = topk.view();
  select_blocks(topo, L, p);
  EXPECT_EQ(topk.ints(), with_lse.topk.ints());
}

TEST(Indexer, RepeatedRunsAreBitwiseIdentical) {
  MSA_SEEDED_RNG(rng);
  const Topology topo;
  const PackedLayout L = layout_of({2200, 77});
  const Inputs in = random_inputs(rng, topo, L);
  const IndexerOutputs a = run_indexer(topo, L, in.index_q, in.index_k);
  const IndexerOutputs b = run_indexer(topo, L, in.index_q, in.index_k);
  EXPECT_EQ(a.topk.raw(), b.topk.raw());
  EXPECT_EQ(a.lse.raw(), b.lse.raw());
}

}  // namespace
}  // namespace msa::test
