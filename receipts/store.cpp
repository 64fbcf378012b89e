#include "receipts/store.h"

#include <sqlite3.h>

#include <algorithm>
#include <limits>
#include <system_error>
#include <utility>

#include "base/error.h"
#include "receipts/schema.h"
#include "receipts/sqlite.h"

namespace megacpp::receipts {
namespace {

using sqlite::Connection;
using sqlite::Query;

// ---- Statements. The SELECT column lists of jobs and steps are spelled once (macros, so that
// they concatenate as literals) and the read_* functions below rely on their order.

constexpr std::string_view kInsertBoot = R"sql(
INSERT INTO boots (started_at, version, git_revision, compiler, build_type, cuda_runtime,
                   cuda_driver, nccl, cudnn, devices, hostname, environment, status)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13))sql";
constexpr std::string_view kUpdateBootStatus = "UPDATE boots SET status = ?2 WHERE id = ?1";
constexpr std::string_view kMarkUnfinishedBootsCrashed =
    "UPDATE boots SET status = 'crashed' WHERE status IN ('starting', 'serving') AND id <> ?1";
constexpr std::string_view kListBoots =
    "SELECT id, started_at, version, git_revision, compiler, build_type, cuda_runtime, "
    "cuda_driver, nccl, cudnn, devices, hostname, environment, status FROM boots "
    "WHERE id < ?1 ORDER BY id DESC LIMIT ?2";
constexpr std::string_view kGetBoot =
    "SELECT id, started_at, version, git_revision, compiler, build_type, cuda_runtime, "
    "cuda_driver, nccl, cudnn, devices, hostname, environment, status FROM boots WHERE id = ?1";

constexpr std::string_view kInsertPrecondition =
    "INSERT INTO preconditions (boot_id, check_name, status, detail, fix, checked_at) "
    "VALUES (?1, ?2, ?3, ?4, ?5, ?6)";
constexpr std::string_view kListPreconditions =
    "SELECT boot_id, check_name, status, detail, fix, checked_at FROM preconditions "
    "WHERE boot_id = ?1 ORDER BY id";

// submitted_at is left out of the update: it is the time of the first submission.
constexpr std::string_view kUpsertJob = R"sql(
INSERT INTO jobs (job_id, boot_id, state, spec, submitted_at, started_at, finished_at, error,
                  attempts, last_checkpoint_step)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
ON CONFLICT (job_id) DO UPDATE SET
  boot_id = excluded.boot_id, state = excluded.state, spec = excluded.spec,
  started_at = excluded.started_at, finished_at = excluded.finished_at, error = excluded.error,
  attempts = excluded.attempts, last_checkpoint_step = excluded.last_checkpoint_step)sql";
#define MEGACPP_JOB_COLUMNS                                                                       \
  "SELECT job_id, boot_id, state, spec, submitted_at, started_at, finished_at, error, attempts, " \
  "last_checkpoint_step FROM jobs "
constexpr std::string_view kGetJob = MEGACPP_JOB_COLUMNS "WHERE job_id = ?1";
constexpr std::string_view kJobSeq = "SELECT seq FROM jobs WHERE job_id = ?1";
constexpr std::string_view kListJobs =
    MEGACPP_JOB_COLUMNS "WHERE seq < ?1 ORDER BY seq DESC LIMIT ?2";
constexpr std::string_view kListJobsInState =
    MEGACPP_JOB_COLUMNS "WHERE state = ?3 AND seq < ?1 ORDER BY seq DESC LIMIT ?2";
#undef MEGACPP_JOB_COLUMNS

constexpr std::string_view kUpsertGateDecision = R"sql(
INSERT INTO gate_decisions (job_id, gate, decision, reason, implementation, stages, decided_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
ON CONFLICT (job_id, gate) DO UPDATE SET
  decision = excluded.decision, reason = excluded.reason,
  implementation = excluded.implementation, stages = excluded.stages,
  decided_at = excluded.decided_at)sql";
constexpr std::string_view kListGateDecisions =
    "SELECT job_id, gate, decision, reason, implementation, stages, decided_at "
    "FROM gate_decisions WHERE job_id = ?1 ORDER BY gate";

