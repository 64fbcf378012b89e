// NCCL all-reduce over the GPUs of this machine (one thread per GPU, as the step's ranks): time,
// algorithm bandwidth (bytes / time) and bus bandwidth (algbw · 2(n-1)/n, the figure nccl-tests
// reports and the links' ceiling), min/median/max over the timed repetitions, for the message
// sizes a tensor-parallel step sends: a row-parallel output in bf16 and an input gradient in fp32
// per layer (batch · seqlen · d_model elements), and a data-parallel gradient reduction.
//
//   nccl_allreduce_bench [--gpus 2] [--bytes N,N,...] [--repeat 20] [--json FILE]
#include <cstdio>

#ifdef MEGACPP_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "kernels/cuda/check.h"
#include "runtime/parallel/cuda_communicator.h"

namespace {

using megacpp::parallel::CollectiveType;
using megacpp::parallel::CudaCommunicator;
using megacpp::parallel::ReduceOp;

struct Options {
  int gpus = 2;
  // bench-1.3b at batch 2 x 8192 on TP=2: 32 Mi elements per layer (64 MiB bf16 forward, 128 MiB
  // fp32 backward); bench-350m's 350M fp32 gradients for DP (1.4 GB); smaller sizes for the curve.
  std::vector<size_t> bytes{size_t{1} << 20,   size_t{16} << 20,  size_t{64} << 20,
                            size_t{128} << 20, size_t{512} << 20, size_t{1400} << 20};
  int repeat = 20;
  std::string json;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) megacpp::fail(megacpp::ErrorKind::kInvalidArgument, "{} needs a value", a);
      return argv[++i];
    };
    if (a == "--gpus") {
      o.gpus = std::stoi(value());
    } else if (a == "--bytes") {
      o.bytes.clear();
      std::stringstream list(value());
      for (std::string item; std::getline(list, item, ',');) o.bytes.push_back(std::stoull(item));
    } else if (a == "--repeat") {
      o.repeat = std::stoi(value());
    } else if (a == "--json") {
      o.json = value();
    } else {
      megacpp::fail(megacpp::ErrorKind::kInvalidArgument, "unknown argument {}", a);
    }
  }
  return o;
}

int run(const Options& o) {
  const std::string id = CudaCommunicator::new_unique_id();
  // Per size: rank 0's times in ms.
  std::vector<std::vector<double>> times(o.bytes.size());
  std::vector<std::string> errors;
  std::mutex mutex;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < o.gpus; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        CudaCommunicator comm(id, o.gpus, rank, rank);
        const size_t largest = *std::max_element(o.bytes.begin(), o.bytes.end());
        void* buffer = nullptr;
        cudaStream_t stream = nullptr;
        cudaEvent_t start = nullptr, stop = nullptr;
        MEGACPP_CUDA_CHECK(cudaMalloc(&buffer, largest));
        MEGACPP_CUDA_CHECK(cudaMemset(buffer, 0, largest));
        MEGACPP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        MEGACPP_CUDA_CHECK(cudaEventCreate(&start));
        MEGACPP_CUDA_CHECK(cudaEventCreate(&stop));
        for (size_t k = 0; k < o.bytes.size(); ++k) {
          const auto count = static_cast<int64_t>(o.bytes[k] / 4);
          for (int i = 0; i < 3; ++i) {
            comm.all_reduce(buffer, count, CollectiveType::kFloat, ReduceOp::kSum, stream);
          }
          for (int i = 0; i < o.repeat; ++i) {
            MEGACPP_CUDA_CHECK(cudaEventRecord(start, stream));
            comm.all_reduce(buffer, count, CollectiveType::kFloat, ReduceOp::kSum, stream);
            MEGACPP_CUDA_CHECK(cudaEventRecord(stop, stream));
            MEGACPP_CUDA_CHECK(cudaEventSynchronize(stop));
            float ms = 0;
            MEGACPP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
            if (rank == 0) times[k].push_back(ms);
          }
        }
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
        cudaStreamDestroy(stream);
        cudaFree(buffer);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors.push_back(e.what());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (!errors.empty()) megacpp::fail(megacpp::ErrorKind::kInternal, "{}", errors.front());
  nlohmann::json out{{"gpus", o.gpus}, {"sizes", nlohmann::json::array()}};
  std::printf("all-reduce (fp32 sum) over %d GPUs, %d repetitions\n", o.gpus, o.repeat);
  std::printf("%12s %28s %12s %12s\n", "bytes", "time ms min/median/max", "algbw GB/s",
              "busbw GB/s");
  const double bus_factor = 2.0 * (o.gpus - 1) / o.gpus;
  for (size_t k = 0; k < o.bytes.size(); ++k) {
    std::vector<double> t = times[k];
    std::sort(t.begin(), t.end());
    const double median = t[t.size() / 2];
    const double algbw = static_cast<double>(o.bytes[k]) / (median * 1e-3) / 1e9;
    std::printf("%12zu %8.3f/%8.3f/%8.3f %12.1f %12.1f\n", o.bytes[k], t.front(), median, t.back(),
                algbw, algbw * bus_factor);
    out["sizes"].push_back({{"bytes", o.bytes[k]},
                            {"ms", {{"min", t.front()}, {"median", median}, {"max", t.back()}}},
                            {"algbw_gb_per_s", algbw},
                            {"busbw_gb_per_s", algbw * bus_factor}});
  }
  if (!o.json.empty()) std::ofstream(o.json) << out.dump(1) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

#else

int main() {
  std::fprintf(stderr, "nccl_allreduce_bench: this build has no CUDA backend\n");
  return 2;
}

#endif
