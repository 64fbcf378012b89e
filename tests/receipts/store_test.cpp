#include "receipts/store.h"

#include <gtest/gtest.h>
#include <sqlite3.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "base/error.h"
#include "receipts/schema.h"
#include "tests/support/temp_dir.h"

namespace megacpp::receipts {
namespace {

namespace fs = std::filesystem;

template <typename Body>
Error capture_error(Body&& body) {
  try {
    body();
  } catch (const Error& error) {
    return error;
  }
  ADD_FAILURE() << "expected a megacpp::Error";
  return Error(ErrorKind::kInternal, "no error");
}

// Reads the database with SQLite directly, independent of the code under test.
class RawDb {
 public:
  explicit RawDb(const fs::path& path) {
    EXPECT_EQ(sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE, nullptr), SQLITE_OK);
  }
  ~RawDb() { sqlite3_close(db_); }
  int64_t integer(const std::string& sql) {
    sqlite3_stmt* statement = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db_, sql.c_str(), -1, &statement, nullptr), SQLITE_OK) << sql;
    int64_t value = -1;
    if (sqlite3_step(statement) == SQLITE_ROW) value = sqlite3_column_int64(statement, 0);
    sqlite3_finalize(statement);
    return value;
  }
  std::string text(const std::string& sql) {
    sqlite3_stmt* statement = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db_, sql.c_str(), -1, &statement, nullptr), SQLITE_OK) << sql;
    std::string value;
    if (sqlite3_step(statement) == SQLITE_ROW) {
      value = reinterpret_cast<const char*>(sqlite3_column_text(statement, 0));
    }
    sqlite3_finalize(statement);
    return value;
  }
  void exec(const std::string& sql) {
    ASSERT_EQ(sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, nullptr), SQLITE_OK) << sql;
  }

 private:
  sqlite3* db_ = nullptr;
};

BootReceipt sample_boot(const std::string& host) {
  BootReceipt boot;
  boot.started_at = "2026-11-22T08:00:00.125Z";
  boot.version = "0.1.0";
  boot.git_revision = "d8237d0abcde";
  boot.compiler = "GCC 12.2.0";
  boot.build_type = "Release";
  boot.cuda_runtime = "12.4";
  boot.cuda_driver = "550.54";
  boot.nccl = "2.21.5";
  boot.cudnn = "";
  boot.devices = nlohmann::json::array({{{"name", "H100"}, {"memory_bytes", 85899345920LL}}});
  boot.hostname = host;
  boot.environment = {{"NCCL_NVLS_ENABLE", "0"}, {"OMP_NUM_THREADS", "2"}};
  boot.status = "starting";
  return boot;
}

JobRecord sample_job(const std::string& id, int64_t boot_id, const std::string& state) {
  JobRecord job;
  job.job_id = id;
  job.boot_id = boot_id;
  job.state = state;
  job.spec = {{"model", "tiny"}, {"steps", 100}, {"gates", nlohmann::json::array({"tma"})}};
  job.submitted_at = "2026-11-22T08:01:00.000Z";
  job.started_at = "";
  job.finished_at = "";
  job.attempts = 0;
  job.last_checkpoint_step = -1;
  return job;
}

StepReceipt sample_step(const std::string& job, int64_t step, int attempt = 1) {
  StepReceipt receipt;
  receipt.job_id = job;
  receipt.step = step;
  receipt.attempt = attempt;
  receipt.loss = 5.5 - 0.01 * static_cast<double>(step) + 0.001 * attempt;
  receipt.grad_norm = 1.25;
  receipt.lr = 3e-4;
  receipt.tokens = 2048;
  receipt.step_ms = 100.0 + static_cast<double>(step % 7);
  receipt.tokens_per_s = 2048.0 / receipt.step_ms * 1000.0;
  receipt.flops_per_s = 1.5e12;
  receipt.recorded_at = "2026-11-22T08:02:00.500Z";
  return receipt;
}

