#include <gtest/gtest.h>

#include "base/version.h"

TEST(Version, NamesTheProject) {
  EXPECT_NE(megacpp::version_string().find("megacpp"), std::string::npos);
}
