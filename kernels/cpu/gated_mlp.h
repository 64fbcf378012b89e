#pragma once
// GatedMLP: [a | g] = x · fc1ᵀ (a first), h = a ⊙ silu(g), y = h · fc2ᵀ. No biases.
#include <cmath>

#include "kernels/cpu/linear.h"

namespace megacpp::cpu {

template <typename T>
inline T sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

// Saves fc1_out [rows, 2·hidden] and hidden_act [rows, hidden] for the backward.
template <typename T>
void gated_mlp_forward(int rows, int dim, int hidden, const T* x, const T* fc1, const T* fc2,
                       T* fc1_out, T* hidden_act, T* y) {
  linear_forward<T>(rows, dim, 2 * hidden, x, fc1, nullptr, fc1_out);
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    const T* a = fc1_out + static_cast<int64_t>(r) * 2 * hidden;
    const T* g = a + hidden;
    T* h = hidden_act + static_cast<int64_t>(r) * hidden;
    for (int c = 0; c < hidden; ++c) h[c] = a[c] * g[c] * sigmoid(g[c]);
  }
  linear_forward<T>(rows, hidden, dim, hidden_act, fc2, nullptr, y);
}

// scratch_hidden [rows, hidden] and scratch_fc1 [rows, 2·hidden] are caller-owned
// buffers planned with the activations. dx is overwritten; dfc1, dfc2 accumulate.
template <typename T>
void gated_mlp_backward(int rows, int dim, int hidden, const T* x, const T* fc1, const T* fc2,
                        const T* fc1_out, const T* hidden_act, const T* dy, T* dx, T* dfc1, T* dfc2,
                        T* scratch_hidden, T* scratch_fc1) {
  linear_backward<T>(rows, hidden, dim, hidden_act, fc2, dy, scratch_hidden, dfc2, nullptr);
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    const T* a = fc1_out + static_cast<int64_t>(r) * 2 * hidden;
    const T* g = a + hidden;
    const T* dh = scratch_hidden + static_cast<int64_t>(r) * hidden;
    T* da = scratch_fc1 + static_cast<int64_t>(r) * 2 * hidden;
    T* dg = da + hidden;
    for (int c = 0; c < hidden; ++c) {
      const T s = sigmoid(g[c]);
      da[c] = dh[c] * g[c] * s;
      dg[c] = dh[c] * a[c] * s * (T(1) + g[c] * (T(1) - s));
    }
  }
  linear_backward<T>(rows, dim, 2 * hidden, x, fc1, scratch_fc1, dx, dfc1, nullptr);
}

}  // namespace megacpp::cpu
