#pragma once
// The daemon's Prometheus metrics, kept in one prometheus-cpp Registry and served as the text
// exposition format by the HTTP endpoint's /metrics (the daemon does not run prometheus-cpp's
// own HTTP server: /metrics shares the endpoint's TLS, bearer token and worker limits).
//
// Two kinds of series:
//  - gauges read from the job manager's snapshot at each scrape: jobs by state, queue depth,
//    devices, store size, and each running job's step, tokens/s, loss and step time. A job's
//    gauges disappear when it stops running, as they always have;
//  - series fed by the step receipts as executors send them: megacpp_steps_total and the
//    step-time histogram megacpp_step_seconds (by job_id), from which PromQL's
//    histogram_quantile gives p50/p99. An ended job's histogram is kept for a while
//    (kEndedJobRetention) so that the scrapes after its end still see its last steps.
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace megacpp::daemon {

struct ManagerSnapshot;

class DaemonMetrics {
 public:
  // Long enough for several scrapes at any usual scrape interval, short enough that a daemon
  // running thousands of jobs does not keep a histogram for each.
  static constexpr std::chrono::minutes kEndedJobRetention{10};
  // Seconds. From a few milliseconds (toy CPU jobs) to a minute (a large model's step with
  // gradient accumulation); histogram_quantile interpolates within a bucket, so the buckets
  // grow by about 2.5x.
  static const std::vector<double>& step_seconds_buckets();

  DaemonMetrics();

  // One step receipt from `job_id`'s executor; called from the job manager as it records it.
  void observe_step(const std::string& job_id, double step_seconds);
  // `job_id` has ended (succeeded, failed, cancelled, interrupted).
  void job_ended(const std::string& job_id);

  // Updates the snapshot gauges from `snap` and `store_bytes`, drops histograms of jobs that
  // ended more than kEndedJobRetention ago, and renders the registry (text format 0.0.4).
  std::string scrape(const ManagerSnapshot& snap, uint64_t store_bytes);

 private:
  using Clock = std::chrono::steady_clock;
  struct RunningSeries {
    prometheus::Gauge* step;
    prometheus::Gauge* tokens_per_second;
    prometheus::Gauge* loss;
    prometheus::Gauge* step_seconds;
  };
  struct StepHistogram {
    prometheus::Histogram* histogram;
    std::optional<Clock::time_point> ended;
  };

  // Serialises scrapes and step observations over the maps below; prometheus-cpp's families
  // lock only themselves, and two concurrent scrapes must not both remove the same series.
  std::mutex mu_;
  prometheus::Registry registry_;
  prometheus::Family<prometheus::Gauge>& jobs_;
  prometheus::Family<prometheus::Gauge>& queue_depth_;
  prometheus::Family<prometheus::Counter>& steps_total_;
  prometheus::Family<prometheus::Gauge>& job_step_;
  prometheus::Family<prometheus::Gauge>& job_tokens_per_second_;
  prometheus::Family<prometheus::Gauge>& job_loss_;
  prometheus::Family<prometheus::Gauge>& job_step_seconds_;
  prometheus::Family<prometheus::Gauge>& devices_held_;
  prometheus::Family<prometheus::Gauge>& devices_;
  prometheus::Family<prometheus::Gauge>& store_bytes_;
  prometheus::Family<prometheus::Histogram>& step_seconds_;
  prometheus::Counter& steps_total_value_;
  std::map<std::string, RunningSeries> running_;
  std::map<std::string, StepHistogram> histograms_;
};

}  // namespace megacpp::daemon
