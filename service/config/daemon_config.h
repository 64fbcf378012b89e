#pragma once
// The daemon's configuration file (configs/daemon.json). Every key is known: an unknown one is a
// typo that would otherwise silently leave a default in force on a shared machine. Relative
// paths are relative to the config file's directory, not to wherever the daemon was started,
// so a unit file and a developer's shell read the same config the same way.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "service/preconditions/preconditions.h"

namespace megacpp {

struct DaemonDevicesConfig {
  int cpu_slots = 1;      // CPU jobs that may run at once
  bool gpus_auto = true;  // "auto": every GPU the daemon finds
  std::vector<int> gpus;  // the CUDA device indices to use when !gpus_auto; may be empty
};

struct DaemonLimitsConfig {
  int max_queued_jobs = 64;
  // nullopt: as many as there are device slots (cpu_slots + GPUs), see max_concurrent_jobs_for.
  std::optional<int> max_concurrent_jobs;
  uint64_t max_message_bytes = 4ull << 20;
  uint64_t max_spec_bytes = 256ull << 10;
  // Each open WatchJob stream holds a server thread: beyond this, RESOURCE_EXHAUSTED.
  int max_watch_streams = 64;
  // Memory a running job's in-daemon event history may take; older events are dropped (late
  // watchers read them from the store) and the whole history is freed when the job ends.
  uint64_t job_event_history_bytes = 1ull << 20;
};

// How the daemon supervises running jobs and restarts failed ones. Seconds throughout.
struct DaemonJobsConfig {
  // A running job whose executor sent no event (step, eval, checkpoint, log line) for this long is
  // stopped and failed; 0 disables the watchdog.
  int progress_timeout_seconds = 600;
  // Several-GPU jobs: a collective that has waited this long for the other ranks (a rank hung)
  // fails the job from inside the waiting rank, its NCCL communicators aborted
  // (runtime/parallel/collective_watchdog.h); 0 disables it. Below progress_timeout_seconds
  // (when both are on), so that the rank waiting for a hung one reports first; unset, at most
  // half of it.
  int collective_timeout_seconds = 300;
  // Time an executor gets after SIGTERM (cancel, watchdog, time limit) before SIGKILL.
  int cancel_grace_seconds = 30;
  // The daemon stops a job still running this long after its spec.max_seconds: the executor
  // enforces max_seconds itself, but a stuck one cannot.
  int time_limit_grace_seconds = 300;
  // Restart n (1-based) of a failed job waits min(restart_backoff_max_seconds,
  // restart_backoff_seconds * 2^(n-1)).
  int restart_backoff_seconds = 10;
  int restart_backoff_max_seconds = 300;
};

struct DaemonSecurityConfig {
  std::filesystem::path token_file;     // empty: no bearer token required
  std::filesystem::path tls_cert_file;  // both empty (plaintext) or both set
  std::filesystem::path tls_key_file;
  // With a token: /metrics answers without it too (for a scraper that cannot send one).
  bool public_metrics = false;
};

// The HTTP endpoint serves each open connection on one worker thread, so an idle or slow client
// holds a worker until a timeout drops it: enough workers and short timeouts keep /healthz and
// /metrics answering while some clients misbehave.
struct DaemonHttpConfig {
  int workers = 64;
  int idle_timeout_seconds = 2;  // a connection with no request under way is closed after this
  int io_timeout_seconds = 10;   // each read or write of a request or response in transit
};

struct DaemonConfig {
  std::string source;                              // where the config came from, for messages
  std::string listen_address = "127.0.0.1:50551";  // gRPC; host:port or unix:/path
  std::string http_address = "127.0.0.1:8551";     // dashboards; empty disables the endpoint
  // All paths below are absolute and lexically normal after parsing.
  std::filesystem::path state_dir;
  std::filesystem::path store_path;               // default state_dir/receipts.db
  std::filesystem::path checkpoint_root;          // default state_dir/checkpoints
  std::vector<std::filesystem::path> data_roots;  // default [state_dir/data]
  std::vector<std::filesystem::path> cache_dirs;  // default [state_dir/cache]
  uint64_t min_free_bytes = 1ull << 30;
  DaemonDevicesConfig devices;
  DaemonLimitsConfig limits;
  DaemonJobsConfig jobs;
  DaemonSecurityConfig security;
  DaemonHttpConfig http;
  bool allow_nvls = false;
  // Empty: megacpp-executor next to the daemon's own binary (see executor_path_for).
  std::filesystem::path executor_path;

  // limits.max_concurrent_jobs, or cpu_slots + gpu_count when it was not set.
  int max_concurrent_jobs_for(int gpu_count) const;
  // executor_path, or `daemon_binary`'s directory / "megacpp-executor" when it is empty.
  std::filesystem::path executor_path_for(const std::filesystem::path& daemon_binary) const;
  // The directories and limits the preconditions check.
  preconditions::PreconditionConfig precondition_config() const;
};

// Parses a config object. `source` names it in error messages (normally the file's path);
// relative paths resolve against `base_dir` (made absolute against the current directory).
// Throws Error(kInvalidArgument) naming the source, the field, its value and the rule.
DaemonConfig parse_daemon_config(const nlohmann::json& json, const std::string& source,
                                 const std::filesystem::path& base_dir);

// Reads and parses `path`; relative paths in it resolve against its directory. Throws
// Error(kNotFound) for a missing file and Error(kInvalidArgument) for bad JSON or a broken rule.
DaemonConfig load_daemon_config(const std::filesystem::path& path);

}  // namespace megacpp
