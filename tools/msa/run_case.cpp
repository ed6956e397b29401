#include "run_case.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <limits>

#include "case_io.h"
#include "msa/msa.h"
#include "step_buffers.h"

namespace msa::tool {

namespace {

[[noreturn]] void invalid(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }

const std::vector<std::string> kTensorNames = {"q",           "k",           "v",     "index_q", "index_k", "cu_seqlens_q",
                                               "cu_seqlens_k", "fragment_indices", "topk", "grad_out"};
const std::vector<std::string> kMetadataKeys = {"mode",          "init_blocks", "local_blocks", "lse_temperature",
                                                "softmax_scale", "index_scale", "q_per_cta",    "kl_grad_scale",
                                                "format"};

// index_q / index_k: BF16, or F8_E4M3 (scale 1), which the indexer takes as it is.
const StTensor& require_index_tensor(const SafetensorsFile& in, const std::string& name) {
  const StTensor* t = in.find(name);
  if (t && t->dtype != DType::bf16 && t->dtype != DType::f8e4m3)
    invalid(in.path + ": tensor '" + name + "' must be BF16 or F8_E4M3 of rank 3, got " + describe(*t));
  return require_tensor(in, name, t ? t->dtype : DType::bf16, {-1, -1, -1});
}

// The KL backward reads bf16 index inputs: an F8_E4M3 one as a bf16 copy (exact).
StTensor bf16_values(const StTensor& t) {
  StTensor out = make_tensor(t.name, DType::bf16, t.shape);
  const std::vector<float> values = to_host_floats(t.view());
  auto* dst = reinterpret_cast<uint16_t*>(out.bytes.data());
  for (size_t i = 0; i < values.size(); ++i) dst[i] = float_to_bf16(values[i]);
  return out;
}

Topology topology_from(const SafetensorsFile& in, const Metadata& meta, const StTensor& q, const StTensor& k,
                       const StTensor& index_q) {
  Topology topo;
  topo.num_q_heads = int(q.shape[1]);
  topo.num_kv_heads = int(k.shape[1]);
  topo.num_index_heads = int(index_q.shape[1]);
  topo.head_dim = int(q.shape[2]);
  topo.index_head_dim = int(index_q.shape[2]);
  topo.init_blocks = int(meta.integer("init_blocks", 0, 16).value_or(topo.init_blocks));
  topo.local_blocks = int(meta.integer("local_blocks", 0, 16).value_or(topo.local_blocks));
  topo.softmax_scale = float(meta.number("softmax_scale").value_or(0.0));
  topo.index_scale = float(meta.number("index_scale").value_or(0.0));
  try {
    topo.validate();
  } catch (const Error& e) {
    invalid(in.path + ": the inputs describe an unsupported configuration (Hq = q.shape[1] = " +
            std::to_string(topo.num_q_heads) + ", Hkv = k.shape[1] = " + std::to_string(topo.num_kv_heads) +
            ", Hi = index_q.shape[1] = " + std::to_string(topo.num_index_heads) + ", head dim = q.shape[2] = " +
            std::to_string(topo.head_dim) + "): " + e.what());
  }
  return topo;
}

// LSE over the selected causal keys of index_scale * <index_q, index_k>, divided by the
// temperature, in float64 on the host; used when the caller supplies its own selection.
// Also validates the selection so that no id can read outside its document.
std::vector<float> host_selected_lse(const Topology& topo, const PackedLayout& layout, const StTensor& index_q,
                                     const StTensor& index_k, const StTensor& topk, double temperature) {
  const int H = topo.num_index_heads, K = topo.topk, Di = topo.index_head_dim;
  const int64_t total_q = layout.total_q();
  const auto* ids = reinterpret_cast<const int32_t*>(topk.bytes.data());
  const std::vector<float> qi = to_host_floats(index_q.view()), ki = to_host_floats(index_k.view());
  const double scale = topo.indexer_scale();
  std::vector<float> lse(size_t(H * total_q));
  std::string error;
  for (const DocumentSpan& d : layout.documents()) {
    for (int64_t i = 0; i < d.q_len && error.empty(); ++i) {
      const int64_t row = d.q_start + i, local = (d.k_len - d.q_len + i) / topo.block_size;
      for (int g = 0; g < H; ++g) {
        const int32_t* r = ids + (int64_t(g) * total_q + row) * K;
        bool ended = false;
        for (int s = 0; s < K && error.empty(); ++s) {
          const std::string at = "topk[" + std::to_string(g) + ", " + std::to_string(row) + ", " + std::to_string(s) + "]";
          if (r[s] < 0) {
            if (r[s] != -1) error = at + " must be a block id or -1, got " + std::to_string(r[s]);
            ended = true;
          } else if (ended) {
            error = at + " = " + std::to_string(r[s]) + " follows a -1 (valid ids must form a prefix)";
          } else if (r[s] > local) {
            error = at + " = " + std::to_string(r[s]) + " is not a visible block (the query sees blocks 0.." +
                    std::to_string(local) + ")";
          } else {
            for (int t = 0; t < s; ++t)
              if (r[t] == r[s]) error = at + " repeats block " + std::to_string(r[s]);
          }
        }
      }
    }
  }
  if (!error.empty()) invalid(error);

  const auto& docs = layout.documents();
  const auto& query_doc = layout.query_document();
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t row = 0; row < total_q; ++row) {
    const DocumentSpan& d = docs[size_t(query_doc[size_t(row)])];
    const int64_t p = d.k_len - d.q_len + (row - d.q_start);
    std::vector<double> scores;
    for (int g = 0; g < H; ++g) {
      scores.clear();
      const int32_t* r = ids + (int64_t(g) * total_q + row) * K;
      for (int s = 0; s < K && r[s] >= 0; ++s) {
        const int64_t begin = int64_t(r[s]) * topo.block_size;
        const int64_t end = std::min({begin + topo.block_size, p + 1, d.k_len});
        for (int64_t t = begin; t < end; ++t) {
          const float* a = qi.data() + (row * H + g) * Di;
          const float* b = ki.data() + (d.k_start + t) * Di;
          double dot = 0;
          for (int c = 0; c < Di; ++c) dot += double(a[c]) * double(b[c]);
          scores.push_back(dot * scale / temperature);
        }
      }
      double m = -std::numeric_limits<double>::infinity(), sum = 0;
      for (double v : scores) m = std::max(m, v);
      if (std::isfinite(m)) {
        for (double v : scores) sum += std::exp(v - m);
        lse[size_t(g * total_q + row)] = float(m + std::log(sum));
      } else {
        lse[size_t(g * total_q + row)] = scores.empty() ? -std::numeric_limits<float>::infinity() : float(m);
      }
    }
  }
  return lse;
}

// Token counts of the tensors against each other, before anything is allocated from them.
void check_token_counts(const std::string& path, const StTensor& a, const StTensor& b) {
  if (a.shape[0] != b.shape[0])
    invalid(path + ": " + b.name + " must have " + a.name + ".shape[0] = " + std::to_string(a.shape[0]) +
            " tokens, got " + describe(b));
}

StTensor float_tensor(const std::string& name, const std::vector<float>& values, std::vector<int64_t> shape) {
  StTensor t = make_tensor(name, DType::f32, std::move(shape));
  std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

}  // namespace

int run_case(const std::string& in_path, const std::string& out_path, const RunCaseOptions& options) {
  return run_case(SafetensorsFile::read(in_path), out_path, options);
}

int run_case(const SafetensorsFile& in, const std::string& out_path, const RunCaseOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  const std::string& in_path = in.path;
  const Metadata meta(in.metadata, in_path);
  const std::string mode = meta.text("mode").value_or("training");
  if (mode == "decode" || mode == "paged_prefill") return run_inference_case(in, out_path, options);
  if (mode != "training")
    invalid(in_path + ": __metadata__ 'mode' must be training, decode or paged_prefill, got " + quote_short(mode));
  meta.require_known(kMetadataKeys);
  for (const auto& [name, tensor] : in.tensors) {
    (void)tensor;
    bool known = false;
    for (const std::string& n : kTensorNames) known = known || n == name;
    if (!known) {
      std::string list;
      for (const std::string& n : kTensorNames) list += (list.empty() ? "" : ", ") + n;
      invalid(in_path + ": unknown tensor " + quote_short(name) + " (run-case reads " + list + ")");
    }
  }

  // ---- inputs ----
  const StTensor& q = require_tensor(in, "q", DType::bf16, {-1, -1, -1});
  const StTensor& k = require_tensor(in, "k", DType::bf16, {-1, -1, -1});
  const StTensor& v = require_tensor(in, "v", DType::bf16, {-1, -1, -1});
  const StTensor& index_q = require_index_tensor(in, "index_q");
  const StTensor& index_k = require_index_tensor(in, "index_k");
  const StTensor& cu_q = require_tensor(in, "cu_seqlens_q", DType::i32, {-1});
  const StTensor& cu_k = require_tensor(in, "cu_seqlens_k", DType::i32, {-1});
  const StTensor* fragments = optional_tensor(in, "fragment_indices", DType::i32, {-1});
  const StTensor* given_topk = optional_tensor(in, "topk", DType::i32, {-1, -1, -1});
  const StTensor* grad_out = optional_tensor(in, "grad_out", DType::bf16, {-1, -1, -1});

  const Topology topo = topology_from(in, meta, q, k, index_q);
  check_token_counts(in_path, q, index_q);
  check_token_counts(in_path, k, v);
  check_token_counts(in_path, k, index_k);
  if (grad_out) check_token_counts(in_path, q, *grad_out);
  check_cu_seqlens(in_path, cu_q, q.shape[0], "q.shape[0]");
  check_cu_seqlens(in_path, cu_k, k.shape[0], "k.shape[0]");
  if (fragments && fragments->numel() != cu_q.numel() - 1)
    invalid(in_path + ": fragment_indices must have shape [batch = " + std::to_string(cu_q.numel() - 1) + "], got " +
            describe(*fragments));
  const double temperature = meta.number("lse_temperature").value_or(1.0);
  if (!(std::isfinite(temperature) && temperature > 0))
    invalid(in_path + ": __metadata__ 'lse_temperature' must be finite and > 0, got " + quote_short(*meta.text("lse_temperature")));
  PlanOptions plan_options;
  plan_options.q_per_cta = int(meta.integer("q_per_cta", 1, 1 << 20).value_or(plan_options.q_per_cta));
  const double kl_grad_scale = meta.number("kl_grad_scale").value_or(0.0);
  if (!(std::isfinite(kl_grad_scale) && kl_grad_scale >= 0))
    invalid(in_path + ": __metadata__ 'kl_grad_scale' must be finite and >= 0, got " + quote_short(*meta.text("kl_grad_scale")));

  PackedLayout layout;
  try {
    layout = PackedLayout::from_tensors(cu_q.view(), cu_k.view(), fragments ? fragments->view() : TensorView{});
  } catch (const Error& e) {
    invalid(in_path + ": " + e.what());
  }
  const int64_t total_q = layout.total_q(), total_k = layout.total_k();
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, Hi = topo.num_index_heads, D = topo.head_dim;

  // The library names the argument and the expected shape; prefix the file for context.
  auto in_file = [&](const auto& work) {
    try {
      work();
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::invalid_argument) throw;
      invalid(in_path + ": " + e.what());
    }
  };

