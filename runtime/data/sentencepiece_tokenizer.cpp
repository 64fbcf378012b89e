#include "runtime/data/sentencepiece_tokenizer.h"

#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/atomic_file.h"
#include "base/error.h"

extern char** environ;

namespace megacpp::data {
namespace {

constexpr const char* kHelper = "megacpp-sentencepiece";
constexpr size_t kMaxHeaderBytes = 1 << 16;

std::string fnv1a64(std::string_view bytes) {
  std::uint64_t hash = 14695981039346656037ull;
  for (const char c : bytes) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 1099511628211ull;
  }
  return fmt::format("{:016x}", hash);
}

bool executable(const std::filesystem::path& path) {
  return !path.empty() && ::access(path.c_str(), X_OK) == 0;
}

}  // namespace

std::filesystem::path find_sentencepiece_helper() {
  std::vector<std::filesystem::path> tried;
  if (const char* env = std::getenv("MEGACPP_SENTENCEPIECE_HELPER"); env && *env) {
    if (executable(env)) return env;
    tried.emplace_back(env);
  }
  std::error_code error;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    for (const auto& candidate :
         {self.parent_path() / kHelper, self.parent_path().parent_path() / "bin" / kHelper}) {
      if (executable(candidate)) return candidate;
      tried.push_back(candidate);
    }
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (!dir.empty() && executable(std::filesystem::path(dir) / kHelper)) {
      return std::filesystem::path(dir) / kHelper;
    }
  }
  std::string places;
  for (const auto& t : tried) places += t.string() + ", ";
  fail(ErrorKind::kFailedPrecondition,
       "{} (which encodes with libsentencepiece) not found at {}nor on PATH: build it (target {}) "
       "and install it beside megacpp, or set MEGACPP_SENTENCEPIECE_HELPER",
       kHelper, places, kHelper);
}

SentencePieceTokenizer::SentencePieceTokenizer(const std::filesystem::path& model) : path_(model) {
  // The fingerprint is of the bytes the helper is about to load.
  fingerprint_ = fnv1a64(read_file(model));
  helper_ = find_sentencepiece_helper();
  int sockets[2];
  // A socket rather than pipes: sends carry MSG_NOSIGNAL, so a helper that died is an error
  // here, not a SIGPIPE that ends the whole program.
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets) != 0) {
    fail(ErrorKind::kIo, "{}: socketpair failed: {}", helper_.string(), std::strerror(errno));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, sockets[1], 0);
  posix_spawn_file_actions_adddup2(&actions, sockets[1], 1);
  const std::string helper = helper_.string(), model_arg = model.string();
  char* argv[] = {const_cast<char*>(helper.c_str()), const_cast<char*>(model_arg.c_str()), nullptr};
  const int spawned = ::posix_spawn(&pid_, helper.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(sockets[1]);
  socket_ = sockets[0];
  if (spawned != 0) {
    pid_ = -1;
    stop();
    fail(ErrorKind::kIo, "{}: cannot start: {}", helper, std::strerror(spawned));
  }
  std::string header;
  for (char c = 0; c != '\n';) {
    const ssize_t got = ::read(socket_, &c, 1);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0 || header.size() > kMaxHeaderBytes) {
      stop();
      fail(ErrorKind::kIo, "{} {}: ended before naming the model's vocabulary", helper, model_arg);
    }
    header.push_back(c);
  }
  nlohmann::json reply;
  try {
    reply = nlohmann::json::parse(header);
    if (reply.contains("error")) {
      stop();
      fail(ErrorKind::kInvalidArgument, "{}: not a SentencePiece model: {}", model_arg,
           reply["error"].get<std::string>());
    }
    vocab_size_ = reply.at("vocab_size").get<std::int32_t>();
    end_of_document_ = reply.at("eos_id").get<std::int32_t>();
  } catch (const nlohmann::json::exception& e) {
    stop();
    fail(ErrorKind::kIo, "{}: unreadable reply {}: {}", helper, header, e.what());
  }
  if (end_of_document_ < 0 || end_of_document_ >= vocab_size_) {
    stop();
    fail(ErrorKind::kInvalidArgument,
         "{}: the SentencePiece model has no end-of-sentence piece (eos_id={}), which ends each "
         "document: train it with an eos piece (spm_train --eos_id=2, the default)",
         model_arg, end_of_document_);
  }
}

SentencePieceTokenizer::~SentencePieceTokenizer() {
  stop();
}

void SentencePieceTokenizer::stop() noexcept {
  if (socket_ >= 0) ::close(socket_);  // the helper sees the end of its input and exits
  socket_ = -1;
  if (pid_ > 0) {
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
  pid_ = -1;
}

std::vector<std::int32_t> SentencePieceTokenizer::encode(std::string_view text) const {
  const auto broken = [&](const char* what) {
    fail(ErrorKind::kIo, "{} {}: {} failed: {}", helper_.string(), path_.string(), what,
         errno == 0 ? "the helper closed its end" : std::strerror(errno));
  };
  const auto send_all = [&](const void* data, size_t size) {
    const auto* bytes = static_cast<const char*>(data);
    while (size > 0) {
      errno = 0;
      const ssize_t put = ::send(socket_, bytes, size, MSG_NOSIGNAL);
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) broken("sending a document");
      bytes += put;
      size -= static_cast<size_t>(put);
    }
  };
  const auto receive_all = [&](void* out, size_t size) {
    auto* bytes = static_cast<char*>(out);
    while (size > 0) {
      errno = 0;
      const ssize_t got = ::read(socket_, bytes, size);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) broken("reading its pieces");
      bytes += got;
      size -= static_cast<size_t>(got);
    }
  };
  const std::uint64_t size = text.size();
  send_all(&size, sizeof size);
  send_all(text.data(), text.size());
  std::uint64_t count = 0;
  receive_all(&count, sizeof count);
  // Only a bound against a garbled reply: normalization may expand a character (NFKC turns
  // U+FDFA, 3 bytes, into 18 characters) and byte fallback gives an id per byte of that.
  if (count > 32 * (text.size() + 1)) {
    errno = 0;
    broken("a reply of plausible length");
  }
  std::vector<std::int32_t> ids(count);
  receive_all(ids.data(), ids.size() * sizeof(std::int32_t));
  for (const std::int32_t id : ids) {
    if (id < 0 || id >= vocab_size_) {
      fail(ErrorKind::kIo, "{} {}: id {} outside the vocabulary of {}", helper_.string(),
           path_.string(), id, vocab_size_);
    }
  }
  return ids;
}

}  // namespace megacpp::data
