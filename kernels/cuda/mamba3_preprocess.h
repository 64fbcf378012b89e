#pragma once
// The Mamba-3 mixer's preprocessing on a CUDA GPU: steps 1-2 of the mixer in
// shared/spec/model.md, the same function as kernels/cpu/mamba3_preprocess.h, forward and
// backward. It turns in_proj's output into the inputs of the CUDA scan
// (kernels/cuda/mamba3_scan.h) and maps the scan's gradients back onto in_proj's output.
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it.
// Per-token tensors are bf16 passed as uint16_t bit patterns, row-major, in the layouts of
// kernels/contracts/mamba3_scan.h (rows = batch · seqlen); the parameters and their gradients are
// fp32. Arithmetic is fp32.
//
//   forward   one warp per row: z, x, trap and angles are copied out of the row, A, DT and
//             ADT computed per head, and every (r, g) vector of B and C normalized in turn
//             (a butterfly sum, so the order is fixed); the norm scales (rstd) stay in the
//             workspace for backward().
//   backward  one block per tile of rows, one warp per row at a time: dproj; each warp keeps
//             its rows' share of the dt_bias and norm-weight gradients in shared memory, so
//             the tile's partial is a fixed-order sum; a second kernel sums the tiles'
//             partials in a fixed order. No floating-point atomics: results are bitwise
//             reproducible. (A row's work is a short chain of loads, reductions and stores:
//             a block per row, or a block walking its rows one by one, kept the GPU waiting
//             on those chains where the heads are few, as in a tensor-parallel share.)
#include <cstddef>
#include <cstdint>

#include "kernels/contracts/mamba3_preprocess.h"

namespace megacpp::cuda {

// Device pointers to the fp32 parameters the preprocessing reads.
struct PreprocessDeviceParams {
  const float* dt_bias = nullptr;        // [H]
  const float* b_norm_weight = nullptr;  // [N]
  const float* c_norm_weight = nullptr;  // [N]
};

// The scan's per-token inputs (bf16), as ScanDeviceInputs names them: forward() overwrites
// them. angles may be null when the shape has none.
struct PreprocessDeviceOutputs {
  uint16_t* z = nullptr;       // [rows, H·P]
  uint16_t* x = nullptr;       // [rows, H·P]   the scan's v
  uint16_t* k = nullptr;       // [rows, R·G·N] normalized B
  uint16_t* q = nullptr;       // [rows, R·G·N] normalized C
  uint16_t* adt = nullptr;     // [rows, H]
  uint16_t* dt = nullptr;      // [rows, H]
  uint16_t* trap = nullptr;    // [rows, H]
  uint16_t* angles = nullptr;  // [rows, A_n]
};

// The gradients of those tensors, bf16, as Mamba3ScanCuda::backward writes them into
// ScanDeviceGrads (z, v → x, k, q, adt, dt, trap, angles).
struct PreprocessDeviceGrads {
  const uint16_t* z = nullptr;
  const uint16_t* x = nullptr;
  const uint16_t* k = nullptr;
  const uint16_t* q = nullptr;
  const uint16_t* adt = nullptr;
  const uint16_t* dt = nullptr;
  const uint16_t* trap = nullptr;
  const uint16_t* angles = nullptr;
};

// The fp32 parameter gradients; backward() overwrites them (like the scan, it does not
// accumulate into them).
struct PreprocessDeviceParamGrads {
  float* dt_bias = nullptr;        // [H]
  float* b_norm_weight = nullptr;  // [N]
  float* c_norm_weight = nullptr;  // [N]
};

class Mamba3PreprocessCuda {
 public:
  // Rows of one backward tile: the number of per-tile partials is ceil(rows / this).
  static constexpr int kRowsPerTile = 32;
  // The widest shapes the kernels take: the backward's shared memory, sized by the shape, is
  // at most 96 KB there (a GPU that allows less a block refuses such shapes).
  static constexpr int kMaxState = 512;
  static constexpr int kMaxHeads = 2048;

  // Validates the shape (throws megacpp::Error kInvalidArgument naming the field and value
  // otherwise), then allocates the device workspace once: the norm scales [rows, 2·R·G]
  // and the backward tiles' partials.
  // proj_stride: elements from one of proj's rows to the next, 0 for columns() (dense); more
  // where in_proj's rows are padded (dproj stays dense).
  explicit Mamba3PreprocessCuda(const ops::Mamba3PreprocessShape& shape, int proj_stride = 0);
  // The bytes the constructor allocates for `shape` (throws like it on a bad shape).
  static size_t workspace_bytes(const ops::Mamba3PreprocessShape& shape);
  ~Mamba3PreprocessCuda();
  Mamba3PreprocessCuda(const Mamba3PreprocessCuda&) = delete;
  Mamba3PreprocessCuda& operator=(const Mamba3PreprocessCuda&) = delete;

  // proj: in_proj's output [rows, columns()] bf16, rows proj_stride apart. Keeps the norm scales
  // for backward(). out.z and out.x both null: they are not copied out (a scan reading them in
  // place in proj, with ScanDeviceInputs::zv_row_stride = proj_stride). stream: a cudaStream_t, or
  // null for the default stream. Asynchronous.
  void forward(const uint16_t* proj, const PreprocessDeviceParams& params,
               const PreprocessDeviceOutputs& out, void* stream = nullptr);
  // Needs a forward() on the same proj and params first (throws kFailedPrecondition
  // otherwise). dproj [rows, columns()] bf16 is overwritten, every column of it.
  void backward(const uint16_t* proj, const PreprocessDeviceParams& params,
                const PreprocessDeviceGrads& grads, uint16_t* dproj,
                const PreprocessDeviceParamGrads& param_grads, void* stream = nullptr);

  const ops::Mamba3PreprocessShape& shape() const { return shape_; }
  // Device pointer to the norm scales forward() saved, fp32 [rows, 2·R·G]: per row the B
  // vectors' then the C vectors' 1/sqrt(mean(v²) + eps), as cpu::mamba3_preprocess_forward
  // lays out its bc_rstd.
  const float* bc_rstd() const { return rstd_; }
  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  ops::Mamba3PreprocessShape shape_;
  int proj_stride_ = 0;
  bool has_forward_ = false;
  int device_ = 0;
  void* arena_ = nullptr;
  size_t workspace_bytes_ = 0;
  float* rstd_ = nullptr;
  float* partials_ = nullptr;  // [tiles, H + 2·N]
};

}  // namespace megacpp::cuda
