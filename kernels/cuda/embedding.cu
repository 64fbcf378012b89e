// CUDA token embedding: see embedding.h for the structure. The backward's row order within a
// token is that of kernels/cpu/embedding.h (increasing rows), which makes it reproducible without
// atomics.
#include <cub/device/device_radix_sort.cuh>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/embedding.h"

namespace megacpp::cuda {
namespace {

using detail::refuse;

constexpr int kThreads = 256;

// Tokens outside [0, vocab) are sorted under this key, after every real token, and skipped.
__device__ __forceinline__ int sort_key(int32_t token, int vocab) {
  return token >= 0 && token < vocab ? token : vocab;
}

__global__ void __launch_bounds__(kThreads)
    gather_kernel(int dim, int vocab, const int32_t* __restrict__ tokens,
                  const float* __restrict__ table, float* __restrict__ out) {
  const int row = blockIdx.x;
  const int32_t token = tokens[row];
  float* dst = out + static_cast<int64_t>(row) * dim;
  if (token < 0 || token >= vocab) {
    for (int c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = nanf("");
    return;
  }
  const float* src = table + static_cast<int64_t>(token) * dim;
  for (int c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = src[c];
}

__global__ void __launch_bounds__(kThreads)
    sort_input_kernel(int rows, int vocab, const int32_t* __restrict__ tokens,
                      int32_t* __restrict__ keys, int32_t* __restrict__ ids) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
    keys[r] = sort_key(tokens[r], vocab);
    ids[r] = r;
  }
}

// seg_begin/seg_end [vocab] arrive zeroed: a token no row has keeps the empty segment [0, 0).
__global__ void __launch_bounds__(kThreads)
    segment_kernel(int rows, int vocab, const int32_t* __restrict__ keys,
                   int32_t* __restrict__ seg_begin, int32_t* __restrict__ seg_end) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += gridDim.x * blockDim.x) {
    const int32_t key = keys[i];
    if (key == vocab) continue;
    if (i == 0 || keys[i - 1] != key) seg_begin[key] = i;
    if (i == rows - 1 || keys[i + 1] != key) seg_end[key] = i + 1;
  }
}

// Block (v, slice) owns columns [slice·blockDim, (slice+1)·blockDim) of table row v.
__global__ void __launch_bounds__(kThreads)
    scatter_kernel(int dim, const int32_t* __restrict__ seg_begin,
                   const int32_t* __restrict__ seg_end, const int32_t* __restrict__ sorted_rows,
                   const float* __restrict__ dout, float* __restrict__ dtable, bool accumulate) {
  const int v = blockIdx.x;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= dim) return;
  float* dst = dtable + static_cast<int64_t>(v) * dim + c;
  // Starting from the held value and adding row by row is the CPU op's float order exactly.
  float sum = accumulate ? *dst : 0.f;
  const int end = seg_end[v];
  for (int i = seg_begin[v]; i < end; ++i) {
    sum += dout[static_cast<int64_t>(sorted_rows[i]) * dim + c];
  }
  *dst = sum;
}

size_t aligned(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// Keys run up to vocab (the sentinel) inclusive: the sort looks at no higher bit.
int key_bits(int vocab) {
  int bits = 1;
  while (bits < 31 && (1u << bits) <= static_cast<unsigned>(vocab)) ++bits;
  return bits;
}

void validate(const EmbeddingShape& s) {
  const auto positive = [](int value, const char* field) {
    if (value <= 0) {
      refuse(ErrorKind::kInvalidArgument, "EmbeddingCuda: EmbeddingShape.{}={} must be positive",
             field, value);
    }
  };
  positive(s.rows, "rows");
  positive(s.dim, "dim");
  positive(s.vocab, "vocab");
  // The sentinel key (vocab) must fit the sort's non-negative int32 keys.
  if (s.vocab >= (1 << 30)) {
    refuse(ErrorKind::kInvalidArgument, "EmbeddingCuda: EmbeddingShape.vocab={} must be below {}",
           s.vocab, 1 << 30);
  }
}

struct Layout {
  size_t keys_in = 0, ids_in = 0, keys_out = 0, ids_out = 0, segments = 0, temp = 0;
  size_t temp_bytes = 0, total = 0;
};

// CUB's scratch for the sort: a size query (CUB touches no memory when the scratch pointer is
// null), made once per op.
size_t sort_temp_bytes(const EmbeddingShape& s) {
  size_t bytes = 0;
  MEGACPP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), s.rows, 0,
      key_bits(s.vocab)));
  return bytes;
}