constexpr std::string_view kUpsertStep = R"sql(
INSERT INTO steps (job_id, step, attempt, loss, grad_norm, lr, tokens, step_ms, tokens_per_s,
                   flops_per_s, recorded_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
ON CONFLICT (job_id, step) DO UPDATE SET
  attempt = excluded.attempt, loss = excluded.loss, grad_norm = excluded.grad_norm,
  lr = excluded.lr, tokens = excluded.tokens, step_ms = excluded.step_ms,
  tokens_per_s = excluded.tokens_per_s, flops_per_s = excluded.flops_per_s,
  recorded_at = excluded.recorded_at)sql";
constexpr std::string_view kDeleteStepsAfter = "DELETE FROM steps WHERE job_id = ?1 AND step > ?2";
#define MEGACPP_STEP_COLUMNS                                                           \
  "SELECT job_id, step, attempt, loss, grad_norm, lr, tokens, step_ms, tokens_per_s, " \
  "flops_per_s, "                                                                      \
  "recorded_at FROM steps "
constexpr std::string_view kStepsOldestFirst =
    MEGACPP_STEP_COLUMNS "WHERE job_id = ?1 AND step > ?2 ORDER BY step ASC LIMIT ?3";
constexpr std::string_view kStepsNewestFirst =
    MEGACPP_STEP_COLUMNS "WHERE job_id = ?1 AND step < ?2 ORDER BY step DESC LIMIT ?3";
#undef MEGACPP_STEP_COLUMNS

constexpr std::string_view kUpsertEval = R"sql(
INSERT INTO evals (job_id, step, val_loss, recorded_at) VALUES (?1, ?2, ?3, ?4)
ON CONFLICT (job_id, step) DO UPDATE SET
  val_loss = excluded.val_loss, recorded_at = excluded.recorded_at)sql";
constexpr std::string_view kListEvals =
    "SELECT job_id, step, val_loss, recorded_at FROM evals WHERE job_id = ?1 ORDER BY step";

constexpr std::string_view kInsertKernel = R"sql(
INSERT INTO kernel_receipts (job_id, kernel, device, launch, registers, static_smem,
                             dynamic_smem, occupancy, time_ms_min, time_ms_median, time_ms_max,
                             samples, recorded_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13))sql";
constexpr std::string_view kListKernels =
    "SELECT job_id, kernel, device, launch, registers, static_smem, dynamic_smem, occupancy, "
    "time_ms_min, time_ms_median, time_ms_max, samples, recorded_at FROM kernel_receipts "
    "WHERE job_id = ?1 ORDER BY id";

constexpr std::string_view kUpsertRunSummary = R"sql(
INSERT INTO run_summaries (job_id, summary, recorded_at) VALUES (?1, ?2, ?3)
ON CONFLICT (job_id) DO UPDATE SET
  summary = excluded.summary, recorded_at = excluded.recorded_at)sql";
constexpr std::string_view kGetRunSummary =
    "SELECT job_id, summary, recorded_at FROM run_summaries WHERE job_id = ?1";

constexpr std::string_view kCounts = R"sql(
SELECT (SELECT count(*) FROM boots), (SELECT count(*) FROM preconditions),
       (SELECT count(*) FROM jobs), (SELECT count(*) FROM gate_decisions),
       (SELECT count(*) FROM steps), (SELECT count(*) FROM evals),
       (SELECT count(*) FROM kernel_receipts), (SELECT count(*) FROM run_summaries))sql";

constexpr std::string_view kKnownJobStates[] = {"queued",    "running",     "succeeded", "failed",
                                                "cancelled", "interrupted", "refused"};

// A required timestamp left empty means "now".
std::string stamped(const std::string& timestamp) {
  return timestamp.empty() ? utc_now() : timestamp;
}

// Invalid UTF-8 (an environment variable can hold any bytes) is replaced rather than refused:
// a receipt is worth more with a replacement character than not written.
std::string json_text(const nlohmann::json& value) {
  return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

nlohmann::json parse_json(const Query& row, int column, std::string_view what) {
  const std::string text = row.text(column);
  auto value = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) {
    fail(ErrorKind::kCorruptData, "receipt store: {} is not valid JSON: '{}'", what,
         text.substr(0, 80));
  }
  return value;
}

