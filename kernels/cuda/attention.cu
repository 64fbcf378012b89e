// CUDA causal grouped-query attention: see attention.h for the structure. The math is that of
// kernels/cpu/attention.h: P = causal softmax(scale · Q Kᵀ), out = P V; backward
// dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)), dQ = scale · dS K, dK = scale · dSᵀ Q, dV = Pᵀ dO.
//
// Fragments. Every product is a warp's mma.sync m16n8k16 (A 16×16 row-major, B 16×8
// column-major, C 16×8 fp32). With g = lane / 4 and t = lane % 4, a lane holds
//   A: (g, 2t..2t+1), (g+8, 2t..2t+1), (g, 2t+8..2t+9), (g+8, 2t+8..2t+9), two bf16 per register;
//   B: (2t..2t+1, g), (2t+8..2t+9, g);
//   C: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
// So the C fragments of a 16×16 slice of scores are, once rounded to bf16, exactly the A
// fragment of the product that consumes them: probabilities never leave the registers, and each
// row's max and sum need only the 4 lanes of one quad (shuffles 1 and 2).
//
// Softmax in base 2: x = scale·log2(e)·(q·k), p = 2^(x − m); lse is stored in natural log.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/device_query.h"

namespace megacpp::cuda {
namespace {

using detail::refuse;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
// Rows of a key tile, of a dQ block's query tile and of a dK/dV block's key tile: 16 a warp. (A
// forward block's query tile is kR of them.)
constexpr int kTile = kWarps * 16;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;

// Everything a kernel reads from the call; passed by value.
struct Params {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const uint16_t* dout;
  const float* lse_in;
  const float* delta;
  uint16_t* out;
  float* lse_out;
  uint16_t* dq;
  uint16_t* dk;
  uint16_t* dv;
  int seqlen;
  int q_heads;
  int group;  // q heads per kv head
  int q_stride;
  int kv_stride;
  float scale;       // softmax_scale
  float scale_log2;  // softmax_scale · log2(e)
  // Every pointer 16-byte aligned and every row stride a multiple of 8 elements: tiles load as
  // 16-byte vectors and pairs store as 32-bit words. Otherwise element by element.
  bool vec;
};

__device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  // Never runs: the constructor refuses devices without bf16 mma.
  (void)c;
  (void)a;
  (void)b0;
  (void)b1;
#endif
}

// The copies of global tiles into shared memory are asynchronous (copy_16_async, common.cuh): a
// kernel starts the next key or query tile's copy before it computes on the current one, and
// waits for it (wait_copies, then a barrier) only once that compute is done.
// Rows [row0, row0 + rows) of one head, row t at base + t·stride, into a shared tile [rows][ld]
// with ld = D + 8 (the padding puts the eight rows of an ldmatrix on distinct banks). Rows at or
// past seqlen are zero, so that they give finite scores and add nothing. With vec, asynchronous
// copies of 16 bytes (see commit_copies); otherwise element by element.
template <int D>
__device__ void load_tile(uint16_t* tile, const uint16_t* base, int stride, int row0, int rows,
                          int seqlen, bool vec) {
  constexpr int kLd = D + 8;
  if (vec) {
    constexpr int kChunks = D / 8;  // 16-byte vectors per row
    for (int i = threadIdx.x; i < rows * kChunks; i += blockDim.x) {
      const int r = i / kChunks, c = (i % kChunks) * 8;
      const int row = row0 + r;
      const bool valid = row < seqlen;
      copy_16_async(tile + r * kLd + c, base + (valid ? static_cast<int64_t>(row) * stride + c : 0),
                    valid);
    }
  } else {
    for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
      const int r = i / D, c = i % D;
      const int row = row0 + r;
      tile[r * kLd + c] = row < seqlen ? base[static_cast<int64_t>(row) * stride + c] : 0;
    }
  }
}

__device__ __forceinline__ void store_pair(uint16_t* p, float x, float y, bool vec) {
  const uint32_t bits = pack_bf16(x, y);
  if (vec) {
    *reinterpret_cast<uint32_t*>(p) = bits;
  } else {
    p[0] = static_cast<uint16_t>(bits & 0xffffu);
    p[1] = static_cast<uint16_t>(bits >> 16);
  }
}

__device__ __forceinline__ const bf16* as_bf16(const uint16_t* p) {
  return reinterpret_cast<const bf16*>(p);
}

// The A fragments of rows [row0, row0 + 16) × [0, K) of a shared tile, one ldmatrix per 16 of k.
template <int K>
__device__ __forceinline__ void load_a(uint32_t (&a)[K / 16][4], const uint16_t* tile, int ld,
                                       int row0, int lane) {
  // Lane l addresses row l % 8 of matrix l / 8: (rows 0-7 | 8-15) × (k 0-7 | 8-15) = a0 … a3.
  const int row = row0 + lane % 8 + 8 * ((lane / 8) % 2), col = 8 * (lane / 16);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk)
    ldmatrix_x4<false>(a[kk], as_bf16(tile + row * ld + kk * 16 + col));
}

