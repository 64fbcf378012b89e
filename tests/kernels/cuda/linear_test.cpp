// The CUDA linear layer (kernels/cuda/linear.h, cuBLASLt) against the CPU oracle
// (kernels/cpu/linear.h in double) on the same bf16-rounded operands and fp32 bias: an entry of
// the oracle harness, plus the refusals.
#include "tests/kernels/cuda/oracle_harness.h"

#ifdef MEGACPP_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/linear.h"
#include "kernels/cuda/linear.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using megacpp::cuda::LinearCuda;
using megacpp::cuda::LinearShape;
using megacpp::cuda::RowsOut;
using oracle::DType;
using oracle::Role;

struct Linear {
  static constexpr const char* kName = "LinearCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  // The output type is a case's (the harness's outputs have one dtype per case); the variants
  // are one op and a second op built for the same shape, which must choose the same algorithms
  // and so give the same bits.
  using Variant = oracle::Variant;
  struct Case {
    std::string name;
    LinearShape shape;
    bool bias;        // forward adds a bias, backward gives its gradient
    bool accumulate;  // dweight and dbias add into held values (an earlier micro-batch)
    bool f32;         // y and dx in fp32 rather than bf16
    bool dx;          // the input needs a gradient
    std::vector<Variant> variants;
  };

  static std::vector<Case> cases() {
    const std::vector<Variant> variants{{"op", -1}, {"second_op", 0}};
    std::vector<Case> out;
    const auto add = [&](int rows, int in, int outs, bool bias, bool accumulate, bool f32,
                         bool dx) {
      std::ostringstream name;
      name << "rows" << rows << "_in" << in << "_out" << outs << (bias ? "_bias" : "")
           << (accumulate ? "_accumulate" : "") << (f32 ? "_f32" : "_bf16") << (dx ? "" : "_no_dx");
      out.push_back({name.str(), LinearShape{rows, in, outs}, bias, accumulate, f32, dx, variants});
    };
    // bench-350m-like: d_model 1024 into a 3072-wide projection over 2048 rows, in both output
    // types, with and without bias.
    add(2048, 1024, 3072, true, true, false, true);
    add(2048, 1024, 3072, false, false, true, true);
    // Odd sizes: leading dimensions that are no multiple of 16 bytes (in = 70: 140-byte rows of
    // x and W; out = 33: 66-byte rows of y and dy), a partial row tile for the bias gradient.
    add(77, 70, 33, true, true, false, true);
    add(77, 70, 33, true, false, true, true);
    add(77, 70, 33, false, false, false, true);
    add(77, 70, 33, false, true, true, true);
    add(3, 5, 7, true, false, true, true);
    add(1, 1, 1, true, true, false, true);
    // Aligned, no input gradient (the first layer's).
    add(130, 128, 256, true, false, false, false);
    // The weight gradient's GEMM planned for 16 SMs (as tensor parallelism plans it for fewer
    // than the GPU's: CudaModelOptions::tensor_parallel_reserved_sms), held to the oracle.
    out.push_back({"rows2048_in1024_out3072_accumulate_bf16_wgrad_on_16_sms",
                   LinearShape{2048, 1024, 3072},
                   false,
                   true,
                   false,
                   true,
                   {{"wgrad_on_16_sms", -1}}});
    // y's rows padded (LinearShape::y_stride): the forward leaves the columns past out alone.
    for (auto [shape, f32] : {std::pair{LinearShape{2048, 1024, 3072, 3136}, false},
                              std::pair{LinearShape{77, 70, 33, 40}, true}}) {
      std::ostringstream name;
      name << "rows" << shape.rows << "_in" << shape.in << "_out" << shape.out << "_bias"
           << (f32 ? "_f32" : "_bf16") << "_y_stride" << shape.y_stride;
      out.push_back({name.str(), shape, true, false, f32, true, {{"op", -1}}});
    }
    return out;
  }

