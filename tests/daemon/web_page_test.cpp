// The web page at / in a real browser: headless Chromium (/usr/bin/chromium) loads it from a
// daemon with a bearer token, after a CPU job ran to completion, with the token in the URL
// fragment. The page's curves must have one point per step receipt (counted through gRPC), its
// gate and kernel tables one row per receipt, and its compare view CompareRuns' verdicts. The
// page's data routes refuse callers without the token; a screenshot lands in the test's output.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "receipts/store.h"
#include "tests/daemon/daemon_harness.h"
#include "tests/daemon/metrics_support.h"

namespace megacpp {
namespace {

namespace v1 = megacpp::v1;
using testing::Daemon;
using testing::poll_until;

constexpr const char* kChromium = "/usr/bin/chromium";
// '+' and '/' as in base64 tokens: the page must not read the fragment as a query string.
constexpr const char* kToken = "web+page/token";
constexpr const char* kTokenInUrl = "web%2Bpage%2Ftoken";

// $TEST_UNDECLARED_OUTPUTS_DIR when the runner gives one, else a folder in the working directory;
// it outlives the test, for a person to look at.
std::filesystem::path output_dir() {
  const char* given = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  const std::filesystem::path dir = given != nullptr && *given != '\0'
                                        ? std::filesystem::path(given)
                                        : std::filesystem::current_path() / "web_page_test_output";
  std::filesystem::create_directories(dir);
  return dir;
}

struct BrowserRun {
  int exit_status = -1;  // -1: killed at the deadline
  std::string stdout_text;
  std::string log;
};

// Headless Chromium with its own profile, as root (hence --no-sandbox); `mode_args` say what to
// produce (--dump-dom, --screenshot=...). Virtual time stops while the page's fetches are pending,
// so the budget is the page's own timers, not the daemon's answer time.
BrowserRun run_chromium(const std::vector<std::string>& mode_args, const std::string& url,
                        const std::filesystem::path& work_dir, int timeout_seconds = 90) {
  const std::filesystem::path profile = work_dir / "profile";
  const std::filesystem::path out = work_dir / "stdout", log = work_dir / "chromium.log";
  std::vector<std::string> args = {kChromium,
                                   "--headless",
                                   "--no-sandbox",
                                   "--disable-gpu",
                                   "--disable-dev-shm-usage",
                                   "--no-first-run",
                                   "--user-data-dir=" + profile.string(),
                                   "--virtual-time-budget=5000"};
  args.insert(args.end(), mode_args.begin(), mode_args.end());
  args.push_back(url);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // A group of its own, so that a browser past its deadline goes with all its children.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int out_fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int log_fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out_fd, 1);
    ::dup2(log_fd, 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(kChromium, argv.data());
    ::_exit(127);
  }
  BrowserRun run;
  int status = 0;
  const bool exited =
      poll_until([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, timeout_seconds);
  if (exited) {
    run.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  } else {
    ::kill(-pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  run.stdout_text = testing::read_bytes(out);
  run.log = testing::read_bytes(log);
  return run;
}

// The start tag of the first element with this attribute text ("" when there is none).
std::string start_tag_with(const std::string& dom, const std::string& attribute_text) {
  const auto at = dom.find(attribute_text);
  if (at == std::string::npos) return "";
  const auto open = dom.rfind('<', at);
  return dom.substr(open, dom.find('>', at) - open + 1);
}

std::string start_tag(const std::string& dom, const std::string& id) {
  return start_tag_with(dom, " id=\"" + id + "\"");
}

// An attribute of a start tag; nullopt when absent. The leading space keeps "points" from
// matching inside "data-points".
std::optional<std::string> attribute(const std::string& tag, const std::string& name) {
  const std::string key = " " + name + "=\"";
  const auto at = tag.find(key);
  if (at == std::string::npos) return std::nullopt;
  const auto begin = at + key.size();
  return tag.substr(begin, tag.find('"', begin) - begin);
}

// The element with this id through its closing tag (for svg and table, which do not nest here).
std::string element(const std::string& dom, const std::string& id, const std::string& tag_name) {
  const auto at = dom.find(" id=\"" + id + "\"");
  if (at == std::string::npos) return "";
  const auto open = dom.rfind('<', at);
  const auto close = dom.find("</" + tag_name + ">", at);
  return dom.substr(open, close == std::string::npos ? std::string::npos : close - open);
}

// The polylines' start tags inside an svg element.
std::vector<std::string> polylines(const std::string& svg) {
  std::vector<std::string> out;
  for (auto at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1))
    out.push_back(svg.substr(at, svg.find('>', at) - at + 1));
  return out;
}

size_t point_count(const std::string& points) {
  std::istringstream in(points);
  size_t n = 0;
  for (std::string xy; in >> xy;) ++n;
  return n;
}

size_t count_of(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

void authorize(grpc::ClientContext* context) {
  context->AddMetadata("authorization", std::string("Bearer ") + kToken);
}

int http_status(httplib::Client& http, const std::string& path, const std::string& token) {
  httplib::Headers headers;
  if (!token.empty()) headers.emplace("Authorization", "Bearer " + token);
  auto r = http.Get(path, headers);
  return r ? r->status : -1;
}

TEST(WebPage, ChromiumDrawsOnePointPerStepReceiptAndTheGatesAndComparison) {
  if (!std::filesystem::exists(kChromium)) {
    GTEST_SKIP() << kChromium
                 << " is missing (Debian package chromium; deploy/install-deps.sh installs it)";
  }
  const auto started = std::chrono::steady_clock::now();
  testing::TempDir secrets, browser;
  testing::write_text(secrets / "token", std::string(kToken) + "\n");
  Daemon d([&](nlohmann::json& c) {
    c["security"] = {{"token_file", (secrets / "token").string()}};
  });
  ASSERT_EQ(d.start(), -1) << d.log();

  v1::JobSpec spec = d.small_job(12);
  spec.set_name("web-page");
  spec.set_eval_interval(4);
  spec.set_eval_batches(1);
  spec.set_checkpoint_interval(1000);
  v1::Job job;
  {
    grpc::ClientContext context;
    authorize(&context);
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    v1::SubmitJobResponse response;
    const grpc::Status s = d.jobs()->SubmitJob(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    job = response.job();
  }
  // A job's end is visible only after all its receipts are in the store.
  ASSERT_TRUE(poll_until(
      [&] {
        grpc::ClientContext context;
        authorize(&context);
        v1::GetJobRequest get;
        get.set_id(job.id());
        return d.jobs()->GetJob(&context, get, &job).ok() && job.state() != v1::JOB_STATE_QUEUED &&
               job.state() != v1::JOB_STATE_RUNNING;
      },
      120))
      << d.log();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.error();

  // What the page must show, read through the API and the store.
  v1::ListStepReceiptsResponse steps;
  v1::ListGateDecisionsResponse gates;
  v1::ListKernelReceiptsResponse kernels;
  v1::CompareRunsResponse comparison;
  {
    grpc::ClientContext c1, c2, c3, c4;
    for (auto* c : {&c1, &c2, &c3, &c4}) authorize(c);
    v1::ListStepReceiptsRequest step_request;
    step_request.set_job_id(job.id());
    step_request.set_limit(100000);
    ASSERT_TRUE(d.receipts()->ListStepReceipts(&c1, step_request, &steps).ok());
    v1::JobReceiptsRequest job_request;
    job_request.set_job_id(job.id());
    ASSERT_TRUE(d.receipts()->ListGateDecisions(&c2, job_request, &gates).ok());
    ASSERT_TRUE(d.receipts()->ListKernelReceipts(&c3, job_request, &kernels).ok());
    v1::CompareRunsRequest compare_request;
    compare_request.set_job_a(job.id());
    compare_request.set_job_b(job.id());
    ASSERT_TRUE(d.receipts()->CompareRuns(&c4, compare_request, &comparison).ok());
  }
  const size_t evals =
      receipts::Store(d.store_path(), receipts::OpenMode::kReadOnly).evals(job.id()).size();
  ASSERT_GT(steps.steps_size(), 0);
  ASSERT_GT(gates.decisions_size(), 0);
  ASSERT_GT(evals, 0u);
  ASSERT_EQ(comparison.metrics_size(), 4);

  // Over HTTP: the shell is served to anyone and carries no data; the data needs the token.
  auto http = testing::http_client(d.http_address());
  auto page = http.Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(page->get_header_value("Content-Type"), "text/html; charset=utf-8");
  EXPECT_NE(page->get_header_value("Content-Security-Policy").find("default-src 'none'"),
            std::string::npos);
  EXPECT_EQ(page->body.find(job.id()), std::string::npos);
  const std::string job_path = "/api/jobs/" + job.id();
  for (const std::string& path : {std::string("/api/jobs"), job_path, job_path + "/steps",
                                  job_path + "/evals", job_path + "/gates", job_path + "/kernels",
                                  "/api/compare?a=" + job.id() + "&b=" + job.id()}) {
    EXPECT_EQ(http_status(http, path, ""), 401) << path;
    EXPECT_EQ(http_status(http, path, "wrong"), 401) << path;
    EXPECT_EQ(http_status(http, path, kToken), 200) << path;
  }
  EXPECT_EQ(http_status(http, "/api/jobs/no-such-job/steps", kToken), 404);
  EXPECT_EQ(http_status(http, "/api/compare?a=" + job.id(), kToken), 400);
  EXPECT_EQ(http_status(http, job_path + "/steps?limit=-1", kToken), 400);
  // A page of no jobs is refused, not served (it once read past an empty list).
  EXPECT_EQ(http_status(http, "/api/jobs?limit=0", kToken), 400);
  EXPECT_EQ(http_status(http, "/api/jobs?page_token=" + job.id(), kToken), 200);
  EXPECT_EQ(http_status(http, "/api/jobs?page_token=job-that-never-was", kToken), 400);
  for (const std::string& path :
       {std::string("/"), std::string("/api/jobs"), job_path + "/steps"}) {
    auto post =
        http.Post(path, {{"Authorization", std::string("Bearer ") + kToken}}, "", "text/plain");
    ASSERT_TRUE(post) << path;
    EXPECT_EQ(post->status, 405) << path;
  }

  // In the browser, the token in the fragment; the job compared with itself.
  const std::filesystem::path out_dir = output_dir();
  const std::string url = "http://" + d.http_address() + "/#token=" + kTokenInUrl +
                          "&job=" + job.id() + "&a=" + job.id() + "&b=" + job.id();
  const BrowserRun dumped = run_chromium({"--dump-dom"}, url, browser.path());
  testing::write_text(out_dir / "web_page.html", dumped.stdout_text);
  std::cout << "web page DOM: " << (out_dir / "web_page.html").string() << std::endl;
  ASSERT_EQ(dumped.exit_status, 0) << dumped.log;
  const std::string& dom = dumped.stdout_text;
  ASSERT_EQ(attribute(start_tag(dom, "error"), "hidden"), "") << dom << "\n" << dumped.log;
  ASSERT_NE(dom.find("data-ready=\"true\""), std::string::npos) << dom << "\n" << dumped.log;
  EXPECT_EQ(dom.find(kToken), std::string::npos) << "the token is rendered into the page";

  // The jobs table: the job, its state and its progress.
  const std::string row = start_tag_with(dom, " data-job=\"" + job.id() + "\"");
  EXPECT_EQ(attribute(row, "data-state"), "succeeded") << row;
  EXPECT_NE(dom.find("<progress max=\"12\" value=\"12\">"), std::string::npos);

  // One point per step receipt on the loss and tokens/s curves, per eval on validation loss.
  const auto receipts_count = std::to_string(steps.steps_size());
  for (const auto& [chart, series, expected] :
       std::vector<std::tuple<std::string, std::string, size_t>>{
           {"chart-loss", "loss", static_cast<size_t>(steps.steps_size())},
           {"chart-tokens", "tokens_per_s", static_cast<size_t>(steps.steps_size())},
           {"chart-val-loss", "val_loss", evals}}) {
    const std::string svg = element(dom, chart, "svg");
    ASSERT_FALSE(svg.empty()) << chart << " is missing:\n" << dom;
    EXPECT_EQ(attribute(start_tag(dom, chart), "data-points"), std::to_string(expected)) << chart;
    const auto lines = polylines(svg);
    ASSERT_EQ(lines.size(), 1u) << svg;
    EXPECT_EQ(attribute(lines[0], "data-series"), series);
    EXPECT_EQ(point_count(attribute(lines[0], "points").value_or("")), expected) << lines[0];
  }
  EXPECT_EQ(attribute(start_tag(dom, "job"), "data-step-receipts"), receipts_count);

  // A row per gate decision, each with the decision the store holds.
  const std::string gate_table = element(dom, "gates-table", "table");
  EXPECT_EQ(attribute(start_tag(dom, "gates-table"), "data-rows"),
            std::to_string(gates.decisions_size()));
  EXPECT_EQ(count_of(gate_table, "<tr data-gate="), static_cast<size_t>(gates.decisions_size()));
  for (const auto& g : gates.decisions()) {
    EXPECT_NE(gate_table.find("<tr data-gate=\"" + g.gate() + "\" data-decision=\"" + g.decision() +
                              "\">"),
              std::string::npos)
        << g.gate() << " " << g.decision() << "\n"
        << gate_table;
  }
  EXPECT_EQ(attribute(start_tag(dom, "kernels-table"), "data-rows"),
            std::to_string(kernels.kernels_size()));

  // The compare view: CompareRuns' verdict per metric, both curves with every step receipt.
  const std::string compare_table = element(dom, "compare-table", "table");
  EXPECT_FALSE(attribute(start_tag(dom, "compare-table"), "hidden").has_value());
  for (const auto& m : comparison.metrics()) {
    EXPECT_NE(compare_table.find("<tr data-metric=\"" + m.metric() + "\" data-verdict=\"" +
                                 m.verdict() + "\">"),
              std::string::npos)
        << m.metric() << " " << m.verdict() << "\n"
        << compare_table;
  }
  const auto compared = polylines(element(dom, "compare-loss", "svg"));
  ASSERT_EQ(compared.size(), 2u) << dom;
  for (const auto& line : compared) {
    EXPECT_EQ(point_count(attribute(line, "points").value_or("")),
              static_cast<size_t>(steps.steps_size()))
        << line;
  }

  // Without the token the browser gets the shell and the token form, and no data.
  testing::TempDir anonymous_browser;
  const BrowserRun anonymous =
      run_chromium({"--dump-dom"}, "http://" + d.http_address() + "/", anonymous_browser.path());
  ASSERT_EQ(anonymous.exit_status, 0) << anonymous.log;
  EXPECT_NE(anonymous.stdout_text.find("data-ready=\"error\""), std::string::npos)
      << anonymous.stdout_text;
  EXPECT_FALSE(attribute(start_tag(anonymous.stdout_text, "auth"), "hidden").has_value())
      << anonymous.stdout_text;
  EXPECT_EQ(anonymous.stdout_text.find(job.id()), std::string::npos);

  // The screenshot, for people.
  const std::filesystem::path png = out_dir / "web_page.png";
  std::filesystem::remove(png);
  const BrowserRun shot = run_chromium({"--screenshot=" + png.string(), "--window-size=1280,1800"},
                                       url, browser.path());
  EXPECT_EQ(shot.exit_status, 0) << shot.log;
  ASSERT_TRUE(std::filesystem::exists(png)) << shot.log;
  // A blank 1280x1800 page compresses to a few KiB; charts, tables and text do not.
  EXPECT_GT(std::filesystem::file_size(png), 20000u);
  EXPECT_EQ(testing::read_bytes(png).substr(0, 8), "\x89PNG\r\n\x1a\n");
  std::cout << "web page screenshot: " << png.string() << std::endl;
  std::cout << "test took "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()
            << " s" << std::endl;
  EXPECT_EQ(d.stop(SIGTERM), 0);
}

}  // namespace
}  // namespace megacpp
