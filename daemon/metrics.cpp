#include "daemon/metrics.h"

#include <prometheus/text_serializer.h>

#include <algorithm>
#include <set>

#include "daemon/job_manager.h"
#include "service/job_states.h"

namespace megacpp::daemon {

namespace v1 = megacpp::v1;

// Not "job": Prometheus attaches its own `job` label (the scrape job) to every series and renames
// a scraped `job` to `exported_job`, so the megacpp job id would need honor_labels to survive.
constexpr const char* kJobLabel = "job_id";

const std::vector<double>& DaemonMetrics::step_seconds_buckets() {
  static const std::vector<double> buckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                              0.5,   1,      2.5,   5,    10,    25,   60};
  return buckets;
}

// The family names and meanings are those of the hand-written exposition they replace, so
// dashboards and alerts written against it keep working once they select kJobLabel.
DaemonMetrics::DaemonMetrics()
    : jobs_(prometheus::BuildGauge()
                .Name("megacpp_jobs")
                .Help("Jobs known to the daemon, by state.")
                .Register(registry_)),
      queue_depth_(prometheus::BuildGauge()
                       .Name("megacpp_queue_depth")
                       .Help("Jobs waiting for devices.")
                       .Register(registry_)),
      steps_total_(prometheus::BuildCounter()
                       .Name("megacpp_steps_total")
                       .Help("Training steps completed under this daemon.")
                       .Register(registry_)),
      job_step_(prometheus::BuildGauge()
                    .Name("megacpp_job_step")
                    .Help("Last completed step of a running job.")
                    .Register(registry_)),
      job_tokens_per_second_(prometheus::BuildGauge()
                                 .Name("megacpp_job_tokens_per_second")
                                 .Help("Training throughput of a running job.")
                                 .Register(registry_)),
      job_loss_(prometheus::BuildGauge()
                    .Name("megacpp_job_loss")
                    .Help("Last training loss of a running job.")
                    .Register(registry_)),
      job_step_seconds_(prometheus::BuildGauge()
                            .Name("megacpp_job_step_seconds")
                            .Help("Step time of a running job.")
                            .Register(registry_)),
      devices_held_(prometheus::BuildGauge()
                        .Name("megacpp_devices_held")
                        .Help("Devices held by jobs, by kind.")
                        .Register(registry_)),
      devices_(prometheus::BuildGauge()
                   .Name("megacpp_devices")
                   .Help("Devices in the inventory, by kind.")
                   .Register(registry_)),
      store_bytes_(prometheus::BuildGauge()
                       .Name("megacpp_store_bytes")
                       .Help("Size of the receipt store's main file.")
                       .Register(registry_)),
      step_seconds_(prometheus::BuildHistogram()
                        .Name("megacpp_step_seconds")
                        .Help("Training step time as the executors report it, by job; "
                              "histogram_quantile over its buckets gives p50/p99.")
                        .Register(registry_)),
      steps_total_value_(steps_total_.Add({})) {}

void DaemonMetrics::observe_step(const std::string& job_id, double step_seconds) {
  std::lock_guard lock(mu_);
  steps_total_value_.Increment();
  auto it = histograms_.find(job_id);
  if (it == histograms_.end()) {
    auto* histogram = &step_seconds_.Add({{kJobLabel, job_id}}, step_seconds_buckets());
    it = histograms_.emplace(job_id, StepHistogram{histogram, std::nullopt}).first;
  }
  // A job that resumes after an interruption is running again: keep its histogram.
  it->second.ended.reset();
  it->second.histogram->Observe(std::max(0.0, step_seconds));
}

void DaemonMetrics::job_ended(const std::string& job_id) {
  std::lock_guard lock(mu_);
  if (auto it = histograms_.find(job_id); it != histograms_.end()) it->second.ended = Clock::now();
}

std::string DaemonMetrics::scrape(const ManagerSnapshot& snap, uint64_t store_bytes) {
  std::lock_guard lock(mu_);
  // Every state, zeros included: a panel or alert on a state no job is in reads 0, not "no data".
  for (const v1::JobState job_state : job_states()) {
    const std::string& state = job_state_name(job_state);
    const auto it = snap.jobs_by_state.find(state);
    jobs_.Add({{"state", state}}).Set(it == snap.jobs_by_state.end() ? 0 : it->second);
  }
  queue_depth_.Add({}).Set(static_cast<double>(snap.queued.size()));

  std::set<std::string> running;
  for (const auto& j : snap.running) {
    running.insert(j.id());
    auto it = running_.find(j.id());
    if (it == running_.end()) {
      const prometheus::Labels labels{{kJobLabel, j.id()}};
      it = running_
               .emplace(j.id(),
                        RunningSeries{&job_step_.Add(labels), &job_tokens_per_second_.Add(labels),
                                      &job_loss_.Add(labels), &job_step_seconds_.Add(labels)})
               .first;
    }
    const double tokens_per_step = static_cast<double>(j.spec().batch()) * j.spec().seqlen() *
                                   std::max(1, j.spec().grad_accum());
    it->second.step->Set(static_cast<double>(j.step()));
    it->second.tokens_per_second->Set(j.tokens_per_s());
    it->second.loss->Set(j.loss());
    it->second.step_seconds->Set(j.tokens_per_s() > 0 ? tokens_per_step / j.tokens_per_s() : 0.0);
  }
  for (auto it = running_.begin(); it != running_.end();) {
    if (running.contains(it->first)) {
      ++it;
      continue;
    }
    job_step_.Remove(it->second.step);
    job_tokens_per_second_.Remove(it->second.tokens_per_second);
    job_loss_.Remove(it->second.loss);
    job_step_seconds_.Remove(it->second.step_seconds);
    it = running_.erase(it);
  }

  std::map<std::string, std::pair<int, int>> by_kind;  // kind -> (held, all)
  for (const auto& d : snap.devices) {
    by_kind[d.kind].first += d.held_by.empty() ? 0 : 1;
    by_kind[d.kind].second += 1;
  }
  for (const auto& [kind, counts] : by_kind) {
    devices_held_.Add({{"kind", kind}}).Set(counts.first);
    devices_.Add({{"kind", kind}}).Set(counts.second);
  }
  store_bytes_.Add({}).Set(static_cast<double>(store_bytes));

  const auto now = Clock::now();
  for (auto it = histograms_.begin(); it != histograms_.end();) {
    if (it->second.ended && now - *it->second.ended > kEndedJobRetention) {
      step_seconds_.Remove(it->second.histogram);
      it = histograms_.erase(it);
    } else {
      ++it;
    }
  }
  return prometheus::TextSerializer().Serialize(registry_.Collect());
}

}  // namespace megacpp::daemon
