// A design probe for issue 10's redesign, not the product's scan: what the SISO backward's core
// costs when it is built the way the official Triton kernel (mamba3_siso_bwd_kernel_dqkv) is, one
// block per (batch, head) walking the chunks in reverse and carrying dL/d(state) on chip, with
// our model's weights and our precision rule (every product with the state on split hi + lo bf16
// operands, see chunk_backward_kernel's note). It answers one question before the redesign is
// built: does such a core fit the ~1.2 ms that chunk_dstate + chunk_backward must come to for the
// SISO goal (bench/RESULTS.md, session 31)?
//
// The core of the model's scan (kernels/cpu/mamba3_scan_chunked.h's notation, SISO: R = 1, one
// group) for one (batch, head): q̃_t = R(θ_t)(q_t + q_bias) and k̃_t likewise (rotation pairs
// (n, n + N/2) for n < A, rounded to bf16 once), l the chunk-local cumulative ADT, weights
// W_ts = e^{l_t − l_s} κ_s (s < t), γ_t (s = t), E_c the chunk's entry state (fp32, as the
// forward stores it), X = dL/d(exit state of c), last = C − 1:
//   y_t     = Σ_{s≤t} (q̃_t·k̃_s) W_ts v_s + e^{l_t} E_c q̃_t + D v_t
//   E_{c+1} = e^{l_last} E_c + Σ_s e^{l_last − l_s} κ_s v_s k̃_sᵀ
// and, with dA_ts = dO_t·v_s, S_ts = q̃_t·k̃_s, G_ts = dA_ts S_ts W_ts (s < t):
//   dq̃_t = Σ_{s≤t} dA_ts W_ts k̃_s + e^{l_t} E_cᵀ dO_t
//   dk̃_s = Σ_{t≥s} dA_ts W_ts q̃_t + e^{l_last − l_s} κ_s Xᵀ v_s
//   dv_s  = Σ_{t≥s} S_ts W_ts dO_t + e^{l_last − l_s} κ_s X k̃_s + D dO_s
//   dl_t  = Σ_{s<t} G_ts − Σ_{u>t} G_ut + e^{l_t} dO_t·(E_c q̃_t) − e^{l_last − l_t} κ_t v_t·(X k̃_t)
//           + [t = last] (Σ_s e^{l_last − l_s} κ_s v_s·(X k̃_s) + e^{l_last} <E_c, X>);
//   dADT_u = Σ_{t ≥ u of the chunk} dl_t
//   dκ_s  = Σ_{t>s} dA_ts S_ts e^{l_t − l_s} + e^{l_last − l_s} v_s·(X k̃_s),  dγ_t = dA_tt S_tt
//   dq_t = R(θ_t)ᵀ dq̃_t, dθ_t (pair n) = the q and k terms −dq̃_n q̃_{n+N/2} + dq̃_{n+N/2} q̃_n,
//   dD = Σ_t dO_t·v_t, and X for chunk c − 1: e^{l_last} X + Σ_t e^{l_t} dO_t q̃_tᵀ.
// The un-rotation and dθ, which the official structure does in its rotary_bias_angles kernel, are
// here. What stays outside, as there: the gating (dO from dy; dz: the official dzdo, 0.169 ms at
// M3-ref), the sums of dq and dk over a group's heads and over tokens (the biases' gradients; in
// the official rotary_bias_angles), the suffix sums of dθ over later chunks and the dt/trap chain
// from dκ, dγ and dADT (the official angle_dt_bwd, 0.238 ms; our dtheta_offsets and
// finish_tokens, 0.13 ms).
//
// Its shared memory (about 201 KB a block) needs a Hopper GPU; on another it says so and stops.
//
// Usage: sweep_backward_probe [--repeats N] [--batch B] [--seqlen T] [--heads H]
//        sweep_backward_probe --reference-only   (the reference's finite-difference check; no GPU)
// Prints, for each variant (state operands plain bf16 as the official kernel's, or split hi + lo
// as ours; every score block computed, or the causal mask's zero blocks skipped), its errors
// against a double-precision reference (entry states from the forward recurrence) on two cases:
// a small one, on which the reference is checked against finite differences of that forward, and
// one at the correctness grid's sequence length (2048) without an initial state, as in the
// product, where dθ's suffix sums over the sequence (the angle gradient's small remainder of large
// terms) are compared too. Then its time at the given shape (default M3-ref SISO: batch 8, seqlen
// 8192, H 16, N = P = 64, chunk 64, A = 16 rotating pairs), CUDA events, min/median/max of the
// repeats after two warm-ups.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/common.cuh"

