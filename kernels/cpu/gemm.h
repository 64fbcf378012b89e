#pragma once
// Row-major GEMM through OpenBLAS, for float (the CPU backend) and double (the
// test oracle). C[M,N] = alpha * op(A) * op(B) + beta * C, where op(X) is X or
// its transpose. Leading dimensions are the row strides of the stored matrices.
//
// Threading: OpenBLAS runs single-threaded and we split large products across
// the OpenMP threads ourselves. OpenBLAS's own thread pool would otherwise fight
// the OpenMP loops that call small GEMMs (the scan's per-head products), and each
// output element is still computed by exactly one thread, so results do not
// depend on scheduling.
#include <cblas.h>
#include <omp.h>

#include <mutex>

namespace megacpp::cpu {

namespace detail {
inline void blas_single_threaded() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}
inline void blas_gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                      const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void blas_gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda,
                      const double* b, int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, alpha, a, lda, b, ldb, beta, c, ldc);
}
}  // namespace detail

template <typename T>
void gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda, const T* b,
          int ldb, T beta, T* c, int ldc) {
  detail::blas_single_threaded();
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const double flops = 2.0 * m * n * k;
  if (threads <= 1 || flops < 4e6) {
    detail::blas_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // Split the larger of M and N into one contiguous slab per thread.
  const bool split_rows = m >= n;
  const int extent = split_rows ? m : n;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int begin = static_cast<int>(static_cast<long>(extent) * t / nt);
    const int end = static_cast<int>(static_cast<long>(extent) * (t + 1) / nt);
    if (end > begin) {
      if (split_rows) {
        const T* a_slab = trans_a ? a + begin : a + static_cast<long>(begin) * lda;
        detail::blas_gemm(trans_a, trans_b, end - begin, n, k, alpha, a_slab, lda, b, ldb, beta,
                          c + static_cast<long>(begin) * ldc, ldc);
      } else {
        const T* b_slab = trans_b ? b + static_cast<long>(begin) * ldb : b + begin;
        detail::blas_gemm(trans_a, trans_b, m, end - begin, k, alpha, a, lda, b_slab, ldb, beta,
                          c + begin, ldc);
      }
    }
  }
}

// Y[rows, out] = X[rows, in] * W[out, in]^T (+ beta * Y): the Linear layer's product.
template <typename T>
void matmul_xwt(int rows, int in, int out, const T* x, const T* w, T* y, T beta = T(0)) {
  gemm(false, true, rows, out, in, T(1), x, in, w, in, beta, y, out);
}

}  // namespace megacpp::cpu
