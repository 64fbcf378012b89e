// CUDA Mamba-3 preprocessing: see mamba3_preprocess.h for the structure. The formulas are
// those of kernels/cpu/mamba3_preprocess.h, evaluated in fp32 from bf16 inputs.
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mamba3_preprocess.h"

namespace megacpp::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr size_t kSharedWithoutOptIn = 48 * 1024;  // dynamic shared memory a block gets by default

// Shape constants and column offsets every kernel needs, passed by value.
struct Dims {
  int rows, heads, state, angles;
  int cols, d_inner, bc_width, vecs;  // vecs = R·G vectors of B (and of C) per row
  int proj_stride;                    // elements from one of proj's rows to the next (≥ cols)
  int col_x, col_b, col_c, col_dd_dt, col_dd_a, col_trap, col_angles;
  int tiles;          // backward tiles of Mamba3PreprocessCuda::kRowsPerTile rows
  int partial_width;  // H + 2·N floats per tile
  float a_floor, norm_eps;
};

// ---------------------------------------------------------------------------------
// Device helpers.

// n elements of a row's z or x part, between the in_proj row and its own [d_inner] row: 16
// bytes a lane where `wide` (both ends 16-byte aligned on every row: checked on the host), else
// an element a lane. These copies are most of the kernels' bytes.
__device__ __forceinline__ void copy_span(const bf16* __restrict__ from, bf16* __restrict__ to,
                                          int n, bool wide, int lane) {
  if (wide) {
    for (int i = 8 * lane; i < n; i += 8 * 32) {
      *reinterpret_cast<uint4*>(to + i) = *reinterpret_cast<const uint4*>(from + i);
    }
    return;
  }
  for (int i = lane; i < n; i += 32) to[i] = from[i];
}

__device__ __forceinline__ float heavy_tail(float v) {
  return v >= 0.f ? 1.f + v : 1.f / (1.f - v);
}
__device__ __forceinline__ float heavy_tail_derivative(float v) {
  if (v >= 0.f) return 1.f;
  const float d = 1.f - v;
  return 1.f / (d * d);
}
__device__ __forceinline__ float softplus(float v) {
  return v > 20.f ? v : log1pf(expf(v));
}

// ---------------------------------------------------------------------------------
// Kernels.

struct FwdOut {
  bf16 *z, *x, *k, *q, *adt, *dt, *trap, *angles;
};

// One warp per row, kWarps rows a block: a row's loads, its norms' reductions and its stores
// form one short chain, and a block per row left most of the GPU waiting on them (a quarter of
// the rows' bytes a second, at bench-1.3b's TP = 4 share of the heads).
__global__ void __launch_bounds__(kThreads)
    forward_kernel(Dims d, const bf16* __restrict__ proj, const float* __restrict__ dt_bias,
                   const float* __restrict__ b_weight, const float* __restrict__ c_weight,
                   FwdOut out, float* __restrict__ rstd, bool wide) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarps + warp;
  if (row >= d.rows) return;
  const bf16* p = proj + static_cast<int64_t>(row) * d.proj_stride;
  const int64_t row_di = static_cast<int64_t>(row) * d.d_inner;
  if (out.z != nullptr) {  // else the scan reads z and x in place
    copy_span(p, out.z + row_di, d.d_inner, wide, lane);
    copy_span(p + d.col_x, out.x + row_di, d.d_inner, wide, lane);
  }
  for (int h = lane; h < d.heads; h += 32) {
    const int64_t o = static_cast<int64_t>(row) * d.heads + h;
    const float a = fminf(-heavy_tail(to_f(p[d.col_dd_a + h])), -d.a_floor);
    const float dt = softplus(to_f(p[d.col_dd_dt + h]) + dt_bias[h]);
    out.dt[o] = __float2bfloat16(dt);
    out.adt[o] = __float2bfloat16(a * dt);
    out.trap[o] = p[d.col_trap + h];
  }
  for (int j = lane; j < d.angles; j += 32) {
    out.angles[static_cast<int64_t>(row) * d.angles + j] = p[d.col_angles + j];
  }
  const float inv_n = 1.f / static_cast<float>(d.state);
  // Vector u < vecs is B's vector u, else C's vector u − vecs: the bc_rstd order.
  for (int u = 0; u < 2 * d.vecs; ++u) {
    const bool is_c = u >= d.vecs;
    const int offset = (is_c ? u - d.vecs : u) * d.state;
    const bf16* in = p + (is_c ? d.col_c : d.col_b) + offset;
    const float* weight = is_c ? c_weight : b_weight;
    bf16* normalized = (is_c ? out.q : out.k) + static_cast<int64_t>(row) * d.bc_width + offset;
    float sum_sq = 0.f;
    for (int i = lane; i < d.state; i += 32) {
      const float v = to_f(in[i]);
      sum_sq = fmaf(v, v, sum_sq);
    }
    const float inv = 1.f / sqrtf(warp_sum(sum_sq) * inv_n + d.norm_eps);
    if (lane == 0) rstd[static_cast<int64_t>(row) * 2 * d.vecs + u] = inv;
    for (int i = lane; i < d.state; i += 32) {
      normalized[i] = __float2bfloat16(to_f(in[i]) * inv * weight[i]);
    }
  }
}