void require_limit(int limit, std::string_view what) {
  if (limit < 1) fail(ErrorKind::kInvalidArgument, "{}: limit must be >= 1, got {}", what, limit);
}

// Prefixes an Error escaping `body` with which record was being written.
template <typename Body>
auto with_context(std::string_view context, Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const Error& error) {
    std::string message = fmt::format("{}: {}", context, error.what());
    if (error.kind() == ErrorKind::kInvalidArgument &&
        std::string_view(error.what()).find("FOREIGN KEY") != std::string_view::npos) {
      message += " (the boot or job it refers to is not in the store: write that first)";
    }
    throw Error(error.kind(), std::move(message));
  }
}

BootReceipt read_boot(const Query& row) {
  BootReceipt boot;
  boot.id = row.int64(0);
  boot.started_at = row.text(1);
  boot.version = row.text(2);
  boot.git_revision = row.text(3);
  boot.compiler = row.text(4);
  boot.build_type = row.text(5);
  boot.cuda_runtime = row.text(6);
  boot.cuda_driver = row.text(7);
  boot.nccl = row.text(8);
  boot.cudnn = row.text(9);
  boot.devices = parse_json(row, 10, fmt::format("boots.devices of boot {}", boot.id));
  boot.hostname = row.text(11);
  boot.environment = parse_json(row, 12, fmt::format("boots.environment of boot {}", boot.id));
  boot.status = row.text(13);
  return boot;
}

JobRecord read_job(const Query& row) {
  JobRecord job;
  job.job_id = row.text(0);
  job.boot_id = row.int64(1);
  job.state = row.text(2);
  job.spec = parse_json(row, 3, fmt::format("jobs.spec of job '{}'", job.job_id));
  job.submitted_at = row.text(4);
  job.started_at = row.text(5);
  job.finished_at = row.text(6);
  job.error = row.text(7);
  job.attempts = row.int32(8);
  job.last_checkpoint_step = row.int64(9);
  return job;
}

StepReceipt read_step(const Query& row) {
  StepReceipt step;
  step.job_id = row.text(0);
  step.step = row.int64(1);
  step.attempt = row.int32(2);
  step.loss = row.real(3);
  step.grad_norm = row.real(4);
  step.lr = row.real(5);
  step.tokens = row.int64(6);
  step.step_ms = row.real(7);
  step.tokens_per_s = row.real(8);
  step.flops_per_s = row.real(9);
  step.recorded_at = row.text(10);
  return step;
}

KernelReceipt read_kernel(const Query& row) {
  KernelReceipt kernel;
  kernel.job_id = row.text(0);
  kernel.kernel = row.text(1);
  kernel.device = row.text(2);
  kernel.launch =
      parse_json(row, 3, fmt::format("kernel_receipts.launch of kernel '{}'", kernel.kernel));
  kernel.registers = row.int32(4);
  kernel.static_smem = row.int32(5);
  kernel.dynamic_smem = row.int32(6);
  kernel.occupancy = row.real(7);
  kernel.time_ms_min = row.real(8);
  kernel.time_ms_median = row.real(9);
  kernel.time_ms_max = row.real(10);
  kernel.samples = row.int32(11);
  kernel.recorded_at = row.text(12);
  return kernel;
}

}  // namespace

struct Store::Impl {
  Impl(const std::filesystem::path& path, OpenMode open_mode)
      : connection(path, open_mode == OpenMode::kReadOnly), mode(open_mode) {}

  Connection connection;
  OpenMode mode;
  int version = 0;
  int transaction_depth = 0;

  void require_writable(std::string_view what) const {
    if (mode != OpenMode::kReadWrite) {
      fail(ErrorKind::kFailedPrecondition,
           "receipt store {}: {} needs a read-write store, this one is read-only",
           connection.path().string(), what);
    }
  }

  int read_version() {
    Query query = connection.query("PRAGMA user_version");
    return query.next() ? query.int32(0) : 0;
  }

