// GPU test of the CUDA Mamba-3 scan against the CPU oracle (the chunked form in double,
// which equals the recurrence to 1e-15), fed the same bf16-rounded inputs. Skipped where
// the build has no CUDA or the machine has no GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/mamba3_scan.h"
#include "kernels/cpu/mamba3_scan_chunked.h"
#include "runtime/common/error.h"

#ifdef MEGACPP_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/device_query.h"
#include "kernels/cuda/mamba3_scan.h"
#endif

namespace {

using megacpp::cpu::ScanShape;

#ifdef MEGACPP_HAVE_CUDA

// Round to nearest even, as the device's __float2bfloat16 does.
uint16_t to_bf16(double value) {
  const float f = static_cast<float>(value);
  uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

double from_bf16(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float f = 0.f;
  std::memcpy(&f, &bits, sizeof(f));
  return static_cast<double>(f);
}

void cuda_ok(cudaError_t status, const char* what) {
  ASSERT_EQ(status, cudaSuccess) << what << ": " << cudaGetErrorString(status);
}

// One tensor in three forms: bf16 bits on the host, the same values as double for the
// oracle, and a device copy.
struct Tensor {
  std::vector<uint16_t> bits;
  std::vector<double> values;
  uint16_t* device = nullptr;
};

struct Case {
  ScanShape shape;
  std::string label;
};

std::string shape_label(const ScanShape& s) {
  std::ostringstream out;
  out << "N" << s.state << " P" << s.headdim << " R" << s.rank << " C" << s.chunk << " B" << s.batch
      << " L" << s.seqlen << " H" << s.heads << " G" << s.groups;
  return out.str();
}

ScanShape grid_shape(int n, int p, int r, int chunk) {
  ScanShape s;
  s.batch = 4;
  s.seqlen = 2048;
  s.heads = 16;
  s.groups = 1;
  s.state = n;
  s.headdim = p;
  s.rank = r;
  s.chunk = chunk;
  s.angles = n / 4;
  return s;
}

struct Inputs {
  Tensor q, k, v, z, adt, dt, trap, angles, q_bias, k_bias, mimo_x, mimo_z, mimo_o, d, dy;
};

// Plausible model values: unit-scale q, k, x, z; DT log-uniform in [1e-3, 0.1]; ADT = A·DT
// with A in [-8, -0.5]; biases and mimo weights near their initial values.
Inputs make_inputs(const ScanShape& s, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const size_t tokens = static_cast<size_t>(s.batch) * s.seqlen;
  const size_t qk = tokens * s.rank * s.groups * s.state;
  const size_t xz = tokens * s.heads * s.headdim;
  const size_t th = tokens * s.heads;
  const size_t rn = static_cast<size_t>(s.heads) * s.rank * s.state;
  const size_t rp = static_cast<size_t>(s.heads) * s.rank * s.headdim;
  const double inv_rank = 1.0 / s.rank;
  const auto fill = [](Tensor& t, size_t count, auto draw) {
    t.bits.resize(count);
    t.values.resize(count);
    for (size_t i = 0; i < count; ++i) {
      t.bits[i] = to_bf16(draw());
      t.values[i] = from_bf16(t.bits[i]);
    }
  };
  Inputs in;
  fill(in.q, qk, [&] { return normal(rng); });
  fill(in.k, qk, [&] { return normal(rng); });
  fill(in.v, xz, [&] { return normal(rng); });
  fill(in.z, xz, [&] { return normal(rng); });
  std::vector<double> dt(th);
  for (double& x : dt) x = std::exp(std::log(1e-3) + unit(rng) * (std::log(0.1) - std::log(1e-3)));
  size_t at = 0;
  fill(in.dt, th, [&] { return dt[at++]; });
  at = 0;
  fill(in.adt, th, [&] { return -(0.5 + 7.5 * unit(rng)) * dt[at++]; });
  fill(in.trap, th, [&] { return normal(rng); });
  fill(in.angles, tokens * s.angles, [&] { return normal(rng); });
  fill(in.q_bias, rn, [&] { return 1.0 + 0.3 * normal(rng); });
  fill(in.k_bias, rn, [&] { return 1.0 + 0.3 * normal(rng); });
  fill(in.mimo_x, rp, [&] { return inv_rank * (1.0 + 0.3 * normal(rng)); });
  fill(in.mimo_z, rp, [&] { return 1.0 + 0.3 * normal(rng); });
  fill(in.mimo_o, rp, [&] { return inv_rank * (1.0 + 0.3 * normal(rng)); });
  fill(in.d, static_cast<size_t>(s.heads), [&] { return 0.5 + unit(rng); });
  fill(in.dy, xz, [&] { return normal(rng); });
  return in;
}

template <typename T>
T* device_alloc(size_t count) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) return nullptr;
  return static_cast<T*>(p);
}

