#pragma once
// The Mamba-3 MIMO scan as its definition (shared/spec/model.md, steps 3-7): the
// state S_t (P×N per batch and head) advanced one token at a time,
//   S_t = α_t S_{t-1} + β_t Σ_r v_{t-1,r} k_{t-1,r}ᵀ + γ_t Σ_r v_{t,r} k_{t,r}ᵀ,
//   o_{t,r} = S_t q_{t,r} + D v_{t,r}.
// This is the test oracle: plain loops, every S_t kept for the backward pass.
// backward() uses what the latest forward() stored, so call forward() first with
// the same inputs. Not safe to call concurrently on one object.
#include <cstddef>
#include <vector>

#include "base/error.h"
#include "kernels/contracts/mamba3_scan.h"
#include "kernels/cpu/mamba3_scan_common.h"

namespace megacpp::cpu {

template <typename T>
class Mamba3ScanRecurrent {
 public:
  explicit Mamba3ScanRecurrent(const ScanShape& shape)
      : common_(mamba3_detail::validated_shape(shape, /*needs_chunk=*/false)),
        matrix_(static_cast<size_t>(shape.headdim) * static_cast<size_t>(shape.state)),
        pair_stride_((static_cast<size_t>(shape.seqlen) + kScratchMatrices) * matrix_) {
    states_.assign(static_cast<size_t>(common_.pairs()) * pair_stride_, T(0));
  }

  void forward(const ScanInputs<T>& in, T* y) {
    common_.require_complete(in);
    if (y == nullptr) fail(ErrorKind::kInvalidArgument, "Mamba3ScanRecurrent::forward: y is null");
    const int pairs = common_.pairs();
    const bool parallel = common_.worth_threads();
#pragma omp parallel for schedule(static) if (parallel)
    for (int bh = 0; bh < pairs; ++bh) {
      common_.prologue_forward(in, bh);
      scan_forward(bh);
      common_.epilogue_forward(in, bh, y);
    }
    has_forward_ = true;
  }

  void backward(const ScanInputs<T>& in, const T* dy, const ScanGrads<T>& grads) {
    if (!has_forward_) {
      fail(ErrorKind::kFailedPrecondition,
           "Mamba3ScanRecurrent::backward needs a forward() with the same inputs first");
    }
    common_.require_complete(in);
    common_.require_complete(grads);
    if (dy == nullptr)
      fail(ErrorKind::kInvalidArgument, "Mamba3ScanRecurrent::backward: dy is null");
    const int pairs = common_.pairs();
    const bool parallel = common_.worth_threads();
#pragma omp parallel for schedule(static) if (parallel)
    for (int bh = 0; bh < pairs; ++bh) {
      common_.epilogue_backward(in, dy, bh, grads);
      scan_backward(bh);
      common_.prologue_backward(in, bh, grads);
    }
    common_.reduce_shared_grads(grads);
  }

 private:
  // Per pair after the L states: U_t, U_{t-1}, dS_t, dS_{t+1}, dU_t.
  static constexpr size_t kScratchMatrices = 5;

  T* pair_states(int bh) {
    return states_.data() + static_cast<size_t>(bh) * pair_stride_;
  }

  // U = Σ_r v_{t,r} k_{t,r}ᵀ (P×N).
  void outer_sum(const mamba3_detail::HeadSlice<T>& s, size_t t, T* u) const {
    const ScanShape& shape = common_.shape();
    const size_t n_count = static_cast<size_t>(shape.state);
    const size_t p_count = static_cast<size_t>(shape.headdim);
    for (size_t i = 0; i < matrix_; ++i) u[i] = T(0);
    for (int r = 0; r < shape.rank; ++r) {
      const size_t row = t * static_cast<size_t>(shape.rank) + static_cast<size_t>(r);
      const T* v = s.v + row * p_count;
      const T* k = s.k + row * n_count;
      for (size_t p = 0; p < p_count; ++p) {
        for (size_t n = 0; n < n_count; ++n) u[p * n_count + n] += v[p] * k[n];
      }
    }
  }

  static T dot(const T* a, const T* b, size_t count) {
    T sum = T(0);
    for (size_t i = 0; i < count; ++i) sum += a[i] * b[i];
    return sum;
  }

