#pragma once
// RMSNorm fused with the residual add on a CUDA GPU: the function of kernels/cpu/rmsnorm.h
// (residual_rmsnorm_forward / _backward) in the mixed precision of the training step: the residual
// stream and the norm weight are fp32 (residual_in_fp32, fp32 master weights), the normalized
// output is bf16 because it is the next matmul's operand, statistics and arithmetic are fp32.
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it. Pointers
// are device pointers owned by the caller; bf16 tensors are uint16_t bit patterns; [rows, dim]
// row-major.
//
//   forward   one block per row: residual_out = residual_in + delta, the sum of squares by a
//             fixed-order block reduction, rstd = 1/sqrt(mean + eps), y = x·rstd·weight.
//   backward  one block per tile of rows: dx row by row (each row's Σ dy·w·x by a fixed-order
//             block reduction), while each thread adds its columns' dy·x·rstd over the tile's
//             rows in order into the tile's dweight partial; a second kernel sums the partials
//             in a fixed order into dweight (kReduceGroups interleaved groups of tiles, then the
//             groups). A tile is up to kMaxRowsPerTile rows, fewer where the rows are few, so
//             that about kTargetTiles blocks keep every SM busy: a block's rows run one after
//             another, so a block's time is its rows' latency, whatever the grid. No atomics:
//             bitwise reproducible.
#include <cstddef>
#include <cstdint>

namespace megacpp::cuda {

struct RmsNormShape {
  int rows = 0;  // batch · seqlen
  int dim = 0;   // d_model
  double eps = 1e-5;
};

// A [rows, dim] activation given either in bf16 (a matmul's output) or in fp32: at most one of
// the two pointers is set.
struct RowsRef {
  const uint16_t* bf16 = nullptr;
  const float* f32 = nullptr;
};

class ResidualRmsNormCuda {
 public:
  static constexpr int kMaxRowsPerTile = 32;
  static constexpr int kTargetTiles = 1024;
  static constexpr int kReduceGroups = 8;
  // The widest row: backward keeps a tile's dweight partial [dim] in shared memory.
  static constexpr int kMaxDim = 8192;

  // Device memory backward() needs: the tiles' dweight partials, fp32 [tiles, dim].
  static size_t workspace_bytes(const RmsNormShape& shape);

  // Validates the shape (kInvalidArgument naming the field otherwise) and takes `workspace`,
  // workspace_bytes(shape) bytes of device memory that stays the op's while it lives (forward()
  // does not use it: a forward-only user may pass null and 0).
  ResidualRmsNormCuda(const RmsNormShape& shape, void* workspace, size_t bytes);

  // residual_out = residual_in + delta (delta may be empty: residual_out = residual_in);
  // residual_out may be residual_in (in place). y [rows, dim] bf16 = rmsnorm(residual_out)·weight,
  // rstd [rows] fp32 = 1/sqrt(mean(residual_out²) + eps), kept for backward. Asynchronous.
  void forward(const float* residual_in, RowsRef delta, const float* weight, float* residual_out,
               uint16_t* y, float* rstd, void* stream = nullptr) const;

  // x: forward's residual_out; rstd: forward's. dy: the gradient of y (exactly one pointer set).
  // dx [rows, dim] fp32 = d(norm)/dx·dy + residual_grad (the gradient flowing along the residual
  // stream; null for none); dx may be residual_grad (in place). dweight [dim] fp32: accumulate
  // adds into it, otherwise overwrites it. Asynchronous.
  void backward(const float* x, const float* weight, const float* rstd, RowsRef dy,
                const float* residual_grad, float* dx, float* dweight, bool accumulate,
                void* stream = nullptr) const;

  const RmsNormShape& shape() const { return shape_; }

 private:
  RmsNormShape shape_;
  int device_ = 0;
  float* partials_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace megacpp::cuda
