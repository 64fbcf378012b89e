// The backward as a sweep (ScanSweep, mamba3_scan.h): at the fixed SISO and MIMO shapes (N = P =
// 64, A = 16 rotation pairs; R = 1 and chunk 64, or R = 4 and chunk 16: either way a chunk is 64
// rows (token, rank)) on the tensor cores, where a block may have the core's shared memory and
// the kernels run as built for sm_90 (Hopper: sweep_core's copies are the tensor memory
// accelerator's), three kernels replace chunk_dstate, the reverse state pass, chunk_backward,
// dtheta_offsets and finish_tokens. Each is a template on R; the tiles are the chunk's 64 rows at
// either rank, and what is per token (l, κ, γ, θ, dt, trap, z, dy, x) is indexed by row / R:
//   sweep_prep    a block per (chunk, batch, head): dO = dy ⊙ silu(z ⊙ mimo_z) ⊙ mimo_o (bf16)
//                 per row, dz (summed over a token's ranks), mimo_z's and mimo_o's partials, from
//                 the pre-gate output the forward kept
//                 (Work::gate_in; the forward also kept the per-token scalars l, κ, γ and the
//                 rotation's cos θ and sin θ, as its load_scalars made them);
//   sweep_core    a block per (batch, head) walking the chunks in reverse with dL/d(exit state)
//                 on chip (the official mamba3_siso_bwd_kernel_dqkv's structure, bench/RESULTS.md
//                 sessions 32-34), 8 compute warps and a warpgroup that makes each chunk's
//                 operands while they work on the chunk after it, which gives each head's
//                 un-rotated dq and dk,
//                 dv = dL/dPsiV ⊙ mimo_x, the per-head partials (the biases', mimo_x's, dD's),
//                 dADT, dκ, the dt/trap terms of dκ and dγ, and dθ's suffix sums over the
//                 sequence (the reverse walk carries them from chunk to chunk);
//   sweep_finish  a block per (chunk, batch): q and k summed over each group's heads in head
//                 order, then sweep_token_terms (the angles', adt's, dt's, trap's gradients);
// then reduce_params. No floating-point atomics: the bits repeat.
//
// The core's mathematics (kernels/cpu/mamba3_scan_chunked.h's notation at R = 1, one (batch, head),
// chunk c; at R = 4 read t and s as rows (token, rank), with l, κ, γ and θ the row's token's, the
// causal mask and the diagonal (γ) by token (a token's rows see each other's at its γ), and the
// per-token gradients (dl, dκ, dγ, dθ, dv) summed over the token's rows):
// q̃_t = R(θ_t)(q_t + q_bias) and k̃_t likewise, rounded to bf16 once; l the chunk-local
// cumulative ADT; weights W_ts = e^{l_t − l_s} κ_s (s < t), γ_t (s = t); E_c the chunk's entry
// state (as the forward leaves it: split into hi + lo, from its fp32 value); X = dL/d(exit state of
// c); last = C − 1:
//   o_t     = Σ_{s≤t} (q̃_t·k̃_s) W_ts v_s + e^{l_t} E_c q̃_t + D v_t      (v = PsiV)
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
// Padded tokens of a last, shorter chunk arrive as zeros (q, k, v, dO; κ = γ = 0, adt = 0), so
// they add nothing anywhere.
//
// Precision: chunk_backward_kernel's note holds here too (wgmma may sum a product's fp32 terms in
// another order than mma.sync: the bits are its own, and repeat run to run). The rotated q
// and k are rounded once and used by both sides; every product with the state (E, X, e^{l} dO)
// takes split hi + lo operands. dO is rounded to bf16 once (as the official kernels do), and every
// product reads that one value, so the angle gradient's cancelling terms still see the same numbers
// (<E_c, X> reads E's split too). Each head's dq and dk are rounded to bf16 before the sums over
// heads (dθ and the biases' sums over tokens take the fp32 values). The decays e^{l} are
// exp_flushed's: __expf's bits, but 0 where those would be subnormal (below 1.2e−38, far under
// every tolerance), for three instructions fewer each.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <mutex>
#include <string>

#include "kernels/cuda/mamba3_scan_device.cuh"

namespace megacpp::cuda::scan_detail {
namespace {

// kC: a chunk's rows (token, rank), C · R: 64 tokens at R = 1 (SISO), 16 at R = 4 (MIMO).
constexpr int kC = 64, kN = 64, kP = 64, kA = 16;
// The [64][64] bf16 operands of the products (q, k, dO, PsiV, and the splits of E, X and e^{l} dO)
// are held dense and swizzled: 128-byte rows whose 16-byte chunk c is stored at c ^ (row % 8), the
// tensor memory accelerator's 128-byte swizzle (it writes q, k, dO and E so), which wgmma reads
// through a descriptor and which keeps ldmatrix's rows (below sm_90a) on distinct banks. Each tile
// starts on a 1024-byte boundary, so that row % 8 is the address's bits 7-9, as both units take it.
constexpr int kSwizzledTile = kC * kN;
// bf16 row stride of v as it came in (read by rows, not by the products): padded, so that the key
// warps' reads of a row each (sweep_core's dv terms) fall on distinct banks at R = 1.
constexpr int kLd = 72;
// sweep_core's block: 8 compute warps (0-3 the query side, 4-7 the key side) and a warpgroup of
// operand warps (8-11) that makes each chunk's operands a chunk ahead of them (in the reverse
// walk's order). Registers (setmaxnreg): 168 a thread at entry (65,536 / 384), then the compute
// warps take what they use without spilling (224 at R = 4, 232 at R = 1) and the operand warps keep
// the rest (56 or 40: 2 · 224 + 56 = 3 · 168). setmaxnreg is sm_90a's: built for another
// architecture every warp keeps 168 (the compute warps spill; the results are the same). The sums
// assume the 168 that __launch_bounds__(384, 1) gives: a -maxrregcount below it would leave the
// compute warps' setmaxnreg.inc waiting for registers that never come free.
constexpr int kCoreWarps = 8, kCoreThreads = kCoreWarps * 32;
constexpr int kOperandThreads = 128;
constexpr int kCoreBlockThreads = kCoreThreads + kOperandThreads;
constexpr int kEntryRegisters = 65536 / kCoreBlockThreads / 8 * 8;
template <int R>
constexpr int kComputeRegisters = R == 1 ? 232 : 224;
template <int R>
constexpr int kOperandRegisters = 3 * kEntryRegisters - 2 * kComputeRegisters<R>;
constexpr int kQueryThreads = kCoreThreads / 2;  // warps 0-3, the query side
constexpr int kAngleLd = kA + 1;                 // fp32 row stride of the dθ parts
// fp32 row stride of cos θ and sin θ: the tile copy's box is 20 floats wide (a multiple of 16
// bytes; the 4 past a row's 16 land as zeros).
constexpr int kRotationLd = kA + 4;

// Shared memory: two stages of the chunk's q and k (rotated in place once in), dO ([C][P]), v as
// it came in (a token's row once: [C / R][kLd]), cos θ, sin θ, l, κ and γ, PsiV = v ⊙ mimo_x, and
// E_c's split (hi and lo, rows p, columns n: the forward leaves it split, Work::states) and
// e^{l} dO's (rows t, columns p; the operand warps split it); the split operand of X (rows p,
// columns n; each query warp splits its rows), hi and lo; the head's mimo_x, and the parts that a
// chunk's warps leave for the next chunk to finish (two slots: dl's per token, the exit terms, <E,
// X>, dγ and dκ, dθ's q and k terms, mimo_x's column sums of each key warp, and the column sums of
// each warp's dq or dk). The operand tiles are swizzled (kSwizzledTile); the tile copies' other
// targets are 128-byte aligned (the tensor memory accelerator's rule), and each stage's copies land
// on its mbarriers (rotation_full, operands_full, entry_full).
template <int R>
struct CoreSmem {
  static constexpr int kTokens = kC / R;
  alignas(1024) bf16 q[2][kSwizzledTile], k[2][kSwizzledTile], d_out[2][kSwizzledTile],
      psiv[2][kSwizzledTile];
  alignas(128) bf16 v[2][kTokens * kLd];
  alignas(128) float cos_theta[2][kTokens * kRotationLd], sin_theta[2][kTokens * kRotationLd];
  alignas(16) float log_decay[2][kTokens], kappa[2][kTokens], gamma[2][kTokens];
  // E_c's split, a stage's, as the forward left it.
  alignas(1024) bf16 e_hi[2][kSwizzledTile], e_lo[2][kSwizzledTile];
  alignas(1024) bf16 x_hi[kSwizzledTile], x_lo[kSwizzledTile];
  // e^{l} dO's split, a stage's, made by the operand warps (the query warps' X update reads it;
  // split by the query warps, each its columns, then a barrier among them, it was on their chunk
  // step, the longest: bench/RESULTS.md session 47).
  alignas(1024) bf16 ds_hi[2][kSwizzledTile], ds_lo[2][kSwizzledTile];
  alignas(16) float mimo_x[R * kP];
  float dl_query[2][kTokens], dl_key[2][kTokens], exit_terms[2][kC];
  float d_gamma[2][kTokens], d_kappa[2][kTokens];
  float d_theta[2][2][kC * kAngleLd];
  float mimo_x_parts[2][4][R * kP];
  alignas(16) float bias_parts[2][2][4][R * kN];  // [slot][q, k][the side's warp][rank, column]
  float group_parts[2 * R * kN + R * kP];         // the biases' and mimo_x's over a group of chunks
  float dot_parts[2][4];                          // [slot][query warp]: <E_c, X>'s parts
  // A stage's copies land on three mbarriers, in the order they are needed: q, k, cos θ and sin θ
  // (the rotation's), then dO, v, l, κ and γ (PsiV's and e^{l} dO's), then E's split (the query
  // warps' alone, waited for by them).
  uint64_t rotation_full[2], operands_full[2], entry_full[2];
};

// The bytes of a stage's tile copies, by mbarrier: q, k, cos θ and sin θ; dO, v (C / R rows of
// kLd), l, κ and γ; E's two parts. A box's bytes count whole, its zeros past a tensor's bounds
// among them.
template <int R>
constexpr unsigned kRotationBytes = sizeof(bf16) * 2 * kSwizzledTile +
                                    sizeof(float) * (2 * kC / R) * kRotationLd;
template <int R>
constexpr unsigned kOperandsBytes = sizeof(bf16) * (kSwizzledTile + kC / R * kLd) +
                                    sizeof(float) * 3 * kC / R;
constexpr unsigned kEntryBytes = sizeof(bf16) * 2 * kSwizzledTile;

// sweep_core's tile copies (the tensor memory accelerator's maps, sweep_copies makes them for one
// backward). The operands' boxes (q, k, dO, E) are 64 elements (128 bytes) wide and written with
// the 128-byte swizzle (kSwizzledTile); v's box is kLd = 72 wide, its 8 past a row's 64 past the
// map's innermost dimension (zeros in the row's padding). Coordinates, innermost first:
//   q, k   (n, group, rank, token, batch): a chunk's box is its C rows (token, rank) in order;
//   v      (p, head, token, batch): C / R rows, a token's once;
//   d_out  (p, rank, head, token, batch), Work::sweep_d_out;
//   entry  (n, row) over Work::states as bf16 [B·H·chunks·2·P][N] (entry_split_of);
//   cos_theta, sin_theta (pair, row) over [B·H·Tp][A] fp32 (Work::sweep_rotation).
// Tokens past the sequence are past the token dimension: zeros, as the padded rows need.
struct SweepCopies {
  CUtensorMap q, k, v, d_out, entry, cos_theta, sin_theta;
};

// A pair of bf16 packed as pack_bf16 packs them (common.cuh), as floats.
__device__ __forceinline__ float2 unpack_bf16(uint32_t pair) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pair));
}

// A (batch, head)'s padded row count, chunks · C · R (the sweep's dq and dk hold whole chunks of
// rows).
__host__ __device__ inline size_t padded_rows(const Dims& d) {
  return static_cast<size_t>(d.chunks) * kC;
}

// ---------------------------------------------------------------------------------
// sweep_prep

constexpr int kPrepThreads = 256;

