#include "receipts/schema.h"

#include <array>

namespace megacpp::receipts {
namespace {

// STRICT tables: SQLite refuses a value of the wrong type instead of storing it as it comes.
// Floating-point columns are nullable because SQLite stores NaN as NULL.
// Steps and evals are WITHOUT ROWID tables keyed by (job_id, step): a job's receipts lie together
// in key order, so "the last 1,000 steps of a job" is one backward range scan, and a re-executed
// step replaces its row by key.
constexpr std::string_view kTables = R"sql(
CREATE TABLE boots (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  started_at TEXT NOT NULL,
  version TEXT NOT NULL,
  git_revision TEXT NOT NULL,
  compiler TEXT NOT NULL,
  build_type TEXT NOT NULL,
  cuda_runtime TEXT NOT NULL,
  cuda_driver TEXT NOT NULL,
  nccl TEXT NOT NULL,
  cudnn TEXT NOT NULL,
  devices TEXT NOT NULL,
  hostname TEXT NOT NULL,
  environment TEXT NOT NULL,
  status TEXT NOT NULL
) STRICT;

CREATE TABLE preconditions (
  id INTEGER PRIMARY KEY,
  boot_id INTEGER NOT NULL REFERENCES boots(id),
  check_name TEXT NOT NULL,
  status TEXT NOT NULL,
  detail TEXT NOT NULL,
  fix TEXT NOT NULL,
  checked_at TEXT NOT NULL
) STRICT;

CREATE TABLE jobs (
  seq INTEGER PRIMARY KEY,
  job_id TEXT NOT NULL UNIQUE,
  boot_id INTEGER NOT NULL REFERENCES boots(id),
  state TEXT NOT NULL,
  spec TEXT NOT NULL,
  submitted_at TEXT NOT NULL,
  started_at TEXT NOT NULL,
  finished_at TEXT NOT NULL,
  error TEXT NOT NULL,
  attempts INTEGER NOT NULL,
  last_checkpoint_step INTEGER NOT NULL
) STRICT;

CREATE TABLE gate_decisions (
  job_id TEXT NOT NULL REFERENCES jobs(job_id),
  gate TEXT NOT NULL,
  decision TEXT NOT NULL,
  reason TEXT NOT NULL,
  implementation TEXT NOT NULL,
  stages TEXT NOT NULL,
  decided_at TEXT NOT NULL,
  PRIMARY KEY (job_id, gate)
) STRICT, WITHOUT ROWID;

CREATE TABLE steps (
  job_id TEXT NOT NULL REFERENCES jobs(job_id),
  step INTEGER NOT NULL,
  attempt INTEGER NOT NULL,
  loss REAL,
  grad_norm REAL,
  lr REAL,
  tokens INTEGER NOT NULL,
  step_ms REAL,
  tokens_per_s REAL,
  flops_per_s REAL,
  recorded_at TEXT NOT NULL,
  PRIMARY KEY (job_id, step)
) STRICT, WITHOUT ROWID;

CREATE TABLE evals (
  job_id TEXT NOT NULL REFERENCES jobs(job_id),
  step INTEGER NOT NULL,
  val_loss REAL,
  recorded_at TEXT NOT NULL,
  PRIMARY KEY (job_id, step)
) STRICT, WITHOUT ROWID;

CREATE TABLE kernel_receipts (
  id INTEGER PRIMARY KEY,
  job_id TEXT NOT NULL REFERENCES jobs(job_id),
  kernel TEXT NOT NULL,
  device TEXT NOT NULL,
  launch TEXT NOT NULL,
  registers INTEGER NOT NULL,
  static_smem INTEGER NOT NULL,
  dynamic_smem INTEGER NOT NULL,
  occupancy REAL,
  time_ms_min REAL,
  time_ms_median REAL,
  time_ms_max REAL,
  samples INTEGER NOT NULL,
  recorded_at TEXT NOT NULL
) STRICT;

CREATE TABLE run_summaries (
  job_id TEXT PRIMARY KEY REFERENCES jobs(job_id),
  summary TEXT NOT NULL,
  recorded_at TEXT NOT NULL
) STRICT, WITHOUT ROWID;
)sql";

// The read paths the daemon serves: jobs by state (newest first), a boot's checks, a job's
// kernel receipts, and the foreign-key lookups from jobs to boots.
constexpr std::string_view kReadIndexes = R"sql(
CREATE INDEX jobs_by_state ON jobs(state, seq);
CREATE INDEX jobs_by_boot ON jobs(boot_id);
CREATE INDEX preconditions_by_boot ON preconditions(boot_id, id);
CREATE INDEX kernel_receipts_by_job ON kernel_receipts(job_id, id);
)sql";

constexpr std::array kMigrations = {
    Migration{1, "receipt tables", kTables},
    Migration{2, "indexes for the read paths", kReadIndexes},
};

}  // namespace

std::span<const Migration> migrations() {
  return kMigrations;
}

int latest_schema_version() {
  return kMigrations.back().version;
}

}  // namespace megacpp::receipts
