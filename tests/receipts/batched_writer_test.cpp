#include "receipts/batched_writer.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "receipts/store.h"
#include "tests/support/temp_dir.h"

namespace megacpp::receipts {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

BootReceipt boot_receipt() {
  BootReceipt boot;
  boot.version = "0.1.0";
  boot.hostname = "test-host";
  boot.devices = nlohmann::json::array();
  boot.environment = nlohmann::json::object();
  boot.status = "serving";
  return boot;
}

JobRecord job_record(const std::string& id, int64_t boot_id) {
  JobRecord job;
  job.job_id = id;
  job.boot_id = boot_id;
  job.state = "running";
  job.spec = {{"model", "tiny"}};
  return job;
}

StepReceipt step_receipt(const std::string& job, int64_t step) {
  StepReceipt receipt;
  receipt.job_id = job;
  receipt.step = step;
  receipt.attempt = 1;
  receipt.loss = 5.0 / static_cast<double>(step + 1);
  receipt.tokens = 4096;
  receipt.step_ms = 50.0;
  receipt.tokens_per_s = 81920.0;
  receipt.recorded_at = "2026-11-22T10:00:00.000Z";
  return receipt;
}

int64_t step_count(const fs::path& db, const std::string& job) {
  Store reader(db, OpenMode::kReadOnly);
  int64_t count = 0;
  std::optional<int64_t> cursor;
  while (true) {
    const auto page = reader.steps(job, cursor, 1000, false);
    if (page.empty()) return count;
    count += static_cast<int64_t>(page.size());
    cursor = page.back().step;
  }
}

// Polls until `condition` holds or `timeout` passes.
template <typename Condition>
bool eventually(Condition&& condition, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return condition();
}

class BatchedWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = std::make_unique<Store>(db(), OpenMode::kReadWrite);
    boot_ = store_->insert_boot(boot_receipt());
  }
  fs::path db() const { return dir_ / "receipts.db"; }

  testing::TempDir dir_;
  std::unique_ptr<Store> store_;
  int64_t boot_ = 0;
};

TEST_F(BatchedWriterTest, NothingIsCommittedBeforeTheBatchIsDueAndFlushCommitsAll) {
  BatchedWriterOptions options;
  options.flush_interval = 60s;
  options.batch_records = 1000000;
  BatchedWriter writer(*store_, options);
  writer.enqueue(job_record("j", boot_));
  for (int64_t s = 0; s < 100; ++s) writer.enqueue(step_receipt("j", s));
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(step_count(db(), "j"), 0);
  writer.flush();
  EXPECT_EQ(step_count(db(), "j"), 100);
  const BatchedWriterStats stats = writer.stats();
  EXPECT_EQ(stats.committed_records, 101);
  EXPECT_EQ(stats.batches, 1);
  EXPECT_EQ(stats.failed_records, 0);
}

TEST_F(BatchedWriterTest, CommitsWhenTheBatchIsFull) {
  BatchedWriterOptions options;
  options.flush_interval = 60s;
  options.batch_records = 50;
  BatchedWriter writer(*store_, options);
  writer.enqueue(job_record("j", boot_));
  for (int64_t s = 0; s < 149; ++s) writer.enqueue(step_receipt("j", s));
  // 150 records: at least two full batches commit with no flush and no deadline.
  EXPECT_TRUE(eventually([&] { return step_count(db(), "j") >= 99; }, 10s));
  writer.flush();
  EXPECT_EQ(step_count(db(), "j"), 149);
}

TEST_F(BatchedWriterTest, CommitsWhenTheIntervalPasses) {
  BatchedWriterOptions options;
  options.flush_interval = 20ms;
  options.batch_records = 1000000;
  BatchedWriter writer(*store_, options);
  writer.enqueue(job_record("j", boot_));
  for (int64_t s = 0; s < 10; ++s) writer.enqueue(step_receipt("j", s));
  EXPECT_TRUE(eventually([&] { return step_count(db(), "j") == 10; }, 10s));
}

TEST_F(BatchedWriterTest, DestructorCommitsWhatIsQueued) {
  {
    BatchedWriterOptions options;
    options.flush_interval = 60s;
    options.batch_records = 1000000;
    BatchedWriter writer(*store_, options);
    writer.enqueue(job_record("j", boot_));
    for (int64_t s = 0; s < 30; ++s) writer.enqueue(step_receipt("j", s));
  }
  EXPECT_EQ(step_count(db(), "j"), 30);
}

