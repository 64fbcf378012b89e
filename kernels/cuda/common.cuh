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

// The 32-bit shared-memory address that PTX's .shared operands take.
static __device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Asynchronous copies into shared memory (cp.async, sm_80 and later), 16 bytes each: a kernel
// starts a copy, computes, and waits for it (wait_copies, then a barrier) only where it needs the
// data. A source size of 0 (valid false) reads nothing and fills the 16 bytes with zeros.
static __device__ __forceinline__ void copy_16_async(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
               "l"(src), "r"(valid ? 16 : 0));
#else
  (void)dst, (void)src, (void)valid;
#endif
}

// copy_16_async's four-byte form, for rows that are not 16-byte aligned: cp.async on sm_80 and
// newer; before that a plain load and store (the same data, visible to the copying thread at
// once, as wait_copies makes it on sm_80).
static __device__ __forceinline__ void copy_4_async(float* dst, const float* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(shared_address(dst)), "l"(src));
#else
  *dst = *src;
#endif
}

// Closes the group of copies started since the last call.
static __device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most kPending of this thread's committed groups are still in flight. Other
// threads' copies are visible after the barrier that follows.
template <int kPending>
static __device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

// The tensor memory accelerator (TMA, sm_90 and newer): one thread starts a copy of a whole tile
// (a box of a tensor map, cuTensorMapEncodeTiled, or a contiguous run of bytes) into shared
// memory, and the bytes land on an mbarrier there: the issuing thread arrives with the bytes its
// copies will bring (mbarrier_expect_bytes, before them), and a waiter sees the phase complete
// once every arrival is in and every byte has landed. Box elements past the tensor's bounds land
// as zeros. Built for an older architecture these trap (the proxy fence is then nothing): their
// callers run only where the kernel runs as built for sm_90 (its cudaFuncAttributes::ptxVersion).
static __device__ __forceinline__ void mbarrier_init(uint64_t* barrier, unsigned arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)),
               "r"(arrivals)
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  (void)barrier, (void)arrivals;
  __trap();
#endif
}
static __device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* barrier, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)),
      "r"(bytes)
      : "memory");
#else
  (void)barrier, (void)bytes;
  __trap();
#endif
}
// Orders this thread's earlier accesses of shared memory before what the async proxy does with it
// next: the tensor memory accelerator's copies into it, wgmma's reads of it.
static __device__ __forceinline__ void fence_shared_for_async_proxy() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// `bytes` (a multiple of 16; both ends 16-byte aligned) from `src` to `dst`.
static __device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src,
                                                           unsigned bytes, uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(barrier))
      : "memory");
#else
  (void)dst, (void)src, (void)bytes, (void)barrier;
  __trap();
#endif
}
// The box of `map` (a __grid_constant__ kernel parameter) at `at` (its coordinates, innermost
// first; as many as the map has dimensions: 2, 4 or 5) to `dst`, in the box's order: dense, or with
// the map's swizzle applied to each row's 16-byte chunks. `dst` 128-byte aligned, 1024-byte for the
// 128-byte swizzle (whose pattern the unit takes from the address's bits 7-9).
template <int kDims>
static __device__ __forceinline__ void tile_copy_to_shared(void* dst, const void* map,
                                                           const int (&at)[kDims],
                                                           uint64_t* barrier) {
  static_assert(kDims >= 2 && kDims <= 5);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const auto m = reinterpret_cast<uint64_t>(map);
  const unsigned to = shared_address(dst), bar = shared_address(barrier);
  if constexpr (kDims == 2) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(to),
        "l"(m), "r"(at[0]), "r"(at[1]), "r"(bar)
        : "memory");
  } else if constexpr (kDims == 4) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(to),
        "l"(m), "r"(at[0]), "r"(at[1]), "r"(at[2]), "r"(at[3]), "r"(bar)
        : "memory");
  } else {
    static_assert(kDims == 5, "2, 4 or 5 dimensions");
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(to),
        "l"(m), "r"(at[0]), "r"(at[1]), "r"(at[2]), "r"(at[3]), "r"(at[4]), "r"(bar)
        : "memory");
  }
