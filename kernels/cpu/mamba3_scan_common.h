#pragma once
// What the recurrent and the chunked Mamba-3 scans (mamba3_scan.h) share: the
// prologue (biases, angle cumsum, rotation, PsiV, trapezoid coefficients), the
// epilogue (D·v skip, silu(z) gating, mimo_o contraction), their backward passes
// and the cross-head reductions of the gradients. Only the state recurrence in the
// middle differs between the two forms, so a disagreement between them in a test
// points at that middle part.
//
// Work is split by (batch, head) pair, bh = b * heads + h. Everything a pair needs
// lives in its own slice of buffers allocated once here, so a pair is computed by
// one thread from start to end and gradients shared by several pairs (q, k, angles,
// biases, mimo weights, D) are summed afterwards in a fixed order: results do not
// depend on which thread ran which pair.
#include <cmath>
#include <cstddef>
#include <numbers>
#include <vector>

#include "base/error.h"
#include "kernels/contracts/mamba3_scan.h"

namespace megacpp::cpu {
using ops::ScanGrads;
using ops::ScanInputs;
using ops::ScanShape;
}  // namespace megacpp::cpu

namespace megacpp::cpu::mamba3_detail {

struct RotationPair {
  int first;
  int second;
};

// The two coordinates that rotation angle j turns. The only place that knows the
// pairing: if the reference pairs coordinates differently, change this line.
inline RotationPair rotation_pair(int angle, int state) {
  return {angle, angle + state / 2};
}

inline const ScanShape& validated_shape(const ScanShape& shape, bool needs_chunk) {
  const auto require_positive = [](int value, const char* field) {
    if (value <= 0) {
      fail(ErrorKind::kInvalidArgument, "ScanShape.{}={} must be positive", field, value);
    }
  };
  require_positive(shape.batch, "batch");
  require_positive(shape.seqlen, "seqlen");
  require_positive(shape.heads, "heads");
  require_positive(shape.groups, "groups");
  require_positive(shape.state, "state");
  require_positive(shape.headdim, "headdim");
  require_positive(shape.rank, "rank");
  if (needs_chunk) require_positive(shape.chunk, "chunk");
  if (shape.heads % shape.groups != 0) {
    fail(ErrorKind::kInvalidArgument, "ScanShape.groups={} does not divide heads={}", shape.groups,
         shape.heads);
  }
  if (shape.angles < 0 || shape.angles > shape.state / 2) {
    fail(ErrorKind::kInvalidArgument,
         "ScanShape.angles={} must lie in [0, state/2={}] (angle j rotates dims j and j + N/2)",
         shape.angles, shape.state / 2);
  }
  return shape;
}

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Pointers into one (batch, head) pair's slice of the shared buffers. Rows of the
// [L, R, *] buffers are (token, rank), so a chunk of tokens is a contiguous block.
template <typename T>
struct HeadSlice {
  // Forward values, kept for backward.
  T* q;             // [L, R, N] biased, rotated
  T* k;             // [L, R, N]
  T* v;             // [L, R, P] x ⊙ mimo_x
  T* o;             // [L, R, P] S q + D v
  T* gate_sigmoid;  // [L, R, P] sigmoid(z ⊙ mimo_z)
  T* cos;           // [L, A]
  T* sin;           // [L, A]
  T* adt;           // [L] copies of this head's inputs, contiguous
  T* dt;            // [L]
  T* tau;           // [L] sigmoid(trap)
  T* alpha;         // [L] exp(adt)
  T* beta;          // [L] (1 - tau) dt alpha
  T* gamma;         // [L] tau dt
  T* kappa;         // [L] gamma_t + (1 - tau_{t+1}) dt_{t+1}
  // Gradients. The scan adds into dq, dk, dv and the coefficient gradients, which
  // the epilogue backward initializes (dv to D·do, the others to zero).
  T* dq;        // [L, R, N] w.r.t. rotated q, then (in place) w.r.t. biased q
  T* dk;        // [L, R, N]
  T* dv;        // [L, R, P]
  T* d_o;       // [L, R, P]
  T* d_alpha;   // [L]
  T* d_beta;    // [L]
  T* d_gamma;   // [L]
  T* d_kappa;   // [L]
  T* d_adt;     // [L] direct (the chunked form's cumulative decay)
  T* d_angles;  // [L, A] this head's share
  T* d_q_bias;  // [R, N] summed over tokens
  T* d_k_bias;  // [R, N]
  T* d_mimo_x;  // [R, P]
  T* d_mimo_z;  // [R, P]
  T* d_mimo_o;  // [R, P]
  T* d_d;       // [1]
};

template <typename T>
class ScanCommon {
 public:
  explicit ScanCommon(const ScanShape& shape)
      : shape_(shape),
        pairs_(static_cast<size_t>(shape.batch) * static_cast<size_t>(shape.heads)),
        len_(static_cast<size_t>(shape.seqlen)),
        rank_n_(static_cast<size_t>(shape.rank) * static_cast<size_t>(shape.state)),
        rank_p_(static_cast<size_t>(shape.rank) * static_cast<size_t>(shape.headdim)),
        angle_count_(static_cast<size_t>(shape.angles)) {
    // q k dq dk; v o gate_sigmoid dv d_o; cos sin d_angles; the per-token scalars.
    const size_t per_token = 4 * rank_n_ + 5 * rank_p_ + 3 * angle_count_ + kTokenScalars;
    const size_t per_pair = len_ * per_token + 2 * rank_n_ + 3 * rank_p_ + 1;
    pair_stride_ = per_pair;
    storage_.assign(pairs_ * per_pair, T(0));
  }

