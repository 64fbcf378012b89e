#include "receipts/batched_writer.h"

#include <spdlog/spdlog.h>

#include <utility>

namespace megacpp::receipts {
namespace {

// How many failure messages flush() quotes; the rest are counted.
constexpr size_t kQuotedFailures = 5;

// Failures that belong to one record, not to the batch: retrying the others alone can succeed.
bool record_specific(ErrorKind kind) {
  return kind == ErrorKind::kInvalidArgument || kind == ErrorKind::kNotFound;
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
  if (failed_since_flush_ > 0) {
    spdlog::error("receipt store {}: {} receipt(s) were not written since the last flush",
                  store_.path().string(), failed_since_flush_);
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

void BatchedWriter::flush() {
  std::unique_lock lock(mutex_);
  const uint64_t target = enqueued_;
  if (completed_ < target) {
    flush_requested_ = true;
    wake_.notify_one();
    done_.wait(lock, [&] { return completed_ >= target; });
  }
  if (failed_since_flush_ == 0) return;
  std::string message = fmt::format("receipt store {}: {} receipt(s) could not be written",
                                    store_.path().string(), failed_since_flush_);
  for (const std::string& failure : failure_messages_) message += "; " + failure;
  if (failures_since_flush_ > failure_messages_.size()) {
    message +=
        fmt::format("; and {} more failure(s)", failures_since_flush_ - failure_messages_.size());
  }
  const ErrorKind kind = first_failure_kind_;
  failed_since_flush_ = 0;
  failures_since_flush_ = 0;
  failure_messages_.clear();
  throw Error(kind, std::move(message));
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
      record_failure(error.kind(), error.what(), count);
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
          record_failure(single.kind(), single.what(), 1);
        } catch (const std::exception& single) {
          record_failure(ErrorKind::kInternal, single.what(), 1);
        }
      }
    }
  } catch (const std::exception& error) {
    record_failure(ErrorKind::kInternal, error.what(), count);
  }
  receipts.clear();
}

void BatchedWriter::record_failure(ErrorKind kind, const std::string& message, int64_t records) {
  spdlog::error("receipt store {}: {} receipt(s) not written: {}", store_.path().string(), records,
                message);
  std::lock_guard lock(mutex_);
  if (failed_since_flush_ == 0) first_failure_kind_ = kind;
  failed_since_flush_ += records;
  ++failures_since_flush_;
  stats_.failed_records += records;
  if (failure_messages_.size() < kQuotedFailures) failure_messages_.push_back(message);
}

}  // namespace megacpp::receipts
