// Decode (1..16 queries per request, split-K over the 16 slots) against the float64 oracle:
// per-query causal positions and selections, padding rows, every split count, and agreement
// with paged prefill of the same rows, and the automatic split count (its rule on a given device).
#include "../src/core/decode_splits.h"
#include "inference_support.h"

namespace msa::test {
namespace {

const Topology kSmall = Topology::minimax_m3(4);

void expect_padding_rows(const PagedCase& c, const PagedOutputs& o) {
  const int Hq = c.topo.num_q_heads, Hi = c.topo.num_index_heads;
  const auto ids = o.topk.ints();
  const auto out = o.out.floats(), lse = o.lse.floats();
  for (size_t b = 0; b < c.seq_lens.size(); ++b) {
    if (c.seq_lens[b] != 0) continue;
    for (int64_t r = c.cu_seqlens_q[b]; r < c.cu_seqlens_q[b + 1]; ++r) {
      for (int g = 0; g < Hi; ++g)
        for (int s = 0; s < 16; ++s) EXPECT_EQ(ids[size_t((g * c.total_q() + r) * 16 + s)], -1) << "padding row " << r;
      for (int h = 0; h < Hq; ++h) {
        EXPECT_TRUE(std::isinf(lse[size_t(r * Hq + h)]) && lse[size_t(r * Hq + h)] < 0) << "padding row " << r;
        for (int d = 0; d < 128; ++d) EXPECT_EQ(out[size_t((r * Hq + h) * 128 + d)], 0.0f) << "padding row " << r;
      }
    }
  }
}

// A decode run's selection and attention against the oracle, and its padding rows.
void expect_decode_matches_oracle(const PagedCase& c, const PagedOutputs& o) {
  check_paged_selection(c, o.topk);
  check_paged_attention(c, o);
  expect_padding_rows(c, o);
}

TEST(InferenceDecode, SingleQueryAgainstOracleWithPaddingRows) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_decode_case(rng, kSmall, {1, 130, 2400, 0, 128, 129, 0}, 1);
  for (int splits : {1, 4, 16}) {
    SCOPED_TRACE("num_kv_splits " + std::to_string(splits));
    const PagedOutputs o = run_paged(c, splits);
    expect_decode_matches_oracle(c, o);
  }
}

TEST(InferenceDecode, EightQueriesHaveTheirOwnPositions) {
  MSA_SEEDED_RNG(rng);
  // Request 1's eight queries straddle a page edge (positions 124..131); request 2's queries
  // see 18 pages and rank history pages individually.
  const PagedCase c = make_decode_case(rng, kSmall, {8, 132, 2250, 0}, 8);
  const PagedOutputs o = run_paged(c, 2);
  expect_decode_matches_oracle(c, o);
  const auto ids = o.topk.ints();
  // Query i of request 0 sits at position i: exactly page 0.
  for (int i = 0; i < 8; ++i) EXPECT_EQ(ids[size_t(i * 16)], 0);
  // Request 1: positions 124..127 see pages {0}, 128..131 see {0, 1} with 1 last.
  for (int i = 0; i < 8; ++i) {
    const int32_t* row = ids.data() + (8 + i) * 16;
    if (i < 4) EXPECT_EQ(std::vector<int32_t>(row, row + 2), (std::vector<int32_t>{0, -1}));
    else EXPECT_EQ(std::vector<int32_t>(row, row + 3), (std::vector<int32_t>{0, 1, -1}));
  }
}

TEST(InferenceDecode, SixteenQueriesFullTopology) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_decode_case(rng, Topology::minimax_m3(), {16, 2070}, 16);
  const PagedOutputs o = run_paged(c);
  check_paged_selection(c, o.topk);
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < c.total_q(); r += 3) rows.push_back(r);
  check_paged_attention(c, o, rows);
}

TEST(InferenceDecode, SplitCountsAgree) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_decode_case(rng, kSmall, {2300, 700, 3}, 2);
  const PagedOutputs base = run_paged(c, 1, DType::f32);
  const auto base_out = base.out.floats(), base_lse = base.lse.floats();
  for (int splits : {2, 4, 8, 16}) {
    SCOPED_TRACE("num_kv_splits " + std::to_string(splits));
    const PagedOutputs o = run_paged(c, splits, DType::f32);
    EXPECT_EQ(o.topk.ints(), base.topk.ints());
    expect_close("out", o.out.floats(), std::vector<double>(base_out.begin(), base_out.end()), 1e-6, 1e-5);
    expect_close("lse", o.lse.floats(), std::vector<double>(base_lse.begin(), base_lse.end()), 1e-6, 1e-6);
  }
  check_paged_attention(c, base);
}