struct BwdIn {
  const bf16 *z, *x, *k, *q, *adt, *dt, *trap, *angles;
};

// One block per tile of rows, one warp per row at a time (warp w takes the tile's rows w,
// w + kWarps, ...), so that the rows' chains of loads run side by side. Shared memory, per warp:
// the dt_bias partial [H, padded to 4], then the B and C norm-weight partials [N] each; entry i
// of each is owned by lane i mod 32 of its warp. Each warp adds its rows in increasing order and
// the tile's partial sums the warps in increasing order: a fixed order throughout.
__global__ void __launch_bounds__(kThreads)
    backward_kernel(Dims d, const bf16* __restrict__ proj, const float* __restrict__ dt_bias,
                    const float* __restrict__ b_weight, const float* __restrict__ c_weight,
                    const float* __restrict__ rstd, BwdIn g, bf16* __restrict__ dproj,
                    float* __restrict__ partials, bool wide) {
  extern __shared__ float smem[];
  const int heads_padded = (d.heads + 3) / 4 * 4;
  const int warp_width = heads_padded + 2 * d.state;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s_dt_bias = smem + warp * warp_width;
  float* s_weight = s_dt_bias + heads_padded;
  for (int h = lane; h < d.heads; h += 32) s_dt_bias[h] = 0.f;
  for (int i = lane; i < 2 * d.state; i += 32) s_weight[i] = 0.f;
  __syncwarp();  // C's half starts at N, which need not be a multiple of 32: other owners

  const int row_begin = blockIdx.x * Mamba3PreprocessCuda::kRowsPerTile;
  const int row_end = min(d.rows, row_begin + Mamba3PreprocessCuda::kRowsPerTile);
  const float inv_n = 1.f / static_cast<float>(d.state);
  for (int row = row_begin + warp; row < row_end; row += kWarps) {
    const bf16* p = proj + static_cast<int64_t>(row) * d.proj_stride;
    bf16* dp = dproj + static_cast<int64_t>(row) * d.cols;
    const int64_t row_di = static_cast<int64_t>(row) * d.d_inner;
    copy_span(g.z + row_di, dp, d.d_inner, wide, lane);
    copy_span(g.x + row_di, dp + d.col_x, d.d_inner, wide, lane);
    for (int h = lane; h < d.heads; h += 32) {
      const int64_t o = static_cast<int64_t>(row) * d.heads + h;
      const float dd_a = to_f(p[d.col_dd_a + h]);
      const float f = heavy_tail(dd_a);
      const float a = fminf(-f, -d.a_floor);
      const float pre = to_f(p[d.col_dd_dt + h]) + dt_bias[h];
      const float dt = softplus(pre);
      const float g_adt = to_f(g.adt[o]);
      const float d_dt = fmaf(g_adt, a, to_f(g.dt[o]));
      const float d_pre = d_dt / (1.f + expf(-pre));
      dp[d.col_dd_dt + h] = __float2bfloat16(d_pre);
      s_dt_bias[h] += d_pre;
      // A is clamped at −A_floor: no gradient flows where the floor binds.
      dp[d.col_dd_a + h] =
          __float2bfloat16(f > d.a_floor ? -g_adt * dt * heavy_tail_derivative(dd_a) : 0.f);
      dp[d.col_trap + h] = g.trap[o];
    }
    for (int j = lane; j < d.angles; j += 32) {
      dp[d.col_angles + j] = g.angles[static_cast<int64_t>(row) * d.angles + j];
    }
    for (int u = 0; u < 2 * d.vecs; ++u) {
      const bool is_c = u >= d.vecs;
      const int offset = (is_c ? u - d.vecs : u) * d.state;
      const int column = (is_c ? d.col_c : d.col_b) + offset;
      const bf16* in = p + column;
      const bf16* dy = (is_c ? g.q : g.k) + static_cast<int64_t>(row) * d.bc_width + offset;
      const float* weight = is_c ? c_weight : b_weight;
      float* acc = s_weight + (is_c ? d.state : 0);
      const float r = rstd[static_cast<int64_t>(row) * 2 * d.vecs + u];
      float dot = 0.f;
      for (int i = lane; i < d.state; i += 32)
        dot = fmaf(to_f(dy[i]) * weight[i], to_f(in[i]), dot);
      const float coef = warp_sum(dot) * inv_n * r * r * r;
      for (int i = lane; i < d.state; i += 32) {
        const float dyi = to_f(dy[i]), xi = to_f(in[i]);
        dp[column + i] = __float2bfloat16(dyi * weight[i] * r - coef * xi);
        acc[i] = fmaf(dyi * xi, r, acc[i]);
      }
    }
  }
  __syncthreads();
  float* out = partials + static_cast<int64_t>(blockIdx.x) * d.partial_width;
  for (int c = threadIdx.x; c < d.partial_width; c += blockDim.x) {
    const int at = c < d.heads ? c : heads_padded + c - d.heads;
    float sum = 0.f;
    for (int w = 0; w < kWarps; ++w) sum += smem[w * warp_width + at];
    out[c] = sum;
  }
}

