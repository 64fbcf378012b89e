// megacppd end to end: a real daemon, real executors, the real client stubs.
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>

#include "receipts/store.h"
#include "service/gates/gates.h"
#include "tests/daemon/daemon_harness.h"

namespace megacpp {
namespace {

namespace v1 = megacpp::v1;
using testing::Daemon;
using testing::ended;
using testing::get_job;
using testing::submit;
using testing::wait_for;

int count_jobs(const Daemon& d) {
  grpc::ClientContext context;
  v1::ListJobsResponse response;
  EXPECT_TRUE(d.jobs()->ListJobs(&context, v1::ListJobsRequest(), &response).ok());
  return response.jobs_size();
}

TEST(Daemon, TinyJobSucceedsWithEveryReceiptRecorded) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::Job job;
  ASSERT_TRUE(submit(d, d.small_job(12), &job).ok());
  // WatchJob streams to the end and reports the summary.
  grpc::ClientContext context;
  v1::WatchJobRequest request;
  request.set_id(job.id());
  auto reader = d.jobs()->WatchJob(&context, request);
  v1::JobEvent event;
  int steps = 0;
  bool summary = false;
  v1::JobState last = v1::JOB_STATE_UNSPECIFIED;
  while (reader->Read(&event)) {
    if (event.has_step() && event.step().val_loss() < 0) ++steps;
    if (event.has_summary()) summary = true;
    last = event.job().state();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(last, v1::JOB_STATE_SUCCEEDED) << d.log();
  EXPECT_EQ(steps, 12);
  EXPECT_TRUE(summary);
  EXPECT_EQ(d.stop(SIGTERM), 0);
  receipts::Store store(d.store_path(), receipts::OpenMode::kReadOnly);
  const auto boots = store.list_boots(5);
  ASSERT_EQ(boots.size(), 1u);
  EXPECT_EQ(boots[0].status, "stopped");
  EXPECT_FALSE(store.preconditions(boots[0].id).empty());
  EXPECT_EQ(store.gate_decisions(job.id()).size(),  // every registered gate, all "off"
            gates::GateRegistry::builtin().gates().size());
  for (const auto& g : store.gate_decisions(job.id())) EXPECT_EQ(g.decision, "off");
  const auto receipts = store.steps(job.id(), std::nullopt, 100, false);
  ASSERT_EQ(receipts.size(), 12u);
  for (size_t i = 0; i < receipts.size(); ++i)
    EXPECT_EQ(receipts[i].step, static_cast<int64_t>(i + 1));
  ASSERT_TRUE(store.run_summary(job.id()).has_value());
  EXPECT_EQ(store.run_summary(job.id())->summary["stop_reason"], "completed");
  EXPECT_EQ(store.get_job(job.id())->state, "succeeded");
}

TEST(Daemon, InvalidSpecsAreRefusedByFieldAndNothingIsQueued) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  const std::filesystem::path outside = d.dir() / "outside";
  std::filesystem::create_directories(outside);
  testing::write_text(outside / "x.idx", "x");
  testing::write_text(outside / "x.bin", "x");
  std::filesystem::create_symlink(outside / "x.idx", d.dir() / "data/escape.idx");
  std::filesystem::create_symlink(outside / "x.bin", d.dir() / "data/escape.bin");
  struct Case {
    std::function<void(v1::JobSpec&)> breaks;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](v1::JobSpec& s) { s.set_batch(0); }, "batch=0 must be positive"},
      {[](v1::JobSpec& s) { s.set_steps(-1); }, "steps=-1 must be positive"},
      {[](v1::JobSpec& s) { s.clear_config_json(); }, "model is required"},
      {[](v1::JobSpec& s) { s.set_preset("huge"); }, "unknown model preset"},
      {[](v1::JobSpec& s) {
         s.set_config_json(
             R"({"d_model": 32, "pattern": "M", "vocab_size": 257, "ssm_cfg": {"headdim": 24}})");
       },
       "ssm_cfg.headdim=24 does not divide d_inner=64"},
      {[](v1::JobSpec& s) { s.set_config_json("{not json"); }, "config_json is not valid JSON"},
      {[](v1::JobSpec& s) { s.set_device_count(3); }, "device_count=3 exceeds"},
      {[](v1::JobSpec& s) {
         s.set_tensor_parallel(2);
         s.set_device_count(2);
         s.set_config_json(
             R"({"d_model": 48, "pattern": "M", "vocab_size": 257, "ssm_cfg": {"headdim": 32, "d_state": 16}})");
       },
       "tensor_parallel=2 does not divide the Mamba-3 heads H=3"},
      {[](v1::JobSpec& s) {
         s.set_device_count(2);
         s.set_tensor_parallel(4);
       },
       "tensor_parallel=4 does not divide device_count=2"},
      {[](v1::JobSpec& s) { s.set_device_kind("tpu"); }, "device_kind=\"tpu\""},
      {[&](v1::JobSpec& s) { s.set_train_data((outside / "x").string()); }, "spec.train_data"},
      {[&](v1::JobSpec& s) { s.set_train_data((d.dir() / "data/../outside/x").string()); },
       "spec.train_data"},
      {[&](v1::JobSpec& s) { s.set_train_data((d.dir() / "data/escape").string()); },
       "spec.train_data"},
      {[&](v1::JobSpec& s) { s.set_train_data("data/toy_train"); }, "spec.train_data"},
      {[&](v1::JobSpec& s) { s.set_valid_data((d.dir() / "data/missing").string()); },
       "spec.valid_data"},
      {[](v1::JobSpec& s) { s.add_feature_gates("warp_speed"); }, "warp_speed"},
      {[](v1::JobSpec& s) {
         s.add_feature_gates("tma");
         s.add_feature_gates("tma");
       },
       "tma"},
  };
  for (const auto& c : cases) {
    v1::JobSpec spec = d.small_job(5);
    c.breaks(spec);
    const grpc::Status s = submit(d, spec, nullptr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.message << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.message), std::string::npos) << s.error_message();
  }
  EXPECT_EQ(count_jobs(d), 0);
}

