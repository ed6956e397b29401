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

// Owning buffer on the CPU or on a CUDA device; `view()` describes it as a contiguous tensor.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Device device, DType dtype, std::vector<int64_t> shape);
  TensorView view() const;
  void* data() const { return storage_.get(); }
  int64_t bytes() const { return bytes_; }
  bool empty() const { return storage_ == nullptr; }

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
