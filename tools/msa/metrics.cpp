#include "metrics.h"

#include <cmath>
#include <cstdio>
#include <limits>

namespace msa::tool {

void ErrorStats::add(double value, double reference) {
  ++count_;
  if (!std::isfinite(value) || !std::isfinite(reference)) {
    if (!(std::isinf(value) && value == reference)) {
      ++mismatches_;
      max_abs_ = std::numeric_limits<double>::infinity();
      diff2_ = std::numeric_limits<double>::infinity();
    }
    return;
  }
  const double diff = value - reference;
  if (std::abs(diff) > atol_ + rtol_ * std::abs(reference)) ++mismatches_;
  max_abs_ = std::max(max_abs_, std::abs(diff));
  diff2_ += diff * diff;
  ref2_ += reference * reference;
  val2_ += value * value;
  dot_ += value * reference;
}

double ErrorStats::relative_l2() const {
  if (ref2_ == 0) return diff2_ == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff2_ / ref2_);
}

double ErrorStats::cosine() const {
  if (!std::isfinite(diff2_)) return std::numeric_limits<double>::quiet_NaN();
  if (ref2_ == 0 && val2_ == 0) return 1.0;
  if (ref2_ == 0 || val2_ == 0) return 0.0;
  return dot_ / std::sqrt(ref2_ * val2_);
}

std::string sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1e", v);
  return buf;
}

}  // namespace msa::tool
