#include "daemon/job_manager.h"

#include <fcntl.h>
#include <google/protobuf/util/json_util.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <system_error>

#include "base/error.h"
#include "daemon/metrics.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/trainer/trainer.h"
#include "service/executor/event_stream.h"
#include "service/gates/gates.h"
#include "service/job_states.h"

namespace megacpp::daemon {

namespace fs = std::filesystem;
namespace v1 = megacpp::v1;
using nlohmann::json;

std::string now_iso8601();  // daemon/boot.cpp

struct ExecutorEventView {
  const v1::ExecutorEvent& event;
};

using Clock = std::chrono::steady_clock;

struct JobManager::Entry {
  v1::Job job;
  json train_job;
  pid_t pid = 0;  // 0 once the executor has exited (before it is reaped: never a reused pid)
  // A several-GPU job's ranks 1..: each rank's executor, 0 once exited (as pid). Rank 0 is
  // `pid`; its monitor ends the job, after every other rank has exited.
  std::vector<pid_t> peer_pids;
  // The daemon killed the job's other ranks after one failed: their deaths are not causes.
  bool ranks_killed = false;
  bool cancel_requested = false;
  bool summary_received = false;
  // finish() is committing the job's end: its outcome is decided, nothing may change it.
  bool finishing = false;
  std::string stop_reason;
  std::string failure_message;
  int64_t last_checkpoint_step = -1;  // -1: none yet
  Clock::time_point attempt_started;
  int64_t attempt_first_step = 1;
  // Supervision of the running attempt.
  Clock::time_point last_progress;           // the executor's last event
  std::optional<Clock::time_point> kill_at;  // SIGTERM was sent: SIGKILL then
  bool killed = false;
  std::string abort_reason;      // why the daemon stopped the executor (watchdog, time limit)
  Clock::time_point not_before;  // restart backoff: not started before then
  // The watchers' history, bounded by limits.job_event_history_bytes. Events keep their job
  // without its spec, which is the bulk of a job and never changes: watch() attaches it.
  struct HistoryEvent {
    v1::JobEvent event;
    size_t bytes = 0;
  };
  std::deque<HistoryEvent> events;
  int64_t first_event_seq = 0;  // sequence number of events.front()
  size_t history_bytes = 0;
  int64_t evicted_through_step = 0;  // no dropped step event had a larger step
  // No dropped eval had a larger step. An eval follows its step's event, so the history may have
  // dropped a step and still hold its eval: a replay from the store stops its evals here.
  int64_t evicted_through_eval = 0;
};

// Where one watch() stream is: in the history, and in what it has sent (which store replays
// continue from).
struct JobManager::WatchCursor {
  int64_t seq = 0;
  int64_t last_step = 0;
  int64_t last_eval_step = 0;
  bool summary_sent = false;

  void sent(const v1::JobEvent& event) {
    if (event.has_step()) {
      (event.step().val_loss() < 0 ? last_step : last_eval_step) = event.step().step();
    }
    if (event.has_summary()) summary_sent = true;
  }
};

namespace {

bool is_terminal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED || s == v1::JOB_STATE_REFUSED;
}

std::string spec_to_json(const v1::JobSpec& spec) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(spec, &out, options);
  return out;
}

std::string tail_lines(const fs::path& file, size_t count) {
  std::ifstream in(file);
  std::deque<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
    if (lines.size() > count) lines.pop_front();
  }
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return fmt::format("executor killed by signal {} ({})", sig, strsignal(sig));
  }
  if (WIFEXITED(status)) return fmt::format("executor exited with code {}", WEXITSTATUS(status));
  return "executor ended abnormally";
}

}  // namespace

JobManager::JobManager(const DaemonConfig& config, receipts::BatchedWriter& writer,
                       const fs::path& store_path, int64_t boot_id, std::vector<DeviceSlot> devices,
                       fs::path executor_path, DaemonMetrics& metrics)
    : config_(config),
      writer_(writer),
      store_path_(store_path),
      boot_id_(boot_id),
      executor_path_(std::move(executor_path)),
      metrics_(metrics),
      devices_(std::move(devices)) {}

JobManager::~JobManager() {
  shutdown();
}

fs::path JobManager::job_dir(const std::string& id) const {
  return config_.state_dir / "jobs" / id;
}

std::string JobManager::new_job_id() {
  return fmt::format("job-{:06d}", ++id_counter_);
}

void JobManager::record_job(const Entry& e) {
  record_job(e.job, e.last_checkpoint_step);
}

void JobManager::record_job(const v1::Job& job, int64_t last_checkpoint_step) {
  receipts::JobRecord r;
  r.job_id = job.id();
  r.boot_id = boot_id_;
  r.state = job_state_name(job.state());
  r.spec = json::parse(spec_to_json(job.spec()));
  r.submitted_at = job.submitted_at();
  r.started_at = job.started_at();
  r.finished_at = job.finished_at();
  r.error = job.error();
  r.attempts = job.attempts();
  r.last_checkpoint_step = last_checkpoint_step;
  writer_.enqueue(r);
}

void JobManager::push_event(Entry& e, v1::JobEvent event) {
  // An ended job keeps no history (free_history): its watchers read the store.
  if (!is_terminal(e.job.state())) {
    // Copy the job without its spec (swapped out and back: no copy of the spec at all).
    v1::JobSpec spec;
    spec.Swap(e.job.mutable_spec());
    *event.mutable_job() = e.job;
    spec.Swap(e.job.mutable_spec());
    const size_t bytes = event.SpaceUsedLong() + sizeof(Entry::HistoryEvent);
    e.history_bytes += bytes;
    e.events.push_back({std::move(event), bytes});
    while (e.history_bytes > config_.limits.job_event_history_bytes && e.events.size() > 1) {
      const auto& front = e.events.front();
      if (front.event.has_step()) {
        int64_t& through =
            front.event.step().val_loss() < 0 ? e.evicted_through_step : e.evicted_through_eval;
        through = std::max(through, front.event.step().step());
      }
      e.history_bytes -= front.bytes;
      e.events.pop_front();
      ++e.first_event_seq;
    }
  }
  changed_.notify_all();
}

void JobManager::free_history(Entry& e) {
  e.first_event_seq += static_cast<int64_t>(e.events.size());
  std::deque<Entry::HistoryEvent>().swap(e.events);  // clear() may keep the blocks
  e.history_bytes = 0;
}

