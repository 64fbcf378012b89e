// The backward of the CUDA Mamba-3 scan: chunk-local gradients of the entry states, the reverse
// pass over chunks that turns them into exit-state gradients (one kernel with the first at the
// fixed shapes), every chunk's gradients (one block per (batch, group, chunk) looping over the
// group's heads), then the cross-chunk suffix sums (angles) and the fixed-order reductions of the
// per-head parameter gradients. See mamba3_scan_device.cuh for the notation.
#include "kernels/cuda/mamba3_scan_device.cuh"

namespace megacpp::cuda::scan_detail {
namespace {

// chunk_backward at the fixed SISO shape (R = 1, C = 64) uses all 128 registers a thread of its
// 512 may have: a code path added for the other shapes, even one it never takes there, made its
// registers spill and cost it more than the path saved (measured on an H100: the epilogue's terms
// kept in place, MIMO −1.6% and SISO +1.4%; the next head's tokens staged with cp.async, MIMO
// −1.7% and SISO +2.7%). Those paths are compiled out of it.
template <class D>
constexpr bool lean_registers() {
  if constexpr (D::kFixed) {
    return D::rank == 1;
  } else {
    return false;
  }
}
template <class D>
constexpr bool kLeanRegisters = lean_registers<D>();

// A fixed shape whose rank is a multiple of four: a token's ranks are float4s of a score row.
template <class D>
constexpr bool ranks_in_quads() {
  if constexpr (D::kFixed) {
    return D::rank % 4 == 0;
  } else {
    return false;
  }
}
template <class D>
constexpr bool kRanksInQuads = ranks_in_quads<D>();

// copy_16_async is a plain no-op below sm_80: the staged tokens are used only where it copies.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool kAsyncCopies = false;
#else
constexpr bool kAsyncCopies = true;
#endif

// Where element (token i, column p) of chunk_backward's z_dy rows lies: i's row of P, its 16-byte
// column groups permuted by the token (XOR), where P is a power of two. The gating sums read a
// column of several tokens a warp (SISO: eight tokens of four columns), which rows of P = 64
// without the permutation put on 8-way bank conflicts. Rows (C + i) hold dy.
template <class D>
__device__ __forceinline__ int z_dy_at(const D& d, int i, int p) {
  const int P = d.headdim;
  const int groups = (P & (P - 1)) == 0 ? (P - 1) & ~7 : 0;
  return i * P + (p ^ ((i * 8) & groups));
}

// d_o = dy ⊙ silu(z ⊙ mimo_z) ⊙ mimo_o, rows (i, r), fp32; an index is (row, W columns p). With
// z_dy, also the chunk's z and dy as loaded (bf16 [C][P] each by z_dy_at, z then dy; zeros for
// padded tokens), for the epilogue; with mimo_copy, the head's mimo_z then mimo_o ([R][P] each,
// fp32); with split_hi, also d_o as split_bf16's hi + lo pairs (split_hi, split_lo, rows of
// ld_split), the tensor-core operands, each row scaled by its token's split_scale first when that
// is given. Without dst, no fp32 d_o (the pairs, z_dy and mimo_copy as asked).
template <class D>
struct DOutLoader {
  static constexpr int W = kColumnsPerItem<D>;
  static constexpr int kBatch = kLoaderBatch<D>;
  struct Loaded {
    Bf16Row<W> z, mimo_z, dy, mimo_o;
  };
  const D& d;
  const DevInputs& in;
  const bf16* dy;
  const ChunkPos& pos;
  float* dst;
  int ld;
  bf16* z_dy = nullptr;
  float* mimo_copy = nullptr;
  const bf16* staged_z_dy = nullptr;  // the chunk's z then dy already in shared memory, [2][C][P]
  bf16* split_hi = nullptr;
  bf16* split_lo = nullptr;
  int ld_split = 0;
  const float* split_scale = nullptr;  // [C], or null

  static __device__ __forceinline__ int items(const D& d) { return d.rows * d.headdim / W; }
  __device__ __forceinline__ Loaded load(int idx) const {
    const int P = d.headdim, R = d.rank;
    const auto [row, p] = headdim_item<W>(d, idx);
    const int i = d.by_rank.div(row), r = d.by_rank.mod(row);
    Loaded loaded{zero_row<W>(), zero_row<W>(), zero_row<W>(), zero_row<W>()};
    if (i < pos.len) {
      const size_t th = token_head(d, pos.b, pos.t0 + i, pos.h);
      const size_t wr = (static_cast<size_t>(pos.h) * R + r) * P + p;
      if (staged_z_dy != nullptr) {
        const int at = i * P + p;
        loaded = {load_row<W>(staged_z_dy + at), load_row<W>(in.mimo_z + wr),
                  load_row<W>(staged_z_dy + d.chunk * P + at), load_row<W>(in.mimo_o + wr)};
      } else {
        loaded = {load_row<W>(in.z + zv_row(d, in, pos.b, pos.t0 + i, pos.h) + p),
                  load_row<W>(in.mimo_z + wr), load_row<W>(dy + th * P + p),
                  load_row<W>(in.mimo_o + wr)};
      }
    }
    return loaded;
  }
  __device__ __forceinline__ void store(int idx, const Loaded& loaded) const {
    const int P = d.headdim, R = d.rank;
    const auto [row, p] = headdim_item<W>(d, idx);
    const int i = d.by_rank.div(row), r = d.by_rank.mod(row);
    // Padded tokens loaded zeros: gate 0, value 0.
    float d_out[W];
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float gate = loaded.z.at(w) * loaded.mimo_z.at(w);
      d_out[w] = loaded.dy.at(w) * gate * sigmoidf(gate) * loaded.mimo_o.at(w);
    }
    if (dst != nullptr) store_floats<W>(dst + row * ld + p, d_out);
    if (split_hi != nullptr) {
      const float scale = split_scale != nullptr ? split_scale[i] : 1.f;
      float hi[W], lo[W];
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float x = split_scale != nullptr ? d_out[w] * scale : d_out[w];
        hi[w] = to_f(__float2bfloat16(x));
        lo[w] = x - hi[w];
      }
      store_row(split_hi + row * ld_split + p, round_row<W>(hi));
      store_row(split_lo + row * ld_split + p, round_row<W>(lo));
    }
    if (z_dy != nullptr && r == 0) {
      store_row(z_dy + z_dy_at(d, i, p), loaded.z);
      store_row(z_dy + z_dy_at(d, d.chunk + i, p), loaded.dy);
    }
    if (mimo_copy != nullptr && i == 0) {
      float mimo_z[W], mimo_o[W];
#pragma unroll
      for (int w = 0; w < W; ++w) {
        mimo_z[w] = loaded.mimo_z.at(w);
        mimo_o[w] = loaded.mimo_o.at(w);
      }
      const int ld_mimo = mimo_params_stride(P);
      store_floats<W>(mimo_copy + r * ld_mimo + p, mimo_z);
      store_floats<W>(mimo_copy + (R + r) * ld_mimo + p, mimo_o);
    }
  }
};

// dL/dE_c through chunk c's own outputs: H_c = Σ_{i,r} e^{l_i} d_o_{i,r} q_{i,r}ᵀ.
//
// kReversePass (the fixed shapes): the reverse state pass too, as chunk_forward does the forward's
// (see there for why the waits end): blocks take tickets from the last chunk back, and the block
// of chunk c takes X_c = dL/d(chunk c's exit state) from chunk c + 1's block (zero for the last
// chunk), keeps it in gstates[c] for chunk_backward and publishes X_{c−1} = H_c + a_c X_c in
// gstates[c − 1]: state_pass_backward's recurrence and bits, without H going through memory and
// without a launch of its own.
template <bool kTensor, bool kReversePass, class D>
__global__ void chunk_dstate_kernel(D d, SmemPlan plan, DevInputs in, Work w, const bf16* dy) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkPos pos = kReversePass ? take_chain_chunk(d, w.order, true)
                                    : chunk_pos(d, blockIdx.y, false, blockIdx.x);
  float* sc = reinterpret_cast<float*>(smem + plan.token_scalars);
  float* cosv = reinterpret_cast<float*>(smem + plan.rotation_cos);
  float* sinv = reinterpret_cast<float*>(smem + plan.rotation_sin);
  bf16* q_rot = reinterpret_cast<bf16*>(smem + plan.q_rotated);
  float* d_o = reinterpret_cast<float*>(smem + plan.d_out);
  // At the fixed shapes on the tensor cores, z and dy (then q, where it fits: MIMO) are staged in
  // the fp32 d_o's space, which holds nothing until H_c (why: above stage_rows).
  constexpr bool kStaged = kAsyncCopies && kTensor && D::kFixed;
  bf16* staged_z_dy = nullptr;
  bf16* staged_q = nullptr;
  if constexpr (kStaged) {
    constexpr int kZDy = 2 * D::chunk * D::headdim, kQ = D::rows * D::state;
    constexpr int kSpace = D::rows * (D::headdim + 4) * sizeof(float) / sizeof(bf16);
    static_assert(kZDy <= kSpace);
    staged_z_dy = reinterpret_cast<bf16*>(smem + plan.d_out);
    stage_tokens(d, in.z, in.zv_stride, pos, staged_z_dy);
    stage_tokens(d, dy, static_cast<size_t>(d.heads) * D::headdim, pos,
                 staged_z_dy + D::chunk * D::headdim);
    if constexpr (kZDy + kQ <= kSpace) {
      staged_q = staged_z_dy + kZDy;
      stage_rows(d, in.q, pos, staged_q);
    }
    commit_copies();
  }
  load_scalars<kStaged>(d, in, w, pos, sc, cosv, sinv);
  const SmemStrides ld = strides_of<D>(plan);
  const int ld_qk = ld.qk, ld_mp = ld.mp;
  const RotatedLoader<D> q_loader(d, pos, in.q, in.q_bias, cosv, sinv, q_rot, ld_qk, staged_q);
  // On the tensor cores the loader makes e^{l} d_o's hi + lo pairs itself (the fp32 d_o is not
  // stored: its space may hold H_c, see backward_launches).
  const int ld_pv = ld.pv;
  bf16* scaled_hi = reinterpret_cast<bf16*>(smem + plan.split_hi);
  bf16* scaled_lo = reinterpret_cast<bf16*>(smem + plan.split_lo);
  if constexpr (kStaged) {
    // q's and d_o's loads in one pass (load_together): the global loads left (q where it is not
    // staged, the per-head parameters) wait once.
    static_assert(D::rows * (D::state / 2) / RotatedLoader<D>::W ==
                  D::rows * D::headdim / DOutLoader<D>::W);
    load_together(DOutLoader<D>::items(d), q_loader,
                  DOutLoader<D>{d, in, dy, pos, nullptr, ld_mp, nullptr, nullptr, staged_z_dy,
                                scaled_hi, scaled_lo, ld_pv, sc + kEntryDecay * d.chunk});
  } else if constexpr (kTensor) {
    load_alone(RotatedLoader<D>::items(d), q_loader);
    load_alone(DOutLoader<D>::items(d),
               DOutLoader<D>{d, in, dy, pos, nullptr, ld_mp, nullptr, nullptr, nullptr, scaled_hi,
                             scaled_lo, ld_pv, sc + kEntryDecay * d.chunk});
  } else {
    load_alone(RotatedLoader<D>::items(d), q_loader);
    load_alone(DOutLoader<D>::items(d), DOutLoader<D>{d, in, dy, pos, d_o, ld_mp});
  }
  __syncthreads();
  const int N = d.state, P = d.headdim, C = d.chunk;
  const size_t bhc = (static_cast<size_t>(pos.b) * d.heads + pos.h) * d.chunks + pos.c;
  const size_t matrix = static_cast<size_t>(P) * N;
  float* out =
      kReversePass ? reinterpret_cast<float*>(smem + plan.exit_part) : w.gstates + bhc * matrix;
  // H_c in shared memory has padded rows (exit_part_stride); the gradients in global memory none.
  const int ld_out = kReversePass ? exit_part_stride(N) : N;
  const auto store = [&](int p, int n, float value) {
    out[p * ld_out + n] = value;
  };
  if constexpr (kTensor) {
    smem_mma_split<true, true, true, false>(P, N, d.rows, scaled_hi, scaled_lo, ld_pv, q_rot,
                                            nullptr, ld_qk, store);
  } else {
    state_gemm<kTensor, true, false>(
        P, N, d.rows,
        [&](int p, int row) {
          return d_o[row * ld_mp + p] * sc[kEntryDecay * C + d.by_rank.div(row)];
        },
        [&](int row, int n) { return to_f(q_rot[row * ld_qk + n]); }, store);
  }
  if constexpr (kReversePass) {
    static_assert(D::kFixed);
    float* exit_gradient = w.gstates + bhc * matrix;  // X_c: gstates[c]
    int* ready = chain_flags(w, d, static_cast<size_t>(pos.b) * d.heads + pos.h);
    const bool last = pos.c + 1 == d.chunks;
    // a_c is loaded before the wait: after it, its memory latency was on every link of the chain.
    const float decay = w.decay[bhc];
    wait_ready(ready + pos.c, !last);  // its barrier: every thread's H_c is in `out`
    constexpr int kQuads = D::headdim * D::state / 4;
    for (int quad = threadIdx.x; quad < kQuads; quad += blockDim.x) {
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
      if (last) {
        reinterpret_cast<float4*>(exit_gradient)[quad] = x;
      } else {
        x = __ldcg(reinterpret_cast<const float4*>(exit_gradient) + quad);
      }
      if (pos.c > 0) {
        const float4 own = exit_part_quad<D>(out, quad);
        __stcg(reinterpret_cast<float4*>(exit_gradient - matrix) + quad, scale_add(decay, x, own));
      }
    }
    publish_ready(ready + pos.c - 1, pos.c > 0);
  }
}

