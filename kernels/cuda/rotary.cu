// CUDA rotary embedding: see rotary.h for the structure and the precision of the angles. The
// validation rules are those of kernels/cpu/rotary.h.
#include <cmath>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rotary.h"

namespace megacpp::cuda {
namespace {

using detail::refuse;

constexpr int kThreads = 128;
// Angles per pass of a block: one per thread, kept in shared memory while every head uses them.
constexpr int kChunk = kThreads;

__device__ __forceinline__ float load_bf16(const uint16_t* p) {
  return __bfloat162float(__ushort_as_bfloat16(*p));
}

__device__ __forceinline__ void store_bf16(uint16_t* p, float value) {
  *p = __bfloat16_as_ushort(__float2bfloat16_rn(value));
}

// Block `token` rotates that token's heads; sign is +1 (forward) or −1 (the transpose).
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(int seqlen, int row_stride, int head_offset, int heads, int head_dim,
                  int rotary_dim, double base, float sign, uint16_t* x) {
  __shared__ float cos_s[kChunk];
  __shared__ float sin_s[kChunk];
  const int token = blockIdx.x;
  const int t = token % seqlen;
  const int half = rotary_dim / 2;
  uint16_t* row = x + static_cast<int64_t>(token) * row_stride + head_offset;
  for (int i0 = 0; i0 < half; i0 += kChunk) {
    const int n = min(kChunk, half - i0);
    if (static_cast<int>(threadIdx.x) < n) {
      const int i = i0 + static_cast<int>(threadIdx.x);
      const double inv_freq = pow(base, -2.0 * i / static_cast<double>(rotary_dim));
      const double angle = static_cast<double>(t) * inv_freq;
      double s = 0, c = 0;
      sincos(angle, &s, &c);
      cos_s[threadIdx.x] = static_cast<float>(c);
      sin_s[threadIdx.x] = sign * static_cast<float>(s);
    }
    __syncthreads();
    for (int w = threadIdx.x; w < heads * n; w += blockDim.x) {
      const int h = w / n, i = w % n;
      uint16_t* u1 = row + static_cast<int64_t>(h) * head_dim + i0 + i;
      uint16_t* u2 = u1 + half;
      const float a = load_bf16(u1), b = load_bf16(u2);
      const float c = cos_s[i], s = sin_s[i];
      store_bf16(u1, a * c - b * s);
      store_bf16(u2, b * c + a * s);
    }
    __syncthreads();  // the next pass overwrites the angles
  }
}

void validate(const RotaryShape& s) {
  const auto positive = [](int value, const char* field) {
    if (value <= 0) {
      refuse(ErrorKind::kInvalidArgument, "RotaryCuda: RotaryShape.{}={} must be positive", field,
             value);
    }
  };
  positive(s.batch, "batch");
  positive(s.seqlen, "seqlen");
  positive(s.heads, "heads");
  positive(s.head_dim, "head_dim");
  if (s.rotary_dim < 0 || s.rotary_dim % 2 != 0 || s.rotary_dim > s.head_dim) {
    refuse(ErrorKind::kInvalidArgument,
           "RotaryCuda: RotaryShape.rotary_dim={} must be even and within [0, head_dim={}]",
           s.rotary_dim, s.head_dim);
  }
  if (s.head_offset < 0) {
    refuse(ErrorKind::kInvalidArgument, "RotaryCuda: RotaryShape.head_offset={} must be >= 0",
           s.head_offset);
  }
  const int64_t span =
      static_cast<int64_t>(s.head_offset) + static_cast<int64_t>(s.heads) * s.head_dim;
  if (s.row_stride < span) {
    refuse(ErrorKind::kInvalidArgument,
           "RotaryCuda: RotaryShape.row_stride={} is shorter than head_offset + heads * head_dim "
           "= {}",
           s.row_stride, span);
  }
  if (!(s.base > 0.0) || !std::isfinite(s.base)) {
    refuse(ErrorKind::kInvalidArgument,
           "RotaryCuda: RotaryShape.base={} must be positive and finite", s.base);
  }
  // One block per token: the grid's x dimension takes up to 2³¹ − 1.
  const int64_t tokens = static_cast<int64_t>(s.batch) * s.seqlen;
  if (tokens > 2147483647) {
    refuse(ErrorKind::kInvalidArgument,
           "RotaryCuda: RotaryShape.batch * seqlen = {} must be below 2^31", tokens);
  }
}

void rotate(const RotaryShape& s, uint16_t* x, float sign, void* stream, const char* entry) {
  validate(s);
  if (x == nullptr) refuse(ErrorKind::kInvalidArgument, "RotaryCuda: {}: x is null", entry);
  if (s.rotary_dim == 0) return;
  const int tokens = s.batch * s.seqlen;
  rotary_kernel<<<tokens, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      s.seqlen, s.row_stride, s.head_offset, s.heads, s.head_dim, s.rotary_dim, s.base, sign, x);
  MEGACPP_CUDA_CHECK_LAUNCH("rotary_kernel");
}

}  // namespace

void rotary_forward(const RotaryShape& shape, uint16_t* x, void* stream) {
  rotate(shape, x, 1.f, stream, "rotary_forward");
}

void rotary_backward(const RotaryShape& shape, uint16_t* dx, void* stream) {
  rotate(shape, dx, -1.f, stream, "rotary_backward");
}

}  // namespace megacpp::cuda
