#pragma once
// What the three files of the CUDA Mamba-3 scan share (see mamba3_scan.h for the structure):
//   mamba3_scan_forward.cu   the forward kernels and their launches
//   mamba3_scan_backward.cu  the backward kernels and their launches
//   mamba3_scan.cu           Mamba3ScanCuda: validation, workspace, launch table, introspection
// Here: the shape constants, the dynamic shared-memory plan of the chunk kernels, the device
// views of inputs, gradients and workspace, the launch records, and the device functions that
// forward and backward chunk kernels both call.
//
// The math per chunk follows kernels/cpu/mamba3_scan_chunked.h (its header states the chunked
// form); names match it: l = cumulative ADT since the chunk start, κ_j = γ_j + (1 − τ_{j+1})
// DT_{j+1}, W_ij = e^{l_i − l_j} κ_j (j < i), γ_i (j = i), exit scale e^{l_last − l_j} κ_j.
// Every exponential is e^{Λ_a − Λ_b} for two tokens a ≥ b of one chunk (or the token before it),
// so the gradient of ADT only needs chunk-local suffix sums of dL/dl.
#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mamba3_scan.h"

namespace megacpp::cuda::scan_detail {

constexpr int kThreads = 256;
// chunk_backward holds one block per SM (its shared memory): twice the warps of the other chunk
// kernels hide more of its load and barrier latency. chunk_output fits two or three blocks per
// SM; it gets the same count.
constexpr int kBackwardThreads = 512;
constexpr int kOutputThreads = 512;
constexpr float kPi = 3.14159265358979323846f;
// Shared memory the runtime reserves per resident block (sm_80 and later), on top of what the
// kernel asks for: chunk_forward is chosen only where two of its blocks fit an SM.
constexpr size_t kSharedReservedPerBlock = 1024;

// Shape constants every kernel needs, passed by value.
struct Dims {
  int batch, seqlen, heads, groups, state, headdim, rank, chunk, angles;
  int chunks;           // ceil(seqlen / chunk)
  int rows;             // chunk * rank: rows (token, rank) of a chunk
  int heads_per_group;  // heads / groups
  int partial_width;    // per-head parameter gradient floats of one slot: a (batch, chunk), or
                        // under the sweep a (batch, group of chunks)
  // The same shape values as divisors (see FastDiv): rank R, head dimension P, state N, N / 2,
  // angles A (1 when there are none), chunk C, rows C·R.
  FastDiv by_rank, by_headdim, by_state, by_half, by_angles, by_chunk, by_rows;
  static constexpr bool kFixed = false;
};

// Division by a shape value known at compile time: the compiler's own shifts or multiply-shift,
// with no divisor in a register or the parameter bank.
template <int kDivisor>
struct ConstDiv {
  static_assert(kDivisor > 0);
#if defined(__CUDACC__)
  __device__ __forceinline__ int div(int x) const {
    return static_cast<int>(static_cast<unsigned>(x) / kDivisor);
  }
  __device__ __forceinline__ int mod(int x) const {
    return static_cast<int>(static_cast<unsigned>(x) % kDivisor);
  }
#endif
};

// The shapes the scan meets most (the benchmark and model presets) compiled with their
// (N, P, R, C) as constants: the chunk kernels' index arithmetic (67% of chunk_backward's
// instructions with runtime shapes, measured) folds into immediates and the loops over R and the
// products' tile loops get fixed trip counts. Members hide Dims' runtime ones of the same name;
// the rest (batch, seqlen, heads, groups, angles, ...) stay runtime.
template <int kN, int kP, int kR, int kC>
struct FixedDims : Dims {
  static constexpr int state = kN, headdim = kP, rank = kR, chunk = kC, rows = kC * kR;
  static constexpr bool kFixed = true;
  ConstDiv<kR> by_rank;
  ConstDiv<kP> by_headdim;
  ConstDiv<kN> by_state;
  ConstDiv<kN / 2> by_half;
  ConstDiv<kC> by_chunk;
  ConstDiv<kC * kR> by_rows;
  explicit FixedDims(const Dims& d) : Dims(d) {}
};

// Row strides (elements) of the chunk kernels' shared-memory matrices; SmemPlan says why each is
// padded. One formula for the plan and for the kernels compiled with fixed shapes.
struct SmemStrides {
  int qk, pv, state, mm, mp, mn, sw;
};
__host__ __device__ constexpr SmemStrides smem_strides(int n, int p, int rows) {
  return {n + 8, p + 8, n + 1, rows + 4, p + 4, n + 4, rows + 8};
}

// Row stride (elements) of the token-pair matrices W and dL/dW (fp32 [C][C]): read by column in
// chunk_backward's per-token weight gradients (a token's lanes over the rows j of its column i,
// several tokens a warp: share_lanes), where unpadded rows of 64 put the lanes of a column on one
// bank; two more keep rows 8-byte aligned for the float2 stores and leave about 2-way conflicts
// on those column reads and on the row reads beside them.
__host__ __device__ constexpr int weights_stride(int chunk) {
  return chunk + 2;
}

// Whether chunk_forward makes each token weight in its scores' epilogue (token_weight) rather
// than reading a table: at R = 1 a weight serves one score, at R > 1 a token pair's weight serves
// R² scores, so the table is made once. plan_for reserves the table exactly when this is false.
__host__ __device__ constexpr bool forward_weights_inline(int rank) {
  return rank == 1;
}

// Row stride (elements) of the [C][A] per-token, per-pair fp32 arrays (cos θ, sin θ,
// chunk_backward's dL/dθ): load_scalars stores them a lane per token of one pair, and
// chunk_backward's θ sums read them the same way, where rows of A = 32 put a warp on one bank.
__host__ __device__ constexpr int angles_stride(int angles) {
  return angles + 1;
}

// Row stride (elements) of a chunk's fp32 [P][N] state part kept in shared memory for the
// chain's link (chunk_forward's F_c, chunk_dstate's H_c): the products' tile epilogues store it
// a fragment at a time (eight rows a warp), which rows of N = 64 put on 8-way bank conflicts;
// four more keep the link's float4 reads aligned and leave 2-way.
__host__ __device__ constexpr int exit_part_stride(int state) {
  return state + 4;
}

// Quad `quad` (elements 4·quad … 4·quad + 3 in row-major [P][N] order) of such a part, at the
// fixed shapes: the chain's link reads the part a float4 a thread.
template <class D>
__device__ __forceinline__ float4 exit_part_quad(const float* part, int quad) {
  constexpr int kQuadsPerRow = D::state / 4;
  return *reinterpret_cast<const float4*>(part + quad / kQuadsPerRow * exit_part_stride(D::state) +
                                          quad % kQuadsPerRow * 4);
}

// Row stride (elements) of chunk_backward's copies of the head's mimo_x, mimo_z and mimo_o
// ([3][R][P] fp32): the tile epilogues read a rank's row by a fragment's pair of columns, the
// ranks of a warp's rows apart, which rows of P = 64 put on 4-way conflicts; with eight more a
// half warp's pairs fall on distinct banks.
__host__ __device__ constexpr int mimo_params_stride(int headdim) {
  return headdim + 8;
}

// Byte offsets of the blocks of a chunk kernel's dynamic shared memory; a block the kernel does
// not use stays at offset 0. rows = (token i, rank r) of the chunk, i·R + r; C = chunk tokens.
struct SmemPlan {
  size_t token_scalars = 0;  // fp32 [kScalarCount][C]: the per-token scalars (enum Scalar)
  size_t rotation_cos = 0;   // fp32 [C][angles_stride]: cos θ of each rotation pair at each token
  size_t rotation_sin = 0;   // fp32 [C][angles_stride]: sin θ
  size_t q_rotated = 0;      // bf16 [rows][N]: q + q_bias, rotated
  size_t k_rotated = 0;      // bf16 [rows][N]: k + k_bias, rotated
  size_t psiv = 0;           // bf16 [rows][P]: v ⊙ mimo_x
  size_t state = 0;          // fp32 [P][N]: the chunk's entry state E; in the backward later
                             //   dL/d(exit state). chunk_output on the tensor cores holds E's
                             //   hi + lo pairs here instead; chunk_backward with the split
                             //   state holds z and dy here for the epilogue, then dS (copied
                             //   ahead; rows of N, unpadded, at the fixed shapes) until the
                             //   exit-state phase, and never the fp32 E; chunk_forward F_c
  size_t scores = 0;         // fp32 [rows][rows]: Q Kᵀ (backward). With chunk_backward's
                             //   fused_weights: dL/dW [C][weights_stride] instead, then (as
                             //   without) d_qk, then possibly the chunk's v
  size_t d_scores = 0;       // fp32 [rows][rows]: dL/d(Q Kᵀ ⊙ W). With fused_weights: dSc ⊙ W
                             //   (bf16 [rows][ld_sw]) until the dK phase, then the next head's
                             //   entry state [P][N] copied ahead
  size_t token_weights = 0;  // fp32 [C][weights_stride]: W (chunk_backward: none where
                             //   weights_recomputed)
  size_t d_token_weights = 0;  // fp32 [C][weights_stride]: dL/dW without fused_weights; shares
                               //   `out` when it fits
  size_t out = 0;              // fp32 [rows][P]: o (not chunk_forward's); in the backward then
                               //   mimo_o's terms (or their row-tile sums with mimo_z's), later
                               //   K dSᵀ (without fused_weights) or mimo_x's row-tile terms
                               //   (fused_dv, dx_in_tiles)
  size_t d_out = 0;   // fp32 [rows][P]: dL/do = dy ⊙ silu(z ⊙ mimo_z) ⊙ mimo_o; in the
                      //   backward then mimo_z's terms (not with fused_dv or gating_in_tiles);
                      //   chunk_dstate on the tensor cores stores none, and at the fixed shapes H_c
                      //   lives here
  size_t d_psiv = 0;  // fp32 [rows][P]: dL/d(v ⊙ mimo_x) (with dx_in_tiles only D dO + Swᵀ dO,
                      //   finished in K dSᵀ's tiles); with fused_dv (never stored) mimo_z's
                      //   terms, unless o's tiles take them (gating_in_tiles)
  size_t d_qk = 0;    // fp32 [rows][N]: dL/d(rotated q), then dL/d(rotated k)
  size_t sum_scratch = 0;      // fp32 [kBackwardThreads / 32]: block_sum's
  size_t weighted_scores = 0;  // bf16 [rows][rows]: QKᵀ ⊙ W, the tensor-core operand; in the
                               //   backward without fused_weights later dL/d(QKᵀ) (= dSc ⊙ W)
  size_t d_out_bf16 = 0;       // bf16 [rows][P]: d_out rounded, the tensor-core operand
  size_t d_theta = 0;          // fp32 [C][angles_stride]: dL/dθ of each token of this head
  size_t row_terms = 0;        // fp32 [rows][P / 16]: chunk_backward's per-row sums of a product's
                               //   16-column tiles (the entry dot, then d_scale's terms)
  size_t mimo_params = 0;      // fp32 [3][R][mimo_params_stride]: the head's mimo_x, mimo_z,
                               //   mimo_o (backward)
  size_t v_tokens = 0;         // bf16 [C][P]: the chunk's v (backward, when it fits)
  size_t staged_tokens = 0;    // bf16 [3][C][P]: the next head's v, z, dy (backward, when it fits)
  size_t dq_acc = 0;           // fp32 [rows][N]: dL/dq summed over the group's heads, or 0 when
  size_t dk_acc = 0;           //   the sums go through the workspace (see plan_backward)
  size_t state_hi = 0;         // bf16 [P][N]: the state (E, later dS) split hi + lo once, the
  size_t state_lo = 0;         //   products' ldmatrix operands; 0 when not (see plan_backward)
  size_t d_out_lo = 0;         // bf16 [rows][P]: d_out − bf16(d_out), beside d_out_bf16
  size_t exit_part = 0;        // fp32 [P][exit_part_stride]: chunk_forward's F_c (the chunk's own
                               //   part of the next entry state; in `state` when it fits),
                               //   chunk_dstate's H_c (in `d_out` at the fixed shapes on the
                               //   tensor cores)
  size_t psiv_hi = 0;          // bf16 [rows][P]: chunk_forward's exit-scaled PsiV, hi part
  size_t psiv_lo = 0;          //   and lo part
  size_t split_hi = 0;         // bf16, the forward kernels' and chunk_dstate's one fp32 operand
  size_t split_lo = 0;         //   as hi + lo: chunk_dstate's e^l dO [rows][P] (ld_pv); chunk_state
                               //   its scaled PsiV's lo part (the hi part in PsiV's place, so no
                               //   split_hi); chunk_output and chunk_forward the entry state
                               //   [P][N] (ld_split, in `state`)
  size_t total = 0;
  // chunk_backward only, where its plan would not fit the device otherwise (plan_backward): W has
  // no space, each weight is made again from the token scalars where it is read (token_weight).
  bool weights_recomputed = false;
  // Row strides (elements) of the matrices above. Rows are padded so that the access patterns
  // of the products (mma fragments: eight rows × four column pairs per warp; the fp32 tiles:
  // sixteen rows of one column) fall on distinct banks; unpadded rows of 64 elements put every
  // row on the same bank (measured: shared-memory stalls were the largest in chunk_backward).
  int ld_qk = 0;     // q_rotated, k_rotated (bf16): N + 8
  int ld_pv = 0;     // psiv (bf16): P + 8
  int ld_state = 0;  // state (fp32): N + 1
  int ld_mm = 0;     // scores, d_scores (fp32): rows + 4
  int ld_mp = 0;     // out, d_out, d_psiv (fp32): P + 4
  int ld_mn = 0;     // d_qk (fp32): N + 4
  int ld_sw = 0;     // weighted_scores (bf16): rows + 8
  int ld_split = 0;  // state_hi, state_lo, chunk_output's split_hi, split_lo (bf16): N + 8
};

enum ScanKernel { kStateKernel, kOutputKernel, kForwardKernel, kDStateKernel, kBackwardKernel };

// Per-token scalar arrays of a chunk, each `chunk` floats, in the token_scalars block.
enum Scalar {
  kAdt,
  kDt,
  kTau,
  kGamma,
  kKappa,
  kLog,
  kEntryDecay,
  kExitScale,
  kDLog,
  kDGamma,
  kDKappa,
  kScratch,
  kScalarCount
};

// weights_recomputed: chunk_backward's plan without W's space (plan_backward).
inline SmemPlan plan_for(const Dims& d, ScanKernel kernel, bool weights_recomputed = false) {
  SmemPlan p;
  p.weights_recomputed = weights_recomputed && kernel == kBackwardKernel;
  size_t cursor = 0;
  const auto take = [&cursor](size_t bytes) {
    const size_t at = cursor;
    cursor += (bytes + 15) / 16 * 16;
    return at;
  };
  const size_t m = static_cast<size_t>(d.rows);
  const size_t hp = static_cast<size_t>(d.headdim), c = static_cast<size_t>(d.chunk);
  const SmemStrides ld = smem_strides(d.state, d.headdim, d.rows);
  p.ld_qk = ld.qk;
  p.ld_pv = ld.pv;
  p.ld_state = ld.state;
  p.ld_mm = ld.mm;
  p.ld_mp = ld.mp;
  p.ld_mn = ld.mn;
  p.ld_sw = ld.sw;
  const size_t ld_qk = static_cast<size_t>(p.ld_qk), ld_pv = static_cast<size_t>(p.ld_pv);
  const size_t ld_state = static_cast<size_t>(p.ld_state), ld_mm = static_cast<size_t>(p.ld_mm);
  const size_t ld_mp = static_cast<size_t>(p.ld_mp), ld_mn = static_cast<size_t>(p.ld_mn);
  const size_t ld_sw = static_cast<size_t>(p.ld_sw);
  p.token_scalars = take(kScalarCount * c * sizeof(float));
  const size_t ld_a = static_cast<size_t>(angles_stride(d.angles));
  p.rotation_cos = take(c * ld_a * sizeof(float));
  p.rotation_sin = take(c * ld_a * sizeof(float));
  const bool backward = kernel == kBackwardKernel;
  // chunk_forward holds what chunk_output does but o (kept in registers), plus F_c and the
  // exit-scaled PsiV's pairs.
  const bool fused = kernel == kForwardKernel;
  if (fused) kernel = kOutputKernel;
  if (kernel != kStateKernel) p.q_rotated = take(m * ld_qk * sizeof(bf16));
  if (kernel != kDStateKernel) p.k_rotated = take(m * ld_qk * sizeof(bf16));
  if (kernel != kDStateKernel) p.psiv = take(m * ld_pv * sizeof(bf16));
  const size_t split_state = 2 * hp * static_cast<size_t>(d.state + 8) * sizeof(bf16);
  if (kernel == kOutputKernel || backward) {
    // chunk_output's entry state is fp32 on the CUDA cores, a hi + lo pair on the tensor cores:
    // one space for either (a second space took chunk_output from two blocks per SM to one at
    // the SISO shape, measured).
    const size_t fp32_state = hp * ld_state * sizeof(float);
    p.state = take(kernel == kOutputKernel ? std::max(fp32_state, split_state) : fp32_state);
    if (backward) {
      p.scores = take(m * ld_mm * sizeof(float));
      // d_scores right after scores: d_qk takes both once they are dead.
      p.d_scores = take(m * ld_mm * sizeof(float));
    }
    const size_t ld_w = static_cast<size_t>(weights_stride(d.chunk));
    const bool weights_inline = fused && forward_weights_inline(d.rank);
    if (!p.weights_recomputed && !weights_inline) p.token_weights = take(c * ld_w * sizeof(float));
    if (!fused) p.out = take(m * ld_mp * sizeof(float));  // chunk_forward keeps o in registers
    p.weighted_scores = take(m * ld_sw * sizeof(bf16));
  }
  if (kernel == kDStateKernel || backward) p.d_out = take(m * ld_mp * sizeof(float));
  // The forward kernels' and chunk_dstate's products with near-fp32 operands take them as hi + lo
  // bf16 pairs made once (smem_mma_split) on the tensor cores; chunk_state makes its hi part in
  // PsiV's place.
  p.ld_split = d.state + 8;
  if (kernel == kDStateKernel) p.split_hi = take(m * ld_pv * sizeof(bf16));
  if (kernel == kStateKernel || kernel == kDStateKernel) {
    p.split_lo = take(m * ld_pv * sizeof(bf16));
  }
  if (kernel == kOutputKernel) {
    p.split_hi = p.state;
    p.split_lo = p.state + split_state / 2;
  }
  if (fused) {
    // F_c lives in the entry state's space (its last read, the publish, is a barrier before E_c's
    // pairs are written there).
    const size_t exit_bytes = hp * static_cast<size_t>(exit_part_stride(d.state)) * sizeof(float);
    const size_t state_bytes = std::max(hp * ld_state * sizeof(float), split_state);
    p.exit_part = exit_bytes <= state_bytes ? p.state : take(exit_bytes);
    // The exit-scaled PsiV's pairs have spaces of their own: PsiV and the weighted scores stay
    // whole for o's intra-chunk tiles.
    p.psiv_hi = take(m * ld_pv * sizeof(bf16));
    p.psiv_lo = take(m * ld_pv * sizeof(bf16));
  }
  if (backward) {
    // d_token_weights lives in out's space (o is dead between the epilogue and K dSᵀ) when it
    // fits.
    const size_t weights_floats = c * static_cast<size_t>(weights_stride(d.chunk));
    p.d_token_weights = weights_floats <= m * ld_mp ? p.out : take(weights_floats * sizeof(float));
    // The bf16 dO is an operand only while the state holds nothing (between o = Q Eᵀ and the
    // reload of E for dO E).
    p.d_out_bf16 = m * ld_pv * sizeof(bf16) <= hp * ld_state * sizeof(float)
                       ? p.state
                       : take(m * ld_pv * sizeof(bf16));
    p.d_psiv = take(m * ld_mp * sizeof(float));
    // d_qk is written only after the last use of the scores and their gradient.
    p.d_qk = m * ld_mn <= 2 * m * ld_mm ? p.scores : take(m * ld_mn * sizeof(float));
    p.sum_scratch = take(kBackwardThreads / 32 * sizeof(float));
    p.d_theta = take(c * ld_a * sizeof(float));
    p.row_terms = take(m * (hp / 16) * sizeof(float));
    p.mimo_params = take(3 * static_cast<size_t>(d.rank) *
                         static_cast<size_t>(mimo_params_stride(d.headdim)) * sizeof(float));
  }
  p.total = cursor;
  return p;
}

// chunk_backward's plan: plan_for's (without W's space where even that exceeds `limit`: the
// weights are then made again where read, and the split state below is not taken), plus what fits
// within `limit` bytes per block, in this order:
//   split state (tensor cores only): the state (E, later dS) and dO held as hi + lo bf16 pairs
//     once, so that their products fetch operands by ldmatrix (smem_mma_split) rather than
//     element by element with a split per fetch (the fp32 state reads were about a tenth of the
//     kernel's stall samples); the bf16 dO then gets its own space;
//   v: the chunk's v, loaded with PsiV at the head's start for dx's pass (or dV's or K dSᵀ's
//     tiles);
//   accumulators: the group's dQ and dK sums: the block walks every head of the group over the
//     same rows, so the sums need no global read-modify-write per head, and the block writes the
//     bf16 gradients once at the end. Otherwise they go through the workspace;
//   staged tokens: the next head's v, z and dy, copied asynchronously while the block computes the
//     current head (their loads were the largest wait of the head's start, measured).
inline SmemPlan plan_backward(const Dims& d, bool tensor_cores, size_t limit) {
  SmemPlan p = plan_for(d, kBackwardKernel);
  // Where even that does not fit (the SISO shape on an A100), W gets no space: its C² weights are
  // made again where they are read, and the plan takes no split (fused_weights, which the split
  // enables, reads W from shared memory).
  const bool recompute = p.total > limit;
  if (recompute) p = plan_for(d, kBackwardKernel, true);
  const auto round16 = [](size_t bytes) {
    return (bytes + 15) / 16 * 16;
  };
  const size_t rows = static_cast<size_t>(d.rows), hp = static_cast<size_t>(d.headdim);
  const size_t split_ld = static_cast<size_t>(d.state) + 8;
  const size_t state_half = round16(hp * split_ld * sizeof(bf16));
  const size_t d_out_half = round16(rows * static_cast<size_t>(p.ld_pv) * sizeof(bf16));
  const bool d_out_bf16_shared = p.d_out_bf16 == p.state;
  const size_t split = 2 * state_half + d_out_half + (d_out_bf16_shared ? d_out_half : 0);
  if (tensor_cores && !recompute && p.total + split <= limit) {
    p.ld_split = static_cast<int>(split_ld);
    p.state_hi = p.total;
    p.state_lo = p.state_hi + state_half;
    p.d_out_lo = p.state_lo + state_half;
    // `state` holds z and dy, then dS, while the bf16 dO is still an operand.
    if (d_out_bf16_shared) p.d_out_bf16 = p.d_out_lo + d_out_half;
    p.total += split;
  }
  const size_t v_bytes = round16(static_cast<size_t>(d.chunk) * hp * sizeof(bf16));
  if (p.total + v_bytes <= limit) {
    p.v_tokens = p.total;
    p.total += v_bytes;
  }
  const size_t sums = round16(rows * static_cast<size_t>(d.state) * sizeof(float));
  if (p.total + 2 * sums <= limit) {
    p.dq_acc = p.total;
    p.dk_acc = p.total + sums;
    p.total += 2 * sums;
  }
  const size_t staged = round16(3 * static_cast<size_t>(d.chunk) * hp * sizeof(bf16));
  if (d.headdim % 8 == 0 && p.total + staged <= limit) {
    p.staged_tokens = p.total;
    p.total += staged;
  }
  return p;
}

// The bytes of shared memory per block chunk_backward cannot do without (the largest of the scan's
// kernels' needs): its plan with W recomputed, nothing added.
inline size_t least_backward_bytes(const Dims& d) {
  return plan_for(d, kBackwardKernel, true).total;
}

struct DevInputs {
  const bf16 *q, *k, *v, *z, *adt, *dt, *trap, *angles, *q_bias, *k_bias, *mimo_x, *mimo_z, *mimo_o,
      *d;
  size_t zv_stride;  // elements from a token's z (and v) row to the next (zv_row)
};

struct DevGrads {
  bf16 *q, *k, *v, *z, *adt, *dt, *trap, *angles;
  float *q_bias, *k_bias, *mimo_x, *mimo_z, *mimo_o, *d;
};

// Workspace (all fp32 unless noted), indices in the comments.
struct Work {
  float* theta0;   // [B, H, chunks, A] θ just before each chunk
  float* states;   // [B, H, chunks, P, N] chunk-local exit part, then entry states (chunk_forward:
                   //   entry states only); where the sweep will run (sweep_runs), each chunk's
                   //   block then leaves its entry state as the sweep reads it, split in place:
                   //   bf16 [P, N] hi parts, then lo parts (entry_split_of)
  float* decay;    // [B, H, chunks] e^{l_last}
  float* gstates;  // [B, H, chunks, P, N] dL/d(entry), then dL/d(exit state) (the fused
                   //   chunk_dstate: dL/d(exit state) only)
  float* dq_acc;   // [B, L, R, G, N] summed over the group's heads, unless chunk_backward's
  float* dk_acc;   //   plan keeps the sums in shared memory (then unused, still allocated)
  float* dtheta;   // [B, H, L, A] dL/dθ_t, then its suffix sum over t (the sweep writes the sums)
  float*
      dtheta_tot;   // [B, H, chunks, A] per chunk, then the sum over later chunks (chunk_backward's
                    //   path only)
  float* tok_dadt;  // [B, L, H]
  float* tok_ddt;   // [B, L, H] d_dt without the κ_{t−1} and angle terms
  float* tok_dtau;  // [B, L, H] d_τ without the κ_{t−1} term
  float* tok_dkappa;  // [B, L, H]
  float* partials;    // [H, B * chunks, partial_width]
  float* split_qk;    // [split units, heads per group, 2, C·R·N]: the q then k gradients of each
                      //   head of chunk_backward's split units (HeadSplit), for finish_tokens to
                      //   sum in head order; null when no unit is split
  int* order;         // [1 + B·H·chunks] for chunk_forward and the fused chunk_dstate: the next
                      //   block's ticket, then one flag per (b, h, c), set once the state its
                      //   block waits for is in `states` (`gstates`); zeroed before each launch
  bf16* psiv;         // [B, L, H, R, P] or null
  // The sweep backward's (mamba3_scan_sweep.cu), null where it does not run. C below is the
  // chunk's tokens (64 at R = 1, 16 at R = 4), chunks · C the padded token count of a (batch,
  // head), and a chunk's rows (token, rank) are C · R = 64.
  bf16* gate_in;          // [B, L, H, R, P] o before the gating: forward() keeps it for backward()
  bf16* sweep_d_out;      // [B, L, H, R, P] dL/do, rounded once
  float* sweep_scalars;   // [3][B, H, chunks · C] l, κ, γ (forward() keeps them)
  float* sweep_rotation;  // [2][B, H, chunks · C, A] cos θ, then sin θ (forward() keeps them)
  bf16* sweep_dq;         // [B, chunks · C · R, H, N] each head's dL/dq, then its dL/dk: both in
  bf16* sweep_dk;         //   gstates' space

