#pragma once
// Owns the jobs: validates and queues submissions, starts each job's executor
// process when its devices are free, reads the executor's event stream, records
// everything through the receipt writer, serves watchers, applies restart
// policies, and recovers interrupted jobs at startup.
#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
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
#include "runtime/daemon_config/daemon_config.h"

namespace megacpp::daemon {

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
  int64_t steps_total = 0;  // steps completed by jobs of this daemon's lifetime
};

class JobManager {
 public:
  JobManager(const DaemonConfig& config, receipts::BatchedWriter& writer,
             const std::filesystem::path& store_path, int64_t boot_id,
             std::vector<DeviceSlot> devices, std::filesystem::path executor_path);
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
  std::vector<megacpp::v1::Job> list(const std::vector<megacpp::v1::JobState>& states, int limit,
                                     const std::string& after_id, std::string* next_token) const;
  // Throws Error(kNotFound). Queued jobs are cancelled at once; running ones get
  // SIGTERM and become cancelled when their executor has checkpointed and exited.
  megacpp::v1::Job cancel(const std::string& id);

  // Events of a job after `cursor` (returns the new cursor); waits up to
  // `timeout` for new ones. `finished` is set once the job is terminal and every
  // event was returned.
  std::vector<megacpp::v1::JobEvent> wait_events(const std::string& id, int64_t& cursor,
                                                 std::chrono::milliseconds timeout, bool* finished);

  ManagerSnapshot snapshot() const;

 private:
  struct Entry;
  megacpp::v1::Job submit_locked(const megacpp::v1::JobSpec& spec);
  void rewind_to_recorded_checkpoint(const receipts::Store& store, const std::string& id);
  void scheduler_loop();
  bool try_start(Entry& entry);  // with mu_ held
  void spawn(Entry& entry);      // with mu_ held
  void monitor(std::string id, pid_t pid, int events_fd);
  void handle_event(Entry& entry, const struct ExecutorEventView& view);
  void set_state(Entry& entry, megacpp::v1::JobState state, const std::string& error = "");
  void push_event(Entry& entry, megacpp::v1::JobEvent event);
  void record_job(const Entry& entry);
  void record_gate_decisions(const std::string& id, const std::vector<gates::GateDecision>& decisions);
  void release_devices(Entry& entry);
  std::string new_job_id();
  std::filesystem::path job_dir(const std::string& id) const;

  const DaemonConfig& config_;
  receipts::BatchedWriter& writer_;
  std::filesystem::path store_path_;
  int64_t boot_id_;
  std::filesystem::path executor_path_;
  mutable std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::unique_ptr<Entry>> jobs_;
  std::deque<std::string> queue_;
  std::vector<DeviceSlot> devices_;
  bool accepting_ = true;
  bool stopping_ = false;
  int64_t id_counter_ = 0;
  int64_t steps_total_ = 0;
  std::thread scheduler_;
  std::vector<std::thread> monitors_;
};

}  // namespace megacpp::daemon
