#pragma once
// Causal grouped-query softmax attention of the MHA layer (shared/spec/model.md):
//   out[t, h] = sum_{s <= t} softmax_s(scale * q[t, h] . k[s, g(h)]) v[s, g(h)],
// where kv head g(h) = h / (q_heads / kv_heads) serves q_heads / kv_heads
// consecutive q heads.
//
// Layouts (row-major, batch outermost, everything for one head contiguous):
//   q        head h of token (b, t) at q + (b * seqlen + t) * q_stride + h * head_dim
//   k, v     head g at k + (b * seqlen + t) * kv_stride + g * head_dim
//   out      [batch, seqlen, q_heads * head_dim], contiguous; dout likewise
//   dq/dk/dv the strides and offsets of q/k/v
// so q, k, v (and dq, dk, dv) may be views into one packed qkv row of width
// (q_heads + 2 kv_heads) * head_dim: pass that width as both strides and offset
// the pointers.
//
// Query rows are processed in tiles of kRowTile: a tile of rows [r0, r1) only
// needs keys [0, r1), which skips most of the masked half of the score matrix and
// keeps the scratch at kRowTile x seqlen per thread. backward() recomputes the
// probabilities from q and k instead of saving them, so it needs nothing from a
// forward() call (and recomputed activations work unchanged).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "base/error.h"
#include "kernels/cpu/gemm.h"

namespace megacpp::cpu {

struct AttentionShape {
  int batch = 0;
  int seqlen = 0;
  int q_heads = 0;   // Hq
  int kv_heads = 0;  // Hkv, divides Hq
  int head_dim = 0;
  double softmax_scale = 0.0;  // the spec's default is 1 / sqrt(head_dim)
};

// One object per shape; not safe to call concurrently (the scratch is shared).
template <typename T>
class CausalAttention {
 public:
  // Throws megacpp::Error (kInvalidArgument) naming the bad field.
  explicit CausalAttention(const AttentionShape& shape) : shape_(shape) {
    require_positive(shape.batch, "batch");
    require_positive(shape.seqlen, "seqlen");
    require_positive(shape.q_heads, "q_heads");
    require_positive(shape.kv_heads, "kv_heads");
    require_positive(shape.head_dim, "head_dim");
    if (shape.q_heads % shape.kv_heads != 0) {
      fail(ErrorKind::kInvalidArgument,
           "attention: q_heads ({}) must be a multiple of kv_heads ({})", shape.q_heads,
           shape.kv_heads);
    }
    if (!(shape.softmax_scale > 0.0) || !std::isfinite(shape.softmax_scale)) {
      fail(ErrorKind::kInvalidArgument,
           "attention: softmax_scale must be positive and finite, got {}", shape.softmax_scale);
    }
    tile_ = std::min(kRowTile, shape.seqlen);
    ensure_scratch();
  }

  const AttentionShape& shape() const { return shape_; }

  void forward(const T* q, const T* k, const T* v, int q_stride, int kv_stride, T* out) {
    validate_strides(q_stride, kv_stride);
    ensure_scratch();
    const int out_stride = shape_.q_heads * shape_.head_dim;
    const int items = shape_.batch * shape_.q_heads;
#pragma omp parallel for schedule(static)
    for (int item = 0; item < items; ++item) {
      const int b = item / shape_.q_heads;
      const int h = item % shape_.q_heads;
      Scratch& scratch = scratch_[omp_get_thread_num()];
      const HeadViews<const T> qh = head(q, q_stride, b, h);
      const HeadViews<const T> kh = head(k, kv_stride, b, kv_head_of(h));
      const HeadViews<const T> vh = head(v, kv_stride, b, kv_head_of(h));
      T* oh = out + row_offset(b, 0, out_stride) + static_cast<int64_t>(h) * shape_.head_dim;
      T* probs = scratch.probs.data();
      for (int r0 = 0; r0 < shape_.seqlen; r0 += tile_) {
        const int r1 = std::min(r0 + tile_, shape_.seqlen);
        probabilities(qh, kh, r0, r1, probs);
        gemm(false, false, r1 - r0, shape_.head_dim, r1, T(1), probs, shape_.seqlen, vh.at(0),
             vh.stride, T(0), oh + static_cast<int64_t>(r0) * out_stride, out_stride);
      }
    }
  }