// acc[rt][16, N] += A[rt]·Bᵀ for the warp's kR tiles of 16 rows: A in fragments (load_a), B =
// rows [0, N) of b_tile [.., K] in shared memory, two 8-column slices per ldmatrix, each fetched
// once for all kR row tiles. k ascends: a fixed order.
template <int K, int N, int kR>
__device__ __forceinline__ void warp_abt_tiles(float (&acc)[kR][N / 8][4],
                                               const uint32_t (&a)[kR][K / 16][4],
                                               const uint16_t* b_tile, int ld, int lane) {
  // Matrices: (columns 0-7, k 0-7), (0-7, k 8-15), (8-15, k 0-7), (8-15, k 8-15).
  const int row = lane % 8 + 8 * (lane / 16), col = 8 * ((lane / 8) % 2);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4<false>(b, as_bf16(b_tile + (np * 16 + row) * ld + kk * 16 + col));
#pragma unroll
      for (int rt = 0; rt < kR; ++rt) {
        mma(acc[rt][2 * np], a[rt][kk], b[0], b[1]);
        mma(acc[rt][2 * np + 1], a[rt][kk], b[2], b[3]);
      }
    }
  }
}

template <int K, int N>
__device__ __forceinline__ void warp_abt(float (&acc)[N / 8][4], const uint32_t (&a)[K / 16][4],
                                         const uint16_t* b_tile, int ld, int lane) {
  warp_abt_tiles<K, N, 1>(reinterpret_cast<float(&)[1][N / 8][4]>(acc),
                          reinterpret_cast<const uint32_t(&)[1][K / 16][4]>(a), b_tile, ld, lane);
}