void upload(Tensor& t) {
  t.device = device_alloc<uint16_t>(t.bits.size());
  ASSERT_NE(t.device, nullptr);
  cuda_ok(
      cudaMemcpy(t.device, t.bits.data(), t.bits.size() * sizeof(uint16_t), cudaMemcpyHostToDevice),
      "upload");
}

const char* const kGradNames[14] = {"q",      "k",      "v",      "adt",    "dt",
                                    "trap",   "q_bias", "k_bias", "mimo_x", "mimo_z",
                                    "mimo_o", "angles", "d",      "z"};

// Device outputs of one run, as doubles, in kGradNames order after y.
struct DeviceResult {
  std::vector<double> y;
  std::vector<std::vector<double>> grads;        // 14
  std::vector<std::vector<uint16_t>> grad_bits;  // bitwise copies for determinism
};

struct DeviceGrads {
  std::vector<uint16_t*> bf16_grads;  // q k v adt dt trap angles z
  std::vector<float*> f32_grads;      // q_bias k_bias mimo_x mimo_z mimo_o d
  std::vector<size_t> bf16_sizes, f32_sizes;
};

class ScanRunner {
 public:
  ScanRunner(const ScanShape& s, Inputs& in) : shape_(s), in_(in) {
    for (Tensor* t : all()) upload(*t);
    const size_t tokens = static_cast<size_t>(s.batch) * s.seqlen;
    y_size_ = tokens * s.heads * s.headdim;
    y_ = device_alloc<uint16_t>(y_size_);
    const size_t qk = tokens * s.rank * s.groups * s.state;
    const size_t th = tokens * s.heads;
    g_.bf16_sizes = {qk, qk, y_size_, th, th, th, tokens * s.angles, y_size_};
    const size_t rn = static_cast<size_t>(s.heads) * s.rank * s.state;
    const size_t rp = static_cast<size_t>(s.heads) * s.rank * s.headdim;
    g_.f32_sizes = {rn, rn, rp, rp, rp, static_cast<size_t>(s.heads)};
    for (size_t n : g_.bf16_sizes) g_.bf16_grads.push_back(device_alloc<uint16_t>(n));
    for (size_t n : g_.f32_sizes) g_.f32_grads.push_back(device_alloc<float>(n));
  }
  ~ScanRunner() {
    for (Tensor* t : all()) cudaFree(t->device);
    cudaFree(y_);
    for (auto* p : g_.bf16_grads) cudaFree(p);
    for (auto* p : g_.f32_grads) cudaFree(p);
  }

  megacpp::cuda::ScanDeviceInputs inputs() const {
    megacpp::cuda::ScanDeviceInputs d;
    d.q = in_.q.device;
    d.k = in_.k.device;
    d.v = in_.v.device;
    d.z = in_.z.device;
    d.adt = in_.adt.device;
    d.dt = in_.dt.device;
    d.trap = in_.trap.device;
    d.angles = in_.angles.device;
    d.q_bias = in_.q_bias.device;
    d.k_bias = in_.k_bias.device;
    d.mimo_x = in_.mimo_x.device;
    d.mimo_z = in_.mimo_z.device;
    d.mimo_o = in_.mimo_o.device;
    d.d = in_.d.device;
    return d;
  }

