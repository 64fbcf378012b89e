// megacpp: the command-line client. Every subcommand is a function under cli/commands/
// (commands.h lists them); this file parses the command line, runs the one named, and turns an
// error that escapes it into the exit code of cli/commands/exit_codes.h.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>

#include <exception>

#include "base/error.h"
#include "base/version.h"
#include "cli/commands/commands.h"
#include "cli/commands/exit_codes.h"
#include "service/logging.h"

int main(int argc, char** argv) {
  namespace cli = megacpp::cli;
  CLI::App app{"megacpp: train hybrid Mamba-3 / attention language models"};
  app.set_version_flag("--version", megacpp::version_string());
  app.require_subcommand(1);
  cli::GlobalOptions global;
  app.add_flag("--json", global.json, "machine-readable output");

  // The order here is the order `megacpp --help` lists them in.
  cli::CommandTable commands;
  cli::add_train_commands(app, commands);
  cli::add_data_commands(app, commands);
  cli::add_job_commands(app, commands);
  cli::add_receipt_commands(app, commands);
  cli::add_daemon_commands(app, commands);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error exits like bad input.
    return app.exit(e) == 0 ? cli::kExitOk : cli::kExitInvalid;
  }
  megacpp::log_to_stderr("%H:%M:%S.%e %^%l%$ %v");
  try {
    return commands.run(global);
  } catch (const megacpp::Error& e) {
    spdlog::error("{}", e.what());
    return cli::exit_code(e.kind());
  } catch (const std::exception& e) {
    spdlog::error("internal error: {}", e.what());
    return cli::kExitFailed;
  }
}
