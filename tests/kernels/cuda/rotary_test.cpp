// The CUDA rotary embedding (kernels/cuda/rotary.h) against the CPU oracle (kernels/cpu/rotary.h
// in double) on the same bf16 values: an entry of the oracle harness, forward and backward as
// separate outputs, plus the refusals.
#include "tests/kernels/cuda/oracle_harness.h"

#ifdef MEGACPP_HAVE_CUDA

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/rotary.h"
#include "kernels/cuda/rotary.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using megacpp::cuda::RotaryShape;
using oracle::DType;
using oracle::Role;

size_t elements(const RotaryShape& s) {
  return static_cast<size_t>(s.batch) * static_cast<size_t>(s.seqlen) *
         static_cast<size_t>(s.row_stride);
}

struct Rotary {
  static constexpr const char* kName = "RotaryCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  using Variant = oracle::Variant;
  struct Case {
    std::string name;
    RotaryShape shape;
    std::vector<Variant> variants;
  };

  static std::vector<Case> cases() {
    std::vector<Case> out;
    const auto add = [&](const std::string& name, RotaryShape s) {
      out.push_back({name, s, {}});
    };
    // q and k where they sit in the packed qkv row (Hq 4, Hkv 2, head_dim 64): one call over the
    // 6 heads from the row's start, v's columns left alone.
    add("packed_qkv_B2_L77_Hq4_Hkv2_D64", {2, 77, (4 + 2 * 2) * 64, 0, 6, 64, 64, 10000.0});
    // Half the dims rotated (rope fraction 0.5), on the k heads only (head_offset past q).
    add("k_heads_rd32_B1_L33_D64", {1, 33, (4 + 2 * 2) * 64, 4 * 64, 2, 64, 32, 10000.0});
    // Odd everything: head_dim 6 with 2 rotated dims, an odd stride and offset, another base.
    add("odd_B3_L19_H5_D6_rd2", {3, 19, 37, 3, 5, 6, 2, 500.0});
    // rotary_dim 0: x comes back as it went in.
    add("rd0_B1_L5_H2_D8", {1, 5, 16, 0, 2, 8, 0, 10000.0});
    // More angles than a block computes at once (500 > 128): several passes per token.
    add("wide_B1_L9_H2_D1024_rd1000", {1, 9, 2 * 1024 + 5, 5, 2, 1024, 1000, 10000.0});
    // Long sequences (angles up to 4095 rad): the packed qkv of a 16/4-head attention layer at
    // head_dim 64 over 2 × 4096 tokens. An fp32 angle would still pass here (its error, ~2e-4,
    // is below a bf16 step); the case guards the indexing and the range reduction at large t.
    add("long_B2_L4096_Hq16_Hkv4_D64", {2, 4096, (16 + 2 * 4) * 64, 0, 20, 64, 64, 10000.0});
    // bench-350m-like: 4 × 2048 tokens, Hq 16, Hkv 4, rope on half of head_dim 64.
    add("bench_B4_L2048_Hq16_Hkv4_D64_rd32", {4, 2048, (16 + 2 * 4) * 64, 0, 20, 64, 32, 10000.0});
    return out;
  }

  static void declare(const Case& c, oracle::Problem& p) {
    std::mt19937_64& rng = p.rng();
    std::normal_distribution<double> normal(0.0, 1.0);
    const size_t n = elements(c.shape);
    p.input("x", DType::kBf16, n, [&] { return normal(rng); });
    p.input("dy", DType::kBf16, n, [&] { return normal(rng); });
    p.output("y", DType::kBf16, n, Role::kOutput);
    p.output("dx", DType::kBf16, n, Role::kGradient);
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    const RotaryShape& s = c.shape;
    const size_t n = elements(s);
    double* y = p.out("y");
    std::copy(p.in("x"), p.in("x") + n, y);
    megacpp::cpu::rotary_forward<double>(s.batch, s.seqlen, s.row_stride, s.head_offset, s.heads,
                                         s.head_dim, s.rotary_dim, s.base, y);
    double* dx = p.out("dx");
    std::copy(p.in("dy"), p.in("dy") + n, dx);
    megacpp::cpu::rotary_backward<double>(s.batch, s.seqlen, s.row_stride, s.head_offset, s.heads,
                                          s.head_dim, s.rotary_dim, s.base, dx);
  }

