// Paged prefill attention on the training forward's engine (attention_forward.cu): the step's
// requests form a packed layout (request b = document b: its chunk's query rows, seq_lens[b]
// keys, bottom-right aligned), each layer's top-k is inverted into the k2q CSR and work items
// of that layout, and the KV-outer kernel reads its key blocks from the paged cache through
// the page table (KvSource). Large chunks thus run at the training forward's speed: a key
// block is loaded once per group of queries that selected it, not once per query tile.
//
// The plan builds the layout's tables and sizes every buffer once per step
// (prepare_paged_prefill); a layer rebuilds only the schedule from its top-k (no host
// synchronisation; sort scratch from the stream-ordered allocator).
#include <algorithm>
#include <climits>
#include <memory>
#include <vector>

#include "backend.h"
#include "backend_inference.h"
#include "cuda/attention_forward.h"
#include "cuda/common.cuh"
#include "cuda/inference/quant.cuh"
#include "cuda/plan_build.h"
#include "cuda/workspace.h"

namespace msa::cuda {

namespace {

constexpr int kQueriesPerItem = 8;  // the forward's q_per_cta (one task of 8 queries per item)

// What one prefill step keeps for its layers: the layout's plan (buffers sized for any
// selection of this layout) and the forward's partial states.
struct PrefillEngine {
  PackedLayout layout;
  SparsePlan plan;
  PlanState state;
  WorkspaceLayout partials;
  Buffer scratch;  // partials.total bytes
};

KvSourceKind source_kind(KvFormat f) {
  switch (f) {
    case KvFormat::bf16: return KvSourceKind::paged_bf16;
    case KvFormat::fp8_e4m3: return KvSourceKind::paged_fp8;
    case KvFormat::nvfp4: return KvSourceKind::paged_nvfp4;
  }
  return KvSourceKind::paged_bf16;
}

}  // namespace

std::shared_ptr<void> prepare_paged_prefill(const InferencePlan& plan, const std::vector<int32_t>& cu_seqlens_q,
                                            const std::vector<int32_t>& seq_lens, void* stream) {
  DeviceGuard guard(plan.device.index);
  const Topology& topo = plan.topo;
  std::vector<int32_t> cu_k(seq_lens.size() + 1, 0);
  int64_t total_k = 0;
  for (size_t b = 0; b < seq_lens.size(); ++b) {
    total_k += seq_lens[b];
    if (total_k > INT32_MAX)
      throw Error(ErrorKind::unsupported, "paged prefill (CUDA): the step's seq_lens must sum to less than 2^31, got " +
                                              std::to_string(total_k) + " after request " + std::to_string(b));
    cu_k[b + 1] = int32_t(total_k);
  }
  auto e = std::make_shared<PrefillEngine>();
  e->layout = PackedLayout::from_cu_seqlens(cu_seqlens_q, cu_k);
  const int Hkv = topo.num_kv_heads;
  const int64_t total_q = plan.total_q, rows = e->layout.total_rows(kPageSize);
  check_schedule_size(Hkv, total_q, rows, "paged prefill (CUDA)");
  // The plan's memory goes back in `stream`'s order once its runs there are done (PlanStreams).
  e->plan = detail::allocate_plan(topo, total_q, rows, kQueriesPerItem, plan.device, stream, false, Release::in_stream);
  upload_layout(topo, e->layout, e->plan, e->state, false, static_cast<cudaStream_t>(stream), Release::in_stream);
  e->partials = forward_workspace_layout(total_q, Hkv, e->state.forward_window);
  e->scratch = Buffer(plan.device, DType::u8, {e->partials.total}, stream, Release::in_stream);
  // No host wait: runs on other streams wait for the uploads on the device (InferencePlan::streams).
  return e;
}

void paged_prefill_attention(const InferencePlan& plan, const PagedAttentionParams& p, const RunOptions& opt) {
  auto* e = static_cast<PrefillEngine*>(plan.backend.get());
  if (e == nullptr)
    throw Error(ErrorKind::invalid_argument, "paged_attention: the prefill plan has no CUDA state; make it with "
                                             "plan_paged_prefill on a CUDA device");
  if (plan.total_q == 0) return;
  DeviceGuard guard(p.q.device.index);
  const cudaStream_t s = as_stream(opt);
  build_schedule(plan.topo, p.topk, e->plan, e->state, false, s);
  ForwardLaunch f;
  f.kind = source_kind(p.kv.format);
  f.kv = paged_kv_source(plan, p.kv);
  f.k_extent = p.kv.k.shape[0];
  f.v_extent = p.kv.v.shape[0];
  f.q = p.q;
  f.schedule = static_cast<const WorkItem*>(e->plan.schedule.data());
  f.schedule_capacity = e->state.schedule_capacity;
  f.work_count = i32(e->plan.work_count_dev);
  f.full_items = i32(e->state.schedule_full);
  f.q_indices = i32(e->plan.q_indices);
  f.split_slot = i32(e->plan.split_slot);
  f.split_counts = i32(e->plan.split_counts);
  f.status = i32(e->plan.status);
  f.docs = doc_ptr(e->state);
  f.order = forward_order_ptr(e->state);
  f.q_per_cta = e->plan.q_per_cta;
  set_forward_windows(f, e->state);
  f.part_o = static_cast<char*>(e->scratch.data()) + e->partials.part_o;
  f.part_ml = static_cast<char*>(e->scratch.data()) + e->partials.part_ml;
  f.total_q = plan.total_q;
  f.Hq = plan.topo.num_q_heads;
  f.Hkv = plan.topo.num_kv_heads;
  f.softmax_scale = plan.topo.attention_scale();
  f.out = p.out;
  f.lse = p.lse;
  run_sparse_forward(f, s);
}

}  // namespace msa::cuda
