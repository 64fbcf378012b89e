// Benchmark of the CUDA Mamba-3 scan (kernels/cuda/mamba3_scan.h) at M3-ref (batch 8,
// seqlen 8192, H 16, G 1, N 64, P 64, R 4, chunk 16) and its SISO variant (R 1, chunk
// 64): forward, backward and forward+backward timed with CUDA events (min/median/max of
// the timed repeats after warm-up), against the two floors (FLOPs over the measured
// matrix-unit rate, minimal bytes over the measured copy bandwidth), plus each kernel's
// registers, shared memory and occupancy, and the PsiV cache on versus off.
//
// Usage: mamba3_scan_cuda_bench [--repeats N] [--batch B] [--heads H] [--chains always|never]
//                               [--head-split always|never] [--sweep always|never]
//                               [--zv-row COLUMNS] [--only mimo|siso]
//                               [--profile-once [--siso | --small R C N]]
//   --batch B, --heads H: M3-ref (and its SISO variant) at B sequences and H heads (a
//     tensor-parallel rank's share of a model's heads: bench-1.3b at TP = 4 is batch 2, heads 16);
//   --chains always|never: the chunk chains forced on or off (ScanChains; by default they run
//     where the (batch, head) pairs are many enough for them to pay);
//   --head-split always|never: chunk_backward's units split into a block per head everywhere or
//     nowhere (ScanHeadSplit; by default the units left over after the last whole wave, where
//     that pays);
//   --sweep always|never: the backward as a sweep (ScanSweep) wherever it applies, or
//     nowhere (by default where the pairs are many enough for it to pay);
//   --only mimo|siso: time only M3-ref's MIMO shape, or only its SISO variant;
//   --zv-row COLUMNS: z and v read in place in rows of COLUMNS elements (z at column 0, v at
//     heads · headdim), as the model reads them in in_proj's output
//     (ScanDeviceInputs::zv_row_stride); without it, each its own dense tensor;
//   --profile-once: one forward + backward at M3-ref and exit (for ncu); MIMO R = 4 chunk 16,
//     or with --siso R = 1 chunk 64;
//   --small R C N: instead, at P 64 with rank R, chunk C and state N, batch 1, seqlen 128 and
//   4 heads, one forward + backward of each variant (tensor cores with the PsiV cache off and on,
//   CUDA cores): for compute-sanitizer's racecheck and synccheck, which run the kernels far
//   slower. N other than 64 takes the kernels compiled for runtime shapes.
// Writes mamba3_scan_cuda_bench.json under $MEGACPP_RESULTS_DIR when set.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "kernels/contracts/mamba3_scan.h"

#ifdef MEGACPP_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/cuda/device_query.h"
#include "kernels/cuda/mamba3_scan.h"
#endif

#ifdef MEGACPP_HAVE_CUDA
namespace {

using megacpp::ops::ScanShape;

void ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

void ok(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: cuBLAS status %d\n", what, static_cast<int>(status));
    std::exit(1);
  }
}

struct Stats {
  double min_ms = 0, median_ms = 0, max_ms = 0;
};

Stats stats_of(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  Stats s;
  s.min_ms = ms.front();
  s.max_ms = ms.back();
  const size_t n = ms.size();
  s.median_ms = n % 2 == 1 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  return s;
}

// Times `body` (already warmed up) `repeats` times with events around each run.
template <class Body>
Stats time_events(int repeats, Body body) {
  cudaEvent_t start, stop;
  ok(cudaEventCreate(&start), "cudaEventCreate");
  ok(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    ok(cudaEventRecord(start), "cudaEventRecord");
    body();
    ok(cudaEventRecord(stop), "cudaEventRecord");
    ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float elapsed = 0.f;
    ok(cudaEventElapsedTime(&elapsed, start, stop), "cudaEventElapsedTime");
    ms.push_back(static_cast<double>(elapsed));
  }
  ok(cudaGetLastError(), "timed body");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return stats_of(ms);
}