// The per-head parameters' partials a (batch, head) are one slot a group of kPartialGroupChunks
// chunks (sweep_prep's block; sweep_core sums its chunks' parts over the group on chip): at M3-ref
// MIMO a slot a chunk wrote and reduce_params read 336 MB of partials. 256 tokens a group at SISO,
// 128 at MIMO (its 64 were 0.3-0.5% slower forward+backward, bench/RESULTS.md session 36).
template <int R>
constexpr int kPartialGroupChunks = R == 1 ? 4 : 8;

__host__ __device__ inline int partial_groups(const Dims& d) {
  const int group = d.rank == 1 ? kPartialGroupChunks<1> : kPartialGroupChunks<4>;
  return (d.chunks + group - 1) / group;
}

// sweep_prep's shared memory: two steps' dy and z rows and their R rows of o a token, copied in
// (cp.async) a step ahead of the one computed, so a block's copies stay in flight while it
// computes (at M3-ref MIMO forward+backward 0.7% faster than a step at a time, in the same
// shared memory, 64 KB a block; SISO's block grew to 52 KB and is unchanged; with the column sums
// over the step buffers and 4 blocks an SM at 64 registers it spilled and was 3.4% slower,
// bench/RESULTS.md session 45). Loaded into registers, two rows a thread left DRAM 39% busy at
// M3-ref MIMO (ncu, session 36), where a warp's dy and z rows are one token's.
template <int R>
constexpr int kPrepStepTokens = R == 1 ? 64 : 32;
template <int R>
struct PrepSmem {
  static constexpr int kStepTokens = kPrepStepTokens<R>;
  bf16 dy[2][kStepTokens * kP], z[2][kStepTokens * kP], o[2][kStepTokens * R * kP];
  float sums[2][kPrepThreads / 32][R * kP];
};

// A block per (group of chunks, batch, head), a step of kPrepStepTokens tokens at a time.
template <int R>
__global__ void __launch_bounds__(kPrepThreads, 3)
    sweep_prep_kernel(Dims d, DevInputs in, Work w, const bf16* dy, DevGrads grads) {
  constexpr int kTokens = kC / R, kStepTokens = kPrepStepTokens<R>, kStepRows = kStepTokens * R;
  constexpr int kParts = kP / 8;  // 16-byte parts of a row
  constexpr int kWarps = kPrepThreads / 32;
  static_assert((kPartialGroupChunks<R> * kTokens) % kStepTokens == 0);
  extern __shared__ __align__(16) unsigned char prep_smem[];
  PrepSmem<R>& sm = *reinterpret_cast<PrepSmem<R>*>(prep_smem);
  const int group = blockIdx.x, bh = blockIdx.y, b = bh / d.heads, h = bh % d.heads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  // The gating's backward of one element: dO's and dz's terms, and mimo_z's and mimo_o's terms
  // added to their sums over the group's chunks.
  const auto gating = [](float dy_e, float z, float o, float mz, float mo, float& d_out, float& dz,
                         float& sum_z, float& sum_o) {
    const float gate = z * mz, sig = sigmoidf(gate), silu = gate * sig;
    d_out = dy_e * silu * mo;
    sum_o += dy_e * o * silu;
    const float d_gate = dy_e * o * mo * sig * (1.f + gate * (1.f - sig));
    dz = d_gate * mz;
    sum_z += d_gate * z;
  };
  // A thread's columns and what it sums. At R = 1 a thread takes eight columns p … p + 7 (16-byte
  // rows) of the step's rows row, row + 32, …. At R > 1 a warp takes the step's tokens warp, warp +
  // kWarps, … and a lane two columns p, p + 1 of all of a token's R rank rows: the token's dy and z
  // are read and converted once for its ranks, and dz's sum over the ranks is the thread's own. At
  // every R a thread's columns of mimo_z and mimo_o are converted once for the kernel. Until
  // session 53 a thread took one rank's eight columns at every R, and the ranks' dz were summed by
  // shuffles over lanes 8 apart; a warp has the same tokens either way, and every sum the same
  // order ((r0 + r1) + (r2 + r3) for dz). dz's rank products may now be fused into that sum (the
  // compiler's multiply-adds), so dz can differ from the shuffled sum's in its last bit. At MIMO
  // the kernel executes 20% fewer instructions and took 0.39 ms for 0.53 under ncu,
  // forward+backward 1.7-2.1% faster (bench/RESULTS.md, session 53).
  constexpr int W = R == 1 ? 8 : 2;
  const int p = R == 1 ? W * (lane % W) : W * lane, row = threadIdx.x / W;
  float mimo_z[R][W], mimo_o[R][W];  // the thread's columns, converted once
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const size_t wr = (static_cast<size_t>(h) * R + r) * kP + p;
    const Bf16Row<W> mz_row = load_row<W>(in.mimo_z + wr), mo_row = load_row<W>(in.mimo_o + wr);
#pragma unroll
    for (int e = 0; e < W; ++e) {
      mimo_z[r][e] = mz_row.at(e);
      mimo_o[r][e] = mo_row.at(e);
    }
  }
  float sum_z[R][W] = {}, sum_o[R][W] = {};
  const int group_tokens = kPartialGroupChunks<R> * kTokens;
  const int group_begin = group * group_tokens;
  const int group_end = min(group_begin + group_tokens, d.seqlen);
  // The copies of the step from token t0 into buffer `buffer`, as one group.
  const auto copy_step = [&](int t0, int buffer) {
    for (int item = threadIdx.x; item < kStepTokens * kParts; item += kPrepThreads) {
      const int i = item / kParts, part = item % kParts * 8, t = t0 + i;
      const bool valid = t < d.seqlen;
      const size_t th = token_head(d, b, valid ? t : t0, h);
      copy_16_async(sm.dy[buffer] + i * kP + part, dy + th * kP + part, valid);
      copy_16_async(sm.z[buffer] + i * kP + part, in.z + zv_row(d, in, b, valid ? t : t0, h) + part,
                    valid);
    }
    for (int item = threadIdx.x; item < kStepRows * kParts; item += kPrepThreads) {
      const int i = item / kParts, part = item % kParts * 8, t = t0 + i / R;
      const bool valid = t < d.seqlen;
      const size_t th = token_head(d, b, valid ? t : t0, h);
      copy_16_async(sm.o[buffer] + i * kP + part, w.gate_in + (th * R + i % R) * kP + part, valid);
    }
    commit_copies();
  };
  copy_step(group_begin, 0);
#pragma unroll 1
  for (int t0 = group_begin, buffer = 0; t0 < group_end; t0 += kStepTokens, buffer ^= 1) {
    // The next step's copies into the other buffer (read at the step before, and the barrier
    // at its end passed), then this step's wait.
    if (t0 + kStepTokens < group_end) {
      copy_step(t0 + kStepTokens, buffer ^ 1);
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    const bf16 *step_dy = sm.dy[buffer], *step_z = sm.z[buffer], *step_o = sm.o[buffer];
    if constexpr (R == 1) {
#pragma unroll 2
      for (int i = row; i < kStepRows; i += 32) {
        const int t = t0 + i;
        if (t >= d.seqlen) break;
        const size_t th = token_head(d, b, t, h);
        const Bf16Row<W> dy_row = load_row<W>(step_dy + i * kP + p);
        const Bf16Row<W> z_row = load_row<W>(step_z + i * kP + p);
        const Bf16Row<W> o_row = load_row<W>(step_o + i * kP + p);
        float d_out[W], dz[W];
#pragma unroll
        for (int e = 0; e < W; ++e) {
          gating(dy_row.at(e), z_row.at(e), o_row.at(e), mimo_z[0][e], mimo_o[0][e], d_out[e],
                 dz[e], sum_z[0][e], sum_o[0][e]);
        }
        store_row(w.sweep_d_out + th * kP + p, round_row<W>(d_out));
        store_row(grads.z + th * kP + p, round_row<W>(dz));
      }
    } else {
      static_assert(R == 4, "dz's sum over the ranks is written for four");
#pragma unroll 2
      for (int i = warp; i < kStepTokens; i += kWarps) {
        const int t = t0 + i;
        if (t >= d.seqlen) break;
        const size_t th = token_head(d, b, t, h);
        const Bf16Row<W> dy_row = load_row<W>(step_dy + i * kP + p);
        const Bf16Row<W> z_row = load_row<W>(step_z + i * kP + p);
        float dz[R][W];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const Bf16Row<W> o_row = load_row<W>(step_o + (i * R + r) * kP + p);
          float d_out[W];
#pragma unroll
          for (int e = 0; e < W; ++e) {
            gating(dy_row.at(e), z_row.at(e), o_row.at(e), mimo_z[r][e], mimo_o[r][e], d_out[e],
                   dz[r][e], sum_z[r][e], sum_o[r][e]);
          }
          store_row(w.sweep_d_out + (th * R + r) * kP + p, round_row<W>(d_out));
        }
        float dz_sum[W];
#pragma unroll
        for (int e = 0; e < W; ++e) dz_sum[e] = (dz[0][e] + dz[1][e]) + (dz[2][e] + dz[3][e]);
        store_row(grads.z + th * kP + p, round_row<W>(dz_sum));
      }
    }
    __syncthreads();  // the step's rows are read before the copies two steps on overwrite them
  }
  // A warp's sums by (rank, column), then the warps' in order. At R = 1 a column's sums are over
  // the lanes 8 apart (its rows), at R > 1 the thread's own.
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int e = 0; e < W; ++e) {
      float z = sum_z[r][e], o = sum_o[r][e];
      if constexpr (R == 1) {
#pragma unroll
        for (int offset = W; offset < 32; offset <<= 1) {
          z += __shfl_xor_sync(0xffffffffu, z, offset);
          o += __shfl_xor_sync(0xffffffffu, o, offset);
        }
      }
      if (R > 1 || lane < W) {
        sm.sums[0][warp][r * kP + p + e] = z;
        sm.sums[1][warp][r * kP + p + e] = o;
      }
    }
  }
  __syncthreads();
  const size_t slot = static_cast<size_t>(b) * partial_groups(d) + group;
  const size_t slots = static_cast<size_t>(d.batch) * partial_groups(d);
  // mimo_z's terms after the biases' and mimo_x's, then mimo_o's (reduce_params' layout).
  float* partial = w.partials + (static_cast<size_t>(h) * slots + slot) * d.partial_width;
  for (int item = threadIdx.x; item < 2 * R * kP; item += kPrepThreads) {
    const int which = item / (R * kP), column = item % (R * kP);
    float total = 0.f;
    for (int x = 0; x < kPrepThreads / 32; ++x) total += sm.sums[which][x][column];
    partial[2 * R * kN + (1 + which) * R * kP + column] = total;
  }
}

// ---------------------------------------------------------------------------------
// sweep_core

// sweep_core's hardware barriers (bar.sync waits; bar.arrive counts itself in and goes on):
//  - the X barrier (1, the compute warps): the query warps arrive once X's split operand is in
//    shared memory; the key warps wait there before their first read of it;
//  - a stage's ready barrier (2 + stage, the block): the operand warps arrive once the chunk's
//    stage (q and k rotated, PsiV, e^{l} dO's split, and the copies they waited for) is complete
//    (E's split lands on its own mbarrier, entry_full, which the query warps wait for); the compute
//    warps wait there at the chunk's start (so it is also their barrier between chunks: every part
//    a chunk's warps left is complete, and the one before it read);
//  - a stage's free barrier (4 + stage, the block): the compute warps arrive at the end of each
//    chunk c > 1; the operand warps wait there before they overwrite its stage (with chunk
//    c − 2's copies). One a stage: the operand warps arrive at chunk c − 1's ready barrier before
//    they wait at chunk c's free one, so the compute warps can finish chunk c − 1 while chunk c's
//    phase is still open, and on one barrier their arrival would meet it (one barrier measured 2%
//    slower at MIMO, bench/RESULTS.md session 41);
//  - the compute warps' own (8).
//
// compute-sanitizer's racecheck does not model bar.arrive: it reports hazards between accesses
// that a __syncthreads orders once a named barrier's producers only arrive, on a minimal kernel as
// on this one (bench/racecheck_named_barrier.cu, session 37). Built with
// -DMEGACPP_RACECHECK_NAMED_BARRIERS the query warps wait at the X barrier as well (the same
// order, slower); the operand warps' hand-overs cannot be waits on both sides (each side waits for
// the other's next one), so racecheck sees those as hazards (PsiV and e^{l} dO's split among them).
constexpr int kXBarrier = 1, kReadyBarrier = 2, kFreeBarrier = 4;
constexpr int kComputeBarrier = 8;
__device__ __forceinline__ void barrier_wait(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void arrive_x_split() {
#ifdef MEGACPP_RACECHECK_NAMED_BARRIERS
  barrier_wait(kXBarrier, kCoreThreads);
#else
  barrier_arrive(kXBarrier, kCoreThreads);
#endif
}
__device__ __forceinline__ void wait_x_split() {
  barrier_wait(kXBarrier, kCoreThreads);
}

// The per-token values (l or κ) of the columns u and u + 1 (u even): at R = 1 two tokens, one
// 8-byte read; at R > 1 (even) one token.
struct TokenPair {
  float x, y;
};
// l, κ and γ of the tokens of a lane's two fragment rows, row and row + 8.
struct RowScalars {
  float l[2], kappa[2], gamma[2];
};
template <int R>
__device__ __forceinline__ RowScalars row_scalars(const float* l, const float* kappa,
                                                  const float* gamma, int row) {
  RowScalars out;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int token = (row + 8 * half) / R;
    out.l[half] = l[token];
    out.kappa[half] = kappa[token];
    out.gamma[half] = gamma[token];
  }
  return out;
}
template <int R>
__device__ __forceinline__ TokenPair token_pair(const float* values, int u) {
  if constexpr (R == 1) {
    const float2 pair = *reinterpret_cast<const float2*>(values + u);
    return {pair.x, pair.y};
  } else {
    static_assert(R % 2 == 0);
    const float value = values[u / R];
    return {value, value};
  }
}

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

