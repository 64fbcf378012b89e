// megacppd against a hostile or unauthorised client: requests that do not parse, the bearer
// token on reflection and on every HTTP route but /healthz, and TLS with a certificate made
// here (openssl), for gRPC, HTTPS and the CLI.
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "tests/daemon/daemon_harness.h"

namespace megacpp {
namespace {

namespace v1 = megacpp::v1;
namespace fs = std::filesystem;
using testing::Daemon;

constexpr const char* kToken = "s3cret-token";

std::string to_string(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// One unary call with raw request bytes, as a client that does not use protobuf would make.
grpc::Status raw_unary(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                       const std::string& bytes, const std::string& token = "") {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  if (!token.empty()) context.AddMetadata("authorization", std::string("Bearer ") + token);
  grpc::Slice slice(bytes.data(), bytes.size());
  grpc::ByteBuffer request(&slice, 1), response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
    std::lock_guard lock(mu);
    status = std::move(s);
    done = true;
    cv.notify_all();
  });
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return done; });  // the deadline bounds the wait
  return status;
}

// A list_services request to server reflection (a bidi stream); returns the status and, in
// `reply`, what came back.
grpc::Status reflection_list(const std::shared_ptr<grpc::Channel>& channel,
                             const std::string& token, std::string* reply) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  const grpc::internal::RpcMethod method(
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel.get(), method, &context));
  const std::string list_services("\x3a\x00", 2);  // ServerReflectionRequest{list_services: ""}
  grpc::Slice slice(list_services.data(), list_services.size());
  stream->Write(grpc::ByteBuffer(&slice, 1));
  stream->WritesDone();
  grpc::ByteBuffer response;
  while (stream->Read(&response)) *reply += to_string(response);
  return stream->Finish();
}

struct HttpAnswer {
  int status = -1;  // -1: no answer
  std::string body;
};

template <typename Client>  // httplib::Client or httplib::SSLClient
HttpAnswer http_get(Client& client, const std::string& path, const std::string& token = "") {
  httplib::Headers headers;
  if (!token.empty()) headers.emplace("Authorization", "Bearer " + token);
  auto res = client.Get(path, headers);
  if (!res) return {};
  return {res->status, res->body};
}

std::pair<std::string, int> split(const std::string& address) {
  const auto colon = address.rfind(':');
  return {address.substr(0, colon), std::stoi(address.substr(colon + 1))};
}

TEST(DaemonSecurity, MalformedRequestsAnswerInvalidArgumentNamingTheMessage) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  struct Case {
    const char* method;
    std::string bytes;
    const char* what;
    const char* type;
  };
  const std::vector<Case> cases = {
      {"/megacpp.v1.JobService/SubmitJob", std::string(11, '\xff'), "garbage",
       "megacpp.v1.SubmitJobRequest"},
      {"/megacpp.v1.JobService/SubmitJob",
       std::string("\x0a\x64"
                   "abc",
                   5),
       "truncated", "megacpp.v1.SubmitJobRequest"},
      // SubmitJobRequest{spec: JobSpec{name: "\xc3\x28"}}: a string that is not UTF-8.
      {"/megacpp.v1.JobService/SubmitJob", std::string("\x0a\x04\x0a\x02\xc3\x28", 6),
       "invalid UTF-8", "megacpp.v1.SubmitJobRequest"},
      {"/megacpp.v1.JobService/GetJob", std::string("\x0a\x02\xff\xfe", 4), "invalid UTF-8",
       "megacpp.v1.GetJobRequest"},
      {"/megacpp.v1.JobService/WatchJob", std::string("\x00", 1), "field number 0",
       "megacpp.v1.WatchJobRequest"},
      {"/megacpp.v1.ReceiptService/ListBoots", "hello, daemon", "text",
       "megacpp.v1.ListBootsRequest"},
      {"/megacpp.v1.StatusService/GetStatus", std::string(64, '\x80'), "endless varint",
       "megacpp.v1.GetStatusRequest"},
  };
  for (const auto& c : cases) {
    const grpc::Status s = raw_unary(d.channel(), c.method, c.bytes);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.method << " with " << c.what << ": " << s.error_code() << " " << s.error_message();
    EXPECT_NE(s.error_message().find(c.type), std::string::npos)
        << c.method << " with " << c.what << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.method), std::string::npos) << s.error_message();
  }
  // A well-formed raw request still works, and the daemon is unharmed.
  EXPECT_TRUE(raw_unary(d.channel(), "/megacpp.v1.StatusService/GetStatus", "").ok());
  grpc::ClientContext context;
  v1::ListJobsResponse jobs;
  EXPECT_TRUE(d.jobs()->ListJobs(&context, v1::ListJobsRequest(), &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 0);
}

