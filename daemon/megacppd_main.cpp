// megacppd: the long-running service that owns this machine's devices. Startup:
// config → preconditions (nothing served and no device touched if one fails) →
// boot receipt → recovery of interrupted jobs → gRPC + HTTP. SIGTERM/SIGINT:
// stop accepting, checkpoint and stop executors, flush the store, exit 0.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cerrno>

#include <csignal>
#include <fstream>
#include <iostream>

#include "base/atomic_file.h"
#include "base/error.h"
#include "base/version.h"
#include "daemon/boot.h"
#include "daemon/http_endpoint.h"
#include "daemon/job_manager.h"
#include "daemon/metrics.h"
#include "daemon/services.h"
#include "receipts/batched_writer.h"
#include "receipts/store.h"
#include "service/config/daemon_config.h"
#include "service/logging.h"
#include "service/preconditions/preconditions.h"

namespace {

std::string read_secret(const std::filesystem::path& file, const char* what) {
  std::string text = megacpp::read_file(file);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' '))
    text.pop_back();
  if (text.empty())
    megacpp::fail(megacpp::ErrorKind::kInvalidArgument, "{} {} is empty", what, file.string());
  return text;
}

std::vector<megacpp::receipts::PreconditionResult> to_receipts(
    const std::vector<megacpp::preconditions::CheckResult>& checks, int64_t boot_id) {
  std::vector<megacpp::receipts::PreconditionResult> out;
  const std::string now = megacpp::daemon::now_iso8601();
  for (const auto& c : checks) {
    const char* status = c.status == megacpp::preconditions::CheckResult::Status::kPass   ? "pass"
                         : c.status == megacpp::preconditions::CheckResult::Status::kFail ? "fail"
                                                                                          : "skip";
    out.push_back({boot_id, c.name, status, c.detail, c.fix, now});
  }
  return out;
}

// Whether an address from the config only accepts connections from this host.
bool local_only(const std::string& address) {
  if (address.empty() || address.starts_with("unix:")) return true;
  const std::string host = address.substr(0, address.rfind(':'));
  return host == "localhost" || host == "[::1]" || host.starts_with("127.");
}

// The main thread, which takes the stop signals with sigwait (see main).
pid_t main_thread_id = 0;

