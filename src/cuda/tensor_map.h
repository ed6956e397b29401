// TMA descriptors (sm_90) for the row-major [rows, 128] bf16 matrices the attention kernels
// move in 16-row pieces: Q rows of one (token, group), partial outputs of one edge.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace msa::cuda {

// Describes `rows` rows of 128 bf16 at `base` (256-byte row stride), copied in boxes of
// `box_rows` rows x 64 columns with the 128-byte swizzle of the shared-memory tiles
// (device.cuh): one box fills rows r.. of one column half of a tile. Rows past the end read
// as zero. The base must be 16-byte aligned (validation checks user tensors); `what` names the
// tensor in the error raised when the driver refuses the descriptor.
CUtensorMap bf16_row_tile_map(const void* base, int64_t rows, int box_rows, const char* what);

// Describes `rows` rows of 128 fp32 at `base` (512-byte row stride) in boxes of `box_rows`
// rows x 32 columns (128 bytes) with the 128-byte swizzle: 16-byte chunk c of box row r sits
// at chunk c ^ (r % 8) in shared memory. For reductions into an fp32 accumulator.
CUtensorMap f32_row_tile_map(void* base, int64_t rows, int box_rows, const char* what);

// Describes a [tokens, heads, 128] bf16 tensor with any 16-byte-multiple strides (elements
// token_stride, head_stride), copied in boxes of `box_heads` heads x `box_tokens` tokens x 64
// columns, same swizzle: a box fills the rows (token-major, then head) of one column half of a
// tile, e.g. the 16 head rows of one query, or 128 keys of one head. Tokens past the end read
// as zero.
CUtensorMap bf16_head_tile_map(const void* base, int64_t tokens, int64_t heads, int64_t token_stride,
                               int64_t head_stride, int box_heads, const char* what, int box_tokens = 1);

// Describes one side (K or V) of a paged cache [pages, heads, 128 tokens, row] with any
// 16-byte-multiple byte strides (page_stride, head_stride, token_stride), copied a page of one
// head at a time: boxes of 128 rows x `box_bytes` bytes. bf16 rows (row_bytes 256) go in two
// boxes of 64 columns with the 128-byte swizzle of the shared-memory tiles (device.cuh), one
// per column half; FP8 / NVFP4 codes (row_bytes 128 / 64) in one box of whole rows, unswizzled,
// or swizzled (`swizzled`: 128-byte rows with the 128-byte swizzle, chunk c of row t at
// c ^ (t % 8); 64-byte rows with the 64-byte swizzle, chunk c at c ^ ((t / 2) % 4)).
CUtensorMap paged_cache_map(const void* base, int64_t pages, int64_t heads, int row_bytes, int64_t page_stride,
                            int64_t head_stride, int64_t token_stride, const char* what, bool swizzled = false);

// Describes `rows` rows of 128 one-byte codes (E4M3) at `base` (128-byte row stride), copied
// in boxes of `box_rows` whole rows with the 128-byte swizzle: a box fills rows r.. of the first
// column half of a tile (device.cuh), the layout 8-bit wgmma operands are read in.
CUtensorMap byte_row_tile_map(const void* base, int64_t rows, int box_rows, const char* what);

}  // namespace msa::cuda
