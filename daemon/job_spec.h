#pragma once
// Validation of submitted job specs, before anything is queued.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megacpp/v1/jobs.pb.h"
#include "runtime/daemon_config/daemon_config.h"
#include "runtime/gates/gates.h"

namespace megacpp::daemon {

struct ValidatedJob {
  nlohmann::json train_job;  // the trainer's job file (runtime/trainer/trainer.h)
  gates::DeviceKind device_kind = gates::DeviceKind::kCpu;
  int device_count = 1;
  std::vector<gates::GateDecision> gate_decisions;  // one per registered gate
};

// Checks everything a spec can get wrong, in the order a user would fix it:
// sizes, model config, tensor-parallel geometry, resources, paths, gates.
// Throws Error(kInvalidArgument) naming the field and rule for a bad spec. A
// refused feature gate does NOT throw: the decisions are returned and the
// caller refuses the job (FAILED_PRECONDITION) after recording them.
ValidatedJob validate_job_spec(const megacpp::v1::JobSpec& spec, const DaemonConfig& config,
                               int cpu_slots, int gpus, const std::filesystem::path& checkpoint_dir);

}  // namespace megacpp::daemon