TEST(Daemon, RequestedScaffoldGateIsRefusedAndRecorded) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::JobSpec spec = d.small_job(5);
  spec.add_feature_gates("psiv_cache");
  const grpc::Status s = submit(d, spec, nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("psiv_cache"), std::string::npos) << s.error_message();
  grpc::ClientContext context;
  v1::ListJobsResponse listed;
  ASSERT_TRUE(d.jobs()->ListJobs(&context, v1::ListJobsRequest(), &listed).ok());
  ASSERT_EQ(listed.jobs_size(), 1);
  EXPECT_EQ(listed.jobs(0).state(), v1::JOB_STATE_REFUSED);
  // A page token is a job id the daemon handed out: the last job's gives an empty page, one that
  // names no job is refused naming the field (it once started the page where the name sorts).
  for (const std::string& token : {listed.jobs(0).id(), std::string("job-that-never-was")}) {
    grpc::ClientContext page_context;
    v1::ListJobsRequest page_request;
    page_request.set_page_token(token);
    v1::ListJobsResponse page;
    const grpc::Status listed_page = d.jobs()->ListJobs(&page_context, page_request, &page);
    if (token == listed.jobs(0).id()) {
      ASSERT_TRUE(listed_page.ok()) << listed_page.error_message();
      EXPECT_EQ(page.jobs_size(), 0);
      EXPECT_TRUE(page.next_page_token().empty());
    } else {
      EXPECT_EQ(listed_page.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_NE(listed_page.error_message().find("page_token 'job-that-never-was'"),
                std::string::npos)
          << listed_page.error_message();
    }
  }
  // The refusal and its reason are in the store (read through the service).
  grpc::ClientContext ctx2;
  v1::JobReceiptsRequest request;
  request.set_job_id(listed.jobs(0).id());
  v1::ListGateDecisionsResponse decisions;
  for (int tries = 0; tries < 50 && decisions.decisions_size() == 0; ++tries) {
    grpc::ClientContext ctx;
    decisions.Clear();
    ASSERT_TRUE(d.receipts()->ListGateDecisions(&ctx, request, &decisions).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  bool refused = false;
  for (const auto& g : decisions.decisions()) {
    if (g.gate() == "psiv_cache") {
      refused =
          g.decision() == "refused" && g.reason().find("pays for itself") != std::string::npos;
    }
  }
  EXPECT_TRUE(refused) << decisions.DebugString();
}

TEST(Daemon, CancelCheckpointsAndKillingAnExecutorFailsOnlyItsJob) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::Job a, b;
  ASSERT_TRUE(submit(d, d.small_job(100000), &a).ok());
  ASSERT_TRUE(submit(d, d.small_job(100000), &b).ok());
  wait_for(d, a.id(), [](const v1::Job& j) { return j.step() >= 3; });
  wait_for(d, b.id(), [](const v1::Job& j) { return j.step() >= 3; });
  // Cancel a: it checkpoints and ends cancelled.
  {
    grpc::ClientContext context;
    v1::CancelJobRequest request;
    request.set_id(a.id());
    v1::Job out;
    ASSERT_TRUE(d.jobs()->CancelJob(&context, request, &out).ok());
  }
  const v1::Job cancelled = wait_for(d, a.id(), ended);
  EXPECT_EQ(cancelled.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_TRUE(
      std::filesystem::exists(std::filesystem::path(cancelled.checkpoint_dir()) / "latest"));
  // kill -9 b's executor: b fails with the cause; the daemon carries on.
  const auto pids = testing::executor_pids(d.pid());
  ASSERT_EQ(pids.size(), 1u);
  ::kill(pids[0], SIGKILL);
  const v1::Job failed = wait_for(d, b.id(), ended);
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(failed.error().find("signal 9"), std::string::npos) << failed.error();
  v1::Job c;
  ASSERT_TRUE(submit(d, d.small_job(3), &c).ok());
  EXPECT_EQ(wait_for(d, c.id(), ended).state(), v1::JOB_STATE_SUCCEEDED);
}

TEST(Daemon, KilledDaemonResumesInterruptedJobWithContinuousReceipts) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::JobSpec spec = d.small_job(2000);
  spec.set_restart_policy(v1::RESTART_POLICY_ON_INTERRUPT);
  v1::Job job;
  ASSERT_TRUE(submit(d, spec, &job).ok());
  // Kill once the store holds some step receipts (and so knows the job ran).
  int64_t recorded = 0;
  for (int i = 0; i < 400 && recorded < 30; ++i) {
    grpc::ClientContext context;
    v1::ListStepReceiptsRequest r;
    r.set_job_id(job.id());
    r.set_newest_first(true);
    r.set_limit(1);
    v1::ListStepReceiptsResponse out;
    if (d.receipts()->ListStepReceipts(&context, r, &out).ok() && out.steps_size() > 0) {
      recorded = out.steps(0).step();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GE(recorded, 30);
  ASSERT_LT(recorded, 1500) << "the job ran too fast to be interrupted";
  const auto executors = testing::executor_pids(d.pid());
  d.stop(SIGKILL);
  // The orphaned executor notices, checkpoints and exits by itself.
  for (int i = 0; i < 600 && !executors.empty() && ::kill(executors[0], 0) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(executors.empty() || ::kill(executors[0], 0) != 0) << "executor outlived its daemon";
  ASSERT_EQ(d.start(), -1) << d.log();
  ASSERT_EQ(count_jobs(d), 1) << d.log();
  const v1::Job done = wait_for(d, job.id(), ended, 180);
  EXPECT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.error();
  EXPECT_EQ(done.attempts(), 2) << d.log();
  EXPECT_EQ(d.stop(SIGTERM), 0);
  receipts::Store store(d.store_path(), receipts::OpenMode::kReadOnly);
  const auto steps = store.steps(job.id(), std::nullopt, 5000, false);
  ASSERT_EQ(steps.size(), 2000u);
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i].step, static_cast<int64_t>(i + 1));
  EXPECT_EQ(store.integrity_check(), "ok");
  bool saw_interrupted = d.log().find("interrupted") != std::string::npos;
  EXPECT_TRUE(saw_interrupted);
}

TEST(Daemon, UnwritableStateDirectoryStopsTheDaemonBeforeServing) {
  Daemon d([](nlohmann::json& c) { c["state_dir"] = "/proc/megacpp-state"; });
  const int code = d.start();
  EXPECT_GT(code, 0) << d.log();
  EXPECT_NE(d.log().find("state_dir"), std::string::npos) << d.log();
  EXPECT_EQ(d.log().find("serving gRPC"), std::string::npos);
}

TEST(Daemon, BearerTokenIsRequiredButHealthIsNot) {
  testing::TempDir secrets;
  testing::write_text(secrets / "token", "s3cret\n");
  Daemon d([&](nlohmann::json& c) {
    c["security"] = {{"token_file", (secrets / "token").string()}};
  });
  ASSERT_EQ(d.start(), -1) << d.log();
  {
    grpc::ClientContext context;
    v1::Status status;
    EXPECT_EQ(d.status()->GetStatus(&context, v1::GetStatusRequest(), &status).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer wrong");
    v1::Status status;
    EXPECT_EQ(d.status()->GetStatus(&context, v1::GetStatusRequest(), &status).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer s3cret");
    v1::Status status;
    EXPECT_TRUE(d.status()->GetStatus(&context, v1::GetStatusRequest(), &status).ok());
  }
  {
    grpc::ClientContext context;
    v1::SubmitJobResponse response;
    v1::SubmitJobRequest request;
    *request.mutable_spec() = d.small_job(2);
    EXPECT_EQ(d.jobs()->SubmitJob(&context, request, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  // grpc.health.v1 answers without a token (a raw call: no generated stub needed).
  grpc::GenericStub generic(d.channel());
  grpc::ClientContext context;
  grpc::ByteBuffer request, response;
  grpc::Slice empty("", 0);
  request = grpc::ByteBuffer(&empty, 1);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status health;
  generic.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                    &response, [&](grpc::Status s) {
                      std::lock_guard lock(mu);
                      health = s;
                      done = true;
                      cv.notify_all();
                    });
  std::unique_lock lock(mu);
  cv.wait_for(lock, std::chrono::seconds(10), [&] { return done; });
  EXPECT_TRUE(done && health.ok()) << health.error_message();
}

TEST(Daemon, ConcurrentClientsReadWhileAJobTrains) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::Job job;
  ASSERT_TRUE(submit(d, d.small_job(60), &job).ok());
  wait_for(d, job.id(), [](const v1::Job& j) { return j.step() >= 2; });
  std::atomic<int> errors{0}, calls{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 32; ++t) {
    clients.emplace_back([&, t] {
      for (int i = 0; i < 15; ++i) {
        grpc::ClientContext context;
        grpc::Status s;
        if ((t + i) % 3 == 0) {
          v1::Status out;
          s = d.status()->GetStatus(&context, v1::GetStatusRequest(), &out);
        } else if ((t + i) % 3 == 1) {
          v1::ListStepReceiptsRequest r;
          r.set_job_id(job.id());
          r.set_newest_first(true);
          v1::ListStepReceiptsResponse out;
          s = d.receipts()->ListStepReceipts(&context, r, &out);
        } else {
          v1::ListJobsResponse out;
          s = d.jobs()->ListJobs(&context, v1::ListJobsRequest(), &out);
        }
        ++calls;
        if (!s.ok()) ++errors;
      }
    });
  }
  for (auto& c : clients) c.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(calls.load(), 32 * 15);
  EXPECT_EQ(wait_for(d, job.id(), ended).state(), v1::JOB_STATE_SUCCEEDED);
}

TEST(Daemon, ConcurrencyLimitKeepsASecondJobQueuedDespiteAFreeSlot) {
  Daemon d([](nlohmann::json& c) { c["limits"] = {{"max_concurrent_jobs", 1}}; });
  ASSERT_EQ(d.start(), -1) << d.log();
  v1::Job a, b;
  ASSERT_TRUE(submit(d, d.small_job(100000), &a).ok());
  ASSERT_TRUE(submit(d, d.small_job(100000), &b).ok());
  wait_for(d, a.id(), [](const v1::Job& j) { return j.step() >= 3; });
  EXPECT_EQ(get_job(d, b.id()).state(), v1::JOB_STATE_QUEUED);  // a free slot, but the limit is 1
  grpc::ClientContext context;
  v1::CancelJobRequest cancel;
  cancel.set_id(a.id());
  v1::Job out;
  ASSERT_TRUE(d.jobs()->CancelJob(&context, cancel, &out).ok());
  const v1::Job started = wait_for(d, b.id(), [](const v1::Job& j) { return j.step() >= 1; });
  EXPECT_EQ(started.state(), v1::JOB_STATE_RUNNING);
}

TEST(Daemon, HttpEndpointIsReadOnly) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  const auto colon = d.http_address().rfind(':');
  httplib::Client http(d.http_address().substr(0, colon),
                       std::stoi(d.http_address().substr(colon + 1)));
  auto health = http.Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto status = http.Get("/status");
  ASSERT_TRUE(status);
  const auto json = nlohmann::json::parse(status->body);
  EXPECT_TRUE(json.contains("devices")) << status->body;
  auto metrics = http.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("megacpp_jobs{state=\"running\"}"), std::string::npos);
  EXPECT_NE(metrics->body.find("megacpp_store_bytes"), std::string::npos);
  auto post = http.Post("/status", "", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);
}

}  // namespace
}  // namespace megacpp