// Random bf16 bits with a cheap generator (the values matter, not their quality):
// uniform in [center − spread, center + spread].
std::vector<uint16_t> random_bf16(size_t count, float center, float spread, uint64_t seed) {
  std::vector<uint16_t> out(count);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < count; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    const float unit = static_cast<float>(state >> 40) / static_cast<float>(1ull << 24);
    const float value = center + spread * (2.f * unit - 1.f);
    uint32_t bits = 0;
    std::memcpy(&bits, &value, sizeof(bits));
    bits += 0x7fffu + ((bits >> 16) & 1u);
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

uint16_t* upload(const std::vector<uint16_t>& host) {
  void* p = nullptr;
  ok(cudaMalloc(&p, host.size() * sizeof(uint16_t)), "cudaMalloc");
  ok(cudaMemcpy(p, host.data(), host.size() * sizeof(uint16_t), cudaMemcpyHostToDevice), "upload");
  return static_cast<uint16_t*>(p);
}

template <typename T>
T* scratch(size_t count) {
  void* p = nullptr;
  ok(cudaMalloc(&p, count * sizeof(T)), "cudaMalloc");
  return static_cast<T*>(p);
}

struct Ceilings {
  std::string device;
  double copy_tb_s = 0;     // bytes read + written
  double bf16_tflop_s = 0;  // cuBLAS bf16 GEMM 8192³, fp32 accumulate
  double fp32_tflop_s = 0;  // cuBLAS SGEMM 8192³ (the CUDA-core rate)
};

Ceilings measure_ceilings(int repeats) {
  Ceilings c;
  cudaDeviceProp prop{};
  ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  c.device = prop.name;
  {
    const size_t bytes = size_t{2} << 30;
    void* a = scratch<unsigned char>(bytes);
    void* b = scratch<unsigned char>(bytes);
    ok(cudaMemset(a, 1, bytes), "cudaMemset");
    for (int i = 0; i < 3; ++i) ok(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "copy");
    const Stats s =
        time_events(repeats, [&] { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice); });
    c.copy_tb_s = 2.0 * static_cast<double>(bytes) / (s.median_ms * 1e-3) / 1e12;
    cudaFree(a);
    cudaFree(b);
  }
  cublasHandle_t handle;
  ok(cublasCreate(&handle), "cublasCreate");
  const int n = 8192;
  const size_t elems = static_cast<size_t>(n) * n;
  const double flops = 2.0 * n * static_cast<double>(n) * n;
  {
    uint16_t* a = upload(random_bf16(elems, 0.f, 1.f, 11));
    uint16_t* b = upload(random_bf16(elems, 0.f, 1.f, 12));
    uint16_t* out = scratch<uint16_t>(elems);
    const float one = 1.f, zero = 0.f;
    const auto gemm = [&] {
      ok(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b,
                      CUDA_R_16BF, n, &zero, out, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT),
         "cublasGemmEx");
    };
    for (int i = 0; i < 3; ++i) gemm();
    const Stats s = time_events(std::max(10, repeats / 2), gemm);
    c.bf16_tflop_s = flops / (s.median_ms * 1e-3) / 1e12;
    cudaFree(a);
    cudaFree(b);
    cudaFree(out);
  }
  {
    float* a = scratch<float>(elems);
    float* b = scratch<float>(elems);
    float* out = scratch<float>(elems);
    // Small nonzero values, not zeros (zeros run faster than real data).
    std::vector<float> host(elems);
    for (size_t i = 0; i < elems; ++i)
      host[i] = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f;
    ok(cudaMemcpy(a, host.data(), elems * sizeof(float), cudaMemcpyHostToDevice), "upload");
    ok(cudaMemcpy(b, host.data(), elems * sizeof(float), cudaMemcpyHostToDevice), "upload");
    const float one = 1.f, zero = 0.f;
    const auto gemm = [&] {
      ok(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, n, b, n, &zero, out, n),
         "cublasSgemm");
    };
    for (int i = 0; i < 2; ++i) gemm();
    const Stats s = time_events(5, gemm);
    c.fp32_tflop_s = flops / (s.median_ms * 1e-3) / 1e12;
    cudaFree(a);
    cudaFree(b);
    cudaFree(out);
  }
  cublasDestroy(handle);
  return c;
}

// FLOPs of the matrix products the chunked algorithm performs (2 per multiply-add), and
// the fewest bytes each pass must move (every input read once, every output written once).
struct Work {
  double fwd_flops = 0, bwd_flops = 0;
  double fwd_bytes = 0, bwd_bytes = 0;
  double state_bytes_fwd = 0, state_bytes_bwd = 0;  // this implementation's state traffic
};