#else
  (void)dst, (void)map, (void)at, (void)barrier;
  __trap();
#endif
}
// Waits until the barrier's phase of parity `parity` is complete.
static __device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned done = 0;
  do {
    asm volatile(
        "{\n.reg .pred complete;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        "selp.u32 %0, 1, 0, complete;\n}\n"
        : "=r"(done)
        : "r"(shared_address(barrier)), "r"(parity)
        : "memory");
  } while (done == 0);
#else
  (void)barrier, (void)parity;
  __trap();
#endif
}

// A butterfly sum: every lane ends with the same bits (each step adds a pair in both orders, and
// addition commutes exactly), so no broadcast is needed.
static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Division of non-negative ints below 2^31 by a divisor fixed per launch, as a multiply-high and
// a shift (Granlund and Montgomery): index arithmetic by runtime shape values (rank, head
// dimension, ...) sits inside the scan's innermost operand loads, where a hardware-less integer
// division costs about twenty instructions (measured: integer work was the busiest pipe).
struct FastDiv {
  int divisor = 1;
  unsigned multiplier = 0;  // ceil(2^(31 + L) / divisor), L = ceil(log2 divisor)
  unsigned shift = 0;       // L − 1
  FastDiv() = default;
  explicit FastDiv(int value) : divisor(value < 1 ? 1 : value) {
    if (divisor == 1) return;
    unsigned log = 0;
    while ((1u << log) < static_cast<unsigned>(divisor)) ++log;
    multiplier = static_cast<unsigned>(((1ull << (31 + log)) + divisor - 1) / divisor);
    shift = log - 1;
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ int div(int x) const {
    return divisor == 1 ? x
                        : static_cast<int>(__umulhi(static_cast<unsigned>(x), multiplier) >> shift);
  }
  __device__ __forceinline__ int mod(int x) const {
    return x - div(x) * divisor;
  }
#endif
};

// Block-wide sum of one float per thread, for thread 0 alone (the others get their warp's sum):
// a butterfly inside each warp, then thread 0 adds the warps' sums in warp order (a fixed order:
// deterministic). `scratch` holds blockDim.x / 32 floats of shared memory; blockDim.x is a
// multiple of 32. One barrier: call it from every thread of the block; the caller's next barrier
// must come before any other thread reads what thread 0 makes of the total, or writes `scratch`.
static __device__ float block_sum_to_first_thread(float value, float* scratch) {
  value = warp_sum(value);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0) {
    for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) total += scratch[i];
  }
  return threadIdx.x == 0 ? total : value;
}

// block_sum_to_first_thread's total for every thread. Three barriers.
static __device__ float block_sum(float value, float* scratch) {
  float total = block_sum_to_first_thread(value, scratch);
  if (threadIdx.x == 0) scratch[0] = total;
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

// A float as two bf16 numbers, hi = bf16(x) and lo = bf16(x − hi): hi + lo carries 16
// significant bits. Returns the two packed mma operand registers for the pair (x0, x1).
template <typename F = float>
static __device__ __forceinline__ void split_bf16(F x0, F x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 high = __floats2bfloat162_rn(x0, x1);
  const __nv_bfloat162 low = __floats2bfloat162_rn(x0 - __low2float(high), x1 - __high2float(high));
  hi = *reinterpret_cast<const uint32_t*>(&high);
  lo = *reinterpret_cast<const uint32_t*>(&low);
}

// x as split_bf16's pair: its hi part to hi[at], its lo part to lo[at].
static __device__ __forceinline__ void store_split(float x, bf16* hi, bf16* lo, int at) {
  const bf16 high = __float2bfloat16(x);
  hi[at] = high;
  lo[at] = __float2bfloat16(x - __bfloat162float(high));
}

// The 16×16 output tile at (i0, j0) that a warp holds as two mma C fragments (columns j0 … j0 + 7
// in acc[0], j0 + 8 … j0 + 15 in acc[1]), element by element to out(i, j, value); g = lane / 4,
// t = lane % 4.
template <class FOut>
static __device__ __forceinline__ void store_tile(const float (&acc)[2][4], int i0, int j0, int g,
                                                  int t, FOut out) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int col = j0 + half * 8 + 2 * t;
    out(i0 + g, col, acc[half][0]);
    out(i0 + g, col + 1, acc[half][1]);
    out(i0 + g + 8, col, acc[half][2]);
    out(i0 + g + 8, col + 1, acc[half][3]);
  }
}