void JobManager::finish(Lock& lock, Entry& e, v1::JobState state, const std::string& error) {
  // The job's end is recorded first and published only once the store has committed it and
  // everything enqueued before it (its step receipts, evals, run summary): the writer commits
  // in enqueue order, so one flush covers them all. mu_ is released meanwhile so that the
  // API and the other jobs do not wait for the disk; `finishing` keeps cancel() off the job.
  e.finishing = true;
  v1::Job ended = e.job;
  ended.set_state(state);
  if (!error.empty()) ended.set_error(error);
  ended.set_finished_at(now_iso8601());
  record_job(ended, e.last_checkpoint_step);
  lock.unlock();
  try {
    writer_.flush(ended.id());
  } catch (const std::exception& failure) {
    // A job must still end; the writer logged each lost receipt.
    spdlog::error("job {}: the receipt store did not commit everything before the job ended: {}",
                  ended.id(), failure.what());
  }
  lock.lock();
  e.finishing = false;
  e.job.set_state(state);
  e.job.set_error(ended.error());
  e.job.set_finished_at(ended.finished_at());
  release_devices(e);
  metrics_.job_ended(e.job.id());
  if (is_terminal(state)) {
    free_history(e);
  } else {
    v1::JobEvent event;
    event.set_state_changed(state);
    push_event(e, std::move(event));
  }
  spdlog::info("job {}: {}{}", e.job.id(), job_state_name(state),
               error.empty() ? "" : ": " + error);
  changed_.notify_all();
}

void JobManager::set_state(Entry& e, v1::JobState state, const std::string& error) {
  e.job.set_state(state);
  if (!error.empty()) e.job.set_error(error);
  if (state == v1::JOB_STATE_RUNNING) e.job.set_started_at(now_iso8601());
  if (is_terminal(state) || state == v1::JOB_STATE_INTERRUPTED)
    e.job.set_finished_at(now_iso8601());
  record_job(e);
  v1::JobEvent event;
  event.set_state_changed(state);
  push_event(e, std::move(event));
  spdlog::info("job {}: {}{}", e.job.id(), job_state_name(state),
               error.empty() ? "" : ": " + error);
}

void JobManager::record_gate_decisions(const std::string& id,
                                       const std::vector<gates::GateDecision>& decisions) {
  for (const auto& d : decisions) {
    receipts::GateDecision g;
    g.job_id = id;
    g.gate = d.gate;
    g.decision = std::string(gates::to_string(d.decision));
    g.reason = d.reason;
    g.implementation = std::string(gates::to_string(d.implementation));
    g.stages = json::array();
    for (const auto& s : d.stages) g.stages.push_back({{"name", s.name}, {"done", s.done}});
    g.decided_at = now_iso8601();
    writer_.enqueue(g);
  }
}

struct JobManager::Submission {
  std::unique_ptr<Entry> entry;
  bool refused = false;
  std::string refusal;
  bool has_directory = false;
};

// Nothing a client can see is uncommitted: a submission's records (the job row and its gate
// decisions, or its refusal) are written and flushed to the store first, and only then does the
// job enter jobs_ (GetJob, ListJobs, /status) and the queue. A submission that fails on the way
// (an unwritable job directory, a full disk, a store that cannot commit) leaves nothing behind
// but, at worst, a gap in the job ids; an accepted job survives a crash right after SubmitJob
// returns.
v1::Job JobManager::submit(const v1::JobSpec& spec) {
  std::lock_guard serial(submit_mu_);
  Submission submission = prepare_submission(spec);
  const std::string id = submission.entry->job.id();
  try {
    // This job's records only: another job's lost receipts are not this submission's failure.
    writer_.flush(id);
  } catch (const std::exception& e) {
    if (submission.has_directory) {
      std::error_code ignored;
      fs::remove_all(job_dir(id), ignored);
    }
    fail(ErrorKind::kIo,
         "job {} was not accepted: the receipt store could not commit it ({}); nothing was "
         "queued",
         id, e.what());
  }
  return publish_submission(std::move(submission));
}

JobManager::Submission JobManager::prepare_submission(const v1::JobSpec& spec) {
  Lock lock(mu_);
  if (!accepting_)
    fail(ErrorKind::kFailedPrecondition, "the daemon is shutting down: not accepting jobs");
  if (static_cast<int>(queue_.size()) >= config_.limits.max_queued_jobs) {
    fail(ErrorKind::kFailedPrecondition,
         "the queue is full (limits.max_queued_jobs={}): retry later",
         config_.limits.max_queued_jobs);
  }
  int cpu_slots = 0, gpus = 0;
  uint64_t smallest_gpu_bytes = 0;
  for (const auto& d : devices_) {
    if (d.kind == "cpu") {
      ++cpu_slots;
    } else {
      ++gpus;
      if (smallest_gpu_bytes == 0 || d.memory_bytes < smallest_gpu_bytes)
        smallest_gpu_bytes = d.memory_bytes;
    }
  }
  const std::string id = new_job_id();
  Submission submission;
  submission.entry = std::make_unique<Entry>();
  Entry& e = *submission.entry;
  ValidatedJob validated;
  try {
    validated = validate_job_spec(spec, config_, cpu_slots, gpus, config_.checkpoint_root / id,
                                  MemoryBudget{0, smallest_gpu_bytes});
    e.job.set_id(id);
    *e.job.mutable_spec() = spec;
    e.job.set_submitted_at(now_iso8601());
    e.job.set_total_steps(spec.steps());
    e.job.set_checkpoint_dir((config_.checkpoint_root / id).string());
    e.train_job = validated.train_job;
    if (spec.threads() == 0 && cpu_slots > 0) {
      // The CPU slots share the cores.
      const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
      e.train_job["threads"] = std::max<long>(1, cores / cpu_slots) * validated.device_count;
    }
    for (const auto& d : validated.gate_decisions) {
      if (d.decision != gates::Decision::kRefused) continue;
      submission.refused = true;
      submission.refusal += (submission.refusal.empty() ? "" : "; ") + d.reason;
    }
    if (!submission.refused) {
      submission.has_directory = true;
      try {
        fs::create_directories(job_dir(id));
      } catch (const fs::filesystem_error& fe) {
        fail(ErrorKind::kIo, "job {} was not accepted: cannot create its directory {}: {}", id,
             job_dir(id).string(), fe.code().message());
      }
      save_json_atomically(job_dir(id) / "job.json", e.train_job);
    }
  } catch (...) {
    // Nothing was recorded under this id: the next submission takes it.
    --id_counter_;
    if (submission.has_directory) {
      std::error_code ignored;
      fs::remove_all(job_dir(id), ignored);
    }
    throw;
  }
  // The job row first: gate decisions refer to it.
  if (submission.refused) {
    set_state(e, v1::JOB_STATE_REFUSED, submission.refusal);
  } else {
    set_state(e, v1::JOB_STATE_QUEUED);
  }
  record_gate_decisions(id, validated.gate_decisions);
  return submission;
}

