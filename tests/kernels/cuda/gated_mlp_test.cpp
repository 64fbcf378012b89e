// The CUDA GatedMLP (kernels/cuda/gated_mlp.h: two cuBLASLt linears around the gate kernels)
// against the CPU oracle (kernels/cpu/gated_mlp.h in double) on the same bf16-rounded input,
// weights and output gradient: an entry of the oracle harness, plus the refusals. The
// intermediates the op keeps (fc1's output, the activation) and the gradients it leaves in the
// caller's scratch are checked too, each half of fc1's output on its own.
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

#include "kernels/cpu/gated_mlp.h"
#include "kernels/cuda/gated_mlp.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using megacpp::cuda::GatedMlpCuda;
using megacpp::cuda::GatedMlpShape;
using megacpp::cuda::RowsOut;
using oracle::DType;
using oracle::Role;

struct GatedMlp {
  static constexpr const char* kName = "GatedMlpCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  using Variant = oracle::Variant;
  struct Case {
    std::string name;
    GatedMlpShape shape;
    bool accumulate;  // dfc1 and dfc2 add into held values (an earlier micro-batch)
    bool f32;         // y and dx in fp32 rather than bf16
    std::vector<Variant> variants;
  };

  static std::vector<Case> cases() {
    std::vector<Case> out;
    const auto add = [&](int rows, int dim, int hidden, bool accumulate, bool f32) {
      std::ostringstream name;
      name << "rows" << rows << "_D" << dim << "_H" << hidden << (accumulate ? "_accumulate" : "")
           << (f32 ? "_f32" : "_bf16");
      out.push_back({name.str(), GatedMlpShape{rows, dim, hidden}, accumulate, f32, {}});
    };
    // bench-350m: d_model 1024, hidden 2816 (d_intermediate 2816), over 2048 rows.
    add(2048, 1024, 2816, true, false);
    // Odd sizes: rows of 70 and 33 bf16 (no multiple of 16 bytes), hidden below a block.
    add(77, 70, 33, true, false);
    add(77, 70, 33, false, true);
    add(130, 64, 300, false, false);
    add(1, 3, 1, true, true);
    return out;
  }

  static void declare(const Case& c, oracle::Problem& p) {
    const GatedMlpShape& s = c.shape;
    std::mt19937_64& rng = p.rng();
    std::normal_distribution<double> normal(0.0, 1.0);
    const size_t rows = static_cast<size_t>(s.rows), dim = static_cast<size_t>(s.dim),
                 hidden = static_cast<size_t>(s.hidden);
    // Unit-variance fc1 outputs: the gate sees g across silu's bend and both tails.
    const double fc1_scale = 1.0 / std::sqrt(static_cast<double>(s.dim));
    const double fc2_scale = 1.0 / std::sqrt(static_cast<double>(s.hidden));
    const DType out_type = c.f32 ? DType::kF32 : DType::kBf16;
    p.input("x", DType::kBf16, rows * dim, [&] { return normal(rng); });
    p.input("fc1", DType::kBf16, 2 * hidden * dim, [&] { return fc1_scale * normal(rng); });
    p.input("fc2", DType::kBf16, dim * hidden, [&] { return fc2_scale * normal(rng); });
    p.input("dy", DType::kBf16, rows * dim, [&] { return normal(rng); });
    p.input("dfc1_in", DType::kF32, c.accumulate ? 2 * hidden * dim : 0,
            [&] { return normal(rng); });
    p.input("dfc2_in", DType::kF32, c.accumulate ? dim * hidden : 0, [&] { return normal(rng); });
    p.output("fc1_out", DType::kBf16, rows * 2 * hidden, Role::kOutput);
    p.output("act", DType::kBf16, rows * hidden, Role::kOutput);
    p.output("y", out_type, rows * dim, Role::kOutput);
    p.output("dact", DType::kBf16, rows * hidden, Role::kGradient);
    p.output("dfc1_out", DType::kBf16, rows * 2 * hidden, Role::kGradient);
    p.output("dx", out_type, rows * dim, Role::kGradient);
    p.output("dfc1", DType::kF32, 2 * hidden * dim, Role::kGradient);
    p.output("dfc2", DType::kF32, dim * hidden, Role::kGradient);
    const int h = s.hidden;
    p.sections("fc1_out", 2 * h, {{"fc1_out.a", 0, h}, {"fc1_out.g", h, h}});
    p.sections("dfc1_out", 2 * h, {{"dfc1_out.a", 0, h}, {"dfc1_out.g", h, h}});
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    const GatedMlpShape& s = c.shape;
    megacpp::cpu::gated_mlp_forward<double>(s.rows, s.dim, s.hidden, p.in("x"), p.in("fc1"),
                                            p.in("fc2"), p.out("fc1_out"), p.out("act"),
                                            p.out("y"));
    if (c.accumulate) {
      const size_t fc_size = static_cast<size_t>(s.hidden) * s.dim;
      std::copy(p.in("dfc1_in"), p.in("dfc1_in") + 2 * fc_size, p.out("dfc1"));
      std::copy(p.in("dfc2_in"), p.in("dfc2_in") + fc_size, p.out("dfc2"));
    }
    megacpp::cpu::gated_mlp_backward<double>(s.rows, s.dim, s.hidden, p.in("x"), p.in("fc1"),
                                             p.in("fc2"), p.out("fc1_out"), p.out("act"),
                                             p.in("dy"), p.out("dx"), p.out("dfc1"), p.out("dfc2"),
                                             p.out("dact"), p.out("dfc1_out"));
  }

