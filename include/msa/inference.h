// Inference-path operations: paged KV caches (page = 128 tokens = one sparse block),
// pre-processing (Gemma RMSNorm + partial NeoX RoPE, cache insertion), FP8 / NVFP4 caches,
// and plan / run for paged (chunked) prefill and decode.
//
// Flow of one engine step:
//   1. plan_paged_prefill / plan_decode: request metadata (seq_lens, page tables,
//      cu_seqlens_q or q_len_per_req) -> InferencePlan. Built once per step, shared by every
//      sparse layer; holds the device copies of the metadata and all scratch memory.
//   2. per layer: rms_norm_rope on q and index_q, insert_kv (norm + RoPE of k / index_k on the
//      way into the caches), then paged_forward (indexer + attention) or the two halves
//      paged_indexer / paged_attention. Decode runs never allocate; a CUDA prefill attention
//      run takes its schedule's sort scratch from the stream-ordered device allocator.
//
// Conventions shared by every operation here:
//   * Query row r of request b has causal position pos = seq_lens[b] - q_len_b + i
//     (bottom-right alignment; i = its index inside the request's chunk). Rows with pos < 0
//     (decode padding rows, seq_lens[b] = 0) attend nothing: top-k all -1, out 0, lse -inf.
//   * Top-k entries are request-local logical page ids (= block ids); valid entries form a
//     prefix, are unique, lie in [0, pos / 128]; producers put the local page last.
//   * Cache views may have any int64 strides; only the last dimension must be contiguous
//     (e.g. K and V as the two halves of a combined [pages, Hkv, 128, 256] cache). On CUDA the
//     rows of q, the K / V caches and the index-K cache must start at 16-byte aligned
//     addresses (NVFP4 block scales: 8-byte), which such views keep.
//   * A call that throws msa::Error has not written to any output.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "msa/layout.h"
#include "msa/ops.h"
#include "msa/tensor.h"
#include "msa/topology.h"