// `kernels`: what the scan launches (kernel_attributes), which decides its state traffic.
Work work_of(const ScanShape& s, const std::vector<megacpp::cuda::KernelAttributes>& kernels) {
  const double chunks = std::ceil(static_cast<double>(s.seqlen) / s.chunk);
  const double blocks = static_cast<double>(s.batch) * s.heads * chunks;
  const double m = static_cast<double>(s.chunk) * s.rank, n = s.state, p = s.headdim;
  Work w;
  w.fwd_flops = blocks * 2.0 * (2 * p * n * m + m * m * (n + p));
  w.bwd_flops = blocks * 2.0 * (5 * p * n * m + 3 * m * m * (n + p));
  const double tokens = static_cast<double>(s.batch) * s.seqlen;
  const double qk = tokens * s.rank * s.groups * s.state * 2;
  const double xz = tokens * s.heads * s.headdim * 2;
  const double scalars = tokens * s.heads * 2 * 3 + tokens * s.angles * 2;
  w.fwd_bytes = 2 * qk + 2 * xz + scalars + xz;  // q k v z coefficients, y
  w.bwd_bytes = (2 * qk + 3 * xz + scalars) + (2 * qk + 2 * xz + scalars);  // + dy; grads
  const double matrix = blocks * n * p * 4;
  const auto launches = [&](const char* name) {
    return std::any_of(kernels.begin(), kernels.end(),
                       [&](const megacpp::cuda::KernelAttributes& k) { return k.name == name; });
  };
  const bool sweeps = launches("sweep_core");
  // chunk_forward: each entry state written by its chunk's predecessor and read once; apart, F
  // written, read and written by the pass, the entry read. Where the sweep runs, each entry state
  // is then written again, split, in its own place (Work::states), and the sweep reads that once;
  // otherwise H written, the pass's read and write, G read, E read twice.
  w.state_bytes_fwd = (launches("chunk_forward") ? 2 : 4) * matrix + (sweeps ? matrix : 0);
  w.state_bytes_bwd = (sweeps ? 1 : 6) * matrix;
  return w;
}

struct Measured {
  std::string name;
  bool psiv = false;
  bool tensor = true;
  Stats fwd, bwd, both;
  size_t workspace = 0, psiv_bytes = 0;
  std::vector<megacpp::cuda::KernelAttributes> kernels;
};

struct Problem {
  ScanShape shape;
  std::vector<uint16_t*> tensors;
  megacpp::cuda::ScanDeviceInputs in;
  uint16_t* y = nullptr;
  uint16_t* dy = nullptr;
  megacpp::cuda::ScanDeviceGrads grads;
};