Layout layout_of(const EmbeddingShape& s, size_t temp_bytes) {
  Layout l;
  const size_t row_ints = aligned(static_cast<size_t>(s.rows) * sizeof(int32_t));
  l.ids_in = l.keys_in + row_ints;
  l.keys_out = l.ids_in + row_ints;
  l.ids_out = l.keys_out + row_ints;
  l.segments = l.ids_out + row_ints;
  l.temp = l.segments + aligned(2 * static_cast<size_t>(s.vocab) * sizeof(int32_t));
  l.temp_bytes = temp_bytes;
  l.total = l.temp + aligned(temp_bytes);
  return l;
}

template <class T>
void require(const T* pointer, const char* field) {
  if (pointer == nullptr) refuse(ErrorKind::kInvalidArgument, "EmbeddingCuda: {} is null", field);
}

template <class T>
T* at(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<unsigned char*>(base) + offset);
}

int grid_for(int items) {
  return (items + kThreads - 1) / kThreads < 4096 ? (items + kThreads - 1) / kThreads : 4096;
}

}  // namespace

size_t EmbeddingCuda::workspace_bytes(const EmbeddingShape& shape) {
  validate(shape);
  return layout_of(shape, sort_temp_bytes(shape)).total;
}

EmbeddingCuda::EmbeddingCuda(const EmbeddingShape& shape, void* workspace, size_t bytes)
    : shape_(shape), workspace_(workspace), workspace_bytes_(bytes) {
  validate(shape);
  if (bytes > 0) require(workspace, "the workspace (of nonzero size)");
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device_));
  sort_temp_bytes_ = sort_temp_bytes(shape);
}

void EmbeddingCuda::forward(const int32_t* tokens, const float* table, float* out,
                            void* stream) const {
  require(tokens, "forward: tokens");
  require(table, "forward: table");
  require(out, "forward: out");
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  gather_kernel<<<shape_.rows, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      shape_.dim, shape_.vocab, tokens, table, out);
  MEGACPP_CUDA_CHECK_LAUNCH("gather_kernel");
}

void EmbeddingCuda::backward(const int32_t* tokens, const float* dout, float* dtable,
                             bool accumulate, void* stream) const {
  require(tokens, "backward: tokens");
  require(dout, "backward: dout");
  require(dtable, "backward: dtable");
  const Layout l = layout_of(shape_, sort_temp_bytes_);
  if (workspace_bytes_ < l.total) {
    refuse(ErrorKind::kInvalidArgument,
           "EmbeddingCuda::backward needs workspace_bytes(shape) = {} bytes of workspace, got {}",
           l.total, workspace_bytes_);
  }
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int rows = shape_.rows, vocab = shape_.vocab;
  int32_t* keys_in = at<int32_t>(workspace_, l.keys_in);
  int32_t* ids_in = at<int32_t>(workspace_, l.ids_in);
  int32_t* keys_out = at<int32_t>(workspace_, l.keys_out);
  int32_t* ids_out = at<int32_t>(workspace_, l.ids_out);
  int32_t* seg_begin = at<int32_t>(workspace_, l.segments);
  int32_t* seg_end = seg_begin + vocab;

  sort_input_kernel<<<grid_for(rows), kThreads, 0, s>>>(rows, vocab, tokens, keys_in, ids_in);
  MEGACPP_CUDA_CHECK_LAUNCH("sort_input_kernel");
  size_t temp_bytes = l.temp_bytes;
  MEGACPP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(at<void>(workspace_, l.temp), temp_bytes,
                                                     keys_in, keys_out, ids_in, ids_out, rows, 0,
                                                     key_bits(vocab), s));
  MEGACPP_CUDA_CHECK(
      cudaMemsetAsync(seg_begin, 0, 2 * static_cast<size_t>(vocab) * sizeof(int32_t), s));
  segment_kernel<<<grid_for(rows), kThreads, 0, s>>>(rows, vocab, keys_out, seg_begin, seg_end);
  MEGACPP_CUDA_CHECK_LAUNCH("segment_kernel");
  const int threads = shape_.dim < kThreads ? (shape_.dim + 31) / 32 * 32 : kThreads;
  const dim3 grid(static_cast<unsigned>(vocab),
                  static_cast<unsigned>((shape_.dim + threads - 1) / threads));
  scatter_kernel<<<grid, threads, 0, s>>>(shape_.dim, seg_begin, seg_end, ids_out, dout, dtable,
                                          accumulate);
  MEGACPP_CUDA_CHECK_LAUNCH("scatter_kernel");
}

}  // namespace megacpp::cuda
