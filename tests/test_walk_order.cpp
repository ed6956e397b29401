// The query-major walks of the CUDA training kernels (src/core/walk_order.h) on the shapes
// they were measured on (docs/performance.md, runs 40-41). Forward: long documents and chunks
// over short prefixes take 2048-query chunks; chunks over prefixes whose key blocks a
// 2048-query chunk gives fewer than 32 queries each keep the schedule's order (0). Backward:
// 1024-query windows for documents of 8k queries and more, the list's order below.
#include "../src/core/walk_order.h"
#include "test_support.h"

namespace msa::test {
namespace {

using detail::backward_window_queries;
using detail::forward_chunk_queries;

TEST(ForwardWalk, TrainingDocumentsAndPacksWalkByChunks) {
  EXPECT_EQ(forward_chunk_queries(layout_of({16384})), 2048);
  EXPECT_EQ(forward_chunk_queries(layout_of({131072})), 2048);  // 32 queries a block exactly
  EXPECT_EQ(forward_chunk_queries(layout_of({2048, 2048, 2048, 2048, 2048, 2048, 2048, 2048})), 2048);
}

TEST(ForwardWalk, PrefillChunksFollowTheirKeyBlocks) {
  // 4k over 32k and 8k over 122k: measured faster by the walk; 16k over 178k: slower.
  EXPECT_EQ(forward_chunk_queries(layout_of({4096}, {36864})), 2048);
  EXPECT_EQ(forward_chunk_queries(layout_of({8192}, {131072})), 2048);
  EXPECT_EQ(forward_chunk_queries(layout_of({16384}, {194560})), 0);
  // Weighted by queries: 40 queries over 140k keys and 400 over 33k give 22 a block.
  EXPECT_EQ(forward_chunk_queries(layout_of({40, 400}, {140040, 33400})), 0);
  EXPECT_EQ(forward_chunk_queries(layout_of({40, 4000}, {140040, 33400})), 2048);
}

TEST(ForwardWalk, NoQueriesKeepTheScheduleOrder) {
  EXPECT_EQ(forward_chunk_queries(layout_of({0, 0}, {300, 5})), 0);
}

TEST(ForwardWindows, PartialsOfAFewChunksAtATime) {
  using detail::forward_window_queries;
  EXPECT_EQ(forward_window_queries(16384, 2048), 4096);    // 4 windows
  EXPECT_EQ(forward_window_queries(131072, 2048), 8192);   // 16 windows of 4 chunks
  EXPECT_EQ(forward_window_queries(262144, 2048), 16384);
  EXPECT_EQ(forward_window_queries(13000, 2048), 4096);    // 4 windows, the last of 712 queries
  EXPECT_EQ(forward_window_queries(33000, 2048), 4096);    // 17 chunks: 9 windows of 2
  EXPECT_EQ(forward_window_queries(8192, 2048), 8192);     // up to 8192 queries: one window
  EXPECT_EQ(forward_window_queries(7000, 2048), 7000);
  EXPECT_EQ(forward_window_queries(1500, 2048), 1500);
  EXPECT_EQ(forward_window_queries(50000, 0), 50000);      // no walk: one window
  EXPECT_EQ(forward_window_queries(0, 0), 0);
}

TEST(ForwardWindows, LongLayoutsWithoutAWalkStillWalkByWindows) {
  using detail::forward_walk_chunk;
  EXPECT_EQ(forward_walk_chunk(layout_of({131072})), 2048);    // the rule's chunk
  EXPECT_EQ(forward_walk_chunk(layout_of({262144})), 16384);   // 16 queries a block: chunks of a window
  EXPECT_EQ(forward_walk_chunk(layout_of({40000}, {400000})), 4096);
  EXPECT_EQ(forward_walk_chunk(layout_of({16384}, {194560})), 0);  // few queries: one window
}

TEST(BackwardWalk, LongDocumentsWalkByWindows) {
  EXPECT_EQ(backward_window_queries(layout_of({16384})), 1024);  // measured faster
  EXPECT_EQ(backward_window_queries(layout_of({8192})), 1024);
  EXPECT_EQ(backward_window_queries(layout_of({65536, 4096})), 1024);
}

TEST(BackwardWalk, ShortDocumentsKeepTheListOrder) {
  EXPECT_EQ(backward_window_queries(layout_of({4096})), 0);  // measured slower
  // A pack of 4k documents is many short documents, not one long one.
  EXPECT_EQ(backward_window_queries(layout_of({4096, 4096, 4096, 4096})), 0);
  // Weighted by queries: 8k and 4k documents average 6.8k.
  EXPECT_EQ(backward_window_queries(layout_of({8192, 4096})), 0);
  EXPECT_EQ(backward_window_queries(layout_of({0, 0}, {300, 5})), 0);
}

}  // namespace
}  // namespace msa::test