// G_c = H_c + a_c G_{c+1}, walked from the last chunk; stores G_{c+1} (the gradient of
// chunk c's exit state) in place of H_c. Four neighbouring elements a thread, as state_pass.
__global__ void state_pass_backward_kernel(Dims d, Work w) {
  const size_t quads = static_cast<size_t>(d.headdim) * d.state / 4;
  const size_t quad = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (quad >= quads) return;
  const size_t bh = blockIdx.y;
  state_recurrence<true>(reinterpret_cast<float4*>(w.gstates) + bh * d.chunks * quads + quad, quads,
                         w.decay + bh * d.chunks, d.chunks);
}

// How chunk_backward's block (kBackwardThreads) shares `items` outputs out by lanes of its warps:
// `lanes` neighbouring lanes an output (2^shift: the largest power of two up to 32 with
// items · lanes within the block's threads, else 1) and `per_pass` outputs a pass of the block.
// With the block a constant, it is worked out at compile time where `items` is a fixed shape's.
struct LaneShare {
  int lanes, shift, per_pass;
};
__host__ __device__ constexpr LaneShare share_lanes(int items) {
  int lanes = 1, shift = 0;
  while (lanes < 32 && items * lanes * 2 <= kBackwardThreads) {
    lanes *= 2;
    ++shift;
  }
  return {lanes, shift, kBackwardThreads >> shift};
}

// For each of `items` outputs, kOutputs sums taken by the whole block: the `lanes` neighbouring
// lanes of one warp that share_lanes(items) gives an output each add their part through
// walk(item, slice, lanes, acc) (slice: the lane's place among them; it adds into
// acc[0 … kOutputs)), and a butterfly over those lanes (a fixed order: deterministic) combines
// them before the first calls store(item, acc). The block is chunk_backward's (kBackwardThreads,
// its only caller): with that a constant, the lanes are worked out at compile time at the fixed
// shapes rather than at every call (backward −1% at MIMO and SISO, measured).
template <int kOutputs, class Walk, class Store>
static __device__ __forceinline__ void lane_group_sums(int items, Walk walk, Store store) {
  // Shifts, not integer divisions by a runtime value (about 4% of chunk_backward's instructions
  // were those divisions).
  const LaneShare share = share_lanes(items);
  const int lanes = share.lanes, shift = share.shift, per_pass = share.per_pass;
  const int slice = static_cast<int>(threadIdx.x) & (lanes - 1);
  for (int first = 0; first < items; first += per_pass) {
    const int item = first + (static_cast<int>(threadIdx.x) >> shift);
    float acc[kOutputs];
#pragma unroll
    for (int o = 0; o < kOutputs; ++o) acc[o] = 0.f;
    if (item < items) walk(item, slice, lanes, acc);
    for (int offset = lanes / 2; offset > 0; offset >>= 1) {
#pragma unroll
      for (int o = 0; o < kOutputs; ++o) acc[o] += __shfl_xor_sync(0xffffffffu, acc[o], offset);
    }
    if (slice == 0 && item < items) store(item, acc);
  }
}

// For each of `items` outputs, kOutputs sums over the chunk's tokens i < len (lane_group_sums'
// lanes, lane s adding tokens s, s + lanes, ... through term(i, item, acc)). One thread per output
// walking every token left most of the block waiting at the next barrier where the outputs are
// few (R·P = 64 per-head parameters in SISO).
template <int kOutputs, class Term, class Store>
static __device__ __forceinline__ void token_sums(int items, int len, Term term, Store store) {
  lane_group_sums<kOutputs>(
      items,
      [&](int item, int slice, int lanes, float* acc) {
        for (int i = slice; i < len; i += lanes) term(i, item, acc);
      },
      store);
}

// Un-rotates the gradient in d_qk (w.r.t. rotated q or k, rows (i, r)) in place, adds
// dL/dθ into d_theta, the bias gradient of head h into its partial, and the result into the
// group's sum (= for the group's first head, + after: a fixed order): the block's shared
// [rows][N] sum when smem_acc is not null, else the workspace's [B, T, R, G, N] one, acc.
// Its last phase reads d_qk: `close` ends with a barrier, for a caller that writes d_qk's space
// (the scores') next; without it, the caller's next barrier closes those reads.
template <class D>
__device__ void finish_qk_grad(const D& d, const ChunkPos& pos, bool first_head, const float* cosv,
                               const float* sinv, const bf16* rotated, int ld_rotated, float* d_qk,
                               int ld_d_qk, float* d_theta, float* bias_partial, float* smem_acc,
                               float* acc, bool close) {
  const int N = d.state, half = N / 2, R = d.rank, A = d.angles, ld_a = angles_stride(A);
  // Thread per (token, pair): the θ gradient of pair j sums over ranks without races.
  for (int idx = threadIdx.x; idx < d.chunk * half; idx += blockDim.x) {
    const int i = d.by_half.div(idx), n = d.by_half.mod(idx);
    if (n >= A) continue;
    float dl_dtheta = 0.f;
    const float cs = cosv[i * ld_a + n], sn = sinv[i * ld_a + n];
    for (int r = 0; r < R; ++r) {
      float* row = d_qk + (i * R + r) * ld_d_qk;
      const float da = row[n], db = row[n + half];
      const float ra = to_f(rotated[(i * R + r) * ld_rotated + n]);
      const float rb = to_f(rotated[(i * R + r) * ld_rotated + n + half]);
      dl_dtheta += db * ra - da * rb;
      row[n] = da * cs + db * sn;
      row[n + half] = db * cs - da * sn;
    }
    d_theta[i * ld_a + n] += dl_dtheta;
  }
  __syncthreads();
  token_sums<1>(
      R * N, pos.len,
      [&](int i, int item, float* acc) {
        acc[0] += d_qk[(i * R + d.by_state.div(item)) * ld_d_qk + d.by_state.mod(item)];
      },
      [&](int item, const float* acc) { bias_partial[item] = acc[0]; });
  if (smem_acc != nullptr) {
    constexpr int W = kPassColumnsPerItem<D>;  // float4 rows at the fixed shapes
    for (int idx = threadIdx.x; idx < pos.len * R * N / W; idx += blockDim.x) {
      const auto [row, n] = state_item<W>(d, idx);
      float here[W], sum[W];
      load_floats<W>(d_qk + row * ld_d_qk + n, here);
      if (!first_head) load_floats<W>(smem_acc + row * N + n, sum);
        // As the workspace's sum: the first head's term added to zero (−0 becomes +0 either way).
#pragma unroll
      for (int w = 0; w < W; ++w) sum[w] = (first_head ? 0.f : sum[w]) + here[w];
      store_floats<W>(smem_acc + row * N + n, sum);
    }
    if (close) __syncthreads();
    return;
  }
  // The chunk's rows (i, r) lie group-stride apart in the accumulator's [B, T, R, G, N] layout:
  // one 64-bit base per chunk, 32-bit offsets per element.
  float* acc_chunk =
      acc + ((static_cast<size_t>(pos.b) * d.seqlen + pos.t0) * R * d.groups + pos.g) * N;
  const int row_stride = d.groups * N;
  // W columns an index (16-byte rows at the fixed shapes), two indexes a batch there.
  constexpr int W = kPassColumnsPerItem<D>;
  struct Sum {
    float v[W];
  };
  for_each_batched<W == 1 ? kLoadBatch : 2>(
      pos.len * R * N / W,
      [&](int idx) {
        const auto [row, n] = state_item<W>(d, idx);
        Sum before{};
        if (!first_head) load_floats<W>(acc_chunk + row * row_stride + n, before.v);
        return before;
      },
      [&](int idx, const Sum& before) {
        const auto [row, n] = state_item<W>(d, idx);
        float here[W];
        load_floats<W>(d_qk + row * ld_d_qk + n, here);
#pragma unroll
        for (int w = 0; w < W; ++w) here[w] = before.v[w] + here[w];
        store_floats<W>(acc_chunk + row * row_stride + n, here);
      });
  if (close) __syncthreads();
}

