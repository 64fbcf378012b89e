#pragma once
// The base every CUDA op's .cu file includes: bf16 conversion, fixed-order reductions and the
// block-wide matrix products (CUDA cores and tensor cores), plus check.h for the host side.
//
// Each .cu file is compiled on its own, without relocatable device code, so every device function
// here is static (internal linkage, as if written in the including file's unnamed namespace):
// each file gets its own copy and nothing has to be linked across files.
//
// Every reduction here adds in an order fixed by the launch shape alone, never by timing, so the
// ops that use them are bitwise reproducible.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/check.h"

namespace megacpp::cuda {

using bf16 = __nv_bfloat16;

// A kernel as the runtime's attribute, occupancy and launch calls take it.
template <class Kernel>
const void* kernel_address(Kernel* kernel) {
  return reinterpret_cast<const void*>(kernel);
}

static __device__ __forceinline__ float to_f(bf16 x) {
  return __bfloat162float(x);
}

// A butterfly sum: every lane ends with the same bits (each step adds a pair in both orders, and
// addition commutes exactly), so no broadcast is needed.
static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Block-wide sum of one float per thread, added by thread 0 in thread order; `scratch` holds
// blockDim.x floats of shared memory. Every thread gets the total. Holds three barriers: call it
// from every thread of the block.
static __device__ float block_sum(float value, float* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0) {
    for (int i = 0; i < static_cast<int>(blockDim.x); ++i) total += scratch[i];
    scratch[0] = total;
  }
  __syncthreads();
  total = scratch[0];
  __syncthreads();
  return total;
}

// C = A·B over a block: every thread owns 4×4 output tiles and sums over k in a fixed
// order (deterministic). a(i, k), b(k, j) read operands; out(i, j, value) stores.
// M and N are multiples of 4.
template <class FA, class FB, class FOut>
static __device__ void block_gemm(int m, int n, int k, FA a, FB b, FOut out) {
  const int tiles_n = n / 4;
  const int tiles = (m / 4) * tiles_n;
  for (int tile = threadIdx.x; tile < tiles; tile += blockDim.x) {
    const int i0 = (tile / tiles_n) * 4, j0 = (tile % tiles_n) * 4;
    float acc[4][4];
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
      for (int y = 0; y < 4; ++y) acc[x][y] = 0.f;
    for (int kk = 0; kk < k; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        av[x] = a(i0 + x, kk);
        bv[x] = b(kk, j0 + x);
      }
#pragma unroll
      for (int x = 0; x < 4; ++x)
#pragma unroll
        for (int y = 0; y < 4; ++y) acc[x][y] = fmaf(av[x], bv[y], acc[x][y]);
    }
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
      for (int y = 0; y < 4; ++y) out(i0 + x, j0 + y, acc[x][y]);
  }
}

// Two floats rounded to bf16 (round to nearest even), packed lo | hi << 16: an mma.sync operand
// register. A template so that the passes that compile no mma (host, sm < 80) do not see an
// unused function.
template <typename F = float>
static __device__ __forceinline__ uint32_t pack_bf16(F lo, F hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// The same contract as block_gemm on the tensor cores: operands are rounded to bf16,
// products accumulate in fp32 (mma.sync m16n8k16). Every warp owns 16×16 output tiles
// and walks k in a fixed order (deterministic). M, N and K are multiples of 16.
// Below sm_80 (no bf16 mma) it is block_gemm.
template <class FA, class FB, class FOut>
static __device__ void block_mma(int m, int n, int k, FA a, FB b, FOut out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int tiles_n = n / 16;
  const int tiles = (m / 16) * tiles_n;
  for (int tile = warp; tile < tiles; tile += warps) {
    const int i0 = (tile / tiles_n) * 16, j0 = (tile % tiles_n) * 16;
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    for (int k0 = 0; k0 < k; k0 += 16) {
      const int ka = k0 + 2 * t;
      uint32_t af[4];
      af[0] = pack_bf16(a(i0 + g, ka), a(i0 + g, ka + 1));
      af[1] = pack_bf16(a(i0 + g + 8, ka), a(i0 + g + 8, ka + 1));
      af[2] = pack_bf16(a(i0 + g, ka + 8), a(i0 + g, ka + 9));
      af[3] = pack_bf16(a(i0 + g + 8, ka + 8), a(i0 + g + 8, ka + 9));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = j0 + half * 8 + g;
        const uint32_t b0 = pack_bf16(b(ka, col), b(ka + 1, col));
        const uint32_t b1 = pack_bf16(b(ka + 8, col), b(ka + 9, col));
        float* c = acc[half];
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(af[0]), "r"(af[1]), "r"(af[2]), "r"(af[3]), "r"(b0), "r"(b1));
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = j0 + half * 8 + 2 * t;
      out(i0 + g, col, acc[half][0]);
      out(i0 + g, col + 1, acc[half][1]);
      out(i0 + g + 8, col, acc[half][2]);
      out(i0 + g + 8, col + 1, acc[half][3]);
    }
  }
#else
  block_gemm(m, n, k, a, b, out);
#endif
}

// block_mma when kTensor, else block_gemm: one kernel template serves both math variants.
template <bool kTensor, class FA, class FB, class FOut>
static __device__ __forceinline__ void gemm(int m, int n, int k, FA a, FB b, FOut out) {
  if constexpr (kTensor) {
    block_mma(m, n, k, a, b, out);
  } else {
    block_gemm(m, n, k, a, b, out);
  }
}

}  // namespace megacpp::cuda