  // Poisons every output with NaN, runs forward + backward, copies everything back.
  DeviceResult run(megacpp::cuda::Mamba3ScanCuda& scan) {
    DeviceResult r;
    poison();
    scan.forward(inputs(), y_);
    if (cudaDeviceSynchronize() != cudaSuccess || cudaGetLastError() != cudaSuccess) {
      ADD_FAILURE() << "forward failed";
      return r;
    }
    std::vector<uint16_t> bits(y_size_);
    cudaMemcpy(bits.data(), y_, y_size_ * sizeof(uint16_t), cudaMemcpyDeviceToHost);
    r.y.resize(y_size_);
    for (size_t i = 0; i < y_size_; ++i) r.y[i] = from_bf16(bits[i]);
    megacpp::cuda::ScanDeviceGrads g;
    g.q = g_.bf16_grads[0];
    g.k = g_.bf16_grads[1];
    g.v = g_.bf16_grads[2];
    g.adt = g_.bf16_grads[3];
    g.dt = g_.bf16_grads[4];
    g.trap = g_.bf16_grads[5];
    g.angles = g_.bf16_grads[6];
    g.z = g_.bf16_grads[7];
    g.q_bias = g_.f32_grads[0];
    g.k_bias = g_.f32_grads[1];
    g.mimo_x = g_.f32_grads[2];
    g.mimo_z = g_.f32_grads[3];
    g.mimo_o = g_.f32_grads[4];
    g.d = g_.f32_grads[5];
    scan.backward(inputs(), in_.dy.device, g);
    const cudaError_t status = cudaDeviceSynchronize();
    if (status != cudaSuccess) {
      ADD_FAILURE() << "backward failed: " << cudaGetErrorString(status);
      return r;
    }
    // kGradNames order: q k v adt dt trap q_bias k_bias mimo_x mimo_z mimo_o angles d z.
    const int bf16_index[14] = {0, 1, 2, 3, 4, 5, -1, -1, -1, -1, -1, 6, -1, 7};
    const int f32_index[14] = {-1, -1, -1, -1, -1, -1, 0, 1, 2, 3, 4, -1, 5, -1};
    for (int gi = 0; gi < 14; ++gi) {
      std::vector<double> values;
      std::vector<uint16_t> raw;
      if (bf16_index[gi] >= 0) {
        const size_t n = g_.bf16_sizes[static_cast<size_t>(bf16_index[gi])];
        raw.resize(n);
        cudaMemcpy(raw.data(), g_.bf16_grads[static_cast<size_t>(bf16_index[gi])],
                   n * sizeof(uint16_t), cudaMemcpyDeviceToHost);
        values.resize(n);
        for (size_t i = 0; i < n; ++i) values[i] = from_bf16(raw[i]);
      } else {
        const size_t n = g_.f32_sizes[static_cast<size_t>(f32_index[gi])];
        std::vector<float> f(n);
        cudaMemcpy(f.data(), g_.f32_grads[static_cast<size_t>(f32_index[gi])], n * sizeof(float),
                   cudaMemcpyDeviceToHost);
        raw.resize(n * 2);
        std::memcpy(raw.data(), f.data(), n * sizeof(float));
        values.assign(f.begin(), f.end());
      }
      r.grads.push_back(std::move(values));
      r.grad_bits.push_back(std::move(raw));
    }
    return r;
  }

 private:
  std::vector<Tensor*> all() {
    return {&in_.q,      &in_.k,      &in_.v,      &in_.z,      &in_.adt,
            &in_.dt,     &in_.trap,   &in_.angles, &in_.q_bias, &in_.k_bias,
            &in_.mimo_x, &in_.mimo_z, &in_.mimo_o, &in_.d,      &in_.dy};
  }
  void poison() {
    // 0xFF bytes are NaN both as bf16 and as fp32.
    cudaMemset(y_, 0xff, y_size_ * sizeof(uint16_t));
    for (size_t i = 0; i < g_.bf16_grads.size(); ++i)
      cudaMemset(g_.bf16_grads[i], 0xff, g_.bf16_sizes[i] * sizeof(uint16_t));
    for (size_t i = 0; i < g_.f32_grads.size(); ++i)
      cudaMemset(g_.f32_grads[i], 0xff, g_.f32_sizes[i] * sizeof(float));
  }