// acc[rt][16, D] += P[rt]·B for the warp's kR tiles of 16 rows: P in C fragments (rounded to
// bf16 here), B = rows [0, N) of b_tile [.., D] in shared memory, fetched transposed, two
// 8-column slices per ldmatrix, each fetched once for all kR row tiles. k ascends: a fixed order.
template <int N, int D, int kR>
__device__ __forceinline__ void warp_pb_tiles(float (&acc)[kR][D / 8][4],
                                              const float (&p)[kR][N / 8][4],
                                              const uint16_t* b_tile, int ld, int lane) {
  // Matrices: (k 0-7, columns 0-7), (k 8-15, 0-7), (k 0-7, 8-15), (k 8-15, 8-15), transposed.
  const int row = lane % 8 + 8 * ((lane / 8) % 2), col = 8 * (lane / 16);
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    uint32_t a[kR][4];
#pragma unroll
    for (int rt = 0; rt < kR; ++rt) {
      a[rt][0] = pack_bf16(p[rt][2 * kk][0], p[rt][2 * kk][1]);
      a[rt][1] = pack_bf16(p[rt][2 * kk][2], p[rt][2 * kk][3]);
      a[rt][2] = pack_bf16(p[rt][2 * kk + 1][0], p[rt][2 * kk + 1][1]);
      a[rt][3] = pack_bf16(p[rt][2 * kk + 1][2], p[rt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4<true>(b, as_bf16(b_tile + (kk * 16 + row) * ld + dp * 16 + col));
#pragma unroll
      for (int rt = 0; rt < kR; ++rt) {
        mma(acc[rt][2 * dp], a[rt], b[0], b[1]);
        mma(acc[rt][2 * dp + 1], a[rt], b[2], b[3]);
      }
    }
  }
}

template <int N, int D>
__device__ __forceinline__ void warp_pb(float (&acc)[D / 8][4], const float (&p)[N / 8][4],
                                        const uint16_t* b_tile, int ld, int lane) {
  warp_pb_tiles<N, D, 1>(reinterpret_cast<float(&)[1][D / 8][4]>(acc),
                         reinterpret_cast<const float(&)[1][N / 8][4]>(p), b_tile, ld, lane);
}

// Blocks run in launch order, roughly: the longest query tiles (the last rows, which see the
// most keys) go first, so that the short ones fill the tail.
__device__ __forceinline__ int heavy_first_tile() {
  return static_cast<int>(gridDim.x - 1 - blockIdx.x);
}

// Block (tile, h, b): query rows [tile·kRows, tile·kRows + kRows) of q head h, kRows = 64·kR;
// each warp owns kR tiles of 16 consecutive rows, so that every K and V fragment fetched from
// shared memory feeds kR products. Dynamic shared memory: the Q tile [kRows][D + 8], then two
// stages of (K, V) tiles [64][D + 8] bf16: the next key tile's copy runs while the current one is
// computed on.
template <int D, int kR>
__global__ void __launch_bounds__(kThreads) forward_kernel(Params p) {
  constexpr int kRows = kTile * kR, kLd = D + 8, kKeysSize = kTile * kLd;
  extern __shared__ uint4 smem[];
  uint16_t* sq = reinterpret_cast<uint16_t*>(smem);
  uint16_t* stages = sq + kRows * kLd;  // stage s: K at 2s, V at 2s + 1
  const int tile = heavy_first_tile(), h = blockIdx.y, b = blockIdx.z;
  const int seqlen = p.seqlen, row0 = tile * kRows;
  const int64_t token0 = static_cast<int64_t>(b) * seqlen;
  const int kv_col = (h / p.group) * D;
  const uint16_t* k_head = p.k + token0 * p.kv_stride + kv_col;
  const uint16_t* v_head = p.v + token0 * p.kv_stride + kv_col;
  const auto load_keys = [&](int kt) {
    uint16_t* stage = stages + (kt % 2) * 2 * kKeysSize;
    load_tile<D>(stage, k_head, p.kv_stride, kt * kTile, kTile, seqlen, p.vec);
    load_tile<D>(stage + kKeysSize, v_head, p.kv_stride, kt * kTile, kTile, seqlen, p.vec);
    commit_copies();
  };
  load_tile<D>(sq, p.q + token0 * p.q_stride + h * D, p.q_stride, row0, kRows, seqlen, p.vec);
  load_keys(0);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int wrow = warp * 16 * kR;  // the warp's first row in the tile
  int rows[kR][2];
#pragma unroll
  for (int rt = 0; rt < kR; ++rt) {
    rows[rt][0] = row0 + wrow + rt * 16 + lane / 4;
    rows[rt][1] = rows[rt][0] + 8;
  }
  // Keys up to the block's last row that exists.
  const int key_tiles = (min(row0 + kRows, seqlen) - 1) / kTile + 1;
  uint32_t qf[kR][D / 16][4];  // this warp's Q rows, for every key tile
  float o[kR][D / 8][4] = {};
  float m[kR][2], l[kR][2];  // per row: running max of x, running Σ 2^(x − m)
#pragma unroll
  for (int rt = 0; rt < kR; ++rt) {
    m[rt][0] = m[rt][1] = -INFINITY;
    l[rt][0] = l[rt][1] = 0.f;
  }
  for (int kt = 0; kt < key_tiles; ++kt) {
    if (kt + 1 < key_tiles) {
      load_keys(kt + 1);  // its stage was last read before the previous iteration's barrier
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    if (kt == 0) {
#pragma unroll
      for (int rt = 0; rt < kR; ++rt) load_a<D>(qf[rt], sq, kLd, wrow + rt * 16, lane);
    }
    const uint16_t* sk = stages + (kt % 2) * 2 * kKeysSize;
    const uint16_t* sv = sk + kKeysSize;
    const int key0 = kt * kTile;
    // A warp whose rows all precede the tile's keys has nothing to add from it; only a tile
    // reaching past the warp's first row holds masked pairs (keys after a row, or past seqlen).
    if (key0 <= row0 + wrow + 16 * kR - 1) {
      const bool masked = key0 + kTile - 1 > row0 + wrow;
      float s[kR][kTile / 8][4] = {};
      warp_abt_tiles<D, kTile, kR>(s, qf, sk, kLd, lane);
#pragma unroll
      for (int rt = 0; rt < kR; ++rt) {
#pragma unroll
        for (int nt = 0; nt < kTile / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key0 + nt * 8 + 2 * t + (e & 1);
            s[rt][nt][e] =
                !masked || key <= rows[rt][e / 2] ? s[rt][nt][e] * p.scale_log2 : -INFINITY;
          }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float mx = m[rt][i];
#pragma unroll
          for (int nt = 0; nt < kTile / 8; ++nt) {
            mx = fmaxf(mx, fmaxf(s[rt][nt][2 * i], s[rt][nt][2 * i + 1]));
          }
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
          // A row's first tile holds key 0, so mx is finite for every row that exists; the guard
          // keeps a fully masked row at 0 instead of NaN all the same.
          const float base = mx == -INFINITY ? 0.f : mx;
          const float alpha = exp2f(m[rt][i] - base);  // 0 on the first tile (m = −inf)
          m[rt][i] = mx;
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < kTile / 8; ++nt) {
            s[rt][nt][2 * i] = exp2f(s[rt][nt][2 * i] - base);
            s[rt][nt][2 * i + 1] = exp2f(s[rt][nt][2 * i + 1] - base);
            sum += s[rt][nt][2 * i] + s[rt][nt][2 * i + 1];
          }
          // Butterflies: the quad's 4 lanes end with the same bits.
          sum += __shfl_xor_sync(kFull, sum, 1);
          sum += __shfl_xor_sync(kFull, sum, 2);
          l[rt][i] = l[rt][i] * alpha + sum;
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt) {
            o[rt][dt][2 * i] *= alpha;
            o[rt][dt][2 * i + 1] *= alpha;
          }
        }
      }
      warp_pb_tiles<kTile, D, kR>(o, s, sv, kLd, lane);
    }
    __syncthreads();  // this stage is refilled two iterations on
  }

  const int out_stride = p.q_heads * D;
