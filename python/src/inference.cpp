// The inference operations of include/msa/inference.h: paged caches, norm + RoPE, cache
// insertion, NVFP4 -> FP8, and plan / run of paged prefill and decode.
#include "msa/inference.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sstream>

#include "bindings.h"
#include "convert.h"
#include "msa/error.h"

namespace nb = nanobind;

namespace msa::python {

namespace {

using OptIn = std::optional<InArray>;
using OptOut = std::optional<OutArray>;

#define MSA_RUN_ARGS nb::arg("deterministic") = false, nb::arg("num_threads") = 0, nb::arg("stream") = 0
#define MSA_CACHE_ARGS                                                                                         \
  nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("format") = KvFormat::bf16,                                  \
      nb::arg("k_block_scale").none() = nb::none(), nb::arg("v_block_scale").none() = nb::none(),              \
      nb::arg("k_scale").none() = nb::none(), nb::arg("v_scale").none() = nb::none()

InferencePlanOptions plan_options(const std::string& device, int num_kv_splits, int num_threads, uintptr_t stream) {
  InferencePlanOptions options;
  options.device = parse_device(device);
  options.num_kv_splits = num_kv_splits;
  options.num_threads = num_threads;
  options.stream = reinterpret_cast<void*>(stream);
  return options;
}

NormRopeConfig norm_rope_config(int rotary_dim, float eps, float rope_theta) {
  NormRopeConfig c;
  c.rotary_dim = rotary_dim;
  c.eps = eps;
  c.rope_theta = rope_theta;
  return c;
}

// k/v caches are written by insert_kv and read by the attention; views are the same either way.
PagedKvCache make_cache(const OutArray& k, const OutArray& v, KvFormat format, const OptOut& k_block_scale,
                        const OptOut& v_block_scale, const OptOut& k_scale, const OptOut& v_scale) {
  PagedKvCache c;
  c.format = format;
  c.k = to_view(k, "k_cache");
  c.v = to_view(v, "v_cache");
  c.k_block_scale = to_view(k_block_scale, "k_block_scale");
  c.v_block_scale = to_view(v_block_scale, "v_block_scale");
  c.k_scale = to_view(k_scale, "k_scale");
  c.v_scale = to_view(v_scale, "v_scale");
  return c;
}

nb::object plan_array(const Buffer& b, nb::handle owner) {
  if (b.empty()) return nb::none();
  TensorView v = b.view();
  std::vector<size_t> shape(v.shape.begin(), v.shape.begin() + v.rank);
  const int device_type = v.device.is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  nb::dlpack::dtype dt = v.dtype == DType::f32 ? nb::dtype<float>() : nb::dtype<int32_t>();
  nb::ndarray<> a(v.data, shape.size(), shape.data(), owner, nullptr, dt, device_type, v.device.index);
  if (!v.device.is_cuda()) return nb::cast(nb::ndarray<nb::numpy>(a));
  return nb::cast(a);
}

}  // namespace

void bind_inference(nb::module_& m) {
  nb::enum_<KvFormat>(m, "KvFormat", "Storage format of the paged K/V cache.")
      .value("bf16", KvFormat::bf16)
      .value("fp8_e4m3", KvFormat::fp8_e4m3)
      .value("nvfp4", KvFormat::nvfp4);
  nb::enum_<InferencePhase>(m, "InferencePhase").value("prefill", InferencePhase::prefill).value("decode", InferencePhase::decode);

  nb::class_<InferencePlan>(m, "InferencePlan",
                            "One engine step's request metadata and scratch memory (from plan_paged_prefill or "
                            "plan_decode); shared by every sparse layer of the step, one run at a time.")
      .def_ro("phase", &InferencePlan::phase)
      .def_ro("topology", &InferencePlan::topo)
      .def_prop_ro("device", [](const InferencePlan& p) { return to_string(p.device); })
      .def_ro("batch", &InferencePlan::batch)
      .def_ro("total_q", &InferencePlan::total_q)
      .def_ro("max_pages", &InferencePlan::max_pages)
      .def_ro("max_seqlen_q", &InferencePlan::max_seqlen_q)
      .def_ro("max_seqlen_k", &InferencePlan::max_seqlen_k)
      .def_ro("max_physical_page", &InferencePlan::max_physical_page)
      .def_ro("q_len_per_req", &InferencePlan::q_len_per_req)
      .def_ro("num_kv_splits", &InferencePlan::num_kv_splits)
      .def(
          "arrays",
          [](nb::handle self) {
            const InferencePlan& p = nb::cast<const InferencePlan&>(self);
            nb::dict d;
            d["cu_seqlens_q"] = plan_array(p.cu_seqlens_q, self);
            d["seq_lens"] = plan_array(p.seq_lens, self);
            d["page_table"] = plan_array(p.page_table, self);
            d["positions"] = plan_array(p.positions, self);
            d["query_request"] = plan_array(p.query_request, self);
            d["slot_mapping"] = plan_array(p.slot_mapping, self);
            return d;
          },
          "The plan's metadata arrays (sharing its memory): positions, slot_mapping (feed it to insert_kv "
          "for this step's tokens), ...")
      .def("__repr__", [](const InferencePlan& p) {
        std::ostringstream os;
        os << "InferencePlan(phase=" << (p.phase == InferencePhase::prefill ? "prefill" : "decode")
           << ", device=" << to_string(p.device) << ", batch=" << p.batch << ", total_q=" << p.total_q
           << ", num_kv_splits=" << p.num_kv_splits << ")";
        return os.str();
      });

  m.def(
      "rms_norm_rope",
      [](const InArray& x, const InArray& weight, const OptIn& positions, const OutArray& out, int rotary_dim, float eps,
         float rope_theta, bool deterministic, int num_threads, uintptr_t stream) {
        RmsNormRopeParams p;
        p.x = to_view(x, "x");
        p.weight = to_view(weight, "weight");
        p.positions = to_view(positions, "positions");
        p.out = to_view(out, "out");
        p.config = norm_rope_config(rotary_dim, eps, rope_theta);
        const RunOptions opt = run_options(deterministic, num_threads, stream);
        nb::gil_scoped_release unlocked;
        rms_norm_rope(p, opt);
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("positions").none(), nb::arg("out"), nb::arg("rotary_dim") = 64,
      nb::arg("eps") = 1e-6f, nb::arg("rope_theta") = 5e6f, MSA_RUN_ARGS,
      "Gemma RMSNorm then partial NeoX RoPE of x [tokens, H, 128] bf16 into out (may be x itself).");

  m.def(
      "insert_kv",
      [](const InArray& k, const InArray& v, const InArray& slot_mapping, const OutArray& k_cache,
         const OutArray& v_cache, KvFormat format, const OptOut& k_block_scale, const OptOut& v_block_scale,
         const OptOut& k_scale, const OptOut& v_scale, const OptIn& index_k, const OptOut& index_k_cache,
         const OptIn& k_norm, const OptIn& index_k_norm, const OptIn& positions, int rotary_dim, float eps,
         float rope_theta, bool deterministic, int num_threads, uintptr_t stream) {
        KvInsertParams p;
        p.k = to_view(k, "k");
        p.v = to_view(v, "v");
        p.slot_mapping = to_view(slot_mapping, "slot_mapping");
        p.cache = make_cache(k_cache, v_cache, format, k_block_scale, v_block_scale, k_scale, v_scale);
        p.index_k = to_view(index_k, "index_k");
        p.index_k_cache = to_view(index_k_cache, "index_k_cache");
        p.k_norm = to_view(k_norm, "k_norm");
        p.index_k_norm = to_view(index_k_norm, "index_k_norm");
        p.positions = to_view(positions, "positions");
        p.config = norm_rope_config(rotary_dim, eps, rope_theta);
        const RunOptions opt = run_options(deterministic, num_threads, stream);
        nb::gil_scoped_release unlocked;
        insert_kv(p, opt);
      },
      nb::arg("k"), nb::arg("v"), nb::arg("slot_mapping"), MSA_CACHE_ARGS, nb::arg("index_k").none() = nb::none(),
      nb::arg("index_k_cache").none() = nb::none(), nb::arg("k_norm").none() = nb::none(),
      nb::arg("index_k_norm").none() = nb::none(), nb::arg("positions").none() = nb::none(),
      nb::arg("rotary_dim") = 64, nb::arg("eps") = 1e-6f, nb::arg("rope_theta") = 5e6f, MSA_RUN_ARGS,
      "Writes new tokens into the paged caches (slot = page * 128 + offset, -1 skips); with k_norm / "
      "index_k_norm, norm + RoPE are applied on the way in.");

  m.def(
      "nvfp4_to_fp8",
      [](const InArray& packed, const InArray& block_scale, const OutArray& out, const OptIn& page_ids,
         bool deterministic, int num_threads, uintptr_t stream) {
        Nvfp4ToFp8Params p;
        p.packed = to_view(packed, "packed");
        p.block_scale = to_view(block_scale, "block_scale");
        p.out = to_view(out, "out");
        p.page_ids = to_view(page_ids, "page_ids");
        const RunOptions opt = run_options(deterministic, num_threads, stream);
        nb::gil_scoped_release unlocked;
        nvfp4_to_fp8(p, opt);
      },
      nb::arg("packed"), nb::arg("block_scale"), nb::arg("out"), nb::arg("page_ids").none() = nb::none(), MSA_RUN_ARGS,
      "Converts an NVFP4 cache (or the pages in page_ids) to FP8 E4M3 holding the same values.");

  m.def(
      "document_positions",
      [](const PackedLayout& layout) {
        auto* owned = new std::vector<int32_t>(document_positions(layout));
        nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
        return nb::cast(nb::ndarray<nb::numpy, int32_t>(owned->data(), {owned->size()}, owner));
      },
      nb::arg("layout"), "Positions of a packed layout's tokens, restarting in every document.");

  m.def(
      "plan_paged_prefill",
      [](const Topology& topo, const InArray& cu_seqlens_q, const InArray& seq_lens, const InArray& page_table,
         const std::string& device, int num_kv_splits, int num_threads, uintptr_t stream) {
        PagedPrefillMetadata meta;
        meta.cu_seqlens_q = to_view(cu_seqlens_q, "cu_seqlens_q");
        meta.seq_lens = to_view(seq_lens, "seq_lens");
        meta.page_table = to_view(page_table, "page_table");
        const InferencePlanOptions options = plan_options(device, num_kv_splits, num_threads, stream);
        nb::gil_scoped_release unlocked;
        return plan_paged_prefill(topo, meta, options);
      },
      nb::arg("topology"), nb::arg("cu_seqlens_q"), nb::arg("seq_lens"), nb::arg("page_table"),
      nb::arg("device") = "cpu", nb::arg("num_kv_splits") = 0, nb::arg("num_threads") = 0, nb::arg("stream") = 0,
      "Plans a paged (chunked) prefill step from int32 CPU metadata.");

  m.def(
      "plan_decode",
      [](const Topology& topo, const InArray& seq_lens, const InArray& page_table, int q_len_per_req,
         const std::string& device, int num_kv_splits, int num_threads, uintptr_t stream) {
        DecodeMetadata meta;
        meta.seq_lens = to_view(seq_lens, "seq_lens");
        meta.page_table = to_view(page_table, "page_table");
        meta.q_len_per_req = q_len_per_req;
        const InferencePlanOptions options = plan_options(device, num_kv_splits, num_threads, stream);
        nb::gil_scoped_release unlocked;
        return plan_decode(topo, meta, options);
      },
      nb::arg("topology"), nb::arg("seq_lens"), nb::arg("page_table"), nb::arg("q_len_per_req") = 1,
      nb::arg("device") = "cpu", nb::arg("num_kv_splits") = 0, nb::arg("num_threads") = 0, nb::arg("stream") = 0,
      "Plans a decode step (q_len_per_req queries per request) from int32 CPU metadata.");

  m.def(
      "update_decode_plan",
      [](InferencePlan& plan, const InArray& seq_lens, const InArray& page_table, int q_len_per_req,
         uintptr_t stream) {
        DecodeMetadata meta;
        meta.seq_lens = to_view(seq_lens, "seq_lens");
        meta.page_table = to_view(page_table, "page_table");
        meta.q_len_per_req = q_len_per_req;
        RunOptions opt;
        opt.stream = reinterpret_cast<void*>(stream);
        nb::gil_scoped_release unlocked;
        update_decode_plan(plan, meta, opt);
      },
      nb::arg("plan"), nb::arg("seq_lens"), nb::arg("page_table"), nb::arg("q_len_per_req"), nb::arg("stream") = 0,
      "Rewrites a decode plan's device metadata for the next step (same batch, Q and table width).");

  m.def(
      "paged_indexer",
      [](const InferencePlan& plan, const InArray& index_q, const InArray& index_k_cache, const OutArray& topk,
         bool deterministic, int num_threads, uintptr_t stream) {
        PagedIndexerParams p;
        p.index_q = to_view(index_q, "index_q");
        p.index_k_cache = to_view(index_k_cache, "index_k_cache");
        p.topk = to_view(topk, "topk");
        const RunOptions opt = run_options(deterministic, num_threads, stream);
        nb::gil_scoped_release unlocked;
        paged_indexer(plan, p, opt);
      },
      nb::arg("plan"), nb::arg("index_q"), nb::arg("index_k_cache"), nb::arg("topk"), MSA_RUN_ARGS,
      "Indexer over the paged index-K cache: topk [Hi, total_q, 16] logical page ids.");

  m.def(
      "paged_attention",
      [](const InferencePlan& plan, const InArray& q, const OutArray& k_cache, const OutArray& v_cache,
         KvFormat format, const OptOut& k_block_scale, const OptOut& v_block_scale, const OptOut& k_scale,
         const OptOut& v_scale, const InArray& topk, const OutArray& out, const OutArray& lse, bool deterministic,
         int num_threads, uintptr_t stream) {
        PagedAttentionParams p;
        p.q = to_view(q, "q");
        p.kv = make_cache(k_cache, v_cache, format, k_block_scale, v_block_scale, k_scale, v_scale);
        p.topk = to_view(topk, "topk");
        p.out = to_view(out, "out");
        p.lse = to_view(lse, "lse");
        const RunOptions opt = run_options(deterministic, num_threads, stream);
        nb::gil_scoped_release unlocked;
        paged_attention(plan, p, opt);
      },
      nb::arg("plan"), nb::arg("q"), MSA_CACHE_ARGS, nb::arg("topk"), nb::arg("out"), nb::arg("lse"), MSA_RUN_ARGS,
      "Sparse attention over the paged caches with the given top-k.");

  m.def(
      "paged_forward",
      [](const InferencePlan& plan, const InArray& index_q, const InArray& index_k_cache, const OutArray& topk,
         const InArray& q, const OutArray& k_cache, const OutArray& v_cache, KvFormat format,
         const OptOut& k_block_scale, const OptOut& v_block_scale, const OptOut& k_scale, const OptOut& v_scale,
         const OutArray& out, const OutArray& lse, bool deterministic, int num_threads, uintptr_t stream) {
        PagedIndexerParams ip;
        ip.index_q = to_view(index_q, "index_q");
        ip.index_k_cache = to_view(index_k_cache, "index_k_cache");
        ip.topk = to_view(topk, "topk");
        PagedAttentionParams ap;
        ap.q = to_view(q, "q");
        ap.kv = make_cache(k_cache, v_cache, format, k_block_scale, v_block_scale, k_scale, v_scale);
        ap.out = to_view(out, "out");
        ap.lse = to_view(lse, "lse");
        const RunOptions opt = run_options(deterministic, num_threads, stream);
        nb::gil_scoped_release unlocked;
        paged_forward(plan, ip, ap, opt);
      },
      nb::arg("plan"), nb::arg("index_q"), nb::arg("index_k_cache"), nb::arg("topk"), nb::arg("q"), MSA_CACHE_ARGS,
      nb::arg("out"), nb::arg("lse"), MSA_RUN_ARGS, "Indexer then attention with its top-k.");
}

}  // namespace msa::python
