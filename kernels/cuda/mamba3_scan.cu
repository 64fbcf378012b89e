// CUDA Mamba-3 scan: see mamba3_scan.h for the structure. The math per chunk follows
// kernels/cpu/mamba3_scan_chunked.h (its header states the chunked form); names below
// match it: l = cumulative ADT since the chunk start, κ_j = γ_j + (1 − τ_{j+1}) DT_{j+1},
// W_ij = e^{l_i − l_j} κ_j (j < i), γ_i (j = i), exit scale e^{l_last − l_j} κ_j.
//
// Every exponential is e^{Λ_a − Λ_b} for two tokens a ≥ b of one chunk (or the token
// before it), so the gradient of ADT only needs chunk-local suffix sums of dL/dl.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>

#include "kernels/cuda/mamba3_scan.h"
#include "kernels/cuda/host_errors.h"
#include "runtime/common/error.h"

namespace megacpp::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;
constexpr float kPi = 3.14159265358979323846f;

// Shape constants every kernel needs, passed by value.
struct Dims {
  int batch, seqlen, heads, groups, state, headdim, rank, chunk, angles;
  int chunks;           // ceil(seqlen / chunk)
  int rows;             // chunk * rank: rows (token, rank) of a chunk
  int heads_per_group;  // heads / groups
  int partial_width;    // per-head parameter gradient floats of one (batch, chunk)
};

// Byte offsets into a kernel's dynamic shared memory; 0-size fields are unused.
struct SmemPlan {
  size_t scalars = 0, cos = 0, sin = 0, q = 0, k = 0, v = 0, e = 0, s = 0, sw = 0, dsc = 0;
  size_t wtok = 0, dwt = 0, o = 0, d_o = 0, dv = 0, dqk = 0, red = 0, dth = 0;
  size_t total = 0;
};

enum ScanKernel { kStateKernel, kOutputKernel, kDStateKernel, kBackwardKernel };

// Per-token scalar arrays of a chunk, each `chunk` floats, in the scalars block.
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

SmemPlan plan_for(const Dims& d, ScanKernel kernel) {
  SmemPlan p;
  size_t cursor = 0;
  const auto take = [&cursor](size_t bytes) {
    const size_t at = cursor;
    cursor += (bytes + 15) / 16 * 16;
    return at;
  };
  const size_t m = static_cast<size_t>(d.rows), n = static_cast<size_t>(d.state);
  const size_t hp = static_cast<size_t>(d.headdim), c = static_cast<size_t>(d.chunk);
  const size_t a = static_cast<size_t>(d.angles);
  p.scalars = take(kScalarCount * c * sizeof(float));
  p.cos = take(c * a * sizeof(float));
  p.sin = take(c * a * sizeof(float));
  const bool backward = kernel == kBackwardKernel;
  if (kernel != kStateKernel) p.q = take(m * n * sizeof(bf16));
  if (kernel != kDStateKernel) p.k = take(m * n * sizeof(bf16));
  if (kernel != kDStateKernel) p.v = take(m * hp * sizeof(bf16));
  if (kernel == kOutputKernel || backward) {
    p.e = take(hp * n * sizeof(float));
    p.s = take(m * m * sizeof(float));
    p.wtok = take(c * c * sizeof(float));
    p.o = take(m * hp * sizeof(float));
  }
  if (kernel == kDStateKernel || backward) p.d_o = take(m * hp * sizeof(float));
  if (backward) {
    p.dsc = take(m * m * sizeof(float));
    // dwt lives in o's space (o is dead between the epilogue and K dSᵀ) when it fits.
    p.dwt = c * c <= m * hp ? p.o : take(c * c * sizeof(float));
    p.dv = take(m * hp * sizeof(float));
    p.dqk = take(m * n * sizeof(float));
    // red lives in dqk's space: the two block sums run while dqk holds nothing.
    p.red = m * n >= kThreads ? p.dqk : take(kThreads * sizeof(float));
    p.dth = take(c * a * sizeof(float));
  }
  p.total = cursor;
  return p;
}

// ---------------------------------------------------------------------------------
// Device helpers.

