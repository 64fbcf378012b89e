#pragma once
// For the metrics tests: reading a daemon's /metrics over HTTP, a strict parser of the
// Prometheus text exposition format, a CPU job kept training while a test looks on, and a real
// Prometheus server (/usr/bin/prometheus) on loopback.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "tests/daemon/daemon_harness.h"

namespace megacpp::testing {

inline httplib::Client http_client(const std::string& address) {
  const auto colon = address.rfind(':');
  httplib::Client client(address.substr(0, colon), std::stoi(address.substr(colon + 1)));
  client.set_connection_timeout(10, 0);
  client.set_read_timeout(30, 0);
  return client;
}

// Polls `done` (every 200 ms) until it holds or `seconds` pass; the machine may be busy, so
// deadlines are generous and nothing waits a fixed time.
inline bool poll_until(const std::function<bool()>& done, int seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (true) {
    if (done()) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct MetricFamily {
  std::string type;  // "" when the exposition gave none
  std::string help;
  std::vector<Sample> samples;
};

// The text exposition format, version 0.0.4, read strictly: every family has one HELP and one
// TYPE line before its samples, and a family's samples are not interleaved with another's.
// Each breach is one entry of `errors`.
struct Exposition {
  std::map<std::string, MetricFamily> families;
  std::vector<std::string> errors;

  // The series names a PromQL query may use: the family names, plus _bucket, _sum and _count for
  // histograms (and _sum, _count for summaries).
  std::set<std::string> series_names() const {
    std::set<std::string> out;
    for (const auto& [name, family] : families) {
      out.insert(name);
      if (family.type == "histogram") out.insert(name + "_bucket");
      if (family.type == "histogram" || family.type == "summary") {
        out.insert(name + "_sum");
        out.insert(name + "_count");
      }
    }
    return out;
  }

  // The samples named `name` (a family name, or a histogram's _bucket/_sum/_count) whose labels
  // include `labels`.
  std::vector<Sample> find(const std::string& name,
                           const std::map<std::string, std::string>& labels = {}) const {
    std::vector<Sample> out;
    for (const auto& [family_name, family] : families) {
      for (const auto& s : family.samples) {
        if (s.name != name) continue;
        bool match = true;
        for (const auto& [k, v] : labels) {
          auto it = s.labels.find(k);
          match = match && it != s.labels.end() && it->second == v;
        }
        if (match) out.push_back(s);
      }
    }
    return out;
  }
};

inline Exposition parse_exposition(const std::string& text) {
  Exposition out;
  std::string current;  // the family whose HELP or TYPE came last
  std::set<std::string> with_samples;
  size_t line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t end = text.find('\n', pos);
    const std::string line = text.substr(pos, end == std::string::npos ? end : end - pos);
    pos = end == std::string::npos ? text.size() : end + 1;
    ++line_no;
    const std::string where = "line " + std::to_string(line_no) + " \"" + line + "\": ";
    if (line.empty()) continue;
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) {
      const bool help = line[2] == 'H';
      const std::string rest = line.substr(7);
      const auto space = rest.find(' ');
      const std::string name = rest.substr(0, space);
      const std::string value = space == std::string::npos ? "" : rest.substr(space + 1);
      if (with_samples.contains(name)) {
        out.errors.push_back(where + "HELP/TYPE after the family's samples");
      }
      auto& family = out.families[name];
      std::string& field = help ? family.help : family.type;
      if (!field.empty()) out.errors.push_back(where + "a second " + (help ? "HELP" : "TYPE"));
      field = value;
      current = name;
      continue;
    }
    if (line[0] == '#') continue;
    Sample s;
    size_t i = line.find_first_of("{ ");
    if (i == std::string::npos) {
      out.errors.push_back(where + "no value");
      continue;
    }
    s.name = line.substr(0, i);
    if (line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const size_t eq = line.find('=', i);
        if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
          out.errors.push_back(where + "bad label");
          break;
        }
        const std::string key = line.substr(i, eq - i);
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) {
            ++j;
            value += line[j] == 'n' ? '\n' : line[j];
          } else {
            value += line[j];
          }
        }
        s.labels[key] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      i = line.find(' ', i);
    }
    if (i == std::string::npos) {
      out.errors.push_back(where + "no value");
      continue;
    }
    const std::string value = line.substr(i + 1, line.find(' ', i + 1) - i - 1);
    char* parsed_end = nullptr;
    s.value = std::strtod(value.c_str(), &parsed_end);
    if (parsed_end == value.c_str()) out.errors.push_back(where + "value is not a number");
    // The family a sample belongs to: its own name, or a histogram's/summary's base name.
    std::string family = s.name;
    if (!out.families.contains(family) || out.families[family].type.empty()) {
      for (const char* suffix : {"_bucket", "_sum", "_count"}) {
        const std::string_view sv(s.name);
        if (sv.ends_with(suffix)) {
          const std::string base(sv.substr(0, sv.size() - std::string_view(suffix).size()));
          if (out.families.contains(base)) family = base;
        }
      }
    }
    if (family != current) {
      out.errors.push_back(where + "sample outside its family's block (the last HELP/TYPE was " +
                           current + ")");
    }
    with_samples.insert(family);
    out.families[family].samples.push_back(std::move(s));
  }
  for (const auto& [name, family] : out.families) {
    if (family.type.empty()) out.errors.push_back(name + ": no TYPE line");
    if (family.help.empty()) out.errors.push_back(name + ": no HELP line");
  }
  return out;
}

