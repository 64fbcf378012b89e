#include "daemon/services.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/util/json_util.h>
#include <grpc/grpc.h>
#include <spdlog/spdlog.h>

#include <fmt/format.h>

#include "base/error.h"
#include "base/version.h"
#include "receipts/compare.h"
#include "receipts/store.h"

namespace megacpp::daemon {

namespace v1 = megacpp::v1;
using grpc::Status;
using grpc::StatusCode;

grpc::Status to_grpc_status(const std::exception& error) {
  if (const auto* e = dynamic_cast<const Error*>(&error)) {
    switch (e->kind()) {
      case ErrorKind::kInvalidArgument:
        return {StatusCode::INVALID_ARGUMENT, e->what()};
      case ErrorKind::kNotFound:
        return {StatusCode::NOT_FOUND, e->what()};
      case ErrorKind::kFailedPrecondition:
        return {StatusCode::FAILED_PRECONDITION, e->what()};
      case ErrorKind::kCorruptData:
        return {StatusCode::DATA_LOSS, e->what()};
      default:
        return {StatusCode::INTERNAL, e->what()};
    }
  }
  return {StatusCode::INTERNAL, error.what()};
}

bool TokenCheck::accepts(const std::string_view* given) const {
  if (token_.empty()) return true;
  if (given == nullptr) return false;
  const std::string expected = "Bearer " + token_;
  // Constant-time comparison: the time taken does not reveal a prefix match.
  unsigned char diff = given->size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    diff |= static_cast<unsigned char>(expected[i] ^ (i < given->size() ? (*given)[i] : 0));
  }
  return diff == 0;
}

Status TokenCheck::check(const grpc::ServerContext* context) const {
  if (token_.empty()) return Status::OK;
  const auto& md = context->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return {StatusCode::UNAUTHENTICATED, "this daemon requires a bearer token"};
  const std::string_view given(it->second.data(), it->second.size());
  if (!accepts(&given)) return {StatusCode::UNAUTHENTICATED, "the bearer token is not valid"};
  return Status::OK;
}

namespace {

namespace gx = grpc::experimental;

class RequestGuard final : public gx::Interceptor {
 public:
  RequestGuard(gx::ServerRpcInfo* info, const TokenCheck& auth)
      : info_(info),
        auth_(auth),
        method_(info->method() ? info->method() : ""),
        reflection_(method_.starts_with("/grpc.reflection.")),
        // Only these read their one request before the handler runs; in a client stream an
        // empty read is the normal end of the stream, not a parse failure.
        single_request_(info->type() == gx::ServerRpcInfo::Type::UNARY ||
                        info->type() == gx::ServerRpcInfo::Type::SERVER_STREAMING),
        ours_(method_.starts_with("/megacpp.")) {}

  void Intercept(gx::InterceptorBatchMethods* methods) override {
    using Hook = gx::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(Hook::POST_RECV_INITIAL_METADATA)) {
      authorized_ = authorized(methods->GetRecvInitialMetadata());
      if (reflection_ && !authorized_) {
        // The reflection handler cannot be told to refuse; cancelling the call before it reads
        // the first request leaves it nothing to answer, and the client sees this status.
        grpc_call_cancel_with_status(info_->server_context()->c_call(), GRPC_STATUS_UNAUTHENTICATED,
                                     "server reflection requires the bearer token", nullptr);
      }
    }
    // The sync server parses a unary or server-streaming request before any handler runs and
    // passes no message on when that fails.
    if (single_request_ && methods->QueryInterceptionHookPoint(Hook::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      unparsable_ = true;
    }
    if (methods->QueryInterceptionHookPoint(Hook::PRE_SEND_STATUS) && unparsable_ && ours_) {
      if (!authorized_) {
        methods->ModifySendStatus(
            Status(StatusCode::UNAUTHENTICATED, "this daemon requires a bearer token"));
      } else {
        methods->ModifySendStatus(Status(
            StatusCode::INVALID_ARGUMENT,
            fmt::format("{}: the request is not a valid {} message (malformed or truncated "
                        "protobuf, a string field that is not UTF-8, or not protobuf at all)",
                        method_, request_type())));
      }
    }
    methods->Proceed();
  }