// A block per 32 parameter-gradient entries, a warp per slice of the tiles: warp s sums the
// tiles t ≡ s (mod kWarps) in increasing order, then the slices are added in increasing order
// (the latency of one long chain of loads per entry was most of this kernel's time).
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(Dims d, const float* __restrict__ partials, float* d_dt_bias, float* d_b_weight,
                  float* d_c_weight) {
  __shared__ double slices[kWarps][32];
  const int slice = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = blockIdx.x * 32 + lane;
  double sum = 0.0;
  if (c < d.partial_width) {
    for (int t = slice; t < d.tiles; t += kWarps) {
      sum += partials[static_cast<int64_t>(t) * d.partial_width + c];
    }
  }
  slices[slice][lane] = sum;
  __syncthreads();
  if (slice != 0 || c >= d.partial_width) return;
  double whole = 0.0;
  for (int w = 0; w < kWarps; ++w) whole += slices[w][lane];
  const float total = static_cast<float>(whole);
  if (c < d.heads) {
    d_dt_bias[c] = total;
  } else if (c < d.heads + d.state) {
    d_b_weight[c - d.heads] = total;
  } else {
    d_c_weight[c - d.heads - d.state] = total;
  }
}

// ---------------------------------------------------------------------------------
// Host side.

using detail::refuse;