// Everything the chunk contributes to every gradient, for each head of the group.
//
// Precision note. The scan depends on the angles only through differences θ_t − θ_s, so
// the per-token angle gradients sum to zero and dL/dangle_t (a suffix sum of them over
// the rest of the sequence) is a small remainder of large terms that cancel. They cancel
// only if the q-side and k-side terms see the same numbers: the rotated q and k are
// rounded to bf16 once and used everywhere, the intra-chunk score gradient is rounded
// once for both dQ and dK, and every product with the state (E, dS, F, G) keeps 16 or more
// significant bits: fp32 on the CUDA cores, or split-bf16 (hi + lo) operands on the tensor
// cores (state_gemm). Rounding E or dS to plain bf16 measured 1.1-3.6% angle error.
template <bool kTensor, class D>
__global__ void __launch_bounds__(kBackwardThreads)
    chunk_backward_kernel(D d, SmemPlan plan, DevInputs in, Work w, bool read_psiv, const bf16* dy,
                          DevGrads grads, HeadSplit head_split) {
  // At the fixed SISO shape (kLeanRegisters: R = 1), the launch's block (backward_launches) as a
  // constant: loops over blockDim.x strides here and in the helpers inlined then have constant
  // strides and trip counts (SISO backward −2.5%). At MIMO the same made the backward 4% slower
  // (more unrolled: 52/44 bytes of spill stores/loads a thread against 28/20).
  if constexpr (kLeanRegisters<D>) __builtin_assume(blockDim.x == kBackwardThreads);
  extern __shared__ __align__(16) unsigned char smem[];
  float* sc = reinterpret_cast<float*>(smem + plan.token_scalars);
  float* cosv = reinterpret_cast<float*>(smem + plan.rotation_cos);
  float* sinv = reinterpret_cast<float*>(smem + plan.rotation_sin);
  bf16* q_rot = reinterpret_cast<bf16*>(smem + plan.q_rotated);
  bf16* k_rot = reinterpret_cast<bf16*>(smem + plan.k_rotated);
  bf16* psiv = reinterpret_cast<bf16*>(smem + plan.psiv);
  float* state = reinterpret_cast<float*>(smem + plan.state);
  float* scores = reinterpret_cast<float*>(smem + plan.scores);
  float* d_scores = reinterpret_cast<float*>(smem + plan.d_scores);
  float* weights = reinterpret_cast<float*>(smem + plan.token_weights);
  // W[i][j] by token, read where the plan gives W a space, else made again (token_weight).
  const bool weights_recomputed = plan.weights_recomputed;
  const int ld_w = weights_stride(d.chunk);  // W's and dL/dW's rows
  const auto weight_of = [&](int i, int j) {
    return weights_recomputed ? token_weight(d, sc, i, j) : weights[i * ld_w + j];
  };
  float* o = reinterpret_cast<float*>(smem + plan.out);
  float* d_o = reinterpret_cast<float*>(smem + plan.d_out);
  float* d_psiv = reinterpret_cast<float*>(smem + plan.d_psiv);
  float* d_qk = reinterpret_cast<float*>(smem + plan.d_qk);
  float* sum_scratch = reinterpret_cast<float*>(smem + plan.sum_scratch);
  float* row_terms = reinterpret_cast<float*>(smem + plan.row_terms);
  const int column_tiles = d.headdim / 16;  // row_terms' columns
  // A tile epilogue's per-row partial sum over its own columns: summed over the row's four t-lanes
  // and stored as row_terms[row][the tile's column]. Every lane of the warp calls it together.
  const auto store_row_term = [&](float term, int row, int j0, int t) {
    term += __shfl_xor_sync(0xffffffffu, term, 1);
    term += __shfl_xor_sync(0xffffffffu, term, 2);
    if (t == 0) row_terms[row * column_tiles + j0 / 16] = term;
  };
  float* d_theta = reinterpret_cast<float*>(smem + plan.d_theta);
  // The head's mimo_x, then mimo_z and mimo_o, [R][P] fp32 each (rows of mimo_params_stride):
  // loaded once with PsiV and dO, read by the epilogue and dx instead of global memory inside their
  // loops.
  float* mimo_x = reinterpret_cast<float*>(smem + plan.mimo_params);
  const int ld_mimo = mimo_params_stride(d.headdim);
  float* mimo_zo = mimo_x + d.rank * ld_mimo;
  // The group's dQ and dK sums, when they stay in shared memory (plan_backward).
  float* dq_sum = plan.dq_acc != 0 ? reinterpret_cast<float*>(smem + plan.dq_acc) : nullptr;
  float* dk_sum = plan.dk_acc != 0 ? reinterpret_cast<float*>(smem + plan.dk_acc) : nullptr;
  // Sw = QKᵀ ⊙ W, the bf16 operand of the tensor-core products; without fused_weights (below) it
  // then takes dSc ⊙ W after dL/dV, which fused_weights keeps in d_scores' space (d_weighted).
  bf16* weighted = reinterpret_cast<bf16*>(smem + plan.weighted_scores);
  bf16* d_o_bf16 = reinterpret_cast<bf16*>(smem + plan.d_out_bf16);
  // The state (E, later dS) and dO as hi + lo bf16 pairs for smem_mma_split (plan_backward), or
  // null: the state products then split their fp32 operands per fetch (state_gemm).
  const bool split = kTensor && plan.state_hi != 0;
  bf16* state_hi = split ? reinterpret_cast<bf16*>(smem + plan.state_hi) : nullptr;
  bf16* state_lo = split ? reinterpret_cast<bf16*>(smem + plan.state_lo) : nullptr;
  bf16* d_o_lo = split ? reinterpret_cast<bf16*>(smem + plan.d_out_lo) : nullptr;
  const int ld_split = plan.ld_split;
  const int N = d.state, P = d.headdim, R = d.rank, C = d.chunk, M = d.rows, A = d.angles;
  const int ld_a = angles_stride(A);  // cos θ's, sin θ's and dL/dθ's rows
  const SmemStrides ld = strides_of<D>(plan);
  const int ld_qk = ld.qk, ld_pv = ld.pv, ld_state = ld.state;
  const int ld_mm = ld.mm, ld_mp = ld.mp, ld_mn = ld.mn, ld_sw = ld.sw;
  // Split, with R a power of two up to 8 (an R×R block of the scores then lies within a warp's
  // tile) and d_qk within the scores' space: the score products' tiles make Sw, dSc ⊙ W (bf16, in
  // d_scores' space) and dL/dW (in the scores' space, free until d_qk) at once, and neither fp32
  // score matrix is stored.
  const bool fused_weights = split && (R & (R - 1)) == 0 && R <= 8 && ld_mn <= ld_mm;
  bf16* d_weighted = fused_weights ? reinterpret_cast<bf16*>(d_scores) : weighted;
  float* d_weights = fused_weights ? scores : reinterpret_cast<float*>(smem + plan.d_token_weights);
  // State element (p, n): split, its hi + lo pair (split_bf16's), which is all the products read;
  // else the fp32 value.
  const auto set_state = [&](int p, int n, float value) {
    if (split) {
      store_split(value, state_hi, state_lo, p * ld_split + n);
    } else {
      state[p * ld_state + n] = value;
    }
  };
  // Split, the fp32 state's space is free from the head's start until dS is copied in after D's
  // partial: it holds the chunk's z and dy for the epilogue when they fit.
  bf16* z_dy = split && C <= ld_state ? reinterpret_cast<bf16*>(state) : nullptr;
  // The chunk's v for mimo_x's partial, in the scores' space when it fits: written only after
  // finish_qk_grad for k has passed its last barrier, when neither the scores nor d_qk (which may
  // share that space) are read again for the head.
  // With a space of its own (plan_backward) and PsiV computed rather than read from the cache, v
  // arrives there with PsiV's loads at the head's start: dx's pass (or dV's tiles) then waits on
  // no load.
  bf16* v_early =
      plan.v_tokens != 0 && !read_psiv ? reinterpret_cast<bf16*>(smem + plan.v_tokens) : nullptr;
  // With fused_weights at R = 1: dV is never stored. Its tiles are made in registers in the
  // exit-state phase (Swᵀ dO + D dO + exit_scale · K dSᵀ) and give dx, d_scale's and mimo_x's
  // terms there; z's in-place terms (without gating_in_tiles) then take dV's space. (At R = 4,
  // making dV's tiles whole with Swᵀ dO in them measured 0.8% slower; dx_in_tiles below keeps
  // Swᵀ dO stored and only finishes dV in K dSᵀ's tiles.)
  const bool fused_dv = fused_weights && R == 1;
  // With fused_weights and the chunk's z and dy in shared memory (not at the fixed SISO shape:
  // kLeanRegisters), o's tiles finish the gating epilogue in registers and o is never stored:
  // dz (a token's ranks summed over the lanes g ^ 1 …), D's partial, and mimo_o's and mimo_z's
  // terms summed over each rank's rows of the tile (lanes g ^ R …) into gating_tiles, two
  // [row tile][R][P] blocks in o's space, summed over the row tiles after the phase.
  const bool gating_in_tiles = fused_weights && z_dy != nullptr && !kLeanRegisters<D>;
  float* gating_tiles = o;
  const int row_tiles = M / 16;
  // With gating_in_tiles at R ≥ 2 (not fused_dv): K dSᵀ's tiles, which complete dV, also give
  // dx (a token's ranks summed over lanes) and mimo_x's terms (each rank's rows of the tile summed
  // over lanes into [row tile][R][P] blocks in o's space, summed after the phase); dV is not
  // stored back and the dx pass is gone.
  const bool dx_in_tiles = gating_in_tiles && !fused_dv;
  float* mimo_x_tiles = o;
  bf16* v_tokens = v_early != nullptr ? v_early
                   : C * P * sizeof(bf16) <= M * ld_mm * sizeof(float)
                       ? reinterpret_cast<bf16*>(scores)
                       : nullptr;
  // The next head's v, z and dy ([3][C][P]), copied 16 bytes at a time while this head computes,
  // when the plan has the space and the tensors' rows allow it (not at the fixed SISO shape:
  // kLeanRegisters).
  const bool aligned = ((reinterpret_cast<uintptr_t>(in.v) | reinterpret_cast<uintptr_t>(in.z) |
                         reinterpret_cast<uintptr_t>(dy) | in.zv_stride * sizeof(bf16)) %
                        16) == 0;
  bf16* staged = kAsyncCopies && !kLeanRegisters<D> && plan.staged_tokens != 0 && aligned
                     ? reinterpret_cast<bf16*>(smem + plan.staged_tokens)
                     : nullptr;
  const auto stage = [&](const ChunkPos& at) {
    constexpr int kPiece = 8;  // bf16 per 16-byte copy
    const int pieces = P / kPiece;
    for (int idx = threadIdx.x; idx < 3 * C * pieces; idx += blockDim.x) {
      const int row = idx / pieces, piece = idx % pieces;  // row = (which, token)
      const int which = row / C, i = row % C;
      const bf16* src = which == 0 ? in.v : which == 1 ? in.z : dy;
      const bool valid = i < at.len;  // padded tokens are zeros
      const size_t from = token_row(d, at.b, at.t0 + (valid ? i : 0), at.h,
                                    which == 2 ? static_cast<size_t>(d.heads) * P : in.zv_stride);
      copy_16_async(staged + row * P + piece * kPiece, src + from + piece * kPiece, valid);
    }
    commit_copies();
  };
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  // The element-wise passes over rows take W neighbouring columns an index (float4 rows at the
  // fixed shapes; see kPassColumnsPerItem).
  constexpr int W = kPassColumnsPerItem<D>;
  // The block's unit (batch, group, chunk) and its heads in the group: all of them, or one where
  // the unit is split (HeadSplit).
  int unit = blockIdx.x, head_first = 0, head_end = d.heads_per_group;
  if (unit >= head_split.whole_units) {
    const int k = unit - head_split.whole_units;
    unit = head_split.whole_units + k / d.heads_per_group;
    head_first = k % d.heads_per_group;
    head_end = head_first + 1;
  }
  const ChunkPos group_pos = chunk_pos(d, unit / d.chunks, true, unit % d.chunks);
  if (staged != nullptr) {  // the block's first head
    ChunkPos first = group_pos;
    first.h += head_first;
    stage(first);
  }
  // With fused_weights at the fixed shapes, each head's entry state E (fp32, unpadded) is copied
  // ahead into d_scores' space, free from the dK phase to the next head's score products: for the
  // group's first head now, for the next head once dK's phase is done. Each thread reads back
  // the quads it copied (so no barrier). Its load at the head's start was the largest wait on
  // global memory there (ncu: a quarter of the kernel's long-scoreboard stalls).
  const bool entry_ahead = fused_weights && W > 1 && P * N <= M * ld_mm;
  float* entry_stage = d_scores;
  const auto copy_entry_ahead = [&](int head) {
    const float* src =
        w.states + ((static_cast<size_t>(group_pos.b) * d.heads + head) * d.chunks + group_pos.c) *
                       static_cast<size_t>(P) * N;
    for (int quad = threadIdx.x; quad < P * N / 4; quad += blockDim.x) {
      copy_16_async(entry_stage + 4 * quad, src + 4 * quad, true);
    }
    commit_copies();
  };
  if (entry_ahead) copy_entry_ahead(group_pos.h + head_first);
  const size_t slot = static_cast<size_t>(group_pos.b) * d.chunks + group_pos.c;
  const size_t slots = static_cast<size_t>(d.batch) * d.chunks;

  for (int hg = head_first; hg < head_end; ++hg) {
    ChunkPos pos = group_pos;
    pos.h = group_pos.g * d.heads_per_group + hg;
    const int h = pos.h;
    const size_t bhc = (static_cast<size_t>(pos.b) * d.heads + h) * d.chunks + pos.c;
    const size_t matrix = static_cast<size_t>(P) * N;
    float* partial = w.partials + (static_cast<size_t>(h) * slots + slot) * d.partial_width;
    float* qb_partial = partial;
    float* kb_partial = partial + R * N;
    float* mx_partial = partial + 2 * R * N;
    float* mz_partial = mx_partial + R * P;
    float* mo_partial = mz_partial + R * P;
    float* d_partial = mo_partial + R * P;
    const float skip = to_f(in.d[h]);

    // This head's staged tokens: load_scalars' barrier makes every thread's copies visible.
    if (staged != nullptr) wait_copies<0>();
    load_scalars(d, in, w, pos, sc, cosv, sinv);
    load_rotated_qk(d, in, pos, cosv, sinv, q_rot, k_rot, ld_qk);
    load_together(
        PsivLoader<D>::items(d),
        PsivLoader<D>{d, in, pos, w.psiv, read_psiv, false, psiv, ld_pv, mimo_x, v_early, staged},
        DOutLoader<D>{d, in, dy, pos, d_o, ld_mp, z_dy, mimo_zo,
                      staged != nullptr ? staged + C * P : nullptr, split ? d_o_bf16 : nullptr,
                      d_o_lo, ld_pv});
    bool entry_split = false;
    if constexpr (W > 1) {
      // Four elements of a row a thread.
      if (split) {
        entry_split = true;
        const auto store_entry_quad = [&](int p, int n, const float4& x) {
          store_split_quad(x, state_hi, state_lo, p * ld_split + n);
        };
        if (entry_ahead) {
          wait_copies<0>();  // this thread's quads (with the staged tokens)
          for (int quad = threadIdx.x; quad < P * N / 4; quad += blockDim.x) {
            store_entry_quad(d.by_state.div(4 * quad), d.by_state.mod(4 * quad),
                             reinterpret_cast<const float4*>(entry_stage)[quad]);
          }
        } else {
          for_each_state_quad(d, w.states + bhc * matrix, store_entry_quad);
        }
      }
    }
    if (!entry_split) for_each_state_element(d, w.states + bhc * matrix, set_state);
    if (!weights_recomputed) fill_weights(d, sc, weights);
    for (int idx = threadIdx.x; idx < C * ld_a; idx += blockDim.x) d_theta[idx] = 0.f;
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
      sc[kDLog * C + i] = 0.f;
      sc[kDGamma * C + i] = 0.f;
      sc[kDKappa * C + i] = 0.f;
    }
    __syncthreads();
    // The staged tokens are read: the next head's copies start.
    if (staged != nullptr && hg + 1 < head_end) {
      ChunkPos next = pos;
      next.h = h + 1;
      stage(next);
    }

    float d_local = 0.f;  // D's partial: Σ dO ⊙ PsiV
    // Recompute the forward: scores, weighted scores and o.
    if (fused_weights) {
      // Each warp makes a tile of QKᵀ and the same tile of dSc = dO Vᵀ (dO's pairs came with its
      // load) and keeps neither in fp32: Sw = QKᵀ ⊙ W and dSc ⊙ W rounded to bf16, and the
      // score-weight gradient dL/dW, each R×R block's Σ dSc ⊙ QKᵀ, summed across the block's
      // lanes.
      smem_mma_pair_tiles(
          M, M,
          SmemOperands<false, false, false, false>{q_rot, nullptr, ld_qk, k_rot, nullptr, ld_qk, N},
          SmemOperands<false, false, false, false>{d_o_bf16, nullptr, ld_pv, psiv, nullptr, ld_pv,
                                                   P},
          [&](const float(&score)[2][4], const float(&d_score)[2][4], int i0, int j0, int g,
              int t) {
#pragma unroll
            for (int upper = 0; upper < 2; ++upper) {
              const int i = i0 + g + 8 * upper;
              const float* weight_row = weights + d.by_rank.div(i) * ld_w;
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                const int j = j0 + half * 8 + 2 * t;
                const float s0 = score[half][2 * upper], s1 = score[half][2 * upper + 1];
                const float ds0 = d_score[half][2 * upper], ds1 = d_score[half][2 * upper + 1];
                const float w0 = weight_row[d.by_rank.div(j)],
                            w1 = weight_row[d.by_rank.div(j + 1)];
                *reinterpret_cast<__nv_bfloat162*>(weighted + i * ld_sw + j) =
                    __floats2bfloat162_rn(s0 * w0, s1 * w1);
                *reinterpret_cast<__nv_bfloat162*>(d_weighted + i * ld_sw + j) =
                    __floats2bfloat162_rn(ds0 * w0, ds1 * w1);
                if (R == 1) {
                  *reinterpret_cast<float2*>(d_weights + i * ld_w + j) =
                      make_float2(ds0 * s0, ds1 * s1);
                  continue;
                }
                // R ≥ 2: the pair of columns lies in one block; its other columns are in the
                // lanes t ^ 1 … (R / 2 of them), its other rows in the lanes g ^ 1 … (R).
                const int block_lanes = R > 1 ? R / 2 : 1;  // t-lanes a block spans
                float block = ds0 * s0 + ds1 * s1;
                for (int offset = 1; offset < block_lanes; offset <<= 1) {
                  block += __shfl_xor_sync(0xffffffffu, block, offset);
                }
                for (int offset = 4; offset < 4 * R; offset <<= 1) {
                  block += __shfl_xor_sync(0xffffffffu, block, offset);
                }
                if (t % block_lanes == 0 && g % R == 0) {
                  d_weights[d.by_rank.div(i) * ld_w + d.by_rank.div(j)] = block;
                }
              }
            }
          });
    } else {
      bf16_gemm<kTensor, false, false>(
          M, M, N, q_rot, ld_qk, k_rot, ld_qk, [&](int i, int j, float value) {
            scores[i * ld_mm + j] = value;
            weighted[i * ld_sw + j] =
                __float2bfloat16(value * weight_of(d.by_rank.div(i), d.by_rank.div(j)));
          });
    }
    if (split) {
      // dO's pairs came with its load: dSc = dO Vᵀ goes with the scores, and each warp makes its
      // tiles of o whole, o = e^{l} Q Eᵀ + Sw PsiV + D PsiV, from both products in registers,
      // summing each row's dO ⊙ Q Eᵀ (dL/dl_i's entry term) over the tile into row_terms.
      if (!fused_weights) {
        bf16_gemm<kTensor, false, false>(
            M, M, P, d_o_bf16, ld_pv, psiv, ld_pv,
            [&](int i, int j, float value) { d_scores[i * ld_mm + j] = value; });
      }
      __syncthreads();
      // kGating: gating_in_tiles, compiled in only where it may be taken (the fixed SISO shape's
      // code stays as it was: kLeanRegisters).
      const auto o_tiles = [&](auto gating) {
        constexpr bool kGating = decltype(gating)::value;
        smem_mma_pair_tiles(
            M, P,
            SmemOperands<false, false, false, true>{q_rot, nullptr, ld_qk, state_hi, state_lo,
                                                    ld_split, N},
            SmemOperands<false, true, false, false>{weighted, nullptr, ld_sw, psiv, nullptr, ld_pv,
                                                    M},
            [&](const float(&entry)[2][4], const float(&intra)[2][4], int i0, int j0, int g,
                int t) {
              // kGating: mimo_o's and mimo_z's terms [which][half][column], summed over the
              // thread's two rows (one rank: R divides 8), and dz [half][column] of each row.
              [[maybe_unused]] float gating_sums[2][2][2] = {};
#pragma unroll
              for (int upper = 0; upper < 2; ++upper) {
                const int row = i0 + g + 8 * upper;
                const int token = d.by_rank.div(row);
                const float decay = sc[kEntryDecay * C + token];
                float term = 0.f;
                [[maybe_unused]] float dz[2][2];
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                  const int p = j0 + half * 8 + 2 * t;
                  const float e0 = entry[half][2 * upper], e1 = entry[half][2 * upper + 1];
                  const float2 d_out = *reinterpret_cast<const float2*>(d_o + row * ld_mp + p);
                  term += d_out.x * e0 + d_out.y * e1;
                  const __nv_bfloat162 v_pair =
                      *reinterpret_cast<const __nv_bfloat162*>(psiv + row * ld_pv + p);
                  // e^{l} Q Eᵀ rounded on its own, as when it was stored before the sum.
                  float2 out;
                  out.x =
                      __fmul_rn(decay, e0) + (intra[half][2 * upper] + skip * __low2float(v_pair));
                  out.y = __fmul_rn(decay, e1) +
                          (intra[half][2 * upper + 1] + skip * __high2float(v_pair));
                  if constexpr (!kGating) {
                    *reinterpret_cast<float2*>(o + row * ld_mp + p) = out;
                  } else {
                    // The gating epilogue's terms of (token, rank, p) and (…, p + 1).
                    const int rank = d.by_rank.mod(row);
                    const bool valid = token < pos.len;
                    const float2 zs = __bfloat1622float2(
                        *reinterpret_cast<const __nv_bfloat162*>(z_dy + z_dy_at(d, token, p)));
                    const float2 dys = __bfloat1622float2(
                        *reinterpret_cast<const __nv_bfloat162*>(z_dy + z_dy_at(d, C + token, p)));
                    const float2 mz =
                        *reinterpret_cast<const float2*>(mimo_zo + rank * ld_mimo + p);
                    const float2 mo =
                        *reinterpret_cast<const float2*>(mimo_zo + (R + rank) * ld_mimo + p);
                    const float zc[2] = {zs.x, zs.y}, dyc[2] = {dys.x, dys.y};
                    const float mzc[2] = {mz.x, mz.y}, moc[2] = {mo.x, mo.y};
                    const float oc[2] = {out.x, out.y};
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                      const float gate = zc[c] * mzc[c], sg = sigmoidf(gate);
                      const float gated = dyc[c] * oc[c] * sg;
                      const float slope = moc[c] * (1.f + gate * (1.f - sg));
                      dz[half][c] = gated * slope * mzc[c];
                      gating_sums[0][half][c] += valid ? gated * gate : 0.f;
                      gating_sums[1][half][c] += valid ? gated * slope * zc[c] : 0.f;
                    }
                    if (valid) {
                      d_local += d_out.x * __low2float(v_pair) + d_out.y * __high2float(v_pair);
                    }
                  }
                }
                store_row_term(term, row, j0, t);
                if constexpr (kGating)
                  store_token_fragment(d, pos, h, token, row, j0, t, dz, grads.z);
              }
              if constexpr (kGating) {
                // Each rank's rows of the tile: lanes g ^ R … (R divides 8).
                for (int offset = 4 * R; offset < 32; offset <<= 1) {
#pragma unroll
                  for (int which = 0; which < 2; ++which)
#pragma unroll
                    for (int half = 0; half < 2; ++half)
#pragma unroll
                      for (int c = 0; c < 2; ++c) {
                        gating_sums[which][half][c] +=
                            __shfl_xor_sync(0xffffffffu, gating_sums[which][half][c], offset);
                      }
                }
                if (g < R) {  // rank g
#pragma unroll
                  for (int which = 0; which < 2; ++which)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                      const int at =
                          ((which * row_tiles + i0 / 16) * R + g) * P + j0 + half * 8 + 2 * t;
                      *reinterpret_cast<float2*>(gating_tiles + at) =
                          make_float2(gating_sums[which][half][0], gating_sums[which][half][1]);
                    }
                }
              }
            });
      };
      if constexpr (kLeanRegisters<D>) {
        o_tiles(std::false_type{});
      } else if (gating_in_tiles) {
        o_tiles(std::true_type{});
      } else {
        o_tiles(std::false_type{});
      }
    } else {
      state_gemm<kTensor, false, true>(
          M, P, N, [&](int i, int n) { return to_f(q_rot[i * ld_qk + n]); },
          [&](int n, int p) { return state[p * ld_state + n]; },
          [&](int i, int p, float value) { o[i * ld_mp + p] = value; });
      __syncthreads();
      // dL/dl_i from the entry term e^{l_i} (Q Eᵀ)_i: one warp per token. Each lane then scales
      // the o elements it read by e^{l_i} and rounds their dO to bf16 (E is dead until dO E
      // reloads it, and its space takes the bf16 dO): no barrier between the dot's reads and
      // those writes, and no second pass.
      for (int i = warp; i < C; i += warps) {
        const float decay = sc[kEntryDecay * C + i];
        float dot = 0.f;
        for (int x = lane * W; x < R * P; x += 32 * W) {
          const int row = i * R + d.by_headdim.div(x), p = d.by_headdim.mod(x);
          const int at = row * ld_mp + p;
          float out[W], value[W];
          load_floats<W>(o + at, out);
          load_floats<W>(d_o + at, value);
#pragma unroll
          for (int w = 0; w < W; ++w) {
            dot += value[w] * out[w];
            out[w] *= decay;
          }
          store_floats<W>(o + at, out);
          store_row(d_o_bf16 + row * ld_pv + p, round_row<W>(value));
        }
        dot = warp_sum(dot);
        if (lane == 0) sc[kScratch * C + i] = decay * dot;
      }
      __syncthreads();
      bf16_gemm<kTensor, false, true>(
          M, P, M, weighted, ld_sw, psiv, ld_pv, [&](int i, int p, float value) {
            o[i * ld_mp + p] += value + skip * to_f(psiv[i * ld_pv + p]);
          });
      // Inside the chunk: dSc = dO Vᵀ.
      bf16_gemm<kTensor, false, false>(
          M, M, P, d_o_bf16, ld_pv, psiv, ld_pv,
          [&](int i, int j, float value) { d_scores[i * ld_mm + j] = value; });
    }
    // dV = D dO + Swᵀ dO (fused_dv: later, with its last term).
    if (!fused_dv) {
      bf16_gemm<kTensor, true, true>(M, P, M, weighted, ld_sw, d_o_bf16, ld_pv,
                                     [&](int i, int p, float value) {
                                       d_psiv[i * ld_mp + p] = value + skip * d_o[i * ld_mp + p];
                                     });
    }
    __syncthreads();

    // Epilogue backward (gating, mimo_o, mimo_z, D) now that o is complete; z and dy from z_dy,
    // or global memory.
    // Split, o is dead after this epilogue and dO (fp32) after D's partial (unless fused_dv, whose
    // dV tiles read it later): each (i, r, p) term of mimo_o's and mimo_z's partials is computed
    // once, beside dz (one sigmoid per element where the sums over tokens took a second), and left
    // in o and z_terms (dO's space, or dV's with fused_dv) for those sums. Not at the fixed SISO
    // shape (kLeanRegisters). With gating_in_tiles, o's tiles did all of it: only the row tiles'
    // sums are left.
    const bool terms_in_place = split && !kLeanRegisters<D>;
    float* z_terms = fused_dv ? d_psiv : d_o;  // fused_dv keeps dO for dV
    for (int idx = threadIdx.x; idx < (gating_in_tiles ? 0 : pos.len * P / W); idx += blockDim.x) {
      const auto [i, p] = headdim_item<W>(d, idx);
      const size_t th = token_head(d, pos.b, pos.t0 + i, h);
      const Bf16Row<W> zs =
          load_row<W>(z_dy != nullptr ? z_dy + z_dy_at(d, i, p)
                                      : in.z + zv_row(d, in, pos.b, pos.t0 + i, h) + p);
      const Bf16Row<W> dys =
          load_row<W>(z_dy != nullptr ? z_dy + z_dy_at(d, C + i, p) : dy + th * P + p);
      float dz[W] = {};
      for (int r = 0; r < R; ++r) {
        const int at = (i * R + r) * ld_mp + p;
        float mz[W], mo[W], o_r[W], d_o_r[W], o_term[W], z_term[W];
        load_floats<W>(mimo_zo + r * ld_mimo + p, mz);
        load_floats<W>(mimo_zo + (R + r) * ld_mimo + p, mo);
        load_floats<W>(o + at, o_r);
        if (terms_in_place) load_floats<W>(d_o + at, d_o_r);
        const Bf16Row<W> psiv_r = load_row<W>(psiv + (i * R + r) * ld_pv + p);
#pragma unroll
        for (int w = 0; w < W; ++w) {
          const float z = zs.at(w), g_out = dys.at(w);
          const float gate = z * mz[w], sg = sigmoidf(gate);
          const float gated = g_out * o_r[w] * sg, slope = mo[w] * (1.f + gate * (1.f - sg));
          dz[w] += gated * slope * mz[w];
          if (terms_in_place) {
            d_local += d_o_r[w] * psiv_r.at(w);
            o_term[w] = gated * gate;       // mimo_o's term
            z_term[w] = gated * slope * z;  // mimo_z's term
          }
        }
        if (terms_in_place) {
          store_floats<W>(o + at, o_term);
          store_floats<W>(z_terms + at, z_term);
        }
      }
      store_row(grads.z + th * P + p, round_row<W>(dz));
    }
    if (gating_in_tiles) {
      // The row tiles' sums, in order (the phase's barrier above made them visible).
      for (int item = threadIdx.x; item < R * P; item += blockDim.x) {
        float mo_sum = 0.f, mz_sum = 0.f;
        for (int tile = 0; tile < row_tiles; ++tile) {
          mo_sum += gating_tiles[tile * R * P + item];
          mz_sum += gating_tiles[(row_tiles + tile) * R * P + item];
        }
        mo_partial[item] = mo_sum;
        mz_partial[item] = mz_sum;
      }
    } else if (terms_in_place) {
      __syncthreads();
      token_sums<2>(
          R * P, pos.len,
          [&](int i, int item, float* acc) {
            const int at = (i * R + d.by_headdim.div(item)) * ld_mp + d.by_headdim.mod(item);
            acc[0] += o[at];
            acc[1] += z_terms[at];
          },
          [&](int item, const float* acc) {
            mo_partial[item] = acc[0];
            mz_partial[item] = acc[1];
          });
    } else {
      // z and dy from shared memory or global memory, chosen once outside the sums' loops (a
      // choice per term computed both addresses, predicated).
      const auto gating_sums = [&](auto&& z_and_dy_at) {
        token_sums<2>(
            R * P, pos.len,
            [&](int i, int item, float* acc) {
              const int r = d.by_headdim.div(item), p = d.by_headdim.mod(item);
              const float2 zg = z_and_dy_at(i, p);
              const float z = zg.x, g_out = zg.y;
              const float mz = mimo_zo[r * ld_mimo + p], mo = mimo_zo[(R + r) * ld_mimo + p];
              const float o_ir = o[(i * R + r) * ld_mp + p];
              const float gate = z * mz, sg = sigmoidf(gate);
              acc[0] += g_out * o_ir * gate * sg;
              acc[1] += g_out * o_ir * mo * sg * (1.f + gate * (1.f - sg)) * z;
            },
            [&](int item, const float* acc) {
              mo_partial[item] = acc[0];
              mz_partial[item] = acc[1];
            });
      };
      if (z_dy != nullptr) {
        gating_sums([&](int i, int p) {
          return make_float2(to_f(z_dy[z_dy_at(d, i, p)]), to_f(z_dy[z_dy_at(d, C + i, p)]));
        });
      } else {
        gating_sums([&](int i, int p) {
          const size_t th = token_head(d, pos.b, pos.t0 + i, h);
          return make_float2(to_f(in.z[zv_row(d, in, pos.b, pos.t0 + i, h) + p]),
                             to_f(dy[th * P + p]));
        });
      }
      for (int idx = threadIdx.x; idx < M * P / W; idx += blockDim.x) {
        const auto [row, p] = headdim_item<W>(d, idx);
        float d_o_row[W];
        load_floats<W>(d_o + row * ld_mp + p, d_o_row);
        const Bf16Row<W> psiv_row = load_row<W>(psiv + row * ld_pv + p);
#pragma unroll
        for (int w = 0; w < W; ++w) d_local += d_o_row[w] * psiv_row.at(w);
      }
    }
    {
      // Its barrier also closes the sums' reads of o before d_token_weights (in o's space).
      const float total = block_sum_to_first_thread(d_local, sum_scratch);
      if (threadIdx.x == 0) d_partial[0] = total;
    }
    // Split, the fp32 state's space is free from here (z and dy are read): the exit state's
    // gradient dS is copied into it now and read only at the exit-state phase, by the thread that
    // copied each element, so that its load waits on nothing in between. (Unsplit, E is reloaded
    // there for dO E, and dS is loaded at the phase.)
    const auto for_each_own_state_element = [&](auto&& at) {
      for (int idx = threadIdx.x; idx < P * N; idx += blockDim.x) {
        at(d.by_state.div(idx), d.by_state.mod(idx), idx);
      }
    };
    // At the fixed shapes dS is staged unpadded (rows of N), 16 bytes a copy.
    const float* exit_gradient = w.gstates + bhc * matrix;
    if (split && W > 1) {
      for (int quad = threadIdx.x; quad < P * N / 4; quad += blockDim.x) {
        copy_16_async(state + 4 * quad, exit_gradient + 4 * quad, true);
      }
      commit_copies();
    } else if (split) {
      for_each_own_state_element([&](int p, int n, int idx) {
        copy_4_async(state + p * ld_state + n, exit_gradient + idx);
      });
      commit_copies();
    }

    // Score-weight gradients per token pair, then dSc ⊙ W (rounded once, for dQ and dK), unless
    // the products' tiles made both.
    for (int idx = threadIdx.x; idx < (fused_weights ? 0 : C * C); idx += blockDim.x) {
      const int ti = d.by_chunk.div(idx), tj = d.by_chunk.mod(idx);
      float d_weight = 0.f;
      if (tj <= ti) {
        for (int r = 0; r < R; ++r) {
          const int at = (ti * R + r) * ld_mm + tj * R;
          if constexpr (kRanksInQuads<D>) {
            // The same products in the same order, four ranks a float4.
            for (int r2 = 0; r2 < R; r2 += 4) {
              float d_sc[4], sc_r[4];
              load_floats<4>(d_scores + at + r2, d_sc);
              load_floats<4>(scores + at + r2, sc_r);
#pragma unroll
              for (int e = 0; e < 4; ++e) d_weight += d_sc[e] * sc_r[e];
            }
          } else {
            for (int r2 = 0; r2 < R; ++r2) d_weight += d_scores[at + r2] * scores[at + r2];
          }
        }
      }
      d_weights[ti * ld_w + tj] = d_weight;
    }
    if (!fused_weights) __syncthreads();
    for (int idx = threadIdx.x; idx < (fused_weights ? 0 : M * M / W); idx += blockDim.x) {
      const auto [i, j] = rows_item<W>(d, idx);
      float d_sc[W];
      load_floats<W>(d_scores + i * ld_mm + j, d_sc);
      const int ti = d.by_rank.div(i);
#pragma unroll
      for (int w = 0; w < W; ++w) d_sc[w] *= weight_of(ti, d.by_rank.div(j + w));
      store_row(weighted + i * ld_sw + j, round_row<W>(d_sc));
    }
    // dL/dl_i, dL/dκ_i and dL/dγ_i of each token i from its pairs (i, j): `lanes` neighbouring
    // lanes a token (share_lanes), lane s taking j = s, s + lanes, …, and one butterfly over them
    // for the three sums together. A warp a token (its lanes over j) walked four tokens in a row at
    // SISO (C = 64), each behind three chains of five shuffles, while the block waited at the
    // barrier (this phase 5,151 → 3,285 cycles a head at SISO, fwd+bwd −3.6%; MIMO −0.7%).
    lane_group_sums<3>(
        C,
        [&](int i, int slice, int lanes, float* acc) {
          const float log_i = sc[kLog * C + i];
          for (int j = slice; j < C; j += lanes) {
            if (j < i) {
              acc[0] += d_weights[i * ld_w + j] * weight_of(i, j);
            } else if (j > i) {
              acc[1] += d_weights[j * ld_w + i] * exp_flushed(sc[kLog * C + j] - log_i);
            }
          }
          // The entry term: split, the sum of the token's row terms (o's tiles), scaled below.
          if (split) {
            for (int x = slice; x < R * column_tiles; x += lanes)
              acc[2] += row_terms[i * R * column_tiles + x];
          }
        },
        [&](int i, const float* acc) {
          const float d_log = acc[0], d_kappa = acc[1], entry = acc[2];
          // The later tokens' terms of dL/dl_i, −Σ_{j>i} dL/dW_ji W_ji, are −κ_i dL/dκ_i.
          sc[kDLog * C + i] = (split ? sc[kEntryDecay * C + i] * entry : sc[kScratch * C + i]) +
                              (d_log - sc[kKappa * C + i] * d_kappa);
          sc[kDKappa * C + i] = d_kappa;
          sc[kDGamma * C + i] = d_weights[i * ld_w + i];
        });
    __syncthreads();

    // dQ = dSc K + e^{l} dO E. Split (the pairs are still E's), each tile of both products by one
    // warp, summed in registers; unsplit, the fp32 E reloaded (its space held the bf16 dO) and
    // the second product added to the first in d_qk.
    if (split) {
      smem_mma_pair(M, N,
                    SmemOperands<false, true, false, false>{d_weighted, nullptr, ld_sw, k_rot,
                                                            nullptr, ld_qk, M},
                    SmemOperands<false, true, true, true>{d_o_bf16, d_o_lo, ld_pv, state_hi,
                                                          state_lo, ld_split, P},
                    [&](int i, int n, float d_sc_k, float d_o_e) {
                      d_qk[i * ld_mn + n] = d_sc_k + sc[kEntryDecay * C + d.by_rank.div(i)] * d_o_e;
                    });
    } else {
      load_state(d, w.states + bhc * matrix, state, ld_state);
      bf16_gemm<kTensor, false, true>(
          M, N, M, weighted, ld_sw, k_rot, ld_qk,
          [&](int i, int n, float value) { d_qk[i * ld_mn + n] = value; });
      __syncthreads();
      state_gemm<kTensor, true, true>(
          M, N, P, [&](int i, int p) { return d_o[i * ld_mp + p]; },
          [&](int p, int n) { return state[p * ld_state + n]; },
          [&](int i, int n, float value) {
            d_qk[i * ld_mn + n] += sc[kEntryDecay * C + d.by_rank.div(i)] * value;
          });
    }
    __syncthreads();
    // Not closed: the exit state's phase writes neither d_qk nor the sums, and its barrier comes
    // before dK's product writes d_qk.
    finish_qk_grad(d, pos, hg == head_first, cosv, sinv, q_rot, ld_qk, d_qk, ld_mn, d_theta,
                   qb_partial, dq_sum, w.dq_acc, false);

    // Exit state: dS = dL/d(exit state). dL/dl_last += e^{l_last} <dS, E>, with E still in
    // `state`, or split in its hi + lo pair (each element is read by the thread that then
    // overwrites it with dS's).
    {
      float local = 0.f;
      if (split && W > 1) {
        wait_copies<0>();  // this thread's dS quads (and the staged tokens, issued earlier)
        for (int quad = threadIdx.x; quad < P * N / 4; quad += blockDim.x) {
          const int p = d.by_state.div(4 * quad), n = d.by_state.mod(4 * quad);
          const int at = p * ld_split + n;
          float d_exit[4], hi[4], lo[4];
          load_floats<4>(state + 4 * quad, d_exit);
          const Bf16Row<4> e_hi = load_row<4>(state_hi + at), e_lo = load_row<4>(state_lo + at);
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            local += d_exit[w] * (e_hi.at(w) + e_lo.at(w));
            hi[w] = to_f(__float2bfloat16(d_exit[w]));
            lo[w] = d_exit[w] - hi[w];
          }
          store_row(state_hi + at, round_row<4>(hi));
          store_row(state_lo + at, round_row<4>(lo));
        }
      } else if (split) {
        wait_copies<0>();  // this thread's dS elements (and the staged tokens, issued earlier)
        for_each_own_state_element([&](int p, int n, int) {
          const float d_exit = state[p * ld_state + n];
          const int at = p * ld_split + n;
          local += d_exit * (to_f(state_hi[at]) + to_f(state_lo[at]));
          store_split(d_exit, state_hi, state_lo, at);
        });
      } else {
        for_each_state_element(d, w.gstates + bhc * matrix, [&](int p, int n, float d_exit) {
          local += d_exit * state[p * ld_state + n];
          set_state(p, n, d_exit);
        });
      }
      const float total = block_sum_to_first_thread(local, sum_scratch);
      if (threadIdx.x == 0) {
        sc[kDLog * C + pos.len - 1] += sc[kEntryDecay * C + pos.len - 1] * total;
      }
    }
    __syncthreads();
    // dK = dScᵀ Q + exit_scale · V dS, and K dSᵀ for dV += exit_scale · K dSᵀ and for
    // d_scale = Σ (K dSᵀ) ⊙ PsiV over each token's rows.
    if (split) {
      // As dQ: both products of a tile by one warp, summed in registers.
      smem_mma_pair(M, N,
                    SmemOperands<true, true, false, false>{d_weighted, nullptr, ld_sw, q_rot,
                                                           nullptr, ld_qk, M},
                    SmemOperands<false, true, false, true>{psiv, nullptr, ld_pv, state_hi, state_lo,
                                                           ld_split, P},
                    [&](int i, int n, float d_sc_q, float psiv_ds) {
                      d_qk[i * ld_mn + n] =
                          d_sc_q + sc[kExitScale * C + d.by_rank.div(i)] * psiv_ds;
                    });
      if (fused_dv) {
        // dV's tiles made whole, Swᵀ dO + D dO + exit_scale · K dSᵀ, and never stored: each warp
        // sums over its tile d_scale's row terms (as below), writes dx = dV ⊙ mimo_x (a row is a
        // token at R = 1) to grads.v, and sums mimo_x's terms dV ⊙ v over the tile's rows (lanes
        // g ^ 1 …) into mimo_x_tiles[row tile][p] in o's space (o is dead), summed after the
        // phase. v from shared memory, or global memory with the PsiV cache (the same bits).
        smem_mma_pair_tiles(
            M, P,
            SmemOperands<true, true, false, false>{weighted, nullptr, ld_sw, d_o_bf16, nullptr,
                                                   ld_pv, M},
            SmemOperands<false, false, false, true>{k_rot, nullptr, ld_qk, state_hi, state_lo,
                                                    ld_split, N},
            [&](const float(&sw_d_o)[2][4], const float(&k_ds)[2][4], int i0, int j0, int g,
                int t) {
              float mimo_x_term[2][2];  // [half][column]
#pragma unroll
              for (int upper = 0; upper < 2; ++upper) {
                const int token = i0 + g + 8 * upper;
                const float scale = sc[kExitScale * C + token];
                const bool valid = token < pos.len;
                const size_t th = token_head(d, pos.b, pos.t0 + (valid ? token : 0), h);
                float term = 0.f;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                  const int p = j0 + half * 8 + 2 * t;
                  const float2 d_out = *reinterpret_cast<const float2*>(d_o + token * ld_mp + p);
                  const float k_ds0 = k_ds[half][2 * upper], k_ds1 = k_ds[half][2 * upper + 1];
                  // D dO + Swᵀ dO, then + exit_scale · K dSᵀ: the sums (and roundings) of the
                  // stored dV's.
                  const float base0 = sw_d_o[half][2 * upper] + skip * d_out.x;
                  const float base1 = sw_d_o[half][2 * upper + 1] + skip * d_out.y;
                  const float d_v0 = base0 + scale * k_ds0, d_v1 = base1 + scale * k_ds1;
                  const __nv_bfloat162 psiv_pair =
                      *reinterpret_cast<const __nv_bfloat162*>(psiv + token * ld_pv + p);
                  term += k_ds0 * __low2float(psiv_pair) + k_ds1 * __high2float(psiv_pair);
                  const float2 mimo = *reinterpret_cast<const float2*>(mimo_x + p);
                  __nv_bfloat162 v_pair = __floats2bfloat162_rn(0.f, 0.f);
                  if (valid) {
                    *reinterpret_cast<__nv_bfloat162*>(grads.v + th * P + p) =
                        __floats2bfloat162_rn(d_v0 * mimo.x, d_v1 * mimo.y);
                    v_pair = *reinterpret_cast<const __nv_bfloat162*>(
                        v_early != nullptr ? v_early + token * P + p
                                           : in.v + zv_row(d, in, pos.b, pos.t0 + token, h) + p);
                  }
                  const float m0 = d_v0 * __low2float(v_pair), m1 = d_v1 * __high2float(v_pair);
                  mimo_x_term[half][0] = upper == 0 ? m0 : mimo_x_term[half][0] + m0;
                  mimo_x_term[half][1] = upper == 0 ? m1 : mimo_x_term[half][1] + m1;
                }
                store_row_term(term, token, j0, t);
              }
#pragma unroll
              for (int offset = 4; offset < 32; offset <<= 1) {
#pragma unroll
                for (int half = 0; half < 2; ++half)
#pragma unroll
                  for (int c = 0; c < 2; ++c) {
                    mimo_x_term[half][c] +=
                        __shfl_xor_sync(0xffffffffu, mimo_x_term[half][c], offset);
                  }
              }
              if (g == 0) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                  *reinterpret_cast<float2*>(mimo_x_tiles + (i0 / 16) * P + j0 + half * 8 + 2 * t) =
                      make_float2(mimo_x_term[half][0], mimo_x_term[half][1]);
                }
              }
            });
      } else {
        // K dSᵀ tile by tile, never stored: its warp adds it into dV (in place, or with
        // dx_in_tiles into dx's and mimo_x's terms) and sums each row's (K dSᵀ) ⊙ PsiV over the
        // tile's 16 columns into row_terms[row][tile column], which the d_scale pass sums in a
        // fixed order.
        const auto k_ds_tiles = [&](auto with_dx) {
          constexpr bool kDx = decltype(with_dx)::value;
          smem_mma_tiles(
              M, P,
              SmemOperands<false, false, false, true>{k_rot, nullptr, ld_qk, state_hi, state_lo,
                                                      ld_split, N},
              [&](const float(&acc)[2][4], int i0, int j0, int g, int t) {
                [[maybe_unused]] float mimo_x_sums[2][2] = {};  // [half][column], one rank
#pragma unroll
                for (int upper = 0; upper < 2; ++upper) {
                  const int row = i0 + g + 8 * upper;
                  const int token = d.by_rank.div(row);
                  const float scale = sc[kExitScale * C + token];
                  float term = 0.f;
                  [[maybe_unused]] float dx[2][2];
#pragma unroll
                  for (int half = 0; half < 2; ++half) {
                    const int p = j0 + half * 8 + 2 * t;
                    const float k_ds0 = acc[half][2 * upper], k_ds1 = acc[half][2 * upper + 1];
                    float2* d_v = reinterpret_cast<float2*>(d_psiv + row * ld_mp + p);
                    float2 value = *d_v;
                    value.x += scale * k_ds0;
                    value.y += scale * k_ds1;
                    const __nv_bfloat162 v_pair =
                        *reinterpret_cast<const __nv_bfloat162*>(psiv + row * ld_pv + p);
                    term += k_ds0 * __low2float(v_pair) + k_ds1 * __high2float(v_pair);
                    if constexpr (!kDx) {
                      *d_v = value;
                    } else {
                      // dx's and mimo_x's terms of (token, rank, p) and (…, p + 1); v from shared
                      // memory, or global memory with the PsiV cache (the same bits).
                      const int rank = d.by_rank.mod(row);
                      const bool valid = token < pos.len;
                      const float2 mimo =
                          *reinterpret_cast<const float2*>(mimo_x + rank * ld_mimo + p);
                      dx[half][0] = value.x * mimo.x;
                      dx[half][1] = value.y * mimo.y;
                      if (valid) {
                        const float2 v =
                            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(
                                v_early != nullptr
                                    ? v_early + token * P + p
                                    : in.v + zv_row(d, in, pos.b, pos.t0 + token, h) + p));
                        mimo_x_sums[half][0] += value.x * v.x;
                        mimo_x_sums[half][1] += value.y * v.y;
                      }
                    }
                  }
                  store_row_term(term, row, j0, t);
                  if constexpr (kDx)
                    store_token_fragment(d, pos, h, token, row, j0, t, dx, grads.v);
                }
                if constexpr (kDx) {
                  // Each rank's rows of the tile: lanes g ^ R … (R divides 8).
                  for (int offset = 4 * R; offset < 32; offset <<= 1) {
#pragma unroll
                    for (int half = 0; half < 2; ++half)
#pragma unroll
                      for (int c = 0; c < 2; ++c) {
                        mimo_x_sums[half][c] +=
                            __shfl_xor_sync(0xffffffffu, mimo_x_sums[half][c], offset);
                      }
                  }
                  if (g < R) {  // rank g
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                      *reinterpret_cast<float2*>(mimo_x_tiles + ((i0 / 16) * R + g) * P + j0 +
                                                 half * 8 + 2 * t) =
                          make_float2(mimo_x_sums[half][0], mimo_x_sums[half][1]);
                    }
                  }
                }
              });
        };
        if constexpr (kLeanRegisters<D>) {
          k_ds_tiles(std::false_type{});
        } else if (dx_in_tiles) {
          k_ds_tiles(std::true_type{});
        } else {
          k_ds_tiles(std::false_type{});
        }
      }
      __syncthreads();
      // dSc ⊙ W is read: the next head's entry state may land in its space.
      if (entry_ahead && hg + 1 < head_end) copy_entry_ahead(h + 1);
      // A lane per token; the sum of d_scale · exit_scale over tokens by warp 0 alone, so no
      // barrier before it.
      if (warp == 0) {
        float sum = 0.f;
        const int last = pos.len - 1;
        for (int j = lane; j < C; j += 32) {
          float d_scale = 0.f;
          for (int x = 0; x < R * column_tiles; ++x) d_scale += row_terms[j * R * column_tiles + x];
          const float scale = sc[kExitScale * C + j];
          sc[kDKappa * C + j] += d_scale * exp_flushed(sc[kLog * C + last] - sc[kLog * C + j]);
          sc[kDLog * C + j] -= d_scale * scale;
          sum += d_scale * scale;
        }
        sum = warp_sum(sum);
        __syncwarp();
        if (lane == 0) sc[kDLog * C + last] += sum;
      }
    } else {
      bf16_gemm<kTensor, true, true>(
          M, N, M, weighted, ld_sw, q_rot, ld_qk,
          [&](int i, int n, float value) { d_qk[i * ld_mn + n] = value; });
      __syncthreads();
      state_gemm<kTensor, false, true>(
          M, N, P, [&](int i, int p) { return to_f(psiv[i * ld_pv + p]); },
          [&](int p, int n) { return state[p * ld_state + n]; },
          [&](int i, int n, float value) {
            d_qk[i * ld_mn + n] += sc[kExitScale * C + d.by_rank.div(i)] * value;
          });
      // K dSᵀ into o (o is no longer needed).
      state_gemm<kTensor, false, true>(
          M, P, N, [&](int i, int n) { return to_f(k_rot[i * ld_qk + n]); },
          [&](int n, int p) { return state[p * ld_state + n]; },
          [&](int i, int p, float value) { o[i * ld_mp + p] = value; });
      __syncthreads();
      // One warp per token.
      for (int j = warp; j < C; j += warps) {
        float d_scale = 0.f;
        for (int x = lane * W; x < R * P; x += 32 * W) {
          const int row = j * R + d.by_headdim.div(x), p = d.by_headdim.mod(x);
          float k_ds[W];
          load_floats<W>(o + row * ld_mp + p, k_ds);
          const Bf16Row<W> psiv_row = load_row<W>(psiv + row * ld_pv + p);
#pragma unroll
          for (int w = 0; w < W; ++w) d_scale += k_ds[w] * psiv_row.at(w);
        }
        d_scale = warp_sum(d_scale);
        if (lane == 0) {
          const float scale = sc[kExitScale * C + j];
          const int last = pos.len - 1;
          sc[kDKappa * C + j] += d_scale * exp_flushed(sc[kLog * C + last] - sc[kLog * C + j]);
          sc[kScratch * C + j] = d_scale * scale;
          sc[kDLog * C + j] -= d_scale * scale;
        }
      }
      // dV += exit_scale · K dSᵀ.
      for (int idx = threadIdx.x; idx < M * P / W; idx += blockDim.x) {
        const auto [row, p] = headdim_item<W>(d, idx);
        const int at = row * ld_mp + p;
        const float scale = sc[kExitScale * C + d.by_rank.div(row)];
        float d_v[W], k_ds[W];
        load_floats<W>(d_psiv + at, d_v);
        load_floats<W>(o + at, k_ds);
#pragma unroll
        for (int w = 0; w < W; ++w) d_v[w] += scale * k_ds[w];
        store_floats<W>(d_psiv + at, d_v);
      }
      __syncthreads();
      if (warp == 0) {
        float sum = 0.f;
        for (int j = lane; j < C; j += 32) sum += sc[kScratch * C + j];
        sum = warp_sum(sum);
        if (lane == 0) sc[kDLog * C + pos.len - 1] += sum;
      }
    }
    // v in the scores' space is written next (dx's pass), over d_qk; not with fused_dv or
    // dx_in_tiles (no dx pass).
    const bool v_in_scores = !fused_dv && !dx_in_tiles && v_tokens != nullptr && v_early == nullptr;
    finish_qk_grad(d, pos, hg == head_first, cosv, sinv, k_rot, ld_qk, d_qk, ld_mn, d_theta,
                   kb_partial, dk_sum, w.dk_acc, v_in_scores);

    if (fused_dv || dx_in_tiles) {
      // mimo_x's partial: the row tiles' terms (o's space, from the exit-state phase), in order.
      for (int item = threadIdx.x; item < R * P; item += blockDim.x) {
        float sum = 0.f;
        for (int tile = 0; tile < row_tiles; ++tile) sum += mimo_x_tiles[tile * R * P + item];
        mx_partial[item] = sum;
      }
    } else {
      // v = x ⊙ mimo_x: dx (this head's own output) and mimo_x's partial.
      for (int idx = threadIdx.x; idx < pos.len * P / W; idx += blockDim.x) {
        const auto [i, p] = headdim_item<W>(d, idx);
        const size_t th = token_head(d, pos.b, pos.t0 + i, h);
        float dx[W] = {};
        for (int r = 0; r < R; ++r) {
          float d_psiv_r[W], mimo_x_r[W];
          load_floats<W>(d_psiv + (i * R + r) * ld_mp + p, d_psiv_r);
          load_floats<W>(mimo_x + r * ld_mimo + p, mimo_x_r);
#pragma unroll
          for (int w = 0; w < W; ++w) dx[w] += d_psiv_r[w] * mimo_x_r[w];
        }
        store_row(grads.v + th * P + p, round_row<W>(dx));
        if (v_in_scores) {
          store_row(v_tokens + i * P + p,
                    load_row<W>(in.v + zv_row(d, in, pos.b, pos.t0 + i, h) + p));
        }
      }
      if (v_in_scores) __syncthreads();
      // v from shared memory or global memory, chosen once outside the sums' loops.
      const auto mimo_x_sums = [&](auto&& v_at) {
        token_sums<1>(
            R * P, pos.len,
            [&](int i, int item, float* acc) {
              const int r = d.by_headdim.div(item), p = d.by_headdim.mod(item);
              acc[0] += d_psiv[(i * R + r) * ld_mp + p] * v_at(i, p);
            },
            [&](int item, const float* acc) { mx_partial[item] = acc[0]; });
      };
      if (v_tokens != nullptr) {
        mimo_x_sums([&](int i, int p) { return to_f(v_tokens[i * P + p]); });
      } else {
        mimo_x_sums(
            [&](int i, int p) { return to_f(in.v[zv_row(d, in, pos.b, pos.t0 + i, h) + p]); });
      }
    }
    // Per-token coefficient gradients; dL/dADT_u = Σ_{i ≥ u} dL/dl_i inside the chunk.
    if (warp == 0) {
      warp_scan(
          pos.len, true, false, 0.f, [&](int i) { return sc[kDLog * C + i]; },
          [&](int i, float suffix) {
            const size_t th = token_head(d, pos.b, pos.t0 + i, h);
            const float both = sc[kDGamma * C + i] + sc[kDKappa * C + i];
            w.tok_dadt[th] = suffix;
            w.tok_ddt[th] = both * sc[kTau * C + i];
            w.tok_dtau[th] = both * sc[kDt * C + i];
            w.tok_dkappa[th] = sc[kDKappa * C + i];
          });
    }
    const size_t bh = static_cast<size_t>(pos.b) * d.heads + h;
    float* dtheta_chunk = w.dtheta + (bh * d.seqlen + pos.t0) * A;
    for (int idx = threadIdx.x; idx < pos.len * A; idx += blockDim.x) {
      dtheta_chunk[idx] = d_theta[d.by_angles.div(idx) * ld_a + d.by_angles.mod(idx)];
    }
    token_sums<1>(
        A, pos.len, [&](int i, int j, float* acc) { acc[0] += d_theta[i * ld_a + j]; },
        [&](int j, const float* acc) { w.dtheta_tot[(bh * d.chunks + pos.c) * A + j] = acc[0]; });
    __syncthreads();
  }
  if (dq_sum != nullptr && head_end - head_first < d.heads_per_group) {
    // A split unit's head: its q and k gradients, for finish_tokens to add in head order.
    const int rows_n = d.rows * N;
    float* to =
        w.split_qk +
        (static_cast<size_t>(unit - head_split.whole_units) * d.heads_per_group + head_first) * 2 *
            rows_n;
    for (int idx = threadIdx.x; idx < group_pos.len * R * N; idx += blockDim.x) {
      to[idx] = dq_sum[idx];
      to[rows_n + idx] = dk_sum[idx];
    }
  } else if (dq_sum != nullptr) {
    // Every head is in: the group's q and k gradients of the chunk, rows G·N apart in [B, T, R,
    // G, N].
    const size_t base =
        ((static_cast<size_t>(group_pos.b) * d.seqlen + group_pos.t0) * R * d.groups +
         group_pos.g) *
        N;
    const int row_stride = d.groups * N;
    for (int idx = threadIdx.x; idx < group_pos.len * R * N; idx += blockDim.x) {
      const size_t at = base + d.by_state.div(idx) * row_stride + d.by_state.mod(idx);
      grads.q[at] = __float2bfloat16(dq_sum[idx]);
      grads.k[at] = __float2bfloat16(dk_sum[idx]);
    }
  }
}

