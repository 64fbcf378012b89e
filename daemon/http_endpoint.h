#pragma once
// The read-only HTTP endpoint for dashboards: /status (GetStatus as JSON),
// /metrics (Prometheus text format), /healthz.
#include <memory>
#include <string>
#include <thread>

#include "daemon/services.h"

namespace httplib {
class Server;
}

namespace megacpp::daemon {

class HttpEndpoint {
 public:
  HttpEndpoint(const StatusSource& source, std::string address);  // "host:port"
  ~HttpEndpoint();
  void start();  // throws Error(kFailedPrecondition) when the address cannot be bound
  void stop();
  int port() const { return port_; }

 private:
  const StatusSource& source_;
  std::string host_;
  int port_ = 0;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
};

}  // namespace megacpp::daemon
