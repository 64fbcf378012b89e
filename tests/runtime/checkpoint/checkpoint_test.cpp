// Model checkpoints: round trip, and refusal of a missing, extra or mis-shaped
// tensor with its name and both shapes.
#include "runtime/checkpoint/checkpoint.h"

#include <gtest/gtest.h>

#include "runtime/checkpoint/safetensors.h"
#include "runtime/common/error.h"
#include "tests/support/temp_dir.h"

namespace megacpp {
namespace {

ModelConfig config() {
  return parse_model_config(
      nlohmann::json{{"d_model", 16},
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
  EXPECT_EQ(model_config_to_json(load_checkpoint_config(dir.path())), model_config_to_json(config()));
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
  EXPECT_NE(e.find("backbone.layers.0.mixer.D has shape [3], expected [4]"), std::string::npos) << e;
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

}  // namespace
}  // namespace megacpp
