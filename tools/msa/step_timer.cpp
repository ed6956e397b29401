#include "step_timer.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <cstdio>
#include <vector>

#include "msa/error.h"
#include "workload.h"

#if MSA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace msa::tool {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

#if MSA_WITH_CUDA
void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw Error(ErrorKind::runtime, std::string(call) + " failed: " + cudaGetErrorString(e));
}
#define MSA_TOOL_CUDA(call) check((call), #call)
#else
[[noreturn]] void no_cuda() { throw Error(ErrorKind::unsupported, "this msa was built without the CUDA backend"); }
#endif

}  // namespace

StepTimer::StepTimer(Device device) : device_(device) {
  if (!device.is_cuda()) return;
#if MSA_WITH_CUDA
  MSA_TOOL_CUDA(cudaSetDevice(device.index));
  cudaStream_t s = nullptr;
  cudaEvent_t a = nullptr, b = nullptr;
  MSA_TOOL_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
  MSA_TOOL_CUDA(cudaEventCreate(&a));
  start_ = a;
  MSA_TOOL_CUDA(cudaEventCreate(&b));
  stop_ = b;
#else
  no_cuda();
#endif
}

StepTimer::~StepTimer() {
#if MSA_WITH_CUDA
  // A destructor must not throw: errors here are cleared, not reported.
  if (start_ && cudaEventDestroy(static_cast<cudaEvent_t>(start_)) != cudaSuccess) cudaGetLastError();
  if (stop_ && cudaEventDestroy(static_cast<cudaEvent_t>(stop_)) != cudaSuccess) cudaGetLastError();
  if (stream_ && cudaStreamDestroy(static_cast<cudaStream_t>(stream_)) != cudaSuccess) cudaGetLastError();
  if (flush_ && cudaFree(flush_) != cudaSuccess) cudaGetLastError();
#endif
}

void StepTimer::flush_l2_before_each(int64_t bytes) {
  if (!device_.is_cuda()) return;
#if MSA_WITH_CUDA
  sync();
  if (flush_) MSA_TOOL_CUDA(cudaFree(flush_));
  flush_ = nullptr;
  flush_bytes_ = 0;
  if (bytes <= 0) return;
  MSA_TOOL_CUDA(cudaMalloc(&flush_, size_t(bytes)));
  flush_bytes_ = bytes;
#endif
}

void StepTimer::flush() const {
#if MSA_WITH_CUDA
  if (flush_bytes_ > 0)
    MSA_TOOL_CUDA(cudaMemsetAsync(flush_, 0, size_t(flush_bytes_), static_cast<cudaStream_t>(stream_)));
#endif
}

void StepTimer::sync() const {
  if (!device_.is_cuda()) return;
#if MSA_WITH_CUDA
  MSA_TOOL_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
#endif
}

double StepTimer::median_seconds(int warmup, int repeats, const std::function<void()>& work,
                                 const std::function<void(const std::string&)>& before) {
  for (int i = 0; i < warmup; ++i) {
    if (before) before("warm-up");
    work();
  }
  sync();
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    if (before) before("run " + std::to_string(i + 1) + "/" + std::to_string(repeats));
    if (!device_.is_cuda()) {
      const auto start = std::chrono::steady_clock::now();
      work();
      times.push_back(seconds_since(start));
      continue;
    }
#if MSA_WITH_CUDA
    const auto s = static_cast<cudaStream_t>(stream_);
    const auto a = static_cast<cudaEvent_t>(start_), b = static_cast<cudaEvent_t>(stop_);
    flush();  // before the start event: the flush is not timed
    MSA_TOOL_CUDA(cudaEventRecord(a, s));
    work();
    MSA_TOOL_CUDA(cudaEventRecord(b, s));
    MSA_TOOL_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    MSA_TOOL_CUDA(cudaEventElapsedTime(&ms, a, b));
    times.push_back(double(ms) * 1e-3);
#endif
  }
  return median(times);
}

