#include "receipts/compare.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "base/error.h"
#include "receipts/store.h"
#include "tests/support/temp_dir.h"

namespace megacpp::receipts {
namespace {

// Median by sorting, independent of the code under test.
double reference_median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Evenly spread values centre - spread .. centre + spread, in a scrambled but fixed order.
std::vector<double> spread_values(double centre, double spread, int count) {
  std::vector<double> values(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    const int slot = (i * 37) % count;  // 37 is coprime with the counts used here
    values[static_cast<size_t>(i)] =
        centre + spread * (2.0 * static_cast<double>(slot) / static_cast<double>(count - 1) - 1.0);
  }
  return values;
}

const MetricComparison& metric(const RunComparison& comparison, const std::string& name) {
  for (const auto& m : comparison.metrics) {
    if (m.metric == name) return m;
  }
  throw std::runtime_error("no metric " + name);
}

class CompareRunsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = std::make_unique<Store>(dir_ / "receipts.db", OpenMode::kReadWrite);
    BootReceipt boot;
    boot.status = "serving";
    boot_ = store_->insert_boot(boot);
  }

  // A job of `step_ms.size()` steps of 8192 tokens; loss follows the same curve in every job.
  void add_job(const std::string& id, const std::vector<double>& step_ms) {
    JobRecord job;
    job.job_id = id;
    job.boot_id = boot_;
    job.state = "succeeded";
    store_->upsert_job(job);
    std::vector<StepReceipt> steps;
    for (size_t i = 0; i < step_ms.size(); ++i) {
      StepReceipt s;
      s.job_id = id;
      s.step = static_cast<int64_t>(i) + 1;
      s.attempt = 1;
      s.loss = 6.0 - 0.01 * static_cast<double>(i % 50);
      s.tokens = 8192;
      s.step_ms = step_ms[i];
      s.tokens_per_s = 8192.0 / (step_ms[i] / 1000.0);
      s.flops_per_s = 2.0e12 / (step_ms[i] / 1000.0);
      steps.push_back(s);
    }
    store_->write_steps(steps);
  }

  testing::TempDir dir_;
  std::unique_ptr<Store> store_;
  int64_t boot_ = 0;
};

TEST(NoiseEnvelope, MatchesHandComputedStatistics) {
  const std::vector<double> values = {4, 100, 1, 3, 2};
  const NoiseEnvelope e = noise_envelope(values);
  EXPECT_EQ(e.count, 5);
  EXPECT_DOUBLE_EQ(e.min, 1);
  EXPECT_DOUBLE_EQ(e.max, 100);
  EXPECT_DOUBLE_EQ(e.median, 3);
  EXPECT_DOUBLE_EQ(e.q1, 2);
  EXPECT_DOUBLE_EQ(e.q3, 4);
  EXPECT_DOUBLE_EQ(e.mad, 1);  // deviations from 3: {1, 97, 2, 0, 1}
  const std::vector<double> even = {1, 2, 3, 4, std::numeric_limits<double>::quiet_NaN()};
  const NoiseEnvelope f = noise_envelope(even);
  EXPECT_EQ(f.count, 4);  // NaN dropped
  EXPECT_DOUBLE_EQ(f.median, 2.5);
  EXPECT_DOUBLE_EQ(f.q1, 1.75);
  EXPECT_DOUBLE_EQ(f.mad, 1.0);  // deviations {1.5, 0.5, 0.5, 1.5}
  const NoiseEnvelope empty = noise_envelope(std::vector<double>{});
  EXPECT_EQ(empty.count, 0);
  EXPECT_TRUE(std::isnan(empty.median));
}

TEST(CompareMetric, ShiftBeyondThreeMadsButOverlappingQuartilesIsNoise) {
  // A: median 100, MAD 0, but its upper quartile reaches 122.5; B sits at 110 inside it.
  const std::vector<double> a = {100, 100, 100, 100, 100, 100, 100, 130, 130, 130};
  const std::vector<double> b(10, 110.0);
  const MetricComparison m = compare_metric("step_ms", MetricSense::kLowerIsFaster, a, b, 5);
  EXPECT_DOUBLE_EQ(m.envelope_a.q3, 122.5);
  EXPECT_DOUBLE_EQ(m.relative_delta, 0.1);
  EXPECT_EQ(m.verdict, Verdict::kWithinNoise);
}

