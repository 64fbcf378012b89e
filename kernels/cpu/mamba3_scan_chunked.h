#pragma once
// The Mamba-3 MIMO scan in chunked form: the same function as
// mamba3_scan_recurrent.h, computed with chunk-level matrix products.
//
// With Λ_t = Σ_{u≤t} ADT_u, U_s = Σ_r v_{s,r} k_{s,r}ᵀ and
// κ_s = γ_s + (1 − τ_{s+1}) DT_{s+1} (no second term for the last token), the
// recurrence unrolls to S_t = Σ_{s<t} e^{Λ_t−Λ_s} κ_s U_s + γ_t U_t: each β_{s+1}
// term is U_s seen one step later, so it folds into U_s's own coefficient. The
// state passed between chunks is S'_t = Σ_{s≤t} e^{Λ_t−Λ_s} κ_s U_s, which already
// includes the β part of the next chunk's first token. Inside a chunk, with l_i the
// cumulative ADT since the chunk start and rows (i, r):
//   o_{i,r} = e^{l_i} S'_in q_{i,r} + Σ_{j≤i} W_ij Σ_{r'} (q_{i,r}·k_{j,r'}) v_{j,r'}
//   W_ij    = e^{l_i−l_j} κ_j for j < i, γ_i for j = i
//   S'_out  = e^{l_last} S'_in + Σ_j e^{l_last−l_j} κ_j U_j.
// ADT is expected to be negative (decay), so every exponential here is ≤ 1.
//
// forward() keeps each chunk's entry state; backward() uses what the latest
// forward() stored, so call forward() first with the same inputs. Not safe to call
// concurrently on one object.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "base/error.h"
#include "kernels/contracts/mamba3_scan.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/mamba3_scan_common.h"

namespace megacpp::cpu {

template <typename T>
class Mamba3ScanChunked {
 public:
  explicit Mamba3ScanChunked(const ScanShape& shape)
      : common_(mamba3_detail::validated_shape(shape, /*needs_chunk=*/true)),
        chunk_(std::min(shape.chunk, shape.seqlen)),
        chunks_((shape.seqlen + chunk_ - 1) / chunk_),
        max_rows_(chunk_ * shape.rank),
        matrix_(static_cast<size_t>(shape.headdim) * static_cast<size_t>(shape.state)) {
    states_.assign(static_cast<size_t>(common_.pairs()) * static_cast<size_t>(chunks_) * matrix_,
                   T(0));
    const size_t rows = static_cast<size_t>(max_rows_);
    const size_t widest = static_cast<size_t>(std::max(shape.state, shape.headdim));
    const size_t chunk = static_cast<size_t>(chunk_);
    // Scratch per (batch, head) pair rather than per thread: a few percent of the
    // pair's own buffers, and correct whatever threads (or nested regions) run it.
    scratch_stride_ = 3 * rows * rows + 2 * rows * widest + matrix_ + chunk * chunk + 3 * chunk;
    scratch_.assign(static_cast<size_t>(common_.pairs()) * scratch_stride_, T(0));
  }

  void forward(const ScanInputs<T>& in, T* y) {
    common_.require_complete(in);
    if (y == nullptr) fail(ErrorKind::kInvalidArgument, "Mamba3ScanChunked::forward: y is null");
    const int pairs = common_.pairs();
    const bool parallel = common_.worth_threads();
#pragma omp parallel for schedule(static) if (parallel)
    for (int bh = 0; bh < pairs; ++bh) {
      const Scratch scratch = pair_scratch(bh);
      common_.prologue_forward(in, bh);
      scan_forward(bh, scratch);
      common_.epilogue_forward(in, bh, y);
    }
    has_forward_ = true;
  }

  void backward(const ScanInputs<T>& in, const T* dy, const ScanGrads<T>& grads) {
    if (!has_forward_) {
      fail(ErrorKind::kFailedPrecondition,
           "Mamba3ScanChunked::backward needs a forward() with the same inputs first");
    }
    common_.require_complete(in);
    common_.require_complete(grads);
    if (dy == nullptr) fail(ErrorKind::kInvalidArgument, "Mamba3ScanChunked::backward: dy is null");
    const int pairs = common_.pairs();
    const bool parallel = common_.worth_threads();
#pragma omp parallel for schedule(static) if (parallel)
    for (int bh = 0; bh < pairs; ++bh) {
      const Scratch scratch = pair_scratch(bh);
      common_.epilogue_backward(in, dy, bh, grads);
      scan_backward(bh, scratch);
      common_.prologue_backward(in, bh, grads);
    }
    common_.reduce_shared_grads(grads);
  }

