#pragma once
// The megacpp subcommands. Each is a pair of functions in its group's file: add_NAME declares the
// command and its flags on the app, NAME runs it once the command line has parsed and returns
// its exit code (cli/commands/exit_codes.h). A command reports its own refusals with their exit
// code; a megacpp::Error it lets escape is mapped by the same table in main.
#include <CLI/CLI.hpp>

#include <functional>
#include <memory>
#include <vector>

#include "cli/commands/exit_codes.h"

namespace megacpp::cli {

// Options given before the subcommand.
struct GlobalOptions {
  bool json = false;
};

// Which function runs which subcommand.
class CommandTable {
 public:
  // Registers `body` to run `command`; returns the arguments object for the command's flags to
  // fill in. It lives as long as the table, so the flags may bind to its fields.
  template <typename Args>
  Args& add(CLI::App* command, int (*body)(const Args&, const GlobalOptions&)) {
    auto args = std::make_shared<Args>();
    entries_.push_back({command, [args, body](const GlobalOptions& g) {
                          return body(*args, g);
                        }});
    return *args;
  }

  // Runs the subcommand the command line named.
  int run(const GlobalOptions& global) const {
    for (const Entry& entry : entries_) {
      if (entry.command->parsed()) return entry.run(global);
    }
    // The app requires a subcommand and every leaf command has an entry, so parsing already
    // refused a command line that gets here.
    return kExitInvalid;
  }

 private:
  struct Entry {
    CLI::App* command;
    std::function<int(const GlobalOptions&)> run;
  };
  std::vector<Entry> entries_;
};

// In process, no daemon.
void add_train_commands(CLI::App& app, CommandTable& commands);  // train, eval
void add_data_commands(CLI::App& app, CommandTable& commands);   // data prepare, data stats
// Clients of megacppd (gRPC).
void add_job_commands(CLI::App& app, CommandTable& commands);  // submit, watch, jobs, job, cancel
void add_receipt_commands(CLI::App& app, CommandTable& commands);  // receipts, compare
// status asks megacppd; doctor runs the daemon's startup checks in this process.
void add_daemon_commands(CLI::App& app, CommandTable& commands);  // status, doctor

}  // namespace megacpp::cli