TEST(DaemonSecurity, TokenGuardsReflectionAndEveryHttpRouteButHealthz) {
  testing::TempDir secrets;
  testing::write_text(secrets / "token", std::string(kToken) + "\n");
  Daemon d([&](nlohmann::json& c) {
    c["security"] = {{"token_file", (secrets / "token").string()}};
  });
  ASSERT_EQ(d.start(), -1) << d.log();

  // Reflection: refused without the token, served with it.
  std::string reply;
  const grpc::Status anonymous = reflection_list(d.channel(), "", &reply);
  EXPECT_EQ(anonymous.error_code(), grpc::StatusCode::UNAUTHENTICATED) << anonymous.error_message();
  EXPECT_EQ(reply.find("megacpp.v1"), std::string::npos) << reply;
  reply.clear();
  EXPECT_EQ(reflection_list(d.channel(), "wrong", &reply).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  reply.clear();
  const grpc::Status authorised = reflection_list(d.channel(), kToken, &reply);
  EXPECT_TRUE(authorised.ok()) << authorised.error_message();
  EXPECT_NE(reply.find("megacpp.v1.JobService"), std::string::npos) << reply;

  // A request that does not parse is not an oracle for callers without the token.
  EXPECT_EQ(
      raw_unary(d.channel(), "/megacpp.v1.JobService/GetJob", std::string(9, '\xff')).error_code(),
      grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(raw_unary(d.channel(), "/megacpp.v1.JobService/GetJob", std::string(9, '\xff'), kToken)
                .error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  // A running job, so that /status has a spec and absolute paths to reveal.
  v1::Job job;
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + kToken);
    v1::SubmitJobRequest request;
    *request.mutable_spec() = d.small_job(100000);
    v1::SubmitJobResponse response;
    ASSERT_TRUE(d.jobs()->SubmitJob(&context, request, &response).ok());
    job = response.job();
  }
  const auto [host, port] = split(d.http_address());
  httplib::Client http(host, port);
  http.set_read_timeout(30, 0);
  EXPECT_EQ(http_get(http, "/healthz").status, 200);
  for (const char* path : {"/status", "/metrics", "/nowhere"}) {
    for (const std::string token : {"", "wrong"}) {
      const HttpAnswer a = http_get(http, path, token);
      EXPECT_EQ(a.status, 401) << path << " with token '" << token << "': " << a.body;
      EXPECT_EQ(a.body.find(d.dir().path().string()), std::string::npos) << a.body;
      EXPECT_EQ(a.body.find(job.id()), std::string::npos) << a.body;
    }
  }
  auto post = http.Post("/status", "", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 401);
  // Authorised callers see everything: the spec and its absolute paths.
  HttpAnswer status;
  for (int i = 0; i < 600; ++i) {
    status = http_get(http, "/status", kToken);
    if (status.body.find(d.data("train")) != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(status.status, 200);
  EXPECT_NE(status.body.find(d.data("train")), std::string::npos) << status.body;
  const HttpAnswer metrics = http_get(http, "/metrics", kToken);
  EXPECT_EQ(metrics.status, 200);
  EXPECT_NE(metrics.body.find("megacpp_queue_depth"), std::string::npos) << metrics.body;

  grpc::ClientContext context;
  context.AddMetadata("authorization", std::string("Bearer ") + kToken);
  v1::CancelJobRequest cancel;
  cancel.set_id(job.id());
  v1::Job out;
  EXPECT_TRUE(d.jobs()->CancelJob(&context, cancel, &out).ok());
}

TEST(DaemonSecurity, PublicMetricsOpensMetricsOnly) {
  testing::TempDir secrets;
  testing::write_text(secrets / "token", kToken);
  Daemon d([&](nlohmann::json& c) {
    c["security"] = {{"token_file", (secrets / "token").string()}, {"public_metrics", true}};
  });
  ASSERT_EQ(d.start(), -1) << d.log();
  const auto [host, port] = split(d.http_address());
  httplib::Client http(host, port);
  http.set_read_timeout(30, 0);
  const HttpAnswer metrics = http_get(http, "/metrics");
  EXPECT_EQ(metrics.status, 200);
  EXPECT_NE(metrics.body.find("megacpp_jobs"), std::string::npos) << metrics.body;
  EXPECT_EQ(http_get(http, "/status").status, 401);
  EXPECT_EQ(http_get(http, "/healthz").status, 200);
  std::string reply;
  EXPECT_EQ(reflection_list(d.channel(), "", &reply).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

// A self-signed certificate for localhost and 127.0.0.1, made with the openssl CLI.
void make_certificate(const fs::path& dir, const std::string& name) {
  const std::string command =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=localhost"
      " -addext subjectAltName=DNS:localhost,IP:127.0.0.1"
      " -keyout '" +
      (dir / (name + ".key")).string() + "' -out '" + (dir / (name + ".pem")).string() + "' >'" +
      (dir / (name + ".log")).string() + "' 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0)
      << "openssl (Debian package openssl, see deploy/install-deps.sh) failed:\n"
      << testing::read_bytes(dir / (name + ".log"));
}

TEST(DaemonSecurity, TlsServesGrpcHttpsAndTheCliWithATestCertificate) {
  testing::TempDir secrets;
  ASSERT_NO_FATAL_FAILURE(make_certificate(secrets.path(), "daemon"));
  ASSERT_NO_FATAL_FAILURE(make_certificate(secrets.path(), "stranger"));
  testing::write_text(secrets / "token", kToken);
  Daemon d([&](nlohmann::json& c) {
    c["security"] = {{"token_file", (secrets / "token").string()},
                     {"tls_cert_file", (secrets / "daemon.pem").string()},
                     {"tls_key_file", (secrets / "daemon.key").string()}};
  });
  ASSERT_EQ(d.start(), -1) << d.log();
  const std::string address = d.grpc_address();

  auto get_status = [&](const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
    auto stub = v1::StatusService::NewStub(grpc::CreateChannel(address, credentials));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    context.AddMetadata("authorization", std::string("Bearer ") + kToken);
    v1::Status status;
    return stub->GetStatus(&context, v1::GetStatusRequest(), &status);
  };
  grpc::SslCredentialsOptions trusted;
  trusted.pem_root_certs = testing::read_bytes(secrets / "daemon.pem");
  const grpc::Status ok = get_status(grpc::SslCredentials(trusted));
  EXPECT_TRUE(ok.ok()) << ok.error_code() << " " << ok.error_message() << "\n" << d.log();
  EXPECT_FALSE(get_status(grpc::InsecureChannelCredentials()).ok());
  grpc::SslCredentialsOptions untrusted;
  untrusted.pem_root_certs = testing::read_bytes(secrets / "stranger.pem");
  EXPECT_FALSE(get_status(grpc::SslCredentials(untrusted)).ok());

  // The CLI: --tls-ca with the daemon's certificate; without it the daemon is unreachable.
  const std::vector<std::string> base = {
      "status",    "--daemon", address, "--token-file", (secrets / "token").string(),
      "--timeout", "20"};
  std::vector<std::string> with_ca = base;
  with_ca.insert(with_ca.end(), {"--tls-ca", (secrets / "daemon.pem").string()});
  const testing::CliRun trusting = testing::run_cli(secrets.path(), with_ca);
  EXPECT_EQ(trusting.code, 0) << trusting.out << trusting.err;
  const testing::CliRun without_ca = testing::run_cli(secrets.path(), base);
  EXPECT_EQ(without_ca.code, 5) << without_ca.out << without_ca.err;

  // HTTPS with the same certificate, the token still required; plain HTTP gets nothing.
  const auto [host, port] = split(d.http_address());
  httplib::SSLClient https(host, port);
  https.set_ca_cert_path((secrets / "daemon.pem").c_str());
  https.enable_server_certificate_verification(true);
  https.set_read_timeout(30, 0);
  EXPECT_EQ(http_get(https, "/healthz").status, 200);
  EXPECT_EQ(http_get(https, "/status").status, 401);
  const HttpAnswer status = http_get(https, "/status", kToken);
  EXPECT_EQ(status.status, 200);
  EXPECT_NE(status.body.find("devices"), std::string::npos) << status.body;
  httplib::Client plain(host, port);
  plain.set_read_timeout(10, 0);
  EXPECT_NE(http_get(plain, "/healthz").status, 200);
}

}  // namespace
}  // namespace megacpp