// A template for the same reason as pack_bf16.
template <typename F = float>
static __device__ __forceinline__ void mma_bf16_16816(F* c, const uint32_t* a, uint32_t b0,
                                                      uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  (void)c, (void)a, (void)b0, (void)b1;
#endif
}

// A tensor-core product (mma.sync m16n8k16, fp32 accumulation; every warp owns 16×16 output
// tiles and walks k in a fixed order: deterministic; M, N, K multiples of 16) with near-fp32
// operands: an operand marked split (kSplitA, kSplitB) enters as
// hi + lo bf16 parts and the product as hi·hi + hi·lo + lo·hi (the lo·lo term is below fp32's
// last bits of the operands' 16). An operand that is exactly bf16 already (rotated q or k,
// PsiV) is not split. Three tensor-core products cost far less than one fp32 product on the
// CUDA cores; the state products need the precision (see chunk_backward_kernel's note).
// Below sm_80 it is block_gemm.
template <bool kSplitA, bool kSplitB, class FA, class FB, class FOut>
static __device__ __forceinline__ void block_mma_split(int m, int n, int k, FA a, FB b, FOut out) {
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
      uint32_t a_hi[4], a_lo[4];
      split_bf16(a(i0 + g, ka), a(i0 + g, ka + 1), a_hi[0], a_lo[0]);
      split_bf16(a(i0 + g + 8, ka), a(i0 + g + 8, ka + 1), a_hi[1], a_lo[1]);
      split_bf16(a(i0 + g, ka + 8), a(i0 + g, ka + 9), a_hi[2], a_lo[2]);
      split_bf16(a(i0 + g + 8, ka + 8), a(i0 + g + 8, ka + 9), a_hi[3], a_lo[3]);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = j0 + half * 8 + g;
        uint32_t b0_hi, b0_lo, b1_hi, b1_lo;
        split_bf16(b(ka, col), b(ka + 1, col), b0_hi, b0_lo);
        split_bf16(b(ka + 8, col), b(ka + 9, col), b1_hi, b1_lo);
        float* c = acc[half];
        mma_bf16_16816(c, a_hi, b0_hi, b1_hi);
        if constexpr (kSplitB) mma_bf16_16816(c, a_hi, b0_lo, b1_lo);
        if constexpr (kSplitA) mma_bf16_16816(c, a_lo, b0_hi, b1_hi);
      }
    }
    store_tile(acc, i0, j0, g, t, out);
  }
#else
  block_gemm(m, n, k, a, b, out);
#endif
}

