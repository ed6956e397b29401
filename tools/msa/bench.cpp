#include "bench.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "case_io.h"
#include "msa/msa.h"
#include "step_buffers.h"
#include "table.h"
#include "workload.h"

namespace msa::tool {

namespace {

[[noreturn]] void invalid(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }

void progress(const std::string& line) { std::cerr << "[msa bench] " << line << std::endl; }

// Index vectors of the coherent distribution decorrelate over about this many tokens.
constexpr double kCoherentTokens = 256;

struct StepTiming {
  double seconds = 0;  // median
  double flops = 0;    // useful FLOPs, 0 when no convention applies
};

struct BenchRow {
  int64_t tokens = 0;
  Selection selection = Selection::independent;
  double union8 = 0;
  StepTiming indexer, plan, forward, backward, kl;
  int64_t buffer_bytes = 0;
};

BenchRow bench_one(const Topology& topo, Device dev, int64_t tokens, Selection selection, int repeats, const RunOptions& run,
                   uint64_t seed) {
  const PackedLayout layout = layout_of_documents({tokens});
  const int64_t T = tokens;
  const int Hq = topo.num_q_heads, Hkv = topo.num_kv_heads, Hi = topo.num_index_heads, D = topo.head_dim,
            Di = topo.index_head_dim;
  DeviceArena arena(dev);

  // Inputs: main tensors i.i.d.; index vectors by the chosen distribution.
  auto random_input = [&](std::vector<int64_t> shape, uint64_t stream) {
    StTensor t = make_tensor("", DType::bf16, std::move(shape));
    fill_normal_bf16(reinterpret_cast<uint16_t*>(t.bytes.data()), t.numel(), 0.2f, seed, stream);
    return arena.upload(t.view());
  };
  StepBuffers buf;
  buf.q = random_input({T, Hq, D}, 1);
  buf.k = random_input({T, Hkv, D}, 2);
  buf.v = random_input({T, Hkv, D}, 3);
  buf.dout = random_input({T, Hq, D}, 4);
  if (selection == Selection::independent) {
    buf.index_q = random_input({T, Hi, Di}, 5);
    buf.index_k = random_input({T, 1, Di}, 6);
  } else {
    StTensor iq = make_tensor("", DType::bf16, {T, Hi, Di}), ik = make_tensor("", DType::bf16, {T, 1, Di});
    fill_drifting_bf16(reinterpret_cast<uint16_t*>(iq.bytes.data()), layout, false, Hi, Di, 0.2f, kCoherentTokens, seed, 5);
    fill_drifting_bf16(reinterpret_cast<uint16_t*>(ik.bytes.data()), layout, true, 1, Di, 0.2f, kCoherentTokens, seed, 6);
    buf.index_q = arena.upload(iq.view());
    buf.index_k = arena.upload(ik.view());
  }
  buf.allocate_outputs(arena, topo, T, T);

  // One workspace for every plan of the run, as a training loop keeps one: the plan time is
  // then the plan's own work, not a fresh allocation of its scratch (CUDA only).
  const int64_t workspace_bytes = plan_workspace_bytes(topo, layout, dev);
  const Buffer workspace = workspace_bytes > 0 ? Buffer(dev, DType::u8, {workspace_bytes}, run.stream) : Buffer();
  PlanOptions plan_options;
  if (workspace_bytes > 0) plan_options.workspace = workspace.view();
  SparsePlan plan;
  auto indexer = [&] { select_blocks(topo, layout, buf.select_blocks_params(), run); };
  auto make_plan = [&] { plan = build_plan(topo, layout, buf.topk.view(), plan_options, run); };
  auto forward = [&] { sparse_attention_forward(topo, layout, plan, buf.forward_params(), run); };
  auto backward = [&] { sparse_attention_backward(topo, layout, plan, buf.backward_params(), run); };
  auto kl = [&] { kl_backward(topo, layout, plan, buf.kl_params(), run); };

  const std::string label = std::to_string(T) + " tokens, " + to_string(selection) + " selection";
  // One line before every step: on the CPU a single backward of a long document takes many
  // seconds, and a bench that prints nothing for that long looks hung.
  const char* names[5] = {"select_blocks", "build_plan", "forward", "backward", "kl_backward"};
  const std::function<void()> steps[5] = {indexer, make_plan, forward, backward, kl};
  auto step_line = [&](const std::string& phase, int i) {
    if (!dev.is_cuda() || i == 0) progress(label + ": " + phase + (dev.is_cuda() ? "" : std::string(": ") + names[i]));
  };
  for (int i = 0; i < 5; ++i) {
    step_line("warm-up", i);
    steps[i]();
  }
  synchronize(dev);

  std::vector<double> times[5];
  for (int r = 0; r < repeats; ++r) {
    const std::string phase = "run " + std::to_string(r + 1) + "/" + std::to_string(repeats);
    for (int i = 0; i < 5; ++i) {
      step_line(phase, i);
      times[i].push_back(time_once(dev, steps[i]));
    }
  }
  const std::vector<double>&t_indexer = times[0], &t_plan = times[1], &t_forward = times[2], &t_backward = times[3],
                           &t_kl = times[4];

  const std::vector<int32_t> ids = to_host_ints(buf.topk.view());
  BenchRow row;
  row.tokens = T;
  row.selection = selection;
  row.union8 = mean_union_of_8(topo, layout, ids.data());
  row.indexer = {median(t_indexer), indexer_flops(topo, layout)};
  row.plan = {median(t_plan), 0};
  row.forward = {median(t_forward), forward_flops(topo, layout, ids.data())};
  row.backward = {median(t_backward), 2.5 * row.forward.flops};
  row.kl = {median(t_kl), 0};
  row.buffer_bytes = arena.bytes_allocated() + workspace_bytes;
  for (const Buffer* b : {&plan.rows, &plan.row_ptr, &plan.q_indices, &plan.split_slot, &plan.split_counts, &plan.schedule,
                          &plan.work_count_dev})
    row.buffer_bytes += b->bytes();
  return row;
}

std::string cell(const StepTiming& s) {
  if (s.flops <= 0) return format_time(s.seconds);
  return format_time(s.seconds) + " (" + format_rate(s.flops, s.seconds) + ")";
}

nlohmann::json step_json(const StepTiming& s) {
  nlohmann::json j = {{"ms", s.seconds * 1e3}};
  if (s.flops > 0) {
    j["useful_flops"] = s.flops;
    j["tflops_per_s"] = s.seconds > 0 ? s.flops / s.seconds / 1e12 : 0.0;
  }
  return j;
}

}  // namespace

int run_bench(const BenchOptions& o) {
  if (o.decode) return run_bench_decode(o);
  const Device dev = resolve_backend(o.backend);
  std::vector<int64_t> sizes;
  if (!o.sizes.empty()) sizes = parse_size_list(o.sizes, "--sizes");
  else if (dev.is_cuda()) sizes = {4096, 8192, 16384, 32768, 65536, 131072};
  else sizes = {4096, 8192};
  std::vector<Selection> selections;
  if (o.selection == "independent" || o.selection == "both") selections.push_back(Selection::independent);
  if (o.selection == "coherent" || o.selection == "both") selections.push_back(Selection::coherent);
  if (selections.empty()) invalid("--selection must be independent, coherent or both, got '" + o.selection + "'");
  const int repeats = o.repeats > 0 ? o.repeats : (dev.is_cuda() ? 10 : 3);
  if (!o.json_path.empty()) {
    const auto parent = std::filesystem::absolute(o.json_path).parent_path();
    if (!std::filesystem::is_directory(parent))
      invalid("--json " + o.json_path + ": the folder " + parent.string() + " does not exist");
  }

  if (o.tp != 1 && o.tp != 2 && o.tp != 4) invalid("--tp must be 1, 2 or 4, got " + std::to_string(o.tp));
  const Topology topo = Topology::minimax_m3(o.tp);
  RunOptions run;
  run.num_threads = o.threads;
  std::cout << "msa " << kVersion << " bench on " << to_string(dev) << ": one document per size, " << topo.num_q_heads
            << " query / " << topo.num_kv_heads << " kv / " << topo.num_index_heads << " index heads, head dim "
            << topo.head_dim << ", top-" << topo.topk << " blocks of " << topo.block_size << "; median of " << repeats
            << " runs after a warm-up\n\n";

  std::vector<BenchRow> rows;
  for (int64_t n : sizes)
    for (Selection s : selections) rows.push_back(bench_one(topo, dev, n, s, repeats, run, o.seed));

  Table table({"tokens", "selection", "union of 8", "indexer", "plan", "forward", "backward", "KL", "buffers"});
  for (const BenchRow& r : rows) {
    char u[16];
    std::snprintf(u, sizeof u, "%.1f", r.union8);
    table.add_row({std::to_string(r.tokens), to_string(r.selection), u, cell(r.indexer), cell(r.plan), cell(r.forward),
                   cell(r.backward), cell(r.kl), format_bytes(double(r.buffer_bytes))});
  }
  table.print(std::cout);
  std::cout << "\nRates are on useful FLOPs: forward = 4 * Hq * 128 * attended (query, key) pairs, backward = 2.5 x forward,"
               " indexer = 2 * 128 * Hi * causal pairs. 'union of 8': mean number of distinct blocks selected by 8"
               " consecutive tokens of one index head (windows past the first 16 blocks). 'buffers': inputs, outputs, the plan and its workspace (one for all plans of a size; the plan time excludes allocating it).\n";

  if (!o.json_path.empty()) {
    nlohmann::json j = {{"msa_version", kVersion},
                        {"device", to_string(dev)},
                        {"heads", {{"q", topo.num_q_heads}, {"kv", topo.num_kv_heads}, {"index", topo.num_index_heads}}},
                        {"repeats", repeats},
                        {"flop_convention",
                         "forward = 4*Hq*128*attended pairs; backward = 2.5*forward; indexer = 2*128*Hi*causal pairs"},
                        {"results", nlohmann::json::array()}};
    for (const BenchRow& r : rows)
      j["results"].push_back({{"tokens", r.tokens},
                              {"selection", to_string(r.selection)},
                              {"mean_union_of_8", r.union8},
                              {"indexer", step_json(r.indexer)},
                              {"plan", step_json(r.plan)},
                              {"forward", step_json(r.forward)},
                              {"backward", step_json(r.backward)},
                              {"kl", step_json(r.kl)},
                              {"buffer_bytes", r.buffer_bytes}});
    const std::string temp = o.json_path + ".tmp";
    {
      std::ofstream f(temp);
      f << j.dump(2) << '\n';
      if (!f) invalid("--json " + o.json_path + ": cannot write the file");
    }
    std::filesystem::rename(temp, o.json_path);
    std::cout << "wrote " << o.json_path << "\n";
  }
  return 0;
}

}  // namespace msa::tool