namespace {

using megacpp::cuda::bf16;
using megacpp::cuda::commit_copies;
using megacpp::cuda::copy_16_async;
using megacpp::cuda::ldmatrix_x4;
using megacpp::cuda::mma_bf16_16816;
using megacpp::cuda::pack_bf16;
using megacpp::cuda::split_bf16;
using megacpp::cuda::to_f;
using megacpp::cuda::wait_copies;
using megacpp::cuda::warp_sum;

constexpr int kC = 64, kN = 64, kP = 64, kA = 16;
// bf16 row stride of every [64][64] operand: ldmatrix rows on distinct banks.
constexpr int kLd = 72;
constexpr int kTile = kC * kLd;
constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int kAngleLd = kA + 1;  // fp32 row stride of cos, sin and the dθ parts
// The most a kernel's gradient may differ from the double reference (max|Δ|/max|ref|): our scan
// test's bound for the gradients.
constexpr double kTolerance = 0.012;

struct Inputs {
  const bf16 *q, *k;             // [B][T][N]: the group's (one group)
  const float *q_bias, *k_bias;  // [H][N]
  const float* theta;            // [B][H][T][A]
  const bf16 *v, *d_out;         // [B][T][H][P]
  const float* log_decay;        // [B][H][T]: l, cumulative within the chunk
  const float *kappa, *gamma;    // [B][H][T]
  const float* entry_states;     // [B][H][chunks][P][N]
  const float* skip;             // [H]: D
  int batch, seqlen, heads;
};

struct Outputs {
  float *dq, *dk;                    // [B][T][H][N]: each head's, w.r.t. q and k (un-rotated)
  float* dv;                         // [B][T][H][P]
  float *d_adt, *d_kappa, *d_gamma;  // [B][H][T]
  float* d_theta;    // [B][H][T][A]: each token's own (not yet summed over later ones)
  float* d_skip;     // [B][H]
  float* d_initial;  // [B][H][P][N]: dL/d(entry state of chunk 0)
};

constexpr int kEntryLd = kN + 4;  // fp32 row stride of E_c: the X fragments' reads 2-way, not 8

// Shared memory: two stages of the chunk's q and k (rotated in place once in), v, dO (bf16
// [C][kLd]), E_c (fp32 [P][kEntryLd]), θ, l, κ and γ; then the chunk's cos θ and sin θ, the split
// operands (E and X: rows p, columns n; e^{l} dO: rows t, columns p; hi and lo each), and the
// per-token parts that a chunk's warps leave for the next chunk to finish (two slots: dl's, the
// exit terms, <E, X>, and dθ's q and k terms).
struct Smem {
  bf16 q[2][kTile], k[2][kTile], v[2][kTile], d_out[2][kTile];
  float entry[2][kP * kEntryLd];
  float theta[2][kC * kA];
  float log_decay[2][kC], kappa[2][kC], gamma[2][kC];
  float cos_theta[kC * kAngleLd], sin_theta[kC * kAngleLd];
  bf16 e_hi[kTile], e_lo[kTile], x_hi[kTile], x_lo[kTile], ds_hi[kTile], ds_lo[kTile];
  float dl_query[2][kC], dl_key[2][kC], exit_terms[2][kC], dot_total[2];
  float d_theta[2][2][kC * kAngleLd];
  float dot_parts[4];
};

// lane's ldmatrix row address within a 16×16 operand block, as accumulate_tile (common.cuh) takes
// it: A [m][k] non-transposed, B as [n][k] non-transposed, B as [k][n] transposed, A as [k][m]
// transposed.
struct LaneAddress {
  int a_row, a_col, bn_row, bn_col, bt_row, bt_col, at_row, at_col;
  __device__ explicit LaneAddress(int lane) {
    const int lo8 = lane % 8, second = (lane / 8) % 2, upper = lane / 16;
    a_row = lo8 + 8 * second, a_col = 8 * upper;
    bn_row = lo8 + 8 * upper, bn_col = 8 * second;
    bt_row = lo8 + 8 * second, bt_col = 8 * upper;
    at_row = lo8 + 8 * upper, at_col = 8 * second;
  }
};

// acc[8][4] (16 rows × 64 columns, eight n-tiles) += A(16 rows from r0 of `a`, [m][k]) × Bᵀ where
// `b` holds B as [n][k] (rows n): both non-transposed, k = 64; only the 16-column blocks first …
// last (the causal mask's nonzero ones; the others are left as they are).
__device__ __forceinline__ void rows_times_rows(float (&acc)[8][4], const bf16* a, int r0,
                                                const bf16* b, const LaneAddress& at, int first,
                                                int last) {
#pragma unroll
  for (int k0 = 0; k0 < 64; k0 += 16) {
    uint32_t af[4];
    ldmatrix_x4<false>(af, a + (r0 + at.a_row) * kLd + k0 + at.a_col);
#pragma unroll
    for (int n0 = 0; n0 < 64; n0 += 16) {
      if (n0 / 16 < first || n0 / 16 > last) continue;
      uint32_t bf[4];
      ldmatrix_x4<false>(bf, b + (n0 + at.bn_row) * kLd + k0 + at.bn_col);
      mma_bf16_16816(acc[n0 / 8], af, bf[0], bf[1]);
      mma_bf16_16816(acc[n0 / 8 + 1], af, bf[2], bf[3]);
    }
  }
}

// acc[kTiles][4] += A(16 rows from r0 of `a`, [m][k]) × B, B held as [k][n] (`b`, columns from
// c0): B transposed by ldmatrix, k = 64.
template <int kTiles>
__device__ __forceinline__ void rows_times_cols(float (&acc)[kTiles][4], const bf16* a, int r0,
                                                const bf16* b, int c0, const LaneAddress& at) {
#pragma unroll
  for (int k0 = 0; k0 < 64; k0 += 16) {
    uint32_t af[4];
    ldmatrix_x4<false>(af, a + (r0 + at.a_row) * kLd + k0 + at.a_col);
#pragma unroll
    for (int n0 = 0; n0 < kTiles * 8; n0 += 16) {
      uint32_t bf[4];
      ldmatrix_x4<true>(bf, b + (k0 + at.bt_row) * kLd + c0 + n0 + at.bt_col);
      mma_bf16_16816(acc[n0 / 8], af, bf[0], bf[1]);
      mma_bf16_16816(acc[n0 / 8 + 1], af, bf[2], bf[3]);
    }
  }
}

// acc[8][4] += F × B where F (16 × 64, k = the chunk's tokens) is in registers as C fragments
// (f[8][4], rounded to bf16 here) and B is held as [k][n] (`b`): transposed by ldmatrix; only the
// k blocks of 16 first … last (F is zero elsewhere).
__device__ __forceinline__ void frags_times_cols(float (&acc)[8][4], const float (&f)[8][4],
                                                 const bf16* b, const LaneAddress& at, int first,
                                                 int last) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    if (kk < first || kk > last) continue;
    const uint32_t af[4] = {pack_bf16(f[2 * kk][0], f[2 * kk][1]),
                            pack_bf16(f[2 * kk][2], f[2 * kk][3]),
                            pack_bf16(f[2 * kk + 1][0], f[2 * kk + 1][1]),
                            pack_bf16(f[2 * kk + 1][2], f[2 * kk + 1][3])};
#pragma unroll
    for (int n0 = 0; n0 < 64; n0 += 16) {
      uint32_t bf[4];
      ldmatrix_x4<true>(bf, b + (16 * kk + at.bt_row) * kLd + n0 + at.bt_col);
      mma_bf16_16816(acc[n0 / 8], af, bf[0], bf[1]);
      mma_bf16_16816(acc[n0 / 8 + 1], af, bf[2], bf[3]);
    }
  }
}

__device__ __forceinline__ void zero(float (&acc)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
}

// The four lanes of a quad hold one row's columns: their sum, in every lane of the quad.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// acc = A (16 rows from r0 of `a`, [t][p]) × a state held as [p][n] (its hi part, plus its lo
// part when kSplit), and each row's dot with `rows` (the same tokens' rotated q or k): dl's state
// term for the row before its scale.
template <bool kSplit>
__device__ __forceinline__ void state_product(float (&acc)[8][4], float (&dots)[2], const bf16* a,
                                              const bf16* hi, const bf16* lo, const bf16* rows,
                                              int r0, int g, int c4, const LaneAddress& at) {
  zero(acc);
  rows_times_cols<8>(acc, a, r0, hi, 0, at);
  if constexpr (kSplit) rows_times_cols<8>(acc, a, r0, lo, 0, at);
  dots[0] = dots[1] = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = r0 + g + 8 * (e / 2), n = 8 * j + 2 * c4 + e % 2;
      dots[e / 2] += acc[j][e] * to_f(rows[t * kLd + n]);
    }
  }
}

// dθ's terms of the rows r0 … r0 + 15 into d_theta_part, and acc (dL/d(rotated) of those rows, all
// columns) un-rotated in place: w.r.t. q or k as they came in. `rotated` holds the rotated rows
// as rounded (the values every product used). A thread's columns n and n + N/2 are its tiles j and
// j + 4, so each pair is in one thread.
__device__ __forceinline__ void unrotate(float (&acc)[8][4], const bf16* rotated,
                                         const float* cos_theta, const float* sin_theta,
                                         float* d_theta_part, int r0, int g, int c4) {
#pragma unroll
  for (int j = 0; j < kA / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = r0 + g + 8 * (e / 2), n = 8 * j + 2 * c4 + e % 2;
      const float d_first = acc[j][e], d_second = acc[j + 4][e];
      const float first = to_f(rotated[t * kLd + n]), second = to_f(rotated[t * kLd + n + kN / 2]);
      d_theta_part[t * kAngleLd + n] = d_second * first - d_first * second;
      const float c = cos_theta[t * kAngleLd + n], s = sin_theta[t * kAngleLd + n];
      acc[j][e] = d_first * c + d_second * s;
      acc[j + 4][e] = d_second * c - d_first * s;
    }
  }
}

// The rows r0 … r0 + 15 of acc (all 64 columns) to a [B][T][H][64] fp32 tensor.
__device__ __forceinline__ void store_rows(float* to, const float (&acc)[8][4], size_t first_row,
                                           int heads, int r0, int g, int c4) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const size_t row = first_row + static_cast<size_t>(r0 + g + 8 * half) * heads;
      *reinterpret_cast<float2*>(to + row * 64 + 8 * j + 2 * c4) =
          make_float2(acc[j][2 * half], acc[j][2 * half + 1]);
    }
  }
}

