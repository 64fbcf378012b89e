#pragma once
// What training a model takes in memory, counted from the config before anything is
// allocated: the daemon refuses a job that cannot fit at submit, with these numbers,
// instead of letting it die of bad_alloc (or the OOM killer) once it runs.
//
// The counts follow the CPU Model exactly: ParameterSet (values and gradients), AdamW
// (two moments), Model::plan() and the layers' and kernels' plan-time buffers. Sums
// saturate at UINT64_MAX, so an absurd config gives an absurd, never a wrapped, total.
#include <cstdint>
#include <string>

#include "runtime/config/model_config.h"

namespace megacpp {

struct TrainingShape {
  int64_t batch = 1;
  int64_t seqlen = 1;
  // OpenMP threads the run uses: attention keeps one score scratch per thread.
  int64_t threads = 1;
  ScanForm scan_form = ScanForm::kChunked;
  uint64_t element_bytes = sizeof(float);  // the model's scalar: float trains, double checks
};

struct MemoryEstimate {
  uint64_t parameter_count = 0;
  uint64_t parameters = 0;   // bytes of the weights
  uint64_t gradients = 0;    // bytes of their gradients
  uint64_t optimizer = 0;    // bytes of AdamW's exp_avg and exp_avg_sq
  uint64_t activations = 0;  // bytes Model::plan(batch, seqlen) allocates
  uint64_t workspace = 0;    // bytes the training loop adds: token windows, per-call scratch
  uint64_t datasets = 0;     // bytes of dataset indexes held in memory (set by the caller)

  uint64_t total() const;
  // "N bytes (parameters P, gradients G, AdamW moments M, activations A, workspace W,
  // dataset indexes D)", for messages.
  std::string describe() const;
};

// `config` must be valid (validate_model_config); batch, seqlen and threads below 1
// count as 1.
MemoryEstimate estimate_training_memory(const ModelConfig& config, const TrainingShape& shape);

// Only the parameters: their count for a valid config, saturating.
uint64_t count_parameters(const ModelConfig& config);

// The host's memory from /proc/meminfo (MemAvailable, MemTotal), or sysconf's available
// and physical pages where that file is missing. 0 where neither can be read.
struct HostMemory {
  uint64_t available = 0;
  uint64_t total = 0;
};
HostMemory read_host_memory();

}  // namespace megacpp
