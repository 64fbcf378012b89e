// The collective watchdog's policy, against groups whose collectives the test drives: it times a
// collective only once its stream has reached it, fires once the timeout has passed since then
// (never before), aborts every group with one reason that names the collective and its group,
// fires at once on an asynchronous error, and does nothing while collectives keep finishing.
// The thread runs the same check; one test drives it through start().
#include "runtime/parallel/collective_watchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "base/error.h"

namespace megacpp::parallel {
namespace {

using Clock = CollectiveWatchdog::Clock;
using std::chrono::milliseconds;

// Orders the first abort of each group across groups.
std::atomic<int> abort_clock{0};

class FakeGroup final : public WatchedGroup {
 public:
  explicit FakeGroup(std::string name) : name_(std::move(name)) {}
  std::string group_name() const override { return name_; }
  std::optional<PendingCollective> oldest_unfinished() override {
    std::lock_guard lock(mutex_);
    return pending_;
  }
  std::string asynchronous_error() override {
    std::lock_guard lock(mutex_);
    return error_;
  }
  bool abort(const std::string& reason) override {
    std::lock_guard lock(mutex_);
    if (aborts_++ == 0) first_abort_ = ++abort_clock;
    abort_reason_ = reason;
    if (refusals_left_ > 0) {
      --refusals_left_;
      return false;
    }
    return true;
  }
  // The next `n` aborts cannot be done yet (a call of the group is inside NCCL).
  void refuse_aborts(int n) {
    std::lock_guard lock(mutex_);
    refusals_left_ = n;
  }

  void set_pending(std::optional<PendingCollective> p) {
    std::lock_guard lock(mutex_);
    pending_ = std::move(p);
  }
  void set_error(std::string e) {
    std::lock_guard lock(mutex_);
    error_ = std::move(e);
  }
  int aborts() const {
    std::lock_guard lock(mutex_);
    return aborts_;
  }
  std::string abort_reason() const {
    std::lock_guard lock(mutex_);
    return abort_reason_;
  }
  int first_abort() const {
    std::lock_guard lock(mutex_);
    return first_abort_;
  }

