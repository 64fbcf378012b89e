#pragma once
// RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension.
// The residual add that precedes every norm in the model is fused here: the
// forward can add a delta into the residual stream first, and the backward adds
// the gradient already flowing along the residual stream.
#include <cmath>
#include <vector>

namespace megacpp::cpu {

// If delta is non-null, residual += delta first (in place). Then
// y = rmsnorm(residual) * weight; rstd[row] saves 1/sqrt(mean + eps).
template <typename T>
void residual_rmsnorm_forward(int rows, int dim, double eps, T* residual, const T* delta,
                              const T* weight, T* y, T* rstd) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    T* x = residual + static_cast<int64_t>(r) * dim;
    if (delta != nullptr) {
      const T* d = delta + static_cast<int64_t>(r) * dim;
      for (int c = 0; c < dim; ++c) x[c] += d[c];
    }
    double sum_sq = 0;
    for (int c = 0; c < dim; ++c) sum_sq += static_cast<double>(x[c]) * x[c];
    const T inv = static_cast<T>(1.0 / std::sqrt(sum_sq / dim + eps));
    rstd[r] = inv;
    T* out = y + static_cast<int64_t>(r) * dim;
    for (int c = 0; c < dim; ++c) out[c] = x[c] * inv * weight[c];
  }
}

// dx = d(norm)/dx · dy, plus residual_grad when non-null (the gradient reaching
// the residual stream from later layers). Writes dx (may alias residual_grad).
// dweight is accumulated; its column sums run over rows in order per column
// block so the result is deterministic.
template <typename T>
void residual_rmsnorm_backward(int rows, int dim, const T* x, const T* weight, const T* rstd,
                               const T* dy, const T* residual_grad, T* dx, T* dweight) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    const T* xr = x + static_cast<int64_t>(r) * dim;
    const T* g = dy + static_cast<int64_t>(r) * dim;
    const T inv = rstd[r];
    double dot = 0;  // sum_c g_c w_c x_c
    for (int c = 0; c < dim; ++c) dot += static_cast<double>(g[c]) * weight[c] * xr[c];
    const T coef = static_cast<T>(dot / dim) * inv * inv * inv;
    T* out = dx + static_cast<int64_t>(r) * dim;
    const T* res = residual_grad ? residual_grad + static_cast<int64_t>(r) * dim : nullptr;
    for (int c = 0; c < dim; ++c) {
      const T v = g[c] * weight[c] * inv - coef * xr[c];
      out[c] = res ? res[c] + v : v;
    }
  }
  constexpr int kColumnBlock = 32;
  const int blocks = (dim + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < blocks; ++blk) {
    const int c0 = blk * kColumnBlock;
    const int c1 = c0 + kColumnBlock < dim ? c0 + kColumnBlock : dim;
    T acc[kColumnBlock] = {};
    for (int r = 0; r < rows; ++r) {
      const T* xr = x + static_cast<int64_t>(r) * dim;
      const T* g = dy + static_cast<int64_t>(r) * dim;
      for (int c = c0; c < c1; ++c) acc[c - c0] += g[c] * xr[c] * rstd[r];
    }
    for (int c = c0; c < c1; ++c) dweight[c] += acc[c - c0];
  }
}

}  // namespace megacpp::cpu
