// The CUDA Mamba-3 preprocessing (kernels/cuda/mamba3_preprocess.h) against the CPU oracle
// (kernels/cpu/mamba3_preprocess.h in double), fed the same bf16-rounded in_proj output and scan
// gradients and the same fp32 parameters: an entry of the oracle harness, plus the refusals.
#include "tests/kernels/cuda/oracle_harness.h"

#ifdef MEGACPP_HAVE_CUDA

#include <cmath>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/contracts/mamba3_preprocess.h"
#include "kernels/cpu/mamba3_preprocess.h"
#include "kernels/cuda/mamba3_preprocess.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using megacpp::cuda::Mamba3PreprocessCuda;
using megacpp::ops::Mamba3PreprocessShape;
using oracle::DType;
using oracle::Role;

Mamba3PreprocessShape make_shape(int rows, int heads, int headdim, int state, int groups, int rank,
                                 int angles) {
  Mamba3PreprocessShape s;
  s.rows = rows;
  s.heads = heads;
  s.headdim = headdim;
  s.state = state;
  s.groups = groups;
  s.rank = rank;
  s.angles = angles;
  return s;
}

struct Mamba3Preprocess {
  static constexpr const char* kName = "Mamba3PreprocessCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  using Variant = oracle::Variant;
  struct Case {
    std::string name;
    Mamba3PreprocessShape shape;
    std::vector<Variant> variants;
  };

  static std::vector<Case> cases() {
    std::vector<Case> out;
    const auto add = [&](const Mamba3PreprocessShape& s) {
      std::ostringstream name;
      name << "rows" << s.rows << "_H" << s.heads << "_P" << s.headdim << "_N" << s.state << "_G"
           << s.groups << "_R" << s.rank << "_A" << s.angles;
      // z and x left in proj (a scan reading them in place): the other outputs' bits unchanged.
      // proj's rows padded (proj_stride): the same bits as from dense rows.
      out.push_back({name.str(), s, {{"copies", -1}, {"z-x-in-place", 0}, {"padded-proj", 0}}});
    };
    // rows = 4·2048, H 16, P 64, R 4, A_n = N/4; (N, G).
    for (const auto& [n, g] :
         {std::pair{64, 1}, std::pair{64, 2}, std::pair{128, 1}, std::pair{128, 2}}) {
      add(make_shape(4 * 2048, 16, 64, n, g, 4, n / 4));
    }
    // A partial backward tile, N not a multiple of the warp, no angles (null angle pointers).
    add(make_shape(77, 6, 32, 48, 2, 2, 0));
    // Heads and state at their maxima: the backward's partials take 96 KB of shared memory, past
    // the 48 KB a block gets without opting in.
    add(make_shape(40, 2048, 4, 512, 1, 1, 0));
    return out;
  }