// Where a [64][64] operand tile holds its element (row, col) (kSwizzledTile's note).
__device__ __forceinline__ int swizzled(int row, int col) {
  return row * kN + (col ^ ((row & 7) << 3));
}
// Rows 8 apart have the same swizzle: their elements are 512 apart.
constexpr int kEightRows = 8 * kN;
// A lane's fragment element (row r0 + g + 8 half, columns 8 j + 2 c4 and + 1; r0 a multiple of 8)
// from `lane_first` = fragment_first(r0, g, c4): both rows are g mod 8, so column group j is
// lane_first's bits 3-5 XOR j (one instruction, where swizzled() takes several).
__device__ __forceinline__ int fragment_first(int r0, int g, int c4) {
  return swizzled(r0 + g, 2 * c4);
}
__device__ __forceinline__ int fragment_index(int lane_first, int j, int half) {
  return (lane_first ^ (8 * j)) + kEightRows * half;
}

// The products by mma.sync and ldmatrix, where wgmma is not built (below sm_90a).
#ifndef __CUDA_ARCH_FEAT_SM90_ALL
// acc[8][4] += the A fragments af (16 rows, k0 … k0 + 15) × B's rows k0 … k0 + 15, all 64
// columns: B held as [n][k] (rows n), or with kTransposedB as [k][n] (transposed by ldmatrix).
template <bool kTransposedB>
__device__ __forceinline__ void times_b_rows(float (&acc)[8][4], const uint32_t (&af)[4],
                                             const bf16* b, int k0, const LaneAddress& at) {
#pragma unroll
  for (int n0 = 0; n0 < 64; n0 += 16) {
    uint32_t bf[4];
    ldmatrix_x4<kTransposedB>(bf, b + (kTransposedB ? swizzled(k0 + at.bt_row, n0 + at.bt_col)
                                                    : swizzled(n0 + at.bn_row, k0 + at.bn_col)));
    mma_bf16_16816(acc[n0 / 8], af, bf[0], bf[1]);
    mma_bf16_16816(acc[n0 / 8 + 1], af, bf[2], bf[3]);
  }
}

// acc[8][4] (16 rows × 64 columns, eight n-tiles) += A(16 rows from r0 of `a`, [m][k]) × Bᵀ where
// `b` holds B as [n][k] (rows n): both non-transposed, k = 64.
__device__ __forceinline__ void rows_times_rows(float (&acc)[8][4], const bf16* a, int r0,
                                                const bf16* b, const LaneAddress& at) {
#pragma unroll
  for (int k0 = 0; k0 < 64; k0 += 16) {
    uint32_t af[4];
    ldmatrix_x4<false>(af, a + swizzled(r0 + at.a_row, k0 + at.a_col));
    times_b_rows<false>(acc, af, b, k0, at);
  }
}

// acc[8][4] += A(16 rows from r0) × B, B held as [k][n] (`b`): B transposed by ldmatrix, k = 64.
// `a` holds A as [m][k], or with kTransposedA as [k][m] (A's rows are then its columns r0 …).
template <bool kTransposedA>
__device__ __forceinline__ void rows_times_cols(float (&acc)[8][4], const bf16* a, int r0,
                                                const bf16* b, const LaneAddress& at) {
#pragma unroll
  for (int k0 = 0; k0 < 64; k0 += 16) {
    uint32_t af[4];
    ldmatrix_x4<kTransposedA>(af, a + (kTransposedA ? swizzled(k0 + at.at_row, r0 + at.at_col)
                                                    : swizzled(r0 + at.a_row, k0 + at.a_col)));
    times_b_rows<true>(acc, af, b, k0, at);
  }
}

#endif

// acc[8][4] += F × B where F (16 × 64, k = the chunk's tokens) is in registers as C fragments
// (f[8][4], rounded to bf16 here: the A fragments of mma.sync and of wgmma alike) and B is held as
// [k][n] (`b`, swizzled).
__device__ __forceinline__ void frags_times_cols(float (&acc)[8][4], const float (&f)[8][4],
                                                 const bf16* b, const LaneAddress& at) {
  uint32_t af[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    af[kk][0] = pack_bf16(f[2 * kk][0], f[2 * kk][1]);
    af[kk][1] = pack_bf16(f[2 * kk][2], f[2 * kk][3]);
    af[kk][2] = pack_bf16(f[2 * kk + 1][0], f[2 * kk + 1][1]);
    af[kk][3] = pack_bf16(f[2 * kk + 1][2], f[2 * kk + 1][3]);
  }
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  (void)at;
  const uint64_t b_tile = swizzled_tile_descriptor(b);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_64x64x16_registers<true>(acc, af[kk], b_tile + 128 * kk);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(acc);
#else
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) times_b_rows<true>(acc, af[kk], b, 16 * kk, at);
#endif
}

__device__ __forceinline__ void zero(float (&acc)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
}

#ifdef __CUDA_ARCH_FEAT_SM90_ALL
// acc (= or, with kAccumulate, +=) A B over k = 64 for the warpgroup's 64 rows: four wgmma k-slices
// of the tiles' descriptors, issued only (layouts as product_sum's).
template <bool kAccumulate, bool kTransposedA, bool kTransposedB>
__device__ __forceinline__ void issue_product(float (&acc)[8][4], uint64_t a_tile,
                                              uint64_t b_tile) {
  constexpr uint64_t kStepA = kTransposedA ? 128 : 2, kStepB = kTransposedB ? 128 : 2;
  wgmma_64x64x16<kAccumulate, kTransposedA, kTransposedB>(acc, a_tile, b_tile);
#pragma unroll
  for (int kk = 1; kk < 4; ++kk) {
    wgmma_64x64x16<true, kTransposedA, kTransposedB>(acc, a_tile + kStepA * kk,
                                                     b_tile + kStepB * kk);
  }
}
#endif

// acc = A0 B0 + A1 B1 (a split operand's two parts, hi first) for the warp's 16 rows from r0, k =
// 64: A held [m][k] or, with kTransposedA, [k][m]; B held [n][k] or, with kTransposedB, [k][n].
// Built for sm_90a, the warpgroup's 64 rows by wgmma; without kWait only issued (as score_tiles').
template <bool kTransposedA, bool kTransposedB, bool kWait = true>
__device__ __forceinline__ void product_sum(float (&acc)[8][4], const bf16* a0, const bf16* b0,
                                            const bf16* a1, const bf16* b1, int r0,
                                            const LaneAddress& at) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  (void)r0, (void)at;
  const uint64_t a0_tile = swizzled_tile_descriptor(a0), b0_tile = swizzled_tile_descriptor(b0);
  const uint64_t a1_tile = swizzled_tile_descriptor(a1), b1_tile = swizzled_tile_descriptor(b1);
  wgmma_fence();
  issue_product<false, kTransposedA, kTransposedB>(acc, a0_tile, b0_tile);
  issue_product<true, kTransposedA, kTransposedB>(acc, a1_tile, b1_tile);
  wgmma_commit();
  if constexpr (kWait) {
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
  }
#else
  zero(acc);
  if constexpr (kTransposedB) {
    rows_times_cols<kTransposedA>(acc, a0, r0, b0, at);
    rows_times_cols<kTransposedA>(acc, a1, r0, b1, at);
  } else {
    static_assert(!kTransposedA, "A transposed is read only with B transposed");
    rows_times_rows(acc, a0, r0, b0, at);
    rows_times_rows(acc, a1, r0, b1, at);
  }
#endif
}

// One side's two score tiles for its 16 rows from r0: scores = A Bᵀ (rotated q and k, one way or
// the other) and d_scores = C Dᵀ (dO and PsiV, the same way), unweighted; all four swizzled tiles.
// Built for sm_90a, the side's warpgroup makes its 64 rows with wgmma (each warp's 16 are r0's):
// eight instructions a warp where mma.sync and ldmatrix took 104. Without kWait they are only
// issued there, and the caller waits (wgmma_wait<0>) before it reads the tiles.
template <bool kWait = true>
__device__ __forceinline__ void score_tiles(float (&scores)[8][4], float (&d_scores)[8][4],
                                            const bf16* a, const bf16* b, const bf16* c,
                                            const bf16* d, int r0, const LaneAddress& at) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  (void)r0, (void)at;
  const uint64_t a_tile = swizzled_tile_descriptor(a), b_tile = swizzled_tile_descriptor(b);
  const uint64_t c_tile = swizzled_tile_descriptor(c), d_tile = swizzled_tile_descriptor(d);
  wgmma_fence();
  issue_product<false, false, false>(scores, a_tile, b_tile);
  issue_product<false, false, false>(d_scores, c_tile, d_tile);
  wgmma_commit();
  if constexpr (kWait) {
    wgmma_wait<0>();
    wgmma_fence_operands(scores);
    wgmma_fence_operands(d_scores);
  }
#else
  zero(scores);
  zero(d_scores);
  rows_times_rows(scores, a, r0, b, at);
  rows_times_rows(d_scores, c, r0, d, at);
#endif
}

// The four lanes of a quad hold one row's columns: their sum, in every lane of the quad.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// The sums over a warp's 16 rows, from each thread's over its own two (sums[2j + k]: column
// 8j + 2 c4 + k), by halving: each exchange keeps the half of the values its lane's bit selects
// and adds the partner's copy of them, so after three steps lane (g, c4) holds the whole sums of
// columns 8g + 2 c4 and + 1 in sums[0] and sums[1] (14 shuffles, not 48). The steps are template
// instances: a loop over them stayed rolled in sweep_core, which put the array in local memory.
__device__ __forceinline__ void sum_rows(float (&sums)[16], int lane) {
  halve<8>(sums, lane);
  halve<4>(sums, lane);
  halve<2>(sums, lane);
}

// Column sums over a warp's 16 rows, by rank, from each thread's over its own two (sums[2j + k]:
// column 8j + 2 c4 + k), to `to` ([R][64]). At R = 1 by halving (sum_rows); at R > 1 a thread's
// two rows (g and g + 8) are of rank g % R, and the warp's other rows of that rank are in the
// lanes 4 R, 8 R, … apart (g + R, …).
template <int R>
__device__ __forceinline__ void store_rank_column_sums(float* to, float (&sums)[16], int lane) {
  if constexpr (R == 1) {
    sum_rows(sums, lane);
    *reinterpret_cast<float2*>(to + 8 * (lane / 4) + 2 * (lane % 4)) =
        make_float2(sums[0], sums[1]);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
      for (int offset = 4 * R; offset < 32; offset <<= 1) {
        sums[i] += __shfl_xor_sync(0xffffffffu, sums[i], offset);
      }
    }
    if (lane < 4 * R) {
      float* row = to + (lane / 4) * 64 + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<float2*>(row + 8 * j) = make_float2(sums[2 * j], sums[2 * j + 1]);
      }
    }
  }
}

