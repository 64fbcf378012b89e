#pragma once
// Validation of submitted job specs, before anything is queued.
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megacpp/v1/jobs.pb.h"
#include "service/config/daemon_config.h"
#include "service/gates/gates.h"

namespace megacpp::daemon {

struct ValidatedJob {
  nlohmann::json train_job;  // the trainer's job file (runtime/trainer/trainer.h)
  gates::DeviceKind device_kind = gates::DeviceKind::kCpu;
  int device_count = 1;
  std::vector<gates::GateDecision> gate_decisions;  // one per registered gate
};

// The most restarts a spec may ask for: each restart reruns from the last checkpoint,
// and a job that failed this often will not succeed on the next try.
inline constexpr int kMaxRestarts = 100;

// The memory a job must fit in.
struct MemoryBudget {
  // Bytes a CPU job may use; 0: the host's MemAvailable when the spec is validated.
  uint64_t host_bytes = 0;
  // Bytes of one GPU (DeviceSlot::memory_bytes); 0: unknown, cuda jobs go unchecked. Checking
  // against it plans the CUDA model, which queries the device (CUB's sort sizes).
  uint64_t gpu_bytes = 0;
};

// Checks everything a spec can get wrong, in the order a user would fix it:
// sizes, model config, tensor-parallel geometry, resources, paths, gates.
// Throws Error(kInvalidArgument) naming the field and rule for a bad spec. A
// refused feature gate does NOT throw: the decisions are returned and the
// caller refuses the job (FAILED_PRECONDITION) after recording them. A job that would not
// fit `memory` is refused with the numbers: a cpu job by the CPU model's estimate
// (runtime/model/memory_estimate.h), a cuda job (CUDA builds) by the CUDA model's own plan for
// each rank (CudaModel::plan_memory, with the job's gates). The train job carries the daemon's
// min_free_bytes as its checkpoint floor.
ValidatedJob validate_job_spec(const megacpp::v1::JobSpec& spec, const DaemonConfig& config,
                               int cpu_slots, int gpus, const std::filesystem::path& checkpoint_dir,
                               const MemoryBudget& memory = {});

}  // namespace megacpp::daemon
