#pragma once
// Token embedding: out[row] = table[token[row]]. Backward scatters into the table.
#include <cstdint>
#include <cstring>

namespace megacpp::cpu {

template <typename T>
void embedding_forward(int rows, int dim, const int32_t* tokens, const T* table, T* out) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    std::memcpy(out + static_cast<int64_t>(r) * dim, table + static_cast<int64_t>(tokens[r]) * dim,
                sizeof(T) * static_cast<size_t>(dim));
  }
}

// Accumulates into dtable. Rows that share a token are summed in row order (for
// determinism the parallel split is over the embedding's columns, not its rows).
template <typename T>
void embedding_backward(int rows, int dim, const int32_t* tokens, const T* dout, T* dtable) {
  constexpr int kColumnBlock = 64;
  const int blocks = (dim + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < blocks; ++blk) {
    const int c0 = blk * kColumnBlock;
    const int c1 = c0 + kColumnBlock < dim ? c0 + kColumnBlock : dim;
    for (int r = 0; r < rows; ++r) {
      T* dst = dtable + static_cast<int64_t>(tokens[r]) * dim;
      const T* src = dout + static_cast<int64_t>(r) * dim;
      for (int c = c0; c < c1; ++c) dst[c] += src[c];
    }
  }
}

}  // namespace megacpp::cpu
