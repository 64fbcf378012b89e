#pragma once
// The collective watchdog: a thread of each rank of a several-GPU job that notices when a
// collective never finishes, and ends the wait.
//
// A rank that hangs (stopped, deadlocked, its GPU wedged) leaves every other rank of its groups
// spinning inside a collective kernel, and NCCL has no timeout of its own. The watchdog looks at
// each of the rank's groups' oldest unfinished collective. Once its stream has reached it, the
// work before it is done, so from then on the collective waits only for the peers. One that has
// waited longer than the timeout means a peer stopped answering. The watchdog then aborts every
// group of the rank with the reason: the spinning kernel returns, the rank's next collective call
// fails with that reason, and the job fails naming it instead of hanging. An error NCCL reports
// asynchronously (a peer's connection lost) fires it at once.
//
// The group whose collective timed out is aborted first (its kernel must end before the others'
// teardown can). The abort cannot reach a thread blocked inside an NCCL call (an enqueue waiting
// for room in NCCL's queue to the device, whose kernels wait for the hung peer): freeing the
// communicator under it is not safe, so that group's abort is retried every poll. A watchdog that
// fired and was not destroyed by its owner within the grace calls its last resort (from a thread
// of its own, which calls into neither CUDA nor NCCL), which ends the process with the reason:
// the executor's.
//
// A collective that waits on the host before it is enqueued (NCCL connecting lazily to a peer
// that hangs at that moment) is not seen: the daemon's progress watchdog still ends that job.
//
// Plain C++: what it watches is the WatchedGroup interface (CudaCommunicator implements it with
// CUDA events), so the policy is tested without GPUs.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace megacpp::parallel {

// A group's oldest collective that has not finished.
struct PendingCollective {
  uint64_t sequence = 0;    // its number among the group's collectives, from 1
  std::string description;  // e.g. "all-reduce of 64.0 MiB bf16"
  bool started = false;     // its stream reached it: it waits for the peers alone
};

class WatchedGroup {
 public:
  virtual ~WatchedGroup() = default;
  // Says which group this is in a failure message, e.g. "tensor-parallel group (world ranks 0-1)".
  virtual std::string group_name() const = 0;
  virtual std::optional<PendingCollective> oldest_unfinished() = 0;
  // The error NCCL reports for this group while no call is made (empty: none).
  virtual std::string asynchronous_error() = 0;
  // Fails the group's pending and later collectives with `reason`; idempotent, any thread.
  // Returns false when the abort could not be done yet (a call of the group is inside NCCL and
  // the group cannot be freed under it): later calls still fail, and the watchdog tries again.
  virtual bool abort(const std::string& reason) = 0;
};

class CollectiveWatchdog {
 public:
  using Clock = std::chrono::steady_clock;

  // Watches `groups` (null entries are skipped), which must outlive the watchdog. The thread
  // starts with start(); without it, check() is driven by the caller (tests).
  CollectiveWatchdog(double timeout_seconds, std::vector<WatchedGroup*> groups);
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  // Called, on a thread of its own, with the reason when the watchdog fired and was not destroyed
  // `grace_seconds` later: the rank's work is stuck where the abort does not reach. Meant to end
  // the process. Set before start(). The destructor disarms it only after its poll thread has
  // stopped (which may itself be held inside NCCL).
  void set_last_resort(std::function<void(const std::string&)> last_resort, double grace_seconds);
  // Looks every `poll_seconds` until destroyed.
  void start(double poll_seconds = 0.05);
  // One look at the groups as of `now`, for a watchdog that was not started (tests; refused
  // beside the thread). Fires (aborts the groups) when a started collective has waited
  // timeout_seconds or longer since the first look that saw it started, or a group reports an
  // asynchronous error. Returns reason().
  std::string check(Clock::time_point now);
  // Empty until it fired; then why, once and for all.
  std::string reason() const;
  double timeout_seconds() const { return timeout_seconds_; }

 private:
  struct Watch {
    WatchedGroup* group = nullptr;
    uint64_t sequence = 0;  // the started collective being timed (0: none)
    Clock::time_point started_seen;
    bool aborted = false;
  };
  std::string look(Clock::time_point now);
  // Sets the reason once, starts the last resort's clock, aborts (`first` first).
  void fire(const std::string& reason, const Watch* first);
  // Aborts the groups not aborted yet, in order, stopping at the first that cannot be aborted
  // yet (the others' teardown could wait for its kernel); true when none is left.
  bool abort_groups();

  const double timeout_seconds_;
  std::vector<Watch> watches_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool started_ = false;
  bool stopping_ = false;  // the poll thread ends
  bool disarmed_ = false;  // the last resort will not be called
  std::string reason_;
  std::function<void(const std::string&)> last_resort_;
  double grace_seconds_ = 0;
  std::thread thread_;
  std::thread last_resort_thread_;
};

}  // namespace megacpp::parallel
