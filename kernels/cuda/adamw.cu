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
  int wide;   // 1: every pointer aligned for four elements a load (16 bytes; the bf16 copy 8)
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

// One element's update, the CPU op's float arithmetic in its order.
struct Updated {
  float m, v, p;
};
__device__ __forceinline__ Updated update(float grad, float exp_avg, float exp_avg_sq, float param,
                                          const StepConstants& k, float decay, float scale) {
  const float g = grad * scale;
  const float m = k.b1 * exp_avg + (1.f - k.b1) * g;
  const float v = k.b2 * exp_avg_sq + (1.f - k.b2) * g * g;
  const float denom = sqrtf(v) * k.inv_sqrt_bias2 + k.eps;
  return {m, v, param * decay - k.step_size * m / denom};
}

__global__ void __launch_bounds__(kThreads)
    step_kernel(const Tensor* __restrict__ tensors, const Chunk* __restrict__ chunks,
                StepConstants k, const float* __restrict__ grad_scale) {
  const Chunk chunk = chunks[blockIdx.x];
  const Tensor t = tensors[chunk.tensor];
  const float scale = grad_scale != nullptr ? *grad_scale : 1.f;
  const float decay = t.decay ? k.decay : 1.f;
  const int64_t end = chunk.start + chunk.size;
  int64_t scalar_from = chunk.start;
  if (t.wide) {
    // Four elements a thread with 16-byte loads and stores: the element-at-a-time loop kept
    // a third of the memory system idle (13.1 ms a step at bench-1.3b on one H200, 67% of the
    // bytes' time at the DRAM's peak). Chunks start at multiples of kChunk, so aligned.
    const int64_t quads = chunk.size / 4;
    for (int64_t q = threadIdx.x; q < quads; q += blockDim.x) {
      const int64_t i = chunk.start + 4 * q;
      const float4 g = *reinterpret_cast<const float4*>(t.grad + i);
      float4 m = *reinterpret_cast<const float4*>(t.exp_avg + i);
      float4 v = *reinterpret_cast<const float4*>(t.exp_avg_sq + i);
      float4 p = *reinterpret_cast<const float4*>(t.param + i);
      const Updated u0 = update(g.x, m.x, v.x, p.x, k, decay, scale);
      const Updated u1 = update(g.y, m.y, v.y, p.y, k, decay, scale);
      const Updated u2 = update(g.z, m.z, v.z, p.z, k, decay, scale);
      const Updated u3 = update(g.w, m.w, v.w, p.w, k, decay, scale);
      m = make_float4(u0.m, u1.m, u2.m, u3.m);
      v = make_float4(u0.v, u1.v, u2.v, u3.v);
      p = make_float4(u0.p, u1.p, u2.p, u3.p);
      *reinterpret_cast<float4*>(t.exp_avg + i) = m;
      *reinterpret_cast<float4*>(t.exp_avg_sq + i) = v;
      *reinterpret_cast<float4*>(t.param + i) = p;
      if (t.param_bf16 != nullptr) {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(p.x, p.y);
        const __nv_bfloat162 hi = __floats2bfloat162_rn(p.z, p.w);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&lo);
        packed.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(t.param_bf16 + i) = packed;
      }
    }
    scalar_from = chunk.start + 4 * quads;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) {
    const Updated u = update(t.grad[i], t.exp_avg[i], t.exp_avg_sq[i], t.param[i], k, decay, scale);
    t.exp_avg[i] = u.m;
    t.exp_avg_sq[i] = u.v;
    t.param[i] = u.p;
    if (t.param_bf16 != nullptr) t.param_bf16[i] = __float2bfloat16(u.p);
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
    const auto at = [](const void* p, uintptr_t bytes) {
      return reinterpret_cast<uintptr_t>(p) % bytes == 0;
    };
    const bool wide = at(t.param, 16) && at(t.grad, 16) && at(t.exp_avg, 16) &&
                      at(t.exp_avg_sq, 16) && at(t.param_bf16, 8);
    out.tensors.push_back({t.param, t.grad, t.exp_avg, t.exp_avg_sq,
                           reinterpret_cast<bf16*>(t.param_bf16), t.weight_decay ? 1 : 0,
                           wide ? 1 : 0});
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
