#include "daemon/job_spec.h"

#include <fmt/format.h>

#include "runtime/common/error.h"
#include "runtime/daemon_config/path_policy.h"
#include "runtime/model/config.h"
#include "runtime/trainer/trainer.h"

namespace megacpp::daemon {

using nlohmann::json;

namespace {

template <typename... Args>
[[noreturn]] void refuse(fmt::format_string<Args...> rule, Args&&... args) {
  fail(ErrorKind::kInvalidArgument, "spec.{}", fmt::format(rule, std::forward<Args>(args)...));
}

// Tensor-parallel legality of the spec's model (shared/spec/model.md).
void check_tensor_parallel(const ModelConfig& m, int tp) {
  if (tp <= 1) return;
  const bool has_mamba = static_cast<int>(m.attn_layer_idx.size()) < m.n_layer;
  if (has_mamba && m.ssm_heads() % tp != 0) {
    refuse("tensor_parallel={} does not divide the Mamba-3 heads H={}", tp, m.ssm_heads());
  }
  if (!m.attn_layer_idx.empty()) {
    if (m.attn.num_heads % tp != 0) {
      refuse("tensor_parallel={} does not divide attn_cfg.num_heads={}", tp, m.attn.num_heads);
    }
    if (m.attn_kv_heads() % tp != 0) {
      refuse("tensor_parallel={} does not divide attn_cfg.num_heads_kv={}", tp, m.attn_kv_heads());
    }
  }
  if (m.d_intermediate > 0 && m.mlp_hidden() % tp != 0) {
    refuse("tensor_parallel={} does not divide the MLP hidden size {}", tp, m.mlp_hidden());
  }
}

std::string dataset_prefix(const std::string& value, const char* field, const DaemonConfig& config) {
  if (value.empty()) refuse("{} is required: a dataset prefix (PREFIX.bin and PREFIX.idx)", field);
  // Both files must be inside an allowed data root, symlinks resolved.
  const auto idx = resolve_allowed_path(value + ".idx", config.data_roots,
                                       std::string("spec.") + field, /*must_exist=*/true);
  resolve_allowed_path(value + ".bin", config.data_roots, std::string("spec.") + field, true);
  std::string prefix = idx.string();
  return prefix.substr(0, prefix.size() - 4);
}

}  // namespace

ValidatedJob validate_job_spec(const megacpp::v1::JobSpec& spec, const DaemonConfig& config,
                               int cpu_slots, int gpus, const std::filesystem::path& checkpoint_dir) {
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
  if (out.device_count % tp != 0) {
    refuse("tensor_parallel={} does not divide device_count={}", tp, out.device_count);
  }
  check_tensor_parallel(model_config, tp);
  const int available = out.device_kind == gates::DeviceKind::kCpu ? cpu_slots : gpus;
  if (out.device_count > available) {
    refuse("device_count={} exceeds this machine's {} {} device(s)", out.device_count, available, kind);
  }

  const std::string train = dataset_prefix(spec.train_data(), "train_data", config);
  const std::string valid =
      spec.valid_data().empty() ? std::string() : dataset_prefix(spec.valid_data(), "valid_data", config);
  if (spec.restart_policy() == megacpp::v1::RESTART_POLICY_ON_FAILURE && spec.max_restarts() < 0) {
    refuse("max_restarts={} must be >= 0", spec.max_restarts());
  }

  json job = {{"model", model},
              {"data", {{"train", train}}},
              {"steps", spec.steps()},
              {"batch", spec.batch()},
              {"seqlen", spec.seqlen()},
              {"grad_accum", spec.grad_accum() == 0 ? 1 : spec.grad_accum()},
              {"checkpoint", {{"dir", checkpoint_dir.string()}, {"interval", spec.checkpoint_interval()}}},
              {"eval", {{"interval", spec.eval_interval()}, {"batches", spec.eval_batches() == 0 ? 4 : spec.eval_batches()}}},
              {"seed", spec.seed() == 0 ? 1234 : spec.seed()},
              {"max_seconds", spec.max_seconds()},
              {"threads", spec.threads()}};
  if (!valid.empty()) job["data"]["valid"] = valid;
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
    out.gate_decisions.push_back(
        {"cuda_backend", gates::Decision::kRefused,
         "device_kind=cuda: the CUDA training backend is not implemented yet (the scan kernels "
         "exist; the trainer runs on the CPU only)",
         gates::GateImplementation::kScaffold, {}});
  }
  return out;
}

}  // namespace megacpp::daemon
