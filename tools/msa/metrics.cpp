#include "metrics.h"

#include <algorithm>
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

void RowErrors::add(double value, double reference) {
  if (!std::isfinite(value) || !std::isfinite(reference)) {
    bad_ = bad_ || !(std::isinf(value) && value == reference);
    return;
  }
  diff2_ += (value - reference) * (value - reference);
  ref2_ += reference * reference;
}

void RowErrors::end_row() {
  diff_norm_.push_back(bad_ ? std::numeric_limits<double>::infinity() : std::sqrt(diff2_));
  ref_norm_.push_back(std::sqrt(ref2_));
  diff2_ = ref2_ = 0;
  bad_ = false;
}

namespace {
double rms(const std::vector<double>& norms) {
  double mean_square = 0;
  for (double r : norms) mean_square += r * r;
  return norms.empty() ? 0.0 : std::sqrt(mean_square / double(norms.size()));
}
}  // namespace

bool RowErrors::negligible() const { return rms(ref_norm_) <= floor_; }

double RowErrors::worst() const {
  const double floor = std::max(0.1 * rms(ref_norm_), floor_);
  double worst = 0;
  for (size_t i = 0; i < diff_norm_.size(); ++i) {
    const double den = std::max({ref_norm_[i], floor, 1e-300});
    worst = std::max(worst, std::isfinite(diff_norm_[i]) ? diff_norm_[i] / den : diff_norm_[i]);
  }
  return worst;
}

std::string sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1e", v);
  return buf;
}

}  // namespace msa::tool
