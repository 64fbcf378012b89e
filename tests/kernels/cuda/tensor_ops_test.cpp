// The CUDA step's element-wise helpers (kernels/cuda/tensor_ops.h) against their CPU meaning in
// double: the bf16 copy of fp32 weights and the gradient add, over sizes around the grid-stride
// bounds. An entry of the oracle harness, plus the refusals.
#include "tests/kernels/cuda/oracle_harness.h"

#ifdef MEGACPP_HAVE_CUDA

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/tensor_ops.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using oracle::DType;
using oracle::Role;

struct TensorOps {
  static constexpr const char* kName = "TensorOpsCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  using Variant = oracle::Variant;
  struct Case {
    std::string name;
    int64_t n;
    std::vector<Variant> variants;
  };

  static std::vector<Case> cases() {
    // One element, a partial block, and more elements than the largest grid covers in one pass.
    return {{"n1", 1, {}}, {"n777", 777, {}}, {"n5000000", 5000000, {}}};
  }

  static void declare(const Case& c, oracle::Problem& p) {
    std::normal_distribution<double> normal(0.0, 1.0);
    const size_t n = static_cast<size_t>(c.n);
    p.input("src", DType::kF32, n, [&] { return normal(p.rng()); });
    p.input("dst_in", DType::kF32, n, [&] { return normal(p.rng()); });
    p.output("copy", DType::kBf16, n, Role::kOutput);
    p.output("sum", DType::kF32, n, Role::kGradient);
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    for (int64_t i = 0; i < c.n; ++i) {
      p.out("copy")[i] = p.in("src")[i];
      p.out("sum")[i] = p.in("dst_in")[i] + p.in("src")[i];
    }
  }

  static oracle::Gpu gpu(const Case& c, const Variant&, oracle::DeviceTensors& t) {
    const float* src = t.f32("src");
    const float* dst_in = t.f32("dst_in");
    uint16_t* copy = t.bf16("copy");
    float* sum = t.f32("sum");
    const int64_t n = c.n;
    return {{{"cast",
              [=] {
                megacpp::cuda::cast_f32_to_bf16(src, copy, n);
              }},
             {"add",
              [=] {
                MEGACPP_CUDA_CHECK(cudaMemcpy(sum, dst_in, static_cast<size_t>(n) * sizeof(float),
                                              cudaMemcpyDeviceToDevice));
                megacpp::cuda::add_f32(src, sum, n);
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
}

}  // namespace

MEGACPP_ORACLE_ENTRY(TensorOps);

#else
MEGACPP_ORACLE_NO_CUDA(TensorOpsCuda);
#endif
