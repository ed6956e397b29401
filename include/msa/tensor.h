// Non-owning tensor views (shape + int64 element strides) and a small owning buffer.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "msa/dtype.h"

namespace msa {

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU
  static Device cpu() { return {}; }
  static Device cuda(int ordinal = 0) { return {DeviceType::cuda, ordinal}; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool operator==(const Device&) const = default;
};
std::string to_string(Device d);

inline constexpr int kMaxRank = 6;

// A view of memory owned elsewhere. Strides are in elements, not bytes.
// A default-constructed view is "absent" (data == nullptr, rank 0) and is how
// optional arguments are left out.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> stride{};

  // Contiguous (row-major) view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::cpu());
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                               Device device = Device::cpu());
  // View with explicit element strides.
  static TensorView strided(void* data, DType dtype, const std::vector<int64_t>& shape,
                            const std::vector<int64_t>& stride, Device device = Device::cpu());

  bool present() const { return data != nullptr || (rank > 0 && numel() == 0); }
  int64_t numel() const;
  int64_t size(int dim) const { return shape[dim < 0 ? dim + rank : dim]; }
  bool is_contiguous() const;
  std::vector<int64_t> shape_vector() const { return {shape.begin(), shape.begin() + rank}; }
  // "[64, 4, 128]"
  std::string shape_string() const;

  template <typename T> T* as() const { return static_cast<T*>(data); }
};

// Where msa's CUDA memory comes from: plan buffers, the plan's workspace, temporary scratch
// and Buffers on a CUDA device. Process-wide; by default cudaMalloc / cudaFree for buffers,
// cudaMallocAsync / cudaFreeAsync for temporary scratch and inference plans (Release below).
//
// A custom allocator (for example a framework's caching allocator, so that plans built during
// CUDA-graph capture come from the graph's memory pool) must be stream-ordered:
//   allocate(bytes, device, stream, context): `bytes` > 0 bytes on CUDA device `device`, to be
//     used by work queued on `stream` (a cudaStream_t; null is the legacy default stream).
//     Returns nullptr or throws when it cannot; an exception reaches msa's caller unchanged.
//   deallocate(ptr, bytes, device, stream, context): gives back memory from `allocate` with
//     the same bytes, device and stream. Work queued on `stream` before the call may still be
//     using it: the allocator must not hand it out to other streams before that work is done
//     (a stream-ordered allocator gives this). Must not throw.
// Memory is always given back to the allocator that gave it, even after a later call to
// set_device_allocator; `context` must stay valid as long as such memory lives.
struct DeviceAllocator {
  void* (*allocate)(int64_t bytes, int device, void* stream, void* context) = nullptr;
  void (*deallocate)(void* ptr, int64_t bytes, int device, void* stream, void* context) = nullptr;
  void* context = nullptr;
  bool is_default() const { return allocate == nullptr; }
};
// Installs `allocator` for all later CUDA allocations (both functions, or neither = the default).
void set_device_allocator(const DeviceAllocator& allocator);
// Back to cudaMalloc / cudaFree (and cudaMallocAsync for scratch).
void reset_device_allocator();
// The allocator in use (is_default() for the built-in one).
DeviceAllocator device_allocator();

// How the built-in allocator gives a CUDA buffer's memory back (a custom allocator receives
// the buffer's stream either way and is stream-ordered by contract).
enum class Release : uint8_t {
  device_wait,  // cudaFree: waits for all work on the device, so any stream may have used it
  in_stream,    // cudaFreeAsync on the buffer's stream: no wait; work on other streams that used
                //   the buffer must be ordered before the release on that stream (the stream
                //   must outlive the buffer)
};

// Owning buffer on the CPU or on a CUDA device; `view()` describes it as a contiguous tensor.
// CUDA buffers come from the device allocator above; `stream` (a cudaStream_t) is the stream
// their users run on, passed to a custom allocator; `release` applies to the built-in one.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Device device, DType dtype, std::vector<int64_t> shape, void* stream = nullptr,
         Release release = Release::device_wait);
  TensorView view() const;
  void* data() const { return storage_.get(); }
  int64_t bytes() const { return bytes_; }
  bool empty() const { return storage_ == nullptr; }
  // A [shape] `dtype` buffer over this one's bytes from `offset` on (aligned to the dtype),
  // sharing its ownership: the memory lives as long as any slice of it.
  Buffer slice(int64_t offset, DType dtype, std::vector<int64_t> shape) const;

 private:
  std::shared_ptr<void> storage_;
  int64_t bytes_ = 0;
  Device device_{};
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
};

// Copies src into dst (same dtype and shape, both contiguous) between any pair of devices.
// With CUDA memory involved the copy is ordered on opt_stream (a cudaStream_t, may be null).
void copy(const TensorView& src, const TensorView& dst, void* stream = nullptr);
// Waits until all work queued on `device` has finished (no-op on the CPU).
void synchronize(Device device);
// Fills a tensor's bytes with zeros (contiguous tensors).
void zero(const TensorView& t, void* stream = nullptr);

}  // namespace msa