class StoreTest : public ::testing::Test {
 protected:
  fs::path db() const { return dir_ / "receipts.db"; }
  testing::TempDir dir_;
};

TEST(ReceiptTimestamps, FormatsUtcWithMilliseconds) {
  using std::chrono::milliseconds;
  using std::chrono::system_clock;
  EXPECT_EQ(utc_timestamp(system_clock::time_point{}), "1970-01-01T00:00:00.000Z");
  // 1234567890 s is 2009-02-13 23:31:30 UTC.
  EXPECT_EQ(utc_timestamp(system_clock::time_point{milliseconds{1234567890123LL}}),
            "2009-02-13T23:31:30.123Z");
  EXPECT_EQ(utc_timestamp(system_clock::time_point{milliseconds{-1}}), "1969-12-31T23:59:59.999Z");
  EXPECT_TRUE(is_utc_timestamp(utc_now()));
  EXPECT_TRUE(is_utc_timestamp("2026-11-22T09:30:00.123Z"));
  EXPECT_FALSE(is_utc_timestamp("2026-11-22T09:30:00Z"));
  EXPECT_FALSE(is_utc_timestamp("2026-11-22 09:30:00.123Z"));
  EXPECT_FALSE(is_utc_timestamp("2026-13-22T09:30:00.123Z"));
  EXPECT_FALSE(is_utc_timestamp("2026-11-22T09:30:00.123+01:00"));
}

TEST_F(StoreTest, FreshStoreIsWalAtLatestSchemaWithFullSync) {
  {
    Store store(db(), OpenMode::kReadWrite);
    EXPECT_EQ(store.schema_version(), latest_schema_version());
    EXPECT_EQ(store.quick_check(), "ok");
    EXPECT_EQ(store.integrity_check(), "ok");
  }
  RawDb raw(db());
  EXPECT_EQ(raw.text("PRAGMA journal_mode"), "wal");
  EXPECT_EQ(raw.integer("PRAGMA user_version"), latest_schema_version());
  EXPECT_EQ(raw.integer("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN "
                        "('boots','preconditions','jobs','gate_decisions','steps','evals',"
                        "'kernel_receipts','run_summaries')"),
            8);
}

