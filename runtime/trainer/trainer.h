#pragma once
// Training a model from a job description: data, schedule, checkpointing.
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/layers/mamba3_mixer.h"
#include "runtime/model/config.h"
#include "runtime/trainer/observer.h"
#include "runtime/trainer/optimizer.h"

namespace megacpp {

// A training job, as a JSON file:
// {"model": {"preset": "tiny"} | {"config": {...}} | {"config_file": "path"},
//  "data": {"train": "PREFIX_train", "valid": "PREFIX_valid"},
//  "steps": 300, "batch": 8, "seqlen": 256, "grad_accum": 1,
//  "optimizer": {"lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2", "eps",
//                "grad_clip"},
//  "eval": {"interval": 50, "batches": 4},
//  "checkpoint": {"dir": "runs/x", "interval": 100},
//  "seed": 1234, "max_seconds": 0, "scan": "chunked"|"recurrent", "threads": 0,
//  "log": "runs/x/steps.jsonl"}
struct TrainJob {
  ModelConfig model;
  std::string model_source;
  std::filesystem::path train_data;
  std::filesystem::path valid_data;  // empty: no validation
  int64_t steps = 0;
  int batch = 0;
  int seqlen = 0;
  int grad_accum = 1;
  OptimizerConfig optimizer;
  int eval_interval = 0;  // 0: only at the end
  int eval_batches = 4;   // 0: the whole validation set
  std::filesystem::path checkpoint_dir;  // empty: no checkpoints
  int checkpoint_interval = 0;           // 0: only at the end
  uint64_t seed = 1234;
  double max_seconds = 0;  // stop (with a checkpoint) once exceeded; 0: no limit
  ScanForm scan_form = ScanForm::kChunked;
  int threads = 0;  // OpenMP threads; 0: the runtime's default
  std::filesystem::path log;  // JSON lines; empty: none
};

// Validates every field; errors name the field (e.g. "job.json: batch=0 must be positive").
TrainJob parse_train_job(const nlohmann::json& json, const std::string& source);
TrainJob load_train_job(const std::filesystem::path& path);

struct TrainOptions {
  bool resume = true;      // continue from checkpoint_dir/latest when present
  int64_t stop_at = 0;     // stop after this step (with a checkpoint), 0: run to the end
  const std::atomic<bool>* stop_requested = nullptr;  // checked between steps
};

// Runs the job; returns its summary (also passed to the observer).
RunSummary train(const TrainJob& job, TrainingObserver& observer, const TrainOptions& options = {});

// Mean loss of a model over evaluation windows of a dataset (all when max_windows = 0).
struct EvalResult {
  double loss = 0;
  int64_t windows = 0;
  int64_t tokens = 0;
};
EvalResult evaluate_checkpoint(const std::filesystem::path& checkpoint_dir,
                               const std::filesystem::path& data_prefix, int seqlen, int batch,
                               int64_t max_windows);

}  // namespace megacpp
