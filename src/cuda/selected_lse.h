// The indexer's selected-block LSE (SelectBlocksParams::selected_lse), computed after the
// selection from the top-k it wrote (selected_lse.cu).
#pragma once

#include <cuda_runtime.h>

#include "msa/layout.h"
#include "msa/ops.h"
#include "msa/topology.h"

namespace msa::cuda {

// p.selected_lse from p.topk (already written on `stream`), p.index_q and p.index_k.
void selected_lse(const Topology& topo, const PackedLayout& layout, const SelectBlocksParams& p, cudaStream_t stream);

}  // namespace msa::cuda
