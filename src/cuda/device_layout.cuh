// Device-side lookups into the document table.
#pragma once

#include <cstdint>

#include "cuda/common.cuh"

namespace msa::cuda {

// Document of packed query row q: the last b with cu_q[b] <= q (empty documents skipped).
__device__ __forceinline__ int find_document(const int32_t* __restrict__ cu_q, int B, int32_t q) {
  int l = 0, r = B + 1;
  while (l < r) {
    const int m = (l + r) >> 1;
    if (cu_q[m] <= q) l = m + 1; else r = m;
  }
  return l - 1;
}

}  // namespace msa::cuda