  static void declare(const Case& c, oracle::Problem& p) {
    const Mamba3PreprocessShape& s = c.shape;
    std::mt19937_64& rng = p.rng();
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    const size_t rows = static_cast<size_t>(s.rows), cols = static_cast<size_t>(s.columns());
    const size_t heads = static_cast<size_t>(s.heads), state = static_cast<size_t>(s.state);
    const size_t xz = rows * s.d_inner(), bc = rows * s.bc_width(), th = rows * heads;
    const size_t angles = rows * s.angles;
    const auto gaussian = [&] {
      return normal(rng);
    };

    // in_proj output: unit-scale everywhere except dd_A, which is O(1) with a tenth of its
    // entries so negative that f(dd_A) < A_floor (the floor binds there).
    size_t floor_bound = 0;
    p.input("proj", DType::kBf16, rows * cols, [&](size_t i) {
      const size_t col = i % cols;
      if (col >= static_cast<size_t>(s.col_dd_a()) &&
          col < static_cast<size_t>(s.col_dd_a()) + heads) {
        if (unit(rng) < 0.1) {
          ++floor_bound;
          return -(2e4 + 8e4 * unit(rng));
        }
        return 1.5 * normal(rng);
      }
      return normal(rng);
    });
    ASSERT_GT(floor_bound, 0u) << "no dd_A entry where the floor binds";
    // dt_bias = softplus⁻¹ of a DT log-uniform in [1e-3, 0.1]; norm weights near 1.
    p.input("dt_bias", DType::kF32, heads, [&] {
      const double dt = std::exp(std::log(1e-3) + unit(rng) * (std::log(0.1) - std::log(1e-3)));
      return std::log(std::expm1(dt));
    });
    p.input("b_norm_weight", DType::kF32, state, [&] { return 1.0 + 0.3 * normal(rng); });
    p.input("c_norm_weight", DType::kF32, state, [&] { return 1.0 + 0.3 * normal(rng); });
    // The scan's gradients, which backward maps onto dproj.
    const std::pair<const char*, size_t> scan_grads[] = {
        {"dz", xz},   {"dx", xz},  {"dk", bc},    {"dq", bc},
        {"dadt", th}, {"ddt", th}, {"dtrap", th}, {"dangles", angles}};
    for (const auto& [name, count] : scan_grads) p.input(name, DType::kBf16, count, gaussian);

    const std::pair<const char*, size_t> scan_inputs[] = {
        {"z", xz},   {"x", xz},  {"k", bc},    {"q", bc},
        {"adt", th}, {"dt", th}, {"trap", th}, {"angles", angles}};
    for (const auto& [name, count] : scan_inputs)
      p.output(name, DType::kBf16, count, Role::kOutput);
    p.output("rstd", DType::kF32, rows * 2 * s.rank * s.groups, Role::kOutput);
    p.output("dproj", DType::kBf16, rows * cols, Role::kGradient);
    p.sections("dproj", s.columns(),
               {{"dproj.z", 0, s.d_inner()},
                {"dproj.x", s.col_x(), s.d_inner()},
                {"dproj.B", s.col_b(), s.bc_width()},
                {"dproj.C", s.col_c(), s.bc_width()},
                {"dproj.dd_dt", s.col_dd_dt(), s.heads},
                // Where the floor binds the oracle's dd_A gradient is exactly 0: so must the GPU's.
                {"dproj.dd_A", s.col_dd_a(), s.heads, /*exact_zeros=*/true},
                {"dproj.trap", s.col_trap(), s.heads},
                {"dproj.angles", s.col_angles(), s.angles}});
    p.output("d_dt_bias", DType::kF32, heads, Role::kGradient);
    p.output("d_b_norm_weight", DType::kF32, state, Role::kGradient);
    p.output("d_c_norm_weight", DType::kF32, state, Role::kGradient);
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    const Mamba3PreprocessShape& s = c.shape;
    const double* proj = p.in("proj");
    const double* dt_bias = p.in("dt_bias");
    const double* b_weight = p.in("b_norm_weight");
    const double* c_weight = p.in("c_norm_weight");
    double* rstd = p.out("rstd");
    megacpp::cpu::mamba3_preprocess_forward(
        s, proj, dt_bias, b_weight, c_weight,
        megacpp::ops::Mamba3ScanBuffers<double>{p.out("z"), p.out("x"), p.out("k"), p.out("q"),
                                                p.out("adt"), p.out("dt"), p.out("trap"),
                                                p.out("angles")},
        rstd);
    const megacpp::ops::Mamba3ScanBuffers<const double> grads{
        p.in("dz"),   p.in("dx"),  p.in("dk"),    p.in("dq"),
        p.in("dadt"), p.in("ddt"), p.in("dtrap"), p.in("dangles")};
    std::vector<double> row_scratch(static_cast<size_t>(s.rows) * (s.heads + 2 * s.state));
    megacpp::cpu::mamba3_preprocess_backward(
        s, proj, dt_bias, b_weight, c_weight, rstd, grads, p.out("dproj"), p.out("d_dt_bias"),
        p.out("d_b_norm_weight"), p.out("d_c_norm_weight"), row_scratch.data());
  }

