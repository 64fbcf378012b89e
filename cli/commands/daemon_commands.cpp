#include "cli/commands/daemon_commands.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdlib>
#include <fmt/format.h>
#include <iostream>
#include <nlohmann/json.hpp>

#include "megacpp/v1/jobs.grpc.pb.h"
#include "megacpp/v1/receipts.grpc.pb.h"
#include "megacpp/v1/status.grpc.pb.h"
#include "runtime/common/atomic_file.h"
#include "runtime/common/error.h"
#include "runtime/daemon_config/daemon_config.h"
#include "runtime/preconditions/preconditions.h"

namespace megacpp::cli {

namespace v1 = megacpp::v1;
using nlohmann::json;

namespace {

struct Connection {
  std::string address;
  std::string token_file;
  std::string tls_ca_file;
  double timeout_s = 30;

  std::shared_ptr<grpc::Channel> channel() const {
    std::string target = address;
    if (target.empty()) {
      const char* env = std::getenv("MEGACPP_DAEMON");
      target = env ? env : "127.0.0.1:50551";
    }
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (!tls_ca_file.empty()) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = read_file(tls_ca_file);
      creds = grpc::SslCredentials(ssl);
    }
    return grpc::CreateChannel(target, creds);
  }
  void prepare(grpc::ClientContext& context, bool streaming = false) const {
    std::string file = token_file;
    if (file.empty()) {
      if (const char* env = std::getenv("MEGACPP_TOKEN_FILE")) file = env;
    }
    if (!file.empty()) {
      std::string token = read_file(file);
      while (!token.empty() && (token.back() == '\n' || token.back() == ' ')) token.pop_back();
      context.AddMetadata("authorization", "Bearer " + token);
    }
    if (!streaming) {
      context.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
    }
  }
};

int exit_code(const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::OK: return kExitOk;
    case grpc::StatusCode::INVALID_ARGUMENT: return kExitInvalid;
    case grpc::StatusCode::FAILED_PRECONDITION: return kExitRefused;
    case grpc::StatusCode::NOT_FOUND: return kExitNotFound;
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED: return kExitUnavailable;
    case grpc::StatusCode::UNAUTHENTICATED: return kExitUnauthenticated;
    default: return kExitFailed;
  }
}

int report(const grpc::Status& s) {
  std::cerr << "error: " << s.error_message() << " (" << s.error_code() << ")\n";
  return exit_code(s);
}

std::string to_json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.add_whitespace = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  return out;
}

std::string state_text(v1::JobState s) {
  std::string name = v1::JobState_Name(s);
  name = name.substr(std::string("JOB_STATE_").size());
  for (auto& c : name) c = static_cast<char>(std::tolower(c));
  return name;
}

std::string duration_text(double seconds) {
  if (seconds < 0 || seconds > 1e7) return "--:--";
  const auto s = static_cast<int64_t>(seconds);
  return s >= 3600 ? fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60)
                   : fmt::format("{}:{:02d}", s / 60, s % 60);
}

void print_job(const v1::Job& j) {
  fmt::print("{}  {}  step {}/{}  loss {:.4f}  {:.0f} tok/s  attempts {}  devices [{}]\n", j.id(),
             state_text(j.state()), j.step(), j.total_steps(), j.loss(), j.tokens_per_s(), j.attempts(),
             fmt::join(j.devices(), ","));
  if (!j.error().empty()) fmt::print("  error: {}\n", j.error());
}

