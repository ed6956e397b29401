// Placeholder until the inference path (paged prefill, decode) is available in this build.
#include "inference_case.h"

#include "msa/error.h"

namespace msa::tool {

int run_inference_case(const SafetensorsFile& in, const std::string&, const RunCaseOptions&) {
  const auto it = in.metadata.find("mode");
  const std::string mode = it == in.metadata.end() ? std::string() : it->second;
  throw Error(ErrorKind::unsupported, "run-case mode '" + mode + "' is not available in this build");
}

}  // namespace msa::tool
