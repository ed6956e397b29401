// Packed variable-length documents: which query and key tokens belong to which document,
// and where each query sits causally inside its document.
#pragma once

#include <cstdint>
#include <vector>

#include "msa/tensor.h"

namespace msa {

// One document (or one context-parallel fragment, or one chunked-prefill request).
// Query i of the document has causal position k_len - q_len + i (bottom-right alignment).
struct DocumentSpan {
  int64_t q_start = 0;  // first row in the packed query tensor
  int64_t q_len = 0;
  int64_t k_start = 0;  // first row in the packed key tensor (fragment-redirected)
  int64_t k_len = 0;    // keys visible to the document's last query
};

class PackedLayout {
 public:
  // cu_seqlens_q / cu_seqlens_k: [batch + 1] cumulative lengths starting at 0.
  // fragment_indices (optional, [batch]): fragment b reads keys
  //   [cu_seqlens_k[fragment_indices[b]], cu_seqlens_k[b + 1]), so fragments of one document
  //   can share one stored KV range (context parallelism).
  static PackedLayout from_cu_seqlens(std::vector<int32_t> cu_seqlens_q, std::vector<int32_t> cu_seqlens_k,
                                      std::vector<int32_t> fragment_indices = {});
  // The same from int32 CPU tensors ([batch + 1], [batch + 1], optional [batch]).
  static PackedLayout from_tensors(const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                   const TensorView& fragment_indices = {});
  // document_map: [batch, seq] int32 tensor (any strides); 0 marks padding, any other value
  // is a document id. Ids are per row (each row is one sequence; equal ids in two rows are
  // two documents) and a document must be one contiguous run of its row. Documents are
  // packed in the order they appear (row-major); queries and keys are the same tokens.
  // A CUDA map is reduced on its device to the runs of equal values of each row, ordered on
  // `stream` (a cudaStream_t, may be null); the host waits once for that compact result and
  // finishes the layout exactly as for a CPU map (same checks, same errors). The layout is a
  // host object either way; a CUDA map cannot be read during CUDA-graph capture.
  static PackedLayout from_document_map(const TensorView& document_map, void* stream = nullptr);

  int num_documents() const { return int(docs_.size()); }
  const DocumentSpan& document(int b) const { return docs_[size_t(b)]; }
  const std::vector<DocumentSpan>& documents() const { return docs_; }
  int64_t total_q() const { return total_q_; }
  int64_t total_k() const { return total_k_; }
  int64_t max_seqlen_q() const { return max_q_; }
  int64_t max_seqlen_k() const { return max_k_; }
  // Σ_b ceil(k_len_b / block_size): CSR rows, counting fragments that share storage.
  int64_t total_rows(int block_size = 128) const;

  const std::vector<int32_t>& cu_seqlens_q() const { return cu_q_; }
  const std::vector<int32_t>& cu_seqlens_k() const { return cu_k_; }
  const std::vector<int32_t>& fragment_indices() const { return fragment_; }

  // Document index of every packed query row ([total_q]).
  const std::vector<int32_t>& query_document() const { return query_doc_; }

  // Only for layouts made from a document map: the padded shape and, for every padded
  // position (row-major), its packed row or -1 for padding.
  bool has_document_map() const { return padded_batch_ > 0; }
  int64_t padded_batch() const { return padded_batch_; }
  int64_t padded_seq() const { return padded_seq_; }
  const std::vector<int64_t>& packed_row_of_padded() const { return packed_row_; }
  // Padded position (row-major) of every document's first token: document b occupies padded
  // positions [start_b, start_b + q_len_b) and packed rows [q_start_b, q_start_b + q_len_b).
  const std::vector<int64_t>& document_padded_start() const { return padded_start_; }

 private:
  void finish();
  std::vector<int32_t> cu_q_, cu_k_, fragment_;
  std::vector<DocumentSpan> docs_;
  std::vector<int32_t> query_doc_;
  std::vector<int64_t> packed_row_;
  std::vector<int64_t> padded_start_;
  int64_t padded_batch_ = 0, padded_seq_ = 0;
  int64_t total_q_ = 0, total_k_ = 0, max_q_ = 0, max_k_ = 0;
};

// [batch, seq, ...] -> [tokens, ...] for a layout made from a document map. The trailing
// dimensions must match; dtypes must match; both tensors contiguous and on the same device.
// On CUDA tensors the copy is a kernel ordered on `stream` (a cudaStream_t, may be null) that
// reads no device metadata (the layout's document table travels as kernel arguments): it
// does not wait for the device and can be captured in a CUDA graph.
void pack(const PackedLayout& layout, const TensorView& padded, const TensorView& packed, void* stream = nullptr);
// [tokens, ...] -> [batch, seq, ...]; padding positions are set to zero.
void unpack(const PackedLayout& layout, const TensorView& packed, const TensorView& padded, void* stream = nullptr);

}  // namespace msa