  static void declare(const Case& c, oracle::Problem& p) {
    const LinearShape& s = c.shape;
    std::mt19937_64& rng = p.rng();
    std::normal_distribution<double> normal(0.0, 1.0);
    const size_t rows = static_cast<size_t>(s.rows), in = static_cast<size_t>(s.in),
                 outs = static_cast<size_t>(s.out);
    const double w_scale = 1.0 / std::sqrt(static_cast<double>(s.in));
    const DType out_type = c.f32 ? DType::kF32 : DType::kBf16;
    p.input("x", DType::kBf16, rows * in, [&] { return normal(rng); });
    p.input("weight", DType::kBf16, outs * in, [&] { return w_scale * normal(rng); });
    p.input("bias", DType::kF32, c.bias ? outs : 0, [&] { return normal(rng); });
    p.input("dy", DType::kBf16, rows * outs, [&] { return normal(rng); });
    p.input("dweight_in", DType::kF32, c.accumulate ? outs * in : 0, [&] { return normal(rng); });
    p.input("dbias_in", DType::kF32, c.accumulate && c.bias ? outs : 0,
            [&] { return normal(rng); });
    p.output("y", out_type, rows * outs, Role::kOutput);
    p.output("dx", out_type, c.dx ? rows * in : 0, Role::kGradient);
    p.output("dweight", DType::kF32, outs * in, Role::kGradient);
    p.output("dbias", DType::kF32, c.bias ? outs : 0, Role::kGradient);
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    const LinearShape& s = c.shape;
    megacpp::cpu::linear_forward<double>(s.rows, s.in, s.out, p.in("x"), p.in("weight"),
                                         c.bias ? p.in("bias") : nullptr, p.out("y"));
    double* dweight = p.out("dweight");
    double* dbias = c.bias ? p.out("dbias") : nullptr;
    if (c.accumulate) {
      std::copy(p.in("dweight_in"), p.in("dweight_in") + static_cast<size_t>(s.out) * s.in,
                dweight);
      if (c.bias) std::copy(p.in("dbias_in"), p.in("dbias_in") + s.out, dbias);
    }
    megacpp::cpu::linear_backward<double>(s.rows, s.in, s.out, p.in("x"), p.in("weight"),
                                          p.in("dy"), c.dx ? p.out("dx") : nullptr, dweight, dbias);
  }

  static oracle::Gpu gpu(const Case& c, const Variant& v, oracle::DeviceTensors& t) {
    const LinearShape s = c.shape;
    const auto workspace = std::make_shared<oracle::DeviceBuffer>(LinearCuda::workspace_bytes(s));
    const int weight_gradient_sms = v.name == "wgrad_on_16_sms" ? 16 : 0;
    const auto op = std::make_shared<LinearCuda>(s, workspace->get(), workspace->bytes(), nullptr,
                                                 weight_gradient_sms);
    RowsOut y, dx;
    if (c.f32) {
      y.f32 = t.f32("y");
      dx.f32 = t.f32("dx");  // null when the case has no dx
    } else {
      y.bf16 = t.bf16("y");
      dx.bf16 = t.bf16("dx");
    }
    const uint16_t* x = t.bf16("x");
    const uint16_t* weight = t.bf16("weight");
    const uint16_t* dy = t.bf16("dy");
    const float* bias = t.f32("bias");
    const float* dweight_in = t.f32("dweight_in");
    const float* dbias_in = t.f32("dbias_in");
    float* dweight = t.f32("dweight");
    float* dbias = t.f32("dbias");
    const bool accumulate = c.accumulate, has_bias = c.bias;
    const size_t dweight_bytes = static_cast<size_t>(s.out) * s.in * sizeof(float);
    const size_t dbias_bytes = static_cast<size_t>(s.out) * sizeof(float);
    oracle::Gpu g;
    if (s.y_stride != 0) {
      // y written into padded rows (the padding NaNs, which must stay), then copied out dense.
      const size_t element = c.f32 ? sizeof(float) : sizeof(uint16_t);
      const size_t rows = static_cast<size_t>(s.rows);
      const auto padded = std::make_shared<oracle::DeviceBuffer>(rows * s.y_stride * element);
      g.passes.push_back({"forward", [=] {
                            MEGACPP_CUDA_CHECK(cudaMemset(padded->get(), 0xff, padded->bytes()));
                            RowsOut wide;
                            if (c.f32) {
                              wide.f32 = static_cast<float*>(padded->get());
                            } else {
                              wide.bf16 = static_cast<uint16_t*>(padded->get());
                            }
                            op->forward(x, weight, bias, wide);
                            void* dense = c.f32 ? static_cast<void*>(y.f32) : y.bf16;
                            MEGACPP_CUDA_CHECK(cudaMemcpy2D(dense, s.out * element, padded->get(),
                                                            s.y_stride * element, s.out * element,
                                                            rows, cudaMemcpyDeviceToDevice));
                            std::vector<unsigned char> tail(rows * s.y_stride * element);
                            MEGACPP_CUDA_CHECK(cudaMemcpy(tail.data(), padded->get(), tail.size(),
                                                          cudaMemcpyDeviceToHost));
                            for (size_t r = 0; r < rows; ++r) {
                              for (size_t b = s.out * element; b < s.y_stride * element; ++b) {
                                ASSERT_EQ(tail[r * s.y_stride * element + b], 0xff)
                                    << "row " << r << " written past out";
                              }
                            }
                          }});
    } else {
      g.passes.push_back({"forward", [=] {
                            op->forward(x, weight, bias, y);
                          }});
    }
    g.passes.push_back({"backward", [=] {
                          (void)workspace;  // alive as long as the op
                          if (accumulate) {
                            MEGACPP_CUDA_CHECK(cudaMemcpy(dweight, dweight_in, dweight_bytes,
                                                          cudaMemcpyDeviceToDevice));
                            if (has_bias) {
                              MEGACPP_CUDA_CHECK(cudaMemcpy(dbias, dbias_in, dbias_bytes,
                                                            cudaMemcpyDeviceToDevice));
                            }
                          }
                          op->backward(x, weight, dy, dx, dweight, dbias, accumulate);
                        }});
    return g;
  }
};

