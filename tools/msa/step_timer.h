// Timing and device queries of `msa bench`: on a GPU, CUDA-event times on the bench's own
// stream and a host clock for steps that also work on the host (the plan); on the CPU, wall
// time. The one file of the benches (training and decode) that calls the CUDA runtime.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "msa/tensor.h"

namespace msa::tool {

class StepTimer {
 public:
  // CUDA: a non-blocking stream and two events on `device`; throws msa::Error (runtime) when
  // the runtime refuses.
  explicit StepTimer(Device device);
  ~StepTimer();
  StepTimer(const StepTimer&) = delete;
  StepTimer& operator=(const StepTimer&) = delete;

  // The stream every timed call must queue its work on (a cudaStream_t; null on the CPU).
  void* stream() const { return stream_; }
  // Waits for the work queued on stream() (no-op on the CPU).
  void sync() const;

  // Median seconds of `repeats` calls after `warmup` untimed ones. CUDA: between two events
  // recorded on stream() around each call; CPU: wall time of each call. `before` (if set)
  // runs before every call with "warm-up" or "run i/n".
  double median_seconds(int warmup, int repeats, const std::function<void()>& work,
                        const std::function<void(const std::string&)>& before = {});
  // CUDA: `work` captured once into a CUDA graph on stream(), then the median seconds of
  // `repeats` graph launches after `warmup` (events around each launch): the device time of
  // the work without the host's launch costs, as an engine replaying a captured step sees it.
  // The work must only queue device work on stream(). -1 on the CPU.
  double graph_median_seconds(int warmup, int repeats, const std::function<void()>& work);
  // Host clock from the call to the end of the device work it queued on stream().
  double host_seconds(const std::function<void()>& work) const;
  // CUDA: from now on every call of median_seconds (graph launches included) is preceded,
  // outside its events, by a write of `bytes` to a buffer of the timer's, which drives the
  // last call's data out of the L2 cache (0: no more flushing). Nothing on the CPU.
  void flush_l2_before_each(int64_t bytes);

 private:
  Device device_;
  void* stream_ = nullptr;
  void* start_ = nullptr;  // cudaEvent_t
  void* stop_ = nullptr;
  void* flush_ = nullptr;  // device buffer of flush_bytes_ (flush_l2_before_each)
  int64_t flush_bytes_ = 0;
  void flush() const;
};

// The most device memory msa allocated at once: while a PeakMemory lives, every CUDA allocation
// of the library and of msa Buffers (all of them come from msa's device allocator) goes
// through a counting allocator (cudaMallocAsync / cudaFreeAsync on the allocation's stream);
// its destructor puts the built-in allocator back (memory it counted still comes back to it).
// One at a time. Nothing on the CPU.
class PeakMemory {
 public:
  explicit PeakMemory(Device device);
  ~PeakMemory();
  PeakMemory(const PeakMemory&) = delete;
  PeakMemory& operator=(const PeakMemory&) = delete;
  int64_t in_use() const;
  int64_t peak() const;  // since construction or the last restart
  void restart();        // the peak from the bytes in use now
 private:
  bool active_ = false;
};

// CUDA: bytes of device memory in use (total - free from cudaMemGetInfo: the CUDA context and
// other processes included). -1 on the CPU.
int64_t device_memory_in_use(Device device);
// CUDA: "NVIDIA H200, 132 SMs, 63 MB L2". Empty on the CPU.
std::string device_description(Device device);
// CUDA: the device's L2 cache in bytes. 0 on the CPU.
int64_t device_l2_bytes(Device device);

// CUDA: the device's copy bandwidth in bytes per second: a device-to-device cudaMemcpyAsync
// of `bytes` on timer.stream(), median of `repeats` copies after one warm-up, counting every
// byte once read and once written (2 x bytes per copy). -1 on the CPU.
double device_copy_rate(Device device, StepTimer& timer, int64_t bytes, int repeats);

}  // namespace msa::tool
