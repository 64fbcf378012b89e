#include "kernels/cpu/cross_entropy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace megacpp::cpu {
namespace {

struct Problem {
  int rows = 0;
  int vocab_padded = 0;
  int vocab_size = 0;
  std::vector<double> logits;
  std::vector<int32_t> targets;
};

// Every column, padded ones included, drawn from the same distribution: the padded columns
// are ordinary members of the softmax.
Problem make_problem(int rows, int vocab_padded, int vocab_size, unsigned seed,
                     double amplitude = 3.0) {
  Problem p{rows, vocab_padded, vocab_size, {}, {}};
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> logit(-amplitude, amplitude);
  std::uniform_int_distribution<int32_t> token(0, vocab_size - 1);
  p.logits.resize(static_cast<size_t>(rows) * vocab_padded);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < vocab_padded; ++c) {
      p.logits[static_cast<size_t>(r) * vocab_padded + c] = logit(rng);
    }
    p.targets.push_back(token(rng));
  }
  return p;
}

// log(sum(exp)) written directly (fine for the small logits used with it), over the first
// `columns` columns: all of them (vocab_padded) for the official loss.
double reference_loss(const Problem& p, int columns) {
  double total = 0;
  int counted = 0;
  for (int r = 0; r < p.rows; ++r) {
    if (p.targets[r] < 0) continue;
    const double* x = p.logits.data() + static_cast<size_t>(r) * p.vocab_padded;
    double sum = 0;
    for (int c = 0; c < columns; ++c) sum += std::exp(x[c]);
    total += std::log(sum) - x[p.targets[r]];
    ++counted;
  }
  return counted ? total / counted : 0.0;
}

double loss_and_grad(const Problem& p, std::vector<double>& grad, float grad_scale) {
  grad.assign(p.logits.size(), std::nan(""));
  return cross_entropy_forward_backward(p.rows, p.vocab_padded, p.vocab_size, p.logits.data(),
                                        p.targets.data(), grad.data(), grad_scale);
}

TEST(CrossEntropy, MatchesReference) {
  Problem p = make_problem(9, 16, 13, 1);
  p.targets[2] = -1;
  p.targets[5] = -100;
  p.targets[6] = 0;
  p.targets[7] = 12;  // the last real token
  const double expected = reference_loss(p, p.vocab_padded);
  std::vector<double> grad;
  EXPECT_NEAR(loss_and_grad(p, grad, 1.0f), expected, 1e-13);
  EXPECT_NEAR(cross_entropy_forward(p.rows, p.vocab_padded, p.vocab_size, p.logits.data(),
                                    p.targets.data()),
              expected, 1e-13);
}

TEST(CrossEntropy, GradientIsSoftmaxMinusOneHotOverValidRows) {
  Problem p = make_problem(6, 12, 10, 2);
  p.targets[1] = -1;
  const float grad_scale = 0.25f;
  std::vector<double> grad;
  loss_and_grad(p, grad, grad_scale);
  const int valid = 5;
  for (int r = 0; r < p.rows; ++r) {
    const double* x = p.logits.data() + static_cast<size_t>(r) * p.vocab_padded;
    double sum = 0;
    for (int c = 0; c < p.vocab_padded; ++c) sum += std::exp(x[c]);
    for (int c = 0; c < p.vocab_padded; ++c) {
      double expected = 0;
      if (p.targets[r] >= 0) {
        expected = (std::exp(x[c]) / sum - (c == p.targets[r] ? 1.0 : 0.0)) * grad_scale / valid;
      }
      EXPECT_NEAR(grad[static_cast<size_t>(r) * p.vocab_padded + c], expected, 1e-15)
          << "row " << r << " column " << c;
    }
  }
}

// The official convention (shared/spec/model.md): the padded columns are part of the softmax.
// Their logits move the loss, they receive softmax-probability gradients, and the loss is not the
// masked one over the real columns alone.
TEST(CrossEntropy, PaddedColumnsTakePartInLossAndGradient) {
  Problem p = make_problem(5, 16, 11, 9);
  std::vector<double> grad;
  const double loss = loss_and_grad(p, grad, 1.0f);
  EXPECT_NEAR(loss, reference_loss(p, p.vocab_padded), 1e-13);
  EXPECT_GT(std::abs(loss - reference_loss(p, p.vocab_size)), 1e-3);
  for (int r = 0; r < p.rows; ++r) {
    for (int c = p.vocab_size; c < p.vocab_padded; ++c) {
      EXPECT_GT(grad[static_cast<size_t>(r) * p.vocab_padded + c], 0.0)
          << "row " << r << " padded column " << c;
    }
  }
  // Raising one padded column's logit raises the loss of its row (it is never the target).
  p.logits[static_cast<size_t>(2) * p.vocab_padded + 13] += 4.0;
  EXPECT_GT(cross_entropy_forward(p.rows, p.vocab_padded, p.vocab_size, p.logits.data(),
                                  p.targets.data()),
            loss + 1e-3);
}