// Validation runs before any CUDA call: no device needed, only a CUDA build.
TEST(LinearCudaShapes, RefusesShapesItDoesNotCover) {
  const auto refused = [](LinearShape s, const std::string& field) {
    oracle::expect_error([&] { LinearCuda op(s, nullptr, 0); },
                         megacpp::ErrorKind::kInvalidArgument, field, "a bad " + field);
    oracle::expect_error([&] { (void)LinearCuda::workspace_bytes(s); },
                         megacpp::ErrorKind::kInvalidArgument, field, "sizing a bad " + field);
  };
  refused({0, 8, 8}, "rows=0");
  refused({4, 0, 8}, "in=0");
  refused({4, 8, -1}, "out=-1");
  refused({4, 8, 8, 7}, "y_stride=7");
}

TEST(LinearCudaShapes, RefusesNullPointersAmbiguousOutputsAndMisalignment) {
  MEGACPP_REQUIRE_GPU();
  const LinearShape s{8, 16, 16};
  const size_t bytes = LinearCuda::workspace_bytes(s);
  oracle::DeviceBuffer workspace(bytes);
  oracle::expect_error([&] { LinearCuda op(s, workspace.get(), bytes - 1); },
                       megacpp::ErrorKind::kInvalidArgument, "workspace_bytes", "a short one");
  oracle::expect_error([&] { LinearCuda op(s, static_cast<char*>(workspace.get()) + 16, bytes); },
                       megacpp::ErrorKind::kInvalidArgument, "aligned", "a misaligned workspace");
  oracle::expect_error([&] { LinearCuda op(s, workspace.get(), bytes, nullptr, -1); },
                       megacpp::ErrorKind::kInvalidArgument, "weight_gradient_sms=-1",
                       "a negative SM count");
  LinearCuda op(s, workspace.get(), bytes);
  oracle::DeviceBuffer buffer(4096);
  uint16_t* b = static_cast<uint16_t*>(buffer.get());
  float* f = static_cast<float*>(buffer.get());
  oracle::expect_error(
      [&] {
        op.forward(nullptr, b, nullptr, RowsOut{b, nullptr});
      },
      megacpp::ErrorKind::kInvalidArgument, "x is null", "no x");
  oracle::expect_error(
      [&] {
        op.forward(b, nullptr, nullptr, RowsOut{b, nullptr});
      },
      megacpp::ErrorKind::kInvalidArgument, "weight is null", "no weight");
  oracle::expect_error([&] { op.forward(b, b, nullptr, RowsOut{}); },
                       megacpp::ErrorKind::kInvalidArgument, "exactly one", "no y");
  oracle::expect_error(
      [&] {
        op.forward(b, b, nullptr, RowsOut{b, f});
      },
      megacpp::ErrorKind::kInvalidArgument, "exactly one", "two y");
  oracle::expect_error([&] { op.backward(b, b, nullptr, RowsOut{}, f, nullptr, false); },
                       megacpp::ErrorKind::kInvalidArgument, "dy is null", "no dy");
  oracle::expect_error(
      [&] {
        op.backward(b, b, b, RowsOut{b, f}, f, nullptr, false);
      },
      megacpp::ErrorKind::kInvalidArgument, "both", "two dx");
  // 16 bf16 columns are 32-byte rows: the algorithms were chosen for 16-byte aligned matrices.
  oracle::expect_error(
      [&] {
        op.forward(b + 1, b, nullptr, RowsOut{b, nullptr});
      },
      megacpp::ErrorKind::kInvalidArgument, "aligned", "a misaligned x");
  oracle::expect_error(
      [&] {
        op.forward(b, b, f + 1, RowsOut{nullptr, f});
      },
      megacpp::ErrorKind::kInvalidArgument, "aligned", "a misaligned bias");
  MEGACPP_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace

MEGACPP_ORACLE_ENTRY(Linear);

#else

MEGACPP_ORACLE_NO_CUDA(LinearCuda);

#endif