double StepTimer::graph_median_seconds(int warmup, int repeats, const std::function<void()>& work) {
  if (!device_.is_cuda()) return -1;
#if MSA_WITH_CUDA
  const auto s = static_cast<cudaStream_t>(stream_);
  sync();
  cudaGraph_t graph = nullptr;
  MSA_TOOL_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    work();
  } catch (...) {
    // Leave the stream usable: end (and drop) the capture before reporting the error.
    if (cudaStreamEndCapture(s, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  MSA_TOOL_CUDA(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check(made, "cudaGraphInstantiate(&exec, graph, 0)");
  double seconds = 0;
  try {
    seconds = median_seconds(warmup, repeats, [&] { MSA_TOOL_CUDA(cudaGraphLaunch(exec, s)); });
  } catch (...) {
    cudaGraphExecDestroy(exec);
    throw;
  }
  MSA_TOOL_CUDA(cudaGraphExecDestroy(exec));
  return seconds;
#else
  (void)warmup, (void)repeats, (void)work;
  no_cuda();
#endif
}

double StepTimer::host_seconds(const std::function<void()>& work) const {
  sync();
  const auto start = std::chrono::steady_clock::now();
  work();
  sync();
  return seconds_since(start);
}

namespace {
// The counters of PeakMemory's allocator. Static: memory it gave must come back to it after the
// PeakMemory is gone (the allocator's context must outlive its allocations).
struct MemoryCounter {
  std::mutex mutex;
  int64_t in_use = 0, peak = 0;
};
MemoryCounter& memory_counter() {
  static MemoryCounter counter;
  return counter;
}

#if MSA_WITH_CUDA
void* counting_allocate(int64_t bytes, int device, void* stream, void* context) {
  auto* c = static_cast<MemoryCounter*>(context);
  int previous = 0;
  MSA_TOOL_CUDA(cudaGetDevice(&previous));
  MSA_TOOL_CUDA(cudaSetDevice(device));
  void* ptr = nullptr;
  const cudaError_t err = cudaMallocAsync(&ptr, size_t(bytes), static_cast<cudaStream_t>(stream));
  MSA_TOOL_CUDA(cudaSetDevice(previous));
  if (err != cudaSuccess) return nullptr;
  std::lock_guard<std::mutex> lock(c->mutex);
  c->in_use += bytes;
  c->peak = std::max(c->peak, c->in_use);
  return ptr;
}

void counting_deallocate(void* ptr, int64_t bytes, int device, void* stream, void* context) {
  auto* c = static_cast<MemoryCounter*>(context);
  int previous = 0;
  if (cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(device) == cudaSuccess) {
    cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream));  // must not throw
    cudaSetDevice(previous);
  }
  std::lock_guard<std::mutex> lock(c->mutex);
  c->in_use -= bytes;
}
#endif
}  // namespace

PeakMemory::PeakMemory(Device device) {
  if (!device.is_cuda()) return;
#if MSA_WITH_CUDA
  MemoryCounter& c = memory_counter();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    c.peak = c.in_use;
  }
  DeviceAllocator a;
  a.allocate = counting_allocate;
  a.deallocate = counting_deallocate;
  a.context = &c;
  set_device_allocator(a);
  active_ = true;
#else
  no_cuda();
#endif
}

PeakMemory::~PeakMemory() {
  if (active_) reset_device_allocator();
}

int64_t PeakMemory::in_use() const {
  std::lock_guard<std::mutex> lock(memory_counter().mutex);
  return memory_counter().in_use;
}

int64_t PeakMemory::peak() const {
  std::lock_guard<std::mutex> lock(memory_counter().mutex);
  return memory_counter().peak;
}

void PeakMemory::restart() {
  std::lock_guard<std::mutex> lock(memory_counter().mutex);
  memory_counter().peak = memory_counter().in_use;
}

int64_t device_memory_in_use(Device device) {
  if (!device.is_cuda()) return -1;
#if MSA_WITH_CUDA
  MSA_TOOL_CUDA(cudaSetDevice(device.index));
  size_t free_bytes = 0, total_bytes = 0;
  MSA_TOOL_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  return int64_t(total_bytes - free_bytes);
#else
  no_cuda();
#endif
}

double device_copy_rate(Device device, StepTimer& timer, int64_t bytes, int repeats) {
  if (!device.is_cuda()) return -1;
#if MSA_WITH_CUDA
  // Contents do not matter: the copy streams whatever the allocation holds.
  const Buffer src(device, DType::u8, {bytes}, timer.stream()), dst(device, DType::u8, {bytes}, timer.stream());
  const auto s = static_cast<cudaStream_t>(timer.stream());
  const double seconds = timer.median_seconds(1, repeats, [&] {
    MSA_TOOL_CUDA(cudaMemcpyAsync(dst.data(), src.data(), size_t(bytes), cudaMemcpyDeviceToDevice, s));
  });
  timer.sync();  // the buffers are freed on return
  return seconds > 0 ? 2.0 * double(bytes) / seconds : -1;
#else
  (void)timer, (void)bytes, (void)repeats;
  no_cuda();
#endif
}

std::string device_description(Device device) {
  if (!device.is_cuda()) return "";
#if MSA_WITH_CUDA
  cudaDeviceProp prop{};
  MSA_TOOL_CUDA(cudaGetDeviceProperties(&prop, device.index));
  char text[320];
  std::snprintf(text, sizeof text, "%s, %d SMs, %.0f MB L2", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6);
  return text;
#else
  no_cuda();
#endif
}

int64_t device_l2_bytes(Device device) {
  if (!device.is_cuda()) return 0;
#if MSA_WITH_CUDA
  int bytes = 0;
  MSA_TOOL_CUDA(cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, device.index));
  return bytes;
#else
  no_cuda();
#endif
}

}  // namespace msa::tool
