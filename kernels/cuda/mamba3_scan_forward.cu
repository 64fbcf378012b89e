// The forward of the CUDA Mamba-3 scan: angle offsets per chunk, chunk-local exit states, the
// sequential pass over chunks that turns them into entry states, then every chunk's outputs; or, at
// the fixed shapes on the tensor cores where two chunk_forward blocks fit an SM, the last three
// in that one kernel.
// See mamba3_scan_device.cuh for the notation.
#include "kernels/cuda/mamba3_scan_device.cuh"

namespace megacpp::cuda::scan_detail {
namespace {

// θ before each chunk, in two launches. angle_sums: a block per (chunk, batch) sums
// tanh(angle)·DT·π over the chunk's tokens for every (head, pair), from tables in shared memory of
// the tokens' tanh (each made once: every head takes it) and dt (loaded together, not by each
// thread in turn). Made per (batch, head) in one kernel with the prefix, the tanh were 16 times as
// many at M3-ref SISO and the kernel took 43 µs; with the tanh table alone, 28 µs of dt loads
// (ncu). angle_prefix: a block per (batch, head) turns its chunks' sums into exclusive prefixes.
constexpr int kSlopeFloats = 2048;  // A ≤ kThreads: a table holds 8 tokens or more
constexpr int kDtTable = 4096;      // heads · tokens; with more heads, dt is read from memory
__global__ void __launch_bounds__(kThreads) angle_sums_kernel(Dims d, DevInputs in, Work w) {
  __shared__ float slopes[kSlopeFloats];
  __shared__ bf16 dt_table[kDtTable];
  const int c = blockIdx.x, b = blockIdx.y, A = d.angles, H = d.heads;
  const int t0 = c * d.chunk, len = min(d.chunk, d.seqlen - t0);
  const bool dt_fits = H <= kDtTable;
  const int tokens_per_table = dt_fits ? min(kSlopeFloats / A, kDtTable / H) : kSlopeFloats / A;
  const size_t first_token = static_cast<size_t>(b) * d.seqlen + t0;
  // A thread's (head, pair) item; where there are more than threads, the tables are made again
  // for each round of items (not at M3-ref SISO: H · A = 256 = kThreads, one table of 64 tokens).
  for (int first = 0; first < H * A; first += blockDim.x) {
    const int item = first + static_cast<int>(threadIdx.x);
    const bool owner = item < H * A;
    const int h = d.by_angles.div(item), j = d.by_angles.mod(item);
    float sum = 0.f;
    for (int from = 0; from < len; from += tokens_per_table) {
      const int count = min(tokens_per_table, len - from);
      const bf16* dt_row = in.dt + (first_token + from) * H;  // token i's at dt_row[i * H]
      __syncthreads();  // the previous tables' readers are done with them
      for_each_batched<kLoadBatch>(
          count * A, [&](int e) { return in.angles[(first_token + from) * A + e]; },
          [&](int e, bf16 angle) { slopes[e] = tanhf(to_f(angle)); });
      if (dt_fits) {
        for_each_batched<kLoadBatch>(
            count * H, [&](int e) { return dt_row[e]; }, [&](int e, bf16 dt) { dt_table[e] = dt; });
      }
      __syncthreads();
      if (owner) {
        const bf16* dts = dt_fits ? dt_table : dt_row;
#pragma unroll 8
        for (int i = 0; i < count; ++i) sum += slopes[i * A + j] * to_f(dts[i * H + h]) * kPi;
      }
    }
    if (owner) {
      w.theta0[((static_cast<size_t>(b) * H + h) * d.chunks + c) * A + j] = sum;
    }
  }
}

// A warp per rotation pair.
constexpr int kPrefixThreads = 512;
__global__ void __launch_bounds__(kPrefixThreads) angle_prefix_kernel(Dims d, Work w) {
  const int A = d.angles;
  float* theta0 = w.theta0 + static_cast<size_t>(blockIdx.x) * d.chunks * A;
  for (int j = threadIdx.x / 32; j < A; j += blockDim.x / 32) {
    warp_scan(
        d.chunks, false, true, 0.f, [&](int c) { return theta0[c * A + j]; },
        [&](int c, float before) { theta0[c * A + j] = before; });
  }
}

// Chunk-local exit state F_c = Σ_j e^{l_last − l_j} κ_j Σ_r v_{j,r} k_{j,r}ᵀ and the
// chunk's decay e^{l_last}. Writes PsiV to the cache when asked.
template <bool kTensor, class D>
__global__ void chunk_state_kernel(D d, SmemPlan plan, DevInputs in, Work w, bool write_psiv) {
  extern __shared__ __align__(16) unsigned char smem[];
  const SmemStrides ld = strides_of<D>(plan);
  const int ld_qk = ld.qk, ld_pv = ld.pv;
  const ChunkPos pos = chunk_pos(d, blockIdx.y, false, blockIdx.x);
  float* sc = reinterpret_cast<float*>(smem + plan.token_scalars);
  float* cosv = reinterpret_cast<float*>(smem + plan.rotation_cos);
  float* sinv = reinterpret_cast<float*>(smem + plan.rotation_sin);
  bf16* k_rot = reinterpret_cast<bf16*>(smem + plan.k_rotated);
  bf16* psiv = reinterpret_cast<bf16*>(smem + plan.psiv);
  load_scalars(d, in, w, pos, sc, cosv, sinv);
  load_rotated(d, in.k, in.k_bias, pos, cosv, sinv, k_rot, ld_qk);
  load_psiv(d, in, pos, w.psiv, false, write_psiv, psiv, ld_pv);
  __syncthreads();
  const int N = d.state, P = d.headdim, C = d.chunk;
  const size_t bhc = (static_cast<size_t>(pos.b) * d.heads + pos.h) * d.chunks + pos.c;
  float* out = w.states + bhc * P * N;
  // The state products keep (near) fp32 precision in both variants: the angle gradient is a
  // long suffix sum of terms that cancel only when the state is formed and used without bf16
  // rounding (see the note at chunk_backward_kernel).
  const auto store = [&](int p, int n, float value) {
    out[p * N + n] = value;
  };
  if constexpr (kTensor) {
    // The scaled PsiV as hi + lo pairs, the hi part in PsiV's place.
    bf16* scaled_lo = reinterpret_cast<bf16*>(smem + plan.split_lo);
    for (int idx = threadIdx.x; idx < d.rows * P; idx += blockDim.x) {
      const int row = d.by_headdim.div(idx), p = d.by_headdim.mod(idx);
      const int at = row * ld_pv + p;
      store_split(to_f(psiv[at]) * sc[kExitScale * C + d.by_rank.div(row)], psiv, scaled_lo, at);
    }
    __syncthreads();
    smem_mma_split<true, true, true, false>(P, N, d.rows, psiv, scaled_lo, ld_pv, k_rot, nullptr,
                                            ld_qk, store);
  } else {
    state_gemm<kTensor, true, false>(
        P, N, d.rows,
        [&](int p, int row) {
          return to_f(psiv[row * ld_pv + p]) * sc[kExitScale * C + d.by_rank.div(row)];
        },
        [&](int row, int n) { return to_f(k_rot[row * ld_qk + n]); }, store);
  }
  if (threadIdx.x == 0) w.decay[bhc] = sc[kEntryDecay * C + (pos.len - 1)];
}

// Entry states: E_0 = 0, E_{c+1} = a_c E_c + F_c, in place over the F_c buffer. A thread owns
// four neighbouring elements of the [P][N] state (P·N is a multiple of 4 and every state starts
// 16-byte aligned: the workspace parts are multiples of 256 bytes from a base that is 16-byte
// aligned, checked by the constructor, and a state is P·N floats).
__global__ void state_pass_kernel(Dims d, Work w) {
  const size_t quads = static_cast<size_t>(d.headdim) * d.state / 4;
  const size_t quad = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (quad >= quads) return;
  const size_t bh = blockIdx.y;
  state_recurrence<false>(reinterpret_cast<float4*>(w.states) + bh * d.chunks * quads + quad, quads,
                          w.decay + bh * d.chunks, d.chunks);
}

// y = Σ_r o_r ⊙ silu(z ⊙ mimo_z_r) ⊙ mimo_o_r for the chunk's tokens, o in rows (i, r) of stride
// ld_o: the epilogue of chunk_output. o itself to gate_in ([B, L, H, R, P] bf16) unless null.
template <class D>
static __device__ __forceinline__ void write_gated_output(const D& d, const DevInputs& in,
                                                          const ChunkPos& pos, const float* o,
                                                          int ld_o, bf16* y, bf16* gate_in) {
  const int P = d.headdim, R = d.rank;
  constexpr int W = kPassColumnsPerItem<D>;
  for (int idx = threadIdx.x; idx < pos.len * P / W; idx += blockDim.x) {
    const auto [i, p] = headdim_item<W>(d, idx);
    const size_t th = token_head(d, pos.b, pos.t0 + i, pos.h);
    const Bf16Row<W> z = load_row<W>(in.z + zv_row(d, in, pos.b, pos.t0 + i, pos.h) + p);
    // From −0, the additive identity of every float: at R = 1 the sum is the one product as
    // chunk_forward rounds it, −0 included (+0 would turn a product of −0 into +0).
    float sum[W];
#pragma unroll
    for (int w = 0; w < W; ++w) sum[w] = -0.f;
    for (int r = 0; r < R; ++r) {
      const size_t wr = (static_cast<size_t>(pos.h) * R + r) * P + p;
      const Bf16Row<W> mimo_z = load_row<W>(in.mimo_z + wr), mimo_o = load_row<W>(in.mimo_o + wr);
      float o_r[W];
      load_floats<W>(o + (i * R + r) * ld_o + p, o_r);
      if (gate_in != nullptr) store_row(gate_in + (th * R + r) * P + p, round_row<W>(o_r));
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float gate = z.at(w) * mimo_z.at(w);
        sum[w] += o_r[w] * (gate * sigmoidf(gate) * mimo_o.at(w));
      }
    }
    store_row(y + th * P + p, round_row<W>(sum));
  }
}

// Where the sweep backward will run (Work::sweep_runs): the chunk's cos θ, sin θ, l,
// κ and γ as load_scalars made them, in the layouts Work gives, for sweep_core (which then reads
// the values the forward used).
template <class D>
static __device__ void keep_sweep_scalars(const D& d, const Work& w, const ChunkPos& pos,
                                          const float* sc, const float* cosv, const float* sinv) {
  if (!w.sweep_runs()) return;
  const int C = d.chunk, A = d.angles, ld_a = angles_stride(A);
  const size_t pairs = static_cast<size_t>(d.batch) * d.heads;
  const size_t padded = sweep_padded_tokens(d);
  const size_t first = (static_cast<size_t>(pos.b) * d.heads + pos.h) * padded + pos.t0;
  float* cos_out = w.sweep_rotation + first * A;
  float* sin_out = cos_out + pairs * padded * A;
  // Four pairs an item, one 16-byte store each: the sweep runs only at 16 rotation pairs
  // (sweep_applies), so a row in memory is a multiple of 16 bytes, 16-byte aligned (in shared
  // memory its stride is ld_a, unaligned).
  for (int idx = 4 * threadIdx.x; idx < C * A; idx += 4 * blockDim.x) {
    const int i = d.by_angles.div(idx), j = d.by_angles.mod(idx), at = i * ld_a + j;
    reinterpret_cast<float4*>(cos_out)[idx / 4] =
        make_float4(cosv[at], cosv[at + 1], cosv[at + 2], cosv[at + 3]);
    reinterpret_cast<float4*>(sin_out)[idx / 4] =
        make_float4(sinv[at], sinv[at + 1], sinv[at + 2], sinv[at + 3]);
  }
  for (int idx = threadIdx.x; idx < 3 * C; idx += blockDim.x) {
    const int which = idx / C, i = idx % C;
    const int scalar = which == 0 ? kLog : which == 1 ? kKappa : kGamma;
    w.sweep_scalars[which * pairs * padded + first + i] = sc[scalar * C + i];
  }
}

// o = e^{l} Q Eᵀ + (QKᵀ ⊙ W) V + D v, y = Σ_r o_r ⊙ silu(z ⊙ mimo_z_r) ⊙ mimo_o_r.
template <bool kTensor, class D>
__global__ void __launch_bounds__(kOutputThreads)
    chunk_output_kernel(D d, SmemPlan plan, DevInputs in, Work w, bool read_psiv, bf16* y) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkPos pos = chunk_pos(d, blockIdx.y, false, blockIdx.x);
  float* sc = reinterpret_cast<float*>(smem + plan.token_scalars);
  float* cosv = reinterpret_cast<float*>(smem + plan.rotation_cos);
  float* sinv = reinterpret_cast<float*>(smem + plan.rotation_sin);
  bf16* q_rot = reinterpret_cast<bf16*>(smem + plan.q_rotated);
  bf16* k_rot = reinterpret_cast<bf16*>(smem + plan.k_rotated);
  bf16* psiv = reinterpret_cast<bf16*>(smem + plan.psiv);
  float* entry = reinterpret_cast<float*>(smem + plan.state);
  float* weights = reinterpret_cast<float*>(smem + plan.token_weights);
  float* o = reinterpret_cast<float*>(smem + plan.out);
  bf16* weighted = reinterpret_cast<bf16*>(smem + plan.weighted_scores);
  const int N = d.state, P = d.headdim, C = d.chunk, M = d.rows;
  const int ld_w = weights_stride(C);
  const size_t bhc = (static_cast<size_t>(pos.b) * d.heads + pos.h) * d.chunks + pos.c;
  load_scalars(d, in, w, pos, sc, cosv, sinv);
  keep_sweep_scalars(d, w, pos, sc, cosv, sinv);
  const SmemStrides ld = strides_of<D>(plan);
  const int ld_qk = ld.qk, ld_pv = ld.pv, ld_state = ld.state;
  const int ld_mp = ld.mp;
  load_rotated_qk(d, in, pos, cosv, sinv, q_rot, k_rot, ld_qk);
  load_psiv(d, in, pos, w.psiv, read_psiv, false, psiv, ld_pv);
  // The entry state: as hi + lo pairs for the tensor-core product, else fp32.
  bf16* entry_hi = reinterpret_cast<bf16*>(smem + plan.split_hi);
  bf16* entry_lo = reinterpret_cast<bf16*>(smem + plan.split_lo);
  const int ld_split = plan.ld_split;
  for_each_state_element(d, w.states + bhc * P * N, [&](int p, int n, float value) {
    if constexpr (kTensor) {
      store_split(value, entry_hi, entry_lo, p * ld_split + n);
    } else {
      entry[p * ld_state + n] = value;
    }
  });
  fill_weights(d, sc, weights);
  __syncthreads();
  if constexpr (kTensor) {
    // Where the sweep will run, E_c's split in place of its fp32 copy, as the sweep reads it (the
    // block's reads of that copy were before the barrier, and no other block reads it).
    if (w.sweep_runs()) {
      // Four elements a copy (N a multiple of 16 on the tensor cores, ld_split of 8).
      bf16* split_out = entry_split_of(w, bhc, P * N);
      for (int idx = 4 * threadIdx.x; idx < P * N; idx += 4 * blockDim.x) {
        const int at = d.by_state.div(idx) * ld_split + d.by_state.mod(idx);
        store_row(split_out + idx, load_row<4>(entry_hi + at));
        store_row(split_out + P * N + idx, load_row<4>(entry_lo + at));
      }
    }
  }
  const int ld_sw = ld.sw;
  bf16_gemm<kTensor, false, false>(
      M, M, N, q_rot, ld_qk, k_rot, ld_qk, [&](int i, int j, float value) {
        weighted[i * ld_sw + j] =
            __float2bfloat16(value * weights[d.by_rank.div(i) * ld_w + d.by_rank.div(j)]);
      });
  const auto decayed = [&](int i, int p, float value) {
    o[i * ld_mp + p] = value * sc[kEntryDecay * C + d.by_rank.div(i)];
  };
  if constexpr (kTensor) {
    smem_mma_split<false, false, false>(M, P, N, q_rot, nullptr, ld_qk, entry_hi, entry_lo,
                                        ld_split, decayed);
  } else {
    state_gemm<kTensor, false, true>(
        M, P, N, [&](int i, int n) { return to_f(q_rot[i * ld_qk + n]); },
        [&](int n, int p) { return entry[p * ld_state + n]; }, decayed);
  }
  __syncthreads();
  const float skip = to_f(in.d[pos.h]);
  bf16_gemm<kTensor, false, true>(M, P, M, weighted, ld_sw, psiv, ld_pv,
                                  [&](int i, int p, float value) {
                                    o[i * ld_mp + p] += value + skip * to_f(psiv[i * ld_pv + p]);
                                  });
  __syncthreads();
  write_gated_output(d, in, pos, o, ld_mp, y, w.gate_in);
}