Problem make_problem(const ScanShape& s, int zv_row) {
  Problem pr;
  pr.shape = s;
  const size_t tokens = static_cast<size_t>(s.batch) * s.seqlen;
  const size_t qk = tokens * s.rank * s.groups * s.state;
  const size_t xz = tokens * s.heads * s.headdim;
  const size_t th = tokens * s.heads;
  const size_t rn = static_cast<size_t>(s.heads) * s.rank * s.state;
  const size_t rp = static_cast<size_t>(s.heads) * s.rank * s.headdim;
  const float inv_rank = 1.f / static_cast<float>(s.rank);
  const auto add = [&pr](std::vector<uint16_t> host) {
    pr.tensors.push_back(upload(host));
    return pr.tensors.back();
  };
  pr.in.q = add(random_bf16(qk, 0.f, 1.7f, 1));
  pr.in.k = add(random_bf16(qk, 0.f, 1.7f, 2));
  pr.in.v = add(random_bf16(xz, 0.f, 1.7f, 3));
  pr.in.z = add(random_bf16(xz, 0.f, 1.7f, 4));
  if (zv_row > 0) {
    // The same values, placed in rows of zv_row elements.
    const size_t dense = static_cast<size_t>(s.heads) * s.headdim;
    uint16_t* rows = scratch<uint16_t>(tokens * static_cast<size_t>(zv_row));
    pr.tensors.push_back(rows);
    ok(cudaMemset(rows, 0, tokens * static_cast<size_t>(zv_row) * sizeof(uint16_t)), "memset");
    const std::pair<const uint16_t**, size_t> placed[] = {{&pr.in.z, 0}, {&pr.in.v, dense}};
    for (const auto& [tensor, column] : placed) {
      ok(cudaMemcpy2D(rows + column, static_cast<size_t>(zv_row) * sizeof(uint16_t), *tensor,
                      dense * sizeof(uint16_t), dense * sizeof(uint16_t), tokens,
                      cudaMemcpyDeviceToDevice),
         "placing z and v");
      *tensor = rows + column;
    }
    pr.in.zv_row_stride = zv_row;
  }
  pr.in.adt = add(random_bf16(th, -0.1f, 0.09f, 5));
  pr.in.dt = add(random_bf16(th, 0.05f, 0.045f, 6));
  pr.in.trap = add(random_bf16(th, 0.f, 1.5f, 7));
  pr.in.angles = add(random_bf16(tokens * s.angles, 0.f, 1.5f, 8));
  pr.in.q_bias = add(random_bf16(rn, 1.f, 0.3f, 9));
  pr.in.k_bias = add(random_bf16(rn, 1.f, 0.3f, 10));
  pr.in.mimo_x = add(random_bf16(rp, inv_rank, 0.3f * inv_rank, 11));
  pr.in.mimo_z = add(random_bf16(rp, 1.f, 0.3f, 12));
  pr.in.mimo_o = add(random_bf16(rp, inv_rank, 0.3f * inv_rank, 13));
  pr.in.d = add(random_bf16(static_cast<size_t>(s.heads), 1.f, 0.5f, 14));
  pr.dy = add(random_bf16(xz, 0.f, 1.7f, 15));
  pr.y = scratch<uint16_t>(xz);
  pr.grads.q = scratch<uint16_t>(qk);
  pr.grads.k = scratch<uint16_t>(qk);
  pr.grads.v = scratch<uint16_t>(xz);
  pr.grads.z = scratch<uint16_t>(xz);
  pr.grads.adt = scratch<uint16_t>(th);
  pr.grads.dt = scratch<uint16_t>(th);
  pr.grads.trap = scratch<uint16_t>(th);
  pr.grads.angles = scratch<uint16_t>(std::max<size_t>(tokens * s.angles, 1));
  pr.grads.q_bias = scratch<float>(rn);
  pr.grads.k_bias = scratch<float>(rn);
  pr.grads.mimo_x = scratch<float>(rp);
  pr.grads.mimo_z = scratch<float>(rp);
  pr.grads.mimo_o = scratch<float>(rp);
  pr.grads.d = scratch<float>(static_cast<size_t>(s.heads));
  return pr;
}

void free_problem(Problem& pr) {
  for (uint16_t* t : pr.tensors) cudaFree(t);
  cudaFree(pr.y);
  void* grads[] = {pr.grads.q,      pr.grads.k,      pr.grads.v,      pr.grads.z,
                   pr.grads.adt,    pr.grads.dt,     pr.grads.trap,   pr.grads.angles,
                   pr.grads.q_bias, pr.grads.k_bias, pr.grads.mimo_x, pr.grads.mimo_z,
                   pr.grads.mimo_o, pr.grads.d};
  for (void* g : grads) cudaFree(g);
}

Measured measure(const std::string& name, Problem& pr, bool psiv, bool tensor,
                 megacpp::cuda::ScanChains chains, megacpp::cuda::ScanHeadSplit head_split,
                 megacpp::cuda::ScanSweep sweep, int repeats) {
  Measured m;
  m.name = name;
  m.psiv = psiv;
  m.tensor = tensor;
  megacpp::cuda::Mamba3ScanCuda scan(pr.shape, psiv, tensor, nullptr, 0, chains, head_split, sweep);
  m.workspace = scan.workspace_bytes();
  m.psiv_bytes = scan.psiv_bytes();
  m.kernels = scan.kernel_attributes();
  for (int i = 0; i < 3; ++i) {
    scan.forward(pr.in, pr.y);
    scan.backward(pr.in, pr.dy, pr.grads);
  }
  ok(cudaDeviceSynchronize(), "warm-up");
  m.fwd = time_events(repeats, [&] { scan.forward(pr.in, pr.y); });
  m.bwd = time_events(repeats, [&] { scan.backward(pr.in, pr.dy, pr.grads); });
  m.both = time_events(repeats, [&] {
    scan.forward(pr.in, pr.y);
    scan.backward(pr.in, pr.dy, pr.grads);
  });
  return m;
}

