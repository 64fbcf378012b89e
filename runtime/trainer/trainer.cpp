#include "runtime/trainer/trainer.h"

#include <omp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "base/error.h"
#include "base/plan_cache.h"
#include "base/version.h"
#include "kernels/cpu/grad_clip.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/data/blended_loader.h"
#include "runtime/data/dataset_tokenizer.h"
#include "runtime/data/sequence_loader.h"
#include "runtime/model/model.h"
#include "runtime/parallel/shard_plan.h"
#ifdef MEGACPP_HAVE_CUDA
#include <fmt/ranges.h>

#include <thread>

#include "base/atomic_file.h"
#include "kernels/cuda/device_query.h"
#include "kernels/cuda/gemm_plan_cache.h"
#include "runtime/model/cuda_model.h"
#include "runtime/parallel/cuda_communicator.h"
#endif

namespace megacpp {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

template <typename T>
T read_field(const json& object, const char* key, const std::string& where, T fallback,
             bool required = false) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) {
    if (required) fail(ErrorKind::kInvalidArgument, "{}: missing required field {}", where, key);
    return fallback;
  }
  try {
    return it->get<T>();
  } catch (const std::exception& e) {
    fail(ErrorKind::kInvalidArgument, "{}: field {} = {} has the wrong type: {}", where, key,
         it->dump(), e.what());
  }
}

// Integers are read at 64 bits and range-checked before anything narrows them, so
// 2^40 is refused as 2^40 rather than wrapping to 0 and passing or failing as 0.
// The message for a value below `min` keeps the rule's usual wording.
// `where` names the object ("job.json: eval"), `name` the field in value messages
// ("job.json: optimizer.warmup_steps").
int64_t read_integer(const json& object, const char* key, const std::string& where,
                     const std::string& name, int64_t fallback, int64_t min, int64_t max,
                     bool required = false) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) {
    if (required) fail(ErrorKind::kInvalidArgument, "{}: missing required field {}", where, key);
    return fallback;
  }
  if (!it->is_number_integer()) {
    fail(ErrorKind::kInvalidArgument, "{} = {} has the wrong type: expected an integer", name,
         it->dump());
  }
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(max)) {
    fail(ErrorKind::kInvalidArgument, "{}={} must be at most {}", name, it->get<uint64_t>(), max);
  }
  const int64_t value = it->get<int64_t>();
  if (value > max) fail(ErrorKind::kInvalidArgument, "{}={} must be at most {}", name, value, max);
  if (value < min) {
    if (min == 1) fail(ErrorKind::kInvalidArgument, "{}={} must be positive", name, value);
    if (min == 0) fail(ErrorKind::kInvalidArgument, "{}={} must be >= 0", name, value);
    fail(ErrorKind::kInvalidArgument, "{}={} must be at least {}", name, value, min);
  }
  return value;
}

// NaN and infinities are refused by name: a NaN passes every `x < bound` test, and
// written back to JSON it becomes null, which reads as "use the default".
double read_real(const json& object, const char* key, const std::string& name, double fallback) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_number()) {
    fail(ErrorKind::kInvalidArgument, "{} = {} has the wrong type: expected a number", name,
         it->dump());
  }
  const double value = it->get<double>();
  if (!std::isfinite(value)) {
    fail(ErrorKind::kInvalidArgument, "{}={} must be a finite number", name, value);
  }
  return value;
}

void refuse_unknown_keys(const json& object, std::initializer_list<const char*> known,
                         const std::string& where) {
  // Not a structured binding: clang before 16 cannot capture one in a lambda (the fuzz build).
  for (const auto& item : object.items()) {
    const std::string& key = item.key();
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return key == k; })) {
      fail(ErrorKind::kInvalidArgument, "{}: unknown field {}", where, key);
    }
  }
}

