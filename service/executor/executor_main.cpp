// megacpp-executor: runs one training job for the daemon. Started by megacppd
// with the job file and a pipe (--events-fd) on which it streams ExecutorEvents.
// A job on several GPUs runs one executor per rank (--rank, --rendezvous: the file
// where rank 0 leaves the NCCL id for the others); the daemon reads rank 0's steps
// and every rank's kernel receipts and failure.
// SIGTERM (cancel, daemon shutdown) or the daemon's death (the pipe breaks, or
// PR_SET_PDEATHSIG) make it finish the current step, checkpoint and exit 0.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "base/error.h"
#include "runtime/trainer/trainer.h"
#include "service/executor/event_stream.h"
#include "service/logging.h"

namespace {

std::atomic<bool> g_stop{false};

void request_stop(int) {
  g_stop.store(true);
}

class EventObserver final : public megacpp::TrainingObserver {
 public:
  explicit EventObserver(int fd) : fd_(fd) {}
  void on_start(const nlohmann::json& info) override {
    megacpp::v1::ExecutorEvent e;
    auto* s = e.mutable_started();
    s->set_first_step(info.value("first_step", int64_t{1}));
    s->set_total_steps(info.value("steps", int64_t{0}));
    s->set_parameters(info.value("parameters", int64_t{0}));
    s->set_info_json(info.dump());
    send(e);
  }
  void on_step(const megacpp::StepRecord& r) override {
    megacpp::v1::ExecutorEvent e;
    auto* s = e.mutable_step();
    s->set_step(r.step);
    s->set_loss(r.loss);
    s->set_grad_norm(r.grad_norm);
    s->set_lr(r.lr);
    s->set_tokens(r.tokens);
    s->set_step_ms(r.step_ms);
    s->set_tokens_per_s(r.tokens_per_s);
    s->set_flops_per_s(r.flops_per_s);
    send(e);
  }
  void on_eval(const megacpp::EvalRecord& r) override {
    megacpp::v1::ExecutorEvent e;
    e.mutable_eval()->set_step(r.step);
    e.mutable_eval()->set_val_loss(r.loss);
    send(e);
  }
  void on_checkpoint(int64_t step, const std::filesystem::path& dir) override {
    megacpp::v1::ExecutorEvent e;
    e.mutable_checkpoint()->set_step(step);
    e.mutable_checkpoint()->set_dir(dir.string());
    send(e);
  }
  void on_finish(const megacpp::RunSummary& summary) override {
    megacpp::v1::ExecutorEvent e;
    e.set_summary_json(megacpp::to_json(summary).dump());
    send(e);
  }
  void on_kernels(const std::vector<megacpp::KernelRecord>& kernels) override {
    for (const megacpp::KernelRecord& k : kernels) {
      megacpp::v1::ExecutorEvent e;
      auto* r = e.mutable_kernel();
      r->set_kernel(k.kernel);
      r->set_device(k.device);
      r->set_launch_json(k.launch.dump());
      r->set_registers(k.registers);
      r->set_static_smem(k.static_smem);
      r->set_dynamic_smem(k.dynamic_smem);
      r->set_occupancy(k.occupancy);
      r->set_time_ms_min(k.time_ms_min);
      r->set_time_ms_median(k.time_ms_median);
      r->set_time_ms_max(k.time_ms_max);
      r->set_samples(k.samples);
      send(e);
    }
  }
  void send_failure(const std::string& message) {
    megacpp::v1::ExecutorEvent e;
    e.set_failed(message);
    send(e);
  }

 private:
  void send(const megacpp::v1::ExecutorEvent& e) {
    // The collective watchdog's last resort sends from its own thread.
    std::lock_guard lock(send_mutex_);
    // A broken pipe means the daemon is gone: stop after this step, with a checkpoint.
    if (!megacpp::executor::write_event(fd_, e)) g_stop.store(true);
  }
  std::mutex send_mutex_;
  int fd_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megacpp-executor: runs one job for megacppd"};
  std::string job_file;
  int events_fd = -1;
  int rank = 0;
  std::string rendezvous;
  double collective_timeout = megacpp::TrainOptions{}.collective_timeout_seconds;
  app.add_option("--job", job_file, "job JSON file")->required();
  app.add_option("--events-fd", events_fd, "pipe to stream events on")->required();
  app.add_option("--rank", rank, "world rank of this process in a several-GPU job")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--rendezvous", rendezvous,
                 "file where rank 0 writes the NCCL unique id (several-GPU jobs)");
  app.add_option("--collective-timeout", collective_timeout,
                 "seconds a started collective may wait for the other ranks before the job "
                 "fails (several-GPU jobs); 0: no limit")
      ->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  // The daemon's death delivers SIGTERM; a closed pipe is noticed on write. A
  // signal mask inherited from the parent must not keep SIGTERM from us.
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() == 1) g_stop.store(true);
  struct sigaction stop {};
  stop.sa_handler = request_stop;
  sigemptyset(&stop.sa_mask);
  ::sigaction(SIGTERM, &stop, nullptr);
  ::sigaction(SIGINT, &stop, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  megacpp::log_to_stderr(rank > 0 ? fmt::format("%H:%M:%S.%e %l [rank {}] %v", rank)
                                  : std::string("%H:%M:%S.%e %l %v"));

  EventObserver observer(events_fd);
  try {
    const megacpp::TrainJob job = megacpp::load_train_job(job_file);
    megacpp::TrainOptions options;
    options.stop_requested = &g_stop;
    options.world_rank = rank;
    options.rendezvous = rendezvous;
    options.collective_timeout_seconds = collective_timeout;
    options.on_stuck_rank = [&observer](const std::string& reason) {
      const std::string message =
          reason +
          "; this rank's work was still stuck 5 s after the abort (a CUDA or NCCL call the "
          "abort does not reach), so its executor exits";
      spdlog::error("{}", message);
      observer.send_failure(message);
      std::_Exit(3);
    };
    megacpp::train(job, observer, options);
  } catch (const megacpp::Error& e) {
    spdlog::error("{}", e.what());
    observer.send_failure(e.what());
    return 2;
  } catch (const std::exception& e) {
    spdlog::error("internal error: {}", e.what());
    observer.send_failure(std::string("internal error: ") + e.what());
    return 1;
  }
  return 0;
}
