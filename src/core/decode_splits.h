// The automatic split-K count of decode attention (plan_decode with num_kv_splits = 0).
//
// The CUDA kernel runs one CTA per (tile of a request's Q rows, KV head, split): a tile is the
// request's rows for Q <= 8, half of them above (decode_tile_rows). The CTA takes split s's
// share of the distinct pages the tile's rows selected (pages s * U / S .. of the U in their
// union). More splits shorten each CTA's chain of pages but cost a partial write per CTA and
// a merge; past one wave of CTAs they only add waves. So the count is the largest power of two
// S <= 16 that
//   1. keeps one wave: units * S <= the CTAs the device runs at once (SMs x CTAs per SM),
//      units = (tile, KV head) pairs, and
//   2. leaves each split at least kMinPagesPerSplit of the unit's pages (estimated),
// and 1 when even S = 2 breaks one of them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "msa/constants.h"

namespace msa::detail {

inline constexpr int kDecodeSlots = model::kTopk;
inline constexpr double kMinPagesPerSplit = 4;  // below this the partial write and merge dominate
inline constexpr int kDecodeTileRows = 8;       // the most query rows of a decode attention CTA

// Query rows of a decode attention tile: a request's Q rows, in two tiles above 8.
inline int decode_tile_rows(int q_len_per_req) {
  return q_len_per_req <= kDecodeTileRows ? q_len_per_req : (q_len_per_req + 1) / 2;
}

// What the rule looks at, for the requests of one step that have keys.
struct DecodeSplitWork {
  int64_t units = 0;            // (tile, KV head) pairs: one CTA per split
  double pages_per_unit = 0;    // distinct pages a unit reads, at most (mean over the units)
  int64_t concurrent_ctas = 0;  // attention CTAs the device runs at once
};

inline int automatic_kv_splits(const DecodeSplitWork& w) {
  int chosen = 1;
  for (int s = 2; s <= kDecodeSlots; s *= 2) {
    const bool one_wave = w.units * s <= w.concurrent_ctas;
    const bool enough_pages = w.pages_per_unit >= kMinPagesPerSplit * s;
    if (!(one_wave && enough_pages)) break;  // each test only gets harder with s
    chosen = s;
  }
  return chosen;
}

// A unit reads the union of its tile's selections: at most rows x min(16, visible) pages and
// never more than the request's visible pages (rows of one request often agree, so fewer).
inline int64_t decode_unit_pages(int64_t seq_len, int tile_rows) {
  const int64_t visible = (seq_len + model::kPageSize - 1) / model::kPageSize;
  return std::min(int64_t(tile_rows) * std::min<int64_t>(kDecodeSlots, visible), visible);
}

// The work of a decode step: seq_lens of the requests (0 = padding, no keys), Q rows each.
inline DecodeSplitWork decode_split_work(const std::vector<int32_t>& seq_lens, int q_len, int kv_heads,
                                         int64_t concurrent_ctas) {
  DecodeSplitWork w;
  w.concurrent_ctas = concurrent_ctas;
  const int rows = decode_tile_rows(q_len);
  const int64_t tiles = (q_len + rows - 1) / rows;
  int64_t requests = 0;
  double pages = 0;
  for (const int32_t len : seq_lens) {
    if (len <= 0) continue;
    pages += double(decode_unit_pages(len, rows));
    ++requests;
  }
  if (requests == 0) return w;
  w.units = requests * tiles * kv_heads;
  w.pages_per_unit = pages / double(requests);
  return w;
}

}  // namespace msa::detail