  // ---- device copies ----
  DeviceArena arena(options.device);
  const Device dev = options.device;
  RunOptions run;
  run.deterministic = options.deterministic;
  run.num_threads = options.threads;
  StepBuffers buf;
  buf.q = arena.upload(q.view());
  buf.k = arena.upload(k.view());
  buf.v = arena.upload(v.view());
  buf.index_q = arena.upload(index_q.view());
  buf.index_k = arena.upload(index_k.view());

  Buffer kl_lse_d;  // [Hi, total_q] f32: the selected LSE at temperature 1, as kl_backward reads it
  std::vector<float> host_lse;  // indexer_lse when topk was given
  if (given_topk) {
    in_file([&] {
      if (given_topk->shape != std::vector<int64_t>{Hi, total_q, topo.topk})
        invalid("topk must have shape [Hi=" + std::to_string(Hi) + ", total_q=" + std::to_string(total_q) + ", " +
                std::to_string(topo.topk) + "], got " + describe(*given_topk));
      if (index_q.shape[0] != total_q)
        invalid("index_q must have shape [total_q=" + std::to_string(total_q) + ", Hi, 128], got " + describe(index_q));
      if (index_k.shape != std::vector<int64_t>{total_k, 1, topo.index_head_dim})
        invalid("index_k must have shape [total_k=" + std::to_string(total_k) + ", 1, 128], got " + describe(index_k));
      host_lse = host_selected_lse(topo, layout, index_q, index_k, *given_topk, temperature);
    });
    buf.topk = arena.upload(given_topk->view());
    if (grad_out) {
      const std::vector<float> kl_lse =
          temperature == 1.0 ? host_lse : host_selected_lse(topo, layout, index_q, index_k, *given_topk, 1.0);
      kl_lse_d = arena.upload(TensorView::contiguous(const_cast<float*>(kl_lse.data()), DType::f32, {Hi, total_q}));
    }
  } else {
    buf.topk = arena.allocate(DType::i32, {Hi, total_q, topo.topk});
    buf.index_lse = arena.allocate(DType::f32, {Hi, total_q});
    in_file([&] {
      SelectBlocksParams p = buf.select_blocks_params();
      p.lse_temperature = float(temperature);
      select_blocks(topo, layout, p, run);
      if (grad_out && temperature != 1.0) {
        Buffer scratch = arena.allocate(DType::i32, {Hi, total_q, topo.topk});
        kl_lse_d = arena.allocate(DType::f32, {Hi, total_q});
        p.topk = scratch.view();
        p.selected_lse = kl_lse_d.view();
        p.lse_temperature = 1.0f;
        select_blocks(topo, layout, p, run);
      } else {
        kl_lse_d = buf.index_lse;
      }
    });
  }

