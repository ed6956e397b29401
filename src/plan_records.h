// The typed records a plan writes and every backend's kernels read. The plan's public
// buffers (include/msa/ops.h) hold them as int32 arrays of the documented widths; these
// structs name the fields so that no kernel indexes a record by position.
#pragma once

#include <cstdint>

namespace msa {

// One work item of a plan's schedule (forward) or chunk list (backward / KL): up to
// q_count queries of one (KV head, key block) row of the k2q CSR.
struct WorkItem {
  int32_t head_kv;   // KV head (= index head) g
  int32_t row;       // CSR row: one (document, key block) pair
  int32_t q_begin;   // first edge of the item in q_indices[head_kv] / split_slot[head_kv]
  int32_t q_count;   // queries of the item
  int32_t document;  // document b of the row
  int32_t kv_block;  // document-local key block j of the row
};
static_assert(sizeof(WorkItem) == 6 * sizeof(int32_t), "WorkItem is the schedule's [capacity, 6] int32 row");

inline constexpr int kWorkItemInts = int(sizeof(WorkItem) / sizeof(int32_t));

}  // namespace msa
