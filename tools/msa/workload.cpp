#include "workload.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <set>

#include "msa/dtype.h"
#include "msa/error.h"

namespace msa::tool {

namespace {

[[noreturn]] void invalid(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Two independent standard normals for counter `i` of (seed, stream), by Box-Muller.
void normal_pair(uint64_t seed, uint64_t stream, uint64_t i, double& a, double& b) {
  const uint64_t base = splitmix64(seed ^ splitmix64(stream * 0x632be59bd9b4e019ull + 1)) + 2 * i;
  const uint64_t r1 = splitmix64(base), r2 = splitmix64(base + 1);
  const double u1 = (double(r1 >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = double(r2 >> 11) * 0x1.0p-53;          // [0, 1)
  const double radius = std::sqrt(-2.0 * std::log(u1));
  a = radius * std::cos(2.0 * M_PI * u2);
  b = radius * std::sin(2.0 * M_PI * u2);
}

// Keys of block `block` visible to position p (document of k_len keys).
int64_t visible_keys_in_block(int64_t block, int64_t p, int64_t k_len) {
  const int64_t begin = block * 128, end = std::min({begin + 128, p + 1, k_len});
  return std::max<int64_t>(0, end - begin);
}

}  // namespace

// ---------------------------------------------------------------------------------------

std::vector<int64_t> demo_document_lengths(int64_t total_tokens) {
  if (total_tokens < 1) invalid("--tokens must be >= 1, got " + std::to_string(total_tokens));
  const std::vector<int64_t> head = {4096, 2500, 1200, 300};
  const std::vector<int64_t> tail = {129, 1};
  const int64_t pattern_total = 4096 + 2500 + 1200 + 300 + 129 + 1;
  if (total_tokens == pattern_total) {
    std::vector<int64_t> all = head;
    all.insert(all.end(), tail.begin(), tail.end());
    return all;
  }
  if (total_tokens < 520) {
    if (total_tokens == 1) return {1};
    return {total_tokens - 1, 1};
  }
  // Scale the four large documents to what the fixed tail leaves; the rounding remainder
  // goes to the first one.
  const int64_t room = total_tokens - 130;
  const int64_t head_total = 4096 + 2500 + 1200 + 300;
  std::vector<int64_t> lengths;
  int64_t used = 0;
  for (int64_t h : head) {
    const int64_t n = std::max<int64_t>(1, h * room / head_total);
    lengths.push_back(n);
    used += n;
  }
  lengths[0] += room - used;
  lengths.insert(lengths.end(), tail.begin(), tail.end());
  return lengths;
}

int64_t default_demo_tokens(Device device) {
  // CPU: the 8226-token mixed pack. GPU: the same mix at 4x (32904 tokens).
  return device.is_cuda() ? 4 * 8226 : 8226;
}

PackedLayout layout_of_documents(const std::vector<int64_t>& lengths) {
  std::vector<int32_t> cu = {0};
  for (int64_t n : lengths) {
    if (n < 1) invalid("document lengths must be >= 1, got " + std::to_string(n));
    if (cu.back() + n > int64_t(INT32_MAX)) invalid("the pack holds more than 2^31 - 1 tokens");
    cu.push_back(int32_t(cu.back() + n));
  }
  return PackedLayout::from_cu_seqlens(cu, cu);
}

std::vector<int64_t> parse_size_list(const std::string& text, const std::string& option) {
  std::vector<int64_t> sizes;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const std::string original = item;
    int64_t mult = 1;
    if (!item.empty() && (item.back() == 'k' || item.back() == 'K')) mult = 1024, item.pop_back();
    else if (!item.empty() && (item.back() == 'm' || item.back() == 'M')) mult = 1024 * 1024, item.pop_back();
    if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || item.size() > 12)
      invalid(option + " must be a comma-separated list of positive token counts (e.g. 4096,8k), got '" + original + "'");
    const int64_t value = std::stoll(item) * mult;
    if (value < 1 || value > int64_t(INT32_MAX))
      invalid(option + " entries must be in [1, 2^31 - 1], got '" + original + "'");
    sizes.push_back(value);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return sizes;
}

// ---------------------------------------------------------------------------------------

void fill_normal_bf16(uint16_t* dst, int64_t n, float stddev, uint64_t seed, uint64_t stream) {
  const int64_t pairs = (n + 1) / 2;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < pairs; ++i) {
    double a, b;
    normal_pair(seed, stream, uint64_t(i), a, b);
    dst[2 * i] = float_to_bf16(float(a * stddev));
    if (2 * i + 1 < n) dst[2 * i + 1] = float_to_bf16(float(b * stddev));
  }
}

void fill_drifting_bf16(uint16_t* dst, const PackedLayout& layout, bool along_keys, int heads, int dim, float stddev,
                        double correlation_tokens, uint64_t seed, uint64_t stream) {
  const double a = std::exp(-1.0 / std::max(1.0, correlation_tokens));
  const double innovation = std::sqrt(1.0 - a * a);
  const int64_t columns = int64_t(heads) * dim;
  const int num_docs = layout.num_documents();
  // Fragments may share key storage: fill each stored key range once, from its first row.
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, end) packed rows
  for (int b = 0; b < num_docs; ++b) {
    const DocumentSpan& d = layout.document(b);
    if (along_keys) ranges.emplace_back(d.k_start, d.k_start + d.k_len);
    else ranges.emplace_back(d.q_start, d.q_start + d.q_len);
  }
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<int64_t, int64_t>> disjoint;
  for (auto r : ranges) {
    if (!disjoint.empty() && r.first < disjoint.back().second) {
      disjoint.back().second = std::max(disjoint.back().second, r.second);
    } else {
      disjoint.push_back(r);
    }
  }
  const int64_t tasks = int64_t(disjoint.size()) * columns;
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t task = 0; task < tasks; ++task) {
    const auto [begin, end] = disjoint[size_t(task / columns)];
    const int64_t column = task % columns;
    const uint64_t column_stream = stream * 0x100000001b3ull + uint64_t(task);
    double x = 0;
    for (int64_t row = begin; row < end; row += 2) {
      double e0, e1;
      normal_pair(seed, column_stream, uint64_t(row - begin) / 2, e0, e1);
      x = row == begin ? e0 : a * x + innovation * e0;
      dst[row * columns + column] = float_to_bf16(float(x * stddev));
      if (row + 1 < end) {
        x = a * x + innovation * e1;
        dst[(row + 1) * columns + column] = float_to_bf16(float(x * stddev));
      }
    }
  }
}