// Hopper's warpgroup products (wgmma, sm_90a only: __CUDA_ARCH_FEAT_SM90_ALL). A warpgroup (four
// consecutive warps from a multiple of four) issues each one together; warp w % 4 of it owns rows
// 16 (w % 4) … + 15 of the 64, and its 32 accumulators a thread are the mma.sync m16n8 C fragments
// of those rows' eight column tiles: acc[j][e] is row lane / 4 (+ 8 where e ≥ 2), column
// 8 j + 2 (lane % 4) + e % 2, so the code around a product does not depend on which made it.
//
// The shared-memory matrix descriptor of a [rows][64] bf16 tile held with the 128-byte swizzle
// (16-byte chunk c of row r at c ^ (r % 8); the tile 1024-byte aligned), 8-row groups 1024 bytes
// apart. Read K-major (rows m or n, columns k), its k16 slice kk is the descriptor plus 2 kk (32
// bytes, in units of 16); read transposed (rows k, columns m or n), plus 128 kk (16 rows). Only
// for tiles 64 wide: a wider one read transposed would need its leading byte offset (the stride
// between 64-column blocks), which this leaves at 1.
static __device__ __forceinline__ uint64_t swizzled_tile_descriptor(const void* tile) {
  constexpr uint64_t kGroupStride = 1024 >> 4, kSwizzle128 = 1;
  return static_cast<uint64_t>((shared_address(tile) & 0x3ffff) >> 4) | (uint64_t{1} << 16) |
         (kGroupStride << 32) | (kSwizzle128 << 62);
}
// Orders the registers' earlier writes (accumulators, A operands) before the products issued next.
static __device__ __forceinline__ void wgmma_fence() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// Closes the products issued since the last commit into a group.
static __device__ __forceinline__ void wgmma_commit() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most kPending groups are in flight (their accumulators are then readable).
template <int kPending>
static __device__ __forceinline__ void wgmma_wait() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Ties acc to the code around it: after a wait, no read of acc moves above the wait (a wait has
// no register operands, and the compiler may move register arithmetic across volatile asm).
static __device__ __forceinline__ void wgmma_fence_operands(float (&acc)[8][4]) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    asm volatile("" : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])::"memory");
  }
#else
  (void)acc;
#endif
}
// acc (= or, with kAccumulate, +=) A B for the warpgroup's 64 rows and 64 columns, k = 16, bf16
// operands through their descriptors, fp32 accumulation: A held [m][k] (K-major) or, with
// kTransposedA, [k][m]; B held [n][k] (K-major) or, with kTransposedB, [k][n]. Without kAccumulate
// the accumulators are outputs only (wgmma's scale-d = 0), so nothing zeroes them first.
#define MEGACPP_WGMMA_ACCUMULATORS(mode)                                                   \
  mode(acc[0][0]), mode(acc[0][1]), mode(acc[0][2]), mode(acc[0][3]), mode(acc[1][0]),     \
      mode(acc[1][1]), mode(acc[1][2]), mode(acc[1][3]), mode(acc[2][0]), mode(acc[2][1]), \
      mode(acc[2][2]), mode(acc[2][3]), mode(acc[3][0]), mode(acc[3][1]), mode(acc[3][2]), \
      mode(acc[3][3]), mode(acc[4][0]), mode(acc[4][1]), mode(acc[4][2]), mode(acc[4][3]), \
      mode(acc[5][0]), mode(acc[5][1]), mode(acc[5][2]), mode(acc[5][3]), mode(acc[6][0]), \
      mode(acc[6][1]), mode(acc[6][2]), mode(acc[6][3]), mode(acc[7][0]), mode(acc[7][1]), \
      mode(acc[7][2]), mode(acc[7][3])
#define MEGACPP_WGMMA_OUT(x) "=f"(x)
#define MEGACPP_WGMMA_INOUT(x) "+f"(x)
#define MEGACPP_WGMMA_64X64X16(scale_d, a, rest)                                                  \
  "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, " scale_d                                   \
  ", 0;\n"                                                                                        \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " a ", " rest \
  ";\n}\n"
