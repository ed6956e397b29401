// The k2q plan on the host: CSR rows (document, kv block) numbered level-major, the
// queries of every row per kv head, partial slots, per-query counts and the work schedule.
#include <algorithm>
#include <vector>

#include "backend.h"
#include "cpu/common.h"
#include "plan_records.h"

namespace msa::cpu {

void build_plan(const Topology& topo, const PackedLayout& L, const TensorView& topk, SparsePlan& plan) {
  const int Hkv = plan.num_kv_heads, K = plan.topk, q_per_cta = plan.q_per_cta;
  const int64_t total_q = plan.total_q, total_rows = plan.total_rows, edges = total_q * K;
  const int block = topo.block_size;
  const int B = L.num_documents();

  auto* rows = static_cast<int32_t*>(plan.rows.data());                // [total_rows, 2]
  auto* row_ptr = static_cast<int32_t*>(plan.row_ptr.data());          // [Hkv, total_rows + 1]
  auto* q_indices = static_cast<int32_t*>(plan.q_indices.data());      // [Hkv, edges]
  auto* split_slot = static_cast<int32_t*>(plan.split_slot.data());    // [Hkv, edges]
  auto* split_counts = static_cast<int32_t*>(plan.split_counts.data());  // [total_q, Hkv]
  auto* schedule = static_cast<WorkItem*>(plan.schedule.data());       // [capacity] work items
  const int64_t capacity = plan.schedule.bytes() / int64_t(sizeof(WorkItem));
  const auto* ids = topk.as<const int32_t>();                          // [Hkv, total_q, K]

  // Row numbering: every document's block 0, then every block 1, ... (documents in order).
  std::vector<int64_t> doc_blocks(static_cast<size_t>(B)), doc_offset(static_cast<size_t>(B) + 1, 0);
  for (int b = 0; b < B; ++b) {
    doc_blocks[size_t(b)] = (L.document(b).k_len + block - 1) / block;
    doc_offset[size_t(b) + 1] = doc_offset[size_t(b)] + doc_blocks[size_t(b)];
  }
  std::vector<int32_t> row_of(static_cast<size_t>(total_rows));  // [doc_offset[b] + j] -> row
  {
    std::vector<int> active;
    for (int b = 0; b < B; ++b)
      if (doc_blocks[size_t(b)] > 0) active.push_back(b);
    int64_t r = 0;
    for (int64_t j = 0; !active.empty(); ++j) {
      size_t kept = 0;
      for (int b : active) {
        row_of[size_t(doc_offset[size_t(b)] + j)] = int32_t(r);
        rows[2 * r] = b;
        rows[2 * r + 1] = int32_t(j);
        ++r;
        if (doc_blocks[size_t(b)] > j + 1) active[kept++] = b;
      }
      active.resize(kept);
    }
  }

  // CSR per kv head. Queries are visited in ascending order, so each row's list ascends.
#pragma omp parallel for schedule(static)
  for (int h = 0; h < Hkv; ++h) {
    int32_t* ptr = row_ptr + int64_t(h) * (total_rows + 1);
    int32_t* qi = q_indices + int64_t(h) * edges;
    int32_t* slot_out = split_slot + int64_t(h) * edges;
    std::vector<int32_t> cursor(size_t(total_rows) + 1, 0);
    for (int b = 0; b < B; ++b) {
      const DocumentSpan& d = L.document(b);
      for (int64_t i = 0; i < d.q_len; ++i) {
        const int32_t* sel = ids + (int64_t(h) * total_q + d.q_start + i) * K;
        for (int s = 0; s < K; ++s)
          if (sel[s] >= 0 && sel[s] < doc_blocks[size_t(b)]) ++cursor[size_t(row_of[size_t(doc_offset[size_t(b)] + sel[s])]) + 1];
      }
    }
    for (int64_t r = 0; r < total_rows; ++r) cursor[size_t(r) + 1] += cursor[size_t(r)];
    std::copy(cursor.begin(), cursor.end(), ptr);
    for (int b = 0; b < B; ++b) {
      const DocumentSpan& d = L.document(b);
      for (int64_t i = 0; i < d.q_len; ++i) {
        const int64_t row = d.q_start + i;
        const int32_t* sel = ids + (int64_t(h) * total_q + row) * K;
        int count = 0;
        for (int s = 0; s < K; ++s) {
          if (sel[s] < 0 || sel[s] >= doc_blocks[size_t(b)]) continue;
          ++count;
          int smaller = 0;  // the edge's partial slot: valid blocks of this query with a smaller id
          for (int t = 0; t < K; ++t) smaller += (sel[t] >= 0 && sel[t] < sel[s]);
          const int64_t pos = cursor[size_t(row_of[size_t(doc_offset[size_t(b)] + sel[s])])]++;
          qi[pos] = int32_t(i);
          slot_out[pos] = smaller;
        }
        split_counts[row * Hkv + h] = count;
      }
    }
    std::fill(qi + ptr[total_rows], qi + edges, -1);
    std::fill(slot_out + ptr[total_rows], slot_out + edges, -1);
  }

  // Schedule: rows split into chunks of q_per_cta queries, largest chunks first; equal
  // sizes keep (head, row, chunk) order.
  std::vector<int64_t> per_size(size_t(q_per_cta) + 2, 0);
  for (int h = 0; h < Hkv; ++h) {
    const int32_t* ptr = row_ptr + int64_t(h) * (total_rows + 1);
    for (int64_t r = 0; r < total_rows; ++r) {
      const int64_t n = ptr[r + 1] - ptr[r];
      per_size[size_t(q_per_cta)] += n / q_per_cta;
      if (n % q_per_cta) ++per_size[size_t(n % q_per_cta)];
    }
  }
  std::vector<int64_t> next(size_t(q_per_cta) + 1, 0);  // first entry of each size
  int64_t work = 0;
  for (int c = q_per_cta; c >= 1; --c) {
    next[size_t(c)] = work;
    work += per_size[size_t(c)];
  }
  for (int h = 0; h < Hkv; ++h) {
    const int32_t* ptr = row_ptr + int64_t(h) * (total_rows + 1);
    for (int64_t r = 0; r < total_rows; ++r) {
      for (int64_t begin = ptr[r]; begin < ptr[r + 1]; begin += q_per_cta) {
        const int count = int(std::min<int64_t>(q_per_cta, ptr[r + 1] - begin));
        schedule[next[size_t(count)]++] = WorkItem{.head_kv = h,
                                                   .row = int32_t(r),
                                                   .q_begin = int32_t(begin),
                                                   .q_count = count,
                                                   .document = rows[2 * r],
                                                   .kv_block = rows[2 * r + 1]};
      }
    }
  }
  constexpr WorkItem kUnused{-1, -1, -1, -1, -1, -1};  // entries past work_count
  std::fill(schedule + work, schedule + capacity, kUnused);
  plan.work_count = work;
  *static_cast<int32_t*>(plan.work_count_dev.data()) = int32_t(work);
}

}  // namespace msa::cpu
