// PackedLayout (cu_seqlens, tensors, document maps) and pack / unpack (docs/semantics.md §2).
#include "test_support.h"

namespace msa::test {
namespace {

void expect_span(const DocumentSpan& d, int64_t q_start, int64_t q_len, int64_t k_start, int64_t k_len) {
  EXPECT_EQ(d.q_start, q_start);
  EXPECT_EQ(d.q_len, q_len);
  EXPECT_EQ(d.k_start, k_start);
  EXPECT_EQ(d.k_len, k_len);
}

// The library's spans agree with the oracle's reading of the same cu_seqlens.
void expect_matches_oracle(const PackedLayout& L) {
  const auto docs = oracle_docs(L);
  ASSERT_EQ(int(docs.size()), L.num_documents());
  for (int b = 0; b < L.num_documents(); ++b) {
    SCOPED_TRACE("document " + std::to_string(b));
    expect_span(L.document(b), docs[size_t(b)].q_start, docs[size_t(b)].q_len, docs[size_t(b)].k_start,
                docs[size_t(b)].k_len);
  }
}

TEST(Layout, FromCuSeqlens) {
  const PackedLayout L = PackedLayout::from_cu_seqlens({0, 3, 3, 200, 201}, {0, 3, 10, 2310, 2311});
  ASSERT_EQ(L.num_documents(), 4);
  expect_span(L.document(0), 0, 3, 0, 3);
  expect_span(L.document(1), 3, 0, 3, 7);
  expect_span(L.document(2), 3, 197, 10, 2300);
  expect_span(L.document(3), 200, 1, 2310, 1);
  EXPECT_EQ(L.total_q(), 201);
  EXPECT_EQ(L.total_k(), 2311);
  EXPECT_EQ(L.max_seqlen_q(), 197);
  EXPECT_EQ(L.max_seqlen_k(), 2300);
  EXPECT_EQ(L.total_rows(), 1 + 1 + 18 + 1);
  EXPECT_EQ(L.total_rows(64), 1 + 1 + 36 + 1);
  ASSERT_EQ(L.query_document().size(), 201u);
  EXPECT_EQ(L.query_document()[0], 0);
  EXPECT_EQ(L.query_document()[2], 0);
  EXPECT_EQ(L.query_document()[3], 2);
  EXPECT_EQ(L.query_document()[199], 2);
  EXPECT_EQ(L.query_document()[200], 3);
  EXPECT_EQ(L.cu_seqlens_q(), (std::vector<int32_t>{0, 3, 3, 200, 201}));
  EXPECT_EQ(L.cu_seqlens_k(), (std::vector<int32_t>{0, 3, 10, 2310, 2311}));
  EXPECT_FALSE(L.has_document_map());
  expect_matches_oracle(L);
}

TEST(Layout, FragmentIndicesRedirectTheKeyStart) {
  // Spec §5.1 / §11 case generator: a document's KV stored once, its fragments reading from the
  // first fragment's start with cu_seqlens_k[f + 1] = base + local_end(f).
  const PackedLayout L = PackedLayout::from_cu_seqlens({0, 300, 900, 1300}, {0, 300, 2600, 3000}, {0, 0, 2});
  expect_span(L.document(0), 0, 300, 0, 300);
  expect_span(L.document(1), 300, 600, 0, 2600);
  expect_span(L.document(2), 900, 400, 2600, 400);
  EXPECT_EQ(L.total_k(), 3000);
  EXPECT_EQ(L.total_rows(), 3 + 21 + 4);  // shared storage still counts each fragment's rows
  EXPECT_EQ(L.fragment_indices(), (std::vector<int32_t>{0, 0, 2}));
  EXPECT_EQ(L.max_seqlen_k(), 2600);
  expect_matches_oracle(L);
}

TEST(Layout, FromTensorsMatchesFromVectors) {
  const HostTensor cq = int_tensor({0, 5, 5, 300}, {4}), ck = int_tensor({0, 5, 100, 2400}, {4}),
                   fr = int_tensor({0, 1, 1}, {3});
  const PackedLayout a = PackedLayout::from_tensors(cq.view(), ck.view());
  const PackedLayout b = PackedLayout::from_cu_seqlens({0, 5, 5, 300}, {0, 5, 100, 2400});
  ASSERT_EQ(a.num_documents(), b.num_documents());
  for (int d = 0; d < a.num_documents(); ++d)
    expect_span(a.document(d), b.document(d).q_start, b.document(d).q_len, b.document(d).k_start, b.document(d).k_len);
  const PackedLayout f = PackedLayout::from_tensors(cq.view(), ck.view(), fr.view());
  expect_span(f.document(2), 5, 295, 5, 2395);
  expect_matches_oracle(f);
}

TEST(Layout, FromDocumentMapWithPadding) {
  // Several documents per row, padding in the middle and at the end, ids in any order.
  const HostTensor map = int_tensor({1, 1, 0, 2, 2, 2, 0, 0,   //
                                     7, 7, 7, 4, 0, 0, 0, 0,   //
                                     0, 0, 5, 5, 5, 5, 5, 0},  //
                                    {3, 8});
  const PackedLayout L = PackedLayout::from_document_map(map.view());
  ASSERT_EQ(L.num_documents(), 5);
  const int64_t lens[] = {2, 3, 3, 1, 5};
  int64_t start = 0;
  for (int b = 0; b < 5; ++b) {
    expect_span(L.document(b), start, lens[b], start, lens[b]);
    start += lens[b];
  }
  EXPECT_EQ(L.total_q(), 14);
  EXPECT_TRUE(L.has_document_map());
  EXPECT_EQ(L.padded_batch(), 3);
  EXPECT_EQ(L.padded_seq(), 8);
  const std::vector<int64_t> rows = {0, 1, -1, 2, 3, 4, -1, -1,  //
                                     5, 6, 7, 8, -1, -1, -1, -1,  //
                                     -1, -1, 9, 10, 11, 12, 13, -1};
  EXPECT_EQ(L.packed_row_of_padded(), rows);
}

TEST(Layout, DocumentMapIdsArePerRow) {
  // Every row a single document with id 1 (the usual "one sequence per row" map): two
  // documents, not a split one.
  const HostTensor map = int_tensor({1, 1, 1, 0,  //
                                     1, 1, 0, 0},
                                    {2, 4});
  const PackedLayout L = PackedLayout::from_document_map(map.view());
  ASSERT_EQ(L.num_documents(), 2);
  expect_span(L.document(0), 0, 3, 0, 3);
  expect_span(L.document(1), 3, 2, 3, 2);
}

TEST(Layout, DocumentMapRejectsSplitDocuments) {
  const HostTensor map = int_tensor({1, 1, 2, 1, 0, 0}, {1, 6});
  expect_error([&] { PackedLayout::from_document_map(map.view()); }, {"document_map", "document 1", "contiguous"});
  const HostTensor after_padding = int_tensor({3, 3, 0, 0, 5, 5, 0, 5}, {2, 4});
  expect_error([&] { PackedLayout::from_document_map(after_padding.view()); },
               {"document 5 of row 1", "contiguous", "[1, 3]"});
  const HostTensor negative = int_tensor({1, -2}, {1, 2});
  expect_error([&] { PackedLayout::from_document_map(negative.view()); }, {"document_map[0, 1]", "-2"});
  const HostTensor padding = int_tensor({0, 0, 0}, {1, 3});
  expect_error([&] { PackedLayout::from_document_map(padding.view()); }, {"document_map", "no tokens"});
}

TEST(Layout, PackUnpackRoundTrip) {
  MSA_SEEDED_RNG(rng);
  const HostTensor map = int_tensor({1, 1, 1, 0, 2, 0,  //
                                     0, 3, 3, 3, 3, 3,  //
                                     4, 0, 0, 0, 0, 0},  //
                                    {3, 6});
  const PackedLayout L = PackedLayout::from_document_map(map.view());
  for (DType dtype : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const HostTensor padded = random_tensor(rng, {3, 6, 4, 16}, 1.0f, dtype);
    HostTensor packed(dtype, {L.total_q(), 4, 16});
    poison(packed);
    pack(L, padded.view(), packed.view());
    const auto& rows = L.packed_row_of_padded();
    for (int64_t i = 0; i < 18; ++i) {
      if (rows[size_t(i)] < 0) continue;
      for (int64_t e = 0; e < 64; ++e) ASSERT_EQ(packed.at(rows[size_t(i)] * 64 + e), padded.at(i * 64 + e));
    }
    EXPECT_EQ(count_nan(packed.floats()), 0) << "pack left rows unwritten";
    HostTensor back(dtype, {3, 6, 4, 16});
    poison(back);
    unpack(L, packed.view(), back.view());
    for (int64_t i = 0; i < 18; ++i)
      for (int64_t e = 0; e < 64; ++e)
        ASSERT_EQ(back.at(i * 64 + e), rows[size_t(i)] < 0 ? 0.0f : padded.at(i * 64 + e)) << "padded position " << i;
  }
  // Integer payloads travel unchanged too.
  const HostTensor ids = int_tensor({10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27}, {3, 6});
  HostTensor packed_ids(DType::i32, {L.total_q()});
  pack(L, ids.view(), packed_ids.view());
  EXPECT_EQ(packed_ids.ints(), (std::vector<int32_t>{10, 11, 12, 14, 17, 18, 19, 20, 21, 22}));
}

TEST(Layout, PackRejectsMismatches) {
  const PackedLayout plain = layout_of({3});
  HostTensor padded(DType::f32, {1, 3, 2}), packed(DType::f32, {3, 2});
  expect_error([&] { pack(plain, padded.view(), packed.view()); }, {"from_document_map"});
  const HostTensor map = int_tensor({1, 1, 0}, {1, 3});
  const PackedLayout L = PackedLayout::from_document_map(map.view());
  HostTensor wrong_rows(DType::f32, {3, 2});
  expect_error([&] { pack(L, padded.view(), wrong_rows.view()); }, {"packed must have shape [2, ...]", "[3, 2]"});
  HostTensor wrong_dtype(DType::bf16, {2, 2});
  expect_error([&] { pack(L, padded.view(), wrong_dtype.view()); }, {"dtype", "f32", "bf16"});
  HostTensor wrong_inner(DType::f32, {2, 3});
  expect_error([&] { unpack(L, wrong_inner.view(), padded.view()); }, {"trailing shape"});
}

}  // namespace
}  // namespace msa::test
