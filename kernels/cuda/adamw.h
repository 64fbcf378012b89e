#pragma once
// A fused multi-tensor AdamW step on a CUDA GPU: the update of kernels/cpu/adamw.h (the
// hyperparameters of kernels/contracts/adamw.h, decoupled weight decay) over every parameter
// tensor of a model in one launch, with the fp32 master weights and moments updated in place, the
// gradient clipping factor of GradNormCuda (kernels/cuda/grad_clip.h) applied as each gradient is
// loaded, and the bf16 copy of each updated weight (the next step's matmul operand) written in the
// same pass.
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it.
//
// The tensors are cut into chunks of kChunk elements; one block per chunk. Every element is
// updated by itself (no reduction): bitwise reproducible.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/contracts/adamw.h"

namespace megacpp::cuda {

// One parameter tensor: `size` values at each device pointer.
struct AdamWTensorRef {
  float* param = nullptr;          // fp32 master weights, updated in place
  const float* grad = nullptr;     // fp32 gradient
  float* exp_avg = nullptr;        // fp32 first moment, updated in place
  float* exp_avg_sq = nullptr;     // fp32 second moment, updated in place
  uint16_t* param_bf16 = nullptr;  // bf16 copy of the updated weights; null: none
  int64_t size = 0;
  bool weight_decay = true;  // false: the spec's no-decay set (dt_bias, D, norm weights, biases)
};

class AdamWCuda {
 public:
  // Small enough that a small model's few million parameters still fill every SM (65536 left more
  // than half of an H100 idle at 3.7M parameters), large enough that the tables stay small.
  static constexpr int64_t kChunk = int64_t{1} << 13;

  // Device memory for this tensor list: the tensor and chunk tables. Throws megacpp::Error
  // (kInvalidArgument) on a null pointer (param_bf16 aside) or a negative size.
  static size_t workspace_bytes(const std::vector<AdamWTensorRef>& tensors);

  // Validates the list, takes `workspace` (workspace_bytes(tensors) bytes of device memory that
  // stays the op's while it lives) and uploads the tables into it, once (synchronously). The
  // tensors must stay where they are: the tables hold their addresses.
  AdamWCuda(const std::vector<AdamWTensorRef>& tensors, void* workspace, size_t bytes);

  // One update with `hyper` (its weight_decay applies to the tensors with weight_decay set, 0 to
  // the others) at step `step` (counting from 1: the bias corrections). grad_scale: a device
  // pointer to the factor every gradient is multiplied by first (GradNormCuda's clip scale), or
  // null for none. Asynchronous.
  void step(const ops::AdamWHyper& hyper, int64_t step, const float* grad_scale,
            void* stream = nullptr) const;

  int chunks() const { return chunks_; }

 private:
  int device_ = 0;
  int chunks_ = 0;
  void* workspace_ = nullptr;
  size_t tensors_bytes_ = 0;  // the tensor table's share of the workspace; the chunks follow
};

}  // namespace megacpp::cuda
