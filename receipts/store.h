#pragma once
// The receipt store: one SQLite database file holding what the daemon recorded about its boots,
// precondition checks, jobs, gate decisions and runs.
//
// One process writes (the daemon, through a read-write Store, usually behind a BatchedWriter);
// any number of readers each open their own read-only Store. The database runs in WAL mode, so
// readers see the last committed state and never block the writer, nor the writer them.
//
// A Store is one SQLite connection: use it from one thread at a time. Every statement is a
// cached prepared statement with bound values. Failures throw megacpp::Error naming the file.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "receipts/records.h"

namespace megacpp::receipts {

enum class OpenMode {
  kReadWrite,  // creates the file when missing and migrates it to the latest schema
  kReadOnly,   // the file must exist and already be at the latest schema
};

struct StoreOptions {
  // How long a statement waits for a lock held by another connection before failing.
  std::chrono::milliseconds busy_timeout{10000};
  // Read-write only: migrate no further than this schema version (0 = the latest). For tests and
  // tooling that need a database at an older version; the daemon leaves it at 0. The store's
  // statements are written for the latest schema, so against an older one some may fail.
  int migrate_to_version = 0;
};

struct JobQuery {
  std::string state;       // only jobs in this state; empty: all
  int limit = 50;          // >= 1
  std::string page_token;  // empty: start at the newest job; else a previous next_page_token
};

struct JobPage {
  std::vector<JobRecord> jobs;  // newest submission first
  std::string next_page_token;  // empty when there are no more jobs
};

struct StoreCounts {
  int64_t boots = 0;
  int64_t preconditions = 0;
  int64_t jobs = 0;
  int64_t gate_decisions = 0;
  int64_t steps = 0;
  int64_t evals = 0;
  int64_t kernel_receipts = 0;
  int64_t run_summaries = 0;
  int64_t database_bytes = 0;  // the main file's pages
  int64_t wal_bytes = 0;       // the write-ahead log not yet checkpointed into it
};

class Store {
 public:
  // Throws Error(kNotFound) for a read-only open of a missing file, Error(kFailedPrecondition)
  // for a schema version newer than this build knows (or, read-only, older than it knows),
  // Error(kCorruptData) for a file that is not an SQLite database, Error(kIo) otherwise.
  Store(const std::filesystem::path& path, OpenMode mode, const StoreOptions& options = {});
  ~Store();
  Store(Store&&) noexcept;
  Store& operator=(Store&&) noexcept;

  const std::filesystem::path& path() const;
  OpenMode mode() const;
  int schema_version() const;

  // ---- Writes (read-write stores only; each throws Error(kFailedPrecondition) otherwise).
  // A write that is not inside transaction() commits on its own. Records are validated first
  // (Error(kInvalidArgument) naming the field); a receipt that refers to a boot or job the store
  // does not hold is refused with Error(kInvalidArgument): write the boot and job first.

  // Runs `body` in one transaction: everything it writes commits together, or, when it throws,
  // nothing does and the exception propagates. Nested calls become savepoints.
  void transaction(const std::function<void()>& body);

  // Returns the new boot's id (boot.id is ignored).
  int64_t insert_boot(const BootReceipt& boot);
  // Error(kNotFound) when there is no such boot.
  void update_boot_status(int64_t boot_id, std::string_view status);
  // Sets every boot but `current_boot_id` that is still "starting" or "serving" to "crashed": a
  // daemon that ends normally leaves "stopped" or "refused", so those were killed (kill -9, OOM,
  // power loss). Only a daemon holding the state directory's lock may call it, or a live
  // daemon's boot would be marked. Returns how many boots it marked.
  int64_t mark_unfinished_boots_crashed(int64_t current_boot_id);
  void insert_preconditions(std::span<const PreconditionResult> results);
  // Inserts, or updates every field of the job with that id except submitted_at, which keeps
  // the time of the first submission.
  void upsert_job(const JobRecord& job);
  // A decision for a (job, gate) that already has one replaces it.
  void insert_gate_decisions(std::span<const GateDecision> decisions);
  // A receipt for a (job, step) that already has one replaces it: a resumed job re-executes the
  // steps after its last checkpoint and must leave neither duplicates nor gaps.
  void write_steps(std::span<const StepReceipt> steps);
  // Deletes the job's step receipts with step > `step`; returns how many there were.
  int64_t delete_steps_after(std::string_view job_id, int64_t step);
  // Replaced per (job, step), like steps.
  void insert_evals(std::span<const EvalReceipt> evals);
  void insert_kernel_receipts(std::span<const KernelReceipt> kernels);
  // Replaces the job's previous summary, if any.
  void insert_run_summary(const RunSummary& summary);
  // Applies each receipt in order, all in one transaction.
  void write(std::span<const Receipt> receipts);

  // ---- Reads (any store). limit must be >= 1 (Error(kInvalidArgument) otherwise).

  // Runs `body` on one consistent snapshot of the database: reads inside it do not see writes
  // committed meanwhile. Outside it, each read sees the latest commit.
  void read_snapshot(const std::function<void()>& body) const;

  // Newest first; with before_id, only boots with a smaller id (the next page).
  std::vector<BootReceipt> list_boots(int limit,
                                      std::optional<int64_t> before_id = std::nullopt) const;
  std::optional<BootReceipt> get_boot(int64_t boot_id) const;
  // In the order they were recorded.
  std::vector<PreconditionResult> preconditions(int64_t boot_id) const;
  std::optional<JobRecord> get_job(std::string_view job_id) const;
  // Error(kInvalidArgument) for an unknown state or a page token that names no job.
  JobPage list_jobs(const JobQuery& query) const;
  // Ordered by gate name.
  std::vector<GateDecision> gate_decisions(std::string_view job_id) const;
  // Up to `limit` step receipts of the job in step order, oldest first or, with newest_first,
  // newest first. after_step is a page cursor, the last step of the previous page: the page
  // continues past it in the listing order (larger steps oldest first, smaller newest first).
  std::vector<StepReceipt> steps(std::string_view job_id, std::optional<int64_t> after_step,
                                 int limit, bool newest_first) const;
  // In step order.
  std::vector<EvalReceipt> evals(std::string_view job_id) const;
  // In the order they were recorded.
  std::vector<KernelReceipt> kernel_receipts(std::string_view job_id) const;
  std::optional<RunSummary> run_summary(std::string_view job_id) const;

  // Rows per table (counting scans each table: tens of milliseconds at a million steps) and the
  // size of the files, for the daemon's metrics.
  StoreCounts counts() const;
  // "ok", or SQLite's list of problems, one per line. quick_check skips the index-content
  // cross-checks; integrity_check does them all and also checks every foreign key.
  std::string quick_check() const;
  std::string integrity_check() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megacpp::receipts
