#pragma once
// Checkpoints. A model checkpoint is a directory holding config.json (MambaConfig's keys)
// and model.safetensors (fp32, the PyTorch module names; a tied model's lm_head.weight as
// a copy of the embedding): the format mamba_ssm's MambaLMHeadModel reads
// (MambaLMHeadModel(MambaConfig(**config)).load_state_dict(tensors, strict=True)). A training
// checkpoint adds optimizer.safetensors (AdamW moments, named exp_avg.<param> / exp_avg_sq.<param>)
// and trainer_state.json (step, data position, RNG, schedule). Every file is written atomically;
// the `latest` pointer of a run directory is written last, so a crash mid-save leaves the previous
// checkpoint as the latest complete one.
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/json_file.h"
#include "runtime/model/model.h"
#include "runtime/optimizer/adamw.h"

namespace megacpp {

void save_model_checkpoint(const std::filesystem::path& dir, const Model<float>& model);
// Reads dir/config.json.
ModelConfig load_checkpoint_config(const std::filesystem::path& dir);
// Loads dir/model.safetensors into `model`, refusing a missing, extra or
// mis-shaped tensor with its name and both shapes, and a tied model's lm_head.weight
// that is not an exact copy of the embedding (a file without one loads).
void load_model_weights(const std::filesystem::path& dir, Model<float>& model);

void save_optimizer_state(const std::filesystem::path& file, const ParameterSet<float>& params,
                          AdamW<float>& optimizer);
void load_optimizer_state(const std::filesystem::path& file, const ParameterSet<float>& params,
                          AdamW<float>& optimizer);

// The run directory layout: RUN/step-00000100/{config.json, model.safetensors,
// optimizer.safetensors, trainer_state.json} and RUN/latest naming the newest.
std::filesystem::path step_checkpoint_dir(const std::filesystem::path& run_dir, int64_t step);
void mark_latest_checkpoint(const std::filesystem::path& run_dir, int64_t step);
// Where a training checkpoint of `step` is written before install_checkpoint makes it the run's:
// RUN/.staging-step-NNNNNNNN (outside the step-* namespace, so never taken for a checkpoint).
std::filesystem::path staging_checkpoint_dir(const std::filesystem::path& run_dir, int64_t step);
// Makes the complete checkpoint written in `staging` the run's step `step` and its latest. The
// directory is renamed into place whole, so `latest` never names a mix of two writes' files: a
// step directory already there (a run started over in the same directory) is renamed aside to
// RUN/.replaced-step-NNNNNNNN first and deleted once the new one is latest. A crash between those
// two renames leaves it aside with `latest` naming it: latest_checkpoint puts it back.
void install_checkpoint(const std::filesystem::path& run_dir, const std::filesystem::path& staging,
                        int64_t step);
// The newest complete checkpoint of a run directory, if any.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& run_dir);

// About how many bytes a training checkpoint of `params` writes: the weights and both
// AdamW moments in fp32, their safetensors headers, the JSON files. An upper estimate.
uint64_t training_checkpoint_bytes(const ParameterSet<float>& params);

// The floor on free space: throws Error(kFailedPrecondition) naming run_dir, its file
// system's free bytes, `bytes` and `min_free_bytes` when writing `bytes` there would
// leave less than `min_free_bytes` available. Creates run_dir if missing.
void require_free_space_for_checkpoint(const std::filesystem::path& run_dir, uint64_t bytes,
                                       uint64_t min_free_bytes);

// Retention: deletes the step checkpoints of run_dir older than its newest `keep_last`,
// except the one of `final_step` (the run's last) and the one `latest` names. keep_last
// = 0 keeps everything. A checkpoint is renamed out of the step-* namespace before it is
// deleted, so a crash mid-delete never leaves a partial one that looks complete.
// Returns the step directories removed.
std::vector<std::filesystem::path> prune_checkpoints(const std::filesystem::path& run_dir,
                                                     int keep_last, int64_t final_step);

}  // namespace megacpp
