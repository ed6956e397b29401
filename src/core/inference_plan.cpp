// Planning of paged prefill and decode: checks one step's request metadata on the host,
// derives the per-row facts every layer needs (causal position, request, cache slot) and
// allocates the run's scratch memory on the plan's device.
#include <omp.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <new>

#include "backend.h"
#include "backend_inference.h"
#include "core/buffer_pack.h"
#include "core/check.h"
#include "core/decode_splits.h"
#include "core/dispatch.h"
#include "msa/inference.h"

namespace msa {

using detail::concat;
using detail::Dim;
using detail::fail;
using detail::require;

namespace {

constexpr int64_t kMaxPages = 8192;                          // 1,048,576 tokens per request
constexpr int64_t kMaxPhysicalPage = (int64_t(1) << 31) / 128 - 1;  // slot ids fit in int32

// Copies a host int32 tensor of the given shape (any strides) into a row-major vector.
std::vector<int32_t> host_int32(const TensorView& t, const char* name, const std::vector<Dim>& dims) {
  detail::check_present(t, name);
  detail::check_dtype(t, name, {DType::i32});
  detail::check_shape(t, name, dims);
  require(!t.device.is_cuda(),
          concat(name, " must be a CPU tensor (plans read request metadata on the host), got ", to_string(t.device)));
  const int64_t rows = t.rank == 2 ? t.shape[0] : 1, cols = t.shape[size_t(t.rank - 1)];
  const int64_t row_stride = t.rank == 2 ? t.stride[0] : 0, col_stride = t.stride[size_t(t.rank - 1)];
  std::vector<int32_t> v(size_t(rows * cols));
  const auto* p = t.as<const int32_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) v[size_t(r * cols + c)] = p[r * row_stride + c * col_stride];
  return v;
}

// A plan's buffer on `device` holding a copy of host `values` with `shape` (queued on `stream`,
// given back in its order).
Buffer device_copy(Device device, const std::vector<int32_t>& values, std::vector<int64_t> shape, void* stream) {
  Buffer b(device, DType::i32, shape, stream, Release::in_stream);
  if (values.empty()) return b;
  const TensorView src = TensorView::contiguous(const_cast<int32_t*>(values.data()), DType::i32, shape);
  copy(src, b.view(), stream);
  return b;
}

// Several int32 tables on `device` from one allocation (a BufferPack) and one copy: each copy
// from pageable host memory costs ~10 us of a plan's time on a GPU, whatever its size.
class Int32Upload {
 public:
  void add(Buffer* target, const std::vector<int32_t>& values, std::vector<int64_t> shape) {
    pieces_.push_back({pack_.add(target, DType::i32, std::move(shape)), &values});
  }
  // Queued on `stream` (pageable host memory: the values are staged before the call returns).
  void run(Device device, void* stream) {
    const Buffer whole = pack_.allocate(device, stream, Release::in_stream);
    std::vector<uint8_t> host(size_t(whole.bytes()), 0);
    for (const auto& [offset, values] : pieces_)
      if (!values->empty()) std::memcpy(host.data() + offset, values->data(), values->size() * sizeof(int32_t));
    copy(TensorView::contiguous(host.data(), DType::u8, {int64_t(host.size())}), whole.view(), stream);
    pieces_.clear();
  }

