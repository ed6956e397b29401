// Validation and dispatch of the training-path operations. This is the only layer that
// reads user arguments; backends receive checked inputs.
#include "msa/ops.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "backend.h"
#include "core/buffer_pack.h"
#include "core/check.h"
#include "core/dispatch.h"

namespace msa {

using detail::check_tensor;
using detail::concat;
using detail::Dim;
using detail::dispatch;
using detail::fail;
using detail::require;

namespace {

constexpr auto kBf16 = {DType::bf16};
// The indexer's inputs: bf16, or FP8 E4M3 (scale 1), each on its own; every E4M3 value is
// exact in bf16, so the scores are the same dot products either way.
constexpr auto kIndexInput = {DType::bf16, DType::f8e4m3};
constexpr auto kFloatOut = {DType::bf16, DType::f32};

bool on_cuda(const TensorView& t) { return t.device.is_cuda(); }

// Checks a top-k tensor's shape and, on the CPU, its contents against the layout: valid ids
// form a prefix, are unique and lie in [0, local block of the query].
void check_topk(const Topology& topo, const PackedLayout& L, const TensorView& topk, const char* name, Device dev) {
  const int H = topo.num_index_heads, K = topo.topk;
  check_tensor(topk, name, {DType::i32}, {Dim(H, "Hi"), Dim(L.total_q(), "total_q"), Dim(K, "16")}, dev);
  if (on_cuda(topk)) return;  // contents are checked by the device plan builder
  const auto* ids = topk.as<const int32_t>();
  for (int b = 0; b < L.num_documents(); ++b) {
    const DocumentSpan& d = L.document(b);
    for (int64_t i = 0; i < d.q_len; ++i) {
      const int64_t row = d.q_start + i;
      const int64_t local = (d.k_len - d.q_len + i) / topo.block_size;
      for (int h = 0; h < H; ++h) {
        detail::check_selection_row(name, h, row, ids + (int64_t(h) * L.total_q() + row) * K, K, local, "block", [&] {
          return concat(" is not a visible block: query ", i, " of document ", b, " sees blocks 0..", local,
                        " (history ids must precede the local block)");
        });
      }
    }
  }
}

void check_plan(const SparsePlan& plan, const PackedLayout& L, const Topology& topo, Device dev) {
  require(plan.total_q == L.total_q() && plan.total_rows == L.total_rows(topo.block_size) &&
              plan.num_kv_heads == topo.num_kv_heads,
          concat("plan does not match this micro-batch (plan: total_q ", plan.total_q, ", rows ", plan.total_rows,
                 "; layout: total_q ", L.total_q(), ", rows ", L.total_rows(topo.block_size), "); rebuild it with build_plan"));
  require(plan.device == dev, concat("plan lives on ", to_string(plan.device), " but the inputs are on ", to_string(dev)));
}

// The selection a call passes must be the one the plan was built from: the plan's CSR and
// schedule encode that selection, and another one would give wrong results without a word.
// Returns the view the backend reads: the plan's own copy when the caller passed none.
TensorView bound_selection(const SparsePlan& plan, const TensorView& topk, const char* op, const RunOptions& opt) {
  require(!plan.selection.empty(),
          concat(op, ": the plan holds no selection (it was not made by build_plan); build it with build_plan"));
  const TensorView own = plan.selection.view();
  if (!topk.present() || topk.data == own.data) return own;  // the plan's own copy: nothing to compare
  int64_t i = -1;
  int32_t given_at = 0, built_at = 0;
  if (own.device.is_cuda()) {
    // Compared on the device (ordered on opt.stream after whatever wrote topk); 8 bytes come
    // back, and 8 more to name the difference. A capturing stream cannot be read from the
    // host; only the plan's own copy is verified then.
    i = detail::dispatch(op, own.device, [] { return int64_t(-1); },
                         [&] { return cuda::first_selection_difference(topk, own, opt); });
    if (i == cuda::kSelectionNotReadable) return topk;
    if (i >= 0) {
      const auto at = [&](const TensorView& t) {
        int32_t v = 0;
        TensorView one = TensorView::contiguous(static_cast<int32_t*>(t.data) + i, DType::i32, {1}, t.device);
        copy(one, TensorView::contiguous(&v, DType::i32, {1}), opt.stream);
        return v;
      };
      given_at = at(topk);
      built_at = at(own);
    }
  } else {
    const int32_t *given = topk.as<const int32_t>(), *built = own.as<const int32_t>();
    const int64_t n = own.numel();
    if (std::memcmp(given, built, size_t(n) * sizeof(int32_t)) != 0) {
      i = 0;
      while (given[i] == built[i]) ++i;
      given_at = given[i];
      built_at = built[i];
    }
  }
  if (i < 0) return topk;
  const int64_t K = own.shape[2], rows = own.shape[1];
  fail(concat(op, ": topk does not match the selection the plan was built from (first difference at topk[", i / K / rows,
              ", ", i / K % rows, ", ", i % K, "]: ", given_at, " here, ", built_at,
              " in the plan); build a plan from this topk, or pass the plan's own plan.selection"));
}

// Bytes a workspace must hold: for every call (a plan's own, `call` empty) or for one call.
int64_t needed_workspace_bytes(const Topology& topo, const PackedLayout& L, std::optional<WorkspaceCall> call,
                               bool deterministic) {
  if constexpr (detail::kWithCuda) {  // without the backend, build_plan refuses CUDA inputs anyway
    return call ? cuda::call_workspace_bytes(topo, L, *call, deterministic) : cuda::plan_workspace_bytes(topo, L);
  } else {
    (void)topo, (void)L, (void)call, (void)deterministic;
    return 0;
  }
}

// What a workspace of `call` must hold, as an error names it.
std::string workspace_requirement(std::optional<WorkspaceCall> call, bool deterministic, int64_t needed) {
  if (!call) return concat("plan_workspace_bytes = ", needed);
  return concat("call_workspace_bytes(", to_string(*call), deterministic ? ", deterministic" : "", ") = ", needed);
}

// A caller's workspace (`name`: options.workspace at build_plan, workspace in a call's params):
// CUDA only, uint8 [n] contiguous on the plan's device, large enough for this layout and call
// and 256-byte aligned (the kernels' TMA maps and vector stores need it).
void check_workspace(const Topology& topo, const PackedLayout& L, const TensorView& ws, Device dev,
                     const std::string& name, const char* holder, std::optional<WorkspaceCall> call,
                     bool deterministic) {
  require(dev.is_cuda(), concat(name, " is used by CUDA plans only, but ", holder, " is on ", to_string(dev), " (leave ",
                                name, " empty)"));
  require(ws.rank == 1, concat(name, " must be 1-D, uint8 [n], got shape ", ws.shape_string()));
  check_tensor(ws, name.c_str(), {DType::u8}, {Dim(ws.shape[0], "n")}, dev);
  const int64_t needed = needed_workspace_bytes(topo, L, call, deterministic);
  require(ws.shape[0] >= needed, concat(name, " must hold at least ", workspace_requirement(call, deterministic, needed),
                                        " bytes for this layout, got ", ws.shape[0]));
  require(reinterpret_cast<uintptr_t>(ws.data) % 256 == 0,
          concat(name, " must start at a 256-byte aligned address, got ", ws.data));
}

// The scratch of one forward / backward / KL call: the params' workspace when given (checked),
// which a plan built with workspace_per_call requires.
void check_call_workspace(const Topology& topo, const PackedLayout& L, const SparsePlan& plan, const TensorView& ws,
                          Device dev, const char* op, WorkspaceCall call, const RunOptions& opt) {
  if (ws.present()) return check_workspace(topo, L, ws, dev, concat(op, " workspace"), "q", call, opt.deterministic);
  if (plan.workspace_per_call && dev.is_cuda()) {
    const int64_t needed = needed_workspace_bytes(topo, L, call, opt.deterministic);
    fail(concat(op, ": the plan was built with workspace_per_call and holds no scratch; pass workspace (uint8 [n >= ",
                workspace_requirement(call, opt.deterministic, needed), "], 256-byte aligned, on ", to_string(dev),
                ")"));
  }
}

}  // namespace

void select_blocks(const Topology& topo, const PackedLayout& L, const SelectBlocksParams& p, const RunOptions& opt) {
  detail::check_run_options(opt);
  topo.validate();
  detail::check_present(p.index_q, "index_q");
  const Device dev = p.index_q.device;
  const int Hi = topo.num_index_heads, Di = topo.index_head_dim;
  check_tensor(p.index_q, "index_q", kIndexInput, {Dim(L.total_q(), "total_q"), Dim(Hi, "Hi"), Dim(Di)}, dev);
  check_tensor(p.index_k, "index_k", kIndexInput, {Dim(L.total_k(), "total_k"), Dim(1), Dim(Di)}, dev);
  check_tensor(p.topk, "topk", {DType::i32}, {Dim(Hi, "Hi"), Dim(L.total_q(), "total_q"), Dim(topo.topk, "16")}, dev);
  if (p.selected_lse.present())
    check_tensor(p.selected_lse, "selected_lse", {DType::f32}, {Dim(Hi, "Hi"), Dim(L.total_q(), "total_q")}, dev);
  require(std::isfinite(p.lse_temperature) && p.lse_temperature > 0,
          concat("lse_temperature must be finite and > 0, got ", p.lse_temperature));
  // The CUDA indexer moves index rows with TMA and 16-byte asynchronous copies.
  detail::check_rows_aligned(p.index_q, "index_q", 16);
  detail::check_rows_aligned(p.index_k, "index_k", 16);
  dispatch(
      "select_blocks", dev, [&] { cpu::select_blocks(topo, L, p, opt); },
      [&] { cuda::select_blocks(topo, L, p, opt); });
}

int64_t plan_workspace_bytes(const Topology& topo, const PackedLayout& L, Device device) {
  topo.validate();
  return dispatch(
      "plan_workspace_bytes", device, [] { return int64_t(0); }, [&] { return cuda::plan_workspace_bytes(topo, L); });
}

const char* to_string(WorkspaceCall call) {
  switch (call) {
    case WorkspaceCall::forward: return "forward";
    case WorkspaceCall::backward: return "backward";
    case WorkspaceCall::kl_backward: return "kl_backward";
  }
  return "?";
}

int64_t call_workspace_bytes(const Topology& topo, const PackedLayout& L, Device device, WorkspaceCall call,
                             bool deterministic) {
  topo.validate();
  require(call == WorkspaceCall::forward || call == WorkspaceCall::backward || call == WorkspaceCall::kl_backward,
          concat("call_workspace_bytes: call must be forward, backward or kl_backward, got ", int(call)));
  return dispatch(
      "call_workspace_bytes", device, [] { return int64_t(0); },
      [&] { return cuda::call_workspace_bytes(topo, L, call, deterministic); });
}

namespace detail {

SparsePlan allocate_plan(const Topology& topo, int64_t total_q, int64_t rows, int q_per_cta, Device device,
                         void* stream, bool with_selection, Release release) {
  const int Hkv = topo.num_kv_heads;
  const int64_t edges = total_q * topo.topk;
  SparsePlan plan;
  plan.device = device;
  plan.total_q = total_q;
  plan.total_rows = rows;
  plan.num_kv_heads = Hkv;
  plan.topk = topo.topk;
  plan.q_per_cta = q_per_cta;
  const int64_t capacity = Hkv * (rows + (edges + q_per_cta - 1) / q_per_cta);
  BufferPack buffers;
  buffers.add(&plan.rows, DType::i32, {rows, 2});
  buffers.add(&plan.row_ptr, DType::i32, {Hkv, rows + 1});
  buffers.add(&plan.q_indices, DType::i32, {Hkv, edges});
  buffers.add(&plan.split_slot, DType::i32, {Hkv, edges});
  buffers.add(&plan.split_counts, DType::i32, {total_q, Hkv});
  buffers.add(&plan.schedule, DType::i32, {capacity, 6});
  buffers.add(&plan.work_count_dev, DType::i32, {1});
  if (with_selection) buffers.add(&plan.selection, DType::i32, {topo.num_index_heads, total_q, topo.topk});
  buffers.allocate(device, stream, release);
  return plan;
}

}  // namespace detail

SparsePlan build_plan(const Topology& topo, const PackedLayout& L, const TensorView& topk, const PlanOptions& options,
                      const RunOptions& opt) {
  detail::check_run_options(opt);
  topo.validate();
  detail::check_present(topk, "topk");
  require(options.q_per_cta >= 1, concat("plan q_per_cta must be >= 1, got ", options.q_per_cta));
  check_topk(topo, L, topk, "topk", topk.device);
  require(!(options.workspace_per_call && options.workspace.present()),
          "build_plan: options.workspace_per_call means the plan holds no scratch, but options.workspace gives it "
          "one; pass the workspace to each call instead");
  if (options.workspace.present())
    check_workspace(topo, L, options.workspace, topk.device, "options.workspace", "topk", std::nullopt, false);
  // CUDA buffers are used on opt.stream.
  SparsePlan plan = detail::allocate_plan(topo, L.total_q(), L.total_rows(topo.block_size), options.q_per_cta,
                                          topk.device, on_cuda(topk) ? opt.stream : nullptr, true);
  // The plan keeps its own copy of the selection, so that a later call cannot pair it with
  // another one (see bound_selection); on CUDA one device copy on opt.stream.
  copy(topk, plan.selection.view(), on_cuda(topk) ? opt.stream : nullptr);
  dispatch(
      "build_plan", plan.device, [&] { cpu::build_plan(topo, L, topk, plan); },
      [&] { cuda::build_plan(topo, L, topk, options.workspace, options.workspace_per_call, plan, opt); });
  plan.workspace_per_call = options.workspace_per_call && on_cuda(topk);
  return plan;
}

void sparse_attention_forward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan,
                              const AttentionForwardParams& p, const RunOptions& opt) {
  detail::check_run_options(opt);
  topo.validate();
  detail::check_present(p.q, "q");
  const Device dev = p.q.device;
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, D = topo.head_dim;
  check_tensor(p.q, "q", kBf16, {Dim(L.total_q(), "total_q"), Dim(Hq, "Hq"), Dim(D)}, dev);
  check_tensor(p.k, "k", kBf16, {Dim(L.total_k(), "total_k"), Dim(Hkv, "Hkv"), Dim(D)}, dev);
  check_tensor(p.v, "v", kBf16, {Dim(L.total_k(), "total_k"), Dim(Hkv, "Hkv"), Dim(D)}, dev);
  if (p.topk.present())
    check_tensor(p.topk, "topk", {DType::i32}, {Dim(Hkv, "Hkv"), Dim(L.total_q(), "total_q"), Dim(topo.topk, "16")}, dev);
  check_tensor(p.out, "out", kFloatOut, {Dim(L.total_q(), "total_q"), Dim(Hq, "Hq"), Dim(D)}, dev);
  check_tensor(p.lse, "lse", {DType::f32}, {Dim(L.total_q(), "total_q"), Dim(Hq, "Hq")}, dev);
  check_plan(plan, L, topo, dev);
  check_call_workspace(topo, L, plan, p.workspace, dev, "sparse_attention_forward", WorkspaceCall::forward, opt);
  if (on_cuda(p.q)) {
    detail::check_rows_aligned(p.q, "q", 16);
    detail::check_rows_aligned(p.k, "k", 16);
    detail::check_rows_aligned(p.v, "v", 16);
    // The forward's TMA coordinates are 32-bit: 16 partial rows per (query, head).
    require(16 * L.total_q() * Hq < (int64_t(1) << 31),
            concat("sparse_attention_forward on CUDA handles total_q * Hq up to 2^27, got total_q ", L.total_q(),
                   " with Hq ", Hq));
  }
  AttentionForwardParams bound = p;
  bound.topk = bound_selection(plan, p.topk, "sparse_attention_forward", opt);
  dispatch(
      "sparse_attention_forward", dev, [&] { cpu::sparse_attention_forward(topo, L, plan, bound, opt); },
      [&] { cuda::sparse_attention_forward(topo, L, plan, bound, opt); });
}

