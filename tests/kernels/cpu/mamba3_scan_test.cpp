#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numbers>
#include <ostream>
#include <string>
#include <vector>

#include "base/error.h"
#include "base/rng.h"
#include "kernels/contracts/mamba3_scan.h"
#include "kernels/cpu/mamba3_scan_chunked.h"
#include "kernels/cpu/mamba3_scan_recurrent.h"

namespace megacpp::cpu {

// Names the shape in failure messages of parameterized tests (found by ADL).
void PrintTo(const ScanShape& s, std::ostream* out) {
  *out << "B" << s.batch << " L" << s.seqlen << " H" << s.heads << " G" << s.groups << " N"
       << s.state << " P" << s.headdim << " R" << s.rank << " C" << s.chunk << " A" << s.angles;
}

namespace {

constexpr int kTensorCount = 14;
const char* const kTensorNames[kTensorCount] = {"q",      "k",      "v",      "z",      "adt",
                                                "dt",     "trap",   "angles", "q_bias", "k_bias",
                                                "mimo_x", "mimo_z", "mimo_o", "d"};

// The 14 scan inputs (or their gradients), in kTensorNames order.
template <typename T>
struct Tensors {
  std::vector<T> data[kTensorCount];

  explicit Tensors(const ScanShape& s) {
    const size_t b = static_cast<size_t>(s.batch), l = static_cast<size_t>(s.seqlen);
    const size_t h = static_cast<size_t>(s.heads), g = static_cast<size_t>(s.groups);
    const size_t n = static_cast<size_t>(s.state), p = static_cast<size_t>(s.headdim);
    const size_t r = static_cast<size_t>(s.rank), a = static_cast<size_t>(s.angles);
    const size_t sizes[kTensorCount] = {b * l * r * g * n, b * l * r * g * n,
                                        b * l * h * p,     b * l * h * p,
                                        b * l * h,         b * l * h,
                                        b * l * h,         b * l * a,
                                        h * r * n,         h * r * n,
                                        h * r * p,         h * r * p,
                                        h * r * p,         h};
    for (int i = 0; i < kTensorCount; ++i) data[i].assign(sizes[i], T(0));
  }

