// Gradient checks (double, central differences) and reference checks for the
// small ops: embedding, RMSNorm with residual add, linear, GatedMLP, AdamW and
// gradient clipping.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gated_mlp.h"
#include "kernels/cpu/grad_clip.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/rmsnorm.h"
#include "tests/support/gradcheck.h"

namespace megacpp::cpu {
namespace {

using megacpp::testing::expect_gradient_matches;
using megacpp::testing::random_vector;

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

TEST(Embedding, ForwardGathersAndBackwardScattersRepeatedTokens) {
  const int rows = 5, dim = 3;
  std::vector<int32_t> tokens = {2, 0, 2, 1, 2};
  std::vector<double> table = {0, 1, 2, 10, 11, 12, 20, 21, 22};
  std::vector<double> out(rows * dim);
  embedding_forward(rows, dim, tokens.data(), table.data(), out.data());
  EXPECT_EQ(out[0], 20);
  EXPECT_EQ(out[4], 1);
  std::vector<double> dout(rows * dim, 1.0), dtable(9, 0.0);
  dout[0] = 5;
  embedding_backward(rows, dim, tokens.data(), dout.data(), dtable.data());
  EXPECT_EQ(dtable[6], 5 + 1 + 1);  // token 2 appears 3 times
  EXPECT_EQ(dtable[7], 3);
  EXPECT_EQ(dtable[0], 1);
  EXPECT_EQ(dtable[3], 1);
}

TEST(RmsNorm, MatchesDefinition) {
  std::mt19937_64 rng(1);
  const int rows = 3, dim = 7;
  auto x = random_vector(rows * dim, rng), w = random_vector(dim, rng);
  std::vector<double> residual = x, y(rows * dim), rstd(rows);
  residual_rmsnorm_forward<double>(rows, dim, 1e-5, residual.data(), nullptr, w.data(), y.data(),
                                   rstd.data());
  for (int r = 0; r < rows; ++r) {
    double ms = 0;
    for (int c = 0; c < dim; ++c) ms += x[r * dim + c] * x[r * dim + c] / dim;
    for (int c = 0; c < dim; ++c) {
      EXPECT_NEAR(y[r * dim + c], x[r * dim + c] / std::sqrt(ms + 1e-5) * w[c], 1e-12);
    }
  }
}

TEST(RmsNorm, GradientsOfInputResidualDeltaAndWeight) {
  std::mt19937_64 rng(2);
  const int rows = 4, dim = 6;
  auto base = random_vector(rows * dim, rng), delta = random_vector(rows * dim, rng);
  auto w = random_vector(dim, rng, 0.5, 1.5), dy = random_vector(rows * dim, rng);
  auto residual_grad = random_vector(rows * dim, rng);
  // loss = <dy, norm(base + delta)> + <residual_grad, base + delta>
  auto loss = [&] {
    std::vector<double> r = base, y(rows * dim), rstd(rows);
    residual_rmsnorm_forward(rows, dim, 1e-5, r.data(), delta.data(), w.data(), y.data(),
                             rstd.data());
    return dot(dy, y) + dot(residual_grad, r);
  };
  std::vector<double> r = base, y(rows * dim), rstd(rows);
  residual_rmsnorm_forward(rows, dim, 1e-5, r.data(), delta.data(), w.data(), y.data(),
                           rstd.data());
  std::vector<double> dx(rows * dim), dw(dim, 0.0);
  residual_rmsnorm_backward(rows, dim, r.data(), w.data(), rstd.data(), dy.data(),
                            residual_grad.data(), dx.data(), dw.data());
  expect_gradient_matches("d base", base, dx, loss, rng);
  expect_gradient_matches("d delta", delta, dx, loss, rng);
  expect_gradient_matches("d weight", w, dw, loss, rng);
}

TEST(Linear, GradientsOfInputWeightAndBias) {
  std::mt19937_64 rng(3);
  const int rows = 5, in = 4, out = 3;
  auto x = random_vector(rows * in, rng), w = random_vector(out * in, rng);
  auto b = random_vector(out, rng), dy = random_vector(rows * out, rng);
  auto loss = [&] {
    std::vector<double> y(rows * out);
    linear_forward(rows, in, out, x.data(), w.data(), b.data(), y.data());
    return dot(dy, y);
  };
  std::vector<double> y(rows * out);
  linear_forward(rows, in, out, x.data(), w.data(), b.data(), y.data());
  EXPECT_NEAR(y[0], x[0] * w[0] + x[1] * w[1] + x[2] * w[2] + x[3] * w[3] + b[0], 1e-12);
  std::vector<double> dx(rows * in, 7.0), dw(out * in, 0.0), db(out, 0.0);
  linear_backward(rows, in, out, x.data(), w.data(), dy.data(), dx.data(), dw.data(), db.data());
  expect_gradient_matches("dx", x, dx, loss, rng);
  expect_gradient_matches("dW", w, dw, loss, rng);
  expect_gradient_matches("db", b, db, loss, rng);
  // Weight gradients accumulate; dx accumulates only when asked.
  std::vector<double> dx2 = dx;
  linear_backward(rows, in, out, x.data(), w.data(), dy.data(), dx2.data(), dw.data(), db.data(),
                  /*accumulate_dx=*/true);
  EXPECT_NEAR(dx2[3], 2 * dx[3], 1e-12);
  std::vector<double> once(out * in, 0.0), once_b(out, 0.0);
  linear_backward<double>(rows, in, out, x.data(), w.data(), dy.data(), nullptr, once.data(),
                          once_b.data());
  EXPECT_NEAR(dw[5], 2 * once[5], 1e-12);
}

TEST(GatedMlp, GradientsOfInputAndBothWeights) {
  std::mt19937_64 rng(4);
  const int rows = 3, dim = 4, hidden = 5;
  auto x = random_vector(rows * dim, rng), fc1 = random_vector(2 * hidden * dim, rng);
  auto fc2 = random_vector(dim * hidden, rng), dy = random_vector(rows * dim, rng);
  std::vector<double> fc1_out(rows * 2 * hidden), act(rows * hidden), y(rows * dim);
  auto loss = [&] {
    gated_mlp_forward(rows, dim, hidden, x.data(), fc1.data(), fc2.data(), fc1_out.data(),
                      act.data(), y.data());
    return dot(dy, y);
  };
  loss();
  // h = a ⊙ silu(g) with a the first half of fc1's output.
  const double a = fc1_out[0], g = fc1_out[hidden];
  EXPECT_NEAR(act[0], a * g / (1 + std::exp(-g)), 1e-12);
  std::vector<double> dx(rows * dim), d1(fc1.size(), 0.0), d2(fc2.size(), 0.0);
  std::vector<double> s1(rows * hidden), s2(rows * 2 * hidden);
  gated_mlp_backward(rows, dim, hidden, x.data(), fc1.data(), fc2.data(), fc1_out.data(),
                     act.data(), dy.data(), dx.data(), d1.data(), d2.data(), s1.data(), s2.data());
  expect_gradient_matches("dx", x, dx, loss, rng);
  expect_gradient_matches("dfc1", fc1, d1, loss, rng, 40);
  expect_gradient_matches("dfc2", fc2, d2, loss, rng);
}

TEST(AdamW, MatchesTheAlgorithmStepByStep) {
  std::vector<double> p = {1.0, -2.0}, g = {0.5, 0.25}, m = {0, 0}, v = {0, 0};
  AdamWHyper h{0.1, 0.9, 0.99, 1e-8, 0.01};
  std::vector<double> rp = p, rm = m, rv = v;
  for (int step = 1; step <= 3; ++step) {
    adamw_step<double>(2, p.data(), g.data(), m.data(), v.data(), h, step);
    for (int i = 0; i < 2; ++i) {
      rp[i] -= h.lr * h.weight_decay * rp[i];
      rm[i] = h.beta1 * rm[i] + (1 - h.beta1) * g[i];
      rv[i] = h.beta2 * rv[i] + (1 - h.beta2) * g[i] * g[i];
      const double mhat = rm[i] / (1 - std::pow(h.beta1, step));
      const double vhat = rv[i] / (1 - std::pow(h.beta2, step));
      rp[i] -= h.lr * mhat / (std::sqrt(vhat) + h.eps);
      EXPECT_NEAR(p[i], rp[i], 1e-12) << "step " << step << " i " << i;
    }
  }
  // Without decay a zero gradient leaves a fresh parameter where it is.
  std::vector<double> q = {3.0}, zero = {0.0}, mq = {0}, vq = {0};
  adamw_step<double>(1, q.data(), zero.data(), mq.data(), vq.data(), {0.1, 0.9, 0.99, 1e-8, 0.0},
                     1);
  EXPECT_EQ(q[0], 3.0);
}

TEST(GradClip, ScalesOnlyAboveTheThreshold) {
  std::vector<float> a = {3, 0}, b = {0, 4};
  std::vector<GradBuffer<float>> bufs = {{a.data(), 2}, {b.data(), 2}};
  EXPECT_NEAR(clip_grad_norm<float>(bufs, 10.0), 5.0, 1e-6);
  EXPECT_EQ(a[0], 3.0f);
  EXPECT_NEAR(clip_grad_norm<float>(bufs, 1.0), 5.0, 1e-6);
  EXPECT_NEAR(std::sqrt(a[0] * a[0] + b[1] * b[1]), 1.0, 1e-5);
  EXPECT_NEAR(global_grad_norm<float>(bufs), 1.0, 1e-5);
}

}  // namespace
}  // namespace megacpp::cpu
