#include "receipts/batched_writer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

namespace megacpp::receipts {
namespace {

// How many failure messages flush() quotes; the rest are counted.
constexpr size_t kQuotedFailures = 5;

// Failures that belong to one record, not to the batch: retrying the others alone can succeed.
bool record_specific(ErrorKind kind) {
  return kind == ErrorKind::kInvalidArgument || kind == ErrorKind::kNotFound;
}

// The job a record belongs to; "" for the daemon's own (boot status, preconditions).
std::string job_of(const Receipt& receipt) {
  return std::visit(
      [](const auto& record) -> std::string {
        if constexpr (requires { record.job_id; }) {
          return record.job_id;
        } else {
          return {};
        }
      },
      receipt);
}

}  // namespace

BatchedWriter::BatchedWriter(Store& store, const BatchedWriterOptions& options)
    : store_(store), options_(options) {
  if (store.mode() != OpenMode::kReadWrite) {
    fail(ErrorKind::kFailedPrecondition,
         "receipt store {}: a BatchedWriter needs a read-write store", store.path().string());
  }
  if (options_.batch_records == 0 || options_.max_queued_records == 0) {
    fail(ErrorKind::kInvalidArgument,
         "BatchedWriterOptions: batch_records and max_queued_records must be >= 1, got {} and {}",
         options_.batch_records, options_.max_queued_records);
  }
  thread_ = std::thread([this] { run(); });
}

BatchedWriter::~BatchedWriter() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
  int64_t unreported = 0;
  for (const auto& [job, failures] : failures_) unreported += failures.records;
  if (unreported > 0) {
    spdlog::error("receipt store {}: {} receipt(s) were not written, and no flush reported them",
                  store_.path().string(), unreported);
  }
}

void BatchedWriter::enqueue(Receipt receipt) {
  validate(receipt);
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return queue_.size() < options_.max_queued_records; });
  if (queue_.empty()) oldest_queued_ = std::chrono::steady_clock::now();
  queue_.push_back(Entry{std::move(receipt)});
  ++enqueued_;
  // The thread sleeps without a deadline while the queue is empty, and until the deadline
  // otherwise: wake it for the first record and for a full batch.
  const bool wake = queue_.size() == 1 || queue_.size() >= options_.batch_records;
  lock.unlock();
  if (wake) wake_.notify_one();
}

int64_t BatchedWriter::insert_boot(const BootReceipt& boot) {
  validate(boot);
  BootTask task{boot, 0, nullptr, false};
  std::unique_lock lock(mutex_);
  if (queue_.empty()) oldest_queued_ = std::chrono::steady_clock::now();
  queue_.push_back(Entry{&task});
  ++enqueued_;
  flush_requested_ = true;
  wake_.notify_one();
  done_.wait(lock, [&] { return task.done; });
  if (task.error) std::rethrow_exception(task.error);
  return task.id;
}

void BatchedWriter::wait_for_enqueued(std::unique_lock<std::mutex>& lock) {
  const uint64_t target = enqueued_;
  if (completed_ < target) {
    flush_requested_ = true;
    wake_.notify_one();
    done_.wait(lock, [&] { return completed_ >= target; });
  }
}

void BatchedWriter::throw_failures(const Failures& reported) const {
  std::string message = fmt::format("receipt store {}: {} receipt(s) could not be written",
                                    store_.path().string(), reported.records);
  for (const std::string& failure : reported.messages) message += "; " + failure;
  if (reported.errors > reported.messages.size()) {
    message += fmt::format("; and {} more failure(s)", reported.errors - reported.messages.size());
  }
  throw Error(reported.first_kind, std::move(message));
}

void BatchedWriter::flush() {
  std::unique_lock lock(mutex_);
  wait_for_enqueued(lock);
  if (failures_.empty()) return;
  // Every job's failures in one summary. An error that cost a batch of several jobs is listed
  // under each of them: it is quoted once here, and the errors are not counted (a batch's would
  // count once per job in it).
  int64_t records = 0;
  const Failures* earliest = nullptr;
  std::vector<std::string> distinct;
  bool unquoted = false;
  for (const auto& [job, failures] : failures_) {
    records += failures.records;
    unquoted |= failures.errors > failures.messages.size();
    if (earliest == nullptr || failures.first < earliest->first) earliest = &failures;
    for (const std::string& message : failures.messages) {
      if (std::find(distinct.begin(), distinct.end(), message) == distinct.end()) {
        distinct.push_back(message);
      }
    }
  }
  unquoted |= distinct.size() > kQuotedFailures;
  if (distinct.size() > kQuotedFailures) distinct.resize(kQuotedFailures);
  std::string message = fmt::format("receipt store {}: {} receipt(s) could not be written",
                                    store_.path().string(), records);
  for (const std::string& failure : distinct) message += "; " + failure;
  if (unquoted) message += "; and further failures (see the log)";
  const ErrorKind kind = earliest->first_kind;
  failures_.clear();
  throw Error(kind, std::move(message));
}

