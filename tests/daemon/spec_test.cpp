// Job spec validation (daemon/job_spec.cpp), what SubmitJob runs before anything is
// queued: every numeric field bounded and finite, 64-bit config values refused by their
// real value, a job that cannot fit in memory refused with the estimate, and the
// checkpoint floor and retention carried to the trainer. The last test submits to a
// real daemon.
#include "daemon/job_spec.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <thread>

#include "base/error.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/config/model_config.h"
#include "runtime/data/prepare.h"
#include "runtime/model/model.h"
#ifdef MEGACPP_HAVE_CUDA
#include "runtime/model/cuda_model.h"
#include "tests/support/gpu.h"
#endif
#include "runtime/trainer/trainer.h"
#include "tests/daemon/daemon_harness.h"

namespace megacpp {
namespace {

namespace v1 = megacpp::v1;
using daemon::MemoryBudget;
using daemon::validate_job_spec;
using nlohmann::json;

constexpr uint64_t kGiB = uint64_t{1} << 30;

class SpecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 4; ++i) {
      testing::write_text(dir_ / ("corpus/f" + std::to_string(i) + ".txt"),
                          testing::pseudo_text(static_cast<uint64_t>(i), 200));
    }
    data::PrepareOptions prepare;
    prepare.input = dir_ / "corpus";
    prepare.output_prefix = dir_ / "data/toy";
    prepare.valid_fraction = 0.25;
    data::prepare_dataset(prepare);
    config_.data_roots = {std::filesystem::canonical(dir_ / "data")};
    config_.checkpoint_root = dir_ / "checkpoints";
    config_.min_free_bytes = 12345678;
    config_.cache_dirs = {dir_ / "cache"};
  }

  v1::JobSpec small_job() const {
    v1::JobSpec spec;
    spec.set_config_json(
        R"({"d_model": 32, "pattern": "M*", "d_intermediate": 32, "vocab_size": 257,
        "ssm_cfg": {"d_state": 16, "headdim": 16, "mimo_rank": 2, "chunk_size": 8},
        "attn_cfg": {"num_heads": 2, "rotary_emb_dim": 8}})");
    spec.set_train_data((config_.data_roots[0] / "toy_train").string());
    spec.set_valid_data((config_.data_roots[0] / "toy_valid").string());
    spec.set_steps(5);
    spec.set_batch(2);
    spec.set_seqlen(32);
    spec.set_threads(1);
    return spec;
  }

  daemon::ValidatedJob validate(const v1::JobSpec& spec, MemoryBudget budget = {8 * kGiB, 0},
                                int gpus = 0) const {
    return validate_job_spec(spec, config_, 2, gpus, dir_ / "checkpoints/job-1", budget);
  }

  // The message of the refusal, or "" when the spec was accepted.
  std::string refusal(const v1::JobSpec& spec, MemoryBudget budget = {8 * kGiB, 0}) const {
    try {
      validate(spec, budget);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      return e.what();
    }
    return "";
  }

  testing::TempDir dir_;
  DaemonConfig config_;
};

struct Case {
  const char* name;
  std::function<void(v1::JobSpec&)> breaks;
  std::string message;
};

void expect_refusals(const std::vector<Case>& cases,
                     const std::function<std::string(const v1::JobSpec&)>& refusal,
                     const v1::JobSpec& base) {
  for (const Case& c : cases) {
    v1::JobSpec spec = base;
    c.breaks(spec);
    const std::string message = refusal(spec);
    EXPECT_NE(message.find(c.message), std::string::npos)
        << c.name << ": expected \"" << c.message << "\", got \"" << message << "\"";
  }
}