 private:
  struct Scratch {
    T* scores;      // [rows, rows] q·k of every row pair in the chunk
    T* weighted;    // [rows, rows] scores ⊙ W, zero above the diagonal blocks
    T* d_scores;    // [rows, rows]
    T* rows_a;      // [rows, max(N, P)]
    T* rows_b;      // [rows, max(N, P)]
    T* d_state;     // [P, N] gradient w.r.t. the chunk's exit state
    T* decay;       // [C, C] e^{l_i − l_j}, j ≤ i
    T* log_decay;   // [C] l_i
    T* d_log;       // [C] dL/dl_i
    T* exit_scale;  // [C] e^{l_last − l_j} κ_j
  };

  // The span of one chunk: tokens [begin, begin + length), rows [begin·R, ...).
  struct Chunk {
    int begin;
    int length;
    int rows;
  };

  Scratch pair_scratch(int bh) {
    T* cursor = scratch_.data() + static_cast<size_t>(bh) * scratch_stride_;
    const auto take = [&cursor](size_t count) {
      T* begin = cursor;
      cursor += count;
      return begin;
    };
    const ScanShape& shape = common_.shape();
    const size_t rows = static_cast<size_t>(max_rows_);
    const size_t widest = static_cast<size_t>(std::max(shape.state, shape.headdim));
    const size_t chunk = static_cast<size_t>(chunk_);
    Scratch s{};
    s.scores = take(rows * rows);
    s.weighted = take(rows * rows);
    s.d_scores = take(rows * rows);
    s.rows_a = take(rows * widest);
    s.rows_b = take(rows * widest);
    s.d_state = take(matrix_);
    s.decay = take(chunk * chunk);
    s.log_decay = take(chunk);
    s.d_log = take(chunk);
    s.exit_scale = take(chunk);
    return s;
  }

  Chunk chunk_span(int c) const {
    const int begin = c * chunk_;
    const int length = std::min(chunk_, common_.shape().seqlen - begin);
    return {begin, length, length * common_.shape().rank};
  }

  T* entry_state(int bh, int c) {
    return states_.data() +
           (static_cast<size_t>(bh) * static_cast<size_t>(chunks_) + static_cast<size_t>(c)) *
               matrix_;
  }

  // W_ij of the chunk's token pair (i, j): how much of U_j token i's state holds.
  T score_weight(const Scratch& w, const T* kappa, const T* gamma, int i, int j) const {
    if (j < i) return w.decay[static_cast<size_t>(i) * static_cast<size_t>(chunk_) + j] * kappa[j];
    return j == i ? gamma[i] : T(0);
  }

  // Decays, exit weights and the weighted score matrix of one chunk (needed by both
  // passes; backward recomputes them rather than storing them per chunk).
  void prepare_chunk(const mamba3_detail::HeadSlice<T>& s, const Chunk& chunk,
                     const Scratch& w) const {
    const ScanShape& shape = common_.shape();
    const int rank = shape.rank, rows = chunk.rows, len = chunk.length;
    const size_t stride = static_cast<size_t>(chunk_);
    const T* adt = s.adt + chunk.begin;
    const T* kappa = s.kappa + chunk.begin;
    const T* gamma = s.gamma + chunk.begin;
    T running = T(0);
    for (int i = 0; i < len; ++i) {
      running += adt[i];
      w.log_decay[i] = running;
    }
    for (int i = 0; i < len; ++i) {
      for (int j = 0; j <= i; ++j) {
        w.decay[static_cast<size_t>(i) * stride + j] = std::exp(w.log_decay[i] - w.log_decay[j]);
      }
    }
    for (int j = 0; j < len; ++j) {
      w.exit_scale[j] = w.decay[static_cast<size_t>(len - 1) * stride + j] * kappa[j];
    }
    const T* q = s.q + static_cast<size_t>(chunk.begin) * rank * shape.state;
    const T* k = s.k + static_cast<size_t>(chunk.begin) * rank * shape.state;
    gemm(false, true, rows, rows, shape.state, T(1), q, shape.state, k, shape.state, T(0), w.scores,
         rows);
    for (int i = 0; i < len; ++i) {
      for (int r = 0; r < rank; ++r) {
        const size_t row = static_cast<size_t>(i * rank + r) * static_cast<size_t>(rows);
        for (int j = 0; j < len; ++j) {
          const T weight = score_weight(w, kappa, gamma, i, j);
          for (int r2 = 0; r2 < rank; ++r2) {
            const size_t col = row + static_cast<size_t>(j * rank + r2);
            w.weighted[col] = w.scores[col] * weight;
          }
        }
      }
    }
  }

