// Workloads shared by `msa demo` and `msa bench`: document packs, random inputs (i.i.d. or
// slowly drifting index vectors), the useful-FLOP convention, selection statistics and the
// timing helpers.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "msa/layout.h"
#include "msa/tensor.h"
#include "msa/topology.h"

namespace msa::tool {

// ---- document packs ----

// The demo's mixed pack: 4096 + 2500 + 1200 + 300 + 129 + 1 = 8226 tokens, scaled to
// `total_tokens` (the 129- and 1-token documents are kept whenever there is room).
std::vector<int64_t> demo_document_lengths(int64_t total_tokens);
// The default demo size on `device` (larger on a GPU).
int64_t default_demo_tokens(Device device);
// Self-attention layout (queries and keys are the same tokens) of documents of these lengths.
PackedLayout layout_of_documents(const std::vector<int64_t>& lengths);
// Parses "4096,8192,16k,1m"-style lists of positive integers (k = 1024, m = 1024*1024).
std::vector<int64_t> parse_size_list(const std::string& text, const std::string& option);

// ---- random inputs ----

// Fills `n` bf16 values with normal(0, 1) * stddev, deterministically from (seed, stream)
// and independent of the thread count.
void fill_normal_bf16(uint16_t* dst, int64_t n, float stddev, uint64_t seed, uint64_t stream);

// Index vectors that drift slowly along each document: per (head, dim) an AR(1) sequence
// x_t = a x_{t-1} + sqrt(1 - a^2) e_t with a = exp(-1 / correlation_tokens) and
// e_t ~ normal(0, 1) * stddev, restarted at each document start.
// dst: [total_tokens, heads, dim] bf16.
void fill_drifting_bf16(uint16_t* dst, const PackedLayout& layout, bool along_keys, int heads, int dim,
                        float stddev, double correlation_tokens, uint64_t seed, uint64_t stream);

// How index vectors are drawn for a workload (architecture §5).
enum class Selection { independent, coherent };
std::string to_string(Selection s);
// --selection: "independent", "coherent" or "both" (independent first); refuses anything else.
std::vector<Selection> parse_selections(const std::string& text);

// ---- useful FLOPs (architecture §5) ----

// Σ over (index head g, query row) of the keys the row attends: t <= p inside its selected
// blocks. topk: [Hi, total_q, 16] int32 on the host.
double attended_pairs(const Topology& topo, const PackedLayout& layout, const int32_t* topk);
// Forward = 4 * Hq * 128 * visible (query, key) pairs = 4 * 128 * group_size * attended_pairs.
double forward_flops(const Topology& topo, const PackedLayout& layout, const int32_t* topk);
inline double backward_flops(const Topology& topo, const PackedLayout& layout, const int32_t* topk) {
  return 2.5 * forward_flops(topo, layout, topk);
}
// Indexer = 2 * 128 * Hi * causal (query, key) pairs.
double indexer_flops(const Topology& topo, const PackedLayout& layout);
// KL backward = (2 * 128 * group_size + 6 * 128) * attended_pairs: the teacher's scores over
// the group's query heads, and the index score with its two gradients.
double kl_flops(const Topology& topo, const PackedLayout& layout, const int32_t* topk);

// Mean over (index head, window) of the number of distinct blocks selected by 8 consecutive
// query tokens of one document (windows aligned to the document start). Only windows whose
// every token ranks history blocks (sees more than topk blocks) count, so that short
// prefixes, where every block is selected anyway, do not hide the pattern; when there is no
// such window, every full or partial window counts.
double mean_union_of_8(const Topology& topo, const PackedLayout& layout, const int32_t* topk);

// ---- formatting and timing ----

// "812 GFLOP/s" / "1.23 TFLOP/s"; "-" when seconds <= 0.
std::string format_rate(double flops, double seconds);
// "12.3 ms" / "1.52 s".
std::string format_time(double seconds);
std::string format_bytes(double bytes);

// Runs `work` once between two device synchronisations and returns the wall time in seconds.
double time_once(Device device, const std::function<void()>& work);
double median(std::vector<double> values);

}  // namespace msa::tool