  void open_read_write(const StoreOptions& options) {
    // WAL: readers work on the last committed snapshot while the writer appends, so listing
    // receipts never stalls training and training never stalls a listing.
    const std::string journal = connection.pragma_text("PRAGMA journal_mode = WAL");
    if (journal != "wal") {
      fail(ErrorKind::kFailedPrecondition,
           "receipt store {}: cannot switch to WAL journal mode (got '{}'); the store needs a "
           "local file system that supports shared memory",
           connection.path().string(), journal);
    }
    // FULL, not WAL's usual NORMAL: with NORMAL a commit returns before the log is fsynced, so a
    // power loss can drop the last transactions even though the daemon was told they committed.
    // A receipt the daemon reported as recorded must survive power loss; batching writes into
    // transactions (BatchedWriter) keeps the cost to one fsync per batch.
    connection.exec("PRAGMA synchronous = FULL");
    connection.exec("PRAGMA foreign_keys = ON");
    migrate(options.migrate_to_version);
  }

  void open_read_only() {
    connection.exec("PRAGMA query_only = ON");
    version = read_version();
    const std::string& name = connection.path().string();
    if (version == 0) {
      fail(ErrorKind::kFailedPrecondition,
           "receipt store {}: not an initialised receipt store (schema version 0); the daemon "
           "creates it when it opens it read-write",
           name);
    }
    refuse_newer(version);
    if (version < latest_schema_version()) {
      fail(ErrorKind::kFailedPrecondition,
           "receipt store {}: schema version {} is older than this build's {}; open it read-write "
           "once (start the daemon) to migrate it",
           name, version, latest_schema_version());
    }
  }

  void refuse_newer(int found) const {
    if (found > latest_schema_version()) {
      fail(ErrorKind::kFailedPrecondition,
           "receipt store {}: schema version {} is newer than the latest this build knows ({}); "
           "it was written by a newer megacpp: use that build, or another store path",
           connection.path().string(), found, latest_schema_version());
    }
  }

  void migrate(int requested) {
    const int target = requested == 0 ? latest_schema_version() : requested;
    if (target < 1 || target > latest_schema_version()) {
      fail(ErrorKind::kInvalidArgument,
           "receipt store {}: migrate_to_version must be in [0, {}], got {}",
           connection.path().string(), latest_schema_version(), requested);
    }
    version = read_version();
    refuse_newer(version);
    for (const Migration& migration : migrations()) {
      if (migration.version <= version || migration.version > target) continue;
      with_context(
          fmt::format("migrating to schema version {} ({})", migration.version, migration.name),
          [&] {
            connection.exec("BEGIN IMMEDIATE");
            try {
              // Another process may have migrated while this one waited for the lock.
              const int current = read_version();
              refuse_newer(current);
              if (current < migration.version) {
                connection.exec(migration.sql);
                // A PRAGMA takes no bound parameters; the value is this build's
                // constant, never outside input.
                connection.exec(fmt::format("PRAGMA user_version = {}", migration.version));
              }
              connection.exec("COMMIT");
            } catch (...) {
              if (connection.in_transaction()) connection.exec("ROLLBACK");
              throw;
            }
          });
      version = read_version();
    }
  }

  // ---- Single-record writes; the caller provides the transaction.

  void write_one(const BootStatusUpdate& update) {
    validate(update);
    connection.query(kUpdateBootStatus).bind(1, update.boot_id).bind(2, update.status).run();
    if (sqlite3_changes(connection.handle()) == 0) {
      fail(ErrorKind::kNotFound, "receipt store {}: no boot with id {} to set status '{}'",
           connection.path().string(), update.boot_id, update.status);
    }
  }

  void write_one(const PreconditionResult& result) {
    validate(result);
    with_context(fmt::format("precondition '{}' of boot {}", result.check, result.boot_id), [&] {
      connection.query(kInsertPrecondition)
          .bind(1, result.boot_id)
          .bind(2, result.check)
          .bind(3, result.status)
          .bind(4, result.detail)
          .bind(5, result.fix)
          .bind(6, stamped(result.checked_at))
          .run();
    });
  }

