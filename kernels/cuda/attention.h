#pragma once
// Causal grouped-query softmax attention on a CUDA GPU: the function of kernels/cpu/attention.h,
//   out[t, h] = Σ_{s ≤ t} softmax_s(scale · q[t, h] · k[s, g(h)]) v[s, g(h)],  g(h) = h / (Hq/Hkv),
// forward and backward, in the mixed precision of the training step: q, k, v, out and the
// gradients are bf16, the scores, the softmax and every accumulation are fp32.
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it. Pointers
// are device pointers owned by the caller; bf16 tensors are uint16_t bit patterns. Layouts are
// the CPU op's:
//   q        head h of token (b, t) at q + (b·seqlen + t)·q_stride + h·head_dim
//   k, v     head g at k + (b·seqlen + t)·kv_stride + g·head_dim
//   out      [batch, seqlen, q_heads·head_dim] contiguous; dout likewise
//   lse      fp32 [batch, q_heads, seqlen]: each row's natural log-sum-exp of its scaled scores
//   dq/dk/dv the strides and offsets of q/k/v
// so q, k, v (and dq, dk, dv) may be views into one packed qkv row of width
// (q_heads + 2·kv_heads)·head_dim: pass that width as both strides and offset the pointers.
//
// Flash-attention-2 style: no [seqlen, seqlen] matrix is ever stored. Blocks of 4 warps, each warp
// owning tiles of 16 rows; the products run on the tensor cores (mma.sync m16n8k16, bf16 operands,
// fp32 accumulation; the accumulator layout is the PTX-documented one, so the softmax works on the
// products in registers), their operands fetched from shared memory by ldmatrix, and the next
// tile's copy into shared memory runs asynchronously (cp.async) while the current one is computed
// on. Needs compute capability 8.0 or newer. head_dim a multiple of 16 (the depth of one mma) in
// [16, 128], each with its own instantiation of the kernels; others are refused.
//   forward   one block per (batch, q head, tile of query rows: 128, two tiles a warp, up to
//             head_dim 64; 64 above), walking the key tiles up to the diagonal with an online max
//             and sum; saves lse.
//   backward  first D = rowsum(dout ⊙ out) (fp32, into the workspace); then one block per
//             (batch, kv head, tile of 64 keys) that walks the group's q heads and the query
//             tiles at or after its keys in a fixed order, holding dK and dV in registers; then
//             one block per (batch, q head, query tile) that walks the key tiles for dQ. Both
//             recompute the probabilities from q, k and lse. No atomics: every sum is in a fixed
//             order, so results are bitwise reproducible.
#include <cstddef>
#include <cstdint>

namespace megacpp::cuda {

struct AttentionShape {
  int batch = 0;
  int seqlen = 0;
  int q_heads = 0;             // Hq
  int kv_heads = 0;            // Hkv, divides Hq
  int head_dim = 0;            // a multiple of 16 in [16, 128]
  double softmax_scale = 0.0;  // the spec's default is 1 / sqrt(head_dim)
};

// The rules every attention op of this backend holds a shape to: positive sizes, kv_heads
// dividing q_heads, a positive finite softmax_scale. Throws Error(kInvalidArgument) naming `op`,
// the field and its value. Each op adds its own (the head_dims it has kernels for).
void validate_attention_shape(const AttentionShape& shape, const char* op);

class CausalAttentionCuda {
 public:
  // Device memory backward() needs: D = rowsum(dout ⊙ out), fp32 [batch, q_heads, seqlen].
  // Throws megacpp::Error on a bad shape.
  static size_t workspace_bytes(const AttentionShape& shape);

  // Validates the shape (kInvalidArgument naming the field otherwise) and takes `workspace`,
  // workspace_bytes(shape) bytes of device memory that stays the op's while it lives (forward()
  // does not use it: a forward-only user may pass null and 0). Refuses a device below compute
  // capability 8.0, and one whose shared memory per block is less than the kernels of this
  // head_dim need (head_dim 128 needs about 102 KiB: not on compute capability 8.6 and 8.9)
  // (kFailedPrecondition).
  CausalAttentionCuda(const AttentionShape& shape, void* workspace, size_t bytes);

  // out and lse as in the layouts above; lse is what backward() needs besides the inputs.
  // Strides are in elements: q_stride ≥ q_heads·head_dim, kv_stride ≥ kv_heads·head_dim.
  // stream: a cudaStream_t, or null. Asynchronous.
  void forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, int q_stride, int kv_stride,
               uint16_t* out, float* lse, void* stream = nullptr) const;

  // out and lse: forward()'s for the same q, k, v. Overwrites dq, dk, dv (no need to clear them),
  // which must not overlap q, k, v or each other. Asynchronous.
  void backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, int q_stride,
                int kv_stride, const uint16_t* out, const uint16_t* dout, const float* lse,
                uint16_t* dq, uint16_t* dk, uint16_t* dv, void* stream = nullptr) const;

  const AttentionShape& shape() const { return shape_; }

 private:
  AttentionShape shape_;
  int device_ = 0;
  float* delta_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace megacpp::cuda
