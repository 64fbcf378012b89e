#pragma once
// The read-only HTTP endpoint for dashboards and people: /status (GetStatus as JSON),
// /metrics (Prometheus text format), /healthz, the web page at / and the JSON it reads under
// /api/ (jobs, their step, eval, gate and kernel receipts, CompareRuns). With a bearer token
// configured every route but /healthz and the page's shell at / requires it (/metrics too unless
// public_metrics); the shell holds no data, and its script sends the token on every request.
// With TLS configured it serves HTTPS with the daemon's certificate, so the token never crosses
// the network in the clear.
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "daemon/services.h"

namespace httplib {
class Server;
}

namespace megacpp::daemon {

struct HttpOptions {
  int workers = 64;
  int idle_timeout_seconds = 2;
  int io_timeout_seconds = 10;
  const TokenCheck* auth = nullptr;  // null: no token required
  bool public_metrics = false;
  std::filesystem::path tls_cert_file;  // both set: HTTPS
  std::filesystem::path tls_key_file;
};

class HttpEndpoint {
 public:
  HttpEndpoint(const StatusSource& source, const JobManager& jobs, const ReceiptQueries& receipts,
               std::string address,  // "host:port"
               HttpOptions options = {});
  ~HttpEndpoint();
  // Takes the port exclusively (no SO_REUSEPORT: a second daemon must not share it). Throws
  // Error(kFailedPrecondition) naming the address, and its holder when it can be found.
  void bind();
  void start();  // serves; binds first when bind() was not called
  void stop();
  int port() const { return port_; }

 private:
  void add_routes();
  void add_web_routes();

  const StatusSource& source_;
  const JobManager& jobs_;
  const ReceiptQueries& receipts_;
  HttpOptions options_;
  std::string address_;
  std::string host_;
  int port_ = 0;
  bool bound_ = false;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
};

}  // namespace megacpp::daemon