__device__ __forceinline__ float to_f(bf16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float sigmoidf(float x) {
  return 1.f / (1.f + expf(-x));
}

// C = A·B over a block: every thread owns 4×4 output tiles and sums over k in a fixed
// order (deterministic). a(i, k), b(k, j) read operands; out(i, j, value) stores.
// M and N are multiples of 4.
template <class FA, class FB, class FOut>
__device__ void block_gemm(int m, int n, int k, FA a, FB b, FOut out) {
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

// The same contract as block_gemm on the tensor cores: operands are rounded to bf16,
// products accumulate in fp32 (mma.sync m16n8k16). Every warp owns 16×16 output tiles
// and walks k in a fixed order (deterministic). M, N and K are multiples of 16.
// A template so that the passes that compile no mma (host, sm < 80) do not see an unused
// function.
template <typename F = float>
__device__ __forceinline__ uint32_t pack_bf16(F lo, F hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

template <class FA, class FB, class FOut>
__device__ void block_mma(int m, int n, int k, FA a, FB b, FOut out) {
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

template <bool kTensor, class FA, class FB, class FOut>
__device__ __forceinline__ void gemm(int m, int n, int k, FA a, FB b, FOut out) {
  if constexpr (kTensor) {
    block_mma(m, n, k, a, b, out);
  } else {
    block_gemm(m, n, k, a, b, out);
  }
}

struct DevInputs {
  const bf16 *q, *k, *v, *z, *adt, *dt, *trap, *angles, *q_bias, *k_bias, *mimo_x, *mimo_z, *mimo_o,
      *d;
};

struct DevGrads {
  bf16 *q, *k, *v, *z, *adt, *dt, *trap, *angles;
  float *q_bias, *k_bias, *mimo_x, *mimo_z, *mimo_o, *d;
};

// Workspace (all fp32 unless noted), indices in the comments.
struct Work {
  float* theta0;      // [B, H, chunks, A] θ just before each chunk
  float* states;      // [B, H, chunks, P, N] chunk-local exit part, then entry states
  float* decay;       // [B, H, chunks] e^{l_last}
  float* gstates;     // [B, H, chunks, P, N] dL/d(entry), then dL/d(exit state)
  float* dq_acc;      // [B, L, R, G, N] summed over the group's heads
  float* dk_acc;      // [B, L, R, G, N]
  float* dtheta;      // [B, H, L, A] dL/dθ_t, then its suffix sum over t
  float* dtheta_tot;  // [B, H, chunks, A] per chunk, then the sum over later chunks
  float* tok_dadt;    // [B, L, H]
  float* tok_ddt;     // [B, L, H] d_dt without the κ_{t−1} and angle terms
  float* tok_dtau;    // [B, L, H] d_τ without the κ_{t−1} term
  float* tok_dkappa;  // [B, L, H]
  float* partials;    // [H, B * chunks, partial_width]
  bf16* psiv;         // [B, L, H, R, P] or null
};

struct ChunkPos {
  int b, h, g, c, t0, len;
};

__device__ ChunkPos chunk_pos(const Dims& d, int bh_or_bg, bool by_group, int c) {
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

__device__ __forceinline__ size_t token_head(const Dims& d, int b, int t, int h) {
  return (static_cast<size_t>(b) * d.seqlen + t) * d.heads + h;
}

// Per-token scalars and rotation cos/sin of head pos.h for the chunk. Padded tokens
// (i ≥ len) get zero coefficients, so they contribute nothing anywhere.
__device__ void load_scalars(const Dims& d, const DevInputs& in, const Work& w, const ChunkPos& pos,
                             float* sc, float* cosv, float* sinv) {
  const int C = d.chunk;
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    float adt = 0.f, dt = 0.f, tau = 0.f, kappa = 0.f;
    if (i < pos.len) {
      const size_t th = token_head(d, pos.b, pos.t0 + i, pos.h);
      adt = to_f(in.adt[th]);
      dt = to_f(in.dt[th]);
      tau = sigmoidf(to_f(in.trap[th]));
      kappa = tau * dt;
      if (pos.t0 + i + 1 < d.seqlen) {
        const size_t next = th + d.heads;
        kappa += (1.f - sigmoidf(to_f(in.trap[next]))) * to_f(in.dt[next]);
      }
    }
    sc[kAdt * C + i] = adt;
    sc[kDt * C + i] = dt;
    sc[kTau * C + i] = tau;
    sc[kGamma * C + i] = tau * dt;
    sc[kKappa * C + i] = kappa;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float running = 0.f;
    for (int i = 0; i < C; ++i) {
      running += sc[kAdt * C + i];
      sc[kLog * C + i] = running;
    }
    const float last = sc[kLog * C + (pos.len - 1)];
    for (int i = 0; i < C; ++i) {
      sc[kEntryDecay * C + i] = expf(sc[kLog * C + i]);
      sc[kExitScale * C + i] = expf(last - sc[kLog * C + i]) * sc[kKappa * C + i];
    }
  }
  const int A = d.angles;
  for (int j = threadIdx.x; j < A; j += blockDim.x) {
    const size_t bh = static_cast<size_t>(pos.b) * d.heads + pos.h;
    float theta = w.theta0[(bh * d.chunks + pos.c) * A + j];
    for (int i = 0; i < C; ++i) {
      float cs = 1.f, sn = 0.f;
      if (i < pos.len) {
        const int t = pos.t0 + i;
        const float slope =
            tanhf(to_f(in.angles[(static_cast<size_t>(pos.b) * d.seqlen + t) * A + j]));
        theta += slope * to_f(in.dt[token_head(d, pos.b, t, pos.h)]) * kPi;
        sincosf(theta, &sn, &cs);
      }
      cosv[i * A + j] = cs;
      sinv[i * A + j] = sn;
    }
  }
  __syncthreads();
}

// q or k of head pos.h for the chunk: + bias, rotated, rounded to bf16. Rows (i, r).
__device__ void load_rotated(const Dims& d, const bf16* src, const bf16* bias, const ChunkPos& pos,
                             const float* cosv, const float* sinv, bf16* dst) {
  const int N = d.state, half = N / 2, R = d.rank, A = d.angles;
  const int items = d.rows * half;
  for (int idx = threadIdx.x; idx < items; idx += blockDim.x) {
    const int row = idx / half, n = idx % half;
    const int i = row / R, r = row % R;
    float first = 0.f, second = 0.f;
    if (i < pos.len) {
      const int t = pos.t0 + i;
      const size_t base = ((static_cast<size_t>(pos.b) * d.seqlen + t) * R + r) * d.groups + pos.g;
      const bf16* in_row = src + base * N;
      const bf16* bias_row = bias + (static_cast<size_t>(pos.h) * R + r) * N;
      const float a = to_f(in_row[n]) + to_f(bias_row[n]);
      const float b = to_f(in_row[n + half]) + to_f(bias_row[n + half]);
      if (n < A) {
        const float cs = cosv[i * A + n], sn = sinv[i * A + n];
        first = a * cs - b * sn;
        second = a * sn + b * cs;
      } else {
        first = a;
        second = b;
      }
    }
    dst[row * N + n] = __float2bfloat16(first);
    dst[row * N + n + half] = __float2bfloat16(second);
  }
}

// v = x ⊙ mimo_x (PsiV) of head pos.h, rows (i, r), bf16: from the cache when
// read_cache, else computed (and stored to the cache when write_cache). Both ways give
// the same bits, so the cache never changes results.
__device__ void load_psiv(const Dims& d, const DevInputs& in, const ChunkPos& pos, bf16* cache,
                          bool read_cache, bool write_cache, bf16* dst) {
  const int P = d.headdim, R = d.rank;
  const int items = d.rows * P;
  for (int idx = threadIdx.x; idx < items; idx += blockDim.x) {
    const int row = idx / P, p = idx % P;
    const int i = row / R, r = row % R;
    bf16 value = __float2bfloat16(0.f);
    if (i < pos.len) {
      const size_t th = token_head(d, pos.b, pos.t0 + i, pos.h);
      const size_t cached = (th * R + r) * P + p;
      if (read_cache) {
        value = cache[cached];
      } else {
        value = __float2bfloat16(to_f(in.v[th * P + p]) *
                                 to_f(in.mimo_x[(static_cast<size_t>(pos.h) * R + r) * P + p]));
        if (write_cache) cache[cached] = value;
      }
    }
    dst[row * P + p] = value;
  }
}

// d_o = dy ⊙ silu(z ⊙ mimo_z) ⊙ mimo_o, rows (i, r), fp32.
__device__ void load_d_o(const Dims& d, const DevInputs& in, const bf16* dy, const ChunkPos& pos,
                         float* dst) {
  const int P = d.headdim, R = d.rank;
  const int items = d.rows * P;
  for (int idx = threadIdx.x; idx < items; idx += blockDim.x) {
    const int row = idx / P, p = idx % P;
    const int i = row / R, r = row % R;
    float value = 0.f;
    if (i < pos.len) {
      const size_t th = token_head(d, pos.b, pos.t0 + i, pos.h);
      const size_t wr = (static_cast<size_t>(pos.h) * R + r) * P + p;
      const float gate = to_f(in.z[th * P + p]) * to_f(in.mimo_z[wr]);
      value = to_f(dy[th * P + p]) * gate * sigmoidf(gate) * to_f(in.mimo_o[wr]);
    }
    dst[idx] = value;
  }
}

// Token-level weights W[i][j] of the chunk (zero above the diagonal).
__device__ void fill_weights(const Dims& d, const float* sc, float* wtok) {
  const int C = d.chunk;
  for (int idx = threadIdx.x; idx < C * C; idx += blockDim.x) {
    const int i = idx / C, j = idx % C;
    float weight = 0.f;
    if (j < i) {
      weight = expf(sc[kLog * C + i] - sc[kLog * C + j]) * sc[kKappa * C + j];
    } else if (j == i) {
      weight = sc[kGamma * C + i];
    }
    wtok[idx] = weight;
  }
}

__device__ void load_state(const float* src, int count, float* dst) {
  for (int idx = threadIdx.x; idx < count; idx += blockDim.x) dst[idx] = src[idx];
}

// ---------------------------------------------------------------------------------
// Forward kernels.

// θ before each chunk: per-chunk sums of tanh(angle)·DT·π, then an exclusive prefix.
__global__ void angle_prefix_kernel(Dims d, DevInputs in, Work w) {
  const int bh = blockIdx.x, b = bh / d.heads, h = bh % d.heads, A = d.angles;
  float* theta0 = w.theta0 + static_cast<size_t>(bh) * d.chunks * A;
  for (int item = threadIdx.x; item < d.chunks * A; item += blockDim.x) {
    const int c = item / A, j = item % A;
    const int t0 = c * d.chunk, t1 = min(d.seqlen, t0 + d.chunk);
    float sum = 0.f;
    for (int t = t0; t < t1; ++t) {
      sum += tanhf(to_f(in.angles[(static_cast<size_t>(b) * d.seqlen + t) * A + j])) *
             to_f(in.dt[token_head(d, b, t, h)]) * kPi;
    }
    theta0[item] = sum;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < A; j += blockDim.x) {
    float running = 0.f;
    for (int c = 0; c < d.chunks; ++c) {
      const float chunk_sum = theta0[c * A + j];
      theta0[c * A + j] = running;
      running += chunk_sum;
    }
  }
}

// Chunk-local exit state F_c = Σ_j e^{l_last − l_j} κ_j Σ_r v_{j,r} k_{j,r}ᵀ and the
// chunk's decay e^{l_last}. Writes PsiV to the cache when asked.
template <bool kTensor>
__global__ void chunk_state_kernel(Dims d, SmemPlan plan, DevInputs in, Work w, bool write_psiv) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkPos pos = chunk_pos(d, blockIdx.y, false, blockIdx.x);
  float* sc = reinterpret_cast<float*>(smem + plan.scalars);
  float* cosv = reinterpret_cast<float*>(smem + plan.cos);
  float* sinv = reinterpret_cast<float*>(smem + plan.sin);
  bf16* ks = reinterpret_cast<bf16*>(smem + plan.k);
  bf16* vs = reinterpret_cast<bf16*>(smem + plan.v);
  load_scalars(d, in, w, pos, sc, cosv, sinv);
  load_rotated(d, in.k, in.k_bias, pos, cosv, sinv, ks);
  load_psiv(d, in, pos, w.psiv, false, write_psiv, vs);
  __syncthreads();
  const int N = d.state, P = d.headdim, R = d.rank, C = d.chunk;
  const size_t bhc = (static_cast<size_t>(pos.b) * d.heads + pos.h) * d.chunks + pos.c;
  float* out = w.states + bhc * P * N;
  // The state products stay in fp32 in both variants: the angle gradient is a long suffix
  // sum of terms that cancel exactly only when the state is formed and used without
  // rounding (see the note at chunk_backward_kernel).
  (void)sizeof(kTensor);
  block_gemm(
      P, N, d.rows,
      [&](int p, int row) { return to_f(vs[row * P + p]) * sc[kExitScale * C + row / R]; },
      [&](int row, int n) { return to_f(ks[row * N + n]); },
      [&](int p, int n, float value) { out[p * N + n] = value; });
  if (threadIdx.x == 0) w.decay[bhc] = sc[kEntryDecay * C + (pos.len - 1)];
}

// Entry states: E_0 = 0, E_{c+1} = a_c E_c + F_c, in place over the F_c buffer.
__global__ void state_pass_kernel(Dims d, Work w) {
  const size_t matrix = static_cast<size_t>(d.headdim) * d.state;
  const size_t element = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (element >= matrix) return;
  const size_t bh = blockIdx.y;
  float* states = w.states + bh * d.chunks * matrix + element;
  const float* decay = w.decay + bh * d.chunks;
  // Loads are issued kBatch chunks at a time: one dependent load per chunk would leave
  // the pass latency-bound (measured 10.7 ms at M3-ref, about 200 GB/s).
  constexpr int kBatch = 8;
  float entry = 0.f;
  for (int c0 = 0; c0 < d.chunks; c0 += kBatch) {
    float local[kBatch], scale[kBatch];
#pragma unroll
    for (int x = 0; x < kBatch; ++x) {
      const int c = min(c0 + x, d.chunks - 1);
      local[x] = states[c * matrix];
      scale[x] = decay[c];
    }
#pragma unroll
    for (int x = 0; x < kBatch; ++x) {
      if (c0 + x < d.chunks) {
        states[(c0 + x) * matrix] = entry;
        entry = scale[x] * entry + local[x];
      }
    }
  }
}

// o = e^{l} Q Eᵀ + (QKᵀ ⊙ W) V + D v, y = Σ_r o_r ⊙ silu(z ⊙ mimo_z_r) ⊙ mimo_o_r.
template <bool kTensor>
__global__ void chunk_output_kernel(Dims d, SmemPlan plan, DevInputs in, Work w, bool read_psiv,
                                    bf16* y) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkPos pos = chunk_pos(d, blockIdx.y, false, blockIdx.x);
  float* sc = reinterpret_cast<float*>(smem + plan.scalars);
  float* cosv = reinterpret_cast<float*>(smem + plan.cos);
  float* sinv = reinterpret_cast<float*>(smem + plan.sin);
  bf16* qs = reinterpret_cast<bf16*>(smem + plan.q);
  bf16* ks = reinterpret_cast<bf16*>(smem + plan.k);
  bf16* vs = reinterpret_cast<bf16*>(smem + plan.v);
  float* es = reinterpret_cast<float*>(smem + plan.e);
  float* ss = reinterpret_cast<float*>(smem + plan.s);
  float* wtok = reinterpret_cast<float*>(smem + plan.wtok);
  float* os = reinterpret_cast<float*>(smem + plan.o);
  const int N = d.state, P = d.headdim, R = d.rank, C = d.chunk, M = d.rows;
  const size_t bhc = (static_cast<size_t>(pos.b) * d.heads + pos.h) * d.chunks + pos.c;
  load_scalars(d, in, w, pos, sc, cosv, sinv);
  load_rotated(d, in.q, in.q_bias, pos, cosv, sinv, qs);
  load_rotated(d, in.k, in.k_bias, pos, cosv, sinv, ks);
  load_psiv(d, in, pos, w.psiv, read_psiv, false, vs);
  load_state(w.states + bhc * P * N, P * N, es);
  fill_weights(d, sc, wtok);
  __syncthreads();
  gemm<kTensor>(
      M, M, N, [&](int i, int n) { return to_f(qs[i * N + n]); },
      [&](int n, int j) { return to_f(ks[j * N + n]); },
      [&](int i, int j, float value) { ss[i * M + j] = value * wtok[(i / R) * C + j / R]; });
  block_gemm(
      M, P, N, [&](int i, int n) { return to_f(qs[i * N + n]); },
      [&](int n, int p) { return es[p * N + n]; },
      [&](int i, int p, float value) { os[i * P + p] = value * sc[kEntryDecay * C + i / R]; });
  __syncthreads();
  const float skip = to_f(in.d[pos.h]);
  gemm<kTensor>(
      M, P, M, [&](int i, int j) { return ss[i * M + j]; },
      [&](int j, int p) { return to_f(vs[j * P + p]); },
      [&](int i, int p, float value) { os[i * P + p] += value + skip * to_f(vs[i * P + p]); });
  __syncthreads();
  for (int idx = threadIdx.x; idx < pos.len * P; idx += blockDim.x) {
    const int i = idx / P, p = idx % P;
    const size_t th = token_head(d, pos.b, pos.t0 + i, pos.h);
    const float z = to_f(in.z[th * P + p]);
    float sum = 0.f;
    for (int r = 0; r < R; ++r) {
      const size_t wr = (static_cast<size_t>(pos.h) * R + r) * P + p;
      const float gate = z * to_f(in.mimo_z[wr]);
      sum += os[(i * R + r) * P + p] * gate * sigmoidf(gate) * to_f(in.mimo_o[wr]);
    }
    y[th * P + p] = __float2bfloat16(sum);
  }
}

// ---------------------------------------------------------------------------------
// Backward kernels.

// dL/dE_c through chunk c's own outputs: Σ_{i,r} e^{l_i} d_o_{i,r} q_{i,r}ᵀ.
template <bool kTensor>
__global__ void chunk_dstate_kernel(Dims d, SmemPlan plan, DevInputs in, Work w, const bf16* dy) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ChunkPos pos = chunk_pos(d, blockIdx.y, false, blockIdx.x);
  float* sc = reinterpret_cast<float*>(smem + plan.scalars);
  float* cosv = reinterpret_cast<float*>(smem + plan.cos);
  float* sinv = reinterpret_cast<float*>(smem + plan.sin);
  bf16* qs = reinterpret_cast<bf16*>(smem + plan.q);
  float* dos = reinterpret_cast<float*>(smem + plan.d_o);
  load_scalars(d, in, w, pos, sc, cosv, sinv);
  load_rotated(d, in.q, in.q_bias, pos, cosv, sinv, qs);
  load_d_o(d, in, dy, pos, dos);
  __syncthreads();
  const int N = d.state, P = d.headdim, R = d.rank, C = d.chunk;
  const size_t bhc = (static_cast<size_t>(pos.b) * d.heads + pos.h) * d.chunks + pos.c;
  float* out = w.gstates + bhc * P * N;
  (void)sizeof(kTensor);
  block_gemm(
      P, N, d.rows,
      [&](int p, int row) { return dos[row * P + p] * sc[kEntryDecay * C + row / R]; },
      [&](int row, int n) { return to_f(qs[row * N + n]); },
      [&](int p, int n, float value) { out[p * N + n] = value; });
}

// G_c = H_c + a_c G_{c+1}, walked from the last chunk; stores G_{c+1} (the gradient of
// chunk c's exit state) in place of H_c.
__global__ void state_pass_backward_kernel(Dims d, Work w) {
  const size_t matrix = static_cast<size_t>(d.headdim) * d.state;
  const size_t element = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (element >= matrix) return;
  const size_t bh = blockIdx.y;
  float* g = w.gstates + bh * d.chunks * matrix + element;
  const float* decay = w.decay + bh * d.chunks;
  constexpr int kBatch = 8;  // as in state_pass_kernel
  float later = 0.f;
  for (int c0 = d.chunks - 1; c0 >= 0; c0 -= kBatch) {
    float local[kBatch], scale[kBatch];
#pragma unroll
    for (int x = 0; x < kBatch; ++x) {
      const int c = max(c0 - x, 0);
      local[x] = g[c * matrix];
      scale[x] = decay[c];
    }
#pragma unroll
    for (int x = 0; x < kBatch; ++x) {
      if (c0 - x >= 0) {
        g[(c0 - x) * matrix] = later;
        later = scale[x] * later + local[x];
      }
    }
  }
}

// Block-wide sum of one float per thread, in a fixed order.
__device__ float block_sum(float value, float* red) {
  red[threadIdx.x] = value;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0) {
    for (int i = 0; i < static_cast<int>(blockDim.x); ++i) total += red[i];
    red[0] = total;
  }
  __syncthreads();
  total = red[0];
  __syncthreads();
  return total;
}