TEST(InferenceDecode, MatchesPagedPrefillOfTheSameRows) {
  MSA_SEEDED_RNG(rng);
  PagedCase d = make_decode_case(rng, kSmall, {2200, 40, 300}, 4);
  PagedCase p = d;  // same caches and inputs, described as a chunked prefill of 4 tokens each
  p.phase = InferencePhase::prefill;
  p.q_len_per_req = 0;
  const PagedOutputs od = run_paged(d, 16, DType::f32), op = run_paged(p, 0, DType::f32);
  EXPECT_EQ(od.topk.ints(), op.topk.ints());
  const auto out = op.out.floats(), lse = op.lse.floats();
  expect_close("out", od.out.floats(), std::vector<double>(out.begin(), out.end()), 1e-6, 1e-5);
  expect_close("lse", od.lse.floats(), std::vector<double>(lse.begin(), lse.end()), 1e-6, 1e-6);
}

// The next step of a decode plan: other seq_lens, request 1 reading request 0's pages.
PagedCase next_step(const PagedCase& c) {
  PagedCase next = c;
  next.seq_lens = {2999, 130, 0, 139};
  for (int64_t j = 0; j < c.max_pages; ++j) next.page_table[size_t(c.max_pages + j)] = c.page_table[size_t(j)];
  return next;
}

DecodeMetadata metadata(const PagedCase& c, const HostTensor& seq_lens, const HostTensor& page_table) {
  DecodeMetadata m;
  m.seq_lens = seq_lens.view();
  m.page_table = page_table.view();
  m.q_len_per_req = c.q_len_per_req;
  return m;
}

// update_decode_plan: a plan rewritten for the next step runs it exactly as a fresh plan of
// that step does (bitwise on the CPU), and the oracle agrees.
TEST(InferenceDecode, UpdatedPlanRunsTheNextStep) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_decode_case(rng, kSmall, {3000, 0, 700, 140}, 4);
  const PagedCase next = next_step(c);
  const HostTensor sl = int_tensor(next.seq_lens, {4}), pt = int_tensor(next.page_table, {4, next.max_pages});
  for (int splits : {1, 4}) {
    SCOPED_TRACE("num_kv_splits " + std::to_string(splits));
    InferencePlan plan = c.plan(splits);
    update_decode_plan(plan, metadata(next, sl, pt));
    PagedOutputs o = make_outputs(next);
    PagedAttentionParams a = attention_params(next, o);
    a.topk = {};
    paged_forward(plan, indexer_params(next, o), a);
    const PagedOutputs fresh = run_paged(next, splits);
    EXPECT_EQ(o.topk.raw(), fresh.topk.raw());
    EXPECT_EQ(o.out.raw(), fresh.out.raw());
    EXPECT_EQ(o.lse.raw(), fresh.lse.raw());
    expect_decode_matches_oracle(next, o);
  }
}

// InferencePlan's assignments (they release the old plan as a whole, CUDA ordering included)
// must still carry every field: a plan assigned over another runs the assigned step.
TEST(InferenceDecode, AssignedPlansRunTheAssignedStep) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_decode_case(rng, kSmall, {3000, 0, 700, 140}, 4);
  const PagedCase next = next_step(c);
  const PagedOutputs want = run_paged(next, 4);
  auto run = [&](const InferencePlan& plan) {
    PagedOutputs o = make_outputs(next);
    PagedAttentionParams a = attention_params(next, o);
    a.topk = {};
    paged_forward(plan, indexer_params(next, o), a);
    EXPECT_EQ(o.topk.raw(), want.topk.raw());
    EXPECT_EQ(o.out.raw(), want.out.raw());
    EXPECT_EQ(o.lse.raw(), want.lse.raw());
  };
  InferencePlan plan = c.plan(1);
  const InferencePlan source = next.plan(4);
  plan = source;  // copy
  EXPECT_EQ(plan.num_kv_splits, 4);
  EXPECT_EQ(plan.partial_out.data(), source.partial_out.data()) << "copies share their buffers";
  run(plan);
  InferencePlan moved = c.plan(1);
  moved = next.plan(4);  // move
  EXPECT_EQ(moved.max_seqlen_k, source.max_seqlen_k);
  run(moved);
  InferencePlan& self = moved;
  moved = std::move(self);  // self-move leaves the plan as it was
  run(moved);
}