v1::Job JobManager::publish_submission(Submission submission) {
  Lock lock(mu_);
  Entry& e = *submission.entry;
  const std::string id = e.job.id();
  jobs_[id] = std::move(submission.entry);
  if (submission.refused) {
    fail(ErrorKind::kFailedPrecondition, "job {} refused: {}", id, submission.refusal);
  }
  queue_.push_back(id);
  changed_.notify_all();
  return e.job;
}

std::optional<v1::Job> JobManager::get(const std::string& id) const {
  std::lock_guard lock(mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return std::nullopt;
  return it->second->job;
}

std::vector<v1::Job> JobManager::list(const std::vector<v1::JobState>& states, int limit,
                                      const std::string& after_id, std::string* next_token) const {
  if (limit < 1) fail(ErrorKind::kInvalidArgument, "limit={} must be at least 1", limit);
  std::lock_guard lock(mu_);
  // A token is a job id this daemon handed out; one that names no job (mistyped, or from another
  // daemon) would quietly start the page wherever that name sorts.
  if (!after_id.empty() && !jobs_.contains(after_id)) {
    fail(ErrorKind::kInvalidArgument, "page_token '{}' names no job of this daemon", after_id);
  }
  std::vector<v1::Job> out;
  next_token->clear();
  for (auto it = after_id.empty() ? jobs_.begin() : jobs_.upper_bound(after_id); it != jobs_.end();
       ++it) {
    const auto& job = it->second->job;
    if (!states.empty() && std::find(states.begin(), states.end(), job.state()) == states.end())
      continue;
    if (static_cast<int>(out.size()) == limit) {
      *next_token = out.back().id();
      break;
    }
    out.push_back(job);
  }
  return out;
}

v1::Job JobManager::cancel(const std::string& id) {
  Lock lock(mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) fail(ErrorKind::kNotFound, "no job {}", id);
  Entry& e = *it->second;
  if (is_terminal(e.job.state()) || e.finishing) return e.job;
  e.cancel_requested = true;
  if (e.pid > 0) {
    // The executor checkpoints and exits; monitor() finishes the job. supervise() escalates to
    // SIGKILL if it has not exited within the grace period (stopped, or stuck in a kernel).
    if (!e.kill_at) {
      signal_ranks(e, SIGTERM);
      e.kill_at = Clock::now() + std::chrono::seconds(config_.jobs.cancel_grace_seconds);
      changed_.notify_all();
    }
    return e.job;
  }
  // Running without a pid: the executor has exited and monitor() is about to finish the job,
  // as cancelled now.
  if (e.job.state() == v1::JOB_STATE_RUNNING) return e.job;
  queue_.erase(std::remove(queue_.begin(), queue_.end(), id), queue_.end());
  finish(lock, e, v1::JOB_STATE_CANCELLED);
  return e.job;
}

bool JobManager::acquire_watch_stream() {
  std::lock_guard lock(mu_);
  if (watch_streams_ >= config_.limits.max_watch_streams) return false;
  ++watch_streams_;
  return true;
}

void JobManager::release_watch_stream() {
  std::lock_guard lock(mu_);
  --watch_streams_;
}

bool JobManager::replay_steps(const receipts::Store& store, const v1::Job& job, WatchCursor& cursor,
                              int64_t through_step, int64_t evals_through,
                              const std::function<bool(const v1::JobEvent&)>& send) const {
  const auto evals = store.evals(job.id());
  size_t next_eval = 0;
  double loss = job.loss();
  // As live: an eval follows the step it was run at.
  auto send_evals_through = [&](int64_t step) {
    step = std::min(step, evals_through);
    for (; next_eval < evals.size() && evals[next_eval].step <= step; ++next_eval) {
      const auto& r = evals[next_eval];
      if (r.step <= cursor.last_eval_step) continue;
      v1::JobEvent event;
      *event.mutable_job() = job;
      auto* p = event.mutable_step();
      p->set_step(r.step);
      p->set_total_steps(job.total_steps());
      p->set_loss(loss);
      p->set_val_loss(r.val_loss);
      if (!send(event)) return false;
      cursor.sent(event);
    }
    return true;
  };
  constexpr int kPage = 1000;
  while (true) {
    const auto page = store.steps(
        job.id(), cursor.last_step > 0 ? std::optional<int64_t>(cursor.last_step) : std::nullopt,
        kPage, /*newest_first=*/false);
    for (const auto& r : page) {
      if (r.step > through_step) return send_evals_through(through_step);
      if (!send_evals_through(r.step - 1)) return false;
      v1::JobEvent event;
      *event.mutable_job() = job;
      event.mutable_job()->set_step(r.step);
      event.mutable_job()->set_loss(r.loss);
      event.mutable_job()->set_tokens_per_s(r.tokens_per_s);
      auto* p = event.mutable_step();
      p->set_step(r.step);
      p->set_total_steps(job.total_steps());
      p->set_loss(r.loss);
      p->set_tokens_per_s(r.tokens_per_s);
      p->set_step_ms(r.step_ms);
      p->set_val_loss(-1);
      if (!send(event)) return false;
      cursor.sent(event);
      loss = r.loss;
    }
    if (static_cast<int>(page.size()) < kPage) return send_evals_through(through_step);
  }
}

void JobManager::watch(const std::string& id, const std::function<bool(const v1::JobEvent&)>& send,
                       const std::function<bool()>& cancelled) {
  WatchCursor cursor;
  std::unique_ptr<receipts::Store> store;  // opened when the history falls short
  auto open_store = [&]() -> const receipts::Store& {
    if (!store)
      store = std::make_unique<receipts::Store>(store_path_, receipts::OpenMode::kReadOnly);
    return *store;
  };
  Lock lock(mu_);
  while (true) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) fail(ErrorKind::kNotFound, "no job {}", id);
    Entry& e = *it->second;
    if (is_terminal(e.job.state())) {
      // Its history is gone, and everything recorded for it is committed (finish()): the rest
      // of the stream is in the store.
      const v1::Job job = e.job;
      lock.unlock();
      const auto& receipts = open_store();
      if (!replay_steps(receipts, job, cursor, INT64_MAX, INT64_MAX, send)) return;
      if (!cursor.summary_sent) {
        if (auto summary = receipts.run_summary(job.id())) {
          v1::JobEvent event;
          *event.mutable_job() = job;
          event.mutable_summary()->set_summary_json(summary->summary.dump());
          if (!send(event)) return;
        }
      }
      v1::JobEvent event;
      *event.mutable_job() = job;
      event.set_state_changed(job.state());
      send(event);
      return;
    }
    if (cursor.seq < e.first_event_seq) {
      // The history dropped events this stream had not sent. Their receipts were enqueued when
      // they were pushed: once flushed, the store has every step up to evicted_through_step.
      const int64_t through = e.evicted_through_step;
      const int64_t evals_through = e.evicted_through_eval;
      const int64_t resume = e.first_event_seq;
      const v1::Job job = e.job;
      lock.unlock();
      spdlog::debug(
          "watch {}: the history dropped events {}..{} before they were sent: steps "
          "through {} come from the store",
          id, cursor.seq, resume - 1, through);
      // The store up to date for the replay; lost receipts are the job's to report at its end.
      writer_.wait_committed();
      // Evals only as far as the history dropped them: one it still holds (the eval of the
      // last dropped step) comes from it, and sent from the store as well it came twice.
      if (!replay_steps(open_store(), job, cursor, through, evals_through, send)) return;
      cursor.seq = resume;
      lock.lock();
      continue;
    }
    const int64_t end = e.first_event_seq + static_cast<int64_t>(e.events.size());
    if (cursor.seq >= end) {
      if (stopping_ && e.job.state() != v1::JOB_STATE_RUNNING) return;  // interrupted
      if (cancelled()) return;
      changed_.wait_for(lock, std::chrono::milliseconds(500));
      continue;
    }
    std::vector<v1::JobEvent> batch;
    batch.reserve(static_cast<size_t>(end - cursor.seq));
    for (; cursor.seq < end; ++cursor.seq) {
      batch.push_back(e.events[static_cast<size_t>(cursor.seq - e.first_event_seq)].event);
      *batch.back().mutable_job()->mutable_spec() = e.job.spec();
    }
    lock.unlock();
    for (const auto& event : batch) {
      if (!send(event)) return;
      cursor.sent(event);
    }
    if (cancelled()) return;
    lock.lock();
  }
}

