// The CUDA lm_head fused with the mean cross entropy: see lm_head_loss.h for the structure. The
// per-row formulas are those of kernels/cpu/cross_entropy.h, in fp32.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/lm_head_loss.h"

namespace megacpp::cuda {
namespace {

using detail::refuse;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// A picked chunk is a multiple of this many rows: whole GEMM tiles.
constexpr int kChunkMultiple = 128;

// Every target the CPU op would accept and count; vocab_size <= vocab_padded is validated, so
// this also keeps the logit read in the row.
__device__ __forceinline__ bool counted(int32_t target, int vocab_size) {
  return target >= 0 && target < vocab_size;
}

// Block-wide reductions in an order fixed by blockDim alone (butterflies within warps, then every
// warp combines the warps' values the same way): all threads hold the same bits. `warp_vals`
// holds kWarps floats of shared memory; call from every thread.
__device__ float block_total(float value, float* warp_vals) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  value = warp_sum(value);
  if (lane == 0) warp_vals[warp] = value;
  __syncthreads();
  float total = lane < kWarps ? warp_vals[lane] : 0.f;
  total = warp_sum(total);
  __syncthreads();  // warp_vals may be written again by the next call
  return total;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

__device__ float block_max(float value, float* warp_vals) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  value = warp_max(value);
  if (lane == 0) warp_vals[warp] = value;
  __syncthreads();
  float result = lane < kWarps ? warp_vals[lane] : -INFINITY;
  result = warp_max(result);
  __syncthreads();
  return result;
}

// One block: the number of counted rows. Integer sums do not depend on the order.
__global__ void __launch_bounds__(kThreads)
    count_kernel(int rows, int vocab_size, const int32_t* __restrict__ targets,
                 int32_t* __restrict__ count) {
  __shared__ int32_t partial[kThreads];
  int32_t n = 0;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) n += counted(targets[r], vocab_size);
  partial[threadIdx.x] = n;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int i = 0; i < kThreads; ++i) total += partial[i];
    *count = total;
  }
}

// A running (max, Σ exp(x − max)) over the values one thread sees: one pass over the row
// instead of two. A NaN logit makes the sum NaN (x > max is false), so the loss shows it.
struct Online {
  float max = -INFINITY;
  float sum = 0.f;
  __device__ __forceinline__ void take(float x) {
    if (x > max) {
      sum = sum * expf(max - x) + 1.f;
      max = x;
    } else {
      sum += expf(x - max);
    }
  }
};