// chunk_state, state_pass and chunk_output in one pass (tensor cores): each block computes its
// chunk's F_c, takes its entry state E_c from the block of chunk c − 1 (the same (b, h)), publishes
// E_{c+1} = a_c E_c + F_c for the block of chunk c + 1, and makes o and y after the publish (before
// it, only F_c's product, the wait, E_c's load and E_{c+1}'s stores). F_c never goes through memory
// and the state pass is not a kernel of its own (the two cost 2.5 ms of the 5.9 ms MIMO forward at
// M3-ref; the state pass ran at 85% of DRAM bandwidth).
//
// Blocks take their chunk from a ticket (take_chain_chunk: why every wait ends). The recurrence is
// the state pass's (E_0 = 0, scale_add, chunks in order), and o's two terms are rounded and added
// as chunk_output rounds and adds them; y sums a token's ranks in another order (over lanes).
//
// A block a chunk: resident blocks that take ticket after ticket were slower at both fixed shapes,
// with the next chunk's inputs copied ahead (cp.async) or without, and so were L2 prefetch hints of
// a later chunk's inputs (bench/RESULTS.md, session 39): the kernel is bound by issuing its
// instructions, and its load waits are covered by its other warps.
template <class D>
__global__ void __launch_bounds__(kOutputThreads, 2)
    chunk_forward_kernel(D d, SmemPlan plan, DevInputs in, Work w, bool write_psiv, bf16* y) {
  // The launch's block (forward_launches) as a constant: the loops over blockDim.x strides here and
  // in the helpers inlined have constant strides and trip counts (MIMO forward −1.5%).
  __builtin_assume(blockDim.x == kOutputThreads);
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkPos pos = take_chain_chunk(d, w.order, false);
  float* sc = reinterpret_cast<float*>(smem + plan.token_scalars);
  float* cosv = reinterpret_cast<float*>(smem + plan.rotation_cos);
  float* sinv = reinterpret_cast<float*>(smem + plan.rotation_sin);
  bf16* q_rot = reinterpret_cast<bf16*>(smem + plan.q_rotated);
  bf16* k_rot = reinterpret_cast<bf16*>(smem + plan.k_rotated);
  bf16* psiv = reinterpret_cast<bf16*>(smem + plan.psiv);
  bf16* psiv_hi = reinterpret_cast<bf16*>(smem + plan.psiv_hi);
  bf16* psiv_lo = reinterpret_cast<bf16*>(smem + plan.psiv_lo);
  float* exit_part = reinterpret_cast<float*>(smem + plan.exit_part);
  constexpr int kExitStride = exit_part_stride(D::state);
  float* weights = reinterpret_cast<float*>(smem + plan.token_weights);
  bf16* weighted = reinterpret_cast<bf16*>(smem + plan.weighted_scores);
  bf16* entry_hi = reinterpret_cast<bf16*>(smem + plan.split_hi);
  bf16* entry_lo = reinterpret_cast<bf16*>(smem + plan.split_lo);
  const int N = d.state, P = d.headdim, R = d.rank, C = d.chunk, M = d.rows;
  const int ld_w = weights_stride(C);
  const SmemStrides ld = strides_of<D>(plan);
  const int ld_qk = ld.qk, ld_pv = ld.pv, ld_sw = ld.sw;
  const int ld_split = plan.ld_split;
  // q and k rotated, and PsiV with its exit-scaled copy as hi + lo pairs beside it (PsiV and the
  // weighted scores stay whole for o's intra-chunk tiles): an item of each loader a thread at the
  // fixed shapes. q's and k's rows are loaded into registers before load_scalars, so that their
  // latency passes under its work, and v's after it (under keep_sweep_scalars' where the sweep
  // runs); all are rotated, scaled and stored once the scalars are made. Against the three loaded
  // together after load_scalars, as until session 52: MIMO's forward −2.7% (forward+backward
  // −1.2%), SISO's forward −1.4%. v's loads before load_scalars as well spilled more (38 and 68
  // bytes stored at MIMO and SISO, against 6 and 30) and were slower (bench/RESULTS.md, session
  // 52).
  using Rotated = RotatedLoader<D>;
  static_assert(D::rows * (D::state / 2) / Rotated::W == kOutputThreads &&
                D::rows * D::headdim / PsivLoader<D>::W == kOutputThreads);
  const Rotated q_loader(d, pos, in.q, in.q_bias, cosv, sinv, q_rot, ld_qk);
  const Rotated k_loader(d, pos, in.k, in.k_bias, cosv, sinv, k_rot, ld_qk);
  PsivLoader<D> v{d, in, pos, w.psiv, false, write_psiv, psiv, ld_pv};
  v.scaled_hi = psiv_hi;
  v.scaled_lo = psiv_lo;
  v.exit_scale = sc + kExitScale * C;
  const int item = static_cast<int>(threadIdx.x);
  const typename Rotated::Loaded q_in = q_loader.load(item), k_in = k_loader.load(item);
  load_scalars(d, in, w, pos, sc, cosv, sinv);
  const typename PsivLoader<D>::Loaded v_in = v.load(item);
  keep_sweep_scalars(d, w, pos, sc, cosv, sinv);
  {
    const typename Rotated::Rotation rot = q_loader.rotation(item);
    q_loader.store(item, q_in, rot);
    k_loader.store(item, k_in, rot);
    v.store(item, v_in);
  }
  // Inline weights are token_weight's, fill_weights' expression: the same bits either way.
  constexpr bool kWeightsInline = forward_weights_inline(D::rank);
  if constexpr (!kWeightsInline) fill_weights(d, sc, weights);
  __syncthreads();
  // A tile a warp of every product below (the tiles smem_mma gives each warp: one, at these
  // shapes), lane's fragment rows g and g + 8, column pairs 2t.
  static_assert((D::rows / 16) * (D::headdim / 16) == kOutputThreads / 32 && D::rows == D::headdim);
  const int lane = static_cast<int>(threadIdx.x % 32), tile = static_cast<int>(threadIdx.x / 32);
  const int tile_i0 = (tile / (D::headdim / 16)) * 16, tile_j0 = (tile % (D::headdim / 16)) * 16;
  const int g = lane / 4, t = lane % 4;
  // F_c, the one product the next chunk's block waits for.
  smem_mma_split<true, true, true, false>(
      P, N, M, psiv_hi, psiv_lo, ld_pv, k_rot, nullptr, ld_qk,
      [&](int p, int n, float value) { exit_part[p * kExitStride + n] = value; });
  // E_c from chunk c − 1's block (chunk 0 starts from zero).
  const size_t pair = static_cast<size_t>(pos.b) * d.heads + pos.h;
  const size_t matrix = static_cast<size_t>(P) * N;
  float* states = w.states + (pair * d.chunks + pos.c) * matrix;
  int* ready = chain_flags(w, d, pair);
  wait_ready(ready + pos.c, pos.c > 0);  // its barrier: every thread's F_c is in exit_part
  static_assert(D::kFixed);
  constexpr int kPerThread = (D::headdim * D::state / 4 + kOutputThreads - 1) / kOutputThreads;
  const int quads = P * N / 4;
  float4 entry[kPerThread];
  const float decay = sc[kEntryDecay * C + (pos.len - 1)];
  const bool has_next = pos.c + 1 < d.chunks;
  const bool keeps_split = w.sweep_runs();
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int quad = threadIdx.x + u * kOutputThreads;
    if (quad >= quads) continue;
    entry[u] = pos.c > 0 ? __ldcg(reinterpret_cast<const float4*>(states) + quad)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
    if (pos.c == 0 && !keeps_split) reinterpret_cast<float4*>(states)[quad] = entry[u];
    if (has_next) {
      const float4 part = exit_part_quad<D>(exit_part, quad);
      __stcg(reinterpret_cast<float4*>(states + matrix) + quad, scale_add(decay, entry[u], part));
    }
  }
  publish_ready(ready + pos.c + 1, has_next);
  // What follows does not delay chunk c + 1's block. Made before the wait (until session 51: the
  // scores, o's intra-chunk tile and y's gating factors), it made MIMO's forward+backward 0.5–0.9%
  // longer and SISO's 1.3–1.7%, in two calls (bench/RESULTS.md, session 51).
  {
    // The scores Q Kᵀ ⊙ W, rounded to bf16 a column pair at a time (smem_mma's tile, the same
    // bits). At R > 1 (even) a pair's two columns are one token: one weight for both.
    float scores[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    accumulate_tile(
        SmemOperands<false, false, false, false>{q_rot, nullptr, ld_qk, k_rot, nullptr, ld_qk, N},
        tile_i0, tile_j0, lane, scores);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int upper = 0; upper < 2; ++upper) {
        const int i = tile_i0 + g + 8 * upper, j = tile_j0 + half * 8 + 2 * t;
        float weight0, weight1;
        if constexpr (kWeightsInline) {
          weight0 = token_weight(d, sc, i, j);
          weight1 = token_weight(d, sc, i, j + 1);
        } else {
          static_assert(D::rank % 2 == 0);
          weight0 = weight1 = weights[d.by_rank.div(i) * ld_w + d.by_rank.div(j)];
        }
        *reinterpret_cast<__nv_bfloat162*>(weighted + i * ld_sw + j) = __floats2bfloat162_rn(
            scores[half][2 * upper] * weight0, scores[half][2 * upper + 1] * weight1);
      }
    }
  }
  __syncthreads();
  // y's gating inputs of the lane's fragment elements, loaded here so that their latency passes
  // under the product below. Both of a thread's rows, g and g + 8 of its tile, are one rank
  // (R divides 8 at the fixed shapes), so its columns of mimo_z and mimo_o are loaded once.
  static_assert(8 % D::rank == 0);
  const int rank = d.by_rank.mod(tile_i0 + g);
  __nv_bfloat162 z_pairs[2][2], mimo_z[2], mimo_o[2];  // z: [upper][half]
  {
    const size_t wr = (static_cast<size_t>(pos.h) * R + rank) * P + tile_j0 + 2 * t;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      mimo_z[half] = *reinterpret_cast<const __nv_bfloat162*>(in.mimo_z + wr + half * 8);
      mimo_o[half] = *reinterpret_cast<const __nv_bfloat162*>(in.mimo_o + wr + half * 8);
    }
