#include "receipts/compare.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "base/error.h"

namespace megacpp::receipts {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr int kPageSize = 10000;

// The p-quantile of sorted values, interpolating linearly between neighbouring order statistics.
double quantile(const std::vector<double>& sorted, double p) {
  const double position = p * static_cast<double>(sorted.size() - 1);
  const auto below = static_cast<size_t>(std::floor(position));
  const size_t above = std::min(below + 1, sorted.size() - 1);
  const double fraction = position - static_cast<double>(below);
  return sorted[below] + fraction * (sorted[above] - sorted[below]);
}

std::vector<StepReceipt> all_steps(const Store& store, std::string_view job_id) {
  std::vector<StepReceipt> steps;
  std::optional<int64_t> cursor;
  while (true) {
    std::vector<StepReceipt> page = store.steps(job_id, cursor, kPageSize, /*newest_first=*/false);
    if (page.empty()) break;
    cursor = page.back().step;
    const bool last = page.size() < static_cast<size_t>(kPageSize);
    steps.insert(steps.end(), std::make_move_iterator(page.begin()),
                 std::make_move_iterator(page.end()));
    if (last) break;
  }
  return steps;
}

int64_t warmup_for(const CompareOptions& options, std::string_view job_id, int64_t receipts) {
  if (!options.warmup_steps) {
    return std::min(std::max<int64_t>(1, receipts / 10), receipts - 1);
  }
  const int64_t warmup = *options.warmup_steps;
  if (warmup < 0 || warmup >= receipts) {
    fail(ErrorKind::kInvalidArgument,
         "compare_runs: warmup_steps must be in [0, {}) for job '{}' ({} step receipts), got {}",
         receipts, job_id, receipts, warmup);
  }
  return warmup;
}

}  // namespace

std::string_view verdict_name(Verdict verdict) {
  switch (verdict) {
    case Verdict::kFaster:
      return "faster";
    case Verdict::kSlower:
      return "slower";
    case Verdict::kLower:
      return "lower";
    case Verdict::kHigher:
      return "higher";
    case Verdict::kWithinNoise:
      return "within noise";
  }
  return "within noise";
}

NoiseEnvelope noise_envelope(std::span<const double> values) {
  std::vector<double> sorted;
  sorted.reserve(values.size());
  for (double value : values) {
    if (!std::isnan(value)) sorted.push_back(value);
  }
  NoiseEnvelope envelope;
  envelope.count = static_cast<int64_t>(sorted.size());
  if (sorted.empty()) {
    envelope.min = envelope.q1 = envelope.median = envelope.q3 = envelope.max = envelope.mad = kNaN;
    return envelope;
  }
  std::sort(sorted.begin(), sorted.end());
  envelope.min = sorted.front();
  envelope.max = sorted.back();
  envelope.q1 = quantile(sorted, 0.25);
  envelope.median = quantile(sorted, 0.5);
  envelope.q3 = quantile(sorted, 0.75);
  std::vector<double> deviations(sorted.size());
  for (size_t i = 0; i < sorted.size(); ++i) deviations[i] = std::abs(sorted[i] - envelope.median);
  std::sort(deviations.begin(), deviations.end());
  envelope.mad = quantile(deviations, 0.5);
  return envelope;
}

MetricComparison compare_metric(std::string metric, MetricSense sense, std::span<const double> a,
                                std::span<const double> b, int64_t min_samples) {
  MetricComparison result;
  result.metric = std::move(metric);
  result.envelope_a = noise_envelope(a);
  result.envelope_b = noise_envelope(b);
  const NoiseEnvelope& ea = result.envelope_a;
  const NoiseEnvelope& eb = result.envelope_b;
  result.median_a = ea.median;
  result.median_b = eb.median;
  if (ea.count == 0 || eb.count == 0) {
    result.relative_delta = kNaN;
    return result;
  }
  const double shift = eb.median - ea.median;
  if (shift == 0) {
    result.relative_delta = 0;
  } else {
    result.relative_delta = ea.median == 0 ? kNaN : shift / std::abs(ea.median);
  }
  const bool enough = ea.count >= min_samples && eb.count >= min_samples;
  const bool beyond_spread = std::abs(shift) > 3.0 * std::max(ea.mad, eb.mad);
  const bool quartiles_apart = ea.q3 < eb.q1 || eb.q3 < ea.q1;
  if (!(enough && beyond_spread && quartiles_apart)) return result;
  const bool b_higher = shift > 0;
  switch (sense) {
    case MetricSense::kLowerIsFaster:
      result.verdict = b_higher ? Verdict::kSlower : Verdict::kFaster;
      break;
    case MetricSense::kHigherIsFaster:
      result.verdict = b_higher ? Verdict::kFaster : Verdict::kSlower;
      break;
    case MetricSense::kNotSpeed:
      result.verdict = b_higher ? Verdict::kHigher : Verdict::kLower;
      break;
  }
  return result;
}

RunComparison compare_runs(const Store& store, std::string_view job_a, std::string_view job_b,
                           const CompareOptions& options) {
  std::vector<StepReceipt> steps_a, steps_b;
  store.read_snapshot([&] {
    for (std::string_view job : {job_a, job_b}) {
      if (!store.get_job(job)) {
        fail(ErrorKind::kNotFound, "compare_runs: job '{}' is not in the receipt store {}", job,
             store.path().string());
      }
    }
    steps_a = all_steps(store, job_a);
    steps_b = all_steps(store, job_b);
  });
  for (const auto& [job, steps] : {std::pair{job_a, &steps_a}, std::pair{job_b, &steps_b}}) {
    if (steps->empty()) {
      fail(ErrorKind::kFailedPrecondition, "compare_runs: job '{}' has no step receipts to compare",
           job);
    }
  }
  RunComparison comparison;
  comparison.job_a = std::string(job_a);
  comparison.job_b = std::string(job_b);
  comparison.warmup_a = warmup_for(options, job_a, static_cast<int64_t>(steps_a.size()));
  comparison.warmup_b = warmup_for(options, job_b, static_cast<int64_t>(steps_b.size()));

  auto window = [](const std::vector<StepReceipt>& steps, int64_t warmup,
                   double StepReceipt::*field) {
    std::vector<double> values;
    values.reserve(steps.size() - static_cast<size_t>(warmup));
    for (size_t i = static_cast<size_t>(warmup); i < steps.size(); ++i) {
      values.push_back(steps[i].*field);
    }
    return values;
  };
  const struct {
    const char* name;
    double StepReceipt::*field;
    MetricSense sense;
  } metrics[] = {
      {"step_ms", &StepReceipt::step_ms, MetricSense::kLowerIsFaster},
      {"tokens_per_s", &StepReceipt::tokens_per_s, MetricSense::kHigherIsFaster},
      {"flops_per_s", &StepReceipt::flops_per_s, MetricSense::kHigherIsFaster},
      {"loss", &StepReceipt::loss, MetricSense::kNotSpeed},
  };
  for (const auto& metric : metrics) {
    const std::vector<double> a = window(steps_a, comparison.warmup_a, metric.field);
    const std::vector<double> b = window(steps_b, comparison.warmup_b, metric.field);
    comparison.metrics.push_back(
        compare_metric(metric.name, metric.sense, a, b, options.min_samples));
  }
  return comparison;
}

}  // namespace megacpp::receipts
