#include "daemon/http_endpoint.h"

#include <fcntl.h>
#include <google/protobuf/util/json_util.h>
#include <httplib.h>
#include <sys/socket.h>

#include <charconv>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "daemon/boot.h"
#include "daemon/web_page_html.h"

namespace megacpp::daemon {

namespace v1 = megacpp::v1;

namespace {

// As /status has always printed: field names as in proto/, zeros and empty fields included (so
// that the page needs no defaults). int64 fields come out as JSON strings, as proto3 JSON says.
std::string proto_json(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

int http_status_of(const std::exception& error) {
  const auto* e = dynamic_cast<const Error*>(&error);
  if (e == nullptr) return 500;
  switch (e->kind()) {
    case ErrorKind::kInvalidArgument:
      return 400;
    case ErrorKind::kNotFound:
      return 404;
    case ErrorKind::kFailedPrecondition:
      return 409;
    default:
      return 500;
  }
}

// Runs a data route's body; a failure answers {"error": "..."} with the status its kind maps to.
template <typename Body>
void answer_json(httplib::Response& res, Body&& body) {
  // Receipts change while jobs run: a cached answer would draw a stale curve.
  res.set_header("Cache-Control", "no-store");
  try {
    res.set_content(body(), "application/json");
  } catch (const std::exception& e) {
    res.status = http_status_of(e);
    res.set_content(nlohmann::json{{"error", e.what()}}.dump(), "application/json");
  }
}

// A non-negative integer query parameter; `fallback` when absent.
int64_t integer_param(const httplib::Request& req, const char* name, int64_t fallback) {
  if (!req.has_param(name)) return fallback;
  const std::string text = req.get_param_value(name);
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0) {
    fail(ErrorKind::kInvalidArgument, "query parameter {}=\"{}\" must be a non-negative integer",
         name, text);
  }
  return value;
}

int int_param(const httplib::Request& req, const char* name, int fallback, int max) {
  return static_cast<int>(std::min<int64_t>(integer_param(req, name, fallback), max));
}

std::string required_param(const httplib::Request& req, const char* name) {
  std::string value = req.get_param_value(name);
  if (value.empty()) fail(ErrorKind::kInvalidArgument, "query parameter {} is required", name);
  return value;
}

}  // namespace

HttpEndpoint::HttpEndpoint(const StatusSource& source, const JobManager& jobs,
                           const ReceiptQueries& receipts, std::string address, HttpOptions options)
    : source_(source),
      jobs_(jobs),
      receipts_(receipts),
      options_(std::move(options)),
      address_(std::move(address)) {
  const auto colon = address_.rfind(':');
  if (colon == std::string::npos) {
    fail(ErrorKind::kInvalidArgument, "http_address=\"{}\" must be host:port", address_);
  }
  host_ = address_.substr(0, colon);
  port_ = std::stoi(address_.substr(colon + 1));
}

HttpEndpoint::~HttpEndpoint() {
  stop();
}

void HttpEndpoint::add_routes() {
  server_->Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain");
  });
  server_->Get("/status", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(proto_json(source_.status()), "application/json");
  });
  server_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(source_.prometheus_metrics(), "text/plain; version=0.0.4");
  });
  // Read-only: every method that could change something is refused.
  auto refuse = [](const httplib::Request&, httplib::Response& res) {
    res.status = 405;
    res.set_content("read-only endpoint\n", "text/plain");
  };
  add_web_routes();
  for (const char* path : {"/healthz", "/status", "/metrics", "/", "/api/.*", "/.*"}) {
    server_->Post(path, refuse);
    server_->Put(path, refuse);
    server_->Delete(path, refuse);
    server_->Patch(path, refuse);
  }
  // Before routing, so that unknown paths and refused methods reveal nothing either.
  server_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    using Handled = httplib::Server::HandlerResponse;
    const TokenCheck* auth = options_.auth;
    // The page's shell carries no data: a browser opening it cannot send a header yet.
    const bool page_shell = req.path == "/" && (req.method == "GET" || req.method == "HEAD");
    if (auth == nullptr || !auth->required() || req.path == "/healthz" || page_shell ||
        (req.path == "/metrics" && options_.public_metrics)) {
      return Handled::Unhandled;
    }
    if (req.has_header("Authorization")) {
      const std::string value = req.get_header_value("Authorization");
      const std::string_view given(value);
      if (auth->accepts(&given)) return Handled::Unhandled;
    }
    res.status = 401;
    res.set_header("WWW-Authenticate", "Bearer");
    res.set_content(fmt::format("{} requires the daemon's bearer token (Authorization: Bearer "
                                "<token from security.token_file>)\n",
                                req.path),
                    "text/plain");
    return Handled::Handled;
  });
}