#pragma unroll
    for (int upper = 0; upper < 2; ++upper) {
      const int token = d.by_rank.div(tile_i0 + g + 8 * upper);
      const bool valid = token < pos.len;
      const bf16* z_row =
          in.z + zv_row(d, in, pos.b, pos.t0 + (valid ? token : 0), pos.h) + tile_j0 + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        z_pairs[upper][half] = valid ? *reinterpret_cast<const __nv_bfloat162*>(z_row + half * 8)
                                     : __floats2bfloat162_rn(0.f, 0.f);
      }
    }
  }
  // o's intra-chunk tile Sw PsiV, in registers until o is made whole.
  float intra_tile[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  accumulate_tile(
      SmemOperands<false, true, false, false>{weighted, nullptr, ld_sw, psiv, nullptr, ld_pv, M},
      tile_i0, tile_j0, lane, intra_tile);
  // What of o and y does not read the state: D PsiV added to the intra-chunk tile (the same
  // expression as chunk_output's), and y's gating factors silu(z ⊙ mimo_z_r) ⊙ mimo_o_r of the
  // fragment's elements (y's terms multiply o by them, as chunk_output's do).
  float gating[2][4];  // as the tile's fragments: [half][2 · upper + column]
  {
    const float skip = to_f(in.d[pos.h]);
#pragma unroll
    for (int upper = 0; upper < 2; ++upper) {
      const int row = tile_i0 + g + 8 * upper;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(
            psiv + row * ld_pv + tile_j0 + half * 8 + 2 * t));
        const float2 z = __bfloat1622float2(z_pairs[upper][half]);
        const float2 mz = __bfloat1622float2(mimo_z[half]), mo = __bfloat1622float2(mimo_o[half]);
        const float vs[2] = {v.x, v.y}, zs[2] = {z.x, z.y};
        const float mzs[2] = {mz.x, mz.y}, mos[2] = {mo.x, mo.y};
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          intra_tile[half][2 * upper + c] = intra_tile[half][2 * upper + c] + skip * vs[c];
          const float gate = zs[c] * mzs[c];
          gating[half][2 * upper + c] = gate * sigmoidf(gate) * mos[c];
        }
      }
    }
  }
  if (threadIdx.x == 0) w.decay[pair * d.chunks + pos.c] = decay;
  // E_c as hi + lo pairs, the operand of o's entry tiles; where the sweep will run, also in place
  // of E_c's fp32 copy, as the sweep reads it (every thread's reads of that copy were before
  // publish_ready's barrier, and no other block reads it).
  bf16* split_out = entry_split_of(w, pair * d.chunks + pos.c, P * N);
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int quad = threadIdx.x + u * kOutputThreads;
    if (quad >= quads) continue;
    const int at = d.by_state.div(4 * quad) * ld_split + d.by_state.mod(4 * quad);
    const SplitQuad parts = store_split_quad(entry[u], entry_hi, entry_lo, at);
    if (keeps_split) {
      __stcg(reinterpret_cast<uint2*>(split_out) + quad, parts.hi.raw);
      __stcg(reinterpret_cast<uint2*>(split_out + matrix) + quad, parts.lo.raw);
    }
  }
  __syncthreads();
  // o = e^{l} Q E_cᵀ + Sw PsiV + D PsiV made whole in registers, a tile a warp: its entry tile now,
  // its intra-chunk part and D PsiV made earlier (rounded and summed as chunk_output rounds and
  // sums them), and y's terms o_r ⊙ (silu(z ⊙ mimo_z_r) ⊙ mimo_o_r) summed over a token's ranks,
  // rows g ^ 1 … of the tile: o is never stored.
  const auto finish_tile = [&](const float(&from_entry)[2][4]) {
    float terms[8];  // y's terms of the lane's fragment: [upper][half][column]
    bool valid[2];
    size_t th[2];
#pragma unroll
    for (int upper = 0; upper < 2; ++upper) {
      const int row = tile_i0 + g + 8 * upper, token = d.by_rank.div(row);
      valid[upper] = token < pos.len;
      const float entry_decay = sc[kEntryDecay * C + token];
      th[upper] = token_head(d, pos.b, pos.t0 + (valid[upper] ? token : 0), pos.h);
      float outs[2][2];  // [half][column]
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          // The product rounded, then the sum: no fused multiply-add that chunk_output lacks.
          const float out = __fadd_rn(intra_tile[half][2 * upper + c],
                                      __fmul_rn(from_entry[half][2 * upper + c], entry_decay));
          terms[4 * upper + 2 * half + c] = out * gating[half][2 * upper + c];
          outs[half][c] = out;
        }
      }
      if (valid[upper] && w.gate_in != nullptr) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          *reinterpret_cast<__nv_bfloat162*>(w.gate_in + (th[upper] * R + rank) * P + tile_j0 +
                                             half * 8 + 2 * t) =
              __floats2bfloat162_rn(outs[half][0], outs[half][1]);
        }
      }
    }
    if constexpr (D::rank == 4) {
      // A token's four rank rows are lanes 4 apart (g ^ 1, g ^ 2): two halving steps leave each of
      // them a column pair's whole sums (in sum_over_token_ranks' order, (r0 + r1) + (r2 + r3)),
      // upper by its bit 4 and half by its bit 8, and each stores its pair.
      halve<4, 4>(terms, lane);
      halve<2, 8>(terms, lane);
      const int upper = (lane >> 2) & 1, half = (lane >> 3) & 1;
      if (upper == 0 ? valid[0] : valid[1]) {
        *reinterpret_cast<__nv_bfloat162*>(y + (upper == 0 ? th[0] : th[1]) * P + tile_j0 +
                                           half * 8 + 2 * t) =
            __floats2bfloat162_rn(terms[0], terms[1]);
      }
    } else {
#pragma unroll
      for (int upper = 0; upper < 2; ++upper) {
        float sums[2][2] = {{terms[4 * upper], terms[4 * upper + 1]},
                            {terms[4 * upper + 2], terms[4 * upper + 3]}};
        sum_over_token_ranks(sums, R);
        if (valid[upper] && rank == 0) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            *reinterpret_cast<__nv_bfloat162*>(y + th[upper] * P + tile_j0 + half * 8 + 2 * t) =
                __floats2bfloat162_rn(sums[half][0], sums[half][1]);
          }
        }
      }
    }
  };
  float entry_tile[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  accumulate_tile(SmemOperands<false, false, false, true>{q_rot, nullptr, ld_qk, entry_hi, entry_lo,
                                                          ld_split, N},
                  tile_i0, tile_j0, lane, entry_tile);
  finish_tile(entry_tile);
}

}  // namespace