// Accepted before: grad_accum = 2^31 - 1 (hangs a slot for ever), threads = 100000
// (segfaults the executor), NaN and infinities in the float fields (several were
// written to job.json as null and replaced by defaults, while the store kept the NaN),
// unbounded max_restarts; and d_model = 2^40 was reported as "d_model=0".
TEST_F(SpecTest, EveryNumericFieldIsBoundedAndFinite) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<Case> cases = {
      {"grad_accum", [](v1::JobSpec& s) { s.set_grad_accum(2147483647); },
       "grad_accum=2147483647 must be at most 1024"},
      {"threads", [](v1::JobSpec& s) { s.set_threads(100000); },
       "threads=100000 must be at most 1024"},
      {"steps", [](v1::JobSpec& s) { s.set_steps(int64_t{1} << 40); },
       "steps=1099511627776 must be at most"},
      {"min_lr", [&](v1::JobSpec& s) { s.mutable_optimizer()->set_min_lr(nan); },
       "optimizer.min_lr=nan must be a finite number"},
      {"grad_clip", [&](v1::JobSpec& s) { s.mutable_optimizer()->set_grad_clip(inf); },
       "optimizer.grad_clip=inf must be a finite number"},
      {"weight_decay", [&](v1::JobSpec& s) { s.mutable_optimizer()->set_weight_decay(nan); },
       "optimizer.weight_decay=nan"},
      {"beta1", [&](v1::JobSpec& s) { s.mutable_optimizer()->set_beta1(nan); },
       "optimizer.beta1=nan"},
      {"beta2", [&](v1::JobSpec& s) { s.mutable_optimizer()->set_beta2(-inf); },
       "optimizer.beta2=-inf"},
      {"eps", [&](v1::JobSpec& s) { s.mutable_optimizer()->set_eps(inf); }, "optimizer.eps=inf"},
      {"lr", [&](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(inf); }, "optimizer.lr=inf"},
      {"max_seconds nan", [&](v1::JobSpec& s) { s.set_max_seconds(nan); },
       "max_seconds=nan must be a finite number"},
      {"max_seconds inf", [&](v1::JobSpec& s) { s.set_max_seconds(inf); },
       "max_seconds=inf must be a finite number"},
      {"max_restarts high",
       [](v1::JobSpec& s) {
         s.set_restart_policy(v1::RESTART_POLICY_ON_FAILURE);
         s.set_max_restarts(1000000);
       },
       "max_restarts=1000000 must be in [0, 100]"},
      {"max_restarts negative", [](v1::JobSpec& s) { s.set_max_restarts(-1); },
       "max_restarts=-1 must be in [0, 100]"},
      {"recompile_budget negative", [](v1::JobSpec& s) { s.set_recompile_budget(-1); },
       "recompile_budget=-1 must be in [0, 1000000]"},
      {"recompile_budget high", [](v1::JobSpec& s) { s.set_recompile_budget(int64_t{1} << 40); },
       "recompile_budget=1099511627776 must be in [0, 1000000]"},
      {"restart_policy",
       [](v1::JobSpec& s) { s.set_restart_policy(static_cast<v1::RestartPolicy>(99)); },
       "restart_policy=99 is not a RestartPolicy value"},
      {"keep_last", [](v1::JobSpec& s) { s.set_checkpoint_keep_last(-2); },
       "checkpoint_keep_last=-2 must be in [0,"},
      {"d_model 2^40",
       [](v1::JobSpec& s) {
         s.set_config_json(R"({"d_model": 1099511627776, "pattern": "M", "vocab_size": 257})");
       },
       "d_model=1099511627776 must be at most 1048576"},
      {"a number past the double range",
       [](v1::JobSpec& s) {
         s.set_config_json(R"({"d_model": 32, "pattern": "*", "vocab_size": 257,
             "attn_cfg": {"num_heads": 2, "softmax_scale": 1e400}})");
       },
       "config_json is not valid JSON"},
  };
  expect_refusals(
      cases, [&](const v1::JobSpec& s) { return refusal(s); }, small_job());
  // Each bound itself is accepted.
  v1::JobSpec edge = small_job();
  edge.set_grad_accum(TrainJobLimits::kMaxGradAccum);
  edge.set_threads(TrainJobLimits::kMaxThreads);
  edge.set_restart_policy(v1::RESTART_POLICY_ON_FAILURE);
  edge.set_max_restarts(daemon::kMaxRestarts);
  edge.set_recompile_budget(TrainJobLimits::kMaxRecompileBudget);
  EXPECT_EQ(refusal(edge), "");
}