  static oracle::Gpu gpu(const Case& c, const Variant& v, oracle::DeviceTensors& t) {
    const bool padded = v.name == "padded-proj";
    const int columns = c.shape.columns(), stride = padded ? columns + 24 : columns;
    const auto pre = std::make_shared<Mamba3PreprocessCuda>(c.shape, padded ? stride : 0);
    const megacpp::cuda::PreprocessDeviceParams params{t.f32("dt_bias"), t.f32("b_norm_weight"),
                                                       t.f32("c_norm_weight")};
    // angles is null where the shape has none (t gives null for an empty tensor).
    const megacpp::cuda::PreprocessDeviceOutputs outs{t.bf16("z"),    t.bf16("x"),     t.bf16("k"),
                                                      t.bf16("q"),    t.bf16("adt"),   t.bf16("dt"),
                                                      t.bf16("trap"), t.bf16("angles")};
    const megacpp::cuda::PreprocessDeviceGrads grads{
        t.bf16("dz"),   t.bf16("dx"),  t.bf16("dk"),    t.bf16("dq"),
        t.bf16("dadt"), t.bf16("ddt"), t.bf16("dtrap"), t.bf16("dangles")};
    const megacpp::cuda::PreprocessDeviceParamGrads param_grads{
        t.f32("d_dt_bias"), t.f32("d_b_norm_weight"), t.f32("d_c_norm_weight")};
    const uint16_t* proj = t.bf16("proj");
    std::shared_ptr<oracle::DeviceBuffer> wide;
    if (padded) {
      // proj's rows `stride` apart, the padding NaNs.
      const size_t rows = static_cast<size_t>(c.shape.rows);
      wide = std::make_shared<oracle::DeviceBuffer>(rows * stride * sizeof(uint16_t));
      MEGACPP_CUDA_CHECK(cudaMemset(wide->get(), 0xff, wide->bytes()));
      MEGACPP_CUDA_CHECK(cudaMemcpy2D(wide->get(), stride * sizeof(uint16_t), proj,
                                      columns * sizeof(uint16_t), columns * sizeof(uint16_t), rows,
                                      cudaMemcpyDeviceToDevice));
      proj = static_cast<const uint16_t*>(wide->get());
    }
    uint16_t* const dproj = t.bf16("dproj");
    float* const rstd = t.f32("rstd");
    const size_t rstd_bytes =
        static_cast<size_t>(c.shape.rows) * 2 * c.shape.rank * c.shape.groups * sizeof(float);
    const bool in_place = v.name == "z-x-in-place";
    const Mamba3PreprocessShape shape = c.shape;
    return {{{"forward",
              [=] {
                if (!in_place) {
                  pre->forward(proj, params, outs);
                  return;
                }
                megacpp::cuda::PreprocessDeviceOutputs rest = outs;
                rest.z = rest.x = nullptr;
                pre->forward(proj, params, rest);
                // What a scan reading them in place sees, into z and x for the comparison.
                const size_t pitch = static_cast<size_t>(shape.columns()) * sizeof(uint16_t);
                const size_t width = static_cast<size_t>(shape.d_inner()) * sizeof(uint16_t);
                MEGACPP_CUDA_CHECK(cudaMemcpy2D(outs.z, width, proj, pitch, width, shape.rows,
                                                cudaMemcpyDeviceToDevice));
                MEGACPP_CUDA_CHECK(cudaMemcpy2D(outs.x, width, proj + shape.col_x(), pitch, width,
                                                shape.rows, cudaMemcpyDeviceToDevice));
              }},
             {"backward",
              [=] {
                (void)wide;
                pre->backward(proj, params, grads, dproj, param_grads);
              }}},
            // The norm scales stay in the op's workspace for backward(): copied out to compare.
            [=] {
              MEGACPP_CUDA_CHECK(
                  cudaMemcpy(rstd, pre->bc_rstd(), rstd_bytes, cudaMemcpyDeviceToDevice));
            }};
  }
};

