// Scaffolding for the C++ examples of the documentation (tests/docs/docs_examples.py wraps
// each example in main() after this header): the caller's tensors the examples use but do
// not define, zero-filled host memory of the sizes the examples describe.
#pragma once

#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#include <msa/msa.h>
#if __has_include(<msa/inference.h>)
#include <msa/inference.h>
#endif

namespace docs_scaffold {
// Zeroed bytes that live until the program ends.
inline void* zeros(size_t bytes) { return (new std::vector<unsigned char>(bytes, 0))->data(); }
inline msa::TensorView tensor(msa::DType dtype, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return msa::TensorView::contiguous(zeros(size_t(n * msa::dtype_size(dtype))), dtype, shape);
}
}  // namespace docs_scaffold

// README "C++ usage": host buffers of two documents, 4200 tokens, MiniMax-M3 heads.
inline void* const q_ptr = docs_scaffold::zeros(4200 * 64 * 128 * 2);
inline void* const k_ptr = docs_scaffold::zeros(4200 * 4 * 128 * 2);
inline void* const v_ptr = docs_scaffold::zeros(4200 * 4 * 128 * 2);
inline void* const qi_ptr = docs_scaffold::zeros(4200 * 4 * 128 * 2);
inline void* const ki_ptr = docs_scaffold::zeros(4200 * 1 * 128 * 2);

// docs/inference.md: 60 query rows of two requests over a bf16 cache of 10 pages.
inline const msa::TensorView k_cache = docs_scaffold::tensor(msa::DType::bf16, {10, 4, 128, 128});
inline const msa::TensorView v_cache = docs_scaffold::tensor(msa::DType::bf16, {10, 4, 128, 128});
inline const msa::TensorView index_k_cache = docs_scaffold::tensor(msa::DType::bf16, {10, 128, 128});
inline const msa::TensorView index_q = docs_scaffold::tensor(msa::DType::bf16, {60, 4, 128});
inline const msa::TensorView q = docs_scaffold::tensor(msa::DType::bf16, {60, 64, 128});
inline const msa::TensorView topk = docs_scaffold::tensor(msa::DType::i32, {4, 60, 16});
inline const msa::TensorView out = docs_scaffold::tensor(msa::DType::bf16, {60, 64, 128});
inline const msa::TensorView lse = docs_scaffold::tensor(msa::DType::f32, {60, 64});