  ScanShape shape_;
  Inputs& in_;
  uint16_t* y_ = nullptr;
  size_t y_size_ = 0;
  DeviceGrads g_;
};

struct Reference {
  std::vector<double> y;
  std::vector<std::vector<double>> grads;  // kGradNames order
};

Reference oracle(const ScanShape& s, const Inputs& in) {
  megacpp::cpu::ScanInputs<double> ci;
  ci.q = in.q.values.data();
  ci.k = in.k.values.data();
  ci.v = in.v.values.data();
  ci.z = in.z.values.data();
  ci.adt = in.adt.values.data();
  ci.dt = in.dt.values.data();
  ci.trap = in.trap.values.data();
  ci.angles = in.angles.values.data();
  ci.q_bias = in.q_bias.values.data();
  ci.k_bias = in.k_bias.values.data();
  ci.mimo_x = in.mimo_x.values.data();
  ci.mimo_z = in.mimo_z.values.data();
  ci.mimo_o = in.mimo_o.values.data();
  ci.d = in.d.values.data();
  Reference ref;
  ref.y.resize(in.v.values.size());
  const size_t sizes[14] = {
      in.q.values.size(),      in.k.values.size(),      in.v.values.size(),
      in.adt.values.size(),    in.dt.values.size(),     in.trap.values.size(),
      in.q_bias.values.size(), in.k_bias.values.size(), in.mimo_x.values.size(),
      in.mimo_z.values.size(), in.mimo_o.values.size(), in.angles.values.size(),
      in.d.values.size(),      in.z.values.size()};
  for (size_t n : sizes) ref.grads.emplace_back(n);
  megacpp::cpu::ScanGrads<double> cg;
  cg.q = ref.grads[0].data();
  cg.k = ref.grads[1].data();
  cg.v = ref.grads[2].data();
  cg.adt = ref.grads[3].data();
  cg.dt = ref.grads[4].data();
  cg.trap = ref.grads[5].data();
  cg.q_bias = ref.grads[6].data();
  cg.k_bias = ref.grads[7].data();
  cg.mimo_x = ref.grads[8].data();
  cg.mimo_z = ref.grads[9].data();
  cg.mimo_o = ref.grads[10].data();
  cg.angles = ref.grads[11].data();
  cg.d = ref.grads[12].data();
  cg.z = ref.grads[13].data();
  megacpp::cpu::Mamba3ScanChunked<double> scan(s);
  scan.forward(ci, ref.y.data());
  scan.backward(ci, in.dy.values.data(), cg);
  return ref;
}

// max|got − want| / max|want|; NaN or a size mismatch is +inf.
double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return INFINITY;
  double err = 0, scale = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    err = std::max(err, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return scale > 0 ? err / scale : err;
}

bool gpu_available(std::string& why) {
  const auto info = megacpp::cuda::query_devices();
  if (info.devices.empty()) {
    why = info.error;
    return false;
  }
  return true;
}

struct Row {
  std::string shape;
  double y_err = 0;
  double worst = 0;
  std::string worst_name;
  bool pass = false;
};

std::vector<Row>& table() {
  static std::vector<Row> rows;
  return rows;
}

void print_table() {
  std::ostringstream out;
  out << "| shape | max rel err y | worst gradient | its max rel err | pass |\n";
  out << "|---|---|---|---|---|\n";
  char buffer[256];
  for (const Row& r : table()) {
    std::snprintf(buffer, sizeof(buffer), "| %s | %.2e | %s | %.2e | %s |\n", r.shape.c_str(),
                  r.y_err, r.worst_name.c_str(), r.worst, r.pass ? "yes" : "NO");
    out << buffer;
  }
  std::printf("%s", out.str().c_str());
  if (const char* dir = std::getenv("MEGACPP_RESULTS_DIR")) {
    std::ofstream file(std::string(dir) + "/mamba3_scan_grid.md");
    file << out.str();
  }
}