// One block per row of the chunk. logits fp32 [chunk, vocab_padded]; targets, row_loss: the
// chunk's rows; dlogits bf16 [chunk, vocab_padded], every entry written (kGrad). kVec = 4 reads
// float4 (vocab_padded % 4 == 0: every row 16-byte aligned), else single floats.
template <int kVec, bool kGrad>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(int vocab_padded, int vocab_size, const float* __restrict__ logits,
                         const int32_t* __restrict__ targets, const int32_t* __restrict__ count,
                         float grad_scale, float* __restrict__ row_loss,
                         bf16* __restrict__ dlogits) {
  __shared__ float warp_vals[kWarps];
  const int row = blockIdx.x;
  const int32_t target = targets[row];
  const float* x = logits + static_cast<int64_t>(row) * vocab_padded;
  const int groups = vocab_padded / kVec;
  // The whole block takes the same branch: no barrier is skipped by some threads only.
  if (!counted(target, vocab_size)) {
    if (threadIdx.x == 0) row_loss[row] = 0.f;
    if constexpr (kGrad) {
      bf16* dx = dlogits + static_cast<int64_t>(row) * vocab_padded;
      for (int c = threadIdx.x; c < vocab_padded; c += blockDim.x) dx[c] = __float2bfloat16(0.f);
    }
    return;
  }
  Online online;
  for (int i = threadIdx.x; i < groups; i += blockDim.x) {
    if constexpr (kVec == 4) {
      const float4 q = reinterpret_cast<const float4*>(x)[i];
      online.take(q.x);
      online.take(q.y);
      online.take(q.z);
      online.take(q.w);
    } else {
      online.take(x[i]);
    }
  }
  const float row_max = block_max(online.max, warp_vals);
  // A thread that saw no column has sum 0 and max −inf: its term is 0·0.
  const float sum = block_total(online.sum * expf(online.max - row_max), warp_vals);
  const float lse = row_max + logf(sum);
  if (threadIdx.x == 0) row_loss[row] = lse - x[target];
  if constexpr (kGrad) {
    bf16* dx = dlogits + static_cast<int64_t>(row) * vocab_padded;
    // count >= 1: this row is counted.
    const float scale = grad_scale / static_cast<float>(*count);
    const auto grad = [&](float v, int c) {
      const float p = expf(v - lse);
      return (c == target ? p - 1.f : p) * scale;
    };
    for (int i = threadIdx.x; i < groups; i += blockDim.x) {
      if constexpr (kVec == 4) {
        const float4 q = reinterpret_cast<const float4*>(x)[i];
        const int c = 4 * i;
        uint2 packed;
        packed.x = pack_bf16(grad(q.x, c), grad(q.y, c + 1));
        packed.y = pack_bf16(grad(q.z, c + 2), grad(q.w, c + 3));
        reinterpret_cast<uint2*>(dx)[i] = packed;
      } else {
        dx[i] = __float2bfloat16(grad(x[i], i));
      }
    }
  }
}

// One block: the per-row losses summed in row order per thread, the threads' sums in thread
// order, in double (thousands of rows), divided by the count.
__global__ void __launch_bounds__(kThreads)
    mean_kernel(int rows, const float* __restrict__ row_loss, const int32_t* __restrict__ count,
                float* __restrict__ loss, int32_t* __restrict__ valid_rows) {
  __shared__ double partial[kThreads];
  double sum = 0;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) sum += static_cast<double>(row_loss[r]);
  partial[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int i = 0; i < kThreads; ++i) total += partial[i];
    const int32_t n = *count;
    *loss = n > 0 ? static_cast<float>(total / static_cast<double>(n)) : 0.f;
    if (valid_rows != nullptr) *valid_rows = n;
  }
}

void validate(const LmHeadLossShape& s) {
  const auto positive = [](int value, const char* field) {
    if (value <= 0) {
      refuse(ErrorKind::kInvalidArgument, "LmHeadLossCuda: LmHeadLossShape.{}={} must be positive",
             field, value);
    }
  };
  positive(s.rows, "rows");
  positive(s.dim, "dim");
  positive(s.vocab_padded, "vocab_padded");
  positive(s.vocab_size, "vocab_size");
  if (s.vocab_padded < s.vocab_size) {
    refuse(ErrorKind::kInvalidArgument,
           "LmHeadLossCuda: LmHeadLossShape.vocab_padded={} must be >= vocab_size={}",
           s.vocab_padded, s.vocab_size);
  }
  if (s.first_row < 0 || s.total_rows < 0 ||
      (s.total_rows > 0 && s.first_row > s.total_rows - s.rows) ||
      (s.total_rows == 0 && s.first_row != 0)) {
    refuse(
        ErrorKind::kInvalidArgument,
        "LmHeadLossCuda: LmHeadLossShape rows [first_row={}, +rows={}) must lie inside the batch "
        "of total_rows={} (0: rows, with first_row 0)",
        s.first_row, s.rows, s.total_rows);
  }
  if (s.chunk_rows < 0) {
    refuse(ErrorKind::kInvalidArgument,
           "LmHeadLossCuda: LmHeadLossShape.chunk_rows={} must be >= 0 (0: picked)", s.chunk_rows);
  }
}