  static oracle::Gpu gpu(const Case& c, const Variant& /*v*/, oracle::DeviceTensors& t) {
    const GatedMlpShape s = c.shape;
    const auto workspace = std::make_shared<oracle::DeviceBuffer>(GatedMlpCuda::workspace_bytes(s));
    const auto op = std::make_shared<GatedMlpCuda>(s, workspace->get(), workspace->bytes());
    RowsOut y, dx;
    if (c.f32) {
      y.f32 = t.f32("y");
      dx.f32 = t.f32("dx");
    } else {
      y.bf16 = t.bf16("y");
      dx.bf16 = t.bf16("dx");
    }
    const uint16_t* x = t.bf16("x");
    const uint16_t* fc1 = t.bf16("fc1");
    const uint16_t* fc2 = t.bf16("fc2");
    const uint16_t* dy = t.bf16("dy");
    const float* dfc1_in = t.f32("dfc1_in");
    const float* dfc2_in = t.f32("dfc2_in");
    uint16_t* fc1_out = t.bf16("fc1_out");
    uint16_t* act = t.bf16("act");
    uint16_t* dact = t.bf16("dact");
    uint16_t* dfc1_out = t.bf16("dfc1_out");
    float* dfc1 = t.f32("dfc1");
    float* dfc2 = t.f32("dfc2");
    const bool accumulate = c.accumulate;
    const size_t fc_bytes = static_cast<size_t>(s.hidden) * s.dim * sizeof(float);
    oracle::Gpu g;
    g.passes.push_back({"forward", [=] {
                          op->forward(x, fc1, fc2, fc1_out, act, y);
                        }});
    g.passes.push_back(
        {"backward", [=] {
           (void)workspace;  // alive as long as the op
           if (accumulate) {
             MEGACPP_CUDA_CHECK(cudaMemcpy(dfc1, dfc1_in, 2 * fc_bytes, cudaMemcpyDeviceToDevice));
             MEGACPP_CUDA_CHECK(cudaMemcpy(dfc2, dfc2_in, fc_bytes, cudaMemcpyDeviceToDevice));
           }
           op->backward(x, fc1, fc2, fc1_out, act, dy, dx, dfc1, dfc2, accumulate, dact, dfc1_out);
         }});
    return g;
  }
};

// Validation runs before any CUDA call: no device needed, only a CUDA build.
TEST(GatedMlpCudaShapes, RefusesShapesItDoesNotCover) {
  const auto refused = [](GatedMlpShape s, const std::string& field) {
    oracle::expect_error([&] { GatedMlpCuda op(s, nullptr, 0); },
                         megacpp::ErrorKind::kInvalidArgument, field, "a bad " + field);
    oracle::expect_error([&] { (void)GatedMlpCuda::workspace_bytes(s); },
                         megacpp::ErrorKind::kInvalidArgument, field, "sizing a bad " + field);
    uint16_t dummy = 0;
    oracle::expect_error([&] { megacpp::cuda::gated_mlp_gate_forward(s, &dummy, &dummy); },
                         megacpp::ErrorKind::kInvalidArgument, field, "a gate with " + field);
  };
  refused({0, 8, 8}, "rows=0");
  refused({4, 0, 8}, "dim=0");
  refused({4, 8, -3}, "hidden=-3");
  refused({4, 8, 1 << 30}, "hidden=1073741824");
}

TEST(GatedMlpCudaShapes, RefusesNullPointers) {
  MEGACPP_REQUIRE_GPU();
  const GatedMlpShape s{8, 16, 16};
  const size_t bytes = GatedMlpCuda::workspace_bytes(s);
  oracle::DeviceBuffer workspace(bytes);
  GatedMlpCuda op(s, workspace.get(), bytes);
  oracle::DeviceBuffer buffer(4096);
  uint16_t* b = static_cast<uint16_t*>(buffer.get());
  float* f = static_cast<float*>(buffer.get());
  oracle::expect_error(
      [&] {
        op.forward(b, b, b, nullptr, b, RowsOut{b, nullptr});
      },
      megacpp::ErrorKind::kInvalidArgument, "fc1_out is null", "no fc1_out");
  oracle::expect_error([&] { op.forward(b, b, b, b, b, RowsOut{}); },
                       megacpp::ErrorKind::kInvalidArgument, "exactly one", "no y");
  oracle::expect_error([&] { op.backward(b, b, b, b, b, b, RowsOut{}, f, f, false, nullptr, b); },
                       megacpp::ErrorKind::kInvalidArgument, "scratch_dact is null", "no scratch");
  oracle::expect_error([&] { megacpp::cuda::gated_mlp_gate_backward(s, b, nullptr, b); },
                       megacpp::ErrorKind::kInvalidArgument, "dact is null", "a gate without dact");
  MEGACPP_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace

MEGACPP_ORACLE_ENTRY(GatedMlp);

#else

MEGACPP_ORACLE_NO_CUDA(GatedMlpCuda);

#endif
