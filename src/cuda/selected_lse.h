// The indexer's selected-block LSE (SelectBlocksParams::selected_lse), computed after the
// selection from the top-k it wrote (selected_lse.cu).
#pragma once

#include <cuda_runtime.h>

#include "msa/layout.h"
#include "msa/ops.h"
#include "msa/topology.h"

namespace msa::cuda {

// Refuses (ErrorKind::unsupported) a layout the pass cannot index: edges pack (row << 4) | slot
// in int32, so total_q must stay below 2^27. Called before select_blocks launches anything, so
// that a refused call writes no output.
void check_selected_lse_size(const PackedLayout& layout);

// p.selected_lse from p.topk (already written on `stream`), p.index_q and p.index_k; the layout
// passed check_selected_lse_size.
void selected_lse(const Topology& topo, const PackedLayout& layout, const SelectBlocksParams& p, cudaStream_t stream);

}  // namespace msa::cuda
