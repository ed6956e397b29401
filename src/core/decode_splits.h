// The automatic split-K count of decode attention (plan_decode with num_kv_splits = 0).
//
// The CUDA kernel runs one CTA per (request, KV head, split); the CTA streams the distinct
// pages its request's Q rows selected in the split's slots (split s of S holds slots
// s * 16 / S .. (s + 1) * 16 / S - 1 of every row). More splits shorten each CTA's chain of
// pages but cost a partial write per CTA and a merge; past one wave of CTAs they only add
// waves. So the count is the largest power of two S <= 16 that
//   1. keeps one wave: units * S <= the CTAs the device runs at once (SMs x CTAs per SM),
//   2. leaves each split at least kMinPagesPerSplit of the unit's pages (estimated), and
//   3. gives the last split a slot that holds a page (a row with n < 16 visible pages fills
//      slots 0 .. n - 1 only),
// and 1 when even S = 2 breaks one of them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "msa/constants.h"

namespace msa::detail {

inline constexpr int kDecodeSlots = model::kTopk;
inline constexpr double kMinPagesPerSplit = 4;  // below this the partial write and merge dominate

// What the rule looks at, for the requests of one step that have keys.
struct DecodeSplitWork {
  int64_t units = 0;            // (request, KV head) pairs: one CTA per split
  double pages_per_unit = 0;    // distinct pages a unit reads, at most (mean over the units)
  double slots_per_row = 0;     // slots the request's last row fills, min(16, visible pages) (mean)
  int64_t concurrent_ctas = 0;  // attention CTAs the device runs at once
};

inline int automatic_kv_splits(const DecodeSplitWork& w) {
  int chosen = 1;
  for (int s = 2; s <= kDecodeSlots; s *= 2) {
    const bool one_wave = w.units * s <= w.concurrent_ctas;
    const bool enough_pages = w.pages_per_unit >= kMinPagesPerSplit * s;
    const bool last_split_filled = w.slots_per_row > kDecodeSlots - kDecodeSlots / s;
    if (!(one_wave && enough_pages && last_split_filled)) break;  // each test only gets harder with s
    chosen = s;
  }
  return chosen;
}

// The work of a decode step: seq_lens of the requests (0 = padding, no keys), Q rows each.
// A unit reads the union of its Q rows' selections: at most Q x min(16, visible) pages and
// never more than the request's visible pages (rows of one request often agree, so fewer).
inline DecodeSplitWork decode_split_work(const std::vector<int32_t>& seq_lens, int q_len, int kv_heads,
                                         int64_t concurrent_ctas) {
  DecodeSplitWork w;
  w.concurrent_ctas = concurrent_ctas;
  int64_t requests = 0;
  double pages = 0, slots = 0;
  for (const int32_t len : seq_lens) {
    if (len <= 0) continue;
    const int64_t visible = (int64_t(len) + model::kPageSize - 1) / model::kPageSize;
    const int64_t filled = std::min<int64_t>(kDecodeSlots, visible);
    pages += double(std::min(int64_t(q_len) * filled, visible));
    slots += double(filled);
    ++requests;
  }
  if (requests == 0) return w;
  w.units = requests * kv_heads;
  w.pages_per_unit = pages / double(requests);
  w.slots_per_row = slots / double(requests);
  return w;
}

}  // namespace msa::detail
