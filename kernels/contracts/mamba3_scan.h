#pragma once
// The contract of the Mamba-3 MIMO scan: steps 3-7 of the mixer in shared/spec/model.md, from
// the preprocessed per-token tensors to y (before out_proj). Its shape, layouts, inputs and
// gradients, shared by every backend:
//   kernels/cpu/mamba3_scan_recurrent.h  the recurrence, token by token (the definition)
//   kernels/cpu/mamba3_scan_chunked.h    the chunked form the GPU computes
//   kernels/cuda/mamba3_scan.h           the CUDA kernels (bf16 device tensors)
// No OpenMP, no CUDA: every backend's host code includes this header.
#include <cstddef>

namespace megacpp::ops {

struct ScanShape {
  int batch = 0;
  int seqlen = 0;
  int heads = 0;    // H
  int groups = 0;   // G, divides H; head h belongs to group h / (H / G)
  int state = 0;    // N
  int headdim = 0;  // P
  int rank = 0;     // R (1 = SISO)
  int chunk = 0;    // C, used by the chunked form only
  int angles = 0;   // A_n: rotation pairs (j, j + N/2) for j < A_n
};

// Layouts (row-major, batch outermost):
//   q, k            [B, L, R, G, N]  C and B after their RMSNorm, before the biases
//   v (= x), z      [B, L, H, P]
//   adt, dt, trap   [B, L, H]        trap before its sigmoid
//   angles          [B, L, A_n]      before tanh
//   q_bias, k_bias  [H, R, N]
//   mimo_x/z/o      [H, R, P]
//   d               [H]
//   y               [B, L, H, P]
template <typename T>
struct ScanInputs {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  const T* z = nullptr;
  const T* adt = nullptr;
  const T* dt = nullptr;
  const T* trap = nullptr;
  const T* angles = nullptr;
  const T* q_bias = nullptr;
  const T* k_bias = nullptr;
  const T* mimo_x = nullptr;
  const T* mimo_z = nullptr;
  const T* mimo_o = nullptr;
  const T* d = nullptr;
};

// Gradients with the shapes of the matching inputs. backward() overwrites them
// (it does not accumulate into them).
template <typename T>
struct ScanGrads {
  T* q = nullptr;
  T* k = nullptr;
  T* v = nullptr;
  T* z = nullptr;
  T* adt = nullptr;
  T* dt = nullptr;
  T* trap = nullptr;
  T* angles = nullptr;
  T* q_bias = nullptr;
  T* k_bias = nullptr;
  T* mimo_x = nullptr;
  T* mimo_z = nullptr;
  T* mimo_o = nullptr;
  T* d = nullptr;
};

}  // namespace megacpp::ops
