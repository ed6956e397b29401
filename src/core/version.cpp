#include "msa/version.h"

#include "backend.h"

namespace msa {

bool built_with_cuda() { return MSA_WITH_CUDA != 0; }

#if MSA_WITH_CUDA
namespace cuda {
int device_count();
}
int cuda_device_count() { return cuda::device_count(); }
#else
int cuda_device_count() { return 0; }
#endif

}  // namespace msa
