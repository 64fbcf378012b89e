#pragma once
// What the daemon's client commands share: how to reach megacppd and how a failed call ends.
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

namespace megacpp::cli {

struct ClientOptions {
  std::string address;      // empty: $MEGACPP_DAEMON, else 127.0.0.1:50551
  std::string token_file;   // empty: $MEGACPP_TOKEN_FILE, else no token
  std::string tls_ca_file;  // empty: plaintext
  double timeout_s = 30;

  std::shared_ptr<grpc::Channel> channel() const;
  // Adds the bearer token and, unless the call streams until the job ends, the deadline.
  void prepare(grpc::ClientContext& context, bool streaming = false) const;
};

// --daemon, --token-file, --tls-ca, --timeout.
void add_client_options(CLI::App* command, ClientOptions& options);

// Prints a failed call's status on stderr; returns its exit code.
int report(const grpc::Status& status);

}  // namespace megacpp::cli