  // Whether the sweep backward will run: then the forward keeps what it reads (the per-token
  // scalars, the rotation, each entry state split in place).
  __host__ __device__ bool sweep_runs() const { return sweep_rotation != nullptr; }
};

// Work::order's length in ints: the ticket counter, then a ready flag per (batch, head, chunk).
inline size_t chain_order_ints(const Dims& d) {
  return 1 + static_cast<size_t>(d.batch) * d.heads * d.chunks;
}
// The tickets and flags zeroed, before each launch of a kernel that walks the chunk chain.
inline void reset_chain(const Dims& d, const Work& w, cudaStream_t stream) {
  MEGACPP_CUDA_CHECK(cudaMemsetAsync(w.order, 0, chain_order_ints(d) * sizeof(int), stream));
}
// Whether a fixed shape's chunk chains run (ScanChains, mamba3_scan.h). Where paying: in the
// forward from 48 (batch, head) pairs at MIMO and 32 at SISO, in the backward from 96 at both:
// the crossovers measured on an H200 at seqlen 8192, batch 2 to 8 of 16 heads and 2 of 32
// (bench/RESULTS.md, sessions 22 and 27). Since the links poll with an acquire load and
// chunk_dstate loads a_c before its wait (session 27), at MIMO the forward's chain and the
// separate passes are within 1% at 32 pairs and the chain saves 19% from 64; the separate
// backward still saves 19% at 32 pairs and 5% at 64, and the chain 1% at 96 and 3% at 128. A
// chain's time grows with its chunks as the passes' work does, so the pair count alone decides,
// whatever the length.
inline bool chains_run(const Dims& d, ScanChains chains, int least_pairs) {
  if (chains != ScanChains::kWherePaying) return chains == ScanChains::kAlways;
  return static_cast<long>(d.batch) * d.heads >= least_pairs;
}
inline bool forward_chains_run(const Dims& d, ScanChains chains) {
  return chains_run(d, chains, d.rank == 1 ? 32 : 48);
}
inline bool backward_chains_run(const Dims& d, ScanChains chains) {
  return chains_run(d, chains, 96);
}
// The ready flags of one (batch, head) pair, one per chunk.
static __device__ __forceinline__ int* chain_flags(const Work& w, const Dims& d, size_t pair) {
  return w.order + 1 + pair * d.chunks;
}

// One kernel launch as the scan makes it, derived once per shape: what forward() and backward()
// launch with and what kernel_attributes() reports.
struct Launch {
  const char* name = "";
  const void* function = nullptr;  // the kernel, for the runtime's attribute and occupancy calls
  dim3 grid;
  dim3 block;
  SmemPlan smem;  // the chunk kernels' dynamic shared memory; smem.total bytes (0 for the others)
};

// mamba3_scan_forward.cu: the forward's kernels, in launch order.
struct ForwardLaunches {
  Launch angle_sums, angle_prefix, chunk_state, state_pass, chunk_output;
  // At the fixed shapes on the tensor cores, where two of its blocks fit an SM: chunk_forward
  // does what chunk_state, state_pass and chunk_output do, in one launch (the three are then not
  // launched).
  bool fused = false;
  Launch chunk_forward;
};
// shared_per_sm: the device's shared memory per SM, as capped (current_shared_memory_limits;
// chunk_forward only where two blocks fit).
ForwardLaunches forward_launches(const Dims& d, bool tensor_cores, size_t shared_per_sm,
                                 ScanChains chains);
// Writes y; keeps the chunk-entry states (and PsiV when psiv_cache) in w for run_backward.
void run_forward(const ForwardLaunches& launches, bool tensor_cores, bool psiv_cache, const Dims& d,
                 const DevInputs& in, const Work& w, bf16* y, cudaStream_t stream);

// mamba3_scan_backward.cu: the backward's kernels, in launch order.
// chunk_backward's work comes in units, one per (batch, group, chunk). A block walking a unit's
// heads one after another takes about as long as heads_per_group single-head blocks, and the units
// that are left over after the last whole wave of blocks (units mod the blocks the GPU holds at
// once) run with most SMs idle: at M3-ref on 132 SMs, 4096 units leave 4 for a 32nd wave of 16
// heads' time. Split, each of the last split_units units runs a block per head instead, so that the
// last wave takes a head's time per block. A split unit's heads leave their q and k gradients in
// the workspace (Work::split_qk), and finish_tokens adds them into the group's sums in the order
// the block's shared sums take (head 0 first, added to zero), so splitting changes no bit.
struct HeadSplit {
  int whole_units = 0;  // units [0, whole_units): a block each, walking the group's heads
  int split_units = 0;  // the units after them: a block per (unit, head)
};
// Floats of Work::split_qk for `split_units` split units.
inline size_t split_qk_floats(const Dims& d, int split_units) {
  return static_cast<size_t>(split_units) * d.heads_per_group * 2 * d.rows * d.state;
}

// mamba3_scan_sweep.cu: the backward as a sweep over each (batch, head)'s chunks (ScanSweep),
// which replaces chunk_dstate, the reverse state pass, chunk_backward, dtheta_offsets and
// finish_tokens where it runs.
struct SweepLaunches {
  Launch prep, core, finish;
};
// The padded token count of a (batch, head) in the sweep's per-token parts (Work::sweep_scalars
// and sweep_rotation: whole chunks), for the forward that fills them and the sweep's sizes.
template <class D>
__host__ __device__ inline size_t sweep_padded_tokens(const D& d) {
  return static_cast<size_t>(d.chunks) * d.chunk;
}
// Floats of the sweep's workspace parts (Work's sweep fields; bf16 ones as half as many floats).
struct SweepFloats {
  size_t gate_in = 0, d_out = 0, scalars = 0, rotation = 0;
};
// Whether the sweep computes `d`'s backward: the fixed SISO or MIMO shape (64 rows a chunk) with 16
// rotation pairs, on the tensor cores, where a block may have sweep_core's shared memory (the
// larger of its two instances; Hopper: about 210 KiB) and the device runs sweep_core as built for
// sm_90 (its copies are the tensor memory accelerator's) with a driver that makes tensor maps.
bool sweep_applies(const Dims& d, bool tensor_cores, size_t shared_per_block);
// One of sweep_applies' conditions, a pure one: the tile copies' int coordinates reach every row
// of the entry states' split and of the rotation's tables.
bool sweep_copy_rows_fit(const Dims& d);
size_t sweep_core_shared_bytes();
SweepFloats sweep_floats(const Dims& d);
// The sweep's partial slots a batch (Work::partials, for reduce_params): one a group of chunks
// (kPartialGroupChunks in mamba3_scan_sweep.cu), fewer than chunk_backward's one a chunk.
int sweep_partial_slots(const Dims& d);
SweepLaunches sweep_launches(const Dims& d);
// Writes every gradient but the per-head parameters', whose partials it leaves for reduce_params.
void run_sweep(const SweepLaunches& launches, const Dims& d, const DevInputs& in, const Work& w,
               const bf16* dy, const DevGrads& grads, cudaStream_t stream);

struct BackwardLaunches {
  Launch chunk_dstate, state_pass_backward, chunk_backward, dtheta_offsets, finish_tokens,
      reduce_params;
  // The sweep runs instead of chunk_dstate, state_pass_backward, chunk_backward, dtheta_offsets
  // and finish_tokens (reduce_params follows it).
  bool sweep = false;
  SweepLaunches sweep_kernels;
  // At the fixed shapes chunk_dstate also does the reverse state pass (state_pass_backward is then
  // not launched).
  bool reverse_pass_fused = false;
  HeadSplit split;  // chunk_backward's grid: split.whole_units + split.split_units · heads a group
};
// shared_limit: the device's shared memory per block, as capped (chunk_backward keeps the group's
// dQ and dK sums there when they fit; see plan_backward). split_units: chunk_backward's last units
// that run a block per head (planned_split_units; refused, kInternal, beyond the units, where the
// plan keeps the dQ and dK sums in the workspace, or at one head a group).
// sweep: the sweep runs (sweep_applies must hold; split_units is then 0).
BackwardLaunches backward_launches(const Dims& d, bool tensor_cores, size_t shared_limit,
                                   ScanChains chains, int split_units = 0, bool sweep = false);
void run_backward(const BackwardLaunches& launches, bool tensor_cores, bool psiv_cache,
                  const Dims& d, const DevInputs& in, const Work& w, const bf16* dy,
                  const DevGrads& grads, cudaStream_t stream);

// ---------------------------------------------------------------------------------
// Device functions of both passes' chunk kernels.

// __expf(x) where its result is a normal float, and 0 where it would be subnormal (below 2^−126,
// about 1.2e−38): its product and ex2, with subnormals flushed (ex2.approx.ftz). __expf keeps a
// subnormal result by halving its argument below −126 and squaring the result: a compare and two
// predicated multiplies a call, 3 of sweep_prep's 50 instructions an element (session 39). Every
// decay of the scan takes it (forward, chunk_backward and the sweep alike, so their weights agree):
// a decay's argument is at most 0, so only decays below 1.2e−38 become 0. The IEEE expf it replaced
// in the forward's weights differs by about 2 ulp.
static __device__ __forceinline__ float exp_flushed(float x) {
  float result;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(result) : "f"(__fmul_rn(x, 1.44269502162933349609375f)));
  return result;
}

