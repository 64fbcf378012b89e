#include "daemon/services.h"

#include <google/protobuf/util/json_util.h>
#include <spdlog/spdlog.h>

#include <fmt/format.h>

#include "receipts/compare.h"
#include "receipts/store.h"
#include "runtime/common/error.h"
#include "runtime/common/version.h"

namespace megacpp::daemon {

namespace v1 = megacpp::v1;
using grpc::Status;
using grpc::StatusCode;

grpc::Status to_grpc_status(const std::exception& error) {
  if (const auto* e = dynamic_cast<const Error*>(&error)) {
    switch (e->kind()) {
      case ErrorKind::kInvalidArgument: return {StatusCode::INVALID_ARGUMENT, e->what()};
      case ErrorKind::kNotFound: return {StatusCode::NOT_FOUND, e->what()};
      case ErrorKind::kFailedPrecondition: return {StatusCode::FAILED_PRECONDITION, e->what()};
      case ErrorKind::kCorruptData: return {StatusCode::DATA_LOSS, e->what()};
      default: return {StatusCode::INTERNAL, e->what()};
    }
  }
  return {StatusCode::INTERNAL, error.what()};
}

Status TokenCheck::check(const grpc::ServerContext* context) const {
  if (token_.empty()) return Status::OK;
  const auto& md = context->client_metadata();
  auto it = md.find("authorization");
  const std::string expected = "Bearer " + token_;
  if (it == md.end()) return {StatusCode::UNAUTHENTICATED, "this daemon requires a bearer token"};
  const std::string_view given(it->second.data(), it->second.size());
  // Constant-time comparison: the time taken does not reveal a prefix match.
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    diff |= static_cast<unsigned char>(expected[i] ^ (i < given.size() ? given[i] : 0));
  }
  if (diff != 0) return {StatusCode::UNAUTHENTICATED, "the bearer token is not valid"};
  return Status::OK;
}

#define MEGACPP_REQUIRE_AUTH()                       \
  do {                                               \
    if (auto s = auth_.check(context); !s.ok()) return s; \
  } while (0)

template <typename F>
Status guarded(F&& body) {
  try {
    body();
    return Status::OK;
  } catch (const std::exception& e) {
    return to_grpc_status(e);
  }
}

// --- JobService -----------------------------------------------------------

Status JobServiceImpl::SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request,
                                 v1::SubmitJobResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] { *response->mutable_job() = jobs_.submit(request->spec()); });
}

Status JobServiceImpl::GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request, v1::Job* response) {
  MEGACPP_REQUIRE_AUTH();
  auto job = jobs_.get(request->id());
  if (!job) return {StatusCode::NOT_FOUND, "no job " + request->id()};
  *response = *job;
  return Status::OK;
}

Status JobServiceImpl::ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                                v1::ListJobsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  if (request->page_size() < 0) return {StatusCode::INVALID_ARGUMENT, "page_size must be >= 0"};
  std::vector<v1::JobState> states;
  for (int s : request->states()) states.push_back(static_cast<v1::JobState>(s));
  std::string next;
  for (auto& job : jobs_.list(states, request->page_size() == 0 ? 50 : request->page_size(),
                              request->page_token(), &next)) {
    *response->add_jobs() = std::move(job);
  }
  response->set_next_page_token(next);
  return Status::OK;
}

Status JobServiceImpl::CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                                 v1::Job* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] { *response = jobs_.cancel(request->id()); });
}

Status JobServiceImpl::WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                                grpc::ServerWriter<v1::JobEvent>* writer) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] {
    int64_t cursor = 0;
    bool finished = false;
    while (!finished && !context->IsCancelled()) {
      for (const auto& event : jobs_.wait_events(request->id(), cursor, std::chrono::milliseconds(500), &finished)) {
        if (!writer->Write(event)) return;  // the client went away
      }
    }
  });
}

// --- ReceiptService --------------------------------------------------------

namespace {

// One read-only connection per server thread: WAL readers never block the
// daemon's writer, and gRPC's sync server reuses its threads.
const receipts::Store& reader(const std::filesystem::path& path) {
  thread_local std::unique_ptr<receipts::Store> store;
  thread_local std::filesystem::path opened;
  if (!store || opened != path) {
    store = std::make_unique<receipts::Store>(path, receipts::OpenMode::kReadOnly);
    opened = path;
  }
  return *store;
}

void fill(v1::Boot* out, const receipts::BootReceipt& b) {
  out->set_id(b.id);
  out->set_started_at(b.started_at);
  out->set_status(b.status);
  out->set_version(b.version);
  out->set_git_revision(b.git_revision);
  out->set_compiler(b.compiler);
  out->set_build_type(b.build_type);
  out->set_cuda_runtime(b.cuda_runtime);
  out->set_cuda_driver(b.cuda_driver);
  out->set_nccl(b.nccl);
  out->set_cudnn(b.cudnn);
  out->set_devices_json(b.devices.dump());
  out->set_hostname(b.hostname);
  out->set_environment_json(b.environment.dump());
}

void fill_envelope(v1::NoiseEnvelope* out, const receipts::NoiseEnvelope& e) {
  out->set_min(e.min);
  out->set_median(e.median);
  out->set_max(e.max);
  out->set_mad(e.mad);
  out->set_count(e.count);
}

}  // namespace