// A stop signal that reaches another thread, one that does not block it (a thread a library
// started before main blocked the signals), is forwarded to the main thread, where it stays
// pending until sigwait takes it. Without this, the default action of SIGTERM killed the process
// whenever it arrived while the main thread was not yet in sigwait (after daemon.json was
// written): no clean stop, no "stopped" boot receipt.
void forward_stop_signal(int signal_number) {
  const int saved_errno = errno;
  ::syscall(SYS_tgkill, ::getpid(), main_thread_id, signal_number);
  errno = saved_errno;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megacppd: the megacpp training daemon"};
  app.set_version_flag("--version", megacpp::version_string());
  std::string config_file = "configs/daemon.json";
  bool check_only = false;
  app.add_option("--config", config_file, "daemon config JSON")->capture_default_str();
  app.add_flag("--check", check_only,
               "run the preconditions, print them and exit (megacpp doctor)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  megacpp::log_to_stderr("%Y-%m-%d %H:%M:%S.%e %^%l%$ %v");
  // Block the stop signals in every thread; one thread waits for them below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  main_thread_id = static_cast<pid_t>(::syscall(SYS_gettid));
  struct sigaction forward = {};
  forward.sa_handler = forward_stop_signal;
  sigemptyset(&forward.sa_mask);
  forward.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &forward, nullptr);
  ::sigaction(SIGINT, &forward, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  namespace mc = megacpp;
  try {
    const mc::DaemonConfig config = mc::load_daemon_config(config_file);
    const auto checks = mc::preconditions::run_preconditions(config.precondition_config());
    const bool passed = mc::preconditions::all_passed(checks);
    if (check_only || !passed) std::cout << mc::preconditions::format_report(checks);
    // The store, when usable, records even a refused boot.
    std::unique_ptr<mc::receipts::Store> store;
    try {
      store = std::make_unique<mc::receipts::Store>(config.store_path,
                                                    mc::receipts::OpenMode::kReadWrite);
    } catch (const std::exception& e) {
      spdlog::error("receipt store {} unusable: {}", config.store_path.string(), e.what());
    }
    if (!passed || check_only) {
      if (store) {
        auto boot = mc::daemon::describe_boot(mc::daemon::inventory_devices(config, false), false);
        boot.status = passed ? "checked" : "refused";
        const int64_t id = store->insert_boot(boot);
        store->insert_preconditions(to_receipts(checks, id));
      }
      if (!passed) {
        spdlog::error("a startup precondition failed: not serving (see the table on stdout)");
        return 3;
      }
      return 0;
    }
    if (!store) mc::fail(mc::ErrorKind::kFailedPrecondition, "the receipt store cannot be opened");

    // One daemon per state directory and per store, taken before this daemon writes anything
    // that assumes it is alone: two daemons would run each other's jobs twice, and the crash
    // marking below would mark a live daemon's boot.
    const mc::daemon::DaemonLock state_lock(config.state_dir / "megacppd.lock",
                                            "state_dir " + config.state_dir.string());
    const mc::daemon::DaemonLock store_lock(config.store_path.string() + ".lock",
                                            "store_path " + config.store_path.string());

    const auto devices = mc::daemon::inventory_devices(config, true);
    auto boot = mc::daemon::describe_boot(devices, true);
    const int64_t boot_id = store->insert_boot(boot);
    store->insert_preconditions(to_receipts(checks, boot_id));
    if (const int64_t crashed = store->mark_unfinished_boots_crashed(boot_id); crashed > 0) {
      spdlog::warn(
          "{} earlier boot(s) were still starting or serving (the daemon was killed): "
          "marked crashed",
          crashed);
    }
    mc::receipts::BatchedWriter writer(*store);  // the daemon is the store's only writer

    const auto executor = config.executor_path_for(std::filesystem::canonical("/proc/self/exe"));
    mc::daemon::DaemonMetrics metrics;
    mc::daemon::JobManager jobs(config, writer, config.store_path, boot_id, devices, executor,
                                metrics);

    std::string token;
    if (!config.security.token_file.empty())
      token = read_secret(config.security.token_file, "security.token_file");
    mc::daemon::TokenCheck auth(token);
    if (auth.required() && config.security.tls_cert_file.empty() &&
        !(local_only(config.listen_address) && local_only(config.http_address))) {
      spdlog::warn(
          "security.token_file is set but TLS is not (security.tls_cert_file): the token "
          "crosses the network in the clear to listen_address {} / http_address {}",
          config.listen_address, config.http_address);
    }
    mc::daemon::StatusSource status_source(jobs, metrics, config.store_path, boot_id);
    mc::daemon::JobServiceImpl job_service(jobs, auth);
    mc::daemon::ReceiptServiceImpl receipt_service(config.store_path, auth);
    const mc::daemon::ReceiptQueries web_receipts(config.store_path);
    mc::daemon::StatusServiceImpl status_service(status_source, auth);

    // Both ports before any job is recovered: a daemon that cannot serve must not start (and
    // then interrupt) executors.
    std::unique_ptr<mc::daemon::HttpEndpoint> http;
    try {
      if (!config.http_address.empty()) {
        mc::daemon::HttpOptions http_options;
        http_options.workers = config.http.workers;
        http_options.idle_timeout_seconds = config.http.idle_timeout_seconds;
        http_options.io_timeout_seconds = config.http.io_timeout_seconds;
        http_options.auth = &auth;
        http_options.public_metrics = config.security.public_metrics;
        http_options.tls_cert_file = config.security.tls_cert_file;
        http_options.tls_key_file = config.security.tls_key_file;
        http = std::make_unique<mc::daemon::HttpEndpoint>(status_source, jobs, web_receipts,
                                                          config.http_address, http_options);
        http->bind();
      }
      mc::daemon::check_port_free("listen_address", config.listen_address);
    } catch (const std::exception&) {
      writer.enqueue(mc::receipts::BootStatusUpdate{boot_id, "refused"});
      writer.flush();
      throw;
    }

    jobs.recover();
    writer.flush();
    jobs.start();

    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    // gRPC sets SO_REUSEPORT by default: a second daemon on the same port would bind too and
    // take half the connections.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> guards;
    guards.push_back(std::make_unique<mc::daemon::RequestGuardFactory>(auth));
    builder.experimental().SetInterceptorCreators(std::move(guards));
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
    if (!config.security.tls_cert_file.empty()) {
      grpc::SslServerCredentialsOptions ssl;
      ssl.pem_key_cert_pairs.push_back(
          {read_secret(config.security.tls_key_file, "security.tls_key_file"),
           read_secret(config.security.tls_cert_file, "security.tls_cert_file")});
      credentials = grpc::SslServerCredentials(ssl);
    }
    int port = 0;
    builder.AddListeningPort(config.listen_address, credentials, &port);
    builder.SetMaxReceiveMessageSize(static_cast<int>(config.limits.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(config.limits.max_message_bytes));
    builder.RegisterService(&job_service);
    builder.RegisterService(&receipt_service);
    builder.RegisterService(&status_service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    // From here submissions may be writing too: the daemon flushes its own records ("": of no
    // job) and leaves each job's failures to that job's flush.
    if (!server || port == 0) {
      writer.enqueue(mc::receipts::BootStatusUpdate{boot_id, "refused"});
      writer.flush("");
      mc::fail(mc::ErrorKind::kFailedPrecondition,
               "listen_address {}: cannot listen: the port is in use (only one process may "
               "serve it), or the address is not local",
               config.listen_address);
    }
    if (http) http->start();
    writer.enqueue(mc::receipts::BootStatusUpdate{boot_id, "serving"});
    writer.flush("");
    // Announce the real ports (a config may ask for port 0): tests and scripts read this.
    const std::string host = config.listen_address.substr(0, config.listen_address.rfind(':'));
    const nlohmann::json ready = {{"grpc", host + ":" + std::to_string(port)},
                                  {"http", http ? host + ":" + std::to_string(http->port()) : ""},
                                  {"pid", ::getpid()},
                                  {"boot_id", boot_id}};
    mc::write_file_atomically(config.state_dir / "daemon.json", ready.dump() + "\n");
    spdlog::info("megacppd serving gRPC on {}:{}{}, boot {}", host, port,
                 http ? ", HTTP on port " + std::to_string(http->port()) : "", boot_id);

    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    spdlog::info("signal {}: stopping (executors checkpoint first)", signal_number);
    jobs.shutdown();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (http) http->stop();
    writer.enqueue(mc::receipts::BootStatusUpdate{boot_id, "stopped"});
    writer.flush("");
    spdlog::info("stopped cleanly");
    return 0;
  } catch (const megacpp::Error& e) {
    spdlog::error("{}", e.what());
    // Refused before serving (a lock, a port, the store): the same code as a failed check.
    return e.kind() == megacpp::ErrorKind::kFailedPrecondition ? 3 : 2;
  } catch (const std::exception& e) {
    spdlog::error("internal error: {}", e.what());
    return 1;
  }
}