#pragma unroll
  for (int rt = 0; rt < kR; ++rt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = rows[rt][i];
      if (row >= seqlen) continue;
      const float inv = 1.f / l[rt][i];
      uint16_t* dst = p.out + (token0 + row) * out_stride + h * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        store_pair(dst + dt * 8 + 2 * t, o[rt][dt][2 * i] * inv, o[rt][dt][2 * i + 1] * inv, p.vec);
      }
      if (t == 0) {
        p.lse_out[(static_cast<int64_t>(b) * p.q_heads + h) * seqlen + row] =
            (m[rt][i] + log2f(l[rt][i])) * kLn2;
      }
    }
  }
}

// delta[b, h, t] = Σ_d dout·out over one row, fp32: one warp per row of [batch·seqlen·q_heads],
// rows in their memory order. The dS of the CPU op uses rowsum(P ⊙ dP), which equals this.
__global__ void __launch_bounds__(kThreads)
    delta_kernel(int64_t rows, int seqlen, int q_heads, int head_dim, const uint16_t* out,
                 const uint16_t* dout, float* delta) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= rows) return;  // whole warps: warp_sum below needs every lane
  const uint16_t* o = out + row * head_dim;
  const uint16_t* d = dout + row * head_dim;
  float sum = 0.f;
  for (int c = lane; c < head_dim; c += 32) {
    sum = fmaf(__bfloat162float(__ushort_as_bfloat16(o[c])),
               __bfloat162float(__ushort_as_bfloat16(d[c])), sum);
  }
  sum = warp_sum(sum);
  if (lane == 0) {
    const int64_t token = row / q_heads;
    const int h = static_cast<int>(row % q_heads);
    const int64_t b = token / seqlen, t = token % seqlen;
    delta[(b * q_heads + h) * seqlen + t] = sum;
  }
}

// Block (tile, h, b): dQ of query rows [tile·64, tile·64 + 64) of q head h. Dynamic shared
// memory: Q and dO tiles, then two stages of (K, V) tiles, [64][D + 8] bf16 each. (At D = 128 the
// six tiles pass the 99 KiB a block may have on compute capability 8.6 and 8.9, where the
// constructor refuses that head_dim; the Q and dO tiles could be the second stage once every
// warp holds its rows of them.)
template <int D>
__global__ void __launch_bounds__(kThreads) dq_kernel(Params p) {
  constexpr int kLd = D + 8, kTileSize = kTile * kLd;
  extern __shared__ uint4 smem[];
  uint16_t* sq = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sdo = sq + kTileSize;
  uint16_t* stages = sdo + kTileSize;  // stage s: K at 2s, V at 2s + 1
  const int tile = heavy_first_tile(), h = blockIdx.y, b = blockIdx.z;
  const int seqlen = p.seqlen, row0 = tile * kTile;
  const int64_t token0 = static_cast<int64_t>(b) * seqlen;
  const int kv_col = (h / p.group) * D;
  const int out_stride = p.q_heads * D;
  const uint16_t* k_head = p.k + token0 * p.kv_stride + kv_col;
  const uint16_t* v_head = p.v + token0 * p.kv_stride + kv_col;
  const auto load_keys = [&](int kt) {
    uint16_t* stage = stages + (kt % 2) * 2 * kTileSize;
    load_tile<D>(stage, k_head, p.kv_stride, kt * kTile, kTile, seqlen, p.vec);
    load_tile<D>(stage + kTileSize, v_head, p.kv_stride, kt * kTile, kTile, seqlen, p.vec);
    commit_copies();
  };
  load_tile<D>(sq, p.q + token0 * p.q_stride + h * D, p.q_stride, row0, kTile, seqlen, p.vec);
  load_tile<D>(sdo, p.dout + token0 * out_stride + h * D, out_stride, row0, kTile, seqlen, p.vec);
  load_keys(0);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int wrow = warp * 16;
  const int rows[2] = {row0 + wrow + lane / 4, row0 + wrow + lane / 4 + 8};
  const int64_t stats = (static_cast<int64_t>(b) * p.q_heads + h) * seqlen;
  float lse2[2], dl[2];
  bool valid[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    valid[i] = rows[i] < seqlen;
    lse2[i] = valid[i] ? p.lse_in[stats + rows[i]] * kLog2e : 0.f;
    dl[i] = valid[i] ? p.delta[stats + rows[i]] : 0.f;
  }
  uint32_t qf[D / 16][4], dof[D / 16][4];  // this warp's Q and dO rows, for every key tile
  float dq[D / 8][4] = {};
  for (int kt = 0; kt <= tile; ++kt) {
    if (kt < tile) {
      load_keys(kt + 1);
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    if (kt == 0) {
      load_a<D>(qf, sq, kLd, wrow, lane);
      load_a<D>(dof, sdo, kLd, wrow, lane);
    }
    const uint16_t* sk = stages + (kt % 2) * 2 * kTileSize;
    const uint16_t* sv = sk + kTileSize;
    const int key0 = kt * kTile;
    float s[kTile / 8][4] = {};
    warp_abt<D, kTile>(s, qf, sk, kLd, lane);
    float dp[kTile / 8][4] = {};
    warp_abt<D, kTile>(dp, dof, sv, kLd, lane);
    const bool diagonal = kt == tile;
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e / 2;
        const int key = key0 + nt * 8 + 2 * t + (e & 1);
        const float prob = (!diagonal || key <= rows[i]) && valid[i]
                               ? exp2f(s[nt][e] * p.scale_log2 - lse2[i])
                               : 0.f;
        s[nt][e] = prob * (dp[nt][e] - dl[i]);  // dS without the scale
      }
    }
    warp_pb<kTile, D>(dq, s, sk, kLd, lane);
    __syncthreads();  // this stage is refilled two iterations on
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = rows[i];
    if (row >= seqlen) continue;
    uint16_t* dst = p.dq + (token0 + row) * p.q_stride + h * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      store_pair(dst + dt * 8 + 2 * t, dq[dt][2 * i] * p.scale, dq[dt][2 * i + 1] * p.scale, p.vec);
    }
  }
}

