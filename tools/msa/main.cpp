// The msa command-line tool: argument parsing and error reporting. The subcommands live in
// their own files (demo.cpp, run_case.cpp, bench.cpp, make_case.cpp, inspect.cpp).
//
// Exit codes: 0 success; 1 a check failed (demo FAIL, compare found differences) or the run
// itself failed (e.g. a CUDA error); 2 bad usage or bad input (arguments, files, tensors).
#include <CLI/CLI.hpp>

#include <filesystem>
#include <iostream>
#include <string>

#include "bench.h"
#include "case_io.h"
#include "demo.h"
#include "inspect.h"
#include "make_case.h"
#include "msa/error.h"
#include "msa/version.h"
#include "run_case.h"

namespace {

constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

// A file the run writes (after its first row): its folder must exist before the run starts.
const CLI::Validator output_file(
    [](std::string& path) -> std::string {
      if (path.empty()) return "the file name is empty";
      const auto folder = std::filesystem::absolute(path).parent_path();
      return std::filesystem::is_directory(folder) ? "" : "the folder " + folder.string() + " does not exist";
    },
    "FILE");

std::string version_text() {
  return std::string("msa ") + msa::kVersion + (msa::built_with_cuda() ? " (CPU + CUDA backends)" : " (CPU backend)");
}

}  // namespace

