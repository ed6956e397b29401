// `msa run-case` for the inference modes: paged prefill and decode over paged KV caches.
//
// Inputs (names are exact; any other tensor name is an error):
//   q [total_q, Hq, 128] BF16 (decode: total_q = batch * q_len_per_req),
//   index_q [total_q, Hi, 128] BF16 or F8_E4M3,
//   k_cache, v_cache: kv_format bf16  -> BF16    [physical_pages, Hkv, 128, 128]
//                     kv_format fp8   -> F8_E4M3 [physical_pages, Hkv, 128, 128]
//                     kv_format nvfp4 -> U8      [physical_pages, Hkv, 128, 64] (packed E2M1)
//   k_cache_sf, v_cache_sf [physical_pages, Hkv, 128, 8] F8_E4M3 (nvfp4 block scales),
//   k_scale, v_scale F32 (optional, both or neither): fp8 [] / [1] per tensor or
//     [Hkv, max_kv_tokens] per (head, physical_page * 128 + offset); nvfp4 [] / [1] global scale,
//   index_k_cache [physical_pages, 128, 128] BF16 or F8_E4M3,
//   page_table [batch, max_pages] I32, seq_lens [batch] I32 (KV length including this step),
//   cu_seqlens_q [batch + 1] I32 (paged_prefill only),
//   topk [Hi, total_q, 16] I32 (optional: then the indexer is skipped).
// __metadata__: mode (decode | paged_prefill), kv_format (bf16 | fp8 | nvfp4; default from the
//   dtype of k_cache), q_len_per_req (decode; default total_q / batch), num_kv_splits (decode;
//   0 or absent = automatic), softmax_scale, format (ignored). Any other key is an error.
// Outputs: topk I32 [Hi, total_q, 16], out BF16 [total_q, Hq, 128], lse F32 [total_q, Hq].
#include "inference_case.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>

#include "case_io.h"
#include "msa/msa.h"
#include "msa/inference.h"