  const ScanShape& shape() const { return shape_; }

  // Whether a call is big enough to pay for waking threads. A pair's results do not
  // depend on the thread that computes it, so this changes timing, never results.
  bool worth_threads() const {
    const double multiply_adds = static_cast<double>(pairs_) * static_cast<double>(len_) *
                                 static_cast<double>(rank_n_) * static_cast<double>(shape_.headdim);
    return multiply_adds >= kThreadingThreshold;
  }
  int pairs() const { return static_cast<int>(pairs_); }

  HeadSlice<T> slice(int bh) {
    T* cursor = storage_.data() + static_cast<size_t>(bh) * pair_stride_;
    const auto take = [&cursor](size_t count) {
      T* begin = cursor;
      cursor += count;
      return begin;
    };
    HeadSlice<T> s{};
    s.q = take(len_ * rank_n_);
    s.k = take(len_ * rank_n_);
    s.v = take(len_ * rank_p_);
    s.o = take(len_ * rank_p_);
    s.gate_sigmoid = take(len_ * rank_p_);
    s.dq = take(len_ * rank_n_);
    s.dk = take(len_ * rank_n_);
    s.dv = take(len_ * rank_p_);
    s.d_o = take(len_ * rank_p_);
    s.cos = take(len_ * angle_count_);
    s.sin = take(len_ * angle_count_);
    s.d_angles = take(len_ * angle_count_);
    s.adt = take(len_);
    s.dt = take(len_);
    s.tau = take(len_);
    s.alpha = take(len_);
    s.beta = take(len_);
    s.gamma = take(len_);
    s.kappa = take(len_);
    s.d_alpha = take(len_);
    s.d_beta = take(len_);
    s.d_gamma = take(len_);
    s.d_kappa = take(len_);
    s.d_adt = take(len_);
    s.d_q_bias = take(rank_n_);
    s.d_k_bias = take(rank_n_);
    s.d_mimo_x = take(rank_p_);
    s.d_mimo_z = take(rank_p_);
    s.d_mimo_o = take(rank_p_);
    s.d_d = take(1);
    return s;
  }

