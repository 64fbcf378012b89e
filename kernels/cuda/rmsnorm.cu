// CUDA RMSNorm fused with the residual add: see rmsnorm.h for the structure. The formulas are
// those of kernels/cpu/rmsnorm.h; dweight's sum over rows runs in tiles, then groups of tiles (the
// CPU sums the rows in order), so its rounding differs.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rmsnorm.h"

namespace megacpp::cuda {
namespace {

using detail::refuse;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Which of RowsRef's pointers a kernel reads: none (no delta), bf16 or fp32.
enum Source { kNone = 0, kBf16 = 1, kF32 = 2 };

template <int kSource>
__device__ __forceinline__ float load(const bf16* b, const float* f, int64_t i) {
  if constexpr (kSource == kBf16) {
    return to_f(b[i]);
  } else if constexpr (kSource == kF32) {
    return f[i];
  } else {
    return 0.f;
  }
}

// Block-wide sum in an order fixed by blockDim alone: butterflies within warps, then every warp
// adds the warps' sums the same way, so all threads hold the same bits. `warp_sums` holds kWarps
// floats of shared memory; call from every thread.
__device__ float block_total(float value, float* warp_sums) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  value = warp_sum(value);
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  float total = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0.f;
  total = warp_sum(total);
  __syncthreads();  // warp_sums may be written again by the next call
  return total;
}

// residual_in and residual_out may be the same buffer: not __restrict__.
template <int kDelta>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(int dim, float eps, const float* residual_in, const bf16* delta_bf16,
                   const float* delta_f32, const float* __restrict__ weight, float* residual_out,
                   bf16* __restrict__ y, float* __restrict__ rstd) {
  __shared__ float warp_sums[kWarps];
  const int row = blockIdx.x;
  const int64_t base = static_cast<int64_t>(row) * dim;
  float sum_sq = 0.f;
  for (int c = threadIdx.x; c < dim; c += blockDim.x) {
    float x = residual_in[base + c];
    if constexpr (kDelta != kNone) x += load<kDelta>(delta_bf16, delta_f32, base + c);
    residual_out[base + c] = x;
    sum_sq = fmaf(x, x, sum_sq);
  }
  const float total = block_total(sum_sq, warp_sums);
  const float inv = 1.f / sqrtf(total / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) rstd[row] = inv;
  // Each thread reads back only the columns it wrote itself.
  for (int c = threadIdx.x; c < dim; c += blockDim.x) {
    y[base + c] = __float2bfloat16(residual_out[base + c] * inv * weight[c]);
  }
}

// Dynamic shared memory: the tile's dweight partial [dim], column c owned by thread
// c mod blockDim. dx and residual_grad may be the same buffer: not __restrict__.
template <int kDy>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(int rows, int tile_rows, int dim, const float* __restrict__ x,
                    const float* __restrict__ weight, const float* __restrict__ rstd,
                    const bf16* dy_bf16, const float* dy_f32, const float* residual_grad, float* dx,
                    float* __restrict__ partials) {
  extern __shared__ float acc[];
  __shared__ float warp_sums[kWarps];
  for (int c = threadIdx.x; c < dim; c += blockDim.x) acc[c] = 0.f;
  const int row_begin = blockIdx.x * tile_rows;
  const int row_end = min(rows, row_begin + tile_rows);
  const float inv_dim = 1.f / static_cast<float>(dim);
  for (int row = row_begin; row < row_end; ++row) {
    const int64_t base = static_cast<int64_t>(row) * dim;
    const float inv = rstd[row];
    float dot = 0.f;  // Σ_c dy·w·x
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
      dot = fmaf(load<kDy>(dy_bf16, dy_f32, base + c) * weight[c], x[base + c], dot);
    }
    const float coef = block_total(dot, warp_sums) * inv_dim * inv * inv * inv;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
      const float g = load<kDy>(dy_bf16, dy_f32, base + c);
      const float xc = x[base + c];
      const float v = g * weight[c] * inv - coef * xc;
      dx[base + c] = residual_grad != nullptr ? residual_grad[base + c] + v : v;
      acc[c] += g * xc * inv;
    }
  }
  float* out = partials + static_cast<int64_t>(blockIdx.x) * dim;
  for (int c = threadIdx.x; c < dim; c += blockDim.x) out[c] = acc[c];
}

