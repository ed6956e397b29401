// `msa run-case`: runs the training path (indexer -> plan -> forward [-> backward -> KL])
// on the tensors of a safetensors file and writes the results to another.
//
// Inputs (names are exact; any other tensor name is an error):
//   q [total_q, Hq, 128] BF16, k, v [total_k, Hkv, 128] BF16,
//   index_q [total_q, Hi, 128] BF16, index_k [total_k, 1, 128] BF16,
//   cu_seqlens_q, cu_seqlens_k [B + 1] I32, optional fragment_indices [B] I32,
//   optional topk [Hi, total_q, 16] I32 (then the indexer is skipped),
//   optional grad_out [total_q, Hq, 128] BF16 (then backward and KL run).
// Head counts come from the shapes: Hq = q.shape[1], Hkv = k.shape[1], Hi = index_q.shape[1].
// __metadata__ (string values): mode (training | decode | paged_prefill; default training),
//   init_blocks, local_blocks, lse_temperature, softmax_scale, index_scale, q_per_cta,
//   kl_grad_scale, format (ignored). Any other key is an error.
//
// Outputs: topk I32 [Hi, total_q, 16], out BF16 [total_q, Hq, 128], lse F32 [total_q, Hq],
//   indexer_lse F32 [Hi, total_q] (LSE of the index scores over the selected causal keys
//   divided by lse_temperature: from the library's indexer when it ran; when topk was given,
//   computed by the tool on the host in float64 over the given selection), and with grad_out:
//   dq F32 [total_q, Hq, 128], dk, dv F32 [total_k, Hkv, 128], dindex_q F32 [total_q, Hi, 128],
//   dindex_k F32 [total_k, 1, 128]. Gradients are written in F32 (the library's fp32
//   accumulators, unrounded) so that checks measure the kernels, not a final bf16 rounding.
//   The KL uses the indexer LSE at temperature 1 and grad_scale = kl_grad_scale
//   (0 or absent = 1 / (Hi * total_q)).
#pragma once

#include <string>

#include "inference_case.h"

namespace msa::tool {

// Returns the exit code (0) and prints a one-line summary; throws msa::Error on bad input.
int run_case(const std::string& in_path, const std::string& out_path, const RunCaseOptions& options);
// The same on a file already read (an empty `out_path` writes nothing: the fuzz target).
int run_case(const SafetensorsFile& in, const std::string& out_path, const RunCaseOptions& options);

}  // namespace msa::tool
