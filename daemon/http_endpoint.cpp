#include "daemon/http_endpoint.h"

#include <fcntl.h>
#include <google/protobuf/util/json_util.h>
#include <httplib.h>
#include <sys/socket.h>

#include "base/error.h"
#include "daemon/boot.h"

namespace megacpp::daemon {

HttpEndpoint::HttpEndpoint(const StatusSource& source, std::string address, HttpOptions options)
    : source_(source), options_(std::move(options)), address_(std::move(address)) {
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
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.preserve_proto_field_names = true;
    options.always_print_primitive_fields = true;
    (void)google::protobuf::util::MessageToJsonString(source_.status(), &json, options);
    res.set_content(json, "application/json");
  });
  server_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(source_.prometheus_metrics(), "text/plain; version=0.0.4");
  });
  // Read-only: every method that could change something is refused.
  auto refuse = [](const httplib::Request&, httplib::Response& res) {
    res.status = 405;
    res.set_content("read-only endpoint\n", "text/plain");
  };
  for (const char* path : {"/healthz", "/status", "/metrics", "/.*"}) {
    server_->Post(path, refuse);
    server_->Put(path, refuse);
    server_->Delete(path, refuse);
    server_->Patch(path, refuse);
  }
  // Before routing, so that unknown paths and refused methods reveal nothing either.
  server_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    using Handled = httplib::Server::HandlerResponse;
    const TokenCheck* auth = options_.auth;
    if (auth == nullptr || !auth->required() || req.path == "/healthz" ||
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
