// The operations of include/msa/ops.h and layout.h on caller-allocated DLPack arrays. Inputs
// and outputs are converted to views without copying; the GIL is released while msa runs.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "bindings.h"
#include "convert.h"
#include "msa/error.h"
#include "msa/layout.h"

namespace nb = nanobind;

namespace msa::python {

namespace {

// Keyword arguments every operation takes after its arrays.
#define MSA_RUN_ARGS nb::arg("deterministic") = false, nb::arg("num_threads") = 0, nb::arg("stream") = 0

void select_blocks_py(const Topology& topo, const PackedLayout& layout, const InArray& index_q, const InArray& index_k,
                      const OutArray& topk, const std::optional<OutArray>& selected_lse, float lse_temperature,
                      bool deterministic, int num_threads, uintptr_t stream) {
  SelectBlocksParams p;
  p.index_q = to_view(index_q, "index_q");
  p.index_k = to_view(index_k, "index_k");
  p.topk = to_view(topk, "topk");
  p.selected_lse = to_view(selected_lse, "selected_lse");
  p.lse_temperature = lse_temperature;
  const RunOptions opt = run_options(deterministic, num_threads, stream);
  nb::gil_scoped_release unlocked;
  select_blocks(topo, layout, p, opt);
}

Plan build_plan_py(const Topology& topo, const PackedLayout& layout, const InArray& topk, int q_per_cta,
                   const std::optional<OutArray>& workspace, bool workspace_per_call, bool deterministic,
                   int num_threads, uintptr_t stream) {
  const TensorView t = to_view(topk, "topk");
  PlanOptions options;
  options.q_per_cta = q_per_cta;
  options.workspace = to_view(workspace, "workspace");
  options.workspace_per_call = workspace_per_call;
  const RunOptions opt = run_options(deterministic, num_threads, stream);
  nb::gil_scoped_release unlocked;
  return Plan{build_plan(topo, layout, t, options, opt), topo, workspace};
}

void forward_py(const Topology& topo, const PackedLayout& layout, const Plan& plan, const InArray& q, const InArray& k,
                const InArray& v, const std::optional<InArray>& topk, const OutArray& out, const OutArray& lse,
                const std::optional<OutArray>& workspace, bool deterministic, int num_threads, uintptr_t stream) {
  AttentionForwardParams p;
  p.workspace = to_view(workspace, "workspace");
  p.q = to_view(q, "q");
  p.k = to_view(k, "k");
  p.v = to_view(v, "v");
  p.topk = to_view(topk, "topk");
  p.out = to_view(out, "out");
  p.lse = to_view(lse, "lse");
  const RunOptions opt = run_options(deterministic, num_threads, stream);
  nb::gil_scoped_release unlocked;
  sparse_attention_forward(topo, layout, plan.plan, p, opt);
}

void backward_py(const Topology& topo, const PackedLayout& layout, const Plan& plan, const InArray& q, const InArray& k,
                 const InArray& v, const std::optional<InArray>& topk, const InArray& out, const InArray& lse, const InArray& dout,
                 const OutArray& dq, const OutArray& dk, const OutArray& dv, const std::optional<OutArray>& workspace,
                 bool deterministic, int num_threads, uintptr_t stream) {
  AttentionBackwardParams p;
  p.workspace = to_view(workspace, "workspace");
  p.q = to_view(q, "q");
  p.k = to_view(k, "k");
  p.v = to_view(v, "v");
  p.topk = to_view(topk, "topk");
  p.out = to_view(out, "out");
  p.lse = to_view(lse, "lse");
  p.dout = to_view(dout, "dout");
  p.dq = to_view(dq, "dq");
  p.dk = to_view(dk, "dk");
  p.dv = to_view(dv, "dv");
  const RunOptions opt = run_options(deterministic, num_threads, stream);
  nb::gil_scoped_release unlocked;
  sparse_attention_backward(topo, layout, plan.plan, p, opt);
}

void kl_backward_py(const Topology& topo, const PackedLayout& layout, const Plan& plan, const InArray& q,
                    const InArray& k, const InArray& lse, const InArray& index_q, const InArray& index_k,
                    const InArray& index_lse, const std::optional<InArray>& topk, const OutArray& dindex_q, const OutArray& dindex_k,
                    float grad_scale, const std::optional<OutArray>& workspace, bool deterministic, int num_threads,
                    uintptr_t stream) {
  KlBackwardParams p;
  p.workspace = to_view(workspace, "workspace");
  p.q = to_view(q, "q");
  p.k = to_view(k, "k");
  p.lse = to_view(lse, "lse");
  p.index_q = to_view(index_q, "index_q");
  p.index_k = to_view(index_k, "index_k");
  p.index_lse = to_view(index_lse, "index_lse");
  p.topk = to_view(topk, "topk");
  p.dindex_q = to_view(dindex_q, "dindex_q");
  p.dindex_k = to_view(dindex_k, "dindex_k");
  p.grad_scale = grad_scale;
  const RunOptions opt = run_options(deterministic, num_threads, stream);
  nb::gil_scoped_release unlocked;
  kl_backward(topo, layout, plan.plan, p, opt);
}

void merge_states_py(const InArray& out_partials, const InArray& lse_partials, const OutArray& out, const OutArray& lse,
                     bool deterministic, int num_threads, uintptr_t stream) {
  MergeStatesParams p;
  p.out_partials = to_view(out_partials, "out_partials");
  p.lse_partials = to_view(lse_partials, "lse_partials");
  p.out = to_view(out, "out");
  p.lse = to_view(lse, "lse");
  const RunOptions opt = run_options(deterministic, num_threads, stream);
  nb::gil_scoped_release unlocked;
  merge_states(p, opt);
}

void pack_py(const PackedLayout& layout, const InArray& padded, const OutArray& packed, uintptr_t stream) {
  const TensorView src = to_view(padded, "padded"), dst = to_view(packed, "packed");
  nb::gil_scoped_release unlocked;
  pack(layout, src, dst, reinterpret_cast<void*>(stream));
}

void unpack_py(const PackedLayout& layout, const InArray& packed, const OutArray& padded, uintptr_t stream) {
  const TensorView src = to_view(packed, "packed"), dst = to_view(padded, "padded");
  nb::gil_scoped_release unlocked;
  unpack(layout, src, dst, reinterpret_cast<void*>(stream));
}

}  // namespace

void bind_ops(nb::module_& m) {
  m.def("select_blocks", &select_blocks_py, nb::arg("topology"), nb::arg("layout"), nb::arg("index_q"),
        nb::arg("index_k"), nb::arg("topk"), nb::arg("selected_lse").none() = nb::none(),
        nb::arg("lse_temperature") = 1.0f, MSA_RUN_ARGS,
        "Indexer: writes topk [Hi, total_q, 16] int32 (and optionally selected_lse [Hi, total_q] f32) from "
        "index_q [total_q, Hi, 128] bf16 and index_k [total_k, 1, 128] bf16.");
  m.def("build_plan", &build_plan_py, nb::arg("topology"), nb::arg("layout"), nb::arg("topk"),
        nb::arg("q_per_cta") = 8, nb::arg("workspace").none() = nb::none(), nb::arg("workspace_per_call") = false,
        MSA_RUN_ARGS,
        "Validates topk against the layout and builds the k2q plan on topk's device. workspace: optional "
        "uint8 [n >= plan_workspace_bytes] CUDA array the plan uses as its scratch instead of allocating one "
        "(kept alive with the plan; operations of plans sharing it must run in order on one stream). "
        "workspace_per_call: a CUDA plan holds no scratch and every forward / backward / KL call passes its own "
        "workspace (a plan kept between calls then costs only its CSR and schedule).");
  m.def(
      "plan_workspace_bytes",
      [](const Topology& topo, const PackedLayout& layout, const std::string& device) {
        return plan_workspace_bytes(topo, layout, parse_device(device));
      },
      nb::arg("topology"), nb::arg("layout"), nb::arg("device") = "cuda",
      "Bytes of scratch a plan for this layout uses on `device` ('cpu': 0; 'cuda' / 'cuda:N'): enough for "
      "every call on it in either mode.");
  m.def(
      "call_workspace_bytes",
      [](const Topology& topo, const PackedLayout& layout, const std::string& call, bool deterministic,
         const std::string& device) {
        WorkspaceCall c{};
        if (call == "forward") c = WorkspaceCall::forward;
        else if (call == "backward") c = WorkspaceCall::backward;
        else if (call == "kl_backward") c = WorkspaceCall::kl_backward;
        else throw Error(ErrorKind::invalid_argument,
                         "call must be 'forward', 'backward' or 'kl_backward', got '" + call + "'");
        return call_workspace_bytes(topo, layout, parse_device(device), c, deterministic);
      },
      nb::arg("topology"), nb::arg("layout"), nb::arg("call"), nb::arg("deterministic") = false,
      nb::arg("device") = "cuda",
      "Bytes of scratch one call ('forward', 'backward' or 'kl_backward', in deterministic mode or not) on a "
      "plan for this layout uses on `device`: the least a workspace passed to that call must hold.");
  m.def("sparse_attention_forward", &forward_py, nb::arg("topology"), nb::arg("layout"), nb::arg("plan"),
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("topk").none(), nb::arg("out"), nb::arg("lse"),
        nb::arg("workspace").none() = nb::none(), MSA_RUN_ARGS,
        "Writes out [total_q, Hq, 128] (bf16 or f32) and lse [total_q, Hq] f32 (natural log). topk None: the "
        "plan's own selection; another topk is compared with it (on CUDA: one stream synchronisation). "
        "workspace: this call's CUDA scratch (uint8 [n >= plan_workspace_bytes]) instead of the plan's.");
  m.def("sparse_attention_backward", &backward_py, nb::arg("topology"), nb::arg("layout"), nb::arg("plan"),
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("topk").none(), nb::arg("out"), nb::arg("lse"), nb::arg("dout"),
        nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("workspace").none() = nb::none(), MSA_RUN_ARGS,
        "Writes dq, dk, dv of the sparse attention. workspace: as for sparse_attention_forward.");
  m.def("kl_backward", &kl_backward_py, nb::arg("topology"), nb::arg("layout"), nb::arg("plan"), nb::arg("q"),
        nb::arg("k"), nb::arg("lse"), nb::arg("index_q"), nb::arg("index_k"), nb::arg("index_lse"), nb::arg("topk").none(),
        nb::arg("dindex_q"), nb::arg("dindex_k"), nb::arg("grad_scale") = 0.0f, nb::arg("workspace").none() = nb::none(),
        MSA_RUN_ARGS,
        "Writes the gradient of the indexer's KL(teacher || student) w.r.t. index_q and index_k. workspace: as "
        "for sparse_attention_forward.");
  m.def("merge_states", &merge_states_py, nb::arg("out_partials"), nb::arg("lse_partials"), nb::arg("out"),
        nb::arg("lse"), MSA_RUN_ARGS, "Merges partial attention states [S, rows, H, D] / [S, rows, H] by LSE.");
  m.def("pack", &pack_py, nb::arg("layout"), nb::arg("padded"), nb::arg("packed"), nb::arg("stream") = 0,
        "[batch, seq, ...] -> [tokens, ...] for a layout made from a document map (CPU, or a kernel "
        "on `stream` for CUDA arrays).");
  m.def("unpack", &unpack_py, nb::arg("layout"), nb::arg("packed"), nb::arg("padded"), nb::arg("stream") = 0,
        "[tokens, ...] -> [batch, seq, ...]; padding positions are set to zero.");
}

}  // namespace msa::python
