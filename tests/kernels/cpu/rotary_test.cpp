#include "kernels/cpu/rotary.h"

#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <random>
#include <string>
#include <vector>

namespace megacpp::cpu {
namespace {

// A packed qkv-like row: 3 q heads then 1 k head then 1 v head, plus 2 spare columns,
// so the strided path and the untouched columns are both exercised.
struct Layout {
  int batch = 2;
  int seqlen = 7;
  int heads = 4;  // the rotated ones (q and k)
  int head_dim = 6;
  int rotary_dim = 4;
  int head_offset = 3;
  int row_stride = 3 + 5 * 6 + 2;
  double base = 10000.0;
  size_t size() const { return static_cast<size_t>(batch) * seqlen * row_stride; }
};

std::vector<double> random_vector(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

template <typename T>
void forward(const Layout& s, std::vector<T>& x) {
  rotary_forward(s.batch, s.seqlen, s.row_stride, s.head_offset, s.heads, s.head_dim, s.rotary_dim,
                 s.base, x.data());
}

template <typename T>
void backward(const Layout& s, std::vector<T>& x) {
  rotary_backward(s.batch, s.seqlen, s.row_stride, s.head_offset, s.heads, s.head_dim, s.rotary_dim,
                  s.base, x.data());
}

size_t at(const Layout& s, int b, int t, int h, int d) {
  return (static_cast<size_t>(b) * s.seqlen + t) * s.row_stride + s.head_offset +
         static_cast<size_t>(h) * s.head_dim + d;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

// Pairs (d, d + rd/2) as complex numbers turn by e^{i t theta}: an independent
// statement of the same rotation.
std::vector<double> reference(const Layout& s, const std::vector<double>& x) {
  std::vector<double> y = x;
  const int half = s.rotary_dim / 2;
  for (int b = 0; b < s.batch; ++b) {
    for (int t = 0; t < s.seqlen; ++t) {
      for (int h = 0; h < s.heads; ++h) {
        for (int i = 0; i < half; ++i) {
          const double theta = t / std::pow(s.base, (2.0 * i) / s.rotary_dim);
          const std::complex<double> z(x[at(s, b, t, h, i)], x[at(s, b, t, h, i + half)]);
          const std::complex<double> turned = z * std::polar(1.0, theta);
          y[at(s, b, t, h, i)] = turned.real();
          y[at(s, b, t, h, i + half)] = turned.imag();
        }
      }
    }
  }
  return y;
}

TEST(Rotary, MatchesComplexMultiplicationReference) {
  for (const int rotary_dim : {2, 4, 6}) {
    Layout s;
    s.rotary_dim = rotary_dim;
    s.base = rotary_dim == 6 ? 500.0 : 10000.0;
    const std::vector<double> x = random_vector(s.size(), 1);
    std::vector<double> y = x;
    forward(s, y);
    const std::vector<double> expected = reference(s, x);
    for (size_t i = 0; i < y.size(); ++i) {
      EXPECT_NEAR(y[i], expected[i], 1e-14) << "rotary_dim " << rotary_dim << " index " << i;
    }
  }
}

TEST(Rotary, LeavesEverythingOutsideTheRotaryDimsUntouched) {
  Layout s;
  const std::vector<double> x = random_vector(s.size(), 2);
  std::vector<double> y = x;
  forward(s, y);
  std::vector<bool> rotated(s.size(), false);
  for (int b = 0; b < s.batch; ++b) {
    for (int t = 0; t < s.seqlen; ++t) {
      for (int h = 0; h < s.heads; ++h) {
        for (int d = 0; d < s.rotary_dim; ++d) rotated[at(s, b, t, h, d)] = true;
      }
    }
  }
  int changed = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    if (!rotated[i]) {
      EXPECT_EQ(y[i], x[i]) << "index " << i;
    } else if (y[i] != x[i]) {
      ++changed;
    }
  }
  EXPECT_GT(changed, 0);
}

TEST(Rotary, PositionZeroIsIdentity) {
  Layout s;
  s.rotary_dim = s.head_dim;
  const std::vector<double> x = random_vector(s.size(), 3);
  std::vector<double> y = x;
  forward(s, y);
  for (int b = 0; b < s.batch; ++b) {
    for (int h = 0; h < s.heads; ++h) {
      for (int d = 0; d < s.head_dim; ++d) EXPECT_EQ(y[at(s, b, 0, h, d)], x[at(s, b, 0, h, d)]);
    }
  }
}

TEST(Rotary, PreservesTheNormOfEveryHead) {
  Layout s;
  const std::vector<double> x = random_vector(s.size(), 4);
  std::vector<double> y = x;
  forward(s, y);
  for (int b = 0; b < s.batch; ++b) {
    for (int t = 0; t < s.seqlen; ++t) {
      for (int h = 0; h < s.heads; ++h) {
        double before = 0;
        double after = 0;
        for (int d = 0; d < s.head_dim; ++d) {
          before += x[at(s, b, t, h, d)] * x[at(s, b, t, h, d)];
          after += y[at(s, b, t, h, d)] * y[at(s, b, t, h, d)];
        }
        EXPECT_NEAR(after, before, 1e-13);
      }
    }
  }
}

TEST(Rotary, BackwardIsTheExactTranspose) {
  Layout s;
  const std::vector<double> x = random_vector(s.size(), 5);
  const std::vector<double> y = random_vector(s.size(), 6);
  std::vector<double> rx = x;
  forward(s, rx);
  std::vector<double> rty = y;
  backward(s, rty);
  EXPECT_NEAR(dot(rx, y), dot(x, rty), 1e-12);
  // A rotation's transpose is its inverse.
  backward(s, rx);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(rx[i], x[i], 1e-14);
}

TEST(Rotary, FiniteDifferenceGradient) {
  Layout s;
  const std::vector<double> x = random_vector(s.size(), 7);
  const std::vector<double> weight = random_vector(s.size(), 8);
  auto loss = [&](const std::vector<double>& input) {
    std::vector<double> y = input;
    forward(s, y);
    return dot(y, weight);
  };
  std::vector<double> grad = weight;
  backward(s, grad);
  const double eps = 1e-5;
  for (size_t i = 0; i < x.size(); ++i) {
    std::vector<double> plus = x;
    std::vector<double> minus = x;
    plus[i] += eps;
    minus[i] -= eps;
    const double numeric = (loss(plus) - loss(minus)) / (2 * eps);
    EXPECT_NEAR(grad[i], numeric, 1e-6 * std::max(1.0, std::abs(numeric))) << "index " << i;
  }
}

TEST(Rotary, FloatAgreesWithDouble) {
  Layout s;
  s.seqlen = 2048;  // large angles (the tables are computed in double for both types) and
                    // enough rows for the parallel path
  s.rotary_dim = s.head_dim;
  const std::vector<double> x = random_vector(s.size(), 9);
  std::vector<double> yd = x;
  forward(s, yd);
  std::vector<float> yf(x.begin(), x.end());
  forward(s, yf);
  std::vector<double> gd = x;
  backward(s, gd);
  std::vector<float> gf(x.begin(), x.end());
  backward(s, gf);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_NEAR(yf[i], yd[i], 1e-6) << "index " << i;
    EXPECT_NEAR(gf[i], gd[i], 1e-6) << "index " << i;
  }
}

TEST(Rotary, ZeroRotaryDimIsANoOp) {
  Layout s;
  s.rotary_dim = 0;
  const std::vector<double> x = random_vector(s.size(), 10);
  std::vector<double> y = x;
  forward(s, y);
  backward(s, y);
  EXPECT_EQ(y, x);
}

void expect_refused(const Layout& s, const std::string& field) {
  std::vector<double> x(1024, 0.0);
  try {
    rotary_forward(s.batch, s.seqlen, s.row_stride, s.head_offset, s.heads, s.head_dim,
                   s.rotary_dim, s.base, x.data());
    ADD_FAILURE() << "accepted a bad " << field;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}

TEST(Rotary, RefusesBadShapes) {
  Layout s;
  s.batch = 1;
  s.seqlen = 2;
  Layout bad = s;
  bad.rotary_dim = 3;
  expect_refused(bad, "rotary_dim");
  bad = s;
  bad.rotary_dim = 8;
  expect_refused(bad, "rotary_dim");
  bad = s;
  bad.rotary_dim = -2;
  expect_refused(bad, "rotary_dim");
  bad = s;
  bad.row_stride = bad.head_offset + bad.heads * bad.head_dim - 1;
  expect_refused(bad, "row_stride");
  bad = s;
  bad.head_offset = -1;
  expect_refused(bad, "head_offset");
  bad = s;
  bad.base = 0.0;
  expect_refused(bad, "base");
  bad = s;
  bad.heads = 0;
  expect_refused(bad, "heads");
  bad = s;
  bad.seqlen = 0;
  expect_refused(bad, "seqlen");
  bad = s;
  bad.batch = -1;
  expect_refused(bad, "batch");
  bad = s;
  bad.head_dim = 0;
  expect_refused(bad, "head_dim");
}

}  // namespace
}  // namespace megacpp::cpu