void BatchedWriter::wait_committed() {
  std::unique_lock lock(mutex_);
  wait_for_enqueued(lock);
}

void BatchedWriter::flush(const std::string& job) {
  std::unique_lock lock(mutex_);
  wait_for_enqueued(lock);
  const auto it = failures_.find(job);
  if (it == failures_.end()) return;
  const Failures reported = std::move(it->second);
  failures_.erase(it);
  throw_failures(reported);
}

BatchedWriterStats BatchedWriter::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void BatchedWriter::run() {
  std::unique_lock lock(mutex_);
  while (true) {
    if (queue_.empty()) {
      if (stopping_) return;
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      continue;
    }
    wake_.wait_until(lock, oldest_queued_ + options_.flush_interval, [&] {
      return stopping_ || flush_requested_ || queue_.size() >= options_.batch_records;
    });
    flush_requested_ = false;
    std::deque<Entry> batch;
    batch.swap(queue_);
    done_.notify_all();  // room for enqueuers blocked on a full queue
    lock.unlock();
    process(batch);
    lock.lock();
    completed_ += batch.size();
    done_.notify_all();
  }
}

void BatchedWriter::process(std::deque<Entry>& batch) {
  std::vector<Receipt> receipts;
  receipts.reserve(batch.size());
  for (Entry& entry : batch) {
    if (auto* receipt = std::get_if<Receipt>(&entry.item)) {
      receipts.push_back(std::move(*receipt));
      continue;
    }
    // A boot goes in after the records queued before it, and its caller waits for the id.
    commit(receipts);
    BootTask* task = std::get<BootTask*>(entry.item);
    int64_t id = 0;
    std::exception_ptr error;
    try {
      id = store_.insert_boot(task->boot);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard lock(mutex_);
    task->id = id;
    task->error = error;
    task->done = true;
    done_.notify_all();
  }
  commit(receipts);
}

void BatchedWriter::commit(std::vector<Receipt>& receipts) {
  if (receipts.empty()) return;
  const auto count = static_cast<int64_t>(receipts.size());
  try {
    store_.write(receipts);
    std::lock_guard lock(mutex_);
    stats_.committed_records += count;
    ++stats_.batches;
  } catch (const Error& error) {
    if (!record_specific(error.kind()) || receipts.size() == 1) {
      record_batch_failure(error.kind(), error.what(), receipts);
    } else {
      spdlog::warn("receipt store {}: a batch of {} receipts failed ({}); writing them one by one",
                   store_.path().string(), count, error.what());
      for (const Receipt& receipt : receipts) {
        try {
          store_.write(std::span<const Receipt>(&receipt, 1));
          std::lock_guard lock(mutex_);
          stats_.committed_records += 1;
          ++stats_.batches;
        } catch (const Error& single) {
          record_failure(single.kind(), single.what(), job_of(receipt), 1);
        } catch (const std::exception& single) {
          record_failure(ErrorKind::kInternal, single.what(), job_of(receipt), 1);
        }
      }
    }
  } catch (const std::exception& error) {
    record_batch_failure(ErrorKind::kInternal, error.what(), receipts);
  }
  receipts.clear();
}

void BatchedWriter::record_batch_failure(ErrorKind kind, const std::string& message,
                                         const std::vector<Receipt>& receipts) {
  spdlog::error("receipt store {}: {} receipt(s) not written: {}", store_.path().string(),
                receipts.size(), message);
  std::map<std::string, int64_t> lost;
  for (const Receipt& receipt : receipts) ++lost[job_of(receipt)];
  std::lock_guard lock(mutex_);
  for (const auto& [job, records] : lost) add_failure(kind, message, job, records);
  ++failure_clock_;
}

void BatchedWriter::record_failure(ErrorKind kind, const std::string& message,
                                   const std::string& job, int64_t records) {
  spdlog::error("receipt store {}: {} receipt(s) not written: {}", store_.path().string(), records,
                message);
  std::lock_guard lock(mutex_);
  add_failure(kind, message, job, records);
  ++failure_clock_;
}

void BatchedWriter::add_failure(ErrorKind kind, const std::string& message, const std::string& job,
                                int64_t records) {
  stats_.failed_records += records;
  Failures& failures = failures_[job];
  if (failures.records == 0) {
    failures.first = failure_clock_;
    failures.first_kind = kind;
  }
  failures.records += records;
  ++failures.errors;
  if (failures.messages.size() < kQuotedFailures) failures.messages.push_back(message);
}

}  // namespace megacpp::receipts
