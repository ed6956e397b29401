// The query a warp takes from a backward / KL chunk item (shared by backward.cu and
// kl_backward.cu): warp w of a CTA takes query sub * 8 + w of the item.
#pragma once

#include "cuda/common.cuh"

namespace msa::cuda {

// Records (packed row or -1, partial slot, last visible key index in the block) of query qi
// of the chunk item in meta[4 warp ..] (lane 0 writes) and returns whether the slot holds a
// query; `row` is its packed row, 0 for an empty slot (so its loads stay in bounds and are
// zero-filled by the caller).
__device__ __forceinline__ bool chunk_query(const int32_t* q_indices, const int32_t* split_slot, int64_t edge0, int qi,
                                            int q_count, const DocInfo& d, int key0, int* meta, int warp, int lane,
                                            int& row) {
  const bool valid = qi < q_count;
  row = 0;
  if (valid) {
    const int ql = q_indices[edge0 + qi];
    row = d.q_start + ql;
    if (lane == 0) {
      meta[4 * warp] = row;
      meta[4 * warp + 1] = split_slot[edge0 + qi];
      meta[4 * warp + 2] = d.k_len - d.q_len + ql - key0;
    }
  } else if (lane == 0) {
    meta[4 * warp] = -1;
  }
  return valid;
}

}  // namespace msa::cuda