// Refused at submit with the estimate, rather than dying of bad_alloc once running.
TEST_F(SpecTest, JobThatCannotFitIsRefusedWithTheEstimate) {
  v1::JobSpec wide = small_job();
  wide.set_config_json(R"({"d_model": 1048576, "pattern": "M*", "vocab_size": 257,
      "ssm_cfg": {"d_state": 16, "headdim": 64}, "attn_cfg": {"num_heads": 16}})");
  std::string message = refusal(wide);
  EXPECT_NE(message.find("the job needs about"), std::string::npos) << message;
  EXPECT_NE(message.find("weights"), std::string::npos) << message;
  EXPECT_NE(message.find("AdamW moments"), std::string::npos) << message;
  EXPECT_NE(message.find("activations"), std::string::npos) << message;
  EXPECT_NE(message.find("more than the 8589934592 bytes this host has available"),
            std::string::npos)
      << message;
  // Against the host's own memory as well (no budget given).
  message = refusal(wide, MemoryBudget{});
  EXPECT_NE(message.find("the job needs about"), std::string::npos) << message;
  EXPECT_NE(message.find("MemAvailable"), std::string::npos) << message;

  v1::JobSpec rows = small_job();
  rows.set_batch(65536);
  rows.set_seqlen(65536);  // batch·seqlen = 2^32
  message = refusal(rows);
  EXPECT_NE(message.find("spec.batch=65536, seqlen=65536: the job needs about"), std::string::npos)
      << message;

  // A small budget refuses even the small job; a fitting one accepts it.
  message = refusal(small_job(), MemoryBudget{1 << 20, 0});
  EXPECT_NE(message.find("more than the 1048576 bytes"), std::string::npos) << message;
  EXPECT_EQ(refusal(small_job()), "");
  EXPECT_EQ(refusal(small_job(), MemoryBudget{}), "");
}