int chunk_rows_of(const LmHeadLossShape& s) {
  if (s.chunk_rows > 0) return std::min(s.chunk_rows, s.rows);
  const size_t row_bytes = static_cast<size_t>(s.vocab_padded) * sizeof(float);
  const size_t fit = LmHeadLossCuda::kChunkLogitsBytes / row_bytes;
  if (fit >= static_cast<size_t>(s.rows)) return s.rows;
  if (fit >= static_cast<size_t>(kChunkMultiple)) {
    return static_cast<int>(fit / kChunkMultiple * kChunkMultiple);
  }
  return std::max(1, static_cast<int>(fit));
}

size_t aligned(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

struct Layout {
  int chunk = 0, tail = 0;  // tail: rows of the last, shorter chunk (0: none)
  size_t logits = 0, dlogits = 0, row_loss = 0, count = 0, linear = 0;
  size_t linear_bytes = 0, total = 0;
};

Layout layout_of(const LmHeadLossShape& s) {
  Layout l;
  l.chunk = chunk_rows_of(s);
  l.tail = s.rows % l.chunk;
  const size_t chunk_entries = static_cast<size_t>(l.chunk) * static_cast<size_t>(s.vocab_padded);
  l.dlogits = l.logits + aligned(chunk_entries * sizeof(float));
  l.row_loss = l.dlogits + aligned(chunk_entries * sizeof(uint16_t));
  l.count = l.row_loss + aligned(static_cast<size_t>(s.rows) * sizeof(float));
  l.linear = l.count + aligned(sizeof(int32_t));
  // The chunks' GEMMs run one after another on one stream: one workspace serves both.
  l.linear_bytes = LinearCuda::workspace_bytes(LinearShape{l.chunk, s.dim, s.vocab_padded});
  if (l.tail > 0) {
    l.linear_bytes = std::max(
        l.linear_bytes, LinearCuda::workspace_bytes(LinearShape{l.tail, s.dim, s.vocab_padded}));
  }
  l.total = l.linear + aligned(l.linear_bytes);
  return l;
}

template <class T>
void require(const T* pointer, const char* field) {
  if (pointer == nullptr) refuse(ErrorKind::kInvalidArgument, "LmHeadLossCuda: {} is null", field);
}

template <class T>
T* at(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<unsigned char*>(base) + offset);
}

template <int kVec, bool kGrad>
void launch_cross_entropy(int chunk, const LmHeadLossShape& s, const float* logits,
                          const int32_t* targets, const int32_t* count, float grad_scale,
                          float* row_loss, bf16* dlogits, cudaStream_t stream) {
  cross_entropy_kernel<kVec, kGrad><<<chunk, kThreads, 0, stream>>>(
      s.vocab_padded, s.vocab_size, logits, targets, count, grad_scale, row_loss, dlogits);
  MEGACPP_CUDA_CHECK_LAUNCH("cross_entropy_kernel");
}

}  // namespace

size_t LmHeadLossCuda::workspace_bytes(const LmHeadLossShape& shape) {
  validate(shape);
  return layout_of(shape).total;
}

LmHeadLossCuda::LmHeadLossCuda(const LmHeadLossShape& shape, void* workspace, size_t bytes,
                               GemmPlanCache* cache)
    : shape_(shape) {
  validate(shape);
  const Layout l = layout_of(shape);
  if (bytes < l.total) {
    refuse(ErrorKind::kInvalidArgument,
           "LmHeadLossCuda needs workspace_bytes(shape) = {} bytes of workspace, got {}", l.total,
           bytes);
  }
  require(workspace, "the workspace");
  // cuBLASLt's workspace (LinearCuda's, at an aligned offset) needs 256 bytes; the float4 reads
  // of the logits need 16.
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0) {
    refuse(ErrorKind::kInvalidArgument, "LmHeadLossCuda: the workspace must be 256-byte aligned");
  }
  chunk_rows_ = l.chunk;
  logits_ = at<float>(workspace, l.logits);
  dlogits_ = at<uint16_t>(workspace, l.dlogits);
  row_loss_ = at<float>(workspace, l.row_loss);
  count_ = at<int32_t>(workspace, l.count);
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device_));
  void* linear = at<void>(workspace, l.linear);
  full_ = std::make_unique<LinearCuda>(LinearShape{l.chunk, shape.dim, shape.vocab_padded}, linear,
                                       l.linear_bytes, cache);
  if (l.tail > 0) {
    tail_ = std::make_unique<LinearCuda>(LinearShape{l.tail, shape.dim, shape.vocab_padded}, linear,
                                         l.linear_bytes, cache);
  }
}

