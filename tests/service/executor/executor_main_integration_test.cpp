// megacpp-executor as the daemon starts it: events on --events-fd, logs on stderr. Its stdout is
// left empty, so nothing the executor logs can be taken for output.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "service/executor/event_stream.h"
#include "tests/support/temp_dir.h"

namespace megacpp::executor {
namespace {

TEST(ExecutorMain, AFailureIsLoggedOnStderrAndSentAsAnEvent) {
  testing::TempDir dir;
  const std::string bin = std::string(MEGACPP_BINARY_DIR) + "/bin/megacpp-executor";
  const std::string job = (dir / "missing-job.json").string();
  const std::string out = (dir / "stdout.txt").string(), err = (dir / "stderr.txt").string();
  int events[2] = {-1, -1};
  ASSERT_EQ(::pipe(events), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(events[1], 3);
    ::dup2(::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), 1);
    ::dup2(::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), 2);
    ::execl(bin.c_str(), bin.c_str(), "--job", job.c_str(), "--events-fd", "3", nullptr);
    ::_exit(127);
  }
  ASSERT_GT(pid, 0);
  ::close(events[1]);
  std::string failure;
  {
    EventReader reader(events[0]);
    while (const auto event = reader.next()) {
      if (event->has_failed()) failure = event->failed();
    }
  }
  ::close(events[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const std::string logged = testing::read_bytes(err);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << status << "\n" << logged;
  EXPECT_NE(failure.find("missing-job.json"), std::string::npos) << failure;
  EXPECT_NE(logged.find("missing-job.json"), std::string::npos) << logged;
  EXPECT_EQ(testing::read_bytes(out), "") << "stderr:\n" << logged;
}

}  // namespace
}  // namespace megacpp::executor