void sparse_attention_backward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan,
                               const AttentionBackwardParams& p, const RunOptions& opt) {
  detail::check_run_options(opt);
  topo.validate();
  detail::check_present(p.q, "q");
  const Device dev = p.q.device;
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, D = topo.head_dim;
  const Dim Tq(L.total_q(), "total_q"), Tk(L.total_k(), "total_k");
  check_tensor(p.q, "q", kBf16, {Tq, Dim(Hq, "Hq"), Dim(D)}, dev);
  check_tensor(p.k, "k", kBf16, {Tk, Dim(Hkv, "Hkv"), Dim(D)}, dev);
  check_tensor(p.v, "v", kBf16, {Tk, Dim(Hkv, "Hkv"), Dim(D)}, dev);
  if (p.topk.present()) check_tensor(p.topk, "topk", {DType::i32}, {Dim(Hkv, "Hkv"), Tq, Dim(topo.topk, "16")}, dev);
  check_tensor(p.out, "out", kFloatOut, {Tq, Dim(Hq, "Hq"), Dim(D)}, dev);
  check_tensor(p.lse, "lse", {DType::f32}, {Tq, Dim(Hq, "Hq")}, dev);
  check_tensor(p.dout, "dout", kFloatOut, {Tq, Dim(Hq, "Hq"), Dim(D)}, dev);
  check_tensor(p.dq, "dq", kFloatOut, {Tq, Dim(Hq, "Hq"), Dim(D)}, dev);
  check_tensor(p.dk, "dk", kFloatOut, {Tk, Dim(Hkv, "Hkv"), Dim(D)}, dev);
  check_tensor(p.dv, "dv", kFloatOut, {Tk, Dim(Hkv, "Hkv"), Dim(D)}, dev);
  check_plan(plan, L, topo, dev);
  check_call_workspace(topo, L, plan, p.workspace, dev, "sparse_attention_backward", WorkspaceCall::backward, opt);
  // The CUDA backward copies rows of these with 16-byte asynchronous copies.
  for (const auto& [t, name] : {std::pair{&p.q, "q"}, {&p.k, "k"}, {&p.v, "v"}, {&p.dout, "dout"}})
    detail::check_rows_aligned(*t, name, 16);
  AttentionBackwardParams bound = p;
  bound.topk = bound_selection(plan, p.topk, "sparse_attention_backward", opt);
  dispatch(
      "sparse_attention_backward", dev, [&] { cpu::sparse_attention_backward(topo, L, plan, bound, opt); },
      [&] { cuda::sparse_attention_backward(topo, L, plan, bound, opt); });
}