LmHeadLossCuda::~LmHeadLossCuda() = default;

void LmHeadLossCuda::forward(const uint16_t* h, const uint16_t* weight, const int32_t* targets,
                             float* loss, int32_t* valid_rows, void* stream) const {
  run(h, weight, targets, 0.f, loss, valid_rows, nullptr, nullptr, stream);
}

void LmHeadLossCuda::forward_backward(const uint16_t* h, const uint16_t* weight,
                                      const int32_t* targets, float grad_scale, float* loss,
                                      int32_t* valid_rows, uint16_t* dh, float* dweight,
                                      void* stream) const {
  require(dh, "forward_backward: dh");
  require(dweight, "forward_backward: dweight");
  run(h, weight, targets, grad_scale, loss, valid_rows, dh, dweight, stream);
}

// dh null: forward only.
void LmHeadLossCuda::run(const uint16_t* h, const uint16_t* weight, const int32_t* targets,
                         float grad_scale, float* loss, int32_t* valid_rows, uint16_t* dh,
                         float* dweight, void* stream) const {
  require(h, "h");
  require(weight, "weight");
  require(targets, "targets");
  require(loss, "loss");
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const LmHeadLossShape& shape = shape_;
  const int chunk = chunk_rows_;
  float* logits = logits_;
  bf16* dlogits = reinterpret_cast<bf16*>(dlogits_);
  float* row_loss = row_loss_;
  int32_t* count = count_;
  const bool grad = dh != nullptr;
  const bool vec = shape.vocab_padded % 4 == 0;

  count_kernel<<<1, kThreads, 0, s>>>(shape.batch_rows(), shape.vocab_size, targets, count);
  targets += shape.first_row;
  MEGACPP_CUDA_CHECK_LAUNCH("count_kernel");
  for (int begin = 0; begin < shape.rows; begin += chunk) {
    const int rows = std::min(chunk, shape.rows - begin);
    const LinearCuda& gemm = rows == chunk ? *full_ : *tail_;
    const int64_t offset = static_cast<int64_t>(begin) * shape.dim;
    gemm.forward(h + offset, weight, nullptr, RowsOut{nullptr, logits}, stream);
    const int32_t* chunk_targets = targets + begin;
    float* chunk_loss = row_loss + begin;
    if (grad && vec) {
      launch_cross_entropy<4, true>(rows, shape, logits, chunk_targets, count, grad_scale,
                                    chunk_loss, dlogits, s);
    } else if (grad) {
      launch_cross_entropy<1, true>(rows, shape, logits, chunk_targets, count, grad_scale,
                                    chunk_loss, dlogits, s);
    } else if (vec) {
      launch_cross_entropy<4, false>(rows, shape, logits, chunk_targets, count, grad_scale,
                                     chunk_loss, nullptr, s);
    } else {
      launch_cross_entropy<1, false>(rows, shape, logits, chunk_targets, count, grad_scale,
                                     chunk_loss, nullptr, s);
    }
    if (grad) {
      gemm.backward(h + offset, weight, dlogits_, RowsOut{dh + offset, nullptr}, dweight, nullptr,
                    /*accumulate=*/true, stream);
    }
  }
  mean_kernel<<<1, kThreads, 0, s>>>(shape.rows, row_loss, count, loss, valid_rows);
  MEGACPP_CUDA_CHECK_LAUNCH("mean_kernel");
}

}  // namespace megacpp::cuda
