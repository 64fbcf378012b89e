// CUDA GatedMLP: see gated_mlp.h for the structure. The gate's formulas and their float
// evaluation order are those of kernels/cpu/gated_mlp.h.
#include <climits>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gated_mlp.h"

namespace megacpp::cuda {
namespace {

using detail::refuse;

constexpr int kThreads = 256;
constexpr int kMaxGridY = 65535;

// expf, not __expf: the fast one loses accuracy for large |g|, where silu's tail matters.
__device__ __forceinline__ float sigmoid(float v) {
  return 1.f / (1.f + expf(-v));
}

// Block (x, y) owns columns [x·blockDim, (x+1)·blockDim) of rows y, y + gridDim.y, ...
__global__ void __launch_bounds__(kThreads)
    gate_forward_kernel(int rows, int hidden, const bf16* __restrict__ fc1_out,
                        bf16* __restrict__ act) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= hidden) return;
  for (int row = blockIdx.y; row < rows; row += gridDim.y) {
    const bf16* a = fc1_out + static_cast<int64_t>(row) * 2 * hidden;
    const float av = to_f(a[c]), gv = to_f(a[hidden + c]);
    act[static_cast<int64_t>(row) * hidden + c] = __float2bfloat16(av * gv * sigmoid(gv));
  }
}

__global__ void __launch_bounds__(kThreads)
    gate_backward_kernel(int rows, int hidden, const bf16* __restrict__ fc1_out,
                         const bf16* __restrict__ dact, bf16* __restrict__ dfc1_out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= hidden) return;
  for (int row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t base = static_cast<int64_t>(row) * 2 * hidden;
    const float av = to_f(fc1_out[base + c]), gv = to_f(fc1_out[base + hidden + c]);
    const float dh = to_f(dact[static_cast<int64_t>(row) * hidden + c]);
    const float s = sigmoid(gv);
    dfc1_out[base + c] = __float2bfloat16(dh * gv * s);
    dfc1_out[base + hidden + c] = __float2bfloat16(dh * av * s * (1.f + gv * (1.f - s)));
  }
}

void validate(const GatedMlpShape& s) {
  const auto positive = [](int value, const char* field) {
    if (value <= 0) {
      refuse(ErrorKind::kInvalidArgument, "GatedMlpCuda: GatedMlpShape.{}={} must be positive",
             field, value);
    }
  };
  positive(s.rows, "rows");
  positive(s.dim, "dim");
  positive(s.hidden, "hidden");
  if (s.hidden > INT_MAX / 2) {
    refuse(ErrorKind::kInvalidArgument,
           "GatedMlpCuda: GatedMlpShape.hidden={} must be at most {} (fc1 has 2·hidden outputs)",
           s.hidden, INT_MAX / 2);
  }
}

template <class T>
void require(const T* pointer, const char* field) {
  if (pointer == nullptr) refuse(ErrorKind::kInvalidArgument, "GatedMlpCuda: {} is null", field);
}

dim3 gate_grid(const GatedMlpShape& s) {
  return dim3(static_cast<unsigned>((s.hidden + kThreads - 1) / kThreads),
              static_cast<unsigned>(s.rows < kMaxGridY ? s.rows : kMaxGridY));
}

LinearShape fc1_shape(const GatedMlpShape& s) {
  validate(s);
  return LinearShape{s.rows, s.dim, 2 * s.hidden};
}

LinearShape fc2_shape(const GatedMlpShape& s) {
  validate(s);
  return LinearShape{s.rows, s.hidden, s.dim};
}

}  // namespace

void gated_mlp_gate_forward(const GatedMlpShape& shape, const uint16_t* fc1_out, uint16_t* act,
                            void* stream) {
  validate(shape);
  require(fc1_out, "gate forward: fc1_out");
  require(act, "gate forward: act");
  gate_forward_kernel<<<gate_grid(shape), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      shape.rows, shape.hidden, reinterpret_cast<const bf16*>(fc1_out),
      reinterpret_cast<bf16*>(act));
  MEGACPP_CUDA_CHECK_LAUNCH("gate_forward_kernel");
}