  // Steps 3-6 up to the recurrence: fills q, k, v, cos, sin and the coefficients.
  void prologue_forward(const ScanInputs<T>& in, int bh) {
    const HeadSlice<T> s = slice(bh);
    const int heads = shape_.heads, rank = shape_.rank, state = shape_.state;
    const int groups = shape_.groups, headdim = shape_.headdim, angles = shape_.angles;
    const int b = bh / heads, h = bh % heads, g = h / (heads / groups);
    const T pi = std::numbers::pi_v<T>;
    for (size_t t = 0; t < len_; ++t) {
      const size_t token = static_cast<size_t>(b) * len_ + t;
      const size_t coeff = token * static_cast<size_t>(heads) + static_cast<size_t>(h);
      s.adt[t] = in.adt[coeff];
      s.dt[t] = in.dt[coeff];
      s.tau[t] = sigmoid(in.trap[coeff]);
      // θ_t accumulates in the cos buffer until the whole prefix sum is known.
      T* theta = s.cos + t * angle_count_;
      for (int j = 0; j < angles; ++j) {
        const T previous = t == 0 ? T(0) : s.cos[(t - 1) * angle_count_ + j];
        theta[j] = previous + std::tanh(in.angles[token * angle_count_ + j]) * s.dt[t] * pi;
      }
      for (int r = 0; r < rank; ++r) {
        const size_t row = t * static_cast<size_t>(rank) + static_cast<size_t>(r);
        const size_t in_row =
            (token * static_cast<size_t>(rank) + static_cast<size_t>(r)) * groups + g;
        const T* q_in = in.q + in_row * static_cast<size_t>(state);
        const T* k_in = in.k + in_row * static_cast<size_t>(state);
        const size_t bias_row = static_cast<size_t>(h) * rank + static_cast<size_t>(r);
        const T* q_bias = in.q_bias + bias_row * static_cast<size_t>(state);
        const T* k_bias = in.k_bias + bias_row * static_cast<size_t>(state);
        T* q_out = s.q + row * static_cast<size_t>(state);
        T* k_out = s.k + row * static_cast<size_t>(state);
        for (int n = 0; n < state; ++n) {
          q_out[n] = q_in[n] + q_bias[n];
          k_out[n] = k_in[n] + k_bias[n];
        }
        const T* x = in.v + coeff * static_cast<size_t>(headdim);
        const T* mimo_x = in.mimo_x + bias_row * static_cast<size_t>(headdim);
        T* v_out = s.v + row * static_cast<size_t>(headdim);
        for (int p = 0; p < headdim; ++p) v_out[p] = x[p] * mimo_x[p];
      }
    }
    for (size_t i = 0; i < len_ * angle_count_; ++i) {
      const T theta = s.cos[i];
      s.cos[i] = std::cos(theta);
      s.sin[i] = std::sin(theta);
    }
    for (size_t t = 0; t < len_; ++t) {
      for (int r = 0; r < rank; ++r) {
        const size_t row = t * static_cast<size_t>(rank) + static_cast<size_t>(r);
        rotate(s.q + row * static_cast<size_t>(state), s.cos + t * angle_count_,
               s.sin + t * angle_count_);
        rotate(s.k + row * static_cast<size_t>(state), s.cos + t * angle_count_,
               s.sin + t * angle_count_);
      }
    }
    for (size_t t = 0; t < len_; ++t) {
      s.alpha[t] = std::exp(s.adt[t]);
      s.beta[t] = (T(1) - s.tau[t]) * s.dt[t] * s.alpha[t];
      s.gamma[t] = s.tau[t] * s.dt[t];
      s.kappa[t] = s.gamma[t];
      if (t + 1 < len_) s.kappa[t] += (T(1) - s.tau[t + 1]) * s.dt[t + 1];
    }
  }

