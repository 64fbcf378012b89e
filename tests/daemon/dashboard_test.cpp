// deploy/grafana/megacpp-dashboard.json against what a live daemon exports: every metric a
// panel or variable queries is one of /metrics' series, so a renamed family cannot leave the
// dashboard silently empty.
#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <set>

#include "tests/daemon/daemon_harness.h"
#include "tests/daemon/metrics_support.h"

namespace megacpp {
namespace {

using nlohmann::json;
using testing::Daemon;

const std::filesystem::path kDashboard =
    std::filesystem::path(MEGACPP_SOURCE_DIR) / "deploy/grafana/megacpp-dashboard.json";

// The megacpp_* names a PromQL expression uses; quoted strings (label values, regexes) skipped.
std::set<std::string> megacpp_names(const std::string& expr) {
  std::set<std::string> out;
  auto ident = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
  };
  for (size_t i = 0; i < expr.size();) {
    const char c = expr[i];
    if (c == '"' || c == '\'' || c == '`') {
      size_t j = i + 1;
      while (j < expr.size() && expr[j] != c) j += expr[j] == '\\' ? 2 : 1;
      i = j + 1;
    } else if (ident(c) || c == ':') {
      size_t j = i;
      while (j < expr.size() && (ident(expr[j]) || expr[j] == ':')) ++j;
      const std::string word = expr.substr(i, j - i);
      if (word.starts_with("megacpp_")) out.insert(word);
      i = j;
    } else {
      ++i;
    }
  }
  return out;
}

TEST(Dashboard, NameParsingSkipsStringsAndFindsEveryMetric) {
  EXPECT_EQ(megacpp_names("histogram_quantile(0.5, sum by (le) (rate(megacpp_step_seconds_bucket{"
                          "job_id=\"megacpp_not_a_metric\"}[5m]))) / megacpp_jobs"),
            (std::set<std::string>{"megacpp_step_seconds_bucket", "megacpp_jobs"}));
}

TEST(Dashboard, EveryPanelQueriesOnlyMetricsTheDaemonExports) {
  const json dashboard = json::parse(testing::read_bytes(kDashboard), nullptr, false);
  ASSERT_FALSE(dashboard.is_discarded()) << kDashboard << " is not valid JSON";

  // The exported names from a daemon with a job training, so that the per-job families and the
  // step-time histogram have series.
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  const auto job = testing::start_training(d);
  ASSERT_FALSE(job.id().empty());
  testing::Exposition exposition;
  ASSERT_TRUE(testing::poll_until(
      [&] {
        exposition = testing::parse_exposition(testing::fetch_metrics(d));
        return !exposition.find("megacpp_job_step", {{"job_id", job.id()}}).empty() &&
               !exposition.find("megacpp_step_seconds_bucket", {{"job_id", job.id()}}).empty();
      },
      120));
  const std::set<std::string> exported = exposition.series_names();
  // A legend naming a label no series carries shows nothing useful; `job` would show the scrape
  // job's name for every series (Prometheus's own label, not the megacpp job id).
  std::set<std::string> labels = {"instance"};
  for (const auto& [name, family] : exposition.families) {
    for (const auto& sample : family.samples) {
      for (const auto& [key, value] : sample.labels) labels.insert(key);
    }
  }
  EXPECT_EQ(d.stop(SIGTERM), 0);

  // Importable with a datasource chosen at import: one input, and every query goes through it.
  ASSERT_TRUE(dashboard.contains("__inputs"));
  ASSERT_EQ(dashboard["__inputs"].size(), 1u);
  EXPECT_EQ(dashboard["__inputs"][0]["name"], "DS_PROMETHEUS");
  EXPECT_EQ(dashboard["__inputs"][0]["pluginId"], "prometheus");
  EXPECT_GE(dashboard.value("schemaVersion", 0), 36);
  const json datasource = {{"type", "prometheus"}, {"uid", "${DS_PROMETHEUS}"}};

  std::set<std::string> used;
  auto check_query = [&](const std::string& where, const std::string& expr) {
    const auto names = megacpp_names(expr);
    EXPECT_FALSE(names.empty()) << where << ": " << expr << " queries no megacpp metric";
    for (const auto& name : names) {
      EXPECT_TRUE(exported.contains(name))
          << where << ": " << name << " is not exported by the daemon (" << kDashboard << ")";
      used.insert(name);
    }
  };
  std::set<int> ids;
  ASSERT_FALSE(dashboard["panels"].empty());
  for (const auto& panel : dashboard["panels"]) {
    const std::string where = "panel \"" + panel.value("title", std::string()) + "\"";
    EXPECT_TRUE(ids.insert(panel.value("id", -1)).second) << where << ": duplicate id";
    EXPECT_EQ(panel["datasource"], datasource) << where;
    ASSERT_FALSE(panel.value("targets", json::array()).empty()) << where << " has no query";
    for (const auto& target : panel["targets"]) {
      EXPECT_EQ(target["datasource"], datasource) << where;
      check_query(where + " target " + target.value("refId", std::string()),
                  target.value("expr", std::string()));
      const std::string legend = target.value("legendFormat", std::string());
      for (size_t open = legend.find("{{"); open != std::string::npos;
           open = legend.find("{{", open + 2)) {
        const size_t close = legend.find("}}", open);
        ASSERT_NE(close, std::string::npos) << where << ": unclosed {{ in legend " << legend;
        std::string label = legend.substr(open + 2, close - open - 2);
        std::erase(label, ' ');
        EXPECT_TRUE(labels.contains(label))
            << where << ": legend " << legend << " names label " << label
            << ", which no /metrics series carries (" << kDashboard << ")";
      }
    }
  }
  for (const auto& variable : dashboard["templating"]["list"]) {
    check_query("variable " + variable.value("name", std::string()),
                variable.value("definition", std::string()));
  }
  // The panels the dashboard is for: jobs by state, throughput, loss, step-time quantiles,
  // queue length, devices, store size.
  for (const char* name :
       {"megacpp_jobs", "megacpp_job_tokens_per_second", "megacpp_job_loss",
        "megacpp_step_seconds_bucket", "megacpp_queue_depth", "megacpp_devices",
        "megacpp_devices_held", "megacpp_store_bytes", "megacpp_job_step", "megacpp_steps_total"}) {
    EXPECT_TRUE(used.contains(name)) << "no panel shows " << name;
  }
}

}  // namespace
}  // namespace megacpp