  ScanInputs<T> inputs() const {
    return {data[0].data(),  data[1].data(),  data[2].data(),  data[3].data(), data[4].data(),
            data[5].data(),  data[6].data(),  data[7].data(),  data[8].data(), data[9].data(),
            data[10].data(), data[11].data(), data[12].data(), data[13].data()};
  }
  ScanGrads<T> grads() {
    return {data[0].data(),  data[1].data(),  data[2].data(),  data[3].data(), data[4].data(),
            data[5].data(),  data[6].data(),  data[7].data(),  data[8].data(), data[9].data(),
            data[10].data(), data[11].data(), data[12].data(), data[13].data()};
  }
};

size_t output_size(const ScanShape& s) {
  return static_cast<size_t>(s.batch) * static_cast<size_t>(s.seqlen) *
         static_cast<size_t>(s.heads) * static_cast<size_t>(s.headdim);
}

// Inputs in the ranges the mixer produces: normalized q/k, decaying ADT < 0, small
// positive DT, and the parameters near their initial values.
Tensors<double> random_inputs(const ScanShape& s, uint64_t seed) {
  Rng rng(seed);
  Tensors<double> t(s);
  const double inv_rank = 1.0 / s.rank;
  const auto fill = [&](int index, auto draw) {
    for (double& x : t.data[index]) x = draw();
  };
  fill(0, [&] { return rng.normal(); });
  fill(1, [&] { return rng.normal(); });
  fill(2, [&] { return rng.normal(); });
  fill(3, [&] { return rng.normal(); });
  fill(4, [&] { return -rng.uniform(0.01, 0.5); });
  fill(5, [&] { return rng.uniform(0.01, 0.3); });
  fill(6, [&] { return rng.normal(); });
  fill(7, [&] { return rng.normal(); });
  fill(8, [&] { return 1.0 + 0.3 * rng.normal(); });
  fill(9, [&] { return 1.0 + 0.3 * rng.normal(); });
  fill(10, [&] { return inv_rank * (1.0 + 0.3 * rng.normal()); });
  fill(11, [&] { return 1.0 + 0.3 * rng.normal(); });
  fill(12, [&] { return inv_rank * (1.0 + 0.3 * rng.normal()); });
  fill(13, [&] { return 1.0 + 0.3 * rng.normal(); });
  return t;
}

std::vector<double> random_vector(size_t count, uint64_t seed) {
  Rng rng(seed);
  std::vector<double> out(count);
  for (double& x : out) x = rng.normal();
  return out;
}

template <typename T>
Tensors<T> converted(const Tensors<double>& in, const ScanShape& s) {
  Tensors<T> out(s);
  for (int i = 0; i < kTensorCount; ++i) {
    for (size_t j = 0; j < in.data[i].size(); ++j) out.data[i][j] = static_cast<T>(in.data[i][j]);
  }
  return out;
}

template <typename T>
std::vector<T> converted(const std::vector<double>& in) {
  std::vector<T> out(in.size());
  for (size_t j = 0; j < in.size(); ++j) out[j] = static_cast<T>(in[j]);
  return out;
}

// max|a − b| / max|b|.
template <typename T>
double relative_error(const std::vector<T>& a, const std::vector<double>& b) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return scale > 0.0 ? diff / scale : diff;
}

struct Result {
  std::vector<double> y;
  Tensors<double> grads;
};

template <typename Scan, typename T = double>
Result run(const ScanShape& s, const Tensors<double>& in, const std::vector<double>& dy) {
  Scan scan(s);
  const Tensors<T> inputs = converted<T>(in, s);
  const std::vector<T> dy_t = converted<T>(dy);
  std::vector<T> y(output_size(s));
  Tensors<T> grads(s);
  scan.forward(inputs.inputs(), y.data());
  scan.backward(inputs.inputs(), dy_t.data(), grads.grads());
  Result result{std::vector<double>(y.begin(), y.end()), Tensors<double>(s)};
  for (int i = 0; i < kTensorCount; ++i) {
    result.grads.data[i].assign(grads.data[i].begin(), grads.data[i].end());
  }
  return result;
}

// y written straight from the spec's formulas with no code shared with the
// kernels: rotation as quarters (ρ = 0.5) or halves (ρ = 1), and the recurrence.
std::vector<double> spec_forward(const ScanShape& s, const Tensors<double>& in) {
  const int n_dim = s.state, p_dim = s.headdim, rank = s.rank, a_n = s.angles;
  std::vector<double> y(output_size(s), 0.0);
  const auto& q = in.data[0];
  const auto& k = in.data[1];
  const auto& x = in.data[2];
  const auto& z = in.data[3];
  const auto& adt = in.data[4];
  const auto& dt = in.data[5];
  const auto& trap = in.data[6];
  const auto& angles = in.data[7];
  const auto& q_bias = in.data[8];
  const auto& k_bias = in.data[9];
  const auto& mimo_x = in.data[10];
  const auto& mimo_z = in.data[11];
  const auto& mimo_o = in.data[12];
  const auto& d = in.data[13];
  // The partner offset of a rotated dim: N/4 · 2 for quarters Q0 ↔ Q2, N/2 for halves.
  EXPECT_TRUE(a_n == 0 || a_n == n_dim / 4 || a_n == n_dim / 2);
  const auto index3 = [&](int b, int t, int h) {
    return (b * s.seqlen + t) * s.heads + h;
  };
  for (int b = 0; b < s.batch; ++b) {
    for (int h = 0; h < s.heads; ++h) {
      const int g = h / (s.heads / s.groups);
      std::vector<double> state(static_cast<size_t>(p_dim * n_dim), 0.0);
      std::vector<double> theta(static_cast<size_t>(a_n), 0.0);
      std::vector<std::vector<double>> k_prev, v_prev;
      for (int t = 0; t < s.seqlen; ++t) {
        const double dt_t = dt[index3(b, t, h)];
        for (int j = 0; j < a_n; ++j) {
          theta[j] += std::tanh(angles[(b * s.seqlen + t) * a_n + j]) * dt_t * std::numbers::pi;
        }
        std::vector<std::vector<double>> q_rot, k_rot, v_r;
        for (int r = 0; r < rank; ++r) {
          std::vector<double> qv(n_dim), kv(n_dim), vv(p_dim);
          for (int n = 0; n < n_dim; ++n) {
            const int in_index = (((b * s.seqlen + t) * rank + r) * s.groups + g) * n_dim + n;
            qv[n] = q[in_index] + q_bias[(h * rank + r) * n_dim + n];
            kv[n] = k[in_index] + k_bias[(h * rank + r) * n_dim + n];
          }
          // Q0' = Q0 cos − Q2 sin, Q2' = Q0 sin + Q2 cos (quarters), or H0/H1 (halves).
          for (auto* vec : {&qv, &kv}) {
            std::vector<double> orig = *vec;
            for (int j = 0; j < a_n; ++j) {
              const int lo = j, hi = (a_n == n_dim / 4 ? 2 * (n_dim / 4) : n_dim / 2) + j;
              (*vec)[lo] = orig[lo] * std::cos(theta[j]) - orig[hi] * std::sin(theta[j]);
              (*vec)[hi] = orig[lo] * std::sin(theta[j]) + orig[hi] * std::cos(theta[j]);
            }
          }
          for (int p = 0; p < p_dim; ++p) {
            vv[p] = x[index3(b, t, h) * p_dim + p] * mimo_x[(h * rank + r) * p_dim + p];
          }
          q_rot.push_back(qv);
          k_rot.push_back(kv);
          v_r.push_back(vv);
        }
        const double tau = 1.0 / (1.0 + std::exp(-trap[index3(b, t, h)]));
        const double alpha = std::exp(adt[index3(b, t, h)]);
        const double beta = (1.0 - tau) * dt_t * alpha, gamma = tau * dt_t;
        for (int p = 0; p < p_dim; ++p) {
          for (int n = 0; n < n_dim; ++n) {
            double value = alpha * state[p * n_dim + n];
            for (int r = 0; r < rank; ++r) {
              if (t > 0) value += beta * v_prev[r][p] * k_prev[r][n];
              value += gamma * v_r[r][p] * k_rot[r][n];
            }
            state[p * n_dim + n] = value;
          }
        }
        for (int p = 0; p < p_dim; ++p) {
          double out = 0.0;
          for (int r = 0; r < rank; ++r) {
            double o = d[h] * v_r[r][p];
            for (int n = 0; n < n_dim; ++n) o += state[p * n_dim + n] * q_rot[r][n];
            const double zg = z[index3(b, t, h) * p_dim + p] * mimo_z[(h * rank + r) * p_dim + p];
            out += o * zg / (1.0 + std::exp(-zg)) * mimo_o[(h * rank + r) * p_dim + p];
          }
          y[index3(b, t, h) * p_dim + p] = out;
        }
        k_prev = k_rot;
        v_prev = v_r;
      }
    }
  }
  return y;
}

ScanShape small_shape(int rank, int angles) {
  ScanShape s;
  s.batch = 2;
  s.seqlen = 7;
  s.heads = 4;
  s.groups = 2;
  s.state = 8;
  s.headdim = 4;
  s.rank = rank;
  s.chunk = 3;
  s.angles = angles;
  return s;
}

std::string describe(const ScanShape& s) {
  char text[160];
  std::snprintf(text, sizeof(text), "B%d L%d H%d G%d N%d P%d R%d C%d A%d", s.batch, s.seqlen,
                s.heads, s.groups, s.state, s.headdim, s.rank, s.chunk, s.angles);
  return text;
}

class SmallShapes : public ::testing::TestWithParam<ScanShape> {};

TEST_P(SmallShapes, RecurrentForwardMatchesSpecFormulas) {
  const ScanShape s = GetParam();
  const Tensors<double> in = random_inputs(s, 11);
  const std::vector<double> expected = spec_forward(s, in);
  std::vector<double> y(output_size(s));
  Mamba3ScanRecurrent<double> scan(s);
  scan.forward(in.inputs(), y.data());
  EXPECT_LE(relative_error(y, expected), 1e-13);
  Mamba3ScanChunked<double> chunked(s);
  chunked.forward(in.inputs(), y.data());
  EXPECT_LE(relative_error(y, expected), 1e-13);
}

// Central differences of L = Σ dy·y against backward(), every element of every
// input.
template <typename Scan>
void check_gradients_by_finite_differences(const ScanShape& s) {
  Tensors<double> in = random_inputs(s, 21);
  const std::vector<double> dy = random_vector(output_size(s), 22);
  Scan scan(s);
  std::vector<double> y(output_size(s));
  Tensors<double> grads(s);
  scan.forward(in.inputs(), y.data());
  scan.backward(in.inputs(), dy.data(), grads.grads());
  const auto loss = [&] {
    scan.forward(in.inputs(), y.data());
    double sum = 0.0;
    for (size_t i = 0; i < y.size(); ++i) sum += dy[i] * y[i];
    return sum;
  };
  for (int tensor = 0; tensor < kTensorCount; ++tensor) {
    const std::vector<double>& analytic = grads.data[tensor];
    double largest = 0.0;
    for (double g : analytic) largest = std::max(largest, std::abs(g));
    double worst = 0.0;
    size_t worst_index = 0;
    for (size_t i = 0; i < in.data[tensor].size(); ++i) {
      double& x = in.data[tensor][i];
      const double original = x, step = 1e-5 * std::max(1.0, std::abs(original));
      x = original + step;
      const double plus = loss();
      x = original - step;
      const double minus = loss();
      x = original;
      const double numeric = (plus - minus) / (2.0 * step);
      const double error =
          std::abs(numeric - analytic[i]) / std::max({std::abs(analytic[i]), 1e-2 * largest, 1e-8});
      if (error > worst) {
        worst = error;
        worst_index = i;
      }
    }
    EXPECT_LE(worst, 1e-6) << kTensorNames[tensor] << " element " << worst_index << " of "
                           << in.data[tensor].size() << ", analytic " << analytic[worst_index];
    if (!analytic.empty()) {
      EXPECT_GT(largest, 0.0) << kTensorNames[tensor] << " gradient is all zero";
    }
  }
}

TEST_P(SmallShapes, RecurrentGradientsMatchFiniteDifferences) {
  check_gradients_by_finite_differences<Mamba3ScanRecurrent<double>>(GetParam());
}

TEST_P(SmallShapes, ChunkedGradientsMatchFiniteDifferences) {
  check_gradients_by_finite_differences<Mamba3ScanChunked<double>>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Mamba3Scan, SmallShapes,
                         ::testing::Values(small_shape(2, 2), small_shape(2, 4), small_shape(1, 2),
                                           small_shape(2, 0)),
                         [](const ::testing::TestParamInfo<ScanShape>& shape_info) {
                           const ScanShape& s = shape_info.param;
                           return "R" + std::to_string(s.rank) + "A" + std::to_string(s.angles);
                         });

// The correctness grid of shared/bench/anchors.md at a length the CPU affords.
struct GridPoint {
  int state, headdim, rank, chunk;
};

void expect_chunked_equals_recurrent(const ScanShape& s, uint64_t seed) {
  SCOPED_TRACE(describe(s));
  const Tensors<double> in = random_inputs(s, seed);
  const std::vector<double> dy = random_vector(output_size(s), seed + 1);
  const Result reference = run<Mamba3ScanRecurrent<double>>(s, in, dy);
  const Result chunked = run<Mamba3ScanChunked<double>>(s, in, dy);
  EXPECT_LE(relative_error(chunked.y, reference.y), 1e-9) << "y";
  for (int i = 0; i < kTensorCount; ++i) {
    EXPECT_LE(relative_error(chunked.grads.data[i], reference.grads.data[i]), 1e-9)
        << kTensorNames[i];
  }
}

TEST(Mamba3Scan, ChunkedEqualsRecurrentOnTheCorrectnessGrid) {
  const GridPoint grid[] = {{16, 64, 4, 8},  {32, 64, 4, 16},  {64, 64, 4, 16},  {128, 64, 4, 16},
                            {256, 64, 4, 8}, {64, 128, 4, 16}, {128, 32, 4, 16}, {128, 128, 4, 8},
                            {128, 64, 8, 8}, {128, 64, 2, 32}, {128, 64, 1, 64}};
  uint64_t seed = 100;
  for (const GridPoint& point : grid) {
    ScanShape s;
    s.batch = 1;
    s.heads = 2;
    s.groups = 1;
    s.state = point.state;
    s.headdim = point.headdim;
    s.rank = point.rank;
    s.chunk = point.chunk;
    s.angles = point.state / 4;
    s.seqlen = 2 * point.chunk + 5;
    expect_chunked_equals_recurrent(s, seed += 2);
  }
}

TEST(Mamba3Scan, ChunkedEqualsRecurrentWhenSeqlenIsAMultipleOfTheChunk) {
  ScanShape s;
  s.batch = 2;
  s.seqlen = 48;
  s.heads = 4;
  s.groups = 2;
  s.state = 64;
  s.headdim = 64;
  s.rank = 4;
  s.chunk = 16;
  s.angles = 16;
  expect_chunked_equals_recurrent(s, 300);
  s.seqlen = 5;  // shorter than one chunk
  expect_chunked_equals_recurrent(s, 302);
}

TEST(Mamba3Scan, FloatChunkedAgreesWithDoubleRecurrent) {
  ScanShape s;
  s.batch = 2;
  s.seqlen = 45;
  s.heads = 4;
  s.groups = 2;
  s.state = 32;
  s.headdim = 16;
  s.rank = 4;
  s.chunk = 16;
  s.angles = 8;
  const Tensors<double> in = random_inputs(s, 400);
  const std::vector<double> dy = random_vector(output_size(s), 401);
  const Result reference = run<Mamba3ScanRecurrent<double>>(s, in, dy);
  const Result single = run<Mamba3ScanChunked<float>, float>(s, in, dy);
  EXPECT_LE(relative_error(single.y, reference.y), 1e-4) << "y";
  for (int i = 0; i < kTensorCount; ++i) {
    EXPECT_LE(relative_error(single.grads.data[i], reference.grads.data[i]), 1e-4)
        << kTensorNames[i];
  }
}

template <typename Scan, typename T>
void expect_bitwise_repeatable(const ScanShape& s) {
  const Tensors<T> in = converted<T>(random_inputs(s, 500), s);
  const std::vector<T> dy = converted<T>(random_vector(output_size(s), 501));
  Scan scan(s);
  std::vector<T> y_first(output_size(s)), y_second(output_size(s));
  Tensors<T> first(s), second(s);
  // Poison the second set so that an element backward forgets to write shows up.
  for (auto& tensor : second.data) std::fill(tensor.begin(), tensor.end(), T(7));
  scan.forward(in.inputs(), y_first.data());
  scan.backward(in.inputs(), dy.data(), first.grads());
  scan.forward(in.inputs(), y_second.data());
  scan.backward(in.inputs(), dy.data(), second.grads());
  EXPECT_EQ(std::memcmp(y_first.data(), y_second.data(), y_first.size() * sizeof(T)), 0);
  for (int i = 0; i < kTensorCount; ++i) {
    EXPECT_EQ(
        std::memcmp(first.data[i].data(), second.data[i].data(), first.data[i].size() * sizeof(T)),
        0)
        << kTensorNames[i];
  }
}

TEST(Mamba3Scan, BackwardIsBitwiseRepeatableAndOverwrites) {
  ScanShape s;
  s.batch = 3;
  s.seqlen = 37;
  s.heads = 4;
  s.groups = 2;
  s.state = 32;
  s.headdim = 16;
  s.rank = 4;
  s.chunk = 8;
  s.angles = 8;
  expect_bitwise_repeatable<Mamba3ScanChunked<float>, float>(s);
  expect_bitwise_repeatable<Mamba3ScanRecurrent<double>, double>(s);
}

template <typename Scan>
void expect_refused(const ScanShape& s, const std::string& fragment) {
  try {
    Scan scan(s);
    ADD_FAILURE() << "accepted " << describe(s);
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

TEST(Mamba3Scan, RefusesInvalidShapesNamingTheField) {
  const ScanShape good = small_shape(2, 2);
  EXPECT_NO_THROW(Mamba3ScanChunked<double>{good});
  ScanShape s = good;
  s.heads = 16;
  s.groups = 3;
  expect_refused<Mamba3ScanChunked<double>>(s, "ScanShape.groups=3 does not divide heads=16");
  expect_refused<Mamba3ScanRecurrent<double>>(s, "ScanShape.groups=3");
  s = good;
  s.state = 0;
  expect_refused<Mamba3ScanRecurrent<float>>(s, "ScanShape.state=0");
  s = good;
  s.batch = -1;
  expect_refused<Mamba3ScanChunked<float>>(s, "ScanShape.batch=-1");
  s = good;
  s.headdim = 0;
  expect_refused<Mamba3ScanChunked<float>>(s, "ScanShape.headdim=0");
  s = good;
  s.rank = 0;
  expect_refused<Mamba3ScanChunked<float>>(s, "ScanShape.rank=0");
  s = good;
  s.seqlen = 0;
  expect_refused<Mamba3ScanChunked<float>>(s, "ScanShape.seqlen=0");
  s = good;
  s.angles = 5;  // N = 8
  expect_refused<Mamba3ScanChunked<double>>(s, "ScanShape.angles=5");
  s.angles = -1;
  expect_refused<Mamba3ScanRecurrent<double>>(s, "ScanShape.angles=-1");
  s = good;
  s.chunk = 0;
  expect_refused<Mamba3ScanChunked<double>>(s, "ScanShape.chunk=0");
  EXPECT_NO_THROW(Mamba3ScanRecurrent<double>{s});  // the recurrence has no chunks
}

TEST(Mamba3Scan, BackwardBeforeForwardIsRefused) {
  const ScanShape s = small_shape(2, 2);
  const Tensors<double> in = random_inputs(s, 1);
  const std::vector<double> dy(output_size(s), 1.0);
  Tensors<double> grads(s);
  Mamba3ScanChunked<double> scan(s);
  try {
    scan.backward(in.inputs(), dy.data(), grads.grads());
    ADD_FAILURE() << "backward ran without forward";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace megacpp::cpu