namespace msa::tool {

namespace {

[[noreturn]] void invalid(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }

const std::vector<std::string> kTensorNames = {"q",          "index_q",      "k_cache",  "v_cache",       "k_cache_sf",
                                               "v_cache_sf", "k_scale",      "v_scale",  "index_k_cache", "page_table",
                                               "seq_lens",   "cu_seqlens_q", "topk"};
const std::vector<std::string> kMetadataKeys = {"mode", "kv_format", "q_len_per_req", "num_kv_splits", "softmax_scale",
                                                "format"};

const StTensor& required(const SafetensorsFile& in, const std::string& name, const std::string& mode) {
  const StTensor* t = in.find(name);
  if (!t) invalid(in.path + ": mode " + mode + " needs tensor '" + name + "'");
  return *t;
}

}  // namespace

int run_inference_case(const SafetensorsFile& in, const std::string& out_path, const RunCaseOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  const Metadata meta(in.metadata, in.path);
  const std::string mode = meta.text("mode").value_or("");
  const bool decode = mode == "decode";
  if (!decode && mode != "paged_prefill")
    invalid(in.path + ": run_inference_case handles modes decode and paged_prefill, got " + quote_short(mode));
  meta.require_known(kMetadataKeys);
  for (const auto& [name, tensor] : in.tensors) {
    (void)tensor;
    if (std::find(kTensorNames.begin(), kTensorNames.end(), name) != kTensorNames.end()) continue;
    std::string list;
    for (const std::string& n : kTensorNames) list += (list.empty() ? "" : ", ") + n;
    invalid(in.path + ": unknown tensor " + quote_short(name) + " for mode " + mode + " (it reads " + list + ")");
  }

  // ---- inputs ----
  const StTensor& q = required(in, "q", mode);
  const StTensor& index_q = required(in, "index_q", mode);
  const StTensor& k_cache = required(in, "k_cache", mode);
  const StTensor& v_cache = required(in, "v_cache", mode);
  const StTensor& index_k_cache = required(in, "index_k_cache", mode);
  const StTensor& page_table = required(in, "page_table", mode);
  const StTensor& seq_lens = required(in, "seq_lens", mode);
  const StTensor* cu_seqlens_q = in.find("cu_seqlens_q");
  const StTensor* k_sf = in.find("k_cache_sf");
  const StTensor* v_sf = in.find("v_cache_sf");
  const StTensor* k_scale = in.find("k_scale");
  const StTensor* v_scale = in.find("v_scale");
  const StTensor* given_topk = in.find("topk");
  if (decode && cu_seqlens_q)
    invalid(in.path + ": mode decode takes q_len_per_req from __metadata__, not a cu_seqlens_q tensor");
  if (!decode && !cu_seqlens_q) invalid(in.path + ": mode paged_prefill needs tensor 'cu_seqlens_q'");
  for (const StTensor* t : {&q, &index_q, &k_cache})
    if (t->shape.size() < 2)
      invalid(in.path + ": " + t->name + " must have rank >= 2 to give a head count, got " + describe(*t));
  if (cu_seqlens_q && cu_seqlens_q->dtype == DType::i32 && cu_seqlens_q->shape.size() == 1)
    check_cu_seqlens(in.path, *cu_seqlens_q, q.shape[0], "q.shape[0]");
  if (seq_lens.shape.size() != 1) invalid(in.path + ": seq_lens must have shape [batch], got " + describe(seq_lens));

  const std::string default_format = k_cache.dtype == DType::u8 ? "nvfp4" : k_cache.dtype == DType::f8e4m3 ? "fp8" : "bf16";
  const std::string format_name = meta.text("kv_format").value_or(default_format);
  PagedKvCache cache;
  if (format_name == "bf16") cache.format = KvFormat::bf16;
  else if (format_name == "fp8") cache.format = KvFormat::fp8_e4m3;
  else if (format_name == "nvfp4") cache.format = KvFormat::nvfp4;
  else invalid(in.path + ": __metadata__ 'kv_format' must be bf16, fp8 or nvfp4, got " + quote_short(format_name));
  if (cache.format != KvFormat::nvfp4 && (k_sf || v_sf))
    invalid(in.path + ": k_cache_sf / v_cache_sf belong to kv_format nvfp4, got kv_format " + format_name);

  Topology topo;
  topo.num_q_heads = int(q.shape[1]);
  topo.num_kv_heads = int(k_cache.shape[1]);
  topo.num_index_heads = int(index_q.shape[1]);
  topo.softmax_scale = float(meta.number("softmax_scale").value_or(0.0));
  try {
    topo.validate();
  } catch (const Error& e) {
    invalid(in.path + ": the inputs describe an unsupported configuration (Hq = q.shape[1] = " +
            std::to_string(topo.num_q_heads) + ", Hkv = k_cache.shape[1] = " + std::to_string(topo.num_kv_heads) +
            ", Hi = index_q.shape[1] = " + std::to_string(topo.num_index_heads) + "): " + e.what());
  }

  auto in_file = [&](const auto& work) {
    try {
      work();
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::invalid_argument) throw;
      invalid(in.path + ": " + e.what());
    }
  };

