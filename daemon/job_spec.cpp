#include "daemon/job_spec.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "base/error.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/config/model_config.h"
#include "runtime/data/dataset_tokenizer.h"
#include "runtime/data/indexed_dataset.h"
#include "runtime/model/memory_estimate.h"
#ifdef MEGACPP_HAVE_CUDA
#include "runtime/model/cuda_model.h"
#endif
#include "runtime/parallel/shard_plan.h"
#include "runtime/trainer/trainer.h"
#include "service/config/path_policy.h"

namespace megacpp::daemon {

using nlohmann::json;

namespace {

template <typename... Args>
[[noreturn]] void refuse(fmt::format_string<Args...> rule, Args&&... args) {
  fail(ErrorKind::kInvalidArgument, "spec.{}", fmt::format(rule, std::forward<Args>(args)...));
}

// proto3 scalars have no presence: 0 means unset, which takes the trainer's default.
template <typename V, typename D>
V or_default(V value, D fallback) {
  return value == V{} ? static_cast<V>(fallback) : value;
}

std::string dataset_prefix(const std::string& value, const std::string& field,
                           const DaemonConfig& config) {
  if (value.empty()) refuse("{} is required: a dataset prefix (PREFIX.bin and PREFIX.idx)", field);
  // Both files must be inside an allowed data root, symlinks resolved.
  const auto idx = resolve_allowed_path(value + ".idx", config.data_roots, "spec." + field,
                                        /*must_exist=*/true);
  resolve_allowed_path(value + ".bin", config.data_roots, "spec." + field, true);
  std::string prefix = idx.string();
  prefix = prefix.substr(0, prefix.size() - 4);
  // The tokenizer record is read too: it must not lead out of the roots either.
  const std::string record = data::tokenizer_file_path(prefix).string();
  if (std::filesystem::exists(record)) {
    resolve_allowed_path(record, config.data_roots, "spec." + field, true);
  }
  return prefix;
}

// The datasets to train on: train_data, or every entry of train_blend. Returns the trainer's
// data.train (a prefix or a blend) and adds each dataset, named by its field, to `named`.
json train_datasets(const megacpp::v1::JobSpec& spec, const DaemonConfig& config,
                    std::vector<data::NamedDataset>& named) {
  if (spec.train_blend_size() == 0) {
    const std::string train = dataset_prefix(spec.train_data(), "train_data", config);
    named.push_back({"spec.train_data", train});
    return train;
  }
  if (!spec.train_data().empty()) {
    refuse(
        "train_data and train_blend are exclusive: name one dataset in train_data or several, "
        "with weights, in train_blend");
  }
  if (spec.train_blend_size() > TrainJobLimits::kMaxBlendDatasets) {
    refuse("train_blend has {} datasets, more than the {} a blend may have",
           spec.train_blend_size(), TrainJobLimits::kMaxBlendDatasets);
  }
  json blend = json::array();
  for (int i = 0; i < spec.train_blend_size(); ++i) {
    const auto& entry = spec.train_blend(i);
    // NaN fails every comparison, so the test is written to let only positive finite values by.
    if (!(std::isfinite(entry.weight()) && entry.weight() > 0)) {
      refuse("train_blend[{}].weight={} must be positive and finite", i, entry.weight());
    }
    const std::string field = fmt::format("train_blend[{}].prefix", i);
    const std::string prefix = dataset_prefix(entry.prefix(), field, config);
    named.push_back({"spec." + field, prefix});
    blend.push_back({{"prefix", prefix}, {"weight", entry.weight()}});
  }
  return blend;
}

// The model checkpoint a job starts from (spec.init_checkpoint): the directory and both of its
// files inside the data roots (a symbolic link to a file elsewhere would otherwise be read with
// the daemon's rights), and its config the job's model, so the mismatch is refused at submit and
// not when the job starts. Returns the canonical directory.
std::string init_checkpoint_dir(const std::string& value, const ModelConfig& model,
                                const DaemonConfig& config) {
  const std::string field = "spec.init_checkpoint";
  const auto dir = resolve_allowed_path(value, config.data_roots, field, /*must_exist=*/true);
  for (const char* file : {"config.json", "model.safetensors"}) {
    resolve_allowed_path((dir / file).string(), config.data_roots, field, /*must_exist=*/true);
  }
  ModelConfig saved;
  try {
    saved = load_checkpoint_config(dir);
  } catch (const Error& e) {
    refuse("init_checkpoint={}: {}", dir.string(), e.what());
  }
  if (model_config_to_json(saved) != model_config_to_json(model)) {
    refuse(
        "init_checkpoint={}: the checkpoint's model config differs from the job's: give its "
        "config.json as config_json",
        dir.string());
  }
  return dir.string();
}

// Refuses a job whose estimated memory exceeds what its device has, with the estimate.
void check_memory(const megacpp::v1::JobSpec& spec, const ModelConfig& model,
                  const ValidatedJob& job, int cpu_slots,
                  const std::vector<data::NamedDataset>& datasets, const MemoryBudget& budget) {
  TrainingShape shape;
  shape.batch = spec.batch();
  shape.seqlen = spec.seqlen();
  // threads = 0 takes the slot's share of the cores, as JobManager assigns it.
  const long cores = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
  // Clamped to the field's bound, which the trainer's validation enforces with its own
  // message; the estimate must not refuse a spec for a field that message names.
  shape.threads = std::clamp<int64_t>(
      spec.threads() > 0 ? spec.threads()
                         : std::max<long>(1, cores / std::max(1, cpu_slots)) * job.device_count,
      1, TrainJobLimits::kMaxThreads);
  MemoryEstimate estimate = estimate_training_memory(model, shape);
  for (const data::NamedDataset& dataset : datasets) {
    std::error_code ec;
    const auto bytes = std::filesystem::file_size(data::index_file_path(dataset.prefix), ec);
    if (!ec) estimate.datasets += bytes;  // the index is read into memory
  }
  if (job.device_kind == gates::DeviceKind::kCpu) {
    const HostMemory host = read_host_memory();
    const uint64_t limit = budget.host_bytes > 0 ? budget.host_bytes : host.available;
    if (limit > 0 && estimate.total() > limit) {
      refuse(
          "batch={}, seqlen={}: the job needs about {} of memory, more than the {} bytes this "
          "host has available (MemAvailable; MemTotal {} bytes): lower batch or seqlen, or "
          "use a smaller model",
          spec.batch(), spec.seqlen(), estimate.describe(), limit, host.total);
    }
  }
  // A cuda job's device memory is checked once its gates are decided (check_device_memory).
}

#ifdef MEGACPP_HAVE_CUDA
// Beside what CudaModel::plan_memory plans, each rank's process holds its CUDA context (about
// half a GiB on an H100), cuBLASLt's and cuDNN's handles, the kernels cuDNN loads for its attention
// plans and, with several GPUs, NCCL's buffers.
constexpr uint64_t kDeviceOverheadBytes = uint64_t{2} << 30;

// Refuses a cuda job whose ranks would not fit a GPU of `gpu_bytes` (0: unknown, not checked):
// the CUDA model's own plan for each TP rank's share of the micro-batch, the bytes the executor
// will allocate, with the gates that change them.
void check_device_memory(const megacpp::v1::JobSpec& spec, const ModelConfig& model,
                         int device_count, int tp, bool recompute_in_proj, bool deterministic,
                         uint64_t gpu_bytes) {
  if (gpu_bytes == 0) return;
  const int replicas = device_count / tp;
  const int micro_batch = spec.batch() / replicas;  // parse_train_job checked the split
  // 0: the plan could not be made here (the CUDA runtime failed in the daemon's process).
  const auto need = [&](bool recompute, bool reproducible) -> uint64_t {
    uint64_t most = 0;
    try {
      for (int rank = 0; rank < tp; ++rank) {
        const CudaMemoryPlan plan = CudaModel::plan_memory(
            model, micro_batch, spec.seqlen(), tp, rank,
            CudaModelOptions{.recompute_in_proj = recompute, .deterministic = reproducible});
        most = std::max(most, plan.total());
      }
    } catch (const Error& e) {
      // A shape the CUDA kernels do not cover, named by them.
      if (e.kind() == ErrorKind::kInvalidArgument) refuse("{}", e.what());
      // The plan asks the device (CUB's sort sizes, the shared-memory limit): when the runtime
      // fails here the job is not refused for it; its executor allocates the same plan and fails
      // with the numbers if it does not fit.
      spdlog::warn("the device memory of a cuda job was not checked at submit: {}", e.what());
      return 0;
    }
    return most + kDeviceOverheadBytes;
  };
  const uint64_t needed = need(recompute_in_proj, deterministic);
  if (needed == 0 || needed <= gpu_bytes) return;
  std::string remedies = ", split it over more GPUs (device_count with tensor_parallel)";
  bool has_mamba = false;
  for (int layer = 0; layer < model.n_layer; ++layer) has_mamba |= !model.is_attention_layer(layer);
  if (!recompute_in_proj && has_mamba) {
    const uint64_t lean = need(true, deterministic);
    if (lean != 0 && lean <= gpu_bytes) {
      remedies += fmt::format(
          ", or ask for the recompute_in_proj feature gate (with it each GPU needs {} bytes)",
          lean);
    }
  }
  if (deterministic) {
    // The deterministic attention backward keeps dS (batch · heads · seqlen² bf16) in cuDNN's
    // workspace.
    const uint64_t lean = need(recompute_in_proj, false);
    if (lean != 0 && lean <= gpu_bytes) {
      remedies += fmt::format(
          ", or ask for the nondeterministic_attention feature gate (with it each GPU needs {} "
          "bytes)",
          lean);
    }
  }
  refuse(
      "batch={}, seqlen={}: each GPU of this cuda job needs {} bytes of device memory (the CUDA "
      "model's plan for a micro-batch of {} x {} tokens over tensor_parallel={}, plus {} bytes "
      "for the CUDA context and libraries), more than a GPU's {} bytes: lower batch or "
      "seqlen{}",
      spec.batch(), spec.seqlen(), needed, micro_batch, spec.seqlen(), tp, kDeviceOverheadBytes,
      gpu_bytes, remedies);
}
#endif

// The cuda_backend gate refusing a cuda job: recorded with the job's other decisions.
void refuse_cuda_backend(ValidatedJob& out, std::string reason,
                         gates::GateImplementation implementation) {
  out.gate_decisions.push_back(
      {"cuda_backend", gates::Decision::kRefused, std::move(reason), implementation, {}});
}

}  // namespace

ValidatedJob validate_job_spec(const megacpp::v1::JobSpec& spec, const DaemonConfig& config,
                               int cpu_slots, int gpus, const std::filesystem::path& checkpoint_dir,
                               const MemoryBudget& memory) {
  if (spec.ByteSizeLong() > config.limits.max_spec_bytes) {
    refuse("size {} bytes exceeds limits.max_spec_bytes={}", spec.ByteSizeLong(),
           config.limits.max_spec_bytes);
  }
  ValidatedJob out;
  json model;
  ModelConfig model_config;
  switch (spec.model_case()) {
    case megacpp::v1::JobSpec::kPreset:
      model_config = model_preset(spec.preset());
      model = {{"preset", spec.preset()}};
      break;
    case megacpp::v1::JobSpec::kConfigJson: {
      json parsed;
      try {
        parsed = json::parse(spec.config_json());
      } catch (const json::parse_error& e) {
        refuse("config_json is not valid JSON (byte {}): {}", e.byte, e.what());
      } catch (const json::exception& e) {
        // Not only syntax: a number beyond the double range (1e400) is out_of_range.
        refuse("config_json is not valid JSON: {}", e.what());
      }
      model_config = parse_model_config(parsed, "spec.config_json");
      model = {{"config", parsed}};
      break;
    }
    default:
      refuse("model is required: set preset (e.g. \"tiny\") or config_json");
  }

  const std::string kind = spec.device_kind().empty() ? "cpu" : spec.device_kind();
  if (kind == "cpu") {
    out.device_kind = gates::DeviceKind::kCpu;
  } else if (kind == "cuda") {
    out.device_kind = gates::DeviceKind::kCuda;
  } else {
    refuse("device_kind=\"{}\" must be \"cpu\" or \"cuda\"", kind);
  }
  if (spec.device_count() < 0) refuse("device_count={} must be >= 0", spec.device_count());
  if (spec.tensor_parallel() < 0) refuse("tensor_parallel={} must be >= 0", spec.tensor_parallel());
  out.device_count = std::max(1, spec.device_count());
  const int tp = std::max(1, spec.tensor_parallel());
  try {
    // The whole plan, not just the divisibility rules: a spec accepted here is one the
    // runtime can split.
    parallel::ShardPlan(model_config, parallel::ParallelConfig{.tensor_parallel = tp,
                                                               .device_count = out.device_count});
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kInvalidArgument) throw;
    refuse("{}", e.what());
  }
  if (out.device_kind == gates::DeviceKind::kCpu && tp > 1) {
    refuse(
        "device_kind=\"cpu\" with tensor_parallel={}: the CPU runtime has no tensor "
        "parallelism (it trains in one process); use device_kind=\"cuda\"",
        tp);
  }
  const int available = out.device_kind == gates::DeviceKind::kCpu ? cpu_slots : gpus;
  // A cuda job where the daemon has no GPU is refused by its cuda_backend gate below, recorded
  // with the other decisions, rather than as a spec error that leaves no trace in the store.
  const bool no_gpu = out.device_kind == gates::DeviceKind::kCuda && gpus == 0;
  if (!no_gpu && out.device_count > available) {
    refuse("device_count={} exceeds this machine's {} {} device(s)", out.device_count, available,
           kind);
  }