 private:
  bool authorized(std::multimap<grpc::string_ref, grpc::string_ref>* metadata) const {
    if (!auth_.required()) return true;
    if (metadata == nullptr) return false;
    auto it = metadata->find("authorization");
    if (it == metadata->end()) return false;
    const std::string_view given(it->second.data(), it->second.size());
    return auth_.accepts(&given);
  }

  // "/megacpp.v1.JobService/SubmitJob" -> "megacpp.v1.SubmitJobRequest".
  std::string request_type() const {
    std::string name = method_.substr(1);
    std::replace(name.begin(), name.end(), '/', '.');
    const auto* method = google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(name);
    return method ? method->input_type()->full_name() : std::string("request");
  }

  gx::ServerRpcInfo* info_;
  const TokenCheck& auth_;
  std::string method_;
  bool reflection_;
  bool single_request_;
  bool ours_;
  bool authorized_ = true;
  bool unparsable_ = false;
};

}  // namespace

grpc::experimental::Interceptor* RequestGuardFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new RequestGuard(info, auth_);
}

#define MEGACPP_REQUIRE_AUTH()                            \
  do {                                                    \
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

Status JobServiceImpl::GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                              v1::Job* response) {
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
  return guarded([&] {
    std::string next;
    for (auto& job : jobs_.list(states, request->page_size() == 0 ? 50 : request->page_size(),
                                request->page_token(), &next)) {
      *response->add_jobs() = std::move(job);
    }
    response->set_next_page_token(next);
  });
}

Status JobServiceImpl::CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                                 v1::Job* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] { *response = jobs_.cancel(request->id()); });
}

