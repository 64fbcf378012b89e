// The CUDA causal grouped-query attention (kernels/cuda/attention.h) against the CPU oracle
// (kernels/cpu/attention.h in double) on the same bf16 q, k, v and output gradient: an entry of
// the oracle harness (out, lse, dq, dk, dv), plus the refusals. The GPU backward consumes the GPU
// forward's own out and lse, as the training step does.
#include "tests/kernels/cuda/oracle_harness.h"

#ifdef MEGACPP_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_cudnn.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using megacpp::cuda::AttentionShape;
using megacpp::cuda::CausalAttentionCuda;
using megacpp::cuda::CausalAttentionCudnn;
using oracle::DType;
using oracle::Role;

// Where q, k, v (and dq, dk, dv) live: their own contiguous tensors, or views into one packed
// qkv row of (Hq + 2·Hkv)·head_dim columns plus `pad` unused ones.
struct Layout {
  bool packed = false;
  int pad = 0;
};

struct Attention {
  static constexpr const char* kName = "CausalAttentionCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  using Variant = oracle::Variant;
  struct Case {
    std::string name;
    AttentionShape shape;
    Layout layout;
    double q_std;  // larger: sharper softmax rows
    std::vector<Variant> variants;
  };

  static std::vector<Case> cases() {
    std::vector<Case> out;
    const auto add = [&](int batch, int seqlen, int q_heads, int kv_heads, int head_dim,
                         Layout layout, double scale, double q_std, const std::string& tag) {
      std::ostringstream name;
      name << tag << "_B" << batch << "_L" << seqlen << "_Hq" << q_heads << "_Hkv" << kv_heads
           << "_D" << head_dim;
      if (scale <= 0) scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
      out.push_back({name.str(),
                     AttentionShape{batch, seqlen, q_heads, kv_heads, head_dim, scale},
                     layout,
                     q_std,
                     {}});
    };
    const Layout separate{false, 0}, packed{true, 0};
    add(1, 128, 4, 4, 64, separate, 0, 1.0, "mha");
    add(2, 77, 8, 2, 64, separate, 0, 1.0, "gqa4");  // odd seqlen: a partial tile
    add(1, 200, 4, 1, 128, separate, 0, 1.0, "gqa4");
    add(1, 17, 2, 2, 128, separate, 0, 1.0, "mha");
    add(3, 1, 2, 1, 64, separate, 0, 1.0, "one_token");
    add(2, 130, 8, 2, 64, packed, 0, 1.0, "packed");
    add(2, 77, 4, 2, 128, packed, 0, 1.0, "packed");
    // An odd row stride: the kernels' element-by-element load and store path.
    add(1, 70, 4, 2, 64, Layout{true, 1}, 0, 1.0, "packed_pad1");
    // Scores of standard deviation ~6: nearly one-hot rows, where the running max matters.
    add(1, 150, 4, 2, 64, packed, 0.3, 2.5, "sharp");
    // bench-350m-like: one sequence of 2048 tokens, 16 q heads over 4 kv heads, head_dim 64.
    add(1, 2048, 16, 4, 64, packed, 0, 1.0, "bench");
    add(1, 1024, 8, 2, 128, packed, 0, 1.0, "bench");
    // The other head_dims: 48 (the tiny preset's), 32 and 96 (other configs), and one case
    // each for the remaining instantiations 16, 80 and 112.
    add(2, 77, 4, 2, 48, separate, 0, 1.0, "gqa");
    add(2, 77, 4, 2, 48, packed, 0, 1.0, "packed");
    add(1, 70, 4, 2, 48, Layout{true, 1}, 0, 1.0, "packed_pad1");
    add(8, 256, 4, 2, 48, packed, 0, 1.0, "tiny_preset");  // batch 8 × seqlen 256, as it trains
    add(2, 45, 4, 1, 32, separate, 0, 1.0, "gqa4");
    add(1, 100, 4, 2, 32, packed, 0, 1.0, "packed");
    add(1, 90, 6, 2, 96, separate, 0, 1.0, "gqa3");
    add(2, 33, 4, 2, 96, packed, 0, 1.0, "packed");
    add(1, 81, 2, 1, 16, packed, 0, 1.0, "packed");
    add(1, 66, 2, 2, 80, separate, 0, 1.0, "mha");
    add(1, 70, 4, 2, 112, packed, 0, 1.0, "packed");
    return out;
  }