ManagerSnapshot JobManager::snapshot() const {
  std::lock_guard lock(mu_);
  ManagerSnapshot s;
  s.devices = devices_;
  for (const auto& [id, e] : jobs_) {
    s.jobs_by_state[job_state_name(e->job.state())]++;
    if (e->job.state() == v1::JOB_STATE_RUNNING) s.running.push_back(e->job);
  }
  for (const auto& id : queue_) s.queued.push_back(jobs_.at(id)->job);
  return s;
}

void JobManager::recover() {
  std::lock_guard lock(mu_);
  if (!fs::exists(store_path_)) return;
  receipts::Store store(store_path_, receipts::OpenMode::kReadOnly);
  std::vector<receipts::JobRecord> records;
  receipts::JobQuery query;
  query.limit = 1000;
  do {
    auto page = store.list_jobs(query);
    records.insert(records.end(), page.jobs.begin(), page.jobs.end());
    query.page_token = page.next_page_token;
  } while (!query.page_token.empty());
  for (const auto& r : records) {
    auto entry = std::make_unique<Entry>();
    Entry& e = *entry;
    v1::JobSpec spec;
    (void)google::protobuf::util::JsonStringToMessage(r.spec.dump(), &spec);
    e.job.set_id(r.job_id);
    *e.job.mutable_spec() = spec;
    e.job.set_state(find_job_state(r.state).value_or(v1::JOB_STATE_UNSPECIFIED));
    e.job.set_submitted_at(r.submitted_at);
    e.job.set_started_at(r.started_at);
    e.job.set_finished_at(r.finished_at);
    e.job.set_error(r.error);
    e.job.set_attempts(r.attempts);
    e.job.set_total_steps(spec.steps());
    e.job.set_step(std::max<int64_t>(0, r.last_checkpoint_step));
    e.job.set_checkpoint_dir((config_.checkpoint_root / r.job_id).string());
    e.last_checkpoint_step = r.last_checkpoint_step;
    if (r.job_id.rfind("job-", 0) == 0) {
      id_counter_ = std::max<int64_t>(id_counter_, std::strtoll(r.job_id.c_str() + 4, nullptr, 10));
    }
    const auto state = e.job.state();
    if (state == v1::JOB_STATE_RUNNING || state == v1::JOB_STATE_QUEUED ||
        state == v1::JOB_STATE_INTERRUPTED) {
      try {
        e.train_job = load_json_file(job_dir(r.job_id) / "job.json");
      } catch (const Error& err) {
        set_state(e, v1::JOB_STATE_FAILED, std::string("cannot resume: ") + err.what());
        jobs_[r.job_id] = std::move(entry);
        continue;
      }
      if (state == v1::JOB_STATE_RUNNING) {
        set_state(e, v1::JOB_STATE_INTERRUPTED, "the daemon stopped while the job was running");
      }
      const auto policy = spec.restart_policy();
      const bool resume = state == v1::JOB_STATE_QUEUED ||
                          policy == v1::RESTART_POLICY_ON_INTERRUPT ||
                          policy == v1::RESTART_POLICY_ON_FAILURE;
      if (resume) {
        rewind_to_recorded_checkpoint(store, r.job_id);
        e.job.clear_error();
        set_state(e, v1::JOB_STATE_QUEUED);
        queue_.push_back(r.job_id);
      }
    }
    jobs_[r.job_id] = std::move(entry);
  }
}

void JobManager::rewind_to_recorded_checkpoint(const receipts::Store& store,
                                               const std::string& id) {
  // Step receipts are committed in order, so the newest recorded step m bounds
  // what is durable. A checkpoint newer than m (written while the daemon died)
  // would skip the unrecorded steps: resume from the newest one at or below m.
  const auto newest = store.steps(id, std::nullopt, 1, /*newest_first=*/true);
  const int64_t recorded = newest.empty() ? 0 : newest.front().step;
  const fs::path run_dir = config_.checkpoint_root / id;
  int64_t best = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(run_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step-", 0) != 0 || !fs::exists(entry.path() / "trainer_state.json")) continue;
    const int64_t step = std::strtoll(name.c_str() + 5, nullptr, 10);
    if (step <= recorded) best = std::max(best, step);
  }
  if (best > 0) {
    mark_latest_checkpoint(run_dir, best);
  } else {
    fs::remove(run_dir / "latest", ec);  // nothing durable to resume from: start over
  }
  spdlog::info("job {}: {} steps recorded; resuming from {}", id, recorded,
               best > 0 ? "checkpoint step " + std::to_string(best) : std::string("the start"));
}

