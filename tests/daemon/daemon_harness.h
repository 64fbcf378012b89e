#pragma once
// Starts a real megacppd (built beside the tests) on free ports with a temporary
// state directory, and gives tests gRPC stubs to it.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "megacpp/v1/jobs.grpc.pb.h"
#include "megacpp/v1/receipts.grpc.pb.h"
#include "megacpp/v1/status.grpc.pb.h"
#include "runtime/data/prepare.h"
#include "tests/support/temp_dir.h"

namespace megacpp::testing {

// Where megacppd and megacpp-executor are: the build's bin/, or MEGACPP_BIN_DIR where the tests
// run away from their build tree (a bundle on a GPU machine).
inline const std::string kBinDir = [] {
  const char* dir = std::getenv("MEGACPP_BIN_DIR");
  return dir != nullptr && *dir != '\0' ? std::string(dir)
                                        : std::string(MEGACPP_BINARY_DIR) + "/bin";
}();

// The live (not zombie) megacpp-executor children of `daemon`.
inline std::vector<pid_t> executor_pids(pid_t daemon) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close == std::string::npos || line.find("megacpp-execut") == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == daemon && state != 'Z') out.push_back(std::stoi(name));
  }
  return out;
}

// A /proc/PID/status figure in KiB ("VmRSS", "VmHWM"); -1 when unreadable.
inline int64_t process_status_kib(pid_t pid, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  }
  return -1;
}

class Daemon {
 public:
  // A toy dataset under root/data and a config under root; `edit` may change it.
  explicit Daemon(const std::function<void(nlohmann::json&)>& edit = {}) {
    for (int i = 0; i < 8; ++i) {
      write_text(dir_ / ("corpus/f" + std::to_string(i) + ".txt"),
                 pseudo_text(static_cast<uint64_t>(i), 400));
    }
    data::PrepareOptions prepare;
    prepare.input = dir_ / "corpus";
    prepare.output_prefix = dir_ / "data/toy";
    prepare.valid_fraction = 0.25;
    data::prepare_dataset(prepare);
    config_ = {{"listen_address", "127.0.0.1:0"},
               {"http_address", "127.0.0.1:0"},
               {"state_dir", (dir_ / "state").string()},
               {"data_roots", {(dir_ / "data").string()}},
               {"min_free_bytes", 1 << 20},
               {"devices", {{"cpu_slots", 2}}},
               {"executor_path", kBinDir + "/megacpp-executor"}};
    if (edit) edit(config_);
    std::ofstream(dir_ / "daemon.json") << config_.dump(2);
  }
  ~Daemon() { stop(SIGKILL); }

  // Starts megacppd; returns its exit code if it exits before serving, else -1.
  int start() {
    std::filesystem::remove(state() / "daemon.json");
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string log = (dir_ / "megacppd.log").string();
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      const std::string bin = kBinDir + "/megacppd", cfg = (dir_ / "daemon.json").string();
      ::execl(bin.c_str(), bin.c_str(), "--config", cfg.c_str(), nullptr);
      ::_exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = 0;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (std::filesystem::exists(state() / "daemon.json")) {
        const auto ready = nlohmann::json::parse(read_bytes(state() / "daemon.json"));
        grpc_address_ = ready["grpc"];
        http_address_ = ready["http"];
        channel_ = grpc::CreateChannel(grpc_address_, grpc::InsecureChannelCredentials());
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ADD_FAILURE() << "megacppd did not start; log:\n" << log();
    return -2;
  }

  // Sends `sig` and waits; returns the exit status as waitpid reports it.
  int stop(int sig = SIGTERM) {
    if (pid_ <= 0) return 0;
    ::kill(pid_, sig);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = 0;
    return status;
  }

  pid_t pid() const { return pid_; }
  std::string log() const { return read_bytes(dir_ / "megacppd.log"); }
  const TempDir& dir() const { return dir_; }
  std::filesystem::path state() const { return dir_ / "state"; }
  std::filesystem::path store_path() const { return dir_ / "state/receipts.db"; }
  std::string data(const std::string& split) const {
    return (dir_ / ("data/toy_" + split)).string();
  }
  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& http_address() const { return http_address_; }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  auto jobs() const { return megacpp::v1::JobService::NewStub(channel_); }
  auto receipts() const { return megacpp::v1::ReceiptService::NewStub(channel_); }
  auto status() const { return megacpp::v1::StatusService::NewStub(channel_); }

  // A small CPU job over the toy data.
  megacpp::v1::JobSpec small_job(int64_t steps) const {
    megacpp::v1::JobSpec spec;
    spec.set_name("test");
    spec.set_config_json(
        R"({"d_model": 32, "pattern": "M*", "d_intermediate": 32, "vocab_size": 257,
        "ssm_cfg": {"d_state": 16, "headdim": 16, "mimo_rank": 2, "chunk_size": 8},
        "attn_cfg": {"num_heads": 2, "rotary_emb_dim": 8}})");
    spec.set_train_data(data("train"));
    spec.set_valid_data(data("valid"));
    spec.set_steps(steps);
    spec.set_batch(2);
    spec.set_seqlen(32);
    spec.set_eval_interval(0);
    spec.set_checkpoint_interval(5);
    spec.set_threads(1);
    return spec;
  }