int main(int argc, char** argv) {
  using namespace msa::tool;
  CLI::App app{"msa: MiniMax Sparse Attention — exact CPU backend, CUDA backend for Hopper.\n"
               "Run 'msa <command> --help' for the options of a command.",
               "msa"};
  app.set_version_flag("--version", version_text());
  app.require_subcommand(1);
  app.fallthrough(false);

  // ---- demo ----
  DemoOptions demo;
  CLI::App* demo_cmd = app.add_subcommand(
      "demo", "Run indexer, plan, forward, backward and KL on a built-in packed batch of random inputs; time each step and "
              "check sampled rows against the float64 oracle (exit 1 on FAIL).");
  demo_cmd->add_option("--backend", demo.backend, "auto (CUDA when a GPU is usable), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  demo_cmd->add_option("--tokens", demo.tokens,
                       "Total tokens of the mixed pack (4096+2500+1200+300+129+1 scaled); default 8226 on the CPU, 32904 on a GPU")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 30));
  demo_cmd->add_option("--docs", demo.docs, "Explicit document lengths, e.g. 2300,129,1 (overrides --tokens)");
  demo_cmd->add_option("--seed", demo.seed, "Random seed")->capture_default_str();
  demo_cmd->add_option("--threads", demo.threads, "CPU threads (0 = all)")->check(CLI::Range(0, 4096))->capture_default_str();
  demo_cmd->add_option("--tp", demo.tp, "Tensor-parallel shard of MiniMax-M3: 1 (64/4 heads), 2 (32/2) or 4 (16/1)")
      ->check(CLI::IsMember({1, 2, 4}))
      ->capture_default_str();
  demo_cmd->add_option("--samples", demo.samples, "Query rows checked one by one against the oracle")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();

  // ---- run-case ----
  std::string case_in, case_out, case_backend = "auto";
  RunCaseOptions case_options;
  CLI::App* case_cmd = app.add_subcommand(
      "run-case",
      "Run the tensors of a safetensors file through msa and write the results to another; prints a one-line summary.\n"
      "Training (__metadata__ mode absent or 'training'): inputs q, k, v, index_q, index_k (BF16), cu_seqlens_q, "
      "cu_seqlens_k (I32), optional fragment_indices, topk (I32, skips the indexer), grad_out (BF16, adds backward and "
      "KL); __metadata__ init_blocks, local_blocks, lse_temperature, softmax_scale, index_scale, q_per_cta, "
      "kl_grad_scale. Outputs: topk, out (BF16), lse, indexer_lse (F32) and with grad_out dq, dk, dv, dindex_q, "
      "dindex_k (F32).\n"
      "Inference (mode 'decode' or 'paged_prefill'): inputs q (BF16), index_q (BF16 or F8_E4M3), k_cache, v_cache "
      "(BF16, F8_E4M3 or U8 packed NVFP4), k_cache_sf, v_cache_sf (F8_E4M3, NVFP4 only), optional k_scale, v_scale "
      "(F32), index_k_cache (BF16 or F8_E4M3), page_table, seq_lens (I32), cu_seqlens_q (I32, paged_prefill), optional "
      "topk (I32); __metadata__ kv_format, q_len_per_req (decode), num_kv_splits (decode), softmax_scale. Outputs: "
      "topk, out (BF16), lse (F32).");
  case_cmd->add_option("--in", case_in, "Input .safetensors file")->required();
  case_cmd->add_option("--out", case_out, "Output .safetensors file (written atomically)")->required();
  case_cmd->add_option("--backend", case_backend, "auto, cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  case_cmd->add_flag("--deterministic", case_options.deterministic, "Bitwise reproducible accumulation");
  case_cmd->add_option("--threads", case_options.threads, "CPU threads (0 = all)")->check(CLI::Range(0, 4096));

  // ---- bench ----
  BenchOptions bench;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench", "The training benchmark: times indexer, plan (with a given workspace and allocating its own), forward, "
               "backward (also deterministic) and KL on one document per size (MiniMax-M3 heads) for independent and "
               "coherent selections; median of repeats after warm-up (CUDA events on a GPU). A table on stdout; "
               "--csv / --json also write the rows to files. --decode times decode steps instead (options marked "
               "--decode); --prefill times prefill steps over a manifest of shapes (options marked --prefill).");
  bench_cmd->add_flag("--decode", bench.decode,
                      "Time decode steps instead: paged indexer, attention and the whole step per (batch, context, "
                      "queries per request, cache format), with GB/s and % of the device's copy bandwidth; --json "
                      "writes the rows");
  CLI::Option* memory_opt = bench_cmd->add_flag(
      "--memory", bench.memory_only,
      "Training bench on a GPU: only each size's peak device memory of one layer step (selection, plan, forward, "
      "backward, KL, each call on its own workspace as msa.torch runs them), no timing");
  const std::vector<CLI::Option*> decode_opts = {
      bench_cmd->add_option("--batches", bench.batches,
                            "--decode: requests per step, e.g. 8,32,128 (default: 8,32,128 on a GPU, 8 on the CPU)"),
      bench_cmd->add_option("--contexts", bench.contexts,
                            "--decode: KV tokens per request, e.g. 4k,32k,128k (default: 4k,32k,128k on a GPU, 4k on the CPU)"),
      bench_cmd->add_option("--queries", bench.queries, "--decode: queries per request, each in 1..16, e.g. 1,2,4,8,16 (default 8)"),
      bench_cmd->add_option("--splits", bench.splits, "--decode: attention split-K count 1, 2, 4, 8 or 16; 0 = the plan's automatic choice")
          ->check(CLI::IsMember({0, 1, 2, 4, 8, 16}))
          ->capture_default_str(),
      bench_cmd->add_option("--l2", bench.l2,
                            "--decode, GPU: flush (write twice the L2 cache's size before every timed call, untimed: "
                            "each call reads its data from memory, and the host's launches are hidden behind the "
                            "write) or keep (repeated calls may find their data in L2)")
          ->check(CLI::IsMember({"flush", "keep"}))
          ->capture_default_str()};
  CLI::Option* formats_opt = bench_cmd->add_option(
      "--formats", bench.formats,
      "--decode, --prefill: K/V cache formats, any of bf16,fp8,nvfp4, each at every shape (default: --decode bf16 at "
      "every shape and fp8 at the middle batch and context; --prefill bf16)");
  CLI::Option* prefill_opt = bench_cmd->add_option(
      "--prefill", bench.prefill,
      "Time paged prefill steps instead: plan, indexer, attention and the whole step per case of FILE (one JSON "
      "object a line: batch_size, query_lens, prefix_lens, final_kv_lens; optional case_id, tags, "
      "representative_weight, stratum, count) and cache format, with sparse TFLOP/s and production-weighted totals "
      "per stratum; or long:N:C, one prompt of N tokens prefilled in chunks of C (e.g. long:1m:16k)");
  const std::vector<CLI::Option*> prefill_opts = {
      bench_cmd->add_option("--cases", bench.cases,
                            "--prefill: the manifest rows to time: representative, all, or a tag (default: "
                            "representative, every row when the manifest has no tags)"),
      bench_cmd->add_option("--sample", bench.sample,
                            "--prefill long:N:C: time the middle chunk of every group of this many consecutive chunks, "
                            "counted for the group in the prompt's total (default 1: every chunk)")
          ->check(CLI::Range(1, 1 << 20))};
  bench_cmd->add_option("--json", bench.json_path, "Also write the results as JSON to this file")->check(output_file);
  CLI::Option* csv_opt =
      bench_cmd->add_option("--csv", bench.csv_path, "Also write the results as CSV to this file")->check(output_file);
  bench_cmd->add_option("--out", bench.csv_path, "Same as --csv")->check(output_file)->excludes(csv_opt);
  bench_cmd->add_option("--backend", bench.backend, "auto, cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  CLI::Option* tokens_opt = bench_cmd->add_option(
      "--tokens", bench.sizes, "Tokens per document, e.g. 4096,16384,16k (default: 4k,8k on the CPU; 4k..128k on a GPU)");
  CLI::Option* sizes_opt = bench_cmd->add_option("--sizes", bench.sizes, "Same as --tokens")->excludes(tokens_opt);
  CLI::Option* selection_opt = bench_cmd->add_option(
      "--selection", bench.selection,
      "independent, coherent or both (default both; --decode: independent, each query row its own index query, or "
      "coherent, the rows of a request sharing one, so they select alike)")
      ->check(CLI::IsMember({"independent", "coherent", "both"}))
      ->capture_default_str();
  CLI::Option* repeats_opt = bench_cmd->add_option("--repeats", bench.repeats, "Timed runs per step (default 3 on the CPU, decode and prefill 2; 10 on a GPU)")
      ->check(CLI::Range(1, 100000));
  bench_cmd->add_option("--reps", bench.repeats, "Same as --repeats")->check(CLI::Range(1, 100000))->excludes(repeats_opt);
  bench_cmd->add_option("--threads", bench.threads, "CPU threads (0 = all)")->check(CLI::Range(0, 4096));
  bench_cmd->add_option("--tp", bench.tp, "Tensor-parallel shard of MiniMax-M3: 1 (64/4 heads), 2 (32/2) or 4 (16/1)")
      ->check(CLI::IsMember({1, 2, 4}))
      ->capture_default_str();
  bench_cmd->add_option("--seed", bench.seed, "Random seed")->capture_default_str();

  // ---- make-case, inspect, compare ----
  MakeCaseOptions make;
  CLI::App* make_cmd = app.add_subcommand("make-case", "Write a run-case input file of random inputs.");
  make_cmd->add_option("--out", make.out_path, "Output .safetensors file")->required();
  make_cmd->add_option("--docs", make.docs, "Document lengths")->capture_default_str();
  make_cmd->add_option("--tp", make.tp, "Tensor-parallel shard of MiniMax-M3: 1 (64/4 heads), 2 (32/2) or 4 (16/1)")
      ->check(CLI::IsMember({1, 2, 4}))
      ->capture_default_str();
  make_cmd->add_option("--seed", make.seed, "Random seed")->capture_default_str();
  make_cmd->add_flag("--grad", make.grad, "Include grad_out (run-case then runs backward and KL)");
  make_cmd->add_option("--topk-from", make.topk_from, "Copy the 'topk' tensor of this file (e.g. an earlier output)");
  make_cmd->add_option("--set", make.set, "KEY=VALUE __metadata__ entry (repeatable)");
  make_cmd->add_option("--omit", make.omit, "Leave out this tensor (repeatable)");
  make_cmd->add_option("--retype", make.retype, "NAME=DTYPE: store a tensor as another dtype (repeatable)");
  make_cmd->add_option("--ints", make.ints,
                       "NAME=V1,V2,...: store (or replace) a 1-D I32 tensor with these values, e.g. "
                       "cu_seqlens_q=0,100 (repeatable)");

  std::string inspect_path;
  CLI::App* inspect_cmd = app.add_subcommand("inspect", "List the metadata and tensors of a safetensors file.");
  inspect_cmd->add_option("file", inspect_path, "A .safetensors file")->required();

  CompareOptions compare;
  CLI::App* compare_cmd = app.add_subcommand(
      "compare",
      "Compare two safetensors files tensor by tensor (exit 1 if they differ). Every tensor of either file is compared; "
      "one present on one side only is a difference. NaN equals NaN at the same place. Default tolerances (the "
      "documented accuracy targets), per element |a - b| <= atol + rtol |b|: out and other float tensors atol = rtol "
      "= 3e-2; lse 1e-3; indexer_lse 2e-3; dindex_q, dindex_k atol 2e-3, rtol 1e-2; dq, dk, dv cosine similarity >= "
      "0.99; integer tensors (topk, ...) exact. --atol / --rtol replace them for every tensor (the other one is then "
      "0 unless given).");
  compare_cmd->add_option("a", compare.a, "First file")->required();
  compare_cmd->add_option("b", compare.b, "Second file (the reference for rtol)")->required();
  compare_cmd->add_option("--tensors", compare.tensors, "Tensors to compare (default: all of both files)")->delimiter(',');
  compare_cmd->add_option("--atol", compare.atol, "Absolute tolerance for every tensor (default: per tensor, see above)")
      ->check(CLI::NonNegativeNumber);
  compare_cmd->add_option("--rtol", compare.rtol, "Relative tolerance for every tensor (default: per tensor, see above)")
      ->check(CLI::NonNegativeNumber);

  auto active_name = [&]() -> std::string {
    for (CLI::App* sub : app.get_subcommands()) return "msa " + sub->get_name();
    return "msa";
  };

  // Name an unknown command instead of only saying that one is required.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string first = argv[1];
    std::string known;
    bool found = false;
    for (CLI::App* sub : app.get_subcommands({})) {
      found = found || sub->get_name() == first;
      known += (known.empty() ? "" : ", ") + sub->get_name();
    }
    if (!found) {
      std::cerr << "msa: error: unknown command '" << first << "' (commands: " << known << ")\nRun 'msa --help' for usage.\n";
      return kExitUsage;
    }
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    const std::string who = active_name();
    std::cerr << who << ": error: " << e.what() << "\nRun '" << who << " --help' for usage.\n";
    return kExitUsage;
  }

  const std::string who = active_name();
  try {
    if (*demo_cmd) return run_demo(demo);
    if (*case_cmd) {
      case_options.device = resolve_backend(case_backend);
      return run_case(case_in, case_out, case_options);
    }
    if (*bench_cmd) {
      if (sizes_opt->count() > 0) bench.sizes_option = "--sizes";
      const bool prefill = prefill_opt->count() > 0;
      auto refuse = [](const std::string& message) { throw msa::Error(msa::ErrorKind::invalid_argument, message); };
      if (prefill && bench.decode) refuse("--prefill and --decode are two different benches: give one of them");
      if ((prefill || bench.decode) && memory_opt->count() > 0)
        refuse("--memory applies to the training bench only (not with --decode or --prefill)");
      for (const CLI::Option* opt : decode_opts)
        if (!bench.decode && opt->count() > 0) refuse(opt->get_name() + " applies to the decode bench (--decode) only");
      for (const CLI::Option* opt : prefill_opts)
        if (!prefill && opt->count() > 0) refuse(opt->get_name() + " applies to the prefill bench (--prefill) only");
      if (!bench.decode && !prefill && formats_opt->count() > 0)
        refuse("--formats applies to the decode and prefill benches (--decode, --prefill) only");
      // --selection: the training bench's two distributions, or the decode bench's (default: independent).
      if (bench.decode && selection_opt->count() == 0) bench.selection = "independent";
      for (const CLI::Option* opt : {tokens_opt, sizes_opt, selection_opt}) {
        if (bench.decode && opt->count() > 0 && opt != selection_opt)
          refuse(opt->get_name() + " applies to the training bench only; with --decode use --batches / --contexts");
        if (prefill && opt->count() > 0)
          refuse(opt->get_name() + " applies to the training bench only; --prefill takes its shapes from the manifest");
      }
      if (prefill) return run_bench_prefill(bench);
      return run_bench(bench);
    }
    if (*make_cmd) return run_make_case(make);
    if (*inspect_cmd) return run_inspect(inspect_path);
    if (*compare_cmd) return run_compare(compare);
  } catch (const msa::Error& e) {
    std::cerr << who << ": error: " << e.what() << "\n";
    return e.kind() == msa::ErrorKind::runtime ? kExitFailed : kExitUsage;
  } catch (const std::bad_alloc&) {
    std::cerr << who << ": error: out of memory\n";
    return kExitFailed;
  } catch (const std::exception& e) {
    std::cerr << who << ": error: " << e.what() << "\n";
    return kExitFailed;
  }
  return kExitUsage;
}
