// GPU test: skipped where the build has no CUDA or the machine has no GPU. The shared-memory cap's
// arithmetic and refusals need no GPU and run wherever the build has CUDA.
#include <gtest/gtest.h>

#ifdef MEGACPP_HAVE_CUDA
#include <string>

#include "base/error.h"
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

#ifdef MEGACPP_HAVE_CUDA
using megacpp::cuda::cap_shared_memory;
using megacpp::cuda::SharedMemoryLimits;

constexpr SharedMemoryLimits kHopper{233472, 232448, false};  // an H100's figures

TEST(SharedMemoryCap, UnsetOrEmptyLeavesTheDeviceAsItIs) {
  for (const char* value : {static_cast<const char*>(nullptr), ""}) {
    const SharedMemoryLimits got = cap_shared_memory(kHopper, value);
    EXPECT_EQ(got.per_sm, kHopper.per_sm);
    EXPECT_EQ(got.per_block, kHopper.per_block);
    EXPECT_FALSE(got.capped);
  }
}

TEST(SharedMemoryCap, AnA100sFiguresOnAnH100KeepTheReservationPerBlock) {
  const SharedMemoryLimits got = cap_shared_memory(kHopper, "167936");
  EXPECT_EQ(got.per_sm, 167936u);
  EXPECT_EQ(got.per_block, 166912u);  // an A100's opt-in per block
  EXPECT_TRUE(got.capped);
  // The device's own figure is allowed and changes nothing but the flag.
  const SharedMemoryLimits same = cap_shared_memory(kHopper, "233472");
  EXPECT_EQ(same.per_sm, kHopper.per_sm);
  EXPECT_EQ(same.per_block, kHopper.per_block);
  EXPECT_TRUE(same.capped);
}

TEST(SharedMemoryCap, RefusesAnythingButBytesWithinTheDevicesRangeNamingTheVariable) {
  for (const char* value : {"abc", "167936 ", " 167936", "-1", "+167936", "1.5e5", "167936B",
                            "49151", "0", "233473", "99999999999999999999999"}) {
    try {
      cap_shared_memory(kHopper, value);
      ADD_FAILURE() << "accepted '" << value << "'";
    } catch (const megacpp::Error& e) {
      EXPECT_EQ(e.kind(), megacpp::ErrorKind::kInvalidArgument);
      const std::string message = e.what();
      EXPECT_NE(message.find("MEGACPP_CUDA_SHARED_MEMORY_PER_SM='" + std::string(value) + "'"),
                std::string::npos)
          << message;
      EXPECT_NE(message.find("from 49152 to this device's 233472 per SM"), std::string::npos)
          << message;
    }
  }
  EXPECT_EQ(cap_shared_memory(kHopper, "49152").per_block, 49152u - 1024u);
}
#endif

}  // namespace
