#include "inspect.h"

#include <cmath>
#include <iostream>

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

int run_compare(const CompareOptions& o) {
  const SafetensorsFile a = SafetensorsFile::read(o.a), b = SafetensorsFile::read(o.b);
  std::vector<std::string> names = o.tensors;
  if (names.empty())
    for (const auto& [name, t] : a.tensors) names.push_back(name);
  Table table({"tensor", "dtype", "shape", "max |a - b|", "rel L2", "outside tolerance", "result"});
  bool all_ok = true;
  for (const std::string& name : names) {
    const StTensor& x = a.get(name);
    const StTensor& y = b.get(name);
    if (x.dtype != y.dtype || x.shape != y.shape) {
      table.add_row({name, describe(x), "vs " + describe(y), "-", "-", "-", "DIFFERENT LAYOUT"});
      all_ok = false;
      continue;
    }
    ErrorStats e(o.atol, o.rtol);
    for (int64_t i = 0; i < x.numel(); ++i)
      e.add(load_as_float(x.bytes.data(), x.dtype, i), load_as_float(y.bytes.data(), y.dtype, i));
    const bool ok = e.mismatches() == 0;
    all_ok = all_ok && ok;
    std::string shape = describe(x);
    table.add_row({name, safetensors_dtype_name(x.dtype), shape.substr(shape.find(' ') + 1), sci(e.max_abs_error()),
                   sci(e.relative_l2()), std::to_string(e.mismatches()) + " / " + std::to_string(e.count()),
                   ok ? "ok" : "DIFFERENT"});
  }
  table.print(std::cout);
  std::cout << (all_ok ? "same" : "different") << " (atol " << o.atol << ", rtol " << o.rtol << ")\n";
  return all_ok ? 0 : 1;
}

}  // namespace msa::tool