  SparsePlan plan;
  in_file([&] { plan = build_plan(topo, layout, buf.topk.view(), plan_options, run); });

  buf.out = arena.allocate(DType::bf16, {total_q, Hq, D});
  buf.lse = arena.allocate(DType::f32, {total_q, Hq});
  in_file([&] { sparse_attention_forward(topo, layout, plan, buf.forward_params(), run); });

  std::vector<StTensor> outputs;
  if (grad_out) {
    buf.dout = arena.upload(grad_out->view());
    buf.dq = arena.allocate(DType::f32, {total_q, Hq, D});
    buf.dk = arena.allocate(DType::f32, {total_k, Hkv, D});
    buf.dv = arena.allocate(DType::f32, {total_k, Hkv, D});
    buf.dindex_q = arena.allocate(DType::f32, {total_q, Hi, topo.index_head_dim});
    buf.dindex_k = arena.allocate(DType::f32, {total_k, 1, topo.index_head_dim});
    in_file([&] { sparse_attention_backward(topo, layout, plan, buf.backward_params(), run); });
    Buffer kl_index_q, kl_index_k;  // bf16 copies of FP8 index inputs
    if (index_q.dtype == DType::f8e4m3) kl_index_q = arena.upload(bf16_values(index_q).view());
    if (index_k.dtype == DType::f8e4m3) kl_index_k = arena.upload(bf16_values(index_k).view());
    in_file([&] {
      KlBackwardParams p = buf.kl_params();
      if (!kl_index_q.empty()) p.index_q = kl_index_q.view();
      if (!kl_index_k.empty()) p.index_k = kl_index_k.view();
      p.index_lse = kl_lse_d.view();
      p.grad_scale = float(kl_grad_scale);
      kl_backward(topo, layout, plan, p, run);
    });
  }
  synchronize(dev);

