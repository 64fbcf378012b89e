// CUDA fused multi-tensor AdamW: see adamw.h. Per element, the float arithmetic of
// kernels/cpu/adamw.h with the same per-step constants, computed on the host in double as there.
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cuda/adamw.h"
#include "kernels/cuda/common.cuh"

namespace megacpp::cuda {
namespace {

using detail::refuse;

constexpr int kThreads = 256;

struct Tensor {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  bf16* param_bf16;
  int decay;  // 1: weight decay applies
};

struct Chunk {
  int tensor;
  int64_t start, size;
};

// The per-step constants, in the CPU op's float narrowing.
struct StepConstants {
  float decay;  // 1 − lr·weight_decay, for the tensors that decay
  float b1, b2, step_size, inv_sqrt_bias2, eps;
};

__global__ void __launch_bounds__(kThreads)
    step_kernel(const Tensor* __restrict__ tensors, const Chunk* __restrict__ chunks,
                StepConstants k, const float* __restrict__ grad_scale) {
  const Chunk chunk = chunks[blockIdx.x];
  const Tensor t = tensors[chunk.tensor];
  const float scale = grad_scale != nullptr ? *grad_scale : 1.f;
  const float decay = t.decay ? k.decay : 1.f;
  const int64_t end = chunk.start + chunk.size;
  for (int64_t i = chunk.start + threadIdx.x; i < end; i += blockDim.x) {
    const float g = t.grad[i] * scale;
    const float m = k.b1 * t.exp_avg[i] + (1.f - k.b1) * g;
    const float v = k.b2 * t.exp_avg_sq[i] + (1.f - k.b2) * g * g;
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    const float denom = sqrtf(v) * k.inv_sqrt_bias2 + k.eps;
    const float p = t.param[i] * decay - k.step_size * m / denom;
    t.param[i] = p;
    if (t.param_bf16 != nullptr) t.param_bf16[i] = __float2bfloat16(p);
  }
}

size_t aligned(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

struct Tables {
  std::vector<Tensor> tensors;
  std::vector<Chunk> chunks;
};

Tables tables_of(const std::vector<AdamWTensorRef>& list) {
  Tables out;
  for (size_t i = 0; i < list.size(); ++i) {
    const AdamWTensorRef& t = list[i];
    if (t.size < 0) {
      refuse(ErrorKind::kInvalidArgument, "AdamWCuda: tensor {} has size {}", i, t.size);
    }
    if (t.size > 0 && (t.param == nullptr || t.grad == nullptr || t.exp_avg == nullptr ||
                       t.exp_avg_sq == nullptr)) {
      refuse(ErrorKind::kInvalidArgument,
             "AdamWCuda: tensor {} ({} values) has a null param, grad, exp_avg or exp_avg_sq", i,
             t.size);
    }
    const int index = static_cast<int>(out.tensors.size());
    out.tensors.push_back({t.param, t.grad, t.exp_avg, t.exp_avg_sq,
                           reinterpret_cast<bf16*>(t.param_bf16), t.weight_decay ? 1 : 0});
    for (int64_t start = 0; start < t.size; start += AdamWCuda::kChunk) {
      const int64_t left = t.size - start;
      out.chunks.push_back({index, start, left < AdamWCuda::kChunk ? left : AdamWCuda::kChunk});
    }
  }
  if (out.chunks.size() > static_cast<size_t>(INT32_MAX)) {
    refuse(ErrorKind::kInvalidArgument, "AdamWCuda: {} chunks exceed the grid", out.chunks.size());
  }
  return out;
}

}  // namespace

size_t AdamWCuda::workspace_bytes(const std::vector<AdamWTensorRef>& tensors) {
  const Tables t = tables_of(tensors);
  return aligned(t.tensors.size() * sizeof(Tensor)) + aligned(t.chunks.size() * sizeof(Chunk));
}

AdamWCuda::AdamWCuda(const std::vector<AdamWTensorRef>& tensors, void* workspace, size_t bytes)
    : workspace_(workspace) {
  const Tables t = tables_of(tensors);
  chunks_ = static_cast<int>(t.chunks.size());
  const size_t needed = workspace_bytes(tensors);
  if (bytes < needed || (needed > 0 && workspace == nullptr)) {
    refuse(ErrorKind::kInvalidArgument,
           "AdamWCuda: needs workspace_bytes(tensors) = {} bytes of workspace, got {}", needed,
           workspace == nullptr ? 0 : bytes);
  }
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device_));
  unsigned char* base = static_cast<unsigned char*>(workspace_);
  if (!t.tensors.empty()) {
    MEGACPP_CUDA_CHECK(cudaMemcpy(base, t.tensors.data(), t.tensors.size() * sizeof(Tensor),
                                  cudaMemcpyHostToDevice));
  }
  if (!t.chunks.empty()) {
    MEGACPP_CUDA_CHECK(cudaMemcpy(base + aligned(t.tensors.size() * sizeof(Tensor)),
                                  t.chunks.data(), t.chunks.size() * sizeof(Chunk),
                                  cudaMemcpyHostToDevice));
  }
  tensors_bytes_ = aligned(t.tensors.size() * sizeof(Tensor));
}

void AdamWCuda::step(const ops::AdamWHyper& h, int64_t step, const float* grad_scale,
                     void* stream) const {
  if (step < 1) refuse(ErrorKind::kInvalidArgument, "AdamWCuda: step={} must be >= 1", step);
  if (chunks_ == 0) return;
  // As cpu::adamw_step derives them: in double, then narrowed.
  const double bias1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  StepConstants k{};
  k.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  k.b1 = static_cast<float>(h.beta1);
  k.b2 = static_cast<float>(h.beta2);
  k.step_size = static_cast<float>(h.lr / bias1);
  k.inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(bias2));
  k.eps = static_cast<float>(h.eps);
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const unsigned char* base = static_cast<const unsigned char*>(workspace_);
  step_kernel<<<chunks_, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const Tensor*>(base), reinterpret_cast<const Chunk*>(base + tensors_bytes_),
      k, grad_scale);
  MEGACPP_CUDA_CHECK_LAUNCH("step_kernel");
}

}  // namespace megacpp::cuda