// Warps 0-3 are the query side (rows of 16 tokens: dq and dγ, and X's 16 rows each), warps 4-7
// the key side (dk, dv, dκ): a scheduler (warp % 4) holds query block i, whose causal work grows
// with i, and key block i, whose work shrinks with it.
// kSplit: the products with E, X and e^{l} dO take hi + lo operands (two mma each).
// kCausal: the score blocks the causal mask zeroes whole are neither computed nor multiplied
// (false: every block, masked, as the official kernel does).
template <bool kSplit, bool kCausal>
__global__ void __launch_bounds__(kThreads, 1) sweep_backward(Inputs in, Outputs out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int h = blockIdx.x, b = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c4 = lane % 4;
  const int H = in.heads, T = in.seqlen, chunks = T / kC;
  const LaneAddress at(lane);
  const bool query_side = warp < 4;
  const int r0 = 16 * (warp % 4), block = warp % 4;
  float x[8][4];  // query warps: X's rows r0 … r0 + 15, all 64 columns
  zero(x);
  const size_t bh = static_cast<size_t>(b) * H + h;
  const float skip = in.skip[h];
  float d_skip = 0.f;
  // A thread rotates the pairs (n, n + N/2) of column n = lane in rows warp, warp + 8, ...
  const float q_bias[2] = {in.q_bias[h * kN + lane], in.q_bias[h * kN + lane + kN / 2]};
  const float k_bias[2] = {in.k_bias[h * kN + lane], in.k_bias[h * kN + lane + kN / 2]};

  // A thread's copies are the same rows of every chunk: row thread / 8 (and + 32) of each of q,
  // k, v, dO, its 16-byte part thread % 8; E's quads thread, + 256, ...; θ's quad thread; l, κ, γ
  // by 48 threads.
  const int copy_row = threadIdx.x / 8, copy_part = threadIdx.x % 8;
  const size_t qk_offset = (static_cast<size_t>(b) * T + copy_row) * kN + copy_part * 8;
  const size_t vo_offset = ((static_cast<size_t>(b) * T + copy_row) * H + h) * 64 + copy_part * 8;
  const auto load_chunk = [&](int c, int stage) {
    const size_t t0 = static_cast<size_t>(c) * kC;
    const bf16* const sources[4] = {in.q + t0 * kN, in.k + t0 * kN, in.v + t0 * H * 64,
                                    in.d_out + t0 * H * 64};
    bf16* const targets[4] = {sm.q[stage], sm.k[stage], sm.v[stage], sm.d_out[stage]};
#pragma unroll
    for (int which = 0; which < 4; ++which) {
      const size_t offset = which < 2 ? qk_offset : vo_offset;
      const size_t half_chunk = static_cast<size_t>(32) * (which < 2 ? kN : H * 64);
      copy_16_async(targets[which] + copy_row * kLd + copy_part * 8, sources[which] + offset, true);
      copy_16_async(targets[which] + (copy_row + 32) * kLd + copy_part * 8,
                    sources[which] + offset + half_chunk, true);
    }
    const float* entry = in.entry_states + (bh * chunks + c) * kP * kN;
#pragma unroll
    for (int i = 0; i < kP * kN / 4 / kThreads; ++i) {
      const int quad = threadIdx.x + i * kThreads, row = quad / (kN / 4), col = quad % (kN / 4) * 4;
      copy_16_async(sm.entry[stage] + row * kEntryLd + col, entry + quad * 4, true);
    }
    copy_16_async(sm.theta[stage] + threadIdx.x * 4,
                  in.theta + (bh * T + t0) * kA + threadIdx.x * 4, true);
    if (threadIdx.x < 48) {
      const int part = threadIdx.x % 16;
      const float* source = threadIdx.x < 16   ? in.log_decay
                            : threadIdx.x < 32 ? in.kappa
                                               : in.gamma;
      float* target = threadIdx.x < 16   ? sm.log_decay[stage]
                      : threadIdx.x < 32 ? sm.kappa[stage]
                                         : sm.gamma[stage];
      copy_16_async(target + part * 4, source + bh * T + t0 + part * 4, true);
    }
    commit_copies();
  };

  // Chunk c's per-token results from the parts its warps left in slot c % 2: dθ (the q and k
  // terms added; the four query warps), and dl, the last token's with the chunk's exit terms and
  // e^{l_last} <E_c, X>, its suffix sums within the chunk being dADT (warp 0; a fixed order).
  const auto finish_chunk = [&](int c) {
    const int slot = c % 2;
    const size_t t0 = static_cast<size_t>(c) * kC;
    for (int item = threadIdx.x; item < kC * kA; item += 128) {
      const int t = item / kA, n = item % kA;
      out.d_theta[(bh * T + t0 + t) * kA + n] =
          sm.d_theta[slot][0][t * kAngleLd + n] + sm.d_theta[slot][1][t * kAngleLd + n];
    }
    if (warp != 0) return;
    const float exit_total = warp_sum(sm.exit_terms[slot][lane] + sm.exit_terms[slot][lane + 32]);
    const float first = sm.dl_query[slot][lane] + sm.dl_key[slot][lane];
    float second = sm.dl_query[slot][lane + 32] + sm.dl_key[slot][lane + 32];
    if (lane == 31) second += exit_total + sm.dot_total[slot];
    float later = second;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float y = __shfl_down_sync(0xffffffffu, later, offset);
      if (lane + offset < 32) later += y;
    }
    const float second_total = __shfl_sync(0xffffffffu, later, 0);
    float earlier = first;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float y = __shfl_down_sync(0xffffffffu, earlier, offset);
      if (lane + offset < 32) earlier += y;
    }
    out.d_adt[bh * T + t0 + lane] = earlier + second_total;
    out.d_adt[bh * T + t0 + lane + 32] = later;
  };

  load_chunk(chunks - 1, (chunks - 1) % 2);
  for (int c = chunks - 1; c >= 0; --c) {
    const int stage = c % 2, slot = c % 2;
    const size_t first_row = (static_cast<size_t>(b) * T + static_cast<size_t>(c) * kC) * H + h;
    wait_copies<0>();
    // Barrier 1: the stage is in; every read of chunk c + 1's operands and parts is done.
    __syncthreads();
    if (c > 0) load_chunk(c - 1, (c - 1) % 2);
    bf16 *q = sm.q[stage], *k = sm.k[stage];
    const bf16 *v = sm.v[stage], *d_out = sm.d_out[stage];
    const float *l = sm.log_decay[stage], *kappa = sm.kappa[stage], *gamma = sm.gamma[stage];
    const float* entry = sm.entry[stage];
    const float l_last = l[kC - 1];
    const float *cos_theta = sm.cos_theta, *sin_theta = sm.sin_theta;
    const bf16 *x_hi = sm.x_hi, *x_lo = sm.x_lo;

    // The chunk's operands: X split from the query warps' registers (with <E_c, X>, X the
    // gradient of this chunk's exit state); q and k rotated in place; E and e^{l} dO split.
    if (query_side) {
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * c4;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = r0 + g + 8 * half;
          const float x0 = x[j][2 * half], x1 = x[j][2 * half + 1];
          const float2 e = *reinterpret_cast<const float2*>(entry + row * kEntryLd + col);
          dot += x0 * e.x + x1 * e.y;
          if constexpr (kSplit) {
            uint32_t hi, lo;
            split_bf16(x0, x1, hi, lo);
            *reinterpret_cast<uint32_t*>(sm.x_hi + row * kLd + col) = hi;
            *reinterpret_cast<uint32_t*>(sm.x_lo + row * kLd + col) = lo;
          } else {
            *reinterpret_cast<uint32_t*>(sm.x_hi + row * kLd + col) = pack_bf16(x0, x1);
          }
        }
      }
      dot = warp_sum(dot);
      if (lane == 0) sm.dot_parts[warp] = dot;
    }
    for (int t = warp; t < kC; t += kWarps) {
      const int n = lane;
      const float q_first = to_f(q[t * kLd + n]) + q_bias[0];
      const float q_second = to_f(q[t * kLd + n + kN / 2]) + q_bias[1];
      const float k_first = to_f(k[t * kLd + n]) + k_bias[0];
      const float k_second = to_f(k[t * kLd + n + kN / 2]) + k_bias[1];
      float c_ = 1.f, s_ = 0.f;
      if (n < kA) {
        __sincosf(sm.theta[stage][t * kA + n], &s_, &c_);
        sm.cos_theta[t * kAngleLd + n] = c_;
        sm.sin_theta[t * kAngleLd + n] = s_;
      }
      q[t * kLd + n] = __float2bfloat16(q_first * c_ - q_second * s_);
      q[t * kLd + n + kN / 2] = __float2bfloat16(q_first * s_ + q_second * c_);
      k[t * kLd + n] = __float2bfloat16(k_first * c_ - k_second * s_);
      k[t * kLd + n + kN / 2] = __float2bfloat16(k_first * s_ + k_second * c_);
    }
    for (int item = threadIdx.x; item < kP * kN / 2; item += kThreads) {
      const int row = item / (kN / 2), col = item % (kN / 2) * 2;
      const float2 e = *reinterpret_cast<const float2*>(entry + row * kEntryLd + col);
      const float scale = __expf(l[row]);
      const float s0 = to_f(d_out[row * kLd + col]) * scale;
      const float s1 = to_f(d_out[row * kLd + col + 1]) * scale;
      if constexpr (kSplit) {
        uint32_t hi, lo;
        split_bf16(e.x, e.y, hi, lo);
        *reinterpret_cast<uint32_t*>(sm.e_hi + row * kLd + col) = hi;
        *reinterpret_cast<uint32_t*>(sm.e_lo + row * kLd + col) = lo;
        split_bf16(s0, s1, hi, lo);
        *reinterpret_cast<uint32_t*>(sm.ds_hi + row * kLd + col) = hi;
        *reinterpret_cast<uint32_t*>(sm.ds_lo + row * kLd + col) = lo;
      } else {
        *reinterpret_cast<uint32_t*>(sm.e_hi + row * kLd + col) = pack_bf16(e.x, e.y);
        *reinterpret_cast<uint32_t*>(sm.ds_hi + row * kLd + col) = pack_bf16(s0, s1);
      }
    }
    // Barrier 2: the operands and the dot's parts are in.
    __syncthreads();

    if (query_side) {
      // Chunk c + 1's parts are complete (barrier 1); the query warps, with the lighter share of
      // the causal work, finish them.
      if (c + 1 < chunks) finish_chunk(c + 1);
      if (warp == 0) {
        sm.dot_total[slot] = __expf(l_last) * (sm.dot_parts[0] + sm.dot_parts[1] + sm.dot_parts[2] +
                                               sm.dot_parts[3]);
      }
      // S = Q̃ K̃ᵀ and dA = dO Vᵀ for the warp's 16 query rows, weighted by W; G's row sums and dγ.
      // Keys after the warp's last query row have no weight: their blocks are not computed.
      const int last = kCausal ? block : 3;
      float s[8][4], da[8][4];
      zero(s);
      zero(da);
      rows_times_rows(s, q, r0, k, at, 0, last);
      rows_times_rows(da, d_out, r0, v, at, 0, last);
      float dl_rows[2] = {0.f, 0.f}, d_gamma[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j / 2 > last) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = r0 + g + 8 * (e / 2), u = 8 * j + 2 * c4 + e % 2;
          const float product = da[j][e] * s[j][e];
          float w = 0.f;
          if (u < t) {
            w = __expf(l[t] - l[u]) * kappa[u];
            dl_rows[e / 2] += product * w;
          } else if (u == t) {
            w = gamma[t];
            d_gamma[e / 2] += product;
          }
          da[j][e] *= w;
        }
      }
      // dq̃: the state's part first (its dot with q̃ is dl's inter term), then the chunk's.
      float acc[8][4];
      float inter[2];
      state_product<kSplit>(acc, inter, d_out, sm.e_hi, sm.e_lo, q, r0, g, c4, at);
      float scale[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = r0 + g + 8 * half;
        scale[half] = __expf(l[t]);
        dl_rows[half] = quad_sum(dl_rows[half] + scale[half] * inter[half]);
        d_gamma[half] = quad_sum(d_gamma[half]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] *= scale[e / 2];
      }
      frags_times_cols(acc, da, k, at, 0, last);
      unrotate(acc, q, cos_theta, sin_theta, sm.d_theta[slot][0], r0, g, c4);
      store_rows(out.dq, acc, first_row, H, r0, g, c4);
      if (c4 == 0) {
        sm.dl_query[slot][r0 + g] = dl_rows[0];
        sm.dl_query[slot][r0 + g + 8] = dl_rows[1];
        out.d_gamma[bh * T + static_cast<size_t>(c) * kC + r0 + g] = d_gamma[0];
        out.d_gamma[bh * T + static_cast<size_t>(c) * kC + r0 + g + 8] = d_gamma[1];
      }
      // X for chunk c − 1: e^{l_last} X + (e^{l} dO)ᵀ Q̃, the warp's 16 rows.
      float update[8][4];
      zero(update);