Status ReceiptServiceImpl::ListBoots(grpc::ServerContext* context, const v1::ListBootsRequest* request,
                                     v1::ListBootsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] {
    const int limit = request->limit() > 0 ? request->limit() : 20;
    std::optional<int64_t> before;
    if (request->before_id() > 0) before = request->before_id();
    for (const auto& b : reader(store_path_).list_boots(limit, before)) fill(response->add_boots(), b);
  });
}

Status ReceiptServiceImpl::ListPreconditions(grpc::ServerContext* context,
                                             const v1::ListPreconditionsRequest* request,
                                             v1::ListPreconditionsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] {
    const auto& store = reader(store_path_);
    int64_t boot = request->boot_id();
    if (boot == 0) {
      const auto boots = store.list_boots(1);
      if (boots.empty()) return;
      boot = boots.front().id;
    }
    for (const auto& p : store.preconditions(boot)) {
      auto* c = response->add_checks();
      c->set_boot_id(p.boot_id);
      c->set_check(p.check);
      c->set_status(p.status);
      c->set_detail(p.detail);
      c->set_fix(p.fix);
      c->set_checked_at(p.checked_at);
    }
  });
}

Status ReceiptServiceImpl::ListGateDecisions(grpc::ServerContext* context, const v1::JobReceiptsRequest* request,
                                             v1::ListGateDecisionsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] {
    for (const auto& g : reader(store_path_).gate_decisions(request->job_id())) {
      auto* d = response->add_decisions();
      d->set_job_id(g.job_id);
      d->set_gate(g.gate);
      d->set_decision(g.decision);
      d->set_reason(g.reason);
      d->set_implementation(g.implementation);
      d->set_stages_json(g.stages.dump());
      d->set_decided_at(g.decided_at);
    }
  });
}

Status ReceiptServiceImpl::ListStepReceipts(grpc::ServerContext* context,
                                            const v1::ListStepReceiptsRequest* request,
                                            v1::ListStepReceiptsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  if (request->limit() < 0) return {StatusCode::INVALID_ARGUMENT, "limit must be >= 0"};
  return guarded([&] {
    std::optional<int64_t> after;
    if (request->after_step() > 0) after = request->after_step();
    const int limit = request->limit() == 0 ? 1000 : std::min(request->limit(), 100000);
    for (const auto& s : reader(store_path_).steps(request->job_id(), after, limit, request->newest_first())) {
      auto* r = response->add_steps();
      r->set_job_id(s.job_id);
      r->set_step(s.step);
      r->set_attempt(s.attempt);
      r->set_loss(s.loss);
      r->set_grad_norm(s.grad_norm);
      r->set_lr(s.lr);
      r->set_tokens(s.tokens);
      r->set_step_ms(s.step_ms);
      r->set_tokens_per_s(s.tokens_per_s);
      r->set_flops_per_s(s.flops_per_s);
      r->set_recorded_at(s.recorded_at);
    }
  });
}

Status ReceiptServiceImpl::ListKernelReceipts(grpc::ServerContext* context, const v1::JobReceiptsRequest* request,
                                              v1::ListKernelReceiptsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] {
    for (const auto& k : reader(store_path_).kernel_receipts(request->job_id())) {
      auto* r = response->add_kernels();
      r->set_job_id(k.job_id);
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
      r->set_recorded_at(k.recorded_at);
    }
  });
}

Status ReceiptServiceImpl::GetRunSummary(grpc::ServerContext* context, const v1::JobReceiptsRequest* request,
                                         v1::RunSummaryReceipt* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] {
    auto summary = reader(store_path_).run_summary(request->job_id());
    if (!summary) fail(ErrorKind::kNotFound, "no run summary for job {}", request->job_id());
    response->set_job_id(summary->job_id);
    response->set_summary_json(summary->summary.dump());
    response->set_recorded_at(summary->recorded_at);
  });
}

Status ReceiptServiceImpl::CompareRuns(grpc::ServerContext* context, const v1::CompareRunsRequest* request,
                                       v1::CompareRunsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] {
    receipts::CompareOptions options;
    if (request->skip_steps() > 0) options.warmup_steps = request->skip_steps();
    const auto result = receipts::compare_runs(reader(store_path_), request->job_a(), request->job_b(), options);
    for (const auto& m : result.metrics) {
      auto* out = response->add_metrics();
      out->set_metric(m.metric);
      out->set_median_a(m.median_a);
      out->set_median_b(m.median_b);
      out->set_relative_delta(m.relative_delta);
      fill_envelope(out->mutable_envelope_a(), m.envelope_a);
      fill_envelope(out->mutable_envelope_b(), m.envelope_b);
      out->set_verdict(std::string(receipts::verdict_name(m.verdict)));
    }
  });
}