// The dθ sum over later chunks: reverse exclusive prefix over chunk totals.
__global__ void dtheta_offsets_kernel(Dims d, Work w) {
  const size_t bh = blockIdx.x;
  float* totals = w.dtheta_tot + bh * d.chunks * d.angles;
  for (int j = threadIdx.x / 32; j < d.angles; j += blockDim.x / 32) {
    warp_scan(
        d.chunks, true, true, 0.f, [&](int c) { return totals[c * d.angles + j]; },
        [&](int c, float later) { totals[c * d.angles + j] = later; });
  }
}

// Per token of one (batch, chunk): dθ's suffix sums (from dtheta_offsets' sums over later
// chunks), then finish_token_terms (the angles', adt's, dt's and trap's gradients), q/k of the
// split units (HeadSplit: their heads' gradients summed in head order) and, when chunk_backward
// summed them in the workspace (qk_in_workspace), q/k to bf16.
__global__ void finish_tokens_kernel(Dims d, DevInputs in, Work w, DevGrads grads,
                                     bool qk_in_workspace, HeadSplit split) {
  const int c = blockIdx.x, b = blockIdx.y, A = d.angles, H = d.heads;
  const int t0 = c * d.chunk, len = min(d.chunk, d.seqlen - t0);
  // The suffix sums walk the chunk's tokens backwards, kTokensAhead of them loaded before the
  // first is added and stored: one load's latency per kTokensAhead tokens. One token at a time,
  // each load waited for the store before it (A is a runtime value, and the compiler could not
  // rule out that the two addresses meet), and that chain was most of this kernel's time at
  // chunk 64. Each thread owns its (h, j) column, so loading ahead is safe; the adds and stores
  // keep their order, so the sums are the same bits.
  constexpr int kTokensAhead = 8;
  for (int item = threadIdx.x; item < H * A; item += blockDim.x) {
    const int h = d.by_angles.div(item), j = d.by_angles.mod(item);
    const size_t bh = static_cast<size_t>(b) * H + h;
    float suffix = w.dtheta_tot[(bh * d.chunks + c) * A + j];
    float* column = w.dtheta + (bh * d.seqlen + t0) * A + j;  // token i at column[i * A]
    for (int last = len - 1; last >= 0; last -= kTokensAhead) {
      float values[kTokensAhead];
#pragma unroll
      for (int u = 0; u < kTokensAhead; ++u) {
        values[u] = last - u >= 0 ? column[(last - u) * A] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kTokensAhead; ++u) {
        if (last - u < 0) break;
        suffix += values[u];
        column[(last - u) * A] = suffix;
      }
    }
  }
  __syncthreads();
  finish_token_terms(d, in, w, grads, b, t0, len);
  // The split units' q and k gradients: each head's added in order to zero, as chunk_backward's
  // shared sums add them (the same bits).
  for (int g = 0; g < d.groups; ++g) {
    const int unit = (b * d.groups + g) * d.chunks + c;
    if (unit < split.whole_units) continue;
    const int N = d.state, rows_n = d.rows * N, row_stride = d.groups * N;
    const float* from =
        w.split_qk + static_cast<size_t>(unit - split.whole_units) * d.heads_per_group * 2 * rows_n;
    const size_t base = ((static_cast<size_t>(b) * d.seqlen + t0) * d.rank * d.groups + g) * N;
    for (int idx = threadIdx.x; idx < len * d.rank * N; idx += blockDim.x) {
      float q = 0.f, k = 0.f;
      for (int head = 0; head < d.heads_per_group; ++head) {
        q += from[head * 2 * rows_n + idx];
        k += from[(head * 2 + 1) * rows_n + idx];
      }
      const size_t at = base + d.by_state.div(idx) * row_stride + d.by_state.mod(idx);
      grads.q[at] = __float2bfloat16(q);
      grads.k[at] = __float2bfloat16(k);
    }
  }
  if (!qk_in_workspace) return;
  const int row_width = d.rank * d.groups * d.state;
  const size_t base = (static_cast<size_t>(b) * d.seqlen + t0) * row_width;
  for (int idx = threadIdx.x; idx < len * row_width; idx += blockDim.x) {
    grads.q[base + idx] = __float2bfloat16(w.dq_acc[base + idx]);
    grads.k[base + idx] = __float2bfloat16(w.dk_acc[base + idx]);
  }
}