void JobManager::start() {
  scheduler_ = std::thread([this] { scheduler_loop(); });
}

void JobManager::scheduler_loop() {
  // Executors are forked from this thread on purpose: PR_SET_PDEATHSIG fires when
  // the forking *thread* exits, and this one lives as long as the daemon serves.
  Lock lock(mu_);
  while (!stopping_) {
    const auto now = Clock::now();
    auto next = supervise(now);
    for (auto it = monitors_.begin(); it != monitors_.end();) {
      if (!it->done) {
        ++it;
        continue;
      }
      it->thread.join();  // it has released mu_ and only returns
      it = monitors_.erase(it);
    }
    // spawn() may release the lock (a job that cannot start is finished): walk a copy.
    const std::vector<std::string> waiting(queue_.begin(), queue_.end());
    for (const auto& id : waiting) {
      if (stopping_) break;
      const auto it = std::find(queue_.begin(), queue_.end(), id);
      if (it == queue_.end()) continue;
      Entry& e = *jobs_.at(id);
      if (e.not_before > now) {
        next = std::min(next, e.not_before);
        continue;
      }
      if (!claim_devices(e)) continue;
      queue_.erase(it);
      spawn(lock, e);
    }
    changed_.wait_until(lock, next);
  }
}

Clock::time_point JobManager::supervise(Clock::time_point now) {
  auto next = now + std::chrono::seconds(1);
  const auto& limits = config_.jobs;
  for (auto& [id, entry] : jobs_) {
    Entry& e = *entry;
    if (e.pid <= 0) continue;
    if (e.kill_at) {
      if (now < *e.kill_at) {
        next = std::min(next, *e.kill_at);
      } else if (!e.killed) {
        spdlog::warn("job {}: the executor (pid {}) did not exit within {} s of SIGTERM: SIGKILL",
                     id, e.pid, limits.cancel_grace_seconds);
        signal_ranks(e, SIGKILL);  // also ends a stopped (SIGSTOP) process
        e.killed = true;
      }
      continue;
    }
    if (limits.progress_timeout_seconds > 0) {
      const auto deadline = e.last_progress + std::chrono::seconds(limits.progress_timeout_seconds);
      if (now >= deadline) {
        stop_executor(
            e, fmt::format(
                   "no progress: the executor sent no event for {} s "
                   "(jobs.progress_timeout_seconds={}); it is stopped, "
                   "deadlocked or stuck in a kernel",
                   std::chrono::duration_cast<std::chrono::seconds>(now - e.last_progress).count(),
                   limits.progress_timeout_seconds));
        continue;
      }
      next = std::min(next, deadline);
    }
    const double max_seconds = e.job.spec().max_seconds();
    // Beyond ~30 years the deadline would overflow the clock: no limit in practice.
    if (max_seconds > 0 && max_seconds < 1e9) {
      const auto deadline =
          e.attempt_started +
          std::chrono::duration_cast<Clock::duration>(
              std::chrono::duration<double>(max_seconds + limits.time_limit_grace_seconds));
      if (now >= deadline) {
        stop_executor(e, fmt::format("time limit: still running {:.0f} s after it started, past "
                                     "spec.max_seconds={} plus jobs.time_limit_grace_seconds={}",
                                     std::chrono::duration<double>(now - e.attempt_started).count(),
                                     max_seconds, limits.time_limit_grace_seconds));
        continue;
      }
      next = std::min(next, deadline);
    }
  }
  return next;
}

void JobManager::stop_executor(Entry& e, const std::string& reason) {
  spdlog::warn("job {}: {}: stopping its executor (pid {})", e.job.id(), reason, e.pid);
  e.abort_reason = reason;
  signal_ranks(e, SIGTERM);
  e.kill_at = Clock::now() + std::chrono::seconds(config_.jobs.cancel_grace_seconds);
}

bool JobManager::claim_devices(Entry& e) {
  int gpus = 0, running = 0;
  for (const auto& d : devices_) gpus += d.kind == "cuda" ? 1 : 0;
  for (const auto& [id, other] : jobs_) running += other->pid > 0 ? 1 : 0;
  if (running >= config_.max_concurrent_jobs_for(gpus)) return false;
  const std::string kind = e.job.spec().device_kind().empty() ? "cpu" : e.job.spec().device_kind();
  const int needed = std::max(1, e.job.spec().device_count());
  std::vector<DeviceSlot*> free;
  for (auto& d : devices_) {
    if (d.kind == kind && d.held_by.empty()) free.push_back(&d);
  }
  if (static_cast<int>(free.size()) < needed) return false;
  e.job.clear_devices();
  for (int i = 0; i < needed; ++i) {
    free[static_cast<size_t>(i)]->held_by = e.job.id();
    e.job.add_devices(free[static_cast<size_t>(i)]->id);
  }
  return true;
}

pid_t JobManager::fork_executor(const Entry& e, int rank, int events_fd) {
  const fs::path dir = job_dir(e.job.id());
  const std::string job_file = (dir / "job.json").string();
  const std::string log_file =
      (dir / (rank == 0 ? std::string("executor.log") : fmt::format("executor.rank{}.log", rank)))
          .string();
  const std::string executor = executor_path_.string();
  const std::string rank_text = std::to_string(rank);
  const std::string rendezvous = (dir / "nccl_id").string();
  const std::string collective_timeout = std::to_string(config_.jobs.collective_timeout_seconds);
  const bool several = !e.peer_pids.empty();
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec. The daemon blocks its stop
    // signals for sigwait(); the executor must receive them. Its handler (which forwards them
    // to the daemon's main thread) goes first: one arriving before exec would otherwise be sent
    // to a thread of the daemon's that this process does not have, and be lost.
    struct sigaction default_action = {};
    default_action.sa_handler = SIG_DFL;
    sigemptyset(&default_action.sa_mask);
    ::sigaction(SIGTERM, &default_action, nullptr);
    ::sigaction(SIGINT, &default_action, nullptr);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::dup2(events_fd, 3);
    const int log = ::open(log_file.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (log >= 0) {
      ::dup2(log, 1);
      ::dup2(log, 2);
    }
    // The executor inherits stdin/out/err and its event pipe, nothing else: sockets the daemon
    // accepted (HTTP connections, gRPC streams) and its lock files must not outlive it there.
    ::close_range(4, ~0U, 0);
    const char* single[] = {executor.c_str(), "--job", job_file.c_str(),
                            "--events-fd",    "3",     nullptr};
    const char* ranked[] = {executor.c_str(),
                            "--job",
                            job_file.c_str(),
                            "--events-fd",
                            "3",
                            "--rank",
                            rank_text.c_str(),
                            "--rendezvous",
                            rendezvous.c_str(),
                            "--collective-timeout",
                            collective_timeout.c_str(),
                            nullptr};
    ::execv(executor.c_str(), const_cast<char* const*>(several ? ranked : single));
    ::_exit(127);
  }
  return pid;
}

