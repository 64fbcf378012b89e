// megacppd job lifecycle under trouble: an end published only once committed, stopped or stuck
// executors, restart backoff, bounded event history and watch streams. Real daemons and
// executors; deadlines are generous (a busy 2-core machine), timeouts configured small only
// where a test waits for them.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <sqlite3.h>

#include <atomic>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "receipts/store.h"
#include "tests/daemon/daemon_harness.h"

namespace megacpp {
namespace {

namespace v1 = megacpp::v1;
using nlohmann::json;
using testing::cancel_job;
using testing::Daemon;
using testing::ended;
using testing::get_job;
using testing::submit;
using testing::wait_for;
using Clock = std::chrono::steady_clock;

// The job's one executor, once it has one.
pid_t executor_of(const Daemon& d) {
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < deadline) {
    const auto pids = testing::executor_pids(d.pid());
    if (pids.size() == 1) return pids[0];
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "no executor";
  return 0;
}

bool gone(pid_t pid) {
  return ::kill(pid, 0) != 0;  // reaped by the daemon
}

grpc::Status run_summary(const Daemon& d, const std::string& id) {
  grpc::ClientContext context;
  v1::JobReceiptsRequest request;
  request.set_job_id(id);
  v1::RunSummaryReceipt out;
  return d.receipts()->GetRunSummary(&context, request, &out);
}

int64_t newest_recorded_step(const Daemon& d, const std::string& id) {
  grpc::ClientContext context;
  v1::ListStepReceiptsRequest request;
  request.set_job_id(id);
  request.set_newest_first(true);
  request.set_limit(1);
  v1::ListStepReceiptsResponse out;
  if (!d.receipts()->ListStepReceipts(&context, request, &out).ok() || out.steps_size() == 0)
    return 0;
  return out.steps(0).step();
}

// A model config padded with whitespace to `bytes`: every copy of the job is that large.
std::string padded(const std::string& config_json, size_t bytes) {
  return config_json +
         std::string(bytes > config_json.size() ? bytes - config_json.size() : 0, ' ');
}

// What one WatchJob stream delivered.
struct Watched {
  std::vector<int64_t> steps;  // training steps, in order
  std::vector<int64_t> evals;
  int summaries = 0;
  v1::JobState last = v1::JOB_STATE_UNSPECIFIED;
  grpc::Status status;

  void add(const v1::JobEvent& event) {
    if (event.has_step())
      (event.step().val_loss() < 0 ? steps : evals).push_back(event.step().step());
    if (event.has_summary()) ++summaries;
    last = event.job().state();
  }
};

Watched watch_to_end(const Daemon& d, const std::string& id) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(180));
  v1::WatchJobRequest request;
  request.set_id(id);
  auto reader = d.jobs()->WatchJob(&context, request);
  Watched w;
  v1::JobEvent event;
  while (reader->Read(&event)) w.add(event);
  w.status = reader->Finish();
  return w;
}

// Where `got` first departs from `want` (for a failure message).
std::string first_difference(const std::vector<int64_t>& got, const std::vector<int64_t>& want) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (i >= want.size() || got[i] != want[i]) {
      return fmt::format("{} of {} events; at index {}: {} (then {})", got.size(), want.size(), i,
                         got[i], i + 1 < got.size() ? std::to_string(got[i + 1]) : "end");
    }
  }
  return fmt::format("{} of {} events, in order", got.size(), want.size());
}

std::vector<int64_t> one_to(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 1; i <= n; ++i) out.push_back(i);
  return out;
}

// What every watcher of a job that succeeded must have got: each step once, in order, the evals
// (in order, each once), one summary and the end.
void expect_the_whole_job(const Watched& w, int64_t steps, const std::vector<int64_t>& evals,
                          const std::string& name) {
  EXPECT_TRUE(w.status.ok()) << name << ": " << w.status.error_message();
  EXPECT_EQ(w.steps, one_to(steps)) << name;
  EXPECT_EQ(w.evals, evals) << name << ": " << first_difference(w.evals, evals);
  EXPECT_EQ(w.summaries, 1) << name;
  EXPECT_EQ(w.last, v1::JOB_STATE_SUCCEEDED) << name;
}