// Un-rotates the gradient in dqk (w.r.t. rotated q or k, rows (i, r)) in place, adds
// dL/dθ into dth, the bias gradient of head h into its partial, and the result into the
// group's accumulator (= for the group's first head, + after: a fixed order).
__device__ void finish_qk_grad(const Dims& d, const ChunkPos& pos, bool first_head,
                               const float* cosv, const float* sinv, const bf16* rotated,
                               float* dqk, float* dth, float* bias_partial, float* acc) {
  const int N = d.state, half = N / 2, R = d.rank, A = d.angles;
  // Thread per (token, pair): the θ gradient of pair j sums over ranks without races.
  for (int idx = threadIdx.x; idx < d.chunk * half; idx += blockDim.x) {
    const int i = idx / half, n = idx % half;
    if (n >= A) continue;
    float d_theta = 0.f;
    const float cs = cosv[i * A + n], sn = sinv[i * A + n];
    for (int r = 0; r < R; ++r) {
      float* row = dqk + (i * R + r) * N;
      const float da = row[n], db = row[n + half];
      const float ra = to_f(rotated[(i * R + r) * N + n]);
      const float rb = to_f(rotated[(i * R + r) * N + n + half]);
      d_theta += db * ra - da * rb;
      row[n] = da * cs + db * sn;
      row[n + half] = db * cs - da * sn;
    }
    dth[i * A + n] += d_theta;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < R * N; idx += blockDim.x) {
    const int r = idx / N, n = idx % N;
    float sum = 0.f;
    for (int i = 0; i < pos.len; ++i) sum += dqk[(i * R + r) * N + n];
    bias_partial[idx] = sum;
  }
  for (int idx = threadIdx.x; idx < pos.len * R * N; idx += blockDim.x) {
    const int row = idx / N, n = idx % N;
    const int i = row / R, r = row % R;
    const size_t out =
        (((static_cast<size_t>(pos.b) * d.seqlen + pos.t0 + i) * R + r) * d.groups + pos.g) * N + n;
    acc[out] = first_head ? dqk[idx] : acc[out] + dqk[idx];
  }
  __syncthreads();
}