 private:
  detail::BufferPack pack_;
  std::vector<std::pair<int64_t, const std::vector<int32_t>*>> pieces_;  // byte offset, values
};

// Host description of the step; turned into a plan by `finish`.
struct StepRequests {
  std::vector<int32_t> cu_q, seq_lens, page_table;
  int64_t batch = 0, max_pages = 0;
};

void check_page_table(const StepRequests& s) {
  int64_t max_k = 0, max_k_req = 0;
  for (int64_t b = 0; b < s.batch; ++b)
    if (s.seq_lens[size_t(b)] > max_k) max_k = s.seq_lens[size_t(b)], max_k_req = b;
  const int64_t pages_needed = (max_k + kPageSize - 1) / kPageSize;
  require(pages_needed <= kMaxPages,
          concat("seq_lens[", max_k_req, "] = ", max_k, " needs ", pages_needed,
                 " pages; the maximum page count must be in [1, ", kMaxPages, "] (contexts of at most ",
                 kMaxPages * kPageSize, " tokens)"));
  require(s.max_pages * kPageSize >= max_k,
          concat("page_table capacity is smaller than max_seqlen_k: page_table has max_pages = ", s.max_pages, " (",
                 s.max_pages * kPageSize, " tokens) but seq_lens[", max_k_req, "] = ", max_k));
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t used = (int64_t(s.seq_lens[size_t(b)]) + kPageSize - 1) / kPageSize;
    for (int64_t j = 0; j < used; ++j) {
      const int32_t page = s.page_table[size_t(b * s.max_pages + j)];
      if (!(page >= 0 && page <= kMaxPhysicalPage))
        fail(concat("page_table[", b, ", ", j, "] = ", page, " maps a page inside seq_lens[", b, "] = ",
                     s.seq_lens[size_t(b)], "; expected a physical page id in [0, ", kMaxPhysicalPage,
                     "] (slot ids page * 128 + offset must fit in int32)"));
    }
  }
}

// What every query row of a step needs (causal position, request, cache slot) and the step's
// extremes.
struct StepRows {
  std::vector<int32_t> positions, request, slots;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0, max_physical_page = -1;
};

StepRows step_rows(const StepRequests& s) {
  StepRows r;
  const size_t total_q = size_t(s.cu_q.back());
  r.positions.resize(total_q), r.request.resize(total_q), r.slots.resize(total_q);
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t q0 = s.cu_q[size_t(b)], q_len = s.cu_q[size_t(b) + 1] - q0, k_len = s.seq_lens[size_t(b)];
    r.max_seqlen_q = std::max(r.max_seqlen_q, q_len);
    r.max_seqlen_k = std::max(r.max_seqlen_k, k_len);
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t pos = k_len - q_len + i;
      r.positions[size_t(q0 + i)] = int32_t(pos);
      r.request[size_t(q0 + i)] = int32_t(b);
      r.slots[size_t(q0 + i)] =
          pos < 0 ? -1 : int32_t(s.page_table[size_t(b * s.max_pages + pos / kPageSize)] * kPageSize + pos % kPageSize);
    }
    for (int64_t j = 0; j < (k_len + kPageSize - 1) / kPageSize; ++j)
      r.max_physical_page = std::max<int64_t>(r.max_physical_page, s.page_table[size_t(b * s.max_pages + j)]);
  }
  return r;
}

