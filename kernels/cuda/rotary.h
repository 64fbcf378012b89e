#pragma once
// Rotary position embedding on a CUDA GPU: the function of kernels/cpu/rotary.h (non-interleaved,
// in place on the first rotary_dim dims of every head, angle_i = t · base^(−2i/rotary_dim)) on a
// bf16 buffer, forward and backward (the transposed rotation).
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it. x is a
// device pointer owned by the caller holding bf16 bit patterns; token (b, t) starts at
// x + (b·seqlen + t)·row_stride and head h's dims head_offset + h·head_dim further, so one call
// with head_offset 0 and heads = Hq + Hkv rotates q and k where they sit in the packed qkv row.
//
// One block per token. Its angles are computed in double, as the CPU's table is: inv_freq_i by
// pow(base, −2i/rotary_dim), angle = t · inv_freq_i and its sin/cos, and only then rounded to
// fp32. An fp32 angle would carry an absolute error of about t · 2⁻²⁴ rad (2.4e-4 at t = 4096,
// 4e-3 at t = 65536), which grows with the position; the double angle keeps the error of the
// rotation at the fp32 rounding of cos and sin whatever t is. The rotation itself is fp32
// arithmetic on the bf16 values, rounded back to bf16. Dims outside the rotary ones are neither
// read nor written. Each element is written by one thread: deterministic.
#include <cstdint>

namespace megacpp::cuda {

struct RotaryShape {
  int batch = 0;
  int seqlen = 0;
  int row_stride = 0;   // elements from one token's row to the next
  int head_offset = 0;  // elements from a row's start to head 0
  int heads = 0;
  int head_dim = 0;
  int rotary_dim = 0;  // even, ≤ head_dim; 0 leaves x as it is
  double base = 10000.0;
};

// Rotates x in place. Validates the shape first (megacpp::Error kInvalidArgument naming the
// field, the rules of the CPU op) and refuses a null x. stream: a cudaStream_t, or null.
// Asynchronous.
void rotary_forward(const RotaryShape& shape, uint16_t* x, void* stream = nullptr);

// The gradient through rotary_forward: applies the transposed rotation to dx in place.
void rotary_backward(const RotaryShape& shape, uint16_t* dx, void* stream = nullptr);

}  // namespace megacpp::cuda