  void write_one(const JobRecord& job) {
    validate(job);
    with_context(fmt::format("job '{}'", job.job_id), [&] {
      connection.query(kUpsertJob)
          .bind(1, job.job_id)
          .bind(2, job.boot_id)
          .bind(3, job.state)
          .bind(4, json_text(job.spec))
          .bind(5, stamped(job.submitted_at))
          .bind(6, job.started_at)
          .bind(7, job.finished_at)
          .bind(8, job.error)
          .bind(9, job.attempts)
          .bind(10, job.last_checkpoint_step)
          .run();
    });
  }

  void write_one(const GateDecision& decision) {
    validate(decision);
    with_context(fmt::format("gate decision '{}' of job '{}'", decision.gate, decision.job_id),
                 [&] {
                   connection.query(kUpsertGateDecision)
                       .bind(1, decision.job_id)
                       .bind(2, decision.gate)
                       .bind(3, decision.decision)
                       .bind(4, decision.reason)
                       .bind(5, decision.implementation)
                       .bind(6, json_text(decision.stages))
                       .bind(7, stamped(decision.decided_at))
                       .run();
                 });
  }

  void write_one(const StepReceipt& step) {
    validate(step);
    with_context(fmt::format("step receipt {} of job '{}'", step.step, step.job_id), [&] {
      connection.query(kUpsertStep)
          .bind(1, step.job_id)
          .bind(2, step.step)
          .bind(3, step.attempt)
          .bind(4, step.loss)
          .bind(5, step.grad_norm)
          .bind(6, step.lr)
          .bind(7, step.tokens)
          .bind(8, step.step_ms)
          .bind(9, step.tokens_per_s)
          .bind(10, step.flops_per_s)
          .bind(11, stamped(step.recorded_at))
          .run();
    });
  }

  void write_one(const EvalReceipt& eval) {
    validate(eval);
    with_context(fmt::format("eval receipt {} of job '{}'", eval.step, eval.job_id), [&] {
      connection.query(kUpsertEval)
          .bind(1, eval.job_id)
          .bind(2, eval.step)
          .bind(3, eval.val_loss)
          .bind(4, stamped(eval.recorded_at))
          .run();
    });
  }

  void write_one(const KernelReceipt& kernel) {
    validate(kernel);
    with_context(fmt::format("kernel receipt '{}' of job '{}'", kernel.kernel, kernel.job_id), [&] {
      connection.query(kInsertKernel)
          .bind(1, kernel.job_id)
          .bind(2, kernel.kernel)
          .bind(3, kernel.device)
          .bind(4, json_text(kernel.launch))
          .bind(5, kernel.registers)
          .bind(6, kernel.static_smem)
          .bind(7, kernel.dynamic_smem)
          .bind(8, kernel.occupancy)
          .bind(9, kernel.time_ms_min)
          .bind(10, kernel.time_ms_median)
          .bind(11, kernel.time_ms_max)
          .bind(12, kernel.samples)
          .bind(13, stamped(kernel.recorded_at))
          .run();
    });
  }

  void write_one(const RunSummary& summary) {
    validate(summary);
    with_context(fmt::format("run summary of job '{}'", summary.job_id), [&] {
      connection.query(kUpsertRunSummary)
          .bind(1, summary.job_id)
          .bind(2, json_text(summary.summary))
          .bind(3, stamped(summary.recorded_at))
          .run();
    });
  }

  int64_t write_one(const DeleteStepsAfter& deletion) {
    validate(deletion);
    connection.query(kDeleteStepsAfter).bind(1, deletion.job_id).bind(2, deletion.step).run();
    return sqlite3_changes64(connection.handle());
  }

  // Runs `body` in a transaction: BEGIN IMMEDIATE at the outermost level (take the write lock
  // up front rather than fail to upgrade a read lock midway), a savepoint when nested.
  void transaction(const std::function<void()>& body) {
    if (transaction_depth > 0) {
      connection.query("SAVEPOINT nested_write").run();
      ++transaction_depth;
      try {
        body();
      } catch (...) {
        --transaction_depth;
        // ROLLBACK TO leaves the savepoint open; RELEASE closes it.
        connection.query("ROLLBACK TO nested_write").run();
        connection.query("RELEASE nested_write").run();
        throw;
      }
      --transaction_depth;
      connection.query("RELEASE nested_write").run();
      return;
    }
    connection.query("BEGIN IMMEDIATE").run();
    transaction_depth = 1;
    try {
      body();
      connection.query("COMMIT").run();
    } catch (...) {
      transaction_depth = 0;
      // SQLite rolls back by itself after some errors (disk full, I/O); then there is nothing left.
      if (connection.in_transaction()) {
        try {
          connection.query("ROLLBACK").run();
        } catch (const Error&) {  // the original error is the one worth reporting
        }
      }
      throw;
    }
    transaction_depth = 0;
  }