  static int q_width(const AttentionShape& s) { return s.q_heads * s.head_dim; }
  static int kv_width(const AttentionShape& s) { return s.kv_heads * s.head_dim; }
  static int row_width(const Case& c) {
    return q_width(c.shape) + 2 * kv_width(c.shape) + c.layout.pad;
  }
  static size_t tokens(const AttentionShape& s) {
    return static_cast<size_t>(s.batch) * static_cast<size_t>(s.seqlen);
  }

  static void declare(const Case& c, oracle::Problem& p) {
    const AttentionShape& s = c.shape;
    std::mt19937_64& rng = p.rng();
    std::normal_distribution<double> normal(0.0, 1.0);
    const size_t n = tokens(s);
    const size_t qw = static_cast<size_t>(q_width(s)), kvw = static_cast<size_t>(kv_width(s));
    if (c.layout.packed) {
      const size_t w = static_cast<size_t>(row_width(c));
      p.input("qkv", DType::kBf16, n * w,
              [&](size_t i) { return (i % w < qw ? c.q_std : 1.0) * normal(rng); });
    } else {
      p.input("q", DType::kBf16, n * qw, [&] { return c.q_std * normal(rng); });
      p.input("k", DType::kBf16, n * kvw, [&] { return normal(rng); });
      p.input("v", DType::kBf16, n * kvw, [&] { return normal(rng); });
    }
    p.input("dout", DType::kBf16, n * qw, [&] { return normal(rng); });
    p.output("out", DType::kBf16, n * qw, Role::kOutput);
    p.output("lse", DType::kF32, n * static_cast<size_t>(s.q_heads), Role::kOutput);
    if (c.layout.packed) {
      const int w = row_width(c);
      p.output("dqkv", DType::kBf16, n * static_cast<size_t>(w), Role::kGradient);
      // The pad columns are neither read nor written: left unchecked.
      p.sections("dqkv", w,
                 {{"dq", 0, q_width(s), false},
                  {"dk", q_width(s), kv_width(s), false},
                  {"dv", q_width(s) + kv_width(s), kv_width(s), false}});
    } else {
      p.output("dq", DType::kBf16, n * qw, Role::kGradient);
      p.output("dk", DType::kBf16, n * kvw, Role::kGradient);
      p.output("dv", DType::kBf16, n * kvw, Role::kGradient);
    }
  }

  // The views q, k, v (or dq, dk, dv) of a case, over whatever element type T the buffers hold.
  template <class T>
  struct Views {
    T* q;
    T* k;
    T* v;
    int q_stride;
    int kv_stride;
  };

  template <class T>
  static Views<T> views(const Case& c, T* packed, T* q, T* k, T* v) {
    const AttentionShape& s = c.shape;
    if (c.layout.packed) {
      const int w = row_width(c);
      return {packed, packed + q_width(s), packed + q_width(s) + kv_width(s), w, w};
    }
    return {q, k, v, q_width(s), kv_width(s)};
  }