// [{"prefix": P, "weight": W}, ...]; `where` is "job.json: data.train".
std::vector<TrainBlendEntry> parse_blend(const json& list, const std::string& where) {
  if (list.empty()) {
    fail(ErrorKind::kInvalidArgument,
         "{}: a blend needs at least one {{\"prefix\": PREFIX, \"weight\": W}}", where);
  }
  if (list.size() > static_cast<size_t>(TrainJobLimits::kMaxBlendDatasets)) {
    fail(ErrorKind::kInvalidArgument, "{}: {} datasets, more than the {} a blend may have", where,
         list.size(), TrainJobLimits::kMaxBlendDatasets);
  }
  std::vector<TrainBlendEntry> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string entry = fmt::format("{}[{}]", where, i);
    if (!list[i].is_object()) {
      fail(ErrorKind::kInvalidArgument, "{} = {} must be {{\"prefix\": PREFIX, \"weight\": W}}",
           entry, list[i].dump());
    }
    refuse_unknown_keys(list[i], {"prefix", "weight"}, entry);
    TrainBlendEntry e;
    e.prefix = read_field<std::string>(list[i], "prefix", entry, "", true);
    if (e.prefix.empty()) fail(ErrorKind::kInvalidArgument, "{}.prefix must not be empty", entry);
    if (!list[i].contains("weight")) {
      fail(ErrorKind::kInvalidArgument, "{}: missing required field weight", entry);
    }
    e.weight = read_real(list[i], "weight", entry + ".weight", 0);
    if (!(e.weight > 0)) {
      fail(ErrorKind::kInvalidArgument, "{}.weight={} must be positive", entry, e.weight);
    }
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace

TrainJob parse_train_job(const json& j, const std::string& source) {
  if (!j.is_object()) fail(ErrorKind::kInvalidArgument, "{}: a job must be a JSON object", source);
  refuse_unknown_keys(j,
                      {"model",
                       "data",
                       "steps",
                       "tensor_parallel",
                       "seqlen",
                       "grad_accum",
                       "optimizer",
                       "eval",
                       "checkpoint",
                       "init",
                       "seed",
                       "max_seconds",
                       "scan",
                       "threads",
                       "log",
                       "device",
                       "gpu",
                       "device_count",
                       "recompile_budget",
                       "gpus",
                       "batch",
                       "plan_cache",
                       "recompute_in_proj",
                       "attention",
                       "deterministic"},
                      source);
  TrainJob job;
  if (!j.contains("model") || !j["model"].is_object()) {
    fail(ErrorKind::kInvalidArgument,
         "{}: missing field model: give {{\"preset\": NAME}}, {{\"config\": {{...}}}} or "
         "{{\"config_file\": PATH}}",
         source);
  }
  const json& m = j["model"];
  refuse_unknown_keys(m, {"preset", "config", "config_file"}, source + ": model");
  if (m.size() != 1) {
    fail(ErrorKind::kInvalidArgument,
         "{}: model must have exactly one of preset, config, config_file", source);
  }
  // preset and config_file are names: anything else is refused naming the field.
  const auto model_name = [&](const char* field) {
    if (!m[field].is_string()) {
      fail(ErrorKind::kInvalidArgument, "{}: model.{} = {} must be a string", source, field,
           m[field].dump());
    }
    return m[field].get<std::string>();
  };
  if (m.contains("preset")) {
    job.model_source = "preset " + model_name("preset");
    job.model = model_preset(model_name("preset"));
  } else if (m.contains("config")) {
    job.model_source = source + ": model.config";
    job.model = parse_model_config(m["config"], job.model_source);
  } else {
    job.model_source = model_name("config_file");
    job.model = load_model_config(job.model_source);
  }
  if (!j.contains("data") || !j["data"].is_object()) {
    fail(ErrorKind::kInvalidArgument,
         "{}: missing field data: {{\"train\": PREFIX, \"valid\": PREFIX}}", source);
  }
  refuse_unknown_keys(j["data"], {"train", "valid"}, source + ": data");
  if (const auto train = j["data"].find("train"); train != j["data"].end() && train->is_array()) {
    job.train_blend = parse_blend(*train, source + ": data.train");
  } else {
    job.train_data = read_field<std::string>(j["data"], "train", source + ": data", "", true);
  }
  job.valid_data = read_field<std::string>(j["data"], "valid", source + ": data", "");
  using L = TrainJobLimits;
  const auto top = [&](const char* key, int64_t fallback, int64_t min, int64_t max,
                       bool required = false) {
    return read_integer(j, key, source, fmt::format("{}: {}", source, key), fallback, min, max,
                        required);
  };
  job.steps = top("steps", 0, 1, L::kMaxSteps, true);
  job.batch = static_cast<int>(top("batch", 0, 1, L::kMaxBatch, true));
  job.seqlen = static_cast<int>(top("seqlen", 0, 2, L::kMaxSeqlen, true));
  job.grad_accum = static_cast<int>(top("grad_accum", 1, 1, L::kMaxGradAccum));
  // The kernels index a micro-batch's rows with int.
  if (int64_t{job.batch} * job.seqlen > L::kMaxRows) {
    fail(ErrorKind::kInvalidArgument,
         "{}: batch·seqlen = {}·{} = {} must be at most {} (rows of one micro-batch)", source,
         job.batch, job.seqlen, int64_t{job.batch} * job.seqlen, L::kMaxRows);
  }
  if (j.contains("optimizer")) {
    const json& o = j["optimizer"];
    const std::string where = source + ": optimizer";
    refuse_unknown_keys(
        o, {"lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2", "eps", "grad_clip"},
        where);
    const auto real = [&](const char* key, double fallback) {
      return read_real(o, key, fmt::format("{}.{}", where, key), fallback);
    };
    OptimizerConfig& c = job.optimizer;
    c.lr = real("lr", c.lr);
    c.min_lr = real("min_lr", c.lr / 10);
    c.warmup_steps = static_cast<int>(read_integer(o, "warmup_steps", where,
                                                   fmt::format("{}.warmup_steps", where),
                                                   c.warmup_steps, 0, L::kMaxSteps));
    c.weight_decay = real("weight_decay", c.weight_decay);
    c.beta1 = real("beta1", c.beta1);
    c.beta2 = real("beta2", c.beta2);
    c.eps = real("eps", c.eps);
    c.grad_clip = real("grad_clip", c.grad_clip);
    if (!(c.lr > 0 && c.lr <= L::kMaxLr)) {
      fail(ErrorKind::kInvalidArgument, "{}.lr={} must be positive and at most {}", where, c.lr,
           L::kMaxLr);
    }
    if (c.min_lr < 0 || c.min_lr > c.lr) {
      fail(ErrorKind::kInvalidArgument, "{}.min_lr={} must be in [0, lr={}]", where, c.min_lr,
           c.lr);
    }
    if (c.weight_decay < 0 || c.weight_decay > L::kMaxWeightDecay) {
      fail(ErrorKind::kInvalidArgument, "{}.weight_decay={} must be in [0, {}]", where,
           c.weight_decay, L::kMaxWeightDecay);
    }
    if (!(c.beta1 >= 0 && c.beta1 < 1) || !(c.beta2 >= 0 && c.beta2 < 1)) {
      fail(ErrorKind::kInvalidArgument, "{}.beta1={} and beta2={} must be in [0, 1)", where,
           c.beta1, c.beta2);
    }
    if (!(c.eps > 0 && c.eps <= 1)) {
      fail(ErrorKind::kInvalidArgument, "{}.eps={} must be in (0, 1]", where, c.eps);
    }
    if (c.grad_clip < 0 || c.grad_clip > L::kMaxGradClip) {
      fail(ErrorKind::kInvalidArgument, "{}.grad_clip={} must be in [0, {}] (0 disables it)", where,
           c.grad_clip, L::kMaxGradClip);
    }
  }
  if (j.contains("eval")) {
    const std::string where = source + ": eval";
    refuse_unknown_keys(j["eval"], {"interval", "batches"}, where);
    const auto field = [&](const char* key, int64_t fallback, int64_t max) {
      return static_cast<int>(
          read_integer(j["eval"], key, where, fmt::format("{}: {}", where, key), fallback, 0, max));
    };
    job.eval_interval = field("interval", 0, L::kMaxSteps);
    job.eval_batches = field("batches", job.eval_batches, L::kMaxEvalBatches);
  }
  if (j.contains("checkpoint")) {
    const std::string where = source + ": checkpoint";
    const json& c = j["checkpoint"];
    refuse_unknown_keys(c, {"dir", "interval", "keep_last", "min_free_bytes"}, where);
    const auto field = [&](const char* key, int64_t fallback, int64_t max) {
      return read_integer(c, key, where, fmt::format("{}: {}", where, key), fallback, 0, max);
    };
    job.checkpoint_dir = read_field<std::string>(c, "dir", where, "", true);
    job.checkpoint_interval = static_cast<int>(field("interval", 0, L::kMaxSteps));
    job.keep_last = static_cast<int>(field("keep_last", job.keep_last, L::kMaxKeepLast));
    job.min_free_bytes =
        static_cast<uint64_t>(field("min_free_bytes", 0, std::numeric_limits<int64_t>::max()));
  }
  if (j.contains("init")) {
    const std::string where = source + ": init";
    const json& init = j["init"];
    if (!init.is_object()) {
      fail(ErrorKind::kInvalidArgument, "{} = {} must be {{\"checkpoint\": DIR}}", where,
           init.dump());
    }
    refuse_unknown_keys(init, {"checkpoint"}, where);
    job.init_checkpoint = read_field<std::string>(init, "checkpoint", where, "", true);
    if (job.init_checkpoint.empty()) {
      fail(ErrorKind::kInvalidArgument, "{}.checkpoint must not be empty", where);
    }
  }
  {
    // Any 64-bit seed, but not a negative one: it would wrap to a different seed than the
    // one written.
    auto it = j.find("seed");
    if (it != j.end() && !it->is_null()) {
      if (!it->is_number_integer() || (!it->is_number_unsigned() && it->get<int64_t>() < 0)) {
        fail(ErrorKind::kInvalidArgument, "{}: seed={} must be an integer in [0, 2^64)", source,
             it->dump());
      }
      job.seed = it->get<uint64_t>();
    }
  }
  job.max_seconds = read_real(j, "max_seconds", fmt::format("{}: max_seconds", source), 0.0);
  if (job.max_seconds < 0 || job.max_seconds > L::kMaxSeconds) {
    fail(ErrorKind::kInvalidArgument, "{}: max_seconds={} must be in [0, {}] (0: no limit)", source,
         job.max_seconds, L::kMaxSeconds);
  }
  const std::string scan = read_field<std::string>(j, "scan", source, "chunked");
  if (scan == "chunked") {
    job.scan_form = ScanForm::kChunked;
  } else if (scan == "recurrent") {
    job.scan_form = ScanForm::kRecurrent;
  } else {
    fail(ErrorKind::kInvalidArgument, "{}: scan=\"{}\" must be \"chunked\" or \"recurrent\"",
         source, scan);
  }
  job.threads = static_cast<int>(top("threads", 0, 0, L::kMaxThreads));
  job.log = read_field<std::string>(j, "log", source, "");
  const std::string device = read_field<std::string>(j, "device", source, "cpu");
  if (device == "cpu") {
    job.device = TrainDevice::kCpu;
  } else if (device == "cuda") {
    job.device = TrainDevice::kCuda;
  } else {
    fail(ErrorKind::kInvalidArgument, "{}: device=\"{}\" must be \"cpu\" or \"cuda\"", source,
         device);
  }
  job.gpu = static_cast<int>(top("gpu", 0, 0, L::kMaxGpu));
  job.plan_cache = read_field<std::string>(j, "plan_cache", source, "");
  job.recompile_budget = top("recompile_budget", 0, 0, L::kMaxRecompileBudget);
  job.recompute_in_proj = read_field<bool>(j, "recompute_in_proj", source, false);
  if (job.recompute_in_proj && job.device != TrainDevice::kCuda) {
    fail(ErrorKind::kInvalidArgument,
         "{}: recompute_in_proj=true needs device=\"cuda\" (the CPU runtime keeps every "
         "activation)",
         source);
  }
  if (j.contains("attention")) {
    job.attention = parse_attention_engine(read_field<std::string>(j, "attention", source, ""),
                                           source + ": attention");
  }
  job.deterministic = read_field<bool>(j, "deterministic", source, true);
  if (job.device != TrainDevice::kCuda && (j.contains("attention") || !job.deterministic)) {
    fail(ErrorKind::kInvalidArgument,
         "{}: {} needs device=\"cuda\" (the CPU runtime has one attention, and is "
         "deterministic)",
         source, j.contains("attention") ? "attention" : "deterministic=false");
  }
  if (job.attention == AttentionEngine::kMegacpp && !job.deterministic) {
    fail(ErrorKind::kInvalidArgument,
         "{}: deterministic=false with attention=\"megacpp\" changes nothing (our own kernels "
         "are deterministic); drop it or use attention=\"cudnn\"",
         source);
  }
  job.device_count = static_cast<int>(top("device_count", 1, 1, L::kMaxDevices));
  job.tensor_parallel = static_cast<int>(top("tensor_parallel", 1, 1, L::kMaxDevices));
  if (j.contains("gpus")) {
    const json& g = j["gpus"];
    if (!g.is_array() || static_cast<int>(g.size()) != job.device_count) {
      fail(ErrorKind::kInvalidArgument,
           "{}: gpus must be an array of device_count={} CUDA device ordinals", source,
           job.device_count);
    }
    for (size_t i = 0; i < g.size(); ++i) {
      if (!g[i].is_number_integer() || g[i].get<int64_t>() < 0 ||
          g[i].get<int64_t>() > L::kMaxGpu) {
        fail(ErrorKind::kInvalidArgument, "{}: gpus[{}]={} must be an integer in [0, {}]", source,
             i, g[i].dump(), L::kMaxGpu);
      }
      job.gpus.push_back(g[i].get<int>());
    }
  }
  if (job.device_count > 1 || job.tensor_parallel > 1) {
    if (job.device != TrainDevice::kCuda) {
      fail(ErrorKind::kInvalidArgument,
           "{}: device_count={}, tensor_parallel={}: several devices need device=\"cuda\" (the "
           "CPU runtime trains on one process)",
           source, job.device_count, job.tensor_parallel);
    }
    parallel::check_tensor_parallel(job.model,
                                    {job.tensor_parallel, job.device_count});  // names the rule
    if (job.batch % job.data_parallel() != 0) {
      fail(ErrorKind::kInvalidArgument,
           "{}: batch={} must be a multiple of the data-parallel degree device_count / "
           "tensor_parallel = {}: every replica takes an equal share of each batch",
           source, job.batch, job.data_parallel());
    }
    try {
      // Names the rule where sequence parallelism would leave the last TP rank no rows.
      parallel::sequence_split(static_cast<int64_t>(job.batch / job.data_parallel()) * job.seqlen,
                               job.tensor_parallel, job.tensor_parallel - 1);
    } catch (const Error& e) {
      fail(ErrorKind::kInvalidArgument,
           "{}: batch={} over data_parallel={} replicas at seqlen={} makes each replica's "
           "micro-batch {} rows: {} (batch, seqlen, device_count and tensor_parallel set them)",
           source, job.batch, job.data_parallel(), job.seqlen,
           static_cast<int64_t>(job.batch / job.data_parallel()) * job.seqlen, e.what());
    }
  }
  return job;
}

TrainJob load_train_job(const fs::path& path) {
  return parse_train_job(load_json_file(path), path.string());
}

namespace {

using Clock = std::chrono::steady_clock;

// What runs a job's steps: the host model and optimizer (on the CPU), or their device mirror. The
// host model and optimizer stay the checkpoint's source of truth: sync_host() brings them up to
// date before a checkpoint is written.
class StepBackend {
 public:
  virtual ~StepBackend() = default;
  virtual void zero_grad() = 0;
  // last_micro_batch: the step's last call before update() (data parallel: its backward averages
  // the gradients over the replicas as it goes).
  virtual double forward_backward(const int32_t* tokens, double grad_scale,
                                  bool last_micro_batch) = 0;
  virtual double forward(const int32_t* tokens) = 0;
  // Global gradient norm (before clipping), clipping and one AdamW update.
  virtual double update(double lr) = 0;
  virtual void sync_host() = 0;
  virtual std::string device() const = 0;
  virtual uint64_t device_bytes() const = 0;
  // Kernel receipts: the steps between set_profiling(true) and (false) are timed per op; the
  // CPU backend has none.
  virtual void set_profiling(bool on) { (void)on; }
  virtual std::vector<KernelRecord> kernel_records() const { return {}; }
  // Several ranks: the sum of `value` over all of them, for decisions they must take alike.
  virtual int64_t sum_over_ranks(int64_t value) { return value; }
  // Whether this rank writes the job's files (checkpoints): world rank 0 alone.
  virtual bool writes_files() const { return true; }
  // The GEMM plan lookups so far and the file they are kept in (cuda); none on the CPU.
  virtual std::optional<PlanLedger> plan_ledger() const { return std::nullopt; }
  virtual std::string plan_cache_file() const { return {}; }
  // What was wrong with the plan cache when it was read or written: the receipt of why a run
  // built plans a warm cache should have held.
  virtual std::vector<std::string> plan_cache_problems() const { return {}; }
};

class CpuBackend final : public StepBackend {
 public:
  // optimizer may be null for a backend that only evaluates.
  CpuBackend(Model<float>& model, AdamW<float>* optimizer, double grad_clip)
      : model_(model), optimizer_(optimizer), grad_clip_(grad_clip) {}
  void zero_grad() override { model_.parameters().zero_grad(); }
  double forward_backward(const int32_t* tokens, double grad_scale, bool) override {
    return model_.forward_backward(tokens, grad_scale);
  }
  double forward(const int32_t* tokens) override { return model_.forward(tokens); }
  double update(double lr) override {
    auto& params = model_.parameters();
    const cpu::GradBuffer<float> all{params.grads().data(), params.total()};
    const double norm = cpu::clip_grad_norm<float>(std::span(&all, 1), grad_clip_);
    if (optimizer_ == nullptr)
      fail(ErrorKind::kInternal, "CpuBackend::update without an optimizer");
    optimizer_->step(lr);
    return norm;
  }
  void sync_host() override {}
  std::string device() const override { return "cpu"; }
  uint64_t device_bytes() const override { return 0; }

 private:
  Model<float>& model_;
  AdamW<float>* optimizer_;
  double grad_clip_;
};

#ifdef MEGACPP_HAVE_CUDA
// The NCCL unique id of a several-GPU job: rank 0 makes it and leaves it in the rendezvous file;
// the other ranks wait for the file.
std::string rendezvous(const TrainOptions& options, int world) {
  if (options.rendezvous.empty()) {
    fail(ErrorKind::kInvalidArgument,
         "device_count={}: each rank needs the rendezvous file where rank 0 leaves the NCCL id "
         "(megacpp-executor --rendezvous)",
         world);
  }
  if (options.world_rank == 0) {
    const std::string id = parallel::CudaCommunicator::new_unique_id();
    write_file_atomically(options.rendezvous, id);
    return id;
  }
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(options.rendezvous_timeout_seconds));
  while (!fs::exists(options.rendezvous)) {
    if (Clock::now() >= deadline) {
      fail(ErrorKind::kFailedPrecondition,
           "rank {} of {}: rank 0 left no NCCL id in {} within {} s (did rank 0 start?)",
           options.world_rank, world, options.rendezvous.string(),
           options.rendezvous_timeout_seconds);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return read_file(options.rendezvous);  // written atomically: whole or absent
}

class CudaBackend final : public StepBackend {
 public:
  CudaBackend(Model<float>& host, AdamW<float>& optimizer, const TrainJob& job,
              const TrainOptions& options)
      : host_(host), optimizer_(optimizer), seqlen_(job.seqlen) {
    const int world = job.device_count, rank = options.world_rank;
    if (rank < 0 || rank >= world) {
      fail(ErrorKind::kInvalidArgument, "world rank {} outside [0, device_count={})", rank, world);
    }
    const int gpu = job.gpu_of(rank);
    const cuda::RuntimeInfo info = cuda::query_devices();
    if (gpu >= static_cast<int>(info.devices.size())) {
      fail(ErrorKind::kFailedPrecondition,
           "gpu={}: this machine has {} CUDA device(s) visible to the job{}{}", gpu,
           info.devices.size(), info.error.empty() ? "" : ": ", info.error);
    }
    device_ = fmt::format("cuda:{} ({})", gpu, info.devices[static_cast<size_t>(gpu)].name);
    CudaModelParallel par;
    if (world > 1) {
      device_ += fmt::format(" rank {}/{}", rank, world);
      const int tp = job.tensor_parallel, dp = job.data_parallel();
      world_ = std::make_unique<parallel::CudaCommunicator>(rendezvous(options, world), world, rank,
                                                            gpu);
      // Collective over the world: every rank splits the same groups in the same order.
      if (tp > 1) {
        tensor_group_ =
            world_->split(rank / tp, rank % tp, {.min_ctas = parallel::kTensorParallelMinCtas});
      }
      if (dp > 1) data_group_ = world_->split(rank % tp, rank / tp);
      world_->set_name(fmt::format("world group (world ranks 0-{})", world - 1));
      if (tensor_group_) {
        const int first = rank / tp * tp;
        tensor_group_->set_name(
            fmt::format("tensor-parallel group (world ranks {}-{})", first, first + tp - 1));
      }
      if (data_group_) {
        std::vector<int> members;
        for (int r = rank % tp; r < world; r += tp) members.push_back(r);
        data_group_->set_name(
            fmt::format("data-parallel group (world ranks {})", fmt::join(members, ", ")));
      }
      if (options.collective_timeout_seconds > 0) {
        std::vector<parallel::WatchedGroup*> watched;
        for (parallel::CudaCommunicator* g :
             {world_.get(), tensor_group_.get(), data_group_.get()}) {
          if (g == nullptr) continue;
          g->track_collectives();
          watched.push_back(g);
        }
        watchdog_ = std::make_unique<parallel::CollectiveWatchdog>(
            options.collective_timeout_seconds, watched);
        if (options.on_stuck_rank) {
          constexpr double kStuckGraceSeconds = 5;
          watchdog_->set_last_resort(options.on_stuck_rank, kStuckGraceSeconds);
        }
        watchdog_->start();
      }
      par = {tp, dp, rank % tp, tensor_group_.get(), data_group_.get()};
      rows_ = job.batch / dp;
      first_row_ = (rank / tp) * rows_;
    } else {
      rows_ = job.batch;
    }
    writes_files_ = rank == 0;
    if (options.plan_cache != nullptr) {
      plans_ = options.plan_cache;
      if (plans_->device() != gpu) {
        fail(ErrorKind::kInvalidArgument,
             "the plan cache passed to train() is GPU {}'s (scope {}), the job runs on gpu={}",
             plans_->device(), plans_->scope(), gpu);
      }
    } else {
      // Without a directory the cache lives in memory: the ledger still counts every build.
      own_plans_ = std::make_unique<cuda::GemmPlanCache>(job.plan_cache, gpu);
      plans_ = own_plans_.get();
    }
    plan_cache_problems_ = plans_->problems();
    for (const std::string& problem : plan_cache_problems_) {
      spdlog::warn("plan cache: {} (the plans are rebuilt)", problem);
    }
    model_ =
        std::make_unique<CudaModel>(host, rows_, job.seqlen, job.optimizer, gpu, par, plans_,
                                    CudaModelOptions{.recompute_in_proj = job.recompute_in_proj,
                                                     .attention = job.attention,
                                                     .deterministic = job.deterministic});
    try {
      // Now, not at the end: a job that fails later still leaves its plans for the next one.
      plans_->flush();
    } catch (const Error& e) {
      // The job trains on (its plans are built); the run summary says why none were kept.
      plan_cache_problems_.push_back(fmt::format("not written: {}", e.what()));
      spdlog::warn("plan cache not written (the next run builds its plans again): {}", e.what());
    }
    model_->upload(host.parameters(), &optimizer);
  }
  void zero_grad() override { model_->zero_grad(); }
  // Every rank is handed the whole batch; its replica trains on its own rows of it.
  double forward_backward(const int32_t* tokens, double grad_scale,
                          bool last_micro_batch) override {
    const double loss = model_->forward_backward(own_rows(tokens), grad_scale, last_micro_batch);
    throw_if_watchdog_fired();
    return loss;
  }
  double forward(const int32_t* tokens) override {
    const double loss = model_->forward(own_rows(tokens));
    throw_if_watchdog_fired();
    return loss;
  }
  int64_t sum_over_ranks(int64_t value) override {
    return world_ ? world_->sum_over_ranks(value) : value;
  }
  bool writes_files() const override { return writes_files_; }
  std::optional<PlanLedger> plan_ledger() const override { return plans_->ledger(); }
  std::vector<std::string> plan_cache_problems() const override { return plan_cache_problems_; }
  std::string plan_cache_file() const override { return plans_->file().string(); }
  double update(double lr) override {
    const double norm = model_->optimizer_step(lr);
    throw_if_watchdog_fired();
    return norm;
  }
  void sync_host() override {
    model_->download(host_.parameters(), &optimizer_);
    throw_if_watchdog_fired();  // before a checkpoint is written from what came down
  }
  std::string device() const override { return device_; }
  uint64_t device_bytes() const override { return model_->device_bytes_in_use(); }
  void set_profiling(bool on) override { model_->set_profiling(on); }
  std::vector<KernelRecord> kernel_records() const override {
    std::vector<KernelRecord> out;
    // The ops of the step, timed on the stream between their neighbours (each one kernel or a few:
    // library GEMMs have no attributes of ours).
    for (const OpTime& t : model_->op_times()) {
      KernelRecord r;
      r.kernel = t.op;
      r.device = device_;
      r.launch = {{"kind", "op"}, {"calls", t.calls}};
      r.time_ms_min = t.min_ms;
      r.time_ms_median = t.median_ms;
      r.time_ms_max = t.max_ms;
      r.samples = static_cast<int>(t.calls);
      out.push_back(std::move(r));
    }
    // cuDNN's attention engines: chosen by its heuristic (or loaded from the plan cache).
    if (const std::string plans = model_->attention_plans(); !plans.empty()) {
      KernelRecord r;
      r.kernel = "cuDNN fused attention";
      r.device = device_;
      r.launch = {{"kind", "cudnn_plans"}, {"op", "attention core"}, {"plans", plans}};
      out.push_back(std::move(r));
    }
    // The scan's own kernels: what the runtime says about each at this shape.
    for (const cuda::KernelAttributes& k : model_->scan_kernel_attributes()) {
      KernelRecord r;
      r.kernel = k.name;
      r.device = device_;
      r.launch = {{"kind", "kernel"},
                  {"op", "mamba scan"},
                  {"chunk", k.chunk},
                  {"grid_blocks", k.grid_blocks},
                  {"block_threads", k.block_threads},
                  {"blocks_per_sm", k.blocks_per_sm},
                  {"local_bytes_per_thread", k.local_bytes_per_thread}};
      r.registers = k.registers_per_thread;
      r.static_smem = static_cast<int>(k.static_shared_bytes);
      r.dynamic_smem = static_cast<int>(k.dynamic_shared_bytes);
      r.occupancy = k.occupancy;
      out.push_back(std::move(r));
    }
    return out;
  }

 private:
  // A collective the watchdog aborted returns with garbage: nothing computed since may count.
  // (The step's calls and sync_host check; the vote and zero_grad fail by themselves, their
  // communicator refusing every call once an abort was asked for.)
  void throw_if_watchdog_fired() const {
    if (!watchdog_) return;
    if (const std::string why = watchdog_->reason(); !why.empty()) {
      fail(ErrorKind::kFailedPrecondition, "{}", why);
    }
  }
  const int32_t* own_rows(const int32_t* tokens) const {
    return tokens + static_cast<size_t>(first_row_) * (seqlen_ + 1);
  }
  Model<float>& host_;
  AdamW<float>& optimizer_;
  int seqlen_ = 0;
  int rows_ = 0;
  int first_row_ = 0;
  bool writes_files_ = true;
  std::string device_;
  // Declared before the model, which uses them: destroyed after it.
  std::unique_ptr<parallel::CudaCommunicator> world_, tensor_group_, data_group_;
  // Watches the communicators above: destroyed (its thread joined) before them.
  std::unique_ptr<parallel::CollectiveWatchdog> watchdog_;
  std::unique_ptr<cuda::GemmPlanCache> own_plans_;
  cuda::GemmPlanCache* plans_ = nullptr;
  std::vector<std::string> plan_cache_problems_;
  std::unique_ptr<CudaModel> model_;
};
#endif

std::unique_ptr<StepBackend> make_backend(const TrainJob& job, Model<float>& model,
                                          AdamW<float>& optimizer, const TrainOptions& options) {
  if (job.device == TrainDevice::kCpu) {
    model.plan(job.batch, job.seqlen);
    return std::make_unique<CpuBackend>(model, &optimizer, job.optimizer.grad_clip);
  }
#ifdef MEGACPP_HAVE_CUDA
  return std::make_unique<CudaBackend>(model, optimizer, job, options);
#else
  (void)options;
  fail(ErrorKind::kFailedPrecondition,
       "device=cuda: this build of megacpp has no CUDA backend (built without the CUDA toolkit)");
#endif
}

// Why the job broke its recompile budget (empty while it holds): plan builds after the run's
// first step, beyond job.recompile_budget.
std::string recompile_violation(const StepBackend& backend, const TrainJob& job,
                                uint64_t builds_at_first_step, int64_t first_step) {
  const auto ledger = backend.plan_ledger();
  if (!ledger) return {};
  const uint64_t after = ledger->builds - builds_at_first_step;
  if (after <= static_cast<uint64_t>(job.recompile_budget)) return {};
  return fmt::format(
      "contract violation: {} GEMM plan(s) built after step {}, over recompile_budget={} (the "
      "job's shapes are fixed, so its plans are all made before the first step ends); the last: "
      "{}",
      after, first_step, job.recompile_budget, ledger->last_build);
}

// An evaluation takes whole batches of windows: a set with fewer than one batch cannot be
// evaluated. Checked when a run starts too, so that such a validation set fails the job before
// it trains, not at an evaluation (the run's last one comes before its final checkpoint).
// `field`: the job field that names the set, for the message ("" where none does).
int64_t require_eval_batch(const data::IndexedDataset& dataset, int seqlen, int batch,
                           std::string_view field) {
  const int64_t available = data::num_eval_windows(dataset, seqlen);
  if (available < batch) {
    fail(ErrorKind::kInvalidArgument,
         "{}{}{}: {} evaluation windows of {} tokens, fewer than one batch of {}: an evaluation "
         "needs at least batch × (seqlen + 1) tokens",
         field, field.empty() ? "" : " ", dataset.index_path().string(), available, seqlen + 1,
         batch);
  }
  return available;
}

double mean_eval_loss(StepBackend& model, const data::IndexedDataset& dataset, int seqlen,
                      int batch, int64_t max_windows, int64_t* windows_used) {
  const int64_t available = require_eval_batch(dataset, seqlen, batch, "");
  const int64_t windows = max_windows > 0 ? std::min(max_windows, available) : available;
  std::vector<int32_t> tokens(static_cast<size_t>(batch) * (seqlen + 1));
  double total = 0;
  int64_t counted = 0;
  // Whole batches only: the model is planned for `batch` rows.
  for (int64_t first = 0; first + batch <= windows; first += batch) {
    for (int b = 0; b < batch; ++b) {
      data::eval_window(dataset, first + b, seqlen,
                        tokens.data() + static_cast<size_t>(b) * (seqlen + 1));
    }
    total += model.forward(tokens.data()) * batch;
    counted += batch;
  }
  if (counted == 0) {
    fail(ErrorKind::kInvalidArgument,
         "{}: {} evaluation windows asked for, fewer than one batch of {}",
         dataset.index_path().string(), windows, batch);
  }
  *windows_used = counted;
  return total / static_cast<double>(counted);
}

// A single dataset's checkpoints keep the one stream position they always had; a blend's hold
// each dataset's cursor, with its prefix and weight for whoever reads them.
const char* data_state_key(const TrainJob& job) {
  return job.train_blend.empty() ? "data_position" : "data_blend";
}

json data_cursors(const TrainJob& job, const data::BlendedLoader& loader) {
  const auto cursors = loader.cursors();
  if (job.train_blend.empty()) return cursors.front().position;
  json out = json::array();
  for (size_t i = 0; i < cursors.size(); ++i) {
    out.push_back({{"prefix", job.train_blend[i].prefix.string()},
                   {"weight", job.train_blend[i].weight},
                   {"position", cursors[i].position},
                   {"windows", cursors[i].windows}});
  }
  return out;
}

// A field of the checkpoint's trainer_state.json, of type T: a missing or mistyped one is
// corrupt data naming the file and the field, not a JSON library's message.
template <class T>
T state_field(const json& object, const char* name, const fs::path& checkpoint,
              const std::string& where = "") {
  const fs::path file = checkpoint / "trainer_state.json";
  if (!object.is_object() || !object.contains(name)) {
    fail(ErrorKind::kCorruptData, "{}: no field {}{}", file.string(), where, name);
  }
  const json& value = object.at(name);
  // get<uint64_t>() would wrap a negative integer rather than refuse it.
  bool typed = value.is_string();
  const char* wanted = "string";
  if constexpr (std::is_floating_point_v<T>) {
    typed = value.is_number();
    wanted = "number";
  } else if constexpr (std::is_unsigned_v<T>) {
    typed = value.is_number_unsigned() &&
            value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    wanted = "non-negative integer";
  }
  if (!typed) {
    fail(ErrorKind::kCorruptData, "{}: field {}{} is {}, not a {}", file.string(), where, name,
         value.dump(), wanted);
  }
  return value.get<T>();
}

void restore_data_cursors(const json& state, const TrainJob& job, const fs::path& checkpoint,
                          data::BlendedLoader& loader) {
  const char* key = data_state_key(job);
  if (!state.contains(key)) {
    fail(ErrorKind::kFailedPrecondition,
         "{}: the checkpoint was written by a job {} a data blend, this one {}: refusing to resume",
         checkpoint.string(), job.train_blend.empty() ? "with" : "without",
         job.train_blend.empty() ? "has none" : "has one");
  }
  if (job.train_blend.empty()) {
    const std::vector<data::BlendedLoader::Cursor> one = {
        {state_field<uint64_t>(state, key, checkpoint), 0}};
    loader.restore(one);
    return;
  }
  const json& saved = state.at(key);
  if (!saved.is_array() || saved.size() != job.train_blend.size()) {
    fail(ErrorKind::kFailedPrecondition,
         "{}: the checkpoint's data blend has {} datasets, the job's data.train {}: refusing to "
         "resume",
         checkpoint.string(), saved.is_array() ? saved.size() : 0, job.train_blend.size());
  }
  std::vector<data::BlendedLoader::Cursor> cursors;
  for (size_t i = 0; i < saved.size(); ++i) {
    const json& c = saved[i];
    const std::string where = fmt::format("{}[{}].", key, i);
    // A cursor is a place in the dataset it was taken on: one restored onto another (the blend
    // reordered, a prefix or weight changed) would skip and repeat data without a word.
    const auto prefix = state_field<std::string>(c, "prefix", checkpoint, where);
    const auto weight = state_field<double>(c, "weight", checkpoint, where);
    const TrainBlendEntry& entry = job.train_blend[i];
    if (prefix != entry.prefix.string() || weight != entry.weight) {
      fail(ErrorKind::kFailedPrecondition,
           "{}: the checkpoint's data blend dataset {} is {} (weight {}), the job's "
           "data.train[{}] is {} (weight {}): refusing to resume (each cursor belongs to the "
           "dataset it was taken on)",
           checkpoint.string(), i, prefix, weight, i, entry.prefix.string(), entry.weight);
    }
    cursors.push_back({state_field<uint64_t>(c, "position", checkpoint, where),
                       state_field<uint64_t>(c, "windows", checkpoint, where)});
  }
  loader.restore(cursors);
}

// The weights of init.checkpoint, its config checked against the job's model first: one of
// another shape would otherwise fail tensor by tensor, and one that differs only in a setting
// without weights of its own (rope_fraction) would load and compute another model.
void load_init_weights(const TrainJob& job, Model<float>& model) {
  const fs::path& dir = job.init_checkpoint;
  std::error_code ec;
  for (const char* file : {"config.json", "model.safetensors"}) {
    if (!fs::is_regular_file(dir / file, ec)) {
      fail(ErrorKind::kNotFound,
           "init.checkpoint={}: no {} there: a model checkpoint directory holds config.json and "
           "model.safetensors",
           dir.string(), file);
    }
  }
  ModelConfig saved;
  try {
    saved = load_checkpoint_config(dir);
  } catch (const Error& e) {
    fail(e.kind(), "init.checkpoint={}: {}", dir.string(), e.what());
  }
  if (model_config_to_json(saved) != model_config_to_json(job.model)) {
    fail(ErrorKind::kFailedPrecondition,
         "init.checkpoint={}: the checkpoint's model config {} differs from the job's ({}) {}; "
         "{{\"model\": {{\"config_file\": \"{}\"}}}} takes the checkpoint's",
         dir.string(), model_config_to_json(saved).dump(), job.model_source,
         model_config_to_json(job.model).dump(), (dir / "config.json").string());
  }
  try {
    load_model_weights(dir, model);
  } catch (const Error& e) {
    fail(e.kind(), "init.checkpoint={}: {}", dir.string(), e.what());
  }
  spdlog::info("initialized from {} (step 0, fresh optimizer)", dir.string());
}

}  // namespace

RunSummary train(const TrainJob& job, TrainingObserver& observer, const TrainOptions& options) {
  const auto train_start = Clock::now();
  if (job.threads > 0) omp_set_num_threads(job.threads);
  // A single dataset is the blend of one: the same windows as before blends existed.
  std::vector<data::NamedDataset> named;
  std::vector<data::BlendComponent> components;
  if (job.train_blend.empty()) {
    named.push_back({"data.train", job.train_data});
    components.push_back({std::make_shared<const data::IndexedDataset>(job.train_data), 1.0});
  }
  for (size_t i = 0; i < job.train_blend.size(); ++i) {
    const TrainBlendEntry& e = job.train_blend[i];
    named.push_back({fmt::format("data.train[{}].prefix", i), e.prefix});
    components.push_back({std::make_shared<const data::IndexedDataset>(e.prefix), e.weight});
  }
  std::shared_ptr<const data::IndexedDataset> valid_set;
  if (!job.valid_data.empty()) {
    named.push_back({"data.valid", job.valid_data});
    valid_set = std::make_shared<const data::IndexedDataset>(job.valid_data);
    require_eval_batch(*valid_set, job.seqlen, job.batch, "data.valid");
  }
  data::check_dataset_tokenizers(named, job.model.vocab_size, job.model_source);
  data::BlendedLoader loader(std::move(components), job.seqlen);

  Model<float> model(job.model, ModelOptions{job.scan_form});
  AdamW<float> optimizer(model.parameters(), job.optimizer);
  int64_t step = 0;
  if (options.resume && !job.checkpoint_dir.empty()) {
    if (auto dir = latest_checkpoint(job.checkpoint_dir)) {
      const ModelConfig saved = load_checkpoint_config(*dir);
      if (model_config_to_json(saved) != model_config_to_json(job.model)) {
        fail(ErrorKind::kFailedPrecondition,
             "{}: the checkpoint's model config differs from the job's ({}): refusing to resume",
             dir->string(), job.model_source);
      }
      load_model_weights(*dir, model);
      load_optimizer_state(*dir / "optimizer.safetensors", model.parameters(), optimizer);
      const json state = load_json_file(*dir / "trainer_state.json");
      step = static_cast<int64_t>(state_field<uint64_t>(state, "step", *dir));
      restore_data_cursors(state, job, *dir, loader);
      spdlog::info("resumed from {} at step {}", dir->string(), step);
    }
  }
  if (step == 0 && !job.init_checkpoint.empty()) {
    load_init_weights(job, model);
  } else if (step == 0) {
    model.init_parameters(job.seed);
  }
  const std::unique_ptr<StepBackend> backend = make_backend(job, model, optimizer, options);

  const double flops_per_micro = model.step_flops(job.batch, job.seqlen);
  const double flops_per_step = flops_per_micro * job.grad_accum;
  const int64_t tokens_per_step = static_cast<int64_t>(job.batch) * job.seqlen * job.grad_accum;
  observer.on_start({{"version", version_string()},
                     {"model", model_config_to_json(job.model)},
                     {"parameters", model.parameters().total()},
                     {"threads", omp_get_max_threads()},
                     {"device", backend->device()},
                     {"first_step", step + 1},
                     {"steps", job.steps},
                     {"tokens_per_step", tokens_per_step},
                     {"flops_per_step", flops_per_step}});

  auto save_checkpoint = [&](int64_t at_step) {
    if (job.checkpoint_dir.empty()) return;
    // Checked before writing anything: a run stopped here keeps its previous checkpoint
    // as `latest` and leaves the disk above the floor.
    require_free_space_for_checkpoint(
        job.checkpoint_dir, training_checkpoint_bytes(model.parameters()), job.min_free_bytes);
    backend->sync_host();  // collective over the ranks: each calls it
    if (!backend->writes_files()) return;
    // Written aside and installed whole: a run started over in a directory that holds this step
    // already must not leave `latest` naming its weights beside the old run's optimizer state.
    const fs::path dir = step_checkpoint_dir(job.checkpoint_dir, at_step);
    const fs::path staging = staging_checkpoint_dir(job.checkpoint_dir, at_step);
    std::error_code stale;
    fs::remove_all(staging, stale);  // a save that died before its install
    save_model_checkpoint(staging, model);
    save_optimizer_state(staging / "optimizer.safetensors", model.parameters(), optimizer);
    save_json_atomically(staging / "trainer_state.json",
                         {{"step", at_step},
                          {data_state_key(job), data_cursors(job, loader)},
                          {"seed", job.seed},
                          {"total_steps", job.steps},
                          {"lr_schedule",
                           {{"lr", job.optimizer.lr},
                            {"min_lr", job.optimizer.min_lr},
                            {"warmup_steps", job.optimizer.warmup_steps}}}});
    install_checkpoint(job.checkpoint_dir, staging, at_step);
    observer.on_checkpoint(at_step, dir);
    // After the new checkpoint is `latest`, so a failure or crash here never leaves fewer
    // complete checkpoints than keep_last.
    for (const fs::path& removed :
         prune_checkpoints(job.checkpoint_dir, job.keep_last, job.steps)) {
      spdlog::info("removed old checkpoint {} (checkpoint.keep_last={})", removed.string(),
                   job.keep_last);
    }
  };
  double last_val = -1;
  auto run_eval = [&](int64_t at_step) {
    if (!valid_set) return;
    int64_t windows = 0;
    last_val =
        mean_eval_loss(*backend, *valid_set, job.seqlen, job.batch,
                       job.eval_batches > 0 ? int64_t{job.eval_batches} * job.batch : 0, &windows);
    observer.on_eval({at_step, last_val, windows * job.seqlen});
  };

  RunSummary summary;
  summary.first_step = step + 1;
  summary.total_steps = job.steps;
  summary.flops_per_step = flops_per_step;
  summary.stop_reason = "completed";
  std::vector<int32_t> tokens(static_cast<size_t>(job.batch) * (job.seqlen + 1));
  // The newest step times, for the median: a ring, so that memory does not grow with
  // the run's length (8 bytes a step would be 8 GB at the step limit).
  constexpr size_t kTimedSteps = size_t{1} << 20;
  std::vector<double> step_ms;
  size_t next_timing = 0;
  const auto run_start = Clock::now();
  bool checkpoint_current = false;
  summary.device = backend->device();
  constexpr int64_t kProfiledSteps = 3;
  uint64_t builds_at_first_step = 0;
  std::string violation;
  while (step < job.steps) {
    const auto t0 = Clock::now();
    ++step;
    // The profiled window: the kProfiledSteps steps after the first (which pays for warm-up).
    const bool profiled = step > summary.first_step && step <= summary.first_step + kProfiledSteps;
    if (step == summary.first_step + 1) backend->set_profiling(true);
    backend->zero_grad();
    double loss = 0;
    for (int micro = 0; micro < job.grad_accum; ++micro) {
      loader.next_batch(job.batch, tokens.data());
      loss += backend->forward_backward(tokens.data(), 1.0 / job.grad_accum,
                                        micro + 1 == job.grad_accum) /
              job.grad_accum;
    }
    const double lr = learning_rate(job.optimizer, step, job.steps);
    const double grad_norm = backend->update(lr);
    if (profiled && (step == summary.first_step + kProfiledSteps || step == job.steps)) {
      backend->set_profiling(false);
      observer.on_kernels(backend->kernel_records());
    }
    if (step == summary.first_step) {
      summary.seconds_to_first_step =
          std::chrono::duration<double>(Clock::now() - train_start).count();
      summary.device_bytes = backend->device_bytes();
      if (const auto ledger = backend->plan_ledger()) builds_at_first_step = ledger->builds;
    }
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (step_ms.size() < kTimedSteps) {
      step_ms.push_back(ms);
    } else {
      step_ms[next_timing] = ms;
      next_timing = (next_timing + 1) % kTimedSteps;
    }
    StepRecord record{step,
                      loss,
                      grad_norm,
                      lr,
                      tokens_per_step,
                      ms,
                      static_cast<double>(tokens_per_step) / (ms / 1000.0),
                      flops_per_step / (ms / 1000.0)};
    observer.on_step(record);
    summary.final_loss = loss;
    summary.tokens += tokens_per_step;
    // Acted on at the ranks' vote below: every rank stops, whichever of them broke it.
    violation = recompile_violation(*backend, job, builds_at_first_step, summary.first_step);
    checkpoint_current = false;
    if (job.eval_interval > 0 && step % job.eval_interval == 0 && step < job.steps) run_eval(step);
    if (job.checkpoint_interval > 0 && step % job.checkpoint_interval == 0) {
      save_checkpoint(step);
      checkpoint_current = true;
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
    if (options.stop_at > 0 && step >= options.stop_at && step < job.steps) {
      summary.stop_reason = violation.empty() ? "stop_at" : "contract_violation";
      break;
    }
    // The ranks of a several-GPU job stop together or not at all (one stopping alone would
    // leave the others waiting in a collective): one vote each, counted over all of them.
    // Each kind of vote has its own digits: up to kMaxDevices time votes stay below
    // kContractVote, as many contract votes below kStopVote.
    constexpr int64_t kStopVote = int64_t{1} << 32;
    constexpr int64_t kContractVote = int64_t{1} << 16;
    static_assert(TrainJobLimits::kMaxDevices < kContractVote &&
                  TrainJobLimits::kMaxDevices * kContractVote < kStopVote);
    const bool time_up = job.max_seconds > 0 && elapsed >= job.max_seconds;
    const bool stop_asked = options.stop_requested && options.stop_requested->load();
    const int64_t votes = backend->sum_over_ranks(
        (stop_asked ? kStopVote : 0) + (violation.empty() ? 0 : kContractVote) + (time_up ? 1 : 0));
    if (votes % kStopVote >= kContractVote) {
      if (violation.empty()) {
        violation = fmt::format(
            "contract violation: another rank of the job built GEMM plans after step {}, over "
            "recompile_budget={} (its log names them)",
            summary.first_step, job.recompile_budget);
      }
      summary.stop_reason = "contract_violation";
      break;
    }
    if (votes % kContractVote > 0 && step < job.steps) {
      summary.stop_reason = "time_limit";
      break;
    }
    if (votes >= kStopVote && step < job.steps) {
      summary.stop_reason = "stopped";
      break;
    }
  }
  summary.last_step = step;
  // A job that broke its contract fails: no final evaluation or checkpoint. (The interval ones
  // of the step it broke it on have run: every rank runs those alike, before the ranks' vote.)
  const bool failed = !violation.empty();
  if (summary.stop_reason != "stopped" && !failed) run_eval(step);
  summary.final_val_loss = last_val;
  if (!checkpoint_current && step >= summary.first_step && !failed) save_checkpoint(step);
  summary.wall_seconds = std::chrono::duration<double>(Clock::now() - run_start).count();
  if (!step_ms.empty()) {
    std::vector<double> sorted = step_ms;
    std::nth_element(sorted.begin(), sorted.begin() + static_cast<long>(sorted.size() / 2),
                     sorted.end());
    summary.median_step_ms = sorted[sorted.size() / 2];
    summary.tokens_per_s = static_cast<double>(tokens_per_step) / (summary.median_step_ms / 1000.0);
    summary.flops_per_s = flops_per_step / (summary.median_step_ms / 1000.0);
  }
  if (const auto ledger = backend->plan_ledger()) {
    summary.plan_cache = {{"path", backend->plan_cache_file()},
                          {"hits", ledger->hits},
                          {"builds", ledger->builds},
                          {"stale", ledger->stale},
                          {"builds_after_first_step",
                           step >= summary.first_step ? ledger->builds - builds_at_first_step : 0},
                          {"budget", job.recompile_budget},
                          {"problems", backend->plan_cache_problems()}};
  }
  summary.error = violation;
  observer.on_finish(summary);
  if (failed) fail(ErrorKind::kFailedPrecondition, "{}", violation);
  return summary;
}

EvalResult evaluate_checkpoint(const fs::path& checkpoint_dir, const fs::path& data_prefix,
                               int seqlen, int batch, int64_t max_windows) {
  if (seqlen <= 1 || batch <= 0) {
    fail(ErrorKind::kInvalidArgument, "seqlen={} must be >= 2 and batch={} positive", seqlen,
         batch);
  }
  Model<float> model(load_checkpoint_config(checkpoint_dir));
  load_model_weights(checkpoint_dir, model);
  model.plan(batch, seqlen);
  const data::IndexedDataset dataset(data_prefix);
  EvalResult result;
  CpuBackend backend(model, nullptr, 0.0);
  result.loss = mean_eval_loss(backend, dataset, seqlen, batch, max_windows, &result.windows);
  result.tokens = result.windows * seqlen;
  return result;
}

}  // namespace megacpp
