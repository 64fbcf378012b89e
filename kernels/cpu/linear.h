#pragma once
// Linear layer: y[rows, out] = x[rows, in] · W[out, in]ᵀ + b[out].
#include "kernels/cpu/gemm.h"

namespace megacpp::cpu {

template <typename T>
void linear_forward(int rows, int in, int out, const T* x, const T* weight, const T* bias, T* y) {
  matmul_xwt(rows, in, out, x, weight, y);
  if (bias == nullptr) return;
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    T* yr = y + static_cast<int64_t>(r) * out;
    for (int c = 0; c < out; ++c) yr[c] += bias[c];
  }
}

// dx = dy · W (overwritten, or accumulated when accumulate_dx), dW += dyᵀ · x,
// db += column sums of dy. dx may be null when the input needs no gradient.
template <typename T>
void linear_backward(int rows, int in, int out, const T* x, const T* weight, const T* dy, T* dx,
                     T* dweight, T* dbias, bool accumulate_dx = false) {
  if (dx != nullptr) {
    gemm(false, false, rows, in, out, T(1), dy, out, weight, in, accumulate_dx ? T(1) : T(0), dx,
         in);
  }
  gemm(true, false, out, in, rows, T(1), dy, out, x, in, T(1), dweight, in);
  if (dbias == nullptr) return;
#pragma omp parallel for schedule(static)
  for (int c = 0; c < out; ++c) {
    T acc = 0;
    for (int r = 0; r < rows; ++r) acc += dy[static_cast<int64_t>(r) * out + c];
    dbias[c] += acc;
  }
}

}  // namespace megacpp::cpu
