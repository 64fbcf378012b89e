#pragma once
// Owns the jobs: validates and queues submissions, starts each job's executor
// process when its devices are free, reads the executor's event stream, records
// everything through the receipt writer, serves watchers, supervises executors
// (progress watchdog, time limit, cancel escalation), applies restart policies
// with backoff, and recovers interrupted jobs at startup.
//
// Invariant: the end of a job that was queued or ran (succeeded, failed,
// cancelled; interrupted at shutdown) becomes visible to get(), list(), watch()
// and snapshot() only after everything recorded for it, its last step receipts,
// run summary and its job row in the final state, is committed to the store:
// every such end goes through finish(). A client that sees a job end can read
// all of its receipts at once. (A refusal at submit is answered after submit()'s
// flush; its row is in jobs_ from validation on.)
#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/job_spec.h"
#include "megacpp/v1/jobs.pb.h"
#include "receipts/batched_writer.h"
#include "receipts/store.h"
#include "service/config/daemon_config.h"

namespace megacpp::daemon {

class DaemonMetrics;

struct DeviceSlot {
  std::string id;    // "cpu:0"
  std::string kind;  // "cpu" | "cuda"
  std::string name;
  uint64_t memory_bytes = 0;
  std::string held_by;  // job id
};

struct ManagerSnapshot {
  std::vector<DeviceSlot> devices;
  std::vector<megacpp::v1::Job> queued;
  std::vector<megacpp::v1::Job> running;
  std::map<std::string, int> jobs_by_state;
};

class JobManager {
 public:
  // `metrics` receives every step receipt and every job's end.
  JobManager(const DaemonConfig& config, receipts::BatchedWriter& writer,
             const std::filesystem::path& store_path, int64_t boot_id,
             std::vector<DeviceSlot> devices, std::filesystem::path executor_path,
             DaemonMetrics& metrics);
  ~JobManager();

  // Starts the scheduler; call once, after recover().
  void start();
  // Jobs left running or queued by a previous daemon: running ones become
  // interrupted and, when their restart policy allows, are queued to resume.
  void recover();
  // Stops accepting, sends SIGTERM to executors (they checkpoint), waits for them,
  // marks their jobs interrupted (resumable at the next start).
  void shutdown();

  // Throws Error: kInvalidArgument (bad spec; nothing queued), kFailedPrecondition
  // (a gate refused: the refusal and every decision are recorded).
  megacpp::v1::Job submit(const megacpp::v1::JobSpec& spec);
  std::optional<megacpp::v1::Job> get(const std::string& id) const;
  // Up to `limit` jobs after `after_id`, oldest first; `next_token` is the last one's id when
  // more may follow. Throws Error(kInvalidArgument) for a limit below 1.
  std::vector<megacpp::v1::Job> list(const std::vector<megacpp::v1::JobState>& states, int limit,
                                     const std::string& after_id, std::string* next_token) const;
  // Throws Error(kNotFound). Queued jobs are cancelled at once; running ones get
  // SIGTERM and become cancelled when their executor has checkpointed and exited,
  // or SIGKILL when it has not within jobs.cancel_grace_seconds.
  megacpp::v1::Job cancel(const std::string& id);

  // Streams the job's events to `send` until the job has ended and its last
  // event was sent, `send` returns false (the client went away) or `cancelled()`
  // (polled at least every half second) is true. Events come from the job's
  // in-memory history while it holds them; what it no longer holds (a watcher
  // that fell behind limits.job_event_history_bytes, or any job that has ended:
  // its history is freed then) comes from the store: step receipts with their
  // evals, the run summary, and the final state. Log lines and intermediate
  // state changes live only in memory. Throws Error(kNotFound).
  void watch(const std::string& id, const std::function<bool(const megacpp::v1::JobEvent&)>& send,
             const std::function<bool()>& cancelled);
  // A WatchJob stream holds a server thread for as long as the job runs: at
  // most limits.max_watch_streams at once. false when that many are open;
  // call release_watch_stream() once for every true.
  bool acquire_watch_stream();
  void release_watch_stream();
  int max_watch_streams() const { return config_.limits.max_watch_streams; }

  ManagerSnapshot snapshot() const;

