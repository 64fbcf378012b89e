#pragma once
// Parameter initialization primitives of the spec (shared/spec/model.md, "Init").
//
// The values are those of one serial pass over one Rng stream, whatever the thread count: a
// large tensor is cut into pieces, each piece's start state is found by discarding the draws
// before it (an engine step is cheap next to a normal draw's log and cos), and the pieces are
// filled in parallel. A model of a few hundred million parameters initializes in a fraction of
// the time of the serial loop, with bitwise the same parameters.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "base/rng.h"

namespace megacpp {

namespace init_detail {

constexpr int64_t kPiece = int64_t{1} << 20;

template <typename T, typename Draw>
void fill_from_stream(T* data, int64_t n, uint64_t draws_per_value, Rng& rng, Draw draw) {
  if (n < 2 * kPiece) {
    for (int64_t i = 0; i < n; ++i) data[i] = static_cast<T>(draw(rng));
    return;
  }
  const int64_t pieces = (n + kPiece - 1) / kPiece;
  std::vector<Rng> starts;
  starts.reserve(static_cast<size_t>(pieces));
  for (int64_t p = 0; p < pieces; ++p) {
    starts.push_back(rng);
    rng.discard(static_cast<uint64_t>(std::min(kPiece, n - p * kPiece)) * draws_per_value);
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t p = 0; p < pieces; ++p) {
    Rng local = starts[static_cast<size_t>(p)];
    const int64_t end = std::min(n, (p + 1) * kPiece);
    for (int64_t i = p * kPiece; i < end; ++i) data[i] = static_cast<T>(draw(local));
  }
}

}  // namespace init_detail

template <typename T>
void fill_uniform(T* data, int64_t n, double bound, Rng& rng) {
  init_detail::fill_from_stream(data, n, 1, rng,
                                [bound](Rng& r) { return r.uniform(-bound, bound); });
}

template <typename T>
void fill_normal(T* data, int64_t n, double stddev, Rng& rng) {
  init_detail::fill_from_stream(data, n, 2, rng, [stddev](Rng& r) { return stddev * r.normal(); });
}

template <typename T>
void fill_constant(T* data, int64_t n, double value) {
  std::fill(data, data + n, static_cast<T>(value));
}

}  // namespace megacpp
