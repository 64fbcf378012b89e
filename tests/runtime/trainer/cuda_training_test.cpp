// Training on the GPU (TrainJob.device = cuda) against training on the CPU: the tiny preset's
// validation loss tracks the CPU float run's (within 1% on average over the validation points,
// 3% at any one); the GPU run's
// checkpoint, evaluated by the CPU runtime, gives the GPU's validation loss within 1e-3; a CPU
// checkpoint resumes on the GPU. MEGACPP_CUDA_TRAIN_STEPS overrides the 300 steps.
#include <gtest/gtest.h>

#ifdef MEGACPP_HAVE_CUDA

#include <cmath>
#include <cstdlib>
#include <vector>

#include "runtime/data/prepare.h"
#include "runtime/trainer/trainer.h"
#include "tests/support/gpu.h"
#include "tests/support/recording_observer.h"
#include "tests/support/temp_dir.h"

namespace megacpp {
namespace {

using nlohmann::json;

using testing::RecordingObserver;

class CudaTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    MEGACPP_REQUIRE_GPU();
    for (int i = 0; i < 24; ++i) {
      testing::write_text(dir_ / ("corpus/file" + std::to_string(i) + ".txt"),
                          testing::pseudo_text(static_cast<uint64_t>(i), 2000));
    }
    data::PrepareOptions prepare;
    prepare.input = dir_ / "corpus";
    prepare.output_prefix = dir_ / "data/toy";
    prepare.valid_fraction = 0.1;
    data::prepare_dataset(prepare);
    if (const char* steps = std::getenv("MEGACPP_CUDA_TRAIN_STEPS")) steps_ = std::atoi(steps);
  }

  TrainJob job(const std::string& run, const std::string& device) const {
    return parse_train_job(json{{"model", {{"preset", "tiny"}}},
                                {"data",
                                 {{"train", (dir_ / "data/toy_train").string()},
                                  {"valid", (dir_ / "data/toy_valid").string()}}},
                                {"steps", steps_},
                                {"batch", 8},
                                {"seqlen", 128},
                                {"optimizer", {{"lr", 0.003}, {"warmup_steps", 20}}},
                                {"eval", {{"interval", std::max(1, steps_ / 6)}, {"batches", 4}}},
                                {"checkpoint", {{"dir", (dir_ / run).string()}, {"interval", 0}}},
                                {"seed", 7},
                                {"device", device}},
                           run);
  }

  testing::TempDir dir_;
  int steps_ = 300;
};

TEST_F(CudaTraining, TinyPresetTracksTheCpuLossCurveAndItsCheckpointEvaluatesOnTheCpu) {
  RecordingObserver cpu, gpu;
  train(job("cpu", "cpu"), cpu);
  train(job("gpu", "cuda"), gpu);
  ASSERT_EQ(gpu.summary.last_step, steps_);
  EXPECT_NE(gpu.summary.device.find("cuda:0"), std::string::npos) << gpu.summary.device;
  EXPECT_GT(gpu.summary.device_bytes, 0u);
  ASSERT_EQ(cpu.evals.size(), gpu.evals.size());
  ASSERT_GE(gpu.evals.size(), 2u);
  // Two runs that round differently drift apart along the trajectory: where the loss falls
  // fastest (the first validation point) a shift of a step or two is a few percent, later the
  // curves meet again. Measured on an H100 (2026-11-23): 2.04% at step 50, at most 0.56% after
  // (1.4% at step 50 before the scan's state products moved to split-bf16 tensor-core
  // products). So the whole curve is held to 1% on average, each point to 3%; a wrong op,
  // optimizer or data order moves every point by far more.
  double total_rel = 0;
  for (size_t i = 0; i < gpu.evals.size(); ++i) {
    const double rel = std::abs(gpu.evals[i].loss - cpu.evals[i].loss) / cpu.evals[i].loss;
    std::printf("step %5lld  val loss cpu %.5f gpu %.5f  (rel %.2e)\n",
                static_cast<long long>(gpu.evals[i].step), cpu.evals[i].loss, gpu.evals[i].loss,
                rel);
    EXPECT_LE(rel, 0.03) << "validation at step " << gpu.evals[i].step;
    total_rel += rel;
  }
  EXPECT_LE(total_rel / static_cast<double>(gpu.evals.size()), 0.01)
      << "mean deviation of the validation curve";
  // Kernel receipts from the 3 profiled steps: every op of the step timed (the tiny preset's 3
  // Mamba layers make 3 scan backward calls a step, 9 samples), the scan's kernels with their
  // attributes.
  EXPECT_TRUE(cpu.kernels.empty());
  bool scan_op = false, scan_kernel = false;
  for (const KernelRecord& k : gpu.kernels) {
    if (k.kernel == "mamba scan backward") {
      scan_op = true;
      EXPECT_EQ(k.samples, 9);
      EXPECT_GT(k.time_ms_min, 0);
      EXPECT_LE(k.time_ms_min, k.time_ms_median);
      EXPECT_LE(k.time_ms_median, k.time_ms_max);
    }
    if (k.launch.value("kind", "") == "kernel") {
      scan_kernel = true;
      EXPECT_GT(k.registers, 0) << k.kernel;
      EXPECT_GT(k.occupancy, 0) << k.kernel;
    }
  }
  EXPECT_TRUE(scan_op);
  EXPECT_TRUE(scan_kernel);

  // Training learned: the last validation loss is well below the uniform guess, ln 257.
  EXPECT_LT(gpu.evals.back().loss, std::log(257.0) - 1.5);
  std::printf("median step: cpu %.1f ms, gpu %.1f ms; gpu to first step %.2f s, %llu bytes\n",
              cpu.summary.median_step_ms, gpu.summary.median_step_ms,
              gpu.summary.seconds_to_first_step,
              static_cast<unsigned long long>(gpu.summary.device_bytes));

  // The final validation ran over eval.batches · batch windows; the CPU runtime reads the GPU's
  // checkpoint and evaluates the same windows.
  const auto latest = dir_ / "gpu" / fmt::format("step-{:08d}", steps_);
  const EvalResult on_cpu = evaluate_checkpoint(latest, dir_ / "data/toy_valid", 128, 8, 4 * 8);
  EXPECT_NEAR(on_cpu.loss, gpu.summary.final_val_loss, 1e-3)
      << "the GPU checkpoint evaluated on the CPU";
}

TEST_F(CudaTraining, ACpuCheckpointResumesOnTheGpu) {
  steps_ = 20;
  RecordingObserver cpu_part, gpu_part, straight;
  TrainOptions stop;
  stop.stop_at = 10;
  train(job("run", "cpu"), cpu_part, stop);
  ASSERT_EQ(cpu_part.summary.last_step, 10);
  train(job("run", "cuda"), gpu_part);
  ASSERT_FALSE(gpu_part.steps.empty());
  EXPECT_EQ(gpu_part.steps.front().step, 11);
  EXPECT_EQ(gpu_part.summary.last_step, 20);
  train(job("straight", "cpu"), straight);
  // Step 11 on the GPU starts from the CPU's step-10 weights and moments: its loss is the CPU's.
  EXPECT_NEAR(gpu_part.steps.front().loss, straight.steps[10].loss, 0.01 * straight.steps[10].loss);
}

}  // namespace
}  // namespace megacpp

#else

TEST(CudaTraining, SkippedWithoutCuda) {
  GTEST_SKIP() << "built without CUDA";
}

#endif
