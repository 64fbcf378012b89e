#pragma once
// The oracle harness of the GPU backend's ops, in the spirit of ggml's test-backend-ops: each op
// is declared once, as an entry, and every case of it becomes one test that runs the CUDA op on
// seeded inputs and checks it against the CPU oracle (kernels/cpu in double) on the same
// bf16-rounded values.
//
// ADDING AN OP: one file tests/kernels/cuda/<op>_test.cpp (CMake makes each *_test.cpp a program,
// and tests/**/cuda/ are labelled gpu):
//
//   #include "tests/kernels/cuda/oracle_harness.h"
//   #ifdef MEGACPP_HAVE_CUDA
//   #include "kernels/cpu/my_op.h"   // the oracle
//   #include "kernels/cuda/my_op.h"  // the op under test
//   namespace {
//   namespace oracle = megacpp::testing::oracle;
//   struct MyOp {
//     static constexpr const char* kName = "MyOpCuda";  // the gtest suite of its cases
//     static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;
//     using Variant = oracle::Variant;
//     struct Case {
//       std::string name;               // the test's name: letters, digits, '_'
//       MyShape shape;
//       std::vector<Variant> variants;  // empty: one run, unnamed
//     };
//     static std::vector<Case> cases();
//     static void declare(const Case& c, oracle::Problem& p);  // p.input(...), p.output(...)
//     static void cpu(const Case& c, oracle::Problem& p);      // reads p.in(), writes p.out()
//     static oracle::Gpu gpu(const Case& c, const Variant& v, oracle::DeviceTensors& t);
//   };
//   }  // namespace
//   MEGACPP_ORACLE_ENTRY(MyOp);
//   #else
//   MEGACPP_ORACLE_NO_CUDA(MyOpCuda);
//   #endif
//
// declare() names every tensor once: inputs with their dtype, size and how to draw them from
// p.rng() (seeded from the case's name, so a case always sees the same values), and outputs with
// their dtype, size and role (kOutput or kGradient, which picks the tolerance); p.sections()
// splits a [rows, columns] output into column ranges checked one by one (list every column: the
// others go unchecked). cpu() is the oracle: the CPU op in double on p.in(name) into p.out(name)
// (zeroed). gpu() builds the CUDA op for one variant over t.bf16(name) / t.f32(name) (device
// buffers, null for an empty tensor) and returns its passes (e.g. forward, backward) as closures
// run in order. EXPECT_* may be used in all three, ASSERT_* in declare() and cpu(). An entry may
// also give beyond_device(case): empty, or why this GPU cannot run the case (too little shared
// memory, say), which skips it with that reason. Refusals and other checks that are not "same
// numbers as the oracle" stay plain TESTs in the entry's file (under another suite name than
// kName), with MEGACPP_REQUIRE_GPU() and oracle::expect_error().
//
// TEST MODE (the default), per case: inputs drawn, the oracle run once, then for every variant
// the GPU passes run twice with every output poisoned to NaN first (0xff bytes; an entry the op
// forgets to write shows up as NaN, which fails). The first run is checked against the oracle:
// max|gpu − oracle| / max|oracle| below the tolerance for every output (or column section of
// one); the second must match the first bit for bit, and a variant with same_bits_as = k must
// match variant k bit for bit. A table of the worst errors is printed after the last test.
//
// PERF MODE, MEGACPP_OP_PERF=1: no oracle and no checks; per case and variant, after three
// warm-up runs, each pass (and all passes together) is timed MEGACPP_OP_PERF_REPEATS times
// (default 20) with CUDA events; a table of min / median / max milliseconds is printed.
//
//   build/tests/kernels_cuda_mamba3_scan_test                      # test mode
//   MEGACPP_OP_PERF=1 build/tests/kernels_cuda_mamba3_scan_test    # perf mode
//
// MEGACPP_OP_SEED=N shifts every case's seed (fresh inputs); MEGACPP_RESULTS_DIR=DIR also writes
// the tables (test mode: with every check's error) to DIR/<kName>_oracle.md or _perf.md.
#include <gtest/gtest.h>