namespace msa {

// ---------------------------------------------------------------------------------------
// Paged KV caches

enum class KvFormat : uint8_t {
  bf16,      // K/V stored as bf16
  fp8_e4m3,  // K/V stored as FP8 E4M3 codes; value = code * scale (per tensor or per head-token)
  nvfp4,     // K/V stored as packed E2M1 codes with one E4M3 scale per 16 elements
};

// The main K and V cache of one layer.
//
// bf16 / fp8_e4m3: k, v [physical_pages, Hkv, 128, 128] bf16 or fp8_e4m3.
// nvfp4: k, v [physical_pages, Hkv, 128, 64] uint8, two E2M1 codes per byte (element 2i in the
//   low nibble, 2i+1 in the high nibble; bit 3 of a code is the sign, magnitudes
//   {0, 0.5, 1, 1.5, 2, 3, 4, 6}); k_block_scale, v_block_scale [physical_pages, Hkv, 128, 8]
//   fp8_e4m3, scale j covering elements 16j..16j+15. Dequantised element =
//   E4M3(clamp(e2m1 * block_scale, -448, 448)), i.e. the product rounded to E4M3.
//
// k_scale / v_scale (f32, both given or both absent; absent = 1):
//   fp8_e4m3: a per-tensor scale (rank 0 or [1]) or per-(KV head, token slot) scales
//     [Hkv, max_kv_tokens] with token slot = physical_page * 128 + offset in page and
//     max_kv_tokens >= physical_pages * 128. Dequantised element = e4m3 value * scale (fp32).
//   nvfp4: an optional per-tensor global scale (rank 0 or [1]) that multiplies the dequantised
//     E4M3 value above (fp32; equivalently k_scale scales the logits, v_scale the output).
//   bf16: must be absent.
// The dequantised values are exact fp32 numbers; backends may fold the scales into the logits
// and output instead of rounding the products.
struct PagedKvCache {
  KvFormat format = KvFormat::bf16;
  TensorView k;              // [physical_pages, Hkv, 128, 128] bf16 / fp8_e4m3, or [.., 64] u8 (nvfp4)
  TensorView v;              // same shape and dtype as k
  TensorView k_block_scale;  // nvfp4 only: [physical_pages, Hkv, 128, 8] fp8_e4m3
  TensorView v_block_scale;  // nvfp4 only: [physical_pages, Hkv, 128, 8] fp8_e4m3
  TensorView k_scale;        // optional f32: [] / [1] per tensor, or fp8 only [Hkv, max_kv_tokens]
  TensorView v_scale;        // optional f32: like k_scale
};

// The index-K side cache: one 128-vector per token, shared by all index heads:
// [physical_pages, 128, 128] bf16 or fp8_e4m3 (FP8: plain saturating cast, scale 1). It uses
// the same physical page ids (and page table) as the main cache.

// ---------------------------------------------------------------------------------------
// Pre-processing

// Gemma RMSNorm followed by partial NeoX RoPE (docs/semantics.md §9.7), per (token, head) row of 128:
//   y = bf16(x * rsqrt(mean(x^2) + eps) * (1 + w))            (fp32 math)
//   for j < rotary_dim / 2: inv_freq_j = fp32(rope_theta^(-2j / rotary_dim)),
//     angle = fp32(pos * inv_freq_j), c = cos(angle), s = sin(angle)   (fp32)
//     y[j] = y1*c - y2*s,  y[j + rotary_dim/2] = y2*c + y1*s   with y1 = y[j], y2 = y[j + rotary_dim/2]
//   dims >= rotary_dim unchanged; result rounded to bf16.
struct NormRopeConfig {
  int rotary_dim = 64;       // even, in [0, 128]; 0 = norm only
  float eps = 1e-6f;
  float rope_theta = 5e6f;
};

struct RmsNormRopeParams {
  TensorView x;          // [tokens, H, 128] bf16 (any row strides, last dim contiguous)
  TensorView weight;     // [128] bf16 or f32: Gemma weight, applied as (1 + w)
  TensorView positions;  // [tokens] int32: position of each token inside its request/document
                         //   (required when rotary_dim > 0)
  TensorView out;        // out: [tokens, H, 128] bf16 (any strides, last dim contiguous); may be
                         //   the very same view as x (in place), must not partially overlap it
  NormRopeConfig config;
};
void rms_norm_rope(const RmsNormRopeParams& p, const RunOptions& opt = {});

// Writes new tokens into the paged caches. Slot s = physical_page * 128 + offset; s = -1
// skips the token. Non-negative slots must be unique and < physical_pages * 128.
// With k_norm / index_k_norm given, Gemma RMSNorm + RoPE (config, positions) are applied to
// k / index_k on the way into the cache (the inputs are not modified); v is stored as is.
// Quantised caches are written as follows:
//   fp8_e4m3, per-tensor scale (or none): code = E4M3(x / scale), saturating at +-448.
//   fp8_e4m3, per-(head, token) scales: scale[h, slot] = max|x| / 448 over the 128 values
//     (1 when all are 0) is written, then code = E4M3(x / scale).
//   nvfp4: per 16 elements, y = x / global_scale, block scale = E4M3(max|y| / 6), codes =
//     nearest E2M1 of y / block_scale (ties to even, clamped to +-6; 0 when the scale is 0).
//   index-K fp8_e4m3: code = E4M3(x).
struct KvInsertParams {
  TensorView k;              // [tokens, Hkv, 128] bf16 (any row strides, last dim contiguous)
  TensorView v;              // [tokens, Hkv, 128] bf16 (any row strides, last dim contiguous)
  TensorView index_k;        // optional [tokens, 1, 128] bf16; requires index_k_cache
  TensorView slot_mapping;   // [tokens] int32: physical_page * 128 + offset, -1 = skip
  PagedKvCache cache;        // destination (written in place; per-token / nvfp4 scales too)
  TensorView index_k_cache;  // [physical_pages, 128, 128] bf16 or fp8_e4m3 (with index_k)
  TensorView k_norm;         // optional [128] bf16 or f32: norm + RoPE k before inserting
  TensorView index_k_norm;   // optional [128] bf16 or f32: norm + RoPE index_k before inserting
  TensorView positions;      // [tokens] int32, required with k_norm / index_k_norm
  NormRopeConfig config;
};
void insert_kv(const KvInsertParams& p, const RunOptions& opt = {});

// NVFP4 -> FP8 E4M3 conversion of one cache (call it for K and for V). Every element becomes
// E4M3(clamp(e2m1 * block_scale, -448, 448)), which is exactly the NVFP4 dequantised value,
// so the FP8 cache with the NVFP4 global scale as its per-tensor scale holds the same values.
//   page_ids absent: the whole cache, out page i <- page i (out has the same page count).
//   page_ids [n] int32: out page i <- cache page page_ids[i]; -1 leaves out page i untouched.
struct Nvfp4ToFp8Params {
  TensorView packed;       // [physical_pages, Hkv, 128, 64] uint8 (last dim contiguous)
  TensorView block_scale;  // [physical_pages, Hkv, 128, 8] fp8_e4m3 (last dim contiguous)
  TensorView page_ids;     // optional [n] int32 (CPU or the device of packed)
  TensorView out;          // out: [n or physical_pages, Hkv, 128, 128] fp8_e4m3 (last dim contiguous)
};
void nvfp4_to_fp8(const Nvfp4ToFp8Params& p, const RunOptions& opt = {});

// Positions of the tokens of a packed (training) layout: restart at 0 in every document,
// bottom-right aligned (k_len - q_len + i). [total_q] values.
std::vector<int32_t> document_positions(const PackedLayout& layout);

// ---------------------------------------------------------------------------------------
// Plan: one step's request metadata, checked once and copied to the device with the scratch
// memory of the runs. The metadata tensors are read on the host (CPU tensors).

struct PagedPrefillMetadata {
  TensorView cu_seqlens_q;  // [batch + 1] int32: query rows of request b are [cu[b], cu[b+1])
  TensorView seq_lens;      // [batch] int32: KV length of request b including this chunk
                            //   (cached prefix = seq_lens[b] - q_len_b >= 0)
  TensorView page_table;    // [batch, max_pages] int32: logical page -> physical page, any order;
                            //   entries past ceil(seq_lens[b] / 128) are never read
};

struct DecodeMetadata {
  TensorView seq_lens;      // [batch] int32: KV length including this step's Q tokens;
                            //   0 marks a padding row, otherwise >= q_len_per_req
  TensorView page_table;    // [batch, max_pages] int32, as above
  int q_len_per_req = 1;    // Q in [1, 16]: query rows b*Q .. b*Q + Q - 1 belong to request b
};

struct InferencePlanOptions {
  Device device = Device::cpu();  // where the run tensors live
  int num_kv_splits = 0;          // decode split-K over the 16 top-k slots: 1, 2, 4, 8 or 16;
                                  //   0 = automatic (more splits for small batches)
  int num_threads = 0;            // CPU: most threads a run uses (scratch is sized for them);
                                  //   0 = OpenMP's default
  void* stream = nullptr;         // CUDA: the cudaStream_t the plan's uploads are queued on
                                  //   (nullptr: the legacy default stream); its memory is given
                                  //   back in this stream's order, so the stream must outlive
                                  //   the plan. Planning never waits for the device; a run on
                                  //   another stream waits for the uploads on the device (an
                                  //   event), except under stream capture: capture on the
                                  //   plan's stream, or after a run of the plan on the
                                  //   capturing stream outside the capture.
};

enum class InferencePhase : uint8_t { prefill, decode };

// Immutable after planning, except for the scratch buffers a run writes: one run at a time
// per plan (copies of a plan share its buffers).
struct InferencePlan {
  InferencePhase phase = InferencePhase::prefill;
  Topology topo;
  Device device{};
  int64_t batch = 0;
  int64_t total_q = 0;
  int64_t max_pages = 0;             // page_table width
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
  int64_t max_physical_page = -1;    // largest physical page read (-1: none); caches need more
  int q_len_per_req = 0;             // decode: Q; prefill: 0 (varies per request)
  int num_kv_splits = 1;             // decode: split-K groups of the 16 slots; prefill: 1
  int num_threads = 1;               // CPU threads the scratch is sized for