void JobManager::spawn(Lock& lock, Entry& e) {
  const fs::path dir = job_dir(e.job.id());
  // A cuda job runs on the GPUs it claimed: the slot "cuda:N" is device ordinal N; rank r of a
  // several-GPU job on its r-th slot.
  const int ranks = e.job.devices_size() > 1 && e.job.devices(0).rfind("cuda:", 0) == 0
                        ? e.job.devices_size()
                        : 1;
  try {
    fs::create_directories(dir);
    if (e.job.devices_size() > 0 && e.job.devices(0).rfind("cuda:", 0) == 0) {
      e.train_job["gpu"] = std::stoi(e.job.devices(0).substr(5));
      if (ranks > 1) {
        json gpus = json::array();
        for (const std::string& d : e.job.devices()) gpus.push_back(std::stoi(d.substr(5)));
        e.train_job["gpus"] = gpus;
      }
    }
    save_json_atomically(dir / "job.json", e.train_job);
  } catch (const std::exception& error) {
    // This thread schedules every job: a job that cannot start (a full disk under state_dir)
    // fails, and the daemon and the other jobs go on.
    finish(lock, e, v1::JOB_STATE_FAILED,
           fmt::format("cannot write the job's files in {}: {}", dir.string(), error.what()));
    return;
  }
  // Rank 0 writes a fresh NCCL id there; an old attempt's must not be read by the others.
  std::error_code ignored;
  fs::remove(dir / "nccl_id", ignored);
  std::vector<std::array<int, 2>> pipes(static_cast<size_t>(ranks));
  for (size_t r = 0; r < pipes.size(); ++r) {
    if (::pipe2(pipes[r].data(), O_CLOEXEC) != 0) {
      const int error = errno;
      for (size_t k = 0; k < r; ++k) {
        ::close(pipes[k][0]);
        ::close(pipes[k][1]);
      }
      finish(lock, e, v1::JOB_STATE_FAILED,
             fmt::format("cannot create the executor pipe: {}", std::strerror(error)));
      return;
    }
  }
  e.peer_pids.assign(static_cast<size_t>(ranks - 1), 0);
  e.ranks_killed = false;
  std::vector<pid_t> pids;
  int fork_error = 0;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = fork_executor(e, r, pipes[static_cast<size_t>(r)][1]);
    ::close(pipes[static_cast<size_t>(r)][1]);
    if (pid < 0) {
      fork_error = errno;
      for (int k = r; k < ranks; ++k) {
        ::close(pipes[static_cast<size_t>(k)][0]);
        if (k > r) ::close(pipes[static_cast<size_t>(k)][1]);
      }
      break;
    }
    pids.push_back(pid);
  }
  if (pids.empty()) {
    e.peer_pids.clear();
    finish(lock, e, v1::JOB_STATE_FAILED,
           fmt::format("cannot start the executor: {}", std::strerror(fork_error)));
    return;
  }
  e.pid = pids[0];
  for (size_t r = 1; r < pids.size(); ++r) e.peer_pids[r - 1] = pids[r];
  e.summary_received = false;
  e.stop_reason.clear();
  e.failure_message.clear();
  e.kill_at.reset();
  e.killed = false;
  e.abort_reason.clear();
  e.job.set_attempts(e.job.attempts() + 1);
  e.job.clear_error();
  e.attempt_started = Clock::now();
  e.last_progress = e.attempt_started;
  set_state(e, v1::JOB_STATE_RUNNING);
  if (static_cast<int>(pids.size()) < ranks) {
    // Without all its ranks the job cannot run: the started ones would wait for the others.
    e.abort_reason = fmt::format("cannot start rank {} of {}: {}", pids.size(), ranks,
                                 std::strerror(fork_error));
    signal_ranks(e, SIGKILL);
  }
  // A thread a rank reads its events and reaps it. Where one cannot be started (the process is
  // out of threads), the ranks left without one are killed and reaped here, so that no executor
  // runs unwatched and the job still ends: through rank 0's monitor when it has one, else here.
  for (size_t r = 0; r < pids.size(); ++r) {
    Monitor& slot = monitors_.emplace_back();
    const auto mark_done = [this, &slot] {
      std::lock_guard done_lock(mu_);
      slot.done = true;
      changed_.notify_all();
    };
    try {
      if (r == 0) {
        slot.thread =
            std::thread([this, mark_done, id = e.job.id(), pid = pids[0], fd = pipes[0][0]] {
              monitor(id, pid, fd);
              mark_done();
            });
      } else {
        slot.thread = std::thread([this, mark_done, id = e.job.id(), rank = static_cast<int>(r),
                                   pid = pids[r], fd = pipes[r][0]] {
          monitor_peer(id, rank, pid, fd);
          mark_done();
        });
      }
    } catch (const std::system_error& error) {
      monitors_.pop_back();
      const std::string reason =
          fmt::format("cannot start a thread to watch rank {}'s executor: {}", r, error.what());
      if (e.abort_reason.empty()) e.abort_reason = reason;
      signal_ranks(e, SIGKILL);
      // Reaped without mu_ (a killed rank can take a while to go); the pids stay in the entry,
      // unreaped and so never reused, until the lock is back.
      lock.unlock();
      for (size_t k = r; k < pids.size(); ++k) {
        while (::waitpid(pids[k], nullptr, 0) < 0 && errno == EINTR) {
        }
        ::close(pipes[k][0]);
      }
      lock.lock();
      for (size_t k = std::max<size_t>(r, 1); k < pids.size(); ++k) e.peer_pids[k - 1] = 0;
      if (r == 0) {
        e.pid = 0;
        finish(lock, e, v1::JOB_STATE_FAILED, reason);
      } else {
        changed_.notify_all();  // rank 0's monitor waits for its peers to be gone
      }
      return;
    }
  }
}