  // ---- plan (request metadata stays on the host) ----
  const int64_t batch = seq_lens.shape[0];
  InferencePlanOptions plan_options;
  plan_options.device = options.device;
  plan_options.num_threads = options.threads;
  InferencePlan plan;
  if (decode) {
    int64_t q_len = batch > 0 && q.shape[0] % batch == 0 ? q.shape[0] / batch : 0;
    q_len = meta.integer("q_len_per_req", -(int64_t(1) << 40), int64_t(1) << 40).value_or(q_len);
    plan_options.num_kv_splits = int(meta.integer("num_kv_splits", 0, 16).value_or(0));
    in_file([&] {
      DecodeMetadata m;
      m.seq_lens = seq_lens.view();
      m.page_table = page_table.view();
      m.q_len_per_req = int(std::clamp<int64_t>(q_len, -1, 1 << 20));
      plan = plan_decode(topo, m, plan_options);
    });
  } else {
    if (meta.text("q_len_per_req") || meta.text("num_kv_splits"))
      invalid(in.path + ": __metadata__ 'q_len_per_req' / 'num_kv_splits' apply to mode decode only");
    in_file([&] {
      PagedPrefillMetadata m;
      m.cu_seqlens_q = cu_seqlens_q->view();
      m.seq_lens = seq_lens.view();
      m.page_table = page_table.view();
      plan = plan_paged_prefill(topo, m, plan_options);
    });
  }

  // ---- device copies ----
  DeviceArena arena(options.device);
  RunOptions run;
  run.deterministic = options.deterministic;
  run.num_threads = options.threads;
  Buffer q_d = arena.upload(q.view()), qi_d = arena.upload(index_q.view());
  Buffer k_d = arena.upload(k_cache.view()), v_d = arena.upload(v_cache.view());
  Buffer ki_d = arena.upload(index_k_cache.view());
  Buffer ksf_d, vsf_d, ks_d, vs_d;
  cache.k = k_d.view();
  cache.v = v_d.view();
  if (k_sf) cache.k_block_scale = (ksf_d = arena.upload(k_sf->view())).view();
  if (v_sf) cache.v_block_scale = (vsf_d = arena.upload(v_sf->view())).view();
  if (k_scale) cache.k_scale = (ks_d = arena.upload(k_scale->view())).view();
  if (v_scale) cache.v_scale = (vs_d = arena.upload(v_scale->view())).view();

  const int64_t total_q = plan.total_q;
  Buffer topk_d = given_topk ? arena.upload(given_topk->view()) : arena.allocate(DType::i32, {topo.num_index_heads, total_q, 16});
  Buffer out_d = arena.allocate(DType::bf16, {total_q, topo.num_q_heads, 128});
  Buffer lse_d = arena.allocate(DType::f32, {total_q, topo.num_q_heads});

  PagedIndexerParams indexer;
  indexer.index_q = qi_d.view();
  indexer.index_k_cache = ki_d.view();
  indexer.topk = topk_d.view();
  PagedAttentionParams attention;
  attention.q = q_d.view();
  attention.kv = cache;
  attention.topk = topk_d.view();
  attention.out = out_d.view();
  attention.lse = lse_d.view();
  in_file([&] {
    if (given_topk) paged_attention(plan, attention, run);
    else paged_forward(plan, indexer, attention, run);
  });
  synchronize(options.device);

  // ---- outputs ----
  std::vector<StTensor> outputs;
  outputs.push_back(arena.download("topk", topk_d.view()));
  outputs.push_back(arena.download("out", out_d.view()));
  outputs.push_back(arena.download("lse", lse_d.view()));
  const std::map<std::string, std::string> out_meta = {
      {"msa_version", kVersion},
      {"backend", to_string(options.device)},
      {"mode", mode},
      {"kv_format", format_name},
      {"num_kv_splits", std::to_string(plan.num_kv_splits)},
      {"indexer", given_topk ? "skipped (topk given)" : "msa paged_indexer"},
  };
  if (out_path.empty()) return 0;
  write_safetensors(out_path, outputs, out_meta);
  if (options.summary) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("run-case: %s, %s, kv_format %s, batch %lld, %lld query tokens, %s; wrote %zu tensors to %s in %.2f s\n",
                mode.c_str(), to_string(options.device).c_str(), format_name.c_str(), static_cast<long long>(batch),
                static_cast<long long>(total_q), given_topk ? "given topk" : "indexer", outputs.size(),
                out_path.c_str(), seconds);
  }
  return 0;
}

}  // namespace msa::tool
