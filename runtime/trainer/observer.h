#pragma once
// What the trainer reports while it runs. The receipt store implements this
// interface to persist step receipts; until then JsonLinesObserver writes them.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace megacpp {

struct StepRecord {
  int64_t step = 0;
  double loss = 0;       // mean training loss over the step's micro-batches
  double grad_norm = 0;  // global norm before clipping
  double lr = 0;
  int64_t tokens = 0;  // tokens processed by this step
  double step_ms = 0;
  double tokens_per_s = 0;
  double flops_per_s = 0;  // model FLOPs (Model::step_flops) per second
};

struct EvalRecord {
  int64_t step = 0;
  double loss = 0;  // mean validation loss
  int64_t tokens = 0;
};

struct RunSummary {
  int64_t first_step = 0;  // the first step this run executed (after a resume, > 1)
  int64_t last_step = 0;
  int64_t total_steps = 0;  // the job's planned steps
  int64_t tokens = 0;
  double wall_seconds = 0;
  double final_loss = 0;
  double final_val_loss = -1;  // -1 when no validation ran
  double median_step_ms = 0;
  double tokens_per_s = 0;  // median over the run's steps (its last 2^20 at most)
  double flops_per_step = 0;
  double flops_per_s = 0;  // at the median step time
  // "completed", "time_limit", "stop_at", "stopped", "contract_violation" (the run fails; the
  // rule it broke is in `error`)
  std::string stop_reason;
  std::string error;
  std::string device;  // "cpu", or "cuda:N" with the GPU's name
  // Device memory the model held after its first step (the planned arena, the ops' own
  // workspaces, library handles); 0 on the CPU.
  uint64_t device_bytes = 0;
  // From the start of train() to the end of the first step: loading, planning, first kernels.
  double seconds_to_first_step = 0;
  // A cuda run's GEMM plans: {path, hits, builds, stale, builds_after_first_step, budget}; null
  // on the CPU.
  nlohmann::json plan_cache;
};

// One kernel, or one op of several kernels, of a GPU step: what the device says about it
// (registers, shared memory, occupancy; 0 where the op is library code such as a cuBLASLt GEMM)
// and its device time per call over the profiled steps (samples 0: attributes only).
struct KernelRecord {
  std::string kernel;
  std::string device;
  nlohmann::json launch;  // what identifies the launch: grid, block, shapes, calls per step
  int registers = 0;
  int static_smem = 0;
  int dynamic_smem = 0;
  double occupancy = 0;
  double time_ms_min = 0;
  double time_ms_median = 0;
  double time_ms_max = 0;
  int samples = 0;
};

nlohmann::json to_json(const StepRecord& r);
nlohmann::json to_json(const KernelRecord& r);
nlohmann::json to_json(const EvalRecord& r);
nlohmann::json to_json(const RunSummary& r);

class TrainingObserver {
 public:
  virtual ~TrainingObserver() = default;
  virtual void on_start(const nlohmann::json& run_info) = 0;
  virtual void on_step(const StepRecord& record) = 0;
  virtual void on_eval(const EvalRecord& record) = 0;
  virtual void on_checkpoint(int64_t step, const std::filesystem::path& dir) = 0;
  virtual void on_finish(const RunSummary& summary) = 0;
  // Once per run on a GPU, after its profiled steps. Observers without a use for them ignore them.
  virtual void on_kernels(const std::vector<KernelRecord>& kernels) { (void)kernels; }
};

// One JSON object per line, {"type": "step"|"eval"|"checkpoint"|"start"|"summary", ...},
// appended to a file (flushed per line) and, optionally, a compact progress line on stderr.
class JsonLinesObserver final : public TrainingObserver {
 public:
  JsonLinesObserver(const std::filesystem::path& file, bool print_progress);
  ~JsonLinesObserver() override;
  void on_start(const nlohmann::json& run_info) override;
  void on_step(const StepRecord& record) override;
  void on_eval(const EvalRecord& record) override;
  void on_checkpoint(int64_t step, const std::filesystem::path& dir) override;
  void on_finish(const RunSummary& summary) override;
  void on_kernels(const std::vector<KernelRecord>& kernels) override;

 private:
  void write(const nlohmann::json& line);
  std::FILE* file_ = nullptr;
  bool print_progress_;
};

}  // namespace megacpp
