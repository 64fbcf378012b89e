// receipts <kind>, compare: ReceiptService clients, reading the daemon's receipt store.
#include <fmt/format.h>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/commands/client.h"
#include "cli/commands/commands.h"
#include "cli/commands/output.h"
#include "megacpp/v1/receipts.grpc.pb.h"

namespace megacpp::cli {
namespace {

namespace v1 = megacpp::v1;
using nlohmann::json;
using ReceiptStub = v1::ReceiptService::Stub;

struct ReceiptsArgs {
  ClientOptions client;
  std::string kind;
  std::string id;
  int last = 20;
  int64_t boot = 0;
};

// One function per kind; each gets a prepared context and prints its reply.

int list_boots(ReceiptStub& stub, grpc::ClientContext& context, const ReceiptsArgs& args,
               bool as_json) {
  v1::ListBootsRequest request;
  request.set_limit(args.last);
  v1::ListBootsResponse out;
  if (auto s = stub.ListBoots(&context, request, &out); !s.ok()) return report(s);
  if (as_json) {
    print_json(out);
    return kExitOk;
  }
  for (const auto& b : out.boots()) {
    fmt::print("boot {}  {}  {}  {}  cuda runtime {} driver {}  nccl {}  {}\n", b.id(),
               b.started_at(), b.status(), b.version(), b.cuda_runtime(), b.cuda_driver(), b.nccl(),
               b.devices_json());
  }
  return kExitOk;
}

int list_checks(ReceiptStub& stub, grpc::ClientContext& context, const ReceiptsArgs& args,
                bool as_json) {
  v1::ListPreconditionsRequest request;
  request.set_boot_id(args.boot);
  v1::ListPreconditionsResponse out;
  if (auto s = stub.ListPreconditions(&context, request, &out); !s.ok()) return report(s);
  if (as_json) {
    print_json(out);
    return kExitOk;
  }
  for (const auto& c : out.checks()) {
    fmt::print("{:5}  {:32}  {}{}\n", c.status(), c.check(), c.detail(),
               c.fix().empty() ? "" : "  fix: " + c.fix());
  }
  return kExitOk;
}

int list_gates(ReceiptStub& stub, grpc::ClientContext& context, const ReceiptsArgs& args,
               bool as_json) {
  v1::JobReceiptsRequest request;
  request.set_job_id(args.id);
  v1::ListGateDecisionsResponse out;
  if (auto s = stub.ListGateDecisions(&context, request, &out); !s.ok()) return report(s);
  if (as_json) {
    print_json(out);
    return kExitOk;
  }
  for (const auto& g : out.decisions()) {
    fmt::print("{:16}  {:8}  {:12}  {}\n", g.gate(), g.decision(), g.implementation(), g.reason());
  }
  return kExitOk;
}

int list_steps(ReceiptStub& stub, grpc::ClientContext& context, const ReceiptsArgs& args,
               bool as_json) {
  v1::ListStepReceiptsRequest request;
  request.set_job_id(args.id);
  request.set_limit(args.last);
  request.set_newest_first(true);
  v1::ListStepReceiptsResponse out;
  if (auto s = stub.ListStepReceipts(&context, request, &out); !s.ok()) return report(s);
  if (as_json) {
    print_json(out);
    return kExitOk;
  }
  // The newest N were asked for; a table reads oldest first.
  fmt::print("{:>7}  {:>8}  {:>9}  {:>9}  {:>9}  {:>10}  {:>7}\n", "step", "loss", "grad_norm",
             "lr", "step_ms", "tokens/s", "attempt");
  for (auto it = out.steps().rbegin(); it != out.steps().rend(); ++it) {
    fmt::print("{:>7}  {:>8.4f}  {:>9.3f}  {:>9.2e}  {:>9.1f}  {:>10.0f}  {:>7}\n", it->step(),
               it->loss(), it->grad_norm(), it->lr(), it->step_ms(), it->tokens_per_s(),
               it->attempt());
  }
  return kExitOk;
}

int list_kernels(ReceiptStub& stub, grpc::ClientContext& context, const ReceiptsArgs& args,
                 bool as_json) {
  v1::JobReceiptsRequest request;
  request.set_job_id(args.id);
  v1::ListKernelReceiptsResponse out;
  if (auto s = stub.ListKernelReceipts(&context, request, &out); !s.ok()) return report(s);
  if (as_json) {
    print_json(out);
    return kExitOk;
  }
  // A receipt without samples carries the kernel's attributes only; one without registers is
  // an op of library kernels (a cuBLASLt GEMM) timed as a whole.
  fmt::print("{:32}  {:>5}  {:>13}  {:>5}  {:>28}  {}\n", "kernel or op", "regs", "smem st+dyn",
             "occ", "ms per call min/median/max", "device");
  for (const auto& k : out.kernels()) {
    const std::string regs = k.registers() > 0 ? std::to_string(k.registers()) : "-";
    const std::string smem =
        k.registers() > 0 ? fmt::format("{}+{}", k.static_smem(), k.dynamic_smem()) : "-";
    const std::string occ = k.registers() > 0 ? fmt::format("{:.2f}", k.occupancy()) : "-";
    const std::string times = k.samples() > 0
                                  ? fmt::format("{:.3f}/{:.3f}/{:.3f} ({} calls)", k.time_ms_min(),
                                                k.time_ms_median(), k.time_ms_max(), k.samples())
                                  : "-";
    fmt::print("{:32}  {:>5}  {:>13}  {:>5}  {:>28}  {}\n", k.kernel(), regs, smem, occ, times,
               k.device());
  }
  return kExitOk;
}

int run_summary(ReceiptStub& stub, grpc::ClientContext& context, const ReceiptsArgs& args,
                bool as_json) {
  v1::JobReceiptsRequest request;
  request.set_job_id(args.id);
  v1::RunSummaryReceipt out;
  if (auto s = stub.GetRunSummary(&context, request, &out); !s.ok()) return report(s);
  std::cout << (as_json ? to_json(out) : json::parse(out.summary_json()).dump(2)) << "\n";
  return kExitOk;
}

int receipts(const ReceiptsArgs& args, const GlobalOptions& global) {
  grpc::ClientContext context;
  args.client.prepare(context);
  auto stub = v1::ReceiptService::NewStub(args.client.channel());
  const bool needs_job = args.kind != "boots" && args.kind != "checks";
  if (needs_job && args.id.empty()) {
    std::cerr << "error: receipts " << args.kind << " needs a job id\n";
    return kExitInvalid;
  }
  if (args.kind == "boots") return list_boots(*stub, context, args, global.json);
  if (args.kind == "checks") return list_checks(*stub, context, args, global.json);
  if (args.kind == "gates") return list_gates(*stub, context, args, global.json);
  if (args.kind == "steps") return list_steps(*stub, context, args, global.json);
  if (args.kind == "kernels") return list_kernels(*stub, context, args, global.json);
  return run_summary(*stub, context, args, global.json);
}

void add_receipts(CLI::App& app, CommandTable& commands) {
  auto* command =
      app.add_subcommand("receipts", "receipt history: boots, checks, gates, steps, kernels, runs");
  auto& args = commands.add(command, receipts);
  command->add_option("kind", args.kind, "boots | checks | gates | steps | kernels | runs")
      ->required()
      ->check(CLI::IsMember({"boots", "checks", "gates", "steps", "kernels", "runs"}));
  command->add_option("id", args.id, "job id (gates, steps, kernels, runs)");
  command->add_option("--last", args.last, "newest N (steps, boots)");
  command->add_option("--boot", args.boot, "boot id (checks; default the latest)");
  add_client_options(command, args.client);
}

struct CompareArgs {
  ClientOptions client;
  std::string a, b;
};

int compare(const CompareArgs& args, const GlobalOptions& global) {
  v1::CompareRunsRequest request;
  request.set_job_a(args.a);
  request.set_job_b(args.b);
  v1::CompareRunsResponse out;
  grpc::ClientContext context;
  args.client.prepare(context);
  auto stub = v1::ReceiptService::NewStub(args.client.channel());
  if (auto s = stub->CompareRuns(&context, request, &out); !s.ok()) return report(s);
  if (global.json) {
    print_json(out);
    return kExitOk;
  }
  fmt::print("{:14} {:>12} {:>12} {:>8}  {:>30}  {:>30}  {}\n", "metric", args.a, args.b, "delta",
             "envelope a (min/med/max ±mad)", "envelope b", "verdict");
  const auto envelope = [](const v1::NoiseEnvelope& e) {
    return fmt::format("{:.4g}/{:.4g}/{:.4g} ±{:.2g}", e.min(), e.median(), e.max(), e.mad());
  };
  for (const auto& m : out.metrics()) {
    fmt::print("{:14} {:>12.4g} {:>12.4g} {:>+7.1f}%  {:>30}  {:>30}  {}\n", m.metric(),
               m.median_a(), m.median_b(), 100 * m.relative_delta(), envelope(m.envelope_a()),
               envelope(m.envelope_b()), m.verdict());
  }
  return kExitOk;
}

void add_compare(CLI::App& app, CommandTable& commands) {
  auto* command =
      app.add_subcommand("compare", "compare two runs' step metrics with their noise envelopes");
  auto& args = commands.add(command, compare);
  command->add_option("a", args.a)->required();
  command->add_option("b", args.b)->required();
  add_client_options(command, args.client);
}

}  // namespace

void add_receipt_commands(CLI::App& app, CommandTable& commands) {
  add_receipts(app, commands);
  add_compare(app, commands);
}

}  // namespace megacpp::cli