  template <typename Record>
  void write_all(std::span<const Record> records) {
    require_writable("writing receipts");
    transaction([&] {
      for (const Record& record : records) write_one(record);
    });
  }
};

Store::Store(const std::filesystem::path& path, OpenMode mode, const StoreOptions& options) {
  if (mode == OpenMode::kReadOnly) {
    std::error_code error;
    if (!std::filesystem::exists(path, error)) {
      fail(ErrorKind::kNotFound,
           "receipt store {}: no such file; a read-only open never creates the store (the daemon "
           "creates it)",
           path.string());
    }
  }
  impl_ = std::make_unique<Impl>(path, mode);
  impl_->connection.set_busy_timeout(options.busy_timeout);
  if (mode == OpenMode::kReadWrite) {
    impl_->open_read_write(options);
  } else {
    impl_->open_read_only();
  }
}

Store::~Store() = default;
Store::Store(Store&&) noexcept = default;
Store& Store::operator=(Store&&) noexcept = default;

const std::filesystem::path& Store::path() const {
  return impl_->connection.path();
}
OpenMode Store::mode() const {
  return impl_->mode;
}
int Store::schema_version() const {
  return impl_->version;
}

void Store::transaction(const std::function<void()>& body) {
  impl_->require_writable("transaction");
  impl_->transaction(body);
}

int64_t Store::insert_boot(const BootReceipt& boot) {
  impl_->require_writable("insert_boot");
  validate(boot);
  Connection& connection = impl_->connection;
  return with_context("boot receipt", [&] {
    connection.query(kInsertBoot)
        .bind(1, stamped(boot.started_at))
        .bind(2, boot.version)
        .bind(3, boot.git_revision)
        .bind(4, boot.compiler)
        .bind(5, boot.build_type)
        .bind(6, boot.cuda_runtime)
        .bind(7, boot.cuda_driver)
        .bind(8, boot.nccl)
        .bind(9, boot.cudnn)
        .bind(10, json_text(boot.devices))
        .bind(11, boot.hostname)
        .bind(12, json_text(boot.environment))
        .bind(13, boot.status)
        .run();
    return static_cast<int64_t>(sqlite3_last_insert_rowid(connection.handle()));
  });
}

void Store::update_boot_status(int64_t boot_id, std::string_view status) {
  impl_->require_writable("update_boot_status");
  impl_->write_one(BootStatusUpdate{boot_id, std::string(status)});
}

int64_t Store::mark_unfinished_boots_crashed(int64_t current_boot_id) {
  impl_->require_writable("mark_unfinished_boots_crashed");
  Connection& connection = impl_->connection;
  connection.query(kMarkUnfinishedBootsCrashed).bind(1, current_boot_id).run();
  return sqlite3_changes64(connection.handle());
}

void Store::insert_preconditions(std::span<const PreconditionResult> results) {
  impl_->write_all(results);
}

void Store::upsert_job(const JobRecord& job) {
  impl_->require_writable("upsert_job");
  impl_->write_one(job);
}

void Store::insert_gate_decisions(std::span<const GateDecision> decisions) {
  impl_->write_all(decisions);
}

void Store::write_steps(std::span<const StepReceipt> steps) {
  impl_->write_all(steps);
}

int64_t Store::delete_steps_after(std::string_view job_id, int64_t step) {
  impl_->require_writable("delete_steps_after");
  return impl_->write_one(DeleteStepsAfter{std::string(job_id), step});
}

void Store::insert_evals(std::span<const EvalReceipt> evals) {
  impl_->write_all(evals);
}