// Forward + backward on fresh random inputs against the oracle, with the chunk products on
// the tensor cores and on CUDA cores; each also run twice to check determinism.
void check_case(const ScanShape& s, std::mt19937_64& rng) {
  Inputs in = make_inputs(s, rng);
  const Reference ref = oracle(s, in);
  ScanRunner runner(s, in);
  for (bool tensor_cores : {true, false}) {
    megacpp::cuda::Mamba3ScanCuda scan(s, /*psiv_cache=*/false, tensor_cores);
    const DeviceResult got = runner.run(scan);
    Row row;
    row.shape = shape_label(s) + (tensor_cores ? " tensor-core" : " cuda-core");
    row.y_err = relative_error(got.y, ref.y);
    for (size_t gi = 0; gi < 14 && gi < got.grads.size(); ++gi) {
      const double err = relative_error(got.grads[gi], ref.grads[gi]);
      EXPECT_LT(err, 0.012) << row.shape << " gradient " << kGradNames[gi];
      if (err >= row.worst) {
        row.worst = err;
        row.worst_name = kGradNames[gi];
      }
    }
    EXPECT_EQ(got.grads.size(), 14u) << row.shape;
    EXPECT_LT(row.y_err, 0.01) << row.shape;
    row.pass = row.y_err < 0.01 && row.worst < 0.012 && got.grads.size() == 14;
    table().push_back(row);
    // Determinism: a second run on the same inputs gives the same bits.
    const DeviceResult again = runner.run(scan);
    EXPECT_TRUE(got.y == again.y) << row.shape << ": y differs between two runs";
    for (size_t gi = 0; gi < 14 && gi < got.grad_bits.size() && gi < again.grad_bits.size(); ++gi) {
      EXPECT_TRUE(got.grad_bits[gi] == again.grad_bits[gi])
          << row.shape << ": gradient " << kGradNames[gi] << " differs between two runs";
    }
  }
}

#define REQUIRE_GPU()                                                                    \
  do {                                                                                   \
    std::string why;                                                                     \
    if (!gpu_available(why)) GTEST_SKIP() << "GPU test: no CUDA device (" << why << ")"; \
  } while (0)

std::mt19937_64& rng() {
  static std::mt19937_64 generator = [] {
    const uint64_t seed = std::random_device{}();
    std::printf("mamba3_scan_test seed %llu\n", static_cast<unsigned long long>(seed));
    return std::mt19937_64(seed);
  }();
  return generator;
}

#endif  // MEGACPP_HAVE_CUDA

class Mamba3ScanCudaGrid : public ::testing::TestWithParam<std::array<int, 4>> {};

TEST_P(Mamba3ScanCudaGrid, MatchesTheOracle) {
#ifndef MEGACPP_HAVE_CUDA
  GTEST_SKIP() << "GPU test: this build has no CUDA (MEGACPP_CUDA=OFF)";
#else
  REQUIRE_GPU();
  const auto [n, p, r, chunk] = GetParam();
  check_case(grid_shape(n, p, r, chunk), rng());
#endif
}

// The correctness grid of shared/bench/anchors.md: (N, P, R, chunk).
INSTANTIATE_TEST_SUITE_P(
    AnchorsGrid, Mamba3ScanCudaGrid,
    ::testing::Values(std::array<int, 4>{16, 64, 4, 8}, std::array<int, 4>{32, 64, 4, 16},
                      std::array<int, 4>{64, 64, 4, 16}, std::array<int, 4>{128, 64, 4, 16},
                      std::array<int, 4>{256, 64, 4, 8}, std::array<int, 4>{64, 128, 4, 16},
                      std::array<int, 4>{128, 32, 4, 16}, std::array<int, 4>{128, 128, 4, 8},
                      std::array<int, 4>{128, 64, 8, 8}, std::array<int, 4>{128, 64, 2, 32},
                      std::array<int, 4>{128, 64, 1, 64}));

TEST(Mamba3ScanCuda, SeqlenNotAMultipleOfTheChunk) {
#ifndef MEGACPP_HAVE_CUDA
  GTEST_SKIP() << "GPU test: this build has no CUDA (MEGACPP_CUDA=OFF)";
#else
  REQUIRE_GPU();
  ScanShape s = grid_shape(64, 64, 4, 16);
  s.batch = 2;
  s.seqlen = 2043;
  check_case(s, rng());
  s = grid_shape(128, 64, 1, 64);
  s.batch = 2;
  s.seqlen = 1000;
  check_case(s, rng());
#endif
}