#ifdef MEGACPP_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "base/error.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/device_query.h"
#include "tests/support/bf16.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"

namespace megacpp::testing::oracle {

enum class DType { kBf16, kF32 };

// Which tolerance an output is held to.
enum class Role { kOutput, kGradient };

struct Tolerance {
  double output;
  double gradient;
};

// shared/bench/anchors.md: with bf16 tensors, max|gpu − oracle| / max|oracle| < 0.01 for the
// outputs and < 0.012 for each gradient.
inline constexpr Tolerance kBf16Tolerance{0.01, 0.012};

// One way of running a case's op (math variant, cache on or off). An entry may use its own
// type: the harness reads only these two members.
struct Variant {
  std::string name;       // shown in the tables; empty where an op has one way
  int same_bits_as = -1;  // index of an earlier variant whose outputs this one must reproduce
  // A variant that sums in whatever order its engine likes (cuDNN's nondeterministic attention
  // backward): checked against the oracle, but two runs need not give the same bits.
  bool nondeterministic = false;
};

// Whether two runs of variant `v` must give the same bits (an entry's own Variant type may
// leave out the nondeterministic member: then they must).
template <class V>
bool must_repeat_bitwise(const V& v) {
  if constexpr (requires { v.nondeterministic; }) {
    return !v.nondeterministic;
  } else {
    return true;
  }
}

// A column range of a [rows, columns] output, compared on its own.
struct Section {
  std::string name;
  int begin = 0;
  int width = 0;
  // Where the oracle is exactly 0 the GPU must be exactly 0 too: a clamp or mask that has to
  // hold bitwise, not within the tolerance.
  bool exact_zeros = false;
};

inline size_t dtype_bytes(DType dtype) {
  return dtype == DType::kBf16 ? sizeof(uint16_t) : sizeof(float);
}

struct Tensor {
  std::string name;
  DType dtype = DType::kBf16;
  bool is_output = false;
  Role role = Role::kOutput;
  std::vector<double> values;  // an input's rounded values; an output's oracle values
  std::vector<uint8_t> bytes;  // an input's bits, as uploaded
  int columns = 0;             // > 0: compared by `sections` of a [rows, columns] matrix
  std::vector<Section> sections;
  size_t count() const { return values.size(); }
};

// The tensors of one case: what declare() builds, the oracle reads and writes, and the device
// copies.
class Problem {
 public:
  explicit Problem(uint64_t seed) : rng_(seed), seed_(seed) {}

  std::mt19937_64& rng() { return rng_; }
  uint64_t seed() const { return seed_; }

  // `count` values from draw() or draw(i) (i the flat index), called in index order and rounded
  // to `dtype`: the oracle reads the rounded values, the GPU their bits.
  template <class Draw>
  void input(const std::string& name, DType dtype, size_t count, Draw draw) {
    Tensor& t = add(name, dtype, count);
    t.bytes.resize(count * dtype_bytes(dtype));
    for (size_t i = 0; i < count; ++i) {
      double value = 0;
      if constexpr (std::is_invocable_v<Draw&, size_t>) {
        value = static_cast<double>(draw(i));
      } else {
        value = static_cast<double>(draw());
      }
      if (dtype == DType::kBf16) {
        const uint16_t bits = to_bf16(value);
        std::memcpy(t.bytes.data() + i * sizeof(bits), &bits, sizeof(bits));
        t.values[i] = from_bf16(bits);
      } else {
        const float narrowed = static_cast<float>(value);
        std::memcpy(t.bytes.data() + i * sizeof(narrowed), &narrowed, sizeof(narrowed));
        t.values[i] = static_cast<double>(narrowed);
      }
    }
  }

  // An output of the op: poisoned before every GPU run, compared with the oracle, repeatable.
  void output(const std::string& name, DType dtype, size_t count, Role role) {
    Tensor& t = add(name, dtype, count);
    t.is_output = true;
    t.role = role;
  }