void Store::insert_kernel_receipts(std::span<const KernelReceipt> kernels) {
  impl_->write_all(kernels);
}

void Store::insert_run_summary(const RunSummary& summary) {
  impl_->require_writable("insert_run_summary");
  impl_->write_one(summary);
}

void Store::write(std::span<const Receipt> receipts) {
  impl_->require_writable("write");
  impl_->transaction([&] {
    for (const Receipt& receipt : receipts) {
      std::visit([&](const auto& record) { impl_->write_one(record); }, receipt);
    }
  });
}

void Store::read_snapshot(const std::function<void()>& body) const {
  Connection& connection = impl_->connection;
  if (connection.in_transaction()) {
    body();
    return;
  }
  connection.query("BEGIN DEFERRED").run();
  try {
    body();
  } catch (...) {
    if (connection.in_transaction()) connection.query("ROLLBACK").run();
    throw;
  }
  connection.query("COMMIT").run();
}

std::vector<BootReceipt> Store::list_boots(int limit, std::optional<int64_t> before_id) const {
  require_limit(limit, "list_boots");
  Query query = impl_->connection.query(kListBoots);
  query.bind(1, before_id.value_or(std::numeric_limits<int64_t>::max())).bind(2, limit);
  std::vector<BootReceipt> boots;
  while (query.next()) boots.push_back(read_boot(query));
  return boots;
}

std::optional<BootReceipt> Store::get_boot(int64_t boot_id) const {
  Query query = impl_->connection.query(kGetBoot);
  query.bind(1, boot_id);
  if (!query.next()) return std::nullopt;
  return read_boot(query);
}

std::vector<PreconditionResult> Store::preconditions(int64_t boot_id) const {
  Query query = impl_->connection.query(kListPreconditions);
  query.bind(1, boot_id);
  std::vector<PreconditionResult> results;
  while (query.next()) {
    results.push_back(PreconditionResult{query.int64(0), query.text(1), query.text(2),
                                         query.text(3), query.text(4), query.text(5)});
  }
  return results;
}

std::optional<JobRecord> Store::get_job(std::string_view job_id) const {
  Query query = impl_->connection.query(kGetJob);
  query.bind(1, job_id);
  if (!query.next()) return std::nullopt;
  return read_job(query);
}

JobPage Store::list_jobs(const JobQuery& request) const {
  require_limit(request.limit, "list_jobs");
  Connection& connection = impl_->connection;
  if (!request.state.empty() && std::find(std::begin(kKnownJobStates), std::end(kKnownJobStates),
                                          request.state) == std::end(kKnownJobStates)) {
    fail(ErrorKind::kInvalidArgument,
         "list_jobs: state filter must be one of queued | running | succeeded | failed | "
         "cancelled | interrupted | refused, got '{}'",
         request.state);
  }
  JobPage page;
  read_snapshot([&] {
    int64_t before_seq = std::numeric_limits<int64_t>::max();
    if (!request.page_token.empty()) {
      Query token = connection.query(kJobSeq);
      token.bind(1, request.page_token);
      if (!token.next()) {
        fail(ErrorKind::kInvalidArgument, "list_jobs: page token '{}' names no job in the store",
             request.page_token);
      }
      before_seq = token.int64(0);
    }
    // One row more than asked tells whether there is a next page.
    Query query = connection.query(request.state.empty() ? kListJobs : kListJobsInState);
    query.bind(1, before_seq).bind(2, static_cast<int64_t>(request.limit) + 1);
    if (!request.state.empty()) query.bind(3, request.state);
    while (query.next()) page.jobs.push_back(read_job(query));
  });
  if (page.jobs.size() > static_cast<size_t>(request.limit)) {
    page.jobs.pop_back();
    page.next_page_token = page.jobs.back().job_id;
  }
  return page;
}

std::vector<GateDecision> Store::gate_decisions(std::string_view job_id) const {
  Query query = impl_->connection.query(kListGateDecisions);
  query.bind(1, job_id);
  std::vector<GateDecision> decisions;
  while (query.next()) {
    GateDecision decision;
    decision.job_id = query.text(0);
    decision.gate = query.text(1);
    decision.decision = query.text(2);
    decision.reason = query.text(3);
    decision.implementation = query.text(4);
    decision.stages =
        parse_json(query, 5, fmt::format("gate_decisions.stages of gate '{}'", decision.gate));
    decision.decided_at = query.text(6);
    decisions.push_back(std::move(decision));
  }
  return decisions;
}