// Refuses, naming the field and value, every shape the kernels do not compute.
void validate(const ops::Mamba3PreprocessShape& s) {
  const auto positive = [](int value, const char* field) {
    if (value <= 0) {
      refuse(ErrorKind::kInvalidArgument,
             "Mamba3PreprocessCuda: Mamba3PreprocessShape.{}={} must be positive", field, value);
    }
  };
  positive(s.rows, "rows");
  positive(s.heads, "heads");
  positive(s.headdim, "headdim");
  positive(s.state, "state");
  positive(s.groups, "groups");
  positive(s.rank, "rank");
  if (s.angles < 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3PreprocessCuda: Mamba3PreprocessShape.angles={} must not be negative", s.angles);
  }
  if (s.state > Mamba3PreprocessCuda::kMaxState) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3PreprocessCuda: Mamba3PreprocessShape.state={} exceeds {} (the backward "
           "kernel's shared memory holds 2·state floats per warp)",
           s.state, Mamba3PreprocessCuda::kMaxState);
  }
  if (s.heads > Mamba3PreprocessCuda::kMaxHeads) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3PreprocessCuda: Mamba3PreprocessShape.heads={} exceeds {} (the backward "
           "kernel's shared memory holds the dt_bias partial)",
           s.heads, Mamba3PreprocessCuda::kMaxHeads);
  }
  const long long di = static_cast<long long>(s.heads) * s.headdim;
  const long long bc = static_cast<long long>(s.state) * s.groups * s.rank;
  const long long columns = 2 * di + 2 * bc + 3LL * s.heads + s.angles;
  if (columns > INT_MAX || static_cast<long long>(s.rows) * 2 * s.groups * s.rank > INT_MAX) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3PreprocessCuda: Mamba3PreprocessShape gives {} in_proj columns (heads={}, "
           "headdim={}, state={}, groups={}, rank={}, angles={}, rows={}); at most {} columns "
           "and rows·2·groups·rank norm scales are supported",
           columns, s.heads, s.headdim, s.state, s.groups, s.rank, s.angles, s.rows, INT_MAX);
  }
  if (!std::isfinite(s.a_floor) || s.a_floor < 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3PreprocessCuda: Mamba3PreprocessShape.a_floor={} must be finite and >= 0",
           s.a_floor);
  }
  if (!std::isfinite(s.norm_eps) || s.norm_eps <= 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3PreprocessCuda: Mamba3PreprocessShape.norm_eps={} must be finite and > 0",
           s.norm_eps);
  }
}

// The split order of ops::Mamba3PreprocessShape: z, x, B, C, dd_dt, dd_A, trap, angles.
// (validate() has bounded every offset by INT_MAX.)
Dims dims_of(const ops::Mamba3PreprocessShape& s, int proj_stride = 0) {
  Dims d{};
  d.rows = s.rows;
  d.heads = s.heads;
  d.state = s.state;
  d.angles = s.angles;
  d.d_inner = s.heads * s.headdim;
  d.bc_width = s.state * s.groups * s.rank;
  d.vecs = s.rank * s.groups;
  d.col_x = d.d_inner;
  d.col_b = 2 * d.d_inner;
  d.col_c = d.col_b + d.bc_width;
  d.col_dd_dt = d.col_c + d.bc_width;
  d.col_dd_a = d.col_dd_dt + s.heads;
  d.col_trap = d.col_dd_a + s.heads;
  d.col_angles = d.col_trap + s.heads;
  d.cols = d.col_angles + s.angles;
  d.proj_stride = proj_stride == 0 ? d.cols : proj_stride;
  d.tiles = (s.rows + Mamba3PreprocessCuda::kRowsPerTile - 1) / Mamba3PreprocessCuda::kRowsPerTile;
  d.partial_width = s.heads + 2 * s.state;
  d.a_floor = static_cast<float>(s.a_floor);
  d.norm_eps = static_cast<float>(s.norm_eps);
  return d;
}

size_t backward_shared_bytes(const Dims& d) {
  const size_t heads_padded = static_cast<size_t>(d.heads + 3) / 4 * 4;
  return static_cast<size_t>(kWarps) * (heads_padded + 2 * static_cast<size_t>(d.state)) *
         sizeof(float);
}