// The hardware exponential and reciprocal (about 2 ulp): the IEEE expf and division cost five
// times the instructions, and the backward takes three sigmoids per gated element. exp_flushed
// gives the sigmoid __expf's bits for every x: a term e^{−x} that __expf would leave subnormal
// changes 1 + e^{−x} by less than half an ulp of 1.
static __device__ __forceinline__ float sigmoidf(float x) {
  return __fdividef(1.f, 1.f + exp_flushed(-x));
}

struct ChunkPos {
  int b, h, g, c, t0, len;
};

template <class D>
static __device__ ChunkPos chunk_pos(const D& d, int bh_or_bg, bool by_group, int c) {
  ChunkPos pos;
  if (by_group) {
    pos.b = bh_or_bg / d.groups;
    pos.g = bh_or_bg % d.groups;
    pos.h = pos.g * d.heads_per_group;
  } else {
    pos.b = bh_or_bg / d.heads;
    pos.h = bh_or_bg % d.heads;
    pos.g = pos.h / d.heads_per_group;
  }
  pos.c = c;
  pos.t0 = c * d.chunk;
  pos.len = min(d.chunk, d.seqlen - pos.t0);
  return pos;
}

template <class D>
static __device__ __forceinline__ size_t token_head(const D& d, int b, int t, int h) {
  return (static_cast<size_t>(b) * d.seqlen + t) * d.heads + h;
}