TEST(CrossEntropy, FiniteDifferenceGradient) {
  Problem p = make_problem(7, 11, 8, 3);
  p.targets[3] = -1;
  p.targets[6] = -5;
  std::vector<double> grad;
  loss_and_grad(p, grad, 1.0f);
  const double eps = 1e-5;
  for (size_t i = 0; i < p.logits.size(); ++i) {
    const double saved = p.logits[i];
    p.logits[i] = saved + eps;
    const double plus = cross_entropy_forward(p.rows, p.vocab_padded, p.vocab_size, p.logits.data(),
                                              p.targets.data());
    p.logits[i] = saved - eps;
    const double minus = cross_entropy_forward(p.rows, p.vocab_padded, p.vocab_size,
                                               p.logits.data(), p.targets.data());
    p.logits[i] = saved;
    const double numeric = (plus - minus) / (2 * eps);
    ASSERT_NEAR(grad[i], numeric, 1e-6 * std::max(std::abs(numeric), 1e-2)) << "element " << i;
  }
}

TEST(CrossEntropy, StableForLargeLogits) {
  Problem p = make_problem(4, 8, 8, 4);
  for (double& x : p.logits) x += 1e4;  // exp would overflow without the max shift
  const double expected = reference_loss(make_problem(4, 8, 8, 4), 8);
  std::vector<double> grad;
  EXPECT_NEAR(loss_and_grad(p, grad, 1.0f), expected, 1e-9);
  std::vector<float> logits_float(p.logits.begin(), p.logits.end());
  std::vector<float> grad_float(logits_float.size());
  const float loss_float =
      cross_entropy_forward_backward(p.rows, p.vocab_padded, p.vocab_size, logits_float.data(),
                                     p.targets.data(), grad_float.data(), 1.0f);
  EXPECT_TRUE(std::isfinite(loss_float));
  EXPECT_NEAR(loss_float, expected, 5e-3);  // the logits themselves are rounded at 1e4
}

TEST(CrossEntropy, FloatAgreesWithDouble) {
  Problem p = make_problem(64, 520, 500, 5, 8.0);
  p.targets[10] = -1;
  std::vector<double> grad;
  const double loss = loss_and_grad(p, grad, 2.0f);
  const std::vector<float> logits_float(p.logits.begin(), p.logits.end());
  std::vector<float> grad_float(logits_float.size());
  const float loss_float =
      cross_entropy_forward_backward(p.rows, p.vocab_padded, p.vocab_size, logits_float.data(),
                                     p.targets.data(), grad_float.data(), 2.0f);
  EXPECT_NEAR(loss_float, loss, 1e-5 * loss);
  for (size_t i = 0; i < grad.size(); ++i) ASSERT_NEAR(grad_float[i], grad[i], 1e-8) << i;
}

TEST(CrossEntropy, AllRowsIgnoredGivesZero) {
  Problem p = make_problem(3, 8, 5, 6);
  for (int32_t& t : p.targets) t = -1;
  std::vector<double> grad;
  EXPECT_EQ(loss_and_grad(p, grad, 1.0f), 0.0);
  for (const double g : grad) EXPECT_EQ(g, 0.0);
}

TEST(CrossEntropy, Deterministic) {
  Problem p = make_problem(257, 136, 130, 7);
  const std::vector<float> logits(p.logits.begin(), p.logits.end());
  std::vector<float> first(logits.size());
  std::vector<float> second(logits.size());
  const float loss_first = cross_entropy_forward_backward(
      p.rows, p.vocab_padded, p.vocab_size, logits.data(), p.targets.data(), first.data(), 1.0f);
  const float loss_second = cross_entropy_forward_backward(
      p.rows, p.vocab_padded, p.vocab_size, logits.data(), p.targets.data(), second.data(), 1.0f);
  EXPECT_EQ(loss_first, loss_second);
  EXPECT_EQ(0, std::memcmp(first.data(), second.data(), first.size() * sizeof(float)));
}

TEST(CrossEntropy, RefusesTargetOutsideVocabulary) {
  Problem p = make_problem(5, 16, 13, 8);
  p.targets[3] = 13;  // a padding column, not a token
  std::vector<double> grad(p.logits.size(), 7.0);
  try {
    cross_entropy_forward_backward(p.rows, p.vocab_padded, p.vocab_size, p.logits.data(),
                                   p.targets.data(), grad.data(), 1.0f);
    ADD_FAILURE() << "accepted target 13 with vocab_size 13";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    const std::string message = e.what();
    EXPECT_NE(message.find("row 3"), std::string::npos) << message;
    EXPECT_NE(message.find("13"), std::string::npos) << message;
  }
  for (const double g : grad) EXPECT_EQ(g, 7.0);  // refused before writing anything
}

TEST(CrossEntropy, RefusesBadShapes) {
  const std::vector<double> logits(64, 0.0);
  const std::vector<int32_t> targets(4, 0);
  auto expect_refused = [&](int rows, int vocab_padded, int vocab_size, const std::string& field) {
    try {
      cross_entropy_forward(rows, vocab_padded, vocab_size, logits.data(), targets.data());
      ADD_FAILURE() << "accepted a bad " << field;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  expect_refused(4, 8, 9, "vocab_padded");
  expect_refused(4, 8, 0, "vocab_size");
  expect_refused(-1, 8, 8, "rows");
}

}  // namespace
}  // namespace megacpp::cpu
