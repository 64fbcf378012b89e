// The trainer: a run of 20 steps equals 10 steps, a checkpoint, and 10 more in a
// fresh process, bit for bit; the job file's validation; the CLI's exit codes.
#include "runtime/trainer/trainer.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <memory>

#include "base/error.h"
#include "base/json_file.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/data/blended_loader.h"
#include "runtime/data/indexed_dataset.h"
#include "runtime/data/prepare.h"
#include "runtime/data/sequence_loader.h"
#include "runtime/model/model.h"
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
                {"data",
                 {{"train", (dir_ / "data/toy_train").string()},
                  {"valid", (dir_ / "data/toy_valid").string()}}},
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
  for (const char* file :
       {"model.safetensors", "optimizer.safetensors", "trainer_state.json", "config.json"}) {
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
  const auto r =
      evaluate_checkpoint(dir_ / "split/step-00000020", dir_ / "data/toy_valid", 32, 2, 0);
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
      {[](json& j) {
         j["model"] = json{{"preset", "huge"}};
       },
       "unknown model preset \"huge\""},
      {[](json& j) {
         j["model"] = json{{"preset", 1}};
       },
       "job.json: model.preset = 1 must be a string"},
      {[](json& j) {
         j["model"] = json{{"config_file", json::array()}};
       },
       "job.json: model.config_file = [] must be a string"},
      {[](json& j) { j["model"]["config"]["ssm_cfg"]["headdim"] = 12; },
       "ssm_cfg.headdim=12 does not divide d_inner=64"},
      {[](json& j) { j["data"].erase("train"); }, "missing required field train"},
      {[](json& j) { j["grad_accum"] = "two"; }, "grad_accum"},
      {[](json& j) { j["device"] = "tpu"; }, "device=\"tpu\" must be \"cpu\" or \"cuda\""},
      {[](json& j) { j["gpu"] = -1; }, "gpu=-1 must be >= 0"},
      {[](json& j) { j["recompute_in_proj"] = true; },
       "recompute_in_proj=true needs device=\"cuda\""},
      {[](json& j) { j["recompute_in_proj"] = 1; },
       "field recompute_in_proj = 1 has the wrong type"},
      {[](json& j) {
         j["device"] = "cuda";
         j["attention"] = "flash";
       },
       "attention=\"flash\" must be \"cudnn\""},
      {[](json& j) { j["attention"] = "megacpp"; }, "attention needs device=\"cuda\""},
      {[](json& j) { j["deterministic"] = false; }, "deterministic=false needs device=\"cuda\""},
      {[](json& j) {
         j["device"] = "cuda";
         j["attention"] = "megacpp";
         j["deterministic"] = false;
       },
       "deterministic=false with attention=\"megacpp\" changes nothing"},
      {[](json& j) {
         j["device"] = "cuda";
         j["deterministic"] = "yes";
       },
       "field deterministic = \"yes\" has the wrong type"},
      {[](json& j) {
         // Four Mamba heads split over four ranks, but 1 x 2 rows cannot be.
         j["model"]["config"]["pattern"] = "MM";
         j["device"] = "cuda";
         j["device_count"] = 4;
         j["tensor_parallel"] = 4;
         j["batch"] = 1;
         j["seqlen"] = 2;
       },
       "micro-batch 2 rows: tensor_parallel=4 leaves its last rank none of a micro-batch's 2 rows"},
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

// Grounds for refusal that used to pass: integers cut to 32 bits (2^40 became 0), no
// upper bounds (grad_accum = 2^31 - 1 hangs a device on one step, threads = 100000
// brings the executor down), and NaN or infinities, which pass `x < bound` tests and
// were written back to JSON as null, silently turning into the default.
TEST_F(TrainerTest, EveryNumericFieldIsBoundedAndFinite) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::function<void(json&)> breaks;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["grad_accum"] = 2147483647; }, "grad_accum=2147483647 must be at most 1024"},
      {[](json& j) { j["threads"] = 100000; }, "threads=100000 must be at most 1024"},
      {[](json& j) { j["batch"] = int64_t{1} << 40; }, "batch=1099511627776 must be at most"},
      {[](json& j) { j["seqlen"] = (int64_t{1} << 32) + 64; }, "seqlen=4294967360 must be at most"},
      {[](json& j) { j["steps"] = int64_t{1} << 50; }, "steps=1125899906842624 must be at most"},
      {[](json& j) {
         j["batch"] = 1 << 16;
         j["seqlen"] = 1 << 16;
       },
       "batch·seqlen = 65536·65536 = 4294967296 must be at most 2147483647"},
      {[](json& j) { j["optimizer"]["warmup_steps"] = int64_t{1} << 40; },
       "optimizer.warmup_steps=1099511627776 must be at most"},
      {[](json& j) { j["eval"]["interval"] = (int64_t{1} << 32) + 5; },
       "eval: interval=4294967301 must be at most"},
      {[](json& j) { j["eval"]["batches"] = -1; }, "eval: batches=-1 must be >= 0"},
      {[](json& j) { j["checkpoint"]["interval"] = (int64_t{1} << 32) + 5; },
       "checkpoint: interval=4294967301 must be at most"},
      {[](json& j) { j["checkpoint"]["keep_last"] = -1; }, "checkpoint: keep_last=-1 must be >= 0"},
      {[](json& j) { j["checkpoint"]["min_free_bytes"] = -1; },
       "checkpoint: min_free_bytes=-1 must be >= 0"},
      {[](json& j) { j["seed"] = -1; }, "seed=-1 must be an integer in [0, 2^64)"},
      {[&](json& j) { j["optimizer"]["min_lr"] = nan; },
       "optimizer.min_lr=nan must be a finite number"},
      {[&](json& j) { j["optimizer"]["lr"] = inf; }, "optimizer.lr=inf must be a finite number"},
      {[&](json& j) { j["optimizer"]["grad_clip"] = inf; }, "optimizer.grad_clip=inf"},
      {[&](json& j) { j["optimizer"]["weight_decay"] = nan; }, "optimizer.weight_decay=nan"},
      {[&](json& j) { j["optimizer"]["beta1"] = nan; }, "optimizer.beta1=nan"},
      {[&](json& j) { j["optimizer"]["beta2"] = -inf; }, "optimizer.beta2=-inf"},
      {[&](json& j) { j["optimizer"]["eps"] = inf; }, "optimizer.eps=inf"},
      {[&](json& j) { j["max_seconds"] = nan; }, "max_seconds=nan must be a finite number"},
      {[&](json& j) { j["max_seconds"] = inf; }, "max_seconds=inf must be a finite number"},
      {[](json& j) { j["optimizer"]["lr"] = 1e6; },
       "optimizer.lr=1000000 must be positive and at most 10"},
      {[](json& j) { j["model"]["config"]["d_model"] = int64_t{1} << 40; },
       "d_model=1099511627776 must be at most"},
  };
  for (const auto& c : cases) {
    json j = job("x");
    c.breaks(j);
    try {
      parse_train_job(j, "job.json");
      ADD_FAILURE() << "accepted: " << c.message;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << e.what();
    }
  }
  // The bounds themselves are accepted.
  json edge = job("x");
  edge["grad_accum"] = TrainJobLimits::kMaxGradAccum;
  edge["threads"] = TrainJobLimits::kMaxThreads;
  edge["seed"] = std::numeric_limits<uint64_t>::max();
  edge["checkpoint"]["keep_last"] = 0;
  edge["checkpoint"]["min_free_bytes"] = std::numeric_limits<int64_t>::max();
  const TrainJob parsed = parse_train_job(edge, "job.json");
  EXPECT_EQ(parsed.grad_accum, TrainJobLimits::kMaxGradAccum);
  EXPECT_EQ(parsed.seed, std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(parsed.keep_last, 0);
  EXPECT_EQ(parsed.min_free_bytes, static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
  EXPECT_EQ(parse_train_job(job("x"), "job.json").keep_last, 3);  // the default
}

struct QuietObserver : TrainingObserver {
  void on_start(const json&) override {}
  void on_step(const StepRecord&) override {}
  void on_eval(const EvalRecord&) override {}
  void on_checkpoint(int64_t, const std::filesystem::path&) override {}
  void on_finish(const RunSummary&) override {}
};

// Truncating the training data under a running job used to kill it with SIGBUS (the
// executor died with an empty log); it must fail with an error naming the file.
TEST_F(TrainerTest, DatasetTruncatedWhileTrainingFailsNamingTheFile) {
  const std::filesystem::path bin = dir_ / "data/toy_train.bin";
  struct Truncating final : QuietObserver {
    std::filesystem::path file;
    void on_step(const StepRecord& r) override {
      if (r.step == 2) std::filesystem::resize_file(file, 0);
    }
  } observer;
  observer.file = bin;
  const TrainJob parsed = parse_train_job(job("trunc"), "job.json");
  try {
    train(parsed, observer);
    FAIL() << "training went on over a truncated dataset";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kCorruptData);
    EXPECT_NE(std::string(e.what()).find(bin.string() + ": changed while in use"),
              std::string::npos)
        << e.what();
  }
}

