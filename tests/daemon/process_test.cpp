// megacppd as a process among others: one daemon per state directory and per port, a boot
// history that tells a crash from a stop, --check, and an HTTP endpoint that idle or slow
// clients cannot take down.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "receipts/store.h"
#include "tests/daemon/daemon_harness.h"

namespace megacpp {
namespace {

namespace v1 = megacpp::v1;
namespace fs = std::filesystem;
using testing::Daemon;

struct Exit {
  int code = -1;  // the exit status, 128 + signal when killed, -1 when it had to be killed
  std::string output;
};

// Runs megacppd with `args` to its end (killed after `seconds`: it was expected to exit).
Exit run_megacppd(const std::vector<std::string>& args, const fs::path& log, int seconds = 90) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    const std::string bin = testing::kBinDir + "/megacppd";
    std::vector<char*> argv = {const_cast<char*>(bin.c_str())};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  Exit out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      out.output = testing::read_bytes(log);
      ADD_FAILURE() << "megacppd " << args.front() << " did not exit within " << seconds
                    << " s; output:\n"
                    << out.output;
      return out;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  out.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  out.output = testing::read_bytes(log);
  return out;
}

// The announced addresses of a serving daemon (its state_dir/daemon.json).
nlohmann::json ready_file(const Daemon& d) {
  return nlohmann::json::parse(testing::read_bytes(d.state() / "daemon.json"));
}

bool status_ok(const Daemon& d) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::Status status;
  return d.status()->GetStatus(&context, v1::GetStatusRequest(), &status).ok();
}

TEST(DaemonProcess, SecondDaemonOnTheSameStateDirExitsNamingTheHolder) {
  Daemon first;
  ASSERT_EQ(first.start(), -1) << first.log();
  const Exit second = run_megacppd({"--config", (first.dir() / "daemon.json").string()},
                                   first.dir() / "second.log");
  EXPECT_EQ(second.code, 3) << second.output;
  EXPECT_NE(second.output.find("state_dir " + first.state().string()), std::string::npos)
      << second.output;
  EXPECT_NE(second.output.find("pid " + std::to_string(first.pid())), std::string::npos)
      << second.output;
  EXPECT_EQ(second.output.find("serving gRPC"), std::string::npos) << second.output;
  // The first daemon is undisturbed: still serving, its boot still "serving".
  EXPECT_TRUE(status_ok(first));
  receipts::Store store(first.store_path(), receipts::OpenMode::kReadOnly);
  const auto boots = store.list_boots(5);
  ASSERT_EQ(boots.size(), 1u);
  EXPECT_EQ(boots[0].status, "serving");
  EXPECT_EQ(ready_file(first)["pid"], first.pid());
}

TEST(DaemonProcess, SecondDaemonOnTheSamePortsExitsNamingTheAddress) {
  Daemon first;
  ASSERT_EQ(first.start(), -1) << first.log();
  const std::string grpc_address = ready_file(first)["grpc"];
  const std::string http_address = first.http_address();
  // Its own state directory, the first daemon's gRPC port.
  Daemon grpc_clash([&](nlohmann::json& c) { c["listen_address"] = grpc_address; });
  const int grpc_code = grpc_clash.start();
  EXPECT_EQ(grpc_code, 3) << grpc_clash.log();
  EXPECT_NE(grpc_clash.log().find("listen_address " + grpc_address), std::string::npos)
      << grpc_clash.log();
  EXPECT_NE(grpc_clash.log().find("pid " + std::to_string(first.pid())), std::string::npos)
      << grpc_clash.log();
  // Its own state directory, the first daemon's HTTP port.
  Daemon http_clash([&](nlohmann::json& c) { c["http_address"] = http_address; });
  const int http_code = http_clash.start();
  EXPECT_EQ(http_code, 3) << http_clash.log();
  EXPECT_NE(http_clash.log().find("http_address " + http_address), std::string::npos)
      << http_clash.log();
  // Both refused before serving, and recorded so.
  for (const Daemon* d : {&grpc_clash, &http_clash}) {
    receipts::Store store(d->store_path(), receipts::OpenMode::kReadOnly);
    const auto boots = store.list_boots(5);
    ASSERT_EQ(boots.size(), 1u) << d->log();
    EXPECT_EQ(boots[0].status, "refused") << d->log();
  }
  EXPECT_TRUE(status_ok(first));
}

