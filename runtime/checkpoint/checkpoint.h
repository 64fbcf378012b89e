#pragma once
// Checkpoints. A model checkpoint is a directory holding config.json and
// model.safetensors (fp32, the PyTorch module names): the format mamba_ssm's
// MambaLMHeadModel reads. A training checkpoint adds optimizer.safetensors
// (AdamW moments, named exp_avg.<param> / exp_avg_sq.<param>) and
// trainer_state.json (step, data position, RNG, schedule). Every file is written
// atomically; the `latest` pointer of a run directory is written last, so a crash
// mid-save leaves the previous checkpoint as the latest complete one.
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "runtime/model/model.h"
#include "runtime/trainer/optimizer.h"

namespace megacpp {

void save_model_checkpoint(const std::filesystem::path& dir, const Model<float>& model);
// Reads dir/config.json.
ModelConfig load_checkpoint_config(const std::filesystem::path& dir);
// Loads dir/model.safetensors into `model`, refusing a missing, extra or
// mis-shaped tensor with its name and both shapes.
void load_model_weights(const std::filesystem::path& dir, Model<float>& model);

void save_optimizer_state(const std::filesystem::path& file, const ParameterSet<float>& params,
                          AdamW<float>& optimizer);
void load_optimizer_state(const std::filesystem::path& file, const ParameterSet<float>& params,
                          AdamW<float>& optimizer);

// The run directory layout: RUN/step-00000100/{config.json, model.safetensors,
// optimizer.safetensors, trainer_state.json} and RUN/latest naming the newest.
std::filesystem::path step_checkpoint_dir(const std::filesystem::path& run_dir, int64_t step);
void mark_latest_checkpoint(const std::filesystem::path& run_dir, int64_t step);
// The newest complete checkpoint of a run directory, if any.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& run_dir);

void save_json_atomically(const std::filesystem::path& file, const nlohmann::json& json);
nlohmann::json load_json_file(const std::filesystem::path& file);

}  // namespace megacpp