void kl_backward(const Topology& topo, const PackedLayout& L, const SparsePlan& plan, const KlBackwardParams& p,
                 const RunOptions& opt) {
  detail::check_run_options(opt);
  topo.validate();
  detail::check_present(p.q, "q");
  const Device dev = p.q.device;
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, Hi = topo.num_index_heads, D = topo.head_dim,
            Di = topo.index_head_dim;
  const Dim Tq(L.total_q(), "total_q"), Tk(L.total_k(), "total_k");
  check_tensor(p.q, "q", kBf16, {Tq, Dim(Hq, "Hq"), Dim(D)}, dev);
  check_tensor(p.k, "k", kBf16, {Tk, Dim(Hkv, "Hkv"), Dim(D)}, dev);
  check_tensor(p.lse, "lse", {DType::f32}, {Tq, Dim(Hq, "Hq")}, dev);
  check_tensor(p.index_q, "index_q", kBf16, {Tq, Dim(Hi, "Hi"), Dim(Di)}, dev);
  check_tensor(p.index_k, "index_k", kBf16, {Tk, Dim(1), Dim(Di)}, dev);
  check_tensor(p.index_lse, "index_lse", {DType::f32}, {Dim(Hi, "Hi"), Tq}, dev);
  if (p.topk.present()) check_tensor(p.topk, "topk", {DType::i32}, {Dim(Hi, "Hi"), Tq, Dim(topo.topk, "16")}, dev);
  check_tensor(p.dindex_q, "dindex_q", kFloatOut, {Tq, Dim(Hi, "Hi"), Dim(Di)}, dev);
  check_tensor(p.dindex_k, "dindex_k", kFloatOut, {Tk, Dim(1), Dim(Di)}, dev);
  require(std::isfinite(p.grad_scale) && p.grad_scale >= 0,
          concat("grad_scale must be finite and >= 0 (0 = 1 / (Hi * total_q)), got ", p.grad_scale));
  check_plan(plan, L, topo, dev);
  check_call_workspace(topo, L, plan, p.workspace, dev, "kl_backward", WorkspaceCall::kl_backward, opt);
  // The CUDA KL backward copies rows of these with 16-byte asynchronous copies.
  for (const auto& [t, name] : {std::pair{&p.q, "q"}, {&p.k, "k"}, {&p.index_q, "index_q"}, {&p.index_k, "index_k"}})
    detail::check_rows_aligned(*t, name, 16);
  KlBackwardParams bound = p;
  bound.topk = bound_selection(plan, p.topk, "kl_backward", opt);
  dispatch(
      "kl_backward", dev, [&] { cpu::kl_backward(topo, L, plan, bound, opt); },
      [&] { cuda::kl_backward(topo, L, plan, bound, opt); });
}