std::vector<StepReceipt> Store::steps(std::string_view job_id, std::optional<int64_t> after_step,
                                      int limit, bool newest_first) const {
  require_limit(limit, "steps");
  Query query = impl_->connection.query(newest_first ? kStepsNewestFirst : kStepsOldestFirst);
  const int64_t cursor = after_step.value_or(newest_first ? std::numeric_limits<int64_t>::max()
                                                          : std::numeric_limits<int64_t>::min());
  query.bind(1, job_id).bind(2, cursor).bind(3, limit);
  std::vector<StepReceipt> steps;
  steps.reserve(static_cast<size_t>(std::min(limit, 4096)));
  while (query.next()) steps.push_back(read_step(query));
  return steps;
}

std::vector<EvalReceipt> Store::evals(std::string_view job_id) const {
  Query query = impl_->connection.query(kListEvals);
  query.bind(1, job_id);
  std::vector<EvalReceipt> evals;
  while (query.next()) {
    evals.push_back(EvalReceipt{query.text(0), query.int64(1), query.real(2), query.text(3)});
  }
  return evals;
}

std::vector<KernelReceipt> Store::kernel_receipts(std::string_view job_id) const {
  Query query = impl_->connection.query(kListKernels);
  query.bind(1, job_id);
  std::vector<KernelReceipt> kernels;
  while (query.next()) kernels.push_back(read_kernel(query));
  return kernels;
}

std::optional<RunSummary> Store::run_summary(std::string_view job_id) const {
  Query query = impl_->connection.query(kGetRunSummary);
  query.bind(1, job_id);
  if (!query.next()) return std::nullopt;
  RunSummary summary;
  summary.job_id = query.text(0);
  summary.summary =
      parse_json(query, 1, fmt::format("run_summaries.summary of job '{}'", summary.job_id));
  summary.recorded_at = query.text(2);
  return summary;
}

StoreCounts Store::counts() const {
  Connection& connection = impl_->connection;
  StoreCounts counts;
  read_snapshot([&] {
    Query query = connection.query(kCounts);
    if (query.next()) {
      counts.boots = query.int64(0);
      counts.preconditions = query.int64(1);
      counts.jobs = query.int64(2);
      counts.gate_decisions = query.int64(3);
      counts.steps = query.int64(4);
      counts.evals = query.int64(5);
      counts.kernel_receipts = query.int64(6);
      counts.run_summaries = query.int64(7);
    }
    Query pages = connection.query("PRAGMA page_count");
    const int64_t page_count = pages.next() ? pages.int64(0) : 0;
    Query size = connection.query("PRAGMA page_size");
    counts.database_bytes = page_count * (size.next() ? size.int64(0) : 0);
  });
  std::error_code error;
  const auto wal_size = std::filesystem::file_size(connection.path().string() + "-wal", error);
  counts.wal_bytes = error ? 0 : static_cast<int64_t>(wal_size);
  return counts;
}

namespace {

std::string collect_lines(Query query) {
  std::string lines;
  while (query.next()) {
    if (!lines.empty()) lines += '\n';
    lines += query.text(0);
  }
  return lines;
}

}  // namespace

std::string Store::quick_check() const {
  return collect_lines(impl_->connection.query("PRAGMA quick_check"));
}

std::string Store::integrity_check() const {
  Connection& connection = impl_->connection;
  std::string report = collect_lines(connection.query("PRAGMA integrity_check"));
  Query foreign = connection.query("PRAGMA foreign_key_check");
  std::string broken;
  while (foreign.next()) {
    if (!broken.empty()) broken += '\n';
    broken += fmt::format("foreign key: a row of {} refers to a missing row of {}", foreign.text(0),
                          foreign.text(2));
  }
  if (broken.empty()) return report;
  return report == "ok" ? broken : report + '\n' + broken;
}

}  // namespace megacpp::receipts