  // Compares output `name`, a [rows, columns] matrix, by column sections instead of whole.
  void sections(const std::string& name, int columns, std::vector<Section> list) {
    Tensor& t = find(name);
    t.columns = columns;
    t.sections = std::move(list);
  }

  const double* in(const std::string& name) const { return find(name).values.data(); }
  double* out(const std::string& name) {
    Tensor& t = find(name);
    if (!t.is_output) throw Error(ErrorKind::kInternal, "oracle: " + name + " is an input");
    return t.values.data();
  }
  const std::deque<Tensor>& tensors() const { return tensors_; }

 private:
  Tensor& add(const std::string& name, DType dtype, size_t count) {
    for (const Tensor& t : tensors_) {
      if (t.name == name) throw Error(ErrorKind::kInternal, "oracle: tensor " + name + " twice");
    }
    Tensor& t = tensors_.emplace_back();
    t.name = name;
    t.dtype = dtype;
    t.values.assign(count, 0.0);
    return t;
  }
  Tensor& find(const std::string& name) {
    return const_cast<Tensor&>(static_cast<const Problem&>(*this).find(name));
  }
  const Tensor& find(const std::string& name) const {
    for (const Tensor& t : tensors_) {
      if (t.name == name) return t;
    }
    throw Error(ErrorKind::kInternal, "oracle: no tensor named " + name);
  }

  std::deque<Tensor> tensors_;  // a deque: in()/out() pointers stay valid while tensors are added
  std::mt19937_64 rng_;
  uint64_t seed_;
};

// Device memory owned by the test: the harness's one allocation type.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) MEGACPP_CUDA_CHECK(cudaMalloc(&data_, bytes_));
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return data_; }  // null when empty
  size_t bytes() const { return bytes_; }
  void upload(const void* host) {
    if (bytes_ > 0) MEGACPP_CUDA_CHECK(cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice));
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(bytes_);
    if (bytes_ > 0) {
      MEGACPP_CUDA_CHECK(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost));
    }
    return host;
  }
  // All bits set: NaN as bf16 and as fp32.
  void poison() {
    if (bytes_ > 0) MEGACPP_CUDA_CHECK(cudaMemset(data_, 0xff, bytes_));
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Every tensor of a Problem on the device: inputs uploaded once, outputs allocated.
class DeviceTensors {
 public:
  explicit DeviceTensors(const Problem& problem) : problem_(problem) {
    for (const Tensor& t : problem.tensors()) {
      DeviceBuffer& buffer = buffers_.emplace_back(t.count() * dtype_bytes(t.dtype));
      if (!t.is_output) buffer.upload(t.bytes.data());
    }
  }

  uint16_t* bf16(const std::string& name) {
    return static_cast<uint16_t*>(buffer(name, DType::kBf16).get());
  }
  float* f32(const std::string& name) {
    return static_cast<float*>(buffer(name, DType::kF32).get());
  }

  void poison_outputs() {
    size_t i = 0;
    for (const Tensor& t : problem_.tensors()) {
      if (t.is_output) buffers_[i].poison();
      ++i;
    }
  }
  // The outputs' bytes, in declaration order.
  std::vector<std::vector<uint8_t>> download_outputs() const {
    std::vector<std::vector<uint8_t>> out;
    size_t i = 0;
    for (const Tensor& t : problem_.tensors()) {
      if (t.is_output) out.push_back(buffers_[i].download());
      ++i;
    }
    return out;
  }

 private:
  DeviceBuffer& buffer(const std::string& name, DType dtype) {
    size_t i = 0;
    for (const Tensor& t : problem_.tensors()) {
      if (t.name == name) {
        if (t.dtype != dtype) throw Error(ErrorKind::kInternal, "oracle: " + name + " dtype");
        return buffers_[i];
      }
      ++i;
    }
    throw Error(ErrorKind::kInternal, "oracle: no tensor named " + name);
  }

  const Problem& problem_;
  std::deque<DeviceBuffer> buffers_;  // parallel to problem_.tensors()
};

// One step of the op on the GPU, e.g. forward or backward; asynchronous is fine.
struct Pass {
  std::string name;
  std::function<void()> run;
};

// What gpu() returns: the op's passes, run in order; collect (optional) runs after them, untimed,
// to copy what the op keeps to itself (a saved workspace) into an output.
struct Gpu {
  std::vector<Pass> passes;
  std::function<void()> collect;
};

using megacpp::testing::expect_error;

namespace detail {

inline const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0' ? value : nullptr;
}

inline bool perf_mode() {
  const char* value = env("MEGACPP_OP_PERF");
  return value != nullptr && std::string(value) != "0";
}

inline int perf_repeats() {
  const char* value = env("MEGACPP_OP_PERF_REPEATS");
  return value != nullptr ? std::max(1, std::atoi(value)) : 20;
}

// FNV-1a of "<suite>/<case>", plus MEGACPP_OP_SEED: stable per case, independent of test order
// and of which cases run.
inline uint64_t case_seed(const std::string& suite, const std::string& name) {
  uint64_t hash = 14695981039346656037ull;
  for (const char c : suite + "/" + name) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 1099511628211ull;
  }
  const char* shift = env("MEGACPP_OP_SEED");
  return hash + (shift != nullptr ? std::strtoull(shift, nullptr, 10) : 0);
}