ForwardLaunches forward_launches(const Dims& d, bool tensor_cores, size_t shared_per_sm,
                                 ScanChains chains) {
  const unsigned bh = static_cast<unsigned>(d.batch * d.heads);
  const unsigned chunks = static_cast<unsigned>(d.chunks);
  // state_pass: a thread per four elements of a state.
  const unsigned matrix_blocks =
      static_cast<unsigned>((d.headdim * d.state / 4 + kThreads - 1) / kThreads);
  const dim3 threads(kThreads);
  ForwardLaunches l;
  l.angle_sums = {"angle_sums",
                  kernel_address(&angle_sums_kernel),
                  dim3(chunks, static_cast<unsigned>(d.batch)),
                  threads,
                  {}};
  l.angle_prefix = {
      "angle_prefix", kernel_address(&angle_prefix_kernel), dim3(bh), dim3(kPrefixThreads), {}};
  with_fixed_dims(d, [&](auto dims) {
    using D = decltype(dims);
    l.chunk_state = {"chunk_state",
                     tensor_cores ? kernel_address(&chunk_state_kernel<true, D>)
                                  : kernel_address(&chunk_state_kernel<false, D>),
                     dim3(chunks, bh), threads, plan_for(d, kStateKernel)};
    l.chunk_output = {"chunk_output",
                      tensor_cores ? kernel_address(&chunk_output_kernel<true, D>)
                                   : kernel_address(&chunk_output_kernel<false, D>),
                      dim3(chunks, bh), dim3(kOutputThreads), plan_for(d, kOutputKernel)};
  });
  l.state_pass = {
      "state_pass", kernel_address(&state_pass_kernel), dim3(matrix_blocks, bh), threads, {}};
  // chunk_forward is compiled for the fixed shapes only (its threads hold their quads of the
  // state in registers, a count known at compile time).
  with_fixed_dims(d, [&](auto dims) {
    using D = decltype(dims);
    if constexpr (D::kFixed) {
      const SmemPlan fused = plan_for(d, kForwardKernel);
      if (tensor_cores && 2 * (fused.total + kSharedReservedPerBlock) <= shared_per_sm &&
          forward_chains_run(d, chains)) {
        l.fused = true;
        l.chunk_forward = {"chunk_forward", kernel_address(&chunk_forward_kernel<D>),
                           dim3(chunks * bh), dim3(kOutputThreads), fused};
      }
    }
  });
  return l;
}

