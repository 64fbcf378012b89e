#pragma once
// Whether a test can reach a GPU, and the skip every GPU test uses where it cannot (CPU machines
// show GPU tests as skipped, with the runtime's reason). Needs a CUDA build: include it only
// under MEGACPP_HAVE_CUDA.
#include <gtest/gtest.h>

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
