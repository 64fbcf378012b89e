// Model checkpoints: round trip, and refusal of a missing, extra or mis-shaped
// tensor with its name and both shapes.
#include "runtime/checkpoint/checkpoint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

#include "base/error.h"
#include "base/json_file.h"
#include "runtime/checkpoint/safetensors.h"
#include "tests/support/temp_dir.h"

namespace megacpp {
namespace {

ModelConfig config() {
  return parse_model_config(
      nlohmann::json{
          {"d_model", 16},
          {"pattern", "M*"},
          {"vocab_size", 20},
          {"ssm_cfg", {{"d_state", 8}, {"headdim", 8}, {"mimo_rank", 2}, {"chunk_size", 4}}},
          {"attn_cfg", {{"num_heads", 2}}}},
      "test");
}

std::string load_error(const std::filesystem::path& dir) {
  Model<float> model(config());
  try {
    load_model_weights(dir, model);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Checkpoint, RoundTripsConfigAndWeights) {
  testing::TempDir dir;
  Model<float> model(config());
  model.init_parameters(5);
  save_model_checkpoint(dir.path(), model);
  EXPECT_EQ(model_config_to_json(load_checkpoint_config(dir.path())),
            model_config_to_json(config()));
  Model<float> loaded(load_checkpoint_config(dir.path()));
  load_model_weights(dir.path(), loaded);
  EXPECT_EQ(loaded.parameters().values(), model.parameters().values());
  std::map<std::string, std::string> metadata;
  auto tensors = load_safetensors(dir / "model.safetensors", &metadata);
  EXPECT_EQ(metadata["format"], "pt");
  EXPECT_TRUE(tensors.count("backbone.layers.0.mixer.dt_bias"));
  EXPECT_TRUE(tensors.count("backbone.layers.1.mixer.out_proj.bias"));
}

TEST(Checkpoint, RefusesMissingExtraAndMisshapedTensorsByName) {
  testing::TempDir dir;
  Model<float> model(config());
  model.init_parameters(5);
  save_model_checkpoint(dir.path(), model);
  auto tensors = load_safetensors(dir / "model.safetensors");
  auto rewrite = [&](const std::map<std::string, TensorF32>& set) {
    std::vector<TensorRef> refs;
    for (const auto& [name, t] : set) refs.push_back({name, t.shape, t.data.data()});
    save_safetensors(dir / "model.safetensors", refs);
  };
  auto missing = tensors;
  missing.erase("backbone.layers.0.mixer.D");
  rewrite(missing);
  std::string e = load_error(dir.path());
  EXPECT_NE(e.find("missing tensor backbone.layers.0.mixer.D"), std::string::npos) << e;

  auto extra = tensors;
  extra["backbone.layers.7.mixer.D"] = TensorF32{{2}, {1, 2}};
  rewrite(extra);
  e = load_error(dir.path());
  EXPECT_NE(e.find("unexpected tensor backbone.layers.7.mixer.D"), std::string::npos) << e;

  auto misshaped = tensors;
  misshaped["backbone.layers.0.mixer.D"] = TensorF32{{3}, {1, 2, 3}};
  rewrite(misshaped);
  e = load_error(dir.path());
  EXPECT_NE(e.find("backbone.layers.0.mixer.D has shape [3], expected [4]"), std::string::npos)
      << e;
}

// The official loader's contract (shared/spec/model.md): config.json holds MambaConfig's keys
// (norm_epsilon only when it is not the official model's fixed 1e-5), and a tied model's file
// has lm_head.weight as an exact copy of the embedding; a copy that differs is refused, and a
// file without one (written before) still loads.
TEST(Checkpoint, FollowsTheOfficialLoadersContract) {
  testing::TempDir dir;
  Model<float> model(config());
  model.init_parameters(5);
  save_model_checkpoint(dir.path(), model);
  const nlohmann::json written = load_json_file(dir / "config.json");
  EXPECT_FALSE(written.contains("norm_epsilon")) << written.dump();
  for (const char* key : {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg",
                          "attn_layer_idx", "attn_cfg", "rms_norm", "residual_in_fp32",
                          "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings"}) {
    EXPECT_TRUE(written.contains(key)) << key;
  }
  EXPECT_EQ(written.size(), 12u) << written.dump();
  auto tensors = load_safetensors(dir / "model.safetensors");
  ASSERT_TRUE(tensors.count("lm_head.weight"));
  EXPECT_EQ(tensors.at("lm_head.weight").data, tensors.at("backbone.embedding.weight").data);

  auto rewrite = [&](const std::map<std::string, TensorF32>& set) {
    std::vector<TensorRef> refs;
    for (const auto& [name, t] : set) refs.push_back({name, t.shape, t.data.data()});
    save_safetensors(dir / "model.safetensors", refs);
  };
  auto differs = tensors;
  differs.at("lm_head.weight").data[3] += 1.0f;
  rewrite(differs);
  const std::string e = load_error(dir.path());
  EXPECT_NE(e.find("lm_head.weight is not an exact copy"), std::string::npos) << e;

  auto older = tensors;
  older.erase("lm_head.weight");
  rewrite(older);
  EXPECT_EQ(load_error(dir.path()), "");

  // Another epsilon is kept, so that it survives the round trip (and the official loader refuses).
  ModelConfig other = config();
  other.norm_epsilon = 1e-6;
  Model<float> eps_model(other);
  save_model_checkpoint(dir / "eps", eps_model);
  EXPECT_EQ(load_checkpoint_config(dir / "eps").norm_epsilon, 1e-6);
}

// The optimizer's step count is a whole non-negative integer: "12abc" was read as 12, and "-1"
// zeroed Adam's bias correction at the next step (the weights went to inf).
TEST(Checkpoint, OptimizerStepsTakenMustBeAWholeNonNegativeInteger) {
  testing::TempDir dir;
  Model<float> model(config());
  model.init_parameters(5);
  AdamW<float> optimizer(model.parameters(), OptimizerConfig{});
  const auto file = dir / "optimizer.safetensors";
  const auto with_steps = [&](const std::string& steps_taken) {
    std::vector<TensorRef> tensors;
    for (const auto& info : model.parameters().entries()) {
      tensors.push_back(
          {"exp_avg." + info.name, info.shape, optimizer.exp_avg().data() + info.offset});
      tensors.push_back(
          {"exp_avg_sq." + info.name, info.shape, optimizer.exp_avg_sq().data() + info.offset});
    }
    save_safetensors(file, tensors, {{"steps_taken", steps_taken}});
  };
  with_steps("7");
  load_optimizer_state(file, model.parameters(), optimizer);
  EXPECT_EQ(optimizer.steps_taken(), 7);
  for (const std::string bad : {"12abc", "-1", "", " 3", "99999999999999999999"}) {
    with_steps(bad);
    try {
      load_optimizer_state(file, model.parameters(), optimizer);
      ADD_FAILURE() << "steps_taken=\"" << bad << "\" was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kCorruptData) << e.what();
      EXPECT_NE(std::string(e.what()).find(file.string() + ": metadata steps_taken=\"" + bad +
                                           "\" is not a non-negative integer"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(Checkpoint, LatestPointerNamesACompleteCheckpoint) {
  testing::TempDir dir;
  EXPECT_FALSE(latest_checkpoint(dir.path()).has_value());
  std::filesystem::create_directories(step_checkpoint_dir(dir.path(), 7));
  mark_latest_checkpoint(dir.path(), 7);
  EXPECT_EQ(latest_checkpoint(dir.path())->filename(), "step-00000007");
  testing::write_text(dir / "latest", "../elsewhere\n");
  EXPECT_THROW(latest_checkpoint(dir.path()), Error);
}

std::vector<std::string> names_in(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// A step written again (a run started over in the same directory) replaces the old directory
// whole: `latest` never names one run's weights beside another's optimizer state, and a crash
// between the two renames leaves the old one aside, which latest_checkpoint puts back.
TEST(Checkpoint, InstallReplacesAStepDirectoryWholeAndACrashMidwayIsUndone) {
  testing::TempDir dir;
  const auto run = dir.path();
  const auto step = step_checkpoint_dir(run, 5);
  testing::write_text(step / "old-run.json", "{}");
  mark_latest_checkpoint(run, 5);
  const auto staging = staging_checkpoint_dir(run, 5);
  EXPECT_EQ(staging.filename(), ".staging-step-00000005");
  testing::write_text(staging / "new-run.json", "{}");
  install_checkpoint(run, staging, 5);
  EXPECT_EQ(names_in(step), std::vector<std::string>{"new-run.json"});
  EXPECT_EQ(names_in(run), (std::vector<std::string>{"latest", "step-00000005"}));
  EXPECT_EQ(latest_checkpoint(run), step);

  // The crash: the old directory renamed aside, the new one not yet in place.
  std::filesystem::rename(step, run / ".replaced-step-00000005");
  testing::write_text(staging / "new-run.json", "{}");
  EXPECT_EQ(latest_checkpoint(run), step);
  EXPECT_EQ(names_in(step), std::vector<std::string>{"new-run.json"});
  // A staging directory never installed is the next pruning's to delete, as is a replaced one
  // whose step directory is back.
  testing::write_text(run / ".replaced-step-00000005" / "x", "");
  prune_checkpoints(run, 1, 5);
  EXPECT_EQ(names_in(run), (std::vector<std::string>{"latest", "step-00000005"}));
}

// Retention keeps the newest keep_last step checkpoints, the final one and the one
// `latest` names, and nothing else that looks like a checkpoint; other files stay.
TEST(Checkpoint, PruningKeepsTheNewestTheFinalAndTheLatest) {
  testing::TempDir dir;
  for (int64_t step : {2, 4, 6, 8, 10, 12}) {
    testing::write_text(step_checkpoint_dir(dir.path(), step) / "trainer_state.json", "{}");
  }
  testing::write_text(dir / "steps.jsonl", "");
  testing::write_text(dir / "step-notes/readme", "not a checkpoint");
  // Left by a run that died mid-delete.
  testing::write_text(dir / ".pruning-step-00000001/model.safetensors", "");
  mark_latest_checkpoint(dir.path(), 6);  // e.g. rewound by the daemon after a crash

  EXPECT_TRUE(prune_checkpoints(dir.path(), 0, 4).empty());  // 0 keeps everything
  const auto removed = prune_checkpoints(dir.path(), 2, /*final_step=*/4);
  EXPECT_EQ(removed, (std::vector<std::filesystem::path>{step_checkpoint_dir(dir.path(), 2),
                                                         step_checkpoint_dir(dir.path(), 8)}));
  EXPECT_EQ(names_in(dir.path()),
            (std::vector<std::string>{"latest", "step-00000004", "step-00000006", "step-00000010",
                                      "step-00000012", "step-notes", "steps.jsonl"}));
  // Keeping more than exist removes nothing.
  EXPECT_TRUE(prune_checkpoints(dir.path(), 10, 4).empty());
}

TEST(Checkpoint, FreeSpaceFloorNamesDirectoryBytesAndFloor) {
  testing::TempDir dir;
  const auto run = dir / "run";
  require_free_space_for_checkpoint(run, 1 << 20, 0);  // creates the directory
  EXPECT_TRUE(std::filesystem::is_directory(run));
  try {
    require_free_space_for_checkpoint(run, 12345, std::numeric_limits<uint64_t>::max() / 2);
    FAIL() << "crossed the floor";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kFailedPrecondition);
    EXPECT_NE(message.find(run.string() + ": a checkpoint of about 12345 bytes"), std::string::npos)
        << message;
    EXPECT_NE(message.find("min_free_bytes=9223372036854775807"), std::string::npos) << message;
    EXPECT_NE(message.find("bytes free"), std::string::npos) << message;
  }
  Model<float> model(config());
  const uint64_t bytes = training_checkpoint_bytes(model.parameters());
  EXPECT_GE(bytes, 3 * sizeof(float) * static_cast<uint64_t>(model.parameters().total()));
  model.init_parameters(1);
  AdamW<float> optimizer(model.parameters(), OptimizerConfig{});
  save_model_checkpoint(run, model);
  save_optimizer_state(run / "optimizer.safetensors", model.parameters(), optimizer);
  const uint64_t written = std::filesystem::file_size(run / "model.safetensors") +
                           std::filesystem::file_size(run / "optimizer.safetensors") +
                           std::filesystem::file_size(run / "config.json");
  EXPECT_GE(bytes, written);
  EXPECT_LE(bytes, written + (128 << 10));
}

}  // namespace
}  // namespace megacpp