template <bool kAccumulate, bool kTransposedA = false, bool kTransposedB = false>
static __device__ __forceinline__ void wgmma_64x64x16(float (&acc)[8][4], uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  if constexpr (kAccumulate) {
    asm volatile(MEGACPP_WGMMA_64X64X16("1", "%32", "%33, accumulate, 1, 1, %34, %35")
                 : MEGACPP_WGMMA_ACCUMULATORS(MEGACPP_WGMMA_INOUT)
                 : "l"(a), "l"(b), "n"(kTransposedA ? 1 : 0), "n"(kTransposedB ? 1 : 0));
  } else {
    asm volatile(MEGACPP_WGMMA_64X64X16("0", "%32", "%33, accumulate, 1, 1, %34, %35")
                 : MEGACPP_WGMMA_ACCUMULATORS(MEGACPP_WGMMA_OUT)
                 : "l"(a), "l"(b), "n"(kTransposedA ? 1 : 0), "n"(kTransposedB ? 1 : 0));
  }
#else
  (void)acc, (void)a, (void)b;
#endif
}
// acc += A B as above, A from registers: each warp's 16 rows × 16 as the mma.sync m16n8k16 A
// fragments (a[0] row lane / 4, k 2 (lane % 4) and + 1; a[1] the row 8 below; a[2] and a[3] the
// same at k + 8), which must not change until the product's group has been waited for.
template <bool kTransposedB>
static __device__ __forceinline__ void wgmma_64x64x16_registers(float (&acc)[8][4],
                                                                const uint32_t (&a)[4],
                                                                uint64_t b) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  asm volatile(MEGACPP_WGMMA_64X64X16("1", "{%32, %33, %34, %35}", "%36, accumulate, 1, 1, %37")
               : MEGACPP_WGMMA_ACCUMULATORS(MEGACPP_WGMMA_INOUT)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kTransposedB ? 1 : 0));
#else
  (void)acc, (void)a, (void)b;
#endif
}
#undef MEGACPP_WGMMA_64X64X16
#undef MEGACPP_WGMMA_INOUT
#undef MEGACPP_WGMMA_OUT
#undef MEGACPP_WGMMA_ACCUMULATORS

// Four 8×8 bf16 matrices from shared memory into mma operand registers; lane l gives the
// address of row l % 8 of matrix l / 8 (16-byte aligned). kTrans: each matrix transposed.
template <bool kTrans>
static __device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const bf16* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = shared_address(row);
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  }
#else
  (void)r, (void)row;
#endif
}

// One product's operands in shared memory as smem_mma_split takes them (layouts as smem_mma's,
// below): A's hi part (and lo part when kSplitA), B's likewise (kSplitB), and k. As there: m, n
// and k multiples of 16 (a partial tile would be dropped, a partial k read past), strides
// multiples of 8 elements, rows 16-byte aligned.
template <bool kATrans, bool kBTrans, bool kSplitA, bool kSplitB>
struct SmemOperands {
  const bf16* a_hi;
  const bf16* a_lo;
  int lda;
  const bf16* b_hi;
  const bf16* b_lo;
  int ldb;
  int k;
};

// acc += the product's 16×16 tile at (i0, j0), k in a fixed order, for the calling warp; lane's
// fragments as store_tile reads them.
template <bool kATrans, bool kBTrans, bool kSplitA, bool kSplitB>
static __device__ __forceinline__ void accumulate_tile(
    const SmemOperands<kATrans, kBTrans, kSplitA, kSplitB>& op, int i0, int j0, int lane,
    float (&acc)[2][4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int lo8 = lane % 8, second = (lane / 8) % 2, upper = lane / 16;
  const int a_row = kATrans ? lo8 + 8 * upper : lo8 + 8 * second;
  const int a_col = kATrans ? 8 * second : 8 * upper;
  const int b_row = kBTrans ? lo8 + 8 * second : lo8 + 8 * upper;
  const int b_col = kBTrans ? 8 * upper : 8 * second;
  const int lda = op.lda, ldb = op.ldb;
  for (int k0 = 0; k0 < op.k; k0 += 16) {
    const int a_at = kATrans ? (k0 + a_row) * lda + i0 + a_col : (i0 + a_row) * lda + k0 + a_col;
    const int b_at = kBTrans ? (k0 + b_row) * ldb + j0 + b_col : (j0 + b_row) * ldb + k0 + b_col;
    uint32_t af_hi[4], af_lo[4], bf_hi[4], bf_lo[4];
    ldmatrix_x4<kATrans>(af_hi, op.a_hi + a_at);
    if constexpr (kSplitA) ldmatrix_x4<kATrans>(af_lo, op.a_lo + a_at);
    ldmatrix_x4<kBTrans>(bf_hi, op.b_hi + b_at);
    if constexpr (kSplitB) ldmatrix_x4<kBTrans>(bf_lo, op.b_lo + b_at);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float* c = acc[half];
      mma_bf16_16816(c, af_hi, bf_hi[2 * half], bf_hi[2 * half + 1]);
      if constexpr (kSplitB) mma_bf16_16816(c, af_hi, bf_lo[2 * half], bf_lo[2 * half + 1]);
      if constexpr (kSplitA) mma_bf16_16816(c, af_lo, bf_hi[2 * half], bf_hi[2 * half + 1]);
    }
  }
#else
  (void)op, (void)i0, (void)j0, (void)lane, (void)acc;
#endif
}