  void scan_forward(int bh, const Scratch& w) {
    const mamba3_detail::HeadSlice<T> s = common_.slice(bh);
    const ScanShape& shape = common_.shape();
    const int state = shape.state, headdim = shape.headdim, rank = shape.rank;
    T* first = entry_state(bh, 0);
    for (size_t i = 0; i < matrix_; ++i) first[i] = T(0);
    for (int c = 0; c < chunks_; ++c) {
      const Chunk chunk = chunk_span(c);
      const size_t row0 = static_cast<size_t>(chunk.begin) * static_cast<size_t>(rank);
      const T* q = s.q + row0 * state;
      const T* k = s.k + row0 * state;
      const T* v = s.v + row0 * headdim;
      T* o = s.o + row0 * headdim;
      prepare_chunk(s, chunk, w);
      gemm(false, false, chunk.rows, headdim, chunk.rows, T(1), w.weighted, chunk.rows, v, headdim,
           T(0), o, headdim);
      const T* entry = entry_state(bh, c);
      if (c > 0) {
        T* scaled_q = w.rows_a;
        scale_rows(
            q, state, chunk, [&](int i) { return std::exp(w.log_decay[i]); }, scaled_q);
        gemm(false, true, chunk.rows, headdim, state, T(1), scaled_q, state, entry, state, T(1), o,
             headdim);
      }
      if (c + 1 < chunks_) {
        T* exit = entry_state(bh, c + 1);
        for (size_t i = 0; i < matrix_; ++i) exit[i] = entry[i];
        T* scaled_k = w.rows_a;
        scale_rows(
            k, state, chunk, [&](int j) { return w.exit_scale[j]; }, scaled_k);
        gemm(true, false, headdim, state, chunk.rows, T(1), v, headdim, scaled_k, state,
             std::exp(w.log_decay[chunk.length - 1]), exit, state);
      }
    }
  }