  // ---- outputs ----
  outputs.push_back(arena.download("topk", buf.topk.view()));
  outputs.push_back(arena.download("out", buf.out.view()));
  outputs.push_back(arena.download("lse", buf.lse.view()));
  if (given_topk) outputs.push_back(float_tensor("indexer_lse", host_lse, {Hi, total_q}));
  else outputs.push_back(arena.download("indexer_lse", buf.index_lse.view()));
  if (grad_out) {
    outputs.push_back(arena.download("dq", buf.dq.view()));
    outputs.push_back(arena.download("dk", buf.dk.view()));
    outputs.push_back(arena.download("dv", buf.dv.view()));
    outputs.push_back(arena.download("dindex_q", buf.dindex_q.view()));
    outputs.push_back(arena.download("dindex_k", buf.dindex_k.view()));
  }
  std::map<std::string, std::string> out_meta = {
      {"msa_version", kVersion},
      {"backend", to_string(dev)},
      {"deterministic", options.deterministic ? "true" : "false"},
      {"indexer", given_topk ? "skipped (topk given)" : "msa select_blocks"},
      {"indexer_lse", given_topk ? "host float64 over the given topk" : "msa select_blocks"},
      {"gradient_dtype", "F32"},
  };
  if (out_path.empty()) return 0;
  write_safetensors(out_path, outputs, out_meta);
  if (options.summary) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("run-case: training, %s, %lld tokens in %d document%s, %s%s; wrote %zu tensors to %s in %.2f s\n",
                to_string(dev).c_str(), static_cast<long long>(total_q), layout.num_documents(),
                layout.num_documents() == 1 ? "" : "s", given_topk ? "given topk, " : "indexer, ",
                grad_out ? "forward + backward + KL" : "forward", outputs.size(), out_path.c_str(), seconds);
  }
  return 0;
}

}  // namespace msa::tool