  // Step 7 (and the D·v term of step 6), given o = S q from the scan in slice.o;
  // slice.o then holds the full o. Writes y[b, :, h, :].
  void epilogue_forward(const ScanInputs<T>& in, int bh, T* y) {
    const HeadSlice<T> s = slice(bh);
    const int heads = shape_.heads, rank = shape_.rank, headdim = shape_.headdim;
    const int b = bh / heads, h = bh % heads;
    const T skip = in.d[h];
    for (size_t t = 0; t < len_; ++t) {
      const size_t coeff = (static_cast<size_t>(b) * len_ + t) * heads + static_cast<size_t>(h);
      const T* z = in.z + coeff * static_cast<size_t>(headdim);
      T* y_t = y + coeff * static_cast<size_t>(headdim);
      for (int p = 0; p < headdim; ++p) y_t[p] = T(0);
      for (int r = 0; r < rank; ++r) {
        const size_t row =
            (t * static_cast<size_t>(rank) + static_cast<size_t>(r)) * static_cast<size_t>(headdim);
        const size_t weight_row = static_cast<size_t>(h) * rank_p_ +
                                  static_cast<size_t>(r) * static_cast<size_t>(headdim);
        const T* mimo_z = in.mimo_z + weight_row;
        const T* mimo_o = in.mimo_o + weight_row;
        const T* v = s.v + row;
        T* o = s.o + row;
        T* gate_sigmoid = s.gate_sigmoid + row;
        // The library exp does not vectorize, so it gets its own loop and the
        // arithmetic below can; omp simd tells GCC the rows do not overlap, which it
        // cannot prove and would otherwise keep the loop scalar.
        for (int p = 0; p < headdim; ++p) gate_sigmoid[p] = sigmoid(z[p] * mimo_z[p]);
#pragma omp simd
        for (int p = 0; p < headdim; ++p) {
          o[p] += skip * v[p];
          y_t[p] += o[p] * (z[p] * mimo_z[p]) * gate_sigmoid[p] * mimo_o[p];
        }
      }
    }
  }

  // Backward of the epilogue. Also starts the pair's backward: sets d_o, dv = D·d_o
  // and zeroes every gradient the scan accumulates into. Writes grads.z[b, :, h, :].
  void epilogue_backward(const ScanInputs<T>& in, const T* dy, int bh, const ScanGrads<T>& grads) {
    const HeadSlice<T> s = slice(bh);
    const int heads = shape_.heads, rank = shape_.rank, headdim = shape_.headdim;
    const int b = bh / heads, h = bh % heads;
    const T skip = in.d[h];
    for (size_t i = 0; i < len_ * rank_n_; ++i) {
      s.dq[i] = T(0);
      s.dk[i] = T(0);
    }
    for (size_t t = 0; t < len_; ++t) {
      s.d_alpha[t] = s.d_beta[t] = s.d_gamma[t] = s.d_kappa[t] = s.d_adt[t] = T(0);
    }
    for (size_t i = 0; i < rank_p_; ++i) s.d_mimo_z[i] = s.d_mimo_o[i] = T(0);
    T d_skip = T(0);
    for (size_t t = 0; t < len_; ++t) {
      const size_t coeff = (static_cast<size_t>(b) * len_ + t) * heads + static_cast<size_t>(h);
      const T* z = in.z + coeff * static_cast<size_t>(headdim);
      const T* dy_t = dy + coeff * static_cast<size_t>(headdim);
      T* dz = grads.z + coeff * static_cast<size_t>(headdim);
      for (int p = 0; p < headdim; ++p) dz[p] = T(0);
      for (int r = 0; r < rank; ++r) {
        const size_t row =
            (t * static_cast<size_t>(rank) + static_cast<size_t>(r)) * static_cast<size_t>(headdim);
        const size_t weight_row = static_cast<size_t>(r) * static_cast<size_t>(headdim);
        const T* mimo_z = in.mimo_z + static_cast<size_t>(h) * rank_p_ + weight_row;
        const T* mimo_o = in.mimo_o + static_cast<size_t>(h) * rank_p_ + weight_row;
        const T* o = s.o + row;
        const T* v = s.v + row;
        const T* gate_sigmoid = s.gate_sigmoid + row;
        T* d_o = s.d_o + row;
        T* dv = s.dv + row;
        T* d_mimo_z = s.d_mimo_z + weight_row;
        T* d_mimo_o = s.d_mimo_o + weight_row;
#pragma omp simd
        for (int p = 0; p < headdim; ++p) {
          const T gate = z[p] * mimo_z[p];
          const T silu = gate * gate_sigmoid[p];
          d_o[p] = dy_t[p] * silu * mimo_o[p];
          dv[p] = skip * d_o[p];
          d_mimo_o[p] += dy_t[p] * o[p] * silu;
          const T d_gate = dy_t[p] * o[p] * mimo_o[p] * gate_sigmoid[p] *
                           (T(1) + gate * (T(1) - gate_sigmoid[p]));
          dz[p] += d_gate * mimo_z[p];
          d_mimo_z[p] += d_gate * z[p];
        }
        T row_skip = T(0);
        for (int p = 0; p < headdim; ++p) row_skip += d_o[p] * v[p];
        d_skip += row_skip;
      }
    }
    s.d_d[0] = d_skip;
  }