// A block per kReduceColumns columns, a warp-wide row of them per group: group g sums tiles g,
// g + kReduceGroups, ... in order, then the first group adds the groups' sums in group order.
constexpr int kReduceColumns = 32;
static_assert(kThreads == kReduceColumns * ResidualRmsNormCuda::kReduceGroups);
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(int dim, int tiles, const float* __restrict__ partials,
                  float* __restrict__ dweight, bool accumulate) {
  constexpr int kGroups = ResidualRmsNormCuda::kReduceGroups;
  __shared__ float group_sums[kGroups][kReduceColumns];
  const int lane = static_cast<int>(threadIdx.x) % kReduceColumns;
  const int group = static_cast<int>(threadIdx.x) / kReduceColumns;
  const int c = static_cast<int>(blockIdx.x) * kReduceColumns + lane;
  float sum = 0.f;
  if (c < dim) {
#pragma unroll 4
    for (int t = group; t < tiles; t += kGroups) sum += partials[static_cast<int64_t>(t) * dim + c];
  }
  group_sums[group][lane] = sum;
  __syncthreads();
  if (group != 0 || c >= dim) return;
  float total = accumulate ? dweight[c] : 0.f;
  for (int g = 0; g < kGroups; ++g) total += group_sums[g][lane];
  dweight[c] = total;
}

int tile_rows_of(const RmsNormShape& s) {
  const int spread =
      (s.rows + ResidualRmsNormCuda::kTargetTiles - 1) / ResidualRmsNormCuda::kTargetTiles;
  return std::clamp(spread, 1, ResidualRmsNormCuda::kMaxRowsPerTile);
}

int tiles_of(const RmsNormShape& s) {
  const int tile_rows = tile_rows_of(s);
  return (s.rows + tile_rows - 1) / tile_rows;
}

void validate(const RmsNormShape& s) {
  if (s.rows <= 0) {
    refuse(ErrorKind::kInvalidArgument,
           "ResidualRmsNormCuda: RmsNormShape.rows={} must be positive", s.rows);
  }
  if (s.dim <= 0 || s.dim > ResidualRmsNormCuda::kMaxDim) {
    refuse(ErrorKind::kInvalidArgument,
           "ResidualRmsNormCuda: RmsNormShape.dim={} must be in [1, {}] (backward keeps a "
           "tile's dweight partial in shared memory)",
           s.dim, ResidualRmsNormCuda::kMaxDim);
  }
  if (!std::isfinite(s.eps) || s.eps <= 0) {
    refuse(ErrorKind::kInvalidArgument,
           "ResidualRmsNormCuda: RmsNormShape.eps={} must be finite and > 0", s.eps);
  }
}

template <class T>
void require(const T* pointer, const char* field) {
  if (pointer == nullptr) {
    refuse(ErrorKind::kInvalidArgument, "ResidualRmsNormCuda: {} is null", field);
  }
}

const bf16* as_bf16(const uint16_t* p) {
  return reinterpret_cast<const bf16*>(p);
}

}  // namespace

size_t ResidualRmsNormCuda::workspace_bytes(const RmsNormShape& shape) {
  validate(shape);
  return static_cast<size_t>(tiles_of(shape)) * static_cast<size_t>(shape.dim) * sizeof(float);
}

ResidualRmsNormCuda::ResidualRmsNormCuda(const RmsNormShape& shape, void* workspace, size_t bytes)
    : shape_(shape), partials_(static_cast<float*>(workspace)), workspace_bytes_(bytes) {
  validate(shape);
  if (bytes > 0) require(workspace, "the workspace (of nonzero size)");
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device_));
}

