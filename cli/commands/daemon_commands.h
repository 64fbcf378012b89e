#pragma once
// The CLI's daemon-facing subcommands (gRPC clients of megacppd) and doctor.
#include <CLI/CLI.hpp>

#include <functional>
#include <string>

namespace megacpp::cli {

struct GlobalOptions {
  bool json = false;
};

// Registers the subcommands on `app`; returns a runner that executes whichever
// of them was parsed and returns the exit code, or -1 if none of them was.
std::function<int()> add_daemon_commands(CLI::App& app, const GlobalOptions& global);

// Exit codes scripts can rely on.
enum ExitCode {
  kExitOk = 0,
  kExitFailed = 1,        // the job failed or was cancelled; an internal error
  kExitInvalid = 2,       // bad usage or bad input (named on stderr)
  kExitRefused = 3,       // a precondition or feature gate refused it
  kExitNotFound = 4,      // no such job or receipt
  kExitUnavailable = 5,   // the daemon cannot be reached
  kExitUnauthenticated = 6,
};

}  // namespace megacpp::cli
