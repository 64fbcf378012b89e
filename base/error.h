#pragma once
// The one error type for recoverable failures: bad configuration, bad input
// files, refused requests. The message must tell a user what to fix: name the
// field, file or rule, and the offending value.
#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

namespace megacpp {

enum class ErrorKind {
  kInvalidArgument,     // a field, flag or value breaks a rule
  kNotFound,            // a named file or object does not exist
  kCorruptData,         // a file exists but its content is malformed or truncated
  kFailedPrecondition,  // the request is valid but cannot run here (gate, hardware)
  kIo,                  // the operating system refused a read or write
  kInternal,            // a bug: an invariant the code relies on does not hold
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message)
      : std::runtime_error(std::move(message)), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

template <typename... Args>
[[noreturn]] void fail(ErrorKind kind, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(kind, fmt::format(format, std::forward<Args>(args)...));
}

// The operating system's words for an errno value, for messages. (std::strerror is not
// thread-safe; the error category's message is.)
inline std::string describe_errno(int error_number) {
  return std::generic_category().message(error_number);
}

}  // namespace megacpp
