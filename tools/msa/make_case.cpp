#include "make_case.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <set>

#include "case_io.h"
#include "msa/msa.h"
#include "workload.h"

namespace msa::tool {

namespace {

[[noreturn]] void invalid(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }

std::pair<std::string, std::string> split_assignment(const std::string& text, const std::string& option) {
  const size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0) invalid(option + " takes KEY=VALUE, got '" + text + "'");
  return {text.substr(0, eq), text.substr(eq + 1)};
}

StTensor random_bf16(const std::string& name, std::vector<int64_t> shape, uint64_t seed, uint64_t stream) {
  StTensor t = make_tensor(name, DType::bf16, std::move(shape));
  fill_normal_bf16(reinterpret_cast<uint16_t*>(t.bytes.data()), t.numel(), 0.2f, seed, stream);
  return t;
}

// "0,100,-1" -> values in int32 range (the file format stores I32).
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& option) {
  std::vector<int64_t> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    errno = 0;
    char* stop = nullptr;
    const long long v = std::strtoll(item.c_str(), &stop, 10);
    if (item.empty() || *stop != '\0' || errno == ERANGE || v < INT32_MIN || v > INT32_MAX)
      invalid(option + ": '" + item + "' is not an int32 value");
    out.push_back(v);
    begin = end + 1;
  }
  return out;
}

StTensor int_tensor(const std::string& name, const std::vector<int32_t>& values) {
  StTensor t = make_tensor(name, DType::i32, {int64_t(values.size())});
  std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

}  // namespace

int run_make_case(const MakeCaseOptions& o) {
  if (o.tp != 1 && o.tp != 2 && o.tp != 4) invalid("--tp must be 1, 2 or 4, got " + std::to_string(o.tp));
  const Topology topo = Topology::minimax_m3(o.tp);
  const std::vector<int64_t> lengths = parse_size_list(o.docs, "--docs");
  const PackedLayout layout = layout_of_documents(lengths);
  const int64_t T = layout.total_q();
  const int D = topo.head_dim;

  std::vector<StTensor> tensors = {
      random_bf16("q", {T, topo.num_q_heads, D}, o.seed, 1),
      random_bf16("k", {T, topo.num_kv_heads, D}, o.seed, 2),
      random_bf16("v", {T, topo.num_kv_heads, D}, o.seed, 3),
      random_bf16("index_q", {T, topo.num_index_heads, topo.index_head_dim}, o.seed, 4),
      random_bf16("index_k", {T, 1, topo.index_head_dim}, o.seed, 5),
      int_tensor("cu_seqlens_q", layout.cu_seqlens_q()),
      int_tensor("cu_seqlens_k", layout.cu_seqlens_k()),
  };
  if (o.grad) tensors.push_back(random_bf16("grad_out", {T, topo.num_q_heads, D}, o.seed, 6));
  if (!o.topk_from.empty()) {
    const SafetensorsFile source = SafetensorsFile::read(o.topk_from);
    tensors.push_back(source.get("topk"));
  }

  std::set<std::string> omitted(o.omit.begin(), o.omit.end());
  std::vector<StTensor> kept;
  for (StTensor& t : tensors) {
    if (omitted.erase(t.name)) continue;
    kept.push_back(std::move(t));
  }
  if (!omitted.empty()) invalid("--omit " + *omitted.begin() + ": the case has no such tensor");

  for (const std::string& r : o.retype) {
    const auto [name, dtype_name] = split_assignment(r, "--retype");
    const DType dtype = parse_safetensors_dtype(dtype_name);
    bool found = false;
    for (StTensor& t : kept) {
      if (t.name != name) continue;
      found = true;
      StTensor converted = make_tensor(t.name, dtype, t.shape);
      for (int64_t i = 0; i < t.numel(); ++i)
        store_from_float(converted.bytes.data(), dtype, i, load_as_float(t.bytes.data(), t.dtype, i));
      t = std::move(converted);
    }
    if (!found) invalid("--retype " + r + ": the case has no tensor '" + name + "'");
  }

  for (const std::string& spec : o.ints) {
    const auto [name, list] = split_assignment(spec, "--ints");
    std::vector<int32_t> values;
    for (const int64_t v : parse_int_list(list, "--ints " + name)) values.push_back(int32_t(v));
    std::erase_if(kept, [&](const StTensor& t) { return t.name == name; });
    kept.push_back(int_tensor(name, values));
  }

  std::map<std::string, std::string> metadata;
  for (const std::string& s : o.set) {
    const auto [key, value] = split_assignment(s, "--set");
    metadata[key] = value;
  }
  write_safetensors(o.out_path, kept, metadata);
  std::cout << "wrote " << o.out_path << ": " << lengths.size() << " documents, " << T << " tokens, "
            << topo.num_q_heads << " query / " << topo.num_kv_heads << " kv heads\n";
  return 0;
}

}  // namespace msa::tool
