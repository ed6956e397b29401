#include "inspect.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <set>

#include "case_io.h"
#include "metrics.h"
#include "msa/error.h"
#include "table.h"

namespace msa::tool {

int run_inspect(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::read(path);
  std::cout << path << ": " << f.tensors.size() << " tensors\n";
  for (const auto& [key, value] : f.metadata) std::cout << "  " << key << " = " << value << "\n";
  Table table({"tensor", "dtype", "shape", "min", "max", "mean |x|", "non-finite"});
  for (const auto& [name, t] : f.tensors) {
    double lo = INFINITY, hi = -INFINITY, abs_sum = 0;
    int64_t bad = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double x = load_as_float(t.bytes.data(), t.dtype, i);
      if (!std::isfinite(x)) {
        ++bad;
        continue;
      }
      lo = std::min(lo, x);
      hi = std::max(hi, x);
      abs_sum += std::abs(x);
    }
    const bool any = t.numel() > bad;
    std::string shape = describe(t);
    shape = shape.substr(shape.find(' ') + 1);
    table.add_row({name, safetensors_dtype_name(t.dtype), shape, any ? sci(lo) : "-", any ? sci(hi) : "-",
                   any ? sci(abs_sum / double(t.numel() - bad)) : "-", std::to_string(bad)});
  }
  table.print(std::cout);
  return 0;
}

namespace {

// The documented accuracy targets (README "Accuracy"), by tensor name; integer tensors must be
// equal; gradients of the main attention are judged by cosine similarity, as in the tests.
struct Tolerance {
  double atol = 0, rtol = 0;
  double min_cosine = -1;  // > -1: the tensor passes on cosine >= min_cosine instead
  std::string text() const {
    if (min_cosine > -1) return "cos >= " + sci(min_cosine).substr(0, 4);
    if (atol == 0 && rtol == 0) return "exact";
    return "atol " + sci(atol) + ", rtol " + sci(rtol);
  }
};

Tolerance default_tolerance(const std::string& name, DType dtype) {
  if (dtype == DType::i32 || dtype == DType::u8) return {0, 0};
  if (name == "lse") return {1e-3, 1e-3};
  if (name == "indexer_lse") return {2e-3, 2e-3};
  if (name == "dq" || name == "dk" || name == "dv") return {0, 0, 0.99};
  if (name == "dindex_q" || name == "dindex_k") return {2e-3, 1e-2};
  return {3e-2, 3e-2};  // out and any other floating-point tensor
}

std::string shape_only(const StTensor& t) {
  const std::string d = describe(t);
  return d.substr(d.find(' ') + 1);
}

}  // namespace

int run_compare(const CompareOptions& o) {
  const SafetensorsFile a = SafetensorsFile::read(o.a), b = SafetensorsFile::read(o.b);
  // Every tensor of either file unless some were named: a tensor on one side only is a difference.
  std::vector<std::string> names = o.tensors;
  if (names.empty()) {
    std::set<std::string> all;
    for (const auto& [name, t] : a.tensors) all.insert(name);
    for (const auto& [name, t] : b.tensors) all.insert(name);
    names.assign(all.begin(), all.end());
  }
  const bool given = o.atol >= 0 || o.rtol >= 0;
  Table table({"tensor", "dtype", "shape", "max |a - b|", "rel L2", "cosine", "tolerance", "outside", "result"});
  bool all_ok = true;
  for (const std::string& name : names) {
    const StTensor *x = a.find(name), *y = b.find(name);
    if (!x || !y) {
      const StTensor& t = x ? *x : *y;
      table.add_row({quote_short(name, 40), safetensors_dtype_name(t.dtype), shape_only(t), "-", "-", "-", "-", "-",
                     x ? "ONLY IN A" : "ONLY IN B"});
      all_ok = false;
      continue;
    }
    if (x->dtype != y->dtype || x->shape != y->shape) {
      table.add_row({quote_short(name, 40), describe(*x), "vs " + describe(*y), "-", "-", "-", "-", "-", "DIFFERENT LAYOUT"});
      all_ok = false;
      continue;
    }
    Tolerance tol = default_tolerance(name, x->dtype);
    if (given) tol = {std::max(o.atol, 0.0), std::max(o.rtol, 0.0)};
    // NaN matches NaN at the same place (a file equals itself); finite values go to the stats.
    ErrorStats e(tol.atol, tol.rtol);
    int64_t nan_mismatches = 0;
    for (int64_t i = 0; i < x->numel(); ++i) {
      const double u = load_as_float(x->bytes.data(), x->dtype, i), v = load_as_float(y->bytes.data(), y->dtype, i);
      if (std::isnan(u) || std::isnan(v)) {
        nan_mismatches += std::isnan(u) != std::isnan(v);
        continue;
      }
      e.add(u, v);
    }
    const int64_t outside = e.mismatches() + nan_mismatches;
    const bool ok = tol.min_cosine > -1 ? nan_mismatches == 0 && e.cosine() >= tol.min_cosine : outside == 0;
    all_ok = all_ok && ok;
    table.add_row({quote_short(name, 40), safetensors_dtype_name(x->dtype), shape_only(*x), sci(e.max_abs_error()),
                   sci(e.relative_l2()), sci(e.cosine()), tol.text(),
                   std::to_string(outside) + " / " + std::to_string(x->numel()), ok ? "ok" : "DIFFERENT"});
  }
  table.print(std::cout);
  std::cout << (all_ok ? "same" : "different") << " ("
            << (given ? "atol " + sci(std::max(o.atol, 0.0)) + ", rtol " + sci(std::max(o.rtol, 0.0)) + " for every tensor"
                      : std::string("the documented tolerance of each tensor"))
            << ")\n";
  return all_ok ? 0 : 1;
}

}  // namespace msa::tool