// Per-head parameter gradients: the partials of slots_per_batch slots a batch (chunk_backward's a
// chunk each, the sweep's a group of chunks: sweep_partial_slots) summed in a fixed order: each of
// kReduceRows rows of threads adds every kReduceRows-th slot, kAhead loads in flight, then the
// rows' sums in row order. (Eight rows a load at a time ran at 16% of warps active in 19.5 µs at
// M3-ref SISO; this runs at 62% in 18.4 µs, ncu: the loads were not what bounds it. A slot's
// partials lie partial_width floats apart, so a column block reads 128 bytes of each 1.3 KB row.)
constexpr int kReduceRows = 32;
__global__ void __launch_bounds__(32 * kReduceRows)
    reduce_params_kernel(Dims d, Work w, DevGrads grads, int slots_per_batch) {
  __shared__ float sums[kReduceRows][33];
  const int h = blockIdx.y, e = blockIdx.x * 32 + threadIdx.x;
  const size_t slots = static_cast<size_t>(d.batch) * slots_per_batch;
  float sum = 0.f;
  if (e < d.partial_width) {
    const float* base = w.partials + static_cast<size_t>(h) * slots * d.partial_width + e;
    constexpr int kAhead = 8;
    for (size_t first = threadIdx.y; first < slots; first += kAhead * kReduceRows) {
      float values[kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        const size_t s = first + u * kReduceRows;
        values[u] = s < slots ? base[s * d.partial_width] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) sum += values[u];  // + 0 past the last slot: the same sum
    }
  }
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || e >= d.partial_width) return;
  float total = 0.f;
  for (int y = 0; y < kReduceRows; ++y) total += sums[y][threadIdx.x];
  const int RN = d.rank * d.state, RP = d.rank * d.headdim;
  if (e < RN) {
    grads.q_bias[static_cast<size_t>(h) * RN + e] = total;
  } else if (e < 2 * RN) {
    grads.k_bias[static_cast<size_t>(h) * RN + e - RN] = total;
  } else if (e < 2 * RN + RP) {
    grads.mimo_x[static_cast<size_t>(h) * RP + e - 2 * RN] = total;
  } else if (e < 2 * RN + 2 * RP) {
    grads.mimo_z[static_cast<size_t>(h) * RP + e - 2 * RN - RP] = total;
  } else if (e < 2 * RN + 3 * RP) {
    grads.mimo_o[static_cast<size_t>(h) * RP + e - 2 * RN - 2 * RP] = total;
  } else {
    grads.d[h] = total;
  }
}