TEST(InferenceDecode, UpdateRefusesAnotherShapeAndLeavesThePlan) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_decode_case(rng, kSmall, {3000, 0, 700, 140}, 4);
  InferencePlan plan = c.plan();
  auto seq_lens_of = [](const InferencePlan& p) {  // a CPU plan's device copy of seq_lens
    const auto* v = static_cast<const int32_t*>(p.seq_lens.data());
    return std::vector<int32_t>(v, v + p.batch);
  };
  const std::vector<int32_t> before = seq_lens_of(plan);
  const PagedCase next = next_step(c);
  const HostTensor sl = int_tensor(next.seq_lens, {4}), pt = int_tensor(next.page_table, {4, next.max_pages});
  DecodeMetadata m = metadata(next, sl, pt);
  m.q_len_per_req = 2;
  expect_error([&] { update_decode_plan(plan, m); }, {"q_len_per_req must be the plan's 4, got 2"});
  const int64_t half = next.max_pages / 2;
  std::vector<int32_t> narrow_table(size_t(4 * half));
  for (int64_t b = 0; b < 4; ++b)
    for (int64_t j = 0; j < half; ++j) narrow_table[size_t(b * half + j)] = next.page_table[size_t(b * next.max_pages + j)];
  const HostTensor three = int_tensor({1, 2, 3}, {3}), narrow = int_tensor(narrow_table, {4, half});
  m = metadata(next, three, int_tensor(std::vector<int32_t>(size_t(3 * next.max_pages), 0), {3, next.max_pages}));
  expect_error([&] { update_decode_plan(plan, m); }, {"seq_lens must have the plan's batch = 4 entries, got 3"});
  m = metadata(next, sl, narrow);
  expect_error([&] { update_decode_plan(plan, m); }, {"page_table must have the plan's width max_pages"});
  const HostTensor longer = int_tensor({3001, 130, 0, 139}, {4});
  m = metadata(next, longer, pt);
  expect_error([&] { update_decode_plan(plan, m); }, {"seq_lens[0] = 3001 is longer than the plan's max_seqlen_k = 3000"});
  const InferencePlan prefill = make_prefill_case(rng, kSmall, {300}, {5}).plan();
  InferencePlan prefill_copy = prefill;
  expect_error([&] { update_decode_plan(prefill_copy, metadata(next, sl, pt)); }, {"needs a decode plan"});
  EXPECT_EQ(seq_lens_of(plan), before) << "a refused update changed the plan";
}

TEST(InferenceDecode, AutomaticSplitCount) {
  MSA_SEEDED_RNG(rng);
  // CPU plans: 1 (the CPU runs a row's splits one after another); an explicit count is kept.
  EXPECT_EQ(make_decode_case(rng, kSmall, {200}, 1).plan().num_kv_splits, 1);
  EXPECT_EQ(make_decode_case(rng, Topology::minimax_m3(), {2200, 8, 9}, 8).plan().num_kv_splits, 1);
  const InferencePlan plan = make_decode_case(rng, kSmall, {200, 300}, 3).plan(4);
  EXPECT_EQ(plan.num_kv_splits, 4);
  EXPECT_EQ(plan.partial_out.view().shape_vector(), (std::vector<int64_t>{4, 6, 16, 128}));
}

// The automatic split rule of CUDA plans (src/core/decode_splits.h) for `batch` requests of
// `context` tokens, Q queries each, Hkv KV heads, on a device running `ctas` attention CTAs at
// once (an H200: 132 SMs, one CTA each).
int rule_splits(int64_t batch, int32_t context, int q = 8, int hkv = 4, int64_t ctas = 132) {
  return detail::automatic_kv_splits(
      detail::decode_split_work(std::vector<int32_t>(size_t(batch), context), q, hkv, ctas));
}