// The end of finish_token_terms' and sweep_token_terms' work, one formula for both. A (token,
// head)'s adt, dt and trap gradients from its terms (d_dt with the angles' terms added) and, where
// t > 0 (has_prev), κ_{t−1}'s gradient `prev`.
static __device__ __forceinline__ void store_token_head_terms(const DevGrads& grads, size_t th,
                                                              float tau, float dt, float d_adt,
                                                              float d_dt, float d_tau,
                                                              bool has_prev, float prev) {
  if (has_prev) {
    d_dt += prev * (1.f - tau);
    d_tau -= prev * dt;
  }
  grads.adt[th] = __float2bfloat16(d_adt);
  grads.dt[th] = __float2bfloat16(d_dt);
  grads.trap[th] = __float2bfloat16(d_tau * tau * (1.f - tau));
}
// An angle's gradient from the heads' dt-weighted sum of its dθ and its tanh (`slope`).
static __device__ __forceinline__ bf16 angle_gradient(float sum, float slope) {
  return __float2bfloat16(sum * (1.f - slope * slope) * kPi);
}

// The per-token gradients of one (batch, chunk) from the backward's per-token terms, by the
// block's threads: the angles' (Work::dtheta holding each head's suffix sums of dθ, weighted by
// the head's dt and summed here over the heads in order), and adt's, dt's and trap's (the κ_{t−1}
// terms added to tok_ddt's and tok_dtau's). finish_tokens' last step (sweep_finish has its own,
// sweep_token_terms).
static __device__ __forceinline__ void finish_token_terms(const Dims& d, const DevInputs& in,
                                                          const Work& w, const DevGrads& grads,
                                                          int b, int t0, int len) {
  const int A = d.angles, H = d.heads;
  for (int item = threadIdx.x; item < len * A; item += blockDim.x) {
    const int i = d.by_angles.div(item), j = d.by_angles.mod(item), t = t0 + i;
    const size_t token = static_cast<size_t>(b) * d.seqlen + t;
    const float slope = tanhf(to_f(in.angles[token * A + j]));
    float sum = 0.f;
    // Unrolled so that the loads of several heads are in flight at once (a latency-bound loop).
#pragma unroll 8
    for (int h = 0; h < H; ++h) {
      const size_t bh = static_cast<size_t>(b) * H + h;
      sum += w.dtheta[(bh * d.seqlen + t) * A + j] * to_f(in.dt[token * H + h]);
    }
    grads.angles[token * A + j] = angle_gradient(sum, slope);
  }
  for (int item = threadIdx.x; item < len * H; item += blockDim.x) {
    const int i = item / H, h = item % H, t = t0 + i;
    const size_t token = static_cast<size_t>(b) * d.seqlen + t;
    const size_t th = token * H + h;
    const size_t bh = static_cast<size_t>(b) * H + h;
    const float tau = sigmoidf(to_f(in.trap[th])), dt = to_f(in.dt[th]);
    float d_dt = w.tok_ddt[th];
#pragma unroll 8
    for (int j = 0; j < A; ++j) {
      d_dt += w.dtheta[(bh * d.seqlen + t) * A + j] * tanhf(to_f(in.angles[token * A + j])) * kPi;
    }
    store_token_head_terms(grads, th, tau, dt, w.tok_dadt[th], d_dt, w.tok_dtau[th], t > 0,
                           t > 0 ? w.tok_dkappa[th - H] : 0.f);
  }
}

// Where head h's row of headdim elements begins for token t of batch b in a per-token tensor
// whose tokens lie `token_stride` elements apart (heads · headdim when dense: token_head · P).
template <class D>
static __device__ __forceinline__ size_t token_row(const D& d, int b, int t, int h,
                                                   size_t token_stride) {
  return (static_cast<size_t>(b) * d.seqlen + t) * token_stride +
         static_cast<size_t>(h) * d.headdim;
}

