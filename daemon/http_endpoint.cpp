#include "daemon/http_endpoint.h"

#include <google/protobuf/util/json_util.h>
#include <httplib.h>

#include "runtime/common/error.h"

namespace megacpp::daemon {

HttpEndpoint::HttpEndpoint(const StatusSource& source, std::string address) : source_(source) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) {
    fail(ErrorKind::kInvalidArgument, "http_address=\"{}\" must be host:port", address);
  }
  host_ = address.substr(0, colon);
  port_ = std::stoi(address.substr(colon + 1));
}

HttpEndpoint::~HttpEndpoint() { stop(); }

void HttpEndpoint::start() {
  server_ = std::make_unique<httplib::Server>();
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
  if (port_ == 0) {
    port_ = server_->bind_to_any_port(host_);
  } else if (!server_->bind_to_port(host_, port_)) {
    port_ = -1;
  }
  if (port_ < 0) {
    fail(ErrorKind::kFailedPrecondition, "http_address {}: cannot bind (in use, or not a local address)", host_);
  }
  thread_ = std::thread([this] { server_->listen_after_bind(); });
}

void HttpEndpoint::stop() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace megacpp::daemon