// A lane's values of its two fragment rows ([half][j][k]: row g + 8 half, column 8j + 2 c4 + k),
// summed over each token's R rows (lanes 4 and 8 apart) and stored as bf16 to rows[half] (the
// token's row at column 2 c4, or null past the sequence). At R = 4 by sum_rows' halve steps: the
// exchange with the lane 4 apart keeps the j its rank's bit 0 selects (j < 4 or j ≥ 4), the one
// with the lane 8 apart the half its bit 1 selects, and each of a token's four lanes stores a
// quarter of the row (24 shuffles, not rank_sum's 64, and a quarter of the stores a lane). The
// sums are rank_sum's, (r0 + r1) + (r2 + r3), bit for bit.
template <int R>
__device__ __forceinline__ void store_token_rows(const float (&values)[2][8][2],
                                                 bf16* const (&rows)[2], int lane) {
  static_assert(R == 1 || R == 4);
  if constexpr (R == 1) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (rows[half] == nullptr) continue;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<__nv_bfloat162*>(rows[half] + 8 * j) =
            __floats2bfloat162_rn(values[half][j][0], values[half][j][1]);
      }
    }
  } else {
    // [j ≥ 4][half][j % 4][k], so that each step keeps a leading half.
    float sums[32];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int k = 0; k < 2; ++k)
          sums[(j / 4) * 16 + half * 8 + (j % 4) * 2 + k] = values[half][j][k];
      }
    }
    halve<16, 4>(sums, lane);
    halve<8, 8>(sums, lane);
    const bool bit0 = (lane & 4) != 0, bit1 = (lane & 8) != 0;
    bf16* row = bit1 ? rows[1] : rows[0];
    if (row == nullptr) return;
    row += bit0 ? 32 : 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      *reinterpret_cast<__nv_bfloat162*>(row + 8 * j) =
          __floats2bfloat162_rn(sums[2 * j], sums[2 * j + 1]);
    }
  }
}

// acc's 64 column sums over the warp's 16 rows, by rank, to `to` ([R][64]).
template <int R>
__device__ __forceinline__ void store_column_sums(float* to, const float (&acc)[8][4], int lane) {
  float sums[16];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    sums[2 * j] = acc[j][0] + acc[j][2];
    sums[2 * j + 1] = acc[j][1] + acc[j][3];
  }
  store_rank_column_sums<R>(to, sums, lane);
}

// The sum of a value over a token's R rows (lanes 4, 8, … apart: g's low bits), in every lane.
template <int R>
__device__ __forceinline__ float rank_sum(float x) {
#pragma unroll
  for (int offset = 4; offset < 4 * R; offset <<= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// acc = A (16 rows from r0 of `a`, [t][p]) × a state held as [p][n] (hi + lo parts), issued only
// (sm_90a): the caller waits (wgmma_wait<0>) before state_dots or any other read of acc.
__device__ __forceinline__ void issue_state_product(float (&acc)[8][4], const bf16* a,
                                                    const bf16* hi, const bf16* lo, int r0,
                                                    const LaneAddress& at) {
  product_sum<false, true, false>(acc, a, hi, a, lo, r0, at);
}

// Each row's dot of a state product (acc) with `rows` (the same tokens' rotated q or k): dl's state
// term for the row before its scale.
__device__ __forceinline__ void state_dots(float (&dots)[2], const float (&acc)[8][4],
                                           const bf16* rows, int r0, int g, int c4) {
  dots[0] = dots[1] = 0.f;
  const int lane_first = fragment_first(r0, g, c4);
  // A thread's columns come in pairs (n, n + 1): one 4-byte read each (as in the loops below).
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float2 row = unpack_bf16(
          *reinterpret_cast<const uint32_t*>(rows + fragment_index(lane_first, j, half)));
      dots[half] += acc[j][2 * half] * row.x;
      dots[half] += acc[j][2 * half + 1] * row.y;
    }
  }
}

// dθ's terms of the rows r0 … r0 + 15 into d_theta_part, and acc (dL/d(rotated) of those rows, all
// columns) un-rotated in place: w.r.t. q or k as they came in. `rotated` holds the rotated rows
// as rounded (the values every product used). A thread's columns n and n + N/2 are its tiles j and
// j + 4, so each pair is in one thread.
template <int R>
__device__ __forceinline__ void unrotate(float (&acc)[8][4], const bf16* rotated,
                                         const float* cos_theta, const float* sin_theta,
                                         float* d_theta_part, int r0, int g, int c4) {
  const int lane_first = fragment_first(r0, g, c4);
#pragma unroll
  for (int j = 0; j < kA / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = r0 + g + 8 * half, n = 8 * j + 2 * c4;
      const float2 firsts = unpack_bf16(
          *reinterpret_cast<const uint32_t*>(rotated + fragment_index(lane_first, j, half)));
      const float2 seconds = unpack_bf16(
          *reinterpret_cast<const uint32_t*>(rotated + fragment_index(lane_first, j + 4, half)));
      const float2 cs = *reinterpret_cast<const float2*>(cos_theta + t / R * kRotationLd + n);
      const float2 sn = *reinterpret_cast<const float2*>(sin_theta + t / R * kRotationLd + n);
#pragma unroll
      for (int col = 0; col < 2; ++col) {
        const int e = 2 * half + col;
        const float d_first = acc[j][e], d_second = acc[j + 4][e];
        const float first = col == 0 ? firsts.x : firsts.y;
        const float second = col == 0 ? seconds.x : seconds.y;
        d_theta_part[t * kAngleLd + n + col] = d_second * first - d_first * second;
        const float c = col == 0 ? cs.x : cs.y, s = col == 0 ? sn.x : sn.y;
        acc[j][e] = d_first * c + d_second * s;
        acc[j + 4][e] = d_second * c - d_first * s;
      }
    }
  }
}

// One step of a 4 × 4 transpose of 32-bit words within each quad of lanes: lanes l and l ^ kMask
// swap blocks, the lane without bit kMask giving its words at the positions with that bit for its
// partner's words at the positions without it, each taking the other's in place of its own.
template <int kMask>
__device__ __forceinline__ void quad_exchange(uint32_t (&words)[4], int c4) {
  static_assert(kMask == 1 || kMask == 2, "a step within the quad");
  const bool upper = (c4 & kMask) != 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if ((k & kMask) != 0) continue;
    const uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? words[k] : words[k ^ kMask], kMask);
    words[k] = upper ? got : words[k];
    words[k ^ kMask] = upper ? words[k ^ kMask] : got;
  }
}

// The rows r0 … r0 + 15 of acc (all 64 columns) to a [B][chunks · C · R][H][64] bf16 tensor. A
// quad's lanes hold a row, two of each 8 columns a lane. At R = 1 the quad transposes them first
// (quad_exchange), so that each lane holds 8 neighbouring columns of 2 of the 8 column groups and
// stores each in one 16-byte store, 4 stores where there were 16, each warp store writing whole
// 32-byte sectors where a 4-byte one wrote half of each it touched: SISO forward+backward −0.4% to
// −1.3% in three calls. At R = 4 the shuffles land on the key warps, the critical role there, and
// cost more than the stores save (MIMO +1.4% to +2.0%; bench/RESULTS.md session 50).
template <int R>
__device__ __forceinline__ void store_rows(bf16* to, const float (&acc)[8][4], size_t first_row,
                                           int heads, int r0, int g, int c4) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    bf16* row = to + (first_row + static_cast<size_t>(r0 + g + 8 * half) * heads) * 64;
    if constexpr (R == 1) {
#pragma unroll
      for (int group = 0; group < 2; ++group) {
        uint32_t words[4];  // columns 8 (4 group + k) + 2 c4, + 1
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          words[k] = pack_bf16(acc[4 * group + k][2 * half], acc[4 * group + k][2 * half + 1]);
        }
        quad_exchange<2>(words, c4);
        quad_exchange<1>(words, c4);
        // Now columns 8 (4 group + c4) + 2 k, + 1.
        *reinterpret_cast<uint4*>(row + 8 * (4 * group + c4)) =
            make_uint4(words[0], words[1], words[2], words[3]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<__nv_bfloat162*>(row + 8 * j + 2 * c4) =
            __floats2bfloat162_rn(acc[j][2 * half], acc[j][2 * half + 1]);
      }
    }
  }
}

// One side's gradient w.r.t. its rotated rows r0 … r0 + 15 finished: acc (the state's part) scaled
// by each row's scale, the chunk's part (the weighted tile f, rows × the other side's rows) times
// `other` added, then un-rotated (dθ's terms into d_theta_part), stored as this head's bf16
// gradient (store_rows) and its column sums left in bias_part for the bias.
template <int R>
__device__ __forceinline__ void finish_rotated_gradient(float (&acc)[8][4], const float (&scale)[2],
                                                        const float (&f)[8][4], const bf16* other,
                                                        const bf16* rotated, const float* cos_theta,
                                                        const float* sin_theta, float* d_theta_part,
                                                        bf16* to, size_t first_row, int heads,
                                                        float* bias_part, int r0, int lane,
                                                        const LaneAddress& at) {
  const int g = lane / 4, c4 = lane % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] *= scale[e / 2];
  }
  frags_times_cols(acc, f, other, at);
  unrotate<R>(acc, rotated, cos_theta, sin_theta, d_theta_part, r0, g, c4);
  store_rows<R>(to, acc, first_row, heads, r0, g, c4);
  store_column_sums<R>(bias_part, acc, lane);
}

// The pair's partials of chunk c, from the parts its warps left in slot c % 2, by the key warps
// (an item is the same thread's at every chunk): q's and k's biases (the warps'
// column sums added) and mimo_x's, summed over the chunk's group on chip and stored to the group's
// slot at its first chunk, the walk's last of it; and a zero for dD but in group 0's slot (the
// pair's whole dD goes there). They were the query warps' (finish_chunk), the role with the longest
// chunk step; the key warps, which waited longest at the ready barrier, take them now
// (bench/RESULTS.md session 47).
template <int R>
__device__ __forceinline__ void add_group_partials(const Dims& d, const Work& w, CoreSmem<R>& sm,
                                                   int h, int b, int c) {
  constexpr int kThreads = kCoreThreads - kQueryThreads;
  const int thread = static_cast<int>(threadIdx.x) - kQueryThreads;
  const int slot = c % 2, chunks = d.chunks;
  const int group = c / kPartialGroupChunks<R>, groups = partial_groups(d);
  const bool opens = c == min((group + 1) * kPartialGroupChunks<R>, chunks) - 1;
  const bool closes = c % kPartialGroupChunks<R> == 0;
  const size_t slots = static_cast<size_t>(d.batch) * groups;
  float* partial =
      w.partials +
      (static_cast<size_t>(h) * slots + static_cast<size_t>(b) * groups + group) * d.partial_width;
  const auto add = [&](int column, float value) {
    float& sum = sm.group_parts[column];
    sum = opens ? value : sum + value;
    if (closes) partial[column] = sum;
  };
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int item = thread + i * kThreads;
    const int which = item / (R * kN), n = item % (R * kN);  // n: (rank, column)
    const float* bias_parts = &sm.bias_parts[slot][which][0][n];
    constexpr int kWarpParts = R * kN;
    add(which * R * kN + n, bias_parts[0] + bias_parts[kWarpParts] + bias_parts[2 * kWarpParts] +
                                bias_parts[3 * kWarpParts]);
  }
  for (int item = thread; item < R * kP; item += kThreads) {
    const float* parts = &sm.mimo_x_parts[slot][0][item];
    constexpr int kWarpParts = R * kP;
    add(2 * R * kN + item,
        parts[0] + parts[kWarpParts] + parts[2 * kWarpParts] + parts[3 * kWarpParts]);
  }
  if (thread == 0 && closes && group > 0) partial[d.partial_width - 1] = 0.f;
}

// The parity of a stage's mbarriers at chunk c's copies, the ((chunks − 1 − c) / 2)-th of the
// stage.
__device__ __forceinline__ unsigned stage_parity(int chunks, int c) {
  return static_cast<unsigned>((chunks - 1 - c) / 2 % 2);
}