Status JobServiceImpl::WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                                grpc::ServerWriter<v1::JobEvent>* writer) {
  MEGACPP_REQUIRE_AUTH();
  // A stream holds one of the server's threads until its job ends: bounded, so that watchers
  // cannot starve every other RPC.
  if (!jobs_.acquire_watch_stream()) {
    return {StatusCode::RESOURCE_EXHAUSTED,
            fmt::format("too many WatchJob streams: limits.max_watch_streams={} are open; retry "
                        "later, or raise the limit in the daemon config",
                        jobs_.max_watch_streams())};
  }
  struct Release {
    JobManager& jobs;
    ~Release() { jobs.release_watch_stream(); }
  } release{jobs_};
  return guarded([&] {
    jobs_.watch(
        request->id(),
        [&](const v1::JobEvent& event) { return writer->Write(event); },  // false: client gone
        [&] { return context->IsCancelled(); });
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

Status ReceiptServiceImpl::ListBoots(grpc::ServerContext* context,
                                     const v1::ListBootsRequest* request,
                                     v1::ListBootsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] {
    // 0 is "not given" (proto3): the defaults. A negative value is refused, never defaulted.
    if (request->limit() < 0)
      fail(ErrorKind::kInvalidArgument, "limit={} must be >= 0", request->limit());
    if (request->before_id() < 0) {
      fail(ErrorKind::kInvalidArgument, "before_id={} must be >= 0", request->before_id());
    }
    const int limit = request->limit() > 0 ? request->limit() : 20;
    std::optional<int64_t> before;
    if (request->before_id() > 0) before = request->before_id();
    for (const auto& b : reader(store_path_).list_boots(limit, before))
      fill(response->add_boots(), b);
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

void ReceiptQueries::gate_decisions(const v1::JobReceiptsRequest& request,
                                    v1::ListGateDecisionsResponse* response) const {
  for (const auto& g : reader(store_path_).gate_decisions(request.job_id())) {
    auto* d = response->add_decisions();
    d->set_job_id(g.job_id);
    d->set_gate(g.gate);
    d->set_decision(g.decision);
    d->set_reason(g.reason);
    d->set_implementation(g.implementation);
    d->set_stages_json(g.stages.dump());
    d->set_decided_at(g.decided_at);
  }
}

void ReceiptQueries::step_receipts(const v1::ListStepReceiptsRequest& request,
                                   v1::ListStepReceiptsResponse* response) const {
  if (request.limit() < 0) fail(ErrorKind::kInvalidArgument, "limit must be >= 0");
  if (request.after_step() < 0) {
    fail(ErrorKind::kInvalidArgument, "after_step={} must be >= 0", request.after_step());
  }
  std::optional<int64_t> after;
  if (request.after_step() > 0) after = request.after_step();
  const int limit = request.limit() == 0 ? 1000 : std::min(request.limit(), kMaxStepsPerPage);
  for (const auto& s :
       reader(store_path_).steps(request.job_id(), after, limit, request.newest_first())) {
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
}

void ReceiptQueries::kernel_receipts(const v1::JobReceiptsRequest& request,
                                     v1::ListKernelReceiptsResponse* response) const {
  for (const auto& k : reader(store_path_).kernel_receipts(request.job_id())) {
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
}

void ReceiptQueries::run_summary(const v1::JobReceiptsRequest& request,
                                 v1::RunSummaryReceipt* response) const {
  auto summary = reader(store_path_).run_summary(request.job_id());
  if (!summary) fail(ErrorKind::kNotFound, "no run summary for job {}", request.job_id());
  response->set_job_id(summary->job_id);
  response->set_summary_json(summary->summary.dump());
  response->set_recorded_at(summary->recorded_at);
}

void ReceiptQueries::compare_runs(const v1::CompareRunsRequest& request,
                                  v1::CompareRunsResponse* response) const {
  receipts::CompareOptions options;
  if (request.skip_steps() < 0) {
    fail(ErrorKind::kInvalidArgument, "skip_steps={} must be >= 0", request.skip_steps());
  }
  if (request.skip_steps() > 0) options.warmup_steps = request.skip_steps();
  const auto result =
      receipts::compare_runs(reader(store_path_), request.job_a(), request.job_b(), options);
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
}

std::vector<receipts::EvalReceipt> ReceiptQueries::evals(std::string_view job_id) const {
  return reader(store_path_).evals(job_id);
}

Status ReceiptServiceImpl::ListGateDecisions(grpc::ServerContext* context,
                                             const v1::JobReceiptsRequest* request,
                                             v1::ListGateDecisionsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] { queries_.gate_decisions(*request, response); });
}

Status ReceiptServiceImpl::ListStepReceipts(grpc::ServerContext* context,
                                            const v1::ListStepReceiptsRequest* request,
                                            v1::ListStepReceiptsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] { queries_.step_receipts(*request, response); });
}

Status ReceiptServiceImpl::ListKernelReceipts(grpc::ServerContext* context,
                                              const v1::JobReceiptsRequest* request,
                                              v1::ListKernelReceiptsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] { queries_.kernel_receipts(*request, response); });
}

Status ReceiptServiceImpl::GetRunSummary(grpc::ServerContext* context,
                                         const v1::JobReceiptsRequest* request,
                                         v1::RunSummaryReceipt* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] { queries_.run_summary(*request, response); });
}

Status ReceiptServiceImpl::CompareRuns(grpc::ServerContext* context,
                                       const v1::CompareRunsRequest* request,
                                       v1::CompareRunsResponse* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] { queries_.compare_runs(*request, response); });
}

// --- Status ----------------------------------------------------------------

v1::Status StatusSource::status() const {
  v1::Status s;
  s.set_version(version_string());
  s.set_build(git_revision());
  s.set_uptime_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
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
  std::error_code ec;
  const auto size = std::filesystem::file_size(store_path_, ec);
  return metrics_.scrape(snap, ec ? 0 : size);
}

Status StatusServiceImpl::GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest*,
                                    v1::Status* response) {
  MEGACPP_REQUIRE_AUTH();
  return guarded([&] { *response = source_.status(); });
}

}  // namespace megacpp::daemon