void run_reduce_params(const BackwardLaunches& launches, const Dims& d, const Work& w,
                       const DevGrads& grads, cudaStream_t stream) {
  const Launch& l = launches.reduce_params;
  const int slots_per_batch = launches.sweep ? sweep_partial_slots(d) : d.chunks;
  reduce_params_kernel<<<l.grid, l.block, 0, stream>>>(d, w, grads, slots_per_batch);
  MEGACPP_CUDA_CHECK_LAUNCH(l.name);
}

// The chunk_backward path's tail: dθ's suffix sums over chunks, the per-token gradients, the
// per-head parameters' reductions. qk_in_workspace: q's and k's sums are in Work::dq_acc and
// dk_acc.
void run_backward_tail(const BackwardLaunches& launches, const Dims& d, const DevInputs& in,
                       const Work& w, const DevGrads& grads, bool qk_in_workspace,
                       cudaStream_t stream) {
  if (d.angles > 0) {
    const Launch& l = launches.dtheta_offsets;
    dtheta_offsets_kernel<<<l.grid, l.block, 0, stream>>>(d, w);
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
  }
  {
    const Launch& l = launches.finish_tokens;
    finish_tokens_kernel<<<l.grid, l.block, 0, stream>>>(d, in, w, grads, qk_in_workspace,
                                                         launches.split);
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
  }
  run_reduce_params(launches, d, w, grads, stream);
}

}  // namespace