  Buffer cu_seqlens_q;   // [batch + 1] int32 (decode: b * Q)
  Buffer seq_lens;       // [batch] int32
  Buffer page_table;     // [batch, max_pages] int32
  Buffer positions;      // [total_q] int32: causal position of each row; < 0 for padding rows
  Buffer query_request;  // [total_q] int32: request of each row
  Buffer slot_mapping;   // [total_q] int32: cache slot of each row's token (page * 128 + offset),
                         //   -1 for padding rows; feed it to insert_kv for this step's tokens
  Buffer partial_out;    // decode: [num_kv_splits, total_q, Hq, 128] f32 split-K partial outputs
  Buffer partial_lse;    // decode: [num_kv_splits, total_q, Hq] f32 split-K partial LSEs
  Buffer split_arrivals; // CUDA decode with num_kv_splits > 1: [tiles * Hkv] int32, the split
                         //   CTAs of a (query tile, KV head) that are done (zero between steps)
  Buffer scratch_f32;    // CPU: [num_threads, n] f32 per-thread work space; CUDA: indexer page
                         //   scores [rows, Hi * history pages] for a chunk of rows
  // CUDA prefill plans: the attention's schedule buffers and partial states (16 per query
  // and head: 0.26 MB per query row with 64 heads), sized for the step.
  std::shared_ptr<void> backend;
  // CUDA: the plan's streams. Runs on a stream other than the latest uploads' (plan_*,
  // update_decode_plan) wait for them on the device; when the last copy of the plan goes, the
  // stream it was made on (InferencePlanOptions::stream) waits on the device for the plan's
  // runs on other streams and its latest update, and the buffers above go back to the
  // allocator in that stream's order: releasing a plan never waits for the device. Keep it the
  // last member (members are destroyed last to first: this ordering is queued before the
  // buffers are given back); assignment releases the old plan the same way.
  std::shared_ptr<void> streams;

