#pragma once
// The daemon's way to write receipts without waiting for the disk: enqueue() hands a record to a
// background thread and returns; the thread commits what has queued up in one transaction per
// batch (one fsync per batch instead of one per receipt), in enqueue order.
//
// A batch is committed when `batch_records` records are waiting, when the oldest waiting record
// has waited `flush_interval`, on flush(), and at destruction. A batch takes everything queued
// when it starts, so when the disk lags behind, batches grow (fewer, larger transactions) up to
// max_queued_records. flush() returns once everything enqueued before it is committed, so
// "flushed" means "on disk" (the store writes with synchronous=FULL).
//
// Failures on the writer thread are logged (spdlog) and reported once, by the next flush() that
// covers them, which throws an Error describing them: flush(job) reports only the failures of
// that job's records, so concurrent callers (a submission, another job's end) each learn about
// their own records and never take or receive another's; flush() reports every failure not yet
// reported. When a batch fails because of one bad record (a receipt of an unknown job), the batch
// is retried record by record, so only the bad records are lost; when it fails for any other
// reason (disk full, I/O error), the whole batch is lost, and each job with records in it has the
// failure to report.
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "base/error.h"
#include "receipts/records.h"
#include "receipts/store.h"

namespace megacpp::receipts {

struct BatchedWriterOptions {
  std::chrono::milliseconds flush_interval{100};
  size_t batch_records = 1000;
  // enqueue() blocks while this many records wait: if the disk stalls, the daemon slows down
  // instead of growing without bound.
  size_t max_queued_records = 200000;
};

struct BatchedWriterStats {
  int64_t committed_records = 0;
  int64_t failed_records = 0;
  int64_t batches = 0;  // committed transactions
};

class BatchedWriter {
 public:
  // `store` must be read-write (Error(kFailedPrecondition) otherwise) and outlive the writer.
  // While the writer exists its thread is the store's only user: write through the writer.
  explicit BatchedWriter(Store& store, const BatchedWriterOptions& options = {});
  // Commits everything still queued; failures are logged, not thrown.
  ~BatchedWriter();
  BatchedWriter(const BatchedWriter&) = delete;
  BatchedWriter& operator=(const BatchedWriter&) = delete;

  // Validates the record (Error(kInvalidArgument) at once when a field breaks its rule) and
  // queues it. Returns without waiting for the disk, unless max_queued_records are waiting.
  void enqueue(Receipt receipt);
  // Inserts a boot in order with the queued records and waits for its id (the daemon needs the
  // id for everything it records afterwards). Throws what Store::insert_boot throws.
  int64_t insert_boot(const BootReceipt& boot);
  // Blocks until every record enqueued before the call is committed or has failed; throws an
  // Error summarising the failures not yet reported, if there were any.
  void flush();
  // The same wait; throws an Error summarising the failures of `job`'s records (those whose
  // job_id is `job`; "" for the records of no job, the daemon's own) not yet reported, if there
  // were any. Other jobs' failures stay for them.
  void flush(const std::string& job);
  // The same wait, reporting nothing: the failures stay for the flushes they belong to (a
  // reader that only needs the store to be up to date).
  void wait_committed();

  BatchedWriterStats stats() const;

 private:
  struct BootTask {
    BootReceipt boot;
    int64_t id = 0;
    std::exception_ptr error;
    bool done = false;
  };
  struct Entry {
    std::variant<Receipt, BootTask*> item;
  };

  void run();
  void process(std::deque<Entry>& batch);
  void commit(std::vector<Receipt>& receipts);
  // The failures of one job's records (or, under "", of records that belong to no job), not yet
  // reported by a flush.
  struct Failures {
    int64_t records = 0;
    size_t errors = 0;   // one error can cost a whole batch
    uint64_t first = 0;  // when the first happened (failure_clock_): the earliest's kind is thrown
    ErrorKind first_kind = ErrorKind::kInternal;
    std::vector<std::string> messages;  // the first few
  };
  void wait_for_enqueued(std::unique_lock<std::mutex>& lock);
  // Throws the summary of `reported` (nothing when it holds no failure).
  [[noreturn]] void throw_failures(const Failures& reported) const;
  // `records` receipts of `job` were lost to one error.
  void record_failure(ErrorKind kind, const std::string& message, const std::string& job,
                      int64_t records);
  // One error cost the whole batch `receipts`: each job with records in it has it to report.
  void record_batch_failure(ErrorKind kind, const std::string& message,
                            const std::vector<Receipt>& receipts);
  // Under mutex_.
  void add_failure(ErrorKind kind, const std::string& message, const std::string& job,
                   int64_t records);

  Store& store_;
  BatchedWriterOptions options_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;  // the writer thread: work arrived, flush asked, stopping
  std::condition_variable done_;  // flushers and blocked enqueuers: a batch finished or was taken
  std::deque<Entry> queue_;
  std::chrono::steady_clock::time_point oldest_queued_;
  uint64_t enqueued_ = 0;
  uint64_t completed_ = 0;
  bool flush_requested_ = false;
  bool stopping_ = false;
  std::map<std::string, Failures> failures_;  // by job, not yet reported
  uint64_t failure_clock_ = 0;
  BatchedWriterStats stats_;

  std::thread thread_;  // last: started once everything above is initialised
};

}  // namespace megacpp::receipts