#pragma unroll
      for (int part = 0; part < (kSplit ? 2 : 1); ++part) {
        const bf16* ds = part == 0 ? sm.ds_hi : sm.ds_lo;
#pragma unroll
        for (int k0 = 0; k0 < 64; k0 += 16) {
          uint32_t af[4];
          ldmatrix_x4<true>(af, ds + (k0 + at.at_row) * kLd + r0 + at.at_col);
#pragma unroll
          for (int n0 = 0; n0 < 64; n0 += 16) {
            uint32_t bf[4];
            ldmatrix_x4<true>(bf, q + (k0 + at.bt_row) * kLd + n0 + at.bt_col);
            mma_bf16_16816(update[n0 / 8], af, bf[0], bf[1]);
            mma_bf16_16816(update[n0 / 8 + 1], af, bf[2], bf[3]);
          }
        }
      }
      const float decay = __expf(l_last);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) x[j][e] = decay * x[j][e] + update[j][e];
      }
    } else {
      // Sᵀ = K̃ Q̃ᵀ and dAᵀ = V dOᵀ for the warp's 16 key rows, weighted by Wᵀ; dκ's chunk part.
      // Queries before the warp's first key row give no weight.
      const int first = kCausal ? block : 0;
      float st[8][4], dat[8][4];
      zero(st);
      zero(dat);
      rows_times_rows(st, k, r0, q, at, first, 3);
      rows_times_rows(dat, v, r0, d_out, at, first, 3);
      float dl_rows[2] = {0.f, 0.f}, d_kappa[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j / 2 < first) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int s_row = r0 + g + 8 * (e / 2), u = 8 * j + 2 * c4 + e % 2;
          const float product = dat[j][e] * st[j][e];
          float w = 0.f;
          if (u > s_row) {
            const float decay = __expf(l[u] - l[s_row]);
            d_kappa[e / 2] += product * decay;
            w = decay * kappa[s_row];
            dl_rows[e / 2] -= product * w;
          } else if (u == s_row) {
            w = gamma[s_row];
          }
          st[j][e] *= w;
          dat[j][e] *= w;
        }
      }
      // dk̃: Xᵀ v's part first (its dot with k̃ is dl's and dκ's exit term), then the chunk's.
      float acc[8][4];
      float exit_term[2];
      state_product<kSplit>(acc, exit_term, v, x_hi, x_lo, k, r0, g, c4, at);
      float scale[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int s_row = r0 + g + 8 * half;
        const float exit_decay = __expf(l_last - l[s_row]);
        scale[half] = exit_decay * kappa[s_row];
        const float raw = quad_sum(exit_term[half]);
        const float term = scale[half] * raw;
        dl_rows[half] = quad_sum(dl_rows[half]) - term;
        d_kappa[half] = quad_sum(d_kappa[half]) + exit_decay * raw;
        if (c4 == 0) {
          sm.exit_terms[slot][s_row] = term;
          sm.dl_key[slot][s_row] = dl_rows[half];
          out.d_kappa[bh * T + static_cast<size_t>(c) * kC + s_row] = d_kappa[half];
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] *= scale[e / 2];
      }
      frags_times_cols(acc, dat, q, at, first, 3);
      unrotate(acc, k, cos_theta, sin_theta, sm.d_theta[slot][1], r0, g, c4);
      store_rows(out.dk, acc, first_row, H, r0, g, c4);
      // dv: X k̃'s part (X's rows p are B's rows n), the chunk's, and D's.
      zero(acc);
      rows_times_rows(acc, k, r0, x_hi, at, 0, 3);
      if constexpr (kSplit) rows_times_rows(acc, k, r0, x_lo, at, 0, 3);
      float own[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int s_row = r0 + g + 8 * (e / 2), p = 8 * j + 2 * c4 + e % 2;
          const float o = to_f(d_out[s_row * kLd + p]);
          own[e / 2] += o * to_f(v[s_row * kLd + p]);
          acc[j][e] = acc[j][e] * scale[e / 2] + skip * o;
        }
      }
      frags_times_cols(acc, st, d_out, at, first, 3);
      store_rows(out.dv, acc, first_row, H, r0, g, c4);
      d_skip += quad_sum(own[0]) + quad_sum(own[1]);
    }
  }
  __syncthreads();
  if (query_side) finish_chunk(0);
  // dL/d(entry state of chunk 0) and this pair's dD.
  if (query_side) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = r0 + g + 8 * half, col = 8 * j + 2 * c4;
        *reinterpret_cast<float2*>(out.d_initial + (bh * kP + row) * kN + col) =
            make_float2(x[j][2 * half], x[j][2 * half + 1]);
      }
    }
  } else {
    // Each quad's lanes hold the same sums: lane 0 of each quad counts them once.
    d_skip = warp_sum(c4 == 0 ? d_skip : 0.f);
    if (lane == 0) sm.dot_parts[warp - 4] = d_skip;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    out.d_skip[bh] = sm.dot_parts[0] + sm.dot_parts[1] + sm.dot_parts[2] + sm.dot_parts[3];
  }
}

void ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

float bf(const bf16& x) {
  return __bfloat162float(x);
}

// One case's inputs on the host (bf16 ones rounded already, as the kernel sees them) and the
// reference's gradients, in double.
struct HostCase {
  int batch, seqlen, heads, chunks;
  std::vector<bf16> q, k, v, d_out;
  std::vector<float> q_bias, k_bias, theta, adt, log_decay, kappa, gamma, skip, initial_state,
      entry_states;
  std::vector<double> dq, dk, dv, d_adt, d_kappa, d_gamma, d_theta, d_skip, d_initial;
  size_t group_token(int b, int t) const { return static_cast<size_t>(b) * seqlen + t; }
  size_t token(int b, int t, int h) const {
    return (static_cast<size_t>(b) * seqlen + t) * heads + h;
  }
  size_t pair_token(int b, int h, int t) const {
    return (static_cast<size_t>(b) * heads + h) * seqlen + t;
  }
};

// initial_scale 0: no initial state, as in the product's scan (then θ enters only through
// differences θ_t − θ_s, and the per-token dθ of a (batch, head) sum to about zero).
HostCase make_case(int batch, int seqlen, int heads, uint64_t seed, float initial_scale) {
  HostCase hc;
  hc.batch = batch, hc.seqlen = seqlen, hc.heads = heads, hc.chunks = seqlen / kC;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.f, 1.f), decay(0.01f, 0.15f), positive(0.2f, 1.f);
  const size_t tokens = static_cast<size_t>(batch) * seqlen, rows = tokens * heads;
  const auto fill = [&](std::vector<bf16>& x, size_t count, float scale) {
    x.resize(count);
    for (auto& e : x) e = __float2bfloat16(unit(rng) * scale);
  };
  fill(hc.q, tokens * kN, 0.5f);
  fill(hc.k, tokens * kN, 0.5f);
  fill(hc.v, rows * kP, 1.f);
  fill(hc.d_out, rows * kP, 1.f);
  hc.q_bias.resize(static_cast<size_t>(heads) * kN);
  hc.k_bias.resize(hc.q_bias.size());
  for (auto& e : hc.q_bias) e = unit(rng) * 0.2f;
  for (auto& e : hc.k_bias) e = unit(rng) * 0.2f;
  hc.theta.resize(rows * kA);
  for (auto& e : hc.theta) e = unit(rng) * 3.f;
  hc.adt.resize(rows);
  hc.log_decay.resize(rows);
  hc.kappa.resize(rows);
  hc.gamma.resize(rows);
  for (size_t i = 0; i < rows; ++i) {
    hc.adt[i] = -decay(rng);
    hc.kappa[i] = positive(rng);
    hc.gamma[i] = positive(rng);
  }
  hc.skip.resize(heads);
  for (auto& e : hc.skip) e = unit(rng);
  hc.initial_state.resize(static_cast<size_t>(batch) * heads * kP * kN);
  for (auto& e : hc.initial_state) e = unit(rng) * initial_scale;
  return hc;
}

// q̃ or k̃ of (b, t, h) in double, unrounded: the oracle's.
void rotated(const HostCase& hc, const std::vector<bf16>& x, const std::vector<float>& bias, int b,
             int t, int h, double* out) {
  const size_t row = hc.group_token(b, t);
  for (int n = 0; n < kN / 2; ++n) {
    const double first = bf(x[row * kN + n]) + bias[h * kN + n];
    const double second = bf(x[row * kN + n + kN / 2]) + bias[h * kN + n + kN / 2];
    double c = 1.0, s = 0.0;
    if (n < kA) {
      const double angle = hc.theta[hc.pair_token(b, h, t) * kA + n];
      c = std::cos(angle), s = std::sin(angle);
    }
    out[n] = first * c - second * s;
    out[n + kN / 2] = first * s + second * c;
  }
}

// l from adt, the entry states of the forward recurrence (stored fp32 when asked; the states are
// rounded to fp32 at each chunk's entry, as the kernel reads them) and the loss Σ_t dO_t·y_t.
double forward(HostCase& hc, bool store_states) {
  const int B = hc.batch, H = hc.heads, chunks = hc.chunks;
  if (store_states) hc.entry_states.assign(static_cast<size_t>(B) * H * chunks * kP * kN, 0.f);
  double loss = 0.0;
  std::vector<double> state(kP * kN), l(kC), qr(kC * kN), kr(kC * kN);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const size_t bh = static_cast<size_t>(b) * H + h;
      for (int i = 0; i < kP * kN; ++i) state[i] = hc.initial_state[bh * kP * kN + i];
      for (int c = 0; c < chunks; ++c) {
        const int t0 = c * kC;
        double cumulative = 0.0;
        for (int t = 0; t < kC; ++t) {
          cumulative += hc.adt[hc.pair_token(b, h, t0 + t)];
          l[t] = cumulative;
          hc.log_decay[hc.pair_token(b, h, t0 + t)] = static_cast<float>(cumulative);
          rotated(hc, hc.q, hc.q_bias, b, t0 + t, h, &qr[t * kN]);
          rotated(hc, hc.k, hc.k_bias, b, t0 + t, h, &kr[t * kN]);
        }
        float* entry =
            store_states ? hc.entry_states.data() + (bh * chunks + c) * kP * kN : nullptr;
        for (int i = 0; i < kP * kN; ++i) {
          state[i] = static_cast<float>(state[i]);
          if (entry != nullptr) entry[i] = static_cast<float>(state[i]);
        }
        const auto V = [&](int t, int p) {
          return bf(hc.v[hc.token(b, t0 + t, h) * kP + p]);
        };
        const auto weight = [&](int t, int s) {
          return s < t ? std::exp(l[t] - l[s]) * hc.kappa[hc.pair_token(b, h, t0 + s)]
                       : hc.gamma[hc.pair_token(b, h, t0 + t)];
        };
        for (int t = 0; t < kC; ++t) {
          const size_t tt = hc.token(b, t0 + t, h);
          std::vector<double> scores(t + 1);
          for (int s = 0; s <= t; ++s) {
            double score = 0.0;
            for (int n = 0; n < kN; ++n) score += qr[t * kN + n] * kr[s * kN + n];
            scores[s] = score * weight(t, s);
          }
          for (int p = 0; p < kP; ++p) {
            double y = 0.0;
            for (int n = 0; n < kN; ++n) y += state[p * kN + n] * qr[t * kN + n];
            y *= std::exp(l[t]);
            for (int s = 0; s <= t; ++s) y += scores[s] * V(s, p);
            y += hc.skip[h] * V(t, p);
            loss += bf(hc.d_out[tt * kP + p]) * y;
          }
        }
        const double l_last = l[kC - 1];
        for (int p = 0; p < kP; ++p) {
          for (int n = 0; n < kN; ++n) {
            double next = std::exp(l_last) * state[p * kN + n];
            for (int s = 0; s < kC; ++s) {
              next += std::exp(l_last - l[s]) * hc.kappa[hc.pair_token(b, h, t0 + s)] * V(s, p) *
                      kr[s * kN + n];
            }
            state[p * kN + n] = next;
          }
        }
      }
    }
  }
  return loss;
}