// A validation set of fewer windows than one batch cannot be evaluated: the job fails naming it
// before its first step, not at the evaluation before its final checkpoint (which lost the run).
TEST_F(TrainerTest, AValidationSetSmallerThanABatchFailsBeforeTraining) {
  const auto valid = dir_ / "data/toy_valid";
  const int64_t windows = data::num_eval_windows(data::IndexedDataset(valid), 32);
  ASSERT_GT(windows, 0);
  json j = job("small-valid");
  j["batch"] = windows + 1;
  struct Counting final : QuietObserver {
    int steps = 0;
    void on_step(const StepRecord&) override { ++steps; }
  } observer;
  try {
    train(parse_train_job(j, "job.json"), observer);
    FAIL() << "a job whose validation set holds less than one batch trained";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    const std::string message = e.what();
    EXPECT_NE(message.find("data.valid " + valid.string()), std::string::npos) << message;
    EXPECT_NE(message.find("fewer than one batch of " + std::to_string(windows + 1)),
              std::string::npos)
        << message;
  }
  EXPECT_EQ(observer.steps, 0);
}

std::vector<std::string> step_dirs(const std::filesystem::path& run) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(run)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory()) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// A cuda job on a machine without a usable GPU (or a build without CUDA) fails before the first
// step with a precondition error that says so; nothing falls back to the CPU.
TEST_F(TrainerTest, ACudaJobWithoutAUsableGpuFailsInsteadOfFallingBack) {
  json j = job("cuda");
  j["device"] = "cuda";
  QuietObserver quiet;
  try {
    const RunSummary summary = train(parse_train_job(j, "job.json"), quiet);
    if (summary.device.rfind("cuda", 0) == 0) GTEST_SKIP() << "this machine has a GPU";
    ADD_FAILURE() << "a cuda job ran on " << summary.device;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFailedPrecondition) << e.what();
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "cuda/step-00000020"));
}

