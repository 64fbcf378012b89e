// Jobs on a data blend: data.train as a list of {prefix, weight}, validated by field; training
// draws from the datasets in proportion and resumes bit for bit; the datasets' tokenizers must
// fit the model.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "base/error.h"
#include "runtime/data/dataset_tokenizer.h"
#include "runtime/data/prepare.h"
#include "runtime/trainer/trainer.h"
#include "tests/support/temp_dir.h"

namespace megacpp {
namespace {

using nlohmann::json;
using testing::TempDir;

struct Quiet final : TrainingObserver {
  void on_start(const json&) override {}
  void on_step(const StepRecord&) override {}
  void on_eval(const EvalRecord&) override {}
  void on_checkpoint(int64_t, const std::filesystem::path&) override {}
  void on_finish(const RunSummary&) override {}
};

class DataBlendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 6; ++i) {
      testing::write_text(dir_ / fmt::format("code/f{}.txt", i),
                          testing::pseudo_text(static_cast<uint64_t>(i), 300));
      testing::write_text(dir_ / fmt::format("prose/f{}.txt", i),
                          testing::pseudo_text(static_cast<uint64_t>(50 + i), 200));
    }
    for (const char* name : {"code", "prose"}) {
      data::PrepareOptions prepare;
      prepare.input = dir_ / name;
      prepare.output_prefix = dir_ / "data" / name;
      prepare.valid_fraction = 0.2;
      data::prepare_dataset(prepare);
    }
  }

  std::string prefix(const std::string& name) const { return (dir_ / "data" / name).string(); }

  json job(const std::string& run) const {
    return json{
        {"model",
         {{"config",
           {{"d_model", 32},
            {"pattern", "M*"},
            {"d_intermediate", 32},
            {"vocab_size", 257},
            {"ssm_cfg", {{"d_state", 16}, {"headdim", 16}, {"mimo_rank", 2}, {"chunk_size", 8}}},
            {"attn_cfg", {{"num_heads", 2}, {"rotary_emb_dim", 8}}}}}}},
        {"data",
         {{"train",
           {{{"prefix", prefix("code_train")}, {"weight", 3}},
            {{"prefix", prefix("prose_train")}, {"weight", 1}}}},
          {"valid", prefix("code_valid")}}},
        {"steps", 8},
        {"batch", 2},
        {"seqlen", 16},
        {"optimizer", {{"lr", 0.01}}},
        {"eval", {{"interval", 0}, {"batches", 1}}},
        {"checkpoint", {{"dir", (dir_ / run).string()}, {"interval", 0}}},
        {"threads", 1},
        {"seed", 5}};
  }

  TempDir dir_;
};

TEST_F(DataBlendTest, BlendFieldsAreValidatedByName) {
  struct Case {
    std::function<void(json&)> breaks;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["data"]["train"][1]["weight"] = -1; },
       "job.json: data.train[1].weight=-1 must be positive"},
      {[](json& j) { j["data"]["train"][0]["weight"] = 0; },
       "job.json: data.train[0].weight=0 must be positive"},
      {[](json& j) { j["data"]["train"][0]["weight"] = std::numeric_limits<double>::quiet_NaN(); },
       "job.json: data.train[0].weight=nan must be a finite number"},
      {[](json& j) { j["data"]["train"][1].erase("weight"); },
       "job.json: data.train[1]: missing required field weight"},
      {[](json& j) { j["data"]["train"][1]["weight"] = "half"; },
       "job.json: data.train[1].weight = \"half\" has the wrong type"},
      {[](json& j) { j["data"]["train"][0].erase("prefix"); },
       "job.json: data.train[0]: missing required field prefix"},
      {[](json& j) { j["data"]["train"][0]["prefix"] = ""; },
       "job.json: data.train[0].prefix must not be empty"},
      {[](json& j) { j["data"]["train"][1]["path"] = "x"; },
       "job.json: data.train[1]: unknown field path"},
      {[](json& j) { j["data"]["train"] = json::array(); },
       "job.json: data.train: a blend needs at least one"},
      {[](json& j) { j["data"]["train"][1] = "prose_train"; }, "job.json: data.train[1] = "},
  };
  for (const auto& c : cases) {
    json j = job("x");
    c.breaks(j);
    try {
      parse_train_job(j, "job.json");
      ADD_FAILURE() << "accepted: " << c.message;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << e.what();
    }
  }
  const TrainJob parsed = parse_train_job(job("x"), "job.json");
  ASSERT_EQ(parsed.train_blend.size(), 2u);
  EXPECT_EQ(parsed.train_blend[1].weight, 1.0);
  EXPECT_TRUE(parsed.train_data.empty());
}