ScanShape m3_ref(int rank, int chunk) {
  ScanShape s;
  s.batch = 8;
  s.seqlen = 8192;
  s.heads = 16;
  s.groups = 1;
  s.state = 64;
  s.headdim = 64;
  s.rank = rank;
  s.chunk = chunk;
  s.angles = 16;
  return s;
}

}  // namespace

static int run(int argc, char** argv) {
  int repeats = 30;
  bool profile_once = false;
  bool small = false, siso = false;
  int small_rank = 0, small_chunk = 0, small_state = 0;
  int batch = 0, heads = 0;  // 0: M3-ref's
  int zv_row = 0;            // 0: z and v dense
  megacpp::cuda::ScanChains chains = megacpp::cuda::ScanChains::kWherePaying;
  megacpp::cuda::ScanHeadSplit head_split = megacpp::cuda::ScanHeadSplit::kWherePaying;
  megacpp::cuda::ScanSweep sweep = megacpp::cuda::ScanSweep::kWherePaying;
  std::string only;  // empty: both shapes
  // A count flag's value: a whole positive number, or the bench refuses it naming the flag (atoi
  // would read "x" or "0" as 0, which means M3-ref's own batch or heads).
  const auto positive = [](const char* flag, const char* text, int& out) {
    const std::string_view s(text);
    int value = 0;
    const auto [end, error] = std::from_chars(s.data(), s.data() + s.size(), value);
    if (error != std::errc{} || end != s.data() + s.size() || value <= 0) {
      std::fprintf(stderr, "mamba3_scan_cuda_bench: %s takes a positive whole number, not %s\n",
                   flag, text);
      return false;
    }
    out = value;
    return true;
  };
  // A forcing flag's value: always or never, or the bench refuses it naming the flag.
  const auto always_or_never = [](const char* flag, const char* text, bool& always) {
    const std::string_view way(text);
    if (way != "always" && way != "never") {
      std::fprintf(stderr, "mamba3_scan_cuda_bench: %s takes always or never, not %s\n", flag,
                   text);
      return false;
    }
    always = way == "always";
    return true;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--repeats" && i + 1 < argc) {
      if (!positive("--repeats", argv[++i], repeats)) return 2;
      repeats = std::max(20, repeats);
    } else if (arg == "--profile-once") {
      profile_once = true;
    } else if (arg == "--siso") {
      siso = true;
    } else if (arg == "--batch" && i + 1 < argc) {
      if (!positive("--batch", argv[++i], batch)) return 2;
    } else if (arg == "--heads" && i + 1 < argc) {
      if (!positive("--heads", argv[++i], heads)) return 2;
    } else if (arg == "--zv-row" && i + 1 < argc) {
      if (!positive("--zv-row", argv[++i], zv_row)) return 2;
    } else if (arg == "--chains" && i + 1 < argc) {
      bool always = false;
      if (!always_or_never("--chains", argv[++i], always)) return 2;
      chains = always ? megacpp::cuda::ScanChains::kAlways : megacpp::cuda::ScanChains::kNever;
    } else if (arg == "--head-split" && i + 1 < argc) {
      bool always = false;
      if (!always_or_never("--head-split", argv[++i], always)) return 2;
      head_split =
          always ? megacpp::cuda::ScanHeadSplit::kAlways : megacpp::cuda::ScanHeadSplit::kNever;
    } else if (arg == "--only" && i + 1 < argc) {
      only = argv[++i];
      if (only != "mimo" && only != "siso") {
        std::fprintf(stderr, "mamba3_scan_cuda_bench: --only takes mimo or siso, not %s\n",
                     only.c_str());
        return 2;
      }
    } else if (arg == "--sweep" && i + 1 < argc) {
      bool always = false;
      if (!always_or_never("--sweep", argv[++i], always)) return 2;
      sweep = always ? megacpp::cuda::ScanSweep::kAlways : megacpp::cuda::ScanSweep::kNever;
    } else if (arg == "--small" && i + 3 < argc) {
      small = true;
      if (!positive("--small R", argv[++i], small_rank) ||
          !positive("--small C", argv[++i], small_chunk) ||
          !positive("--small N", argv[++i], small_state)) {
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "mamba3_scan_cuda_bench: unknown or incomplete argument %s (usage: "
                   "[--repeats N] [--batch B] [--heads H] [--chains always|never] "
                   "[--head-split always|never] [--sweep always|never] [--zv-row COLUMNS] "
                   "[--only mimo|siso] "
                   "[--profile-once [--siso | --small R C N]])\n",
                   arg.c_str());
      return 2;
    }
  }
  if ((batch > 0 || heads > 0) && small) {
    std::fprintf(stderr, "mamba3_scan_cuda_bench: --batch and --heads go without --small\n");
    return 2;
  }
  // M3-ref at another batch or head count (a tensor-parallel rank's share of a model's heads).
  const auto reshaped = [&](ScanShape s) {
    if (batch > 0) s.batch = batch;
    if (heads > 0) s.heads = heads;
    return s;
  };
  std::string shape_note;
  if (batch > 0 || heads > 0) {
    const ScanShape s = reshaped(m3_ref(4, 16));
    shape_note = " (batch " + std::to_string(s.batch) + ", heads " + std::to_string(s.heads) + ")";
  }
  if (zv_row > 0) {
    const ScanShape s = reshaped(m3_ref(4, 16));
    if (small || zv_row < 2 * s.heads * s.headdim) {
      std::fprintf(stderr,
                   "mamba3_scan_cuda_bench: --zv-row %d must hold z and v side by side (at least "
                   "2 · heads · headdim = %d columns) and goes without --small\n",
                   zv_row, 2 * s.heads * s.headdim);
      return 2;
    }
    shape_note += " (z and v in rows of " + std::to_string(zv_row) + " columns)";
  }
  if (siso && (!profile_once || small)) {
    std::fprintf(stderr, "mamba3_scan_cuda_bench: --siso needs --profile-once and no --small\n");
    return 2;
  }
  if (small && (!profile_once || small_rank <= 0 || small_chunk <= 0 || small_state <= 0)) {
    std::fprintf(stderr,
                 "mamba3_scan_cuda_bench: --small R C N needs --profile-once and positive "
                 "R, C and N\n");
    return 2;
  }
  // Read first: a bad kSharedMemoryCapVariable is refused before anything is measured.
  const megacpp::cuda::SharedMemoryLimits shared = megacpp::cuda::current_shared_memory_limits();
  if (profile_once) {
    ScanShape shape = reshaped(siso ? m3_ref(1, 64) : m3_ref(4, 16));
    if (small) {
      shape = m3_ref(small_rank, small_chunk);
      shape.batch = 1;
      shape.seqlen = 128;
      shape.heads = 4;
      shape.state = small_state;
      shape.angles = small_state / 4;
    }
    Problem pr = make_problem(shape, zv_row);
    // (tensor cores, PsiV cache): M3-ref runs the first only.
    const bool variants[3][2] = {{true, false}, {true, true}, {false, false}};
    for (const auto& v : variants) {
      megacpp::cuda::Mamba3ScanCuda scan(pr.shape, v[1], v[0], nullptr, 0, chains, head_split,
                                         sweep);
      scan.forward(pr.in, pr.y);
      scan.backward(pr.in, pr.dy, pr.grads);
      ok(cudaDeviceSynchronize(), "profile run");
      if (!small) break;
    }
    free_problem(pr);
    return 0;
  }
  const Ceilings ceil = measure_ceilings(repeats);
  std::printf("device %s: copy %.2f TB/s, bf16 GEMM %.0f TFLOP/s, fp32 SGEMM %.1f TFLOP/s\n",
              ceil.device.c_str(), ceil.copy_tb_s, ceil.bf16_tflop_s, ceil.fp32_tflop_s);
  if (shared.capped) {
    // The plans are those of a GPU with this much shared memory; residency, clocks and bandwidth
    // are still this GPU's.
    std::printf("shared memory capped by %s: %zu bytes per SM, %zu per block\n",
                megacpp::cuda::kSharedMemoryCapVariable, shared.per_sm, shared.per_block);
  }
  struct Config {
    std::string name;
    ScanShape shape;
  };
  const Config configs[] = {{"M3-ref MIMO R=4 C=16" + shape_note, reshaped(m3_ref(4, 16))},
                            {"M3-ref SISO R=1 C=64" + shape_note, reshaped(m3_ref(1, 64))}};
  std::vector<Measured> results;
  std::vector<Work> works;
  for (const Config& c : configs) {
    if (!only.empty() && (c.shape.rank == 1) != (only == "siso")) continue;
    // A shape whose plan this device cannot hold at its own chunk (the SISO shape in an A100's
    // shared memory) runs at a smaller one: named here and in the tables.
    const int chunk = megacpp::cuda::planned_scan_chunk(c.shape, shared.per_block);
    if (chunk == 0) {
      std::printf("%s: not run: chunk_backward fits this device's shared memory at no chunk\n",
                  c.name.c_str());
      continue;
    }
    std::string name = c.name;
    if (chunk != c.shape.chunk) {
      std::printf(
          "%s: runs at chunk %d: chunk_backward needs %zu bytes of shared memory per block at "
          "chunk %d, this device allows %zu\n",
          c.name.c_str(), chunk, megacpp::cuda::scan_shared_bytes_needed(c.shape), c.shape.chunk,
          shared.per_block);
      name += " (run at chunk " + std::to_string(chunk) + ")";
    }
    // The work (FLOPs, state traffic, floors) of what runs.
    ScanShape run_shape = c.shape;
    run_shape.chunk = chunk;
    Problem pr = make_problem(c.shape, zv_row);
    // Tensor cores with and without the PsiV cache, then the CUDA-core variant.
    const bool variants[3][2] = {{true, false}, {true, true}, {false, false}};
    for (const auto& v : variants) {
      results.push_back(measure(name, pr, v[1], v[0], chains, head_split, sweep, repeats));
      works.push_back(work_of(run_shape, results.back().kernels));
    }
    free_problem(pr);
  }

  // The arithmetic floor of each variant uses the rate of the unit its chunk products run
  // on: the bf16 GEMM rate for the tensor-core variant, the SGEMM rate for the CUDA-core
  // one (both floors are listed).
  std::ostringstream table, json;
  table << "\n| config | math | psiv | pass | min ms | median ms | max ms | GFLOP | MB min | fp32 "
           "floor ms "
           "| bf16 floor ms | bytes floor ms | median / larger floor |\n"
        << "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  char today[16] = {};
  const std::time_t now = std::time(nullptr);
  std::strftime(today, sizeof today, "%Y-%m-%d", std::gmtime(&now));
  json << "{\n  \"device\": \"" << ceil.device << "\",\n  \"date\": \"" << today << "\",\n"
       << "  \"copy_tb_s\": " << ceil.copy_tb_s
       << ",\n  \"bf16_gemm_tflop_s\": " << ceil.bf16_tflop_s
       << ",\n  \"fp32_sgemm_tflop_s\": " << ceil.fp32_tflop_s
       << ",\n  \"shared_memory_per_sm\": " << shared.per_sm
       << ",\n  \"shared_memory_per_block\": " << shared.per_block
       << ",\n  \"shared_memory_capped\": " << (shared.capped ? "true" : "false")
       << ",\n  \"runs\": [\n";
  char line[512];
  for (size_t i = 0; i < results.size(); ++i) {
    const Measured& m = results[i];
    const Work& w = works[i];
    struct Pass {
      const char* name;
      const Stats* stats;
      double flops, bytes;
    };
    const Pass passes[] = {
        {"fwd", &m.fwd, w.fwd_flops, w.fwd_bytes},
        {"bwd", &m.bwd, w.bwd_flops, w.bwd_bytes},
        {"fwd+bwd", &m.both, w.fwd_flops + w.bwd_flops, w.fwd_bytes + w.bwd_bytes}};
    for (const Pass& p : passes) {
      const double fp32_floor = p.flops / (ceil.fp32_tflop_s * 1e12) * 1e3;
      const double bf16_floor = p.flops / (ceil.bf16_tflop_s * 1e12) * 1e3;
      const double bytes_floor = p.bytes / (ceil.copy_tb_s * 1e12) * 1e3;
      const double larger = std::max(m.tensor ? bf16_floor : fp32_floor, bytes_floor);
      std::snprintf(
          line, sizeof(line),
          "| %s | %s | %s | %s | %.3f | %.3f | %.3f | %.1f | %.0f | %.3f | %.3f | %.3f | %.1fx |\n",
          m.name.c_str(), m.tensor ? "tensor" : "fp32", m.psiv ? "on" : "off", p.name,
          p.stats->min_ms, p.stats->median_ms, p.stats->max_ms, p.flops * 1e-9, p.bytes * 1e-6,
          fp32_floor, bf16_floor, bytes_floor, p.stats->median_ms / larger);
      table << line;
      json << "    {\"config\": \"" << m.name
           << "\", \"tensor_cores\": " << (m.tensor ? "true" : "false")
           << ", \"psiv\": " << (m.psiv ? "true" : "false") << ", \"pass\": \"" << p.name
           << "\", \"min_ms\": " << p.stats->min_ms << ", \"median_ms\": " << p.stats->median_ms
           << ", \"max_ms\": " << p.stats->max_ms << ", \"flops\": " << p.flops
           << ", \"min_bytes\": " << p.bytes << ", \"fp32_floor_ms\": " << fp32_floor
           << ", \"bf16_floor_ms\": " << bf16_floor << ", \"bytes_floor_ms\": " << bytes_floor
           << ", \"workspace_bytes\": " << m.workspace << ", \"psiv_bytes\": " << m.psiv_bytes
           << "},\n";
    }
  }
  table << "\n| config | kernel | regs | static smem | dynamic smem | local B | block | grid | "
           "blocks/SM | occupancy |\n|---|---|---|---|---|---|---|---|---|---|\n";
  json << "    null\n  ],\n  \"kernels\": [\n";
  for (size_t i = 0; i < results.size(); ++i) {
    if (results[i].psiv) continue;
    for (const auto& k : results[i].kernels) {
      std::snprintf(
          line, sizeof(line), "| %s | %s | %d | %zu | %zu | %zu | %d | %lld | %d | %.2f |\n",
          (results[i].name + (results[i].tensor ? " tensor" : " fp32")).c_str(), k.name.c_str(),
          k.registers_per_thread, k.static_shared_bytes, k.dynamic_shared_bytes,
          k.local_bytes_per_thread, k.block_threads, k.grid_blocks, k.blocks_per_sm, k.occupancy);
      table << line;
      json << "    {\"config\": \"" << results[i].name
           << "\", \"tensor_cores\": " << (results[i].tensor ? "true" : "false")
           << ", \"kernel\": \"" << k.name << "\", \"registers\": " << k.registers_per_thread
           << ", \"static_smem\": " << k.static_shared_bytes
           << ", \"dynamic_smem\": " << k.dynamic_shared_bytes
           << ", \"local_bytes\": " << k.local_bytes_per_thread
           << ", \"block\": " << k.block_threads << ", \"grid\": " << k.grid_blocks
           << ", \"blocks_per_sm\": " << k.blocks_per_sm << ", \"occupancy\": " << k.occupancy
           << "},\n";
    }
  }
  json << "    null\n  ],\n  \"state_traffic_bytes\": [\n";
  table << "\n| config | workspace MB | psiv MB | state traffic fwd MB | state traffic bwd MB |\n"
        << "|---|---|---|---|---|\n";
  for (size_t i = 0; i < results.size(); ++i) {
    std::snprintf(line, sizeof(line), "| %s %s psiv %s | %.0f | %.0f | %.0f | %.0f |\n",
                  results[i].name.c_str(), results[i].tensor ? "tensor" : "fp32",
                  results[i].psiv ? "on" : "off", static_cast<double>(results[i].workspace) * 1e-6,
                  static_cast<double>(results[i].psiv_bytes) * 1e-6,
                  works[i].state_bytes_fwd * 1e-6, works[i].state_bytes_bwd * 1e-6);
    table << line;
    json << "    {\"config\": \"" << results[i].name
         << "\", \"psiv\": " << (results[i].psiv ? "true" : "false")
         << ", \"fwd\": " << works[i].state_bytes_fwd << ", \"bwd\": " << works[i].state_bytes_bwd
         << "},\n";
  }
  json << "    null\n  ]\n}\n";
  std::printf("%s", table.str().c_str());
  if (const char* dir = std::getenv("MEGACPP_RESULTS_DIR")) {
    std::ofstream(std::string(dir) + "/mamba3_scan_cuda_bench.json") << json.str();
    std::ofstream(std::string(dir) + "/mamba3_scan_cuda_bench.md") << table.str();
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mamba3_scan_cuda_bench: %s\n", e.what());
    return 1;
  }
}

#else  // no CUDA in this build

int main() {
  std::printf(
      "mamba3_scan_cuda_bench: this build has no CUDA (MEGACPP_CUDA=OFF); nothing to run\n");
  return 0;
}

#endif
