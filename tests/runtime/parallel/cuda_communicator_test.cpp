// The NCCL communicator with its collective watchdog, on two GPUs (ranks as threads of this
// process). Collectives that finish leave nothing pending and never fire the watchdog; a rank
// whose peer never joins a collective is freed by its watchdog: the spinning kernel returns, the
// reason names the collective and its group, and the rank's next call fails with it.
#include <gtest/gtest.h>

#ifdef MEGACPP_HAVE_CUDA

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "runtime/parallel/collective_watchdog.h"
#include "runtime/parallel/cuda_communicator.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"

namespace megacpp::parallel {
namespace {

constexpr int64_t kCount = 1 << 18;  // 1 MiB of fp32

// Both ranks' bodies on their threads, each with its world communicator (rank r on GPU r).
void run_two(const std::function<void(int, CudaCommunicator&)>& body) {
  const std::string id = CudaCommunicator::new_unique_id();
  std::vector<std::thread> threads;
  std::vector<std::string> failures(2);
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        CudaCommunicator world(id, 2, rank, rank);
        world.set_name("world group (world ranks 0-1)");
        body(rank, world);
      } catch (const std::exception& e) {
        failures[static_cast<size_t>(rank)] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(failures[static_cast<size_t>(rank)], "") << "rank " << rank;
  }
}

struct DeviceBuffer {
  float* data = nullptr;
  cudaStream_t stream = nullptr;
  explicit DeviceBuffer(int device) {
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&data, kCount * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  }
  ~DeviceBuffer() {
    cudaStreamDestroy(stream);
    cudaFree(data);
  }
  void fill(float value) {
    std::vector<float> host(kCount, value);
    EXPECT_EQ(cudaMemcpy(data, host.data(), kCount * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  float first() {
    float v = 0;
    EXPECT_EQ(cudaMemcpy(&v, data, sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

TEST(CudaCommunicator, FinishedCollectivesLeaveNothingPendingAndNeverFireTheWatchdog) {
  MEGACPP_REQUIRE_GPUS(2);
  run_two([](int rank, CudaCommunicator& world) {
    world.track_collectives();
    CollectiveWatchdog dog(60.0, {&world});
    dog.start(0.01);
    DeviceBuffer buffer(rank);
    buffer.fill(static_cast<float>(rank + 1));
    for (int i = 0; i < 20; ++i) {
      world.all_reduce(buffer.data, kCount, CollectiveType::kFloat, ReduceOp::kSum, buffer.stream);
    }
    world.begin_batch();
    world.all_reduce(buffer.data, kCount / 2, CollectiveType::kFloat, ReduceOp::kSum,
                     buffer.stream);
    world.all_reduce(buffer.data + kCount / 2, kCount / 2, CollectiveType::kFloat, ReduceOp::kSum,
                     buffer.stream);
    world.end_batch();
    ASSERT_EQ(cudaStreamSynchronize(buffer.stream), cudaSuccess);
    // 1 + 2 = 3 after the first sum, doubled by each of the 20 after it: 3 · 2^20, exactly.
    EXPECT_EQ(buffer.first(), 3.0f * static_cast<float>(1 << 20));
    EXPECT_EQ(world.sum_over_ranks(rank + 1), 3);
    EXPECT_FALSE(world.oldest_unfinished().has_value());
    EXPECT_EQ(dog.reason(), "");
    EXPECT_EQ(world.asynchronous_error(), "");
  });
}

// Sequence parallelism's pair, in place: each rank gets its half of the sum, then every rank's
// half is gathered back into the whole buffer.
TEST(CudaCommunicator, ReduceScatterAndAllGatherInPlace) {
  MEGACPP_REQUIRE_GPUS(2);
  run_two([](int rank, CudaCommunicator& world) {
    DeviceBuffer buffer(rank);
    std::vector<float> host(kCount);
    for (int64_t i = 0; i < kCount; ++i)
      host[static_cast<size_t>(i)] = static_cast<float>(i % 97 + rank);
    ASSERT_EQ(cudaMemcpy(buffer.data, host.data(), kCount * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    const int64_t half = kCount / 2;
    float* mine = buffer.data + rank * half;
    world.reduce_scatter(buffer.data, mine, half, CollectiveType::kFloat, ReduceOp::kSum,
                         buffer.stream);
    ASSERT_EQ(cudaStreamSynchronize(buffer.stream), cudaSuccess);
    std::vector<float> got(static_cast<size_t>(half));
    ASSERT_EQ(cudaMemcpy(got.data(), mine, half * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int64_t i = 0; i < half; i += 1001) {
      const int64_t global = rank * half + i;
      EXPECT_EQ(got[static_cast<size_t>(i)], static_cast<float>(2 * (global % 97) + 1)) << i;
    }
    world.all_gather(mine, buffer.data, half, CollectiveType::kFloat, buffer.stream);
    ASSERT_EQ(cudaStreamSynchronize(buffer.stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(host.data(), buffer.data, kCount * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int64_t i = 0; i < kCount; i += 1001) {
      EXPECT_EQ(host[static_cast<size_t>(i)], static_cast<float>(2 * (i % 97) + 1)) << i;
    }
  });
}

// Symmetric memory is registered collectively: a rank that cannot allocate its part must not
// leave its peer waiting in the registration. Every rank fails, naming how many could not, and
// the group stays usable. (Needs GPUs that can share symmetric memory: peer access and cuMem,
// as every lent NVLink machine has.)
TEST(CudaCommunicator, ASymmetricAllocationOneRankCannotMakeFailsOnEveryRank) {
  MEGACPP_REQUIRE_GPUS(2);
  run_two([](int rank, CudaCommunicator& world) {
    constexpr size_t kMiB = size_t{1} << 20;
    const size_t beyond_any_gpu = size_t{1} << 50;  // a PiB
    testing::expect_error([&] { world.allocate_symmetric(rank == 1 ? beyond_any_gpu : kMiB); },
                          ErrorKind::kFailedPrecondition,
                          "1 of the world group (world ranks 0-1)'s 2 ranks could not allocate",
                          "rank " + std::to_string(rank));
    void* memory = world.allocate_symmetric(kMiB);
    EXPECT_NE(memory, nullptr);
    world.free_symmetric(memory);
    EXPECT_EQ(world.sum_over_ranks(1), 2);
  });
}

// NCCL takes a group split with a minimum of blocks (it refuses a minimum without a maximum), and
// the group sums as any other; a block count NCCL cannot take is refused before NCCL sees it,
// naming the field. (That the collectives then run on those blocks is NCCL's to say:
// NCCL_DEBUG=INFO's channel ranges, bench/RESULTS.md session 24.)
TEST(CudaCommunicator, GroupsSplitWithAMinimumOfBlocksAreTakenAndSum) {
  MEGACPP_REQUIRE_GPUS(2);
  run_two([](int rank, CudaCommunicator& world) {
    for (const int bad : {-1, GroupOptions::kMaxCtas + 1}) {
      testing::expect_error(
          [&] { world.split(0, rank, {.min_ctas = bad}); }, ErrorKind::kInvalidArgument,
          "GroupOptions.min_ctas=" + std::to_string(bad), "min_ctas " + std::to_string(bad));
    }
    std::unique_ptr<CudaCommunicator> group =
        world.split(0, rank, {.min_ctas = kTensorParallelMinCtas});
    ASSERT_EQ(group->size(), 2);
    DeviceBuffer buffer(rank);
    buffer.fill(static_cast<float>(rank + 1));
    group->all_reduce(buffer.data, kCount, CollectiveType::kFloat, ReduceOp::kSum, buffer.stream);
    ASSERT_EQ(cudaStreamSynchronize(buffer.stream), cudaSuccess);
    EXPECT_EQ(buffer.first(), 3.0f);
  });
}

TEST(CudaCommunicator, TheWatchdogFreesARankWhosePeerNeverJoinsItsCollective) {
  MEGACPP_REQUIRE_GPUS(2);
  std::atomic<bool> rank0_done{false};
  run_two([&](int rank, CudaCommunicator& world) {
    world.track_collectives();
    DeviceBuffer buffer(rank);
    buffer.fill(1.0f);
    // One collective together first: NCCL connects the ranks lazily, on the host, inside the
    // first call (which the watchdog cannot see; the daemon's progress watchdog covers it).
    world.all_reduce(buffer.data, kCount, CollectiveType::kFloat, ReduceOp::kSum, buffer.stream);
    ASSERT_EQ(cudaStreamSynchronize(buffer.stream), cudaSuccess);
    if (rank == 1) {
      // The hung peer: never enters the collective; leaves once rank 0 has been freed.
      while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      world.abort("the test ends the peer");
      return;
    }
    CollectiveWatchdog dog(1.0, {&world});
    dog.start(0.01);
    const auto enqueued = std::chrono::steady_clock::now();
    world.all_reduce(buffer.data, kCount, CollectiveType::kFloat, ReduceOp::kSum, buffer.stream);
    // Without the watchdog this would wait for ever; the abort ends the kernel.
    cudaStreamSynchronize(buffer.stream);
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - enqueued).count();
    rank0_done.store(true);
    EXPECT_GE(waited, 1.0);
    const std::string reason = dog.reason();
    EXPECT_NE(reason.find("all-reduce of 1.0 MiB fp32 (collective 2 of the world group (world "
                          "ranks 0-1))"),
              std::string::npos)
        << reason;
    EXPECT_TRUE(world.aborted());
    try {
      world.all_reduce(buffer.data, kCount, CollectiveType::kFloat, ReduceOp::kSum, buffer.stream);
      ADD_FAILURE() << "a collective on an aborted communicator was enqueued";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kFailedPrecondition);
      EXPECT_NE(std::string(e.what()).find("NCCL world group (world ranks 0-1) aborted: "
                                           "collective watchdog"),
                std::string::npos)
          << e.what();
    }
    std::printf("rank 0 freed %.2f s after enqueueing: %s\n", waited, reason.c_str());
  });
}

}  // namespace
}  // namespace megacpp::parallel

#else

TEST(CudaCommunicator, NeedsACudaBuild) {
  GTEST_SKIP() << "GPU test: this build has no CUDA (MEGACPP_CUDA=OFF)";
}

#endif