// The operand warps (a warpgroup, 128 threads) of sweep_core: for each chunk, walking the chunks in
// reverse a chunk ahead of the compute warps, its stage copied in (the tensor memory accelerator's
// copies, eleven a chunk, started by the warpgroup's first thread, on three mbarriers), q and k
// rotated in place with their biases (rounded once; padded rows stay zero) once theirs have
// landed, then PsiV = v ⊙ mimo_x (as the forward rounds it, PsivLoader: zeros for padded tokens,
// whose v is zero) and e^{l} dO's split once theirs have, then the stage's ready barrier (E's
// split may land after it: the query warps wait for it themselves); and
// once the compute warps are done with the chunk the walk took before it (the free barrier), the
// next chunk's copies started. The tile copies replaced cp.async's 16-byte copies, up to 27 a
// thread a chunk at MIMO, whose issue took a quarter of the operand warps' chunk step: forward +
// backward 0.5% faster at MIMO, 2.6% at SISO (bench/RESULTS.md sessions 43 and 44).
template <int R>
__device__ __forceinline__ void make_operands(const Dims& d, const DevInputs& in, const Work& w,
                                              const SweepCopies& copies, CoreSmem<R>& sm, int h,
                                              int b, int thread) {
  constexpr int kTokens = kC / R;
  const int T = d.seqlen, chunks = d.chunks, pwarp = thread / 32, lane = thread % 32;
  const size_t Tp = static_cast<size_t>(chunks) * kTokens;
  const size_t pairs = static_cast<size_t>(d.batch) * d.heads;
  const size_t bh = static_cast<size_t>(b) * d.heads + h;
  // Each box fills its stage array exactly (sweep_copies' boxes), and the bytes they bring are
  // what its mbarrier expects: a count that never completed would hang the block.
  static_assert(kRotationBytes<R> == 2 * sizeof(sm.q[0]) + 2 * sizeof(sm.cos_theta[0]) &&
                kOperandsBytes<R> ==
                    sizeof(sm.d_out[0]) + sizeof(sm.v[0]) + 3 * sizeof(sm.log_decay[0]) &&
                kEntryBytes == 2 * sizeof(sm.e_hi[0]));
  static_assert(
      kRotationBytes<R> < (1u << 20) && kOperandsBytes<R> < (1u << 20) && kEntryBytes < (1u << 20),
      "an mbarrier's transaction count is below 2^20");
  // By thread 0 alone. The coordinates fit in int (sweep_applies: sweep_copy_rows_fit).
  const auto load_stage = [&](int c) {
    const int stage = c % 2, t0 = c * kTokens, group = h / d.heads_per_group;
    uint64_t* rotation = &sm.rotation_full[stage];
    mbarrier_expect_bytes(rotation, kRotationBytes<R>);
    tile_copy_to_shared<5>(sm.q[stage], &copies.q, {0, group, 0, t0, b}, rotation);
    tile_copy_to_shared<5>(sm.k[stage], &copies.k, {0, group, 0, t0, b}, rotation);
    const int rotation_row = static_cast<int>(bh * Tp + t0);
    tile_copy_to_shared<2>(sm.cos_theta[stage], &copies.cos_theta, {0, rotation_row}, rotation);
    tile_copy_to_shared<2>(sm.sin_theta[stage], &copies.sin_theta, {0, rotation_row}, rotation);
    uint64_t* operands = &sm.operands_full[stage];
    mbarrier_expect_bytes(operands, kOperandsBytes<R>);
    tile_copy_to_shared<5>(sm.d_out[stage], &copies.d_out, {0, 0, h, t0, b}, operands);
    tile_copy_to_shared<4>(sm.v[stage], &copies.v, {0, h, t0, b}, operands);
    float* const targets[3] = {sm.log_decay[stage], sm.kappa[stage], sm.gamma[stage]};
#pragma unroll
    for (int which = 0; which < 3; ++which) {
      bulk_copy_to_shared(targets[which], w.sweep_scalars + which * pairs * Tp + bh * Tp + t0,
                          kTokens * sizeof(float), operands);
    }
    uint64_t* entry = &sm.entry_full[stage];
    mbarrier_expect_bytes(entry, kEntryBytes);
    const int entry_row = static_cast<int>((bh * chunks + c) * 2 * kP);
    tile_copy_to_shared<2>(sm.e_hi[stage], &copies.entry, {0, entry_row}, entry);
    tile_copy_to_shared<2>(sm.e_lo[stage], &copies.entry, {0, entry_row + kP}, entry);
  };
  // q and k rotated in place, lane (row = lane / 16, m = lane % 16) columns n = 2m and 2m + 1 and
  // their partners n + N/2; then (make_psiv_and_split) PsiV and e^{l} dO's split, four columns an
  // item. A lane's rows are R-periodic in its steps, so its biases and mimo_x columns are the same
  // at every step of every chunk: held in registers from the start (read from shared memory at
  // each step, their loads were the largest share of the operand warps' stalls, ncu source
  // counters).
  constexpr int kRowStep = 2 * (kOperandThreads / 32);
  constexpr int kPsivRowStep = kOperandThreads / (kP / 4);
  static_assert(kRowStep % R == 0 && kPsivRowStep % R == 0);
  // A lane's rows are 8 apart, so their swizzle is the first's.
  static_assert(kRowStep % 8 == 0 && kPsivRowStep % 8 == 0);
  const int rotation_row = 2 * pwarp + lane / 16, rotation_column = 2 * (lane % 16);
  const int lead_index = swizzled(rotation_row, rotation_column);
  const int partner_index = swizzled(rotation_row, rotation_column + kN / 2);
  // As bf16 pairs, the parameters' own values (the operand warps have few registers).
  uint32_t lead_bias[2], partner_bias[2];  // [q or k]
  {
    const bf16* biases[2] = {in.q_bias, in.k_bias};
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      const bf16* bias = biases[which] + (h * R + rotation_row % R) * kN + rotation_column;
      lead_bias[which] = *reinterpret_cast<const uint32_t*>(bias);
      partner_bias[which] = *reinterpret_cast<const uint32_t*>(bias + kN / 2);
    }
  }
  const int psiv_row = thread / (kP / 4), psiv_column = thread % (kP / 4) * 4;
  const int psiv_index = swizzled(psiv_row, psiv_column);
  const uint2 mimo_x =
      *reinterpret_cast<const uint2*>(in.mimo_x + (h * R + psiv_row % R) * kP + psiv_column);
  const auto rotate = [&](int c) {
    const int stage = c % 2, t0 = c * kTokens;
    const float *cos_theta = sm.cos_theta[stage], *sin_theta = sm.sin_theta[stage];
    const int n = rotation_column;
#pragma unroll 1
    for (int i = 0; i < kC / kRowStep; ++i) {
      const int t = rotation_row + i * kRowStep, at = i * kRowStep * kN;
      const bool token = t0 + t / R < T;
      float2 c_ = make_float2(1.f, 1.f), s_ = make_float2(0.f, 0.f);
      if (n < kA) {
        c_ = *reinterpret_cast<const float2*>(cos_theta + t / R * kRotationLd + n);
        s_ = *reinterpret_cast<const float2*>(sin_theta + t / R * kRotationLd + n);
      }
      const float cs[2] = {c_.x, c_.y}, sn[2] = {s_.x, s_.y};
#pragma unroll
      for (int which = 0; which < 2; ++which) {
        bf16* tile = which == 0 ? sm.q[stage] : sm.k[stage];
        uint32_t* const lead_at = reinterpret_cast<uint32_t*>(tile + lead_index + at);
        uint32_t* const partner_at = reinterpret_cast<uint32_t*>(tile + partner_index + at);
        const float2 first = unpack_bf16(*lead_at);
        const float2 second = unpack_bf16(*partner_at);
        // Padded tokens loaded zeros and take no bias, so they store zeros.
        const float2 lead_add = unpack_bf16(token ? lead_bias[which] : 0u);
        const float2 partner_add = unpack_bf16(token ? partner_bias[which] : 0u);
        const float lead[2] = {first.x + lead_add.x, first.y + lead_add.y};
        const float partner[2] = {second.x + partner_add.x, second.y + partner_add.y};
        *lead_at =
            pack_bf16(lead[0] * cs[0] - partner[0] * sn[0], lead[1] * cs[1] - partner[1] * sn[1]);
        *partner_at =
            pack_bf16(lead[0] * sn[0] + partner[0] * cs[0], lead[1] * sn[1] + partner[1] * cs[1]);
      }
    }
  };
  // PsiV, and e^{l} dO as hi + lo pairs (the query warps' X update reads it): the same items.
  const auto make_psiv_and_split = [&](int c) {
    const int stage = c % 2;
    const float* l = sm.log_decay[stage];
#pragma unroll 1
    for (int i = 0; i < kC / kPsivRowStep; ++i) {
      const int row = psiv_row + i * kPsivRowStep, at = psiv_index + i * kPsivRowStep * kN;
      const uint2 v_raw =
          *reinterpret_cast<const uint2*>(sm.v[stage] + row / R * kLd + psiv_column);
      const float2 v01 = unpack_bf16(v_raw.x), v23 = unpack_bf16(v_raw.y);
      const float2 x01 = unpack_bf16(mimo_x.x), x23 = unpack_bf16(mimo_x.y);
      *reinterpret_cast<uint2*>(sm.psiv[stage] + at) = make_uint2(
          pack_bf16(v01.x * x01.x, v01.y * x01.y), pack_bf16(v23.x * x23.x, v23.y * x23.y));
      const uint2 o_raw = *reinterpret_cast<const uint2*>(sm.d_out[stage] + at);
      const float row_scale = exp_flushed(l[row / R]);
      const float2 o01 = unpack_bf16(o_raw.x), o23 = unpack_bf16(o_raw.y);
      store_split_quad(
          make_float4(o01.x * row_scale, o01.y * row_scale, o23.x * row_scale, o23.y * row_scale),
          sm.ds_hi[stage], sm.ds_lo[stage], at);
    }
  };
  // The last chunk's copies first; then, for each chunk c from the last (the compute warps at chunk
  // c + 1), its stage made from its copies, and chunk c − 1's copies started, once the compute
  // warps are done with chunk c + 1, whose stage it takes (the last chunk but one's at once: its
  // stage was never used). A stage's mbarriers complete a phase a use (stage_parity). Each thread's
  // writes (q and k rotated in place, PsiV, the split) are read by the compute warps' wgmma and
  // the rotation's are overwritten by the next copies, both through the async proxy: its proxy
  // fence orders them first (the ready barrier then orders the fence before the products, the
  // free barrier before thread 0's next copies).
  if (thread == 0) load_stage(chunks - 1);
  for (int c = chunks - 1; c >= 0; --c) {
    const unsigned parity = stage_parity(chunks, c);
    mbarrier_wait(&sm.rotation_full[c % 2], parity);
    rotate(c);
    mbarrier_wait(&sm.operands_full[c % 2], parity);
    make_psiv_and_split(c);
    fence_shared_for_async_proxy();
    barrier_arrive(kReadyBarrier + c % 2, kCoreBlockThreads);
    if (c == 0) break;
    if (c + 1 < chunks) barrier_wait(kFreeBarrier + (c + 1) % 2, kCoreBlockThreads);
    if (thread == 0) load_stage(c - 1);
  }
}

