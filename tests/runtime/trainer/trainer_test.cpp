// The trainer: a run of 20 steps equals 10 steps, a checkpoint, and 10 more in a
// fresh process, bit for bit; the job file's validation; the CLI's exit codes.
#include "runtime/trainer/trainer.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>

#include "runtime/checkpoint/checkpoint.h"
#include "runtime/common/error.h"
#include "runtime/data/prepare.h"
#include "tests/support/temp_dir.h"

namespace megacpp {
namespace {

using nlohmann::json;
using testing::TempDir;

const std::string kCli = std::string(MEGACPP_BINARY_DIR) + "/bin/megacpp";

json small_model() {
  return json{{"d_model", 32},
              {"pattern", "M*"},
              {"d_intermediate", 32},
              {"vocab_size", 257},
              {"ssm_cfg", {{"d_state", 16}, {"headdim", 16}, {"mimo_rank", 2}, {"chunk_size", 8}}},
              {"attn_cfg", {{"num_heads", 2}, {"rotary_emb_dim", 8}}}};
}

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 12; ++i) {
      testing::write_text(dir_ / ("corpus/file" + std::to_string(i) + ".txt"),
                          testing::pseudo_text(static_cast<uint64_t>(i), 300));
    }
    data::PrepareOptions prepare;
    prepare.input = dir_ / "corpus";
    prepare.output_prefix = dir_ / "data/toy";
    prepare.valid_fraction = 0.2;
    data::prepare_dataset(prepare);
  }

  json job(const std::string& run) const {
    return json{{"model", {{"config", small_model()}}},
                {"data", {{"train", (dir_ / "data/toy_train").string()}, {"valid", (dir_ / "data/toy_valid").string()}}},
                {"steps", 20},
                {"batch", 2},
                {"seqlen", 32},
                {"grad_accum", 2},
                {"optimizer", {{"lr", 0.01}, {"warmup_steps", 4}}},
                {"eval", {{"interval", 5}, {"batches", 2}}},
                {"checkpoint", {{"dir", (dir_ / run).string()}, {"interval", 0}}},
                {"seed", 99}};
  }

  std::filesystem::path write_job(const std::string& name, const json& j) const {
    const auto path = dir_ / (name + ".json");
    std::ofstream(path) << j.dump(2);
    return path;
  }

  static int run_cli(const std::string& args) {
    const int status = std::system((kCli + " " + args + " > /dev/null 2>&1").c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  TempDir dir_;
};

TEST_F(TrainerTest, TwentyStepsEqualTenSaveLoadInFreshProcessTenMoreBitwise) {
  const auto straight = write_job("straight", job("straight"));
  const auto split = write_job("split", job("split"));
  ASSERT_EQ(run_cli("train --quiet " + straight.string()), 0);
  ASSERT_EQ(run_cli("train --quiet --stop-at 10 " + split.string()), 0);
  ASSERT_TRUE(std::filesystem::exists(dir_ / "split/step-00000010/model.safetensors"));
  ASSERT_FALSE(std::filesystem::exists(dir_ / "split/step-00000020"));
  ASSERT_EQ(run_cli("train --quiet " + split.string()), 0);  // a fresh process resumes
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "trainer_state.json", "config.json"}) {
    const auto a = testing::read_bytes(dir_ / "straight/step-00000020" / file);
    const auto b = testing::read_bytes(dir_ / "split/step-00000020" / file);
    ASSERT_FALSE(a.empty()) << file;
    EXPECT_TRUE(a == b) << file << " differs between the straight and the resumed run";
  }
  // The resumed run's step records continue where the first stopped.
  std::ifstream log(dir_ / "split/steps.jsonl");
  std::vector<int64_t> steps;
  for (std::string line; std::getline(log, line);) {
    const json j = json::parse(line);
    if (j["type"] == "step") steps.push_back(j["step"].get<int64_t>());
  }
  ASSERT_EQ(steps.size(), 20u);
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i], static_cast<int64_t>(i + 1));
  // Training learned something, and eval reads the checkpoint back.
  const auto r = evaluate_checkpoint(dir_ / "split/step-00000020", dir_ / "data/toy_valid", 32, 2, 0);
  EXPECT_LT(r.loss, std::log(257.0) - 1.0);
  EXPECT_GT(r.windows, 0);
}

TEST_F(TrainerTest, ResumeRefusesADifferentModel) {
  const auto first = write_job("first", job("run"));
  ASSERT_EQ(run_cli("train --quiet --stop-at 2 " + first.string()), 0);
  json other = job("run");
  other["model"]["config"]["d_model"] = 48;
  try {
    TrainJob parsed = parse_train_job(other, "other.json");
    struct Quiet final : TrainingObserver {
      void on_start(const json&) override {}
      void on_step(const StepRecord&) override {}
      void on_eval(const EvalRecord&) override {}
      void on_checkpoint(int64_t, const std::filesystem::path&) override {}
      void on_finish(const RunSummary&) override {}
    } quiet;
    train(parsed, quiet);
    FAIL() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("model config differs"), std::string::npos) << e.what();
  }
}

TEST_F(TrainerTest, JobValidationNamesTheField) {
  struct Case {
    std::function<void(json&)> breaks;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["batch"] = 0; }, "batch=0 must be positive"},
      {[](json& j) { j["seqlen"] = 1; }, "seqlen=1 must be at least 2"},
      {[](json& j) { j.erase("steps"); }, "missing required field steps"},
      {[](json& j) { j["stepz"] = 3; }, "unknown field stepz"},
      {[](json& j) { j["optimizer"]["lr"] = -1; }, "optimizer.lr=-1 must be positive"},
      {[](json& j) { j["optimizer"]["beta2"] = 1.0; }, "beta2=1 must be in [0, 1)"},
      {[](json& j) { j["scan"] = "fast"; }, "scan=\"fast\""},
      {[](json& j) { j["model"] = json{{"preset", "huge"}}; }, "unknown model preset \"huge\""},
      {[](json& j) { j["model"]["config"]["ssm_cfg"]["headdim"] = 12; }, "ssm_cfg.headdim=12 does not divide d_inner=64"},
      {[](json& j) { j["data"].erase("train"); }, "missing required field train"},
      {[](json& j) { j["grad_accum"] = "two"; }, "grad_accum"},
  };
  for (const auto& c : cases) {
    json j = job("x");
    c.breaks(j);
    try {
      parse_train_job(j, "job.json");
      ADD_FAILURE() << "accepted: " << c.message;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << e.what();
    }
  }
}

TEST_F(TrainerTest, CliExitCodes) {
  json bad = job("x");
  bad["batch"] = -3;
  EXPECT_EQ(run_cli("train " + write_job("bad", bad).string()), 2);
  EXPECT_EQ(run_cli("eval --checkpoint " + (dir_ / "nowhere").string() + " --data " +
                    (dir_ / "data/toy_valid").string()),
            2);
  EXPECT_EQ(run_cli("data stats " + (dir_ / "data/toy_valid").string()), 0);
  EXPECT_EQ(run_cli("no-such-command"), 2);
  EXPECT_EQ(run_cli("train"), 2);  // the job file is required
  EXPECT_EQ(run_cli("--version"), 0);
}

TEST(LearningRate, WarmupThenCosineToMinimum) {
  OptimizerConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(learning_rate(c, 1, 100), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(c, 10, 100), 1.0);
  EXPECT_NEAR(learning_rate(c, 55, 100), 0.55, 1e-12);
  EXPECT_NEAR(learning_rate(c, 100, 100), 0.1, 1e-12);
}

}  // namespace
}  // namespace megacpp