  std::vector<data::NamedDataset> datasets;
  const json train = train_datasets(spec, config, datasets);
  const std::string valid = spec.valid_data().empty()
                                ? std::string()
                                : dataset_prefix(spec.valid_data(), "valid_data", config);
  if (!valid.empty()) datasets.push_back({"spec.valid_data", valid});
  data::check_dataset_tokenizers(datasets, model_config.vocab_size,
                                 spec.model_case() == megacpp::v1::JobSpec::kPreset
                                     ? "preset " + spec.preset()
                                     : std::string("spec.config_json"));
  // proto3 enums are open: an unknown number would reach the restart logic as is.
  if (!megacpp::v1::RestartPolicy_IsValid(spec.restart_policy())) {
    refuse("restart_policy={} is not a RestartPolicy value",
           static_cast<int>(spec.restart_policy()));
  }
  if (spec.max_restarts() < 0 || spec.max_restarts() > kMaxRestarts) {
    refuse("max_restarts={} must be in [0, {}]", spec.max_restarts(), kMaxRestarts);
  }
  if (spec.has_checkpoint_keep_last() &&
      (spec.checkpoint_keep_last() < 0 ||
       spec.checkpoint_keep_last() > TrainJobLimits::kMaxKeepLast)) {
    refuse("checkpoint_keep_last={} must be in [0, {}] (0 keeps every checkpoint)",
           spec.checkpoint_keep_last(), TrainJobLimits::kMaxKeepLast);
  }
  if (spec.has_recompile_budget() &&
      (spec.recompile_budget() < 0 ||
       spec.recompile_budget() > TrainJobLimits::kMaxRecompileBudget)) {
    refuse("recompile_budget={} must be in [0, {}] (plan builds allowed after the first step)",
           spec.recompile_budget(), TrainJobLimits::kMaxRecompileBudget);
  }
  check_memory(spec, model_config, out, cpu_slots, datasets, memory);