TEST(DecodeSplitRule, OneWaveOfSplitsWithSeveralPages) {
  EXPECT_EQ(rule_splits(8, 4096), 4);  // 32 units x 4 = 128 CTAs; 8 splits would be two waves
  EXPECT_EQ(rule_splits(1, 4096), 8);  // 4 units; at most 32 pages a unit, 4 a split
  EXPECT_LT(rule_splits(8, 4096), rule_splits(1, 4096));
  EXPECT_EQ(rule_splits(1, 4096, 1), 4);  // one query: 16 pages a unit
  EXPECT_EQ(rule_splits(8, 131072), 4);
  EXPECT_EQ(rule_splits(32, 32768), 1);  // 128 units fill the card
  EXPECT_EQ(rule_splits(128, 131072), 1);
  EXPECT_EQ(rule_splits(8, 4096, 8, 4, 264), 8);  // two CTAs an SM: room for twice the splits
  EXPECT_EQ(rule_splits(1, 4096, 8, 4, 16), 4);   // a small device
  EXPECT_EQ(rule_splits(1, 1900), 2);    // 15 visible pages: two splits of 7 and 8
  EXPECT_EQ(rule_splits(1, 1000), 2);    // 8 visible pages: two splits of 4
  EXPECT_EQ(rule_splits(1, 800), 1);     // 7 visible pages: a second split would hold 3
  EXPECT_EQ(rule_splits(1, 4096, 16), 8);   // Q = 16: two tiles of 8 rows, 8 units
  EXPECT_EQ(rule_splits(16, 4096, 16), 1);  // 128 units fill the card
  EXPECT_EQ(rule_splits(1, 1), 1);
  // Padding requests (seq_len 0) add no work; a step of padding only gets 1.
  EXPECT_EQ(detail::automatic_kv_splits(detail::decode_split_work({0, 4096, 0, 0, 0, 0, 0, 0}, 8, 4, 132)),
            rule_splits(1, 4096));
  EXPECT_EQ(detail::automatic_kv_splits(detail::decode_split_work({0, 0}, 8, 4, 132)), 1);
}

TEST(DecodeSplitRule, EverySplitHoldsPagesAndLargerBatchesNeverSplitMore) {
  const std::vector<int32_t> contexts = {1, 100, 128, 129, 1000, 1900, 2048, 2049, 4096, 32768, 131072};
  const std::vector<int64_t> batches = {1, 2, 3, 5, 8, 16, 32, 33, 64, 128, 256};
  for (int64_t ctas : {1, 66, 132, 264, 1000})
    for (int hkv : {1, 4})
      for (int q = 1; q <= 16; ++q)
        for (int32_t context : contexts) {
          int previous = 16;
          for (int64_t batch : batches) {
            SCOPED_TRACE("ctas " + std::to_string(ctas) + ", Hkv " + std::to_string(hkv) + ", Q " + std::to_string(q) +
                         ", batch " + std::to_string(batch) + ", context " + std::to_string(context));
            const int s = rule_splits(batch, context, q, hkv, ctas);
            ASSERT_TRUE(s == 1 || s == 2 || s == 4 || s == 8 || s == 16) << s;
            ASSERT_LE(s, previous);
            previous = s;
            if (s == 1) continue;
            const int rows = q <= 8 ? q : (q + 1) / 2;  // a tile's rows; two tiles above Q = 8
            EXPECT_LE(batch * ((q + rows - 1) / rows) * hkv * s, ctas) << "more than one wave";
            const int64_t visible = (context + 127) / 128;
            EXPECT_GE(std::min<int64_t>(rows * std::min<int64_t>(16, visible), visible), 4 * s) << "splits of < 4 pages";
          }
        }
}

TEST(InferenceDecode, PlanDerivedRows) {
  MSA_SEEDED_RNG(rng);
  const PagedCase c = make_decode_case(rng, kSmall, {130, 0}, 3);
  const InferencePlan plan = c.plan();
  const auto* pos = static_cast<const int32_t*>(plan.positions.data());
  const auto* slot = static_cast<const int32_t*>(plan.slot_mapping.data());
  const auto* req = static_cast<const int32_t*>(plan.query_request.data());
  EXPECT_EQ(std::vector<int32_t>(pos, pos + 6), (std::vector<int32_t>{127, 128, 129, -3, -2, -1}));
  EXPECT_EQ(std::vector<int32_t>(req, req + 6), (std::vector<int32_t>{0, 0, 0, 1, 1, 1}));
  const int32_t p0 = c.page_table[0], p1 = c.page_table[1];
  EXPECT_EQ(std::vector<int32_t>(slot, slot + 6), (std::vector<int32_t>{p0 * 128 + 127, p1 * 128, p1 * 128 + 1, -1, -1, -1}));
  EXPECT_EQ(plan.max_seqlen_k, 130);
  EXPECT_EQ(plan.total_q, 6);
  EXPECT_EQ(plan.max_physical_page, std::max(p0, p1));
}

}  // namespace
}  // namespace msa::test
