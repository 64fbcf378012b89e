// The whole training step on one GPU (runtime/model/cuda_model.h): step time, tokens/s, model
// FLOP/s (Model::step_flops, the formula of bench/RESULTS.md and ../shared/peer/official_step.py),
// MFU against a bf16 GEMM ceiling measured in the same process (cuBLASLt through LinearCuda,
// 8192³), device memory, the time from the start to the end of the first step, and each op's
// share of the step (CUDA events between neighbouring ops, over the profiled steps).
//
//   cuda_step_bench [--preset bench-350m|bench-1.3b] [--rank 4] [--batch 4] [--seqlen 8192]
//                   [--steps 8] [--cuda-graphs] [--tensor-parallel 1] [--data-parallel 1]
//                   [--no-overlap] [--recompute-in-proj] [--tp-reserved-sms N]
//                   [--tp-copy-engines] [--json FILE]
// --tensor-parallel T --data-parallel D: the step on T·D GPUs (ranks as threads of this process,
// one GPU each, joined by NCCL as the executor's rank processes are); --batch is the global batch
// (each replica takes batch / D). Times are rank 0's; the collectives appear as ops.
// --rank 1 is the SISO variant of the preset (chunk 64, as the official R = 1 path runs).
// --no-overlap: data parallel, the gradients averaged in one all-reduce after the backward rather
// than block by block during it (for the comparison).
// --recompute-in-proj: the Mamba-3 in_proj outputs recomputed in the backward, not kept
// (CudaModelOptions; the recompute_in_proj gate).
// --tp-reserved-sms N: tensor parallel, the SMs the weight-gradient GEMMs leave to the collectives
//   and the norm running beside them (CudaModelOptions::tensor_parallel_reserved_sms; 0: none;
//   left out: the default of the degree).
// --tp-copy-engines: tensor parallel, the all-gathers on the copy engines
//   (CudaModelOptions::tensor_parallel_copy_engines, CudaCommunicator::split's copy_engines).
// --tp-min-ctas N: tensor parallel, the fewest NCCL blocks each of the group's collectives runs
//   on (GroupOptions::min_ctas; 0: NCCL's own; left out: the trainer's kTensorParallelMinCtas).
// --attention cudnn|megacpp: cuDNN's fused attention (the default) or our own kernels.
// --nondeterministic: cuDNN's attention backward sums dQ in any order (the
// nondeterministic_attention gate).
// --cuda-graphs: the timed steps replay the step captured as a CUDA graph (the profiled steps
// after them run eagerly); compare with a run without it for the cuda_graphs gate's receipt.
#include <cstdio>

#ifdef MEGACPP_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/device_query.h"
#include "kernels/cuda/linear.h"
#include "runtime/model/cuda_model.h"
#include "runtime/parallel/cuda_communicator.h"

#include <memory>
#include <mutex>
#include <thread>

namespace {

using megacpp::CudaModel;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string preset = "bench-350m";
  int rank = 4;
  int batch = 4;
  int seqlen = 8192;
  int steps = 8;
  bool cuda_graphs = false;  // replay the step as a captured CUDA graph (CudaModel::set_step_graph)
  int tensor_parallel = 1;
  int data_parallel = 1;
  bool overlap = true;  // CudaModel::set_overlapped_gradient_reduction
  bool recompute_in_proj = false;
  megacpp::AttentionEngine attention = megacpp::AttentionEngine::kCudnn;
  bool deterministic = true;
  int reserved_sms = megacpp::CudaModelOptions::kReservedSmsByDegree;
  bool copy_engines = false;
  int min_ctas = megacpp::parallel::kTensorParallelMinCtas;
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
    if (a == "--preset") {
      o.preset = value();
    } else if (a == "--rank") {
      o.rank = std::stoi(value());
    } else if (a == "--batch") {
      o.batch = std::stoi(value());
    } else if (a == "--seqlen") {
      o.seqlen = std::stoi(value());
    } else if (a == "--steps") {
      o.steps = std::stoi(value());
    } else if (a == "--cuda-graphs") {
      o.cuda_graphs = true;
    } else if (a == "--tensor-parallel") {
      o.tensor_parallel = std::stoi(value());
    } else if (a == "--data-parallel") {
      o.data_parallel = std::stoi(value());
    } else if (a == "--recompute-in-proj") {
      o.recompute_in_proj = true;
    } else if (a == "--attention") {
      o.attention = megacpp::parse_attention_engine(value(), "--attention");
    } else if (a == "--nondeterministic") {
      o.deterministic = false;
    } else if (a == "--tp-reserved-sms") {
      o.reserved_sms = std::stoi(value());
    } else if (a == "--tp-copy-engines") {
      o.copy_engines = true;
    } else if (a == "--tp-min-ctas") {
      o.min_ctas = std::stoi(value());
      if (o.min_ctas < 0 || o.min_ctas > megacpp::parallel::GroupOptions::kMaxCtas) {
        megacpp::fail(megacpp::ErrorKind::kInvalidArgument, "--tp-min-ctas {} must be in [0, {}]",
                      o.min_ctas, megacpp::parallel::GroupOptions::kMaxCtas);
      }
    } else if (a == "--no-overlap") {
      o.overlap = false;
    } else if (a == "--json") {
      o.json = value();
    } else {
      megacpp::fail(megacpp::ErrorKind::kInvalidArgument, "unknown argument {}", a);
    }
  }
  if (o.attention == megacpp::AttentionEngine::kMegacpp && !o.deterministic) {
    megacpp::fail(megacpp::ErrorKind::kInvalidArgument,
                  "--nondeterministic changes nothing with --attention megacpp (our own kernels "
                  "are deterministic)");
  }
  return o;
}