// The backward of the header's formulas, in double.
void reference_backward(HostCase& hc) {
  const int B = hc.batch, H = hc.heads, T = hc.seqlen, chunks = hc.chunks;
  const size_t rows = static_cast<size_t>(B) * T * H;
  hc.dq.assign(rows * kN, 0.0);
  hc.dk.assign(rows * kN, 0.0);
  hc.dv.assign(rows * kP, 0.0);
  hc.d_adt.assign(rows, 0.0);
  hc.d_kappa.assign(rows, 0.0);
  hc.d_gamma.assign(rows, 0.0);
  hc.d_theta.assign(rows * kA, 0.0);
  hc.d_skip.assign(static_cast<size_t>(B) * H, 0.0);
  hc.d_initial.assign(static_cast<size_t>(B) * H * kP * kN, 0.0);
  std::vector<double> x(kP * kN), next(kP * kN), l(kC), dl(kC), da(kC * kC), sc(kC * kC);
  std::vector<double> qr(kC * kN), kr(kC * kN), dqr(kC * kN), dkr(kC * kN);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const size_t bh = static_cast<size_t>(b) * H + h;
      std::fill(x.begin(), x.end(), 0.0);
      for (int c = chunks - 1; c >= 0; --c) {
        const int t0 = c * kC;
        const float* entry = hc.entry_states.data() + (bh * chunks + c) * kP * kN;
        for (int t = 0; t < kC; ++t) {
          l[t] = hc.log_decay[hc.pair_token(b, h, t0 + t)];
          rotated(hc, hc.q, hc.q_bias, b, t0 + t, h, &qr[t * kN]);
          rotated(hc, hc.k, hc.k_bias, b, t0 + t, h, &kr[t * kN]);
        }
        std::fill(dqr.begin(), dqr.end(), 0.0);
        std::fill(dkr.begin(), dkr.end(), 0.0);
        const double l_last = l[kC - 1];
        const auto V = [&](int t, int p) {
          return bf(hc.v[hc.token(b, t0 + t, h) * kP + p]);
        };
        const auto O = [&](int t, int p) {
          return bf(hc.d_out[hc.token(b, t0 + t, h) * kP + p]);
        };
        const auto kappa = [&](int t) {
          return hc.kappa[hc.pair_token(b, h, t0 + t)];
        };
        for (int t = 0; t < kC; ++t) {
          for (int s = 0; s < kC; ++s) {
            double a = 0.0, q_k = 0.0;
            for (int p = 0; p < kP; ++p) a += O(t, p) * V(s, p);
            for (int n = 0; n < kN; ++n) q_k += qr[t * kN + n] * kr[s * kN + n];
            da[t * kC + s] = a;
            sc[t * kC + s] = q_k;
          }
        }
        std::fill(dl.begin(), dl.end(), 0.0);
        double exit_total = 0.0;
        for (int t = 0; t < kC; ++t) {
          const size_t tt = hc.token(b, t0 + t, h), pt = hc.pair_token(b, h, t0 + t);
          for (int s = 0; s <= t; ++s) {
            const double decay = s < t ? std::exp(l[t] - l[s]) : 1.0;
            const double w = s < t ? decay * kappa(s) : hc.gamma[pt];
            const double product = da[t * kC + s] * sc[t * kC + s];
            if (s < t) {
              dl[t] += product * w;
              dl[s] -= product * w;
              hc.d_kappa[hc.pair_token(b, h, t0 + s)] += product * decay;
            } else {
              hc.d_gamma[pt] += product;
            }
            for (int n = 0; n < kN; ++n) {
              dqr[t * kN + n] += da[t * kC + s] * w * kr[s * kN + n];
              dkr[s * kN + n] += da[t * kC + s] * w * qr[t * kN + n];
            }
            for (int p = 0; p < kP; ++p) {
              hc.dv[hc.token(b, t0 + s, h) * kP + p] += sc[t * kC + s] * w * O(t, p);
            }
          }
          // The state terms.
          const double exit_decay = std::exp(l_last - l[t]);
          double inter = 0.0, exit_term = 0.0;
          for (int n = 0; n < kN; ++n) {
            double e_do = 0.0, x_v = 0.0;
            for (int p = 0; p < kP; ++p) {
              e_do += entry[p * kN + n] * O(t, p);
              x_v += x[p * kN + n] * V(t, p);
            }
            dqr[t * kN + n] += std::exp(l[t]) * e_do;
            dkr[t * kN + n] += exit_decay * kappa(t) * x_v;
            inter += e_do * qr[t * kN + n];
            exit_term += x_v * kr[t * kN + n];
          }
          for (int p = 0; p < kP; ++p) {
            double x_k = 0.0;
            for (int n = 0; n < kN; ++n) x_k += x[p * kN + n] * kr[t * kN + n];
            hc.dv[tt * kP + p] += exit_decay * kappa(t) * x_k + hc.skip[h] * O(t, p);
          }
          dl[t] += std::exp(l[t]) * inter - exit_decay * kappa(t) * exit_term;
          hc.d_kappa[pt] += exit_decay * exit_term;
          exit_total += exit_decay * kappa(t) * exit_term;
          for (int p = 0; p < kP; ++p) hc.d_skip[bh] += O(t, p) * V(t, p);
        }
        double e_x = 0.0;
        for (int i = 0; i < kP * kN; ++i) e_x += entry[i] * x[i];
        dl[kC - 1] += exit_total + std::exp(l_last) * e_x;
        double suffix = 0.0;
        for (int t = kC - 1; t >= 0; --t) {
          suffix += dl[t];
          hc.d_adt[hc.pair_token(b, h, t0 + t)] = suffix;
        }
        // Un-rotated gradients and dθ.
        for (int t = 0; t < kC; ++t) {
          const size_t tt = hc.token(b, t0 + t, h), pt = hc.pair_token(b, h, t0 + t);
          for (int n = 0; n < kN / 2; ++n) {
            double c_ = 1.0, s_ = 0.0;
            if (n < kA) c_ = std::cos(hc.theta[pt * kA + n]), s_ = std::sin(hc.theta[pt * kA + n]);
            for (int side = 0; side < 2; ++side) {
              const std::vector<double>& r = side == 0 ? qr : kr;
              const std::vector<double>& d = side == 0 ? dqr : dkr;
              std::vector<double>& to = side == 0 ? hc.dq : hc.dk;
              const double d_first = d[t * kN + n], d_second = d[t * kN + n + kN / 2];
              if (n < kA) {
                hc.d_theta[pt * kA + n] +=
                    d_second * r[t * kN + n] - d_first * r[t * kN + n + kN / 2];
              }
              to[tt * kN + n] = d_first * c_ + d_second * s_;
              to[tt * kN + n + kN / 2] = d_second * c_ - d_first * s_;
            }
          }
        }
        for (int p = 0; p < kP; ++p) {
          for (int n = 0; n < kN; ++n) {
            double sum = std::exp(l_last) * x[p * kN + n];
            for (int t = 0; t < kC; ++t) sum += std::exp(l[t]) * O(t, p) * qr[t * kN + n];
            next[p * kN + n] = sum;
          }
        }
        x = next;
      }
      for (int i = 0; i < kP * kN; ++i) hc.d_initial[bh * kP * kN + i] = x[i];
    }
  }
}

