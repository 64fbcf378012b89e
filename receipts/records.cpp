#include "receipts/records.h"

#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <initializer_list>

#include "base/error.h"

namespace megacpp::receipts {
namespace {

bool same_double(double a, double b) {
  return a == b || (std::isnan(a) && std::isnan(b));
}

void require_one_of(std::string_view record, std::string_view field, const std::string& value,
                    std::initializer_list<std::string_view> allowed) {
  if (std::find(allowed.begin(), allowed.end(), value) != allowed.end()) return;
  std::string names;
  for (std::string_view name : allowed) {
    if (!names.empty()) names += " | ";
    names += name;
  }
  fail(ErrorKind::kInvalidArgument, "{}: field '{}' must be one of {}, got '{}'", record, field,
       names, value);
}

// "checked" ends a --check run; "crashed" is set by the next start on a boot that never reached
// "stopped" or "refused" (see Store::mark_unfinished_boots_crashed).
const std::initializer_list<std::string_view> kBootStatuses = {"starting", "serving", "refused",
                                                               "stopped",  "checked", "crashed"};

void require_non_empty(std::string_view record, std::string_view field, const std::string& value) {
  if (value.empty())
    fail(ErrorKind::kInvalidArgument, "{}: field '{}' must not be empty", record, field);
}

void require_timestamp(std::string_view record, std::string_view field, const std::string& value) {
  if (value.empty() || is_utc_timestamp(value)) return;
  fail(ErrorKind::kInvalidArgument,
       "{}: field '{}' must be an ISO-8601 UTC timestamp like 2026-11-22T09:30:00.123Z, got '{}'",
       record, field, value);
}

void require_non_negative(std::string_view record, std::string_view field, int64_t value) {
  if (value < 0)
    fail(ErrorKind::kInvalidArgument, "{}: field '{}' must be >= 0, got {}", record, field, value);
}

}  // namespace

bool same_receipt(const StepReceipt& a, const StepReceipt& b) {
  return a.job_id == b.job_id && a.step == b.step && a.attempt == b.attempt &&
         same_double(a.loss, b.loss) && same_double(a.grad_norm, b.grad_norm) &&
         same_double(a.lr, b.lr) && a.tokens == b.tokens && same_double(a.step_ms, b.step_ms) &&
         same_double(a.tokens_per_s, b.tokens_per_s) && same_double(a.flops_per_s, b.flops_per_s) &&
         a.recorded_at == b.recorded_at;
}

bool same_receipt(const EvalReceipt& a, const EvalReceipt& b) {
  return a.job_id == b.job_id && a.step == b.step && same_double(a.val_loss, b.val_loss) &&
         a.recorded_at == b.recorded_at;
}

bool same_receipt(const KernelReceipt& a, const KernelReceipt& b) {
  return a.job_id == b.job_id && a.kernel == b.kernel && a.device == b.device &&
         a.launch == b.launch && a.registers == b.registers && a.static_smem == b.static_smem &&
         a.dynamic_smem == b.dynamic_smem && same_double(a.occupancy, b.occupancy) &&
         same_double(a.time_ms_min, b.time_ms_min) &&
         same_double(a.time_ms_median, b.time_ms_median) &&
         same_double(a.time_ms_max, b.time_ms_max) && a.samples == b.samples &&
         a.recorded_at == b.recorded_at;
}

std::string utc_timestamp(std::chrono::system_clock::time_point time) {
  const auto millis =
      std::chrono::duration_cast<std::chrono::milliseconds>(time.time_since_epoch()).count();
  // Floor division, so times before the epoch still get a millisecond field in [0, 999].
  int64_t seconds = millis / 1000;
  int64_t fraction = millis % 1000;
  if (fraction < 0) {
    fraction += 1000;
    seconds -= 1;
  }
  const time_t whole = static_cast<time_t>(seconds);
  struct tm parts {};
  gmtime_r(&whole, &parts);
  return fmt::format("{:04d}-{:02d}-{:02d}T{:02d}:{:02d}:{:02d}.{:03d}Z", parts.tm_year + 1900,
                     parts.tm_mon + 1, parts.tm_mday, parts.tm_hour, parts.tm_min, parts.tm_sec,
                     fraction);
}

std::string utc_now() {
  return utc_timestamp(std::chrono::system_clock::now());
}

bool is_utc_timestamp(std::string_view text) {
  static constexpr std::string_view kPattern = "dddd-dd-ddTdd:dd:dd.dddZ";
  if (text.size() != kPattern.size()) return false;
  for (size_t i = 0; i < text.size(); ++i) {
    const bool digit = std::isdigit(static_cast<unsigned char>(text[i])) != 0;
    if (kPattern[i] == 'd' ? !digit : text[i] != kPattern[i]) return false;
  }
  auto number = [&](size_t at, size_t width) {
    int value = 0;
    for (size_t i = at; i < at + width; ++i) value = value * 10 + (text[i] - '0');
    return value;
  };
  const int month = number(5, 2), day = number(8, 2), hour = number(11, 2), minute = number(14, 2),
            second = number(17, 2);
  // 60 admits a leap second.
  return month >= 1 && month <= 12 && day >= 1 && day <= 31 && hour <= 23 && minute <= 59 &&
         second <= 60;
}

void validate(const BootReceipt& boot) {
  require_timestamp("boot receipt", "started_at", boot.started_at);
  require_one_of("boot receipt", "status", boot.status, kBootStatuses);
}

void validate(const PreconditionResult& result) {
  const std::string record = fmt::format("precondition result '{}'", result.check);
  require_non_empty(record, "check", result.check);
  require_one_of(record, "status", result.status, {"pass", "fail", "skip"});
  require_timestamp(record, "checked_at", result.checked_at);
}

void validate(const JobRecord& job) {
  require_non_empty("job record", "job_id", job.job_id);
  const std::string record = fmt::format("job '{}'", job.job_id);
  require_one_of(
      record, "state", job.state,
      {"queued", "running", "succeeded", "failed", "cancelled", "interrupted", "refused"});
  require_timestamp(record, "submitted_at", job.submitted_at);
  require_timestamp(record, "started_at", job.started_at);
  require_timestamp(record, "finished_at", job.finished_at);
  require_non_negative(record, "attempts", job.attempts);
  if (job.last_checkpoint_step < -1) {
    fail(ErrorKind::kInvalidArgument,
         "{}: field 'last_checkpoint_step' must be >= -1 (-1 = none), got {}", record,
         job.last_checkpoint_step);
  }
}

void validate(const GateDecision& decision) {
  require_non_empty("gate decision", "job_id", decision.job_id);
  require_non_empty("gate decision", "gate", decision.gate);
  const std::string record =
      fmt::format("gate decision '{}' of job '{}'", decision.gate, decision.job_id);
  require_one_of(record, "decision", decision.decision, {"off", "on", "refused"});
  require_one_of(record, "implementation", decision.implementation, {"implemented", "scaffold"});
  require_timestamp(record, "decided_at", decision.decided_at);
}

void validate(const StepReceipt& step) {
  require_non_empty("step receipt", "job_id", step.job_id);
  const std::string record = fmt::format("step receipt {} of job '{}'", step.step, step.job_id);
  require_non_negative(record, "step", step.step);
  require_non_negative(record, "attempt", step.attempt);
  require_non_negative(record, "tokens", step.tokens);
  require_timestamp(record, "recorded_at", step.recorded_at);
}

void validate(const EvalReceipt& eval) {
  require_non_empty("eval receipt", "job_id", eval.job_id);
  const std::string record = fmt::format("eval receipt {} of job '{}'", eval.step, eval.job_id);
  require_non_negative(record, "step", eval.step);
  require_timestamp(record, "recorded_at", eval.recorded_at);
}

void validate(const KernelReceipt& kernel) {
  require_non_empty("kernel receipt", "job_id", kernel.job_id);
  require_non_empty("kernel receipt", "kernel", kernel.kernel);
  const std::string record =
      fmt::format("kernel receipt '{}' of job '{}'", kernel.kernel, kernel.job_id);
  require_non_negative(record, "registers", kernel.registers);
  require_non_negative(record, "static_smem", kernel.static_smem);
  require_non_negative(record, "dynamic_smem", kernel.dynamic_smem);
  require_non_negative(record, "samples", kernel.samples);
  require_timestamp(record, "recorded_at", kernel.recorded_at);
}

void validate(const RunSummary& summary) {
  require_non_empty("run summary", "job_id", summary.job_id);
  require_timestamp(fmt::format("run summary of job '{}'", summary.job_id), "recorded_at",
                    summary.recorded_at);
}

void validate(const BootStatusUpdate& update) {
  require_one_of(fmt::format("status update of boot {}", update.boot_id), "status", update.status,
                 kBootStatuses);
}

void validate(const DeleteStepsAfter& deletion) {
  require_non_empty("step deletion", "job_id", deletion.job_id);
}

void validate(const Receipt& receipt) {
  std::visit([](const auto& record) { validate(record); }, receipt);
}

}  // namespace megacpp::receipts