// The run summary's JSON (what the daemon records) has the plan_cache block and the error only
// where a run has them: a CPU run builds no GEMM plans, a run that completed broke no contract.
TEST(RunSummaryJson, CarriesPlanCacheAndErrorOnlyWhenSet) {
  RunSummary s;
  s.stop_reason = "completed";
  const json plain = to_json(s);
  EXPECT_FALSE(plain.contains("plan_cache"));
  EXPECT_FALSE(plain.contains("error"));
  s.stop_reason = "contract_violation";
  s.error = "contract violation: 6 GEMM plan(s) built after step 1, over recompile_budget=0";
  s.plan_cache = {{"path", "/cache/plans/x.plans"}, {"hits", 3},  {"builds", 7}, {"stale", 0},
                  {"builds_after_first_step", 6},   {"budget", 0}};
  const json j = to_json(s);
  EXPECT_EQ(j["stop_reason"], "contract_violation");
  EXPECT_EQ(j["error"], s.error);
  EXPECT_EQ(j["plan_cache"]["builds_after_first_step"], 6);
  EXPECT_EQ(j["plan_cache"]["budget"], 0);
}

// Retention: the newest keep_last checkpoints (and the final one) stay, older ones go;
// a resumed run still matches an uninterrupted one bit for bit.
TEST_F(TrainerTest, OldCheckpointsArePrunedToKeepLast) {
  json j = job("kept");
  j["steps"] = 10;
  j["eval"]["interval"] = 0;
  j["checkpoint"]["interval"] = 2;
  j["checkpoint"]["keep_last"] = 2;
  QuietObserver quiet;
  TrainOptions first;
  first.stop_at = 7;  // checkpoints 2, 4, 6 and the stop at 7
  train(parse_train_job(j, "job.json"), quiet, first);
  EXPECT_EQ(step_dirs(dir_ / "kept"), (std::vector<std::string>{"step-00000006", "step-00000007"}));
  train(parse_train_job(j, "job.json"), quiet);  // resumes from 7: 8, 10 (final)
  EXPECT_EQ(step_dirs(dir_ / "kept"), (std::vector<std::string>{"step-00000008", "step-00000010"}));
  EXPECT_EQ(latest_checkpoint(dir_ / "kept")->filename(), "step-00000010");

  json straight = job("straight");
  straight["steps"] = 10;
  straight["eval"]["interval"] = 0;
  straight["checkpoint"]["interval"] = 2;
  straight["checkpoint"]["keep_last"] = 0;  // keeps every one
  train(parse_train_job(straight, "job.json"), quiet);
  EXPECT_EQ(step_dirs(dir_ / "straight").size(), 5u);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_EQ(testing::read_bytes(dir_ / "kept/step-00000010" / file),
              testing::read_bytes(dir_ / "straight/step-00000010" / file))
        << file;
  }
}

