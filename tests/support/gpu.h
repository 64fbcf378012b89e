#pragma once
// Whether a test can reach a GPU, and the skip every GPU test uses where it cannot (CPU machines
// show GPU tests as skipped, with the runtime's reason). Needs a CUDA build: include it only
// under MEGACPP_HAVE_CUDA.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/device_query.h"

namespace megacpp::testing {

inline bool gpu_present(std::string& why, size_t count = 1) {
  const auto info = cuda::query_devices();
  if (info.devices.empty()) why = info.error;
  if (!info.devices.empty() && info.devices.size() < count) {
    why =
        std::to_string(info.devices.size()) + " device(s), the test needs " + std::to_string(count);
  }
  return info.devices.size() >= count;
}

// The GPUs a several-GPU test runs over: the largest power of two up to 8 the machine has (so
// that every rank count divides the test models' heads).
inline int gpu_world() {
  const auto devices = static_cast<int>(cuda::query_devices().devices.size());
  int world = 1;
  while (world * 2 <= std::min(devices, 8)) world *= 2;
  return world;
}

}  // namespace megacpp::testing

// Skips the calling test where no GPU is present.
#define MEGACPP_REQUIRE_GPU()                                              \
  do {                                                                     \
    std::string megacpp_why_;                                              \
    if (!::megacpp::testing::gpu_present(megacpp_why_)) {                  \
      GTEST_SKIP() << "GPU test: no CUDA device (" << megacpp_why_ << ")"; \
    }                                                                      \
  } while (0)

// Skips the calling test where fewer than `count` GPUs are present (multi-GPU tests).
#define MEGACPP_REQUIRE_GPUS(count)                                                            \
  do {                                                                                         \
    std::string megacpp_why_;                                                                  \
    if (!::megacpp::testing::gpu_present(megacpp_why_, count)) {                               \
      GTEST_SKIP() << "multi-GPU test: needs " << (count) << " CUDA devices (" << megacpp_why_ \
                   << ")";                                                                     \
    }                                                                                          \
  } while (0)
