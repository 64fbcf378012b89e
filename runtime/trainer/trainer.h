#pragma once
// Training a model from a job description: data, schedule, checkpointing.
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/config/model_config.h"
#include "runtime/model/attention_engine.h"
#include "runtime/optimizer/adamw.h"
#include "runtime/trainer/observer.h"

namespace megacpp {

namespace cuda {
class GemmPlanCache;
}

// A training job, as a JSON file:
// {"model": {"preset": "tiny"} | {"config": {...}} | {"config_file": "path"},
//  "data": {"train": "PREFIX_train", "valid": "PREFIX_valid"},
//     or a Megatron blend: "train": [{"prefix": "A_train", "weight": 0.7}, {"prefix": ..., ...}]
//  "steps": 300, "batch": 8, "seqlen": 256, "grad_accum": 1,
//  "optimizer": {"lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2", "eps",
//                "grad_clip"},
//  "eval": {"interval": 50, "batches": 4},
//  "checkpoint": {"dir": "runs/x", "interval": 100, "keep_last": 3, "min_free_bytes": 0},
//  "init": {"checkpoint": "DIR"},
//  "seed": 1234, "max_seconds": 0, "scan": "chunked"|"recurrent", "threads": 0,
//  "log": "runs/x/steps.jsonl", "device": "cpu"|"cuda", "gpu": 0,
//  "device_count": 1, "tensor_parallel": 1, "gpus": [0, 1, ...],
//  "plan_cache": "DIR", "recompile_budget": 0, "recompute_in_proj": false,
//  "attention": "cudnn"|"megacpp", "deterministic": true}
// Where the steps run: the CPU runtime (float), or the CUDA backend (runtime/model/cuda_model.h,
// mixed precision) on GPU ordinal `gpu`; or, with device_count > 1 (cuda only), one process per
// GPU rank (world rank r on GPU gpus[r]), tensor_parallel ranks per model replica and
// device_count / tensor_parallel replicas (data parallel). `batch` is the global batch: each
// replica trains on its share of every batch, so the job computes what one GPU with the whole
// batch would.
//
// init.checkpoint starts the run from a model checkpoint's weights (config.json +
// model.safetensors, e.g. one converted from the official model by python/megacpp_checkpoint)
// instead of a random init: step 0, a fresh optimizer, the job's own schedule and data. The
// plan_cache keeps a cuda job's cuBLASLt algorithm choices across runs
// (kernels/cuda/gemm_plan_cache.h); empty: chosen afresh in every run. Plans built after the run's
// first step are counted against recompile_budget: one more than it allows stops the job with
// stop_reason "contract_violation" (its shapes are fixed, so a rebuild is a bug or a leak).
// recompute_in_proj (cuda): the Mamba-3 layers' in_proj outputs are recomputed in the backward
// rather than kept (runtime/model/cuda_model.h, CudaModelOptions; the feature gate of that name).
// attention (cuda): cuDNN's fused flash attention (the default) or megacpp's own kernels.
// deterministic (cuda): two runs give the same bits (the default); false lets cuDNN's attention
// backward sum in any order, faster and without its batch · heads · seqlen² workspace (the
// nondeterministic_attention feature gate). Their plans are kept in plan_cache as well.
//
// The checkpoint's config must equal the job's model ({"model": {"config_file": "DIR/config.json"}}
// takes it as is). A run that resumes from checkpoint.dir/latest ignores init: the resumed
// weights and optimizer are newer than the ones the run started from.
enum class TrainDevice { kCpu, kCuda };

// One dataset of a blend (runtime/data/blended_loader.h).
struct TrainBlendEntry {
  std::filesystem::path prefix;
  double weight = 1;  // positive, finite, relative to the others
};

struct TrainJob {
  ModelConfig model;
  std::string model_source;
  std::filesystem::path train_data;          // one dataset, or empty when train_blend is set
  std::vector<TrainBlendEntry> train_blend;  // several, drawn from in proportion to weight
  std::filesystem::path valid_data;          // empty: no validation
  int64_t steps = 0;
  int batch = 0;
  int seqlen = 0;
  int grad_accum = 1;
  OptimizerConfig optimizer;
  int eval_interval = 0;                 // 0: only at the end
  int eval_batches = 4;                  // 0: the whole validation set
  std::filesystem::path checkpoint_dir;  // empty: no checkpoints
  int checkpoint_interval = 0;           // 0: only at the end
  // Retention: the newest keep_last step checkpoints stay, with the run's final one and
  // the one `latest` names; older ones are deleted after each save. 0 keeps them all.
  int keep_last = 3;
  // A checkpoint that would leave less than this many bytes free on its file system
  // fails the run (naming the directory and the numbers) instead of filling the disk.
  uint64_t min_free_bytes = 0;
  // The model checkpoint the run starts from (init.checkpoint); empty: init_parameters(seed).
  std::filesystem::path init_checkpoint;
  uint64_t seed = 1234;
  double max_seconds = 0;  // stop (with a checkpoint) once exceeded; 0: no limit
  ScanForm scan_form = ScanForm::kChunked;
  int threads = 0;            // OpenMP threads; 0: the runtime's default
  std::filesystem::path log;  // JSON lines; empty: none
  TrainDevice device = TrainDevice::kCpu;
  int gpu = 0;  // the CUDA device ordinal a cuda job runs on
  int device_count = 1;
  int tensor_parallel = 1;
  std::vector<int> gpus;             // per world rank; empty: gpu, gpu + 1, ...
  std::filesystem::path plan_cache;  // cuda jobs' GEMM plan directory; empty: none
  int64_t recompile_budget = 0;      // plan builds allowed after the first step
  bool recompute_in_proj = false;    // cuda: less memory for one more GEMM per Mamba layer
  AttentionEngine attention = AttentionEngine::kCudnn;  // cuda (CudaModelOptions::attention)
  bool deterministic = true;  // cuda: false lets cuDNN's attention backward sum in any order
  int data_parallel() const { return device_count / tensor_parallel; }
  int gpu_of(int world_rank) const {
    return gpus.empty() ? gpu + world_rank : gpus[static_cast<size_t>(world_rank)];
  }
};

// The bounds of a job's numeric fields. Each is far beyond a sensible job and keeps the
// run finite and its sizes within what the runtime indexes: grad_accum = 2^31 - 1 would
// hold a device for ever on one step, threads = 100000 exhausts the process.
struct TrainJobLimits {
  static constexpr int64_t kMaxSteps = 1'000'000'000;
  static constexpr int kMaxBatch = 1 << 20;
  static constexpr int kMaxSeqlen = 1 << 24;
  static constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();  // batch·seqlen
  static constexpr int kMaxGradAccum = 1024;
  static constexpr int kMaxThreads = 1024;
  static constexpr int kMaxEvalBatches = 1 << 20;
  static constexpr int kMaxKeepLast = 1 << 20;
  static constexpr double kMaxSeconds = 1e9;
  static constexpr double kMaxLr = 10;
  static constexpr double kMaxWeightDecay = 100;
  static constexpr double kMaxGradClip = 1e9;
  static constexpr int kMaxGpu = 1023;
  static constexpr int kMaxDevices = 1024;
  static constexpr int kMaxBlendDatasets = 1024;
  static constexpr int64_t kMaxRecompileBudget = 1'000'000;
};

// Validates every field; errors name the field (e.g. "job.json: batch=0 must be positive").
TrainJob parse_train_job(const nlohmann::json& json, const std::string& source);
TrainJob load_train_job(const std::filesystem::path& path);

struct TrainOptions {
  bool resume = true;   // continue from checkpoint_dir/latest when present
  int64_t stop_at = 0;  // stop after this step (with a checkpoint), 0: run to the end
  const std::atomic<bool>* stop_requested = nullptr;  // checked between steps
  // This process's rank of a device_count > 1 job, and the file where rank 0 leaves the NCCL
  // unique id for the others (the launcher removes it before starting the ranks).
  int world_rank = 0;
  std::filesystem::path rendezvous = {};
  double rendezvous_timeout_seconds = 120;
  // Several GPUs: a collective whose stream reached it and that has waited this long for the
  // other ranks fails the job (runtime/parallel/collective_watchdog.h); 0 turns the watchdog off.
  // It must exceed the longest time one rank spends between collectives while the others wait
  // (rank 0 writing a checkpoint).
  double collective_timeout_seconds = 300;
  // Called with the reason when the collective watchdog fired and this rank's work was still
  // stuck 5 s later (blocked inside an NCCL call the abort cannot reach): it should end the
  // process. Unset: the rank stays stuck (the daemon's progress watchdog ends it).
  std::function<void(const std::string&)> on_stuck_rank = {};
  // A cuda job's plan cache owned by the caller (a test or benchmark that inspects it), used
  // instead of one opened from job.plan_cache; it must be the job's GPU's.
  cuda::GemmPlanCache* plan_cache = nullptr;
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
