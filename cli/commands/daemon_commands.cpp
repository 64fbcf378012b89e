// status (a StatusService client) and doctor (the daemon's startup checks, run here).
#include <fmt/format.h>
#include <iostream>
#include <string>

#include "cli/commands/client.h"
#include "cli/commands/commands.h"
#include "cli/commands/output.h"
#include "megacpp/v1/status.grpc.pb.h"
#include "service/config/daemon_config.h"
#include "service/preconditions/preconditions.h"

namespace megacpp::cli {
namespace {

namespace v1 = megacpp::v1;

struct StatusArgs {
  ClientOptions client;
};

int status(const StatusArgs& args, const GlobalOptions& global) {
  auto stub = v1::StatusService::NewStub(args.client.channel());
  v1::Status out;
  grpc::ClientContext context;
  args.client.prepare(context);
  if (auto s = stub->GetStatus(&context, v1::GetStatusRequest(), &out); !s.ok()) return report(s);
  if (global.json) {
    print_json(out);
    return kExitOk;
  }
  fmt::print("{}  up {}  boot {}  queue {}  store {} bytes\n", out.version(),
             duration_text(out.uptime_seconds()), out.boot().id(), out.queue_depth(),
             out.store_bytes());
  for (const auto& d : out.devices()) {
    fmt::print("  {:8} {:6} {:24} {}\n", d.id(), d.kind(), d.name(),
               d.held_by().empty() ? "free" : "held by " + d.held_by());
  }
  for (const auto& j : out.running()) print_job(j);
  for (const auto& j : out.queued()) print_job(j);
  return kExitOk;
}

void add_status(CLI::App& app, CommandTable& commands) {
  auto* command = app.add_subcommand("status", "the daemon's status");
  auto& args = commands.add(command, status);
  add_client_options(command, args.client);
}

struct DoctorArgs {
  std::string config = "configs/daemon.json";
};

// --json does not apply: the report is the table megacppd itself prints when it refuses to
// start.
int doctor(const DoctorArgs& args, const GlobalOptions&) {
  const DaemonConfig config = load_daemon_config(args.config);
  const auto checks = preconditions::run_preconditions(config.precondition_config());
  std::cout << preconditions::format_report(checks);
  return preconditions::all_passed(checks) ? kExitOk : kExitRefused;
}

void add_doctor(CLI::App& app, CommandTable& commands) {
  auto* command =
      app.add_subcommand("doctor", "run the daemon's startup preconditions here, without serving");
  auto& args = commands.add(command, doctor);
  command->add_option("--config", args.config, "daemon config")->capture_default_str();
}

}  // namespace

void add_daemon_commands(CLI::App& app, CommandTable& commands) {
  add_status(app, commands);
  add_doctor(app, commands);
}

}  // namespace megacpp::cli