TEST_F(StoreTest, BootsRoundTripNewestFirstWithPagination) {
  Store store(db(), OpenMode::kReadWrite);
  std::vector<int64_t> ids;
  for (int i = 0; i < 5; ++i)
    ids.push_back(store.insert_boot(sample_boot("host" + std::to_string(i))));
  for (size_t i = 1; i < ids.size(); ++i) EXPECT_GT(ids[i], ids[i - 1]);
  store.update_boot_status(ids[4], "serving");

  Store reader(db(), OpenMode::kReadOnly);
  const auto first = reader.list_boots(2);
  ASSERT_EQ(first.size(), 2u);
  BootReceipt expected = sample_boot("host4");
  expected.id = ids[4];
  expected.status = "serving";
  EXPECT_EQ(first[0], expected);
  EXPECT_EQ(first[1].hostname, "host3");
  const auto second = reader.list_boots(2, first.back().id);
  ASSERT_EQ(second.size(), 2u);
  EXPECT_EQ(second[0].hostname, "host2");
  EXPECT_EQ(second[1].hostname, "host1");
  const auto last = reader.list_boots(2, second.back().id);
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(last[0].hostname, "host0");
  EXPECT_TRUE(reader.list_boots(2, last.back().id).empty());
  EXPECT_EQ(reader.get_boot(ids[0])->hostname, "host0");
  EXPECT_FALSE(reader.get_boot(ids[4] + 100).has_value());

  EXPECT_EQ(capture_error([&] { store.update_boot_status(ids[4] + 100, "stopped"); }).kind(),
            ErrorKind::kNotFound);
  const Error bad_status = capture_error([&] { store.update_boot_status(ids[0], "sleeping"); });
  EXPECT_EQ(bad_status.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(std::string(bad_status.what()).find("sleeping"), std::string::npos);
}

TEST_F(StoreTest, EmptyTimestampIsStampedWithNow) {
  Store store(db(), OpenMode::kReadWrite);
  BootReceipt boot = sample_boot("h");
  boot.started_at.clear();
  const std::string before = utc_now();
  const int64_t id = store.insert_boot(boot);
  const std::string after = utc_now();
  const std::string stamped = store.get_boot(id)->started_at;
  EXPECT_TRUE(is_utc_timestamp(stamped)) << stamped;
  EXPECT_LE(before, stamped);
  EXPECT_LE(stamped, after);
}

TEST_F(StoreTest, PreconditionsRoundTripInOrder) {
  Store store(db(), OpenMode::kReadWrite);
  const int64_t boot = store.insert_boot(sample_boot("h"));
  const int64_t other = store.insert_boot(sample_boot("h2"));
  std::vector<PreconditionResult> checks = {
      {boot, "state_dir_writable", "pass", "/var/lib/megacpp", "", "2026-11-22T08:00:01.000Z"},
      {boot, "free_space", "fail", "1.2 GiB free, 10 GiB required", "free disk space on /var",
       "2026-11-22T08:00:01.010Z"},
      {boot, "nccl_nvls", "skip", "single GPU", "", "2026-11-22T08:00:01.020Z"},
  };
  store.insert_preconditions(checks);
  store.insert_preconditions(std::vector<PreconditionResult>{
      {other, "store_quick_check", "pass", "ok", "", "2026-11-22T08:00:02.000Z"}});
  EXPECT_EQ(store.preconditions(boot), checks);
  ASSERT_EQ(store.preconditions(other).size(), 1u);
  EXPECT_TRUE(store.preconditions(other + 5).empty());

  // A check of a boot that does not exist is refused by the foreign key, and the batch with it.
  const Error orphan = capture_error([&] {
    store.insert_preconditions(std::vector<PreconditionResult>{
        {boot, "ok_one", "pass", "", "", ""}, {other + 5, "orphan", "pass", "", "", ""}});
  });
  EXPECT_EQ(orphan.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(std::string(orphan.what()).find("orphan"), std::string::npos) << orphan.what();
  EXPECT_EQ(store.preconditions(boot).size(), 3u);
}

TEST_F(StoreTest, JobsUpsertKeepsSubmissionTimeAndRoundTrips) {
  Store store(db(), OpenMode::kReadWrite);
  const int64_t boot = store.insert_boot(sample_boot("h"));
  const int64_t boot2 = store.insert_boot(sample_boot("h"));
  JobRecord job = sample_job("job-a", boot, "queued");
  store.upsert_job(job);
  EXPECT_EQ(*store.get_job("job-a"), job);

  JobRecord running = job;
  running.boot_id = boot2;
  running.state = "failed";
  running.submitted_at = "2030-01-01T00:00:00.000Z";
  running.started_at = "2026-11-22T08:01:05.000Z";
  running.finished_at = "2026-11-22T08:09:00.250Z";
  running.error = "executor killed by signal 9; last log: step 40";
  running.attempts = 2;
  running.last_checkpoint_step = 40;
  running.spec["steps"] = 200;
  store.upsert_job(running);
  JobRecord expected = running;
  expected.submitted_at = job.submitted_at;
  EXPECT_EQ(*store.get_job("job-a"), expected);
  EXPECT_FALSE(store.get_job("job-missing").has_value());

  JobRecord bad = job;
  bad.state = "paused";
  const Error error = capture_error([&] { store.upsert_job(bad); });
  EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(std::string(error.what()).find("'state'"), std::string::npos) << error.what();
  bad = job;
  bad.submitted_at = "yesterday";
  EXPECT_EQ(capture_error([&] { store.upsert_job(bad); }).kind(), ErrorKind::kInvalidArgument);
  bad = job;
  bad.boot_id = boot2 + 10;
  EXPECT_EQ(capture_error([&] { store.upsert_job(bad); }).kind(), ErrorKind::kInvalidArgument);
}

TEST_F(StoreTest, ListJobsPaginatesNewestFirstAndFiltersByState) {
  Store store(db(), OpenMode::kReadWrite);
  const int64_t boot = store.insert_boot(sample_boot("h"));
  for (int i = 0; i < 7; ++i) {
    store.upsert_job(
        sample_job("job-" + std::to_string(i), boot, i % 2 == 0 ? "succeeded" : "failed"));
  }
  // A later update does not move a job in the listing.
  JobRecord updated = sample_job("job-1", boot, "failed");
  updated.error = "updated";
  store.upsert_job(updated);

  Store reader(db(), OpenMode::kReadOnly);
  std::vector<std::string> seen;
  JobQuery query;
  query.limit = 3;
  int pages = 0;
  while (true) {
    const JobPage page = reader.list_jobs(query);
    ++pages;
    for (const JobRecord& job : page.jobs) seen.push_back(job.job_id);
    if (page.next_page_token.empty()) break;
    EXPECT_EQ(page.next_page_token, page.jobs.back().job_id);
    query.page_token = page.next_page_token;
  }
  EXPECT_EQ(pages, 3);
  EXPECT_EQ(seen, (std::vector<std::string>{"job-6", "job-5", "job-4", "job-3", "job-2", "job-1",
                                            "job-0"}));

  JobQuery failed;
  failed.state = "failed";
  failed.limit = 2;
  JobPage page = reader.list_jobs(failed);
  ASSERT_EQ(page.jobs.size(), 2u);
  EXPECT_EQ(page.jobs[0].job_id, "job-5");
  EXPECT_EQ(page.jobs[1].job_id, "job-3");
  failed.page_token = page.next_page_token;
  page = reader.list_jobs(failed);
  ASSERT_EQ(page.jobs.size(), 1u);
  EXPECT_EQ(page.jobs[0].job_id, "job-1");
  EXPECT_EQ(page.jobs[0].error, "updated");
  EXPECT_TRUE(page.next_page_token.empty());

  JobQuery exact;
  exact.limit = 7;
  EXPECT_TRUE(reader.list_jobs(exact).next_page_token.empty());
  JobQuery unknown_state;
  unknown_state.state = "sleeping";
  EXPECT_EQ(capture_error([&] { reader.list_jobs(unknown_state); }).kind(),
            ErrorKind::kInvalidArgument);
  JobQuery bad_token;
  bad_token.page_token = "job-nope";
  const Error token_error = capture_error([&] { reader.list_jobs(bad_token); });
  EXPECT_EQ(token_error.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(std::string(token_error.what()).find("job-nope"), std::string::npos);
  JobQuery zero;
  zero.limit = 0;
  EXPECT_EQ(capture_error([&] { reader.list_jobs(zero); }).kind(), ErrorKind::kInvalidArgument);
}

TEST_F(StoreTest, GateDecisionsRoundTripAndReplacePerGate) {
  Store store(db(), OpenMode::kReadWrite);
  store.upsert_job(sample_job("j", store.insert_boot(sample_boot("h")), "refused"));
  std::vector<GateDecision> decisions = {
      {"j", "tma", "refused", "requested, but tma is a scaffold", "scaffold",
       nlohmann::json::object(), "2026-11-22T08:01:00.001Z"},
      {"j",
       "psiv_cache",
       "off",
       "not requested",
       "scaffold",
       {{"materialize PsiV in forward", "done"}, {"reuse in backward", "todo"}},
       "2026-11-22T08:01:00.002Z"},
  };
  store.insert_gate_decisions(decisions);
  std::vector<GateDecision> read = store.gate_decisions("j");
  ASSERT_EQ(read.size(), 2u);
  EXPECT_EQ(read[0], decisions[1]);  // by gate name
  EXPECT_EQ(read[1], decisions[0]);

  GateDecision again = decisions[0];
  again.decision = "off";
  again.reason = "not requested on resume";
  store.insert_gate_decisions(std::vector<GateDecision>{again});
  read = store.gate_decisions("j");
  ASSERT_EQ(read.size(), 2u);
  EXPECT_EQ(read[1], again);

  GateDecision bad = decisions[0];
  bad.implementation = "half";
  EXPECT_EQ(
      capture_error([&] { store.insert_gate_decisions(std::vector<GateDecision>{bad}); }).kind(),
      ErrorKind::kInvalidArgument);
  EXPECT_TRUE(store.gate_decisions("other").empty());
}

TEST_F(StoreTest, StepsRoundTripIncludingNaNAndInfinity) {
  Store store(db(), OpenMode::kReadWrite);
  store.upsert_job(sample_job("j", store.insert_boot(sample_boot("h")), "running"));
  std::vector<StepReceipt> steps;
  for (int64_t s = 0; s < 5; ++s) steps.push_back(sample_step("j", s));
  steps[3].loss = std::numeric_limits<double>::quiet_NaN();
  steps[3].grad_norm = std::numeric_limits<double>::infinity();
  steps[4].lr = -0.0;
  store.write_steps(steps);
  const auto read = store.steps("j", std::nullopt, 100, false);
  ASSERT_EQ(read.size(), steps.size());
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_TRUE(same_receipt(read[i], steps[i])) << i;
  EXPECT_TRUE(std::isnan(read[3].loss));
  EXPECT_TRUE(std::isinf(read[3].grad_norm));
}

TEST_F(StoreTest, StepsPageInBothDirections) {
  Store store(db(), OpenMode::kReadWrite);
  const int64_t boot = store.insert_boot(sample_boot("h"));
  store.upsert_job(sample_job("a", boot, "running"));
  store.upsert_job(sample_job("b", boot, "running"));
  std::vector<StepReceipt> steps;
  for (int64_t s = 0; s < 25; ++s) {
    steps.push_back(sample_step("a", s));
    steps.push_back(sample_step("b", 100 + s));
  }
  store.write_steps(steps);

  auto step_numbers = [](const std::vector<StepReceipt>& page) {
    std::vector<int64_t> numbers;
    for (const auto& s : page) numbers.push_back(s.step);
    return numbers;
  };
  std::vector<int64_t> forward;
  std::optional<int64_t> cursor;
  while (true) {
    const auto page = store.steps("a", cursor, 10, false);
    if (page.empty()) break;
    for (const auto& s : page) {
      EXPECT_EQ(s.job_id, "a");
      forward.push_back(s.step);
    }
    cursor = page.back().step;
  }
  std::vector<int64_t> expected(25);
  for (int64_t s = 0; s < 25; ++s) expected[static_cast<size_t>(s)] = s;
  EXPECT_EQ(forward, expected);

  EXPECT_EQ(step_numbers(store.steps("a", std::nullopt, 3, true)),
            (std::vector<int64_t>{24, 23, 22}));
  EXPECT_EQ(step_numbers(store.steps("a", 22, 3, true)), (std::vector<int64_t>{21, 20, 19}));
  EXPECT_EQ(step_numbers(store.steps("a", 1, 3, true)), (std::vector<int64_t>{0}));
  EXPECT_EQ(step_numbers(store.steps("b", 110, 2, false)), (std::vector<int64_t>{111, 112}));
  EXPECT_TRUE(store.steps("missing", std::nullopt, 10, true).empty());
  EXPECT_EQ(capture_error([&] { store.steps("a", std::nullopt, 0, true); }).kind(),
            ErrorKind::kInvalidArgument);
}

TEST_F(StoreTest, ReexecutedStepsReplaceAndLeaveNoDuplicates) {
  Store store(db(), OpenMode::kReadWrite);
  store.upsert_job(sample_job("j", store.insert_boot(sample_boot("h")), "running"));
  std::vector<StepReceipt> first;
  for (int64_t s = 0; s < 10; ++s) first.push_back(sample_step("j", s, 1));
  store.write_steps(first);
  // Interrupted at step 9 with a checkpoint at step 6; the resumed attempt redoes 7..12.
  EXPECT_EQ(store.delete_steps_after("j", 8), 1);
  std::vector<StepReceipt> second;
  for (int64_t s = 7; s < 13; ++s) second.push_back(sample_step("j", s, 2));
  store.write_steps(second);

  const auto read = store.steps("j", std::nullopt, 100, false);
  ASSERT_EQ(read.size(), 13u);
  for (int64_t s = 0; s < 13; ++s) {
    const auto& got = read[static_cast<size_t>(s)];
    EXPECT_EQ(got.step, s);
    EXPECT_TRUE(same_receipt(got, sample_step("j", s, s < 7 ? 1 : 2))) << s;
  }
  EXPECT_EQ(store.counts().steps, 13);
  EXPECT_EQ(store.delete_steps_after("j", 100), 0);
  EXPECT_EQ(store.delete_steps_after("j", 9), 3);
  EXPECT_EQ(store.steps("j", std::nullopt, 1, true).front().step, 9);
}

TEST_F(StoreTest, StepOfUnknownJobIsRefusedAndItsBatchRolledBack) {
  Store store(db(), OpenMode::kReadWrite);
  store.upsert_job(sample_job("j", store.insert_boot(sample_boot("h")), "running"));
  const Error error = capture_error([&] {
    store.write_steps(std::vector<StepReceipt>{sample_step("j", 0), sample_step("ghost", 1)});
  });
  EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(std::string(error.what()).find("ghost"), std::string::npos) << error.what();
  EXPECT_TRUE(store.steps("j", std::nullopt, 10, false).empty());
  StepReceipt negative = sample_step("j", -1);
  EXPECT_EQ(capture_error([&] { store.write_steps(std::vector<StepReceipt>{negative}); }).kind(),
            ErrorKind::kInvalidArgument);
}

TEST_F(StoreTest, EvalsKernelsAndSummariesRoundTrip) {
  Store store(db(), OpenMode::kReadWrite);
  store.upsert_job(sample_job("j", store.insert_boot(sample_boot("h")), "succeeded"));
  std::vector<EvalReceipt> evals = {
      {"j", 50, 4.25, "2026-11-22T08:05:00.000Z"},
      {"j", 100, std::numeric_limits<double>::quiet_NaN(), "2026-11-22T08:10:00.000Z"}};
  store.insert_evals(evals);
  store.insert_evals(std::vector<EvalReceipt>{{"j", 50, 4.0, "2026-11-22T08:11:00.000Z"}});
  const auto read_evals = store.evals("j");
  ASSERT_EQ(read_evals.size(), 2u);
  EXPECT_TRUE(same_receipt(read_evals[0], EvalReceipt{"j", 50, 4.0, "2026-11-22T08:11:00.000Z"}));
  EXPECT_TRUE(same_receipt(read_evals[1], evals[1]));

  KernelReceipt kernel;
  kernel.job_id = "j";
  kernel.kernel = "mamba3_scan_fwd";
  kernel.device = "cuda:0 NVIDIA H100";
  kernel.launch = {{"grid", {128, 8, 1}}, {"block", {256, 1, 1}}};
  kernel.registers = 128;
  kernel.static_smem = 49152;
  kernel.dynamic_smem = 98304;
  kernel.occupancy = 0.375;
  kernel.time_ms_min = 0.81;
  kernel.time_ms_median = 0.84;
  kernel.time_ms_max = 1.2;
  kernel.samples = 50;
  kernel.recorded_at = "2026-11-22T08:03:00.000Z";
  KernelReceipt second = kernel;
  second.kernel = "gemm_bf16";
  second.occupancy = std::numeric_limits<double>::quiet_NaN();
  store.insert_kernel_receipts(std::vector<KernelReceipt>{kernel, second});
  const auto kernels = store.kernel_receipts("j");
  ASSERT_EQ(kernels.size(), 2u);
  EXPECT_TRUE(same_receipt(kernels[0], kernel));
  EXPECT_TRUE(same_receipt(kernels[1], second));

  EXPECT_FALSE(store.run_summary("j").has_value());
  RunSummary summary{
      "j", {{"final_loss", 3.5}, {"stop_reason", "completed"}}, "2026-11-22T08:12:00.000Z"};
  store.insert_run_summary(summary);
  EXPECT_EQ(*store.run_summary("j"), summary);
  summary.summary["final_loss"] = 3.25;
  store.insert_run_summary(summary);
  EXPECT_EQ(*store.run_summary("j"), summary);

  const StoreCounts counts = store.counts();
  EXPECT_EQ(counts.boots, 1);
  EXPECT_EQ(counts.jobs, 1);
  EXPECT_EQ(counts.evals, 2);
  EXPECT_EQ(counts.kernel_receipts, 2);
  EXPECT_EQ(counts.run_summaries, 1);
  EXPECT_EQ(counts.steps, 0);
  EXPECT_GT(counts.database_bytes + counts.wal_bytes, 0);
}

TEST_F(StoreTest, WriteAppliesMixedReceiptsInOrderInOneTransaction) {
  Store store(db(), OpenMode::kReadWrite);
  const int64_t boot = store.insert_boot(sample_boot("h"));
  std::vector<Receipt> receipts = {sample_job("j", boot, "running"), sample_step("j", 0),
                                   sample_step("j", 1), DeleteStepsAfter{"j", 0},
                                   BootStatusUpdate{boot, "serving"}};
  store.write(receipts);
  EXPECT_EQ(store.steps("j", std::nullopt, 10, false).size(), 1u);
  EXPECT_EQ(store.get_boot(boot)->status, "serving");

  // A failure anywhere leaves nothing of the batch.
  std::vector<Receipt> failing = {sample_job("k", boot, "running"), sample_step("k", 0),
                                  BootStatusUpdate{boot + 7, "stopped"}};
  EXPECT_EQ(capture_error([&] { store.write(failing); }).kind(), ErrorKind::kNotFound);
  EXPECT_FALSE(store.get_job("k").has_value());

  // Nested transactions: an inner failure caught by the body undoes only the inner part.
  store.transaction([&] {
    store.write_steps(std::vector<StepReceipt>{sample_step("j", 5)});
    try {
      store.write_steps(std::vector<StepReceipt>{sample_step("j", 6), sample_step("nobody", 7)});
    } catch (const Error&) {
    }
  });
  const auto steps = store.steps("j", std::nullopt, 10, false);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[1].step, 5);
}

TEST_F(StoreTest, ReadOnlyStoreRefusesWritesAndMissingFiles) {
  const fs::path missing = dir_ / "nowhere" / "receipts.db";
  const Error error = capture_error([&] { Store store(missing, OpenMode::kReadOnly); });
  EXPECT_EQ(error.kind(), ErrorKind::kNotFound);
  EXPECT_NE(std::string(error.what()).find(missing.string()), std::string::npos) << error.what();
  EXPECT_FALSE(fs::exists(missing));

  { Store create(db(), OpenMode::kReadWrite); }
  Store reader(db(), OpenMode::kReadOnly);
  EXPECT_EQ(capture_error([&] { reader.insert_boot(sample_boot("h")); }).kind(),
            ErrorKind::kFailedPrecondition);
  EXPECT_EQ(capture_error([&] { reader.write_steps(std::vector<StepReceipt>{}); }).kind(),
            ErrorKind::kFailedPrecondition);
  EXPECT_EQ(reader.quick_check(), "ok");
}

TEST_F(StoreTest, NonDatabaseFileIsReportedAsCorrupt) {
  testing::write_text(db(), std::string(4096, 'x'));
  const Error error = capture_error([&] { Store store(db(), OpenMode::kReadWrite); });
  EXPECT_EQ(error.kind(), ErrorKind::kCorruptData) << error.what();
  EXPECT_NE(std::string(error.what()).find(db().string()), std::string::npos);
}

TEST_F(StoreTest, OlderSchemaIsMigratedForwardKeepingData) {
  ASSERT_GE(latest_schema_version(), 2);
  {
    StoreOptions v1;
    v1.migrate_to_version = 1;
    Store store(db(), OpenMode::kReadWrite, v1);
    EXPECT_EQ(store.schema_version(), 1);
    store.upsert_job(sample_job("old", store.insert_boot(sample_boot("h")), "succeeded"));
    store.write_steps(std::vector<StepReceipt>{sample_step("old", 0), sample_step("old", 1)});
  }
  {
    RawDb raw(db());
    EXPECT_EQ(raw.integer("PRAGMA user_version"), 1);
    EXPECT_EQ(raw.integer("SELECT count(*) FROM sqlite_master WHERE name = 'jobs_by_state'"), 0);
  }
  // A reader cannot migrate, and says who can.
  const Error old = capture_error([&] { Store reader(db(), OpenMode::kReadOnly); });
  EXPECT_EQ(old.kind(), ErrorKind::kFailedPrecondition);
  EXPECT_NE(std::string(old.what()).find("older"), std::string::npos) << old.what();

  {
    Store store(db(), OpenMode::kReadWrite);
    EXPECT_EQ(store.schema_version(), latest_schema_version());
    EXPECT_EQ(store.get_job("old")->state, "succeeded");
    EXPECT_EQ(store.steps("old", std::nullopt, 10, false).size(), 2u);
    EXPECT_EQ(store.integrity_check(), "ok");
  }
  RawDb raw(db());
  EXPECT_EQ(raw.integer("PRAGMA user_version"), latest_schema_version());
  EXPECT_EQ(raw.integer("SELECT count(*) FROM sqlite_master WHERE name = 'jobs_by_state'"), 1);
}

TEST_F(StoreTest, NewerSchemaIsRefusedAndLeftUntouched) {
  { Store create(db(), OpenMode::kReadWrite); }
  const int newer = latest_schema_version() + 1;
  {
    RawDb raw(db());
    raw.exec("PRAGMA user_version = " + std::to_string(newer));
  }
  for (OpenMode mode : {OpenMode::kReadWrite, OpenMode::kReadOnly}) {
    const Error error = capture_error([&] { Store store(db(), mode); });
    EXPECT_EQ(error.kind(), ErrorKind::kFailedPrecondition);
    const std::string message = error.what();
    EXPECT_NE(message.find("newer"), std::string::npos) << message;
    EXPECT_NE(message.find(std::to_string(newer)), std::string::npos) << message;
    EXPECT_NE(message.find(db().string()), std::string::npos) << message;
  }
  RawDb raw(db());
  EXPECT_EQ(raw.integer("PRAGMA user_version"), newer);
}

TEST_F(StoreTest, MigrationsAreNumberedInOrder) {
  const auto all = migrations();
  ASSERT_FALSE(all.empty());
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i].version, static_cast<int>(i) + 1);
  EXPECT_EQ(latest_schema_version(), all.back().version);
}

TEST_F(StoreTest, IntegrityCheckReportsBrokenForeignKeys) {
  {
    Store store(db(), OpenMode::kReadWrite);
    store.upsert_job(sample_job("j", store.insert_boot(sample_boot("h")), "running"));
  }
  {
    RawDb raw(db());  // foreign keys are off on this connection
    raw.exec(
        "INSERT INTO steps (job_id, step, attempt, tokens, recorded_at) "
        "VALUES ('ghost', 1, 1, 0, '2026-11-22T00:00:00.000Z')");
  }
  Store reader(db(), OpenMode::kReadOnly);
  EXPECT_EQ(reader.quick_check(), "ok");
  const std::string report = reader.integrity_check();
  EXPECT_NE(report, "ok");
  EXPECT_NE(report.find("steps"), std::string::npos) << report;
}

}  // namespace
}  // namespace megacpp::receipts