  // lse[b, h, t] = log Σ_{s ≤ t} exp(scale · q[t, h] · k[s, g(h)]), as the GPU saves it.
  static void log_sum_exp(const AttentionShape& s, const Views<const double>& in, double* lse) {
    const int group = s.q_heads / s.kv_heads;
    const int items = s.batch * s.q_heads;
#pragma omp parallel for schedule(dynamic)
    for (int item = 0; item < items; ++item) {
      const int b = item / s.q_heads, h = item % s.q_heads, g = h / group;
      std::vector<double> scores(static_cast<size_t>(s.seqlen));
      for (int t = 0; t < s.seqlen; ++t) {
        const double* q =
            in.q + (static_cast<int64_t>(b) * s.seqlen + t) * in.q_stride + h * s.head_dim;
        double top = -std::numeric_limits<double>::infinity();
        for (int j = 0; j <= t; ++j) {
          const double* k =
              in.k + (static_cast<int64_t>(b) * s.seqlen + j) * in.kv_stride + g * s.head_dim;
          double dot = 0;
          for (int d = 0; d < s.head_dim; ++d) dot += q[d] * k[d];
          scores[static_cast<size_t>(j)] = s.softmax_scale * dot;
          top = std::max(top, scores[static_cast<size_t>(j)]);
        }
        double sum = 0;
        for (int j = 0; j <= t; ++j) sum += std::exp(scores[static_cast<size_t>(j)] - top);
        lse[static_cast<size_t>(item) * static_cast<size_t>(s.seqlen) + static_cast<size_t>(t)] =
            top + std::log(sum);
      }
    }
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    const AttentionShape& s = c.shape;
    const bool packed = c.layout.packed;
    const Views<const double> in =
        views<const double>(c, packed ? p.in("qkv") : nullptr, packed ? nullptr : p.in("q"),
                            packed ? nullptr : p.in("k"), packed ? nullptr : p.in("v"));
    const Views<double> grad =
        views<double>(c, packed ? p.out("dqkv") : nullptr, packed ? nullptr : p.out("dq"),
                      packed ? nullptr : p.out("dk"), packed ? nullptr : p.out("dv"));
    megacpp::cpu::CausalAttention<double> op(megacpp::cpu::AttentionShape{
        s.batch, s.seqlen, s.q_heads, s.kv_heads, s.head_dim, s.softmax_scale});
    op.forward(in.q, in.k, in.v, in.q_stride, in.kv_stride, p.out("out"));
    op.backward(in.q, in.k, in.v, in.q_stride, in.kv_stride, p.in("dout"), grad.q, grad.k, grad.v);
    log_sum_exp(s, in, p.out("lse"));
  }

  // The device views of a case's q, k, v and of dq, dk, dv.
  static Views<uint16_t> device_inputs(const Case& c, oracle::DeviceTensors& t) {
    const bool packed = c.layout.packed;
    return views<uint16_t>(c, packed ? t.bf16("qkv") : nullptr, packed ? nullptr : t.bf16("q"),
                           packed ? nullptr : t.bf16("k"), packed ? nullptr : t.bf16("v"));
  }
  static Views<uint16_t> device_gradients(const Case& c, oracle::DeviceTensors& t) {
    const bool packed = c.layout.packed;
    return views<uint16_t>(c, packed ? t.bf16("dqkv") : nullptr, packed ? nullptr : t.bf16("dq"),
                           packed ? nullptr : t.bf16("dk"), packed ? nullptr : t.bf16("dv"));
  }

  static oracle::Gpu gpu(const Case& c, const Variant&, oracle::DeviceTensors& t) {
    const AttentionShape s = c.shape;
    const auto workspace =
        std::make_shared<oracle::DeviceBuffer>(CausalAttentionCuda::workspace_bytes(s));
    const auto op = std::make_shared<CausalAttentionCuda>(s, workspace->get(), workspace->bytes());
    const Views<uint16_t> in = device_inputs(c, t), grad = device_gradients(c, t);
    uint16_t* out = t.bf16("out");
    const uint16_t* dout = t.bf16("dout");
    float* lse = t.f32("lse");
    oracle::Gpu g;
    g.passes.push_back({"forward", [=] {
                          op->forward(in.q, in.k, in.v, in.q_stride, in.kv_stride, out, lse);
                        }});
    g.passes.push_back({"backward", [=] {
                          (void)workspace;  // alive as long as the op
                          op->backward(in.q, in.k, in.v, in.q_stride, in.kv_stride, out, dout, lse,
                                       grad.q, grad.k, grad.v);
                        }});
    return g;
  }
};

// The same function through cuDNN's fused attention (kernels/cuda/attention_cudnn.h), on the
// cases it takes: rows 16-byte aligned (no odd pad), more than one token, and with a cuDNN before
// 9.16 seqlen a multiple of 128. Two variants: deterministic (two runs give the same bits) and
// cuDNN's fp32-accumulated dQ (checked against the oracle only).
struct AttentionCudnn : Attention {
  static constexpr const char* kName = "CausalAttentionCudnn";

  static std::vector<Case> cases() {
    const bool any_length = megacpp::cuda::cudnn_runtime_version() >= 91600;
    std::vector<Case> out;
    for (Case c : Attention::cases()) {
      if (c.layout.pad != 0 || c.shape.seqlen < 2) continue;
      if (!any_length && c.shape.seqlen % 128 != 0) continue;
      c.variants = {Variant{"deterministic", -1, false}, Variant{"nondeterministic", -1, true}};
      out.push_back(c);
    }
    return out;
  }