// A cuda job is measured against one GPU's memory by the CUDA model's own plan for it
// (CudaModel::plan_memory), with its gates: anchors.md's bench-350m at micro-batch 4 x 8192 fits
// an 80 GB H100 (the CPU model's estimate, fp32 throughout, said 315 GiB), and a GPU between its
// needs with and without recompute_in_proj takes it only with the gate, as the refusal says.
TEST_F(SpecTest, ACudaJobIsMeasuredByTheCudaModelsPlanWithItsGates) {
#ifdef MEGACPP_HAVE_CUDA
  MEGACPP_REQUIRE_GPU();  // the plan asks CUB for its sort sizes, which needs a device
  v1::JobSpec cuda = small_job();
  cuda.set_device_kind("cuda");
  try {
    validate(cuda, MemoryBudget{0, 1 << 20}, 1);
    ADD_FAILURE() << "a cuda job larger than the GPU was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than a GPU's 1048576 bytes"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(validate(cuda, MemoryBudget{0, 0}, 1));  // memory unknown: not checked

  v1::JobSpec bench = cuda;
  bench.set_preset("bench-350m");
  bench.set_batch(4);
  bench.set_seqlen(8192);
  bench.clear_valid_data();
  const uint64_t h100 = uint64_t{85'017'493'504};  // an H100 80GB HBM3's total memory
  EXPECT_NO_THROW(validate(bench, MemoryBudget{0, h100}, 1));
  const ModelConfig config = model_preset("bench-350m");
  const uint64_t kept = CudaModel::plan_memory(config, 4, 8192).total();
  const uint64_t lean = CudaModel::plan_memory(config, 4, 8192, 1, 0, {true}).total();
  ASSERT_LT(lean, kept);
  const uint64_t between = kGiB * 2 + (kept + lean) / 2;  // 2 GiB: the daemon's allowance
  std::string message;
  try {
    validate(bench, MemoryBudget{0, between}, 1);
    ADD_FAILURE() << "bench-350m was accepted on a GPU it needs recompute_in_proj to fit";
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("spec.batch=4, seqlen=8192: each GPU of this cuda job needs"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("or ask for the recompute_in_proj feature gate"), std::string::npos)
      << message;
  bench.add_feature_gates("recompute_in_proj");
  EXPECT_NO_THROW(validate(bench, MemoryBudget{0, between}, 1));

  // The deterministic attention backward's dS workspace: a GPU between the needs with and
  // without it takes the job only with the nondeterministic_attention gate, which the train job
  // then carries as deterministic=false.
  const uint64_t summed_in_any_order =
      CudaModel::plan_memory(config, 4, 8192, 1, 0,
                             CudaModelOptions{.recompute_in_proj = true, .deterministic = false})
          .total();
  ASSERT_LT(summed_in_any_order, lean);
  const uint64_t below_ds = kGiB * 2 + (lean + summed_in_any_order) / 2;
  message.clear();
  try {
    validate(bench, MemoryBudget{0, below_ds}, 1);
    ADD_FAILURE() << "bench-350m was accepted on a GPU it needs nondeterministic attention on";
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("or ask for the nondeterministic_attention feature gate"),
            std::string::npos)
      << message;
  EXPECT_FALSE(validate(bench, MemoryBudget{0, between}, 1).train_job.contains("deterministic"))
      << "deterministic is the train job's default";
  bench.add_feature_gates("nondeterministic_attention");
  const daemon::ValidatedJob fast = validate(bench, MemoryBudget{0, below_ds}, 1);
  EXPECT_EQ(fast.train_job.value("deterministic", true), false);
#else
  GTEST_SKIP() << "GPU test: this build has no CUDA (MEGACPP_CUDA=OFF)";
#endif
}

// A cuda job's gate decision: on (the train job runs on the GPU) in a CUDA build, refused with
// the reason in a CPU-only build or across several GPUs, never a silent CPU run.
TEST_F(SpecTest, ACudaJobRunsOnTheGpuOrIsRefusedWithTheReason) {
  v1::JobSpec cuda = small_job();
  cuda.set_device_kind("cuda");
  const auto decision_of = [](const daemon::ValidatedJob& job) {
    for (const auto& d : job.gate_decisions) {
      if (d.gate == "cuda_backend") return d;
    }
    ADD_FAILURE() << "no cuda_backend decision";
    return gates::GateDecision{};
  };
  const daemon::ValidatedJob one = validate(cuda, MemoryBudget{}, 1);
#ifdef MEGACPP_HAVE_CUDA
  EXPECT_EQ(decision_of(one).decision, gates::Decision::kOn);
  EXPECT_EQ(one.train_job["device"], "cuda");
  // The daemon's first cache directory keeps the job's GEMM plans.
  EXPECT_EQ(one.train_job["plan_cache"], (config_.cache_dirs.at(0) / "plans").string());
  EXPECT_FALSE(one.train_job.contains("recompute_in_proj"));
  // The recompute_in_proj gate, on for a cuda job, reaches the trainer.
  v1::JobSpec recompute = cuda;
  recompute.add_feature_gates("recompute_in_proj");
  const daemon::ValidatedJob lean = validate(recompute, MemoryBudget{}, 1);
  EXPECT_EQ(lean.train_job["recompute_in_proj"], true);
  // Several GPUs: one rank per GPU, the geometry handed to the trainer.
  cuda.set_device_count(2);
  cuda.set_tensor_parallel(2);
  const daemon::ValidatedJob two = validate(cuda, MemoryBudget{}, 2);
  EXPECT_EQ(decision_of(two).decision, gates::Decision::kOn);
  EXPECT_NE(decision_of(two).reason.find("tensor_parallel=2"), std::string::npos)
      << decision_of(two).reason;
  EXPECT_EQ(two.train_job["device_count"], 2);
  EXPECT_EQ(two.train_job["tensor_parallel"], 2);
  // B/C groups that would straddle two ranks (G = 3 over TP = 2, H = 6) are refused at submit.
  v1::JobSpec straddling = cuda;
  straddling.set_config_json(
      R"({"d_model": 48, "pattern": "M", "vocab_size": 257,
      "ssm_cfg": {"d_state": 16, "headdim": 16, "ngroups": 3, "mimo_rank": 1, "chunk_size": 16}})");
  try {
    validate(straddling, MemoryBudget{}, 2);
    ADD_FAILURE() << "B/C groups straddling the ranks were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ngroups=3"), std::string::npos) << e.what();
  }
  // The CPU runtime has no tensor parallelism: a cpu job asking for it is refused, not run on
  // one process.
  v1::JobSpec cpu_tp = small_job();
  cpu_tp.set_device_count(2);
  cpu_tp.set_tensor_parallel(2);
  try {
    validate(cpu_tp, MemoryBudget{}, 0);
    ADD_FAILURE() << "a cpu job with tensor_parallel=2 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor parallelism"), std::string::npos) << e.what();
  }
  // Data parallel: every replica takes an equal share of the batch.
  cuda.set_tensor_parallel(1);
  cuda.set_batch(3);
  try {
    validate(cuda, MemoryBudget{}, 2);
    ADD_FAILURE() << "a batch of 3 over 2 replicas was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("batch=3 must be a multiple"), std::string::npos)
        << e.what();
  }
