// /metrics as prometheus-cpp renders it: every family the daemon has always exported, each with
// its HELP and TYPE, the step-time histogram fed by step receipts, and a real Prometheus
// scraping a daemon while a CPU job trains.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <set>

#include "service/job_states.h"
#include "tests/daemon/daemon_harness.h"
#include "tests/daemon/metrics_support.h"

namespace megacpp {
namespace {

namespace v1 = megacpp::v1;
using testing::Daemon;
using testing::Exposition;
using testing::parse_exposition;
using testing::poll_until;

std::string errors_of(const Exposition& e) {
  std::string out;
  for (const auto& error : e.errors) out += error + "\n";
  return out;
}

// The families the hand-written exposition had, with their types (megacpp_devices had none:
// a gauge), and the step-time histogram.
const std::map<std::string, std::string> kFamilies = {
    {"megacpp_jobs", "gauge"},
    {"megacpp_queue_depth", "gauge"},
    {"megacpp_steps_total", "counter"},
    {"megacpp_job_step", "gauge"},
    {"megacpp_job_tokens_per_second", "gauge"},
    {"megacpp_job_loss", "gauge"},
    {"megacpp_job_step_seconds", "gauge"},
    {"megacpp_devices_held", "gauge"},
    {"megacpp_devices", "gauge"},
    {"megacpp_store_bytes", "gauge"},
    {"megacpp_step_seconds", "histogram"},
};

// The hand-written exposition this replaced announced megacpp_devices (with no TYPE) between
// megacpp_devices_held's TYPE and its samples: the parser the tests below rely on refuses it.
TEST(Metrics, ParserRefusesAFamilyWithoutTypeOrInterleavedWithAnother) {
  const Exposition old = parse_exposition(
      "# HELP megacpp_devices_held Devices held by jobs, by kind.\n"
      "# TYPE megacpp_devices_held gauge\n"
      "# HELP megacpp_devices Devices in the inventory, by kind.\n"
      "megacpp_devices_held{kind=\"cpu\"} 0\n"
      "megacpp_devices{kind=\"cpu\"} 2\n");
  const std::string errors = errors_of(old);
  EXPECT_NE(errors.find("megacpp_devices: no TYPE line"), std::string::npos) << errors;
  EXPECT_NE(errors.find("sample outside its family's block"), std::string::npos) << errors;
  const Exposition good = parse_exposition(
      "# HELP h Step time.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\n"
      "h_bucket{le=\"+Inf\"} 2\nh_sum 3.5\nh_count 2\n");
  EXPECT_TRUE(good.errors.empty()) << errors_of(good);
  EXPECT_EQ(good.series_names(), (std::set<std::string>{"h", "h_bucket", "h_sum", "h_count"}));
}

TEST(Metrics, EveryFamilyHasHelpAndTypeAndTheHistogramCountsEveryStep) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  const v1::Job job = testing::start_training(d);
  ASSERT_FALSE(job.id().empty());
  const std::map<std::string, std::string> by_job = {{"job_id", job.id()}};

  // The first scrape after the job started running has its series.
  Exposition e;
  ASSERT_TRUE(poll_until(
      [&] {
        e = parse_exposition(testing::fetch_metrics(d));
        return !e.find("megacpp_job_step", by_job).empty() &&
               !e.find("megacpp_step_seconds_count", by_job).empty();
      },
      120))
      << testing::fetch_metrics(d);
  EXPECT_TRUE(e.errors.empty()) << errors_of(e);
  for (const auto& [name, type] : kFamilies) {
    ASSERT_TRUE(e.families.contains(name)) << name;
    EXPECT_EQ(e.families.at(name).type, type) << name;
    EXPECT_FALSE(e.families.at(name).help.empty()) << name;
  }
  // Every state, zero or not.
  for (const v1::JobState state : job_states()) {
    EXPECT_EQ(e.find("megacpp_jobs", {{"state", job_state_name(state)}}).size(), 1u)
        << job_state_name(state);
  }
  EXPECT_EQ(e.find("megacpp_jobs", {{"state", "running"}})[0].value, 1);
  EXPECT_EQ(e.find("megacpp_devices", {{"kind", "cpu"}})[0].value, 2);
  EXPECT_EQ(e.find("megacpp_devices_held", {{"kind", "cpu"}})[0].value, 1);
  EXPECT_GT(e.find("megacpp_store_bytes")[0].value, 0);
  EXPECT_GE(e.find("megacpp_job_step", by_job)[0].value, 3);
  EXPECT_GT(e.find("megacpp_job_tokens_per_second", by_job)[0].value, 0);
  EXPECT_GT(e.find("megacpp_job_step_seconds", by_job)[0].value, 0);
  EXPECT_TRUE(std::isfinite(e.find("megacpp_job_loss", by_job)[0].value));

