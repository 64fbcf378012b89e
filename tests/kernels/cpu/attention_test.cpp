#include "kernels/cpu/attention.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/rotary.h"

namespace megacpp::cpu {
namespace {

AttentionShape make_shape(int batch, int seqlen, int q_heads, int kv_heads, int head_dim) {
  return {batch,    seqlen,   q_heads,
          kv_heads, head_dim, 1.0 / std::sqrt(static_cast<double>(head_dim))};
}

// q, k, v inside one buffer: either three separate contiguous blocks, or
// interleaved as the packed qkv row [q heads | k heads | v heads] of every token.
template <typename T>
struct Qkv {
  AttentionShape shape;
  bool packed = false;
  std::vector<T> data;
  int q_stride = 0;
  int kv_stride = 0;
  size_t q_offset = 0;
  size_t k_offset = 0;
  size_t v_offset = 0;

  Qkv(const AttentionShape& s, bool is_packed) : shape(s), packed(is_packed) {
    const size_t tokens = static_cast<size_t>(s.batch) * s.seqlen;
    const int q_width = s.q_heads * s.head_dim;
    const int kv_width = s.kv_heads * s.head_dim;
    if (packed) {
      q_stride = kv_stride = q_width + 2 * kv_width;
      k_offset = static_cast<size_t>(q_width);
      v_offset = static_cast<size_t>(q_width + kv_width);
    } else {
      q_stride = q_width;
      kv_stride = kv_width;
      k_offset = tokens * q_width;
      v_offset = k_offset + tokens * kv_width;
    }
    data.assign(tokens * (q_width + 2 * kv_width), T(0));
  }
  T* q() { return data.data() + q_offset; }
  T* k() { return data.data() + k_offset; }
  T* v() { return data.data() + v_offset; }
  const T* q() const { return data.data() + q_offset; }
  const T* k() const { return data.data() + k_offset; }
  const T* v() const { return data.data() + v_offset; }
  // Element d of head h of token (b, t) of tensor q (which = 0), k (1) or v (2).
  T& at(int which, int b, int t, int h, int d) {
    const size_t offset = which == 0 ? q_offset : which == 1 ? k_offset : v_offset;
    const int stride = which == 0 ? q_stride : kv_stride;
    return data[offset + (static_cast<size_t>(b) * shape.seqlen + t) * stride +
                static_cast<size_t>(h) * shape.head_dim + d];
  }
};

size_t out_size(const AttentionShape& s) {
  return static_cast<size_t>(s.batch) * s.seqlen * s.q_heads * s.head_dim;
}

std::vector<double> random_vector(size_t n, unsigned seed, double amplitude = 1.0) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> dist(-amplitude, amplitude);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

Qkv<double> random_qkv(const AttentionShape& s, bool packed, unsigned seed,
                       double amplitude = 1.0) {
  Qkv<double> qkv(s, packed);
  qkv.data = random_vector(qkv.data.size(), seed, amplitude);
  return qkv;
}

template <typename T>
std::vector<T> run_forward(const Qkv<T>& qkv) {
  CausalAttention<T> attention(qkv.shape);
  std::vector<T> out(out_size(qkv.shape));
  attention.forward(qkv.q(), qkv.k(), qkv.v(), qkv.q_stride, qkv.kv_stride, out.data());
  return out;
}

// Gradients in the layout of qkv; pre-filled with NaN to show backward overwrites.
template <typename T>
Qkv<T> run_backward(const Qkv<T>& qkv, const std::vector<T>& dout) {
  CausalAttention<T> attention(qkv.shape);
  Qkv<T> grad(qkv.shape, qkv.packed);
  std::fill(grad.data.begin(), grad.data.end(), std::numeric_limits<T>::quiet_NaN());
  attention.backward(qkv.q(), qkv.k(), qkv.v(), qkv.q_stride, qkv.kv_stride, dout.data(), grad.q(),
                     grad.k(), grad.v());
  return grad;
}

// Plain loops, one softmax per query position.
std::vector<double> reference_forward(Qkv<double> qkv) {
  const AttentionShape& s = qkv.shape;
  std::vector<double> out(out_size(s), 0.0);
  const int group = s.q_heads / s.kv_heads;
  for (int b = 0; b < s.batch; ++b) {
    for (int h = 0; h < s.q_heads; ++h) {
      const int g = h / group;
      for (int t = 0; t < s.seqlen; ++t) {
        std::vector<double> score(t + 1);
        for (int j = 0; j <= t; ++j) {
          double dot = 0;
          for (int d = 0; d < s.head_dim; ++d) dot += qkv.at(0, b, t, h, d) * qkv.at(1, b, j, g, d);
          score[j] = s.softmax_scale * dot;
        }
        const double top = *std::max_element(score.begin(), score.end());
        double total = 0;
        for (double& x : score) total += (x = std::exp(x - top));
        for (int d = 0; d < s.head_dim; ++d) {
          double acc = 0;
          for (int j = 0; j <= t; ++j) acc += score[j] / total * qkv.at(2, b, j, g, d);
          out[((static_cast<size_t>(b) * s.seqlen + t) * s.q_heads + h) * s.head_dim + d] = acc;
        }
      }
    }
  }
  return out;
}

// The finite differences run thousands of tiny forwards: one thread avoids paying a
// parallel region (and, on a busy machine, a descheduled sibling) per probe. The
// analytic backward under test still runs with every thread.
class SingleThreaded {
 public:
  SingleThreaded() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SingleThreaded() { omp_set_num_threads(saved_); }
  SingleThreaded(const SingleThreaded&) = delete;
  SingleThreaded& operator=(const SingleThreaded&) = delete;

