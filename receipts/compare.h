#pragma once
// Comparing two runs' step receipts: is run B faster or slower than run A, or is the difference
// within the runs' own step-to-step noise?
//
// Each run's first steps are warm-up (allocator, caches, clocks ramping) and are left out; the
// rest is the measured window. For each metric the comparison reports both medians, the relative
// delta of B against A, and each window's noise envelope.
//
// The verdict rule. Let d = |median_b - median_a| and MAD the median absolute deviation of a
// window (unscaled). B differs from A when, at once:
//   1. d > 3 * max(MAD_a, MAD_b): the shift is well outside the typical step-to-step spread;
//   2. the interquartile ranges [q1, q3] of the two windows do not overlap: the bulk of B's steps
//      lies on one side of the bulk of A's, not just their middles;
//   3. both windows hold at least `min_samples` values.
// Then, for step_ms (lower is better) and tokens_per_s, flops_per_s (higher is better), the
// verdict is "faster" or "slower" by which way B moved; for loss it is "lower" or "higher".
// Otherwise it is "within noise". NaN values (a diverged loss) are left out of the statistics.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "receipts/store.h"

namespace megacpp::receipts {

struct CompareOptions {
  // Step receipts left out at the start of each run, in step order. Unset: 10% of the run's
  // receipts rounded down, at least 1, but always leaving at least one measured step.
  std::optional<int64_t> warmup_steps;
  // Windows smaller than this get no verdict but "within noise".
  int64_t min_samples = 5;
};

struct NoiseEnvelope {
  double min = 0;
  double q1 = 0;  // 25th percentile (linear interpolation between order statistics)
  double median = 0;
  double q3 = 0;  // 75th percentile
  double max = 0;
  double mad = 0;  // median of |x - median|
  int64_t count = 0;
};

enum class Verdict { kFaster, kSlower, kLower, kHigher, kWithinNoise };
// "faster", "slower", "lower", "higher", "within noise".
std::string_view verdict_name(Verdict verdict);

enum class MetricSense {
  kLowerIsFaster,   // step_ms
  kHigherIsFaster,  // tokens_per_s, flops_per_s
  kNotSpeed,        // loss: the verdict says lower or higher
};

struct MetricComparison {
  std::string metric;  // "step_ms" | "tokens_per_s" | "flops_per_s" | "loss"
  double median_a = 0;
  double median_b = 0;
  // (median_b - median_a) / |median_a|; 0 when the medians are equal; NaN when median_a is 0 and
  // median_b is not, or when a window is empty.
  double relative_delta = 0;
  NoiseEnvelope envelope_a;
  NoiseEnvelope envelope_b;
  Verdict verdict = Verdict::kWithinNoise;
};

struct RunComparison {
  std::string job_a;
  std::string job_b;
  int64_t warmup_a = 0;  // receipts left out of each run
  int64_t warmup_b = 0;
  std::vector<MetricComparison> metrics;  // step_ms, tokens_per_s, flops_per_s, loss
};

// Reads both jobs' step receipts from one snapshot of the store. Error(kNotFound) naming the job
// when a job is not in the store; Error(kFailedPrecondition) when a job has no step receipts;
// Error(kInvalidArgument) when warmup_steps is negative or leaves a run no measured step.
RunComparison compare_runs(const Store& store, std::string_view job_a, std::string_view job_b,
                           const CompareOptions& options = {});

// The statistics alone, for callers with values from elsewhere. NaNs are dropped; an empty
// window gives count 0 and NaN statistics.
NoiseEnvelope noise_envelope(std::span<const double> values);
MetricComparison compare_metric(std::string metric, MetricSense sense, std::span<const double> a,
                                std::span<const double> b, int64_t min_samples);

}  // namespace megacpp::receipts