// Everything the chunk contributes to every gradient, for each head of the group.
//
// Precision note. The scan depends on the angles only through differences θ_t − θ_s, so
// the per-token angle gradients sum to zero and dL/dangle_t (a suffix sum of them over
// the rest of the sequence) is a small remainder of large terms that cancel. They cancel
// only if the q-side and k-side terms see the same numbers: the rotated q and k are
// rounded to bf16 once and used everywhere, the intra-chunk score gradient is rounded
// once for both dQ and dK, and every product with the state (E, dS, F, G) runs in fp32
// on CUDA cores in both variants. Rounding E or dS to bf16 measured 1.1-3.6% angle error.
template <bool kTensor>
__global__ void chunk_backward_kernel(Dims d, SmemPlan plan, DevInputs in, Work w, bool read_psiv,
                                      const bf16* dy, DevGrads grads) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* sc = reinterpret_cast<float*>(smem + plan.scalars);
  float* cosv = reinterpret_cast<float*>(smem + plan.cos);
  float* sinv = reinterpret_cast<float*>(smem + plan.sin);
  bf16* qs = reinterpret_cast<bf16*>(smem + plan.q);
  bf16* ks = reinterpret_cast<bf16*>(smem + plan.k);
  bf16* vs = reinterpret_cast<bf16*>(smem + plan.v);
  float* es = reinterpret_cast<float*>(smem + plan.e);
  float* ss = reinterpret_cast<float*>(smem + plan.s);
  float* dsc = reinterpret_cast<float*>(smem + plan.dsc);
  float* wtok = reinterpret_cast<float*>(smem + plan.wtok);
  float* dwt = reinterpret_cast<float*>(smem + plan.dwt);
  float* os = reinterpret_cast<float*>(smem + plan.o);
  float* dos = reinterpret_cast<float*>(smem + plan.d_o);
  float* dvs = reinterpret_cast<float*>(smem + plan.dv);
  float* dqk = reinterpret_cast<float*>(smem + plan.dqk);
  float* red = reinterpret_cast<float*>(smem + plan.red);
  float* dth = reinterpret_cast<float*>(smem + plan.dth);
  const int N = d.state, P = d.headdim, R = d.rank, C = d.chunk, M = d.rows, A = d.angles;
  const ChunkPos group_pos = chunk_pos(d, blockIdx.y, true, blockIdx.x);
  const size_t slot = static_cast<size_t>(group_pos.b) * d.chunks + group_pos.c;
  const size_t slots = static_cast<size_t>(d.batch) * d.chunks;

  for (int hg = 0; hg < d.heads_per_group; ++hg) {
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

    load_scalars(d, in, w, pos, sc, cosv, sinv);
    load_rotated(d, in.q, in.q_bias, pos, cosv, sinv, qs);
    load_rotated(d, in.k, in.k_bias, pos, cosv, sinv, ks);
    load_psiv(d, in, pos, w.psiv, read_psiv, false, vs);
    load_d_o(d, in, dy, pos, dos);
    load_state(w.states + bhc * matrix, P * N, es);
    fill_weights(d, sc, wtok);
    for (int idx = threadIdx.x; idx < C * A; idx += blockDim.x) dth[idx] = 0.f;
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
      sc[kDLog * C + i] = 0.f;
      sc[kDGamma * C + i] = 0.f;
      sc[kDKappa * C + i] = 0.f;
    }
    __syncthreads();

    // Recompute the forward: scores, weighted scores and o.
    gemm<kTensor>(
        M, M, N, [&](int i, int n) { return to_f(qs[i * N + n]); },
        [&](int n, int j) { return to_f(ks[j * N + n]); },
        [&](int i, int j, float value) { ss[i * M + j] = value; });
    block_gemm(
        M, P, N, [&](int i, int n) { return to_f(qs[i * N + n]); },
        [&](int n, int p) { return es[p * N + n]; },
        [&](int i, int p, float value) { os[i * P + p] = value; });
    __syncthreads();
    // dL/dl_i from the entry term e^{l_i} (Q Eᵀ)_i.
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
      float dot = 0.f;
      for (int x = 0; x < R * P; ++x) dot += dos[i * R * P + x] * os[i * R * P + x];
      sc[kScratch * C + i] = sc[kEntryDecay * C + i] * dot;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < M * P; idx += blockDim.x) {
      os[idx] *= sc[kEntryDecay * C + (idx / P) / R];
    }
    __syncthreads();
    gemm<kTensor>(
        M, P, M, [&](int i, int j) { return ss[i * M + j] * wtok[(i / R) * C + j / R]; },
        [&](int j, int p) { return to_f(vs[j * P + p]); },
        [&](int i, int p, float value) { os[i * P + p] += value + skip * to_f(vs[i * P + p]); });
    // Inside the chunk: dSc = dO Vᵀ; dV = D dO + Swᵀ dO.
    gemm<kTensor>(
        M, M, P, [&](int i, int p) { return dos[i * P + p]; },
        [&](int p, int j) { return to_f(vs[j * P + p]); },
        [&](int i, int j, float value) { dsc[i * M + j] = value; });
    gemm<kTensor>(
        M, P, M, [&](int i, int j) { return ss[j * M + i] * wtok[(j / R) * C + i / R]; },
        [&](int j, int p) { return dos[j * P + p]; },
        [&](int i, int p, float value) { dvs[i * P + p] = value + skip * dos[i * P + p]; });
    __syncthreads();

    // Epilogue backward (gating, mimo_o, mimo_z, D) now that o is complete.
    for (int idx = threadIdx.x; idx < pos.len * P; idx += blockDim.x) {
      const int i = idx / P, p = idx % P;
      const size_t th = token_head(d, pos.b, pos.t0 + i, h);
      const float z = to_f(in.z[th * P + p]), g_out = to_f(dy[th * P + p]);
      float dz = 0.f;
      for (int r = 0; r < R; ++r) {
        const size_t wr = (static_cast<size_t>(h) * R + r) * P + p;
        const float mz = to_f(in.mimo_z[wr]);
        const float gate = z * mz, sg = sigmoidf(gate);
        dz += g_out * os[(i * R + r) * P + p] * to_f(in.mimo_o[wr]) * sg *
              (1.f + gate * (1.f - sg)) * mz;
      }
      grads.z[th * P + p] = __float2bfloat16(dz);
    }
    for (int idx = threadIdx.x; idx < R * P; idx += blockDim.x) {
      const int r = idx / P, p = idx % P;
      const size_t wr = (static_cast<size_t>(h) * R + r) * P + p;
      const float mz = to_f(in.mimo_z[wr]), mo = to_f(in.mimo_o[wr]);
      float d_mo = 0.f, d_mz = 0.f;
      for (int i = 0; i < pos.len; ++i) {
        const size_t th = token_head(d, pos.b, pos.t0 + i, h);
        const float z = to_f(in.z[th * P + p]), g_out = to_f(dy[th * P + p]);
        const float o = os[(i * R + r) * P + p];
        const float gate = z * mz, sg = sigmoidf(gate);
        d_mo += g_out * o * gate * sg;
        d_mz += g_out * o * mo * sg * (1.f + gate * (1.f - sg)) * z;
      }
      mo_partial[idx] = d_mo;
      mz_partial[idx] = d_mz;
    }
    {
      float local = 0.f;
      for (int idx = threadIdx.x; idx < M * P; idx += blockDim.x) local += dos[idx] * to_f(vs[idx]);
      const float total = block_sum(local, red);
      if (threadIdx.x == 0) d_partial[0] = total;
    }

    // Score-weight gradients per token pair, then dSc ⊙= W.
    for (int idx = threadIdx.x; idx < C * C; idx += blockDim.x) {
      const int ti = idx / C, tj = idx % C;
      float d_weight = 0.f;
      if (tj <= ti) {
        for (int r = 0; r < R; ++r)
          for (int r2 = 0; r2 < R; ++r2) {
            const int at = (ti * R + r) * M + tj * R + r2;
            d_weight += dsc[at] * ss[at];
          }
      }
      dwt[idx] = d_weight;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < M * M; idx += blockDim.x) {
      dsc[idx] *= wtok[((idx / M) / R) * C + (idx % M) / R];
    }
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
      float d_log = sc[kScratch * C + i], d_kappa = 0.f;
      for (int j = 0; j < i; ++j) d_log += dwt[i * C + j] * wtok[i * C + j];
      for (int ti = i + 1; ti < C; ++ti) {
        const float weight_term = dwt[ti * C + i];
        d_kappa += weight_term * expf(sc[kLog * C + ti] - sc[kLog * C + i]);
        d_log -= weight_term * wtok[ti * C + i];
      }
      sc[kDLog * C + i] = d_log;
      sc[kDKappa * C + i] = d_kappa;
      sc[kDGamma * C + i] = dwt[i * C + i];
    }
    __syncthreads();

    // dQ = dSc K + e^{l} dO E.
    gemm<kTensor>(
        M, N, M, [&](int i, int j) { return dsc[i * M + j]; },
        [&](int j, int n) { return to_f(ks[j * N + n]); },
        [&](int i, int n, float value) { dqk[i * N + n] = value; });
    __syncthreads();
    block_gemm(
        M, N, P, [&](int i, int p) { return dos[i * P + p]; },
        [&](int p, int n) { return es[p * N + n]; },
        [&](int i, int n, float value) { dqk[i * N + n] += sc[kEntryDecay * C + i / R] * value; });
    __syncthreads();
    finish_qk_grad(d, pos, hg == 0, cosv, sinv, qs, dqk, dth, qb_partial, w.dq_acc);

    // Exit state: dS = dL/d(exit state). dL/dl_last += e^{l_last} <dS, E>.
    {
      const float* g_exit = w.gstates + bhc * matrix;
      const float* entry = w.states + bhc * matrix;
      float local = 0.f;
      for (int idx = threadIdx.x; idx < P * N; idx += blockDim.x) {
        local += g_exit[idx] * entry[idx];
        es[idx] = g_exit[idx];
      }
      const float total = block_sum(local, red);
      if (threadIdx.x == 0) {
        sc[kDLog * C + pos.len - 1] += sc[kEntryDecay * C + pos.len - 1] * total;
      }
    }
    __syncthreads();
    // dK = dScᵀ Q + exit_scale · V dS.
    gemm<kTensor>(
        M, N, M, [&](int i, int j) { return dsc[j * M + i]; },
        [&](int j, int n) { return to_f(qs[j * N + n]); },
        [&](int i, int n, float value) { dqk[i * N + n] = value; });
    __syncthreads();
    block_gemm(
        M, N, P, [&](int i, int p) { return to_f(vs[i * P + p]); },
        [&](int p, int n) { return es[p * N + n]; },
        [&](int i, int n, float value) { dqk[i * N + n] += sc[kExitScale * C + i / R] * value; });
    // K dSᵀ into os (o is no longer needed): dV += exit_scale · K dSᵀ.
    block_gemm(
        M, P, N, [&](int i, int n) { return to_f(ks[i * N + n]); },
        [&](int n, int p) { return es[p * N + n]; },
        [&](int i, int p, float value) { os[i * P + p] = value; });
    __syncthreads();
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
      float d_scale = 0.f;
      for (int x = 0; x < R * P; ++x) d_scale += os[j * R * P + x] * to_f(vs[j * R * P + x]);
      const float scale = sc[kExitScale * C + j];
      const int last = pos.len - 1;
      sc[kDKappa * C + j] += d_scale * expf(sc[kLog * C + last] - sc[kLog * C + j]);
      sc[kScratch * C + j] = d_scale * scale;
      sc[kDLog * C + j] -= d_scale * scale;
    }
    for (int idx = threadIdx.x; idx < M * P; idx += blockDim.x) {
      dvs[idx] += sc[kExitScale * C + (idx / P) / R] * os[idx];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.f;
      for (int j = 0; j < C; ++j) sum += sc[kScratch * C + j];
      sc[kDLog * C + pos.len - 1] += sum;
    }
    finish_qk_grad(d, pos, hg == 0, cosv, sinv, ks, dqk, dth, kb_partial, w.dk_acc);

    // v = x ⊙ mimo_x: dx (this head's own output) and mimo_x's partial.
    for (int idx = threadIdx.x; idx < pos.len * P; idx += blockDim.x) {
      const int i = idx / P, p = idx % P;
      const size_t th = token_head(d, pos.b, pos.t0 + i, h);
      float dx = 0.f;
      for (int r = 0; r < R; ++r)
        dx += dvs[(i * R + r) * P + p] * to_f(in.mimo_x[(static_cast<size_t>(h) * R + r) * P + p]);
      grads.v[th * P + p] = __float2bfloat16(dx);
    }
    for (int idx = threadIdx.x; idx < R * P; idx += blockDim.x) {
      const int r = idx / P, p = idx % P;
      float sum = 0.f;
      for (int i = 0; i < pos.len; ++i) {
        const size_t th = token_head(d, pos.b, pos.t0 + i, h);
        sum += dvs[(i * R + r) * P + p] * to_f(in.v[th * P + p]);
      }
      mx_partial[idx] = sum;
    }
    // Per-token coefficient gradients; dL/dADT_u = Σ_{i ≥ u} dL/dl_i inside the chunk.
    if (threadIdx.x == 0) {
      float suffix = 0.f;
      for (int i = pos.len - 1; i >= 0; --i) {
        suffix += sc[kDLog * C + i];
        const size_t th = token_head(d, pos.b, pos.t0 + i, h);
        const float both = sc[kDGamma * C + i] + sc[kDKappa * C + i];
        w.tok_dadt[th] = suffix;
        w.tok_ddt[th] = both * sc[kTau * C + i];
        w.tok_dtau[th] = both * sc[kDt * C + i];
        w.tok_dkappa[th] = sc[kDKappa * C + i];
      }
    }
    for (int j = threadIdx.x; j < A; j += blockDim.x) {
      const size_t bh = static_cast<size_t>(pos.b) * d.heads + h;
      float total = 0.f;
      for (int i = 0; i < pos.len; ++i) {
        const float value = dth[i * A + j];
        w.dtheta[(bh * d.seqlen + pos.t0 + i) * A + j] = value;
        total += value;
      }
      w.dtheta_tot[(bh * d.chunks + pos.c) * A + j] = total;
    }
    __syncthreads();
  }
}

