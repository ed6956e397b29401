#include "bench.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "case_io.h"
#include "msa/msa.h"
#include "step_buffers.h"
#include "step_timer.h"
#include "table.h"
#include "workload.h"

namespace msa::tool {

namespace {


void progress(const std::string& line) { std::cerr << "[msa bench] " << line << std::endl; }

// Index vectors of the coherent distribution decorrelate over about this many tokens.
constexpr double kCoherentTokens = 256;

// A host bf16 tensor's values rounded to E4M3 codes.
StTensor to_e4m3(const StTensor& bf16) {
  StTensor out = make_tensor(bf16.name, DType::f8e4m3, bf16.shape);
  const auto* in = reinterpret_cast<const uint16_t*>(bf16.bytes.data());
  for (size_t i = 0; i < out.bytes.size(); ++i) out.bytes[i] = float_to_e4m3(bf16_to_float(in[i]));
  return out;
}

struct StepTiming {
  double seconds = -1;  // median; < 0: not measured on this backend
  double flops = 0;     // useful FLOPs, 0 when no convention applies
  bool measured() const { return seconds >= 0; }
  double tflops() const { return seconds > 0 && flops > 0 ? flops / seconds / 1e12 : 0.0; }
};

struct BenchRow {
  int64_t tokens = 0;
  Selection selection = Selection::independent;
  double union8 = 0;
  StepTiming indexer, indexer_fp8, plan, plan_alloc, forward, backward, backward_det, kl;
  int64_t buffer_bytes = 0;
  int64_t device_bytes = -1;  // device memory in use after the last step; -1 on the CPU
  int64_t peak_bytes = -1;    // GPU: the most msa held during one layer step (step_peak_bytes)
};

// GPU: the most device memory msa holds during one layer step as msa.torch runs it: the row's
// inputs, outputs and gradients (`resident`: the arena's bytes), and what the step allocates
// (counted by PeakMemory for the step only, so that the timed steps keep the built-in
// allocator): the selection, a plan without scratch (workspace_per_call), then forward,
// backward and KL, each on its own call_workspace_bytes for its duration.
int64_t step_peak_bytes(const Topology& topo, const PackedLayout& layout, StepBuffers& buf, const RunOptions& run,
                        Device dev, StepTimer& timer, int64_t resident) {
  timer.sync();
  PeakMemory memory(dev);
  select_blocks(topo, layout, buf.select_blocks_params(), run);
  PlanOptions per_call;
  per_call.workspace_per_call = true;
  const SparsePlan plan = build_plan(topo, layout, buf.topk.view(), per_call, run);
  auto scratch = [&](WorkspaceCall call) {
    return Buffer(dev, DType::u8, {std::max<int64_t>(1, call_workspace_bytes(topo, layout, dev, call))}, run.stream);
  };
  {
    const Buffer w = scratch(WorkspaceCall::forward);
    AttentionForwardParams p = buf.forward_params();
    p.workspace = w.view();
    sparse_attention_forward(topo, layout, plan, p, run);
  }
  {
    const Buffer w = scratch(WorkspaceCall::backward);
    AttentionBackwardParams p = buf.backward_params();
    p.workspace = w.view();
    sparse_attention_backward(topo, layout, plan, p, run);
  }
  {
    const Buffer w = scratch(WorkspaceCall::kl_backward);
    KlBackwardParams p = buf.kl_params();
    p.workspace = w.view();
    kl_backward(topo, layout, plan, p, run);
  }
  timer.sync();
  return resident + memory.peak();
}

BenchRow bench_one(const Topology& topo, Device dev, int64_t tokens, Selection selection, int repeats, const RunOptions& run,
                   uint64_t seed, StepTimer& timer, bool memory_only) {
  const PackedLayout layout = layout_of_documents({tokens});
  const int64_t T = tokens;
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, Hi = topo.num_index_heads, D = topo.head_dim,
            Di = topo.index_head_dim;
  const bool gpu = dev.is_cuda();
  DeviceArena arena(dev);

  // Inputs: main tensors i.i.d.; index vectors by the chosen distribution.
  auto random_bf16 = [&](std::vector<int64_t> shape, uint64_t stream) {
    StTensor t = make_tensor("", DType::bf16, std::move(shape));
    fill_normal_bf16(reinterpret_cast<uint16_t*>(t.bytes.data()), t.numel(), 0.2f, seed, stream);
    return t;
  };
  auto random_input = [&](std::vector<int64_t> shape, uint64_t stream) {
    return arena.upload(random_bf16(std::move(shape), stream).view());
  };
  StepBuffers buf;
  buf.q = random_input({T, Hq, D}, 1);
  buf.k = random_input({T, Hkv, D}, 2);
  buf.v = random_input({T, Hkv, D}, 3);
  buf.dout = random_input({T, Hq, D}, 4);
  StTensor iq, ik;
  if (selection == Selection::independent) {
    iq = random_bf16({T, Hi, Di}, 5);
    ik = random_bf16({T, 1, Di}, 6);
  } else {
    iq = make_tensor("", DType::bf16, {T, Hi, Di});
    ik = make_tensor("", DType::bf16, {T, 1, Di});
    fill_drifting_bf16(reinterpret_cast<uint16_t*>(iq.bytes.data()), layout, false, Hi, Di, 0.2f, kCoherentTokens, seed, 5);
    fill_drifting_bf16(reinterpret_cast<uint16_t*>(ik.bytes.data()), layout, true, 1, Di, 0.2f, kCoherentTokens, seed, 6);
  }
  buf.index_q = arena.upload(iq.view());
  buf.index_k = arena.upload(ik.view());
  // The same index vectors as E4M3 codes, for the FP8 indexer (GPU only: the CPU backend reads
  // both types at the same speed).
  Buffer index_q_fp8, index_k_fp8;
  if (gpu) {
    index_q_fp8 = arena.upload(to_e4m3(iq).view());
    index_k_fp8 = arena.upload(to_e4m3(ik).view());
  }
  buf.allocate_outputs(arena, topo, T, T);
  // The uploads went through the legacy stream, which the timer's non-blocking stream does
  // not wait for.
  synchronize(dev);

  BenchRow row;
  row.tokens = T;
  row.selection = selection;
  if (gpu) row.peak_bytes = step_peak_bytes(topo, layout, buf, run, dev, timer, arena.bytes_allocated());
  if (memory_only) return row;

  // One workspace for every plan of the row, as a training loop keeps one (CUDA only): the
  // plan time is then the plan's own work; "+alloc" times plans that allocate their own.
  const int64_t workspace_bytes = plan_workspace_bytes(topo, layout, dev);
  const Buffer workspace = workspace_bytes > 0 ? Buffer(dev, DType::u8, {workspace_bytes}, run.stream) : Buffer();
  PlanOptions given;
  if (workspace_bytes > 0) given.workspace = workspace.view();

  const std::string label = std::to_string(T) + " tokens, " + to_string(selection) + " selection";
  if (gpu) progress(label);
  // On the CPU one line before every call: a single backward of a long document takes many
  // seconds, and a bench that prints nothing for that long looks hung.
  auto before = [&](const std::string& step) -> std::function<void(const std::string&)> {
    if (gpu) return {};
    return [&label, step](const std::string& phase) { progress(label + ": " + phase + ": " + step); };
  };
  const int warmup = gpu ? 2 : 1;

  row.indexer.seconds = timer.median_seconds(
      warmup, repeats, [&] { select_blocks(topo, layout, buf.select_blocks_params(), run); }, before("select_blocks"));
  if (gpu) {
    // Into its own outputs: the plan below is built on the bf16 indexer's selection.
    const Buffer topk = arena.allocate(DType::i32, {Hi, T, topo.topk}), lse = arena.allocate(DType::f32, {Hi, T});
    SelectBlocksParams fp8;
    fp8.index_q = index_q_fp8.view();
    fp8.index_k = index_k_fp8.view();
    fp8.topk = topk.view();
    fp8.selected_lse = lse.view();
    row.indexer_fp8.seconds = timer.median_seconds(warmup, repeats, [&] { select_blocks(topo, layout, fp8, run); });
  }

  // Plans: host clock from the call to the end of its device work (allocations included);
  // each plan is freed after its timed window. One warm-up build, then up to 5.
  auto time_plans = [&](const PlanOptions& options, const std::string& step) {
    const int builds = std::min(repeats, 5);
    const auto note = before(step);
    std::vector<double> times;
    for (int i = 0; i <= builds; ++i) {
      if (note) note(i == 0 ? "warm-up" : "run " + std::to_string(i) + "/" + std::to_string(builds));
      SparsePlan p;
      const double s = timer.host_seconds([&] { p = build_plan(topo, layout, buf.topk.view(), options, run); });
      if (i > 0) times.push_back(s);
    }
    return median(times);
  };
  row.plan.seconds = time_plans(given, "build_plan");
  if (workspace_bytes > 0) row.plan_alloc.seconds = time_plans(PlanOptions{}, "build_plan, own workspace");
  SparsePlan plan = build_plan(topo, layout, buf.topk.view(), given, run);
  timer.sync();

  row.forward.seconds = timer.median_seconds(
      warmup, repeats, [&] { sparse_attention_forward(topo, layout, plan, buf.forward_params(), run); }, before("forward"));
  row.backward.seconds = timer.median_seconds(
      warmup, repeats, [&] { sparse_attention_backward(topo, layout, plan, buf.backward_params(), run); }, before("backward"));
  // The CPU backend is always deterministic: the flag changes only the CUDA backward.
  if (gpu) {
    RunOptions det = run;
    det.deterministic = true;
    row.backward_det.seconds = timer.median_seconds(
        1, std::max(3, repeats / 3), [&] { sparse_attention_backward(topo, layout, plan, buf.backward_params(), det); });
  }
  row.kl.seconds = timer.median_seconds(
      warmup, repeats, [&] { kl_backward(topo, layout, plan, buf.kl_params(), run); }, before("kl_backward"));
  timer.sync();
  row.device_bytes = device_memory_in_use(dev);

  const std::vector<int32_t> ids = to_host_ints(buf.topk.view());
  row.union8 = mean_union_of_8(topo, layout, ids.data());
  row.indexer.flops = indexer_flops(topo, layout);
  row.indexer_fp8.flops = row.indexer.flops;
  row.forward.flops = forward_flops(topo, layout, ids.data());
  row.backward.flops = 2.5 * row.forward.flops;
  row.backward_det.flops = row.backward.flops;
  row.kl.flops = kl_flops(topo, layout, ids.data());
  row.buffer_bytes = arena.bytes_allocated() + workspace_bytes;
  for (const Buffer* b : {&plan.rows, &plan.row_ptr, &plan.q_indices, &plan.split_slot, &plan.split_counts, &plan.schedule,
                          &plan.work_count_dev})
    row.buffer_bytes += b->bytes();
  return row;
}


// Table cells; '-' for what this backend does not measure.
std::string ms_cell(const StepTiming& s) { return s.measured() ? fixed(s.seconds * 1e3, 3) : "-"; }
std::string tf_cell(const StepTiming& s) { return s.measured() ? tflops_cell(s.tflops()) : "-"; }
std::string gib_cell(int64_t bytes) { return bytes >= 0 ? fixed(double(bytes) / double(1ull << 30), 1) : "-"; }

// The row as one line, printed as soon as it is measured (a run cut short keeps its rows).
std::string row_line(const BenchRow& r) {
  std::ostringstream s;
  s << r.tokens << " tokens, " << to_string(r.selection) << " selection: union8 " << fixed(r.union8, 1) << " | indexer "
    << ms_cell(r.indexer) << " ms " << tf_cell(r.indexer) << " TF/s (fp8 " << ms_cell(r.indexer_fp8) << ") | plan " << ms_cell(r.plan) << " ms (+alloc "
    << ms_cell(r.plan_alloc) << ") | fwd " << ms_cell(r.forward) << " ms " << tf_cell(r.forward) << " TF/s | bwd "
    << ms_cell(r.backward) << " ms " << tf_cell(r.backward) << " TF/s (det " << ms_cell(r.backward_det) << ") | kl "
    << ms_cell(r.kl) << " ms " << tf_cell(r.kl) << " TF/s | peak " << gib_cell(r.peak_bytes) << " GiB | in use "
    << gib_cell(r.device_bytes) << " GiB";
  return s.str();
}

// CSV fields; empty for what this backend does not measure.
std::string csv_ms(const StepTiming& s) { return s.measured() ? fixed(s.seconds * 1e3, 4) : ""; }
std::string csv_tf(const StepTiming& s) {
  if (!s.measured() || s.tflops() <= 0) return "";
  char text[48];
  std::snprintf(text, sizeof text, "%.6g", s.tflops());
  return text;
}

// The columns of the earlier GPU benchmark's CSV, in its order, then buffer_bytes and the FP8
// indexer's time.
std::string csv_text(const std::vector<BenchRow>& rows) {
  std::string text =
      "tokens,selection,union8,indexer_ms,plan_ms,forward_ms,backward_ms,backward_det_ms,kl_ms,forward_tflops,"
      "backward_tflops,indexer_tflops,kl_tflops,peak_gib,plan_alloc_ms,buffer_bytes,indexer_fp8_ms\n";
  for (const BenchRow& r : rows) {
    const std::vector<std::string> fields = {
        std::to_string(r.tokens), to_string(r.selection), fixed(r.union8, 2), csv_ms(r.indexer), csv_ms(r.plan),
        csv_ms(r.forward), csv_ms(r.backward), csv_ms(r.backward_det), csv_ms(r.kl), csv_tf(r.forward),
        csv_tf(r.backward), csv_tf(r.indexer), csv_tf(r.kl),
        r.peak_bytes >= 0 ? fixed(double(r.peak_bytes) / double(1ull << 30), 2) : "", csv_ms(r.plan_alloc),
        std::to_string(r.buffer_bytes), csv_ms(r.indexer_fp8)};
    for (size_t i = 0; i < fields.size(); ++i) text += (i ? "," : "") + fields[i];
    text += '\n';
  }
  return text;
}

nlohmann::json step_json(const StepTiming& s) {
  nlohmann::json j = {{"ms", s.seconds * 1e3}};
  if (s.flops > 0) {
    j["useful_flops"] = s.flops;
    j["tflops_per_s"] = s.tflops();
  }
  return j;
}

const char* kFlopConvention =
    "forward = 4*Hq*128*attended pairs; backward = 2.5*forward; indexer = 2*128*Hi*causal pairs; "
    "kl = (2*Hq + 6*Hi)*128*attended pairs";

std::string json_text(const std::vector<BenchRow>& rows, Device dev, const Topology& topo, int repeats) {
  nlohmann::json j = {{"msa_version", kVersion},
                      {"device", to_string(dev)},
                      {"heads", {{"q", topo.num_q_heads}, {"kv", topo.num_kv_heads}, {"index", topo.num_index_heads}}},
                      {"repeats", repeats},
                      {"timing", dev.is_cuda() ? std::string(timing_label(true)) +
                                                     "; plan: host clock to the end of its device work"
                                               : std::string(timing_label(false))},
                      {"flop_convention", kFlopConvention},
                      {"results", nlohmann::json::array()}};
  if (dev.is_cuda()) j["device_name"] = device_description(dev);
  for (const BenchRow& r : rows) {
    nlohmann::json row = {{"tokens", r.tokens},
                          {"selection", to_string(r.selection)},
                          {"mean_union_of_8", r.union8},
                          {"indexer", step_json(r.indexer)},
                          {"plan", step_json(r.plan)},
                          {"forward", step_json(r.forward)},
                          {"backward", step_json(r.backward)},
                          {"kl", step_json(r.kl)},
                          {"buffer_bytes", r.buffer_bytes}};
    if (r.indexer_fp8.measured()) row["indexer_fp8"] = step_json(r.indexer_fp8);
    if (r.plan_alloc.measured()) row["plan_alloc"] = step_json(r.plan_alloc);
    if (r.backward_det.measured()) row["backward_deterministic"] = step_json(r.backward_det);
    if (r.device_bytes >= 0) row["device_bytes_in_use"] = r.device_bytes;
    if (r.peak_bytes >= 0) row["step_peak_bytes"] = r.peak_bytes;
    j["results"].push_back(row);
  }
  return j.dump(2) + '\n';
}

}  // namespace

int run_bench(const BenchOptions& o) {
  if (o.decode) {
    if (!o.csv_path.empty()) invalid("--csv / --out: the decode bench (--decode) writes no CSV");
    return run_bench_decode(o);
  }
  const Device dev = resolve_backend(o.backend);
  if (o.memory_only && !dev.is_cuda())
    invalid("--memory measures CUDA device memory: it needs --backend cuda (or auto on a machine with a GPU), got " +
            to_string(dev));
  std::vector<int64_t> sizes;
  if (!o.sizes.empty()) sizes = parse_size_list(o.sizes, o.sizes_option);
  else if (dev.is_cuda()) sizes = {4096, 8192, 16384, 32768, 65536, 131072};
  else sizes = {4096, 8192};
  const std::vector<Selection> selections = parse_selections(o.selection);
  const int repeats = o.repeats > 0 ? o.repeats : (dev.is_cuda() ? 10 : 3);

  if (o.tp != 1 && o.tp != 2 && o.tp != 4) invalid("--tp must be 1, 2 or 4, got " + std::to_string(o.tp));
  const Topology topo = Topology::minimax_m3(o.tp);
  StepTimer timer(dev);
  RunOptions run;
  run.num_threads = o.threads;
  run.stream = timer.stream();
  std::cout << "msa " << kVersion << " bench on " << to_string(dev);
  if (dev.is_cuda()) std::cout << " (" << device_description(dev) << ")";
  std::cout << ": one document per size, " << topo.num_q_heads << " query / " << topo.num_kv_heads << " kv / "
            << topo.num_index_heads << " index heads, head dim " << topo.head_dim << ", top-" << topo.topk
            << " blocks of " << topo.block_size << "; median of " << repeats << " runs after warm-up\n\n";

  std::vector<BenchRow> rows;
  for (int64_t n : sizes)
    for (Selection s : selections) {
      rows.push_back(bench_one(topo, dev, n, s, repeats, run, o.seed, timer, o.memory_only));
      progress(row_line(rows.back()));
      if (!o.csv_path.empty()) write_file_whole(o.csv_path, csv_text(rows));
      if (!o.json_path.empty()) write_file_whole(o.json_path, json_text(rows, dev, topo, repeats));
    }

  // The columns (and their names) of the earlier GPU benchmark's table, plus the indexer and
  // KL rates, the FP8 indexer's time (E4M3 copies of the same index vectors) and the tool's own
  // buffers.
  Table table({"tokens", "selection", "union8", "index ms", "index TF", "fp8 idx", "plan ms", "+alloc", "fwd ms", "fwd TF", "bwd ms",
               "bwd TF", "bwd det", "kl ms", "kl TF", "peak GiB", "GiB", "buffers"});
  table.align_right({true, false, true, true, true, true, true, true, true, true, true, true, true, true, true, true, true, true});
  for (const BenchRow& r : rows)
    table.add_row({std::to_string(r.tokens), to_string(r.selection), fixed(r.union8, 1), ms_cell(r.indexer),
                   tf_cell(r.indexer), ms_cell(r.indexer_fp8), ms_cell(r.plan), ms_cell(r.plan_alloc), ms_cell(r.forward), tf_cell(r.forward),
                   ms_cell(r.backward), tf_cell(r.backward), ms_cell(r.backward_det), ms_cell(r.kl), tf_cell(r.kl),
                   gib_cell(r.peak_bytes), gib_cell(r.device_bytes), format_bytes(double(r.buffer_bytes))});
  table.print(std::cout);
  const bool gpu = dev.is_cuda();
  std::cout << "\nTimes in ms, medians; "
            << (gpu ? "CUDA-event times on one stream (plan: host clock from the call to the end of its device work, "
                      "allocations included)"
                    : "wall clock")
            << ". TF: TFLOP/s on useful FLOPs: forward = 4 * Hq * 128 * attended (query, key) pairs, backward = 2.5 x "
               "forward, indexer = 2 * 128 * Hi * causal pairs, KL = (2 * Hq + 6 * Hi) * 128 * attended pairs. "
               "'union8': mean number of distinct blocks selected by 8 consecutive tokens of one index head (windows "
               "past the first 16 blocks). "
            << (gpu ? "'plan': one workspace given to every plan of a size; '+alloc': the plan allocating its own. "
                      "'bwd det': RunOptions::deterministic. 'peak GiB': the most device memory msa held during one layer "
                      "step as msa.torch runs it (selection, a plan without scratch, then forward, backward and KL each on "
                      "its own call_workspace_bytes), the row's inputs, outputs and gradients included. 'GiB': device "
                      "memory in use after the timed KL step (every buffer of the row and its plan with a workspace for "
                      "every call alive; CUDA context included). "
                    : "'+alloc', 'bwd det', 'peak GiB', 'GiB': GPU only (the CPU backend is always deterministic and its plan takes "
                      "no workspace). ")
            << "'buffers': inputs, outputs, the plan" << (gpu ? " and its workspace" : "") << ".\n";
  if (!o.csv_path.empty()) std::cout << "wrote " << o.csv_path << "\n";
  if (!o.json_path.empty()) std::cout << "wrote " << o.json_path << "\n";
  return 0;
}

// Through a temporary file, so that a reader never sees half a file.
void write_file_whole(const std::string& path, const std::string& text) {
  const std::string temp = path + ".tmp";
  {
    std::ofstream f(temp);
    f << text;
    if (!f) invalid(path + ": cannot write the file");
  }
  std::filesystem::rename(temp, path);
}

}  // namespace msa::tool
