#pragma once
// The check every refusal test makes: the call throws megacpp::Error of the expected kind, and its
// message names what the user must change.
#include <gtest/gtest.h>

#include <string>

#include "base/error.h"

namespace megacpp::testing {

// Runs fn(), which must throw megacpp::Error of `kind` whose message contains `needle`.
template <class Fn>
void expect_error(Fn&& fn, ErrorKind kind, const std::string& needle, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": accepted";
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << what << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << what << ": the message does not name \"" << needle << "\": " << e.what();
  }
}

}  // namespace megacpp::testing