// The dθ sum over later chunks: reverse exclusive prefix over chunk totals.
__global__ void dtheta_offsets_kernel(Dims d, Work w) {
  const size_t bh = blockIdx.x;
  for (int j = threadIdx.x; j < d.angles; j += blockDim.x) {
    float later = 0.f;
    for (int c = d.chunks - 1; c >= 0; --c) {
      float* at = w.dtheta_tot + (bh * d.chunks + c) * d.angles + j;
      const float chunk_total = *at;
      *at = later;
      later += chunk_total;
    }
  }
}

// Per token of one (batch, chunk): the angle gradients (suffix sums of dθ, summed over
// heads in order), dt/trap/adt (with the κ_{t−1} terms) and q/k to bf16.
__global__ void finish_tokens_kernel(Dims d, DevInputs in, Work w, DevGrads grads) {
  const int c = blockIdx.x, b = blockIdx.y, A = d.angles, H = d.heads;
  const int t0 = c * d.chunk, len = min(d.chunk, d.seqlen - t0);
  for (int item = threadIdx.x; item < H * A; item += blockDim.x) {
    const int h = item / A, j = item % A;
    const size_t bh = static_cast<size_t>(b) * H + h;
    float suffix = w.dtheta_tot[(bh * d.chunks + c) * A + j];
    for (int i = len - 1; i >= 0; --i) {
      float* at = w.dtheta + (bh * d.seqlen + t0 + i) * A + j;
      suffix += *at;
      *at = suffix;
    }
  }
  __syncthreads();
  for (int item = threadIdx.x; item < len * A; item += blockDim.x) {
    const int i = item / A, j = item % A, t = t0 + i;
    const size_t token = static_cast<size_t>(b) * d.seqlen + t;
    const float slope = tanhf(to_f(in.angles[token * A + j]));
    float sum = 0.f;
    for (int h = 0; h < H; ++h) {
      const size_t bh = static_cast<size_t>(b) * H + h;
      sum += w.dtheta[(bh * d.seqlen + t) * A + j] * to_f(in.dt[token * H + h]);
    }
    grads.angles[token * A + j] = __float2bfloat16(sum * (1.f - slope * slope) * kPi);
  }
  for (int item = threadIdx.x; item < len * H; item += blockDim.x) {
    const int i = item / H, h = item % H, t = t0 + i;
    const size_t token = static_cast<size_t>(b) * d.seqlen + t;
    const size_t th = token * H + h;
    const size_t bh = static_cast<size_t>(b) * H + h;
    const float tau = sigmoidf(to_f(in.trap[th])), dt = to_f(in.dt[th]);
    float d_dt = w.tok_ddt[th], d_tau = w.tok_dtau[th];
    for (int j = 0; j < A; ++j) {
      d_dt += w.dtheta[(bh * d.seqlen + t) * A + j] * tanhf(to_f(in.angles[token * A + j])) * kPi;
    }
    if (t > 0) {
      const float prev = w.tok_dkappa[th - H];
      d_dt += prev * (1.f - tau);
      d_tau -= prev * dt;
    }
    grads.adt[th] = __float2bfloat16(w.tok_dadt[th]);
    grads.dt[th] = __float2bfloat16(d_dt);
    grads.trap[th] = __float2bfloat16(d_tau * tau * (1.f - tau));
  }
  const int row_width = d.rank * d.groups * d.state;
  const size_t base = (static_cast<size_t>(b) * d.seqlen + t0) * row_width;
  for (int idx = threadIdx.x; idx < len * row_width; idx += blockDim.x) {
    grads.q[base + idx] = __float2bfloat16(w.dq_acc[base + idx]);
    grads.k[base + idx] = __float2bfloat16(w.dk_acc[base + idx]);
  }
}

