#pragma once
// Causal grouped-query softmax attention through cuDNN's fused flash attention: the function and
// the layouts of kernels/cuda/attention.h (CausalAttentionCuda), computed by the engines cuDNN
// builds for a graph of its backend API (no cudnn-frontend: the descriptors are made here).
//
// The graphs are the ones cuDNN recognises as scaled dot-product attention:
//   forward   S = Q·Kᵀ (fp32), ·scale, causal mask (row index ≥ column index, else -inf),
//             softmax by max / exp / sum, lse = max + log(sum) saved, O = P·V with P in bf16
//   backward  rowsum(dO ⊙ O) into an fp32 tensor of our workspace, P recomputed from Q, K and
//             lse, dV = Pᵀ·dO, dS = P ⊙ (dO·Vᵀ − rowsum) · scale, dK = dSᵀ·Q, dQ = dS·K; with
//             GQA the gradients of a group's q heads are summed into its kv head in the graph.
// Q, K and V are strided views, so a packed qkv row works as it does for CausalAttentionCuda.
//
// Determinism: with `deterministic` the backward's dQ is the matmul's own output (cuDNN then
// keeps dS in its workspace, which grows as batch · q_heads · seqlen²) and every engine whose
// numerical notes say nondeterministic is passed over, so two runs give the same bits. Without
// it dQ is accumulated in fp32 by an engine free to sum in any order: faster, smaller, not
// reproducible bit for bit.
//
// Plans: the constructor builds the forward and backward execution plans (heuristic mode A, the
// first engine that finalises within the workspace and the determinism asked for). With a plan
// cache, a plan is first looked up there by its key (cuDNN version, graph version, shape,
// strides, determinism) and loaded from cuDNN's JSON form of it; one that no longer loads is
// stale, rebuilt and counted; every build is counted in the cache's ledger (recompile budget).
//
// Plain C++ (no CUDA or cuDNN types), so host code compiled by the C++ compiler can include it.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/cuda/attention.h"

namespace megacpp::cuda {

class GemmPlanCache;

// cudnnGetVersion() of the library loaded (e.g. 91900), without touching a device.
int cudnn_runtime_version();

class CausalAttentionCudnn {
 public:
  // Device memory the op needs, planned before any device exists: the backward's rowsum tensor,
  // the fp32 dQ accumulator when not deterministic, and the allowance for cuDNN's own workspace
  // (engines that want more are passed over). Throws megacpp::Error on a bad shape.
  static size_t workspace_bytes(const AttentionShape& shape, bool deterministic);

  // Validates the shape and strides (kInvalidArgument naming the field: head_dim a multiple of
  // 8 in [8, 256], seqlen at least 2 and, with a cuDNN before 9.16, a multiple of 128; strides
  // multiples of 8 elements so every row is 16-byte aligned), checks the cuDNN loaded
  // (kFailedPrecondition: 9.0 or newer, not 9.10.0/9.10.1, whose bf16 attention NVIDIA refuses;
  // workspace_bytes() checks the same) and builds the plans on `device` (kFailedPrecondition
  // when cuDNN has no engine for them within the workspace). `workspace`: workspace_bytes(shape,
  // deterministic) bytes of device memory, 256-byte aligned, used as scratch during each call
  // only (nothing in it outlives a call, so it may be shared with other ops on the same stream).
  // `plans` may be null (plans are then built every time and not counted).
  CausalAttentionCudnn(const AttentionShape& shape, int q_stride, int kv_stride, bool deterministic,
                       void* workspace, size_t bytes, int device, GemmPlanCache* plans = nullptr);
  ~CausalAttentionCudnn();
  CausalAttentionCudnn(const CausalAttentionCudnn&) = delete;
  CausalAttentionCudnn& operator=(const CausalAttentionCudnn&) = delete;

  // As CausalAttentionCuda::forward/backward with the strides given at construction. q, k, v,
  // out, dout, dq, dk, dv must be 16-byte aligned (kInvalidArgument otherwise). Asynchronous on
  // `stream` (a cudaStream_t, or null).
  void forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, float* lse,
               void* stream = nullptr) const;
  void backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* out,
                const uint16_t* dout, const float* lse, uint16_t* dq, uint16_t* dk, uint16_t* dv,
                void* stream = nullptr) const;

  const AttentionShape& shape() const { return shape_; }
  bool deterministic() const { return deterministic_; }
  // Which engines run (global index, workspace) and whether each plan came from the cache.
  std::string describe() const;

 private:
  struct Plans;
  AttentionShape shape_;
  bool deterministic_ = true;
  std::unique_ptr<Plans> plans_;
};

}  // namespace megacpp::cuda
