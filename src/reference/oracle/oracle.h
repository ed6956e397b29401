// The float64 brute-force oracle: an implementation of the MSA semantics written straight
// from the specification (docs/semantics.md §3-§8), independent of the library's backends.
// It favours obviousness over speed: dense per-row key lists, double accumulation, no
// blocking. Inputs are fp32 arrays (bf16 tensors upcast exactly), row-major, packed like the
// library's tensors; outputs are double.
// Reference code, not part of the installed library: `msa demo` and the C++ tests check
// against it (docs/architecture.md says which reference is the ground truth for what).
//
// Conventions shared by every function:
//   * Documents come from cu_seqlens (+ optional fragment indices) through `documents()`.
//   * Query i of a document sits at causal position p = k_len - q_len + i (bottom-right).
//   * Block ids are document-local; the keys of block b are document-local tokens
//     [128 b, 128 b + 127] that are < k_len; the key of token t is packed row k_start + t.
//   * Query head h uses KV head / index head g = h / (Hq / Hkv).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "msa/topology.h"

namespace msa::oracle {

// One document (or fragment) of a packed batch.
struct Doc {
  int64_t q_start = 0, q_len = 0;  // packed query rows [q_start, q_start + q_len)
  int64_t k_start = 0, k_len = 0;  // packed key rows [k_start, k_start + k_len)
};

// Spec §5.1: document b owns queries [cu_q[b], cu_q[b+1]) and keys
// [cu_k[f], cu_k[b+1]) with f = fragment_indices[b] (or b without fragments).
std::vector<Doc> documents(const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k,
                           const std::vector<int32_t>& fragment_indices = {});

// Total packed query rows of a document list.
int64_t total_queries(const std::vector<Doc>& docs);

// Causal position of query i of document d.
inline int64_t position(const Doc& d, int64_t i) { return d.k_len - d.q_len + i; }

// softmax scale / index scale of a topology, in double.
double attention_scale(const Topology& topo);
double index_scale(const Topology& topo);

// ---------------------------------------------------------------------------------------
// Indexer (docs/semantics.md §3).

// The selection of one (query row, index head) with its ingredients, for tests that need to
// judge near-ties.
struct RowSelection {
  int64_t position = 0;               // causal position p of the query
  int num_visible = 0;                // nvis = p / 128 + 1
  std::vector<double> block_scores;   // [nvis] max over visible tokens of the index score (NaN if any is NaN)
  std::vector<int32_t> forced_init;   // init blocks outside the local range, ascending
  std::vector<int32_t> ranked;        // history picked by (score desc, id asc)
  std::vector<int32_t> forced_local;  // local range, ascending: the query's own block is last
  int ranked_slots = 0;               // slots left for ranked history (min(topk, nvis) - forced)
  // Valid prefix of the output row: init, ranked history, local.
  std::vector<int32_t> ids() const;
};

// Selection rule: count = min(topk, nvis); init range [0, min(I, nvis)) and local range
// [max(0, nvis - L), nvis) are forced; the remaining slots take the best other visible blocks by
// (block score desc, block id asc). When nvis <= topk every visible block is selected. When
// ranking is needed, NaN-scored blocks are never ranked (their slots stay -1 if no finite
// candidate is left).
RowSelection select_row(const Topology& topo, const Doc& doc, int64_t query_in_doc, int head,
                        const float* index_q,   // [total_q, Hi, Di]
                        const float* index_k);  // [total_k, 1, Di]

// Full selection: [Hi, total_q, topk] int32, -1 padded.
std::vector<int32_t> select_blocks(const Topology& topo, const std::vector<Doc>& docs, const float* index_q,
                                   const float* index_k);

// Natural-log LSE over the selected causal keys of the index scores scaled by 1/temperature:
// lse[g, row] = log Σ_t exp(s(p, t) / temperature), s = index_scale <qi_g(p), ki(t)>.
// `topk` is any [Hi, total_q, topk] selection (e.g. the library's). Empty rows give -inf.
std::vector<double> selected_lse(const Topology& topo, const std::vector<Doc>& docs, const float* index_q,
                                 const float* index_k, const int32_t* topk, double temperature = 1.0);

// ---------------------------------------------------------------------------------------
// Main branch (docs/semantics.md §4, §6).

struct AttentionResult {
  std::vector<double> out;  // [total_q, Hq, D]
  std::vector<double> lse;  // [total_q, Hq], -inf for rows without keys
  std::vector<double> dq;   // [total_q, Hq, D]   (backward only)
  std::vector<double> dk;   // [total_k, Hkv, D]  (backward only)
  std::vector<double> dv;   // [total_k, Hkv, D]  (backward only)
};

// Forward: mask = selected blocks of index head g AND t <= p. `rows` restricts the work to
// some packed query rows (others are left 0 / -inf in the result); empty = all rows.
AttentionResult attention_forward(const Topology& topo, const std::vector<Doc>& docs,
                                  const float* q,       // [total_q, Hq, D]
                                  const float* k,       // [total_k, Hkv, D]
                                  const float* v,       // [total_k, Hkv, D]
                                  const int32_t* topk,  // [Hkv, total_q, topk]
                                  int64_t total_k, const std::vector<int64_t>& rows = {});

// Forward and backward of the same: dq; dk, dv summed over the query heads of a group.
AttentionResult attention_backward(const Topology& topo, const std::vector<Doc>& docs, const float* q, const float* k,
                                   const float* v, const int32_t* topk,
                                   const float* dout,  // [total_q, Hq, D]
                                   int64_t total_k);

// ---------------------------------------------------------------------------------------
// KL backward (docs/semantics.md §7): per (row, index head g) over the
// selected causal keys, teacher = mean over the group's heads of exp(z - lse),
// student = exp(s - index_lse), ds = (student - teacher) * grad_scale,
// dindex_q = Σ ds ki * index_scale, dindex_k += ds qi * index_scale.
struct KlResult {
  std::vector<double> dindex_q;  // [total_q, Hi, Di]
  std::vector<double> dindex_k;  // [total_k, 1, Di]
};
KlResult kl_backward(const Topology& topo, const std::vector<Doc>& docs, const float* q, const float* k,
                     const float* lse,        // [total_q, Hq]
                     const float* index_q, const float* index_k,
                     const float* index_lse,  // [Hi, total_q]
                     const int32_t* topk, int64_t total_k, double grad_scale);

// ---------------------------------------------------------------------------------------
// k2q CSR and schedule (docs/semantics.md §5).
struct Plan {
  int64_t total_rows = 0;
  std::vector<int32_t> rows;          // [total_rows, 2] (document, kv_block), level-major
  std::vector<int32_t> row_ptr;       // [Hkv, total_rows + 1]
  std::vector<int32_t> q_indices;     // [Hkv, total_q * topk], document-local, ascending per row, -1 tail
  std::vector<int32_t> split_slot;    // [Hkv, total_q * topk], -1 tail
  std::vector<int32_t> split_counts;  // [total_q, Hkv]
  std::vector<int64_t> used_edges;    // [Hkv] valid entries of q_indices per head
  // (head_kv, row, q_begin, q_count, document, kv_block) in (head, row, q_begin) order.
  std::vector<std::array<int32_t, 6>> work;
};
Plan build_plan(const Topology& topo, const std::vector<Doc>& docs, const int32_t* topk, int q_per_cta);

// ---------------------------------------------------------------------------------------
// Merge of partial states (ops.h MergeStatesParams).
struct MergeResult {
  std::vector<double> out;  // [rows, H, D]
  std::vector<double> lse;  // [rows, H]
};
MergeResult merge_states(const float* out_partials,  // [S, rows, H, D]
                         const float* lse_partials,  // [S, rows, H]
                         int64_t S, int64_t rows, int64_t H, int64_t D);

}  // namespace msa::oracle
