// The Mamba-3 mixer's preprocessing: split of in_proj's output, A with its floor,
// softplus DT with dt_bias, ADT, B/C RMSNorm. Checked against the spec's formulas
// and by finite differences for in_proj's output, dt_bias and the norm weights.
#include "kernels/cpu/mamba3_preprocess.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "tests/support/gradcheck.h"

namespace megacpp::cpu {
namespace {

using megacpp::testing::expect_gradient_matches;
using megacpp::testing::random_vector;

Mamba3PreprocessShape small_shape() {
  Mamba3PreprocessShape s;
  s.rows = 3;
  s.heads = 4;
  s.headdim = 2;
  s.state = 4;
  s.groups = 2;
  s.rank = 2;
  s.angles = 2;
  s.a_floor = 1e-4;
  return s;
}

struct Buffers {
  explicit Buffers(const Mamba3PreprocessShape& s)
      : storage(static_cast<size_t>(s.rows) *
                (2 * s.d_inner() + 2 * s.bc_width() + 3 * s.heads + s.angles)) {
    double* p = storage.data();
    auto take = [&](int n) {
      double* out = p;
      p += static_cast<size_t>(s.rows) * n;
      return out;
    };
    view.z = take(s.d_inner());
    view.x = take(s.d_inner());
    view.k = take(s.bc_width());
    view.q = take(s.bc_width());
    view.adt = take(s.heads);
    view.dt = take(s.heads);
    view.trap = take(s.heads);
    view.angles = take(s.angles);
  }
  std::vector<double> storage;
  Mamba3ScanBuffers<double> view{};
};

TEST(Mamba3Preprocess, FollowsTheSpecFormulas) {
  const auto s = small_shape();
  std::mt19937_64 rng(5);
  auto proj = random_vector(static_cast<size_t>(s.rows) * s.columns(), rng, -2, 2);
  proj[s.col_dd_a()] = 0.5;       // f = 1.5
  proj[s.col_dd_a() + 1] = -3.0;  // f = 1/4
  proj[s.col_dd_a() + 2] = -1e6;  // f ≈ 1e-6: the floor binds
  auto dt_bias = random_vector(s.heads, rng), bw = random_vector(s.state, rng),
       cw = random_vector(s.state, rng);
  Buffers out(s);
  std::vector<double> rstd(static_cast<size_t>(s.rows) * 2 * s.rank * s.groups);
  mamba3_preprocess_forward(s, proj.data(), dt_bias.data(), bw.data(), cw.data(), out.view,
                            rstd.data());
  const double dt0 = std::log1p(std::exp(proj[s.col_dd_dt()] + dt_bias[0]));
  EXPECT_NEAR(out.view.dt[0], dt0, 1e-12);
  EXPECT_NEAR(out.view.adt[0], -1.5 * dt0, 1e-12);
  EXPECT_NEAR(out.view.adt[1], -0.25 * out.view.dt[1], 1e-12);
  EXPECT_NEAR(out.view.adt[2], -1e-4 * out.view.dt[2], 1e-15);
  EXPECT_EQ(out.view.z[1], proj[1]);
  EXPECT_EQ(out.view.x[0], proj[s.col_x()]);
  EXPECT_EQ(out.view.trap[3], proj[s.col_trap() + 3]);
  EXPECT_EQ(out.view.angles[1], proj[s.col_angles() + 1]);
  // B's first (r, g) vector, normalized over N and scaled by B_norm.weight.
  double ms = 0;
  for (int n = 0; n < s.state; ++n) ms += proj[s.col_b() + n] * proj[s.col_b() + n] / s.state;
  EXPECT_NEAR(out.view.k[2], proj[s.col_b() + 2] / std::sqrt(ms + 1e-5) * bw[2], 1e-12);
}

TEST(Mamba3Preprocess, GradientsMatchFiniteDifferences) {
  const auto s = small_shape();
  std::mt19937_64 rng(6);
  auto proj = random_vector(static_cast<size_t>(s.rows) * s.columns(), rng, -2, 2);
  proj[s.col_dd_a() + 2] = -1e6;  // the floor: zero gradient
  auto dt_bias = random_vector(s.heads, rng), bw = random_vector(s.state, rng),
       cw = random_vector(s.state, rng);
  Buffers upstream(s);
  const auto upstream_values = random_vector(upstream.storage.size(), rng);
  std::copy(upstream_values.begin(), upstream_values.end(), upstream.storage.begin());
  Buffers out(s);
  std::vector<double> rstd(static_cast<size_t>(s.rows) * 2 * s.rank * s.groups);
  auto loss = [&] {
    mamba3_preprocess_forward(s, proj.data(), dt_bias.data(), bw.data(), cw.data(), out.view,
                              rstd.data());
    double l = 0;
    for (size_t i = 0; i < out.storage.size(); ++i) l += out.storage[i] * upstream.storage[i];
    return l;
  };
  loss();
  std::vector<double> dproj(proj.size()), ddt_bias(s.heads, 0.0), dbw(s.state, 0.0),
      dcw(s.state, 0.0);
  std::vector<double> scratch(static_cast<size_t>(s.rows) * (s.heads + 2 * s.state));
  Mamba3ScanBuffers<const double> g{upstream.view.z,    upstream.view.x,     upstream.view.k,
                                    upstream.view.q,    upstream.view.adt,   upstream.view.dt,
                                    upstream.view.trap, upstream.view.angles};
  mamba3_preprocess_backward(s, proj.data(), dt_bias.data(), bw.data(), cw.data(), rstd.data(), g,
                             dproj.data(), ddt_bias.data(), dbw.data(), dcw.data(), scratch.data());
  EXPECT_EQ(dproj[s.col_dd_a() + 2], 0.0);
  expect_gradient_matches("d in_proj output", proj, dproj, loss, rng, proj.size());
  expect_gradient_matches("d dt_bias", dt_bias, ddt_bias, loss, rng);
  expect_gradient_matches("d B_norm.weight", bw, dbw, loss, rng);
  expect_gradient_matches("d C_norm.weight", cw, dcw, loss, rng);
}

}  // namespace
}  // namespace megacpp::cpu
