#include "runtime/parallel/collective_watchdog.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

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
  // The last resort stays armed while the poll thread may still be held inside an abort.
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard lock(mutex_);
    disarmed_ = true;
  }
  wake_.notify_all();
  if (last_resort_thread_.joinable()) last_resort_thread_.join();
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
  // Under the lock, which the thread takes first: fire() never sees thread_ half assigned.
  std::lock_guard started(mutex_);
  started_ = true;
  thread_ = std::thread([this, poll] {
    bool all_aborted = false;
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      const bool fired = !reason_.empty();
      lock.unlock();
      if (!fired) {
        try {
          look(Clock::now());
        } catch (const std::exception& e) {
          // A watchdog that cannot look is no watchdog: the job fails rather than risk a hang.
          fire(fmt::format("collective watchdog: could not check the collectives: {}", e.what()),
               nullptr);
        }
      } else if (!all_aborted) {
        all_aborted = abort_groups();
      }
      lock.lock();
      wake_.wait_for(lock, poll, [this] { return stopping_; });
    }
  });
}

std::string CollectiveWatchdog::check(Clock::time_point now) {
  {
    std::lock_guard lock(mutex_);
    if (started_) fail(ErrorKind::kInternal, "collective watchdog: check() beside its thread");
  }
  return look(now);
}

std::string CollectiveWatchdog::look(Clock::time_point now) {
  if (std::string done = reason(); !done.empty()) return done;
  for (Watch& w : watches_) {
    if (std::string error = w.group->asynchronous_error(); !error.empty()) {
      fire(fmt::format("collective watchdog: NCCL reports for the {}: {}", w.group->group_name(),
                       error),
           &w);
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
               "collective watchdog: {} (collective {} of the {}) has waited {:.1f} s for the "
               "other ranks without finishing (the job's collective timeout is {} s): a peer rank "
               "of that group stopped answering or failed; this rank's NCCL communicators are "
               "aborted",
               pending->description, pending->sequence, w.group->group_name(), waited,
               timeout_seconds_),
           &w);
      return reason();
    }
  }
  return {};
}

std::string CollectiveWatchdog::reason() const {
  std::lock_guard lock(mutex_);
  return reason_;
}

void CollectiveWatchdog::fire(const std::string& why, const Watch* first) {
  {
    std::lock_guard lock(mutex_);
    if (!reason_.empty()) return;
    reason_ = why;
    if (last_resort_ && started_) {
      const auto grace = std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(grace_seconds_));
      last_resort_thread_ = std::thread([this, grace] {
        std::unique_lock wait(mutex_);
        if (wake_.wait_for(wait, grace, [this] { return disarmed_; })) return;
        const std::string told = reason_;
        wait.unlock();
        last_resort_(told);
      });
    }
  }
  spdlog::error("{}", why);
  if (first != nullptr) {
    // The stuck group first: NCCL's teardown of the others may wait for its kernel.
    const auto at = watches_.begin() + (first - watches_.data());
    std::rotate(watches_.begin(), at, at + 1);
  }
  abort_groups();
}

bool CollectiveWatchdog::abort_groups() {
  const std::string why = reason();
  for (Watch& w : watches_) {
    if (w.aborted) continue;
    if (!w.group->abort(why)) return false;
    w.aborted = true;
  }
  return true;
}

}  // namespace megacpp::parallel