  const TrainJob defaults;
  json job = {{"model", model},
              {"data", {{"train", train}}},
              {"steps", spec.steps()},
              {"batch", spec.batch()},
              {"seqlen", spec.seqlen()},
              {"grad_accum", or_default(spec.grad_accum(), defaults.grad_accum)},
              {"checkpoint",
               {{"dir", checkpoint_dir.string()},
                {"interval", spec.checkpoint_interval()},
                {"keep_last", spec.has_checkpoint_keep_last() ? spec.checkpoint_keep_last()
                                                              : defaults.keep_last},
                // The floor the daemon keeps on its disks holds while the job writes checkpoints.
                {"min_free_bytes", config.min_free_bytes}}},
              {"eval",
               {{"interval", spec.eval_interval()},
                {"batches", or_default(spec.eval_batches(), defaults.eval_batches)}}},
              {"seed", or_default(spec.seed(), defaults.seed)},
              {"max_seconds", spec.max_seconds()},
              {"threads", spec.threads()},
              {"recompile_budget", spec.recompile_budget()}};
  if (!valid.empty()) job["data"]["valid"] = valid;
  if (!spec.init_checkpoint().empty()) {
    job["init"] = {
        {"checkpoint", init_checkpoint_dir(spec.init_checkpoint(), model_config, config)}};
  }
  if (spec.has_optimizer()) {
    const auto& o = spec.optimizer();
    json opt = json::object();
    if (o.lr() != 0) opt["lr"] = o.lr();
    if (o.min_lr() != 0) opt["min_lr"] = o.min_lr();
    if (o.warmup_steps() != 0) opt["warmup_steps"] = o.warmup_steps();
    if (o.weight_decay() != 0) opt["weight_decay"] = o.weight_decay();
    if (o.beta1() != 0) opt["beta1"] = o.beta1();
    if (o.beta2() != 0) opt["beta2"] = o.beta2();
    if (o.eps() != 0) opt["eps"] = o.eps();
    if (o.grad_clip() != 0) opt["grad_clip"] = o.grad_clip();
    job["optimizer"] = opt;
  }
  // The trainer's own validation names the remaining fields (steps, batch, ...).
  parse_train_job(job, "spec");
  out.train_job = job;