TEST(CompareMetric, DisjointQuartilesButShiftWithinThreeMadsIsNoise) {
  // Uniform windows of half-width 1: MAD 0.5, quartiles at +-0.5. A shift of 1.25 separates
  // the quartiles but stays under 3 * MAD = 1.5; a shift of 2 clears both tests.
  const auto a = spread_values(10, 1, 201);
  const MetricComparison near = compare_metric("tokens_per_s", MetricSense::kHigherIsFaster, a,
                                               spread_values(11.25, 1, 201), 5);
  EXPECT_NEAR(near.envelope_a.mad, 0.5, 1e-12);
  EXPECT_LT(near.envelope_a.q3, near.envelope_b.q1);
  EXPECT_EQ(near.verdict, Verdict::kWithinNoise);
  const MetricComparison far =
      compare_metric("tokens_per_s", MetricSense::kHigherIsFaster, a, spread_values(12, 1, 201), 5);
  EXPECT_EQ(far.verdict, Verdict::kFaster);
  const MetricComparison slower =
      compare_metric("tokens_per_s", MetricSense::kHigherIsFaster, a, spread_values(8, 1, 201), 5);
  EXPECT_EQ(slower.verdict, Verdict::kSlower);
  const MetricComparison lower =
      compare_metric("loss", MetricSense::kNotSpeed, a, spread_values(8, 1, 201), 5);
  EXPECT_EQ(lower.verdict, Verdict::kLower);
  EXPECT_EQ(verdict_name(lower.verdict), "lower");
}

TEST(CompareMetric, TooFewSamplesGiveNoVerdict) {
  const std::vector<double> a = {100, 101, 102}, b = {50, 51, 52};
  EXPECT_EQ(compare_metric("step_ms", MetricSense::kLowerIsFaster, a, b, 5).verdict,
            Verdict::kWithinNoise);
  EXPECT_EQ(compare_metric("step_ms", MetricSense::kLowerIsFaster, a, b, 3).verdict,
            Verdict::kFaster);
}

TEST(CompareMetric, RelativeDeltaEdgeCases) {
  const std::vector<double> zeros(6, 0.0), ones(6, 1.0);
  EXPECT_EQ(
      compare_metric("flops_per_s", MetricSense::kHigherIsFaster, zeros, zeros, 5).relative_delta,
      0.0);
  EXPECT_TRUE(std::isnan(
      compare_metric("flops_per_s", MetricSense::kHigherIsFaster, zeros, ones, 5).relative_delta));
}

TEST_F(CompareRunsTest, ClearlyFasterRun) {
  add_job("base", spread_values(100, 2, 101));
  add_job("fast", spread_values(80, 2, 101));
  const RunComparison c = compare_runs(*store_, "base", "fast");
  EXPECT_EQ(c.warmup_a, 10);
  EXPECT_EQ(c.warmup_b, 10);
  const MetricComparison& step_ms = metric(c, "step_ms");
  const auto base = spread_values(100, 2, 101), fast = spread_values(80, 2, 101);
  const double median_a = reference_median(std::vector<double>(base.begin() + 10, base.end()));
  const double median_b = reference_median(std::vector<double>(fast.begin() + 10, fast.end()));
  EXPECT_DOUBLE_EQ(step_ms.median_a, median_a);
  EXPECT_DOUBLE_EQ(step_ms.median_b, median_b);
  EXPECT_DOUBLE_EQ(step_ms.relative_delta, (median_b - median_a) / median_a);
  EXPECT_EQ(step_ms.envelope_a.count, 91);
  EXPECT_EQ(step_ms.verdict, Verdict::kFaster);
  EXPECT_EQ(metric(c, "tokens_per_s").verdict, Verdict::kFaster);
  EXPECT_GT(metric(c, "tokens_per_s").relative_delta, 0.2);
  EXPECT_EQ(metric(c, "flops_per_s").verdict, Verdict::kFaster);
  // Same loss curve in both runs.
  EXPECT_EQ(metric(c, "loss").verdict, Verdict::kWithinNoise);
  EXPECT_DOUBLE_EQ(metric(c, "loss").relative_delta, 0.0);
}