  // Backward of the prologue, once the scan has filled dq, dk, dv (w.r.t. rotated q,
  // k and v) and the coefficient gradients. Writes grads.v/adt/dt/trap[b, :, h] and
  // this pair's shares of the gradients that reduce_shared_grads() sums.
  void prologue_backward(const ScanInputs<T>& in, int bh, const ScanGrads<T>& grads) {
    const HeadSlice<T> s = slice(bh);
    const int heads = shape_.heads, rank = shape_.rank, state = shape_.state;
    const int headdim = shape_.headdim, angles = shape_.angles;
    const int b = bh / heads, h = bh % heads;
    const T pi = std::numbers::pi_v<T>;
    for (size_t i = 0; i < len_ * angle_count_; ++i) s.d_angles[i] = T(0);
    for (size_t i = 0; i < rank_n_; ++i) s.d_q_bias[i] = s.d_k_bias[i] = T(0);
    for (size_t i = 0; i < rank_p_; ++i) s.d_mimo_x[i] = T(0);
    for (size_t t = 0; t < len_; ++t) {
      const size_t coeff = (static_cast<size_t>(b) * len_ + t) * heads + static_cast<size_t>(h);
      T* d_angle = s.d_angles + t * angle_count_;
      for (int r = 0; r < rank; ++r) {
        const size_t row = t * static_cast<size_t>(rank) + static_cast<size_t>(r);
        const size_t offset = row * static_cast<size_t>(state);
        unrotate_grad(s.dq + offset, s.q + offset, s.cos + t * angle_count_,
                      s.sin + t * angle_count_, d_angle);
        unrotate_grad(s.dk + offset, s.k + offset, s.cos + t * angle_count_,
                      s.sin + t * angle_count_, d_angle);
        T* dq_bias = s.d_q_bias + static_cast<size_t>(r) * static_cast<size_t>(state);
        T* dk_bias = s.d_k_bias + static_cast<size_t>(r) * static_cast<size_t>(state);
        for (int n = 0; n < state; ++n) {
          dq_bias[n] += s.dq[offset + n];
          dk_bias[n] += s.dk[offset + n];
        }
      }
      const T* x = in.v + coeff * static_cast<size_t>(headdim);
      T* dx = grads.v + coeff * static_cast<size_t>(headdim);
      for (int p = 0; p < headdim; ++p) dx[p] = T(0);
      for (int r = 0; r < rank; ++r) {
        const size_t row = t * static_cast<size_t>(rank) + static_cast<size_t>(r);
        const T* dv = s.dv + row * static_cast<size_t>(headdim);
        const T* mimo_x = in.mimo_x + static_cast<size_t>(h) * rank_p_ +
                          static_cast<size_t>(r) * static_cast<size_t>(headdim);
        T* d_mimo_x = s.d_mimo_x + static_cast<size_t>(r) * static_cast<size_t>(headdim);
        for (int p = 0; p < headdim; ++p) {
          dx[p] += dv[p] * mimo_x[p];
          d_mimo_x[p] += dv[p] * x[p];
        }
      }
    }
    // d_angles holds dL/dθ_t; θ_t sums over s <= t, so each token needs the suffix sum.
    for (size_t t = len_ - 1; t-- > 0;) {
      for (int j = 0; j < angles; ++j)
        s.d_angles[t * angle_count_ + j] += s.d_angles[(t + 1) * angle_count_ + j];
    }
    for (size_t t = 0; t < len_; ++t) {
      const size_t token = static_cast<size_t>(b) * len_ + t;
      const size_t coeff = token * heads + static_cast<size_t>(h);
      const T tau = s.tau[t], dt = s.dt[t];
      T d_dt = s.d_beta[t] * (T(1) - tau) * s.alpha[t] + (s.d_gamma[t] + s.d_kappa[t]) * tau;
      T d_tau = -s.d_beta[t] * dt * s.alpha[t] + (s.d_gamma[t] + s.d_kappa[t]) * dt;
      if (t > 0) {
        d_dt += s.d_kappa[t - 1] * (T(1) - tau);
        d_tau -= s.d_kappa[t - 1] * dt;
      }
      for (int j = 0; j < angles; ++j) {
        const T slope = std::tanh(in.angles[token * angle_count_ + j]);
        T& d_angle = s.d_angles[t * angle_count_ + j];
        d_dt += d_angle * slope * pi;
        d_angle *= (T(1) - slope * slope) * dt * pi;
      }
      grads.adt[coeff] = s.d_adt[t] + s.d_alpha[t] * s.alpha[t] + s.d_beta[t] * s.beta[t];
      grads.dt[coeff] = d_dt;
      grads.trap[coeff] = d_tau * tau * (T(1) - tau);
    }
  }