// token_row of z and of v: they may be read in place inside a wider row (in_proj's output:
// ScanDeviceInputs::zv_row_stride), so their tokens lie in.zv_stride elements apart rather than
// heads · headdim.
template <class D>
static __device__ __forceinline__ size_t zv_row(const D& d, const DevInputs& in, int b, int t,
                                                int h) {
  return token_row(d, b, t, h, in.zv_stride);
}

// The block's elements 0 … items−1, thread-strided as in `for (idx = threadIdx.x; idx < items;
// idx += blockDim.x)`, kBatch of a thread's elements at a time: every global load of a batch
// (`load`, which only loads) is issued before `store` uses the first of them. The loaders are
// where chunk_backward's warps wait most (long-scoreboard stalls on the first use of each loaded
// value, measured with ncu's source counters): one element per iteration exposes a load's full
// latency per element; a batch exposes it once.
template <int kBatch, class Load, class Store>
static __device__ __forceinline__ void for_each_batched(int items, Load load, Store store) {
  using Loaded = decltype(load(0));
  for (int first = threadIdx.x; first < items; first += kBatch * blockDim.x) {
    Loaded loaded[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = first + u * static_cast<int>(blockDim.x);
      if (idx < items) loaded[u] = load(idx);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = first + u * static_cast<int>(blockDim.x);
      if (idx < items) store(idx, loaded[u]);
    }
  }
}
constexpr int kLoadBatch = 4;

// Columns a loader moves per index at the fixed shapes: W neighbouring bf16 of a row in one 8- or
// 16-byte load and store. An element at a time, the loaders' index arithmetic and 2-byte loads were
// about a sixth of chunk_backward's instructions (ncu source counters). Mamba3ScanCuda requires
// its bf16 inputs 16-byte aligned, and every row of the fixed shapes is a multiple of 16 bytes; at
// other shapes the loaders keep an element an index. kColumnsPerItem: rows of P (PsiV, dO);
// kRotatedColumnsPerItem: the rotation's half rows of N/2 (its pairs (n, n + N/2)).
template <class D>
constexpr int kColumnsPerItem = D::kFixed ? 8 : 1;
template <class D>
constexpr int kRotatedColumnsPerItem = D::kFixed ? 4 : 1;
// The per-token passes that also read and write fp32 rows of shared memory (the gating epilogues,
// dx) take four columns an index: one float4 a row, neighbouring threads on neighbouring 16 bytes.
// With eight, a warp's element-wise reads of those rows lay 32 bytes a thread apart (bank
// conflicts): MIMO forward+backward 17.3 -> 19.0 ms, measured.
template <class D>
constexpr int kPassColumnsPerItem = D::kFixed ? 4 : 1;

// W neighbouring bf16 of a row, held as one raw load (W in 1, 2, 4, 8).
template <int W>
struct Bf16Row {
  using Raw = std::conditional_t<
      W == 8, uint4,
      std::conditional_t<W == 4, uint2, std::conditional_t<W == 2, uint32_t, unsigned short>>>;
  Raw raw;
  __device__ __forceinline__ float at(int w) const {
    return __bfloat162float(reinterpret_cast<const bf16*>(&raw)[w]);
  }
};
template <int W>
static __device__ __forceinline__ Bf16Row<W> load_row(const bf16* from) {
  return {*reinterpret_cast<const typename Bf16Row<W>::Raw*>(from)};
}
template <int W>
static __device__ __forceinline__ void store_row(bf16* to, const Bf16Row<W>& row) {
  *reinterpret_cast<typename Bf16Row<W>::Raw*>(to) = row.raw;
}
template <int W>
static __device__ __forceinline__ Bf16Row<W> zero_row() {
  Bf16Row<W> row;
  row.raw = {};
  return row;
}
// W floats rounded to bf16 (to nearest even, as __float2bfloat16).
template <int W>
static __device__ __forceinline__ Bf16Row<W> round_row(const float (&values)[W]) {
  Bf16Row<W> row;
  bf16* out = reinterpret_cast<bf16*>(&row.raw);
#pragma unroll
  for (int w = 0; w < W; ++w) out[w] = __float2bfloat16(values[w]);
  return row;
}
// Four neighbouring floats as store_split's pairs: their hi parts and their lo parts.
static __device__ __forceinline__ void split_quad(const float4& x, Bf16Row<4>& hi, Bf16Row<4>& lo) {
  const float values[4] = {x.x, x.y, x.z, x.w};
  float high[4], low[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    high[e] = to_f(__float2bfloat16(values[e]));
    low[e] = values[e] - high[e];
  }
  hi = round_row<4>(high);
  lo = round_row<4>(low);
}
// split_quad's parts stored 8 bytes at a time (at + hi and at + lo 8-byte aligned): four 2-byte
// stores a part put a warp's lanes 8 bytes apart, on 2-way bank conflicts. The parts are returned
// for a caller that stores them elsewhere too.
struct SplitQuad {
  Bf16Row<4> hi, lo;
};
static __device__ __forceinline__ SplitQuad store_split_quad(const float4& x, bf16* hi, bf16* lo,
                                                             int at) {
  SplitQuad parts;
  split_quad(x, parts.hi, parts.lo);
  store_row(hi + at, parts.hi);
  store_row(lo + at, parts.lo);
  return parts;
}
// Chunk bhc's entry state split in place of its fp32 copy (Work::states): hi parts [P, N], then lo
// parts (the same bytes as the fp32 state).
static __device__ __forceinline__ bf16* entry_split_of(const Work& w, size_t bhc, int matrix) {
  return reinterpret_cast<bf16*>(w.states + bhc * matrix);
}
// W floats from `from`, four at a time where W allows (`from` then 16-byte aligned).
template <int W>
static __device__ __forceinline__ void load_floats(const float* from, float (&values)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      const float4 x = reinterpret_cast<const float4*>(from)[q];
      values[4 * q] = x.x;
      values[4 * q + 1] = x.y;
      values[4 * q + 2] = x.z;
      values[4 * q + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int w = 0; w < W; ++w) values[w] = from[w];
  }
}
// W floats to `to`, four at a time where W allows (`to` then 16-byte aligned).
template <int W>
static __device__ __forceinline__ void store_floats(float* to, const float (&values)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      reinterpret_cast<float4*>(to)[q] =
          make_float4(values[4 * q], values[4 * q + 1], values[4 * q + 2], values[4 * q + 3]);
    }
  } else {
#pragma unroll
    for (int w = 0; w < W; ++w) to[w] = values[w];
  }
}
// Index idx of a loader over rows of `columns` elements, W to an index: its row and first column.
struct RowColumn {
  int row, col;
};
template <int W, int kColumns, class Div>
static __device__ __forceinline__ RowColumn row_column(const Div& by_columns, int idx) {
  if constexpr (W == 1) {
    return {by_columns.div(idx), by_columns.mod(idx)};
  } else {
    constexpr unsigned kPerRow = kColumns / W;
    static_assert(kColumns % W == 0);
    return {static_cast<int>(static_cast<unsigned>(idx) / kPerRow),
            static_cast<int>(static_cast<unsigned>(idx) % kPerRow) * W};
  }
}
// A loader's index over rows of P (PsiV, dO), W columns to an index.
template <int W, class D>
static __device__ __forceinline__ RowColumn headdim_item(const D& d, int idx) {
  if constexpr (W == 1) {
    return row_column<1, 1>(d.by_headdim, idx);
  } else {
    return row_column<W, D::headdim>(d.by_headdim, idx);
  }
}
// An index over rows of N (states, dQ and dK), W columns to an index.
template <int W, class D>
static __device__ __forceinline__ RowColumn state_item(const D& d, int idx) {
  if constexpr (W == 1) {
    return row_column<1, 1>(d.by_state, idx);
  } else {
    return row_column<W, D::state>(d.by_state, idx);
  }
}
// An index over rows of C·R (the scores), W columns to an index.
template <int W, class D>
static __device__ __forceinline__ RowColumn rows_item(const D& d, int idx) {
  if constexpr (W == 1) {
    return row_column<1, 1>(d.by_rows, idx);
  } else {
    return row_column<W, D::rows>(d.by_rows, idx);
  }
}
// Indexes one thread's loads take in one batch: one at the fixed shapes (a thread's W-wide loads
// are its batch, and four of them for each of two loaders would cost registers), else kLoadBatch.
template <class D>
constexpr int kLoaderBatch = D::kFixed ? 1 : kLoadBatch;

// An mma tile's fragment values [half][column] of rows (token, rank), rank fastest, R ranks a
// token with R dividing 8: each summed over its token's R rows, which lie in the lanes g ^ 1 …
// (4 apart) of the calling warp. Every lane calls it together.
static __device__ __forceinline__ void sum_over_token_ranks(float (&values)[2][2], int ranks) {
  for (int offset = 4; offset < 4 * ranks; offset <<= 1) {
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        values[half][c] += __shfl_xor_sync(0xffffffffu, values[half][c], offset);
      }
  }
}

// One halving step: the lane's bit kMask selects the upper or lower kWidth values, and each of
// the kept ones gets the partner lane's copy (kMask apart) added; they end in sums[0, kWidth).
template <int kWidth, int kMask = 2 * kWidth, int kCount>
static __device__ __forceinline__ void halve(float (&sums)[kCount], int lane) {
  static_assert(2 * kWidth <= kCount);
  const bool upper = (lane & kMask) != 0;
#pragma unroll
  for (int i = 0; i < kWidth; ++i) {
    const float low = sums[i], high = sums[i + kWidth];
    sums[i] = (upper ? high : low) + __shfl_xor_sync(0xffffffffu, upper ? low : high, kMask);
  }
}

// An mma tile's fragment of one token's row (rows (token, rank), columns j0 + half·8 + 2t and the
// next), summed over the token's ranks (sum_over_token_ranks), stored as bf16 pairs by the rank-0
// lanes into head h's columns of a [B, T, H, P] gradient. Every lane calls it together.
template <class D>
static __device__ __forceinline__ void store_token_fragment(const D& d, const ChunkPos& pos, int h,
                                                            int token, int row, int j0, int t,
                                                            float (&values)[2][2], bf16* dst) {
  sum_over_token_ranks(values, d.rank);
  if (token < pos.len && d.by_rank.mod(row) == 0) {
    const size_t th = token_head(d, pos.b, pos.t0 + token, h);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      *reinterpret_cast<__nv_bfloat162*>(dst + th * d.headdim + j0 + half * 8 + 2 * t) =
          __floats2bfloat162_rn(values[half][0], values[half][1]);
    }
  }
}