// Block (tile, kv head, b): dK and dV of keys [tile·64, tile·64 + 64). Each warp owns 16 keys and
// works on the transposed products (keys as rows), visiting the group's q heads in order and, for
// each, the query tiles of kRows rows from the one holding the block's first key to the end.
// Dynamic shared memory: K, V tiles [64][D + 8], then two stages of (Q, dO tiles [kRows][D + 8]
// bf16, the query tile's lse·log2(e) and delta fp32 [kRows] each): the next query tile's copy
// runs while the current one is computed on.
// Up to D = 64, three blocks per SM on an H100 (at most 168 registers a thread, against 176
// unbounded; measured: backward 17.9 -> 16.4 ms at A-ref). Devices with less shared memory per SM
// (A100: 164 KiB, two of these blocks) get the register cap without the third block.
template <int D, int kRows>
__global__ void __launch_bounds__(kThreads, D <= 64 ? 3 : 1) dkdv_kernel(Params p) {
  constexpr int kLd = D + 8;
  constexpr int kStageBytes = 2 * kRows * kLd * 2 + 2 * kRows * 4;
  static_assert(kStageBytes % 16 == 0);
  extern __shared__ uint4 smem[];
  uint16_t* sk = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sv = sk + kTile * kLd;
  unsigned char* stages = reinterpret_cast<unsigned char*>(sv + kTile * kLd);
  // The first key tiles meet the most query tiles: launched first (blockIdx.x order).
  const int tile = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int seqlen = p.seqlen, key0 = tile * kTile;
  const int64_t token0 = static_cast<int64_t>(b) * seqlen;
  const int out_stride = p.q_heads * D;
  load_tile<D>(sk, p.k + token0 * p.kv_stride + kvh * D, p.kv_stride, key0, kTile, seqlen, p.vec);
  load_tile<D>(sv, p.v + token0 * p.kv_stride + kvh * D, p.kv_stride, key0, kTile, seqlen, p.vec);

  // Steps: the group's q heads in order, each the query tiles from first_tile to the last.
  const int q_tiles = (seqlen + kRows - 1) / kRows, first_tile = key0 / kRows;
  const int tiles_per_head = q_tiles - first_tile, steps = p.group * tiles_per_head;
  struct Stage {
    uint16_t* q;
    uint16_t* dout;
    float* lse2;
    float* delta;
  };
  const auto stage_of = [&](int step) {
    unsigned char* base = stages + (step % 2) * kStageBytes;
    uint16_t* q = reinterpret_cast<uint16_t*>(base);
    float* lse2 = reinterpret_cast<float*>(base + 2 * kRows * kLd * 2);
    return Stage{q, q + kRows * kLd, lse2, lse2 + kRows};
  };
  const auto load_queries = [&](int step) {
    const Stage stage = stage_of(step);
    const int h = kvh * p.group + step / tiles_per_head;
    const int q0 = (first_tile + step % tiles_per_head) * kRows;
    load_tile<D>(stage.q, p.q + token0 * p.q_stride + h * D, p.q_stride, q0, kRows, seqlen, p.vec);
    load_tile<D>(stage.dout, p.dout + token0 * out_stride + h * D, out_stride, q0, kRows, seqlen,
                 p.vec);
    commit_copies();
    const int64_t stats = (static_cast<int64_t>(b) * p.q_heads + h) * seqlen;
    for (int i = threadIdx.x; i < kRows; i += blockDim.x) {
      const int row = q0 + i;
      stage.lse2[i] = row < seqlen ? p.lse_in[stats + row] * kLog2e : 0.f;
      stage.delta[i] = row < seqlen ? p.delta[stats + row] : 0.f;
    }
  };
  load_queries(0);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int wrow = warp * 16;
  const int keys[2] = {key0 + wrow + lane / 4, key0 + wrow + lane / 4 + 8};
  float dk[D / 8][4] = {};
  float dv[D / 8][4] = {};
  for (int step = 0; step < steps; ++step) {
    if (step + 1 < steps) {
      load_queries(step + 1);  // its stage was last read before the previous iteration's barrier
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    const Stage stage = stage_of(step);
    const int q0 = (first_tile + step % tiles_per_head) * kRows;
    // Only query tiles that overlap the block's keys or run past seqlen hold masked pairs.
    const bool masked = q0 < key0 + kTile || q0 + kRows > seqlen;
    // Pᵀ [16 keys, kRows queries] = K Qᵀ, then the probabilities. The warp's K and V fragments
    // are fetched again every step: held across steps they would not fit beside dK, dV and the
    // scores under the register cap above.
    float pt[kRows / 8][4] = {};
    {
      uint32_t kf[D / 16][4];
      load_a<D>(kf, sk, kLd, wrow, lane);
      warp_abt<D, kRows>(pt, kf, stage.q, kLd, lane);
    }
#pragma unroll
    for (int nt = 0; nt < kRows / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = nt * 8 + 2 * t + (e & 1);
        const int row = q0 + qi;
        pt[nt][e] = !masked || (keys[e / 2] <= row && row < seqlen)
                        ? exp2f(pt[nt][e] * p.scale_log2 - stage.lse2[qi])
                        : 0.f;
      }
    }
    warp_pb<kRows, D>(dv, pt, stage.dout, kLd, lane);  // dV += Pᵀ dO
    // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ ⊙ (dPᵀ − delta) in place.
    float ds[kRows / 8][4] = {};
    {
      uint32_t vf[D / 16][4];
      load_a<D>(vf, sv, kLd, wrow, lane);
      warp_abt<D, kRows>(ds, vf, stage.dout, kLd, lane);
    }
#pragma unroll
    for (int nt = 0; nt < kRows / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = nt * 8 + 2 * t + (e & 1);
        ds[nt][e] = pt[nt][e] * (ds[nt][e] - stage.delta[qi]);
      }
    }
    warp_pb<kRows, D>(dk, ds, stage.q, kLd, lane);  // dK += dSᵀ Q, the scale applied at the end
    __syncthreads();                                // this stage is refilled two iterations on
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int key = keys[i];
    if (key >= seqlen) continue;
    const int64_t at = (token0 + key) * p.kv_stride + kvh * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      store_pair(p.dk + at + dt * 8 + 2 * t, dk[dt][2 * i] * p.scale, dk[dt][2 * i + 1] * p.scale,
                 p.vec);
      store_pair(p.dv + at + dt * 8 + 2 * t, dv[dt][2 * i], dv[dt][2 * i + 1], p.vec);
    }
  }
}