TEST(Mamba3ScanCuda, TwoGroups) {
#ifndef MEGACPP_HAVE_CUDA
  GTEST_SKIP() << "GPU test: this build has no CUDA (MEGACPP_CUDA=OFF)";
#else
  REQUIRE_GPU();
  ScanShape s = grid_shape(64, 64, 4, 16);
  s.groups = 2;
  s.batch = 2;
  check_case(s, rng());
#endif
}

TEST(Mamba3ScanCuda, BatchOne) {
#ifndef MEGACPP_HAVE_CUDA
  GTEST_SKIP() << "GPU test: this build has no CUDA (MEGACPP_CUDA=OFF)";
#else
  REQUIRE_GPU();
  ScanShape s = grid_shape(128, 64, 2, 32);
  s.batch = 1;
  check_case(s, rng());
#endif
}

TEST(Mamba3ScanCuda, PsivCacheChangesNoBit) {
#ifndef MEGACPP_HAVE_CUDA
  GTEST_SKIP() << "GPU test: this build has no CUDA (MEGACPP_CUDA=OFF)";
#else
  REQUIRE_GPU();
  ScanShape s = grid_shape(64, 64, 4, 16);
  s.batch = 2;
  s.seqlen = 1000;
  Inputs in = make_inputs(s, rng());
  megacpp::cuda::Mamba3ScanCuda plain(s, false), cached(s, true);
  EXPECT_GT(cached.psiv_bytes(), 0u);
  EXPECT_EQ(plain.psiv_bytes(), 0u);
  ScanRunner runner(s, in);
  const DeviceResult a = runner.run(plain);
  const DeviceResult b = runner.run(cached);
  EXPECT_TRUE(a.y == b.y) << "y differs with the PsiV cache";
  ASSERT_EQ(a.grad_bits.size(), b.grad_bits.size());
  for (size_t gi = 0; gi < a.grad_bits.size(); ++gi) {
    EXPECT_TRUE(a.grad_bits[gi] == b.grad_bits[gi])
        << "gradient " << kGradNames[gi] << " differs with the PsiV cache";
  }
#endif
}

TEST(Mamba3ScanCuda, RefusesShapesItDoesNotCover) {
#ifndef MEGACPP_HAVE_CUDA
  GTEST_SKIP() << "GPU test: this build has no CUDA (MEGACPP_CUDA=OFF)";
#else
  REQUIRE_GPU();
  const auto refused = [](ScanShape s, const std::string& field) {
    try {
      megacpp::cuda::Mamba3ScanCuda scan(s);
      ADD_FAILURE() << "accepted " << shape_label(s);
    } catch (const megacpp::Error& e) {
      EXPECT_EQ(e.kind(), megacpp::ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  ScanShape s = grid_shape(64, 64, 4, 16);
  s.state = 24;
  s.angles = 6;
  refused(s, "state=24");
  s = grid_shape(64, 64, 4, 16);
  s.headdim = 40;
  refused(s, "headdim=40");
  s = grid_shape(64, 64, 1, 8);
  refused(s, "chunk=8");
  s = grid_shape(64, 64, 4, 16);
  s.groups = 3;
  refused(s, "groups=3");
  s = grid_shape(512, 256, 8, 64);
  refused(s, "shared memory");
  // The launch-shape introspection reports every kernel.
  const auto attrs = megacpp::cuda::kernel_attributes(grid_shape(64, 64, 4, 16));
  EXPECT_EQ(attrs.size(), 10u);
  for (const auto& a : attrs) {
    EXPECT_GT(a.registers_per_thread, 0) << a.name;
    EXPECT_GT(a.blocks_per_sm, 0) << a.name;
  }
#endif
}

#ifdef MEGACPP_HAVE_CUDA
// Prints the table once every test has run (and writes it under MEGACPP_RESULTS_DIR).
class TablePrinter : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!table().empty()) print_table();
  }
};
[[maybe_unused]] const auto* const kTablePrinter =
    ::testing::AddGlobalTestEnvironment(new TablePrinter);
#endif

}  // namespace