// GET /metrics from a daemon; the body, or "" with a test failure.
inline std::string fetch_metrics(const Daemon& d) {
  auto client = http_client(d.http_address());
  auto response = client.Get("/metrics");
  if (!response) {
    ADD_FAILURE() << "GET /metrics: " << httplib::to_string(response.error());
    return "";
  }
  EXPECT_EQ(response->status, 200) << response->body;
  return response->body;
}

// Submits a CPU job long enough to outlast the test and waits until it has made `steps` steps.
inline megacpp::v1::Job start_training(const Daemon& d, int64_t steps = 3) {
  megacpp::v1::JobSpec spec = d.small_job(1000000);
  // Checkpoints would only add disk traffic to a busy machine; SIGTERM still writes one.
  spec.set_checkpoint_interval(1000);
  megacpp::v1::Job submitted;
  const grpc::Status s = submit(d, spec, &submitted);
  EXPECT_TRUE(s.ok()) << s.error_message();
  const std::string id = submitted.id();
  megacpp::v1::Job job;
  const bool ran = poll_until(
      [&] {
        grpc::ClientContext ctx;
        megacpp::v1::GetJobRequest get;
        get.set_id(id);
        return d.jobs()->GetJob(&ctx, get, &job).ok() && job.step() >= steps;
      },
      180);
  EXPECT_TRUE(ran) << "job " << id << " did not reach step " << steps << "; log:\n" << d.log();
  return job;
}

inline int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

inline const char* kPrometheusBinary = "/usr/bin/prometheus";

// A Prometheus server of its own: a temporary config and TSDB directory, a free loopback port,
// scraping `target` (host:port) every second as scrape job "megacpp", as README's scrape config
// does: without honor_labels, so a per-job label that clashed with Prometheus's own `job` would
// come back renamed `exported_job` and the tests' `job_id` selectors would find nothing.
class PrometheusServer {
 public:
  explicit PrometheusServer(const std::string& target) {
    write_text(dir_ / "prometheus.yml",
               "global:\n"
               "  scrape_interval: 1s\n"
               "  scrape_timeout: 1s\n"
               "  evaluation_interval: 1s\n"
               "scrape_configs:\n"
               "  - job_name: megacpp\n"
               "    static_configs:\n"
               "      - targets: ['" +
                   target + "']\n");
    // The port is free when asked but could be taken before Prometheus binds it: try again then.
    for (int attempt = 0; attempt < 5 && !ready_; ++attempt) {
      port_ = free_loopback_port();
      start();
      ready_ = poll_until(
                   [&] {
                     if (exited()) return true;
                     auto client = http_client(address());
                     auto r = client.Get("/-/ready");
                     return r && r->status == 200;
                   },
                   120) &&
               pid_ > 0;
      if (!ready_) stop();
    }
  }
  ~PrometheusServer() { stop(); }

  bool ready() const { return ready_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  std::string log() const { return read_bytes(dir_ / "prometheus.log"); }

  // GET /api/v1/query; the parsed answer, or null (the reason in `error`).
  nlohmann::json query(const std::string& promql, std::string* error = nullptr) const {
    auto client = http_client(address());
    const httplib::Params params = {{"query", promql}};
    auto r = client.Get("/api/v1/query", params, httplib::Headers{});
    if (!r) {
      if (error) *error = "no answer: " + httplib::to_string(r.error());
      return nullptr;
    }
    auto body = nlohmann::json::parse(r->body, nullptr, false);
    if (body.is_discarded()) {
      if (error) *error = "not JSON: " + r->body;
      return nullptr;
    }
    if (error && body.value("status", "") != "success") *error = r->body;
    return body;
  }

  // The first value of an instant-vector query, or nullopt when it has none (yet).
  std::optional<double> value(const std::string& promql) const {
    const auto body = query(promql);
    if (body.is_null() || body.value("status", "") != "success") return std::nullopt;
    const auto& result = body["data"]["result"];
    if (!result.is_array() || result.empty()) return std::nullopt;
    return std::stod(result[0]["value"][1].get<std::string>());
  }

  std::string targets() const {
    auto client = http_client(address());
    auto r = client.Get("/api/v1/targets");
    return r ? r->body : httplib::to_string(r.error());
  }

 private:
  void start() {
    pid_ = ::fork();
    if (pid_ == 0) {
      // Never outlive the test, even one that crashes.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      const std::string log = (dir_ / "prometheus.log").string();
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      const std::string config = "--config.file=" + (dir_ / "prometheus.yml").string();
      const std::string storage = "--storage.tsdb.path=" + (dir_ / "tsdb").string();
      const std::string listen = "--web.listen-address=" + address();
      ::execl(kPrometheusBinary, kPrometheusBinary, config.c_str(), storage.c_str(), listen.c_str(),
              nullptr);
      ::_exit(127);
    }
  }
  bool exited() {
    int status = 0;
    if (pid_ > 0 && ::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = 0;
      return true;
    }
    return pid_ <= 0;
  }
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    if (!poll_until([&] { return exited(); }, 30)) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    pid_ = 0;
  }

  TempDir dir_;
  pid_t pid_ = 0;
  int port_ = 0;
  bool ready_ = false;
};

}  // namespace megacpp::testing
