#pragma once
// Global gradient-norm clipping over a set of gradient buffers.
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace megacpp::cpu {

template <typename T>
struct GradBuffer {
  T* data;
  int64_t size;
};

// Sum of squares in double, in a fixed order: fixed-size blocks summed in parallel,
// then the block partials summed sequentially, so the norm is deterministic.
template <typename T>
double global_grad_norm(std::span<const GradBuffer<T>> buffers) {
  constexpr int64_t kBlock = 1 << 14;
  double total = 0;
  std::vector<double> partial;
  for (const auto& b : buffers) {
    const int64_t blocks = (b.size + kBlock - 1) / kBlock;
    partial.assign(static_cast<size_t>(blocks), 0.0);
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < blocks; ++k) {
      const int64_t end = (k + 1) * kBlock < b.size ? (k + 1) * kBlock : b.size;
      double s = 0;
      for (int64_t i = k * kBlock; i < end; ++i) s += static_cast<double>(b.data[i]) * b.data[i];
      partial[static_cast<size_t>(k)] = s;
    }
    for (double s : partial) total += s;
  }
  return std::sqrt(total);
}

// Scales every buffer by max_norm / norm when norm exceeds max_norm. Returns the
// norm before clipping. max_norm <= 0 disables clipping.
template <typename T>
double clip_grad_norm(std::span<const GradBuffer<T>> buffers, double max_norm) {
  const double norm = global_grad_norm(buffers);
  if (max_norm > 0 && norm > max_norm) {
    const T scale = static_cast<T>(max_norm / (norm + 1e-6));
    for (const auto& b : buffers) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < b.size; ++i) b.data[i] *= scale;
    }
  }
  return norm;
}

}  // namespace megacpp::cpu
