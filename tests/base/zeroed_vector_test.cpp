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

TEST(ZeroedVector, ItsBytesAreCountedWhileItLives) {
  const int64_t before = zeroed_bytes_in_use();
  {
    const ZeroedVector<double> buffer(1000);
    EXPECT_EQ(zeroed_bytes_in_use() - before, 8000);
  }
  EXPECT_EQ(zeroed_bytes_in_use(), before);
}

}  // namespace
}  // namespace megacpp
