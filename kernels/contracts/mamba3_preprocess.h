#pragma once
// The contract of the Mamba-3 mixer's preprocessing (steps 1-2 of shared/spec/model.md): the
// split of in_proj's output and the buffers it fills, which are the scan's inputs
// (kernels/contracts/mamba3_scan.h). Implemented by kernels/cpu/mamba3_preprocess.h and
// kernels/cuda/mamba3_preprocess.h. No OpenMP, no CUDA.

#include "kernels/contracts/mamba3_scan.h"

namespace megacpp::ops {

struct Mamba3PreprocessShape {
  int rows = 0;     // batch · seqlen
  int heads = 0;    // H
  int headdim = 0;  // P
  int state = 0;    // N
  int groups = 0;   // G
  int rank = 0;     // R
  int angles = 0;   // A_n
  double a_floor = 1e-4;
  double norm_eps = 1e-5;

  int d_inner() const { return heads * headdim; }
  int bc_width() const { return state * groups * rank; }
  // in_proj output columns, in split order: z, x, B, C, dd_dt, dd_A, trap, angles.
  int columns() const { return 2 * d_inner() + 2 * bc_width() + 3 * heads + angles; }
  int col_x() const { return d_inner(); }
  int col_b() const { return 2 * d_inner(); }
  int col_c() const { return col_b() + bc_width(); }
  int col_dd_dt() const { return col_c() + bc_width(); }
  int col_dd_a() const { return col_dd_dt() + heads; }
  int col_trap() const { return col_dd_a() + heads; }
  int col_angles() const { return col_trap() + heads; }

  // The shape of the scan this preprocessing feeds: rows = batch · seqlen tokens in chunks of
  // `chunk`.
  ScanShape scan_shape(int batch, int seqlen, int chunk) const {
    ScanShape s;
    s.batch = batch;
    s.seqlen = seqlen;
    s.heads = heads;
    s.groups = groups;
    s.state = state;
    s.headdim = headdim;
    s.rank = rank;
    s.chunk = chunk;
    s.angles = angles;
    return s;
  }
};

template <typename T>
struct Mamba3ScanBuffers {  // contiguous scan inputs produced by the preprocessing
  T* z;                     // [rows, H·P]
  T* x;                     // [rows, H·P]
  T* k;                     // [rows, R·G·N] normalized B
  T* q;                     // [rows, R·G·N] normalized C
  T* adt;                   // [rows, H]
  T* dt;                    // [rows, H]
  T* trap;                  // [rows, H]
  T* angles;                // [rows, A_n]
};

}  // namespace megacpp::ops