#else
  EXPECT_EQ(decision_of(one).decision, gates::Decision::kRefused);
  EXPECT_NE(decision_of(one).reason.find("built without the CUDA toolkit"), std::string::npos)
      << decision_of(one).reason;
  EXPECT_FALSE(one.train_job.contains("device"));
#endif
  // A daemon with no GPU refuses a cuda job by its gate, a decision the store records, not as a
  // bad spec that leaves nothing behind.
  v1::JobSpec anywhere = small_job();
  anywhere.set_device_kind("cuda");
  const daemon::ValidatedJob none = validate(anywhere, MemoryBudget{}, 0);
  EXPECT_EQ(decision_of(none).decision, gates::Decision::kRefused);
#ifdef MEGACPP_HAVE_CUDA
  EXPECT_NE(decision_of(none).reason.find("has no GPU to run it on"), std::string::npos)
      << decision_of(none).reason;
#endif
  EXPECT_FALSE(none.train_job.contains("device"));
}

// The daemon's free-space floor and the retention rule reach the trainer's job.
TEST_F(SpecTest, CheckpointFloorAndRetentionReachTheTrainJob) {
  const auto job = validate(small_job()).train_job;
  EXPECT_EQ(job["checkpoint"]["min_free_bytes"], 12345678);
  EXPECT_EQ(job["checkpoint"]["keep_last"], 3);
  const TrainJob parsed = parse_train_job(job, "job.json");
  EXPECT_EQ(parsed.min_free_bytes, 12345678u);
  EXPECT_EQ(parsed.keep_last, 3);

  v1::JobSpec all = small_job();
  all.set_checkpoint_keep_last(0);
  EXPECT_EQ(validate(all).train_job["checkpoint"]["keep_last"], 0);
  v1::JobSpec five = small_job();
  five.set_checkpoint_keep_last(5);
  EXPECT_EQ(parse_train_job(validate(five).train_job, "job.json").keep_last, 5);
}

// The recompile budget reaches the trainer: 0 unless the spec sets it.
TEST_F(SpecTest, RecompileBudgetReachesTheTrainJob) {
  EXPECT_EQ(parse_train_job(validate(small_job()).train_job, "job.json").recompile_budget, 0);
  v1::JobSpec three = small_job();
  three.set_recompile_budget(3);
  EXPECT_EQ(parse_train_job(validate(three).train_job, "job.json").recompile_budget, 3);
  // The trainer's own parse refuses what a job file could hold past the spec's checks.
  json job = validate(small_job()).train_job;
  job["recompile_budget"] = -2;
  try {
    parse_train_job(job, "job.json");
    ADD_FAILURE() << "recompile_budget=-2 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("job.json: recompile_budget=-2 must be >= 0"),
              std::string::npos)
        << e.what();
  }
  job["recompile_budget"] = "none";
  EXPECT_THROW(parse_train_job(job, "job.json"), Error);
}