  // Sums the per-pair shares: q and k over the heads of a group, angles over heads,
  // biases, mimo weights and D over the batch. Each output element has one owner
  // and a fixed summation order.
  void reduce_shared_grads(const ScanGrads<T>& grads) {
    const int batch = shape_.batch, heads = shape_.heads, groups = shape_.groups;
    const int rank = shape_.rank, state = shape_.state;
    const int heads_per_group = heads / groups;
    const int tokens = batch * shape_.seqlen;
    const bool parallel = worth_threads();
#pragma omp parallel for schedule(static) if (parallel)
    for (int token = 0; token < tokens; ++token) {
      const int b = token / shape_.seqlen;
      const size_t t = static_cast<size_t>(token % shape_.seqlen);
      for (int r = 0; r < rank; ++r) {
        for (int g = 0; g < groups; ++g) {
          const size_t out = ((static_cast<size_t>(token) * rank + r) * groups + g) * state;
          const size_t row = (t * static_cast<size_t>(rank) + static_cast<size_t>(r)) * state;
          T* dq = grads.q + out;
          T* dk = grads.k + out;
          for (int hg = 0; hg < heads_per_group; ++hg) {
            const HeadSlice<T> s = slice(b * heads + g * heads_per_group + hg);
            for (int n = 0; n < state; ++n) {
              dq[n] = hg == 0 ? s.dq[row + n] : dq[n] + s.dq[row + n];
              dk[n] = hg == 0 ? s.dk[row + n] : dk[n] + s.dk[row + n];
            }
          }
        }
      }
      for (size_t j = 0; j < angle_count_; ++j) {
        T d_angle = T(0);
        for (int h = 0; h < heads; ++h)
          d_angle += slice(b * heads + h).d_angles[t * angle_count_ + j];
        grads.angles[static_cast<size_t>(token) * angle_count_ + j] = d_angle;
      }
    }
#pragma omp parallel for schedule(static) if (parallel)
    for (int h = 0; h < heads; ++h) {
      const size_t n_offset = static_cast<size_t>(h) * rank_n_;
      const size_t p_offset = static_cast<size_t>(h) * rank_p_;
      for (size_t i = 0; i < rank_n_; ++i) {
        T dq_bias = T(0), dk_bias = T(0);
        for (int b = 0; b < batch; ++b) {
          const HeadSlice<T> s = slice(b * heads + h);
          dq_bias += s.d_q_bias[i];
          dk_bias += s.d_k_bias[i];
        }
        grads.q_bias[n_offset + i] = dq_bias;
        grads.k_bias[n_offset + i] = dk_bias;
      }
      for (size_t i = 0; i < rank_p_; ++i) {
        T d_mimo_x = T(0), d_mimo_z = T(0), d_mimo_o = T(0);
        for (int b = 0; b < batch; ++b) {
          const HeadSlice<T> s = slice(b * heads + h);
          d_mimo_x += s.d_mimo_x[i];
          d_mimo_z += s.d_mimo_z[i];
          d_mimo_o += s.d_mimo_o[i];
        }
        grads.mimo_x[p_offset + i] = d_mimo_x;
        grads.mimo_z[p_offset + i] = d_mimo_z;
        grads.mimo_o[p_offset + i] = d_mimo_o;
      }
      T d_skip = T(0);
      for (int b = 0; b < batch; ++b) d_skip += slice(b * heads + h).d_d[0];
      grads.d[h] = d_skip;
    }
  }