BackwardLaunches backward_launches(const Dims& d, bool tensor_cores, size_t shared_limit,
                                   ScanChains chains, int split_units, bool sweep) {
  if (sweep && !sweep_applies(d, tensor_cores, shared_limit)) {
    detail::refuse(ErrorKind::kInternal,
                   "backward_launches: the sweep planned where it does not apply (state {}, "
                   "headdim {}, rank {}, chunk {}, angles {}, tensor cores {}, {} bytes of shared "
                   "memory a block)",
                   d.state, d.headdim, d.rank, d.chunk, d.angles, tensor_cores, shared_limit);
  }
  if (sweep && split_units != 0) {
    detail::refuse(ErrorKind::kInternal,
                   "backward_launches: {} split units planned with the sweep, which has no units",
                   split_units);
  }
  const unsigned bh = static_cast<unsigned>(d.batch * d.heads);
  const unsigned bg = static_cast<unsigned>(d.batch * d.groups);
  const unsigned chunks = static_cast<unsigned>(d.chunks);
  // state_pass_backward: a thread per four elements of a state.
  const unsigned matrix_blocks =
      static_cast<unsigned>((d.headdim * d.state / 4 + kThreads - 1) / kThreads);
  const unsigned partial_blocks = static_cast<unsigned>((d.partial_width + 31) / 32);
  const dim3 threads(kThreads);
  BackwardLaunches l;
  const int units = static_cast<int>(chunks * bg);
  l.split = {units - split_units, split_units};
  const unsigned backward_blocks =
      static_cast<unsigned>(l.split.whole_units + split_units * d.heads_per_group);
  with_fixed_dims(d, [&](auto dims) {
    using D = decltype(dims);
    SmemPlan dstate = plan_for(d, kDStateKernel);
    bool fused = false;
    if constexpr (D::kFixed) {
      fused = backward_chains_run(d, chains);
      if (fused) {
        // H_c stays in shared memory for the reverse pass: on the tensor cores in the fp32 d_o's
        // space, which they do not use (a block then fits in 48,000 B at MIMO: four an SM, not
        // three).
        l.reverse_pass_fused = true;
        const size_t exit_bytes =
            static_cast<size_t>(d.headdim) * exit_part_stride(d.state) * sizeof(float);
        const size_t d_out_bytes =
            static_cast<size_t>(d.rows) * static_cast<size_t>(dstate.ld_mp) * sizeof(float);
        if (tensor_cores && exit_bytes <= d_out_bytes) {
          dstate.exit_part = dstate.d_out;
        } else {
          dstate.exit_part = dstate.total;
          dstate.total += exit_bytes;
        }
        l.chunk_dstate = {"chunk_dstate",
                          tensor_cores ? kernel_address(&chunk_dstate_kernel<true, true, D>)
                                       : kernel_address(&chunk_dstate_kernel<false, true, D>),
                          dim3(chunks * bh), threads, dstate};
      }
    }
    if (!fused) {
      l.chunk_dstate = {"chunk_dstate",
                        tensor_cores ? kernel_address(&chunk_dstate_kernel<true, false, D>)
                                     : kernel_address(&chunk_dstate_kernel<false, false, D>),
                        dim3(chunks, bh), threads, dstate};
    }
    l.chunk_backward = {"chunk_backward",
                        tensor_cores ? kernel_address(&chunk_backward_kernel<true, D>)
                                     : kernel_address(&chunk_backward_kernel<false, D>),
                        dim3(backward_blocks), dim3(kBackwardThreads),
                        plan_backward(d, tensor_cores, shared_limit)};
  });
  // A split unit's heads leave their q and k gradients for finish_tokens, which only works where
  // the block would have summed them in shared memory (in the workspace, a unit's heads add into
  // one sum in order, block after block) and with two or more heads a group (the kernel tells a
  // split block by its head count).
  if (split_units > 0 &&
      (l.chunk_backward.smem.dq_acc == 0 || d.heads_per_group < 2 || split_units > units)) {
    detail::refuse(ErrorKind::kInternal,
                   "backward_launches: {} of {} units split at {} heads a group, the group sums {}",
                   split_units, units, d.heads_per_group,
                   l.chunk_backward.smem.dq_acc == 0 ? "in the workspace" : "in shared memory");
  }
  l.state_pass_backward = {"state_pass_backward",
                           kernel_address(&state_pass_backward_kernel),
                           dim3(matrix_blocks, bh),
                           threads,
                           {}};
  l.dtheta_offsets = {
      "dtheta_offsets", kernel_address(&dtheta_offsets_kernel), dim3(bh), threads, {}};
  l.finish_tokens = {"finish_tokens",
                     kernel_address(&finish_tokens_kernel),
                     dim3(chunks, static_cast<unsigned>(d.batch)),
                     threads,
                     {}};
  l.reduce_params = {"reduce_params",
                     kernel_address(&reduce_params_kernel),
                     dim3(partial_blocks, static_cast<unsigned>(d.heads)),
                     dim3(32, kReduceRows),
                     {}};
  if (sweep) {
    l.sweep = true;
    l.sweep_kernels = sweep_launches(d);
  }
  return l;
}