 private:
  int saved_;
};

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

TEST(CausalAttention, ForwardMatchesNaiveReference) {
  struct Case {
    AttentionShape shape;
    double amplitude;
  };
  AttentionShape custom_scale = make_shape(1, 20, 2, 2, 5);
  custom_scale.softmax_scale = 0.9;
  const std::vector<Case> cases = {
      {make_shape(2, 5, 4, 2, 8), 1.0},    // GQA
      {make_shape(1, 9, 3, 3, 4), 1.0},    // MHA
      {make_shape(2, 7, 4, 1, 4), 1.0},    // one kv head
      {make_shape(1, 130, 4, 2, 8), 1.0},  // several row tiles, the last partial
      {make_shape(1, 1, 2, 1, 3), 1.0},    // a single token
      {make_shape(2, 70, 2, 1, 16), 6.0},  // scores of hundreds: needs the max shift
      {custom_scale, 1.0},
  };
  unsigned seed = 100;
  for (const Case& c : cases) {
    for (const bool packed : {false, true}) {
      const Qkv<double> qkv = random_qkv(c.shape, packed, ++seed, c.amplitude);
      const std::vector<double> out = run_forward(qkv);
      const std::vector<double> expected = reference_forward(qkv);
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_NEAR(out[i], expected[i], 1e-12 * c.amplitude)
            << "seqlen " << c.shape.seqlen << " q_heads " << c.shape.q_heads << " packed " << packed
            << " index " << i;
      }
    }
  }
}

TEST(CausalAttention, FutureTokensDoNotChangeEarlierOutputs) {
  const AttentionShape s = make_shape(2, 100, 4, 2, 8);
  const Qkv<double> qkv = random_qkv(s, true, 7);
  const std::vector<double> out = run_forward(qkv);
  const int changed_position = 70;
  Qkv<double> edited = qkv;
  for (int g = 0; g < s.kv_heads; ++g) {
    for (int d = 0; d < s.head_dim; ++d) {
      edited.at(1, 0, changed_position, g, d) += 0.5;
      edited.at(2, 0, changed_position, g, d) -= 0.5;
    }
  }
  const std::vector<double> edited_out = run_forward(edited);
  const size_t row = static_cast<size_t>(s.q_heads) * s.head_dim;
  for (size_t i = 0; i < out.size(); ++i) {
    const size_t token = i / row;
    const bool may_change = token >= static_cast<size_t>(changed_position) &&
                            token < static_cast<size_t>(s.seqlen);  // batch 0 only
    if (may_change) continue;
    ASSERT_EQ(edited_out[i], out[i]) << "token " << token;
  }
  for (int t = changed_position; t < s.seqlen; ++t) {
    EXPECT_NE(edited_out[static_cast<size_t>(t) * row], out[static_cast<size_t>(t) * row]);
  }
}

// Central differences of <attention(q, k, v), weight> against backward(dout = weight),
// over every step-th element of the buffer holding q, k and v (step 1: all of them;
// larger steps keep the long sequences fast, and a step coprime to the row widths
// still visits every head, dim and row tile).
void check_gradients(const AttentionShape& s, bool packed, unsigned seed, size_t step = 1) {
  Qkv<double> qkv = random_qkv(s, packed, seed);
  const std::vector<double> weight = random_vector(out_size(s), seed + 1000);
  const Qkv<double> grad = run_backward(qkv, weight);
  CausalAttention<double> attention(s);
  std::vector<double> out(out_size(s));
  auto loss = [&] {
    attention.forward(qkv.q(), qkv.k(), qkv.v(), qkv.q_stride, qkv.kv_stride, out.data());
    return dot(out, weight);
  };
  const double eps = 1e-5;
  const SingleThreaded single_threaded;
  for (size_t i = 0; i < qkv.data.size(); i += step) {
    const double saved = qkv.data[i];
    qkv.data[i] = saved + eps;
    const double plus = loss();
    qkv.data[i] = saved - eps;
    const double minus = loss();
    qkv.data[i] = saved;
    const double numeric = (plus - minus) / (2 * eps);
    ASSERT_NEAR(grad.data[i], numeric, 1e-6 * std::max(std::abs(numeric), 1e-2))
        << "packed " << packed << " element " << i << " of " << qkv.data.size();
  }
}

TEST(CausalAttention, GradientsGroupedQuery) {
  check_gradients(make_shape(2, 7, 4, 2, 3), false, 1);
  check_gradients(make_shape(2, 67, 4, 2, 3), false, 5, 11);  // two row tiles
}

TEST(CausalAttention, GradientsEqualHeads) {
  check_gradients(make_shape(2, 9, 3, 3, 4), false, 2);
}

TEST(CausalAttention, GradientsPackedQkv) {
  check_gradients(make_shape(2, 10, 4, 2, 4), true, 3);
  check_gradients(make_shape(1, 6, 2, 2, 3), true, 4);
}

TEST(CausalAttention, PackedLayoutMatchesSeparateBuffers) {
  const AttentionShape s = make_shape(2, 80, 4, 2, 8);
  Qkv<double> separate = random_qkv(s, false, 11);
  Qkv<double> packed(s, true);
  for (int which = 0; which < 3; ++which) {
    const int heads = which == 0 ? s.q_heads : s.kv_heads;
    for (int b = 0; b < s.batch; ++b) {
      for (int t = 0; t < s.seqlen; ++t) {
        for (int h = 0; h < heads; ++h) {
          for (int d = 0; d < s.head_dim; ++d) {
            packed.at(which, b, t, h, d) = separate.at(which, b, t, h, d);
          }
        }
      }
    }
  }
  const std::vector<double> dout = random_vector(out_size(s), 12);
  const std::vector<double> out_separate = run_forward(separate);
  const std::vector<double> out_packed = run_forward(packed);
  for (size_t i = 0; i < out_separate.size(); ++i) {
    ASSERT_NEAR(out_packed[i], out_separate[i], 1e-13);
  }
  Qkv<double> grad_separate = run_backward(separate, dout);
  Qkv<double> grad_packed = run_backward(packed, dout);
  for (const double g : grad_packed.data) ASSERT_TRUE(std::isfinite(g));  // every entry written
  for (int which = 0; which < 3; ++which) {
    const int heads = which == 0 ? s.q_heads : s.kv_heads;
    for (int b = 0; b < s.batch; ++b) {
      for (int t = 0; t < s.seqlen; ++t) {
        for (int h = 0; h < heads; ++h) {
          for (int d = 0; d < s.head_dim; ++d) {
            ASSERT_NEAR(grad_packed.at(which, b, t, h, d), grad_separate.at(which, b, t, h, d),
                        1e-13);
          }
        }
      }
    }
  }
}

// The layer's path: rotary on q and k inside the packed row, then attention.
TEST(CausalAttention, GradientsThroughRotaryAndAttention) {
  const AttentionShape s = make_shape(1, 70, 4, 2, 6);
  const int rotary_dim = 4;
  const double base = 100.0;
  const Qkv<double> qkv = random_qkv(s, true, 21);
  const std::vector<double> weight = random_vector(out_size(s), 22);
  CausalAttention<double> attention(s);
  const int rotated_heads = s.q_heads + s.kv_heads;
  std::vector<double> out(out_size(s));
  auto loss = [&](const Qkv<double>& input) {
    Qkv<double> rotated = input;
    rotary_forward(s.batch, s.seqlen, rotated.q_stride, 0, rotated_heads, s.head_dim, rotary_dim,
                   base, rotated.data.data());
    attention.forward(rotated.q(), rotated.k(), rotated.v(), rotated.q_stride, rotated.kv_stride,
                      out.data());
    return dot(out, weight);
  };
  Qkv<double> rotated = qkv;
  rotary_forward(s.batch, s.seqlen, rotated.q_stride, 0, rotated_heads, s.head_dim, rotary_dim,
                 base, rotated.data.data());
  Qkv<double> grad = run_backward(rotated, weight);
  rotary_backward(s.batch, s.seqlen, grad.q_stride, 0, rotated_heads, s.head_dim, rotary_dim, base,
                  grad.data.data());
  const double eps = 1e-5;
  Qkv<double> probe = qkv;
  const SingleThreaded single_threaded;
  for (size_t i = 0; i < qkv.data.size(); i += 5) {  // 5 is coprime to the row width 48
    probe.data[i] = qkv.data[i] + eps;
    const double plus = loss(probe);
    probe.data[i] = qkv.data[i] - eps;
    const double minus = loss(probe);
    probe.data[i] = qkv.data[i];
    const double numeric = (plus - minus) / (2 * eps);
    ASSERT_NEAR(grad.data[i], numeric, 1e-6 * std::max(std::abs(numeric), 1e-2)) << "element " << i;
  }
}

TEST(CausalAttention, FloatAgreesWithDouble) {
  const AttentionShape s = make_shape(2, 150, 4, 2, 16);
  const Qkv<double> qkv = random_qkv(s, true, 31, 2.0);
  const std::vector<double> dout = random_vector(out_size(s), 32);
  Qkv<float> qkv_float(s, true);
  std::copy(qkv.data.begin(), qkv.data.end(), qkv_float.data.begin());
  const std::vector<float> dout_float(dout.begin(), dout.end());
  const std::vector<double> out = run_forward(qkv);
  const std::vector<float> out_float = run_forward(qkv_float);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out_float[i], out[i], 2e-5) << i;
  const Qkv<double> grad = run_backward(qkv, dout);
  const Qkv<float> grad_float = run_backward(qkv_float, dout_float);
  double largest = 0;
  for (const double g : grad.data) largest = std::max(largest, std::abs(g));
  for (size_t i = 0; i < grad.data.size(); ++i) {
    ASSERT_NEAR(grad_float.data[i], grad.data[i], 1e-5 * largest) << i;
  }
}

