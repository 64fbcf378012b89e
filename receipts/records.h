#pragma once
// The rows of the receipt store as plain C++ records. The daemon converts them to and from its
// protobuf messages; the store never sees protobuf. JSON-valued fields are stored as JSON text.
// Timestamps are ISO-8601 UTC with milliseconds ("2026-11-22T09:30:00.123Z"), which sort
// lexically in time order; a required timestamp left empty is stamped with the current time
// when the record is written.
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>

#include <nlohmann/json.hpp>

namespace megacpp::receipts {

// One start of the daemon: the build and the machine it found.
struct BootReceipt {
  int64_t id = 0;  // assigned by the store
  std::string started_at;
  std::string version;
  std::string git_revision;
  std::string compiler;
  std::string build_type;
  std::string cuda_runtime;
  std::string cuda_driver;
  std::string nccl;
  std::string cudnn;  // empty when absent
  nlohmann::json devices;
  std::string hostname;
  nlohmann::json environment;  // the environment variables that affect the runtime
  // "starting" | "serving" | "refused" | "stopped" | "checked" (a --check run: preconditions
  // only) | "crashed" (never stopped: found starting or serving by the next start)
  std::string status;

  bool operator==(const BootReceipt&) const = default;
};

struct PreconditionResult {
  int64_t boot_id = 0;
  std::string check;
  std::string status;  // "pass" | "fail" | "skip"
  std::string detail;
  std::string fix;
  std::string checked_at;

  bool operator==(const PreconditionResult&) const = default;
};

struct JobRecord {
  std::string job_id;
  int64_t boot_id = 0;  // the boot that last ran (or queued) the job
  // "queued" | "running" | "succeeded" | "failed" | "cancelled" | "interrupted" | "refused"
  std::string state;
  nlohmann::json spec;
  std::string submitted_at;
  std::string started_at;   // empty until it runs
  std::string finished_at;  // empty until it ends
  std::string error;
  int attempts = 0;
  int64_t last_checkpoint_step = -1;  // -1: no checkpoint yet

  bool operator==(const JobRecord&) const = default;
};

// One decision per (job, gate); writing a decision again for the same gate replaces it.
struct GateDecision {
  std::string job_id;
  std::string gate;
  std::string decision;  // "off" | "on" | "refused"
  std::string reason;
  std::string implementation;  // "implemented" | "scaffold"
  nlohmann::json stages;
  std::string decided_at;

  bool operator==(const GateDecision&) const = default;
};

// One per (job, step): a resumed job re-executes the steps after its last checkpoint, and the
// re-executed receipt replaces the earlier one. Floating-point fields may be NaN (a diverged
// loss is a receipt too); SQLite stores NaN as NULL, which reads back as NaN.
struct StepReceipt {
  std::string job_id;
  int64_t step = 0;
  int attempt = 0;
  double loss = 0;
  double grad_norm = 0;
  double lr = 0;
  int64_t tokens = 0;
  double step_ms = 0;
  double tokens_per_s = 0;
  double flops_per_s = 0;
  std::string recorded_at;
};

// One per (job, step), replaced like step receipts.
struct EvalReceipt {
  std::string job_id;
  int64_t step = 0;
  double val_loss = 0;
  std::string recorded_at;
};

struct KernelReceipt {
  std::string job_id;
  std::string kernel;
  std::string device;
  nlohmann::json launch;  // grid, block, shapes: whatever identifies the launch
  int registers = 0;
  int static_smem = 0;
  int dynamic_smem = 0;
  double occupancy = 0;
  double time_ms_min = 0;
  double time_ms_median = 0;
  double time_ms_max = 0;
  int samples = 0;
  std::string recorded_at;
};

// One per job; written again, it replaces the previous summary.
struct RunSummary {
  std::string job_id;
  nlohmann::json summary;
  std::string recorded_at;

  bool operator==(const RunSummary&) const = default;
};

// Writes that only make sense in order with the records around them, so they travel through
// the same queue (BatchedWriter) as the records.
struct BootStatusUpdate {
  int64_t boot_id = 0;
  std::string status;
};
struct DeleteStepsAfter {
  std::string job_id;
  int64_t step = 0;  // step receipts with a larger step are deleted
};

// Anything Store::write applies, in order, in one transaction.
using Receipt = std::variant<BootStatusUpdate, PreconditionResult, JobRecord, GateDecision,
                             StepReceipt, EvalReceipt, KernelReceipt, RunSummary, DeleteStepsAfter>;

// Exact equality, except that NaN equals NaN: a stored NaN must round-trip.
bool same_receipt(const StepReceipt& a, const StepReceipt& b);
bool same_receipt(const EvalReceipt& a, const EvalReceipt& b);
bool same_receipt(const KernelReceipt& a, const KernelReceipt& b);

// "2026-11-22T09:30:00.123Z".
std::string utc_timestamp(std::chrono::system_clock::time_point time);
std::string utc_now();
bool is_utc_timestamp(std::string_view text);

// Each throws Error(kInvalidArgument) naming the record, field and bad value when a field
// breaks its rule (an unknown state, an empty key, a malformed timestamp).
void validate(const BootReceipt& boot);
void validate(const PreconditionResult& result);
void validate(const JobRecord& job);
void validate(const GateDecision& decision);
void validate(const StepReceipt& step);
void validate(const EvalReceipt& eval);
void validate(const KernelReceipt& kernel);
void validate(const RunSummary& summary);
void validate(const BootStatusUpdate& update);
void validate(const DeleteStepsAfter& deletion);
void validate(const Receipt& receipt);

}  // namespace megacpp::receipts
