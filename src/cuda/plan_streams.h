// A run of an inference plan on a stream (plan_streams.cpp): constructed before the run's
// launches (they wait for the plan's latest uploads on the device), destroyed after them (an
// event marks the run, so that the plan's release is ordered after it on the device).
#pragma once

#include <memory>

#include "backend.h"

namespace msa::cuda {

class PlanRun {
 public:
  PlanRun(const std::shared_ptr<void>& streams, void* stream);
  ~PlanRun();
  PlanRun(const PlanRun&) = delete;
  PlanRun& operator=(const PlanRun&) = delete;

 private:
  void* streams_;  // the plan's PlanStreams (the plan outlives the run)
  void* stream_;
};

}  // namespace msa::cuda