// Per-head parameter gradients: the (batch, chunk) partials summed in a fixed order.
__global__ void reduce_params_kernel(Dims d, Work w, DevGrads grads) {
  __shared__ float sums[8][33];
  const int h = blockIdx.y, e = blockIdx.x * 32 + threadIdx.x;
  const size_t slots = static_cast<size_t>(d.batch) * d.chunks;
  float sum = 0.f;
  if (e < d.partial_width) {
    const float* base = w.partials + static_cast<size_t>(h) * slots * d.partial_width + e;
    for (size_t s = threadIdx.y; s < slots; s += 8) sum += base[s * d.partial_width];
  }
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || e >= d.partial_width) return;
  float total = 0.f;
  for (int y = 0; y < 8; ++y) total += sums[y][threadIdx.x];
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

// ---------------------------------------------------------------------------------
// Host side.

using detail::refuse;

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    refuse(ErrorKind::kInternal, "Mamba3ScanCuda: {} failed: {}", what, cudaGetErrorString(status));
  }
}

Dims dims_of(const cpu::ScanShape& s) {
  Dims d{};
  d.batch = s.batch;
  d.seqlen = s.seqlen;
  d.heads = s.heads;
  d.groups = s.groups;
  d.state = s.state;
  d.headdim = s.headdim;
  d.rank = s.rank;
  d.chunk = s.chunk;
  d.angles = s.angles;
  d.chunks = (s.seqlen + s.chunk - 1) / s.chunk;
  d.rows = s.chunk * s.rank;
  d.heads_per_group = s.heads / s.groups;
  d.partial_width = 2 * s.rank * s.state + 3 * s.rank * s.headdim + 1;
  return d;
}

int device_shared_limit() {
  int device = 0, limit = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  return limit;
}

// Refuses, naming the field and value, every shape the kernels do not compute.
void validate(const cpu::ScanShape& s) {
  const auto positive = [](int value, const char* field) {
    if (value <= 0) {
      refuse(ErrorKind::kInvalidArgument, "Mamba3ScanCuda: ScanShape.{}={} must be positive", field,
             value);
    }
  };
  positive(s.batch, "batch");
  positive(s.seqlen, "seqlen");
  positive(s.heads, "heads");
  positive(s.groups, "groups");
  positive(s.state, "state");
  positive(s.headdim, "headdim");
  positive(s.rank, "rank");
  positive(s.chunk, "chunk");
  if (s.heads % s.groups != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: ScanShape.groups={} does not divide heads={}", s.groups, s.heads);
  }
  if (s.state % 16 != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: ScanShape.state={} is not covered (must be a multiple of 16)", s.state);
  }
  if (s.headdim % 16 != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: ScanShape.headdim={} is not covered (must be a multiple of 16)",
           s.headdim);
  }
  if ((s.chunk * s.rank) % 16 != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: ScanShape.chunk={} × rank={} is not covered (rows per chunk must be a "
           "multiple of 16)",
           s.chunk, s.rank);
  }
  if (s.angles < 0 || s.angles > s.state / 2) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: ScanShape.angles={} must lie in [0, state/2={}]", s.angles,
           s.state / 2);
  }
  const size_t need = plan_for(dims_of(s), kBackwardKernel).total;
  const int limit = device_shared_limit();
  if (need > static_cast<size_t>(limit)) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: shape (state={}, headdim={}, rank={}, chunk={}, angles={}) needs {} "
           "bytes of shared memory per block; this device allows {}",
           s.state, s.headdim, s.rank, s.chunk, s.angles, need, limit);
  }
}

