#pragma once
// A TrainingObserver that keeps everything a run reports, for tests that compare runs.
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "runtime/trainer/observer.h"

namespace megacpp::testing {

class RecordingObserver final : public TrainingObserver {
 public:
  void on_start(const nlohmann::json& info) override { start = info; }
  void on_step(const StepRecord& r) override { steps.push_back(r); }
  void on_eval(const EvalRecord& r) override { evals.push_back(r); }
  void on_checkpoint(int64_t, const std::filesystem::path&) override { ++checkpoints; }
  void on_finish(const RunSummary& s) override { summary = s; }
  void on_kernels(const std::vector<KernelRecord>& k) override {
    kernels.insert(kernels.end(), k.begin(), k.end());
  }
  nlohmann::json start;
  std::vector<KernelRecord> kernels;
  std::vector<StepRecord> steps;
  std::vector<EvalRecord> evals;
  int checkpoints = 0;
  RunSummary summary;
};

}  // namespace megacpp::testing
