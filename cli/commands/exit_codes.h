#pragma once
// The exit codes of every megacpp command, in one table. Scripts branch on them, so a code
// follows the kind of the error, not the command that met it or the side of the wire it was
// met on: a missing checkpoint given to `megacpp eval` and a missing job asked of the daemon
// both exit 4.
//
//   exit  meaning                        megacpp::ErrorKind     gRPC status code
//   0     ok                             -                      OK
//   1     job failed, runtime failure    kIo, kInternal         INTERNAL, any other
//   2     invalid input or usage         kInvalidArgument,      INVALID_ARGUMENT, DATA_LOSS
//                                        kCorruptData
//   3     refused: precondition or gate  kFailedPrecondition    FAILED_PRECONDITION
//   4     not found                      kNotFound              NOT_FOUND
//   5     daemon unreachable             -                      UNAVAILABLE, DEADLINE_EXCEEDED
//   6     unauthenticated                -                      UNAUTHENTICATED
//
// The daemon turns an Error into a gRPC status (daemon::to_grpc_status); the gRPC column is that
// mapping read backwards, so an error exits with the same code whether it was thrown in this
// process or in the daemon (tests/cli/commands/exit_codes_test.cpp holds the two together).
#include <grpcpp/support/status_code_enum.h>

#include "base/error.h"

namespace megacpp::cli {

enum ExitCode : int {
  kExitOk = 0,
  kExitFailed = 1,
  kExitInvalid = 2,
  kExitRefused = 3,
  kExitNotFound = 4,
  kExitUnavailable = 5,
  kExitUnauthenticated = 6,
};

// No default case: a new ErrorKind does not compile (-Wswitch) until it has an exit code.
constexpr ExitCode exit_code(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
    case ErrorKind::kCorruptData:
      return kExitInvalid;
    case ErrorKind::kFailedPrecondition:
      return kExitRefused;
    case ErrorKind::kNotFound:
      return kExitNotFound;
    case ErrorKind::kIo:
    case ErrorKind::kInternal:
      return kExitFailed;
  }
  return kExitFailed;
}

constexpr ExitCode exit_code(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return kExitOk;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::DATA_LOSS:
      return kExitInvalid;
    case grpc::StatusCode::FAILED_PRECONDITION:
      return kExitRefused;
    case grpc::StatusCode::NOT_FOUND:
      return kExitNotFound;
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return kExitUnavailable;
    case grpc::StatusCode::UNAUTHENTICATED:
      return kExitUnauthenticated;
    default:
      return kExitFailed;
  }
}

}  // namespace megacpp::cli