 private:
  struct Entry;
  struct WatchCursor;
  using Lock = std::unique_lock<std::mutex>;
  // A submission in two halves around the commit of its records (see submit()).
  struct Submission;
  Submission prepare_submission(const megacpp::v1::JobSpec& spec);
  megacpp::v1::Job publish_submission(Submission submission);
  void rewind_to_recorded_checkpoint(const receipts::Store& store, const std::string& id);
  void scheduler_loop();
  // Watchdog, time limit and SIGKILL escalation of running executors; returns
  // when it next has something to check. With mu_ held.
  std::chrono::steady_clock::time_point supervise(std::chrono::steady_clock::time_point now);
  void stop_executor(Entry& entry, const std::string& reason);  // with mu_ held
  bool claim_devices(Entry& entry);                             // with mu_ held
  void spawn(Lock& lock, Entry& entry);
  // Forks one executor (rank 0 of a single-process job, or one rank of a several-GPU job);
  // returns its pid, or -1 with errno set.
  pid_t fork_executor(const Entry& entry, int rank, int events_fd);
  void monitor(std::string id, pid_t pid, int events_fd);
  // Ranks 1.. of a several-GPU job: their kernel receipts and failures; a rank that fails fails
  // the job at once (every other rank is killed: it would wait in a collective for ever).
  void monitor_peer(std::string id, int rank, pid_t pid, int events_fd);
  void signal_ranks(Entry& entry, int signal);  // with mu_ held
  void handle_event(Entry& entry, const struct ExecutorEventView& view);
  void set_state(Entry& entry, megacpp::v1::JobState state, const std::string& error = "");
  // Ends a job (a terminal state, or interrupted): records the final job row, releases `lock`
  // until the store has committed it and everything recorded before it, then publishes.
  void finish(Lock& lock, Entry& entry, megacpp::v1::JobState state, const std::string& error = "");
  // A failed attempt: queued again after the restart backoff when the restart policy allows,
  // else finished as failed.
  void fail_attempt(Lock& lock, Entry& entry, const std::string& cause);
  std::chrono::seconds restart_delay(int restart) const;  // restart: 1 for the first
  void push_event(Entry& entry, megacpp::v1::JobEvent event);
  void free_history(Entry& entry);
  // Sends what the store holds of the job's steps in (cursor.last_step, through_step], each
  // followed by its eval where one was run and its step is at most evals_through; false when
  // `send` failed.
  bool replay_steps(const receipts::Store& store, const megacpp::v1::Job& job, WatchCursor& cursor,
                    int64_t through_step, int64_t evals_through,
                    const std::function<bool(const megacpp::v1::JobEvent&)>& send) const;
  void record_job(const Entry& entry);
  void record_job(const megacpp::v1::Job& job, int64_t last_checkpoint_step);
  void record_gate_decisions(const std::string& id,
                             const std::vector<gates::GateDecision>& decisions);
  void release_devices(Entry& entry);
  std::string new_job_id();
  std::filesystem::path job_dir(const std::string& id) const;

  const DaemonConfig& config_;
  receipts::BatchedWriter& writer_;
  std::filesystem::path store_path_;
  int64_t boot_id_;
  std::filesystem::path executor_path_;
  DaemonMetrics& metrics_;
  mutable std::mutex mu_;
  // Serialises submissions from validation to publication, so the queue limit and the job ids
  // hold across the unlocked wait for the commit.
  std::mutex submit_mu_;
  std::condition_variable changed_;
  std::map<std::string, std::unique_ptr<Entry>> jobs_;
  std::deque<std::string> queue_;
  std::vector<DeviceSlot> devices_;
  bool accepting_ = true;
  bool stopping_ = false;
  int64_t id_counter_ = 0;
  int watch_streams_ = 0;
  std::thread scheduler_;
  // A thread per executor rank (monitor, monitor_peer): `done` (under mu_) once it has nothing
  // left to do, when the scheduler joins and drops it, so that a long-lived daemon does not keep
  // a finished thread (and its stack) per job it ever ran.
  struct Monitor {
    std::thread thread;
    bool done = false;
  };
  std::list<Monitor> monitors_;
};

}  // namespace megacpp::daemon