TEST_F(BatchedWriterTest, FailuresAreReportedByFlushAndCostOnlyTheBadRecords) {
  BatchedWriterOptions options;
  options.flush_interval = 60s;
  BatchedWriter writer(*store_, options);
  writer.enqueue(job_record("j", boot_));
  writer.enqueue(step_receipt("j", 0));
  writer.enqueue(step_receipt("ghost-job", 0));  // no such job: the foreign key refuses it
  writer.enqueue(step_receipt("j", 1));
  try {
    writer.flush();
    ADD_FAILURE() << "flush() should report the failed receipt";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
    const std::string message = error.what();
    EXPECT_NE(message.find("1 receipt(s)"), std::string::npos) << message;
    EXPECT_NE(message.find("ghost-job"), std::string::npos) << message;
  }
  EXPECT_EQ(step_count(db(), "j"), 2);
  EXPECT_EQ(writer.stats().failed_records, 1);
  // Reported once: the next flush has nothing to say.
  writer.enqueue(step_receipt("j", 2));
  EXPECT_NO_THROW(writer.flush());
  EXPECT_EQ(step_count(db(), "j"), 3);
}

TEST_F(BatchedWriterTest, AJobsFlushReportsItsOwnFailuresAndNoOtherJobs) {
  BatchedWriterOptions options;
  options.flush_interval = 60s;
  BatchedWriter writer(*store_, options);
  writer.enqueue(job_record("j", boot_));
  writer.enqueue(step_receipt("ghost-job", 0));  // no such job: the foreign key refuses it
  writer.enqueue(step_receipt("j", 0));
  // j's records were all written: the ghost's failure is not j's to report, nor is it taken.
  EXPECT_NO_THROW(writer.flush("j"));
  EXPECT_EQ(step_count(db(), "j"), 1);
  try {
    writer.flush("ghost-job");
    ADD_FAILURE() << "flush(\"ghost-job\") should report its failed receipt";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
    const std::string message = error.what();
    EXPECT_NE(message.find("1 receipt(s)"), std::string::npos) << message;
    EXPECT_NE(message.find("ghost-job"), std::string::npos) << message;
  }
  // Reported once: neither the job's flush nor the whole writer's has it again.
  EXPECT_NO_THROW(writer.flush("ghost-job"));
  EXPECT_NO_THROW(writer.flush());

  // wait_committed() reports nothing and takes nothing: the failure stays for its job.
  writer.enqueue(step_receipt("ghost-job", 1));
  EXPECT_NO_THROW(writer.wait_committed());
  EXPECT_THROW(writer.flush("ghost-job"), Error);

  // A failure left unreported by its job's flush is still in the writer's summary.
  writer.enqueue(step_receipt("other-ghost", 0));
  EXPECT_NO_THROW(writer.flush("j"));
  EXPECT_THROW(writer.flush(), Error);
  EXPECT_NO_THROW(writer.flush("other-ghost"));
}

TEST_F(BatchedWriterTest, InvalidRecordsAreRefusedAtEnqueue) {
  BatchedWriter writer(*store_);
  StepReceipt bad = step_receipt("j", 0);
  bad.recorded_at = "10:00";
  EXPECT_THROW(writer.enqueue(bad), Error);
  JobRecord bad_job = job_record("j", boot_);
  bad_job.state = "done";
  EXPECT_THROW(writer.enqueue(bad_job), Error);
  EXPECT_NO_THROW(writer.flush());
  EXPECT_EQ(writer.stats().committed_records, 0);
}

TEST_F(BatchedWriterTest, InsertBootIsOrderedWithTheQueue) {
  BatchedWriterOptions options;
  options.flush_interval = 60s;
  BatchedWriter writer(*store_, options);
  writer.enqueue(BootStatusUpdate{boot_, "stopped"});
  BootReceipt next = boot_receipt();
  next.status = "starting";
  const int64_t id = writer.insert_boot(next);
  EXPECT_GT(id, boot_);
  // The boot and everything queued before it are committed when insert_boot returns.
  Store reader(db(), OpenMode::kReadOnly);
  EXPECT_EQ(reader.get_boot(boot_)->status, "stopped");
  EXPECT_EQ(reader.get_boot(id)->status, "starting");
  writer.enqueue(job_record("j", id));
  writer.flush();
  EXPECT_EQ(reader.get_job("j")->boot_id, id);
}

TEST_F(BatchedWriterTest, ReadOnlyStoreIsRefused) {
  Store reader(db(), OpenMode::kReadOnly);
  try {
    BatchedWriter writer(reader);
    ADD_FAILURE() << "a BatchedWriter on a read-only store";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kFailedPrecondition);
  }
}

