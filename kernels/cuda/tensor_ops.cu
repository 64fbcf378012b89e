// See tensor_ops.h.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/tensor_ops.h"

namespace megacpp::cuda {
namespace {

using detail::refuse;

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU; the grid-stride loops cover the rest.
constexpr int64_t kMaxBlocks = 4096;

__global__ void __launch_bounds__(kThreads)
    cast_kernel(const float* __restrict__ src, bf16* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = __float2bfloat16(src[i]);
  }
}

__global__ void __launch_bounds__(kThreads)
    add_kernel(const float* __restrict__ src, float* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] += src[i];
  }
}

// Block (x, k) copies a share of range k: to_packed, from the whole buffer into the packed one,
// else back.
__global__ void __launch_bounds__(kThreads)
    ranges_kernel(const int64_t* __restrict__ table, bool to_packed, const float* __restrict__ from,
                  float* __restrict__ to) {
  const int64_t offset = table[3 * blockIdx.y], count = table[3 * blockIdx.y + 1],
                start = table[3 * blockIdx.y + 2];
  const int64_t from_base = to_packed ? offset : start, to_base = to_packed ? start : offset;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    to[to_base + i] = from[from_base + i];
  }
}

int blocks_for(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

void check_args(const char* op, const void* src, const void* dst, int64_t n) {
  if (n < 0) refuse(ErrorKind::kInvalidArgument, "{}: n={} must be >= 0", op, n);
  if (n > 0 && (src == nullptr || dst == nullptr)) {
    refuse(ErrorKind::kInvalidArgument, "{}: src and dst must be set for n={}", op, n);
  }
}

void copy_ranges(const char* op, const int64_t* table, int ranges, int64_t longest, bool to_packed,
                 const float* from, float* to, void* stream) {
  if (ranges < 0 || longest < 0) {
    refuse(ErrorKind::kInvalidArgument, "{}: ranges={} and longest={} must be >= 0", op, ranges,
           longest);
  }
  if (ranges == 0 || longest == 0) return;
  if (table == nullptr || from == nullptr || to == nullptr) {
    refuse(ErrorKind::kInvalidArgument, "{}: the table and both buffers must be set for {} ranges",
           op, ranges);
  }
  // Up to 128 blocks a range (the longest's need): with a range a grid row, the long ranges'
  // rows keep every SM busy while the short ones' blocks end at once. A grid has at most 65535
  // rows: more ranges take more launches.
  const auto per_range =
      static_cast<unsigned>(std::clamp<int64_t>((longest + kThreads - 1) / kThreads, 1, 128));
  constexpr int kMaxRows = 65535;
  for (int first = 0; first < ranges; first += kMaxRows) {
    const int rows = std::min(kMaxRows, ranges - first);
    ranges_kernel<<<dim3(per_range, static_cast<unsigned>(rows)), kThreads, 0,
                    static_cast<cudaStream_t>(stream)>>>(table + 3 * static_cast<int64_t>(first),
                                                         to_packed, from, to);
    MEGACPP_CUDA_CHECK_LAUNCH("ranges_kernel");
  }
}

}  // namespace

void pack_ranges_f32(const float* whole, const int64_t* table, int ranges, int64_t longest,
                     float* packed, void* stream) {
  copy_ranges("pack_ranges_f32", table, ranges, longest, true, whole, packed, stream);
}

void unpack_ranges_f32(const float* packed, const int64_t* table, int ranges, int64_t longest,
                       float* whole, void* stream) {
  copy_ranges("unpack_ranges_f32", table, ranges, longest, false, packed, whole, stream);
}

void cast_f32_to_bf16(const float* src, uint16_t* dst, int64_t n, void* stream) {
  check_args("cast_f32_to_bf16", src, dst, n);
  if (n == 0) return;
  cast_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      src, reinterpret_cast<bf16*>(dst), n);
  MEGACPP_CUDA_CHECK_LAUNCH("cast_kernel");
}

void add_f32(const float* src, float* dst, int64_t n, void* stream) {
  check_args("add_f32", src, dst, n);
  if (n == 0) return;
  add_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(src, dst, n);
  MEGACPP_CUDA_CHECK_LAUNCH("add_kernel");
}

}  // namespace megacpp::cuda
