// Validation and dispatch of the inference-path operations (pre-processing, cache insertion,
// NVFP4 conversion, paged indexer / attention). Backends receive checked inputs only; every
// check runs before any output is written.
#include <cmath>
#include <vector>

#include "backend_inference.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "msa/inference.h"

namespace msa {

using detail::check_rows_aligned;
using detail::concat;
using detail::Dim;
using detail::dispatch;
using detail::fail;
using detail::require;

namespace {

bool on_cuda(const TensorView& t) { return t.device.is_cuda(); }

// A present tensor with the given dtype, shape and device whose rows may be strided but whose
// last dimension is contiguous.
void check_view(const TensorView& t, const char* name, std::initializer_list<DType> dtypes, const std::vector<Dim>& dims,
                Device dev) {
  detail::check_present(t, name);
  detail::check_dtype(t, name, dtypes);
  detail::check_shape(t, name, dims);
  detail::check_device(t, name, dev);
  detail::check_inner_contiguous(t, name);
}

void check_weight(const TensorView& w, const char* name, Device dev) {
  check_view(w, name, {DType::bf16, DType::f32}, {Dim(kHeadDim)}, dev);
}

void check_config(const NormRopeConfig& c) {
  require(c.rotary_dim >= 0 && c.rotary_dim <= kHeadDim && c.rotary_dim % 2 == 0,
          concat("rotary_dim must be even and in [0, 128], got ", c.rotary_dim));
  require(std::isfinite(c.eps) && c.eps > 0, concat("eps must be finite and > 0, got ", c.eps));
  require(std::isfinite(c.rope_theta) && c.rope_theta > 1,
          concat("rope_theta must be finite and > 1, got ", c.rope_theta));
}

// Per-tensor scale values on the host must be usable multipliers.
void check_scale_value(const TensorView& s, const char* name) {
  if (on_cuda(s)) return;
  const float v = *s.as<const float>();
  require(std::isfinite(v) && v > 0, concat(name, " must be finite and > 0, got ", v));
}

// Per-(head, token) scales are cache data: on the host, every slot the plan reads (positions
// below each request's seq_len) must hold a usable multiplier, as a per-tensor scale must.
void check_token_scale_values(const InferencePlan& plan, const PagedKvCache& c) {
  if (!c.k_scale.present() || c.k_scale.rank != 2 || on_cuda(c.k_scale)) return;
  const auto* seq_lens = static_cast<const int32_t*>(plan.seq_lens.data());
  const auto* page_table = static_cast<const int32_t*>(plan.page_table.data());
  const char* names[2] = {"k_scale", "v_scale"};
  const TensorView* scales[2] = {&c.k_scale, &c.v_scale};
  for (int i = 0; i < 2; ++i) {
    const auto* s = scales[i]->as<const float>();
    const int64_t heads = scales[i]->shape[0], row = scales[i]->shape[1];  // contiguous (checked)
    for (int64_t b = 0; b < plan.batch; ++b)
      for (int64_t pos = 0; pos < seq_lens[b]; ++pos) {
        const int64_t slot = int64_t(page_table[b * plan.max_pages + pos / kPageSize]) * kPageSize + pos % kPageSize;
        for (int64_t h = 0; h < heads; ++h) {
          const float v = s[h * row + slot];
          if (!(std::isfinite(v) && v > 0))
            fail(concat(names[i], "[", h, ", ", slot, "] (request ", b, ", position ", pos,
                        ") must be finite and > 0, got ", v));
        }
      }
  }
}

const char* format_name(KvFormat f) {
  switch (f) {
    case KvFormat::bf16: return "bf16";
    case KvFormat::fp8_e4m3: return "fp8_e4m3";
    case KvFormat::nvfp4: return "nvfp4";
  }
  return "?";
}

// True when t has rank dims.size() and every dims[i] >= 0 matches (-1 = any size).
bool shape_matches(const TensorView& t, const std::vector<int64_t>& dims) {
  if (t.rank != int(dims.size())) return false;
  for (size_t i = 0; i < dims.size(); ++i)
    if (dims[i] >= 0 && t.shape[i] != dims[i]) return false;
  return true;
}

// Cache tensors are described by their contract ("shape [physical_pages, Hkv, 128, 128]") because
// physical_pages is whatever the caller allocated.
void check_cache_view(const TensorView& t, const char* name, DType dtype, const std::vector<int64_t>& dims,
                      const std::string& contract, Device dev) {
  detail::check_present(t, name);
  detail::check_dtype(t, name, {dtype});
  require(shape_matches(t, dims), concat(name, " must have ", contract, ", got ", t.shape_string()));
  detail::check_device(t, name, dev);
  detail::check_inner_contiguous(t, name);
}

// Checks a main cache; returns its physical page count.
int64_t check_cache(const PagedKvCache& c, int Hkv, Device dev) {
  detail::check_present(c.k, "k_cache");
  const bool fp4 = c.format == KvFormat::nvfp4;
  const DType want = c.format == KvFormat::bf16 ? DType::bf16 : fp4 ? DType::u8 : DType::f8e4m3;
  require(c.k.dtype == want, concat("k_cache must be ", dtype_name(want), " for kv format ", format_name(c.format),
                                    ", got ", dtype_name(c.k.dtype)));
  const int64_t last = fp4 ? kHeadDim / 2 : kHeadDim;
  const std::string hkv = concat(" (Hkv = ", Hkv, ")");
  const std::string contract = concat("shape [physical_pages, Hkv, 128, ", last, "]", hkv);
  check_cache_view(c.k, "k_cache", want, {-1, Hkv, kPageSize, last}, contract, dev);
  const int64_t pages = c.k.shape[0];
  check_cache_view(c.v, "v_cache", want, {pages, Hkv, kPageSize, last},
                   concat("the same shape as k_cache ", c.k.shape_string()), dev);
  if (fp4) {
    const std::string sf = concat("shape [physical_pages, Hkv, 128, 8] = [", pages, ", ", Hkv, ", 128, 8]");
    check_cache_view(c.k_block_scale, "k_block_scale", DType::f8e4m3, {pages, Hkv, kPageSize, 8}, sf, dev);
    check_cache_view(c.v_block_scale, "v_block_scale", DType::f8e4m3, {pages, Hkv, kPageSize, 8}, sf, dev);
  } else {
    require(!c.k_block_scale.present() && !c.v_block_scale.present(),
            concat("k_block_scale / v_block_scale belong to nvfp4 caches, got kv format ", format_name(c.format)));
  }
  require(c.k_scale.present() == c.v_scale.present(), "k_scale and v_scale must be both provided or both absent");
  if (!c.k_scale.present()) return pages;
  require(c.format != KvFormat::bf16, "k_scale / v_scale apply to fp8_e4m3 and nvfp4 caches only, got a bf16 cache");
  const char* names[2] = {"k_scale", "v_scale"};
  const TensorView* scales[2] = {&c.k_scale, &c.v_scale};
  bool per_token[2] = {false, false};
  for (int i = 0; i < 2; ++i) {
    const TensorView& s = *scales[i];
    detail::check_dtype(s, names[i], {DType::f32});
    detail::check_device(s, names[i], dev);
    if (s.rank == 0 || (s.rank == 1 && s.shape[0] == 1)) {
      check_scale_value(s, names[i]);
      continue;
    }
    if (fp4) fail(concat(names[i], " of an nvfp4 cache must be a per-tensor global scale ([] or [1]), got ", s.shape_string()));
    require(s.rank == 2, concat("KV scales must be per-tensor scalars ([] or [1]) or per-(head, token) scales "
                                "[num_kv_heads, max_kv_tokens], got ", names[i], " ", s.shape_string()));
    require(s.shape[0] == Hkv && s.shape[1] >= pages * kPageSize,
            concat("per-token/head KV scales must have shape [num_kv_heads, max_kv_tokens] with num_kv_heads = ", Hkv,
                   " and max_kv_tokens >= physical_pages * 128 = ", pages * kPageSize, ", got ", names[i], " ",
                   s.shape_string()));
    detail::check_contiguous(s, names[i]);
    per_token[i] = true;
  }
  require(per_token[0] == per_token[1],
          "k_scale and v_scale must have the same form (both per-tensor or both per-(head, token))");
  return pages;
}

void check_index_cache(const TensorView& c, Device dev) {
  detail::check_present(c, "index_k_cache");
  detail::check_dtype(c, "index_k_cache", {DType::bf16, DType::f8e4m3});
  check_cache_view(c, "index_k_cache", c.dtype, {-1, kPageSize, kHeadDim}, "shape [physical_pages, 128, 128]", dev);
}

void check_plan_device(const InferencePlan& plan, Device dev, const char* op) {
  require(plan.device == dev, concat(op, ": the plan was built for ", to_string(plan.device), " but the inputs are on ",
                                     to_string(dev)));
}

void check_pages_cover(int64_t pages, const InferencePlan& plan, const char* name) {
  require(pages > plan.max_physical_page,
          concat(name, " has ", pages, " physical pages but the plan's page_table refers to physical page ",
                 plan.max_physical_page));
}

void check_indexer(const InferencePlan& plan, const PagedIndexerParams& p, Device dev) {
  const Topology& t = plan.topo;
  const Dim Tq(plan.total_q, plan.phase == InferencePhase::decode ? "batch * Q" : "total_q");
  check_view(p.index_q, "index_q", {DType::bf16, DType::f8e4m3}, {Tq, Dim(t.num_index_heads, "Hi"), Dim(kHeadDim)}, dev);
  check_index_cache(p.index_k_cache, dev);
  check_rows_aligned(p.index_k_cache, "index_k_cache", 16);
  check_pages_cover(p.index_k_cache.shape[0], plan, "index_k_cache");
  detail::check_tensor(p.topk, "topk", {DType::i32}, {Dim(t.num_index_heads, "Hi"), Tq, Dim(kTopk)}, dev);
}

void check_attention_tensors(const InferencePlan& plan, const PagedAttentionParams& p, Device dev) {
  const Topology& t = plan.topo;
  const Dim Tq(plan.total_q, plan.phase == InferencePhase::decode ? "batch * Q" : "total_q");
  check_view(p.q, "q", {DType::bf16}, {Tq, Dim(t.num_q_heads, "Hq"), Dim(kHeadDim)}, dev);
  const int64_t pages = check_cache(p.kv, t.num_kv_heads, dev);
  check_rows_aligned(p.q, "q", 16);
  check_rows_aligned(p.kv.k, "k_cache", 16);
  check_rows_aligned(p.kv.v, "v_cache", 16);
  if (p.kv.format == KvFormat::nvfp4) {
    check_rows_aligned(p.kv.k_block_scale, "k_block_scale", 8);
    check_rows_aligned(p.kv.v_block_scale, "v_block_scale", 8);
  }
  check_pages_cover(pages, plan, "k_cache");
  check_token_scale_values(plan, p.kv);
  detail::check_tensor(p.out, "out", {DType::bf16, DType::f32}, {Tq, Dim(t.num_q_heads, "Hq"), Dim(kHeadDim)}, dev);
  detail::check_tensor(p.lse, "lse", {DType::f32}, {Tq, Dim(t.num_q_heads, "Hq")}, dev);
}

// Top-k contents (CPU): valid ids form a prefix, are unique and visible to the row.
void check_topk_contents(const InferencePlan& plan, const TensorView& topk) {
  if (on_cuda(topk)) return;  // device contents are trusted (the CUDA indexer produces them)
  const auto* ids = topk.as<const int32_t>();
  const auto* pos = static_cast<const int32_t*>(plan.positions.data());
  const int64_t T = plan.total_q;
  for (int g = 0; g < plan.topo.num_kv_heads; ++g)
    for (int64_t r = 0; r < T; ++r) {
      const int64_t local = pos[r] < 0 ? -1 : pos[r] / kPageSize;
      detail::check_selection_row("topk", g, r, ids + (int64_t(g) * T + r) * kTopk, kTopk, local, "page", [&] {
        return local < 0 ? concat(" but row ", r, " is a padding row (negative causal position): it needs all -1")
                         : concat(" is not a visible page: row ", r, " (position ", pos[r], ") sees logical pages 0..",
                                  local);
      });
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------

void rms_norm_rope(const RmsNormRopeParams& p, const RunOptions& opt) {
  detail::check_run_options(opt);
  detail::check_present(p.x, "x");
  const Device dev = p.x.device;
  require(p.x.rank == 3, concat("x must have shape [tokens, H, 128], got ", p.x.shape_string()));
  const Dim T(p.x.shape[0], "tokens"), H(p.x.shape[1], "H");
  check_view(p.x, "x", {DType::bf16}, {T, H, Dim(kHeadDim)}, dev);
  check_weight(p.weight, "weight", dev);
  check_view(p.out, "out", {DType::bf16}, {T, H, Dim(kHeadDim)}, dev);
  check_config(p.config);
  if (p.config.rotary_dim > 0) detail::check_tensor(p.positions, "positions", {DType::i32}, {T}, dev);
  dispatch("rms_norm_rope", dev, [&] { cpu::rms_norm_rope(p, opt); }, [&] { cuda::rms_norm_rope(p, opt); });
}

void insert_kv(const KvInsertParams& p, const RunOptions& opt) {
  detail::check_run_options(opt);
  detail::check_present(p.k, "k");
  const Device dev = p.k.device;
  require(p.k.rank == 3, concat("k must have shape [tokens, Hkv, 128], got ", p.k.shape_string()));
  const int Hkv = int(p.k.shape[1]);
  const int64_t pages = check_cache(p.cache, Hkv, dev);
  const Dim T(p.k.shape[0], "tokens");
  check_view(p.k, "k", {DType::bf16}, {T, Dim(Hkv, "Hkv"), Dim(kHeadDim)}, dev);
  check_view(p.v, "v", {DType::bf16}, {T, Dim(Hkv, "Hkv"), Dim(kHeadDim)}, dev);
  detail::check_tensor(p.slot_mapping, "slot_mapping", {DType::i32}, {T}, dev);
  if (p.index_k.present()) {
    check_view(p.index_k, "index_k", {DType::bf16}, {T, Dim(1), Dim(kHeadDim)}, dev);
    check_index_cache(p.index_k_cache, dev);
    require(p.index_k_cache.shape[0] >= pages,
            concat("index_k_cache must hold at least the main cache's physical_pages = ", pages,
                   " (the slot ids address both), got ", p.index_k_cache.shape_string()));
  } else {
    require(!p.index_k_cache.present() && !p.index_k_norm.present(),
            "index_k_cache / index_k_norm were given without index_k");
  }
  if (p.k_norm.present()) check_weight(p.k_norm, "k_norm", dev);
  if (p.index_k_norm.present()) check_weight(p.index_k_norm, "index_k_norm", dev);
  if (p.k_norm.present() || p.index_k_norm.present()) {
    check_config(p.config);
    if (p.config.rotary_dim > 0) detail::check_tensor(p.positions, "positions", {DType::i32}, {T}, dev);
  }
  if (!on_cuda(p.slot_mapping)) {
    const auto* slots = p.slot_mapping.as<const int32_t>();
    std::vector<bool> used(size_t(pages * kPageSize), false);
    for (int64_t i = 0; i < T.value; ++i) {
      const int32_t s = slots[i];
      if (s == -1) continue;
      if (!(s >= 0 && s < pages * kPageSize))
        fail(concat("slot_mapping[", i, "] = ", s, " must be -1 or a slot in [0, physical_pages * 128 = ",
                     pages * kPageSize, ")"));
      if (used[size_t(s)])
        fail(concat("slot_mapping[", i, "] = ", s, " repeats a slot written by an earlier token; "
                    "each slot may be written once per call"));
      used[size_t(s)] = true;
    }
  }
  dispatch("insert_kv", dev, [&] { cpu::insert_kv(p, opt); }, [&] { cuda::insert_kv(p, opt); });
}

void nvfp4_to_fp8(const Nvfp4ToFp8Params& p, const RunOptions& opt) {
  detail::check_run_options(opt);
  detail::check_present(p.packed, "packed");
  const Device dev = p.packed.device;
  check_cache_view(p.packed, "packed", DType::u8, {-1, -1, kPageSize, 64}, "shape [physical_pages, Hkv, 128, 64]", dev);
  const int64_t pages = p.packed.shape[0], Hkv = p.packed.shape[1];
  check_cache_view(p.block_scale, "block_scale", DType::f8e4m3, {pages, Hkv, kPageSize, 8},
                   concat("shape [physical_pages, Hkv, 128, 8] = [", pages, ", ", Hkv, ", 128, 8]"), dev);
  int64_t n = pages;
  if (p.page_ids.present()) {
    require(p.page_ids.rank == 1, concat("page_ids must have shape [n], got ", p.page_ids.shape_string()));
    n = p.page_ids.shape[0];
    detail::check_tensor(p.page_ids, "page_ids", {DType::i32}, {Dim(n, "n")}, p.page_ids.device);
    require(p.page_ids.device == dev || !on_cuda(p.page_ids),
            concat("page_ids must be on the CPU or on ", to_string(dev), ", got ", to_string(p.page_ids.device)));
    if (!on_cuda(p.page_ids)) {
      const auto* ids = p.page_ids.as<const int32_t>();
      for (int64_t i = 0; i < n; ++i)
        if (!(ids[i] >= -1 && ids[i] < pages))
          fail(concat("page_ids[", i, "] = ", ids[i], " must be -1 or a page in [0, ", pages, ")"));
    }
  }
  check_cache_view(p.out, "out", DType::f8e4m3, {n, Hkv, kPageSize, kHeadDim},
                   concat(p.page_ids.present() ? "shape [n, Hkv, 128, 128] = [" : "shape [physical_pages, Hkv, 128, 128] = [", n,
                          ", ", Hkv, ", 128, 128]"),
                   dev);
  dispatch("nvfp4_to_fp8", dev, [&] { cpu::nvfp4_to_fp8(p, opt); }, [&] { cuda::nvfp4_to_fp8(p, opt); });
}

void paged_indexer(const InferencePlan& plan, const PagedIndexerParams& p, const RunOptions& opt) {
  detail::check_run_options(opt);
  detail::check_present(p.index_q, "index_q");
  const Device dev = p.index_q.device;
  check_plan_device(plan, dev, "paged_indexer");
  check_indexer(plan, p, dev);
  dispatch("paged_indexer", dev, [&] { cpu::paged_indexer(plan, p, opt); }, [&] { cuda::paged_indexer(plan, p, opt); });
}

void paged_attention(const InferencePlan& plan, const PagedAttentionParams& p, const RunOptions& opt) {
  detail::check_run_options(opt);
  detail::check_present(p.q, "q");
  const Device dev = p.q.device;
  check_plan_device(plan, dev, "paged_attention");
  check_attention_tensors(plan, p, dev);
  const Dim Tq(plan.total_q, plan.phase == InferencePhase::decode ? "batch * Q" : "total_q");
  detail::check_tensor(p.topk, "topk", {DType::i32}, {Dim(plan.topo.num_kv_heads, "Hkv"), Tq, Dim(kTopk)}, dev);
  check_topk_contents(plan, p.topk);
  dispatch(
      "paged_attention", dev, [&] { cpu::paged_attention(plan, p, opt); }, [&] { cuda::paged_attention(plan, p, opt); });
}

void paged_forward(const InferencePlan& plan, const PagedIndexerParams& indexer, const PagedAttentionParams& attention,
                   const RunOptions& opt) {
  detail::check_run_options(opt);
  detail::check_present(indexer.index_q, "index_q");
  const Device dev = indexer.index_q.device;
  check_plan_device(plan, dev, "paged_forward");
  check_indexer(plan, indexer, dev);
  check_attention_tensors(plan, attention, dev);
  require(!attention.topk.present() || attention.topk.data == indexer.topk.data,
          "paged_forward: attention.topk must be absent or the same tensor as indexer.topk (the attention reads the "
          "indexer's selection)");
  PagedAttentionParams a = attention;
  a.topk = indexer.topk;
  dispatch(
      "paged_forward", dev,
      [&] {
        cpu::paged_indexer(plan, indexer, opt);
        cpu::paged_attention(plan, a, opt);
      },
      [&] {
        cuda::paged_indexer(plan, indexer, opt);
        cuda::paged_attention(plan, a, opt);
      });
}

}  // namespace msa