void JobManager::signal_ranks(Entry& e, int signal) {
  if (e.pid > 0) ::kill(e.pid, signal);
  for (pid_t peer : e.peer_pids) {
    if (peer > 0) ::kill(peer, signal);
  }
}

void JobManager::release_devices(Entry& e) {
  for (auto& d : devices_) {
    if (d.held_by == e.job.id()) d.held_by.clear();
  }
}

void JobManager::handle_event(Entry& e, const ExecutorEventView& view) {
  const v1::ExecutorEvent& ev = view.event;
  switch (ev.event_case()) {
    case v1::ExecutorEvent::kStarted:
      e.attempt_first_step = ev.started().first_step();
      e.job.set_total_steps(ev.started().total_steps());
      break;
    case v1::ExecutorEvent::kStep: {
      const auto& s = ev.step();
      receipts::StepReceipt r;
      r.job_id = e.job.id();
      r.step = s.step();
      r.attempt = e.job.attempts();
      r.loss = s.loss();
      r.grad_norm = s.grad_norm();
      r.lr = s.lr();
      r.tokens = s.tokens();
      r.step_ms = s.step_ms();
      r.tokens_per_s = s.tokens_per_s();
      r.flops_per_s = s.flops_per_s();
      r.recorded_at = now_iso8601();
      writer_.enqueue(r);
      metrics_.observe_step(e.job.id(), s.step_ms() / 1000.0);
      e.job.set_step(s.step());
      e.job.set_loss(s.loss());
      e.job.set_tokens_per_s(s.tokens_per_s());
      v1::JobEvent event;
      auto* p = event.mutable_step();
      p->set_step(s.step());
      p->set_total_steps(e.job.total_steps());
      p->set_loss(s.loss());
      p->set_tokens_per_s(s.tokens_per_s());
      p->set_step_ms(s.step_ms());
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - e.attempt_started)
              .count();
      const double done = static_cast<double>(s.step() - e.attempt_first_step + 1);
      p->set_eta_seconds(
          done > 0 ? elapsed / done * static_cast<double>(e.job.total_steps() - s.step()) : 0);
      p->set_val_loss(-1);
      push_event(e, std::move(event));
      break;
    }
    case v1::ExecutorEvent::kEval: {
      receipts::EvalReceipt r{e.job.id(), ev.eval().step(), ev.eval().val_loss(), now_iso8601()};
      writer_.enqueue(r);
      v1::JobEvent event;
      auto* p = event.mutable_step();
      p->set_step(ev.eval().step());
      p->set_total_steps(e.job.total_steps());
      p->set_loss(e.job.loss());
      p->set_val_loss(ev.eval().val_loss());
      push_event(e, std::move(event));
      break;
    }
    case v1::ExecutorEvent::kCheckpoint:
      e.last_checkpoint_step = ev.checkpoint().step();
      record_job(e);
      break;
    case v1::ExecutorEvent::kSummaryJson: {
      e.summary_received = true;
      json summary = json::parse(ev.summary_json(), nullptr, false);
      e.stop_reason = summary.is_object() ? summary.value("stop_reason", "") : "";
      receipts::RunSummary r{e.job.id(), summary, now_iso8601()};
      writer_.enqueue(r);
      v1::JobEvent event;
      event.mutable_summary()->set_summary_json(ev.summary_json());
      push_event(e, std::move(event));
      break;
    }
    case v1::ExecutorEvent::kKernel: {
      const auto& k = ev.kernel();
      receipts::KernelReceipt r;
      r.job_id = e.job.id();
      r.kernel = k.kernel();
      r.device = k.device();
      r.launch = json::parse(k.launch_json(), nullptr, false);
      r.registers = k.registers();
      r.static_smem = k.static_smem();
      r.dynamic_smem = k.dynamic_smem();
      r.occupancy = k.occupancy();
      r.time_ms_min = k.time_ms_min();
      r.time_ms_median = k.time_ms_median();
      r.time_ms_max = k.time_ms_max();
      r.samples = k.samples();
      r.recorded_at = now_iso8601();
      writer_.enqueue(r);
      break;
    }
    case v1::ExecutorEvent::kLogLine: {
      v1::JobEvent event;
      event.set_log_line(ev.log_line());
      push_event(e, std::move(event));
      break;
    }
    case v1::ExecutorEvent::kFailed:
      e.failure_message = ev.failed();
      break;
    default:
      break;
  }
}

void JobManager::monitor(std::string id, pid_t pid, int events_fd) {
  executor::EventReader reader(events_fd);
  while (auto event = reader.next()) {
    std::lock_guard lock(mu_);
    Entry& e = *jobs_.at(id);
    e.last_progress = Clock::now();
    handle_event(e, ExecutorEventView{*event});
  }
  ::close(events_fd);
  // Wait for the exit without reaping, and clear the pid before reaping: supervise(), cancel()
  // and shutdown() signal e.pid, which must never name a reaped (reusable) pid.
  siginfo_t info{};
  while (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT) < 0 && errno == EINTR) {
  }
  {
    Lock lock(mu_);
    Entry& e = *jobs_.at(id);
    // The job ends (and its GPUs are free) only when every rank has exited. After rank 0 failed
    // the others cannot finish a collective without it: killed at once; after a clean exit they
    // get the cancel grace to finish theirs.
    const bool rank0_clean = info.si_code == CLD_EXITED && info.si_status == 0;
    auto deadline = Clock::now() + std::chrono::seconds(config_.jobs.cancel_grace_seconds);
    if (!rank0_clean) {
      deadline = Clock::now();
      e.ranks_killed = true;
    }
    bool peers_killed = false;
    const auto peers_running = [&] {
      return std::any_of(e.peer_pids.begin(), e.peer_pids.end(), [](pid_t p) { return p > 0; });
    };
    while (peers_running()) {
      if (!peers_killed && Clock::now() >= deadline) {
        for (pid_t peer : e.peer_pids) {
          if (peer > 0) ::kill(peer, SIGKILL);
        }
        peers_killed = true;
      }
      changed_.wait_for(lock, std::chrono::milliseconds(50));
    }
    e.pid = 0;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  Lock lock(mu_);
  Entry& e = *jobs_.at(id);
  e.kill_at.reset();
  const bool clean_exit = WIFEXITED(status) && WEXITSTATUS(status) == 0 && e.summary_received;
  const std::string killed =
      e.killed ? fmt::format(
                     " (it did not exit within jobs.cancel_grace_seconds={} of SIGTERM "
                     "and was killed)",
                     config_.jobs.cancel_grace_seconds)
               : "";
  if (clean_exit && (e.stop_reason == "completed" || e.stop_reason == "time_limit")) {
    finish(lock, e, v1::JOB_STATE_SUCCEEDED);
  } else if (e.cancel_requested) {
    finish(lock, e, v1::JOB_STATE_CANCELLED, e.killed ? "cancelled" + killed : "");
  } else if (!e.abort_reason.empty()) {
    fail_attempt(lock, e,
                 e.abort_reason + killed + "\nlast executor log lines:\n" +
                     tail_lines(job_dir(id) / "executor.log", 15));
  } else if (stopping_ || (clean_exit && e.stop_reason == "stopped")) {
    finish(lock, e, v1::JOB_STATE_INTERRUPTED,
           "stopped with the daemon; resumes at its next start");
  } else {
    std::string cause = describe_exit(status);
    if (!e.peer_pids.empty()) {
      cause = fmt::format("rank 0 of {} (pid {}, {}) {}", e.peer_pids.size() + 1, pid,
                          e.job.devices_size() > 0 ? e.job.devices(0) : "?", cause);
    }
    if (!e.failure_message.empty()) cause += ": " + e.failure_message;
    cause += "\nlast executor log lines:\n" + tail_lines(job_dir(id) / "executor.log", 15);
    fail_attempt(lock, e, cause);
  }
  changed_.notify_all();
}