// The reference's gradients against central differences of the forward's loss, for a few inputs
// of each kind: a wrong formula above would otherwise be checked only against itself. q and k are
// shared by the heads: their gradient is the heads' sum.
bool check_reference(HostCase& hc) {
  const double eps = 1e-3;
  double worst = 0.0;
  const auto fd = [&](float& input) {
    const float saved = input;
    input = saved + static_cast<float>(eps);
    const double up_step = static_cast<double>(input) - saved;  // the step fp32 could take
    const double up = forward(hc, false);
    input = saved - static_cast<float>(eps);
    const double down_step = saved - static_cast<double>(input);
    const double down = forward(hc, false);
    input = saved;
    return (up - down) / (up_step + down_step);
  };
  const auto compare = [&](const char* what, double analytic, double numeric) {
    const double err = std::fabs(analytic - numeric) / std::max(1.0, std::fabs(numeric));
    worst = std::max(worst, err);
    if (err > 1e-3) std::printf("  FD %s: analytic %.6f numeric %.6f\n", what, analytic, numeric);
  };
  for (int t : {0, 5, 63, 64, 100, 127}) {
    const size_t at = hc.pair_token(0, 1, t);
    compare("adt", hc.d_adt[at], fd(hc.adt[at]));
    compare("kappa", hc.d_kappa[at], fd(hc.kappa[at]));
    compare("gamma", hc.d_gamma[at], fd(hc.gamma[at]));
    compare("theta", hc.d_theta[at * kA + t % kA], fd(hc.theta[at * kA + t % kA]));
  }
  for (int i : {3, 1000, 4095}) compare("initial_state", hc.d_initial[i], fd(hc.initial_state[i]));
  compare("skip", hc.d_skip[1], fd(hc.skip[1]));
  for (int n : {0, 20, 40, 63}) {
    double q_sum = 0.0, k_sum = 0.0;
    for (int t = 0; t < hc.seqlen; ++t) {
      q_sum += hc.dq[hc.token(0, t, 1) * kN + n];
      k_sum += hc.dk[hc.token(0, t, 1) * kN + n];
    }
    compare("q_bias", q_sum, fd(hc.q_bias[1 * kN + n]));
    compare("k_bias", k_sum, fd(hc.k_bias[1 * kN + n]));
  }
  // q, k, v are bf16: a difference of bf16 steps (the loss is linear in each, so exact).
  const auto fd_bf16 = [&](std::vector<bf16>& x, size_t at, double gradient, const char* what) {
    const bf16 saved = x[at];
    const float base = bf(saved);
    const float step = std::max(std::fabs(base), 0.25f) * 0.0625f;
    x[at] = __float2bfloat16(base + step);
    const double up_step = bf(x[at]) - base;
    const double up = forward(hc, false);
    x[at] = __float2bfloat16(base - step);
    const double down_step = base - bf(x[at]);
    const double down = forward(hc, false);
    x[at] = saved;
    compare(what, gradient, (up - down) / (up_step + down_step));
  };
  for (int t : {2, 66, 127}) {
    for (int n : {7, 40}) {
      double q_sum = 0.0, k_sum = 0.0;
      for (int h = 0; h < hc.heads; ++h) {
        q_sum += hc.dq[hc.token(0, t, h) * kN + n];
        k_sum += hc.dk[hc.token(0, t, h) * kN + n];
      }
      fd_bf16(hc.q, hc.group_token(0, t) * kN + n, q_sum, "q");
      fd_bf16(hc.k, hc.group_token(0, t) * kN + n, k_sum, "k");
    }
    const size_t row = hc.token(0, t, 1);
    fd_bf16(hc.v, row * kP + 13, hc.dv[row * kP + 13], "v");
  }
  forward(hc, true);  // restores log_decay and the states from the unperturbed inputs
  std::printf("reference vs finite differences: worst relative error %.2e\n", worst);
  return worst < 1e-3;
}

template <class T>
T* device_copy(const std::vector<T>& host) {
  T* p = nullptr;
  ok(cudaMalloc(&p, host.size() * sizeof(T)), "cudaMalloc");
  ok(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "copy in");
  return p;
}

float* device_zeros(size_t count) {
  float* p = nullptr;
  ok(cudaMalloc(&p, count * sizeof(float)), "cudaMalloc");
  ok(cudaMemset(p, 0, count * sizeof(float)), "cudaMemset");
  return p;
}

struct DeviceCase {
  Inputs in;
  Outputs out;
  std::vector<void*> owned;
};

DeviceCase upload(const HostCase& hc) {
  DeviceCase dc;
  const size_t rows = static_cast<size_t>(hc.batch) * hc.seqlen * hc.heads;
  const size_t pairs = static_cast<size_t>(hc.batch) * hc.heads;
  const auto keep = [&](auto* p) {
    dc.owned.push_back(const_cast<void*>(static_cast<const void*>(p)));
    return p;
  };
  dc.in = {keep(device_copy(hc.q)),
           keep(device_copy(hc.k)),
           keep(device_copy(hc.q_bias)),
           keep(device_copy(hc.k_bias)),
           keep(device_copy(hc.theta)),
           keep(device_copy(hc.v)),
           keep(device_copy(hc.d_out)),
           keep(device_copy(hc.log_decay)),
           keep(device_copy(hc.kappa)),
           keep(device_copy(hc.gamma)),
           keep(device_copy(hc.entry_states)),
           keep(device_copy(hc.skip)),
           hc.batch,
           hc.seqlen,
           hc.heads};
  dc.out = {keep(device_zeros(rows * kN)),      keep(device_zeros(rows * kN)),
            keep(device_zeros(rows * kP)),      keep(device_zeros(rows)),
            keep(device_zeros(rows)),           keep(device_zeros(rows)),
            keep(device_zeros(rows * kA)),      keep(device_zeros(pairs)),
            keep(device_zeros(pairs * kP * kN))};
  return dc;
}

void release(DeviceCase& dc) {
  for (void* p : dc.owned) ok(cudaFree(p), "cudaFree");
  dc.owned.clear();
}

template <bool kSplit, bool kCausal>
void allow_shared_memory() {
  ok(cudaFuncSetAttribute(sweep_backward<kSplit, kCausal>,
                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                          static_cast<int>(sizeof(Smem))),
     "smem attribute");
}

template <bool kSplit, bool kCausal>
void launch(const DeviceCase& dc, const HostCase& hc) {
  const auto kernel = sweep_backward<kSplit, kCausal>;
  kernel<<<dim3(hc.heads, hc.batch), kThreads, sizeof(Smem)>>>(dc.in, dc.out);
  ok(cudaGetLastError(), "launch");
}