void merge_states(const MergeStatesParams& p, const RunOptions& opt) {
  detail::check_run_options(opt);
  detail::check_present(p.out_partials, "out_partials");
  const Device dev = p.out_partials.device;
  require(p.out_partials.rank == 4, concat("out_partials must have shape [S, rows, H, D], got ", p.out_partials.shape_string()));
  const int64_t S = p.out_partials.shape[0], R = p.out_partials.shape[1], H = p.out_partials.shape[2],
                D = p.out_partials.shape[3];
  require(S >= 1, "out_partials must hold at least one partial state (S >= 1), got S = 0");
  check_tensor(p.out_partials, "out_partials", kFloatOut, {Dim(S, "S"), Dim(R, "rows"), Dim(H, "H"), Dim(D, "D")}, dev);
  check_tensor(p.lse_partials, "lse_partials", {DType::f32}, {Dim(S, "S"), Dim(R, "rows"), Dim(H, "H")}, dev);
  check_tensor(p.out, "out", kFloatOut, {Dim(R, "rows"), Dim(H, "H"), Dim(D, "D")}, dev);
  check_tensor(p.lse, "lse", {DType::f32}, {Dim(R, "rows"), Dim(H, "H")}, dev);
  dispatch("merge_states", dev, [&] { cpu::merge_states(p, opt); }, [&] { cuda::merge_states(p, opt); });
}

}  // namespace msa
