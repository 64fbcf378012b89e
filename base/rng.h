#pragma once
// A portable random source: the standard's mt19937_64 is specified bit for bit
// (base/mt19937_64.h is that engine), but the standard distributions are not, so
// uniform and normal draws are derived here to make initialization identical on
// every standard library.
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "base/error.h"
#include "base/mt19937_64.h"

namespace megacpp {

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  // Uniform in [0, 1) from the top 53 bits.
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Standard normal by Box-Muller (one value per call; the pair's second is dropped
  // so the stream position depends only on the number of calls).
  double normal() {
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  }
  uint64_t next() { return engine_(); }
  // Skips `draws` engine outputs: uniform() takes one, normal() two.
  void discard(uint64_t draws) { engine_.discard(draws); }
  std::string save() const {
    std::ostringstream out;
    out << engine_;
    return out.str();
  }
  // Refuses (kInvalidArgument) a state that is not a saved engine's text; the engine is then
  // unchanged.
  void restore(const std::string& state) {
    std::istringstream in(state);
    in >> engine_;
    if (in.fail()) {
      fail(ErrorKind::kInvalidArgument,
           "random state: not a saved mt19937_64 state (312 words and a position 0..312)");
    }
  }

 private:
  Mt19937_64 engine_;
};

}  // namespace megacpp