void ResidualRmsNormCuda::forward(const float* residual_in, RowsRef delta, const float* weight,
                                  float* residual_out, uint16_t* y, float* rstd,
                                  void* stream) const {
  require(residual_in, "forward: residual_in");
  require(weight, "forward: weight");
  require(residual_out, "forward: residual_out");
  require(y, "forward: y");
  require(rstd, "forward: rstd");
  if (delta.bf16 != nullptr && delta.f32 != nullptr) {
    refuse(ErrorKind::kInvalidArgument,
           "ResidualRmsNormCuda: forward: delta has both a bf16 and an fp32 pointer");
  }
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const float eps = static_cast<float>(shape_.eps);
  bf16* const y_bf16 = reinterpret_cast<bf16*>(y);
  if (delta.bf16 != nullptr) {
    forward_kernel<kBf16><<<shape_.rows, kThreads, 0, s>>>(shape_.dim, eps, residual_in,
                                                           as_bf16(delta.bf16), nullptr, weight,
                                                           residual_out, y_bf16, rstd);
  } else if (delta.f32 != nullptr) {
    forward_kernel<kF32><<<shape_.rows, kThreads, 0, s>>>(
        shape_.dim, eps, residual_in, nullptr, delta.f32, weight, residual_out, y_bf16, rstd);
  } else {
    forward_kernel<kNone><<<shape_.rows, kThreads, 0, s>>>(
        shape_.dim, eps, residual_in, nullptr, nullptr, weight, residual_out, y_bf16, rstd);
  }
  MEGACPP_CUDA_CHECK_LAUNCH("forward_kernel");
}

void ResidualRmsNormCuda::backward(const float* x, const float* weight, const float* rstd,
                                   RowsRef dy, const float* residual_grad, float* dx,
                                   float* dweight, bool accumulate, void* stream) const {
  require(x, "backward: x");
  require(weight, "backward: weight");
  require(rstd, "backward: rstd");
  require(dx, "backward: dx");
  require(dweight, "backward: dweight");
  if ((dy.bf16 == nullptr) == (dy.f32 == nullptr)) {
    refuse(ErrorKind::kInvalidArgument,
           "ResidualRmsNormCuda: backward: dy needs exactly one of its bf16 and fp32 pointers");
  }
  const size_t needed = workspace_bytes(shape_);
  if (workspace_bytes_ < needed) {
    refuse(ErrorKind::kInvalidArgument,
           "ResidualRmsNormCuda::backward needs workspace_bytes(shape) = {} bytes of workspace, "
           "got {}",
           needed, workspace_bytes_);
  }
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int tile_rows = tile_rows_of(shape_);
  const int tiles = tiles_of(shape_);
  const size_t shared = static_cast<size_t>(shape_.dim) * sizeof(float);
  if (dy.bf16 != nullptr) {
    backward_kernel<kBf16><<<tiles, kThreads, shared, s>>>(shape_.rows, tile_rows, shape_.dim, x,
                                                           weight, rstd, as_bf16(dy.bf16), nullptr,
                                                           residual_grad, dx, partials_);
  } else {
    backward_kernel<kF32><<<tiles, kThreads, shared, s>>>(shape_.rows, tile_rows, shape_.dim, x,
                                                          weight, rstd, nullptr, dy.f32,
                                                          residual_grad, dx, partials_);
  }
  MEGACPP_CUDA_CHECK_LAUNCH("backward_kernel");
  reduce_kernel<<<(shape_.dim + kReduceColumns - 1) / kReduceColumns, kThreads, 0, s>>>(
      shape_.dim, tiles, partials_, dweight, accumulate);
  MEGACPP_CUDA_CHECK_LAUNCH("reduce_kernel");
}

}  // namespace megacpp::cuda
