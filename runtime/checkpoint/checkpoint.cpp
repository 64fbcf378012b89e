#include "runtime/checkpoint/checkpoint.h"

#include <fmt/format.h>

#include <cstring>

#include "runtime/checkpoint/safetensors.h"
#include "runtime/common/atomic_file.h"
#include "runtime/common/error.h"
#include "runtime/common/version.h"

namespace megacpp {

namespace fs = std::filesystem;

void save_json_atomically(const fs::path& file, const nlohmann::json& json) {
  write_file_atomically(file, json.dump(2) + "\n");
}

nlohmann::json load_json_file(const fs::path& file) {
  const std::string text = read_file(file);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail(ErrorKind::kCorruptData, "{}: invalid JSON at byte {}: {}", file.string(), e.byte,
         e.what());
  }
}

void save_model_checkpoint(const fs::path& dir, const Model<float>& model) {
  fs::create_directories(dir);
  save_json_atomically(dir / "config.json", model_config_to_json(model.config()));
  const auto& params = model.parameters();
  std::vector<TensorRef> tensors;
  for (size_t i = 0; i < params.entries().size(); ++i) {
    const auto& info = params.entries()[i];
    tensors.push_back({info.name, info.shape, params.value(static_cast<int>(i))});
  }
  save_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}, {"writer", version_string()}});
}

ModelConfig load_checkpoint_config(const fs::path& dir) {
  return load_model_config(dir / "config.json");
}

void load_model_weights(const fs::path& dir, Model<float>& model) {
  const fs::path file = dir / "model.safetensors";
  auto tensors = load_safetensors(file);
  auto& params = model.parameters();
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected;
  for (const auto& info : params.entries()) expected.emplace_back(info.name, info.shape);
  check_tensor_set(tensors, expected, file.string());
  for (size_t i = 0; i < params.entries().size(); ++i) {
    const auto& info = params.entries()[i];
    const auto& data = tensors.at(info.name).data;
    std::memcpy(params.value(static_cast<int>(i)), data.data(), sizeof(float) * data.size());
  }
}

void save_optimizer_state(const fs::path& file, const ParameterSet<float>& params,
                          AdamW<float>& optimizer) {
  std::vector<TensorRef> tensors;
  for (const auto& info : params.entries()) {
    tensors.push_back({"exp_avg." + info.name, info.shape, optimizer.exp_avg().data() + info.offset});
    tensors.push_back(
        {"exp_avg_sq." + info.name, info.shape, optimizer.exp_avg_sq().data() + info.offset});
  }
  save_safetensors(file, tensors, {{"steps_taken", std::to_string(optimizer.steps_taken())}});
}

void load_optimizer_state(const fs::path& file, const ParameterSet<float>& params,
                          AdamW<float>& optimizer) {
  std::map<std::string, std::string> metadata;
  auto tensors = load_safetensors(file, &metadata);
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected;
  for (const auto& info : params.entries()) {
    expected.emplace_back("exp_avg." + info.name, info.shape);
    expected.emplace_back("exp_avg_sq." + info.name, info.shape);
  }
  check_tensor_set(tensors, expected, file.string());
  for (const auto& info : params.entries()) {
    const auto& m = tensors.at("exp_avg." + info.name).data;
    const auto& v = tensors.at("exp_avg_sq." + info.name).data;
    std::memcpy(optimizer.exp_avg().data() + info.offset, m.data(), sizeof(float) * m.size());
    std::memcpy(optimizer.exp_avg_sq().data() + info.offset, v.data(), sizeof(float) * v.size());
  }
  auto it = metadata.find("steps_taken");
  if (it == metadata.end()) {
    fail(ErrorKind::kCorruptData, "{}: metadata lacks steps_taken", file.string());
  }
  try {
    optimizer.set_steps_taken(std::stoll(it->second));
  } catch (const std::exception&) {
    fail(ErrorKind::kCorruptData, "{}: metadata steps_taken=\"{}\" is not an integer",
         file.string(), it->second);
  }
}

fs::path step_checkpoint_dir(const fs::path& run_dir, int64_t step) {
  return run_dir / fmt::format("step-{:08d}", step);
}

void mark_latest_checkpoint(const fs::path& run_dir, int64_t step) {
  write_file_atomically(run_dir / "latest", step_checkpoint_dir(run_dir, step).filename().string() + "\n");
}

std::optional<fs::path> latest_checkpoint(const fs::path& run_dir) {
  const fs::path pointer = run_dir / "latest";
  if (!fs::exists(pointer)) return std::nullopt;
  std::string name = read_file(pointer);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  const fs::path dir = run_dir / name;
  if (name.empty() || name.find('/') != std::string::npos || !fs::is_directory(dir)) {
    fail(ErrorKind::kCorruptData, "{}: names \"{}\", which is not a checkpoint directory of {}",
         pointer.string(), name, run_dir.string());
  }
  return dir;
}

}  // namespace megacpp
