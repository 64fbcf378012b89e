// CUDA global gradient norm: see grad_clip.h for the structure.
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grad_clip.h"

namespace megacpp::cuda {
namespace {

using detail::refuse;

constexpr int kThreads = 256;

struct Chunk {
  const float* data;
  int64_t size;
};

// Block-wide double sum in an order fixed by blockDim alone (a shared-memory tree); thread 0
// gets the total. `scratch` holds blockDim.x doubles, blockDim.x a power of two.
__device__ double block_sum_double(double value, double* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half) scratch[threadIdx.x] += scratch[threadIdx.x + half];
    __syncthreads();
  }
  return scratch[0];
}

__global__ void __launch_bounds__(kThreads)
    partial_kernel(const Chunk* __restrict__ chunks, double* __restrict__ partials) {
  __shared__ double scratch[kThreads];
  const Chunk chunk = chunks[blockIdx.x];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < chunk.size; i += blockDim.x) {
    const double g = static_cast<double>(chunk.data[i]);
    sum = fma(g, g, sum);
  }
  sum = block_sum_double(sum, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__device__ void write_norm(double sum, double max_norm, float* norm, float* scale) {
  const double total = sqrt(sum);
  *norm = static_cast<float>(total);
  if (scale != nullptr) {
    *scale =
        max_norm > 0.0 && total > max_norm ? static_cast<float>(max_norm / (total + 1e-6)) : 1.f;
  }
}

// Writes the norm and scale, or (square_sum non-null) only the sum of squares.
__global__ void __launch_bounds__(kThreads)
    finish_kernel(int chunks, const double* __restrict__ partials, double max_norm,
                  float* __restrict__ norm, float* __restrict__ scale,
                  double* __restrict__ square_sum) {
  __shared__ double scratch[kThreads];
  double sum = 0.0;
  for (int i = threadIdx.x; i < chunks; i += blockDim.x) sum += partials[i];
  sum = block_sum_double(sum, scratch);
  if (threadIdx.x == 0) {
    if (square_sum != nullptr) {
      *square_sum = sum;
    } else {
      write_norm(sum, max_norm, norm, scale);
    }
  }
}

__global__ void norm_from_square_sum_kernel(const double* __restrict__ square_sum, double max_norm,
                                            float* __restrict__ norm, float* __restrict__ scale) {
  write_norm(*square_sum, max_norm, norm, scale);
}

std::vector<Chunk> chunk_table(const std::vector<GradTensorRef>& tensors) {
  std::vector<Chunk> table;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const GradTensorRef& g = tensors[t];
    if (g.size < 0) {
      refuse(ErrorKind::kInvalidArgument, "GradNormCuda: tensor {} has size {}", t, g.size);
    }
    if (g.size > 0 && g.data == nullptr) {
      refuse(ErrorKind::kInvalidArgument, "GradNormCuda: tensor {} ({} values) is null", t, g.size);
    }
    for (int64_t start = 0; start < g.size; start += GradNormCuda::kChunk) {
      const int64_t left = g.size - start;
      table.push_back({g.data + start, left < GradNormCuda::kChunk ? left : GradNormCuda::kChunk});
    }
  }
  if (table.size() > static_cast<size_t>(INT32_MAX)) {
    refuse(ErrorKind::kInvalidArgument, "GradNormCuda: {} chunks exceed the grid", table.size());
  }
  return table;
}

size_t aligned(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

}  // namespace

size_t GradNormCuda::workspace_bytes(const std::vector<GradTensorRef>& tensors) {
  const size_t chunks = chunk_table(tensors).size();
  return aligned(chunks * sizeof(Chunk)) + aligned(chunks * sizeof(double));
}

GradNormCuda::GradNormCuda(const std::vector<GradTensorRef>& tensors, void* workspace, size_t bytes)
    : workspace_(workspace) {
  const std::vector<Chunk> table = chunk_table(tensors);
  chunks_ = static_cast<int>(table.size());
  const size_t needed = workspace_bytes(tensors);
  if (bytes < needed || (needed > 0 && workspace == nullptr)) {
    refuse(ErrorKind::kInvalidArgument,
           "GradNormCuda: needs workspace_bytes(tensors) = {} bytes of workspace, got {}", needed,
           workspace == nullptr ? 0 : bytes);
  }
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device_));
  if (!table.empty()) {
    MEGACPP_CUDA_CHECK(
        cudaMemcpy(workspace_, table.data(), table.size() * sizeof(Chunk), cudaMemcpyHostToDevice));
  }
}

void GradNormCuda::compute(double max_norm, float* norm, float* scale, void* stream) const {
  if (norm == nullptr) refuse(ErrorKind::kInvalidArgument, "GradNormCuda: compute: norm is null");
  reduce(max_norm, norm, scale, nullptr, stream);
}

void GradNormCuda::square_sum(double* square_sum, void* stream) const {
  if (square_sum == nullptr) {
    refuse(ErrorKind::kInvalidArgument, "GradNormCuda: square_sum: the output is null");
  }
  reduce(0.0, nullptr, nullptr, square_sum, stream);
}

void GradNormCuda::norm_from_square_sum(const double* square_sum, double max_norm, float* norm,
                                        float* scale, void* stream) {
  if (square_sum == nullptr || norm == nullptr) {
    refuse(ErrorKind::kInvalidArgument, "GradNormCuda: norm_from_square_sum: a pointer is null");
  }
  norm_from_square_sum_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(square_sum, max_norm,
                                                                              norm, scale);
  MEGACPP_CUDA_CHECK_LAUNCH("norm_from_square_sum_kernel");
}

void GradNormCuda::reduce(double max_norm, float* norm, float* scale, double* square_sum,
                          void* stream) const {
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const Chunk* table = static_cast<const Chunk*>(workspace_);
  double* partials =
      reinterpret_cast<double*>(static_cast<unsigned char*>(workspace_) +
                                aligned(static_cast<size_t>(chunks_) * sizeof(Chunk)));
  if (chunks_ > 0) {
    partial_kernel<<<chunks_, kThreads, 0, s>>>(table, partials);
    MEGACPP_CUDA_CHECK_LAUNCH("partial_kernel");
  }
  finish_kernel<<<1, kThreads, 0, s>>>(chunks_, partials, max_norm, norm, scale, square_sum);
  MEGACPP_CUDA_CHECK_LAUNCH("finish_kernel");
}

}  // namespace megacpp::cuda