// Median bf16 GEMM rate (FLOP/s) of LinearCuda at 8192³, the ceiling MFU is measured against.
double gemm_ceiling() {
  const int n = 8192;
  const megacpp::cuda::LinearShape shape{n, n, n};
  const size_t ws = megacpp::cuda::LinearCuda::workspace_bytes(shape);
  void *x = nullptr, *w = nullptr, *y = nullptr, *workspace = nullptr;
  const size_t elems = static_cast<size_t>(n) * n;
  MEGACPP_CUDA_CHECK(cudaMalloc(&x, elems * 2));
  MEGACPP_CUDA_CHECK(cudaMalloc(&w, elems * 2));
  MEGACPP_CUDA_CHECK(cudaMalloc(&y, elems * 2));
  MEGACPP_CUDA_CHECK(cudaMalloc(&workspace, ws));
  MEGACPP_CUDA_CHECK(cudaMemset(x, 0, elems * 2));
  MEGACPP_CUDA_CHECK(cudaMemset(w, 0, elems * 2));
  std::vector<double> rates;
  {
    megacpp::cuda::LinearCuda gemm(shape, workspace, ws);
    cudaEvent_t start, stop;
    MEGACPP_CUDA_CHECK(cudaEventCreate(&start));
    MEGACPP_CUDA_CHECK(cudaEventCreate(&stop));
    const auto run = [&] {
      gemm.forward(static_cast<uint16_t*>(x), static_cast<uint16_t*>(w), nullptr,
                   megacpp::cuda::RowsOut{static_cast<uint16_t*>(y), nullptr});
    };
    for (int i = 0; i < 3; ++i) run();
    for (int i = 0; i < 15; ++i) {
      MEGACPP_CUDA_CHECK(cudaEventRecord(start));
      run();
      MEGACPP_CUDA_CHECK(cudaEventRecord(stop));
      MEGACPP_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      MEGACPP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      rates.push_back(2.0 * n * n * static_cast<double>(n) / (ms * 1e-3));
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  cudaFree(x);
  cudaFree(w);
  cudaFree(y);
  cudaFree(workspace);
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

// One rank's run of the benchmark: the model on GPU `device`, its steps timed. Rank 0 reports.
struct RankResult {
  double first_loss = 0;
  double to_first_step = 0;
  // Where the time to the first step goes: (phase, seconds), in order.
  std::vector<std::pair<std::string, double>> phases;
  int scan_chunk = 0;  // 0 without Mamba layers
  std::vector<double> ms;
  size_t in_use = 0;
  size_t planned = 0;
  std::vector<megacpp::OpTime> ops;
};

RankResult run_rank(const Options& o, const megacpp::Model<float>& host,
                    const megacpp::AdamW<float>& moments, const megacpp::OptimizerConfig& optimizer,
                    const std::vector<int32_t>& tokens, Clock::time_point start, int device,
                    const megacpp::CudaModelParallel& parallel) {
  RankResult r;
  const int rows = o.batch / o.data_parallel;
  const int32_t* own =
      tokens.data() + static_cast<size_t>(device / o.tensor_parallel) * rows * (o.seqlen + 1);
  auto mark = Clock::now();
  const auto phase = [&](const char* name) {
    const auto now = Clock::now();
    r.phases.emplace_back(name, std::chrono::duration<double>(now - mark).count());
    mark = now;
  };
  r.phases.emplace_back("host setup (model, init, moments, tokens)",
                        std::chrono::duration<double>(mark - start).count());
  CudaModel model(host, rows, o.seqlen, optimizer, device, parallel, nullptr,
                  megacpp::CudaModelOptions{.recompute_in_proj = o.recompute_in_proj,
                                            .attention = o.attention,
                                            .deterministic = o.deterministic,
                                            .tensor_parallel_reserved_sms = o.reserved_sms,
                                            .tensor_parallel_copy_engines = o.copy_engines});
  phase("CudaModel construction (context, arena, plans)");
  model.upload(host.parameters(), &moments);
  model.set_step_graph(o.cuda_graphs);
  model.set_overlapped_gradient_reduction(o.overlap);
  phase("upload");
  const auto step = [&] {
    model.zero_grad();
    const double loss = model.forward_backward(own, 1.0);
    model.optimizer_step(3e-4);
    return loss;
  };
  r.first_loss = step();
  r.to_first_step = std::chrono::duration<double>(Clock::now() - start).count();
  phase("first step");
  step();
  for (int i = 0; i < o.steps; ++i) {
    const auto t0 = Clock::now();
    step();
    r.ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  r.in_use = model.device_bytes_in_use();
  r.planned = model.memory_plan().total();
  // The chunk the scan runs at: the config's, or less on a GPU with less shared memory.
  for (const auto& k : model.scan_kernel_attributes()) r.scan_chunk = k.chunk;
  // The op breakdown comes from separate, profiled steps: the events are not in the timed ones.
  model.set_profiling(true);
  for (int i = 0; i < 3; ++i) step();
  r.ops = model.op_times();
  model.set_profiling(false);
  return r;
}

// Every rank on its own thread and GPU; returns rank 0's result.
RankResult run_ranks(const Options& o, const megacpp::Model<float>& host,
                     const megacpp::AdamW<float>& moments,
                     const megacpp::OptimizerConfig& optimizer, const std::vector<int32_t>& tokens,
                     Clock::time_point start) {
  const int world = o.tensor_parallel * o.data_parallel, tp = o.tensor_parallel;
  if (world == 1) return run_rank(o, host, moments, optimizer, tokens, start, 0, {});
  if (o.batch % o.data_parallel != 0) {
    megacpp::fail(megacpp::ErrorKind::kInvalidArgument,
                  "--batch {} must be a multiple of --data-parallel {}", o.batch, o.data_parallel);
  }
  const std::string id = megacpp::parallel::CudaCommunicator::new_unique_id();
  std::vector<RankResult> results(static_cast<size_t>(world));
  std::vector<std::string> errors;
  std::mutex mutex;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        megacpp::parallel::CudaCommunicator all(id, world, rank, rank);
        std::unique_ptr<megacpp::parallel::CudaCommunicator> tensor, data;
        if (tp > 1) {
          tensor = all.split(rank / tp, rank % tp,
                             {.copy_engines = o.copy_engines, .min_ctas = o.min_ctas});
        }
        if (o.data_parallel > 1) data = all.split(rank % tp, rank / tp);
        const megacpp::CudaModelParallel parallel{tp, o.data_parallel, rank % tp, tensor.get(),
                                                  data.get()};
        results[static_cast<size_t>(rank)] =
            run_rank(o, host, moments, optimizer, tokens, start, rank, parallel);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors.push_back(fmt::format("rank {}: {}", rank, e.what()));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (!errors.empty()) megacpp::fail(megacpp::ErrorKind::kInternal, "{}", errors.front());
  return results.front();
}

int run(const Options& o) {
  const auto start = Clock::now();
  megacpp::ModelConfig config = megacpp::model_preset(o.preset);
  if (o.rank != config.ssm.mimo_rank) {
    config.ssm.mimo_rank = o.rank;
    config.ssm.chunk_size = 64 / o.rank;
  }
  megacpp::Model<float> host(config);
  host.init_parameters(1);
  megacpp::OptimizerConfig optimizer;
  optimizer.lr = 3e-4;
  megacpp::AdamW<float> moments(host.parameters(), optimizer);
  std::mt19937_64 rng(3);
  std::vector<int32_t> tokens(static_cast<size_t>(o.batch) * (o.seqlen + 1));
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(config.vocab_size));
  const RankResult r = run_ranks(o, host, moments, optimizer, tokens, start);
  const double first_loss = r.first_loss, to_first_step = r.to_first_step;
  const std::vector<double>& ms = r.ms;
  const size_t in_use = r.in_use;
  const std::vector<megacpp::OpTime>& ops = r.ops;

  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const double flops = host.step_flops(o.batch, o.seqlen);
  const double tokens_per_step = static_cast<double>(o.batch) * o.seqlen;
  // MFU is per GPU: the step's FLOPs over every GPU's ceiling.
  const double ceiling = gemm_ceiling() * o.tensor_parallel * o.data_parallel;
  const auto info = megacpp::cuda::query_devices();
  double op_total = 0;
  for (const auto& op : ops) op_total += op.total_ms;

  const std::string run_at = r.scan_chunk > 0 && r.scan_chunk != config.ssm.chunk_size
                                 ? fmt::format(" (run at chunk {})", r.scan_chunk)
                                 : "";
  nlohmann::json out{
      {"device", info.devices.empty() ? "" : info.devices[0].name},
      {"preset", o.preset},
      {"rank", o.rank},
      {"chunk", config.ssm.chunk_size},
      {"scan_chunk_run", r.scan_chunk},
      {"batch", o.batch},
      {"seqlen", o.seqlen},
      {"cuda_graphs", o.cuda_graphs},
      {"tensor_parallel", o.tensor_parallel},
      {"data_parallel", o.data_parallel},
      {"overlapped_gradient_reduction", o.overlap && o.data_parallel > 1},
      {"recompute_in_proj", o.recompute_in_proj},
      {"attention", megacpp::to_string(o.attention)},
      {"deterministic", o.deterministic},
      {"tensor_parallel_reserved_sms",
       megacpp::CudaModelOptions{.tensor_parallel_reserved_sms = o.reserved_sms}.reserved_sms(
           o.tensor_parallel)},
      {"tensor_parallel_copy_engines", o.copy_engines},
      {"tensor_parallel_min_ctas", o.tensor_parallel > 1 ? nlohmann::json(o.min_ctas) : nullptr},
      {"parameters", host.parameters().total()},
      {"first_loss", first_loss},
      {"seconds_to_first_step", to_first_step},
      {"first_step_phases", r.phases},
      {"step_ms", {{"min", sorted.front()}, {"median", median}, {"max", sorted.back()}}},
      {"tokens_per_s", tokens_per_step / (median / 1e3)},
      {"model_flops_per_step", flops},
      {"model_tflops_per_s", flops / (median / 1e3) / 1e12},
      {"gemm_ceiling_tflops_per_s", ceiling / 1e12 / (o.tensor_parallel * o.data_parallel)},
      {"mfu", flops / (median / 1e3) / ceiling},
      {"device_bytes_in_use", in_use},
      {"planned_bytes", r.planned}};  // the arena and the layers' workspaces
  std::printf(
      "%s R=%d chunk %d%s, batch %d x seqlen %d%s%s, %s attention%s, TP=%d DP=%d%s%s: step "
      "min/median/max "
      "%.1f/%.1f/%.1f ms, "
      "%.0f tokens/s, %.1f model TFLOP/s, MFU %.1f%% of the %.0f TFLOP/s GEMM ceiling, "
      "%.1f GiB in use (%.1f planned), first step after %.1f s\n",
      o.preset.c_str(), o.rank, config.ssm.chunk_size, run_at.c_str(), o.batch, o.seqlen,
      o.cuda_graphs ? " (step graph)" : "", o.recompute_in_proj ? " (in_proj recomputed)" : "",
      megacpp::to_string(o.attention), o.deterministic ? "" : " (nondeterministic)",
      o.tensor_parallel, o.data_parallel, o.copy_engines ? " (all-gathers on copy engines)" : "",
      o.data_parallel > 1 ? (o.overlap ? " overlapped" : " not overlapped") : "", sorted.front(),
      median, sorted.back(), tokens_per_step / (median / 1e3), flops / (median / 1e3) / 1e12,
      100 * flops / (median / 1e3) / ceiling,
      ceiling / 1e12 / (o.tensor_parallel * o.data_parallel),
      static_cast<double>(in_use) / (1 << 30), static_cast<double>(r.planned) / (1 << 30),
      to_first_step);
  for (const auto& [name, seconds] : r.phases)
    std::printf("  %-48s %6.2f s\n", name.c_str(), seconds);
  std::printf("%-36s %6s %10s %7s\n", "op (3 profiled steps)", "calls", "ms/step", "share");
  for (const auto& op : ops) {
    std::printf("%-36s %6lld %10.2f %6.1f%%\n", op.op.c_str(), static_cast<long long>(op.calls / 3),
                op.total_ms / 3, 100 * op.total_ms / op_total);
    out["ops"].push_back({{"op", op.op},
                          {"calls_per_step", op.calls / 3},
                          {"ms_per_step", op.total_ms / 3},
                          {"share", op.total_ms / op_total}});
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
  std::fprintf(stderr, "cuda_step_bench: this build has no CUDA backend\n");
  return 2;
}

#endif
