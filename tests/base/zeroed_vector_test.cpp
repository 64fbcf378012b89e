#include "base/zeroed_vector.h"

#include <gtest/gtest.h>

namespace megacpp {
namespace {

TEST(ZeroedVector, StartsAsZerosAndWritesWhatItIsGiven) {
  const ZeroedVector<float> zeros(size_t{1} << 22);
  for (float v : zeros) ASSERT_EQ(v, 0.f);
  ZeroedVector<double> filled(100, 2.5);
  for (double v : filled) EXPECT_EQ(v, 2.5);
  filled.push_back(-1.0);
  EXPECT_EQ(filled.back(), -1.0);
  const ZeroedVector<double> copy(filled.begin(), filled.end());
  EXPECT_EQ(copy.size(), 101u);
  EXPECT_EQ(copy.front(), 2.5);
}

}  // namespace
}  // namespace megacpp
