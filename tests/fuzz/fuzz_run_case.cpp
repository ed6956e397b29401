// libFuzzer target: `msa run-case` on arbitrary bytes, without writing an output: the reader,
// the case loader's validation (training and inference modes) and, for the inputs that pass
// it, the CPU run itself. Any outcome but success or an msa::Error is a finding.
#include <cstddef>
#include <cstdint>
#include <span>

#include "msa/error.h"
#include "run_case.h"
#include "safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  msa::tool::RunCaseOptions options;
  options.device = msa::Device::cpu();
  options.threads = 1;
  options.summary = false;
  try {
    const msa::tool::SafetensorsFile file = msa::tool::SafetensorsFile::parse(std::span(data, size), "fuzz.safetensors");
    msa::tool::run_case(file, "", options);
  } catch (const msa::Error&) {
  }
  return 0;
}
