// The block-selection rule shared by the training indexer and the paged (inference) indexer.
#pragma once

#include <algorithm>
#include <cstdint>

#include "msa/topology.h"

namespace msa::cpu {

struct Ranked {
  float score;
  int32_t id;
};

// Writes the selection of one (query, index head) from its visible block scores.
// Order: init blocks ascending, ranked history best first, local blocks ascending (the
// query's own block last); unused slots -1.
inline void select_row(const float* score, int64_t nvis, const Topology& topo, int32_t* out, Ranked* ranked) {
  const int K = topo.topk;
  int n = 0;
  if (nvis <= K) {
    for (; n < nvis; ++n) out[n] = int32_t(n);
  } else {
    const int64_t local_begin = nvis - topo.local_blocks;  // > 0 since nvis > K >= local_blocks
    const int64_t init_end = std::min<int64_t>(topo.init_blocks, local_begin);
    const int slots = K - int(init_end) - topo.local_blocks;
    for (int64_t b = 0; b < init_end; ++b) out[n++] = int32_t(b);
    // Best `slots` of [init_end, local_begin) by (score desc, id asc), kept sorted.
    int count = 0;
    for (int64_t b = init_end; b < local_begin && slots > 0; ++b) {
      const float s = score[b];
      if (s != s) continue;
      int pos;
      if (count < slots) {
        pos = count++;
      } else {
        if (!(s > ranked[slots - 1].score)) continue;
        pos = slots - 1;
      }
      while (pos > 0 && s > ranked[pos - 1].score) {  // ids arrive ascending: equal scores stay behind
        ranked[pos] = ranked[pos - 1];
        --pos;
      }
      ranked[pos] = {s, int32_t(b)};
    }
    for (int i = 0; i < count; ++i) out[n++] = ranked[i].id;
    for (int64_t b = local_begin; b < nvis; ++b) out[n++] = int32_t(b);
  }
  for (; n < K; ++n) out[n] = -1;
}

}  // namespace msa::cpu