TEST(DaemonProcess, CheckExitsZeroAndRecordsACheckedBoot) {
  Daemon d;
  const Exit check =
      run_megacppd({"--config", (d.dir() / "daemon.json").string(), "--check"}, d.dir() / "c.log");
  EXPECT_EQ(check.code, 0) << check.output;
  EXPECT_NE(check.output.find("state_dir"), std::string::npos) << check.output;
  receipts::Store store(d.store_path(), receipts::OpenMode::kReadOnly);
  const auto boots = store.list_boots(5);
  ASSERT_EQ(boots.size(), 1u);
  EXPECT_EQ(boots[0].status, "checked");
  // A boot that does not serve asks nothing of CUDA (which would open the driver).
  EXPECT_EQ(boots[0].cuda_runtime, "");
  EXPECT_EQ(boots[0].cuda_driver, "");
  EXPECT_FALSE(store.preconditions(boots[0].id).empty());
  // A check while a daemon serves neither disturbs it nor marks its boot.
  ASSERT_EQ(d.start(), -1) << d.log();
  const Exit again =
      run_megacppd({"--config", (d.dir() / "daemon.json").string(), "--check"}, d.dir() / "c2.log");
  EXPECT_EQ(again.code, 0) << again.output;
  EXPECT_TRUE(status_ok(d));
  EXPECT_EQ(store.get_boot(ready_file(d)["boot_id"].get<int64_t>())->status, "serving");
}

// Its logs go to stderr (spdlog's default logger would write them to stdout, which is for what
// megacppd is asked to print: the --check table): a daemon that starts, serves and stops with
// every log at debug writes nothing on stdout.
TEST(DaemonProcess, LogsGoToStderrAndLeaveStdoutEmpty) {
  Daemon d;
  const fs::path out = d.dir() / "stdout.txt", err = d.dir() / "stderr.txt";
  const std::string bin = testing::kBinDir + "/megacppd", cfg = (d.dir() / "daemon.json").string();
  std::vector<std::string> env = {"SPDLOG_LEVEL=debug"};
  for (char** e = environ; *e != nullptr; ++e) {
    if (!std::string_view(*e).starts_with("SPDLOG_LEVEL=")) env.emplace_back(*e);
  }
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const char* argv[] = {bin.c_str(), "--config", cfg.c_str(), nullptr};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), 1);
    ::dup2(::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), 2);
    ::execve(bin.c_str(), const_cast<char**>(argv), envp.data());
    ::_exit(127);
  }
  ASSERT_GT(pid, 0);
  int status = 0;
  bool exited = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(d.state() / "daemon.json") && std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!exited) {
    ::kill(pid, SIGTERM);
    ::waitpid(pid, &status, 0);
  }
  const std::string printed = testing::read_bytes(out), logged = testing::read_bytes(err);
  EXPECT_FALSE(exited) << "megacppd exited before serving; stderr:\n" << logged;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << logged;
  EXPECT_EQ(printed, "") << "stderr:\n" << logged;
  EXPECT_NE(logged.find("serving gRPC"), std::string::npos) << logged;
  EXPECT_NE(logged.find("stopped cleanly"), std::string::npos) << logged;
}

// The kernel hands a process-directed SIGTERM to any thread that does not block it, such as one a
// library started before main blocked the stop signals (such a thread's default action killed the
// daemon mid-start, once, in CI): sent to each of the daemon's threads, then to the process, it
// still stops the daemon cleanly, and the boot is recorded as stopped.
TEST(DaemonProcess, SigtermThroughAnyOfItsThreadsStopsItCleanly) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  const int64_t boot = ready_file(d)["boot_id"];
  const pid_t pid = d.pid();
  for (const auto& task : fs::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
    const pid_t thread = static_cast<pid_t>(std::stol(task.path().filename().string()));
    if (thread != pid) ::syscall(SYS_tgkill, pid, thread, SIGTERM);
  }
  const int status = d.stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << d.log();
  EXPECT_NE(d.log().find("stopped cleanly"), std::string::npos) << d.log();
  receipts::Store store(d.store_path(), receipts::OpenMode::kReadOnly);
  EXPECT_EQ(store.get_boot(boot)->status, "stopped");
}