  void scan_backward(int bh, const Scratch& w) {
    const mamba3_detail::HeadSlice<T> s = common_.slice(bh);
    const ScanShape& shape = common_.shape();
    const int state = shape.state, headdim = shape.headdim, rank = shape.rank;
    const size_t stride = static_cast<size_t>(chunk_);
    for (size_t i = 0; i < matrix_; ++i) w.d_state[i] = T(0);
    for (int c = chunks_ - 1; c >= 0; --c) {
      const Chunk chunk = chunk_span(c);
      const int rows = chunk.rows, len = chunk.length, last = len - 1;
      const size_t row0 = static_cast<size_t>(chunk.begin) * static_cast<size_t>(rank);
      const T* q = s.q + row0 * state;
      const T* k = s.k + row0 * state;
      const T* v = s.v + row0 * headdim;
      const T* d_o = s.d_o + row0 * headdim;
      T* dq = s.dq + row0 * state;
      T* dk = s.dk + row0 * state;
      T* dv = s.dv + row0 * headdim;
      T* d_kappa = s.d_kappa + chunk.begin;
      T* d_gamma = s.d_gamma + chunk.begin;
      const T* kappa = s.kappa + chunk.begin;
      const T* gamma = s.gamma + chunk.begin;
      prepare_chunk(s, chunk, w);
      for (int i = 0; i < len; ++i) w.d_log[i] = T(0);

      // Inside the chunk: O = (scores ⊙ W) V.
      gemm(true, false, rows, headdim, rows, T(1), w.weighted, rows, d_o, headdim, T(1), dv,
           headdim);
      gemm(false, true, rows, rows, headdim, T(1), d_o, headdim, v, headdim, T(0), w.d_scores,
           rows);
      for (int i = 0; i < len; ++i) {
        for (int j = 0; j < len; ++j) {
          const T weight = score_weight(w, kappa, gamma, i, j);
          T d_weight = T(0);
          for (int r = 0; r < rank; ++r) {
            const size_t row = static_cast<size_t>(i * rank + r) * static_cast<size_t>(rows);
            for (int r2 = 0; r2 < rank; ++r2) {
              const size_t col = row + static_cast<size_t>(j * rank + r2);
              d_weight += w.d_scores[col] * w.scores[col];
              w.d_scores[col] *= weight;
            }
          }
          if (j < i) {
            d_kappa[j] += d_weight * w.decay[static_cast<size_t>(i) * stride + j];
            w.d_log[i] += d_weight * weight;
            w.d_log[j] -= d_weight * weight;
          } else if (j == i) {
            d_gamma[i] += d_weight;
          }
        }
      }
      gemm(false, false, rows, state, rows, T(1), w.d_scores, rows, k, state, T(1), dq, state);
      gemm(true, false, rows, state, rows, T(1), w.d_scores, rows, q, state, T(1), dk, state);

      const T* entry = entry_state(bh, c);
      const T exit_decay = std::exp(w.log_decay[last]);
      // Chunk exit: S'_out = e^{l_last} S'_in + Σ_j e^{l_last−l_j} κ_j U_j.
      if (c + 1 < chunks_) {
        T* k_d_state = w.rows_a;  // K dS'ᵀ, [rows, P]
        gemm(false, true, rows, headdim, state, T(1), k, state, w.d_state, state, T(0), k_d_state,
             headdim);
        T* v_d_state = w.rows_b;  // V dS', [rows, N]
        gemm(false, false, rows, state, headdim, T(1), v, headdim, w.d_state, state, T(0),
             v_d_state, state);
        for (int j = 0; j < len; ++j) {
          const T scale = w.exit_scale[j];
          T d_scale = T(0);
          for (int r = 0; r < rank; ++r) {
            const size_t row = static_cast<size_t>(j * rank + r);
            for (int p = 0; p < headdim; ++p) {
              const T value = k_d_state[row * headdim + p];
              d_scale += value * v[row * headdim + p];
              dv[row * headdim + p] += scale * value;
            }
            for (int n = 0; n < state; ++n)
              dk[row * state + n] += scale * v_d_state[row * state + n];
          }
          d_kappa[j] += d_scale * w.decay[static_cast<size_t>(last) * stride + j];
          w.d_log[last] += d_scale * scale;
          w.d_log[j] -= d_scale * scale;
        }
        if (c > 0) {
          T entry_dot = T(0);
          for (size_t i = 0; i < matrix_; ++i) entry_dot += w.d_state[i] * entry[i];
          w.d_log[last] += exit_decay * entry_dot;
        }
      }
      // Chunk entry: O += diag(e^{l_i}) Q S'_inᵀ; dS'_in = e^{l_last} dS'_out + Σ e^{l_i} dO Qᵀ.
      if (c > 0) {
        T* q_state = w.rows_a;  // Q S'_inᵀ, [rows, P]
        gemm(false, true, rows, headdim, state, T(1), q, state, entry, state, T(0), q_state,
             headdim);
        T* scaled_d_o = w.rows_b;
        for (int i = 0; i < len; ++i) {
          const T entry_decay = std::exp(w.log_decay[i]);
          T d_entry_decay = T(0);
          for (int r = 0; r < rank; ++r) {
            const size_t row = static_cast<size_t>(i * rank + r) * static_cast<size_t>(headdim);
            for (int p = 0; p < headdim; ++p) {
              d_entry_decay += d_o[row + p] * q_state[row + p];
              scaled_d_o[row + p] = entry_decay * d_o[row + p];
            }
          }
          w.d_log[i] += entry_decay * d_entry_decay;
        }
        gemm(false, false, rows, state, headdim, T(1), scaled_d_o, headdim, entry, state, T(1), dq,
             state);
        gemm(true, false, headdim, state, rows, T(1), scaled_d_o, headdim, q, state, exit_decay,
             w.d_state, state);
      }
      // l_i = Σ_{u≤i} ADT_u, so ADT_u collects dl_i of every i ≥ u.
      T suffix = T(0);
      for (int i = last; i >= 0; --i) {
        suffix += w.d_log[i];
        s.d_adt[chunk.begin + i] += suffix;
      }
    }
  }

  // dst row (i, r) = scale_of_token(i) · src row (i, r).
  template <typename Scale>
  void scale_rows(const T* src, int width, const Chunk& chunk, Scale scale_of_token, T* dst) const {
    const int rank = common_.shape().rank;
    for (int i = 0; i < chunk.length; ++i) {
      const T scale = scale_of_token(i);
      for (int r = 0; r < rank; ++r) {
        const size_t row = static_cast<size_t>(i * rank + r) * static_cast<size_t>(width);
        for (int x = 0; x < width; ++x) dst[row + x] = scale * src[row + x];
      }
    }
  }

  mamba3_detail::ScanCommon<T> common_;
  int chunk_;
  int chunks_;
  int max_rows_;
  size_t matrix_;
  size_t scratch_stride_ = 0;
  std::vector<T> states_;
  std::vector<T> scratch_;
  bool has_forward_ = false;
};

}  // namespace megacpp::cpu