// A prefix sum over count values by one whole warp, 32 at a time (shuffles within each group,
// the running total carried between groups): emit(k, initial + value_0 + … + value_k), or
// without value_k when exclusive; with reverse the order is count − 1, …, 0 (suffix sums).
// One thread walking the values serially was a chain of dependent shared-memory adds while the
// rest of the block waited.
template <class Load, class Emit>
static __device__ __forceinline__ void warp_scan(int count, bool reverse, bool exclusive,
                                                 float initial, Load load, Emit emit) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  float carry = initial;
  for (int base = 0; base < count; base += 32) {
    const int k = base + lane;
    const int at = reverse ? count - 1 - k : k;
    const float own = k < count ? load(at) : 0.f;
    float inclusive = own;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float other = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    float before = __shfl_up_sync(0xffffffffu, inclusive, 1);
    if (lane == 0) before = 0.f;
    if (k < count) emit(at, carry + (exclusive ? before : inclusive));
    carry += __shfl_sync(0xffffffffu, inclusive, 31);
  }
}

// a · x + y with one rounding per element: the step of the state passes, wherever it is taken
// (state_recurrence, chunk_forward, the fused chunk_dstate), so that they give the same bits.
static __device__ __forceinline__ float4 scale_add(float a, float4 x, float4 y) {
  return make_float4(__fmaf_rn(a, x.x, y.x), __fmaf_rn(a, x.y, y.y), __fmaf_rn(a, x.z, y.z),
                     __fmaf_rn(a, x.w, y.w));
}

// The chain over chunks of chunk_forward and the fused chunk_dstate (see chunk_forward_kernel):
// the block's (batch, head) pair and chunk, from a ticket taken in launch order, chunk-major, from
// the last chunk back when `reverse`. A block waits only on the block B·H tickets before it,
// which took its ticket earlier and so is running or done: every wait ends, whatever order the
// hardware starts blocks in. Thread 0 takes the ticket and makes the chunk's position: its
// integer divisions (by B·H, H and the group size) once a block rather than once a thread, where
// they were about 3% of chunk_forward's instructions (ncu source counters).
template <class D>
static __device__ __forceinline__ ChunkPos take_chain_chunk(const D& d, int* order, bool reverse) {
  __shared__ ChunkPos taken;
  if (threadIdx.x == 0) {
    const int pairs = d.batch * d.heads;
    const int ticket = atomicAdd(order, 1), chunk = ticket / pairs;
    taken = chunk_pos(d, ticket % pairs, false, reverse ? d.chunks - 1 - chunk : chunk);
  }
  __syncthreads();
  return taken;
}

// When `wait`: thread 0 waits until `flag` is set, then orders the block's later loads after what
// the setter published (those loads bypass L1: __ldcg). A barrier for the whole block either way.
// The poll is an acquire load (sm_70 and later): the flag's read orders the loads after it, with
// no fence of its own on the chain's critical path (with the fence after a volatile poll, MIMO's
// forward chain took 2.6% longer at 128 pairs and 12% at 32: bench/RESULTS.md, session 27).
static __device__ __forceinline__ void wait_ready(const int* flag, bool wait) {
  if (threadIdx.x == 0 && wait) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    int ready = 0;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
    } while (ready == 0);
#else
    while (*reinterpret_cast<const volatile int*>(flag) == 0) {
    }
    __threadfence();
#endif
  }
  __syncthreads();
}

// A barrier for the whole block; when `publish`, then every thread's stores before the call made
// visible device-wide and `flag` set. The block's stores are ordered before thread 0's by the
// barrier, and its release store (sm_70 and later) orders them all before the flag at device
// scope (a release is cumulative: the pattern of CUTLASS's semaphore and of cooperative groups'
// grid barrier). A fence in every thread before the barrier was 5% of chunk_forward's stall
// samples at MIMO (membar, ncu source counters, session 38).
static __device__ __forceinline__ void publish_ready(int* flag, bool publish) {
  __syncthreads();
  if (threadIdx.x == 0 && publish) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(1) : "memory");
#else
    __threadfence();
    atomicExch(flag, 1);
#endif
  }
}

// The state passes' recurrence over one thread's four neighbouring elements of every chunk's state
// (column[c · stride], c in order, or in reverse): before chunk c's value x_c is read it is
// replaced by the running value, which then becomes scale_c · running + x_c. Loads are issued a
// batch of chunks at a time (one dependent load per chunk left the pass latency-bound: 10.7 ms at
// M3-ref, about 200 GB/s), and the next batch's loads are issued before the current batch's
// stores, so that a batch's memory latency overlaps the previous batch's stores (they touch other
// chunks; the compiler cannot hoist the loads itself across the in-place stores). chunks ≥ 1 (the
// first batch is loaded before the loop; validate refuses an empty sequence).
template <bool kReverse>
static __device__ __forceinline__ void state_recurrence(float4* column, size_t stride,
                                                        const float* scale, int chunks) {
  constexpr int kBatch = 8;
  const auto chunk_of = [&](int k) {  // the k-th chunk walked, clamped to a real one
    const int c = min(k, chunks - 1);
    return kReverse ? chunks - 1 - c : c;
  };
  float4 values[kBatch], ahead[kBatch];
  float scales[kBatch], ahead_scales[kBatch];
#pragma unroll
  for (int x = 0; x < kBatch; ++x) {
    values[x] = column[chunk_of(x) * stride];
    scales[x] = scale[chunk_of(x)];
  }
  float4 running = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int k0 = 0; k0 < chunks; k0 += kBatch) {
    const bool more = k0 + kBatch < chunks;
    if (more) {
#pragma unroll
      for (int x = 0; x < kBatch; ++x) {
        ahead[x] = column[chunk_of(k0 + kBatch + x) * stride];
        ahead_scales[x] = scale[chunk_of(k0 + kBatch + x)];
      }
    }
#pragma unroll
    for (int x = 0; x < kBatch; ++x) {
      if (k0 + x < chunks) {
        column[chunk_of(k0 + x) * stride] = running;
        running = scale_add(scales[x], running, values[x]);
      }
    }
    if (more) {
#pragma unroll
      for (int x = 0; x < kBatch; ++x) {
        values[x] = ahead[x];
        scales[x] = ahead_scales[x];
      }
    }
  }
}

