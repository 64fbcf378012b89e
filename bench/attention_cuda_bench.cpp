// Benchmark of the CUDA causal attention (kernels/cuda/attention.h, or cuDNN's fused attention
// through kernels/cuda/attention_cudnn.h) at A-ref of
// shared/bench/anchors.md (batch 8, seqlen 8192, 16 heads, head_dim 64, causal, bf16): forward,
// backward and forward+backward timed with CUDA events (min/median/max after warm-up), with the
// FLOP rates of ../shared/peer/run_peers.py's sdpa entries (forward 4·B·H·S²·D/2, forward+backward
// 3.5× that), so the two compare in one device call.
//
// Usage: attention_cuda_bench [--repeats N] [--kv-heads H] (GQA: 16 q heads over H kv heads)
//                             [--engine megacpp|cudnn|cudnn-nondeterministic]
// The cuDNN engines' plans are built before timing (the time it took is printed).
// Writes attention_cuda_bench_ENGINE.json under $MEGACPP_RESULTS_DIR when set.
#include <cstdio>

#ifdef MEGACPP_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/check.h"

namespace {

struct Stats {
  double min, median, max;
};

Stats time_it(const std::function<void()>& fn, int repeats) {
  cudaEvent_t start, stop;
  MEGACPP_CUDA_CHECK(cudaEventCreate(&start));
  MEGACPP_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    MEGACPP_CUDA_CHECK(cudaEventRecord(start));
    fn();
    MEGACPP_CUDA_CHECK(cudaEventRecord(stop));
    MEGACPP_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    MEGACPP_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return {ms.front(), ms[ms.size() / 2], ms.back()};
}

uint16_t* random_bf16(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> host(n);
  for (auto& h : host) {
    const float v = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    h = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
  void* device = nullptr;
  MEGACPP_CUDA_CHECK(cudaMalloc(&device, n * 2));
  MEGACPP_CUDA_CHECK(cudaMemcpy(device, host.data(), n * 2, cudaMemcpyHostToDevice));
  return static_cast<uint16_t*>(device);
}

int run(int argc, char** argv) {
  int repeats = 20, kv_heads = 16;
  std::string engine = "megacpp";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--repeats") {
      repeats = std::atoi(argv[i + 1]);
    } else if (a == "--kv-heads") {
      kv_heads = std::atoi(argv[i + 1]);
    } else if (a == "--engine") {
      engine = argv[i + 1];
      if (engine != "megacpp" && engine != "cudnn" && engine != "cudnn-nondeterministic") {
        std::fprintf(stderr, "--engine must be megacpp, cudnn or cudnn-nondeterministic\n");
        return 2;
      }
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  const megacpp::cuda::AttentionShape shape{8, 8192, 16, kv_heads, 64, 0.125};
  const size_t rows = static_cast<size_t>(shape.batch) * shape.seqlen;
  const size_t q_elems = rows * shape.q_heads * shape.head_dim;
  const size_t kv_elems = rows * shape.kv_heads * shape.head_dim;
  uint16_t* q = random_bf16(q_elems, 1);
  uint16_t* k = random_bf16(kv_elems, 2);
  uint16_t* v = random_bf16(kv_elems, 3);
  uint16_t* dout = random_bf16(q_elems, 4);
  uint16_t *out = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float* lse = nullptr;
  void* workspace = nullptr;
  const bool use_cudnn = engine != "megacpp", deterministic = engine == "cudnn";
  const size_t ws = use_cudnn
                        ? megacpp::cuda::CausalAttentionCudnn::workspace_bytes(shape, deterministic)
                        : megacpp::cuda::CausalAttentionCuda::workspace_bytes(shape);
  MEGACPP_CUDA_CHECK(cudaMalloc(&out, q_elems * 2));
  MEGACPP_CUDA_CHECK(cudaMalloc(&dq, q_elems * 2));
  MEGACPP_CUDA_CHECK(cudaMalloc(&dk, kv_elems * 2));
  MEGACPP_CUDA_CHECK(cudaMalloc(&dv, kv_elems * 2));
  MEGACPP_CUDA_CHECK(cudaMalloc(&lse, rows * shape.q_heads * sizeof(float)));
  MEGACPP_CUDA_CHECK(cudaMalloc(&workspace, ws));
  const int q_stride = shape.q_heads * shape.head_dim, kv_stride = shape.kv_heads * shape.head_dim;
  std::unique_ptr<megacpp::cuda::CausalAttentionCuda> own;
  std::unique_ptr<megacpp::cuda::CausalAttentionCudnn> cudnn;
  double plan_ms = 0;
  if (use_cudnn) {
    const auto start = std::chrono::steady_clock::now();
    cudnn = std::make_unique<megacpp::cuda::CausalAttentionCudnn>(shape, q_stride, kv_stride,
                                                                  deterministic, workspace, ws, 0);
    plan_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::printf("%s; plans built in %.0f ms; workspace %zu bytes\n", cudnn->describe().c_str(),
                plan_ms, ws);
  } else {
    own = std::make_unique<megacpp::cuda::CausalAttentionCuda>(shape, workspace, ws);
  }
  const auto forward = [&] {
    if (cudnn) {
      cudnn->forward(q, k, v, out, lse);
    } else {
      own->forward(q, k, v, q_stride, kv_stride, out, lse);
    }
  };
  const auto backward = [&] {
    if (cudnn) {
      cudnn->backward(q, k, v, out, dout, lse, dq, dk, dv);
    } else {
      own->backward(q, k, v, q_stride, kv_stride, out, dout, lse, dq, dk, dv);
    }
  };
  forward();
  const Stats f = time_it(forward, repeats);
  const Stats b = time_it(backward, repeats);
  const Stats fb = time_it(
      [&] {
        forward();
        backward();
      },
      repeats);
  const double flops_f = 4.0 * shape.batch * shape.q_heads * static_cast<double>(shape.seqlen) *
                         shape.seqlen * shape.head_dim / 2;
  nlohmann::json result{
      {"shape", {shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, shape.head_dim}},
      {"engine", engine},
      {"plan_ms", plan_ms},
      {"workspace_bytes", ws},
      {"fwd", {{"min_ms", f.min}, {"median_ms", f.median}, {"max_ms", f.max}}},
      {"bwd", {{"min_ms", b.min}, {"median_ms", b.median}, {"max_ms", b.max}}},
      {"fwd_bwd", {{"min_ms", fb.min}, {"median_ms", fb.median}, {"max_ms", fb.max}}},
      {"fwd_tflops", flops_f / f.median / 1e9},
      {"fwd_bwd_tflops", 3.5 * flops_f / fb.median / 1e9}};
  std::printf(
      "attention A-ref (%s; B 8, S 8192, Hq 16, Hkv %d, D 64, causal): forward %.2f ms "
      "(%.2f-%.2f), backward %.2f ms, forward+backward %.2f ms (%.2f-%.2f); %.0f / %.0f "
      "TFLOP/s\n",
      engine.c_str(), shape.kv_heads, f.median, f.min, f.max, b.median, fb.median, fb.min, fb.max,
      flops_f / f.median / 1e9, 3.5 * flops_f / fb.median / 1e9);
  if (const char* dir = std::getenv("MEGACPP_RESULTS_DIR")) {
    std::ofstream(std::string(dir) + "/attention_cuda_bench_" + engine + ".json")
        << result.dump(1) << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

#else

int main() {
  std::printf("attention_cuda_bench: this build has no CUDA (MEGACPP_CUDA=OFF); nothing to run\n");
  return 0;
}

#endif
