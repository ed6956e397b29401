// Error measures between a result and a reference (docs/semantics.md §10): relative L2 error, cosine
// similarity, and allclose-style counts |x - ref| <= atol + rtol |ref|.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace msa::tool {

class ErrorStats {
 public:
  ErrorStats(double atol = 0, double rtol = 0) : atol_(atol), rtol_(rtol) {}
  // Adds one pair. Non-finite values: equal infinities (e.g. LSE -inf of empty rows) match;
  // anything else non-finite counts as a mismatch (NaN never passes).
  void add(double value, double reference);

  int64_t count() const { return count_; }
  int64_t mismatches() const { return mismatches_; }  // pairs outside atol + rtol |ref|
  double max_abs_error() const { return max_abs_; }
  // ||x - ref|| / ||ref|| (0 when both are zero; inf when only ref is zero).
  double relative_l2() const;
  // <x, ref> / (||x|| ||ref||); 1 when both are zero.
  double cosine() const;

 private:
  double atol_, rtol_;
  int64_t count_ = 0, mismatches_ = 0;
  double max_abs_ = 0, diff2_ = 0, ref2_ = 0, val2_ = 0, dot_ = 0;
};

// Row-by-row relative L2 error: ||x_r - ref_r|| / max(||ref_r||, 0.1 * rms row norm, floor).
// Whole-tensor measures average a few wrong rows away; the worst row does not. `floor` is an
// absolute row norm below which differences do not matter (a small fraction of the quantity's
// natural size), so that exactly-zero references (e.g. gradients of one-key rows) are judged
// sensibly. Add a row's values with add(), then call end_row().
class RowErrors {
 public:
  explicit RowErrors(double floor = 0) : floor_(floor) {}
  void add(double value, double reference);
  void end_row();
  int64_t rows() const { return int64_t(diff_norm_.size()); }
  double worst() const;
  // True when the reference's rms row norm is below the floor: whole-tensor cosine and
  // relative errors then measure rounding noise and say nothing.
  bool negligible() const;

 private:
  double floor_;
  double diff2_ = 0, ref2_ = 0;
  bool bad_ = false;
  std::vector<double> diff_norm_, ref_norm_;
};

// "1.2e-03"
std::string sci(double v);

}  // namespace msa::tool