// A reader on its own connection lists steps while the writer commits batch after batch: WAL
// lets it read the last committed state without waiting. Its busy timeout is zero, so any lock
// contention would surface as an SQLITE_BUSY error instead of a wait.
TEST_F(BatchedWriterTest, ReaderNeverBlocksOrFailsWhileTheWriterCommits) {
  BatchedWriterOptions options;
  options.flush_interval = 2ms;
  options.batch_records = 100;
  BatchedWriter writer(*store_, options);
  writer.enqueue(job_record("j", boot_));
  writer.flush();

  constexpr int64_t kSteps = 20000;
  std::atomic<bool> writing{true};
  std::mutex problems_mutex;
  std::vector<std::string> problems;
  int64_t reads = 0;
  std::thread reader_thread([&] {
    try {
      StoreOptions no_waiting;
      no_waiting.busy_timeout = 0ms;
      Store reader(db(), OpenMode::kReadOnly, no_waiting);
      int64_t newest_seen = -1;
      while (writing.load()) {
        const auto page = reader.steps("j", std::nullopt, 200, /*newest_first=*/true);
        ++reads;
        if (page.empty()) continue;
        // Committed batches only: no gaps inside a page, and the newest step never goes back.
        for (size_t i = 0; i < page.size(); ++i) {
          if (page[i].step != page[0].step - static_cast<int64_t>(i)) {
            std::lock_guard lock(problems_mutex);
            problems.push_back("gap at step " + std::to_string(page[i].step));
            break;
          }
        }
        if (page[0].step < newest_seen) {
          std::lock_guard lock(problems_mutex);
          problems.push_back("newest step went back from " + std::to_string(newest_seen));
        }
        newest_seen = page[0].step;
        if (reads % 50 == 0 && reader.counts().steps < newest_seen + 1) {
          std::lock_guard lock(problems_mutex);
          problems.push_back("counts() behind the listed steps");
        }
      }
    } catch (const std::exception& error) {
      std::lock_guard lock(problems_mutex);
      problems.push_back(error.what());
    }
  });
  for (int64_t s = 0; s < kSteps; ++s) {
    writer.enqueue(step_receipt("j", s));
    if (s % 2000 == 1999) writer.flush();
  }
  writer.flush();
  writing = false;
  reader_thread.join();
  EXPECT_TRUE(problems.empty()) << problems.front();
  EXPECT_GT(reads, 10);
  EXPECT_EQ(step_count(db(), "j"), kSteps);
}

// The durability contract: what flush() reported committed survives the writer being killed
// with SIGKILL at an arbitrary point of its next batches, and the file stays consistent.
TEST(BatchedWriterDurability, FlushedReceiptsSurviveSigkill) {
  testing::TempDir dir;
  const fs::path db = dir / "receipts.db";
  int report[2];
  ASSERT_EQ(pipe(report), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(report[0]);
    try {
      Store store(db, OpenMode::kReadWrite);
      const int64_t boot = store.insert_boot(boot_receipt());
      store.upsert_job(job_record("victim", boot));
      BatchedWriterOptions options;
      options.flush_interval = 1ms;
      options.batch_records = 64;
      BatchedWriter writer(store, options);
      for (int64_t step = 0;; ++step) {
        writer.enqueue(step_receipt("victim", step));
        if (step % 300 == 299) {
          writer.flush();
          if (write(report[1], &step, sizeof step) != sizeof step) _exit(3);
        }
      }
    } catch (...) {
      _exit(2);
    }
  }
  close(report[1]);
  int64_t flushed = -1;
  for (int reports = 0; reports < 15; ++reports) {
    int64_t step = 0;
    ASSERT_EQ(read(report[0], &step, sizeof step), static_cast<ssize_t>(sizeof step))
        << "the writer process stopped early";
    flushed = step;
  }
  ASSERT_EQ(kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "child status " << status;
  // Reports written after the last one read are flushed receipts too.
  int64_t step = 0;
  while (read(report[0], &step, sizeof step) == static_cast<ssize_t>(sizeof step)) flushed = step;
  close(report[0]);
  ASSERT_GE(flushed, 299);

  // Independent check with SQLite itself before the store code touches the file.
  {
    sqlite3* raw = nullptr;
    ASSERT_EQ(sqlite3_open_v2(db.c_str(), &raw, SQLITE_OPEN_READWRITE, nullptr), SQLITE_OK);
    sqlite3_stmt* statement = nullptr;
    ASSERT_EQ(sqlite3_prepare_v2(raw, "PRAGMA integrity_check", -1, &statement, nullptr),
              SQLITE_OK);
    ASSERT_EQ(sqlite3_step(statement), SQLITE_ROW);
    EXPECT_STREQ(reinterpret_cast<const char*>(sqlite3_column_text(statement, 0)), "ok");
    sqlite3_finalize(statement);
    sqlite3_close(raw);
  }
  Store store(db, OpenMode::kReadWrite);
  EXPECT_EQ(store.integrity_check(), "ok");
  const int64_t present = store.counts().steps;
  EXPECT_GE(present, flushed + 1);
  // Batches commit whole and in order: the receipts present are exactly steps 0..present-1.
  const auto newest = store.steps("victim", std::nullopt, 1, true);
  ASSERT_EQ(newest.size(), 1u);
  EXPECT_EQ(newest[0].step, present - 1);
  const auto oldest = store.steps("victim", std::nullopt, 1, false);
  ASSERT_EQ(oldest.size(), 1u);
  EXPECT_EQ(oldest[0].step, 0);
}

}  // namespace
}  // namespace megacpp::receipts