// init_checkpoint: a model checkpoint inside the data roots (the directory and both files,
// symbolic links resolved) whose config is the job's, passed to the trainer as init.checkpoint.
TEST_F(SpecTest, InitCheckpointMustLieInADataRootAndMatchTheModel) {
  const auto save = [](const std::filesystem::path& dir, const std::string& config_json) {
    Model<float> model(parse_model_config(json::parse(config_json), "test"));
    model.init_parameters(3);
    save_model_checkpoint(dir, model);
  };
  const auto root = config_.data_roots[0];
  save(root / "imported", small_job().config_json());
  v1::JobSpec spec = small_job();
  spec.set_init_checkpoint((root / "imported").string());
  const auto job = validate(spec).train_job;
  EXPECT_EQ(job["init"]["checkpoint"], (root / "imported").string());
  EXPECT_EQ(parse_train_job(job, "job.json").init_checkpoint, root / "imported");
  EXPECT_FALSE(validate(small_job()).train_job.contains("init"));

  save(dir_ / "outside", small_job().config_json());
  json other_model = json::parse(small_job().config_json());
  other_model["d_model"] = 48;
  save(root / "other", other_model.dump());
  std::filesystem::create_directories(root / "config-only");
  std::filesystem::copy_file(root / "imported/config.json", root / "config-only/config.json");
  std::filesystem::create_directories(root / "linked");
  std::filesystem::copy_file(root / "imported/config.json", root / "linked/config.json");
  std::filesystem::create_symlink(dir_ / "outside/model.safetensors",
                                  root / "linked/model.safetensors");
  const std::vector<Case> cases = {
      {"outside", [&](v1::JobSpec& s) { s.set_init_checkpoint((dir_ / "outside").string()); },
       "spec.init_checkpoint"},
      {"relative", [](v1::JobSpec& s) { s.set_init_checkpoint("data/imported"); },
       "spec.init_checkpoint"},
      {"dotdot", [&](v1::JobSpec& s) { s.set_init_checkpoint((root / "../outside").string()); },
       "spec.init_checkpoint"},
      {"missing", [&](v1::JobSpec& s) { s.set_init_checkpoint((root / "nothing").string()); },
       "spec.init_checkpoint"},
      {"no weights",
       [&](v1::JobSpec& s) { s.set_init_checkpoint((root / "config-only").string()); },
       "spec.init_checkpoint"},
      {"link out", [&](v1::JobSpec& s) { s.set_init_checkpoint((root / "linked").string()); },
       "spec.init_checkpoint"},
      {"other model", [&](v1::JobSpec& s) { s.set_init_checkpoint((root / "other").string()); },
       "spec.init_checkpoint=" + (root / "other").string() +
           ": the checkpoint's model config differs from the job's"},
  };
  expect_refusals(
      cases, [&](const v1::JobSpec& s) { return refusal(s); }, small_job());
}

// Through a real daemon: the refusals are INVALID_ARGUMENT naming the field, and
// nothing is queued.
TEST(SpecDaemon, BadNumbersAreRefusedAtSubmitAndNothingIsQueued) {
  testing::Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<Case> cases = {
      {"grad_accum", [](v1::JobSpec& s) { s.set_grad_accum(2147483647); },
       "grad_accum=2147483647 must be at most"},
      {"threads", [](v1::JobSpec& s) { s.set_threads(100000); }, "threads=100000 must be at most"},
      {"min_lr", [&](v1::JobSpec& s) { s.mutable_optimizer()->set_min_lr(nan); },
       "optimizer.min_lr=nan"},
      {"memory",
       [](v1::JobSpec& s) {
         s.set_batch(65536);
         s.set_seqlen(65536);
       },
       "the job needs about"},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec = d.small_job(5);
    c.breaks(spec);
    const grpc::Status status = testing::submit(d, spec);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.name << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(c.message), std::string::npos)
        << c.name << ": " << status.error_message();
  }
  grpc::ClientContext context;
  v1::ListJobsResponse listed;
  ASSERT_TRUE(d.jobs()->ListJobs(&context, v1::ListJobsRequest(), &listed).ok());
  EXPECT_EQ(listed.jobs_size(), 0);
}

// A dataset truncated under a running job used to kill its executor with SIGBUS and an
// empty log; the job must fail with an error naming the file.
TEST(SpecDaemon, DatasetTruncatedUnderARunningJobFailsItNamingTheFile) {
  testing::Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::JobSpec spec = d.small_job(1000000);
  spec.clear_valid_data();
  v1::Job submitted;
  const grpc::Status s = testing::submit(d, spec, &submitted);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const std::string id = submitted.id();
  v1::Job job = testing::wait_for(d, id, [](const v1::Job& j) { return j.step() >= 2; });
  ASSERT_GE(job.step(), 2) << v1::JobState_Name(job.state()) << "\n" << d.log();
  // The daemon names the file by its canonical path.
  const std::string bin = std::filesystem::canonical(d.data("train") + ".bin").string();
  std::filesystem::resize_file(bin, 0);
  job = testing::wait_for(d, id, [](const v1::Job& j) {
    return j.state() != v1::JOB_STATE_RUNNING && j.state() != v1::JOB_STATE_QUEUED;
  });
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED) << job.error();
  EXPECT_NE(job.error().find(bin + ": changed while in use"), std::string::npos) << job.error();
  EXPECT_EQ(job.error().find("signal"), std::string::npos) << job.error();
}

}  // namespace
}  // namespace megacpp