inline double decode(const std::vector<uint8_t>& bytes, DType dtype, size_t i) {
  if (dtype == DType::kBf16) {
    uint16_t bits = 0;
    std::memcpy(&bits, bytes.data() + i * sizeof(bits), sizeof(bits));
    return from_bf16(bits);
  }
  float value = 0.f;
  std::memcpy(&value, bytes.data() + i * sizeof(value), sizeof(value));
  return static_cast<double>(value);
}

struct Check {
  std::string name;
  Role role = Role::kOutput;
  double error = 0;
  double limit = 0;
};

// max|got − want| / max|want| (max|got − want| where want is all zeros) over columns
// [begin, begin + width) of every row of a [rows, columns] matrix; +inf on any non-finite value.
// Counts the entries where want is exactly 0 and got is not.
inline double relative_error(const Tensor& t, const std::vector<uint8_t>& got, size_t columns,
                             size_t begin, size_t width, size_t& nonzero_where_zero) {
  double diff = 0, scale = 0;
  bool finite = true;
  for (size_t row = 0; row < t.count() / columns; ++row) {
    for (size_t i = row * columns + begin; i < row * columns + begin + width; ++i) {
      const double g = decode(got, t.dtype, i), w = t.values[i];
      finite = finite && std::isfinite(g) && std::isfinite(w);
      diff = std::max(diff, std::abs(g - w));
      scale = std::max(scale, std::abs(w));
      if (w == 0.0 && g != 0.0) ++nonzero_where_zero;
    }
  }
  if (!finite) return std::numeric_limits<double>::infinity();
  return scale > 0 ? diff / scale : diff;
}

// Compares one run's outputs with the oracle, with a gtest failure per check over its limit.
// exact_zeros_held: false when a section with exact_zeros has a nonzero where the oracle has 0.
inline std::vector<Check> compare(const Problem& problem,
                                  const std::vector<std::vector<uint8_t>>& outputs,
                                  const Tolerance& tolerance, const std::string& where,
                                  bool& exact_zeros_held) {
  exact_zeros_held = true;
  std::vector<Check> checks;
  size_t k = 0;
  for (const Tensor& t : problem.tensors()) {
    if (!t.is_output) continue;
    const std::vector<uint8_t>& got = outputs[k++];
    const double limit = t.role == Role::kOutput ? tolerance.output : tolerance.gradient;
    if (t.count() == 0) continue;
    if (t.columns == 0) {  // the whole tensor: one row
      size_t ignored = 0;
      const double error = relative_error(t, got, t.count(), 0, t.count(), ignored);
      checks.push_back({t.name, t.role, error, limit});
      continue;
    }
    for (const Section& s : t.sections) {
      if (s.width == 0) continue;
      size_t nonzero_where_zero = 0;
      const double error =
          relative_error(t, got, static_cast<size_t>(t.columns), static_cast<size_t>(s.begin),
                         static_cast<size_t>(s.width), nonzero_where_zero);
      checks.push_back({s.name, t.role, error, limit});
      if (s.exact_zeros) {
        exact_zeros_held = exact_zeros_held && nonzero_where_zero == 0;
        EXPECT_EQ(nonzero_where_zero, 0u)
            << where << ": " << s.name << " is nonzero where the oracle is exactly 0";
      }
    }
  }
  for (const Check& c : checks) {
    EXPECT_LT(c.error, c.limit) << where << ": " << c.name << " max rel err " << c.error;
  }
  return checks;
}