  InferencePlan() = default;
  InferencePlan(const InferencePlan&) = default;
  InferencePlan(InferencePlan&&) noexcept = default;
  InferencePlan& operator=(const InferencePlan& other);
  InferencePlan& operator=(InferencePlan&& other) noexcept;
  ~InferencePlan() = default;
};

InferencePlan plan_paged_prefill(const Topology& topo, const PagedPrefillMetadata& meta,
                                 const InferencePlanOptions& options = {});
InferencePlan plan_decode(const Topology& topo, const DecodeMetadata& meta,
                          const InferencePlanOptions& options = {});

// Decode under CUDA graphs: rewrites a decode plan's device metadata in place for the next step
// (new seq_lens and page_table, checked like plan_decode), so that a graph captured with the
// plan's runs replays on the new step without a new plan. The step must keep the plan's batch,
// q_len_per_req and page_table width, and no seq_lens may exceed the plan's max_seqlen_k (make
// the plan with the longest context the graph will serve); the split count stays the plan's.
// The copies are ordered on opt.stream: call it before the replay on the replay's stream, not
// during a capture. Copies of a plan share its device buffers (they see the new step) but keep
// their own max_physical_page.
void update_decode_plan(InferencePlan& plan, const DecodeMetadata& meta, const RunOptions& opt = {});

// ---------------------------------------------------------------------------------------
// Run (per layer)

// Indexer over the paged index-K cache. For row r (position pos, local page = pos / 128,
// nvis = local + 1) and index head g: if nvis <= 16, top-k = 0, 1, ..., local; otherwise the
// 15 history pages b < local with the largest S(b) = max over the page's tokens of
// <index_q[r, g], index_k(t)> (fp32 accumulation), ties to the lower page id, pages with a NaN
// score never chosen, in that order, then the local page. With other topo.init_blocks I /
// local_blocks L: init pages [0, I) ascending, ranked pages, the L last visible pages
// ascending (own page last), like select_blocks.
struct PagedIndexerParams {
  TensorView index_q;        // [total_q, Hi, 128] bf16 or fp8_e4m3 (any row strides, last dim contiguous)
  TensorView index_k_cache;  // [physical_pages, 128, 128] bf16 or fp8_e4m3 (any strides, last dim contiguous)
  TensorView topk;           // out: [Hi, total_q, 16] int32 logical page ids, local last, -1 padded
};
void paged_indexer(const InferencePlan& plan, const PagedIndexerParams& p, const RunOptions& opt = {});

// Sparse attention over the paged caches. Row r, head h, group g = h / 16: keys = tokens
// t <= pos of the logical pages in topk[g, r] (valid prefix, any order); softmax scale
// topo.attention_scale(), fp32 online softmax. Decode splits the 16 slots into
// plan.num_kv_splits groups and merges the partial states by LSE (merge_states semantics).
// Rows with no keys: out 0, lse -inf.
struct PagedAttentionParams {
  TensorView q;      // [total_q, Hq, 128] bf16 (any row strides, last dim contiguous)
  PagedKvCache kv;
  TensorView topk;   // [Hkv, total_q, 16] int32 (from paged_indexer); paged_forward: absent or
                     //   the indexer's topk
  TensorView out;    // out: [total_q, Hq, 128] bf16 or f32
  TensorView lse;    // out: [total_q, Hq] f32, natural log
};
void paged_attention(const InferencePlan& plan, const PagedAttentionParams& p, const RunOptions& opt = {});

// Indexer then attention with its top-k (attention.topk must be absent or the same tensor as
// indexer.topk). Everything is validated before anything is written.
void paged_forward(const InferencePlan& plan, const PagedIndexerParams& indexer,
                   const PagedAttentionParams& attention, const RunOptions& opt = {});

}  // namespace msa