// num_kv_splits: decode's split count, 0 = automatic; prefill: 1.
InferencePlan finish(const Topology& topo, InferencePhase phase, const StepRequests& s, int q_len_per_req,
                     int num_kv_splits, const InferencePlanOptions& options) {
  check_page_table(s);
  InferencePlan plan;
  plan.phase = phase;
  plan.topo = topo;
  plan.device = options.device;
  plan.batch = s.batch;
  plan.max_pages = s.max_pages;
  plan.q_len_per_req = q_len_per_req;
  plan.total_q = s.cu_q.back();
  const StepRows rows = step_rows(s);
  const std::vector<int32_t>& positions = rows.positions;
  const std::vector<int32_t>& request = rows.request;
  const std::vector<int32_t>& slots = rows.slots;
  plan.max_seqlen_q = rows.max_seqlen_q;
  plan.max_seqlen_k = rows.max_seqlen_k;
  plan.max_physical_page = rows.max_physical_page;

  if (options.device.is_cuda() && !detail::kWithCuda) detail::no_cuda_backend("inference plan (options.device)");
  const Device dev = options.device;
  if (num_kv_splits == 0) {  // decode, automatic (src/core/decode_splits.h)
    // The CPU runs the splits of a (row, KV head) item one after another: a split only adds work.
    num_kv_splits = 1;
    if (dev.is_cuda()) {
      const int64_t ctas = detail::cuda_only("inference plan (options.device)", [&] {
        return cuda::decode_attention_concurrency(dev.index, q_len_per_req);
      });
      num_kv_splits = detail::automatic_kv_splits(detail::decode_split_work(s.seq_lens, q_len_per_req, topo.num_kv_heads, ctas));
    }
  }
  plan.num_kv_splits = num_kv_splits;
  Int32Upload tables;
  tables.add(&plan.cu_seqlens_q, s.cu_q, {s.batch + 1});
  tables.add(&plan.seq_lens, s.seq_lens, {s.batch});
  tables.add(&plan.page_table, s.page_table, {s.batch, s.max_pages});
  tables.add(&plan.positions, positions, {plan.total_q});
  tables.add(&plan.query_request, request, {plan.total_q});
  tables.add(&plan.slot_mapping, slots, {plan.total_q});
  tables.run(dev, options.stream);
  if (phase == InferencePhase::decode) {
    plan.partial_out = Buffer(dev, DType::f32, {num_kv_splits, plan.total_q, topo.num_q_heads, kHeadDim},
                              options.stream, Release::in_stream);
    plan.partial_lse = Buffer(dev, DType::f32, {num_kv_splits, plan.total_q, topo.num_q_heads}, options.stream,
                              Release::in_stream);
    if (dev.is_cuda() && num_kv_splits > 1) {  // the last split CTA of a tile merges (paged_decode_wgmma.cu)
      const int64_t rows = detail::decode_tile_rows(q_len_per_req);
      const int64_t n = (plan.total_q + rows - 1) / rows * topo.num_kv_heads;
      plan.split_arrivals = device_copy(dev, std::vector<int32_t>(size_t(n), 0), {n}, options.stream);
    }
  }
  if (!dev.is_cuda()) {
    plan.num_threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
    plan.scratch_f32 = Buffer(dev, DType::f32, {plan.num_threads, cpu::inference_scratch_f32(plan)});
  } else {
    // CUDA: the indexer's page scores [rows, Hi * history pages] for up to `rows` query rows
    // at a time (runs take the rows in chunks of this size), at most ~128 MiB.
    const int64_t history = std::max<int64_t>(1, (plan.max_seqlen_k + kPageSize - 1) / kPageSize - 1);
    const int64_t per_row = int64_t(topo.num_index_heads) * history;
    const int64_t budget = int64_t(32) << 20;  // floats
    const int64_t rows = std::clamp<int64_t>(budget / per_row, 16, std::max<int64_t>(plan.total_q, 16));
    plan.scratch_f32 = Buffer(dev, DType::f32, {rows, per_row}, options.stream, Release::in_stream);
    if (phase == InferencePhase::prefill)
      plan.backend = detail::cuda_only("paged prefill plan", [&] {
        return cuda::prepare_paged_prefill(plan, s.cu_q, s.seq_lens, options.stream);
      });
    plan.streams = detail::cuda_only("inference plan", [&] { return cuda::plan_streams(dev.index, options.stream); });
  }
  return plan;
}

void check_options(const InferencePlanOptions& o) {
  require(o.num_threads >= 0 && o.num_threads <= detail::kMaxThreads,
          concat("num_threads must be in [0, ", detail::kMaxThreads, "] (0 = OpenMP's default), got ", o.num_threads));
}

// The requests of one step: seq_lens [batch], batch >= 1 (`who` names the planner).
StepRequests requests_of(const TensorView& seq_lens, const char* who) {
  detail::check_present(seq_lens, "seq_lens");
  require(seq_lens.rank == 1, concat("seq_lens must have shape [batch], got ", seq_lens.shape_string()));
  StepRequests s;
  s.batch = seq_lens.shape[0];
  require(s.batch >= 1, concat(who, " requires batch >= 1 (seq_lens of shape [batch]), got batch = 0"));
  s.seq_lens = host_int32(seq_lens, "seq_lens", {Dim(s.batch, "batch")});
  return s;
}

