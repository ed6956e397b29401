#include "msa/tensor.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <sstream>

#include "backend.h"
#include "core/allocator.h"
#include "core/check.h"
#include "core/dispatch.h"

namespace msa {

namespace {

std::mutex allocator_mutex;
std::shared_ptr<const DeviceAllocator> installed_allocator;  // null: the built-in one

std::shared_ptr<const DeviceAllocator> current_allocator() {
  std::lock_guard<std::mutex> lock(allocator_mutex);
  return installed_allocator;
}

}  // namespace

void set_device_allocator(const DeviceAllocator& allocator) {
  detail::require((allocator.allocate == nullptr) == (allocator.deallocate == nullptr),
                  "set_device_allocator: give both allocate and deallocate, or neither (the built-in allocator)");
  auto next = allocator.is_default() ? nullptr : std::make_shared<const DeviceAllocator>(allocator);
  std::lock_guard<std::mutex> lock(allocator_mutex);
  installed_allocator = std::move(next);
}

void reset_device_allocator() { set_device_allocator(DeviceAllocator{}); }

DeviceAllocator device_allocator() {
  const auto a = current_allocator();
  return a ? *a : DeviceAllocator{};
}

namespace detail {

std::shared_ptr<void> allocate_device(int64_t bytes, int device, void* stream, Release release) {
  return cuda_only("allocating device memory", [&]() -> std::shared_ptr<void> {
    if (auto a = current_allocator()) {
      void* p = a->allocate(bytes, device, stream, a->context);
      if (!p)
        throw Error(ErrorKind::runtime,
                    concat("the device allocator returned no memory for ", bytes, " bytes on cuda:", device));
      return std::shared_ptr<void>(
          p, [a, bytes, device, stream](void* q) { a->deallocate(q, bytes, device, stream, a->context); });
    }
    if (release == Release::in_stream) {
      void* p = cuda::allocate_async(bytes, device, stream);
      return std::shared_ptr<void>(p, [device, stream](void* q) { cuda::release_async(q, device, stream); });
    }
    void* p = cuda::allocate(bytes, device);
    return std::shared_ptr<void>(p, [device](void* q) { cuda::release(q, device); });
  });
}

}  // namespace detail

std::string to_string(Device d) { return d.is_cuda() ? "cuda:" + std::to_string(d.index) : "cpu"; }

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  return contiguous(data, dtype, std::vector<int64_t>(shape), device);
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape, Device device) {
  std::vector<int64_t> stride(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    stride[i] = s;
    s *= shape[i];
  }
  return strided(data, dtype, shape, stride, device);
}

TensorView TensorView::strided(void* data, DType dtype, const std::vector<int64_t>& shape,
                               const std::vector<int64_t>& stride, Device device) {
  detail::require(shape.size() == stride.size(),
                  detail::concat("tensor view: shape has ", shape.size(), " dims but stride has ", stride.size()));
  detail::require(shape.size() <= size_t(kMaxRank),
                  detail::concat("tensor view: rank must be at most ", kMaxRank, ", got ", shape.size()));
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.rank = int(shape.size());
  for (int i = 0; i < t.rank; ++i) {
    detail::require(shape[size_t(i)] >= 0, detail::concat("tensor view: shape[", i, "] must be >= 0, got ", shape[size_t(i)]));
    t.shape[size_t(i)] = shape[size_t(i)];
    t.stride[size_t(i)] = stride[size_t(i)];
  }
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[size_t(i)];
  return rank == 0 ? (data ? 1 : 0) : n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int i = rank; i-- > 0;) {
    if (shape[size_t(i)] != 1 && stride[size_t(i)] != s) return false;
    s *= shape[size_t(i)];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < rank; ++i) os << (i ? ", " : "") << shape[size_t(i)];
  os << ']';
  return os.str();
}

Buffer::Buffer(Device device, DType dtype, std::vector<int64_t> shape, void* stream, Release release)
    : device_(device), dtype_(dtype), shape_(std::move(shape)) {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  bytes_ = n * dtype_size(dtype);
  const size_t alloc = size_t(bytes_ > 0 ? bytes_ : 1);
  if (device.is_cuda()) {
    storage_ = detail::allocate_device(int64_t(alloc), device.index, stream, release);
  } else {
    void* p = std::aligned_alloc(64, (alloc + 63) / 64 * 64);
    if (!p) throw Error(ErrorKind::runtime, detail::concat("out of host memory allocating ", bytes_, " bytes"));
    storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  }
}

TensorView Buffer::view() const { return TensorView::contiguous(storage_.get(), dtype_, shape_, device_); }

Buffer Buffer::slice(int64_t offset, DType dtype, std::vector<int64_t> shape) const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  const int64_t bytes = n * dtype_size(dtype);
  detail::require(n >= 0 && offset >= 0 && offset % dtype_size(dtype) == 0 && offset + bytes <= bytes_,
                  detail::concat("Buffer::slice: ", bytes, " bytes at offset ", offset, " do not fit a buffer of ",
                                 bytes_, " bytes (or the offset is not a multiple of the ", dtype_name(dtype), " size)"));
  Buffer piece;
  piece.storage_ = std::shared_ptr<void>(storage_, static_cast<char*>(storage_.get()) + offset);
  piece.bytes_ = bytes;
  piece.device_ = device_;
  piece.dtype_ = dtype;
  piece.shape_ = std::move(shape);
  return piece;
}

}  // namespace msa

namespace msa {

void copy(const TensorView& src, const TensorView& dst, void* stream) {
  detail::check_present(src, "src");
  detail::check_present(dst, "dst");
  detail::require(src.dtype == dst.dtype, detail::concat("copy: dst must have the dtype of src (", dtype_name(src.dtype),
                                                         "), got ", dtype_name(dst.dtype)));
  detail::require(src.shape_vector() == dst.shape_vector(),
                  detail::concat("copy: dst must have the shape of src ", src.shape_string(), ", got ", dst.shape_string()));
  detail::check_contiguous(src, "src");
  detail::check_contiguous(dst, "dst");
  const int64_t bytes = src.numel() * dtype_size(src.dtype);
  if (bytes == 0) return;
  if (!src.device.is_cuda() && !dst.device.is_cuda()) {
    std::memmove(dst.data, src.data, size_t(bytes));
    return;
  }
  detail::cuda_only("copy", [&] { cuda::copy_bytes(dst.data, dst.device, src.data, src.device, bytes, stream); });
}

void synchronize(Device device) {
  if (!device.is_cuda()) return;
  detail::cuda_only("synchronize", [&] { cuda::synchronize(device.index); });
}

void zero(const TensorView& t, void* stream) {
  detail::check_present(t, "tensor");
  detail::check_contiguous(t, "tensor");
  const int64_t bytes = t.numel() * dtype_size(t.dtype);
  if (bytes == 0) return;
  if (!t.device.is_cuda()) {
    std::memset(t.data, 0, size_t(bytes));
    return;
  }
  detail::cuda_only("zero", [&] { cuda::memset_zero(t.data, t.device.index, bytes, stream); });
}

}  // namespace msa
