#pragma once
// The GatedMLP on a CUDA GPU: the function of kernels/cpu/gated_mlp.h, [a | g] = x · fc1ᵀ (a
// first), h = a ⊙ silu(g), y = h · fc2ᵀ, no biases, in the step's mixed precision: x, the weights,
// fc1's output, the activation and their gradients are bf16 (matmul operands), arithmetic and
// accumulation are fp32, the weight gradients fp32.
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it. All
// pointers are device pointers owned by the caller; matrices are row-major, bf16 tensors uint16_t
// bit patterns.
//
//   gate      one elementwise kernel each way: h = a·g·σ(g); da = dh·g·σ(g),
//             dg = dh·a·σ(g)·(1 + g·(1 − σ(g))), in fp32 from the bf16 values, written in bf16.
//   GatedMlpCuda  fc1 and fc2 as two LinearCuda (cuBLASLt) around the gate.
#include <cstddef>
#include <cstdint>
#include <functional>

#include "kernels/cuda/linear.h"

namespace megacpp::cuda {

struct GatedMlpShape {
  int rows = 0;    // batch · seqlen
  int dim = 0;     // d_model
  int hidden = 0;  // the MLP's hidden size: fc1 gives 2·hidden columns
};

// act [rows, hidden] = a ⊙ silu(g) of fc1_out [rows, 2·hidden] = [a | g]. Asynchronous on
// `stream` (a cudaStream_t, or null).
void gated_mlp_gate_forward(const GatedMlpShape& shape, const uint16_t* fc1_out, uint16_t* act,
                            void* stream = nullptr);
// dfc1_out [rows, 2·hidden] = [da | dg] from fc1_out and dact [rows, hidden], overwritten.
void gated_mlp_gate_backward(const GatedMlpShape& shape, const uint16_t* fc1_out,
                             const uint16_t* dact, uint16_t* dfc1_out, void* stream = nullptr);

class GatedMlpCuda {
 public:
  // Device workspace the op needs while it lives: the two linears run in order on one stream and
  // share it, so it is the larger of theirs.
  static size_t workspace_bytes(const GatedMlpShape& shape);
  // Validates the shape (kInvalidArgument naming the field otherwise), takes `workspace` and has
  // both linears pick their GEMM algorithms (through `cache` when given: linear.h).
  // weight_gradient_sms: what both linears plan their weight gradients' GEMMs for (linear.h).
  GatedMlpCuda(const GatedMlpShape& shape, void* workspace, size_t bytes,
               GemmPlanCache* cache = nullptr, int weight_gradient_sms = 0);

  // x bf16 [rows, dim]; fc1 bf16 [2·hidden, dim]; fc2 bf16 [dim, hidden]. Writes fc1_out bf16
  // [rows, 2·hidden] and act bf16 [rows, hidden] (kept for backward) and y [rows, dim].
  // Asynchronous.
  void forward(const uint16_t* x, const uint16_t* fc1, const uint16_t* fc2, uint16_t* fc1_out,
               uint16_t* act, RowsOut y, void* stream = nullptr) const;
  // fc1_out and act: forward's. dy bf16 [rows, dim]. dx [rows, dim] overwritten (both pointers
  // null: not computed). dfc1 fp32 [2·hidden, dim] and dfc2 fp32 [dim, hidden] add into what they
  // hold when `accumulate`, otherwise are overwritten. scratch_dact bf16 [rows, hidden] and
  // scratch_dfc1_out bf16 [rows, 2·hidden] are the caller's buffers for the intermediate
  // gradients (left holding them); dx must not alias x, dy or act, which the weight gradients
  // read after dx is written. Asynchronous. `dx_ready` (may be empty) is called once dx
  // is enqueued and before both weight gradients are: where tensor parallelism starts summing
  // dx over its group, hidden behind those two GEMMs.
  void backward(const uint16_t* x, const uint16_t* fc1, const uint16_t* fc2,
                const uint16_t* fc1_out, const uint16_t* act, const uint16_t* dy, RowsOut dx,
                float* dfc1, float* dfc2, bool accumulate, uint16_t* scratch_dact,
                uint16_t* scratch_dfc1_out, void* stream = nullptr,
                const std::function<void()>& dx_ready = {}) const;

  const GatedMlpShape& shape() const { return shape_; }

 private:
  GatedMlpShape shape_;
  LinearCuda fc1_;  // dim → 2·hidden
  LinearCuda fc2_;  // hidden → dim
};

}  // namespace megacpp::cuda