TEST_F(CompareRunsTest, ClearlySlowerRun) {
  add_job("base", spread_values(100, 2, 101));
  add_job("slow", spread_values(125, 3, 101));
  const RunComparison c = compare_runs(*store_, "base", "slow");
  EXPECT_EQ(metric(c, "step_ms").verdict, Verdict::kSlower);
  EXPECT_EQ(metric(c, "tokens_per_s").verdict, Verdict::kSlower);
  EXPECT_EQ(verdict_name(metric(c, "step_ms").verdict), "slower");
  EXPECT_NEAR(metric(c, "step_ms").relative_delta, 0.25, 0.01);
}

TEST_F(CompareRunsTest, NoisyOverlappingRunsAreWithinNoise) {
  add_job("a", spread_values(100, 20, 101));
  add_job("b", spread_values(104, 20, 101));
  const RunComparison c = compare_runs(*store_, "a", "b");
  const MetricComparison& step_ms = metric(c, "step_ms");
  EXPECT_GT(step_ms.median_b, step_ms.median_a);
  EXPECT_EQ(step_ms.verdict, Verdict::kWithinNoise);
  EXPECT_EQ(verdict_name(step_ms.verdict), "within noise");
  EXPECT_EQ(metric(c, "tokens_per_s").verdict, Verdict::kWithinNoise);
  EXPECT_GT(step_ms.envelope_a.max - step_ms.envelope_a.min, 30.0);
}

TEST_F(CompareRunsTest, WarmupIsLeftOutOfTheWindow) {
  // B's first ten steps are ten times slower (compilation, allocator warm-up).
  std::vector<double> warm = spread_values(100, 2, 100);
  for (size_t i = 0; i < 10; ++i) warm[i] = 1000;
  add_job("a", spread_values(100, 2, 100));
  add_job("b", warm);
  const RunComparison by_default = compare_runs(*store_, "a", "b");
  EXPECT_LT(metric(by_default, "step_ms").envelope_b.max, 200.0);
  EXPECT_EQ(metric(by_default, "step_ms").envelope_b.count, 90);
  CompareOptions none;
  none.warmup_steps = 0;
  const RunComparison unskipped = compare_runs(*store_, "a", "b", none);
  EXPECT_DOUBLE_EQ(metric(unskipped, "step_ms").envelope_b.max, 1000.0);
  EXPECT_EQ(metric(unskipped, "step_ms").envelope_b.count, 100);
  CompareOptions too_many;
  too_many.warmup_steps = 100;
  EXPECT_THROW(compare_runs(*store_, "a", "b", too_many), Error);
}

TEST_F(CompareRunsTest, ShortRunsKeepAtLeastOneMeasuredStep) {
  add_job("one", {100});
  add_job("three", {100, 90, 80});
  const RunComparison c = compare_runs(*store_, "one", "three");
  EXPECT_EQ(c.warmup_a, 0);
  EXPECT_EQ(c.warmup_b, 1);
  EXPECT_EQ(metric(c, "step_ms").envelope_b.count, 2);
  EXPECT_EQ(metric(c, "step_ms").verdict, Verdict::kWithinNoise);
}

TEST_F(CompareRunsTest, MissingJobsAreNamed) {
  add_job("a", spread_values(100, 2, 20));
  for (const auto& [first, second] : {std::pair{"a", "nope"}, std::pair{"nope", "a"}}) {
    try {
      compare_runs(*store_, first, second);
      ADD_FAILURE() << "expected kNotFound";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::kNotFound);
      EXPECT_NE(std::string(error.what()).find("'nope'"), std::string::npos) << error.what();
    }
  }
  JobRecord empty;
  empty.job_id = "empty";
  empty.boot_id = boot_;
  empty.state = "queued";
  store_->upsert_job(empty);
  try {
    compare_runs(*store_, "a", "empty");
    ADD_FAILURE() << "expected kFailedPrecondition";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kFailedPrecondition);
    EXPECT_NE(std::string(error.what()).find("'empty'"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace megacpp::receipts