// The compute warps: 0-3 are the query side (16 rows (token, rank) each: dq and dγ, and X's 16
// rows), 4-7 the key side (dk, dv, dκ): a scheduler (warp % 4) holds query block i, whose causal
// work grows with i, key block i, whose work shrinks with it, and an operand warp. Each side is a
// warpgroup, and built for sm_90a its eleven 64 × 64 × 64 products a chunk (five on the query
// side, six on the key side) are wgmma's, the side's 64 rows at once, with the operands in shared
// memory or (the weighted score tiles) in registers: at M3-ref forward + backward 2.6% faster
// (MIMO) and 4.4% (SISO) than mma.sync and ldmatrix, warp by warp (bench/RESULTS.md session 46).
// Every score block is computed (the causal mask's zero blocks too: skipping them measured no gain,
// bench/RESULTS.md session 32).
template <int R>
__global__ void __launch_bounds__(kCoreBlockThreads, 1)
    sweep_core_kernel(Dims d, DevInputs in, Work w, DevGrads grads,
                      const __grid_constant__ SweepCopies copies) {
  constexpr int kTokens = kC / R;
  // Named apart from sweep_prep's: one name declared twice in a file must keep one alignment.
  extern __shared__ __align__(1024) unsigned char core_smem[];
  CoreSmem<R>& sm = *reinterpret_cast<CoreSmem<R>*>(core_smem);
  const int h = blockIdx.x, b = blockIdx.y;
  for (int i = threadIdx.x; i < R * kP; i += kCoreBlockThreads) {
    sm.mimo_x[i] = to_f(in.mimo_x[h * R * kP + i]);
  }
  if (threadIdx.x == kCoreThreads) {
    // The swizzled tiles are 1024-byte aligned (the tensor memory accelerator's 128-byte swizzle,
    // wgmma's descriptors and swizzled() all take row % 8 from the address's bits 7-9) only if the
    // block's shared memory is.
    if (shared_address(core_smem) % 1024 != 0) __trap();
    for (int stage = 0; stage < 2; ++stage) {
      mbarrier_init(&sm.rotation_full[stage], 1);
      mbarrier_init(&sm.operands_full[stage], 1);
      mbarrier_init(&sm.entry_full[stage], 1);
    }
  }
  __syncthreads();
  if (threadIdx.x >= kCoreThreads) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kOperandRegisters<R>));
#endif
    make_operands<R>(d, in, w, copies, sm, h, b, static_cast<int>(threadIdx.x) - kCoreThreads);
    return;
  }
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kComputeRegisters<R>));
#endif
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c4 = lane % 4;
  const int H = d.heads, T = d.seqlen, chunks = d.chunks;
  const size_t rows = padded_rows(d);
  const LaneAddress at(lane);
  const bool query_side = warp < 4;
  const int r0 = 16 * (warp % 4);
  float x[8][4];  // query warps: X's rows r0 … r0 + 15, all 64 columns
  zero(x);
  const size_t bh = static_cast<size_t>(b) * H + h;
  const float skip = to_f(in.d[h]);
  float d_skip = 0.f;

  // Chunk c's results from the parts its warps left in slot c % 2, by the four query warps:
  //  - dθ's suffix sums over the sequence (the q and k terms added): query warp w has columns
  //    4w … 4w + 3, lane (part, column 4w + lane % 4) a part of kAnglePart tokens, and the sums
  //    over later parts come from a suffix scan across the lanes; later_angles carries the sum
  //    over the chunks already finished (the later ones);
  //  - (the pair's partials are the key warps', add_group_partials);
  //  - dκ and the dt and trap terms of dγ and dκ (γ_t = τ_t DT_t, κ_t = τ_t DT_t + ...:
  //    sweep_token_terms adds κ_{t−1}'s and the angles');
  //  - dl, the last token's with the chunk's exit terms and e^{l_last} <E_c, X>, its suffix sums
  //    within the chunk being dADT (warp 0; a fixed order).
  constexpr int kAngleParts = 32 / 4, kAnglePart = kC / kAngleParts;
  static_assert(kA == 4 * (kQueryThreads / 32) && kAnglePart * kAngleParts == kC);
  static_assert(kAnglePart % R == 0 && kTokens <= 2 * 32 && (kTokens == 64 || kTokens <= 32));
  float later_angles = 0.f;
  float later_l_last = 0.f;  // the query warps': l_last of chunk c + 1, for finish_chunk(c + 1)
  // The token threads' trap and dt for the chunk finish_chunk does next, loaded a chunk ahead:
  // loaded where used, their latency held warps 2 and 3 at every chunk's start.
  const bool token_thread = threadIdx.x >= kQueryThreads - kTokens && threadIdx.x < kQueryThreads;
  bf16 token_trap = __float2bfloat16(0.f), token_dt = token_trap;
  const auto prefetch_token_inputs = [&](int c) {
    const int t = c * kTokens + static_cast<int>(threadIdx.x) - (kQueryThreads - kTokens);
    if (t < T) {
      const size_t th = token_head(d, b, t, h);
      token_trap = in.trap[th];
      token_dt = in.dt[th];
    }
  };
  if (token_thread) prefetch_token_inputs(chunks - 1);
  const auto finish_chunk = [&](int c, float chunk_l_last) {
    const int slot = c % 2;
    const int t0 = c * kTokens, len = min(kTokens, T - t0);
    {
      // Over rows; a token's suffix sum is its first row's (rows of one token are adjacent).
      const int n = 4 * warp + lane % 4, part = lane / 4, first = part * kAnglePart;
      float values[kAnglePart];
      float part_total = 0.f;
#pragma unroll
      for (int u = kAnglePart - 1; u >= 0; --u) {
        const int t = first + u;
        values[u] = sm.d_theta[slot][0][t * kAngleLd + n] + sm.d_theta[slot][1][t * kAngleLd + n];
        part_total += values[u];
      }
      float from_here = part_total;  // then the sum over parts part … kAngleParts − 1
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) {
        const float y = __shfl_down_sync(0xffffffffu, from_here, offset);
        if (lane + offset < 32) from_here += y;
      }
      const float after = __shfl_down_sync(0xffffffffu, from_here, 4);
      const float chunk_total = __shfl_sync(0xffffffffu, from_here, lane % 4);
      float suffix = later_angles + (part + 1 < kAngleParts ? after : 0.f);
      later_angles += chunk_total;
#pragma unroll
      for (int u = kAnglePart - 1; u >= 0; --u) {
        suffix += values[u];
        const int i = (first + u) / R;
        if ((first + u) % R == 0 && i < len) w.dtheta[(bh * T + t0 + i) * kA + n] = suffix;
      }
    }
    if (token_thread) {
      const int i = threadIdx.x - (kQueryThreads - kTokens);
      if (i < len) {
        const size_t th = token_head(d, b, t0 + i, h);
        const float d_kappa = sm.d_kappa[slot][i], both = sm.d_gamma[slot][i] + d_kappa;
        w.tok_dkappa[th] = d_kappa;
        w.tok_ddt[th] = both * sigmoidf(to_f(token_trap));
        w.tok_dtau[th] = both * to_f(token_dt);
      }
      if (c > 0) prefetch_token_inputs(c - 1);
    }
    if (warp != 0) return;
    // e^{l_last} <E_c, X> (the parts the query warps left at chunk c's step).
    const float dot_total =
        exp_flushed(chunk_l_last) * (sm.dot_parts[slot][0] + sm.dot_parts[slot][1] +
                                     sm.dot_parts[slot][2] + sm.dot_parts[slot][3]);
    const float exit_total = warp_sum(sm.exit_terms[slot][lane] + sm.exit_terms[slot][lane + 32]);
    const auto suffix_sum = [&](float value) {
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const float y = __shfl_down_sync(0xffffffffu, value, offset);
        if (lane + offset < 32) value += y;
      }
      return value;
    };
    if constexpr (kTokens == 64) {
      const float first = sm.dl_query[slot][lane] + sm.dl_key[slot][lane];
      float second = sm.dl_query[slot][lane + 32] + sm.dl_key[slot][lane + 32];
      if (lane == 31) second += exit_total + dot_total;
      const float later = suffix_sum(second);
      const float second_total = __shfl_sync(0xffffffffu, later, 0);
      const float earlier = suffix_sum(first);
      if (lane < len) w.tok_dadt[token_head(d, b, t0 + lane, h)] = earlier + second_total;
      if (lane + 32 < len) w.tok_dadt[token_head(d, b, t0 + lane + 32, h)] = later;
    } else {
      float value = lane < kTokens ? sm.dl_query[slot][lane] + sm.dl_key[slot][lane] : 0.f;
      if (lane == kTokens - 1) value += exit_total + dot_total;
      const float suffix = suffix_sum(value);
      if (lane < len) w.tok_dadt[token_head(d, b, t0 + lane, h)] = suffix;
    }
  };

  for (int c = chunks - 1; c >= 0; --c) {
    const int stage = c % 2, slot = c % 2;
    const size_t first_row = (static_cast<size_t>(b) * rows + static_cast<size_t>(c) * kC) * H + h;
    const int t0 = c * kTokens;
    // The stage is made; every compute warp is done with chunk c + 1 (its parts are complete, and
    // chunk c + 2's were read: slot c % 2 is free for chunk c's).
    barrier_wait(kReadyBarrier + stage, kCoreBlockThreads);
    bf16 *q = sm.q[stage], *k = sm.k[stage];
    const bf16 *v = sm.psiv[stage], *v_in = sm.v[stage], *d_out = sm.d_out[stage];
    const float *l = sm.log_decay[stage], *kappa = sm.kappa[stage], *gamma = sm.gamma[stage];
    const float l_last = l[kTokens - 1];
    const float *cos_theta = sm.cos_theta[stage], *sin_theta = sm.sin_theta[stage];
    const bf16 *x_hi = sm.x_hi, *x_lo = sm.x_lo;

    if (query_side) {
      // X split (X the gradient of this chunk's exit state), handed to the key warps by the X
      // barrier (they wait there before their first read of it, after their score tiles). x_hi
      // and x_lo are free: the key warps' last reads of chunk c + 1's were before the ready
      // barrier.
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int at_x = fragment_index(fragment_first(r0, g, c4), j, half);
          uint32_t hi, lo;
          split_bf16(x[j][2 * half], x[j][2 * half + 1], hi, lo);
          *reinterpret_cast<uint32_t*>(sm.x_hi + at_x) = hi;
          *reinterpret_cast<uint32_t*>(sm.x_lo + at_x) = lo;
        }
      }
      fence_shared_for_async_proxy();  // the key warps' products read X through the async proxy
      arrive_x_split();
      // S = Q̃ K̃ᵀ and dA = dO Vᵀ for the warp's 16 query rows, weighted by W; G's row sums and dγ.
      // Issued first, so that the tensor cores make them while the query warps finish chunk c + 1
      // (each wgmma waits for the whole warpgroup, and warp 0's share of finish_chunk is the
      // largest).
      float s[8][4], da[8][4];
      score_tiles<false>(s, da, q, k, d_out, v, r0, at);
      // Chunk c + 1's parts are complete (the ready barrier); the query warps, with the lighter
      // share of the causal work, finish them.
      if (c + 1 < chunks) finish_chunk(c + 1, later_l_last);
      later_l_last = l_last;
      // Not followed by wgmma_fence_operands(s) and (da), unlike the other waits: here the pin
      // moves sweep_core<4>'s register allocation, and the code was measured without it (its SASS
      // reads neither before this wait; bench/RESULTS.md session 46).
      wgmma_wait<0>();
      // dq̃'s state part (its dot with q̃ is dl's inter term), made by the tensor cores while the
      // warps weight the score tiles.
      float acc[8][4];
      // E's split lands on its own mbarrier: the operand warps do not wait for it.
      mbarrier_wait(&sm.entry_full[stage], stage_parity(chunks, c));
      issue_state_product(acc, d_out, sm.e_hi[stage], sm.e_lo[stage], r0, at);
      float dl_rows[2] = {0.f, 0.f}, d_gamma[2] = {0.f, 0.f};
      // The lane's two rows' scalars, read once: read where selected, they were loads under
      // branches.
      const RowScalars rows_of = row_scalars<R>(l, kappa, gamma, r0 + g);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const TokenPair l_pair = token_pair<R>(l, 8 * j + 2 * c4);
        const TokenPair kappa_pair = token_pair<R>(kappa, 8 * j + 2 * c4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          // Tokens: the weights are the tokens' (a token's R rows have one).
          const int t = (r0 + g + 8 * (e / 2)) / R, u = (8 * j + 2 * c4 + e % 2) / R;
          const float product = da[j][e] * s[j][e];
          // Without branches (the lanes of a warp differ in u < t): every element's exponential,
          // then selects. e^{l_t − l_u} may overflow where u > t, and is then not selected.
          const float earlier = exp_flushed(rows_of.l[e / 2] - (e % 2 == 0 ? l_pair.x : l_pair.y)) *
                                (e % 2 == 0 ? kappa_pair.x : kappa_pair.y);
          const float weight = u < t ? earlier : u == t ? rows_of.gamma[e / 2] : 0.f;
          dl_rows[e / 2] = u < t ? __fmaf_rn(product, weight, dl_rows[e / 2]) : dl_rows[e / 2];
          d_gamma[e / 2] = u == t ? d_gamma[e / 2] + product : d_gamma[e / 2];
          da[j][e] *= weight;
        }
      }
      // dq̃: the state's part first, then the chunk's.
      wgmma_wait<0>();
      wgmma_fence_operands(acc);
      float inter[2];
      state_dots(inter, acc, q, r0, g, c4);
      float scale[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = (r0 + g + 8 * half) / R;
        scale[half] = exp_flushed(l[t]);
        dl_rows[half] = rank_sum<R>(quad_sum(dl_rows[half] + scale[half] * inter[half]));
        d_gamma[half] = rank_sum<R>(quad_sum(d_gamma[half]));
      }
      finish_rotated_gradient<R>(acc, scale, da, k, q, cos_theta, sin_theta, sm.d_theta[slot][0],
                                 w.sweep_dq, first_row, H, sm.bias_parts[slot][0][warp], r0, lane,
                                 at);
      if (c4 == 0 && g % R == 0) {
        sm.dl_query[slot][(r0 + g) / R] = dl_rows[0];
        sm.dl_query[slot][(r0 + g + 8) / R] = dl_rows[1];
        sm.d_gamma[slot][(r0 + g) / R] = d_gamma[0];
        sm.d_gamma[slot][(r0 + g + 8) / R] = d_gamma[1];
      }
      // <E_c, X>'s part of the warp's 16 rows, with E as its split (the value every product with
      // E reads), for finish_chunk(c).
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int at_e = fragment_index(fragment_first(r0, g, c4), j, half);
          const float2 hi = unpack_bf16(*reinterpret_cast<const uint32_t*>(sm.e_hi[stage] + at_e));
          const float2 lo = unpack_bf16(*reinterpret_cast<const uint32_t*>(sm.e_lo[stage] + at_e));
          dot += x[j][2 * half] * (hi.x + lo.x) + x[j][2 * half + 1] * (hi.y + lo.y);
        }
      }
      dot = warp_sum(dot);
      if (lane == 0) sm.dot_parts[slot][warp] = dot;
      // X for chunk c − 1: e^{l_last} X + (e^{l} dO)ᵀ Q̃, the warp's 16 rows (e^{l} dO's split
      // is the stage's).
      float update[8][4];
      product_sum<true, true>(update, sm.ds_hi[stage], q, sm.ds_lo[stage], q, r0, at);
      const float decay = exp_flushed(l_last);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) x[j][e] = decay * x[j][e] + update[j][e];
      }
    } else {
      // Sᵀ = K̃ Q̃ᵀ and dAᵀ = V dOᵀ for the warp's 16 key rows, weighted by Wᵀ; dκ's chunk part.
      float st[8][4], dat[8][4];
      score_tiles<false>(st, dat, k, q, v, d_out, r0, at);
      // Chunk c + 1's parts are complete (the ready barrier): its partials summed while the tensor
      // cores make the tiles.
      if (c + 1 < chunks) add_group_partials(d, w, sm, h, b, c + 1);
      wgmma_wait<0>();
      wgmma_fence_operands(st);
      wgmma_fence_operands(dat);
      // dk̃'s part Xᵀ v (its dot with k̃ is dl's and dκ's exit term), made by the tensor cores
      // while the warps weight the score tiles (the query warps hand X over at the chunk's start).
      wait_x_split();
      float acc[8][4];
      issue_state_product(acc, v, x_hi, x_lo, r0, at);
      float dl_rows[2] = {0.f, 0.f}, d_kappa[2] = {0.f, 0.f};
      const RowScalars rows_of = row_scalars<R>(l, kappa, gamma, r0 + g);  // as the query side's
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const TokenPair l_pair = token_pair<R>(l, 8 * j + 2 * c4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          // Tokens, as the query side's.
          const int s_row = (r0 + g + 8 * (e / 2)) / R, u = (8 * j + 2 * c4 + e % 2) / R;
          const float product = dat[j][e] * st[j][e];
          // Without branches, as the query side's (e^{l_u − l_s} may overflow where u < s).
          const bool later = u > s_row;
          const float decay = exp_flushed((e % 2 == 0 ? l_pair.x : l_pair.y) - rows_of.l[e / 2]);
          const float weight = later        ? decay * rows_of.kappa[e / 2]
                               : u == s_row ? rows_of.gamma[e / 2]
                                            : 0.f;
          // The terms of tokens u ≤ s as products with zero (selected operands): written as
          // selected sums, they were branches around the two multiply-adds. For finite products
          // the sums' bits are the same (x + 0 = x, and a sum that starts at +0 is never −0).
          d_kappa[e / 2] = __fmaf_rn(product, later ? decay : 0.f, d_kappa[e / 2]);
          dl_rows[e / 2] = __fmaf_rn(-product, later ? weight : 0.f, dl_rows[e / 2]);
          st[j][e] *= weight;
          dat[j][e] *= weight;
        }
      }
      // dk̃: the state's part first, then the chunk's.
      wgmma_wait<0>();
      wgmma_fence_operands(acc);
      float exit_term[2];
      state_dots(exit_term, acc, k, r0, g, c4);
      float scale[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int s_row = r0 + g + 8 * half, s_token = s_row / R;
        const float exit_decay = exp_flushed(l_last - l[s_token]);
        scale[half] = exit_decay * kappa[s_token];
        const float raw = quad_sum(exit_term[half]);
        const float term = scale[half] * raw;
        dl_rows[half] = rank_sum<R>(quad_sum(dl_rows[half]) - term);
        d_kappa[half] = rank_sum<R>(quad_sum(d_kappa[half]) + exit_decay * raw);
        if (c4 == 0) sm.exit_terms[slot][s_row] = term;
        if (c4 == 0 && g % R == 0) {
          sm.dl_key[slot][s_token] = dl_rows[half];
          sm.d_kappa[slot][s_token] = d_kappa[half];
        }
      }
      finish_rotated_gradient<R>(acc, scale, dat, q, k, cos_theta, sin_theta, sm.d_theta[slot][1],
                                 w.sweep_dk, first_row, H, sm.bias_parts[slot][1][warp - 4], r0,
                                 lane, at);
      // dL/dPsiV: X k̃'s part (X's rows p are B's rows n), the chunk's, and D's.
      product_sum<false, false>(acc, k, x_hi, k, x_lo, r0, at);
      float own[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int at_row = fragment_index(fragment_first(r0, g, c4), j, half);
          const float2 o = unpack_bf16(*reinterpret_cast<const uint32_t*>(d_out + at_row));
          const float2 psiv = unpack_bf16(*reinterpret_cast<const uint32_t*>(v + at_row));
          own[half] += o.x * psiv.x;
          own[half] += o.y * psiv.y;
          acc[j][2 * half] = acc[j][2 * half] * scale[half] + skip * o.x;
          acc[j][2 * half + 1] = acc[j][2 * half + 1] * scale[half] + skip * o.y;
        }
      }
      frags_times_cols(acc, st, d_out, at);
      // dv = Σ over the token's ranks of dL/dPsiV ⊙ mimo_x (store_token_rows), and mimo_x's terms
      // dL/dPsiV ⊙ v summed over the warp's 16 rows by rank, left for add_group_partials to add
      // over the key warps (at chunk c − 1's step, or after the walk). A thread's two rows are of
      // rank g % R.
      bf16* v_rows[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = t0 + (r0 + g + 8 * half) / R;
        v_rows[half] = t < T ? grads.v + token_head(d, b, t, h) * kP + 2 * c4 : nullptr;
      }
      const float* rank_mimo_x = sm.mimo_x + g % R * kP;
      float column_sums[16];  // [j][column of the pair]: columns 8j + 2 c4 (+ 1)
      float dv_terms[2][8][2];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int p = 8 * j + 2 * c4;
        const float2 mimo_x = *reinterpret_cast<const float2*>(rank_mimo_x + p);
        column_sums[2 * j] = column_sums[2 * j + 1] = 0.f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int s_row = r0 + g + 8 * half;
          const float2 raw = __bfloat1622float2(
              *reinterpret_cast<const __nv_bfloat162*>(v_in + s_row / R * kLd + p));
          column_sums[2 * j] += acc[j][2 * half] * raw.x;
          column_sums[2 * j + 1] += acc[j][2 * half + 1] * raw.y;
          dv_terms[half][j][0] = acc[j][2 * half] * mimo_x.x;
          dv_terms[half][j][1] = acc[j][2 * half + 1] * mimo_x.y;
        }
      }
      store_token_rows<R>(dv_terms, v_rows, lane);
      store_rank_column_sums<R>(sm.mimo_x_parts[slot][warp - 4], column_sums, lane);
      d_skip += quad_sum(own[0]) + quad_sum(own[1]);
    }
    // Chunk c's stage is no longer read (the operand warps wait here before chunk c − 2's copies:
    // for nothing past chunk 2).
    if (c > 1) barrier_arrive(kFreeBarrier + stage, kCoreBlockThreads);
  }
  barrier_wait(kComputeBarrier, kCoreThreads);
  if (query_side) {
    finish_chunk(0, later_l_last);
  } else {
    add_group_partials(d, w, sm, h, b, 0);
    // Each quad's lanes hold the same sums: lane 0 of each quad counts them once.
    d_skip = warp_sum(c4 == 0 ? d_skip : 0.f);
    // dot_parts' slot 1 (<E, X>'s parts of chunk 1, read by finish_chunk(1) before the loop's
    // end) is free: it takes dD's.
    if (lane == 0) sm.dot_parts[1][warp - 4] = d_skip;
  }
  barrier_wait(kComputeBarrier, kCoreThreads);
  if (threadIdx.x == 0) {
    // dD's partial of the pair, in its group 0 slot (add_group_partials zeroes the other groups').
    const int groups = partial_groups(d);
    const size_t slots = static_cast<size_t>(d.batch) * groups;
    w.partials[(static_cast<size_t>(h) * slots + static_cast<size_t>(b) * groups + 1) *
                   d.partial_width -
               1] =
        sm.dot_parts[1][0] + sm.dot_parts[1][1] + sm.dot_parts[1][2] + sm.dot_parts[1][3];
  }
}