// Per-token scalars and rotation cos/sin of head pos.h for the chunk. Padded tokens
// (i ≥ len) get zero coefficients, so they contribute nothing anywhere. Each rotation pair's θ is
// scanned over the tokens by the lanes of one warp (a segment of `span` lanes, two or more pairs a
// warp when the chunk is short) straight from the loaded increments, and the same lanes take its
// cos and sin; the last warp also makes the token scalars and l's prefix. So the pass has one
// barrier, at its end: it had three (the increments through shared memory, then a warp's scan
// per pair while the others waited, then sincos), and its barriers were a tenth of
// chunk_backward's stall samples at MIMO (ncu source counters). Every global load of a batch of a
// lane's pair steps is issued before the first is used, and the last warp's token loads before
// its pair steps. The sums are warp_scan's, in its order; the compiler may now fuse an increment's
// last product into the first sum it enters (no longer stored between them), which can change θ
// in its last bit: every kernel takes θ from here, so they still agree.
template <bool kLandCopies = false, class D>
static __device__ void load_scalars(const D& d, const DevInputs& in, const Work& w,
                                    const ChunkPos& pos, float* sc, float* cosv, float* sinv) {
  const int C = d.chunk, A = d.angles, ld_a = angles_stride(A);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) / 32, warps = static_cast<int>(blockDim.x) / 32;
  const bool token_warp = warp == warps - 1;
  // A token's adt, dt, trap, and the next token's trap and dt (κ); zeros for padded tokens.
  struct TokenLoads {
    bf16 adt, dt, trap, next_trap, next_dt;
  };
  const auto load_token = [&](int i) {
    const bf16 zero = __float2bfloat16(0.f);
    TokenLoads t{zero, zero, zero, zero, zero};
    if (i < pos.len) {
      const size_t th = token_head(d, pos.b, pos.t0 + i, pos.h);
      t.adt = in.adt[th];
      t.dt = in.dt[th];
      t.trap = in.trap[th];
      if (pos.t0 + i + 1 < d.seqlen) {
        t.next_trap = in.trap[th + d.heads];
        t.next_dt = in.dt[th + d.heads];
      }
    }
    return t;
  };
  constexpr int kTokenGroupsAhead = 2;  // 64 tokens: both fixed chunks
  TokenLoads ahead[kTokenGroupsAhead];
  if (token_warp) {
#pragma unroll
    for (int g = 0; g < kTokenGroupsAhead; ++g) ahead[g] = load_token(g * 32 + lane);
  }

  // θ of pair j at token i = θ at the chunk's start + Σ_{k ≤ i} tanh(angle_k,j)·DT_k·π.
  const int span = C >= 32 ? 32 : 1 << (32 - __clz(C - 1));  // C ≤ span up to 32 lanes
  const int pairs_per_warp = 32 / span, part = lane / span, slot = lane % span;
  const int groups = (C + span - 1) / span;  // 32-token groups of a pair (one when C ≤ 32)
  const int pair_stride = warps * pairs_per_warp;
  // The rounds of pairs in which this warp has one: a warp with none skips the loop. At chunk 16
  // two pairs share a warp, so A = 16 pairs fill 8 of a 16-warp block; the other 8 ran the loop
  // on zeros until session 52 (chunk_forward at MIMO: forward −3.7%, bench/RESULTS.md).
  const int first_pair = warp * pairs_per_warp;
  const int rounds = first_pair < A ? (A - first_pair + pair_stride - 1) / pair_stride : 0;
  const int steps = rounds * groups;
  const size_t bh = static_cast<size_t>(pos.b) * d.heads + pos.h;
  const float* theta_start = w.theta0 + (bh * d.chunks + pos.c) * A;
  constexpr int kStepsAhead = 4;
  float carry = 0.f;
  for (int first = 0; first < steps; first += kStepsAhead) {
    bf16 angle[kStepsAhead], dt[kStepsAhead];
    float start[kStepsAhead];
#pragma unroll
    for (int u = 0; u < kStepsAhead; ++u) {
      const int step = first + u;
      const int j = step / groups * pair_stride + warp * pairs_per_warp + part;
      const int i = step % groups * span + slot;
      angle[u] = dt[u] = __float2bfloat16(0.f);
      start[u] = 0.f;
      if (step < steps && j < A) {
        if (step % groups == 0) start[u] = theta_start[j];
        if (i < pos.len) {
          const int t = pos.t0 + i;
          angle[u] = in.angles[(static_cast<size_t>(pos.b) * d.seqlen + t) * A + j];
          dt[u] = in.dt[token_head(d, pos.b, t, pos.h)];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kStepsAhead; ++u) {
      const int step = first + u;
      if (step >= steps) break;  // the same for the whole warp
      const int j = step / groups * pair_stride + warp * pairs_per_warp + part;
      const int i = step % groups * span + slot;
      if (step % groups == 0) carry = start[u];
      float inclusive = tanhf(to_f(angle[u])) * to_f(dt[u]) * kPi;  // 0 for padded tokens
      for (int offset = 1; offset < span; offset <<= 1) {
        const float other = __shfl_up_sync(0xffffffffu, inclusive, offset, span);
        if (slot >= offset) inclusive += other;
      }
      if (j < A && i < C) {
        float cs = 1.f, sn = 0.f;
        if (i < pos.len) sincosf(carry + inclusive, &sn, &cs);
        cosv[i * ld_a + j] = cs;
        sinv[i * ld_a + j] = sn;
      }
      carry += __shfl_sync(0xffffffffu, inclusive, span - 1, span);
    }
  }

  if (token_warp) {
    float log_carry = 0.f;
    for (int base = 0; base < C; base += 32) {
      const int i = base + lane;
      const int group = base / 32;
      const TokenLoads t = group < kTokenGroupsAhead ? ahead[group] : load_token(i);
      const bool token = i < pos.len;
      float tau = 0.f, kappa = 0.f;
      if (token) {
        tau = sigmoidf(to_f(t.trap));
        kappa = tau * to_f(t.dt);
        if (pos.t0 + i + 1 < d.seqlen)
          kappa += (1.f - sigmoidf(to_f(t.next_trap))) * to_f(t.next_dt);
      }
      float inclusive = to_f(t.adt);  // l: the prefix of adt (warp_scan's sums)
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const float other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
      }
      if (i < C) {
        sc[kAdt * C + i] = to_f(t.adt);
        sc[kLog * C + i] = log_carry + inclusive;
        sc[kDt * C + i] = to_f(t.dt);
        sc[kTau * C + i] = tau;
        sc[kGamma * C + i] = tau * to_f(t.dt);
        sc[kKappa * C + i] = kappa;
      }
      log_carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    __syncwarp();
    const float last = sc[kLog * C + (pos.len - 1)];
    for (int i = lane; i < C; i += 32) {
      sc[kEntryDecay * C + i] = exp_flushed(sc[kLog * C + i]);
      sc[kExitScale * C + i] = exp_flushed(last - sc[kLog * C + i]) * sc[kKappa * C + i];
    }
  }
  if constexpr (kLandCopies) wait_copies<0>();
  __syncthreads();
}

// chunk_dstate's inputs copied into shared memory with cp.async (16 bytes a copy, zeros for padded
// tokens) before load_scalars, so that their memory latency overlaps the scalars' instead of
// following it: the loaders then read them there (RotatedLoader's staged rows, DOutLoader's staged
// z and dy). The loaders' first use of each loaded value, after the scalars' barrier, was where its
// warps waited most (long-scoreboard stalls, ncu source counters). The caller commits the copies
// and lands them (load_scalars with kLandCopies). Fixed shapes only: their rows are whole 16-byte
// pieces, and the per-token tensors are 16-byte aligned (require_aligned_rows). Staged the same
// way, q and k of chunk_forward and chunk_backward (L2-resident there) measured 2-5% slower.
constexpr int kStagePiece = 8;  // bf16 per 16-byte copy
// The chunk's rows (i, r) of q or k ([B, T, R, G, N]) as [rows][N], unpadded.
template <class D>
static __device__ __forceinline__ void stage_rows(const D& d, const bf16* src, const ChunkPos& pos,
                                                  bf16* staged) {
  static_assert(D::kFixed && D::state % kStagePiece == 0);
  constexpr int kPieces = D::state / kStagePiece;
  const bf16* chunk_src =
      src +
      ((static_cast<size_t>(pos.b) * d.seqlen + pos.t0) * D::rank * d.groups + pos.g) * D::state;
  for (int idx = threadIdx.x; idx < D::rows * kPieces; idx += blockDim.x) {
    const int row = idx / kPieces, piece = idx % kPieces;
    const bool valid = d.by_rank.div(row) < pos.len;
    const size_t at = valid ? static_cast<size_t>(row) * d.groups * D::state : 0;
    copy_16_async(staged + row * D::state + piece * kStagePiece,
                  chunk_src + at + piece * kStagePiece, valid);
  }
}
// The chunk's tokens of head pos.h of a [B, T, H, P] tensor (z, dy) as [C][P], unpadded.
template <class D>
static __device__ __forceinline__ void stage_tokens(const D& d, const bf16* src,
                                                    size_t token_stride, const ChunkPos& pos,
                                                    bf16* staged) {
  static_assert(D::kFixed && D::headdim % kStagePiece == 0);
  constexpr int kPieces = D::headdim / kStagePiece;
  for (int idx = threadIdx.x; idx < D::chunk * kPieces; idx += blockDim.x) {
    const int i = idx / kPieces, piece = idx % kPieces;
    const bool valid = i < pos.len;
    const size_t row = token_row(d, pos.b, pos.t0 + (valid ? i : 0), pos.h, token_stride);
    copy_16_async(staged + i * D::headdim + piece * kStagePiece, src + row + piece * kStagePiece,
                  valid);
  }
}

// Two element loaders over the same index space in one pass (for_each_batched): every global
// load of both is issued before either stores, so two tensors cost one memory latency per batch
// rather than two (q and k, or PsiV and dO, loaded one after the other were 7.7% and 14.1% of
// chunk_backward's time, measured). A loader has a Loaded type, load(idx) (loads only) and
// store(idx, loaded).
template <class First, class Second>
static __device__ __forceinline__ void load_together(int items, const First& first,
                                                     const Second& second) {
  static_assert(First::kBatch == Second::kBatch);
  struct Both {
    typename First::Loaded a;
    typename Second::Loaded b;
  };
  for_each_batched<First::kBatch>(
      items,
      [&](int idx) {
        return Both{first.load(idx), second.load(idx)};
      },
      [&](int idx, const Both& both) {
        first.store(idx, both.a);
        second.store(idx, both.b);
      });
}
template <class Loader>
static __device__ __forceinline__ void load_alone(int items, const Loader& loader) {
  for_each_batched<Loader::kBatch>(
      items, [&](int idx) { return loader.load(idx); },
      [&](int idx, const typename Loader::Loaded& loaded) { loader.store(idx, loaded); });
}

// q or k of head pos.h for the chunk: + bias, rotated, rounded to bf16. Rows (i, r); an index
// is (row, W columns n < N/2), the rotation pairs (n, n + N/2).
template <class D>
struct RotatedLoader {
  static constexpr int W = kRotatedColumnsPerItem<D>;
  static constexpr int kBatch = kLoaderBatch<D>;
  struct Loaded {
    Bf16Row<W> a, b, a_bias, b_bias;
  };
  const D& d;
  const ChunkPos& pos;
  const bf16* chunk_src;  // the chunk's first row; rows (i, r) lie G·N apart in [B, T, R, G, N]
  const bf16* bias;
  const float* cosv;
  const float* sinv;
  bf16* dst;
  int ld;
  const bf16* staged;  // the chunk's rows already in shared memory, [rows][N] (stage_rows), or null

  __device__ RotatedLoader(const D& dims, const ChunkPos& p, const bf16* src, const bf16* b,
                           const float* c, const float* s, bf16* out, int stride,
                           const bf16* staged_rows = nullptr)
      : d(dims),
        pos(p),
        chunk_src(src + ((static_cast<size_t>(p.b) * dims.seqlen + p.t0) * dims.rank * dims.groups +
                         p.g) *
                            dims.state),
        bias(b),
        cosv(c),
        sinv(s),
        dst(out),
        ld(stride),
        staged(staged_rows) {}
  static __device__ __forceinline__ int items(const D& d) { return d.rows * (d.state / 2) / W; }
  __device__ __forceinline__ RowColumn at(int idx) const {
    if constexpr (W == 1) {
      return row_column<1, 1>(d.by_half, idx);
    } else {
      return row_column<W, D::state / 2>(d.by_half, idx);
    }
  }

  __device__ __forceinline__ Loaded load(int idx) const {
    const int half = d.state / 2;
    const auto [row, n] = at(idx);
    const int i = d.by_rank.div(row), r = d.by_rank.mod(row);
    Loaded pair{zero_row<W>(), zero_row<W>(), zero_row<W>(), zero_row<W>()};
    if (i < pos.len) {
      const bf16* in_row =
          staged != nullptr ? staged + row * d.state : chunk_src + row * (d.groups * d.state);
      const bf16* bias_row = bias + (pos.h * d.rank + r) * d.state;
      pair = {load_row<W>(in_row + n), load_row<W>(in_row + n + half), load_row<W>(bias_row + n),
              load_row<W>(bias_row + n + half)};
    }
    return pair;
  }
  // cos θ and sin θ of an item's W pairs, read once for q and k (load_rotated_qk); `on` false where
  // a column has no pair (n ≥ A) or the token is padded.
  struct Rotation {
    float cs[W], sn[W];
    bool on[W];
  };
  __device__ __forceinline__ Rotation rotation(int idx) const {
    const int A = d.angles, ld_a = angles_stride(A);
    const auto [row, n0] = at(idx);
    const int i = d.by_rank.div(row);
    Rotation rot;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const int n = n0 + w;
      rot.on[w] = n < A && i < pos.len;
      rot.cs[w] = rot.on[w] ? cosv[i * ld_a + n] : 1.f;
      rot.sn[w] = rot.on[w] ? sinv[i * ld_a + n] : 0.f;
    }
    return rot;
  }
  __device__ __forceinline__ void store(int idx, const Loaded& pair, const Rotation& rot) const {
    const int half = d.state / 2;
    const auto [row, n0] = at(idx);
    // Padded tokens loaded zeros, so they store zeros.
    float first[W], second[W];
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float a = pair.a.at(w) + pair.a_bias.at(w);
      const float b = pair.b.at(w) + pair.b_bias.at(w);
      first[w] = a;
      second[w] = b;
      if (rot.on[w]) {
        first[w] = a * rot.cs[w] - b * rot.sn[w];
        second[w] = a * rot.sn[w] + b * rot.cs[w];
      }
    }
    store_row(dst + row * ld + n0, round_row<W>(first));
    store_row(dst + row * ld + n0 + half, round_row<W>(second));
  }
  __device__ __forceinline__ void store(int idx, const Loaded& pair) const {
    store(idx, pair, rotation(idx));
  }
};

