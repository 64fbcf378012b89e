#pragma once
// AdamW with decoupled weight decay (Loshchilov & Hutter): the decay shrinks the
// parameter directly, outside the adaptive update. `step` counts from 1.
#include <cmath>
#include <cstdint>

#include "kernels/contracts/adamw.h"

namespace megacpp::cpu {

using AdamWHyper = ops::AdamWHyper;

template <typename T>
void adamw_step(int64_t n, T* param, const T* grad, T* m, T* v, const AdamWHyper& h, int64_t step) {
  const double bias1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  const T decay = static_cast<T>(1.0 - h.lr * h.weight_decay);
  const T b1 = static_cast<T>(h.beta1), b2 = static_cast<T>(h.beta2);
  const T step_size = static_cast<T>(h.lr / bias1);
  const T inv_sqrt_bias2 = static_cast<T>(1.0 / std::sqrt(bias2));
  const T eps = static_cast<T>(h.eps);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i];
    m[i] = b1 * m[i] + (T(1) - b1) * g;
    v[i] = b2 * v[i] + (T(1) - b2) * g * g;
    const T denom = std::sqrt(v[i]) * inv_sqrt_bias2 + eps;
    param[i] = param[i] * decay - step_size * m[i] / denom;
  }
}

}  // namespace megacpp::cpu