  static oracle::Gpu gpu(const Case& c, const Variant& variant, oracle::DeviceTensors& t) {
    const AttentionShape s = c.shape;
    const bool deterministic = !variant.nondeterministic;
    const auto workspace = std::make_shared<oracle::DeviceBuffer>(
        CausalAttentionCudnn::workspace_bytes(s, deterministic));
    const Views<uint16_t> in = device_inputs(c, t), grad = device_gradients(c, t);
    int device = 0;
    MEGACPP_CUDA_CHECK(cudaGetDevice(&device));
    const auto op = std::make_shared<CausalAttentionCudnn>(
        s, in.q_stride, in.kv_stride, deterministic, workspace->get(), workspace->bytes(), device);
    std::printf("[ %s ] %s\n", c.name.c_str(), op->describe().c_str());
    uint16_t* out = t.bf16("out");
    const uint16_t* dout = t.bf16("dout");
    float* lse = t.f32("lse");
    oracle::Gpu g;
    g.passes.push_back({"forward", [=] {
                          op->forward(in.q, in.k, in.v, out, lse);
                        }});
    g.passes.push_back({"backward", [=] {
                          (void)workspace;  // alive as long as the op
                          op->backward(in.q, in.k, in.v, out, dout, lse, grad.q, grad.k, grad.v);
                        }});
    return g;
  }
};

// Validation runs before any CUDA or cuDNN call: no device needed, only a CUDA build.
TEST(CausalAttentionCudnnShapes, RefusesShapesStridesAndWorkspacesItCannotTake) {
  const AttentionShape good{2, 256, 4, 2, 64, 0.125};
  const auto kind = megacpp::ErrorKind::kInvalidArgument;
  const auto refused = [&](AttentionShape s, int q_stride, int kv_stride, size_t bytes,
                           const std::string& needle) {
    alignas(256) char byte = 0;
    oracle::expect_error(
        [&] { CausalAttentionCudnn op(s, q_stride, kv_stride, true, &byte, bytes, 0); }, kind,
        needle, "ctor: " + needle);
  };
  const size_t enough = CausalAttentionCudnn::workspace_bytes(good, true);
  AttentionShape s = good;
  s.head_dim = 12;
  refused(s, 48, 24, enough, "head_dim=12 must be a multiple of 8 in [8, 256]");
  s.head_dim = 264;
  refused(s, 4 * 264, 2 * 264, enough, "head_dim=264 must be a multiple of 8 in [8, 256]");
  s = good;
  s.kv_heads = 3;
  refused(s, 256, 192, enough, "q_heads=4 must be a multiple of kv_heads=3");
  s = good;
  s.batch = 0;
  refused(s, 256, 128, enough, "CausalAttentionCudnn: AttentionShape.batch=0 must be positive");
  s = good;
  s.softmax_scale = 0;
  refused(s, 256, 128, enough, "softmax_scale=0 must be positive and finite");
  refused(good, 255, 128, enough, "q_stride must be at least q_heads·head_dim (256)");
  refused(good, 260, 128, enough, "a multiple of 8 elements");
  refused(good, 256, 129, enough, "kv_stride must be at least kv_heads·head_dim (128)");
  refused(good, 256, 128, enough - 1, "workspace_bytes(shape, deterministic)");
  s = good;
  s.seqlen = 1;
  refused(s, 256, 128, enough, "seqlen=1 must be at least 2");
  oracle::expect_error(
      [&] {
        alignas(512) char bytes[512];
        CausalAttentionCudnn op(good, 256, 128, true, bytes + 16, enough, 0);
      },
      kind, "the workspace must be 256-byte aligned", "misaligned workspace");
  oracle::expect_error(
      [&] {
        alignas(512) char bytes[512];
        CausalAttentionCudnn op(good, 256, 128, true, bytes, enough, -1);
      },
      kind, "device must be a CUDA ordinal, got -1", "negative device");
  EXPECT_LT(CausalAttentionCudnn::workspace_bytes(good, false), enough)
      << "the nondeterministic backward keeps no dS in cuDNN's workspace";
}