  // Overwrites dq, dk, dv (the caller need not zero them).
  void backward(const T* q, const T* k, const T* v, int q_stride, int kv_stride, const T* dout,
                T* dq, T* dk, T* dv) {
    validate_strides(q_stride, kv_stride);
    ensure_scratch();
    const int out_stride = shape_.q_heads * shape_.head_dim;
    const int group = shape_.q_heads / shape_.kv_heads;
    const T scale = static_cast<T>(shape_.softmax_scale);
    const int items = shape_.batch * shape_.kv_heads;
    // dk and dv sum over the q heads of a group: one item owns a kv head and visits
    // its q heads and row tiles in a fixed order, so the sums are deterministic.
#pragma omp parallel for schedule(static)
    for (int item = 0; item < items; ++item) {
      const int b = item / shape_.kv_heads;
      const int g = item % shape_.kv_heads;
      Scratch& scratch = scratch_[omp_get_thread_num()];
      const HeadViews<const T> kh = head(k, kv_stride, b, g);
      const HeadViews<const T> vh = head(v, kv_stride, b, g);
      const HeadViews<T> dkh = head(dk, kv_stride, b, g);
      const HeadViews<T> dvh = head(dv, kv_stride, b, g);
      for (int t = 0; t < shape_.seqlen; ++t) {
        std::fill(dkh.at(t), dkh.at(t) + shape_.head_dim, T(0));
        std::fill(dvh.at(t), dvh.at(t) + shape_.head_dim, T(0));
      }
      T* probs = scratch.probs.data();
      T* dscores = scratch.dscores.data();
      const int ld = shape_.seqlen;
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const HeadViews<const T> qh = head(q, q_stride, b, h);
        const HeadViews<T> dqh = head(dq, q_stride, b, h);
        const HeadViews<const T> doh{
            dout + row_offset(b, 0, out_stride) + static_cast<int64_t>(h) * shape_.head_dim,
            out_stride};
        for (int r0 = 0; r0 < shape_.seqlen; r0 += tile_) {
          const int r1 = std::min(r0 + tile_, shape_.seqlen);
          const int rows = r1 - r0;
          probabilities(qh, kh, r0, r1, probs);
          // dP = dO V^T, then dS = P * (dP - rowsum(P * dP)): the softmax backward.
          gemm(false, true, rows, r1, shape_.head_dim, T(1), doh.at(r0), doh.stride, vh.at(0),
               vh.stride, T(0), dscores, ld);
          for (int i = 0; i < rows; ++i) {
            const int keys = r0 + i + 1;  // causal: row r0 + i sees keys [0, r0 + i]
            const T* p = probs + static_cast<int64_t>(i) * ld;
            T* ds = dscores + static_cast<int64_t>(i) * ld;
            double weighted = 0;
            for (int j = 0; j < keys; ++j) weighted += static_cast<double>(p[j]) * ds[j];
            const T row_dot = static_cast<T>(weighted);
            for (int j = 0; j < keys; ++j) ds[j] = p[j] * (ds[j] - row_dot);
            std::fill(ds + keys, ds + r1, T(0));
          }
          // The scores were scale * Q K^T, so dQ and dK carry the scale.
          gemm(false, false, rows, shape_.head_dim, r1, scale, dscores, ld, kh.at(0), kh.stride,
               T(0), dqh.at(r0), dqh.stride);
          gemm(true, false, r1, shape_.head_dim, rows, scale, dscores, ld, qh.at(r0), qh.stride,
               T(1), dkh.at(0), dkh.stride);
          gemm(true, false, r1, shape_.head_dim, rows, T(1), probs, ld, doh.at(r0), doh.stride,
               T(1), dvh.at(0), dvh.stride);
        }
      }
    }
  }

 private:
  static constexpr int kRowTile = 64;

  // The rows of one (batch, head): row t at base + t * stride.
  template <typename U>
  struct HeadViews {
    U* base;
    int stride;
    U* at(int t) const { return base + static_cast<int64_t>(t) * stride; }
  };

  struct Scratch {
    std::vector<T> probs;    // [tile, seqlen]
    std::vector<T> dscores;  // [tile, seqlen]
  };

  static void require_positive(int value, const char* field) {
    if (value <= 0) {
      fail(ErrorKind::kInvalidArgument, "attention: {} must be positive, got {}", field, value);
    }
  }

  void validate_strides(int q_stride, int kv_stride) const {
    if (q_stride < shape_.q_heads * shape_.head_dim) {
      fail(ErrorKind::kInvalidArgument,
           "attention: q_stride {} is shorter than q_heads * head_dim = {}", q_stride,
           shape_.q_heads * shape_.head_dim);
    }
    if (kv_stride < shape_.kv_heads * shape_.head_dim) {
      fail(ErrorKind::kInvalidArgument,
           "attention: kv_stride {} is shorter than kv_heads * head_dim = {}", kv_stride,
           shape_.kv_heads * shape_.head_dim);
    }
  }

  // One scratch per OpenMP thread; grows if the thread count rose since construction.
  void ensure_scratch() {
    const size_t threads = static_cast<size_t>(std::max(1, omp_get_max_threads()));
    if (scratch_.size() >= threads) return;
    const size_t elements = static_cast<size_t>(tile_) * static_cast<size_t>(shape_.seqlen);
    scratch_.resize(threads);
    for (Scratch& s : scratch_) {
      s.probs.resize(elements);
      s.dscores.resize(elements);
    }
  }

  int kv_head_of(int h) const {
    return h / (shape_.q_heads / shape_.kv_heads);
  }

  int64_t row_offset(int b, int t, int stride) const {
    return (static_cast<int64_t>(b) * shape_.seqlen + t) * stride;
  }

  template <typename U>
  HeadViews<U> head(U* base, int stride, int b, int h) const {
    return {base + row_offset(b, 0, stride) + static_cast<int64_t>(h) * shape_.head_dim, stride};
  }

  // probs[i, j] for query rows [r0, r1) and keys j < r1 (leading dimension seqlen):
  // the causal softmax of scale * q . k, zero for j > r0 + i.
  void probabilities(const HeadViews<const T>& qh, const HeadViews<const T>& kh, int r0, int r1,
                     T* probs) const {
    const int ld = shape_.seqlen;
    gemm(false, true, r1 - r0, r1, shape_.head_dim, static_cast<T>(shape_.softmax_scale), qh.at(r0),
         qh.stride, kh.at(0), kh.stride, T(0), probs, ld);
    for (int i = 0; i < r1 - r0; ++i) {
      const int keys = r0 + i + 1;
      T* p = probs + static_cast<int64_t>(i) * ld;
      const T row_max = *std::max_element(p, p + keys);
      double sum = 0;
      for (int j = 0; j < keys; ++j) {
        p[j] = std::exp(p[j] - row_max);
        sum += static_cast<double>(p[j]);
      }
      const T inv_sum = static_cast<T>(1.0 / sum);
      for (int j = 0; j < keys; ++j) p[j] *= inv_sum;
      std::fill(p + keys, p + r1, T(0));
    }
  }

  AttentionShape shape_;
  int tile_ = 0;
  std::vector<Scratch> scratch_;
};

}  // namespace megacpp::cpu
