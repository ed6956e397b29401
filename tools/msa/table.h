// A plain-text table with left-aligned columns, for the tool's reports.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace msa::tool {

class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void add_row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  void print(std::ostream& os) const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace msa::tool
