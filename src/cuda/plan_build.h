// The two halves of build_plan (build_plan.cu), for paths that keep one plan's buffers and
// rebuild only its selection part: paged prefill builds a schedule per layer from the
// indexer's top-k into buffers sized once per step.
#pragma once

#include <cuda_runtime.h>

#include "msa/layout.h"
#include "msa/ops.h"
#include "msa/topology.h"
#include "cuda/common.cuh"

namespace msa::cuda {

// Refuses (ErrorKind::unsupported, naming `who`) a schedule whose int32 edge and row indices
// would overflow: Hkv * total_q * 16 and Hkv * (rows + 1) below 2^31, total_q below 2^27.
void check_schedule_size(int Hkv, int64_t total_q, int64_t rows, const char* who);

// The layout's tables (PlanState: documents, row numbering) and plan.rows on the device.
// plan's buffers (include/msa/ops.h) must already be allocated; with_chunks also sizes the
// backward / KL work items. The state's buffers are given back as `release` says.
void upload_layout(const Topology& topo, const PackedLayout& L, SparsePlan& plan, PlanState& state, bool with_chunks,
                   cudaStream_t stream, Release release = Release::device_wait);

// The k2q CSR, partial slots and work items of `topk` ([Hkv, total_q, 16] int32 on the
// device) into the plan's buffers; invalid entries set plan.status (they are left out).
// Nothing waits for the device; sort scratch comes from the stream-ordered allocator.
void build_schedule(const Topology& topo, const TensorView& topk, SparsePlan& plan, PlanState& state, bool with_chunks,
                    cudaStream_t stream);

}  // namespace msa::cuda
