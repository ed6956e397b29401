// The CUDA side of include/msa/layout.h: document-map runs and pack / unpack kernels. Inputs
// are validated by src/core/layout.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "msa/layout.h"

namespace msa::cuda {

// A run of equal values in one row of a [batch, seq] document map: its first position
// (row-major, b * seq + s) and its value.
struct MapRun {
  int32_t index;
  int32_t id;
};

// The runs of every row of an int32 CUDA map (a run starts at s = 0 and wherever the value
// changes), in row-major order. Queues the work on `stream` and waits for it once; refuses to
// run while `stream` is being captured. batch * seq must be below 2^31.
std::vector<MapRun> document_map_runs(const TensorView& map, void* stream);

// padded [batch, seq, row_bytes] <-> packed [tokens, row_bytes] on the device of both.
void pack_rows(const PackedLayout& layout, const TensorView& padded, const TensorView& packed, int64_t row_bytes,
               void* stream);
void unpack_rows(const PackedLayout& layout, const TensorView& packed, const TensorView& padded, int64_t row_bytes,
                 void* stream);

}  // namespace msa::cuda