// init.checkpoint: the run starts from the checkpoint's weights (its first step's loss is that
// model's loss on the first batch) with a fresh optimizer at step 1; a later resume from the
// run's own checkpoint takes precedence and no longer needs the init directory.
TEST_F(TrainerTest, InitCheckpointStartsFromItsWeightsWithAFreshOptimizer) {
  json source = job("source");
  source["steps"] = 3;
  source["eval"]["interval"] = 0;
  QuietObserver quiet;
  train(parse_train_job(source, "source.json"), quiet);
  // A copy outside the run, as an imported checkpoint would be: config.json + model.safetensors.
  const auto init = dir_ / "init";
  std::filesystem::create_directories(init);
  for (const char* file : {"config.json", "model.safetensors"}) {
    std::filesystem::copy_file(dir_ / "source/step-00000003" / file, init / file);
  }

  json j = job("from-init");
  j["steps"] = 2;
  j["grad_accum"] = 1;
  j["eval"]["interval"] = 0;
  j["init"] = {{"checkpoint", init.string()}};
  struct Recording final : QuietObserver {
    std::vector<StepRecord> steps;
    int64_t first_step = 0;
    void on_start(const json& info) override { first_step = info["first_step"].get<int64_t>(); }
    void on_step(const StepRecord& r) override { steps.push_back(r); }
  } recorded;
  TrainOptions stop;
  stop.stop_at = 1;
  const TrainJob parsed = parse_train_job(j, "job.json");
  EXPECT_EQ(parsed.init_checkpoint, init);
  train(parsed, recorded, stop);
  ASSERT_EQ(recorded.first_step, 1);
  ASSERT_EQ(recorded.steps.size(), 1u);

  // The checkpoint's model on the job's first batch.
  Model<float> loaded(load_checkpoint_config(init));
  load_model_weights(init, loaded);
  loaded.plan(j["batch"].get<int>(), j["seqlen"].get<int>());
  data::BlendedLoader loader(
      {{std::make_shared<const data::IndexedDataset>(dir_ / "data/toy_train"), 1.0}},
      j["seqlen"].get<int>());
  std::vector<int32_t> tokens(static_cast<size_t>(2 * (32 + 1)));
  loader.next_batch(2, tokens.data());
  EXPECT_NEAR(recorded.steps[0].loss, loaded.forward(tokens.data()), 1e-6);
  // Not the job's own random init (seed 99, the source run's start) on that batch.
  Model<float> random_init(load_checkpoint_config(init));
  random_init.init_parameters(99);
  random_init.plan(2, 32);
  EXPECT_GT(std::abs(recorded.steps[0].loss - random_init.forward(tokens.data())), 1e-3);

  // Fresh optimizer: one AdamW step taken, not the source's three plus one.
  std::map<std::string, std::string> metadata;
  load_safetensors(dir_ / "from-init/step-00000001/optimizer.safetensors", &metadata);
  EXPECT_EQ(metadata.at("steps_taken"), "1");
  EXPECT_EQ(load_json_file(dir_ / "from-init/step-00000001/trainer_state.json")["step"], 1);

  // Resume wins over init: with the init directory gone, the run continues from its step 1.
  std::filesystem::remove_all(init);
  recorded.steps.clear();
  train(parse_train_job(j, "job.json"), recorded);
  EXPECT_EQ(recorded.first_step, 2);
  ASSERT_EQ(recorded.steps.size(), 1u);
  EXPECT_EQ(recorded.steps[0].step, 2);
}

