#pragma once
// The token embedding on a CUDA GPU: the function of kernels/cpu/embedding.h over the fp32
// master table, into the fp32 residual stream (residual_in_fp32: x₀ = embedding[tokens] is the
// first residual), forward and backward.
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it. All
// pointers are device pointers owned by the caller; tokens are int32 [rows], tables fp32
// [vocab, dim] (vocab = the padded vocabulary: every row of the table), rows fp32 [rows, dim].
//
//   forward   out[row] = table[tokens[row]]: a gather, one block per row.
//   backward  dtable[v] (+)= Σ dout[row] over the rows whose token is v, added in increasing row
//             order, with no atomics. The rows are sorted by token with a stable radix sort
//             (CUB's, whose output depends on the keys alone), so each token's rows form one
//             segment in row order; every vocabulary row is then owned by one block (per column
//             slice) that sums its segment in that order and writes the row once. Rows no token
//             reaches are written too (0, or left as they were when accumulating), so the table
//             need not be cleared first. Bitwise reproducible.
//
// Tokens outside [0, vocab) cannot be refused on the device: forward writes NaN into their rows
// (so the loss shows it), backward skips them. The runtime validates tokens before upload.
#include <cstddef>
#include <cstdint>

namespace megacpp::cuda {

struct EmbeddingShape {
  int rows = 0;   // tokens per call: batch · seqlen
  int dim = 0;    // d_model
  int vocab = 0;  // rows of the table: the padded vocabulary
};

class EmbeddingCuda {
 public:
  // Device memory backward() needs, for this shape: the sort's keys and row ids (in and out),
  // the per-token segment bounds [vocab] and CUB's scratch. Throws megacpp::Error on a bad shape.
  static size_t workspace_bytes(const EmbeddingShape& shape);

  // Validates the shape (kInvalidArgument naming the field otherwise) and takes `workspace`,
  // workspace_bytes(shape) bytes of device memory that stays the op's while it lives (only
  // backward() uses it; forward() does not, so a null workspace with 0 bytes serves a
  // forward-only user).
  EmbeddingCuda(const EmbeddingShape& shape, void* workspace, size_t bytes);

  // out [rows, dim] = table[tokens]. stream: a cudaStream_t, or null. Asynchronous.
  void forward(const int32_t* tokens, const float* table, float* out, void* stream = nullptr) const;

  // dtable [vocab, dim]: every row written; accumulate adds into what it holds (the tied
  // lm_head's gradient, earlier micro-batches), otherwise overwrites it. Asynchronous.
  void backward(const int32_t* tokens, const float* dout, float* dtable, bool accumulate,
                void* stream = nullptr) const;

  const EmbeddingShape& shape() const { return shape_; }

 private:
  EmbeddingShape shape_;
  int device_ = 0;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  size_t sort_temp_bytes_ = 0;  // CUB's share of the workspace, queried once
};

}  // namespace megacpp::cuda