// Whether copy_span may move 16 bytes a lane: every row of the in_proj buffer and of z and x,
// and x's column offset, start on a 16-byte boundary.
bool wide_rows(const Dims& d, const void* rows, const void* z, const void* x) {
  const auto address = [](const void* p) {
    return reinterpret_cast<uintptr_t>(p);
  };
  return d.cols % 8 == 0 && d.proj_stride % 8 == 0 && d.d_inner % 8 == 0 &&
         (address(rows) | address(z) | address(x)) % 16 == 0;
}

size_t aligned(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

template <class T>
void require(const T* pointer, const char* field) {
  if (pointer == nullptr) {
    refuse(ErrorKind::kInvalidArgument, "Mamba3PreprocessCuda: {} is null", field);
  }
}

void require_params(const PreprocessDeviceParams& params) {
  require(params.dt_bias, "PreprocessDeviceParams.dt_bias");
  require(params.b_norm_weight, "PreprocessDeviceParams.b_norm_weight");
  require(params.c_norm_weight, "PreprocessDeviceParams.c_norm_weight");
}

const bf16* as_bf16(const uint16_t* p) {
  return reinterpret_cast<const bf16*>(p);
}
bf16* as_bf16(uint16_t* p) {
  return reinterpret_cast<bf16*>(p);
}

size_t rstd_bytes_of(const Dims& d) {
  return aligned(static_cast<size_t>(d.rows) * 2 * d.vecs * sizeof(float));
}

}  // namespace

size_t Mamba3PreprocessCuda::workspace_bytes(const ops::Mamba3PreprocessShape& shape) {
  validate(shape);
  const Dims d = dims_of(shape);
  return rstd_bytes_of(d) + aligned(static_cast<size_t>(d.tiles) * d.partial_width * sizeof(float));
}

Mamba3PreprocessCuda::Mamba3PreprocessCuda(const ops::Mamba3PreprocessShape& shape, int proj_stride)
    : shape_(shape), proj_stride_(proj_stride == 0 ? shape.columns() : proj_stride) {
  validate(shape);
  if (proj_stride != 0 && proj_stride < shape.columns()) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3PreprocessCuda: proj_stride={} must be 0 (dense) or at least the shape's "
           "columns()={}",
           proj_stride, shape.columns());
  }
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device_));
  // The backward's per-warp partials: up to kWarps · (kMaxHeads + 2 · kMaxState) floats (96 KB),
  // past the 48 KB a block gets without opting in (backward() opts in per launch).
  const size_t shared = backward_shared_bytes(dims_of(shape));
  int opt_in = 0;
  MEGACPP_CUDA_CHECK(
      cudaDeviceGetAttribute(&opt_in, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
  if (shared > static_cast<size_t>(opt_in)) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3PreprocessCuda: Mamba3PreprocessShape heads={} and state={} need {} bytes of "
           "shared memory a block for the backward's partials; device {} allows {}",
           shape.heads, shape.state, shared, device_, opt_in);
  }
  const size_t rstd_bytes = rstd_bytes_of(dims_of(shape));
  workspace_bytes_ = workspace_bytes(shape);
  MEGACPP_CUDA_CHECK(cudaMalloc(&arena_, workspace_bytes_));
  rstd_ = static_cast<float*>(arena_);
  partials_ = reinterpret_cast<float*>(static_cast<unsigned char*>(arena_) + rstd_bytes);
  MEGACPP_CUDA_CHECK(cudaMemset(arena_, 0, workspace_bytes_));
}

Mamba3PreprocessCuda::~Mamba3PreprocessCuda() {
  if (arena_ != nullptr) cudaFree(arena_);
}