void gated_mlp_gate_backward(const GatedMlpShape& shape, const uint16_t* fc1_out,
                             const uint16_t* dact, uint16_t* dfc1_out, void* stream) {
  validate(shape);
  require(fc1_out, "gate backward: fc1_out");
  require(dact, "gate backward: dact");
  require(dfc1_out, "gate backward: dfc1_out");
  gate_backward_kernel<<<gate_grid(shape), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      shape.rows, shape.hidden, reinterpret_cast<const bf16*>(fc1_out),
      reinterpret_cast<const bf16*>(dact), reinterpret_cast<bf16*>(dfc1_out));
  MEGACPP_CUDA_CHECK_LAUNCH("gate_backward_kernel");
}

size_t GatedMlpCuda::workspace_bytes(const GatedMlpShape& shape) {
  const size_t fc1 = LinearCuda::workspace_bytes(fc1_shape(shape));
  const size_t fc2 = LinearCuda::workspace_bytes(fc2_shape(shape));
  return fc1 > fc2 ? fc1 : fc2;
}

GatedMlpCuda::GatedMlpCuda(const GatedMlpShape& shape, void* workspace, size_t bytes,
                           GemmPlanCache* cache, int weight_gradient_sms)
    : shape_(shape),
      fc1_(fc1_shape(shape), workspace, bytes, cache, weight_gradient_sms),
      fc2_(fc2_shape(shape), workspace, bytes, cache, weight_gradient_sms) {}

void GatedMlpCuda::forward(const uint16_t* x, const uint16_t* fc1, const uint16_t* fc2,
                           uint16_t* fc1_out, uint16_t* act, RowsOut y, void* stream) const {
  require(x, "forward: x");
  require(fc1, "forward: fc1");
  require(fc2, "forward: fc2");
  require(fc1_out, "forward: fc1_out");
  require(act, "forward: act");
  // Refused before anything runs, rather than by fc2 after fc1 and the gate have.
  if ((y.bf16 == nullptr) == (y.f32 == nullptr)) {
    refuse(ErrorKind::kInvalidArgument,
           "GatedMlpCuda: forward: y needs exactly one of its bf16 and fp32 pointers");
  }
  fc1_.forward(x, fc1, nullptr, RowsOut{fc1_out, nullptr}, stream);
  gated_mlp_gate_forward(shape_, fc1_out, act, stream);
  fc2_.forward(act, fc2, nullptr, y, stream);
}

void GatedMlpCuda::backward(const uint16_t* x, const uint16_t* fc1, const uint16_t* fc2,
                            const uint16_t* fc1_out, const uint16_t* act, const uint16_t* dy,
                            RowsOut dx, float* dfc1, float* dfc2, bool accumulate,
                            uint16_t* scratch_dact, uint16_t* scratch_dfc1_out, void* stream,
                            const std::function<void()>& dx_ready) const {
  require(x, "backward: x");
  require(fc1, "backward: fc1");
  require(fc2, "backward: fc2");
  require(fc1_out, "backward: fc1_out");
  require(act, "backward: act");
  require(dy, "backward: dy");
  require(dfc1, "backward: dfc1");
  require(dfc2, "backward: dfc2");
  require(scratch_dact, "backward: scratch_dact");
  require(scratch_dfc1_out, "backward: scratch_dfc1_out");
  if (dx.bf16 != nullptr && dx.f32 != nullptr) {
    refuse(ErrorKind::kInvalidArgument,
           "GatedMlpCuda: backward: dx has both a bf16 and an fp32 pointer");
  }
  fc2_.backward_input(fc2, dy, RowsOut{scratch_dact, nullptr}, stream);
  gated_mlp_gate_backward(shape_, fc1_out, scratch_dact, scratch_dfc1_out, stream);
  fc1_.backward_input(fc1, scratch_dfc1_out, dx, stream);
  if (dx_ready) dx_ready();
  fc1_.backward_weights(x, scratch_dfc1_out, dfc1, nullptr, accumulate, stream);
  fc2_.backward_weights(act, dy, dfc2, nullptr, accumulate, stream);
}

}  // namespace megacpp::cuda
