#pragma once
// Parameter initialization primitives of the spec (shared/spec/model.md, "Init").
#include <cstdint>

#include "base/rng.h"

namespace megacpp {

template <typename T>
void fill_uniform(T* data, int64_t n, double bound, Rng& rng) {
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<T>(rng.uniform(-bound, bound));
}

template <typename T>
void fill_normal(T* data, int64_t n, double stddev, Rng& rng) {
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<T>(stddev * rng.normal());
}

template <typename T>
void fill_constant(T* data, int64_t n, double value) {
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<T>(value);
}

}  // namespace megacpp
