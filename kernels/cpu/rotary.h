#pragma once
// Rotary position embedding of the MHA layer (non-interleaved), applied in place
// to the first rotary_dim dims of every head. With half = rotary_dim / 2,
// u1 = dims [0, half), u2 = [half, rotary_dim), angle_i = t * base^(-2i/rotary_dim):
//   u1' = u1 cos - u2 sin,   u2' = u2 cos + u1 sin.
// t is the token's 0-based index within its sequence.
//
// Layout: token (b, t) starts at x + (b * seqlen + t) * row_stride; head h's dims
// start head_offset + h * head_dim further. The strides let the rotation run on q
// and k while they sit in the packed qkv row: q and k heads are adjacent there, so
// one call with head_offset 0 and heads = Hq + Hkv rotates both.
#include <cmath>
#include <cstdint>
#include <vector>

#include "base/error.h"

namespace megacpp::cpu {

namespace rotary_detail {

inline void validate(int batch, int seqlen, int row_stride, int head_offset, int heads,
                     int head_dim, int rotary_dim, double base) {
  if (batch <= 0)
    fail(ErrorKind::kInvalidArgument, "rotary: batch must be positive, got {}", batch);
  if (seqlen <= 0) {
    fail(ErrorKind::kInvalidArgument, "rotary: seqlen must be positive, got {}", seqlen);
  }
  if (heads <= 0)
    fail(ErrorKind::kInvalidArgument, "rotary: heads must be positive, got {}", heads);
  if (head_dim <= 0) {
    fail(ErrorKind::kInvalidArgument, "rotary: head_dim must be positive, got {}", head_dim);
  }
  if (rotary_dim < 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim) {
    fail(ErrorKind::kInvalidArgument,
         "rotary: rotary_dim must be even and within [0, head_dim={}], got {}", head_dim,
         rotary_dim);
  }
  if (head_offset < 0) {
    fail(ErrorKind::kInvalidArgument, "rotary: head_offset must be >= 0, got {}", head_offset);
  }
  const int64_t span = static_cast<int64_t>(head_offset) + static_cast<int64_t>(heads) * head_dim;
  if (row_stride < span) {
    fail(ErrorKind::kInvalidArgument,
         "rotary: row_stride {} is shorter than head_offset + heads * head_dim = {}", row_stride,
         span);
  }
  if (!(base > 0.0) || !std::isfinite(base)) {
    fail(ErrorKind::kInvalidArgument, "rotary: base must be positive and finite, got {}", base);
  }
}

// direction +1 applies the rotation, -1 its transpose (= inverse).
template <typename T>
void rotate(int batch, int seqlen, int row_stride, int head_offset, int heads, int head_dim,
            int rotary_dim, double base, int direction, T* x) {
  validate(batch, seqlen, row_stride, head_offset, heads, head_dim, rotary_dim, base);
  if (rotary_dim == 0) return;
  const int half = rotary_dim / 2;
  // The angles depend on (t, i) only; computed once in double, then rounded to T.
  std::vector<T> cos_table(static_cast<size_t>(seqlen) * half);
  std::vector<T> sin_table(static_cast<size_t>(seqlen) * half);
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    inv_freq[i] = std::pow(base, -2.0 * i / static_cast<double>(rotary_dim));
  }
  // Small calls (tests, decoding) would spend more on starting threads than on the work.
  constexpr int64_t kParallelMinimum = 1 << 14;
  const bool parallel_table = static_cast<int64_t>(seqlen) * half >= kParallelMinimum;
#pragma omp parallel for schedule(static) if (parallel_table)
  for (int t = 0; t < seqlen; ++t) {
    for (int i = 0; i < half; ++i) {
      const double angle = static_cast<double>(t) * inv_freq[i];
      const size_t at = static_cast<size_t>(t) * half + i;
      cos_table[at] = static_cast<T>(std::cos(angle));
      sin_table[at] = static_cast<T>(direction * std::sin(angle));
    }
  }
  const int tokens = batch * seqlen;
  const bool parallel_rows = static_cast<int64_t>(tokens) * heads * half >= kParallelMinimum;
#pragma omp parallel for schedule(static) if (parallel_rows)
  for (int token = 0; token < tokens; ++token) {
    const int t = token % seqlen;
    const T* c = cos_table.data() + static_cast<size_t>(t) * half;
    const T* s = sin_table.data() + static_cast<size_t>(t) * half;
    T* row = x + static_cast<int64_t>(token) * row_stride + head_offset;
    for (int h = 0; h < heads; ++h) {
      T* u1 = row + static_cast<int64_t>(h) * head_dim;
      T* u2 = u1 + half;
      for (int i = 0; i < half; ++i) {
        const T a = u1[i];
        const T b = u2[i];
        u1[i] = a * c[i] - b * s[i];
        u2[i] = b * c[i] + a * s[i];
      }
    }
  }
}

}  // namespace rotary_detail

// Rotates x in place. Throws megacpp::Error (kInvalidArgument) on a bad shape.
template <typename T>
void rotary_forward(int batch, int seqlen, int row_stride, int head_offset, int heads, int head_dim,
                    int rotary_dim, double base, T* x) {
  rotary_detail::rotate(batch, seqlen, row_stride, head_offset, heads, head_dim, rotary_dim, base,
                        +1, x);
}

// The gradient through rotary_forward: applies the transposed rotation to dx in place.
template <typename T>
void rotary_backward(int batch, int seqlen, int row_stride, int head_offset, int heads,
                     int head_dim, int rotary_dim, double base, T* dx) {
  rotary_detail::rotate(batch, seqlen, row_stride, head_offset, heads, head_dim, rotary_dim, base,
                        -1, dx);
}

}  // namespace megacpp::cpu