void JobManager::monitor_peer(std::string id, int rank, pid_t pid, int events_fd) {
  executor::EventReader reader(events_fd);
  while (auto event = reader.next()) {
    std::lock_guard lock(mu_);
    Entry& e = *jobs_.at(id);
    // Rank 0 reports the job's steps, evals, checkpoints and summary; every rank its kernels.
    if (event->event_case() == v1::ExecutorEvent::kKernel) {
      handle_event(e, ExecutorEventView{*event});
    } else if (event->event_case() == v1::ExecutorEvent::kFailed && e.failure_message.empty()) {
      e.failure_message = fmt::format("rank {}: {}", rank, event->failed());
    }
  }
  ::close(events_fd);
  siginfo_t info{};
  while (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT) < 0 && errno == EINTR) {
  }
  {
    std::lock_guard lock(mu_);
    Entry& e = *jobs_.at(id);
    e.peer_pids[static_cast<size_t>(rank - 1)] = 0;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  std::lock_guard lock(mu_);
  Entry& e = *jobs_.at(id);
  const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!clean && !e.cancel_requested && !stopping_ && !e.finishing && !e.ranks_killed &&
      e.abort_reason.empty()) {
    e.abort_reason = fmt::format(
        "rank {} of {} (pid {}, {}) {}{}\nlast log lines of rank {}:\n{}", rank,
        e.peer_pids.size() + 1, pid, e.job.devices_size() > rank ? e.job.devices(rank) : "?",
        describe_exit(status), e.failure_message.empty() ? "" : ": " + e.failure_message, rank,
        tail_lines(job_dir(id) / fmt::format("executor.rank{}.log", rank), 15));
    spdlog::warn("job {}: {}: stopping every rank", id, e.abort_reason.substr(0, 200));
    e.ranks_killed = true;
    signal_ranks(e, SIGKILL);
  }
  changed_.notify_all();
}

std::chrono::seconds JobManager::restart_delay(int restart) const {
  const int64_t cap = config_.jobs.restart_backoff_max_seconds;
  int64_t delay = config_.jobs.restart_backoff_seconds;
  for (int i = 1; i < restart && delay < cap; ++i) delay *= 2;
  return std::chrono::seconds(std::min(delay, cap));
}

void JobManager::fail_attempt(Lock& lock, Entry& e, const std::string& cause) {
  const auto& spec = e.job.spec();
  const int restart = e.job.attempts();  // this would be restart number `attempts`
  if (spec.restart_policy() != v1::RESTART_POLICY_ON_FAILURE || restart > spec.max_restarts()) {
    finish(lock, e, v1::JOB_STATE_FAILED, cause);
    return;
  }
  // A crash loop must not spin: each restart waits twice as long as the one before, capped.
  const auto delay = restart_delay(restart);
  e.not_before = Clock::now() + delay;
  const std::string plan =
      fmt::format("attempt {} failed; restart {} of spec.max_restarts={} in {} s", e.job.attempts(),
                  restart, spec.max_restarts(), delay.count());
  spdlog::warn("job {}: {}", e.job.id(), plan);
  release_devices(e);
  v1::JobEvent note;
  note.set_log_line(plan + ": " + cause);
  push_event(e, std::move(note));
  set_state(e, v1::JOB_STATE_QUEUED, plan + ": " + cause);
  queue_.push_back(e.job.id());
}

void JobManager::shutdown() {
  std::vector<pid_t> running;
  {
    std::lock_guard lock(mu_);
    if (stopping_ && !scheduler_.joinable() && monitors_.empty()) return;
    accepting_ = false;
    stopping_ = true;
    for (auto& [id, e] : jobs_) {
      if (e->pid > 0) running.push_back(e->pid);
      for (pid_t peer : e->peer_pids) {
        if (peer > 0) running.push_back(peer);
      }
    }
    changed_.notify_all();
  }
  for (pid_t pid : running) ::kill(pid, SIGTERM);
  if (scheduler_.joinable()) scheduler_.join();
  // Executors finish their step and checkpoint; monitor() reaps each and clears
  // its pid. They get the same grace as a cancelled job, then what is left is killed.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(config_.jobs.cancel_grace_seconds);
  auto any_running = [&] {
    std::lock_guard lock(mu_);
    return std::any_of(jobs_.begin(), jobs_.end(),
                       [](const auto& kv) { return kv.second->pid > 0; });
  };
  while (any_running() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  {
    // Only executors not yet reaped: a reaped pid may already belong to another process.
    std::lock_guard lock(mu_);
    for (auto& [id, e] : jobs_) signal_ranks(*e, SIGKILL);
  }
  for (Monitor& m : monitors_) {
    if (m.thread.joinable()) m.thread.join();
  }
  monitors_.clear();
}

}  // namespace megacpp::daemon