  std::vector<std::string> requested(spec.feature_gates().begin(), spec.feature_gates().end());
  out.gate_decisions = gates::GateRegistry::builtin().decide(requested, out.device_kind);
  if (out.device_kind == gates::DeviceKind::kCuda) {
    // Checked after the gates so their decisions are recorded with the refusal.
#ifdef MEGACPP_HAVE_CUDA
    if (no_gpu) {
      refuse_cuda_backend(out,
                          "device_kind=cuda: this megacppd has no GPU to run it on (it found none "
                          "when it started: see its boot receipt's devices)",
                          gates::GateImplementation::kImplemented);
      return out;
    }
    out.train_job["device"] = "cuda";
    for (const gates::GateDecision& d : out.gate_decisions) {
      if (d.gate == "recompute_in_proj" && d.decision == gates::Decision::kOn) {
        out.train_job["recompute_in_proj"] = true;
      }
      if (d.gate == "nondeterministic_attention" && d.decision == gates::Decision::kOn) {
        out.train_job["deterministic"] = false;
      }
    }
    // Checked and repaired at startup (service/preconditions): shared by every job of the
    // daemon, merged under a lock when two write at once.
    if (!config.cache_dirs.empty()) {
      out.train_job["plan_cache"] = (config.cache_dirs[0] / "plans").string();
    }
    if (tp > 1 || out.device_count > 1) {
      const int groups = model_config.ssm.ngroups;
      if (tp > 1 && groups % tp != 0 && groups != 1) {
        refuse(
            "tensor_parallel={} with ssm_cfg.ngroups={}: the CUDA backend splits B/C groups "
            "only when tensor_parallel divides ngroups, or ngroups is 1",
            tp, groups);
      }
      out.train_job["device_count"] = out.device_count;
      out.train_job["tensor_parallel"] = tp;
      try {
        parse_train_job(out.train_job, "spec");  // the batch's split over the replicas
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::kInvalidArgument) throw;
        refuse("{}", e.what());
      }
      out.gate_decisions.push_back(
          {"cuda_backend",
           gates::Decision::kOn,
           fmt::format("device_kind=cuda over device_count={}: one executor process per GPU "
                       "rank joined by NCCL, tensor_parallel={} ranks per replica, {} "
                       "data-parallel replica(s) (runtime/model/cuda_model.h)",
                       out.device_count, tp, out.device_count / tp),
           gates::GateImplementation::kImplemented,
           {}});
    } else {
      out.gate_decisions.push_back({"cuda_backend",
                                    gates::Decision::kOn,
                                    "device_kind=cuda: the whole step runs on one GPU "
                                    "(runtime/model/cuda_model.h)",
                                    gates::GateImplementation::kImplemented,
                                    {}});
    }
    check_device_memory(spec, model_config, out.device_count, tp,
                        out.train_job.value("recompute_in_proj", false),
                        out.train_job.value("deterministic", true), memory.gpu_bytes);
#else
    refuse_cuda_backend(out,
                        "device_kind=cuda: this megacppd was built without the CUDA toolkit, so "
                        "it has no CUDA backend; rebuild it where nvcc exists (/usr/local/cuda)",
                        gates::GateImplementation::kScaffold);
#endif
  }
  return out;
}

}  // namespace megacpp::daemon
