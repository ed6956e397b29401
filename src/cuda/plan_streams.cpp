// The streams of a CUDA inference plan (InferencePlan::streams): where its tables were last
// uploaded (runs elsewhere wait for that on the device) and which runs may still be going (the
// plan's release waits for those on the device). Nothing here waits on the host: a plan is made and
// released per engine step, and a host wait there would stall the queue of the step's layers.
#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/plan_streams.h"

namespace msa::cuda {

namespace {

cudaEvent_t new_event() {
  cudaEvent_t e = nullptr;
  MSA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

// The plan's release needs no stream handle but `home`'s: a run is marked by an event recorded
// after it, so a run stream may be destroyed before the plan.
class PlanStreams {
 public:
  PlanStreams(int device, cudaStream_t home) : device_(device), home_(home), upload_(new_event()) {
    uploaded(home);
  }

  PlanStreams(const PlanStreams&) = delete;
  PlanStreams& operator=(const PlanStreams&) = delete;

  // Runs from the plan's release: never throws. The plan's buffers are given back on `home_`
  // right after this (InferencePlan declares `streams` last), so `home_` first waits for the
  // latest uploads and every run not yet known to be done.
  ~PlanStreams() {
    const QuietDeviceGuard guard(device_);
    if (!guard.ok()) return;
    if (upload_stream_ != home_) cudaStreamWaitEvent(home_, upload_, 0);
    for (cudaEvent_t e : runs_) {
      cudaStreamWaitEvent(home_, e, 0);
      cudaEventDestroy(e);  // its resources go once it has completed
    }
    for (cudaEvent_t e : spare_) cudaEventDestroy(e);
    cudaEventDestroy(upload_);
    cudaGetLastError();
  }

  void uploaded(cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mutex_);
    MSA_CUDA_CHECK(cudaEventRecord(upload_, s));
    upload_stream_ = s;
  }

  // Before a run's launches on `s`: they wait for the latest uploads, on the device. Not under
  // capture: a captured wait on an event recorded outside the graph is an error (capture on the
  // plan's stream, or after a run on the capturing stream, InferencePlanOptions::stream).
  void before_run(cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (s == upload_stream_ || capturing(s)) return;
    MSA_CUDA_CHECK(cudaStreamWaitEvent(s, upload_, 0));
  }

  // After a run's launches on `s`: an event marks them for the release. Runs on `home_` are
  // ordered before the release anyway; captured runs execute when their graph is launched,
  // which the graph's owner orders.
  void after_run(cudaStream_t s) {
    if (s == home_ || capturing(s)) return;
    std::lock_guard<std::mutex> lock(mutex_);
    // Events of runs already done are reused: a decode plan runs every step for a long time.
    for (size_t i = runs_.size(); i-- > 0;)
      if (cudaEventQuery(runs_[i]) == cudaSuccess) {
        spare_.push_back(runs_[i]);
        runs_.erase(runs_.begin() + std::ptrdiff_t(i));
      }
    cudaGetLastError();  // cudaErrorNotReady from the queries above
    cudaEvent_t e = spare_.empty() ? new_event() : spare_.back();
    if (!spare_.empty()) spare_.pop_back();
    runs_.push_back(e);
    MSA_CUDA_CHECK(cudaEventRecord(e, s));
  }

 private:
  std::mutex mutex_;
  int device_;
  cudaStream_t home_;
  cudaEvent_t upload_;
  cudaStream_t upload_stream_ = nullptr;
  std::vector<cudaEvent_t> runs_;   // recorded after runs on streams other than home, maybe not done
  std::vector<cudaEvent_t> spare_;  // completed, for reuse
};

PlanStreams* of(const std::shared_ptr<void>& streams) { return static_cast<PlanStreams*>(streams.get()); }

}  // namespace

std::shared_ptr<void> plan_streams(int device, void* home) {
  DeviceGuard guard(device);
  return std::make_shared<PlanStreams>(device, static_cast<cudaStream_t>(home));
}

void plan_uploaded(const std::shared_ptr<void>& streams, void* stream) {
  if (streams) of(streams)->uploaded(static_cast<cudaStream_t>(stream));
}

PlanRun::PlanRun(const std::shared_ptr<void>& streams, void* stream)
    : streams_(streams.get()), stream_(stream) {
  if (streams_) static_cast<PlanStreams*>(streams_)->before_run(static_cast<cudaStream_t>(stream_));
}

PlanRun::~PlanRun() {
  if (!streams_) return;
  try {
    static_cast<PlanStreams*>(streams_)->after_run(static_cast<cudaStream_t>(stream_));
  } catch (const Error&) {
    // A destructor must not throw; a failing CUDA call here fails the next checked call too.
  }
}

}  // namespace msa::cuda
