#pragma once
// The language-model head fused with the mean cross entropy on a CUDA GPU: the function of
// kernels/cpu/linear.h (logits = h · Wᵀ, no bias) followed by kernels/cpu/cross_entropy.h, and
// their backward, without ever holding the full logits [rows, vocab_padded] in fp32: at the
// 50304-token vocabulary and 8192 rows those alone would be 1.6 GiB, plus their gradient.
//
// The convention is the CPU op's: the softmax runs over all vocab_padded columns (the padded rows
// of the lm_head weight are parameters and get gradients); a row whose target is negative is
// ignored (no loss, zero gradient); the loss is the mean over the rows not ignored, 0 when none
// are; the gradients are grad_scale · d(mean loss). The CPU op refuses a target >= vocab_size;
// the device cannot refuse, so such a target (also one >= vocab_padded) is treated as ignored,
// like a negative one. The runtime validates targets on the host before upload.
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it. All
// pointers are device pointers owned by the caller; bf16 tensors are uint16_t bit patterns;
// matrices are row-major.
//
// Structure, per call (all on one stream, no host synchronization, no atomics):
//   1. one block counts the rows not ignored (kept in the workspace: the gradient of every row
//      needs it before any chunk runs);
//   2. the rows go in chunks of chunk_rows. Per chunk: logits fp32 [chunk, vocab_padded] =
//      h_chunk · Wᵀ (LinearCuda::forward, cuBLASLt); one block per row makes the row's max and
//      Σ exp(logit − max) (an online softmax per thread, then fixed-order block reductions),
//      its loss lse − logit[target], and (forward_backward) dlogits bf16 =
//      (softmax − onehot) · grad_scale / count; then dh_chunk = dlogits · W and
//      dweight += dlogitsᵀ · h_chunk (LinearCuda::backward, accumulating);
//   3. one block sums the per-row losses in row order (in double) and divides by the count.
// The GEMMs' algorithms are fixed at construction and every reduction has a fixed order, so two
// calls give the same bits. The chunking does change dweight's float order (one accumulation per
// chunk), so different chunk_rows give close but not identical dweights. The calls of one op
// share its workspace (logits, per-row losses, count): order them on one stream, or synchronize
// between them.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/cuda/linear.h"

namespace megacpp::cuda {

struct LmHeadLossShape {
  int rows = 0;          // batch · seqlen, or this op's share of them (first_row below)
  int dim = 0;           // d_model
  int vocab_padded = 0;  // rows of the lm_head weight: the softmax's columns
  int vocab_size = 0;    // the real vocabulary: targets at or above it are ignored
  // Rows per chunk; 0 picks the largest multiple of 128 (or all rows, or at least 1) whose fp32
  // logits take at most kChunkLogitsBytes. Larger than rows: all rows in one chunk.
  int chunk_rows = 0;
  // A share of a larger batch (sequence parallelism: each tensor-parallel rank takes its rows):
  // the op's rows are rows [first_row, first_row + rows) of a batch of total_rows. targets holds
  // the whole batch's total_rows entries, h and dh the op's rows only; the mean's denominator is
  // the whole batch's count, so loss is the op's share of the batch's mean (the shares of all the
  // batch's rows sum to it) and valid_rows the batch's count. total_rows 0: the op's rows are the
  // whole batch.
  int first_row = 0;
  int total_rows = 0;
  int batch_rows() const { return total_rows == 0 ? rows : total_rows; }
};

class LmHeadLossCuda {
 public:
  // The bound on one chunk's fp32 logits when chunk_rows is picked: 256 MiB (1334 rows of the
  // 50304-token vocabulary, rounded down to 1280). Its bf16 gradient takes half as much again.
  static constexpr size_t kChunkLogitsBytes = size_t{256} << 20;

  // Device memory the op needs while it lives: one chunk's fp32 logits and bf16 dlogits, the
  // per-row losses fp32 [rows], the valid-row count, and the LinearCuda workspace of the chunk
  // GEMMs. Throws megacpp::Error (kInvalidArgument) on a bad shape.
  static size_t workspace_bytes(const LmHeadLossShape& shape);

  // Validates the shape (kInvalidArgument naming the field otherwise), takes `workspace`, at
  // least workspace_bytes(shape) bytes, 256-byte aligned (refused otherwise; cudaMalloc's are),
  // that stays the op's while it lives, and builds the chunk GEMMs (their
  // algorithms are picked here, once, through `cache` when given: linear.h).
  LmHeadLossCuda(const LmHeadLossShape& shape, void* workspace, size_t bytes,
                 GemmPlanCache* cache = nullptr);
  ~LmHeadLossCuda();
  LmHeadLossCuda(const LmHeadLossCuda&) = delete;
  LmHeadLossCuda& operator=(const LmHeadLossCuda&) = delete;

  // The mean loss alone (evaluation). h bf16 [rows, dim], weight bf16 [vocab_padded, dim],
  // targets int32 [batch_rows()]. loss fp32 [1]: the mean over the counted rows (0 when none);
  // for a share of a batch, this share's part of the batch's mean.
  // valid_rows int32 [1] (may be null): how many rows were counted, so that a caller can weight
  // means of several calls. stream: a cudaStream_t, or null. Asynchronous.
  void forward(const uint16_t* h, const uint16_t* weight, const int32_t* targets, float* loss,
               int32_t* valid_rows, void* stream = nullptr) const;

  // The mean loss (and count) as forward(), and the gradients of grad_scale · (mean loss):
  // dh bf16 [rows, dim] overwritten; dweight fp32 [vocab_padded, dim] always accumulated into
  // (earlier micro-batches; a tied embedding's gradient is added to it afterwards or before).
  // Asynchronous.
  void forward_backward(const uint16_t* h, const uint16_t* weight, const int32_t* targets,
                        float grad_scale, float* loss, int32_t* valid_rows, uint16_t* dh,
                        float* dweight, void* stream = nullptr) const;

  const LmHeadLossShape& shape() const { return shape_; }
  // The rows per chunk in use (shape().chunk_rows, or the one picked, at most rows).
  int chunk_rows() const { return chunk_rows_; }

 private:
  void run(const uint16_t* h, const uint16_t* weight, const int32_t* targets, float grad_scale,
           float* loss, int32_t* valid_rows, uint16_t* dh, float* dweight, void* stream) const;

  LmHeadLossShape shape_;
  int chunk_rows_ = 0;
  int device_ = 0;
  // The workspace's parts (see workspace_bytes).
  float* logits_ = nullptr;
  uint16_t* dlogits_ = nullptr;
  float* row_loss_ = nullptr;
  int32_t* count_ = nullptr;
  // The GEMMs of a full chunk, and of the last, shorter one (null when chunk_rows divides rows).
  std::unique_ptr<LinearCuda> full_;
  std::unique_ptr<LinearCuda> tail_;
};

}  // namespace megacpp::cuda