// The m×n product, each warp's 16×16 tiles handed whole to tile_out(acc, i0, j0, g, t) (acc as
// store_tile reads it; g = lane / 4, t = lane % 4): an epilogue that reduces across a tile's
// lanes. All 32 lanes call tile_out for the same tile together, so it may shuffle.
template <bool kATrans, bool kBTrans, bool kSplitA, bool kSplitB, class FTile>
static __device__ __forceinline__ void smem_mma_tiles(
    int m, int n, const SmemOperands<kATrans, kBTrans, kSplitA, kSplitB>& op, FTile tile_out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int tiles_n = n / 16;
  const int tiles = (m / 16) * tiles_n;
  for (int tile = warp; tile < tiles; tile += warps) {
    const int i0 = (tile / tiles_n) * 16, j0 = (tile % tiles_n) * 16;
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    accumulate_tile(op, i0, j0, lane, acc);
    tile_out(acc, i0, j0, g, t);
  }
}

// Two products of the same m×n shape, each tile of both computed by one warp and handed whole to
// tile_out(first, second, i0, j0, g, t) (as smem_mma_tiles'): a sum of two products (or of one
// and a scaled other) with no pass over an fp32 matrix between them and no barrier.
template <bool kATrans0, bool kBTrans0, bool kSplitA0, bool kSplitB0, bool kATrans1, bool kBTrans1,
          bool kSplitA1, bool kSplitB1, class FTile>
static __device__ __forceinline__ void smem_mma_pair_tiles(
    int m, int n, const SmemOperands<kATrans0, kBTrans0, kSplitA0, kSplitB0>& first,
    const SmemOperands<kATrans1, kBTrans1, kSplitA1, kSplitB1>& second, FTile tile_out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int tiles_n = n / 16;
  const int tiles = (m / 16) * tiles_n;
  for (int tile = warp; tile < tiles; tile += warps) {
    const int i0 = (tile / tiles_n) * 16, j0 = (tile % tiles_n) * 16;
    float acc0[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float acc1[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    accumulate_tile(first, i0, j0, lane, acc0);
    accumulate_tile(second, i0, j0, lane, acc1);
    tile_out(acc0, acc1, i0, j0, g, t);
  }
}

// smem_mma_pair_tiles with the tiles handed to out(i, j, first, second) element by element.
template <bool kATrans0, bool kBTrans0, bool kSplitA0, bool kSplitB0, bool kATrans1, bool kBTrans1,
          bool kSplitA1, bool kSplitB1, class FOut>
static __device__ __forceinline__ void smem_mma_pair(
    int m, int n, const SmemOperands<kATrans0, kBTrans0, kSplitA0, kSplitB0>& first,
    const SmemOperands<kATrans1, kBTrans1, kSplitA1, kSplitB1>& second, FOut out) {
  smem_mma_pair_tiles(
      m, n, first, second,
      [&](const float(&acc0)[2][4], const float(&acc1)[2][4], int i0, int j0, int g, int t) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int col = j0 + half * 8 + 2 * t;
          out(i0 + g, col, acc0[half][0], acc1[half][0]);
          out(i0 + g, col + 1, acc0[half][1], acc1[half][1]);
          out(i0 + g + 8, col, acc0[half][2], acc1[half][2]);
          out(i0 + g + 8, col + 1, acc0[half][3], acc1[half][3]);
        }
      });
}