// Item: a job's end is visible (GetJob, ListJobs, WatchJob, /status) only once its run summary
// and last receipts are committed. The test holds the store's write lock from another
// connection while the executor finishes: the daemon cannot commit, so it must not report the end.
TEST(Lifecycle, EndIsPublishedOnlyAfterTheSummaryAndLastStepsAreCommitted) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::JobSpec spec = d.small_job(1000000);
  spec.set_max_seconds(1);  // the executor ends by itself: time_limit, a success
  spec.set_checkpoint_interval(0);
  v1::Job job;
  ASSERT_TRUE(submit(d, spec, &job).ok());
  wait_for(d, job.id(), [](const v1::Job& j) { return j.step() >= 1; });

  // A watcher that reads the store the moment its stream ends, like `megacpp watch` followed
  // by `megacpp receipts runs`.
  std::atomic<bool> watch_done{false};
  grpc::Status summary_after_watch;
  v1::JobState watched_state = v1::JOB_STATE_UNSPECIFIED;
  std::thread watcher([&] {
    const Watched w = watch_to_end(d, job.id());
    summary_after_watch = run_summary(d, job.id());
    watched_state = w.last;
    watch_done = true;
  });

  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open_v2(d.store_path().c_str(), &db, SQLITE_OPEN_READWRITE, nullptr),
            SQLITE_OK);
  sqlite3_busy_timeout(db, 20000);
  ASSERT_EQ(sqlite3_exec(db, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr), SQLITE_OK)
      << sqlite3_errmsg(db);
  const auto locked = Clock::now();
  // The daemon's writer waits up to its busy timeout (10 s) for the lock, then loses the batch:
  // hold it well under that.
  const auto release_by = locked + std::chrono::seconds(8);
  while (!testing::executor_pids(d.pid()).empty() && Clock::now() < release_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const bool executor_exited = testing::executor_pids(d.pid()).empty();
  std::vector<std::string> seen_ended;
  if (executor_exited) {
    // The executor has sent its summary and exited; the daemon cannot commit it yet.
    const auto colon = d.http_address().rfind(':');
    httplib::Client http(d.http_address().substr(0, colon),
                         std::stoi(d.http_address().substr(colon + 1)));
    const auto watch_until = std::min(release_by, Clock::now() + std::chrono::milliseconds(1500));
    while (Clock::now() < watch_until) {
      const v1::Job seen = get_job(d, job.id());
      if (ended(seen)) seen_ended.push_back("GetJob: " + v1::JobState_Name(seen.state()));
      grpc::ClientContext context;
      v1::ListJobsResponse listed;
      EXPECT_TRUE(d.jobs()->ListJobs(&context, v1::ListJobsRequest(), &listed).ok());
      for (const auto& j : listed.jobs()) {
        if (ended(j)) seen_ended.push_back("ListJobs: " + v1::JobState_Name(j.state()));
      }
      if (auto status = http.Get("/status"); status && status->status == 200) {
        const auto body = json::parse(status->body);
        bool running = false;
        for (const auto& j : body.value("running", json::array())) {
          running = running || j.value("id", "") == job.id();
        }
        if (!running) seen_ended.push_back("/status: not running");
      }
      if (watch_done) seen_ended.push_back("WatchJob ended");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
  sqlite3_close(db);
  if (!executor_exited) {
    watcher.join();
    GTEST_SKIP() << "the executor did not finish within 8 s (a very busy machine): the store "
                    "lock could not be held longer";
  }
  EXPECT_TRUE(seen_ended.empty()) << "the end was visible before it was committed: "
                                  << seen_ended.front();

  const v1::Job done = wait_for(d, job.id(), ended);
  EXPECT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.error();
  // Visible now, so everything is in the store already: no waiting.
  EXPECT_TRUE(run_summary(d, job.id()).ok()) << run_summary(d, job.id()).error_message();
  EXPECT_EQ(newest_recorded_step(d, job.id()), done.step());
  watcher.join();
  EXPECT_EQ(watched_state, v1::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(summary_after_watch.ok()) << summary_after_watch.error_message();
}

// Item: a stopped executor (SIGSTOP: no progress, SIGTERM not acted on) is noticed by the
// watchdog, killed after the grace period and its job failed with the reason, recorded.
TEST(Lifecycle, WatchdogFailsAJobWhoseExecutorMakesNoProgress) {
  Daemon d([](json& c) {
    c["jobs"] = {{"progress_timeout_seconds", 5}, {"cancel_grace_seconds", 1}};
  });
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::Job job;
  ASSERT_TRUE(submit(d, d.small_job(1000000), &job).ok());
  wait_for(d, job.id(), [](const v1::Job& j) { return j.step() >= 2; });
  const pid_t executor = executor_of(d);
  ASSERT_GT(executor, 0);
  ASSERT_EQ(::kill(executor, SIGSTOP), 0);
  const v1::Job failed = wait_for(d, job.id(), ended, 90);
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(failed.error().find("no progress"), std::string::npos) << failed.error();
  EXPECT_NE(failed.error().find("jobs.progress_timeout_seconds=5"), std::string::npos)
      << failed.error();
  EXPECT_NE(failed.error().find("was killed"), std::string::npos) << failed.error();
  EXPECT_TRUE(gone(executor));
  receipts::Store store(d.store_path(), receipts::OpenMode::kReadOnly);
  const auto recorded = store.get_job(job.id());
  ASSERT_TRUE(recorded.has_value());
  EXPECT_EQ(recorded->state, "failed");
  EXPECT_NE(recorded->error.find("jobs.progress_timeout_seconds=5"), std::string::npos)
      << recorded->error;
}

// Item: cancel escalates SIGTERM → SIGKILL after jobs.cancel_grace_seconds.
TEST(Lifecycle, CancelKillsAnExecutorThatDoesNotStopAfterTheGracePeriod) {
  Daemon d([](json& c) { c["jobs"] = {{"cancel_grace_seconds", 1}}; });
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::Job job;
  ASSERT_TRUE(submit(d, d.small_job(1000000), &job).ok());
  wait_for(d, job.id(), [](const v1::Job& j) { return j.step() >= 2; });
  const pid_t executor = executor_of(d);
  ASSERT_GT(executor, 0);
  ASSERT_EQ(::kill(executor, SIGSTOP), 0);  // SIGTERM stays pending: as good as ignored
  ASSERT_TRUE(cancel_job(d, job.id()).ok());
  const v1::Job cancelled = wait_for(d, job.id(), ended, 90);
  EXPECT_EQ(cancelled.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_NE(cancelled.error().find("jobs.cancel_grace_seconds=1"), std::string::npos)
      << cancelled.error();
  EXPECT_TRUE(gone(executor));
  // The slot is free again.
  v1::Job next;
  ASSERT_TRUE(submit(d, d.small_job(3), &next).ok());
  EXPECT_EQ(wait_for(d, next.id(), ended).state(), v1::JOB_STATE_SUCCEEDED);
}

// Item: spec.max_seconds is enforced by the daemon too: an executor that cannot enforce it
// (stopped) is stopped past max_seconds + jobs.time_limit_grace_seconds.
TEST(Lifecycle, DaemonEnforcesMaxSecondsOnAnExecutorThatCannot) {
  Daemon d([](json& c) {
    c["jobs"] = {{"progress_timeout_seconds", 0},  // the watchdog off: the time limit acts
                 {"time_limit_grace_seconds", 1},
                 {"cancel_grace_seconds", 1}};
  });
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::JobSpec spec = d.small_job(1000000);
  spec.set_max_seconds(4);
  v1::Job job;
  ASSERT_TRUE(submit(d, spec, &job).ok());
  wait_for(d, job.id(), [](const v1::Job& j) { return j.step() >= 1; });
  const pid_t executor = executor_of(d);
  ASSERT_GT(executor, 0);
  ASSERT_EQ(::kill(executor, SIGSTOP), 0);
  const v1::Job failed = wait_for(d, job.id(), ended, 90);
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED) << failed.error();
  EXPECT_NE(failed.error().find("spec.max_seconds=4"), std::string::npos) << failed.error();
  EXPECT_NE(failed.error().find("jobs.time_limit_grace_seconds=1"), std::string::npos)
      << failed.error();
  EXPECT_TRUE(gone(executor));
}

// Item: restarts of a crashing job back off exponentially up to the cap.
TEST(Lifecycle, RestartsBackOffExponentiallyUpToTheCap) {
  Daemon d([](json& c) {
    c["jobs"] = {{"restart_backoff_seconds", 1}, {"restart_backoff_max_seconds", 2}};
  });
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::JobSpec spec = d.small_job(1000000);
  spec.set_restart_policy(v1::RESTART_POLICY_ON_FAILURE);
  spec.set_max_restarts(3);
  v1::Job job;
  ASSERT_TRUE(submit(d, spec, &job).ok());
  std::set<pid_t> seen;
  std::vector<Clock::time_point> started, killed;
  for (int attempt = 1; attempt <= 4; ++attempt) {
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    pid_t pid = 0;
    while (pid == 0 && Clock::now() < deadline) {
      for (pid_t p : testing::executor_pids(d.pid())) {
        if (!seen.count(p)) pid = p;
      }
      if (pid == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_NE(pid, 0) << "attempt " << attempt << " never started\n" << d.log();
    started.push_back(Clock::now());
    seen.insert(pid);
    ::kill(pid, SIGKILL);
    killed.push_back(Clock::now());
  }
  const v1::Job failed = wait_for(d, job.id(), ended);
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(failed.attempts(), 4);
  EXPECT_NE(failed.error().find("signal 9"), std::string::npos) << failed.error();
  // The daemon cannot restart before the backoff has passed since it saw the crash (which is
  // after our kill): lower bounds only, however busy the machine is.
  const double expected[] = {1, 2, 2};
  for (size_t i = 0; i < 3; ++i) {
    const double gap = std::chrono::duration<double>(started[i + 1] - killed[i]).count();
    EXPECT_GE(gap, expected[i] - 0.05) << "restart " << i + 1;
  }
  const std::string log = d.log();
  EXPECT_NE(log.find("restart 1 of spec.max_restarts=3 in 1 s"), std::string::npos) << log;
  EXPECT_NE(log.find("restart 2 of spec.max_restarts=3 in 2 s"), std::string::npos) << log;
  EXPECT_NE(log.find("restart 3 of spec.max_restarts=3 in 2 s"), std::string::npos) << log;
}

// Item: max_restarts has an upper bound (daemon/job_spec.h kMaxRestarts), refused at submit
// naming the field, with nothing queued.
TEST(Lifecycle, MaxRestartsAboveTheBoundIsRefusedByName) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::JobSpec spec = d.small_job(1000000);
  spec.set_restart_policy(v1::RESTART_POLICY_ON_FAILURE);
  spec.set_max_restarts(1000000);
  const grpc::Status refused = submit(d, spec, nullptr);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_NE(refused.error_message().find("spec.max_restarts=1000000"), std::string::npos)
      << refused.error_message();
  grpc::ClientContext context;
  v1::ListJobsResponse listed;
  ASSERT_TRUE(d.jobs()->ListJobs(&context, v1::ListJobsRequest(), &listed).ok());
  EXPECT_EQ(listed.jobs_size(), 0);
  spec.set_max_restarts(20);
  v1::Job accepted;
  ASSERT_TRUE(submit(d, spec, &accepted).ok());
  EXPECT_TRUE(cancel_job(d, accepted.id()).ok());
}

// Item: the daemon's per-job event history is bounded in bytes, whatever the size of the job.
TEST(Lifecycle, EventHistoryMemoryIsBoundedForALargeJob) {
  Daemon d([](json& c) { c["limits"] = {{"job_event_history_bytes", 65536}}; });
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::JobSpec spec = d.small_job(800);
  spec.set_config_json(padded(spec.config_json(), 150000));
  spec.set_checkpoint_interval(0);
  const int64_t rss_before = testing::process_status_kib(d.pid(), "VmRSS");
  ASSERT_GT(rss_before, 0);
  v1::Job job;
  ASSERT_TRUE(submit(d, spec, &job).ok()) << submit(d, spec, nullptr).error_message();
  const v1::Job done = wait_for(d, job.id(), ended, 300);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.error();
  // A copy of the job per event would be 800 × 150 kB = 120 MB.
  const int64_t peak = testing::process_status_kib(d.pid(), "VmHWM");
  EXPECT_LT(peak - rss_before, 40 * 1024)
      << "daemon RSS " << rss_before << " KiB → peak " << peak << " KiB";
}

// Item: watchers the history cannot serve read the store: one that attaches after the job has
// ended, one that attaches mid-run after the history dropped the early events, and one too slow
// to keep up. Each gets every step once, in order, the evals, the summary and the end.
TEST(Lifecycle, LateAndSlowWatchersGetEveryStepFromTheStore) {
  Daemon d([](json& c) { c["limits"] = {{"job_event_history_bytes", 8192}}; });
  ASSERT_EQ(d.start(), -1) << d.log();
  // More events than the daemon kept before it bounded the history by bytes (2000).
  constexpr int64_t kSteps = 2500;
  v1::JobSpec spec = d.small_job(kSteps);
  spec.set_eval_interval(500);
  spec.set_eval_batches(1);
  spec.set_checkpoint_interval(100);
  v1::Job job;
  ASSERT_TRUE(submit(d, spec, &job).ok());

  // Slow: reads one event, then nothing until the job has ended.
  grpc::ClientContext slow_context;
  slow_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  v1::WatchJobRequest request;
  request.set_id(job.id());
  auto slow = d.jobs()->WatchJob(&slow_context, request);
  Watched slow_watched;
  v1::JobEvent event;
  ASSERT_TRUE(slow->Read(&event));
  slow_watched.add(event);

  // Mid-run: the executor is held still while the watcher attaches, after step 1000.
  wait_for(d, job.id(), [](const v1::Job& j) { return j.step() >= 1000; });
  const pid_t executor = executor_of(d);
  ASSERT_GT(executor, 0);
  ::kill(executor, SIGSTOP);
  Watched mid;
  std::thread mid_watcher([&] { mid = watch_to_end(d, job.id()); });
  std::this_thread::sleep_for(std::chrono::seconds(1));
  ::kill(executor, SIGCONT);
  mid_watcher.join();

  const v1::Job done = wait_for(d, job.id(), ended);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.error();
  while (slow->Read(&event)) slow_watched.add(event);
  slow_watched.status = slow->Finish();
  const Watched late = watch_to_end(d, job.id());

  const std::vector<int64_t> evals = {500, 1000, 1500, 2000, 2500};
  for (const auto& [name, w] : std::map<std::string, const Watched*>{
           {"slow", &slow_watched}, {"mid-run", &mid}, {"late", &late}}) {
    expect_the_whole_job(*w, kSteps, evals, name);
  }
}

// Item: a watcher that attaches mid-run, when the history has dropped a step but still holds
// its eval, gets that eval once (the replay from the store sent it too, before the mend). With an
// eval every step and the smallest history (4 KB: a few events), about half of the attach points
// fall there: eight watchers attach at steps 40, 80, ..., and each gets every step and every
// eval once, in order. (One that the job outran attaches after the end and reads the store.)
TEST(Lifecycle, WatchersAttachingMidRunGetEveryEvalOnce) {
  Daemon d([](json& c) { c["limits"] = {{"job_event_history_bytes", 4096}}; });
  ASSERT_EQ(d.start(), -1) << d.log();
  constexpr int64_t kSteps = 400;
  v1::JobSpec spec = d.small_job(kSteps);
  spec.set_eval_interval(1);
  spec.set_eval_batches(1);
  spec.set_checkpoint_interval(0);
  v1::Job job;
  ASSERT_TRUE(submit(d, spec, &job).ok());
  std::vector<Watched> watched(8);
  std::vector<std::thread> watchers;
  for (size_t i = 0; i < watched.size(); ++i) {
    const auto at = static_cast<int64_t>(40 * (i + 1));
    wait_for(d, job.id(), [&](const v1::Job& j) { return j.step() >= at || ended(j); });
    watchers.emplace_back([&, i] { watched[i] = watch_to_end(d, job.id()); });
  }
  for (std::thread& t : watchers) t.join();
  for (size_t i = 0; i < watched.size(); ++i) {
    expect_the_whole_job(watched[i], kSteps, one_to(kSteps), "watcher " + std::to_string(i));
  }
}

// Item: at most limits.max_watch_streams WatchJob streams; beyond, RESOURCE_EXHAUSTED naming
// the limit, and a closed stream frees its place.
TEST(Lifecycle, WatchStreamsBeyondTheLimitAreRefusedAsResourceExhausted) {
  Daemon d([](json& c) { c["limits"] = {{"max_watch_streams", 2}}; });
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::Job job;
  ASSERT_TRUE(submit(d, d.small_job(1000000), &job).ok());
  wait_for(d, job.id(), [](const v1::Job& j) { return j.step() >= 1; });
  v1::WatchJobRequest request;
  request.set_id(job.id());
  v1::JobEvent event;
  // Deadlines: a daemon without the limit would stream to all of them until the job ends.
  auto in = [](int seconds) {
    return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
  };
  grpc::ClientContext first_context, second_context;
  first_context.set_deadline(in(300));
  second_context.set_deadline(in(300));
  auto first = d.jobs()->WatchJob(&first_context, request);
  auto second = d.jobs()->WatchJob(&second_context, request);
  ASSERT_TRUE(first->Read(&event));  // both streams are being served
  ASSERT_TRUE(second->Read(&event));
  {
    grpc::ClientContext context;
    context.set_deadline(in(30));
    auto third = d.jobs()->WatchJob(&context, request);
    if (third->Read(&event)) {
      ADD_FAILURE() << "a third stream was served";
      context.TryCancel();
    }
    const grpc::Status s = third->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("limits.max_watch_streams=2"), std::string::npos)
        << s.error_message();
  }
  EXPECT_EQ(get_job(d, job.id()).state(), v1::JOB_STATE_RUNNING);  // other RPCs still served
  first_context.TryCancel();
  first->Finish();
  // The cancelled stream's place comes back once its handler notices (within a second or so).
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  bool reopened = false;
  while (!reopened && Clock::now() < deadline) {
    grpc::ClientContext context;
    context.set_deadline(in(30));
    auto again = d.jobs()->WatchJob(&context, request);
    reopened = again->Read(&event);
    context.TryCancel();
    again->Finish();
    if (!reopened) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_TRUE(reopened);
  second_context.TryCancel();
  second->Finish();
  EXPECT_TRUE(cancel_job(d, job.id()).ok());
}

// A submission that fails after validation (here its job directory cannot be created: a file
// stands where it would go, as a full or broken disk would make it fail) leaves no phantom job:
// nothing is listed, the store holds no row, and the next submission succeeds.
TEST(Lifecycle, SubmitThatCannotBeWrittenLeavesNoPhantomJob) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  std::filesystem::create_directories(d.state() / "jobs");
  std::ofstream(d.state() / "jobs" / "job-000001") << "in the way";
  v1::Job job;
  const grpc::Status failed = submit(d, d.small_job(4), &job);
  EXPECT_FALSE(failed.ok());
  EXPECT_NE(failed.error_message().find("cannot create its directory"), std::string::npos)
      << failed.error_message();
  {
    grpc::ClientContext context;
    v1::ListJobsResponse listed;
    ASSERT_TRUE(d.jobs()->ListJobs(&context, v1::ListJobsRequest(), &listed).ok());
    EXPECT_EQ(listed.jobs_size(), 0) << listed.DebugString();
  }
  std::filesystem::remove(d.state() / "jobs" / "job-000001");
  ASSERT_TRUE(submit(d, d.small_job(4), &job).ok());
  EXPECT_EQ(job.id(), "job-000001");
  EXPECT_TRUE(cancel_job(d, job.id()).ok());
}

}  // namespace
}  // namespace megacpp