// Validation runs before any CUDA call: no device needed, only a CUDA build.
TEST(CausalAttentionCudaShapes, RefusesShapesItDoesNotCover) {
  const AttentionShape good{2, 16, 4, 2, 64, 0.125};
  const auto refused = [](AttentionShape s, const std::string& needle) {
    oracle::expect_error([&] { CausalAttentionCuda op(s, nullptr, 0); },
                         megacpp::ErrorKind::kInvalidArgument, needle, "ctor: " + needle);
    oracle::expect_error([&] { (void)CausalAttentionCuda::workspace_bytes(s); },
                         megacpp::ErrorKind::kInvalidArgument, needle,
                         "workspace_bytes: " + needle);
  };
  AttentionShape s = good;
  s.batch = 0;
  refused(s, "batch=0");
  s = good;
  s.seqlen = -3;
  refused(s, "seqlen=-3");
  s = good;
  s.q_heads = 0;
  refused(s, "q_heads=0");
  s = good;
  s.kv_heads = 0;
  refused(s, "kv_heads=0");
  s = good;
  s.q_heads = 6;
  s.kv_heads = 4;
  refused(s, "q_heads=6 must be a multiple of kv_heads=4");
  s = good;
  s.head_dim = 0;
  refused(s, "head_dim=0");
  s = good;
  s.head_dim = 40;
  refused(s, "head_dim=40 must be a multiple of 16 in [16, 128]");
  s = good;
  s.head_dim = 144;
  refused(s, "head_dim=144 must be a multiple of 16 in [16, 128]");
  s = good;
  s.head_dim = 8;
  refused(s, "head_dim=8");
  s = good;
  s.softmax_scale = 0.0;
  refused(s, "softmax_scale=0");
  s = good;
  s.softmax_scale = std::numeric_limits<double>::infinity();
  refused(s, "softmax_scale=");
}

// Every multiple of 16 in [16, 128] has kernels; validation alone decides, so no device needed.
TEST(CausalAttentionCudaShapes, AcceptsEveryMultipleOf16UpTo128) {
  for (int head_dim = 16; head_dim <= 128; head_dim += 16) {
    const AttentionShape s{2, 16, 4, 2, head_dim, 0.125};
    EXPECT_EQ(CausalAttentionCuda::workspace_bytes(s), 2u * 4u * 16u * sizeof(float))
        << "head_dim=" << head_dim;
  }
}

TEST(CausalAttentionCudaShapes, RefusesShortStridesNullsAndAShortWorkspace) {
  MEGACPP_REQUIRE_GPU();
  const AttentionShape s{1, 8, 4, 2, 64, 0.125};
  oracle::DeviceBuffer buffer(8 * 8 * 64 * sizeof(uint16_t));
  uint16_t* b = static_cast<uint16_t*>(buffer.get());
  float* f = static_cast<float*>(buffer.get());
  CausalAttentionCuda op(s, buffer.get(), 4);
  const auto kind = megacpp::ErrorKind::kInvalidArgument;
  oracle::expect_error([&] { op.forward(b, b, b, 255, 128, b, f); }, kind, "q_stride=255",
                       "short q_stride");
  oracle::expect_error([&] { op.forward(b, b, b, 256, 127, b, f); }, kind, "kv_stride=127",
                       "short kv_stride");
  oracle::expect_error([&] { op.forward(b, nullptr, b, 256, 128, b, f); }, kind, "k is null",
                       "null k");
  oracle::expect_error([&] { op.forward(b, b, b, 256, 128, b, nullptr); }, kind, "lse is null",
                       "null lse");
  oracle::expect_error([&] { op.backward(b, b, b, 256, 128, b, b, f, b, b, nullptr); }, kind,
                       "dv is null", "null dv");
  oracle::expect_error([&] { op.backward(b, b, b, 256, 64, b, b, f, b, b, b); }, kind,
                       "kv_stride=64", "short kv_stride in backward");
  oracle::expect_error([&] { op.backward(b, b, b, 256, 128, b, b, f, b, b, b); }, kind,
                       "workspace_bytes", "4 bytes of workspace");
}

}  // namespace

MEGACPP_ORACLE_ENTRY(Attention);
MEGACPP_ORACLE_ENTRY(AttentionCudnn);

#else

MEGACPP_ORACLE_NO_CUDA(CausalAttentionCuda);

#endif