// Bitwise equality of two runs' outputs, with a gtest failure per output that differs.
inline bool same_bits(const Problem& problem, const std::vector<std::vector<uint8_t>>& a,
                      const std::vector<std::vector<uint8_t>>& b, const std::string& what) {
  bool same = true;
  size_t k = 0;
  for (const Tensor& t : problem.tensors()) {
    if (!t.is_output) continue;
    const bool equal = a[k] == b[k];
    ++k;
    EXPECT_TRUE(equal) << t.name << " differs " << what;
    same = same && equal;
  }
  return same;
}

inline std::vector<std::vector<uint8_t>> run_once(Gpu& gpu, DeviceTensors& device) {
  device.poison_outputs();
  for (Pass& pass : gpu.passes) pass.run();
  if (gpu.collect) gpu.collect();
  MEGACPP_CUDA_CHECK(cudaDeviceSynchronize());
  MEGACPP_CUDA_CHECK(cudaGetLastError());
  return device.download_outputs();
}

struct Timing {
  double min_ms = 0, median_ms = 0, max_ms = 0;
};

template <class Body>
Timing time_repeats(int repeats, Body&& body) {
  cudaEvent_t start = nullptr, stop = nullptr;
  MEGACPP_CUDA_CHECK(cudaEventCreate(&start));
  MEGACPP_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    MEGACPP_CUDA_CHECK(cudaEventRecord(start));
    body();
    MEGACPP_CUDA_CHECK(cudaEventRecord(stop));
    MEGACPP_CUDA_CHECK(cudaEventSynchronize(stop));
    float elapsed = 0.f;
    MEGACPP_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
    ms.push_back(static_cast<double>(elapsed));
  }
  MEGACPP_CUDA_CHECK(cudaEventDestroy(start));
  MEGACPP_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  return {ms.front(), n % 2 == 1 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]), ms.back()};
}

struct TestRow {
  std::string case_name, variant;
  uint64_t seed = 0;
  std::vector<Check> checks;
  bool repeatable = false;
  bool bitwise_checked = true;  // false: a nondeterministic variant, not held to it
  bool pass = false;
};

struct PerfRow {
  std::string case_name, variant, pass;
  Timing timing;
};

struct Rows {
  std::vector<TestRow> test;
  std::vector<PerfRow> perf;
};

template <class Entry>
Rows& rows() {
  static Rows all;
  return all;
}

inline std::string worst(const std::vector<Check>& checks, Role role) {
  const Check* found = nullptr;
  for (const Check& c : checks) {
    if (c.role == role && (found == nullptr || c.error > found->error)) found = &c;
  }
  if (found == nullptr) return "-";
  char text[128];
  std::snprintf(text, sizeof(text), "%.2e (%s)", found->error, found->name.c_str());
  return text;
}

inline const char* shown(const std::string& variant) {
  return variant.empty() ? "-" : variant.c_str();
}

inline std::string device_name() {
  cudaDeviceProp prop{};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    return "unknown device";
  }
  return prop.name;
}

