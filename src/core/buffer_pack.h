// Several buffers carved out of one allocation, each piece 256-byte aligned. A plan holds
// about twenty small buffers; one allocator call instead of one each keeps build_plan short,
// and where cudaFree gives it back (Release::device_wait), a plan's destruction waits once.
#pragma once

#include <vector>

#include "msa/tensor.h"

namespace msa::detail {

class BufferPack {
 public:
  // `*target` becomes a [shape] `dtype` piece when allocate() runs; returns the piece's byte
  // offset in the allocation.
  int64_t add(Buffer* target, DType dtype, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    const int64_t offset = bytes_;
    pieces_.push_back({target, dtype, std::move(shape), offset});
    bytes_ += (n * dtype_size(dtype) + 255) / 256 * 256;
    return offset;
  }

  // One buffer on `device` (for work on `stream`, given back as `release` says) holding every
  // piece added so far; returns it whole (u8), e.g. to fill all the pieces with one copy.
  Buffer allocate(Device device, void* stream, Release release = Release::device_wait) {
    const Buffer whole(device, DType::u8, {bytes_ > 0 ? bytes_ : 256}, stream, release);
    for (Piece& p : pieces_) *p.target = whole.slice(p.offset, p.dtype, std::move(p.shape));
    pieces_.clear();
    bytes_ = 0;
    return whole;
  }

 private:
  struct Piece {
    Buffer* target;
    DType dtype;
    std::vector<int64_t> shape;
    int64_t offset;
  };
  std::vector<Piece> pieces_;
  int64_t bytes_ = 0;
};

}  // namespace msa::detail
