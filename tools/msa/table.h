// A plain-text table for the tool's reports: columns left-aligned unless marked right-aligned
// (numbers).
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace msa::tool {

class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void add_row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  // right[i]: column i is right-aligned, header included.
  void align_right(std::vector<bool> right) { right_ = std::move(right); }
  void print(std::ostream& os) const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
  std::vector<bool> right_;
};

}  // namespace msa::tool