template <class D>
static __device__ void load_rotated(const D& d, const bf16* src, const bf16* bias,
                                    const ChunkPos& pos, const float* cosv, const float* sinv,
                                    bf16* dst, int ld) {
  load_alone(RotatedLoader<D>::items(d), RotatedLoader<D>(d, pos, src, bias, cosv, sinv, dst, ld));
}

// q and k together: one memory latency for both, and one read of the rotation.
template <class D>
static __device__ void load_rotated_qk(const D& d, const DevInputs& in, const ChunkPos& pos,
                                       const float* cosv, const float* sinv, bf16* q_dst,
                                       bf16* k_dst, int ld) {
  using Loader = RotatedLoader<D>;
  const Loader q(d, pos, in.q, in.q_bias, cosv, sinv, q_dst, ld);
  const Loader k(d, pos, in.k, in.k_bias, cosv, sinv, k_dst, ld);
  struct Both {
    typename Loader::Loaded q, k;
  };
  // load_together's pass, with each item's cos θ and sin θ read once for both.
  for_each_batched<Loader::kBatch>(
      Loader::items(d),
      [&](int idx) {
        return Both{q.load(idx), k.load(idx)};
      },
      [&](int idx, const Both& both) {
        const typename Loader::Rotation rot = q.rotation(idx);
        q.store(idx, both.q, rot);
        k.store(idx, both.k, rot);
      });
}

// v = x ⊙ mimo_x (PsiV) of head pos.h, rows (i, r), bf16: from the cache when
// read_cache, else computed (and stored to the cache when write_cache). Both ways give
// the same bits, so the cache never changes results. An index is (row, W columns p). With
// mimo_x_copy, also the head's mimo_x [R][P] as fp32 (loaded by the rows of token 0 either way);
// with v_copy (not with read_cache), the chunk's v.
template <class D>
struct PsivLoader {
  static constexpr int W = kColumnsPerItem<D>;
  static constexpr int kBatch = kLoaderBatch<D>;
  struct Loaded {
    Bf16Row<W> v, mimo_x;
  };
  const D& d;
  const DevInputs& in;
  const ChunkPos& pos;
  bf16* cache;
  bool read_cache, write_cache;
  bf16* dst;
  int ld;
  float* mimo_x_copy = nullptr;
  bf16* v_copy = nullptr;          // the chunk's v, [C][P] (computing PsiV only)
  const bf16* staged_v = nullptr;  // the chunk's v already in shared memory, [C][P]
  // chunk_forward's exit-scaled PsiV as hi + lo pairs, rows of ld (PsiV times a token's exit
  // scale, from the PsiV just rounded: the bits of a pass over PsiV in shared memory).
  bf16* scaled_hi = nullptr;
  bf16* scaled_lo = nullptr;
  const float* exit_scale = nullptr;  // [C]

  static __device__ __forceinline__ int items(const D& d) { return d.rows * d.headdim / W; }
  __device__ __forceinline__ Loaded load(int idx) const {
    const int P = d.headdim, R = d.rank;
    const auto [row, p] = headdim_item<W>(d, idx);
    const int i = d.by_rank.div(row), r = d.by_rank.mod(row);
    Loaded loaded{zero_row<W>(), zero_row<W>()};
    if (i < pos.len) {
      const size_t th = token_head(d, pos.b, pos.t0 + i, pos.h);
      const size_t wr = (static_cast<size_t>(pos.h) * R + r) * P + p;
      if (read_cache) {
        loaded.v = load_row<W>(cache + (th * R + r) * P + p);
        if (mimo_x_copy != nullptr && i == 0) loaded.mimo_x = load_row<W>(in.mimo_x + wr);
      } else {
        loaded = {
            load_row<W>(staged_v != nullptr ? staged_v + i * P + p
                                            : in.v + zv_row(d, in, pos.b, pos.t0 + i, pos.h) + p),
            load_row<W>(in.mimo_x + wr)};
      }
    }
    return loaded;
  }
  __device__ __forceinline__ void store(int idx, const Loaded& loaded) const {
    const int P = d.headdim, R = d.rank;
    const auto [row, p] = headdim_item<W>(d, idx);
    const int i = d.by_rank.div(row), r = d.by_rank.mod(row);
    Bf16Row<W> value = loaded.v;
    if (!read_cache && i < pos.len) {
      float products[W];
#pragma unroll
      for (int w = 0; w < W; ++w) products[w] = loaded.v.at(w) * loaded.mimo_x.at(w);
      value = round_row<W>(products);
      if (write_cache) {
        const size_t th = token_head(d, pos.b, pos.t0 + i, pos.h);
        store_row(cache + (th * R + r) * P + p, value);
      }
    }
    store_row(dst + row * ld + p, value);
    if (scaled_hi != nullptr) {
      const float scale = exit_scale[i];
      float hi[W], lo[W];
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float x = value.at(w) * scale;
        hi[w] = to_f(__float2bfloat16(x));
        lo[w] = x - hi[w];
      }
      store_row(scaled_hi + row * ld + p, round_row<W>(hi));
      store_row(scaled_lo + row * ld + p, round_row<W>(lo));
    }
    if (mimo_x_copy != nullptr && i == 0) {
      float mimo_x[W];
#pragma unroll
      for (int w = 0; w < W; ++w) mimo_x[w] = loaded.mimo_x.at(w);
      store_floats<W>(mimo_x_copy + r * mimo_params_stride(P) + p, mimo_x);
    }
    if (v_copy != nullptr && r == 0) store_row(v_copy + i * P + p, loaded.v);
  }
};

template <class D>
static __device__ void load_psiv(const D& d, const DevInputs& in, const ChunkPos& pos, bf16* cache,
                                 bool read_cache, bool write_cache, bf16* dst, int ld) {
  load_alone(PsivLoader<D>::items(d),
             PsivLoader<D>{d, in, pos, cache, read_cache, write_cache, dst, ld});
}

// Token-level weights W[i][j] of the chunk (zero above the diagonal): token_weight makes one,
// fill_weights all C² in shared memory. chunk_backward makes each again where its plan leaves W no
// space (SmemPlan::weights_recomputed): the same expression, so the same bits.
template <class D>
static __device__ __forceinline__ float token_weight(const D& d, const float* sc, int i, int j) {
  const int C = d.chunk;
  if (j < i) return exp_flushed(sc[kLog * C + i] - sc[kLog * C + j]) * sc[kKappa * C + j];
  return j == i ? sc[kGamma * C + i] : 0.f;
}

template <class D>
static __device__ void fill_weights(const D& d, const float* sc, float* weights) {
  const int C = d.chunk, ld_w = weights_stride(C);
  for (int idx = threadIdx.x; idx < C * C; idx += blockDim.x) {
    const int i = d.by_chunk.div(idx), j = d.by_chunk.mod(idx);
    weights[i * ld_w + j] = token_weight(d, sc, i, j);
  }
}

// The strides a chunk kernel uses: constants for a fixed shape, the plan's otherwise.
template <class D>
static __device__ __forceinline__ SmemStrides strides_of(const SmemPlan& plan) {
  if constexpr (D::kFixed) {
    return smem_strides(D::state, D::headdim, D::rows);
  } else {
    return {plan.ld_qk, plan.ld_pv, plan.ld_state, plan.ld_mm, plan.ld_mp, plan.ld_mn, plan.ld_sw};
  }
}

// For the fixed shapes, each four neighbouring elements (p, n … n + 3) of a [P][N] fp32 state in
// global memory: at(p, n, the four as a float4). They load four at once (N % 4 == 0, and each
// state starts 16-byte aligned: the workspace parts are multiples of 256 bytes from a base that is
// 16-byte aligned, checked by the constructor, and a state is P·N floats), so a thread's elements
// of a 64 × 64 state arrive in one batch of loads rather than two.
template <class D, class At>
static __device__ __forceinline__ void for_each_state_quad(const D& d, const float* src, At at) {
  static_assert(D::kFixed && D::state % 4 == 0);
  for_each_batched<kLoadBatch>(
      D::headdim * D::state / 4, [&](int v) { return reinterpret_cast<const float4*>(src)[v]; },
      [&](int v, const float4& x) { at(d.by_state.div(4 * v), d.by_state.mod(4 * v), x); });
}
// For each element (p, n) of a [P][N] fp32 state in global memory, at(p, n, value): by quads at the
// fixed shapes.
template <class D, class At>
static __device__ __forceinline__ void for_each_state_element(const D& d, const float* src, At at) {
  if constexpr (D::kFixed) {
    for_each_state_quad(d, src, [&](int p, int n, const float4& x) {
      at(p, n, x.x);
      at(p, n + 1, x.y);
      at(p, n + 2, x.z);
      at(p, n + 3, x.w);
    });
  } else {
    for_each_batched<kLoadBatch>(
        d.headdim * d.state, [&](int idx) { return src[idx]; },
        [&](int idx, float value) { at(d.by_state.div(idx), d.by_state.mod(idx), value); });
  }
}

// A [P][N] fp32 state from global memory into rows of stride ld.
template <class D>
static __device__ void load_state(const D& d, const float* src, float* dst, int ld) {
  for_each_state_element(d, src, [&](int p, int n, float value) { dst[p * ld + n] = value; });
}

// Calls f(dims) with the shape's FixedDims when it is one of the compiled shapes, else with the
// runtime Dims: the chunk kernels are instantiated for both (host side).
template <class F>
void with_fixed_dims(const Dims& d, F&& f) {
  if (d.state == 64 && d.headdim == 64 && d.rank == 4 && d.chunk == 16) {
    f(FixedDims<64, 64, 4, 16>(d));  // M3-ref and bench-350m / bench-1.3b MIMO
  } else if (d.state == 64 && d.headdim == 64 && d.rank == 1 && d.chunk == 64) {
    f(FixedDims<64, 64, 1, 64>(d));  // their SISO variant
  } else {
    f(d);
  }
}

}  // namespace megacpp::cuda::scan_detail
