// See tensor_ops.h.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/tensor_ops.h"

namespace megacpp::cuda {
namespace {

using detail::refuse;

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU; the grid-stride loops cover the rest.
constexpr int64_t kMaxBlocks = 4096;

__global__ void __launch_bounds__(kThreads)
    cast_kernel(const float* __restrict__ src, bf16* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = __float2bfloat16(src[i]);
  }
}

__global__ void __launch_bounds__(kThreads)
    add_kernel(const float* __restrict__ src, float* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] += src[i];
  }
}

int blocks_for(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

void check_args(const char* op, const void* src, const void* dst, int64_t n) {
  if (n < 0) refuse(ErrorKind::kInvalidArgument, "{}: n={} must be >= 0", op, n);
  if (n > 0 && (src == nullptr || dst == nullptr)) {
    refuse(ErrorKind::kInvalidArgument, "{}: src and dst must be set for n={}", op, n);
  }
}

}  // namespace

void cast_f32_to_bf16(const float* src, uint16_t* dst, int64_t n, void* stream) {
  check_args("cast_f32_to_bf16", src, dst, n);
  if (n == 0) return;
  cast_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      src, reinterpret_cast<bf16*>(dst), n);
  MEGACPP_CUDA_CHECK_LAUNCH("cast_kernel");
}

void add_f32(const float* src, float* dst, int64_t n, void* stream) {
  check_args("add_f32", src, dst, n);
  if (n == 0) return;
  add_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(src, dst, n);
  MEGACPP_CUDA_CHECK_LAUNCH("add_kernel");
}

}  // namespace megacpp::cuda
