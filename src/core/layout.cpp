#include "msa/layout.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "core/check.h"
#include "core/dispatch.h"
#include "cuda/layout.h"  // declared in every build; reached only through detail::dispatch

namespace msa {

using detail::concat;
using detail::fail;
using detail::require;

namespace {

std::vector<int32_t> int32_vector(const TensorView& t, const char* name, const char* shape_name) {
  require(t.dtype == DType::i32, concat(name, " must be int32, got ", dtype_name(t.dtype)));
  require(t.rank == 1, concat(name, " must have shape ", shape_name, ", got ", t.shape_string()));
  require(!t.device.is_cuda(), concat(name, " must be a CPU tensor to build a layout on the host, got ", to_string(t.device)));
  require(t.is_contiguous(), concat(name, " must be contiguous"));
  const auto* p = t.as<const int32_t>();
  return std::vector<int32_t>(p, p + t.shape[0]);
}

void check_cumulative(const std::vector<int32_t>& cu, const char* name) {
  require(cu[0] == 0, concat(name, "[0] must be 0, got ", cu[0]));
  for (size_t i = 1; i < cu.size(); ++i)
    require(cu[i] >= cu[i - 1], concat(name, " must be non-decreasing, got ", name, "[", i - 1, "] = ", cu[i - 1],
                                       " > ", name, "[", i, "] = ", cu[i]));
}

}  // namespace

PackedLayout PackedLayout::from_cu_seqlens(std::vector<int32_t> cu_q, std::vector<int32_t> cu_k,
                                           std::vector<int32_t> fragment) {
  require(cu_q.size() == cu_k.size(),
          concat("cu_seqlens_q and cu_seqlens_k must have the same shape, got [", cu_q.size(), "] and [", cu_k.size(), "]"));
  require(cu_q.size() >= 2, concat("packed varlen inputs require batch >= 1 (cu_seqlens of shape [batch + 1] with at least 2 "
                                   "entries), got [", cu_q.size(), "]"));
  check_cumulative(cu_q, "cu_seqlens_q");
  check_cumulative(cu_k, "cu_seqlens_k");
  const size_t batch = cu_q.size() - 1;
  if (!fragment.empty()) {
    require(fragment.size() == batch,
            concat("fragment_indices must be contiguous with shape [B] = [", batch, "], got [", fragment.size(), "]"));
    for (size_t b = 0; b < batch; ++b)
      require(fragment[b] >= 0 && size_t(fragment[b]) <= b,
              concat("fragment_indices[", b, "] must be in [0, ", b, "] (a fragment reads keys from an earlier or its own "
                     "start), got ", fragment[b]));
  }
  PackedLayout L;
  L.cu_q_ = std::move(cu_q);
  L.cu_k_ = std::move(cu_k);
  L.fragment_ = std::move(fragment);
  L.finish();
  return L;
}

PackedLayout PackedLayout::from_tensors(const TensorView& cu_q, const TensorView& cu_k, const TensorView& fragment) {
  detail::check_present(cu_q, "cu_seqlens_q");
  detail::check_present(cu_k, "cu_seqlens_k");
  auto q = int32_vector(cu_q, "cu_seqlens_q", "[batch + 1]");
  auto k = int32_vector(cu_k, "cu_seqlens_k", "[batch + 1]");
  std::vector<int32_t> f;
  if (fragment.present()) f = int32_vector(fragment, "fragment_indices", "[batch]");
  return from_cu_seqlens(std::move(q), std::move(k), std::move(f));
}

void PackedLayout::finish() {
  const size_t batch = cu_q_.size() - 1;
  docs_.resize(batch);
  for (size_t b = 0; b < batch; ++b) {
    DocumentSpan& d = docs_[b];
    const int32_t k_begin = fragment_.empty() ? cu_k_[b] : cu_k_[size_t(fragment_[b])];
    d.q_start = cu_q_[b];
    d.q_len = cu_q_[b + 1] - cu_q_[b];
    d.k_start = k_begin;
    d.k_len = int64_t(cu_k_[b + 1]) - k_begin;
    require(d.k_len >= d.q_len,
            concat("document ", b, " has ", d.q_len, " queries but only ", d.k_len,
                   " keys: each query fragment must be the causal suffix of its KV range (q_len <= k_len)"));
    max_q_ = std::max(max_q_, d.q_len);
    max_k_ = std::max(max_k_, d.k_len);
  }
  total_q_ = cu_q_.back();
  total_k_ = cu_k_.back();
  query_doc_.assign(size_t(total_q_), 0);
  for (size_t b = 0; b < batch; ++b)
    std::fill(query_doc_.begin() + docs_[b].q_start, query_doc_.begin() + docs_[b].q_start + docs_[b].q_len, int32_t(b));
}

int64_t PackedLayout::total_rows(int block_size) const {
  int64_t rows = 0;
  for (const auto& d : docs_) rows += (d.k_len + block_size - 1) / block_size;
  return rows;
}

namespace {

// A run of equal values in one row of a document map: first position b * seq + s, its value.
struct Run {
  int64_t index;
  int32_t id;
};

// The runs of a CPU map, row-major (every row starts a run).
std::vector<Run> host_runs(const TensorView& map) {
  const int64_t B = map.shape[0], S = map.shape[1];
  const auto* p = map.as<const int32_t>();
  std::vector<Run> runs;
  for (int64_t b = 0; b < B; ++b) {
    int32_t prev = 0;
    for (int64_t s = 0; s < S; ++s) {
      const int32_t id = p[b * map.stride[0] + s * map.stride[1]];
      if (s == 0 || id != prev) runs.push_back({b * S + s, id});
      prev = id;
    }
  }
  return runs;
}

}  // namespace

PackedLayout PackedLayout::from_document_map(const TensorView& map, void* stream) {
  detail::check_present(map, "document_map");
  require(map.dtype == DType::i32, concat("document_map must be int32, got ", dtype_name(map.dtype)));
  require(map.rank == 2, concat("document_map must have shape [batch, seq], got ", map.shape_string()));
  const int64_t B = map.shape[0], S = map.shape[1];
  std::vector<Run> runs;
  if (map.device.is_cuda()) {
    detail::dispatch("document_map", map.device, [] {}, [&] {
      require(B * S < (int64_t(1) << 31),
              concat("document_map on a CUDA device must have batch * seq < 2^31 positions, got ", map.shape_string()));
      if (B * S > 0)
        for (const cuda::MapRun& r : cuda::document_map_runs(map, stream)) runs.push_back({r.index, r.id});
    });
  } else {
    runs = host_runs(map);
  }

  // The same walk for both devices, run by run: a document is a run of a non-zero id, and
  // an id may not start a second run in its row.
  std::vector<int32_t> cu{0};
  std::vector<int64_t> packed_row(size_t(B * S), -1), padded_start;
  int64_t next = 0;
  for (size_t r = 0; r < runs.size();) {
    const int64_t b = runs[r].index / S;
    std::unordered_set<int32_t> finished;  // ids of this row whose run has ended
    int32_t current = 0;
    for (; r < runs.size() && runs[r].index / S == b; ++r) {
      const int64_t at = runs[r].index, s = at - b * S;
      const int64_t end = (r + 1 < runs.size() && runs[r + 1].index / S == b) ? runs[r + 1].index : (b + 1) * S;
      const int32_t id = runs[r].id;
      if (id < 0) fail(concat("document_map[", b, ", ", s, "] must be >= 0 (0 = padding), got ", id));
      if (id != current) {
        if (current != 0) {
          finished.insert(current);
          cu.push_back(int32_t(next));
        }
        if (id != 0 && finished.count(id))
          fail(concat("document_map: document ", id, " of row ", b, " is not one contiguous run (it starts again at [", b,
                      ", ", s, "])"));
        current = id;
      }
      if (id != 0) {
        if (next + (end - at) > std::numeric_limits<int32_t>::max()) fail("document_map holds more than 2^31 - 1 tokens");
        padded_start.push_back(at);
        for (int64_t i = at; i < end; ++i) packed_row[size_t(i)] = next++;
      }
    }
    if (current != 0) {
      finished.insert(current);
      cu.push_back(int32_t(next));
    }
  }
  require(cu.size() >= 2, "document_map holds no tokens (all entries are 0 = padding)");
  PackedLayout L = from_cu_seqlens(cu, cu);
  L.padded_batch_ = B;
  L.padded_seq_ = S;
  L.packed_row_ = std::move(packed_row);
  L.padded_start_ = std::move(padded_start);
  return L;
}

namespace {

// Bytes of one token's trailing block, after checking that `padded` is [B, S, rest...] and
// `packed` is [T, rest...] with equal rest, dtype and contiguity.
int64_t check_pack_pair(const PackedLayout& L, const TensorView& padded, const TensorView& packed) {
  require(L.has_document_map(), "pack/unpack need a layout made by PackedLayout::from_document_map");
  detail::check_present(padded, "padded");
  detail::check_present(packed, "packed");
  require(padded.dtype == packed.dtype, concat("packed must have the dtype of padded (", dtype_name(padded.dtype),
                                               "), got ", dtype_name(packed.dtype)));
  require(padded.rank >= 2 && padded.shape[0] == L.padded_batch() && padded.shape[1] == L.padded_seq(),
          concat("padded must have shape [", L.padded_batch(), ", ", L.padded_seq(), ", ...], got ", padded.shape_string()));
  require(packed.rank == padded.rank - 1 && packed.shape[0] == L.total_q(),
          concat("packed must have shape [", L.total_q(), ", ...] with one dimension fewer than padded, got ",
                 packed.shape_string()));
  int64_t row = dtype_size(padded.dtype);
  for (int i = 2; i < padded.rank; ++i) {
    require(padded.shape[size_t(i)] == packed.shape[size_t(i - 1)],
            concat("packed trailing shape must match padded: padded ", padded.shape_string(), ", packed ", packed.shape_string()));
    row *= padded.shape[size_t(i)];
  }
  detail::check_contiguous(padded, "padded");
  detail::check_contiguous(packed, "packed");
  require(padded.device == packed.device, concat("packed must be on the device of padded (", to_string(padded.device),
                                                 "), got ", to_string(packed.device)));
  return row;
}

}  // namespace

void pack(const PackedLayout& L, const TensorView& padded, const TensorView& packed, void* stream) {
  const int64_t row = check_pack_pair(L, padded, packed);
  detail::dispatch("pack", padded.device, [&] {
    const auto& rows = L.packed_row_of_padded();
    auto* dst = static_cast<char*>(packed.data);
    const auto* src = static_cast<const char*>(padded.data);
    for (size_t i = 0; i < rows.size(); ++i)
      if (rows[i] >= 0) std::memcpy(dst + rows[i] * row, src + int64_t(i) * row, size_t(row));
  }, [&] { cuda::pack_rows(L, padded, packed, row, stream); });
}

void unpack(const PackedLayout& L, const TensorView& packed, const TensorView& padded, void* stream) {
  const int64_t row = check_pack_pair(L, padded, packed);
  detail::dispatch("unpack", padded.device, [&] {
    const auto& rows = L.packed_row_of_padded();
    auto* dst = static_cast<char*>(padded.data);
    const auto* src = static_cast<const char*>(packed.data);
    for (size_t i = 0; i < rows.size(); ++i) {
      if (rows[i] >= 0)
        std::memcpy(dst + int64_t(i) * row, src + rows[i] * row, size_t(row));
      else
        std::memset(dst + int64_t(i) * row, 0, size_t(row));
    }
  }, [&] { cuda::unpack_rows(L, packed, padded, row, stream); });
}

}  // namespace msa