DevInputs dev_inputs(const ScanDeviceInputs& in, int angles) {
  const auto need = [](const uint16_t* p, const char* field) {
    if (p == nullptr) refuse(ErrorKind::kInvalidArgument, "ScanDeviceInputs.{} is null", field);
    return reinterpret_cast<const bf16*>(p);
  };
  DevInputs d{};
  d.q = need(in.q, "q");
  d.k = need(in.k, "k");
  d.v = need(in.v, "v");
  d.z = need(in.z, "z");
  d.adt = need(in.adt, "adt");
  d.dt = need(in.dt, "dt");
  d.trap = need(in.trap, "trap");
  d.angles = angles > 0 ? need(in.angles, "angles") : reinterpret_cast<const bf16*>(in.angles);
  d.q_bias = need(in.q_bias, "q_bias");
  d.k_bias = need(in.k_bias, "k_bias");
  d.mimo_x = need(in.mimo_x, "mimo_x");
  d.mimo_z = need(in.mimo_z, "mimo_z");
  d.mimo_o = need(in.mimo_o, "mimo_o");
  d.d = need(in.d, "d");
  return d;
}

DevGrads dev_grads(const ScanDeviceGrads& g, int angles) {
  const auto need = [](auto* p, const char* field) {
    if (p == nullptr) refuse(ErrorKind::kInvalidArgument, "ScanDeviceGrads.{} is null", field);
    return p;
  };
  DevGrads d{};
  d.q = reinterpret_cast<bf16*>(need(g.q, "q"));
  d.k = reinterpret_cast<bf16*>(need(g.k, "k"));
  d.v = reinterpret_cast<bf16*>(need(g.v, "v"));
  d.z = reinterpret_cast<bf16*>(need(g.z, "z"));
  d.adt = reinterpret_cast<bf16*>(need(g.adt, "adt"));
  d.dt = reinterpret_cast<bf16*>(need(g.dt, "dt"));
  d.trap = reinterpret_cast<bf16*>(need(g.trap, "trap"));
  d.angles = reinterpret_cast<bf16*>(angles > 0 ? need(g.angles, "angles") : g.angles);
  d.q_bias = need(g.q_bias, "q_bias");
  d.k_bias = need(g.k_bias, "k_bias");
  d.mimo_x = need(g.mimo_x, "mimo_x");
  d.mimo_z = need(g.mimo_z, "mimo_z");
  d.mimo_o = need(g.mimo_o, "mimo_o");
  d.d = need(g.d, "d");
  return d;
}

// One kernel launch as the scan makes it.
struct Launch {
  const char* name;
  const void* function;
  dim3 grid;
  dim3 block;
  size_t shared;
};

std::vector<Launch> launches_of(const Dims& d, bool tensor) {
  const unsigned bh = static_cast<unsigned>(d.batch * d.heads);
  const unsigned bg = static_cast<unsigned>(d.batch * d.groups);
  const unsigned chunks = static_cast<unsigned>(d.chunks);
  const unsigned matrix_blocks =
      static_cast<unsigned>((d.headdim * d.state + kThreads - 1) / kThreads);
  const unsigned partial_blocks = static_cast<unsigned>((d.partial_width + 31) / 32);
  const dim3 threads(kThreads);
  return {
      {"angle_prefix", reinterpret_cast<const void*>(&angle_prefix_kernel), dim3(bh), threads, 0},
      {"chunk_state",
       (tensor ? reinterpret_cast<const void*>(&chunk_state_kernel<true>)
               : reinterpret_cast<const void*>(&chunk_state_kernel<false>)),
       dim3(chunks, bh), threads, plan_for(d, kStateKernel).total},
      {"state_pass", reinterpret_cast<const void*>(&state_pass_kernel), dim3(matrix_blocks, bh),
       threads, 0},
      {"chunk_output",
       (tensor ? reinterpret_cast<const void*>(&chunk_output_kernel<true>)
               : reinterpret_cast<const void*>(&chunk_output_kernel<false>)),
       dim3(chunks, bh), threads, plan_for(d, kOutputKernel).total},
      {"chunk_dstate",
       (tensor ? reinterpret_cast<const void*>(&chunk_dstate_kernel<true>)
               : reinterpret_cast<const void*>(&chunk_dstate_kernel<false>)),
       dim3(chunks, bh), threads, plan_for(d, kDStateKernel).total},
      {"state_pass_backward", reinterpret_cast<const void*>(&state_pass_backward_kernel),
       dim3(matrix_blocks, bh), threads, 0},
      {"chunk_backward",
       (tensor ? reinterpret_cast<const void*>(&chunk_backward_kernel<true>)
               : reinterpret_cast<const void*>(&chunk_backward_kernel<false>)),
       dim3(chunks, bg), threads, plan_for(d, kBackwardKernel).total},
      {"dtheta_offsets", reinterpret_cast<const void*>(&dtheta_offsets_kernel), dim3(bh), threads,
       0},
      {"finish_tokens", reinterpret_cast<const void*>(&finish_tokens_kernel),
       dim3(chunks, static_cast<unsigned>(d.batch)), threads, 0},
      {"reduce_params", reinterpret_cast<const void*>(&reduce_params_kernel),
       dim3(partial_blocks, static_cast<unsigned>(d.heads)), dim3(32, 8), 0},
  };
}

const Launch& launch_named(const std::vector<Launch>& launches, const char* name) {
  for (const Launch& l : launches)
    if (std::string(l.name) == name) return l;
  refuse(ErrorKind::kInternal, "Mamba3ScanCuda: no kernel named {}", name);
}

void raise_shared_limits(const Dims& d) {
  for (bool tensor : {false, true}) {
    for (const Launch& l : launches_of(d, tensor)) {
      if (l.shared > 48 * 1024) {
        check(cudaFuncSetAttribute(l.function, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(l.shared)),
              "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
      }
    }
  }
}

void check_launch(const char* name) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    refuse(ErrorKind::kInternal, "Mamba3ScanCuda: launching {} failed: {}", name,
           cudaGetErrorString(status));
  }
}

}  // namespace

struct Mamba3ScanCuda::Buffers {
  Dims dims;
  Work work;
};

size_t scan_shared_bytes_needed(const cpu::ScanShape& shape) {
  return plan_for(dims_of(shape), kBackwardKernel).total;
}

