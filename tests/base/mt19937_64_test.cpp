#include "base/mt19937_64.h"

#include <gtest/gtest.h>

#include <random>
#include <sstream>

#include "base/error.h"
#include "base/rng.h"

namespace megacpp {
namespace {

TEST(Mt19937_64, DrawsTheStandardEnginesStream) {
  for (uint64_t seed : {uint64_t{0}, uint64_t{1}, uint64_t{5489}, ~uint64_t{0}}) {
    Mt19937_64 ours(seed);
    std::mt19937_64 standard(seed);
    for (int i = 0; i < 5000; ++i)
      ASSERT_EQ(ours(), standard()) << "seed " << seed << " draw " << i;
  }
  // The standard's own check value: the 10000th draw of a default-constructed engine.
  Mt19937_64 engine;
  for (int i = 0; i < 9999; ++i) engine();
  EXPECT_EQ(engine(), 9981545732273789042ULL);
}

TEST(Mt19937_64, SkipsExactlyAsTheStandardEngineDoes) {
  Mt19937_64 ours(42);
  std::mt19937_64 standard(42);
  // Skips that end inside a block, on its boundary, one past it, and across many blocks, each
  // after a different number of draws into the current block.
  for (uint64_t skip : {0ULL, 1ULL, 310ULL, 311ULL, 312ULL, 313ULL, 624ULL, 1000003ULL, 7ULL}) {
    ours.discard(skip);
    standard.discard(skip);
    for (int i = 0; i < 3; ++i) ASSERT_EQ(ours(), standard()) << "after skipping " << skip;
  }
}

TEST(Mt19937_64, ItsTextStateReadsBackIntoEitherEngine) {
  Mt19937_64 ours(7);
  ours.discard(1234);
  std::stringstream text;
  text << ours;
  std::mt19937_64 standard;
  std::stringstream(text.str()) >> standard;
  Mt19937_64 reread(1);
  text >> reread;
  ASSERT_TRUE(text || text.eof());
  EXPECT_TRUE(reread == ours);
  for (int i = 0; i < 1000; ++i) {
    const uint64_t expected = ours();
    ASSERT_EQ(standard(), expected);
    ASSERT_EQ(reread(), expected);
  }
}

TEST(Mt19937_64, ItsTextIsDecimalWhateverTheStreamsFlags) {
  Mt19937_64 ours(11);
  std::stringstream decimal, hex;
  decimal << ours;
  hex << std::hex << ours;
  EXPECT_EQ(hex.str(), decimal.str());
  EXPECT_TRUE(hex.flags() & std::ios_base::hex);  // the caller's flags are left as they were
  Mt19937_64 reread(1);
  std::stringstream in(decimal.str());
  in >> std::hex >> reread;
  EXPECT_TRUE(reread == ours);
}

TEST(Mt19937_64, RngRefusesAStateThatIsNotOne) {
  Rng rng(5);
  Rng copy = rng;
  EXPECT_THROW(rng.restore("not a state"), Error);
  EXPECT_EQ(rng.next(), copy.next());
  Rng restored(1);
  restored.restore(rng.save());
  EXPECT_EQ(restored.next(), rng.next());
}

TEST(Mt19937_64, RefusesATruncatedOrOutOfRangeState) {
  Mt19937_64 engine(3);
  const Mt19937_64 before = engine;
  std::stringstream truncated("1 2 3");
  truncated >> engine;
  EXPECT_TRUE(truncated.fail());
  EXPECT_TRUE(engine == before);

  std::stringstream text;
  text << Mt19937_64(9);
  std::string state = text.str();
  state = state.substr(0, state.rfind(' ')) + " 313";  // position past the 312 words
  std::stringstream bad_position(state);
  bad_position >> engine;
  EXPECT_TRUE(bad_position.fail());
  EXPECT_TRUE(engine == before);
}

}  // namespace
}  // namespace megacpp
