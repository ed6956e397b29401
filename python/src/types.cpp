// Topology, PackedLayout and Plan as Python classes.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <sstream>

#include "bindings.h"
#include "convert.h"
#include "msa/layout.h"

namespace nb = nanobind;

namespace msa::python {

namespace {

// A NumPy array that owns a copy of `values`.
template <typename T>
nb::object numpy_copy(const std::vector<T>& values) {
  auto* owned = new std::vector<T>(values);
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::cast(nb::ndarray<nb::numpy, T>(owned->data(), {owned->size()}, owner));
}

std::string topology_repr(const Topology& t) {
  std::ostringstream os;
  os << "Topology(num_q_heads=" << t.num_q_heads << ", num_kv_heads=" << t.num_kv_heads
     << ", num_index_heads=" << t.num_index_heads << ", head_dim=" << t.head_dim << ", index_head_dim=" << t.index_head_dim
     << ", block_size=" << t.block_size << ", topk=" << t.topk << ", init_blocks=" << t.init_blocks
     << ", local_blocks=" << t.local_blocks << ", softmax_scale=" << t.softmax_scale << ", index_scale=" << t.index_scale
     << ")";
  return os.str();
}

// Causal position of every packed query inside its document (k_len - q_len + i).
std::vector<int32_t> query_positions(const PackedLayout& L) {
  std::vector<int32_t> pos(size_t(L.total_q()));
  for (const DocumentSpan& d : L.documents())
    for (int64_t i = 0; i < d.q_len; ++i) pos[size_t(d.q_start + i)] = int32_t(d.k_len - d.q_len + i);
  return pos;
}

// A view of one plan buffer that keeps the Python Plan object alive.
nb::object plan_array(const Buffer& b, nb::handle owner) {
  TensorView v = b.view();
  std::vector<size_t> shape(v.shape.begin(), v.shape.begin() + v.rank);
  const int device_type = v.device.is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  nb::ndarray<int32_t> a(v.data, shape.size(), shape.data(), owner, nullptr, nb::dtype<int32_t>(), device_type,
                         v.device.index);
  if (!v.device.is_cuda()) return nb::cast(nb::ndarray<nb::numpy, int32_t>(a));
  return nb::cast(a);
}

}  // namespace

void bind_types(nb::module_& m) {
  nb::class_<Topology>(m, "Topology",
                       "Head counts and selection settings; the defaults are MiniMax-M3's sparse layer "
                       "(64 query heads, 4 KV heads, 4 index heads, head dim 128, block 128, top-16).")
      .def(
          "__init__",
          [](Topology* t, int num_q_heads, int num_kv_heads, int num_index_heads, int head_dim, int index_head_dim,
             int block_size, int topk, int init_blocks, int local_blocks, float softmax_scale, float index_scale) {
            new (t) Topology{num_q_heads, num_kv_heads, num_index_heads, head_dim, index_head_dim, block_size,
                             topk,        init_blocks,  local_blocks,    softmax_scale, index_scale};
          },
          nb::kw_only(), nb::arg("num_q_heads") = 64, nb::arg("num_kv_heads") = 4, nb::arg("num_index_heads") = 4,
          nb::arg("head_dim") = 128, nb::arg("index_head_dim") = 128, nb::arg("block_size") = 128, nb::arg("topk") = 16,
          nb::arg("init_blocks") = 0, nb::arg("local_blocks") = 1, nb::arg("softmax_scale") = 0.0f,
          nb::arg("index_scale") = 0.0f)
      .def_static("minimax_m3", &Topology::minimax_m3, nb::arg("tp") = 1,
                  "MiniMax-M3's sparse layer sharded over tp tensor-parallel ranks (1, 2 or 4).")
      .def_rw("num_q_heads", &Topology::num_q_heads)
      .def_rw("num_kv_heads", &Topology::num_kv_heads)
      .def_rw("num_index_heads", &Topology::num_index_heads)
      .def_rw("head_dim", &Topology::head_dim)
      .def_rw("index_head_dim", &Topology::index_head_dim)
      .def_rw("block_size", &Topology::block_size)
      .def_rw("topk", &Topology::topk)
      .def_rw("init_blocks", &Topology::init_blocks)
      .def_rw("local_blocks", &Topology::local_blocks)
      .def_rw("softmax_scale", &Topology::softmax_scale, "0 means 1/sqrt(head_dim)")
      .def_rw("index_scale", &Topology::index_scale, "0 means 1/sqrt(index_head_dim)")
      .def_prop_ro("group_size", &Topology::group_size)
      .def_prop_ro("attention_scale", &Topology::attention_scale)
      .def_prop_ro("indexer_scale", &Topology::indexer_scale)
      .def("validate", &Topology::validate, "Raises InvalidArgumentError naming the first unsupported field.")
      .def("__repr__", &topology_repr);

  nb::class_<PackedLayout>(m, "PackedLayout",
                           "Packed variable-length documents: which query and key rows belong to which "
                           "document. Query i of a document has causal position k_len - q_len + i.")
      .def_static("from_cu_seqlens", &PackedLayout::from_cu_seqlens, nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"),
                  nb::arg("fragment_indices") = std::vector<int32_t>{},
                  "From cumulative lengths [batch + 1] (starting at 0) and optional context-parallel "
                  "fragment_indices [batch].")
      .def_static(
          "from_document_map",
          [](const InArray& map, uintptr_t stream) {
            const TensorView v = to_view(map, "document_map");
            nb::gil_scoped_release unlocked;
            return PackedLayout::from_document_map(v, reinterpret_cast<void*>(stream));
          },
          nb::arg("document_map"), nb::arg("stream") = 0,
          "From a [batch, seq] int32 array: 0 marks padding, any other value is a document id; each "
          "document is one contiguous run. A CUDA array is reduced on its device (ordered on `stream`, "
          "a cudaStream_t as int) and read back with one wait.")
      .def_prop_ro("num_documents", &PackedLayout::num_documents)
      .def_prop_ro("total_q", &PackedLayout::total_q)
      .def_prop_ro("total_k", &PackedLayout::total_k)
      .def_prop_ro("max_seqlen_q", &PackedLayout::max_seqlen_q)
      .def_prop_ro("max_seqlen_k", &PackedLayout::max_seqlen_k)
      .def("total_rows", &PackedLayout::total_rows, nb::arg("block_size") = 128,
           "Sum over documents of ceil(k_len / block_size).")
      .def_prop_ro("cu_seqlens_q", [](const PackedLayout& L) { return numpy_copy(L.cu_seqlens_q()); })
      .def_prop_ro("cu_seqlens_k", [](const PackedLayout& L) { return numpy_copy(L.cu_seqlens_k()); })
      .def_prop_ro("fragment_indices", [](const PackedLayout& L) { return numpy_copy(L.fragment_indices()); })
      .def_prop_ro(
          "documents",
          [](const PackedLayout& L) {
            std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
            for (const DocumentSpan& d : L.documents()) out.emplace_back(d.q_start, d.q_len, d.k_start, d.k_len);
            return out;
          },
          "List of (q_start, q_len, k_start, k_len) per document.")
      .def_prop_ro("query_document", [](const PackedLayout& L) { return numpy_copy(L.query_document()); },
                   "Document index of every packed query row, int32 [total_q].")
      .def_prop_ro("query_positions", [](const PackedLayout& L) { return numpy_copy(query_positions(L)); },
                   "Causal position of every packed query inside its document, int32 [total_q] "
                   "(the RoPE position).")
      .def_prop_ro("has_document_map", &PackedLayout::has_document_map)
      .def_prop_ro("padded_shape",
                   [](const PackedLayout& L) { return std::make_tuple(L.padded_batch(), L.padded_seq()); })
      .def_prop_ro("packed_row_of_padded", [](const PackedLayout& L) { return numpy_copy(L.packed_row_of_padded()); },
                   "For layouts made from a document map: packed row of every padded position "
                   "(row-major) or -1 for padding, int64 [batch * seq].")
      .def_prop_ro("document_padded_start",
                   [](const PackedLayout& L) { return numpy_copy(L.document_padded_start()); },
                   "For layouts made from a document map: padded position (row-major) of every "
                   "document's first token, int64 [num_documents].")
      .def("__repr__", [](const PackedLayout& L) {
        std::ostringstream os;
        os << "PackedLayout(num_documents=" << L.num_documents() << ", total_q=" << L.total_q()
           << ", total_k=" << L.total_k() << ", max_seqlen_q=" << L.max_seqlen_q() << ")";
        return os.str();
      });

  nb::class_<Plan>(m, "Plan",
                   "The key-to-query CSR of a selection and the work schedule (opaque). Built once per layer "
                   "and micro-batch by build_plan; reused by forward, backward and kl_backward.")
      .def_prop_ro("device", [](const Plan& p) { return to_string(p.plan.device); })
      .def_prop_ro("total_q", [](const Plan& p) { return p.plan.total_q; })
      .def_prop_ro("total_rows", [](const Plan& p) { return p.plan.total_rows; })
      .def_prop_ro("num_kv_heads", [](const Plan& p) { return p.plan.num_kv_heads; })
      .def_prop_ro("topk", [](const Plan& p) { return p.plan.topk; })
      .def_prop_ro("q_per_cta", [](const Plan& p) { return p.plan.q_per_cta; })
      .def_prop_ro("work_count", [](const Plan& p) { return p.plan.work_count; })
      .def_prop_ro("topology", [](const Plan& p) { return p.topology; })
      .def(
          "arrays",
          [](nb::handle self) {
            const SparsePlan& p = nb::cast<const Plan&>(self).plan;
            nb::dict d;
            d["rows"] = plan_array(p.rows, self);
            d["row_ptr"] = plan_array(p.row_ptr, self);
            d["q_indices"] = plan_array(p.q_indices, self);
            d["split_slot"] = plan_array(p.split_slot, self);
            d["split_counts"] = plan_array(p.split_counts, self);
            d["schedule"] = plan_array(p.schedule, self);
            d["work_count"] = plan_array(p.work_count_dev, self);
            return d;
          },
          "The plan's int32 buffers as arrays sharing its memory (NumPy on the CPU, DLPack on CUDA), "
          "for inspection.")
      .def("__repr__", [](const Plan& p) {
        std::ostringstream os;
        os << "Plan(device=" << to_string(p.plan.device) << ", total_q=" << p.plan.total_q
           << ", total_rows=" << p.plan.total_rows << ", num_kv_heads=" << p.plan.num_kv_heads
           << ", work_count=" << p.plan.work_count << ")";
        return os.str();
      });
}

}  // namespace msa::python