  void scan_forward(int bh) {
    const mamba3_detail::HeadSlice<T> s = common_.slice(bh);
    const ScanShape& shape = common_.shape();
    const size_t len = static_cast<size_t>(shape.seqlen);
    const size_t n_count = static_cast<size_t>(shape.state);
    const size_t p_count = static_cast<size_t>(shape.headdim);
    T* states = pair_states(bh);
    T* u = states + len * matrix_;
    T* u_previous = u + matrix_;
    for (size_t i = 0; i < matrix_; ++i) u_previous[i] = T(0);
    for (size_t t = 0; t < len; ++t) {
      outer_sum(s, t, u);
      T* state = states + t * matrix_;
      const T* previous = t == 0 ? nullptr : state - matrix_;
      for (size_t i = 0; i < matrix_; ++i) {
        const T carried = previous == nullptr ? T(0) : s.alpha[t] * previous[i];
        state[i] = carried + s.beta[t] * u_previous[i] + s.gamma[t] * u[i];
      }
      for (int r = 0; r < shape.rank; ++r) {
        const size_t row = t * static_cast<size_t>(shape.rank) + static_cast<size_t>(r);
        const T* q = s.q + row * n_count;
        T* o = s.o + row * p_count;
        for (size_t p = 0; p < p_count; ++p) o[p] = dot(state + p * n_count, q, n_count);
      }
      for (size_t i = 0; i < matrix_; ++i) u_previous[i] = u[i];
    }
  }

  void scan_backward(int bh) {
    const mamba3_detail::HeadSlice<T> s = common_.slice(bh);
    const ScanShape& shape = common_.shape();
    const size_t len = static_cast<size_t>(shape.seqlen);
    const size_t n_count = static_cast<size_t>(shape.state);
    const size_t p_count = static_cast<size_t>(shape.headdim);
    T* states = pair_states(bh);
    T* u = states + len * matrix_;
    T* u_previous = u + matrix_;
    T* d_state = u_previous + matrix_;
    T* d_state_next = d_state + matrix_;
    T* d_u = d_state_next + matrix_;
    for (size_t i = 0; i < matrix_; ++i) d_state_next[i] = T(0);
    for (size_t t = len; t-- > 0;) {
      const bool has_next = t + 1 < len;
      // dS_t: from o_{t,r} = S_t q_{t,r}, and through S_{t+1} = α_{t+1} S_t + ...
      for (size_t i = 0; i < matrix_; ++i) {
        d_state[i] = has_next ? s.alpha[t + 1] * d_state_next[i] : T(0);
      }
      const T* state = states + t * matrix_;
      for (int r = 0; r < shape.rank; ++r) {
        const size_t row = t * static_cast<size_t>(shape.rank) + static_cast<size_t>(r);
        const T* q = s.q + row * n_count;
        const T* d_o = s.d_o + row * p_count;
        T* dq = s.dq + row * n_count;
        for (size_t p = 0; p < p_count; ++p) {
          for (size_t n = 0; n < n_count; ++n) {
            d_state[p * n_count + n] += d_o[p] * q[n];
            dq[n] += state[p * n_count + n] * d_o[p];
          }
        }
      }
      outer_sum(s, t, u);
      if (t > 0) {
        outer_sum(s, t - 1, u_previous);
        s.d_alpha[t] += dot(d_state, state - matrix_, matrix_);
        s.d_beta[t] += dot(d_state, u_previous, matrix_);
      }
      s.d_gamma[t] += dot(d_state, u, matrix_);
      // U_t enters S_t (weight γ_t) and S_{t+1} (weight β_{t+1}).
      for (size_t i = 0; i < matrix_; ++i) {
        d_u[i] = s.gamma[t] * d_state[i] + (has_next ? s.beta[t + 1] * d_state_next[i] : T(0));
      }
      for (int r = 0; r < shape.rank; ++r) {
        const size_t row = t * static_cast<size_t>(shape.rank) + static_cast<size_t>(r);
        const T* v = s.v + row * p_count;
        const T* k = s.k + row * n_count;
        T* dv = s.dv + row * p_count;
        T* dk = s.dk + row * n_count;
        for (size_t p = 0; p < p_count; ++p) {
          dv[p] += dot(d_u + p * n_count, k, n_count);
          for (size_t n = 0; n < n_count; ++n) dk[n] += d_u[p * n_count + n] * v[p];
        }
      }
      for (size_t i = 0; i < matrix_; ++i) d_state_next[i] = d_state[i];
    }
  }

  mamba3_detail::ScanCommon<T> common_;
  size_t matrix_;
  size_t pair_stride_;
  std::vector<T> states_;
  bool has_forward_ = false;
};

}  // namespace megacpp::cpu