// page_table [batch, max_pages >= 1] of the requests in `s`.
void read_page_table(const TensorView& page_table, StepRequests& s) {
  detail::check_present(page_table, "page_table");
  require(page_table.rank == 2 && page_table.shape[0] == s.batch && page_table.shape[1] >= 1,
          concat("page_table must have shape [batch, max_pages] = [", s.batch, ", >= 1], got ",
                 page_table.shape_string()));
  s.max_pages = page_table.shape[1];
  s.page_table = host_int32(page_table, "page_table", {Dim(s.batch, "batch"), Dim(s.max_pages, "max_pages")});
}

// A decode step's requests (Q rows each) from its metadata: read (shapes checked), then its
// lengths checked (check_decode_lengths) as plan_decode does.
void check_q_len(int Q) {
  require(Q >= 1 && Q <= kTopk, concat("query_length (q_len_per_req) must be an integer in [1, 16], got ", Q));
}

StepRequests read_decode_requests(const DecodeMetadata& meta) {
  check_q_len(meta.q_len_per_req);
  StepRequests s = requests_of(meta.seq_lens, "decode");
  read_page_table(meta.page_table, s);
  return s;
}

void check_decode_lengths(StepRequests& s, int Q) {
  for (int64_t b = 0; b < s.batch; ++b) {
    const int32_t k_len = s.seq_lens[size_t(b)];
    require(k_len == 0 || k_len >= Q,
            concat("seq_lens[", b, "] = ", k_len, " must be 0 (a padding row) or >= q_len_per_req = ", Q,
                   " (the step's queries are part of the KV sequence)"));
  }
  require(s.batch * Q <= INT32_MAX, concat("batch * q_len_per_req must fit in int32, got ", s.batch * Q));
  s.cu_q.resize(size_t(s.batch) + 1);
  for (int64_t b = 0; b <= s.batch; ++b) s.cu_q[size_t(b)] = int32_t(b * Q);
}

}  // namespace

// Member-wise assignment would give the old plan's buffers back before its `streams` (the last
// member) had ordered their release after the plan's runs; the old plan is released as a whole
// instead, by its destructor.
InferencePlan& InferencePlan::operator=(InferencePlan&& other) noexcept {
  if (this == &other) return *this;
  const InferencePlan old(std::move(*this));  // released when this returns, streams first
  this->~InferencePlan();                     // holds nothing now: every member was moved out
  new (this) InferencePlan(std::move(other));
  return *this;
}

InferencePlan& InferencePlan::operator=(const InferencePlan& other) {
  if (this != &other) *this = InferencePlan(other);
  return *this;
}

InferencePlan plan_paged_prefill(const Topology& topo, const PagedPrefillMetadata& meta,
                                 const InferencePlanOptions& options) {
  topo.validate();
  check_options(options);
  require(options.num_kv_splits == 0 || options.num_kv_splits == 1,
          concat("num_kv_splits applies to decode only; paged prefill needs 0 or 1, got ", options.num_kv_splits));
  StepRequests s = requests_of(meta.seq_lens, "paged prefill");
  s.cu_q = host_int32(meta.cu_seqlens_q, "cu_seqlens_q", {Dim(s.batch + 1, "batch + 1")});
  read_page_table(meta.page_table, s);
  require(s.cu_q[0] == 0, concat("cu_seqlens_q[0] must be 0, got ", s.cu_q[0]));
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t q_len = int64_t(s.cu_q[size_t(b) + 1]) - s.cu_q[size_t(b)];
    require(q_len >= 0, concat("cu_seqlens_q must be non-decreasing, got cu_seqlens_q[", b, "] = ", s.cu_q[size_t(b)],
                               " > cu_seqlens_q[", b + 1, "] = ", s.cu_q[size_t(b) + 1]));
    require(s.seq_lens[size_t(b)] >= q_len,
            concat("query position is outside its KV sequence: request ", b, " has ", q_len,
                   " queries (cu_seqlens_q) but seq_lens[", b, "] = ", s.seq_lens[size_t(b)],
                   "; seq_lens must include the chunk (seq_lens[b] >= q_len_b)"));
  }
  return finish(topo, InferencePhase::prefill, s, 0, 1, options);
}