// The kernels of one head_dim and their dynamic shared memory.
struct Kernels {
  void (*forward)(Params);
  void (*dq)(Params);
  void (*dkdv)(Params);
  size_t forward_smem, dq_smem, dkdv_smem;
  int forward_rows;  // query rows of a forward block
};

template <int D, int kDkdvRows, int kForwardTiles>
Kernels kernels_for() {
  const size_t tile_bytes = static_cast<size_t>(D + 8) * sizeof(uint16_t);
  // Forward: Q and two stages of K, V. dQ: Q, dO and two stages of K, V. dK/dV: K, V and two
  // stages of Q, dO, lse, delta.
  return {forward_kernel<D, kForwardTiles>,
          dq_kernel<D>,
          dkdv_kernel<D, kDkdvRows>,
          (kForwardTiles + 4) * kTile * tile_bytes,
          6 * kTile * tile_bytes,
          2 * kTile * tile_bytes + 2 * (2 * kDkdvRows * tile_bytes + 2 * kDkdvRows * sizeof(float)),
          kForwardTiles * kTile};
}

// dK/dV holds two [16, D] accumulators per warp besides its [16, kRows] scores: above D = 64,
// query tiles of 32 rows keep that within the registers. The forward's warps take two tiles of
// 16 rows up to D = 64 (twice the output and score registers; above, they would spill).
template <int D>
Kernels kernels_of_dim() {
  constexpr int kDkdvRows = D <= 64 ? 64 : 32;
  constexpr int kForwardTiles = D <= 64 ? 2 : 1;
  return kernels_for<D, kDkdvRows, kForwardTiles>();
}

// Every head_dim the kernels are built for: the multiples of 16 (the k of one mma) up to 128.
constexpr int kMinHeadDim = 16;
constexpr int kMaxHeadDim = 128;

bool supported_head_dim(int head_dim) {
  return head_dim >= kMinHeadDim && head_dim <= kMaxHeadDim && head_dim % 16 == 0;
}

