// The inference backend interface: entry points each backend implements for inputs that
// src/core/inference*.cpp has already validated, plus the small facts about a checked
// PagedKvCache that every backend reads the same way.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "msa/constants.h"
#include "msa/inference.h"

namespace msa {

// How the f32 k_scale / v_scale of a (validated) cache apply.
enum class KvScaleMode : uint8_t {
  none,            // absent: scale 1
  per_tensor,      // one value (rank 0 or [1]); fp8: multiplies the code, nvfp4: global scale
  per_head_token,  // fp8 only: [Hkv, max_kv_tokens], slot = physical_page * 128 + offset
};

inline KvScaleMode kv_scale_mode(const PagedKvCache& c) {
  if (!c.k_scale.present()) return KvScaleMode::none;
  return c.k_scale.rank == 2 ? KvScaleMode::per_head_token : KvScaleMode::per_tensor;
}

// The merge of a decode plan's split-K partials into the caller's out / lse.
inline MergeStatesParams split_merge_params(const InferencePlan& plan, const PagedAttentionParams& p) {
  MergeStatesParams merge;
  merge.out_partials = plan.partial_out.view();
  merge.lse_partials = plan.partial_lse.view();
  merge.out = p.out;
  merge.lse = p.lse;
  return merge;
}

// The model constants under the names src/core/inference*.cpp use (aliases of msa::model's).
using model::kHeadDim;
using model::kPageSize;
using model::kTopk;

inline constexpr int kNvfp4GroupSize = 16;                          // elements per E4M3 block scale
inline constexpr int kNvfp4RowBytes = model::kHeadDim / 2;          // two E2M1 codes a byte
inline constexpr int kNvfp4RowScales = model::kHeadDim / kNvfp4GroupSize;  // block scales per 128-row

namespace cpu {
void rms_norm_rope(const RmsNormRopeParams&, const RunOptions&);
void insert_kv(const KvInsertParams&, const RunOptions&);
void nvfp4_to_fp8(const Nvfp4ToFp8Params&, const RunOptions&);
void paged_indexer(const InferencePlan&, const PagedIndexerParams&, const RunOptions&);
void paged_attention(const InferencePlan&, const PagedAttentionParams&, const RunOptions&);
// Per-thread scratch sizes (elements) the CPU runs need for a plan.
int64_t inference_scratch_f32(const InferencePlan&);
}  // namespace cpu

// Defined only in builds with the CUDA backend (src/cuda/inference/); src/core/inference.cpp
// reaches them through detail::dispatch (core/dispatch.h), which calls none of them in other builds.
namespace cuda {
void rms_norm_rope(const RmsNormRopeParams&, const RunOptions&);
void insert_kv(const KvInsertParams&, const RunOptions&);
void nvfp4_to_fp8(const Nvfp4ToFp8Params&, const RunOptions&);
void paged_indexer(const InferencePlan&, const PagedIndexerParams&, const RunOptions&);
void paged_attention(const InferencePlan&, const PagedAttentionParams&, const RunOptions&);
// Decode attention CTAs (for Q rows per request) that run at once on `device`: its SM count
// times the CTAs of the kernel that fit on an SM (the fewest over the cache formats).
int64_t decode_attention_concurrency(int device, int q_len_per_req);
// Paged prefill attention runs on the KV-outer forward (src/cuda/inference/paged_prefill.cu):
// the state a prefill plan keeps for it (InferencePlan::backend), built from the step's
// host metadata, and the run.
// Its uploads are queued on `stream` (the plan's).
std::shared_ptr<void> prepare_paged_prefill(const InferencePlan&, const std::vector<int32_t>& cu_seqlens_q,
                                            const std::vector<int32_t>& seq_lens, void* stream);
void paged_prefill_attention(const InferencePlan&, const PagedAttentionParams&, const RunOptions&);
}  // namespace cuda

}  // namespace msa
