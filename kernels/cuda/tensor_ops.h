#pragma once
// Element-wise helpers of the CUDA training step that belong to no layer: the bf16 copies of
// fp32 master weights (after an upload or a checkpoint load; the optimizer keeps them current
// afterwards), the addition of a gradient an op overwrites (the scan's and preprocessing's
// parameter gradients) into the model's accumulated gradient, and the packing of a buffer's
// scattered ranges into one for a single collective.
//
// Plain C++ (no CUDA types); device pointers owned by the caller; bf16 as uint16_t bit patterns.
// Every element is computed by itself: bitwise reproducible.
#include <cstdint>

namespace megacpp::cuda {

// dst[i] = bf16(src[i]), round to nearest even. n >= 0. Asynchronous.
void cast_f32_to_bf16(const float* src, uint16_t* dst, int64_t n, void* stream = nullptr);

// dst[i] += src[i]. n >= 0. Asynchronous.
void add_f32(const float* src, float* dst, int64_t n, void* stream = nullptr);

// Ranges of one fp32 buffer laid end to end in another, and back: range k is
// whole[offset_k, offset_k + count_k) and packed[start_k, start_k + count_k), start_k the sum of
// the counts before it. `table` is device memory holding the ranges as int64 triples (offset,
// count, start), made once by the caller; `longest` is the largest count. The ranges must not
// overlap. For one collective over many small pieces of a buffer. Asynchronous.
void pack_ranges_f32(const float* whole, const int64_t* table, int ranges, int64_t longest,
                     float* packed, void* stream = nullptr);
void unpack_ranges_f32(const float* packed, const int64_t* table, int ranges, int64_t longest,
                       float* whole, void* stream = nullptr);

}  // namespace megacpp::cuda