double max_error(const float* device, const std::vector<double>& ref) {
  std::vector<float> got(ref.size());
  ok(cudaMemcpy(got.data(), device, got.size() * sizeof(float), cudaMemcpyDeviceToHost), "copy");
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::fabs(got[i] - ref[i]));
    scale = std::max(scale, std::fabs(ref[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

// dθ's suffix sums over each (batch, head)'s tokens, t … T − 1: the angle gradient's part that
// is a small remainder of large terms (before the product's sum over heads and its dt and tanh
// factors, which do not change the relative error).
std::vector<double> theta_suffix_sums(const std::vector<double>& d_theta, const HostCase& hc) {
  std::vector<double> sums(d_theta.size());
  for (size_t pair = 0; pair < static_cast<size_t>(hc.batch) * hc.heads; ++pair) {
    for (int n = 0; n < kA; ++n) {
      double suffix = 0.0;
      for (int t = hc.seqlen - 1; t >= 0; --t) {
        const size_t at = (pair * hc.seqlen + t) * kA + n;
        suffix += d_theta[at];
        sums[at] = suffix;
      }
    }
  }
  return sums;
}

// The variant's errors on one checked case, printed under `label`; false where one exceeds
// kTolerance.
template <bool kSplit, bool kCausal>
bool check_case(const char* name, const char* label, const HostCase& hc) {
  DeviceCase dc = upload(hc);
  launch<kSplit, kCausal>(dc, hc);
  ok(cudaDeviceSynchronize(), label);
  std::vector<float> got(hc.d_theta.size());
  ok(cudaMemcpy(got.data(), dc.out.d_theta, got.size() * sizeof(float), cudaMemcpyDeviceToHost),
     "copy");
  const std::vector<double> ref_sums = theta_suffix_sums(hc.d_theta, hc);
  const std::vector<double> got_sums =
      theta_suffix_sums(std::vector<double>(got.begin(), got.end()), hc);
  double diff = 0.0, scale = 0.0, terms = 0.0;
  for (size_t i = 0; i < ref_sums.size(); ++i) {
    diff = std::max(diff, std::fabs(got_sums[i] - ref_sums[i]));
    scale = std::max(scale, std::fabs(ref_sums[i]));
    terms = std::max(terms, std::fabs(hc.d_theta[i]));
  }
  const std::pair<const char*, double> errors[] = {
      {"dq", max_error(dc.out.dq, hc.dq)},
      {"dk", max_error(dc.out.dk, hc.dk)},
      {"dv", max_error(dc.out.dv, hc.dv)},
      {"d_adt", max_error(dc.out.d_adt, hc.d_adt)},
      {"d_kappa", max_error(dc.out.d_kappa, hc.d_kappa)},
      {"d_gamma", max_error(dc.out.d_gamma, hc.d_gamma)},
      {"d_theta", max_error(dc.out.d_theta, hc.d_theta)},
      {"d_theta suffix sums", scale > 0 ? diff / scale : diff},
      {"d_skip", max_error(dc.out.d_skip, hc.d_skip)},
      {"d_initial", max_error(dc.out.d_initial, hc.d_initial)}};
  release(dc);
  std::printf("%-21s %s max|err|/max|ref|:", name, label);
  bool within = true;
  for (const auto& [what, error] : errors) {
    std::printf(" %s %.2e", what, error);
    within = within && error <= kTolerance;
  }
  std::printf(" (largest dθ suffix sum / largest dθ term: %.2e)\n",
              terms > 0 ? scale / terms : 0.0);
  return within;
}

// Checks the variant on the checked cases and times it; false where an error exceeds kTolerance
// (said before the time).
template <bool kSplit, bool kCausal>
bool run_variant(const std::vector<std::pair<const char*, const HostCase*>>& checked,
                 const HostCase& big, int repeats) {
  const char* name = kSplit ? (kCausal ? "split, causal blocks" : "split, every block")
                            : (kCausal ? "bf16, causal blocks" : "bf16, every block");
  allow_shared_memory<kSplit, kCausal>();
  bool within = true;
  for (const auto& [label, hc] : checked) {
    within = check_case<kSplit, kCausal>(name, label, *hc) && within;
  }
  if (!within) std::printf("%-21s an error exceeds %.3f\n", name, kTolerance);
  DeviceCase db = upload(big);
  cudaEvent_t start, stop;
  ok(cudaEventCreate(&start), "event");
  ok(cudaEventCreate(&stop), "event");
  std::vector<float> ms;
  for (int r = 0; r < repeats + 2; ++r) {
    ok(cudaEventRecord(start), "record");
    launch<kSplit, kCausal>(db, big);
    ok(cudaEventRecord(stop), "record");
    ok(cudaEventSynchronize(stop), "sync");
    float t = 0.f;
    ok(cudaEventElapsedTime(&t, start, stop), "elapsed");
    if (r >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%-21s batch %d seqlen %d heads %d: %.3f / %.3f / %.3f ms\n", name, big.batch,
              big.seqlen, big.heads, ms.front(), ms[ms.size() / 2], ms.back());
  release(db);
  return within;
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 20, batch = 8, seqlen = 8192, heads = 16;
  const bool reference_only = argc == 2 && std::string(argv[1]) == "--reference-only";
  for (int i = 1; !reference_only && i < argc; i += 2) {
    if (i + 1 == argc) {
      std::fprintf(stderr, "%s needs a value\n", argv[i]);
      return 2;
    }
    const std::string flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (flag == "--repeats") {
      repeats = value;
    } else if (flag == "--batch") {
      batch = value;
    } else if (flag == "--seqlen") {
      seqlen = value;
    } else if (flag == "--heads") {
      heads = value;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (seqlen < kC || seqlen % kC != 0 || batch < 1 || heads < 1 || repeats < 1) {
    std::fprintf(stderr,
                 "--seqlen must be a positive multiple of %d; --batch, --heads and --repeats at "
                 "least 1\n",
                 kC);
    return 2;
  }
  HostCase small = make_case(1, 128, 2, 7, 0.2f);
  forward(small, true);
  reference_backward(small);
  if (!check_reference(small)) {
    std::printf("the reference disagrees with finite differences\n");
    return 1;
  }
  if (reference_only) return 0;
  int device = 0, shared_limit = 0;
  ok(cudaGetDevice(&device), "cudaGetDevice");
  ok(cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
     "shared memory limit");
  if (static_cast<size_t>(shared_limit) < sizeof(Smem)) {
    std::printf(
        "the kernel needs %zu bytes of shared memory a block; this GPU allows %d (the "
        "probe is for Hopper)\n",
        sizeof(Smem), shared_limit);
    return 2;
  }
  // The errors at the grid's sequence length, without an initial state (as in the product).
  HostCase medium = make_case(1, 2048, 4, 13, 0.f);
  forward(medium, true);
  reference_backward(medium);
  const std::vector<std::pair<const char*, const HostCase*>> checked = {
      {"(batch 1, seqlen 128, 2 heads)", &small}, {"(batch 1, seqlen 2048, 4 heads)", &medium}};
  HostCase big = make_case(batch, seqlen, heads, 11, 0.2f);
  // Stand-ins for the forward's l and entry states at the timed shape (the time does not depend
  // on the values).
  for (size_t i = 0; i < big.log_decay.size(); ++i) big.log_decay[i] = big.adt[i] * (i % kC + 1);
  big.entry_states.resize(static_cast<size_t>(batch) * heads * (seqlen / kC) * kP * kN);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  for (auto& e : big.entry_states) e = unit(rng);
  bool within = run_variant<false, false>(checked, big, repeats);
  within = run_variant<true, false>(checked, big, repeats) && within;
  within = run_variant<true, true>(checked, big, repeats) && within;
  return within ? 0 : 1;
}
