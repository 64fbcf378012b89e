#pragma once
// What the trainer reports while it runs. The receipt store implements this
// interface to persist step receipts; until then JsonLinesObserver writes them.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

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
  double flops_per_s = 0;   // at the median step time
  std::string stop_reason;  // "completed", "time_limit", "stop_at", "stopped"
};

nlohmann::json to_json(const StepRecord& r);
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

 private:
  void write(const nlohmann::json& line);
  std::FILE* file_ = nullptr;
  bool print_progress_;
};

}  // namespace megacpp
