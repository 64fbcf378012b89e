// The CUDA step's element-wise helpers (kernels/cuda/tensor_ops.h) against their CPU meaning in
// double: the bf16 copy of fp32 weights, the gradient add and the packing of ranges (and back),
// over sizes around the grid-stride bounds. An entry of the oracle harness, plus the refusals.
#include "tests/kernels/cuda/oracle_harness.h"

#ifdef MEGACPP_HAVE_CUDA

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/tensor_ops.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using oracle::DType;
using oracle::Role;

// The ranges packed for a buffer of n: out of order, with gaps, one ending at n (one range
// covering all of a short buffer); or every other element, a range each (more ranges than a grid
// has rows: several launches).
std::vector<std::array<int64_t, 2>> ranges_for(int64_t n, bool every_other) {
  if (every_other) {
    std::vector<std::array<int64_t, 2>> out;
    for (int64_t i = 0; i < n; i += 2) out.push_back({i, 1});
    return out;
  }
  if (n < 7) return {{0, n}};
  return {{n / 2, n / 5}, {0, n / 3}, {n - n / 7, n / 7}};
}

int64_t packed_size(int64_t n, bool every_other) {
  int64_t total = 0;
  for (const auto& r : ranges_for(n, every_other)) total += r[1];
  return total;
}

struct TensorOps {
  static constexpr const char* kName = "TensorOpsCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  using Variant = oracle::Variant;
  struct Case {
    std::string name;
    int64_t n;
    std::vector<Variant> variants;
    bool every_other = false;  // the packing's ranges (ranges_for)
  };

  static std::vector<Case> cases() {
    // One element, a partial block, more elements than the largest grid covers in one pass, and
    // more packed ranges than a grid has rows.
    return {{"n1", 1, {}},
            {"n777", 777, {}},
            {"n5000000", 5000000, {}},
            {"n140001_every_other_element_packed", 140001, {}, true}};
  }

  static void declare(const Case& c, oracle::Problem& p) {
    std::normal_distribution<double> normal(0.0, 1.0);
    const size_t n = static_cast<size_t>(c.n);
    p.input("src", DType::kF32, n, [&] { return normal(p.rng()); });
    p.input("dst_in", DType::kF32, n, [&] { return normal(p.rng()); });
    p.output("copy", DType::kBf16, n, Role::kOutput);
    p.output("sum", DType::kF32, n, Role::kGradient);
    p.output("packed", DType::kF32, static_cast<size_t>(packed_size(c.n, c.every_other)),
             Role::kOutput);
    p.output("unpacked", DType::kF32, n, Role::kOutput);  // dst_in, the ranges taken from src
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    for (int64_t i = 0; i < c.n; ++i) {
      p.out("copy")[i] = p.in("src")[i];
      p.out("sum")[i] = p.in("dst_in")[i] + p.in("src")[i];
      p.out("unpacked")[i] = p.in("dst_in")[i];
    }
    int64_t start = 0;
    for (const auto& [offset, count] : ranges_for(c.n, c.every_other)) {
      for (int64_t i = 0; i < count; ++i) {
        p.out("packed")[start + i] = p.in("src")[offset + i];
        p.out("unpacked")[offset + i] = p.in("src")[offset + i];
      }
      start += count;
    }
  }

  static oracle::Gpu gpu(const Case& c, const Variant&, oracle::DeviceTensors& t) {
    const float* src = t.f32("src");
    const float* dst_in = t.f32("dst_in");
    uint16_t* copy = t.bf16("copy");
    float* sum = t.f32("sum");
    float* packed = t.f32("packed");
    float* unpacked = t.f32("unpacked");
    const int64_t n = c.n;
    std::vector<int64_t> table;
    int64_t start = 0, longest = 0;
    for (const auto& [offset, count] : ranges_for(n, c.every_other)) {
      table.insert(table.end(), {offset, count, start});
      start += count;
      longest = std::max(longest, count);
    }
    const auto device_table =
        std::make_shared<oracle::DeviceBuffer>(table.size() * sizeof(int64_t));
    MEGACPP_CUDA_CHECK(cudaMemcpy(device_table->get(), table.data(), table.size() * sizeof(int64_t),
                                  cudaMemcpyHostToDevice));
    const auto* ranges_table = static_cast<const int64_t*>(device_table->get());
    const int ranges = static_cast<int>(table.size() / 3);
    return {
        {{"cast",
          [=] {
            megacpp::cuda::cast_f32_to_bf16(src, copy, n);
          }},
         {"add",
          [=] {
            MEGACPP_CUDA_CHECK(cudaMemcpy(sum, dst_in, static_cast<size_t>(n) * sizeof(float),
                                          cudaMemcpyDeviceToDevice));
            megacpp::cuda::add_f32(src, sum, n);
          }},
         {"pack and unpack",
          [=] {
            (void)device_table;  // alive as long as the passes
            megacpp::cuda::pack_ranges_f32(src, ranges_table, ranges, longest, packed);
            MEGACPP_CUDA_CHECK(cudaMemcpy(unpacked, dst_in, static_cast<size_t>(n) * sizeof(float),
                                          cudaMemcpyDeviceToDevice));
            megacpp::cuda::unpack_ranges_f32(packed, ranges_table, ranges, longest, unpacked);
          }}},
        {}};
  }
};

TEST(TensorOpsCudaArguments, RefusesNegativeSizesAndNullPointers) {
  MEGACPP_REQUIRE_GPU();
  oracle::DeviceBuffer buffer(64);
  float* f = static_cast<float*>(buffer.get());
  oracle::expect_error([&] { megacpp::cuda::add_f32(f, f, -1); },
                       megacpp::ErrorKind::kInvalidArgument, "n=-1", "a negative size");
  oracle::expect_error([&] { megacpp::cuda::cast_f32_to_bf16(f, nullptr, 4); },
                       megacpp::ErrorKind::kInvalidArgument, "must be set", "a null destination");
  EXPECT_NO_THROW(megacpp::cuda::add_f32(nullptr, nullptr, 0));  // nothing to do
  oracle::expect_error([&] { megacpp::cuda::pack_ranges_f32(f, nullptr, 1, 4, f); },
                       megacpp::ErrorKind::kInvalidArgument, "must be set", "a null table");
  oracle::expect_error([&] { megacpp::cuda::unpack_ranges_f32(f, nullptr, -1, 4, f); },
                       megacpp::ErrorKind::kInvalidArgument, "ranges=-1", "a negative count");
  EXPECT_NO_THROW(megacpp::cuda::pack_ranges_f32(nullptr, nullptr, 0, 0, nullptr));
}

}  // namespace

MEGACPP_ORACLE_ENTRY(TensorOps);

#else
MEGACPP_ORACLE_NO_CUDA(TensorOpsCuda);
#endif