  static oracle::Gpu gpu(const Case& c, const Variant&, oracle::DeviceTensors& t) {
    const RotaryShape s = c.shape;
    const size_t bytes = elements(s) * sizeof(uint16_t);
    const uint16_t* x = t.bf16("x");
    const uint16_t* dy = t.bf16("dy");
    uint16_t* y = t.bf16("y");
    uint16_t* dx = t.bf16("dx");
    oracle::Gpu g;
    // In place: the outputs (poisoned by the harness) start as copies of the inputs, and every
    // column the rotation does not cover must come back as it was.
    g.passes.push_back({"forward", [=] {
                          MEGACPP_CUDA_CHECK(cudaMemcpy(y, x, bytes, cudaMemcpyDeviceToDevice));
                          megacpp::cuda::rotary_forward(s, y);
                        }});
    g.passes.push_back({"backward", [=] {
                          MEGACPP_CUDA_CHECK(cudaMemcpy(dx, dy, bytes, cudaMemcpyDeviceToDevice));
                          megacpp::cuda::rotary_backward(s, dx);
                        }});
    return g;
  }
};

// Validation runs before any CUDA call: no device needed, only a CUDA build.
TEST(RotaryCudaShapes, RefusesShapesTheCpuOpRefuses) {
  const RotaryShape good{2, 8, 64, 0, 4, 16, 8, 10000.0};
  const auto refused = [](RotaryShape s, const std::string& needle) {
    oracle::expect_error([&] { megacpp::cuda::rotary_forward(s, nullptr); },
                         megacpp::ErrorKind::kInvalidArgument, needle, "forward: " + needle);
    oracle::expect_error([&] { megacpp::cuda::rotary_backward(s, nullptr); },
                         megacpp::ErrorKind::kInvalidArgument, needle, "backward: " + needle);
  };
  RotaryShape s = good;
  s.batch = 0;
  refused(s, "batch=0");
  s = good;
  s.seqlen = -1;
  refused(s, "seqlen=-1");
  s = good;
  s.heads = 0;
  refused(s, "heads=0");
  s = good;
  s.head_dim = 0;
  refused(s, "head_dim=0");
  s = good;
  s.rotary_dim = 7;
  refused(s, "rotary_dim=7");
  s = good;
  s.rotary_dim = 18;
  refused(s, "rotary_dim=18");
  s = good;
  s.rotary_dim = -2;
  refused(s, "rotary_dim=-2");
  s = good;
  s.head_offset = -1;
  refused(s, "head_offset=-1");
  s = good;
  s.row_stride = 63;  // head_offset 0 + 4 heads × 16 = 64
  refused(s, "row_stride=63");
  s = good;
  s.head_offset = 1;  // now 65 > 64
  refused(s, "row_stride=64");
  s = good;
  s.base = 0.0;
  refused(s, "base=0");
  s = good;
  s.base = -1.0;
  refused(s, "base=-1");
}

TEST(RotaryCudaShapes, RefusesANullBuffer) {
  const RotaryShape good{2, 8, 64, 0, 4, 16, 8, 10000.0};
  oracle::expect_error([&] { megacpp::cuda::rotary_forward(good, nullptr); },
                       megacpp::ErrorKind::kInvalidArgument, "x is null", "null x");
  oracle::expect_error([&] { megacpp::cuda::rotary_backward(good, nullptr); },
                       megacpp::ErrorKind::kInvalidArgument, "x is null", "null dx");
}

}  // namespace

MEGACPP_ORACLE_ENTRY(Rotary);

#else

MEGACPP_ORACLE_NO_CUDA(RotaryCuda);

#endif