inline void publish(const std::string& file, const std::string& summary, const std::string& all) {
  std::printf("%s", summary.c_str());
  std::fflush(stdout);
  if (const char* dir = env("MEGACPP_RESULTS_DIR")) {
    std::ofstream(std::string(dir) + "/" + file) << summary << all;
  }
}

inline void print_tables(const std::string& name, const Rows& r) {
  char line[512];
  if (!r.test.empty()) {
    std::ostringstream summary, all;
    summary << "\n"
            << name << " against the CPU oracle on " << device_name()
            << " (max|gpu - oracle| / max|oracle|; worst output and worst gradient)\n\n"
            << "| case | variant | worst output | worst gradient | repeat bitwise | pass |\n"
            << "|---|---|---|---|---|---|\n";
    all << "\nEvery check:\n\n| case | variant | seed | check | max rel err | limit |\n"
        << "|---|---|---|---|---|---|\n";
    for (const TestRow& row : r.test) {
      std::snprintf(line, sizeof(line), "| %s | %s | %s | %s | %s | %s |\n", row.case_name.c_str(),
                    shown(row.variant), worst(row.checks, Role::kOutput).c_str(),
                    worst(row.checks, Role::kGradient).c_str(),
                    row.bitwise_checked ? (row.repeatable ? "yes" : "NO") : "n/a",
                    row.pass ? "yes" : "NO");
      summary << line;
      for (const Check& c : row.checks) {
        std::snprintf(line, sizeof(line), "| %s | %s | %llu | %s | %.3e | %.3g |\n",
                      row.case_name.c_str(), shown(row.variant),
                      static_cast<unsigned long long>(row.seed), c.name.c_str(), c.error, c.limit);
        all << line;
      }
    }
    publish(name + "_oracle.md", summary.str(), all.str());
  }
  if (!r.perf.empty()) {
    std::ostringstream summary;
    summary
        << "\n"
        << name << " on " << device_name() << ": GPU time per pass, " << perf_repeats()
        << " timed repeats after 3 warm-up runs (CUDA events)\n\n"
        << "| case | variant | pass | min ms | median ms | max ms |\n|---|---|---|---|---|---|\n";
    for (const PerfRow& row : r.perf) {
      std::snprintf(line, sizeof(line), "| %s | %s | %s | %.4f | %.4f | %.4f |\n",
                    row.case_name.c_str(), shown(row.variant), row.pass.c_str(), row.timing.min_ms,
                    row.timing.median_ms, row.timing.max_ms);
      summary << line;
    }
    publish(name + "_perf.md", summary.str(), "");
  }
}

template <class Entry>
class TablePrinter : public ::testing::Environment {
 public:
  void TearDown() override { print_tables(Entry::kName, rows<Entry>()); }
};

template <class Entry>
const std::vector<typename Entry::Case>& cases_of() {
  static const std::vector<typename Entry::Case> cases = Entry::cases();
  return cases;
}

template <class Entry>
std::vector<typename Entry::Variant> variants_of(const typename Entry::Case& c) {
  if (!c.variants.empty()) return c.variants;
  return {typename Entry::Variant{}};
}

template <class Entry>
void perf_case(const typename Entry::Case& c, DeviceTensors& device) {
  const int repeats = perf_repeats();
  for (const auto& v : variants_of<Entry>(c)) {
    Gpu gpu = Entry::gpu(c, v, device);
    const auto all = [&] {
      for (Pass& pass : gpu.passes) pass.run();
    };
    for (int i = 0; i < 3; ++i) all();
    MEGACPP_CUDA_CHECK(cudaDeviceSynchronize());
    for (Pass& pass : gpu.passes) {
      rows<Entry>().perf.push_back({c.name, v.name, pass.name, time_repeats(repeats, pass.run)});
    }
    if (gpu.passes.size() > 1) {
      rows<Entry>().perf.push_back({c.name, v.name, "all", time_repeats(repeats, all)});
    }
  }
}

