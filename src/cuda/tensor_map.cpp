#include "cuda/tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <mutex>
#include <sstream>
#include <string>

#include "backend.h"
#include "cuda/common.cuh"

namespace msa::cuda {
namespace {

// The driver's encoder, found once through the runtime (no link against the driver library).
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    MSA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found));
    if (found == cudaDriverEntryPointSuccess) fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  if (!fn) throw Error(ErrorKind::runtime, "the CUDA driver does not provide cuTensorMapEncodeTiled (TMA needs driver 12.0+)");
  return fn;
}

// Encodes a map of rank `rank` (dims innermost first, byte strides of dims 1..) of 16-bit
// (bf16) or 8-bit (codes) elements, with or without the 128-byte swizzle; `shape` describes it
// in the error the driver's refusal raises.
CUtensorMap encode(CUtensorMapDataType type, CUtensorMapSwizzle swizzle, int rank, const void* base,
                   const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box, const char* what,
                   const std::string& shape) {
  CUtensorMap map{};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = encoder()(&map, type, cuuint32_t(rank), const_cast<void*>(base), dims, strides, box, element_strides,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::ostringstream os;
    os << "cuTensorMapEncodeTiled for " << what << " failed with error " << int(r) << " (" << shape << " at " << base
       << ")";
    throw Error(ErrorKind::runtime, os.str());
  }
  return map;
}

// A bf16 map with the 128-byte swizzle of the shared-memory tiles.
CUtensorMap encode_bf16(int rank, const void* base, const cuuint64_t* dims, const cuuint64_t* strides,
                        const cuuint32_t* box, const char* what, const std::string& shape) {
  return encode(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, CU_TENSOR_MAP_SWIZZLE_128B, rank, base, dims, strides, box, what, shape);
}

}  // namespace

CUtensorMap paged_cache_map(const void* base, int64_t pages, int64_t heads, int row_bytes, int64_t page_stride,
                            int64_t head_stride, int64_t token_stride, const char* what, bool swizzled) {
  const bool bf16 = row_bytes == 256;
  const cuuint64_t dims[4] = {cuuint64_t(bf16 ? 128 : row_bytes), 128, cuuint64_t(heads), cuuint64_t(pages > 0 ? pages : 1)};
  const cuuint64_t strides[3] = {cuuint64_t(token_stride), cuuint64_t(head_stride), cuuint64_t(page_stride)};
  const cuuint32_t box[4] = {cuuint32_t(bf16 ? 64 : row_bytes), 128, 1, 1};
  const std::string shape = std::to_string(pages) + " pages x " + std::to_string(heads) + " heads";
  if (bf16) return encode_bf16(4, base, dims, strides, box, what, shape);
  const CUtensorMapSwizzle swizzle = !swizzled         ? CU_TENSOR_MAP_SWIZZLE_NONE
                                     : row_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : row_bytes == 64  ? CU_TENSOR_MAP_SWIZZLE_64B
                                                        : CU_TENSOR_MAP_SWIZZLE_NONE;
  return encode(CU_TENSOR_MAP_DATA_TYPE_UINT8, swizzle, 4, base, dims, strides, box, what, shape);
}

CUtensorMap bf16_row_tile_map(const void* base, int64_t rows, int box_rows, const char* what) {
  const cuuint64_t dims[2] = {128, cuuint64_t(rows > 0 ? rows : 1)};
  const cuuint64_t strides[1] = {128 * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
  return encode_bf16(2, base, dims, strides, box, what, std::to_string(rows) + " rows");
}

CUtensorMap f32_row_tile_map(void* base, int64_t rows, int box_rows, const char* what) {
  const cuuint64_t dims[2] = {128, cuuint64_t(rows > 0 ? rows : 1)};
  const cuuint64_t strides[1] = {128 * 4};
  const cuuint32_t box[2] = {32, cuuint32_t(box_rows)};
  return encode(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, CU_TENSOR_MAP_SWIZZLE_128B, 2, base, dims, strides, box, what,
                std::to_string(rows) + " rows");
}

CUtensorMap bf16_head_tile_map(const void* base, int64_t tokens, int64_t heads, int64_t token_stride,
                               int64_t head_stride, int box_heads, const char* what, int box_tokens) {
  const cuuint64_t dims[3] = {128, cuuint64_t(heads), cuuint64_t(tokens > 0 ? tokens : 1)};
  const cuuint64_t strides[2] = {cuuint64_t(head_stride) * 2, cuuint64_t(token_stride) * 2};
  const cuuint32_t box[3] = {64, cuuint32_t(box_heads), cuuint32_t(box_tokens)};
  return encode_bf16(3, base, dims, strides, box, what,
                     std::to_string(tokens) + " tokens x " + std::to_string(heads) + " heads");
}

CUtensorMap byte_row_tile_map(const void* base, int64_t rows, int box_rows, const char* what) {
  const cuuint64_t dims[2] = {128, cuuint64_t(rows > 0 ? rows : 1)};
  const cuuint64_t strides[1] = {128};
  const cuuint32_t box[2] = {128, cuuint32_t(box_rows)};
  return encode(CU_TENSOR_MAP_DATA_TYPE_UINT8, CU_TENSOR_MAP_SWIZZLE_128B, 2, base, dims, strides, box, what,
                std::to_string(rows) + " rows");
}

}  // namespace msa::cuda