TEST(CausalAttention, BackwardIsDeterministic) {
  const AttentionShape s = make_shape(2, 130, 4, 2, 8);
  Qkv<float> qkv(s, true);
  const std::vector<double> values = random_vector(qkv.data.size(), 41);
  std::copy(values.begin(), values.end(), qkv.data.begin());
  const std::vector<double> dout_values = random_vector(out_size(s), 42);
  const std::vector<float> dout(dout_values.begin(), dout_values.end());
  const Qkv<float> first = run_backward(qkv, dout);
  const Qkv<float> second = run_backward(qkv, dout);
  ASSERT_EQ(0,
            std::memcmp(first.data.data(), second.data.data(), first.data.size() * sizeof(float)));
}

void expect_refused(const AttentionShape& s, const std::string& field) {
  try {
    CausalAttention<double> attention(s);
    ADD_FAILURE() << "accepted a bad " << field;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}

TEST(CausalAttention, RefusesBadShapes) {
  const AttentionShape good = make_shape(1, 4, 4, 2, 8);
  AttentionShape bad = good;
  bad.kv_heads = 3;
  expect_refused(bad, "kv_heads");
  bad = good;
  bad.batch = 0;
  expect_refused(bad, "batch");
  bad = good;
  bad.seqlen = -1;
  expect_refused(bad, "seqlen");
  bad = good;
  bad.q_heads = 0;
  expect_refused(bad, "q_heads");
  bad = good;
  bad.kv_heads = 0;
  expect_refused(bad, "kv_heads");
  bad = good;
  bad.head_dim = 0;
  expect_refused(bad, "head_dim");
  bad = good;
  bad.softmax_scale = 0.0;
  expect_refused(bad, "softmax_scale");
  bad = good;
  bad.softmax_scale = std::numeric_limits<double>::quiet_NaN();
  expect_refused(bad, "softmax_scale");
}

TEST(CausalAttention, RefusesShortStrides) {
  const AttentionShape s = make_shape(1, 4, 4, 2, 8);
  CausalAttention<double> attention(s);
  std::vector<double> buffer(1024, 0.0);
  std::vector<double> out(out_size(s));
  const int q_width = s.q_heads * s.head_dim;
  const int kv_width = s.kv_heads * s.head_dim;
  try {
    attention.forward(buffer.data(), buffer.data(), buffer.data(), q_width - 1, kv_width,
                      out.data());
    ADD_FAILURE() << "accepted a short q_stride";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("q_stride"), std::string::npos) << e.what();
  }
  try {
    attention.backward(buffer.data(), buffer.data(), buffer.data(), q_width, kv_width - 1,
                       out.data(), buffer.data(), buffer.data(), buffer.data());
    ADD_FAILURE() << "accepted a short kv_stride";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kv_stride"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace megacpp::cpu