// ---------------------------------------------------------------------------------
// sweep_finish

constexpr int kFinishThreads = 256;
// sweep_token_terms' tiles: the (token, head) items of kTermRows dθ rows at a time, so at most
// kTermRows heads (sweep_applies).
constexpr int kTermRows = 256;
constexpr int kTermRowLd = kA + 4;  // fp32: a quarter-warp's 16-byte row stores on distinct banks

// finish_token_terms' gradients (the angles', adt's, dt's, trap's) at the sweep's A = kA, with the
// same expressions in the same order (the same bits), by tiles of whole tokens: each (token, head)
// item loads its dθ row 16 bytes at a time with its per-token terms (one load's latency a tile),
// makes dt's and trap's gradients and leaves the row and dt in shared memory, where the angles'
// sums over heads read them. finish_token_terms' loops load a value at a time and each reads the
// rows again: they were about half of this kernel's stall samples (ncu, session 34).
static __device__ __forceinline__ void sweep_token_terms(const Dims& d, const DevInputs& in,
                                                         const Work& w, const DevGrads& grads,
                                                         int b, int t0, int len) {
  __shared__ float slopes[kC * kA];  // tanh of the chunk's angles, [token][pair]
  __shared__ __align__(16) float theta_rows[kTermRows * kTermRowLd];
  __shared__ float head_dt[kTermRows];
  const int H = d.heads;
  const size_t first_token = static_cast<size_t>(b) * d.seqlen + t0;
  for_each_batched<kLoadBatch>(
      len * kA, [&](int e) { return in.angles[first_token * kA + e]; },
      [&](int e, bf16 angle) { slopes[e] = tanhf(to_f(angle)); });
  __syncthreads();
  const int tile_tokens = kTermRows / H;
  for (int first = 0; first < len; first += tile_tokens) {
    const int count = min(tile_tokens, len - first);
    for (int item = threadIdx.x; item < count * H; item += kFinishThreads) {
      const int i = first + item / H, h = item % H, t = t0 + i;
      const size_t th = (first_token + i) * H + h;
      const size_t bh = static_cast<size_t>(b) * H + h;
      const float4* row = reinterpret_cast<const float4*>(w.dtheta + (bh * d.seqlen + t) * kA);
      float4 parts[kA / 4];
#pragma unroll
      for (int q = 0; q < kA / 4; ++q) parts[q] = row[q];
      const float tau = sigmoidf(to_f(in.trap[th])), dt = to_f(in.dt[th]);
      float d_dt = w.tok_ddt[th];
      const float d_tau = w.tok_dtau[th], d_adt = w.tok_dadt[th];
      const float prev = t > 0 ? w.tok_dkappa[th - H] : 0.f;
      const float* theta = reinterpret_cast<const float*>(parts);
#pragma unroll
      for (int j = 0; j < kA; ++j) d_dt += theta[j] * slopes[i * kA + j] * kPi;
      store_token_head_terms(grads, th, tau, dt, d_adt, d_dt, d_tau, t > 0, prev);
#pragma unroll
      for (int q = 0; q < kA / 4; ++q) {
        *reinterpret_cast<float4*>(theta_rows + item * kTermRowLd + 4 * q) = parts[q];
      }
      head_dt[item] = dt;
    }
    __syncthreads();
    for (int item = threadIdx.x; item < count * kA; item += kFinishThreads) {
      const int tile_i = item / kA, j = item % kA, i = first + tile_i;
      float sum = 0.f;
      for (int h = 0; h < H; ++h) {
        sum += theta_rows[(tile_i * H + h) * kTermRowLd + j] * head_dt[tile_i * H + h];
      }
      grads.angles[(first_token + i) * kA + j] = angle_gradient(sum, slopes[i * kA + j]);
    }
    __syncthreads();
  }
}