// --- Status ----------------------------------------------------------------

v1::Status StatusSource::status() const {
  v1::Status s;
  s.set_version(version_string());
  s.set_build(MEGACPP_GIT_REVISION);
  s.set_uptime_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
  try {
    if (auto boot = reader(store_path_).get_boot(boot_id_)) fill(s.mutable_boot(), *boot);
  } catch (const std::exception& e) {
    spdlog::warn("status: cannot read the boot receipt: {}", e.what());
  }
  const ManagerSnapshot snap = jobs_.snapshot();
  for (const auto& d : snap.devices) {
    auto* out = s.add_devices();
    out->set_id(d.id);
    out->set_kind(d.kind);
    out->set_name(d.name);
    out->set_held_by(d.held_by);
    out->set_memory_bytes(d.memory_bytes);
  }
  s.set_queue_depth(static_cast<int32_t>(snap.queued.size()));
  for (const auto& j : snap.queued) *s.add_queued() = j;
  for (const auto& j : snap.running) *s.add_running() = j;
  std::error_code ec;
  const auto size = std::filesystem::file_size(store_path_, ec);
  s.set_store_bytes(ec ? 0 : size);
  return s;
}

std::string StatusSource::prometheus_metrics() const {
  const ManagerSnapshot snap = jobs_.snapshot();
  std::string out;
  out += "# HELP megacpp_jobs Jobs known to the daemon, by state.\n# TYPE megacpp_jobs gauge\n";
  for (const char* state : {"queued", "running", "succeeded", "failed", "cancelled", "interrupted", "refused"}) {
    auto it = snap.jobs_by_state.find(state);
    out += fmt::format("megacpp_jobs{{state=\"{}\"}} {}\n", state, it == snap.jobs_by_state.end() ? 0 : it->second);
  }
  out += "# HELP megacpp_queue_depth Jobs waiting for devices.\n# TYPE megacpp_queue_depth gauge\n";
  out += fmt::format("megacpp_queue_depth {}\n", snap.queued.size());
  out += "# HELP megacpp_steps_total Training steps completed under this daemon.\n# TYPE megacpp_steps_total counter\n";
  out += fmt::format("megacpp_steps_total {}\n", snap.steps_total);
  out += "# HELP megacpp_job_step Last completed step of a running job.\n# TYPE megacpp_job_step gauge\n";
  std::string tokens, loss;
  for (const auto& j : snap.running) {
    out += fmt::format("megacpp_job_step{{job=\"{}\"}} {}\n", j.id(), j.step());
    tokens += fmt::format("megacpp_job_tokens_per_second{{job=\"{}\"}} {}\n", j.id(), j.tokens_per_s());
    loss += fmt::format("megacpp_job_loss{{job=\"{}\"}} {}\n", j.id(), j.loss());
  }
  out += "# HELP megacpp_job_tokens_per_second Training throughput of a running job.\n"
         "# TYPE megacpp_job_tokens_per_second gauge\n" + tokens;
  out += "# HELP megacpp_job_loss Last training loss of a running job.\n# TYPE megacpp_job_loss gauge\n" + loss;
  out += "# HELP megacpp_job_step_seconds Step time of a running job.\n# TYPE megacpp_job_step_seconds gauge\n";
  for (const auto& j : snap.running) {
    const double tokens_per_step = static_cast<double>(j.spec().batch()) * j.spec().seqlen() *
                                   std::max(1, j.spec().grad_accum());
    out += fmt::format("megacpp_job_step_seconds{{job=\"{}\"}} {}\n", j.id(),
                       j.tokens_per_s() > 0 ? tokens_per_step / j.tokens_per_s() : 0.0);
  }
  out += "# HELP megacpp_devices_held Devices held by jobs, by kind.\n# TYPE megacpp_devices_held gauge\n"
         "# HELP megacpp_devices Devices in the inventory, by kind.\n";
  std::map<std::string, std::pair<int, int>> by_kind;
  for (const auto& d : snap.devices) {
    by_kind[d.kind].first += d.held_by.empty() ? 0 : 1;
    by_kind[d.kind].second += 1;
  }
  for (const auto& [kind, counts] : by_kind) {
    out += fmt::format("megacpp_devices_held{{kind=\"{}\"}} {}\nmegacpp_devices{{kind=\"{}\"}} {}\n", kind,
                       counts.first, kind, counts.second);
  }
  std::error_code ec;
  const auto size = std::filesystem::file_size(store_path_, ec);
  out += "# HELP megacpp_store_bytes Size of the receipt store's main file.\n# TYPE megacpp_store_bytes gauge\n";
  out += fmt::format("megacpp_store_bytes {}\n", ec ? 0 : size);
  return out;
}

Status StatusServiceImpl::GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest*,
                                    v1::Status* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] { *response = source_.status(); });
}

}  // namespace megacpp::daemon
