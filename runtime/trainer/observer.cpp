#include "runtime/trainer/observer.h"

#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>

#include "base/error.h"

namespace megacpp {

nlohmann::json to_json(const StepRecord& r) {
  return {{"step", r.step},
          {"loss", r.loss},
          {"grad_norm", r.grad_norm},
          {"lr", r.lr},
          {"tokens", r.tokens},
          {"step_ms", r.step_ms},
          {"tokens_per_s", r.tokens_per_s},
          {"flops_per_s", r.flops_per_s}};
}

nlohmann::json to_json(const EvalRecord& r) {
  return {{"step", r.step}, {"val_loss", r.loss}, {"tokens", r.tokens}};
}

nlohmann::json to_json(const KernelRecord& r) {
  return {{"kernel", r.kernel},
          {"device", r.device},
          {"launch", r.launch},
          {"registers", r.registers},
          {"static_smem", r.static_smem},
          {"dynamic_smem", r.dynamic_smem},
          {"occupancy", r.occupancy},
          {"time_ms_min", r.time_ms_min},
          {"time_ms_median", r.time_ms_median},
          {"time_ms_max", r.time_ms_max},
          {"samples", r.samples}};
}

nlohmann::json to_json(const RunSummary& r) {
  nlohmann::json out = {{"first_step", r.first_step},
                        {"last_step", r.last_step},
                        {"total_steps", r.total_steps},
                        {"tokens", r.tokens},
                        {"wall_seconds", r.wall_seconds},
                        {"final_loss", r.final_loss},
                        {"final_val_loss", r.final_val_loss},
                        {"median_step_ms", r.median_step_ms},
                        {"tokens_per_s", r.tokens_per_s},
                        {"flops_per_step", r.flops_per_step},
                        {"flops_per_s", r.flops_per_s},
                        {"stop_reason", r.stop_reason},
                        {"device", r.device},
                        {"device_bytes", r.device_bytes},
                        {"seconds_to_first_step", r.seconds_to_first_step}};
  if (!r.error.empty()) out["error"] = r.error;
  if (!r.plan_cache.is_null()) out["plan_cache"] = r.plan_cache;
  return out;
}

JsonLinesObserver::JsonLinesObserver(const std::filesystem::path& file, bool print_progress)
    : print_progress_(print_progress) {
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  file_ = std::fopen(file.c_str(), "a");
  if (file_ == nullptr) {
    fail(ErrorKind::kIo, "{}: cannot open for appending: {}", file.string(), std::strerror(errno));
  }
}

JsonLinesObserver::~JsonLinesObserver() {
  if (file_ != nullptr) std::fclose(file_);
}

void JsonLinesObserver::write(const nlohmann::json& line) {
  const std::string text = line.dump() + "\n";
  std::fwrite(text.data(), 1, text.size(), file_);
  std::fflush(file_);
}

void JsonLinesObserver::on_start(const nlohmann::json& run_info) {
  nlohmann::json line = run_info;
  line["type"] = "start";
  write(line);
}

void JsonLinesObserver::on_step(const StepRecord& r) {
  nlohmann::json line = to_json(r);
  line["type"] = "step";
  write(line);
  if (print_progress_) {
    spdlog::info("step {:5d}  loss {:.4f}  grad_norm {:.3f}  lr {:.2e}  {:.0f} ms  {:.0f} tok/s",
                 r.step, r.loss, r.grad_norm, r.lr, r.step_ms, r.tokens_per_s);
  }
}

void JsonLinesObserver::on_eval(const EvalRecord& r) {
  nlohmann::json line = to_json(r);
  line["type"] = "eval";
  write(line);
  if (print_progress_) spdlog::info("step {:5d}  val_loss {:.4f}", r.step, r.loss);
}

void JsonLinesObserver::on_checkpoint(int64_t step, const std::filesystem::path& dir) {
  write({{"type", "checkpoint"}, {"step", step}, {"dir", dir.string()}});
  if (print_progress_) spdlog::info("step {:5d}  checkpoint {}", step, dir.string());
}

void JsonLinesObserver::on_finish(const RunSummary& s) {
  nlohmann::json line = to_json(s);
  line["type"] = "summary";
  write(line);
}

void JsonLinesObserver::on_kernels(const std::vector<KernelRecord>& kernels) {
  for (const KernelRecord& k : kernels) {
    nlohmann::json line = to_json(k);
    line["type"] = "kernel";
    write(line);
  }
}

}  // namespace megacpp