TEST(DaemonProcess, KilledDaemonsBootIsMarkedCrashedAtTheNextStart) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  const int64_t killed = ready_file(d)["boot_id"];
  d.stop(SIGKILL);
  {
    receipts::Store store(d.store_path(), receipts::OpenMode::kReadOnly);
    EXPECT_EQ(store.get_boot(killed)->status, "serving");  // nothing could record the kill
  }
  ASSERT_EQ(d.start(), -1) << d.log();
  const int64_t current = ready_file(d)["boot_id"];
  ASSERT_NE(current, killed);
  // Read through the service, as `megacpp receipts boots` does.
  grpc::ClientContext context;
  v1::ListBootsResponse listed;
  ASSERT_TRUE(d.receipts()->ListBoots(&context, v1::ListBootsRequest(), &listed).ok());
  ASSERT_EQ(listed.boots_size(), 2);
  EXPECT_EQ(listed.boots(0).id(), current);
  EXPECT_EQ(listed.boots(0).status(), "serving");
  EXPECT_EQ(listed.boots(1).id(), killed);
  EXPECT_EQ(listed.boots(1).status(), "crashed");
  // A negative count or cursor is refused naming the field, not replaced by the default.
  for (const auto& [field, set] :
       std::vector<std::pair<std::string, std::function<void(v1::ListBootsRequest&)>>>{
           {"limit=-3",
            [](v1::ListBootsRequest& r) {
              r.set_limit(-3);
            }},
           {"before_id=-1", [](v1::ListBootsRequest& r) {
              r.set_before_id(-1);
            }}}) {
    grpc::ClientContext bad_context;
    v1::ListBootsRequest bad;
    set(bad);
    v1::ListBootsResponse none;
    const grpc::Status refused = d.receipts()->ListBoots(&bad_context, bad, &none);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_NE(refused.error_message().find(field), std::string::npos) << refused.error_message();
  }
  EXPECT_EQ(d.stop(SIGTERM), 0);
  receipts::Store store(d.store_path(), receipts::OpenMode::kReadOnly);
  EXPECT_EQ(store.get_boot(current)->status, "stopped");
  EXPECT_EQ(store.get_boot(killed)->status, "crashed");
}

int connect_to(const std::string& address) {
  const auto colon = address.rfind(':');
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &to.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0) << address;
  return fd;
}

TEST(DaemonProcess, HealthAndMetricsAnswerWhileManyHttpClientsSitIdleOrSlow) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  // 24 clients that connect and say nothing, 8 that start a request and stall: before the fix
  // they took all 8 of httplib's workers for 5 s each, and /healthz waited ~20 s behind them.
  std::vector<int> clients;
  for (int i = 0; i < 32; ++i) {
    clients.push_back(connect_to(d.http_address()));
    if (i % 4 == 0) {
      const std::string partial = "GET /healthz HTTP/1.1\r\nHost: x\r\n";
      ASSERT_EQ(::send(clients.back(), partial.data(), partial.size(), MSG_NOSIGNAL),
                static_cast<ssize_t>(partial.size()));
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the server take them all
  const auto colon = d.http_address().rfind(':');
  httplib::Client http(d.http_address().substr(0, colon),
                       std::stoi(d.http_address().substr(colon + 1)));
  http.set_connection_timeout(8, 0);
  http.set_read_timeout(8, 0);
  const auto started = std::chrono::steady_clock::now();
  auto health = http.Get("/healthz");
  ASSERT_TRUE(health) << "no /healthz answer within 8 s: " << httplib::to_string(health.error());
  EXPECT_EQ(health->status, 200);
  auto metrics = http.Get("/metrics");
  ASSERT_TRUE(metrics) << httplib::to_string(metrics.error());
  EXPECT_EQ(metrics->status, 200);
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(8));
  // The idle and stalled connections are dropped by the server (idle timeout 2 s, I/O timeout
  // 10 s), not kept forever.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  size_t closed = 0;
  for (int fd : clients) {
    pollfd p{fd, POLLIN, 0};
    while (std::chrono::steady_clock::now() < deadline) {
      if (::poll(&p, 1, 200) > 0) {
        char byte;
        if (::recv(fd, &byte, 1, 0) <= 0) {
          ++closed;
          break;
        }
      }
    }
    ::close(fd);
  }
  EXPECT_EQ(closed, clients.size());
}

TEST(DaemonProcess, HttpWorkersAndTimeoutsAreConfigurableAndChecked) {
  Daemon bad([](nlohmann::json& c) { c["http"] = {{"workers", 0}}; });
  EXPECT_EQ(bad.start(), 2) << bad.log();
  EXPECT_NE(bad.log().find("http.workers=0 must be positive"), std::string::npos) << bad.log();
  Daemon unknown([](nlohmann::json& c) { c["http"] = {{"idle_timeout", 5}}; });
  EXPECT_EQ(unknown.start(), 2) << unknown.log();
  EXPECT_NE(unknown.log().find("http.idle_timeout"), std::string::npos) << unknown.log();
  // Two workers and a 1 s idle timeout: /healthz still answers behind two idle clients.
  Daemon small([](nlohmann::json& c) {
    c["http"] = {{"workers", 2}, {"idle_timeout_seconds", 1}, {"io_timeout_seconds", 1}};
  });
  ASSERT_EQ(small.start(), -1) << small.log();
  const int a = connect_to(small.http_address()), b = connect_to(small.http_address());
  const auto colon = small.http_address().rfind(':');
  httplib::Client http(small.http_address().substr(0, colon),
                       std::stoi(small.http_address().substr(colon + 1)));
  http.set_read_timeout(30, 0);
  auto health = http.Get("/healthz");
  ASSERT_TRUE(health) << httplib::to_string(health.error());
  EXPECT_EQ(health->status, 200);
  ::close(a);
  ::close(b);
}

}  // namespace
}  // namespace megacpp