 private:
  TempDir dir_;
  nlohmann::json config_;
  pid_t pid_ = 0;
  std::string grpc_address_, http_address_;
  std::shared_ptr<grpc::Channel> channel_;
};

// The gRPC calls most tests make. Each creates its own context; a failed call is returned
// (submit, cancel_job) or is a test failure (get_job).
inline grpc::Status submit(const Daemon& d, const megacpp::v1::JobSpec& spec,
                           megacpp::v1::Job* job = nullptr) {
  grpc::ClientContext context;
  megacpp::v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  megacpp::v1::SubmitJobResponse response;
  const grpc::Status s = d.jobs()->SubmitJob(&context, request, &response);
  if (job) *job = response.job();
  return s;
}

inline megacpp::v1::Job get_job(const Daemon& d, const std::string& id) {
  grpc::ClientContext context;
  megacpp::v1::GetJobRequest request;
  request.set_id(id);
  megacpp::v1::Job job;
  const grpc::Status s = d.jobs()->GetJob(&context, request, &job);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return job;
}

inline grpc::Status cancel_job(const Daemon& d, const std::string& id) {
  grpc::ClientContext context;
  megacpp::v1::CancelJobRequest request;
  request.set_id(id);
  megacpp::v1::Job out;
  return d.jobs()->CancelJob(&context, request, &out);
}

// Whether the job is in a state it never leaves.
inline bool ended(const megacpp::v1::Job& j) {
  namespace v1 = megacpp::v1;
  return j.state() == v1::JOB_STATE_SUCCEEDED || j.state() == v1::JOB_STATE_FAILED ||
         j.state() == v1::JOB_STATE_CANCELLED || j.state() == v1::JOB_STATE_REFUSED;
}

// Polls GetJob until `done(job)` or the timeout (a test failure, with the daemon's log); returns
// the last job seen.
inline megacpp::v1::Job wait_for(const Daemon& d, const std::string& id,
                                 const std::function<bool(const megacpp::v1::Job&)>& done,
                                 int seconds = 120) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  megacpp::v1::Job job;
  while (std::chrono::steady_clock::now() < deadline) {
    job = get_job(d, id);
    if (done(job)) return job;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << "timed out waiting on " << id << ", state "
                << megacpp::v1::JobState_Name(job.state()) << "\n"
                << d.log();
  return job;
}

struct CliRun {
  int code = -1;  // the exit code; -1 when killed
  std::string out, err;
};

// Runs the megacpp CLI with `args` (each quoted), its stdout and stderr kept apart in files
// under `dir`.
inline CliRun run_cli(const std::filesystem::path& dir, const std::vector<std::string>& args) {
  static int runs = 0;
  const std::string name = "cli-" + std::to_string(runs++);
  const auto out = dir / (name + ".out"), err = dir / (name + ".err");
  std::string command = "'" + kBinDir + "/megacpp'";
  for (const auto& a : args) command += " '" + a + "'";
  command += " >'" + out.string() + "' 2>'" + err.string() + "'";
  const int status = std::system(command.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_bytes(out), read_bytes(err)};
}

}  // namespace megacpp::testing