void run_forward(const ForwardLaunches& launches, bool tensor_cores, bool psiv_cache, const Dims& d,
                 const DevInputs& in, const Work& w, bf16* y, cudaStream_t stream) {
  if (d.angles > 0) {
    const Launch& sums = launches.angle_sums;
    angle_sums_kernel<<<sums.grid, sums.block, 0, stream>>>(d, in, w);
    MEGACPP_CUDA_CHECK_LAUNCH(sums.name);
    const Launch& prefix = launches.angle_prefix;
    angle_prefix_kernel<<<prefix.grid, prefix.block, 0, stream>>>(d, w);
    MEGACPP_CUDA_CHECK_LAUNCH(prefix.name);
  }
  if (launches.fused) {
    reset_chain(d, w, stream);
    const Launch& l = launches.chunk_forward;
    with_fixed_dims(d, [&](auto dims) {
      if constexpr (decltype(dims)::kFixed) {
        chunk_forward_kernel<<<l.grid, l.block, l.smem.total, stream>>>(dims, l.smem, in, w,
                                                                        psiv_cache, y);
      }
    });
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
    return;
  }
  {
    const Launch& l = launches.chunk_state;
    with_fixed_dims(d, [&](auto dims) {
      if (tensor_cores) {
        chunk_state_kernel<true>
            <<<l.grid, l.block, l.smem.total, stream>>>(dims, l.smem, in, w, psiv_cache);
      } else {
        chunk_state_kernel<false>
            <<<l.grid, l.block, l.smem.total, stream>>>(dims, l.smem, in, w, psiv_cache);
      }
    });
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
  }
  {
    const Launch& l = launches.state_pass;
    state_pass_kernel<<<l.grid, l.block, 0, stream>>>(d, w);
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
  }
  {
    const Launch& l = launches.chunk_output;
    with_fixed_dims(d, [&](auto dims) {
      if (tensor_cores) {
        chunk_output_kernel<true>
            <<<l.grid, l.block, l.smem.total, stream>>>(dims, l.smem, in, w, psiv_cache, y);
      } else {
        chunk_output_kernel<false>
            <<<l.grid, l.block, l.smem.total, stream>>>(dims, l.smem, in, w, psiv_cache, y);
      }
    });
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
  }
}

}  // namespace megacpp::cuda::scan_detail
