#include "cli/commands/client.h"

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iostream>

#include "base/atomic_file.h"
#include "cli/commands/exit_codes.h"

namespace megacpp::cli {

std::shared_ptr<grpc::Channel> ClientOptions::channel() const {
  std::string target = address;
  if (target.empty()) {
    const char* env = std::getenv("MEGACPP_DAEMON");
    target = env ? env : "127.0.0.1:50551";
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!tls_ca_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = read_file(tls_ca_file);
    creds = grpc::SslCredentials(ssl);
  }
  return grpc::CreateChannel(target, creds);
}

void ClientOptions::prepare(grpc::ClientContext& context, bool streaming) const {
  std::string file = token_file;
  if (file.empty()) {
    if (const char* env = std::getenv("MEGACPP_TOKEN_FILE")) file = env;
  }
  if (!file.empty()) {
    std::string token = read_file(file);
    while (!token.empty() && (token.back() == '\n' || token.back() == ' ')) token.pop_back();
    context.AddMetadata("authorization", "Bearer " + token);
  }
  if (!streaming) {
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  }
}

void add_client_options(CLI::App* command, ClientOptions& options) {
  command->add_option("--daemon", options.address,
                      "daemon address (default $MEGACPP_DAEMON or 127.0.0.1:50551)");
  command->add_option("--token-file", options.token_file,
                      "bearer token file (default $MEGACPP_TOKEN_FILE)");
  command->add_option("--tls-ca", options.tls_ca_file, "CA certificate for a TLS daemon");
  command->add_option("--timeout", options.timeout_s, "seconds per call");
}

int report(const grpc::Status& status) {
  std::cerr << "error: " << status.error_message() << " (" << status.error_code() << ")\n";
  return exit_code(status.error_code());
}

}  // namespace megacpp::cli
