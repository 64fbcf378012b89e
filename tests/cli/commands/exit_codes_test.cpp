#include "cli/commands/exit_codes.h"

#include <gtest/gtest.h>

#include "daemon/services.h"

namespace megacpp::cli {
namespace {

constexpr ErrorKind kAllKinds[] = {
    ErrorKind::kInvalidArgument,    ErrorKind::kNotFound, ErrorKind::kCorruptData,
    ErrorKind::kFailedPrecondition, ErrorKind::kIo,       ErrorKind::kInternal};

// README promises these numbers to scripts.
TEST(ExitCodes, ErrorKindsExitWithTheDocumentedCodes) {
  EXPECT_EQ(exit_code(ErrorKind::kInvalidArgument), 2);
  EXPECT_EQ(exit_code(ErrorKind::kCorruptData), 2);
  EXPECT_EQ(exit_code(ErrorKind::kFailedPrecondition), 3);
  EXPECT_EQ(exit_code(ErrorKind::kNotFound), 4);
  EXPECT_EQ(exit_code(ErrorKind::kIo), 1);
  EXPECT_EQ(exit_code(ErrorKind::kInternal), 1);
}

TEST(ExitCodes, GrpcStatusesExitWithTheDocumentedCodes) {
  EXPECT_EQ(exit_code(grpc::StatusCode::OK), 0);
  EXPECT_EQ(exit_code(grpc::StatusCode::INVALID_ARGUMENT), 2);
  EXPECT_EQ(exit_code(grpc::StatusCode::FAILED_PRECONDITION), 3);
  EXPECT_EQ(exit_code(grpc::StatusCode::NOT_FOUND), 4);
  EXPECT_EQ(exit_code(grpc::StatusCode::UNAVAILABLE), 5);
  EXPECT_EQ(exit_code(grpc::StatusCode::DEADLINE_EXCEEDED), 5);
  EXPECT_EQ(exit_code(grpc::StatusCode::UNAUTHENTICATED), 6);
  EXPECT_EQ(exit_code(grpc::StatusCode::INTERNAL), 1);
  EXPECT_EQ(exit_code(grpc::StatusCode::UNKNOWN), 1);
}

// An error exits with the same code whether the CLI met it in process or the daemon met it and
// sent it over gRPC.
TEST(ExitCodes, AnErrorExitsAlikeOnEitherSideOfTheWire) {
  for (const ErrorKind kind : kAllKinds) {
    const grpc::Status sent = daemon::to_grpc_status(Error(kind, "x"));
    EXPECT_EQ(exit_code(sent.error_code()), exit_code(kind))
        << "ErrorKind " << static_cast<int>(kind) << " is sent as gRPC status "
        << sent.error_code();
  }
}

}  // namespace
}  // namespace megacpp::cli
