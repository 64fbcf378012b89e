// submit, watch, jobs, job, cancel: JobService clients.
#include <google/protobuf/util/json_util.h>
#include <unistd.h>

#include <fmt/format.h>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/atomic_file.h"
#include "cli/commands/client.h"
#include "cli/commands/commands.h"
#include "cli/commands/output.h"
#include "megacpp/v1/jobs.grpc.pb.h"
#include "service/job_states.h"

namespace megacpp::cli {
namespace {

namespace v1 = megacpp::v1;
using nlohmann::json;

// Follows a job to its end: a progress bar on stderr (one line per 25 steps when stderr is not
// a terminal), the run summary on stdout. Exit 0 only when the job succeeded.
int follow(const ClientOptions& client, const std::string& id, bool as_json) {
  auto stub = v1::JobService::NewStub(client.channel());
  grpc::ClientContext context;
  client.prepare(context, /*streaming=*/true);
  v1::WatchJobRequest request;
  request.set_id(id);
  auto reader = stub->WatchJob(&context, request);
  v1::JobEvent event;
  v1::Job last;
  std::string summary;
  const bool tty = ::isatty(2);
  int64_t printed_step = 0;
  while (reader->Read(&event)) {
    last = event.job();
    if (event.has_step() && event.step().val_loss() < 0) {
      const auto& p = event.step();
      const double frac = p.total_steps() > 0
                              ? static_cast<double>(p.step()) / static_cast<double>(p.total_steps())
                              : 0;
      const int width = 30, filled = static_cast<int>(frac * width);
      const std::string bar = std::string(static_cast<size_t>(filled), '#') +
                              std::string(static_cast<size_t>(width - filled), '.');
      const std::string line =
          fmt::format("[{}] step {}/{}  loss {:.4f}  {:.0f} tok/s  ETA {}", bar, p.step(),
                      p.total_steps(), p.loss(), p.tokens_per_s(), duration_text(p.eta_seconds()));
      if (tty) {
        std::cerr << "\r" << line << std::flush;
      } else if (p.step() - printed_step >= 25 || p.step() == p.total_steps()) {
        std::cerr << line << "\n";
        printed_step = p.step();
      }
    } else if (event.has_step()) {
      std::cerr << (tty ? "\n" : "")
                << fmt::format("step {}: validation loss {:.4f}\n", event.step().step(),
                               event.step().val_loss());
    } else if (event.has_summary()) {
      summary = event.summary().summary_json();
    } else if (event.has_state_changed()) {
      std::cerr << (tty ? "\n" : "")
                << fmt::format("{} is {}\n", id, job_state_name(event.state_changed()));
    }
  }
  const grpc::Status status = reader->Finish();
  if (tty) std::cerr << "\n";
  if (!status.ok()) return report(status);
  if (as_json) {
    std::cout << json{{"job", json::parse(to_json(last))},
                      {"summary", summary.empty() ? json() : json::parse(summary)}}
                     .dump(2)
              << "\n";
  } else {
    if (!summary.empty()) {
      const json s = json::parse(summary);
      fmt::print(
          "run summary of {}: steps {}..{} of {} ({})\n  final loss {:.4f}, validation loss "
          "{:.4f}\n"
          "  {} tokens in {:.1f} s; median step {:.1f} ms, {:.0f} tokens/s, {:.2f} GFLOP/s\n",
          id, s.value("first_step", 0), s.value("last_step", 0), s.value("total_steps", 0),
          s.value("stop_reason", ""), s.value("final_loss", 0.0), s.value("final_val_loss", -1.0),
          s.value("tokens", 0), s.value("wall_seconds", 0.0), s.value("median_step_ms", 0.0),
          s.value("tokens_per_s", 0.0), s.value("flops_per_s", 0.0) / 1e9);
    }
    print_job(last);
  }
  return last.state() == v1::JOB_STATE_SUCCEEDED ? kExitOk : kExitFailed;
}

struct SubmitArgs {
  ClientOptions client;
  std::string file;
  bool watch = false;
  std::string device_kind;  // empty: the spec's own
  int device_count = 0;     // 0: the spec's own
  int tensor_parallel = 0;  // 0: the spec's own
};

int submit(const SubmitArgs& args, const GlobalOptions& global) {
  v1::JobSpec spec;
  const std::string text = read_file(args.file);
  google::protobuf::util::JsonParseOptions options;
  if (auto s = google::protobuf::util::JsonStringToMessage(text, &spec, options); !s.ok()) {
    std::cerr << "error: " << args.file << ": not a job spec: " << s.ToString() << "\n";
    return kExitInvalid;
  }
  // The daemon cannot see our working directory: data and init_checkpoint paths go absolute,
  // relative ones read against the spec file's folder.
  const auto base = std::filesystem::absolute(args.file).parent_path();
  std::vector<std::string*> paths = {spec.mutable_train_data(), spec.mutable_valid_data(),
                                     spec.mutable_init_checkpoint()};
  for (auto& entry : *spec.mutable_train_blend()) paths.push_back(entry.mutable_prefix());
  for (auto* path : paths) {
    if (!path->empty() && std::filesystem::path(*path).is_relative()) {
      *path = (base / *path).lexically_normal().string();
    }
  }
  if (!args.device_kind.empty()) spec.set_device_kind(args.device_kind);
  if (args.device_count > 0) spec.set_device_count(args.device_count);
  if (args.tensor_parallel > 0) spec.set_tensor_parallel(args.tensor_parallel);
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::SubmitJobResponse response;
  grpc::ClientContext context;
  args.client.prepare(context);
  auto stub = v1::JobService::NewStub(args.client.channel());
  if (auto s = stub->SubmitJob(&context, request, &response); !s.ok()) return report(s);
  // With --watch, --json is the watch's final document alone, so stdout stays one JSON value
  // (the id is in that document, and in the state lines on stderr).
  if (global.json && !args.watch) {
    print_json(response.job());
  } else if (!global.json) {
    std::cout << response.job().id() << "\n";
  }
  return args.watch ? follow(args.client, response.job().id(), global.json) : kExitOk;
}

void add_submit(CLI::App& app, CommandTable& commands) {
  auto* command =
      app.add_subcommand("submit", "submit a job spec (JSON, proto field names) to the daemon");
  auto& args = commands.add(command, submit);
  // No CLI::ExistingFile check: a missing spec is "not found" (exit 4) from read_file, like a
  // missing file anywhere else, not a usage error.
  command->add_option("file", args.file, "job spec JSON")->required();
  command->add_flag("--watch", args.watch, "then watch it to the end");
  // The daemon validates the value (cpu or cuda) with the rest of the spec.
  command->add_option("--device-kind", args.device_kind,
                      "run on this kind of device (cpu, cuda) instead of the spec's device_kind");
  // The daemon checks the geometry (heads, groups, batch) against the model.
  command
      ->add_option("--device-count", args.device_count,
                   "run on this many devices instead of the spec's device_count")
      ->check(CLI::PositiveNumber);
  command
      ->add_option("--tensor-parallel", args.tensor_parallel,
                   "split each model replica over this many GPUs (the rest of --device-count "
                   "are data-parallel replicas)")
      ->check(CLI::PositiveNumber);
  add_client_options(command, args.client);
}

struct WatchArgs {
  ClientOptions client;
  std::string id;
};

int watch(const WatchArgs& args, const GlobalOptions& global) {
  return follow(args.client, args.id, global.json);
}

void add_watch(CLI::App& app, CommandTable& commands) {
  auto* command = app.add_subcommand("watch", "follow a job: progress bar, then its run summary");
  auto& args = commands.add(command, watch);
  command->add_option("id", args.id)->required();
  add_client_options(command, args.client);
}

struct JobsArgs {
  ClientOptions client;
  std::string state;
};

int jobs(const JobsArgs& args, const GlobalOptions& global) {
  v1::ListJobsRequest request;
  if (!args.state.empty()) {
    const auto state = find_job_state(args.state);
    if (!state) {
      std::cerr << "error: --state " << args.state << " is not a job state (one of "
                << job_state_list() << ")\n";
      return kExitInvalid;
    }
    request.add_states(*state);
  }
  request.set_page_size(1000);
  // Every page: the daemon lists the oldest first, so one page would leave out the newest jobs.
  v1::ListJobsResponse all;
  auto stub = v1::JobService::NewStub(args.client.channel());
  do {
    v1::ListJobsResponse page;
    grpc::ClientContext context;
    args.client.prepare(context);
    if (auto s = stub->ListJobs(&context, request, &page); !s.ok()) return report(s);
    for (auto& j : *page.mutable_jobs()) *all.add_jobs() = std::move(j);
    request.set_page_token(page.next_page_token());
  } while (!request.page_token().empty());
  if (global.json) {
    print_json(all);
  } else {
    for (const auto& j : all.jobs()) print_job(j);
  }
  return kExitOk;
}

void add_jobs(CLI::App& app, CommandTable& commands) {
  auto* command = app.add_subcommand("jobs", "list jobs");
  auto& args = commands.add(command, jobs);
  command->add_option("--state", args.state, job_state_list());
  add_client_options(command, args.client);
}

struct JobIdArgs {
  ClientOptions client;
  std::string id;
};

int print_result(const grpc::Status& status, const v1::Job& job, const GlobalOptions& global) {
  if (!status.ok()) return report(status);
  if (global.json) {
    print_json(job);
  } else {
    print_job(job);
  }
  return kExitOk;
}

int job(const JobIdArgs& args, const GlobalOptions& global) {
  v1::GetJobRequest request;
  request.set_id(args.id);
  v1::Job out;
  grpc::ClientContext context;
  args.client.prepare(context);
  auto stub = v1::JobService::NewStub(args.client.channel());
  const grpc::Status status = stub->GetJob(&context, request, &out);
  return print_result(status, out, global);
}

void add_job(CLI::App& app, CommandTable& commands) {
  auto* command = app.add_subcommand("job", "one job's details");
  auto& args = commands.add(command, job);
  command->add_option("id", args.id)->required();
  add_client_options(command, args.client);
}

int cancel(const JobIdArgs& args, const GlobalOptions& global) {
  v1::CancelJobRequest request;
  request.set_id(args.id);
  v1::Job out;
  grpc::ClientContext context;
  args.client.prepare(context);
  auto stub = v1::JobService::NewStub(args.client.channel());
  const grpc::Status status = stub->CancelJob(&context, request, &out);
  return print_result(status, out, global);
}

void add_cancel(CLI::App& app, CommandTable& commands) {
  auto* command = app.add_subcommand("cancel", "cancel a job (it checkpoints first)");
  auto& args = commands.add(command, cancel);
  command->add_option("id", args.id)->required();
  add_client_options(command, args.client);
}

}  // namespace

void add_job_commands(CLI::App& app, CommandTable& commands) {
  add_submit(app, commands);
  add_watch(app, commands);
  add_jobs(app, commands);
  add_job(app, commands);
  add_cancel(app, commands);
}

}  // namespace megacpp::cli