Kernels kernels_of(int head_dim) {
  switch (head_dim) {
    case 16:
      return kernels_of_dim<16>();
    case 32:
      return kernels_of_dim<32>();
    case 48:
      return kernels_of_dim<48>();
    case 64:
      return kernels_of_dim<64>();
    case 80:
      return kernels_of_dim<80>();
    case 96:
      return kernels_of_dim<96>();
    case 112:
      return kernels_of_dim<112>();
    default:  // 128, the only one left: validate() refuses the others
      return kernels_of_dim<128>();
  }
}

void validate(const AttentionShape& s) {
  validate_attention_shape(s, "CausalAttentionCuda");
  if (!supported_head_dim(s.head_dim)) {
    refuse(ErrorKind::kInvalidArgument,
           "CausalAttentionCuda: AttentionShape.head_dim={} must be a multiple of 16 in [{}, {}]",
           s.head_dim, kMinHeadDim, kMaxHeadDim);
  }
  // Grid dimensions y and z take at most 65535.
  if (s.batch > 65535 || s.q_heads > 65535) {
    refuse(ErrorKind::kInvalidArgument,
           "CausalAttentionCuda: AttentionShape.batch={} and q_heads={} must be at most 65535",
           s.batch, s.q_heads);
  }
}

template <class T>
void require(const T* pointer, const char* field) {
  if (pointer == nullptr) {
    refuse(ErrorKind::kInvalidArgument, "CausalAttentionCuda: {} is null", field);
  }
}

bool aligned16(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

}  // namespace

void validate_attention_shape(const AttentionShape& s, const char* op) {
  const auto positive = [&](int value, const char* field) {
    if (value <= 0) {
      refuse(ErrorKind::kInvalidArgument, "{}: AttentionShape.{}={} must be positive", op, field,
             value);
    }
  };
  positive(s.batch, "batch");
  positive(s.seqlen, "seqlen");
  positive(s.q_heads, "q_heads");
  positive(s.kv_heads, "kv_heads");
  positive(s.head_dim, "head_dim");
  if (s.q_heads % s.kv_heads != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "{}: AttentionShape.q_heads={} must be a multiple of kv_heads={}", op, s.q_heads,
           s.kv_heads);
  }
  if (!(s.softmax_scale > 0.0) || !std::isfinite(s.softmax_scale)) {
    refuse(ErrorKind::kInvalidArgument,
           "{}: AttentionShape.softmax_scale={} must be positive and finite", op, s.softmax_scale);
  }
}

size_t CausalAttentionCuda::workspace_bytes(const AttentionShape& shape) {
  validate(shape);
  return static_cast<size_t>(shape.batch) * static_cast<size_t>(shape.q_heads) *
         static_cast<size_t>(shape.seqlen) * sizeof(float);
}

CausalAttentionCuda::CausalAttentionCuda(const AttentionShape& shape, void* workspace, size_t bytes)
    : shape_(shape), delta_(static_cast<float*>(workspace)), workspace_bytes_(bytes) {
  validate(shape);
  if (bytes > 0) require(workspace, "the workspace (of nonzero size)");
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device_));
  int major = 0;
  MEGACPP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
  if (major < 8) {
    refuse(ErrorKind::kFailedPrecondition,
           "CausalAttentionCuda needs compute capability 8.0 or newer (bf16 mma); device {} is "
           "{}.x",
           device_, major);
  }
  // Above 48 KiB a kernel's dynamic shared memory must be allowed explicitly; past the device's
  // limit per block it cannot be.
  const Kernels k = kernels_of(shape.head_dim);
  const SharedMemoryLimits shared = shared_memory_limits(device_);
  const size_t most = std::max({k.forward_smem, k.dq_smem, k.dkdv_smem});
  if (most > shared.per_block) {
    refuse(ErrorKind::kFailedPrecondition,
           "CausalAttentionCuda: head_dim={} needs {} bytes of shared memory per block; device {} "
           "allows {}{}",
           shape.head_dim, most, device_, shared.per_block, cap_note(shared));
  }
  MEGACPP_CUDA_CHECK(cudaFuncSetAttribute(kernel_address(k.forward),
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(k.forward_smem)));
  MEGACPP_CUDA_CHECK(cudaFuncSetAttribute(kernel_address(k.dq),
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(k.dq_smem)));
  MEGACPP_CUDA_CHECK(cudaFuncSetAttribute(kernel_address(k.dkdv),
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(k.dkdv_smem)));
}

