#include "runtime/parallel/collective_watchdog.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "base/error.h"

namespace megacpp::parallel {

CollectiveWatchdog::CollectiveWatchdog(double timeout_seconds, std::vector<WatchedGroup*> groups)
    : timeout_seconds_(timeout_seconds) {
  if (!(timeout_seconds > 0)) {
    fail(ErrorKind::kInvalidArgument, "collective watchdog: timeout {} s must be positive",
         timeout_seconds);
  }
  for (WatchedGroup* g : groups) {
    if (g != nullptr) watches_.push_back({g, 0, {}});
  }
}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void CollectiveWatchdog::set_last_resort(std::function<void(const std::string&)> last_resort,
                                         double grace_seconds) {
  if (thread_.joinable())
    fail(ErrorKind::kInternal, "collective watchdog: last resort after start");
  last_resort_ = std::move(last_resort);
  grace_seconds_ = grace_seconds;
}

void CollectiveWatchdog::start(double poll_seconds) {
  if (thread_.joinable()) fail(ErrorKind::kInternal, "collective watchdog started twice");
  const auto poll = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(poll_seconds > 0 ? poll_seconds : 0.05));
  thread_ = std::thread([this, poll] {
    std::unique_lock lock(mutex_);
    while (!stopping_ && reason_.empty()) {
      lock.unlock();
      check(Clock::now());
      lock.lock();
      wake_.wait_for(lock, poll, [this] { return stopping_; });
    }
    if (stopping_ || !last_resort_) return;
    // Fired: the owner's work should now fail and destroy the watchdog, within the grace.
    const auto grace =
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_seconds_));
    if (wake_.wait_for(lock, grace, [this] { return stopping_; })) return;
    const std::string why = reason_;
    lock.unlock();
    last_resort_(why);
  });
}

std::string CollectiveWatchdog::check(Clock::time_point now) {
  if (std::string done = reason(); !done.empty()) return done;
  for (Watch& w : watches_) {
    if (std::string error = w.group->asynchronous_error(); !error.empty()) {
      fire(fmt::format("collective watchdog: NCCL reports for the {}: {}", w.group->group_name(),
                       error));
      return reason();
    }
    const std::optional<PendingCollective> pending = w.group->oldest_unfinished();
    if (!pending || !pending->started) {
      w.sequence = 0;
      continue;
    }
    if (pending->sequence != w.sequence) {
      // Timed from the first look that saw it started: at most one poll late, never early.
      w.sequence = pending->sequence;
      w.started_seen = now;
      continue;
    }
    const double waited = std::chrono::duration<double>(now - w.started_seen).count();
    if (waited >= timeout_seconds_) {
      fire(fmt::format(
          "collective watchdog: {} (collective {} of the {}) has waited {:.1f} s for the other "
          "ranks without finishing (the job's collective timeout is {} s): a peer rank of that "
          "group stopped answering or failed; this rank's NCCL communicators are aborted",
          pending->description, pending->sequence, w.group->group_name(), waited,
          timeout_seconds_));
      return reason();
    }
  }
  return {};
}

std::string CollectiveWatchdog::reason() const {
  std::lock_guard lock(mutex_);
  return reason_;
}

void CollectiveWatchdog::fire(const std::string& why) {
  {
    std::lock_guard lock(mutex_);
    if (!reason_.empty()) return;
    reason_ = why;
  }
  spdlog::error("{}", why);
  for (Watch& w : watches_) w.group->abort(why);
}

}  // namespace megacpp::parallel
