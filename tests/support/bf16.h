#pragma once
// bf16 on the host, bit for bit as the GPU converts: the tests' one implementation. A value is
// narrowed to fp32 first (as a kernel holds it), then rounded to nearest even; every NaN becomes
// 0x7fff, CUDA's canonical bf16 NaN (CUDART_NAN_BF16). No CUDA headers: CPU tests may use it too.
#include <cstdint>
#include <cstring>

namespace megacpp::testing {

inline uint16_t to_bf16(double value) {
  const float narrowed = static_cast<float>(value);
  uint32_t word = 0;
  std::memcpy(&word, &narrowed, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  // Adding 0x7fff plus the lowest kept bit rounds half to even; a carry out of the mantissa
  // correctly bumps the exponent (up to infinity).
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}

inline double from_bf16(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float widened = 0.f;
  std::memcpy(&widened, &word, sizeof(widened));
  return static_cast<double>(widened);
}

}  // namespace megacpp::testing
