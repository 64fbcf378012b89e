#pragma once
// The gRPC services (proto/megacpp/v1): jobs, receipts, status. Every RPC but
// the standard health service requires the bearer token when one is configured.
#include <grpcpp/support/server_interceptor.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/job_manager.h"
#include "daemon/metrics.h"
#include "megacpp/v1/jobs.grpc.pb.h"
#include "megacpp/v1/receipts.grpc.pb.h"
#include "megacpp/v1/status.grpc.pb.h"
#include "receipts/records.h"

namespace megacpp::daemon {

// Checks "authorization: Bearer <token>" metadata; an empty token disables it.
class TokenCheck {
 public:
  explicit TokenCheck(std::string token) : token_(std::move(token)) {}
  grpc::Status check(const grpc::ServerContext* context) const;
  // Whether an authorization value (gRPC metadata or HTTP header) carries the token; always
  // true when no token is configured. `given` is null when the caller sent none.
  bool accepts(const std::string_view* given) const;
  bool required() const { return !token_.empty(); }

 private:
  std::string token_;
};

// Installed on the gRPC server (ServerBuilder::experimental().SetInterceptorCreators):
//  - a request that does not parse (malformed protobuf, truncated, a string that is not UTF-8,
//    garbage) answers INVALID_ARGUMENT naming the method and message type; gRPC itself would
//    answer INTERNAL with an empty message. A caller without the token gets UNAUTHENTICATED
//    instead, as it would for a well-formed request.
//  - server reflection (grpc.reflection.*) requires the token: it is served by gRPC's own
//    plugin, which never looks at one.
class RequestGuardFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RequestGuardFactory(const TokenCheck& auth) : auth_(auth) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  const TokenCheck& auth_;
};

class JobServiceImpl final : public megacpp::v1::JobService::Service {
 public:
  JobServiceImpl(JobManager& jobs, const TokenCheck& auth) : jobs_(jobs), auth_(auth) {}
  grpc::Status SubmitJob(grpc::ServerContext*, const megacpp::v1::SubmitJobRequest*,
                         megacpp::v1::SubmitJobResponse*) override;
  grpc::Status GetJob(grpc::ServerContext*, const megacpp::v1::GetJobRequest*,
                      megacpp::v1::Job*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const megacpp::v1::ListJobsRequest*,
                        megacpp::v1::ListJobsResponse*) override;
  grpc::Status CancelJob(grpc::ServerContext*, const megacpp::v1::CancelJobRequest*,
                         megacpp::v1::Job*) override;
  grpc::Status WatchJob(grpc::ServerContext*, const megacpp::v1::WatchJobRequest*,
                        grpc::ServerWriter<megacpp::v1::JobEvent>*) override;

 private:
  JobManager& jobs_;
  const TokenCheck& auth_;
};

// The receipt store's read side as the API presents it: ReceiptService answers from it, and so
// does the HTTP endpoint's web page, so both always show the same receipts. Each call reads
// through the calling thread's own read-only connection; failures throw megacpp::Error.
class ReceiptQueries {
 public:
  // The most step receipts one page holds, whatever the request's limit.
  static constexpr int kMaxStepsPerPage = 100000;

  explicit ReceiptQueries(std::filesystem::path store_path) : store_path_(std::move(store_path)) {}
  void gate_decisions(const megacpp::v1::JobReceiptsRequest& request,
                      megacpp::v1::ListGateDecisionsResponse* response) const;
  // Error(kInvalidArgument) for a negative limit.
  void step_receipts(const megacpp::v1::ListStepReceiptsRequest& request,
                     megacpp::v1::ListStepReceiptsResponse* response) const;
  void kernel_receipts(const megacpp::v1::JobReceiptsRequest& request,
                       megacpp::v1::ListKernelReceiptsResponse* response) const;
  // Error(kNotFound) when the job has none.
  void run_summary(const megacpp::v1::JobReceiptsRequest& request,
                   megacpp::v1::RunSummaryReceipt* response) const;
  void compare_runs(const megacpp::v1::CompareRunsRequest& request,
                    megacpp::v1::CompareRunsResponse* response) const;
  // No RPC carries these yet: the web page's validation-loss curve, in step order.
  std::vector<receipts::EvalReceipt> evals(std::string_view job_id) const;

 private:
  std::filesystem::path store_path_;
};

class ReceiptServiceImpl final : public megacpp::v1::ReceiptService::Service {
 public:
  ReceiptServiceImpl(std::filesystem::path store_path, const TokenCheck& auth)
      : store_path_(store_path), queries_(std::move(store_path)), auth_(auth) {}
  grpc::Status ListBoots(grpc::ServerContext*, const megacpp::v1::ListBootsRequest*,
                         megacpp::v1::ListBootsResponse*) override;
  grpc::Status ListPreconditions(grpc::ServerContext*, const megacpp::v1::ListPreconditionsRequest*,
                                 megacpp::v1::ListPreconditionsResponse*) override;
  grpc::Status ListGateDecisions(grpc::ServerContext*, const megacpp::v1::JobReceiptsRequest*,
                                 megacpp::v1::ListGateDecisionsResponse*) override;
  grpc::Status ListStepReceipts(grpc::ServerContext*, const megacpp::v1::ListStepReceiptsRequest*,
                                megacpp::v1::ListStepReceiptsResponse*) override;
  grpc::Status ListKernelReceipts(grpc::ServerContext*, const megacpp::v1::JobReceiptsRequest*,
                                  megacpp::v1::ListKernelReceiptsResponse*) override;
  grpc::Status GetRunSummary(grpc::ServerContext*, const megacpp::v1::JobReceiptsRequest*,
                             megacpp::v1::RunSummaryReceipt*) override;
  grpc::Status CompareRuns(grpc::ServerContext*, const megacpp::v1::CompareRunsRequest*,
                           megacpp::v1::CompareRunsResponse*) override;

 private:
  std::filesystem::path store_path_;
  ReceiptQueries queries_;
  const TokenCheck& auth_;
};

// Assembles GetStatus: also the HTTP endpoint's /status and /metrics source.
class StatusSource {
 public:
  StatusSource(JobManager& jobs, DaemonMetrics& metrics, std::filesystem::path store_path,
               int64_t boot_id)
      : jobs_(jobs),
        metrics_(metrics),
        store_path_(std::move(store_path)),
        boot_id_(boot_id),
        started_(std::chrono::steady_clock::now()) {}
  megacpp::v1::Status status() const;
  // The /metrics body (Prometheus text format 0.0.4), rendered by prometheus-cpp.
  std::string prometheus_metrics() const;

 private:
  JobManager& jobs_;
  DaemonMetrics& metrics_;
  std::filesystem::path store_path_;
  int64_t boot_id_;
  std::chrono::steady_clock::time_point started_;
};

class StatusServiceImpl final : public megacpp::v1::StatusService::Service {
 public:
  StatusServiceImpl(const StatusSource& source, const TokenCheck& auth)
      : source_(source), auth_(auth) {}
  grpc::Status GetStatus(grpc::ServerContext*, const megacpp::v1::GetStatusRequest*,
                         megacpp::v1::Status*) override;

 private:
  const StatusSource& source_;
  const TokenCheck& auth_;
};

// Maps the runtime's error kinds onto gRPC status codes.
grpc::Status to_grpc_status(const std::exception& error);

}  // namespace megacpp::daemon
