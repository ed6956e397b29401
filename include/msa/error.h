// The one exception type msa throws. Messages name the argument, what was expected and
// what came, e.g. "q must have shape [total_q, 64, 128], got [100, 64, 64]".
// An operation that throws has not written to any of its outputs.
#pragma once

#include <stdexcept>
#include <string>

namespace msa {

enum class ErrorKind {
  invalid_argument,  // bad shape, dtype, stride, value or combination of arguments
  unsupported,       // valid request that this build or backend cannot serve
  runtime,           // failure while running (CUDA error, allocation failure)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace msa