 private:
  std::string name_;
  mutable std::mutex mutex_;
  std::optional<PendingCollective> pending_;
  std::string error_;
  int aborts_ = 0;
  int refusals_left_ = 0;
  int first_abort_ = 0;
  std::string abort_reason_;
};

PendingCollective collective(uint64_t sequence, bool started) {
  return {sequence, "all-reduce of 64.0 MiB bf16", started};
}

TEST(CollectiveWatchdog, TimesAStartedCollectiveAndFiresOnlyAfterTheTimeout) {
  FakeGroup tensor("tensor-parallel group (world ranks 0-1)"), world("world (ranks 0-1)");
  CollectiveWatchdog dog(10.0, {&tensor, nullptr, &world});
  const Clock::time_point t0{};
  tensor.set_pending(collective(7, false));
  // Queued behind compute, however long: not the peers' fault, not timed.
  EXPECT_EQ(dog.check(t0), "");
  EXPECT_EQ(dog.check(t0 + std::chrono::seconds(60)), "");
  tensor.set_pending(collective(7, true));
  const Clock::time_point seen = t0 + std::chrono::seconds(61);
  EXPECT_EQ(dog.check(seen), "");
  EXPECT_EQ(dog.check(seen + milliseconds(9999)), "");
  EXPECT_EQ(tensor.aborts(), 0);
  const std::string reason = dog.check(seen + std::chrono::seconds(10));
  ASSERT_FALSE(reason.empty());
  EXPECT_NE(reason.find("all-reduce of 64.0 MiB bf16 (collective 7 of the tensor-parallel group "
                        "(world ranks 0-1))"),
            std::string::npos)
      << reason;
  EXPECT_NE(reason.find("collective timeout is 10 s"), std::string::npos) << reason;
  EXPECT_NE(reason.find("waited 10.0 s"), std::string::npos) << reason;
  // Every group is aborted, each once, with the same reason; later looks change nothing.
  EXPECT_EQ(tensor.aborts(), 1);
  EXPECT_EQ(world.aborts(), 1);
  EXPECT_EQ(world.abort_reason(), reason);
  EXPECT_EQ(dog.check(seen + std::chrono::seconds(100)), reason);
  EXPECT_EQ(tensor.aborts(), 1);
  EXPECT_EQ(dog.reason(), reason);
}

TEST(CollectiveWatchdog, CollectivesThatKeepFinishingNeverFire) {
  FakeGroup group("data-parallel group (world ranks 0-1)");
  CollectiveWatchdog dog(1.0, {&group});
  Clock::time_point now{};
  // Each collective finishes within the timeout, though together they run far longer.
  for (uint64_t seq = 1; seq <= 100; ++seq) {
    group.set_pending(collective(seq, true));
    EXPECT_EQ(dog.check(now), "");
    now += milliseconds(900);
    EXPECT_EQ(dog.check(now), "") << "collective " << seq;
  }
  // Nothing pending between steps, however long.
  group.set_pending(std::nullopt);
  EXPECT_EQ(dog.check(now + std::chrono::hours(1)), "");
  // The clock of a collective restarts when it is seen again after a gap.
  group.set_pending(collective(101, true));
  EXPECT_EQ(dog.check(now + std::chrono::hours(2)), "");
  EXPECT_EQ(dog.check(now + std::chrono::hours(2) + milliseconds(500)), "");
  EXPECT_EQ(group.aborts(), 0);
}

TEST(CollectiveWatchdog, AnAsynchronousErrorFiresAtOnce) {
  FakeGroup a("tensor-parallel group (world ranks 0-1)"), b("world (ranks 0-1)");
  CollectiveWatchdog dog(600.0, {&a, &b});
  EXPECT_EQ(dog.check(Clock::time_point{}), "");
  b.set_error("remote process exited or there was a network error (6)");
  const std::string reason = dog.check(Clock::time_point{});
  EXPECT_NE(reason.find("NCCL reports for the world (ranks 0-1): remote process exited"),
            std::string::npos)
      << reason;
  EXPECT_EQ(a.aborts(), 1);
  EXPECT_EQ(b.aborts(), 1);
}

TEST(CollectiveWatchdog, RefusesATimeoutThatIsNotPositive) {
  FakeGroup g("world");
  for (double bad : {0.0, -1.0}) {
    try {
      CollectiveWatchdog dog(bad, {&g});
      FAIL() << "accepted timeout " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("must be positive"), std::string::npos) << e.what();
    }
  }
}

TEST(CollectiveWatchdog, ItsThreadFiresOnAHungCollective) {
  FakeGroup group("tensor-parallel group (world ranks 0-1)");
  group.set_pending(collective(3, true));
  CollectiveWatchdog dog(0.2, {&group});
  dog.start(0.01);
  // Polled, not timed: waits for the abort however slow the machine, bounded by ctest's timeout.
  while (group.aborts() == 0) std::this_thread::sleep_for(milliseconds(5));
  EXPECT_NE(dog.reason().find("collective 3 of the tensor-parallel group"), std::string::npos);
  EXPECT_EQ(group.abort_reason(), dog.reason());
}

TEST(CollectiveWatchdog, ItsLastResortRunsOnlyWhenTheOwnerStaysStuckPastTheGrace) {
  // Stuck: fired, and the owner never destroys it within the grace.
  FakeGroup stuck("tensor-parallel group (world ranks 0-1)");
  stuck.set_pending(collective(5, true));
  std::atomic<int> calls{0};
  std::mutex mutex;
  std::string told;
  {
    CollectiveWatchdog dog(0.05, {&stuck});
    dog.set_last_resort(
        [&](const std::string& why) {
          std::lock_guard lock(mutex);
          told = why;
          ++calls;
        },
        0.1);
    dog.start(0.01);
    while (calls.load() == 0) std::this_thread::sleep_for(milliseconds(5));
    EXPECT_EQ(told, dog.reason());
  }
  EXPECT_EQ(calls.load(), 1);
  EXPECT_NE(told.find("collective 5 of the tensor-parallel group"), std::string::npos) << told;

  // Not stuck: the owner destroys the watchdog soon after it fired (its work failed and
  // unwound), long before the grace ends.
  FakeGroup freed("world group (world ranks 0-1)");
  freed.set_pending(collective(9, true));
  std::atomic<int> later{0};
  {
    CollectiveWatchdog dog(0.05, {&freed});
    dog.set_last_resort([&](const std::string&) { ++later; }, 3600.0);
    dog.start(0.01);
    while (freed.aborts() == 0) std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_EQ(later.load(), 0);
}

TEST(CollectiveWatchdog, AbortsTheStuckGroupFirstAndRetriesAnAbortThatCouldNotBeDone) {
  FakeGroup world("world group (world ranks 0-1)"),
      tensor("tensor-parallel group (world ranks 0-1)");
  tensor.set_pending(collective(4, true));
  tensor.refuse_aborts(3);
  CollectiveWatchdog dog(0.05, {&world, &tensor});
  dog.start(0.01);
  // Retried every poll until done: the fourth try succeeds.
  while (tensor.aborts() < 4) std::this_thread::sleep_for(milliseconds(5));
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(tensor.aborts(), 4) << "an abort that was done was asked again";
  EXPECT_EQ(world.aborts(), 1);
  EXPECT_LT(tensor.first_abort(), world.first_abort()) << "the stuck group is aborted first";
  EXPECT_NE(dog.reason().find("collective 4 of the tensor-parallel group"), std::string::npos);
}

TEST(CollectiveWatchdog, ItsThreadStopsWithTheWatchdog) {
  FakeGroup group("world");
  group.set_pending(collective(1, true));
  {
    CollectiveWatchdog dog(3600.0, {&group});
    dog.start(0.01);
    // Its looks belong to its thread now.
    EXPECT_THROW(dog.check(Clock::now()), Error);
    std::this_thread::sleep_for(milliseconds(30));
  }  // joins without waiting for the timeout
  EXPECT_EQ(group.aborts(), 0);
}

}  // namespace
}  // namespace megacpp::parallel
