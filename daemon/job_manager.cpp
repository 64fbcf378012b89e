#include "daemon/job_manager.h"

#include <fcntl.h>
#include <google/protobuf/util/json_util.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "runtime/checkpoint/checkpoint.h"
#include "runtime/common/error.h"
#include "runtime/executor/event_stream.h"
#include "runtime/gates/gates.h"
#include "runtime/trainer/trainer.h"

namespace megacpp::daemon {

namespace fs = std::filesystem;
namespace v1 = megacpp::v1;
using nlohmann::json;

std::string now_iso8601();  // daemon/boot.cpp

struct ExecutorEventView {
  const v1::ExecutorEvent& event;
};

struct JobManager::Entry {
  v1::Job job;
  json train_job;
  pid_t pid = 0;
  bool cancel_requested = false;
  bool summary_received = false;
  std::string stop_reason;
  std::string failure_message;
  int64_t last_checkpoint_step = -1;  // -1: none yet
  std::deque<v1::JobEvent> events;
  int64_t first_event_seq = 0;  // sequence number of events.front()
  std::chrono::steady_clock::time_point attempt_started;
  int64_t attempt_first_step = 1;
};

namespace {

constexpr size_t kMaxEventsKept = 2000;

bool is_terminal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED || s == v1::JOB_STATE_REFUSED;
}

std::string state_name(v1::JobState s) {
  switch (s) {
    case v1::JOB_STATE_QUEUED: return "queued";
    case v1::JOB_STATE_RUNNING: return "running";
    case v1::JOB_STATE_SUCCEEDED: return "succeeded";
    case v1::JOB_STATE_FAILED: return "failed";
    case v1::JOB_STATE_CANCELLED: return "cancelled";
    case v1::JOB_STATE_INTERRUPTED: return "interrupted";
    case v1::JOB_STATE_REFUSED: return "refused";
    default: return "unspecified";
  }
}

v1::JobState state_from_name(const std::string& s) {
  for (int i = v1::JobState_MIN; i <= v1::JobState_MAX; ++i) {
    if (state_name(static_cast<v1::JobState>(i)) == s) return static_cast<v1::JobState>(i);
  }
  return v1::JOB_STATE_UNSPECIFIED;
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
                       fs::path executor_path)
    : config_(config), writer_(writer), store_path_(store_path), boot_id_(boot_id),
      executor_path_(std::move(executor_path)), devices_(std::move(devices)) {}

JobManager::~JobManager() { shutdown(); }

fs::path JobManager::job_dir(const std::string& id) const { return config_.state_dir / "jobs" / id; }

std::string JobManager::new_job_id() { return fmt::format("job-{:06d}", ++id_counter_); }

void JobManager::record_job(const Entry& e) {
  receipts::JobRecord r;
  r.job_id = e.job.id();
  r.boot_id = boot_id_;
  r.state = state_name(e.job.state());
  r.spec = json::parse(spec_to_json(e.job.spec()));
  r.submitted_at = e.job.submitted_at();
  r.started_at = e.job.started_at();
  r.finished_at = e.job.finished_at();
  r.error = e.job.error();
  r.attempts = e.job.attempts();
  r.last_checkpoint_step = e.last_checkpoint_step;
  writer_.enqueue(r);
}

void JobManager::push_event(Entry& e, v1::JobEvent event) {
  *event.mutable_job() = e.job;
  e.events.push_back(std::move(event));
  if (e.events.size() > kMaxEventsKept) {
    e.events.pop_front();
    ++e.first_event_seq;
  }
  changed_.notify_all();
}

void JobManager::set_state(Entry& e, v1::JobState state, const std::string& error) {
  e.job.set_state(state);
  if (!error.empty()) e.job.set_error(error);
  if (state == v1::JOB_STATE_RUNNING) e.job.set_started_at(now_iso8601());
  if (is_terminal(state) || state == v1::JOB_STATE_INTERRUPTED) e.job.set_finished_at(now_iso8601());
  record_job(e);
  v1::JobEvent event;
  event.set_state_changed(state);
  push_event(e, std::move(event));
  spdlog::info("job {}: {}{}", e.job.id(), state_name(state), error.empty() ? "" : ": " + error);
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

v1::Job JobManager::submit(const v1::JobSpec& spec) {
  // An accepted job must survive a crash right after SubmitJob returns: wait for
  // its row (and its gate decisions, or its refusal) to be committed.
  struct FlushOnExit {
    receipts::BatchedWriter& writer;
    ~FlushOnExit() {
      try {
        writer.flush();
      } catch (const std::exception& e) {
        spdlog::error("receipt store flush after a submission failed: {}", e.what());
      }
    }
  } flush_on_exit{writer_};
  return submit_locked(spec);
}

v1::Job JobManager::submit_locked(const v1::JobSpec& spec) {
  std::unique_lock lock(mu_);
  if (!accepting_) fail(ErrorKind::kFailedPrecondition, "the daemon is shutting down: not accepting jobs");
  if (static_cast<int>(queue_.size()) >= config_.limits.max_queued_jobs) {
    fail(ErrorKind::kFailedPrecondition, "the queue is full (limits.max_queued_jobs={}): retry later",
         config_.limits.max_queued_jobs);
  }
  int cpu_slots = 0, gpus = 0;
  for (const auto& d : devices_) (d.kind == "cpu" ? cpu_slots : gpus)++;
  const std::string id = new_job_id();
  ValidatedJob validated;
  try {
    validated = validate_job_spec(spec, config_, cpu_slots, gpus, config_.checkpoint_root / id);
  } catch (...) {
    --id_counter_;  // nothing was queued or recorded under this id
    throw;
  }
  auto entry = std::make_unique<Entry>();
  Entry& e = *entry;
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
  jobs_[id] = std::move(entry);
  if (gates::any_refused(validated.gate_decisions)) {
    std::string reasons;
    for (const auto& d : validated.gate_decisions) {
      if (d.decision == gates::Decision::kRefused) reasons += (reasons.empty() ? "" : "; ") + d.reason;
    }
    set_state(e, v1::JOB_STATE_REFUSED, reasons);  // the job row first: decisions refer to it
    record_gate_decisions(id, validated.gate_decisions);
    fail(ErrorKind::kFailedPrecondition, "job {} refused: {}", id, reasons);
  }
  fs::create_directories(job_dir(id));
  save_json_atomically(job_dir(id) / "job.json", e.train_job);
  set_state(e, v1::JOB_STATE_QUEUED);
  record_gate_decisions(id, validated.gate_decisions);
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
  std::lock_guard lock(mu_);
  std::vector<v1::Job> out;
  next_token->clear();
  for (auto it = after_id.empty() ? jobs_.begin() : jobs_.upper_bound(after_id); it != jobs_.end(); ++it) {
    const auto& job = it->second->job;
    if (!states.empty() && std::find(states.begin(), states.end(), job.state()) == states.end()) continue;
    if (static_cast<int>(out.size()) == limit) {
      *next_token = out.back().id();
      break;
    }
    out.push_back(job);
  }
  return out;
}

v1::Job JobManager::cancel(const std::string& id) {
  std::lock_guard lock(mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) fail(ErrorKind::kNotFound, "no job {}", id);
  Entry& e = *it->second;
  if (is_terminal(e.job.state())) return e.job;
  e.cancel_requested = true;
  if (e.job.state() == v1::JOB_STATE_RUNNING && e.pid > 0) {
    ::kill(e.pid, SIGTERM);  // the executor checkpoints and exits; monitor() finishes the job
  } else {
    queue_.erase(std::remove(queue_.begin(), queue_.end(), id), queue_.end());
    set_state(e, v1::JOB_STATE_CANCELLED);
  }
  return e.job;
}

std::vector<v1::JobEvent> JobManager::wait_events(const std::string& id, int64_t& cursor,
                                                  std::chrono::milliseconds timeout, bool* finished) {
  std::unique_lock lock(mu_);
  auto find = [&]() -> Entry& {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) fail(ErrorKind::kNotFound, "no job {}", id);
    return *it->second;
  };
  Entry* e = &find();
  auto available = [&] { return e->first_event_seq + static_cast<int64_t>(e->events.size()) > cursor; };
  if (!available() && !is_terminal(e->job.state())) {
    changed_.wait_for(lock, timeout, [&] { return available() || is_terminal(e->job.state()) || stopping_; });
  }
  std::vector<v1::JobEvent> out;
  cursor = std::max(cursor, e->first_event_seq);
  for (int64_t seq = cursor; seq < e->first_event_seq + static_cast<int64_t>(e->events.size()); ++seq) {
    out.push_back(e->events[static_cast<size_t>(seq - e->first_event_seq)]);
  }
  cursor = e->first_event_seq + static_cast<int64_t>(e->events.size());
  *finished = is_terminal(e->job.state()) || (stopping_ && e->job.state() != v1::JOB_STATE_RUNNING);
  return out;
}

ManagerSnapshot JobManager::snapshot() const {
  std::lock_guard lock(mu_);
  ManagerSnapshot s;
  s.devices = devices_;
  s.steps_total = steps_total_;
  for (const auto& [id, e] : jobs_) {
    s.jobs_by_state[state_name(e->job.state())]++;
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
    e.job.set_state(state_from_name(r.state));
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

void JobManager::rewind_to_recorded_checkpoint(const receipts::Store& store, const std::string& id) {
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
  std::unique_lock lock(mu_);
  while (!stopping_) {
    for (auto it = queue_.begin(); it != queue_.end();) {
      Entry& e = *jobs_.at(*it);
      if (try_start(e)) {
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    changed_.wait_for(lock, std::chrono::seconds(1));
  }
}

bool JobManager::try_start(Entry& e) {
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
  spawn(e);
  return true;
}

void JobManager::spawn(Entry& e) {
  const fs::path dir = job_dir(e.job.id());
  fs::create_directories(dir);
  save_json_atomically(dir / "job.json", e.train_job);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    release_devices(e);
    set_state(e, v1::JOB_STATE_FAILED, fmt::format("cannot create the executor pipe: {}", std::strerror(errno)));
    return;
  }
  const std::string job_file = (dir / "job.json").string();
  const std::string log_file = (dir / "executor.log").string();
  const std::string executor = executor_path_.string();
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec. The daemon blocks its stop
    // signals for sigwait(); the executor must receive them.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::dup2(fds[1], 3);
    const int log = ::open(log_file.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (log >= 0) {
      ::dup2(log, 1);
      ::dup2(log, 2);
    }
    const char* argv[] = {executor.c_str(), "--job", job_file.c_str(), "--events-fd", "3", nullptr};
    ::execv(executor.c_str(), const_cast<char* const*>(argv));
    ::_exit(127);
  }
  ::close(fds[1]);
  if (pid < 0) {
    ::close(fds[0]);
    release_devices(e);
    set_state(e, v1::JOB_STATE_FAILED, fmt::format("cannot start the executor: {}", std::strerror(errno)));
    return;
  }
  e.pid = pid;
  e.summary_received = false;
  e.stop_reason.clear();
  e.failure_message.clear();
  e.job.set_attempts(e.job.attempts() + 1);
  e.job.clear_error();
  e.attempt_started = std::chrono::steady_clock::now();
  set_state(e, v1::JOB_STATE_RUNNING);
  monitors_.emplace_back([this, id = e.job.id(), pid, fd = fds[0]] { monitor(id, pid, fd); });
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
      ++steps_total_;
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
          std::chrono::duration<double>(std::chrono::steady_clock::now() - e.attempt_started).count();
      const double done = static_cast<double>(s.step() - e.attempt_first_step + 1);
      p->set_eta_seconds(done > 0 ? elapsed / done * static_cast<double>(e.job.total_steps() - s.step()) : 0);
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
    handle_event(*jobs_.at(id), ExecutorEventView{*event});
  }
  ::close(events_fd);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  std::lock_guard lock(mu_);
  Entry& e = *jobs_.at(id);
  e.pid = 0;
  release_devices(e);
  const bool clean_exit = WIFEXITED(status) && WEXITSTATUS(status) == 0 && e.summary_received;
  if (clean_exit && (e.stop_reason == "completed" || e.stop_reason == "time_limit")) {
    set_state(e, v1::JOB_STATE_SUCCEEDED);
  } else if (e.cancel_requested) {
    set_state(e, v1::JOB_STATE_CANCELLED);
  } else if (stopping_ || (clean_exit && e.stop_reason == "stopped")) {
    set_state(e, v1::JOB_STATE_INTERRUPTED, "stopped with the daemon; resumes at its next start");
  } else {
    std::string cause = describe_exit(status);
    if (!e.failure_message.empty()) cause += ": " + e.failure_message;
    cause += "\nlast executor log lines:\n" + tail_lines(job_dir(id) / "executor.log", 15);
    const auto& spec = e.job.spec();
    const bool retry = spec.restart_policy() == v1::RESTART_POLICY_ON_FAILURE &&
                       e.job.attempts() <= spec.max_restarts();
    set_state(e, v1::JOB_STATE_FAILED, cause);
    if (retry) {
      set_state(e, v1::JOB_STATE_QUEUED);
      queue_.push_back(id);
    }
  }
  changed_.notify_all();
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
    }
    changed_.notify_all();
  }
  for (pid_t pid : running) ::kill(pid, SIGTERM);
  if (scheduler_.joinable()) scheduler_.join();
  // Executors finish their step and checkpoint; monitor() reaps each and clears
  // its pid. Give them a bounded time, then kill what is left.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  auto any_running = [&] {
    std::lock_guard lock(mu_);
    return std::any_of(jobs_.begin(), jobs_.end(), [](const auto& kv) { return kv.second->pid > 0; });
  };
  while (any_running() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  {
    // Only executors not yet reaped: a reaped pid may already belong to another process.
    std::lock_guard lock(mu_);
    for (auto& [id, e] : jobs_) {
      if (e->pid > 0) ::kill(e->pid, SIGKILL);
    }
  }
  for (auto& t : monitors_) {
    if (t.joinable()) t.join();
  }
  monitors_.clear();
}

}  // namespace megacpp::daemon
