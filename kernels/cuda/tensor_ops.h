#pragma once
// Element-wise helpers of the CUDA training step that belong to no layer: the bf16 copies of
// fp32 master weights (after an upload or a checkpoint load; the optimizer keeps them current
// afterwards) and the addition of a gradient an op overwrites (the scan's and preprocessing's
// parameter gradients) into the model's accumulated gradient.
//
// Plain C++ (no CUDA types); device pointers owned by the caller; bf16 as uint16_t bit patterns.
// Every element is computed by itself: bitwise reproducible.
#include <cstdint>

namespace megacpp::cuda {

// dst[i] = bf16(src[i]), round to nearest even. n >= 0. Asynchronous.
void cast_f32_to_bf16(const float* src, uint16_t* dst, int64_t n, void* stream = nullptr);

// dst[i] += src[i]. n >= 0. Asynchronous.
void add_f32(const float* src, float* dst, int64_t n, void* stream = nullptr);

}  // namespace megacpp::cuda