namespace {

void validate_strides(const AttentionShape& s, int q_stride, int kv_stride, const char* entry) {
  if (static_cast<int64_t>(q_stride) < static_cast<int64_t>(s.q_heads) * s.head_dim) {
    refuse(ErrorKind::kInvalidArgument,
           "CausalAttentionCuda: {}: q_stride={} is shorter than q_heads * head_dim = {}", entry,
           q_stride, static_cast<int64_t>(s.q_heads) * s.head_dim);
  }
  if (static_cast<int64_t>(kv_stride) < static_cast<int64_t>(s.kv_heads) * s.head_dim) {
    refuse(ErrorKind::kInvalidArgument,
           "CausalAttentionCuda: {}: kv_stride={} is shorter than kv_heads * head_dim = {}", entry,
           kv_stride, static_cast<int64_t>(s.kv_heads) * s.head_dim);
  }
}

Params params_of(const AttentionShape& s, int q_stride, int kv_stride) {
  Params p{};
  p.seqlen = s.seqlen;
  p.q_heads = s.q_heads;
  p.group = s.q_heads / s.kv_heads;
  p.q_stride = q_stride;
  p.kv_stride = kv_stride;
  p.scale = static_cast<float>(s.softmax_scale);
  p.scale_log2 = static_cast<float>(s.softmax_scale * 1.4426950408889634);
  // out and dout have the row stride q_heads · head_dim, a multiple of 8 (so is head_dim).
  p.vec = q_stride % 8 == 0 && kv_stride % 8 == 0;
  return p;
}

dim3 query_grid(const AttentionShape& s) {
  return dim3(static_cast<unsigned>((s.seqlen + kTile - 1) / kTile),
              static_cast<unsigned>(s.q_heads), static_cast<unsigned>(s.batch));
}

}  // namespace

void CausalAttentionCuda::forward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                  int q_stride, int kv_stride, uint16_t* out, float* lse,
                                  void* stream) const {
  validate_strides(shape_, q_stride, kv_stride, "forward");
  require(q, "forward: q");
  require(k, "forward: k");
  require(v, "forward: v");
  require(out, "forward: out");
  require(lse, "forward: lse");
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  Params p = params_of(shape_, q_stride, kv_stride);
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lse_out = lse;
  p.vec = p.vec && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(out);
  const Kernels kernels = kernels_of(shape_.head_dim);
  const dim3 grid(
      static_cast<unsigned>((shape_.seqlen + kernels.forward_rows - 1) / kernels.forward_rows),
      static_cast<unsigned>(shape_.q_heads), static_cast<unsigned>(shape_.batch));
  kernels.forward<<<grid, kThreads, kernels.forward_smem, static_cast<cudaStream_t>(stream)>>>(p);
  MEGACPP_CUDA_CHECK_LAUNCH("forward_kernel");
}

void CausalAttentionCuda::backward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                   int q_stride, int kv_stride, const uint16_t* out,
                                   const uint16_t* dout, const float* lse, uint16_t* dq,
                                   uint16_t* dk, uint16_t* dv, void* stream) const {
  validate_strides(shape_, q_stride, kv_stride, "backward");
  require(q, "backward: q");
  require(k, "backward: k");
  require(v, "backward: v");
  require(out, "backward: out");
  require(dout, "backward: dout");
  require(lse, "backward: lse");
  require(dq, "backward: dq");
  require(dk, "backward: dk");
  require(dv, "backward: dv");
  const size_t needed = workspace_bytes(shape_);
  if (workspace_bytes_ < needed) {
    refuse(ErrorKind::kInvalidArgument,
           "CausalAttentionCuda::backward needs workspace_bytes(shape) = {} bytes of workspace, "
           "got {}",
           needed, workspace_bytes_);
  }
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  Params p = params_of(shape_, q_stride, kv_stride);
  p.q = q;
  p.k = k;
  p.v = v;
  p.dout = dout;
  p.lse_in = lse;
  p.delta = delta_;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  p.vec = p.vec && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout) &&
          aligned16(dq) && aligned16(dk) && aligned16(dv);

  const int64_t rows =
      static_cast<int64_t>(shape_.batch) * shape_.seqlen * static_cast<int64_t>(shape_.q_heads);
  const int64_t delta_blocks = (rows + kWarps - 1) / kWarps;
  if (delta_blocks > 2147483647) {
    refuse(ErrorKind::kInvalidArgument,
           "CausalAttentionCuda::backward: batch * seqlen * q_heads = {} rows are too many", rows);
  }
  delta_kernel<<<static_cast<unsigned>(delta_blocks), kThreads, 0, s>>>(
      rows, shape_.seqlen, shape_.q_heads, shape_.head_dim, out, dout, delta_);
  MEGACPP_CUDA_CHECK_LAUNCH("delta_kernel");

  const Kernels kernels = kernels_of(shape_.head_dim);
  const dim3 key_grid(static_cast<unsigned>((shape_.seqlen + kTile - 1) / kTile),
                      static_cast<unsigned>(shape_.kv_heads), static_cast<unsigned>(shape_.batch));
  kernels.dkdv<<<key_grid, kThreads, kernels.dkdv_smem, s>>>(p);
  MEGACPP_CUDA_CHECK_LAUNCH("dkdv_kernel");
  kernels.dq<<<query_grid(shape_), kThreads, kernels.dq_smem, s>>>(p);
  MEGACPP_CUDA_CHECK_LAUNCH("dq_kernel");
}

}  // namespace megacpp::cuda