TEST_F(TrainerTest, BadInitCheckpointIsRefusedNamingTheField) {
  const std::vector<std::pair<json, const char*>> parse_cases = {
      {"runs/x", "job.json: init = \"runs/x\" must be {\"checkpoint\": DIR}"},
      {json::object(), "job.json: init: missing required field checkpoint"},
      {{{"checkpoint", ""}}, "job.json: init.checkpoint must not be empty"},
      {{{"checkpoint", 3}}, "job.json: init: field checkpoint = 3 has the wrong type"},
      {{{"checkpoint", "d"}, {"optimizer", true}}, "job.json: init: unknown field optimizer"},
  };
  for (const auto& [init, message] : parse_cases) {
    json j = job("x");
    j["init"] = init;
    try {
      parse_train_job(j, "job.json");
      ADD_FAILURE() << "accepted: " << message;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }

  QuietObserver quiet;
  const auto expect_refusal = [&](const json& j, ErrorKind kind, const std::string& message) {
    try {
      train(parse_train_job(j, "job.json"), quiet);
      ADD_FAILURE() << "trained: " << message;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  json j = job("bad-init");
  j["steps"] = 1;
  j["init"] = {{"checkpoint", (dir_ / "nowhere").string()}};
  expect_refusal(j, ErrorKind::kNotFound,
                 "init.checkpoint=" + (dir_ / "nowhere").string() + ": no config.json there");
  EXPECT_FALSE(std::filesystem::exists(dir_ / "bad-init/latest"));

  // Another model's checkpoint.
  json other = job("other");
  other["steps"] = 1;
  other["model"]["config"]["d_model"] = 48;
  train(parse_train_job(other, "other.json"), quiet);
  j["init"] = {{"checkpoint", (dir_ / "other/step-00000001").string()}};
  expect_refusal(j, ErrorKind::kFailedPrecondition,
                 "init.checkpoint=" + (dir_ / "other/step-00000001").string() +
                     ": the checkpoint's model config");
  // Weights that do not match its own config name the tensor.
  const auto broken = dir_ / "broken";
  std::filesystem::create_directories(broken);
  std::filesystem::copy_file(dir_ / "other/step-00000001/model.safetensors",
                             broken / "model.safetensors");
  std::ofstream(broken / "config.json")
      << model_config_to_json(parse_model_config(small_model(), "small")).dump();
  j["init"] = {{"checkpoint", broken.string()}};
  expect_refusal(
      j, ErrorKind::kInvalidArgument,
      "init.checkpoint=" + broken.string() + ": " + (broken / "model.safetensors").string());
}

// The free-space floor: a checkpoint that would cross min_free_bytes fails the run
// with the directory, the free bytes, the checkpoint's size and the floor, and writes
// nothing.
TEST_F(TrainerTest, CheckpointThatWouldCrossTheFloorFailsTheRun) {
  json j = job("floor");
  j["steps"] = 4;
  j["checkpoint"]["interval"] = 2;
  j["checkpoint"]["min_free_bytes"] = int64_t{1} << 62;
  QuietObserver quiet;
  try {
    train(parse_train_job(j, "job.json"), quiet);
    FAIL() << "a checkpoint crossed the floor";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kFailedPrecondition);
    EXPECT_NE(message.find((dir_ / "floor").string() + ": a checkpoint of about "),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("bytes free and must keep min_free_bytes=4611686018427387904"),
              std::string::npos)
        << message;
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "floor/step-00000002"));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "floor/latest"));
}

TEST_F(TrainerTest, CliExitCodes) {
  json bad = job("x");
  bad["batch"] = -3;
  EXPECT_EQ(run_cli("train " + write_job("bad", bad).string()), 2);
  EXPECT_EQ(run_cli("eval --checkpoint " + (dir_ / "nowhere").string() + " --data " +
                    (dir_ / "data/toy_valid").string()),
            4);  // not found: the one exit-code table (cli/commands/exit_codes.h)
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
