// fp32 copies of key-side tensors cut into 128-token blocks, the form every CPU kernel
// reads keys and values in. Documents (context-parallel fragments) that start reading
// keys at the same row share one copy: block j of each of them is the same stored block.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <vector>

#include "cpu/common.h"
#include "msa/constants.h"
#include "msa/layout.h"

namespace msa::cpu {

inline constexpr int kBlock = model::kBlockSize;  // tokens per sparse block
inline constexpr int kDim = model::kHeadDim;       // head dim of q / k / v and of the index vectors
inline constexpr int64_t kBlockElems = int64_t(kBlock) * kDim;

struct KeyBlocks {
  struct Range {
    int64_t start = 0;        // first key row
    int64_t length = 0;       // longest k_len of the documents reading from `start`
    int64_t first_block = 0;  // index of its block 0 in the block arrays
  };
  std::vector<Range> ranges;
  std::vector<int> doc_range;        // [B] range of each document
  std::vector<int64_t> doc_block;    // [B] stored index of the document's block 0
  int64_t num_blocks = 0;
  bool disjoint = true;  // no key row belongs to two ranges

  int64_t blocks_of(const Range& r) const { return (r.length + kBlock - 1) / kBlock; }
};

inline KeyBlocks plan_key_blocks(const PackedLayout& L) {
  KeyBlocks kb;
  std::map<int64_t, int> by_start;
  kb.doc_range.resize(size_t(L.num_documents()));
  for (int b = 0; b < L.num_documents(); ++b) {
    const DocumentSpan& d = L.document(b);
    auto [it, added] = by_start.emplace(d.k_start, int(kb.ranges.size()));
    if (added) kb.ranges.push_back({d.k_start, 0, 0});
    KeyBlocks::Range& r = kb.ranges[size_t(it->second)];
    r.length = std::max(r.length, d.k_len);
    kb.doc_range[size_t(b)] = it->second;
  }
  for (auto& r : kb.ranges) {
    r.first_block = kb.num_blocks;
    kb.num_blocks += kb.blocks_of(r);
  }
  int64_t end = -1;
  for (const auto& [start, index] : by_start) {  // ascending starts
    const auto& r = kb.ranges[size_t(index)];
    if (r.length == 0) continue;
    if (start < end) kb.disjoint = false;
    end = std::max(end, start + r.length);
  }
  kb.doc_block.resize(kb.doc_range.size());
  for (size_t b = 0; b < kb.doc_range.size(); ++b) kb.doc_block[b] = kb.ranges[size_t(kb.doc_range[b])].first_block;
  return kb;
}

// Head `head` of `t` ([total_k, H, 128]) in fp32 as [num_blocks, 128, 128] blocks, rows
// past a range's end zero; `transposed` stores each block as [d][token] instead of
// [token][d].
inline std::vector<float> gather_blocks(const KeyBlocks& kb, const TensorView& t, int head, bool transposed,
                                        int threads) {
  std::vector<float> out(size_t(kb.num_blocks * kBlockElems));
  const int64_t heads = t.shape[1];
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (range, block within range)
  for (size_t r = 0; r < kb.ranges.size(); ++r)
    for (int64_t j = 0; j < kb.blocks_of(kb.ranges[r]); ++j) blocks.emplace_back(int64_t(r), j);
#pragma omp parallel num_threads(threads)
  {
    float row[kDim];
#pragma omp for schedule(static)
    for (size_t i = 0; i < blocks.size(); ++i) {
      const auto& r = kb.ranges[size_t(blocks[i].first)];
      const int64_t j = blocks[i].second;
      float* dst = out.data() + (r.first_block + j) * kBlockElems;
      const int64_t valid = std::min<int64_t>(kBlock, r.length - j * kBlock);
      for (int64_t s = 0; s < kBlock; ++s) {
        if (s < valid)
          load_row(t, ((r.start + j * kBlock + s) * heads + head) * kDim, kDim, row);
        else
          std::fill(row, row + kDim, 0.0f);
        if (transposed)
          for (int d = 0; d < kDim; ++d) dst[d * kBlock + s] = row[d];
        else
          std::copy(row, row + kDim, dst + s * kDim);
      }
    }
  }
  return out;
}

}  // namespace msa::cpu