  void require_complete(const ScanInputs<T>& in) const {
    const auto require = [](const T* pointer, const char* field) {
      if (pointer == nullptr) fail(ErrorKind::kInvalidArgument, "ScanInputs.{} is null", field);
    };
    require(in.q, "q");
    require(in.k, "k");
    require(in.v, "v");
    require(in.z, "z");
    require(in.adt, "adt");
    require(in.dt, "dt");
    require(in.trap, "trap");
    if (shape_.angles > 0) require(in.angles, "angles");
    require(in.q_bias, "q_bias");
    require(in.k_bias, "k_bias");
    require(in.mimo_x, "mimo_x");
    require(in.mimo_z, "mimo_z");
    require(in.mimo_o, "mimo_o");
    require(in.d, "d");
  }

  void require_complete(const ScanGrads<T>& grads) const {
    const auto require = [](const T* pointer, const char* field) {
      if (pointer == nullptr) fail(ErrorKind::kInvalidArgument, "ScanGrads.{} is null", field);
    };
    require(grads.q, "q");
    require(grads.k, "k");
    require(grads.v, "v");
    require(grads.z, "z");
    require(grads.adt, "adt");
    require(grads.dt, "dt");
    require(grads.trap, "trap");
    if (shape_.angles > 0) require(grads.angles, "angles");
    require(grads.q_bias, "q_bias");
    require(grads.k_bias, "k_bias");
    require(grads.mimo_x, "mimo_x");
    require(grads.mimo_z, "mimo_z");
    require(grads.mimo_o, "mimo_o");
    require(grads.d, "d");
  }

 private:
  // adt dt tau alpha beta gamma kappa, and d_ alpha beta gamma kappa adt
  static constexpr size_t kTokenScalars = 12;
  static constexpr double kThreadingThreshold = 1 << 17;

  void rotate(T* vec, const T* cos, const T* sin) const {
    for (int j = 0; j < shape_.angles; ++j) {
      const RotationPair pair = rotation_pair(j, shape_.state);
      const T a = vec[pair.first], b = vec[pair.second];
      vec[pair.first] = a * cos[j] - b * sin[j];
      vec[pair.second] = a * sin[j] + b * cos[j];
    }
  }

  // grad: in, w.r.t. the rotated vector; out, w.r.t. the vector before rotation.
  // d_theta accumulates dL/dθ, which only needs the rotated values.
  void unrotate_grad(T* grad, const T* rotated, const T* cos, const T* sin, T* d_theta) const {
    for (int j = 0; j < shape_.angles; ++j) {
      const RotationPair pair = rotation_pair(j, shape_.state);
      const T da = grad[pair.first], db = grad[pair.second];
      d_theta[j] += db * rotated[pair.first] - da * rotated[pair.second];
      grad[pair.first] = da * cos[j] + db * sin[j];
      grad[pair.second] = db * cos[j] - da * sin[j];
    }
  }

  ScanShape shape_;
  size_t pairs_;
  size_t len_;
  size_t rank_n_;
  size_t rank_p_;
  size_t angle_count_;
  size_t pair_stride_ = 0;
  std::vector<T> storage_;
};

}  // namespace megacpp::cpu::mamba3_detail