// smem_mma (below: the layouts) with near-fp32 operands held in shared memory as hi + lo bf16
// pairs (split_bf16's):
// A split when kSplitA (a_hi, a_lo; else a_hi alone), B likewise when kSplitB. The same tiles, k
// order and per-k order of products (hi·hi, hi·lo, then lo·hi) as block_mma_split, so the same
// bits for the same pairs; every fragment by one ldmatrix.
template <bool kATrans, bool kBTrans, bool kSplitA, bool kSplitB = true, class FOut>
static __device__ __forceinline__ void smem_mma_split(int m, int n, int k, const bf16* a_hi,
                                                      const bf16* a_lo, int lda, const bf16* b_hi,
                                                      const bf16* b_lo, int ldb, FOut out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  smem_mma_tiles(
      m, n, SmemOperands<kATrans, kBTrans, kSplitA, kSplitB>{a_hi, a_lo, lda, b_hi, b_lo, ldb, k},
      [&](const float(&acc)[2][4], int i0, int j0, int g, int t) {
        store_tile(acc, i0, j0, g, t, out);
      });
#else
  (void)m, (void)n, (void)k, (void)a_hi, (void)a_lo, (void)lda, (void)b_hi, (void)b_lo, (void)ldb,
      (void)out;
#endif
}

// C = A·B with both operands bf16 in shared memory, on the tensor cores (fp32 accumulation),
// every operand fragment fetched by one ldmatrix: the same tiles and k order as
// block_mma_split, at a tenth of the instructions of fetching fragments element by element.
// A is m×k: stored [m][k] (row i at a + i·lda), or [k][m] when kATrans. B is k×n: stored [n][k]
// (column j at b + j·ldb, k contiguous), or [k][n] when kBTrans. Strides are multiples of 8
// elements and the buffers 16-byte aligned. M, N and K are multiples of 16.
// It is smem_mma_split with neither operand split.
template <bool kATrans, bool kBTrans, class FOut>
static __device__ __forceinline__ void smem_mma(int m, int n, int k, const bf16* a, int lda,
                                                const bf16* b, int ldb, FOut out) {
  smem_mma_split<kATrans, kBTrans, false, false>(m, n, k, a, nullptr, lda, b, nullptr, ldb, out);
}

// A product of two bf16 matrices in shared memory (layouts as smem_mma): smem_mma when kTensor,
// else block_gemm on the CUDA cores in fp32 over the same bf16 values.
template <bool kTensor, bool kATrans, bool kBTrans, class FOut>
static __device__ __forceinline__ void bf16_gemm(int m, int n, int k, const bf16* a, int lda,
                                                 const bf16* b, int ldb, FOut out) {
  if constexpr (kTensor) {
    smem_mma<kATrans, kBTrans>(m, n, k, a, lda, b, ldb, out);
  } else {
    block_gemm(
        m, n, k, [&](int i, int kk) { return to_f(kATrans ? a[kk * lda + i] : a[i * lda + kk]); },
        [&](int kk, int j) { return to_f(kBTrans ? b[kk * ldb + j] : b[j * ldb + kk]); }, out);
  }
}

// The products with the SSM state: split-bf16 tensor-core products when kTensor, else fp32 on
// the CUDA cores.
template <bool kTensor, bool kSplitA, bool kSplitB, class FA, class FB, class FOut>
static __device__ __forceinline__ void state_gemm(int m, int n, int k, FA a, FB b, FOut out) {
  if constexpr (kTensor) {
    block_mma_split<kSplitA, kSplitB>(m, n, k, a, b, out);
  } else {
    block_gemm(m, n, k, a, b, out);
  }
}

}  // namespace megacpp::cuda