void run_backward(const BackwardLaunches& launches, bool tensor_cores, bool psiv_cache,
                  const Dims& d, const DevInputs& in, const Work& w, const bf16* dy,
                  const DevGrads& grads, cudaStream_t stream) {
  if (launches.sweep) {
    // The sweep leaves dθ's suffix sums and the per-token terms finished (sweep_finish does
    // finish_tokens' part): only the per-head parameters remain.
    run_sweep(launches.sweep_kernels, d, in, w, dy, grads, stream);
    run_reduce_params(launches, d, w, grads, stream);
    return;
  }
  {
    const Launch& l = launches.chunk_dstate;
    if (launches.reverse_pass_fused) {
      reset_chain(d, w, stream);
    }
    with_fixed_dims(d, [&](auto dims) {
      const auto launch = [&](auto use_tensor_cores, auto fused) {
        chunk_dstate_kernel<decltype(use_tensor_cores)::value, decltype(fused)::value>
            <<<l.grid, l.block, l.smem.total, stream>>>(dims, l.smem, in, w, dy);
      };
      // The fused reverse pass exists only at the fixed shapes (backward_chains_run).
      const auto launch_fused_or_not = [&](auto use_tensor_cores) {
        if constexpr (decltype(dims)::kFixed) {
          if (launches.reverse_pass_fused) return launch(use_tensor_cores, std::true_type{});
        }
        launch(use_tensor_cores, std::false_type{});
      };
      if (tensor_cores) {
        launch_fused_or_not(std::true_type{});
      } else {
        launch_fused_or_not(std::false_type{});
      }
    });
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
  }
  if (!launches.reverse_pass_fused) {
    const Launch& l = launches.state_pass_backward;
    state_pass_backward_kernel<<<l.grid, l.block, 0, stream>>>(d, w);
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
  }
  {
    const Launch& l = launches.chunk_backward;
    with_fixed_dims(d, [&](auto dims) {
      if (tensor_cores) {
        chunk_backward_kernel<true><<<l.grid, l.block, l.smem.total, stream>>>(
            dims, l.smem, in, w, psiv_cache, dy, grads, launches.split);
      } else {
        chunk_backward_kernel<false><<<l.grid, l.block, l.smem.total, stream>>>(
            dims, l.smem, in, w, psiv_cache, dy, grads, launches.split);
      }
    });
    MEGACPP_CUDA_CHECK_LAUNCH(l.name);
  }
  run_backward_tail(launches, d, in, w, grads, launches.chunk_backward.smem.dq_acc == 0, stream);
}

}  // namespace megacpp::cuda::scan_detail