InferencePlan plan_decode(const Topology& topo, const DecodeMetadata& meta, const InferencePlanOptions& options) {
  topo.validate();
  check_options(options);
  check_q_len(meta.q_len_per_req);
  const int splits = options.num_kv_splits;
  require(splits == 0 || splits == 1 || splits == 2 || splits == 4 || splits == 8 || splits == 16,
          concat("num_kv_splits must be 0 (automatic), 1, 2, 4, 8 or 16, got ", splits));
  StepRequests s = read_decode_requests(meta);
  check_decode_lengths(s, meta.q_len_per_req);
  return finish(topo, InferencePhase::decode, s, meta.q_len_per_req, splits, options);  // 0: chosen from the work there
}

void update_decode_plan(InferencePlan& plan, const DecodeMetadata& meta, const RunOptions& opt) {
  detail::check_run_options(opt);
  require(plan.phase == InferencePhase::decode && plan.q_len_per_req >= 1,
          "update_decode_plan needs a decode plan (from plan_decode), got a prefill plan");
  require(meta.q_len_per_req == plan.q_len_per_req,
          concat("q_len_per_req must be the plan's ", plan.q_len_per_req, ", got ", meta.q_len_per_req));
  StepRequests s = read_decode_requests(meta);
  require(s.batch == plan.batch,
          concat("seq_lens must have the plan's batch = ", plan.batch, " entries, got ", s.batch));
  require(s.max_pages == plan.max_pages,
          concat("page_table must have the plan's width max_pages = ", plan.max_pages, ", got ", s.max_pages));
  check_decode_lengths(s, meta.q_len_per_req);
  check_page_table(s);
  const StepRows rows = step_rows(s);
  for (int64_t b = 0; b < s.batch; ++b)
    require(s.seq_lens[size_t(b)] <= plan.max_seqlen_k,
            concat("seq_lens[", b, "] = ", s.seq_lens[size_t(b)], " is longer than the plan's max_seqlen_k = ",
                   plan.max_seqlen_k, ": the indexer's launch (also a captured one) covers the context the plan was "
                   "made for; plan with the longest context the step will see"));
  // Checked: now the device copies, ordered on opt.stream (the host vectors may go once the
  // calls return). cu_seqlens_q and query_request depend on batch and Q only.
  auto upload = [&](const std::vector<int32_t>& values, const Buffer& dst) {
    const TensorView src = TensorView::contiguous(const_cast<int32_t*>(values.data()), DType::i32,
                                                  dst.view().shape_vector());
    copy(src, dst.view(), opt.stream);
  };
  upload(s.seq_lens, plan.seq_lens);
  upload(s.page_table, plan.page_table);
  upload(rows.positions, plan.positions);
  upload(rows.slots, plan.slot_mapping);
  plan.max_physical_page = rows.max_physical_page;
  if (plan.device.is_cuda())  // runs on other streams wait for these copies
    detail::cuda_only("update_decode_plan", [&] { cuda::plan_uploaded(plan.streams, opt.stream); });
}

std::vector<int32_t> document_positions(const PackedLayout& layout) {
  std::vector<int32_t> pos(size_t(layout.total_q()));
  for (const DocumentSpan& d : layout.documents())
    for (int64_t i = 0; i < d.q_len; ++i) pos[size_t(d.q_start + i)] = int32_t(d.k_len - d.q_len + i);
  return pos;
}

}  // namespace msa