  // Cumulative buckets in increasing `le`, +Inf equal to the count; one observation per step
  // receipt, so with one job the count is the daemon's step counter (both move under one lock).
  const auto buckets = e.find("megacpp_step_seconds_bucket", by_job);
  ASSERT_GE(buckets.size(), 2u);
  double last_le = -1, last_count = 0;
  for (const auto& b : buckets) {
    const double le = std::stod(b.labels.at("le"));
    EXPECT_GT(le, last_le) << b.labels.at("le");
    EXPECT_GE(b.value, last_count) << b.labels.at("le");
    last_le = le;
    last_count = b.value;
  }
  EXPECT_TRUE(std::isinf(last_le));
  const double count = e.find("megacpp_step_seconds_count", by_job)[0].value;
  EXPECT_EQ(last_count, count);
  EXPECT_GE(count, 3);
  EXPECT_GT(e.find("megacpp_step_seconds_sum", by_job)[0].value, 0);
  EXPECT_EQ(e.find("megacpp_steps_total")[0].value, count);

  // Once the job has ended its gauges go, as they always did; its histogram stays for the
  // scrapes that have not yet seen its last steps.
  ASSERT_TRUE(testing::cancel_job(d, job.id()).ok());
  ASSERT_TRUE(poll_until(
      [&] {
        e = parse_exposition(testing::fetch_metrics(d));
        const auto cancelled = e.find("megacpp_jobs", {{"state", "cancelled"}});
        return !cancelled.empty() && cancelled[0].value == 1;
      },
      120))
      << testing::fetch_metrics(d) << d.log();
  EXPECT_TRUE(e.errors.empty()) << errors_of(e);
  EXPECT_TRUE(e.find("megacpp_job_step", by_job).empty());
  EXPECT_TRUE(e.find("megacpp_job_tokens_per_second", by_job).empty());
  EXPECT_GE(e.find("megacpp_step_seconds_count", by_job).at(0).value, count);
  EXPECT_EQ(d.stop(SIGTERM), 0);
}

// The dashboard's queries, as Grafana would send them over the last few seconds.
std::vector<std::string> dashboard_queries() {
  const std::filesystem::path file =
      std::filesystem::path(MEGACPP_SOURCE_DIR) / "deploy/grafana/megacpp-dashboard.json";
  const auto dashboard = nlohmann::json::parse(testing::read_bytes(file));
  std::vector<std::string> out;
  for (const auto& panel : dashboard.at("panels")) {
    for (const auto& target : panel.value("targets", nlohmann::json::array())) {
      std::string expr = target.at("expr");
      for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
               {"$__rate_interval", "10s"}, {"$instance", ".*"}}) {
        for (size_t at = expr.find(from); at != std::string::npos; at = expr.find(from, at)) {
          expr.replace(at, from.size(), to);
        }
      }
      out.push_back(expr);
    }
  }
  return out;
}

TEST(Metrics, PrometheusScrapesTheJobsThroughputStepsAndStepTimeQuantiles) {
  if (!std::filesystem::exists(testing::kPrometheusBinary)) {
    GTEST_SKIP() << testing::kPrometheusBinary
                 << " is missing (Debian package prometheus; deploy/install-deps.sh installs it)";
  }
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  const v1::Job job = testing::start_training(d);
  ASSERT_FALSE(job.id().empty());
  testing::PrometheusServer prometheus(d.http_address());
  ASSERT_TRUE(prometheus.ready()) << prometheus.log();

  // The scrape job's own label and the megacpp job id side by side: neither renamed.
  const std::string selector = "{job=\"megacpp\", job_id=\"" + job.id() + "\"}";
  std::optional<double> tokens, step;
  const bool scraped = poll_until(
      [&] {
        tokens = prometheus.value("megacpp_job_tokens_per_second" + selector);
        step = prometheus.value("megacpp_job_step" + selector);
        return tokens && step;
      },
      180);
  ASSERT_TRUE(scraped) << "targets: " << prometheus.targets() << "\nprometheus log:\n"
                       << prometheus.log();
  EXPECT_GT(*tokens, 0);
  EXPECT_GE(*step, 3);
  // The step count keeps rising while the job trains.
  EXPECT_TRUE(poll_until(
      [&] {
        const auto later = prometheus.value("megacpp_job_step" + selector);
        return later && *later > *step;
      },
      180));

  // p50 and p99 from the histogram: rate() needs two scrapes of it within the window.
  std::optional<double> p50, p99;
  const std::string rate =
      "sum by (le, job_id) (rate(megacpp_step_seconds_bucket" + selector + "[10s]))";
  EXPECT_TRUE(poll_until(
      [&] {
        p50 = prometheus.value("histogram_quantile(0.5, " + rate + ")");
        p99 = prometheus.value("histogram_quantile(0.99, " + rate + ")");
        return p50 && p99 && std::isfinite(*p50) && std::isfinite(*p99);
      },
      180))
      << prometheus.targets();
  if (p50 && p99) {
    EXPECT_GT(*p50, 0);
    EXPECT_LE(*p50, *p99);
    EXPECT_LE(*p99, 60);
  }

  // Every query of the Grafana dashboard is valid PromQL and finds data.
  const auto queries = dashboard_queries();
  EXPECT_GE(queries.size(), 7u);
  for (const std::string& expr : queries) {
    std::string error;
    bool found = false;
    poll_until(
        [&] {
          error.clear();
          const auto body = prometheus.query(expr, &error);
          found = error.empty() && !body["data"]["result"].empty();
          return found || !error.empty();
        },
        60);
    EXPECT_TRUE(error.empty()) << expr << ": " << error;
    EXPECT_TRUE(found) << expr << " has no data";
  }
  EXPECT_EQ(d.stop(SIGTERM), 0);
}

}  // namespace
}  // namespace megacpp