template <class Entry>
void test_case(const typename Entry::Case& c) {
  const uint64_t seed = case_seed(Entry::kName, c.name);
  SCOPED_TRACE(::testing::Message() << Entry::kName << "." << c.name << " seed " << seed);
  Problem problem(seed);
  Entry::declare(c, problem);
  if (::testing::Test::HasFatalFailure()) return;
  DeviceTensors device(problem);
  if (perf_mode()) {
    perf_case<Entry>(c, device);
    return;
  }
  Entry::cpu(c, problem);
  if (::testing::Test::HasFatalFailure()) return;
  const auto variants = variants_of<Entry>(c);
  std::vector<std::vector<std::vector<uint8_t>>> first_runs;
  for (size_t i = 0; i < variants.size(); ++i) {
    const auto& v = variants[i];
    const std::string where = c.name + (v.name.empty() ? "" : " " + v.name);
    Gpu gpu = Entry::gpu(c, v, device);
    TestRow row{c.name, v.name, seed, {}, false, true, false};
    auto first = run_once(gpu, device);
    bool exact_zeros_held = true;
    row.checks = compare(problem, first, Entry::kTolerance, where, exact_zeros_held);
    const auto second = run_once(gpu, device);
    row.bitwise_checked = must_repeat_bitwise(v);
    row.repeatable = !row.bitwise_checked || same_bits(problem, first, second, "between two runs");
    bool matches_peer = true;
    if (v.same_bits_as >= 0) {
      if (static_cast<size_t>(v.same_bits_as) >= i) {
        throw Error(ErrorKind::kInternal, "oracle: same_bits_as must name an earlier variant");
      }
      const auto& peer = variants[static_cast<size_t>(v.same_bits_as)];
      matches_peer = same_bits(problem, first, first_runs[static_cast<size_t>(v.same_bits_as)],
                               "from variant " + peer.name);
    }
    row.pass = row.repeatable && matches_peer && exact_zeros_held;
    for (const Check& check : row.checks) row.pass = row.pass && check.error < check.limit;
    rows<Entry>().test.push_back(row);
    first_runs.push_back(std::move(first));
  }
}

template <class Entry>
class CaseTest : public ::testing::Test {
 public:
  explicit CaseTest(size_t index) : index_(index) {}
  void TestBody() override {
    std::string why;
    if (!gpu_present(why)) GTEST_SKIP() << "GPU test: no CUDA device (" << why << ")";
    const auto& c = cases_of<Entry>()[index_];
    if constexpr (requires { Entry::beyond_device(c); }) {
      // A case this GPU cannot hold (the entry's own plain test checks that the op refuses it).
      const std::string beyond = Entry::beyond_device(c);
      if (!beyond.empty()) GTEST_SKIP() << "beyond this GPU: " << beyond;
    }
    test_case<Entry>(c);
  }

 private:
  size_t index_;
};

template <class Entry>
bool register_entry(const char* file, int line) {
  const auto& cases = cases_of<Entry>();
  for (size_t i = 0; i < cases.size(); ++i) {
    ::testing::RegisterTest(Entry::kName, cases[i].name.c_str(), nullptr, nullptr, file, line,
                            [i]() -> CaseTest<Entry>* { return new CaseTest<Entry>(i); });
  }
  ::testing::AddGlobalTestEnvironment(new TablePrinter<Entry>);
  return true;
}

}  // namespace detail
}  // namespace megacpp::testing::oracle

// Registers one test per case of Entry (suite Entry::kName), and the tables printed at the end.
#define MEGACPP_ORACLE_ENTRY(Entry)                                    \
  [[maybe_unused]] static const bool megacpp_oracle_entry_##Entry##_ = \
      ::megacpp::testing::oracle::detail::register_entry<Entry>(__FILE__, __LINE__)

#endif  // MEGACPP_HAVE_CUDA

// A build without CUDA: the entry's file shows as one skipped test.
#define MEGACPP_ORACLE_NO_CUDA(Suite)                                      \
  TEST(Suite, NeedsCuda) {                                                 \
    GTEST_SKIP() << "GPU test: this build has no CUDA (MEGACPP_CUDA=OFF)"; \
  }