void Mamba3PreprocessCuda::forward(const uint16_t* proj, const PreprocessDeviceParams& params,
                                   const PreprocessDeviceOutputs& out, void* stream) {
  require(proj, "forward: proj");
  require_params(params);
  if ((out.z == nullptr) != (out.x == nullptr)) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3PreprocessCuda: PreprocessDeviceOutputs.z and .x must be both set or both null "
           "(z and x read in place in proj)");
  }
  require(out.k, "PreprocessDeviceOutputs.k");
  require(out.q, "PreprocessDeviceOutputs.q");
  require(out.adt, "PreprocessDeviceOutputs.adt");
  require(out.dt, "PreprocessDeviceOutputs.dt");
  require(out.trap, "PreprocessDeviceOutputs.trap");
  if (shape_.angles > 0) require(out.angles, "PreprocessDeviceOutputs.angles");
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const Dims d = dims_of(shape_, proj_stride_);
  const FwdOut o{as_bf16(out.z),   as_bf16(out.x),  as_bf16(out.k),    as_bf16(out.q),
                 as_bf16(out.adt), as_bf16(out.dt), as_bf16(out.trap), as_bf16(out.angles)};
  forward_kernel<<<(d.rows + kWarps - 1) / kWarps, kThreads, 0,
                   static_cast<cudaStream_t>(stream)>>>(d, as_bf16(proj), params.dt_bias,
                                                        params.b_norm_weight, params.c_norm_weight,
                                                        o, rstd_, wide_rows(d, proj, out.z, out.x));
  MEGACPP_CUDA_CHECK_LAUNCH("forward_kernel");
  has_forward_ = true;
}

void Mamba3PreprocessCuda::backward(const uint16_t* proj, const PreprocessDeviceParams& params,
                                    const PreprocessDeviceGrads& grads, uint16_t* dproj,
                                    const PreprocessDeviceParamGrads& param_grads, void* stream) {
  if (!has_forward_) {
    refuse(ErrorKind::kFailedPrecondition,
           "Mamba3PreprocessCuda::backward needs forward() first: the norm scales come from it");
  }
  require(proj, "backward: proj");
  require(dproj, "backward: dproj");
  require_params(params);
  require(grads.z, "PreprocessDeviceGrads.z");
  require(grads.x, "PreprocessDeviceGrads.x");
  require(grads.k, "PreprocessDeviceGrads.k");
  require(grads.q, "PreprocessDeviceGrads.q");
  require(grads.adt, "PreprocessDeviceGrads.adt");
  require(grads.dt, "PreprocessDeviceGrads.dt");
  require(grads.trap, "PreprocessDeviceGrads.trap");
  if (shape_.angles > 0) require(grads.angles, "PreprocessDeviceGrads.angles");
  require(param_grads.dt_bias, "PreprocessDeviceParamGrads.dt_bias");
  require(param_grads.b_norm_weight, "PreprocessDeviceParamGrads.b_norm_weight");
  require(param_grads.c_norm_weight, "PreprocessDeviceParamGrads.c_norm_weight");
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const Dims d = dims_of(shape_, proj_stride_);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const BwdIn g{as_bf16(grads.z),   as_bf16(grads.x),  as_bf16(grads.k),    as_bf16(grads.q),
                as_bf16(grads.adt), as_bf16(grads.dt), as_bf16(grads.trap), as_bf16(grads.angles)};
  const size_t shared = backward_shared_bytes(d);
  if (shared > kSharedWithoutOptIn) {
    // The attribute is the function's on this device, not this op's: another op of a smaller
    // shape may have set it lower since, so it is set before every such launch.
    MEGACPP_CUDA_CHECK(cudaFuncSetAttribute(
        backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  }
  backward_kernel<<<d.tiles, kThreads, shared, s>>>(
      d, as_bf16(proj), params.dt_bias, params.b_norm_weight, params.c_norm_weight, rstd_, g,
      as_bf16(dproj), partials_, wide_rows(d, dproj, grads.z, grads.x));
  MEGACPP_CUDA_CHECK_LAUNCH("backward_kernel");
  reduce_kernel<<<(d.partial_width + 31) / 32, kThreads, 0, s>>>(
      d, partials_, param_grads.dt_bias, param_grads.b_norm_weight, param_grads.c_norm_weight);
  MEGACPP_CUDA_CHECK_LAUNCH("reduce_kernel");
}

}  // namespace megacpp::cuda