// A block per (chunk, batch): each group's q and k gradients of the chunk's rows (token, rank),
// its heads' (sweep_core's, bf16) added in head order from zero, eight columns (16 bytes) an
// item; then sweep_token_terms.
template <int R>
__global__ void __launch_bounds__(kFinishThreads)
    sweep_finish_kernel(Dims d, DevInputs in, Work w, DevGrads grads) {
  constexpr int W = 8, kRowParts = kN / W, kTokens = kC / R;
  const int c = blockIdx.x, b = blockIdx.y, H = d.heads, G = d.groups,
            per_group = d.heads_per_group;
  const int t0 = c * kTokens, len = min(kTokens, d.seqlen - t0), len_rows = len * R;
  const size_t rows = padded_rows(d);
  for (int item = threadIdx.x; item < 2 * len_rows * kRowParts; item += kFinishThreads) {
    const int which = item / (len_rows * kRowParts), i = item / kRowParts % len_rows,
              n = item % kRowParts * W;
    const bf16* heads = (which == 0 ? w.sweep_dq : w.sweep_dk) +
                        (static_cast<size_t>(b) * rows + c * kC + i) * H * kN + n;
    bf16* to = (which == 0 ? grads.q : grads.k) +
               ((static_cast<size_t>(b) * d.seqlen + t0) * R + i) * G * kN + n;
    for (int g = 0; g < G; ++g) {
      float sum[W] = {};
      // kAhead heads' rows loaded before the first is added: the loop is latency-bound, and
      // unrolled alone it kept about four loads in flight.
      constexpr int kAhead = 8;
      for (int first = 0; first < per_group; first += kAhead) {
        Bf16Row<W> rows[kAhead];
#pragma unroll
        for (int u = 0; u < kAhead; ++u) {
          if (first + u < per_group) {
            rows[u] = load_row<W>(heads + static_cast<size_t>(g * per_group + first + u) * kN);
          }
        }
#pragma unroll
        for (int u = 0; u < kAhead; ++u) {
          if (first + u >= per_group) break;
#pragma unroll
          for (int e = 0; e < W; ++e) sum[e] += rows[u].at(e);
        }
      }
      store_row(to + static_cast<size_t>(g) * kN, round_row<W>(sum));
    }
  }
  sweep_token_terms(d, in, w, grads, b, t0, len);
}

// cuTensorMapEncodeTiled, a driver function (the runtime's entry point finds it; nothing links
// libcuda), or null where the driver does not offer it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      function = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

// sweep_core's copies are the tensor memory accelerator's (sm_90 and newer), from tensor maps the
// driver makes: where the current device would run the kernel as built for an older architecture
// (compute_80's PTX compiled at load on a newer GPU) it would trap, so there, or without the
// driver's encoder, the sweep does not apply. Known once a device (a failed query is not kept).
bool sweep_core_copies_run() {
  if (tensor_map_encoder() == nullptr) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  static std::mutex mutex;
  static std::map<int, bool> runs;
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto known = runs.find(device); known != runs.end()) return known->second;
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, sweep_core_kernel<1>) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return runs[device] = attributes.ptxVersion >= 90;
}

// A tiled map of `base`: extents and box innermost first, strides in bytes (every dimension's but
// the innermost). sweep_applies has checked what can fail here (the encoder, the extents), so a
// failure is the code's.
template <size_t kDims>
CUtensorMap tile_map(const char* what, CUtensorMapDataType type, const void* base,
                     const std::array<uint64_t, kDims>& extents,
                     const std::array<uint64_t, kDims - 1>& strides,
                     const std::array<uint32_t, kDims>& box,
                     CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE) {
  const auto listed = [](const auto& values) {
    std::string out;
    for (const auto value : values) out += (out.empty() ? "" : ", ") + std::to_string(value);
    return out;
  };
  std::array<uint32_t, kDims> element_strides;
  element_strides.fill(1);
  CUtensorMap map;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  const CUresult result =
      encode == nullptr
          ? CUDA_ERROR_NOT_SUPPORTED
          : encode(&map, type, kDims, const_cast<void*>(base), extents.data(), strides.data(),
                   box.data(), element_strides.data(), CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    detail::refuse(ErrorKind::kInternal,
                   "the scan's sweep: cuTensorMapEncodeTiled refused the map of {} (CUresult {}; "
                   "base {}, extents [{}], byte strides [{}], box [{}], innermost first)",
                   what, static_cast<int>(result), base, listed(extents), listed(strides),
                   listed(box));
  }
  return map;
}

template <int R>
SweepCopies sweep_copies(const Dims& d, const DevInputs& in, const Work& w) {
  constexpr uint32_t kTokens = kC / R;
  const uint64_t B = d.batch, T = d.seqlen, H = d.heads, G = d.groups, e = sizeof(bf16);
  const uint64_t pairs = B * H, Tp = sweep_padded_tokens(d);
  SweepCopies copies;
  const auto qk = [&](const char* what, const bf16* base) {
    return tile_map<5>(what, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, base, {kN, G, R, T, B},
                       {kN * e, G * kN * e, R * G * kN * e, T * R * G * kN * e},
                       {kN, 1, R, kTokens, 1}, CU_TENSOR_MAP_SWIZZLE_128B);
  };
  copies.q = qk("q", in.q);
  copies.k = qk("k", in.k);
  copies.v = tile_map<4>("v", CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, in.v, {kP, H, T, B},
                         {kP * e, in.zv_stride * e, T * in.zv_stride * e}, {kLd, 1, kTokens, 1});
  copies.d_out =
      tile_map<5>("dO", CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, w.sweep_d_out, {kP, R, H, T, B},
                  {kP * e, R * kP * e, H * R * kP * e, T * H * R * kP * e}, {kP, R, 1, kTokens, 1},
                  CU_TENSOR_MAP_SWIZZLE_128B);
  copies.entry =
      tile_map<2>("the entry states' split", CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, w.states,
                  {kN, pairs * d.chunks * 2 * kP}, {kN * e}, {kN, kP}, CU_TENSOR_MAP_SWIZZLE_128B);
  const float* sin_theta = w.sweep_rotation + pairs * Tp * kA;
  const auto rotation = [&](const char* what, const float* base) {
    return tile_map<2>(what, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, base, {kA, pairs * Tp},
                       {kA * sizeof(float)}, {kRotationLd, kTokens});
  };
  copies.cos_theta = rotation("cos θ", w.sweep_rotation);
  copies.sin_theta = rotation("sin θ", sin_theta);
  return copies;
}

}  // namespace

// The tile copies' coordinates are ints: the rows of the entry states' split and of cos θ and
// sin θ (the maps' largest dimensions; the others are Dims' ints) must fit.
bool sweep_copy_rows_fit(const Dims& d) {
  const uint64_t pairs = static_cast<uint64_t>(d.batch) * d.heads;
  const uint64_t rows = std::max(pairs * d.chunks * 2 * kP, pairs * sweep_padded_tokens(d));
  return rows <= static_cast<uint64_t>(std::numeric_limits<int>::max());
}

bool sweep_applies(const Dims& d, bool tensor_cores, size_t shared_per_block) {
  return tensor_cores && d.state == kN && d.headdim == kP && (d.rank == 1 || d.rank == 4) &&
         d.chunk * d.rank == kC && d.angles == kA && d.heads <= kTermRows &&
         shared_per_block >= sweep_core_shared_bytes() && sweep_copy_rows_fit(d) &&
         sweep_core_copies_run();
}

size_t sweep_core_shared_bytes() {
  return std::max(sizeof(CoreSmem<1>), sizeof(CoreSmem<4>));
}

int sweep_partial_slots(const Dims& d) {
  return partial_groups(d);
}

SweepFloats sweep_floats(const Dims& d) {
  const size_t pairs = static_cast<size_t>(d.batch) * d.heads, Tp = sweep_padded_tokens(d);
  const size_t per_row = static_cast<size_t>(d.batch) * d.seqlen * d.heads * d.rank * kP;
  SweepFloats f;
  f.gate_in = per_row / 2;
  f.d_out = per_row / 2;
  f.scalars = 3 * pairs * Tp;
  f.rotation = 2 * pairs * Tp * kA;
  return f;
}

namespace {

template <int R>
SweepLaunches sweep_launches_at(const Dims& d) {
  const unsigned bh = static_cast<unsigned>(d.batch * d.heads);
  const unsigned chunks = static_cast<unsigned>(d.chunks);
  SweepLaunches l;
  SmemPlan prep{};
  prep.total = sizeof(PrepSmem<R>);
  l.prep = {"sweep_prep", kernel_address(&sweep_prep_kernel<R>),
            dim3(static_cast<unsigned>(partial_groups(d)), bh), dim3(kPrepThreads), prep};
  SmemPlan core{};
  core.total = sizeof(CoreSmem<R>);
  l.core = {"sweep_core", kernel_address(&sweep_core_kernel<R>),
            dim3(static_cast<unsigned>(d.heads), static_cast<unsigned>(d.batch)),
            dim3(kCoreBlockThreads), core};
  l.finish = {"sweep_finish",
              kernel_address(&sweep_finish_kernel<R>),
              dim3(chunks, static_cast<unsigned>(d.batch)),
              dim3(kFinishThreads),
              {}};
  return l;
}

template <int R>
void run_sweep_at(const SweepLaunches& launches, const Dims& d, const DevInputs& in, const Work& w,
                  const bf16* dy, const DevGrads& grads, cudaStream_t stream) {
  // The maps first: nothing is launched if one cannot be made.
  const SweepCopies copies = sweep_copies<R>(d, in, w);
  {
    const Launch& l = launches.prep;
    sweep_prep_kernel<R><<<l.grid, l.block, l.smem.total, stream>>>(d, in, w, dy, grads);
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
  }
  {
    const Launch& l = launches.core;
    sweep_core_kernel<R><<<l.grid, l.block, l.smem.total, stream>>>(d, in, w, grads, copies);
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
  }
  {
    const Launch& l = launches.finish;
    sweep_finish_kernel<R><<<l.grid, l.block, l.smem.total, stream>>>(d, in, w, grads);
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
  }
}

}  // namespace

// sweep_applies admits R = 1 and R = 4 only.
SweepLaunches sweep_launches(const Dims& d) {
  return d.rank == 1 ? sweep_launches_at<1>(d) : sweep_launches_at<4>(d);
}

void run_sweep(const SweepLaunches& launches, const Dims& d, const DevInputs& in, const Work& w,
               const bf16* dy, const DevGrads& grads, cudaStream_t stream) {
  if (d.rank == 1) {
    run_sweep_at<1>(launches, d, in, w, dy, grads, stream);
  } else {
    run_sweep_at<4>(launches, d, in, w, dy, grads, stream);
  }
}

}  // namespace megacpp::cuda::scan_detail