std::string to_string(Selection s) { return s == Selection::independent ? "independent" : "coherent"; }

std::vector<Selection> parse_selections(const std::string& text) {
  std::vector<Selection> selections;
  if (text == "independent" || text == "both") selections.push_back(Selection::independent);
  if (text == "coherent" || text == "both") selections.push_back(Selection::coherent);
  if (selections.empty()) invalid("--selection must be independent, coherent or both, got '" + text + "'");
  return selections;
}

// ---------------------------------------------------------------------------------------

double attended_pairs(const Topology& topo, const PackedLayout& layout, const int32_t* topk) {
  const int H = topo.num_index_heads, K = topo.topk;
  const int64_t total_q = layout.total_q();
  double pairs = 0;
  for (const DocumentSpan& d : layout.documents()) {
    for (int64_t i = 0; i < d.q_len; ++i) {
      const int64_t p = d.k_len - d.q_len + i, row = d.q_start + i;
      for (int g = 0; g < H; ++g) {
        const int32_t* ids = topk + (int64_t(g) * total_q + row) * K;
        for (int s = 0; s < K; ++s)
          if (ids[s] >= 0) pairs += double(visible_keys_in_block(ids[s], p, d.k_len));
      }
    }
  }
  return pairs;
}

double forward_flops(const Topology& topo, const PackedLayout& layout, const int32_t* topk) {
  return 4.0 * topo.head_dim * topo.group_size() * attended_pairs(topo, layout, topk);
}

double kl_flops(const Topology& topo, const PackedLayout& layout, const int32_t* topk) {
  return (2.0 * topo.head_dim * topo.group_size() + 6.0 * topo.index_head_dim) * attended_pairs(topo, layout, topk);
}

double indexer_flops(const Topology& topo, const PackedLayout& layout) {
  double causal = 0;
  for (const DocumentSpan& d : layout.documents()) {
    const double first = double(d.k_len - d.q_len) + 1, last = double(d.k_len);  // keys seen by first/last query
    causal += (first + last) * double(d.q_len) / 2;
  }
  return 2.0 * topo.index_head_dim * topo.num_index_heads * causal;
}

double mean_union_of_8(const Topology& topo, const PackedLayout& layout, const int32_t* topk) {
  const int H = topo.num_index_heads, K = topo.topk;
  const int64_t total_q = layout.total_q();
  std::vector<int32_t> ids;
  // [0]: windows of ranking tokens only, [1]: all windows.
  double sum[2] = {0, 0};
  int64_t windows[2] = {0, 0};
  for (const DocumentSpan& d : layout.documents()) {
    for (int64_t w = 0; w < d.q_len; w += 8) {
      const int64_t end = std::min(d.q_len, w + 8);
      const bool ranking = end - w == 8 && (d.k_len - d.q_len + w) / topo.block_size + 1 > K;
      for (int g = 0; g < H; ++g) {
        ids.clear();
        for (int64_t i = w; i < end; ++i) {
          const int32_t* r = topk + (int64_t(g) * total_q + d.q_start + i) * K;
          for (int s = 0; s < K; ++s)
            if (r[s] >= 0) ids.push_back(r[s]);
        }
        std::sort(ids.begin(), ids.end());
        const double size = double(std::unique(ids.begin(), ids.end()) - ids.begin());
        sum[1] += size;
        ++windows[1];
        if (ranking) {
          sum[0] += size;
          ++windows[0];
        }
      }
    }
  }
  if (windows[0]) return sum[0] / double(windows[0]);
  return windows[1] ? sum[1] / double(windows[1]) : 0.0;
}

// ---------------------------------------------------------------------------------------

std::string format_rate(double flops, double seconds) {
  if (!(seconds > 0) || !(flops > 0)) return "-";
  const double rate = flops / seconds;
  char buf[32];
  if (rate >= 1e12) std::snprintf(buf, sizeof buf, "%.2f TFLOP/s", rate / 1e12);
  else std::snprintf(buf, sizeof buf, "%.1f GFLOP/s", rate / 1e9);
  return buf;
}

std::string format_time(double seconds) {
  char buf[32];
  if (seconds < 1e-3) std::snprintf(buf, sizeof buf, "%.1f us", seconds * 1e6);
  else if (seconds < 1.0) std::snprintf(buf, sizeof buf, "%.2f ms", seconds * 1e3);
  else std::snprintf(buf, sizeof buf, "%.2f s", seconds);
  return buf;
}

std::string format_bytes(double bytes) {
  char buf[32];
  if (bytes >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024 * 1024));
  else std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1024.0 * 1024));
  return buf;
}

double time_once(Device device, const std::function<void()>& work) {
  synchronize(device);
  const auto start = std::chrono::steady_clock::now();
  work();
  synchronize(device);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace msa::tool
