#pragma once
// The Mamba-3 mixer's preprocessing (steps 1-2 of the spec): split in_proj's
// output into z, x, B, C, dd_dt, dd_A, trap, angles; A = min(−f(dd_A), −A_floor);
// DT = softplus(dd_dt + dt_bias); ADT = A·DT; RMSNorm of every (t, r, g) vector
// of B and C over its N values. The results are the scan's inputs
// (kernels/contracts/mamba3_scan.h): k = normalized B, q = normalized C.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/contracts/mamba3_preprocess.h"

namespace megacpp::cpu {

using ops::Mamba3PreprocessShape;
using ops::Mamba3ScanBuffers;

// The heavy-tailed map f of the spec and its derivative.
template <typename T>
inline T heavy_tail(T v) {
  return v >= T(0) ? T(1) + v : T(1) / (T(1) - v);
}
template <typename T>
inline T heavy_tail_derivative(T v) {
  return v >= T(0) ? T(1) : T(1) / ((T(1) - v) * (T(1) - v));
}
template <typename T>
inline T softplus(T v) {
  return v > T(20) ? v : std::log1p(std::exp(v));
}

namespace detail {
template <typename T>
void group_rmsnorm_forward(int n, double eps, const T* in, const T* weight, T* out, T* rstd) {
  double sum_sq = 0;
  for (int i = 0; i < n; ++i) sum_sq += static_cast<double>(in[i]) * in[i];
  const T inv = static_cast<T>(1.0 / std::sqrt(sum_sq / n + eps));
  *rstd = inv;
  for (int i = 0; i < n; ++i) out[i] = in[i] * inv * weight[i];
}
// dx of one normalized vector; its contribution to dweight goes to dweight_row.
template <typename T>
void group_rmsnorm_backward(int n, const T* in, const T* weight, T rstd, const T* dy, T* dx,
                            T* dweight_row) {
  double dot = 0;
  for (int i = 0; i < n; ++i) dot += static_cast<double>(dy[i]) * weight[i] * in[i];
  const T coef = static_cast<T>(dot / n) * rstd * rstd * rstd;
  for (int i = 0; i < n; ++i) {
    dx[i] = dy[i] * weight[i] * rstd - coef * in[i];
    dweight_row[i] += dy[i] * in[i] * rstd;
  }
}
}  // namespace detail

// bc_rstd [rows, 2·R·G] saves the B then C norm scales for the backward.
template <typename T>
void mamba3_preprocess_forward(const Mamba3PreprocessShape& s, const T* proj, const T* dt_bias,
                               const T* b_norm_weight, const T* c_norm_weight,
                               const Mamba3ScanBuffers<T>& out, T* bc_rstd) {
  const int cols = s.columns(), di = s.d_inner(), bc = s.bc_width(), vecs = s.rank * s.groups;
  const T floor = static_cast<T>(s.a_floor);
#pragma omp parallel for schedule(static)
  for (int r = 0; r < s.rows; ++r) {
    const T* p = proj + static_cast<int64_t>(r) * cols;
    std::memcpy(out.z + static_cast<int64_t>(r) * di, p, sizeof(T) * di);
    std::memcpy(out.x + static_cast<int64_t>(r) * di, p + s.col_x(), sizeof(T) * di);
    for (int v = 0; v < vecs; ++v) {
      detail::group_rmsnorm_forward(s.state, s.norm_eps, p + s.col_b() + v * s.state, b_norm_weight,
                                    out.k + static_cast<int64_t>(r) * bc + v * s.state,
                                    bc_rstd + static_cast<int64_t>(r) * 2 * vecs + v);
      detail::group_rmsnorm_forward(s.state, s.norm_eps, p + s.col_c() + v * s.state, c_norm_weight,
                                    out.q + static_cast<int64_t>(r) * bc + v * s.state,
                                    bc_rstd + static_cast<int64_t>(r) * 2 * vecs + vecs + v);
    }
    for (int h = 0; h < s.heads; ++h) {
      const int64_t o = static_cast<int64_t>(r) * s.heads + h;
      const T a = std::min(-heavy_tail(p[s.col_dd_a() + h]), -floor);
      const T dt = softplus(p[s.col_dd_dt() + h] + dt_bias[h]);
      out.dt[o] = dt;
      out.adt[o] = a * dt;
      out.trap[o] = p[s.col_trap() + h];
    }
    std::memcpy(out.angles + static_cast<int64_t>(r) * s.angles, p + s.col_angles(),
                sizeof(T) * s.angles);
  }
}

// Maps the scan's gradients (same buffers layout, holding gradients) back onto
// dproj (overwritten) and accumulates d dt_bias, d B_norm.weight, d C_norm.weight.
// row_scratch [rows, H + 2·N] is caller-owned: per-row partials of the shared
// parameters, summed in row order afterwards for determinism.
template <typename T>
void mamba3_preprocess_backward(const Mamba3PreprocessShape& s, const T* proj, const T* dt_bias,
                                const T* b_norm_weight, const T* c_norm_weight, const T* bc_rstd,
                                const Mamba3ScanBuffers<const T>& grad, T* dproj, T* d_dt_bias,
                                T* d_b_norm_weight, T* d_c_norm_weight, T* row_scratch) {
  const int cols = s.columns(), di = s.d_inner(), bc = s.bc_width(), vecs = s.rank * s.groups;
  const int scratch_width = s.heads + 2 * s.state;
  const T floor = static_cast<T>(s.a_floor);
#pragma omp parallel for schedule(static)
  for (int r = 0; r < s.rows; ++r) {
    const T* p = proj + static_cast<int64_t>(r) * cols;
    T* dp = dproj + static_cast<int64_t>(r) * cols;
    T* scratch = row_scratch + static_cast<int64_t>(r) * scratch_width;
    std::memset(scratch, 0, sizeof(T) * scratch_width);
    std::memcpy(dp, grad.z + static_cast<int64_t>(r) * di, sizeof(T) * di);
    std::memcpy(dp + s.col_x(), grad.x + static_cast<int64_t>(r) * di, sizeof(T) * di);
    const T* rstd = bc_rstd + static_cast<int64_t>(r) * 2 * vecs;
    for (int v = 0; v < vecs; ++v) {
      detail::group_rmsnorm_backward(s.state, p + s.col_b() + v * s.state, b_norm_weight, rstd[v],
                                     grad.k + static_cast<int64_t>(r) * bc + v * s.state,
                                     dp + s.col_b() + v * s.state, scratch + s.heads);
      detail::group_rmsnorm_backward(s.state, p + s.col_c() + v * s.state, c_norm_weight,
                                     rstd[vecs + v],
                                     grad.q + static_cast<int64_t>(r) * bc + v * s.state,
                                     dp + s.col_c() + v * s.state, scratch + s.heads + s.state);
    }
    for (int h = 0; h < s.heads; ++h) {
      const int64_t o = static_cast<int64_t>(r) * s.heads + h;
      const T dd_a = p[s.col_dd_a() + h];
      const T f = heavy_tail(dd_a);
      const T a = std::min(-f, -floor);
      const T pre = p[s.col_dd_dt() + h] + dt_bias[h];
      const T dt = softplus(pre);
      const T d_dt = grad.dt[o] + grad.adt[o] * a;
      const T d_pre = d_dt / (T(1) + std::exp(-pre));
      dp[s.col_dd_dt() + h] = d_pre;
      scratch[h] = d_pre;
      // A is clamped at −A_floor: no gradient flows where the floor binds.
      dp[s.col_dd_a() + h] = f > floor ? -grad.adt[o] * dt * heavy_tail_derivative(dd_a) : T(0);
      dp[s.col_trap() + h] = grad.trap[o];
    }
    std::memcpy(dp + s.col_angles(), grad.angles + static_cast<int64_t>(r) * s.angles,
                sizeof(T) * s.angles);
  }
  for (int r = 0; r < s.rows; ++r) {
    const T* scratch = row_scratch + static_cast<int64_t>(r) * scratch_width;
    for (int h = 0; h < s.heads; ++h) d_dt_bias[h] += scratch[h];
    for (int n = 0; n < s.state; ++n) {
      d_b_norm_weight[n] += scratch[s.heads + n];
      d_c_norm_weight[n] += scratch[s.heads + s.state + n];
    }
  }
}

}  // namespace megacpp::cpu
