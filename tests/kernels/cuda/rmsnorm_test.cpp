// The CUDA RMSNorm with the fused residual add (kernels/cuda/rmsnorm.h) against the CPU oracle
// (kernels/cpu/rmsnorm.h in double), fed the same fp32 residual and weights and the same
// bf16-rounded delta and output gradient: an entry of the oracle harness, plus the refusals.
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

#include "kernels/cpu/rmsnorm.h"
#include "kernels/cuda/rmsnorm.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using megacpp::cuda::ResidualRmsNormCuda;
using megacpp::cuda::RmsNormShape;
using megacpp::cuda::RowsRef;
using oracle::DType;
using oracle::Role;

// How the GPU is fed: delta and dy as bf16 or as fp32 holding the same values (so both must give
// the same bits), and out of place or in place (residual_out = residual_in, dx = residual_grad).
struct NormVariant {
  std::string name;
  int same_bits_as = -1;
  bool f32 = false;
  bool in_place = false;
};

struct RmsNorm {
  static constexpr const char* kName = "ResidualRmsNormCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  using Variant = NormVariant;
  struct Case {
    std::string name;
    RmsNormShape shape;
    bool delta;          // a sublayer's output is added into the residual first
    bool residual_grad;  // a gradient already flows along the residual stream (not the final norm)
    bool accumulate;     // dweight adds into a held value (an earlier micro-batch)
    std::vector<Variant> variants;
  };

  static std::vector<Case> cases() {
    const std::vector<Variant> variants{
        {"bf16", -1, false, false}, {"f32", 0, true, false}, {"bf16_in_place", 0, false, true}};
    std::vector<Case> out;
    const auto add = [&](int rows, int dim, bool delta, bool residual_grad, bool accumulate) {
      std::ostringstream name;
      name << "rows" << rows << "_D" << dim << (delta ? "_delta" : "")
           << (residual_grad ? "_resgrad" : "") << (accumulate ? "_accumulate" : "");
      out.push_back(
          {name.str(), RmsNormShape{rows, dim, 1e-5}, delta, residual_grad, accumulate, variants});
    };
    // bench-350m's width over one micro-batch of 4 × 2048: a layer's norm (delta in, gradient
    // along the residual), the first norm (no delta) and the final norm (no residual gradient).
    add(4 * 2048, 1024, true, true, false);
    add(4 * 2048, 1024, false, true, true);
    add(4 * 2048, 1024, true, false, false);
    // Odd sizes: a partial tile, dim below a warp and not a multiple of the block.
    add(77, 70, true, true, true);
    add(33, 5, true, true, false);
    add(300, 2500, true, false, true);
    // Tiles of 3 rows (the rows spread over about kTargetTiles blocks), the last one of 1.
    add(2050, 70, true, true, true);
    return out;
  }

  static void declare(const Case& c, oracle::Problem& p) {
    const RmsNormShape& s = c.shape;
    std::mt19937_64& rng = p.rng();
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    const size_t rows = static_cast<size_t>(s.rows), dim = static_cast<size_t>(s.dim);
    const size_t n = rows * dim;
    // Rows of very different scales (1e-2 to 1e2), as the residual stream grows with depth.
    std::vector<double> row_scale(rows);
    for (double& v : row_scale) v = std::pow(10.0, -2.0 + 4.0 * unit(rng));
    p.input("residual_in", DType::kF32, n,
            [&](size_t i) { return row_scale[i / dim] * normal(rng); });
    p.input("delta", DType::kBf16, c.delta ? n : 0,
            [&](size_t i) { return row_scale[i / dim] * normal(rng); });
    p.input("delta_f32", DType::kF32, c.delta ? n : 0, [&](size_t i) { return p.in("delta")[i]; });
    p.input("weight", DType::kF32, dim, [&] { return 1.0 + 0.3 * normal(rng); });
    p.input("dy", DType::kBf16, n, [&] { return normal(rng); });
    p.input("dy_f32", DType::kF32, n, [&](size_t i) { return p.in("dy")[i]; });
    p.input("residual_grad", DType::kF32, c.residual_grad ? n : 0, [&] { return normal(rng); });
    p.input("dweight_in", DType::kF32, c.accumulate ? dim : 0, [&] { return normal(rng); });
    p.output("residual_out", DType::kF32, n, Role::kOutput);
    p.output("y", DType::kBf16, n, Role::kOutput);
    p.output("rstd", DType::kF32, rows, Role::kOutput);
    p.output("dx", DType::kF32, n, Role::kGradient);
    p.output("dweight", DType::kF32, dim, Role::kGradient);
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    const RmsNormShape& s = c.shape;
    const size_t n = static_cast<size_t>(s.rows) * s.dim;
    double* residual = p.out("residual_out");
    std::copy(p.in("residual_in"), p.in("residual_in") + n, residual);
    megacpp::cpu::residual_rmsnorm_forward<double>(s.rows, s.dim, s.eps, residual,
                                                   c.delta ? p.in("delta") : nullptr,
                                                   p.in("weight"), p.out("y"), p.out("rstd"));
    double* dweight = p.out("dweight");
    if (c.accumulate) std::copy(p.in("dweight_in"), p.in("dweight_in") + s.dim, dweight);
    megacpp::cpu::residual_rmsnorm_backward<double>(
        s.rows, s.dim, residual, p.in("weight"), p.out("rstd"), p.in("dy"),
        c.residual_grad ? p.in("residual_grad") : nullptr, p.out("dx"), dweight);
  }