// Watches a job to its end: a progress bar on stderr (when it is a terminal),
// the run summary on stdout. Exit 0 only when the job succeeded.
int watch(const Connection& conn, const std::string& id, bool as_json) {
  auto stub = v1::JobService::NewStub(conn.channel());
  grpc::ClientContext context;
  conn.prepare(context, /*streaming=*/true);
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
      const double frac = p.total_steps() > 0 ? static_cast<double>(p.step()) / static_cast<double>(p.total_steps()) : 0;
      const int width = 30, filled = static_cast<int>(frac * width);
      const std::string bar = std::string(static_cast<size_t>(filled), '#') + std::string(static_cast<size_t>(width - filled), '.');
      const std::string line = fmt::format("[{}] step {}/{}  loss {:.4f}  {:.0f} tok/s  ETA {}", bar, p.step(),
                                           p.total_steps(), p.loss(), p.tokens_per_s(), duration_text(p.eta_seconds()));
      if (tty) {
        std::cerr << "\r" << line << std::flush;
      } else if (p.step() - printed_step >= 25 || p.step() == p.total_steps()) {
        std::cerr << line << "\n";
        printed_step = p.step();
      }
    } else if (event.has_step()) {
      std::cerr << (tty ? "\n" : "") << fmt::format("step {}: validation loss {:.4f}\n", event.step().step(),
                                                    event.step().val_loss());
    } else if (event.has_summary()) {
      summary = event.summary().summary_json();
    } else if (event.has_state_changed()) {
      std::cerr << (tty ? "\n" : "") << fmt::format("{} is {}\n", id, state_text(event.state_changed()));
    }
  }
  const grpc::Status status = reader->Finish();
  if (tty) std::cerr << "\n";
  if (!status.ok()) return report(status);
  if (as_json) {
    std::cout << json{{"job", json::parse(to_json(last))}, {"summary", summary.empty() ? json() : json::parse(summary)}}.dump(2) << "\n";
  } else {
    if (!summary.empty()) {
      const json s = json::parse(summary);
      fmt::print("run summary of {}: steps {}..{} of {} ({})\n  final loss {:.4f}, validation loss {:.4f}\n"
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

}  // namespace

std::function<int()> add_daemon_commands(CLI::App& app, const GlobalOptions& global) {
  auto conn = std::make_shared<Connection>();
  auto add_connection = [conn](CLI::App* cmd) {
    cmd->add_option("--daemon", conn->address, "daemon address (default $MEGACPP_DAEMON or 127.0.0.1:50551)");
    cmd->add_option("--token-file", conn->token_file, "bearer token file (default $MEGACPP_TOKEN_FILE)");
    cmd->add_option("--tls-ca", conn->tls_ca_file, "CA certificate for a TLS daemon");
    cmd->add_option("--timeout", conn->timeout_s, "seconds per call");
  };
  struct Args {
    std::string file, id, id_b, state, kind;
    bool watch = false;
    int last = 20;
    int64_t boot = 0;
    std::string config = "configs/daemon.json";
  };
  auto args = std::make_shared<Args>();

  auto* submit = app.add_subcommand("submit", "submit a job spec (JSON, proto field names) to the daemon");
  submit->add_option("file", args->file, "job spec JSON")->required()->check(CLI::ExistingFile);
  submit->add_flag("--watch", args->watch, "then watch it to the end");
  auto* watch_cmd = app.add_subcommand("watch", "follow a job: progress bar, then its run summary");
  watch_cmd->add_option("id", args->id)->required();
  auto* jobs_cmd = app.add_subcommand("jobs", "list jobs");
  jobs_cmd->add_option("--state", args->state, "queued, running, succeeded, failed, cancelled, interrupted, refused");
  auto* job_cmd = app.add_subcommand("job", "one job's details");
  job_cmd->add_option("id", args->id)->required();
  auto* cancel_cmd = app.add_subcommand("cancel", "cancel a job (it checkpoints first)");
  cancel_cmd->add_option("id", args->id)->required();
  auto* receipts_cmd = app.add_subcommand("receipts", "receipt history: boots, checks, gates, steps, kernels, runs");
  receipts_cmd->add_option("kind", args->kind, "boots | checks | gates | steps | kernels | runs")
      ->required()
      ->check(CLI::IsMember({"boots", "checks", "gates", "steps", "kernels", "runs"}));
  receipts_cmd->add_option("id", args->id, "job id (gates, steps, kernels, runs)");
  receipts_cmd->add_option("--last", args->last, "newest N (steps, boots)");
  receipts_cmd->add_option("--boot", args->boot, "boot id (checks; default the latest)");
  auto* compare_cmd = app.add_subcommand("compare", "compare two runs' step metrics with their noise envelopes");
  compare_cmd->add_option("a", args->id)->required();
  compare_cmd->add_option("b", args->id_b)->required();
  auto* status_cmd = app.add_subcommand("status", "the daemon's status");
  auto* doctor_cmd = app.add_subcommand("doctor", "run the daemon's startup preconditions here, without serving");
  doctor_cmd->add_option("--config", args->config, "daemon config")->capture_default_str();
  for (auto* c : {submit, watch_cmd, jobs_cmd, job_cmd, cancel_cmd, receipts_cmd, compare_cmd, status_cmd}) {
    add_connection(c);
  }

  return [=, &global]() -> int {
    const bool as_json = global.json;
    auto jobs = [&] { return v1::JobService::NewStub(conn->channel()); };
    auto receipts = [&] { return v1::ReceiptService::NewStub(conn->channel()); };
    if (*submit) {
      v1::JobSpec spec;
      const std::string text = read_file(args->file);
      google::protobuf::util::JsonParseOptions options;
      if (auto s = google::protobuf::util::JsonStringToMessage(text, &spec, options); !s.ok()) {
        std::cerr << "error: " << args->file << ": not a job spec: " << s.ToString() << "\n";
        return kExitInvalid;
      }
      // The daemon cannot see our working directory: data paths go absolute,
      // relative ones read against the spec file's folder.
      const auto base = std::filesystem::absolute(args->file).parent_path();
      for (auto* path : {spec.mutable_train_data(), spec.mutable_valid_data()}) {
        if (!path->empty() && std::filesystem::path(*path).is_relative()) {
          *path = (base / *path).lexically_normal().string();
        }
      }
      v1::SubmitJobRequest request;
      *request.mutable_spec() = spec;
      v1::SubmitJobResponse response;
      grpc::ClientContext context;
      conn->prepare(context);
      if (auto s = jobs()->SubmitJob(&context, request, &response); !s.ok()) return report(s);
      if (as_json && !args->watch) {
        std::cout << to_json(response.job()) << "\n";
      } else {
        std::cout << response.job().id() << "\n";
      }
      return args->watch ? watch(*conn, response.job().id(), as_json) : kExitOk;
    }
    if (*watch_cmd) return watch(*conn, args->id, as_json);
    if (*jobs_cmd) {
      v1::ListJobsRequest request;
      if (!args->state.empty()) {
        std::string upper = "JOB_STATE_" + args->state;
        for (auto& c : upper) c = static_cast<char>(std::toupper(c));
        v1::JobState state;
        if (!v1::JobState_Parse(upper, &state)) {
          std::cerr << "error: --state " << args->state << " is not a job state\n";
          return kExitInvalid;
        }
        request.add_states(state);
      }
      request.set_page_size(1000);
      v1::ListJobsResponse response;
      grpc::ClientContext context;
      conn->prepare(context);
      if (auto s = jobs()->ListJobs(&context, request, &response); !s.ok()) return report(s);
      if (as_json) {
        std::cout << to_json(response) << "\n";
      } else {
        for (const auto& j : response.jobs()) print_job(j);
      }
      return kExitOk;
    }
    if (*job_cmd || *cancel_cmd) {
      v1::Job job;
      grpc::ClientContext context;
      conn->prepare(context);
      grpc::Status s;
      if (*job_cmd) {
        v1::GetJobRequest r;
        r.set_id(args->id);
        s = jobs()->GetJob(&context, r, &job);
      } else {
        v1::CancelJobRequest r;
        r.set_id(args->id);
        s = jobs()->CancelJob(&context, r, &job);
      }
      if (!s.ok()) return report(s);
      if (as_json) {
        std::cout << to_json(job) << "\n";
      } else {
        print_job(job);
      }
      return kExitOk;
    }
    if (*receipts_cmd) {
      grpc::ClientContext context;
      conn->prepare(context);
      auto stub = receipts();
      const bool needs_job = args->kind != "boots" && args->kind != "checks";
      if (needs_job && args->id.empty()) {
        std::cerr << "error: receipts " << args->kind << " needs a job id\n";
        return kExitInvalid;
      }
      v1::JobReceiptsRequest by_job;
      by_job.set_job_id(args->id);
      if (args->kind == "boots") {
        v1::ListBootsRequest r;
        r.set_limit(args->last);
        v1::ListBootsResponse out;
        if (auto s = stub->ListBoots(&context, r, &out); !s.ok()) return report(s);
        if (as_json) { std::cout << to_json(out) << "\n"; return kExitOk; }
        for (const auto& b : out.boots()) {
          fmt::print("boot {}  {}  {}  {}  cuda runtime {} driver {}  nccl {}  {}\n", b.id(), b.started_at(), b.status(),
                     b.version(), b.cuda_runtime(), b.cuda_driver(), b.nccl(), b.devices_json());
        }
      } else if (args->kind == "checks") {
        v1::ListPreconditionsRequest r;
        r.set_boot_id(args->boot);
        v1::ListPreconditionsResponse out;
        if (auto s = stub->ListPreconditions(&context, r, &out); !s.ok()) return report(s);
        if (as_json) { std::cout << to_json(out) << "\n"; return kExitOk; }
        for (const auto& c : out.checks()) {
          fmt::print("{:5}  {:32}  {}{}\n", c.status(), c.check(), c.detail(), c.fix().empty() ? "" : "  fix: " + c.fix());
        }
      } else if (args->kind == "gates") {
        v1::ListGateDecisionsResponse out;
        if (auto s = stub->ListGateDecisions(&context, by_job, &out); !s.ok()) return report(s);
        if (as_json) { std::cout << to_json(out) << "\n"; return kExitOk; }
        for (const auto& g : out.decisions()) {
          fmt::print("{:16}  {:8}  {:12}  {}\n", g.gate(), g.decision(), g.implementation(), g.reason());
        }
      } else if (args->kind == "steps") {
        v1::ListStepReceiptsRequest r;
        r.set_job_id(args->id);
        r.set_limit(args->last);
        r.set_newest_first(true);
        v1::ListStepReceiptsResponse out;
        if (auto s = stub->ListStepReceipts(&context, r, &out); !s.ok()) return report(s);
        if (as_json) { std::cout << to_json(out) << "\n"; return kExitOk; }
        fmt::print("{:>7}  {:>8}  {:>9}  {:>9}  {:>9}  {:>10}  {:>7}\n", "step", "loss", "grad_norm", "lr", "step_ms", "tokens/s", "attempt");
        for (auto it = out.steps().rbegin(); it != out.steps().rend(); ++it) {
          fmt::print("{:>7}  {:>8.4f}  {:>9.3f}  {:>9.2e}  {:>9.1f}  {:>10.0f}  {:>7}\n", it->step(), it->loss(),
                     it->grad_norm(), it->lr(), it->step_ms(), it->tokens_per_s(), it->attempt());
        }
      } else if (args->kind == "kernels") {
        v1::ListKernelReceiptsResponse out;
        if (auto s = stub->ListKernelReceipts(&context, by_job, &out); !s.ok()) return report(s);
        if (as_json) { std::cout << to_json(out) << "\n"; return kExitOk; }
        for (const auto& k : out.kernels()) {
          fmt::print("{:32}  {:10}  regs {:3}  smem {}+{}  occ {:.2f}  {:.3f}/{:.3f}/{:.3f} ms\n", k.kernel(), k.device(),
                     k.registers(), k.static_smem(), k.dynamic_smem(), k.occupancy(), k.time_ms_min(),
                     k.time_ms_median(), k.time_ms_max());
        }
      } else {
        v1::RunSummaryReceipt out;
        if (auto s = stub->GetRunSummary(&context, by_job, &out); !s.ok()) return report(s);
        std::cout << (as_json ? to_json(out) : json::parse(out.summary_json()).dump(2)) << "\n";
      }
      return kExitOk;
    }
    if (*compare_cmd) {
      v1::CompareRunsRequest r;
      r.set_job_a(args->id);
      r.set_job_b(args->id_b);
      v1::CompareRunsResponse out;
      grpc::ClientContext context;
      conn->prepare(context);
      if (auto s = receipts()->CompareRuns(&context, r, &out); !s.ok()) return report(s);
      if (as_json) { std::cout << to_json(out) << "\n"; return kExitOk; }
      fmt::print("{:14} {:>12} {:>12} {:>8}  {:>30}  {:>30}  {}\n", "metric", args->id, args->id_b, "delta",
                 "envelope a (min/med/max ±mad)", "envelope b", "verdict");
      for (const auto& m : out.metrics()) {
        auto env = [](const v1::NoiseEnvelope& e) {
          return fmt::format("{:.4g}/{:.4g}/{:.4g} ±{:.2g}", e.min(), e.median(), e.max(), e.mad());
        };
        fmt::print("{:14} {:>12.4g} {:>12.4g} {:>+7.1f}%  {:>30}  {:>30}  {}\n", m.metric(), m.median_a(), m.median_b(),
                   100 * m.relative_delta(), env(m.envelope_a()), env(m.envelope_b()), m.verdict());
      }
      return kExitOk;
    }
    if (*status_cmd) {
      auto stub = v1::StatusService::NewStub(conn->channel());
      v1::Status out;
      grpc::ClientContext context;
      conn->prepare(context);
      if (auto s = stub->GetStatus(&context, v1::GetStatusRequest(), &out); !s.ok()) return report(s);
      if (as_json) { std::cout << to_json(out) << "\n"; return kExitOk; }
      fmt::print("{}  up {}  boot {}  queue {}  store {} bytes\n", out.version(), duration_text(out.uptime_seconds()),
                 out.boot().id(), out.queue_depth(), out.store_bytes());
      for (const auto& d : out.devices()) {
        fmt::print("  {:8} {:6} {:24} {}\n", d.id(), d.kind(), d.name(), d.held_by().empty() ? "free" : "held by " + d.held_by());
      }
      for (const auto& j : out.running()) print_job(j);
      for (const auto& j : out.queued()) print_job(j);
      return kExitOk;
    }
    if (*doctor_cmd) {
      const DaemonConfig config = load_daemon_config(args->config);
      const auto checks = preconditions::run_preconditions(config.precondition_config());
      std::cout << preconditions::format_report(checks);
      return preconditions::all_passed(checks) ? kExitOk : kExitRefused;
    }
    return -1;
  };
}

}  // namespace megacpp::cli
