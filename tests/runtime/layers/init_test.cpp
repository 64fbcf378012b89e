// The parallel fills give bitwise the values of one serial pass over the stream, and leave the
// stream where the serial pass would.
#include "runtime/layers/init.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace megacpp {
namespace {

// Larger than two pieces and not a multiple of one: the last piece is ragged.
constexpr int64_t kCount = 2 * init_detail::kPiece + init_detail::kPiece / 3 + 17;

template <typename Fill, typename Serial>
void expect_matches_serial(Fill fill, Serial serial) {
  Rng parallel_rng(42), serial_rng(42);
  parallel_rng.next();  // not at the stream's start
  serial_rng.next();
  std::vector<float> parallel(kCount), expected(kCount);
  fill(parallel.data(), parallel_rng);
  for (int64_t i = 0; i < kCount; ++i) expected[static_cast<size_t>(i)] = serial(serial_rng);
  EXPECT_EQ(0, std::memcmp(parallel.data(), expected.data(), sizeof(float) * kCount));
  EXPECT_EQ(parallel_rng.next(), serial_rng.next()) << "the stream ends elsewhere";
}

TEST(Init, NormalFillEqualsTheSerialStream) {
  expect_matches_serial([](float* d, Rng& r) { fill_normal(d, kCount, 0.02, r); },
                        [](Rng& r) { return static_cast<float>(0.02 * r.normal()); });
}

TEST(Init, UniformFillEqualsTheSerialStream) {
  expect_matches_serial([](float* d, Rng& r) { fill_uniform(d, kCount, 0.5, r); },
                        [](Rng& r) { return static_cast<float>(r.uniform(-0.5, 0.5)); });
}

TEST(Init, SmallFillsAreSerial) {
  Rng a(7), b(7);
  std::vector<double> values(1000);
  fill_normal(values.data(), 1000, 1.0, a);
  for (double v : values) EXPECT_EQ(v, b.normal());
}

}  // namespace
}  // namespace megacpp
