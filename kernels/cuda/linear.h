#pragma once
// A linear layer on a CUDA GPU through cuBLASLt: the function of kernels/cpu/linear.h,
// y[rows, out] = x[rows, in] · W[out, in]ᵀ + b[out], in the step's mixed precision: x, W and dy
// are bf16 matmul operands, accumulation is fp32, the bias and the weight/bias gradients are fp32
// (they feed the fp32 master weights), y and dx are written in bf16 or fp32 as the caller asks.
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it. All
// pointers are device pointers owned by the caller; matrices are row-major. The GEMM algorithms
// are chosen for 16-byte aligned matrices and bias (less where a row's bytes are not a multiple
// of 16), as cudaMalloc gives them: a less aligned pointer is refused (kInvalidArgument). The
// workspace is 256-byte aligned. One op is driven from one host thread at a time.
//
//   forward   one GEMM, the bias added by the GEMM's epilogue for an fp32 y (cuBLASLt's bias
//             has D's type), by a small kernel after it for a bf16 y.
//   backward  dx = dy · W (one GEMM), dW (+)= dyᵀ · x (one GEMM, beta 1 when accumulating), db
//             (+)= the column sums of dy (fixed-order, no atomics).
// The algorithm of each GEMM is chosen once, in the constructor (or taken from a plan cache), and
// kept: the same call gives the same bits every time (cuBLASLt is deterministic for a fixed
// algorithm and workspace).
#include <cstddef>
#include <cstdint>

namespace megacpp::cuda {

class GemmPlanCache;

struct LinearShape {
  int rows = 0;  // batch · seqlen (or a chunk of it)
  int in = 0;    // input features
  int out = 0;   // output features
  // forward()'s y: elements from one row to the next, 0 for `out` (dense). More leaves columns
  // past `out` in each row unwritten (rows padded to an alignment their readers want).
  int y_stride = 0;
  int y_row_stride() const { return y_stride == 0 ? out : y_stride; }
};

// A [rows, columns] result written either in bf16 or in fp32: exactly one pointer is set.
struct RowsOut {
  uint16_t* bf16 = nullptr;
  float* f32 = nullptr;
};

class LinearCuda {
 public:
  // Device workspace the op needs while it lives: cuBLASLt's GEMM workspace and the bias
  // gradient's partials. Ops that run one after another on one stream may share one workspace
  // (pass the largest of their sizes to each).
  static size_t workspace_bytes(const LinearShape& shape);
  // Validates the shape (kInvalidArgument naming the field otherwise), takes `workspace` and
  // picks the GEMM algorithms for this shape and both output types. With `cache` (the current
  // device's, kept by the caller only while constructing), a cached algorithm that still passes
  // cuBLASLt's check is taken instead of the heuristic's, and each one built is stored and
  // counted (gemm_plan_cache.h); null: the heuristic every time.
  // weight_gradient_sms: the SMs backward_weights' GEMM is planned for
  // (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), for a caller that runs other kernels beside it on
  // another stream (tensor parallelism's collectives): a GEMM planned for every SM holds them all
  // until it ends, and what runs beside it waits. 0: every SM; refused when negative.
  LinearCuda(const LinearShape& shape, void* workspace, size_t bytes,
             GemmPlanCache* cache = nullptr, int weight_gradient_sms = 0);
  ~LinearCuda();
  LinearCuda(const LinearCuda&) = delete;
  LinearCuda& operator=(const LinearCuda&) = delete;

  // y = x · Wᵀ (+ bias; bias may be null). x bf16 [rows, in], weight bf16 [out, in], bias fp32
  // [out], y [rows, out] with rows shape().y_row_stride() apart. stream: a cudaStream_t, or
  // null. Asynchronous.
  void forward(const uint16_t* x, const uint16_t* weight, const float* bias, RowsOut y,
               void* stream = nullptr) const;
  // dy bf16 [rows, out]. dx [rows, in] = dy · W, overwritten (both pointers null: not computed).
  // dweight fp32 [out, in] and dbias fp32 [out] (may be null) add into what they hold when
  // `accumulate`, otherwise are overwritten. Asynchronous.
  void backward(const uint16_t* x, const uint16_t* weight, const uint16_t* dy, RowsOut dx,
                float* dweight, float* dbias, bool accumulate, void* stream = nullptr) const;
  // backward() in its two halves (backward() = backward_input, then backward_weights), for a
  // caller that starts work on dx, such as tensor parallelism's all-reduce, while the weight
  // gradients are computed.
  void backward_input(const uint16_t* weight, const uint16_t* dy, RowsOut dx,
                      void* stream = nullptr) const;
  void backward_weights(const uint16_t* x, const uint16_t* dy, float* dweight, float* dbias,
                        bool accumulate, void* stream = nullptr) const;

  const LinearShape& shape() const { return shape_; }

 private:
  struct Plans;
  LinearShape shape_;
  int device_ = 0;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  Plans* plans_ = nullptr;
};

}  // namespace megacpp::cuda