void HttpEndpoint::add_web_routes() {
  server_->Get("/", [](const httplib::Request&, httplib::Response& res) {
    // Everything the page needs is inline; this policy keeps it from loading anything else or
    // sending data anywhere but back here.
    res.set_header("Content-Security-Policy",
                   "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                   "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                   "frame-ancestors 'none'");
    res.set_header("X-Content-Type-Options", "nosniff");
    res.set_header("Referrer-Policy", "no-referrer");
    res.set_content(std::string(web_page_html()), "text/html; charset=utf-8");
  });
  server_->Get("/api/jobs", [this](const httplib::Request& req, httplib::Response& res) {
    answer_json(res, [&] {
      v1::ListJobsResponse response;
      std::string next;
      for (auto& job : jobs_.list({}, int_param(req, "limit", 200, 1000),
                                  req.get_param_value("page_token"), &next)) {
        *response.add_jobs() = std::move(job);
      }
      response.set_next_page_token(next);
      return proto_json(response);
    });
  });
  // The job's own route and its receipts; an unknown job is 404 rather than empty lists.
  auto known_job = [this](const httplib::Request& req) {
    std::string id = req.matches[1];
    if (!jobs_.get(id)) fail(ErrorKind::kNotFound, "no job {}", id);
    return id;
  };
  server_->Get(R"(/api/jobs/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    answer_json(res, [&] {
      auto job = jobs_.get(req.matches[1]);
      if (!job) fail(ErrorKind::kNotFound, "no job {}", std::string(req.matches[1]));
      return proto_json(*job);
    });
  });
  server_->Get(R"(/api/jobs/([^/]+)/steps)",
               [this, known_job](const httplib::Request& req, httplib::Response& res) {
                 answer_json(res, [&] {
                   v1::ListStepReceiptsRequest request;
                   request.set_job_id(known_job(req));
                   request.set_after_step(integer_param(req, "after_step", 0));
                   request.set_limit(int_param(req, "limit", 0, ReceiptQueries::kMaxStepsPerPage));
                   v1::ListStepReceiptsResponse response;
                   receipts_.step_receipts(request, &response);
                   return proto_json(response);
                 });
               });
  server_->Get(R"(/api/jobs/([^/]+)/evals)", [this, known_job](const httplib::Request& req,
                                                               httplib::Response& res) {
    answer_json(res, [&] {
      nlohmann::json evals = nlohmann::json::array();
      for (const auto& e : receipts_.evals(known_job(req))) {
        evals.push_back(
            {{"step", e.step}, {"val_loss", e.val_loss}, {"recorded_at", e.recorded_at}});
      }
      return nlohmann::json{{"evals", evals}}.dump();
    });
  });
  server_->Get(R"(/api/jobs/([^/]+)/gates)",
               [this, known_job](const httplib::Request& req, httplib::Response& res) {
                 answer_json(res, [&] {
                   v1::JobReceiptsRequest request;
                   request.set_job_id(known_job(req));
                   v1::ListGateDecisionsResponse response;
                   receipts_.gate_decisions(request, &response);
                   return proto_json(response);
                 });
               });
  server_->Get(R"(/api/jobs/([^/]+)/kernels)",
               [this, known_job](const httplib::Request& req, httplib::Response& res) {
                 answer_json(res, [&] {
                   v1::JobReceiptsRequest request;
                   request.set_job_id(known_job(req));
                   v1::ListKernelReceiptsResponse response;
                   receipts_.kernel_receipts(request, &response);
                   return proto_json(response);
                 });
               });
  server_->Get("/api/compare", [this](const httplib::Request& req, httplib::Response& res) {
    answer_json(res, [&] {
      v1::CompareRunsRequest request;
      request.set_job_a(required_param(req, "a"));
      request.set_job_b(required_param(req, "b"));
      request.set_skip_steps(int_param(req, "skip_steps", 0, std::numeric_limits<int32_t>::max()));
      v1::CompareRunsResponse response;
      receipts_.compare_runs(request, &response);
      return proto_json(response);
    });
  });
}

void HttpEndpoint::bind() {
  if (bound_) return;
  if (!options_.tls_cert_file.empty()) {
    auto tls = std::make_unique<httplib::SSLServer>(options_.tls_cert_file.c_str(),
                                                    options_.tls_key_file.c_str());
    if (!tls->is_valid()) {
      fail(ErrorKind::kFailedPrecondition,
           "http_address {}: cannot serve HTTPS with security.tls_cert_file {} and "
           "security.tls_key_file {} (unreadable, or not a PEM certificate and its key)",
           address_, options_.tls_cert_file.string(), options_.tls_key_file.string());
    }
    server_ = std::move(tls);
  } else {
    server_ = std::make_unique<httplib::Server>();
  }
  // httplib's default pool has max(8, cores - 1) workers and keeps an idle connection for 5 s:
  // eight idle clients were enough to stop /healthz.
  const size_t workers = static_cast<size_t>(options_.workers);
  server_->new_task_queue = [workers] {
    return new httplib::ThreadPool(workers);
  };
  server_->set_keep_alive_timeout(options_.idle_timeout_seconds);
  server_->set_read_timeout(options_.io_timeout_seconds, 0);
  server_->set_write_timeout(options_.io_timeout_seconds, 0);
  // SO_REUSEADDR only: a restart may bind over connections in TIME_WAIT, but httplib's default
  // SO_REUSEPORT would let a second daemon bind the same port and take half the requests.
  // Close-on-exec: an executor that inherited the listening socket would keep the port taken
  // after a kill -9 of the daemon, and the restarted daemon could not bind it.
  server_->set_socket_options([](socket_t sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    ::fcntl(sock, F_SETFD, ::fcntl(sock, F_GETFD) | FD_CLOEXEC);
  });
  add_routes();
  const int requested = port_;
  if (port_ == 0) {
    port_ = server_->bind_to_any_port(host_);
  } else if (!server_->bind_to_port(host_, port_)) {
    port_ = -1;
  }
  if (port_ < 0) {
    const std::string holder = requested > 0 ? describe_port_holder(requested) : "";
    port_ = requested;
    fail(ErrorKind::kFailedPrecondition,
         "http_address {}: cannot bind: the port is in use{} (only one process may serve it), "
         "or {} is not a local address",
         address_, holder.empty() ? "" : " by " + holder, host_);
  }
  bound_ = true;
}

void HttpEndpoint::start() {
  bind();
  thread_ = std::thread([this] { server_->listen_after_bind(); });
}

void HttpEndpoint::stop() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace megacpp::daemon
