#pragma once
// The global gradient norm and its clipping factor on a CUDA GPU: the function of
// kernels/cpu/grad_clip.h over fp32 gradient tensors, computed on the device so that a step never
// waits on the host for it. Clipping itself is fused into the optimizer: AdamWCuda::step reads
// the factor from device memory and scales each gradient as it loads it, which is what the CPU's
// clip_grad_norm (scale in place) followed by adamw_step computes, without a pass over the
// gradients.
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it.
//
//   stage 1  the tensors are cut into chunks of kChunk elements (a tensor's last one shorter),
//            one block per chunk: squares summed in double, threads in a fixed stride, the block
//            by a fixed-order tree, one partial per chunk.
//   stage 2  one block sums the partials in chunk order the same way: norm = sqrt(total).
// The order depends on the tensor list alone: bitwise reproducible.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace megacpp::cuda {

// A gradient tensor in device memory: `size` fp32 values.
struct GradTensorRef {
  const float* data = nullptr;
  int64_t size = 0;
};

class GradNormCuda {
 public:
  // Small enough that a small model's few million parameters still fill every SM (65536 left more
  // than half of an H100 idle at 3.7M parameters), large enough that the tables stay small.
  static constexpr int64_t kChunk = int64_t{1} << 13;

  // Device memory for this tensor list: the chunk table and the per-chunk partials. Throws
  // megacpp::Error (kInvalidArgument) on a null tensor or a negative size.
  static size_t workspace_bytes(const std::vector<GradTensorRef>& tensors);

  // Validates the list, takes `workspace` (workspace_bytes(tensors) bytes of device memory that
  // stays the op's while it lives) and uploads the chunk table into it, once (synchronously).
  // The tensors must stay where they are: the table holds their addresses.
  GradNormCuda(const std::vector<GradTensorRef>& tensors, void* workspace, size_t bytes);

  // norm [1] fp32 = sqrt(Σ g²) over every tensor (summed in double). scale [1] fp32 (may be null)
  // = max_norm / (norm + 1e-6) when max_norm > 0 and norm > max_norm, else 1: the factor
  // cpu::clip_grad_norm multiplies the gradients by. Device pointers. Asynchronous.
  void compute(double max_norm, float* norm, float* scale, void* stream = nullptr) const;

  // A norm over tensors spread over several devices (tensor parallelism): each device writes
  // its tensors' Σ g² to square_sum [1] (double, the same sum compute() takes the root of), the
  // sums are added across devices, and norm_from_square_sum turns the total into the norm and
  // clipping factor exactly as compute() does. Device pointers. Asynchronous.
  void square_sum(double* square_sum, void* stream = nullptr) const;
  static void norm_from_square_sum(const double* square_sum, double max_norm, float* norm,
                                   float* scale, void* stream = nullptr);

  int chunks() const { return chunks_; }

 private:
  void reduce(double max_norm, float* norm, float* scale, double* square_sum, void* stream) const;
  int device_ = 0;
  int chunks_ = 0;
  void* workspace_ = nullptr;
};

}  // namespace megacpp::cuda
