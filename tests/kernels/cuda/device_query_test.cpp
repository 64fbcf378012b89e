// GPU test: skipped where the build has no CUDA or the machine has no GPU.
#include <gtest/gtest.h>

#ifdef MEGACPP_HAVE_CUDA
#include "kernels/cuda/device_query.h"
#endif

namespace {

TEST(CudaDevices, RunAKernelOnEveryDevice) {
#ifndef MEGACPP_HAVE_CUDA
  GTEST_SKIP() << "GPU test: this build has no CUDA (MEGACPP_CUDA=OFF)";
#else
  const auto info = megacpp::cuda::query_devices();
  if (info.devices.empty()) GTEST_SKIP() << "GPU test: no CUDA device here (" << info.error << ")";
  EXPECT_GE(info.driver_version, info.runtime_version) << "the driver is older than the runtime";
  for (const auto& device : info.devices) {
    std::vector<float> a(1000, 1.5f), b(1000, 2.0f);
    ASSERT_EQ(megacpp::cuda::vector_add_on_device(device.index, a, b), "") << device.name;
    for (float v : b) ASSERT_EQ(v, 3.5f);
  }
#endif
}

}  // namespace
