// Layouts the GPU tests run on: the edge cases of docs/semantics.md §2-§4 and real workload shapes
// (tests/data/gpu_shapes.txt, from MiniMax-AI/MSA, MIT license) scaled down so that the CPU
// reference stays quick.
#pragma once

#include <filesystem>
#include <fstream>
#include <sstream>

#include "test_support.h"

namespace msa::test {

struct NamedLayout {
  std::string name;
  PackedLayout layout;
};

inline std::string gpu_shapes_path() {
  namespace fs = std::filesystem;
  const fs::path here = fs::path(__FILE__).parent_path() / "data" / "gpu_shapes.txt";
  if (fs::exists(here)) return here.string();
  for (const char* rel : {"tests/data/gpu_shapes.txt", "../tests/data/gpu_shapes.txt", "../../tests/data/gpu_shapes.txt"})
    if (fs::exists(rel)) return rel;
  return here.string();
}

// Real shapes. Training packs (196,608 tokens) keep their document-length mix: documents are
// scaled by train_tokens / 196,608 when the median document stays >= 256 tokens, otherwise
// every s-th document is kept at its real length (s chosen to land near train_tokens) and
// longer ones are cut to train_tokens. Prefill batches are scaled so that the longest KV
// length is at most max_kv, as chunked prefill (queries after a cached prefix).
inline std::vector<NamedLayout> real_layouts(int64_t train_tokens, int64_t max_kv) {
  std::vector<NamedLayout> out;
  std::ifstream in(gpu_shapes_path());
  EXPECT_TRUE(in.good()) << "cannot read " << gpu_shapes_path();
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream is(line);
    std::string kind, id;
    is >> kind >> id;
    if (kind == "train") {
      std::vector<int64_t> cu;
      for (int64_t x; is >> x;) cu.push_back(x);
      std::vector<int64_t> len;
      for (size_t i = 1; i < cu.size(); ++i) len.push_back(cu[i] - cu[i - 1]);
      std::vector<int64_t> sorted = len;
      std::sort(sorted.begin(), sorted.end());
      const double f = double(train_tokens) / double(cu.back());
      std::vector<int64_t> docs;
      if (double(sorted[sorted.size() / 2]) * f >= 256) {
        for (int64_t n : len) docs.push_back(std::max<int64_t>(1, int64_t(std::llround(double(n) * f))));
      } else {
        const size_t stride = size_t(std::max<int64_t>(1, int64_t(std::ceil(1.0 / f))));
        for (size_t i = 0; i < len.size(); i += stride) docs.push_back(std::min(len[i], train_tokens));
      }
      out.push_back({"train " + id + " " + std::to_string(docs.size()) + " docs", layout_of(docs)});
    } else if (kind == "prefill") {
      int batch = 0;
      std::string tag;
      is >> batch >> tag;
      std::vector<int64_t> q(static_cast<size_t>(batch)), p(static_cast<size_t>(batch));
      for (auto& x : q) is >> x;
      is >> tag;
      for (auto& x : p) is >> x;
      int64_t longest = 0;
      for (int b = 0; b < batch; ++b) longest = std::max(longest, q[size_t(b)] + p[size_t(b)]);
      const double f = std::min(1.0, double(max_kv) / double(longest));
      std::vector<int64_t> ql, kl;
      for (int b = 0; b < batch; ++b) {
        const int64_t qs = std::max<int64_t>(1, int64_t(std::llround(double(q[size_t(b)]) * f)));
        ql.push_back(qs);
        kl.push_back(qs + int64_t(std::llround(double(p[size_t(b)]) * f)));
      }
      out.push_back({id.substr(0, 16) + " batch " + std::to_string(batch), layout_of(ql, kl)});
    }
  }
  return out;
}

// Spec §8 edge cases.
inline std::vector<NamedLayout> edge_layouts() {
  std::vector<NamedLayout> out;
  out.push_back({"single token", layout_of({1})});
  out.push_back({"single-token documents", layout_of({1, 1, 3, 1, 130, 1})});
  out.push_back({"shorter than a block", layout_of({5, 127, 64, 100})});
  out.push_back({"16 blocks exactly", layout_of({16 * 128})});
  out.push_back({"17 blocks", layout_of({17 * 128})});
  out.push_back({"16 and 17 blocks, partial tails", layout_of({16 * 128 - 3, 17 * 128 + 5, 129})});
  out.push_back({"long document", layout_of({24 * 128 + 77})});
  out.push_back({"chunked prefill", layout_of({1, 130, 300, 7}, {2500, 130, 3000, 4096})});
  out.push_back({"documents without queries", layout_of({0, 200, 0, 1}, {300, 2300, 0, 1})});
  {
    // Context-parallel fragments: three fragments of one document share its KV prefix.
    const std::vector<int32_t> cu_q{0, 600, 1400, 2000}, cu_k{0, 1500, 2600, 3000};
    out.push_back({"fragments sharing one KV range", PackedLayout::from_cu_seqlens(cu_q, cu_k, {0, 0, 0})});
  }
  return out;
}

}  // namespace msa::test