TEST_F(DataBlendTest, TrainsOnABlendInProportionAndResumesBitwise) {
  Quiet quiet;
  const RunSummary straight = train(parse_train_job(job("straight"), "straight.json"), quiet);
  EXPECT_EQ(straight.stop_reason, "completed");
  const TrainJob split = parse_train_job(job("split"), "split.json");
  train(split, quiet, {.resume = true, .stop_at = 3});
  train(split, quiet);
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"}) {
    const auto a = testing::read_bytes(dir_ / "straight/step-00000008" / file);
    ASSERT_FALSE(a.empty()) << file;
    EXPECT_TRUE(a == testing::read_bytes(dir_ / "split/step-00000008" / file))
        << file << " differs between the straight and the resumed run";
  }
  // 8 steps of 2 windows, 3:1.
  const json state =
      json::parse(testing::read_bytes(dir_ / "straight/step-00000008/trainer_state.json"));
  ASSERT_TRUE(state.contains("data_blend")) << state.dump();
  EXPECT_EQ(state["data_blend"][0]["windows"], 12);
  EXPECT_EQ(state["data_blend"][1]["windows"], 4);
  EXPECT_EQ(state["data_blend"][1]["prefix"], prefix("prose_train"));

  // A checkpoint of a single-dataset job does not resume as a blend.
  json single = job("straight");
  single["data"]["train"] = prefix("code_train");
  single["steps"] = 10;
  try {
    train(parse_train_job(single, "single.json"), quiet);
    FAIL() << "resumed a blend's checkpoint without one";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("data blend"), std::string::npos) << e.what();
  }

  // Nor as the same datasets in another order: each cursor belongs to the dataset it was taken
  // on, and applied to another it would skip and repeat data.
  json reordered = job("straight");
  std::swap(reordered["data"]["train"][0], reordered["data"]["train"][1]);
  reordered["steps"] = 10;
  try {
    train(parse_train_job(reordered, "reordered.json"), quiet);
    FAIL() << "resumed a blend's checkpoint onto its datasets reordered";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("data.train[0] is " + prefix("prose_train")),
              std::string::npos)
        << e.what();
  }

  // A trainer_state.json whose cursor is not a count is corrupt, naming the file and the field.
  const auto state_file = dir_ / "straight/step-00000008/trainer_state.json";
  json broken = state;
  broken["data_blend"][1]["position"] = -1;
  testing::write_text(state_file, broken.dump());
  json more = job("straight");
  more["steps"] = 10;
  try {
    train(parse_train_job(more, "more.json"), quiet);
    FAIL() << "resumed from a negative data position";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kCorruptData);
    EXPECT_NE(
        std::string(e.what()).find(state_file.string() + ": field data_blend[1].position is -1"),
        std::string::npos)
        << e.what();
  }
}

TEST_F(DataBlendTest, ADatasetThatDoesNotFitTheModelOrIsMissingFailsByName) {
  Quiet quiet;
  // A record as a SentencePiece dataset of 320 ids would have: more than vocab_size 257.
  data::write_dataset_tokenizer(prefix("prose_train"), {"sentencepiece", "/m.model", "ab", 320, 2});
  try {
    train(parse_train_job(job("vocab"), "job.json"), quiet);
    FAIL() << "trained on ids beyond the vocabulary";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(
        message.find(fmt::format("data.train[1].prefix: {}.tokenizer.json", prefix("prose_train"))),
        std::string::npos)
        << message;
    EXPECT_NE(message.find("(320 tokens)"), std::string::npos) << message;
    EXPECT_NE(message.find("vocab_size=257 (job.json: model.config)"), std::string::npos)
        << message;
  }
  json missing = job("missing");
  missing["data"]["train"][1]["prefix"] = prefix("absent");
  try {
    train(parse_train_job(missing, "job.json"), quiet);
    FAIL() << "trained without a dataset";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound) << e.what();
    EXPECT_NE(std::string(e.what()).find(prefix("absent")), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace megacpp