Mamba3ScanCuda::Mamba3ScanCuda(const cpu::ScanShape& shape, bool psiv_cache, bool tensor_cores)
    : shape_(shape), psiv_cache_(psiv_cache), tensor_cores_(tensor_cores) {
  validate(shape);
  check(cudaGetDevice(&device_), "cudaGetDevice");
  const Dims d = dims_of(shape);
  raise_shared_limits(d);
  const size_t B = static_cast<size_t>(d.batch), L = static_cast<size_t>(d.seqlen);
  const size_t H = static_cast<size_t>(d.heads), chunks = static_cast<size_t>(d.chunks);
  const size_t A = static_cast<size_t>(d.angles), matrix = static_cast<size_t>(d.headdim) * d.state;
  const size_t qk = B * L * d.rank * d.groups * d.state;
  // Sizes in floats, in the order the arena hands them out.
  const size_t sizes[] = {
      B * H * chunks * A,       // theta0
      B * H * chunks * matrix,  // states
      B * H * chunks,           // decay
      B * H * chunks * matrix,  // gstates
      qk,                       // dq_acc
      qk,                       // dk_acc
      B * H * L * A,            // dtheta
      B * H * chunks * A,       // dtheta_tot
      B * L * H,
      B * L * H,
      B * L * H,
      B * L * H,                                              // per-token scalars
      H * B * chunks * static_cast<size_t>(d.partial_width),  // partials
  };
  size_t total = 0;
  for (size_t s : sizes) total += (s * sizeof(float) + 255) / 256 * 256;
  psiv_bytes_ = psiv_cache ? B * L * H * d.rank * d.headdim * sizeof(bf16) : 0;
  workspace_bytes_ = total + psiv_bytes_;
  check(cudaMalloc(&arena_, workspace_bytes_), "cudaMalloc(workspace)");
  buffers_ = new Buffers{};
  buffers_->dims = d;
  unsigned char* cursor = static_cast<unsigned char*>(arena_);
  float* parts[13];
  for (int i = 0; i < 13; ++i) {
    parts[i] = reinterpret_cast<float*>(cursor);
    cursor += (sizes[i] * sizeof(float) + 255) / 256 * 256;
  }
  Work& w = buffers_->work;
  w.theta0 = parts[0];
  w.states = parts[1];
  w.decay = parts[2];
  w.gstates = parts[3];
  w.dq_acc = parts[4];
  w.dk_acc = parts[5];
  w.dtheta = parts[6];
  w.dtheta_tot = parts[7];
  w.tok_dadt = parts[8];
  w.tok_ddt = parts[9];
  w.tok_dtau = parts[10];
  w.tok_dkappa = parts[11];
  w.partials = parts[12];
  w.psiv = psiv_cache ? reinterpret_cast<bf16*>(cursor) : nullptr;
  // θ offsets stay zero when there are no angles: the kernels that read them then skip.
  check(cudaMemset(arena_, 0, workspace_bytes_), "cudaMemset(workspace)");
}

Mamba3ScanCuda::~Mamba3ScanCuda() {
  if (arena_ != nullptr) cudaFree(arena_);
  delete buffers_;
}

void Mamba3ScanCuda::forward(const ScanDeviceInputs& in, uint16_t* y, void* stream) {
  if (y == nullptr) refuse(ErrorKind::kInvalidArgument, "Mamba3ScanCuda::forward: y is null");
  check(cudaSetDevice(device_), "cudaSetDevice");
  const Dims& d = buffers_->dims;
  const DevInputs din = dev_inputs(in, d.angles);
  const Work& w = buffers_->work;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const std::vector<Launch> launches = launches_of(d, tensor_cores_);
  if (d.angles > 0) {
    const Launch& l = launch_named(launches, "angle_prefix");
    angle_prefix_kernel<<<l.grid, l.block, 0, s>>>(d, din, w);
    check_launch(l.name);
  }
  {
    const Launch& l = launch_named(launches, "chunk_state");
    if (tensor_cores_) {
      chunk_state_kernel<true>
          <<<l.grid, l.block, l.shared, s>>>(d, plan_for(d, kStateKernel), din, w, psiv_cache_);
    } else {
      chunk_state_kernel<false>
          <<<l.grid, l.block, l.shared, s>>>(d, plan_for(d, kStateKernel), din, w, psiv_cache_);
    }
    check_launch(l.name);
  }
  {
    const Launch& l = launch_named(launches, "state_pass");
    state_pass_kernel<<<l.grid, l.block, 0, s>>>(d, w);
    check_launch(l.name);
  }
  {
    const Launch& l = launch_named(launches, "chunk_output");
    if (tensor_cores_) {
      chunk_output_kernel<true><<<l.grid, l.block, l.shared, s>>>(
          d, plan_for(d, kOutputKernel), din, w, psiv_cache_, reinterpret_cast<bf16*>(y));
    } else {
      chunk_output_kernel<false><<<l.grid, l.block, l.shared, s>>>(
          d, plan_for(d, kOutputKernel), din, w, psiv_cache_, reinterpret_cast<bf16*>(y));
    }
    check_launch(l.name);
  }
  has_forward_ = true;
}

void Mamba3ScanCuda::backward(const ScanDeviceInputs& in, const uint16_t* dy,
                              const ScanDeviceGrads& grads, void* stream) {
  if (!has_forward_) {
    refuse(ErrorKind::kFailedPrecondition,
           "Mamba3ScanCuda::backward needs a forward() with the same inputs first");
  }
  if (dy == nullptr) refuse(ErrorKind::kInvalidArgument, "Mamba3ScanCuda::backward: dy is null");
  check(cudaSetDevice(device_), "cudaSetDevice");
  const Dims& d = buffers_->dims;
  const DevInputs din = dev_inputs(in, d.angles);
  const DevGrads dg = dev_grads(grads, d.angles);
  const Work& w = buffers_->work;
  const bf16* ddy = reinterpret_cast<const bf16*>(dy);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const std::vector<Launch> launches = launches_of(d, tensor_cores_);
  {
    const Launch& l = launch_named(launches, "chunk_dstate");
    if (tensor_cores_) {
      chunk_dstate_kernel<true>
          <<<l.grid, l.block, l.shared, s>>>(d, plan_for(d, kDStateKernel), din, w, ddy);
    } else {
      chunk_dstate_kernel<false>
          <<<l.grid, l.block, l.shared, s>>>(d, plan_for(d, kDStateKernel), din, w, ddy);
    }
    check_launch(l.name);
  }
  {
    const Launch& l = launch_named(launches, "state_pass_backward");
    state_pass_backward_kernel<<<l.grid, l.block, 0, s>>>(d, w);
    check_launch(l.name);
  }
  {
    const Launch& l = launch_named(launches, "chunk_backward");
    if (tensor_cores_) {
      chunk_backward_kernel<true><<<l.grid, l.block, l.shared, s>>>(d, plan_for(d, kBackwardKernel),
                                                                    din, w, psiv_cache_, ddy, dg);
    } else {
      chunk_backward_kernel<false><<<l.grid, l.block, l.shared, s>>>(
          d, plan_for(d, kBackwardKernel), din, w, psiv_cache_, ddy, dg);
    }
    check_launch(l.name);
  }
  if (d.angles > 0) {
    const Launch& l = launch_named(launches, "dtheta_offsets");
    dtheta_offsets_kernel<<<l.grid, l.block, 0, s>>>(d, w);
    check_launch(l.name);
  }
  {
    const Launch& l = launch_named(launches, "finish_tokens");
    finish_tokens_kernel<<<l.grid, l.block, 0, s>>>(d, din, w, dg);
    check_launch(l.name);
  }
  {
    const Launch& l = launch_named(launches, "reduce_params");
    reduce_params_kernel<<<l.grid, l.block, 0, s>>>(d, w, dg);
    check_launch(l.name);
  }
}

std::vector<KernelAttributes> kernel_attributes(const cpu::ScanShape& shape, bool tensor_cores) {
  validate(shape);
  const Dims d = dims_of(shape);
  raise_shared_limits(d);
  int device = 0, max_threads_per_sm = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&max_threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device),
        "cudaDeviceGetAttribute(MaxThreadsPerMultiProcessor)");
  std::vector<KernelAttributes> out;
  for (const Launch& l : launches_of(d, tensor_cores)) {
    cudaFuncAttributes attr{};
    check(cudaFuncGetAttributes(&attr, l.function), "cudaFuncGetAttributes");
    const int threads = static_cast<int>(l.block.x * l.block.y * l.block.z);
    int blocks = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, l.function, threads, l.shared),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    KernelAttributes k;
    k.name = l.name;
    k.registers_per_thread = attr.numRegs;
    k.static_shared_bytes = attr.sharedSizeBytes;
    k.dynamic_shared_bytes = l.shared;
    k.local_bytes_per_thread = attr.localSizeBytes;
    k.max_threads_per_block = attr.maxThreadsPerBlock;
    k.block_threads = threads;
    k.grid_blocks = static_cast<long long>(l.grid.x) * l.grid.y * l.grid.z;
    k.blocks_per_sm = blocks;
    k.occupancy = max_threads_per_sm > 0 ? static_cast<double>(blocks * threads) /
                                               static_cast<double>(max_threads_per_sm)
                                         : 0.0;
    out.push_back(k);
  }
  return out;
}

std::vector<KernelAttributes> Mamba3ScanCuda::kernel_attributes() const {
  return megacpp::cuda::kernel_attributes(shape_, tensor_cores_);
}

}  // namespace megacpp::cuda