  static oracle::Gpu gpu(const Case& c, const Variant& v, oracle::DeviceTensors& t) {
    const RmsNormShape s = c.shape;
    const auto workspace =
        std::make_shared<oracle::DeviceBuffer>(ResidualRmsNormCuda::workspace_bytes(s));
    const auto op = std::make_shared<ResidualRmsNormCuda>(s, workspace->get(), workspace->bytes());
    const size_t bytes = static_cast<size_t>(s.rows) * s.dim * sizeof(float);
    RowsRef delta, dy;
    if (c.delta) {
      if (v.f32) {
        delta.f32 = t.f32("delta_f32");
      } else {
        delta.bf16 = t.bf16("delta");
      }
    }
    if (v.f32) {
      dy.f32 = t.f32("dy_f32");
    } else {
      dy.bf16 = t.bf16("dy");
    }
    const float* residual_in = t.f32("residual_in");
    const float* weight = t.f32("weight");
    const float* residual_grad = c.residual_grad ? t.f32("residual_grad") : nullptr;
    const float* dweight_in = t.f32("dweight_in");
    float* residual_out = t.f32("residual_out");
    uint16_t* y = t.bf16("y");
    float* rstd = t.f32("rstd");
    float* dx = t.f32("dx");
    float* dweight = t.f32("dweight");
    const bool in_place = v.in_place, accumulate = c.accumulate;
    const size_t dweight_bytes = static_cast<size_t>(s.dim) * sizeof(float);
    oracle::Gpu g;
    g.passes.push_back({"forward", [=] {
                          if (in_place) {
                            MEGACPP_CUDA_CHECK(cudaMemcpy(residual_out, residual_in, bytes,
                                                          cudaMemcpyDeviceToDevice));
                          }
                          op->forward(in_place ? residual_out : residual_in, delta, weight,
                                      residual_out, y, rstd);
                        }});
    g.passes.push_back(
        {"backward", [=] {
           (void)workspace;  // alive as long as the op
           const float* along = residual_grad;
           if (in_place && residual_grad != nullptr) {
             MEGACPP_CUDA_CHECK(cudaMemcpy(dx, residual_grad, bytes, cudaMemcpyDeviceToDevice));
             along = dx;
           }
           if (accumulate) {
             MEGACPP_CUDA_CHECK(
                 cudaMemcpy(dweight, dweight_in, dweight_bytes, cudaMemcpyDeviceToDevice));
           }
           op->backward(residual_out, weight, rstd, dy, along, dx, dweight, accumulate);
         }});
    return g;
  }
};

// Validation runs before any CUDA call: no device needed, only a CUDA build.
TEST(ResidualRmsNormCudaShapes, RefusesShapesItDoesNotCover) {
  const auto refused = [](RmsNormShape s, const std::string& field) {
    oracle::expect_error([&] { ResidualRmsNormCuda op(s, nullptr, 0); },
                         megacpp::ErrorKind::kInvalidArgument, field, "a bad " + field);
  };
  refused({0, 8, 1e-5}, "rows=0");
  refused({4, 0, 1e-5}, "dim=0");
  refused({4, ResidualRmsNormCuda::kMaxDim + 1, 1e-5}, "dim=8193");
  refused({4, 8, 0.0}, "eps=0");
}

TEST(ResidualRmsNormCudaShapes, RefusesAmbiguousInputsAndAShortWorkspace) {
  MEGACPP_REQUIRE_GPU();
  const RmsNormShape s{64, 8, 1e-5};
  oracle::DeviceBuffer buffer(64 * 8 * sizeof(float));
  float* f = static_cast<float*>(buffer.get());
  uint16_t* b = static_cast<uint16_t*>(buffer.get());
  ResidualRmsNormCuda op(s, buffer.get(), 4);
  oracle::expect_error(
      [&] {
        op.forward(f, RowsRef{b, f}, f, f, b, f);
      },
      megacpp::ErrorKind::kInvalidArgument, "both", "two deltas");
  oracle::expect_error([&] { op.backward(f, f, f, RowsRef{}, nullptr, f, f, false); },
                       megacpp::ErrorKind::kInvalidArgument, "exactly one", "no dy");
  oracle::expect_error(
      [&] {
        op.backward(f, f, f, RowsRef{b, nullptr}, nullptr, f, f, false);
      },
      megacpp::ErrorKind::kInvalidArgument, "workspace_bytes", "4 bytes");
}

}  // namespace

MEGACPP_ORACLE_ENTRY(RmsNorm);

#else

MEGACPP_ORACLE_NO_CUDA(ResidualRmsNormCuda);

#endif