TEST(Mamba3PreprocessCudaShapes, BackwardNeedsForward) {
  MEGACPP_REQUIRE_GPU();
  Mamba3PreprocessCuda pre(make_shape(4, 2, 4, 8, 1, 1, 1));
  uint16_t dummy = 0;
  float param = 0.f;
  const megacpp::cuda::PreprocessDeviceGrads grads{&dummy, &dummy, &dummy, &dummy,
                                                   &dummy, &dummy, &dummy, &dummy};
  oracle::expect_error(
      [&] {
        pre.backward(&dummy, {&param, &param, &param}, grads, &dummy, {&param, &param, &param});
      },
      megacpp::ErrorKind::kFailedPrecondition, "needs forward()", "backward before forward");
}

// Validation runs before any CUDA call: no device needed, only a CUDA build.
TEST(Mamba3PreprocessCudaShapes, RefusesShapesItDoesNotCover) {
  const Mamba3PreprocessShape good = make_shape(8, 2, 4, 8, 1, 1, 1);
  const auto refused = [&](auto change, const std::string& field) {
    Mamba3PreprocessShape s = good;
    change(s);
    oracle::expect_error([&] { Mamba3PreprocessCuda pre(s); }, megacpp::ErrorKind::kInvalidArgument,
                         field, "a bad " + field);
  };
  refused([](Mamba3PreprocessShape& s) { s.rows = 0; }, "rows=0");
  refused([](Mamba3PreprocessShape& s) { s.state = -3; }, "state=-3");
  refused([](Mamba3PreprocessShape& s) { s.state = Mamba3PreprocessCuda::kMaxState + 1; },
          "state=513");
  refused([](Mamba3PreprocessShape& s) { s.heads = Mamba3PreprocessCuda::kMaxHeads + 1; },
          "heads=2049");
  refused([](Mamba3PreprocessShape& s) { s.angles = -1; }, "angles=-1");
  refused([](Mamba3PreprocessShape& s) { s.groups = 0; }, "groups=0");
  refused([](Mamba3PreprocessShape& s) { s.norm_eps = 0; }, "norm_eps");
  refused([](Mamba3PreprocessShape& s) { s.a_floor = -1; }, "a_floor");
  oracle::expect_error([&] { Mamba3PreprocessCuda pre(good, good.columns() - 1); },
                       megacpp::ErrorKind::kInvalidArgument,
                       "proj_stride=" + std::to_string(good.columns() - 1),
                       "a proj stride below the columns");
}

// z and x are copied out or both read in place: one of them alone is refused.
TEST(Mamba3PreprocessCudaShapes, RefusesZWithoutXOrTheReverse) {
  MEGACPP_REQUIRE_GPU();
  Mamba3PreprocessCuda pre(make_shape(4, 2, 4, 8, 1, 1, 1));
  uint16_t dummy = 0;
  float param = 0.f;
  for (const bool z_set : {true, false}) {
    megacpp::cuda::PreprocessDeviceOutputs out{&dummy, &dummy, &dummy, &dummy,
                                               &dummy, &dummy, &dummy, &dummy};
    (z_set ? out.x : out.z) = nullptr;
    oracle::expect_error(
        [&] {
          pre.forward(&dummy, {&param, &param, &param}, out);
        },
        megacpp::ErrorKind::kInvalidArgument, "both set or both null",
        z_set ? "z without x" : "x without z");
  }
}

}  // namespace

MEGACPP_ORACLE_ENTRY(Mamba3Preprocess);

#else

MEGACPP_ORACLE_NO_CUDA(Mamba3PreprocessCuda);

#endif
