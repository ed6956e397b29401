#pragma once

namespace msa {
inline constexpr const char* kVersion = "0.1.0";
// True when this build of the library includes the CUDA backend.
bool built_with_cuda();
// Number of CUDA devices usable by msa (0 without the CUDA backend or without a GPU).
int cuda_device_count();
}  // namespace msa
