// The parts of the msa._native module, one file each.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>

#include "msa/ops.h"

namespace msa::python {

// msa.MsaError and its subclasses; msa::Error is translated to them.
void bind_errors(nanobind::module_& m);
// Topology, PackedLayout, Plan.
void bind_types(nanobind::module_& m);
// select_blocks, build_plan, forward/backward, kl_backward, merge_states, pack/unpack.
void bind_ops(nanobind::module_& m);

// set_device_allocator / device_allocator: Python callables as msa's CUDA allocator.
void bind_allocator(nanobind::module_& m);

// include/msa/inference.h: paged caches, preprocessing, prefill / decode plans and runs.
void bind_inference(nanobind::module_& m);

// A built plan with the topology it was built for.
struct Plan {
  SparsePlan plan;
  Topology topology;
  std::optional<nanobind::ndarray<>> workspace;  // the caller's workspace, kept alive with the plan
};

}  // namespace msa::python
