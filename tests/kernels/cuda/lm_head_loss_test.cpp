// The CUDA lm_head fused with the cross entropy (kernels/cuda/lm_head_loss.h) against the CPU
// oracle in double: kernels/cpu/linear.h's forward, kernels/cpu/cross_entropy.h and linear.h's
// backward, on the same bf16-rounded h and weight: an entry of the oracle harness, plus the
// refusals and the device's treatment of targets the CPU op would refuse.
#include "tests/kernels/cuda/oracle_harness.h"

#ifdef MEGACPP_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/linear.h"
#include "kernels/cuda/lm_head_loss.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using megacpp::cuda::LmHeadLossCuda;
using megacpp::cuda::LmHeadLossShape;
using oracle::DType;
using oracle::Role;

struct LmHeadLoss {
  static constexpr const char* kName = "LmHeadLossCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  using Variant = oracle::Variant;
  struct Case {
    std::string name;
    LmHeadLossShape shape;
    double ignored;  // the share of rows whose target is negative
    float grad_scale;
    std::vector<Variant> variants;
  };

  static std::vector<Case> cases() {
    std::vector<Case> out;
    const auto add = [&](int rows, int dim, int vocab_size, int padded, int chunk, double ignored,
                         float grad_scale) {
      std::ostringstream name;
      name << "rows" << rows << "_D" << dim << "_V" << vocab_size << "_Vp" << padded;
      if (chunk > 0) name << "_chunk" << chunk;
      if (ignored >= 1.0) {
        name << "_all_ignored";
      } else if (ignored > 0) {
        name << "_some_ignored";
      }
      if (grad_scale != 1.f) name << "_scaled";
      out.push_back({name.str(),
                     LmHeadLossShape{rows, dim, padded, vocab_size, chunk},
                     ignored,
                     grad_scale,
                     {}});
    };
    // Odd sizes in one chunk and in chunks of 32 (two full ones and a partial one of 13).
    add(77, 70, 250, 256, 0, 0.15, 1.f);
    add(77, 70, 250, 256, 32, 0.15, 0.25f);
    // vocab_padded not a multiple of 4 (the kernel's scalar path), no padding, one row per chunk.
    add(33, 24, 13, 13, 0, 0.2, 1.f);
    add(9, 24, 11, 14, 1, 0.2, 0.5f);
    // Every row ignored: loss 0, dh 0, dweight as it came in.
    add(40, 32, 100, 104, 16, 1.0, 1.f);
    add(1024, 256, 1000, 1024, 0, 0.05, 0.5f);
    // bench-350m's width: the byte tokenizer's 257 tokens (padded to 264) over one micro-batch of
    // 4 × 2048, and GPT-2's 50257 (padded to 50304) over a quarter of one, in three chunks.
    add(4 * 2048, 1024, 257, 264, 0, 0.02, 1.f);
    add(1024, 1024, 50257, 50304, 384, 0.02, 0.25f);
    return out;
  }

  static void declare(const Case& c, oracle::Problem& p) {
    const LmHeadLossShape& s = c.shape;
    std::mt19937_64& rng = p.rng();
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    std::uniform_int_distribution<int> token(0, s.vocab_size - 1);
    const size_t rows = static_cast<size_t>(s.rows), dim = static_cast<size_t>(s.dim);
    const size_t table = static_cast<size_t>(s.vocab_padded) * dim;
    // Target ids as fp32 (exact below 2^24): the harness has no integer tensors; gpu() converts.
    // Ignored rows use -1 and -100 (PyTorch's ignore_index) alike.
    p.input("targets", DType::kF32, rows, [&] {
      if (unit(rng) < c.ignored) return unit(rng) < 0.5 ? -1.0 : -100.0;
      return static_cast<double>(token(rng));
    });
    p.input("h", DType::kBf16, rows * dim, [&] { return normal(rng); });
    // Logits of standard deviation ~2: a softmax neither flat nor one-hot.
    const double w_scale = 2.0 / std::sqrt(static_cast<double>(s.dim));
    p.input("weight", DType::kBf16, table, [&] { return w_scale * normal(rng); });
    // What dweight holds before (earlier micro-batches), of the size of one call's gradient, so
    // that the check still sees this call's part.
    const double held = static_cast<double>(c.grad_scale) / static_cast<double>(s.rows);
    p.input("dweight_in", DType::kF32, table, [&] { return held * normal(rng); });
    p.output("loss_eval", DType::kF32, 1, Role::kOutput);  // forward()
    p.output("loss", DType::kF32, 1, Role::kOutput);       // forward_backward()
    p.output("dh", DType::kBf16, rows * dim, Role::kGradient);
    p.output("dweight", DType::kF32, table, Role::kGradient);
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    const LmHeadLossShape& s = c.shape;
    const size_t rows = static_cast<size_t>(s.rows);
    const size_t logits_count = rows * static_cast<size_t>(s.vocab_padded);
    const size_t table = static_cast<size_t>(s.vocab_padded) * s.dim;
    std::vector<int32_t> targets(rows);
    for (size_t r = 0; r < rows; ++r) targets[r] = static_cast<int32_t>(p.in("targets")[r]);
    std::vector<double> logits(logits_count), dlogits(logits_count);
    megacpp::cpu::linear_forward<double>(s.rows, s.dim, s.vocab_padded, p.in("h"), p.in("weight"),
                                         nullptr, logits.data());
    const double loss = megacpp::cpu::cross_entropy_forward_backward<double>(
        s.rows, s.vocab_padded, s.vocab_size, logits.data(), targets.data(), dlogits.data(),
        c.grad_scale);
    p.out("loss_eval")[0] = loss;
    p.out("loss")[0] = loss;
    double* dweight = p.out("dweight");
    std::copy(p.in("dweight_in"), p.in("dweight_in") + table, dweight);
    megacpp::cpu::linear_backward<double>(s.rows, s.dim, s.vocab_padded, p.in("h"), p.in("weight"),
                                          dlogits.data(), p.out("dh"), dweight, nullptr);
  }

  static oracle::Gpu gpu(const Case& c, const Variant&, oracle::DeviceTensors& t) {
    const LmHeadLossShape s = c.shape;
    // The int32 targets, from the fp32 ones the harness uploaded.
    std::vector<float> as_float(static_cast<size_t>(s.rows));
    MEGACPP_CUDA_CHECK(cudaMemcpy(as_float.data(), t.f32("targets"),
                                  as_float.size() * sizeof(float), cudaMemcpyDeviceToHost));
    const std::vector<int32_t> ids(as_float.begin(), as_float.end());
    const auto targets = std::make_shared<oracle::DeviceBuffer>(ids.size() * sizeof(int32_t));
    targets->upload(ids.data());
    const auto workspace =
        std::make_shared<oracle::DeviceBuffer>(LmHeadLossCuda::workspace_bytes(s));
    const auto op = std::make_shared<LmHeadLossCuda>(s, workspace->get(), workspace->bytes());
    const int32_t* target_ids = static_cast<const int32_t*>(targets->get());
    const uint16_t* h = t.bf16("h");
    const uint16_t* weight = t.bf16("weight");
    const float* held = t.f32("dweight_in");
    float* loss_eval = t.f32("loss_eval");
    float* loss = t.f32("loss");
    uint16_t* dh = t.bf16("dh");
    float* dweight = t.f32("dweight");
    const size_t table_bytes = static_cast<size_t>(s.vocab_padded) * s.dim * sizeof(float);
    const float grad_scale = c.grad_scale;
    oracle::Gpu g;
    // workspace and targets stay alive with the closures.
    g.passes.push_back({"forward", [=] {
                          (void)workspace;
                          (void)targets;
                          op->forward(h, weight, target_ids, loss_eval, nullptr);
                        }});
    g.passes.push_back({"hold", [=] {
                          MEGACPP_CUDA_CHECK(
                              cudaMemcpy(dweight, held, table_bytes, cudaMemcpyDeviceToDevice));
                        }});
    g.passes.push_back({"forward_backward", [=] {
                          op->forward_backward(h, weight, target_ids, grad_scale, loss, nullptr, dh,
                                               dweight);
                        }});
    return g;
  }
};

// Validation runs before any CUDA call: no device needed, only a CUDA build.
TEST(LmHeadLossCudaShapes, RefusesBadShapes) {
  const auto refused = [](LmHeadLossShape s, const std::string& field) {
    oracle::expect_error([&] { LmHeadLossCuda op(s, nullptr, 0); },
                         megacpp::ErrorKind::kInvalidArgument, field, "a bad " + field);
    oracle::expect_error([&] { (void)LmHeadLossCuda::workspace_bytes(s); },
                         megacpp::ErrorKind::kInvalidArgument, field, "a bad " + field);
  };
  refused({0, 8, 16, 16, 0}, "rows=0");
  refused({4, -2, 16, 16, 0}, "dim=-2");
  refused({4, 8, 0, 0, 0}, "vocab_padded=0");
  refused({4, 8, 16, 0, 0}, "vocab_size=0");
  refused({4, 8, 16, -5, 0}, "vocab_size=-5");
  refused({4, 8, 12, 16, 0}, "vocab_padded=12");
  refused({4, 8, 16, 16, -1}, "chunk_rows=-1");
  refused({4, 8, 16, 16, 0, 2, 5}, "total_rows=5");  // rows 2..6 of 5
  refused({4, 8, 16, 16, 0, -1, 8}, "first_row=-1");
  refused({4, 8, 16, 16, 0, 1, 0}, "first_row=1");  // a share needs its batch's size
}

TEST(LmHeadLossCudaShapes, RefusesShortWorkspaceAndNullPointers) {
  MEGACPP_REQUIRE_GPU();
  const LmHeadLossShape s{8, 16, 32, 30, 0};
  const size_t bytes = LmHeadLossCuda::workspace_bytes(s);
  oracle::DeviceBuffer buffer(bytes);
  oracle::expect_error([&] { LmHeadLossCuda op(s, buffer.get(), bytes - 1); },
                       megacpp::ErrorKind::kInvalidArgument, "workspace_bytes", "a short one");
  oracle::expect_error([&] { LmHeadLossCuda op(s, nullptr, bytes); },
                       megacpp::ErrorKind::kInvalidArgument, "workspace", "a null one");
  LmHeadLossCuda op(s, buffer.get(), bytes);
  EXPECT_EQ(op.chunk_rows(), 8);
  uint16_t* b = static_cast<uint16_t*>(buffer.get());
  float* f = static_cast<float*>(buffer.get());
  int32_t* i = static_cast<int32_t*>(buffer.get());
  oracle::expect_error([&] { op.forward(b, b, i, nullptr, nullptr); },
                       megacpp::ErrorKind::kInvalidArgument, "loss", "no loss");
  oracle::expect_error([&] { op.forward(b, b, nullptr, f, nullptr); },
                       megacpp::ErrorKind::kInvalidArgument, "targets", "no targets");
  oracle::expect_error([&] { op.forward_backward(b, b, i, 1.f, f, nullptr, nullptr, f); },
                       megacpp::ErrorKind::kInvalidArgument, "dh", "no dh");
  oracle::expect_error([&] { op.forward_backward(b, b, i, 1.f, f, nullptr, b, nullptr); },
                       megacpp::ErrorKind::kInvalidArgument, "dweight", "no dweight");
}

TEST(LmHeadLossCudaShapes, PicksChunksThatBoundTheLogits) {
  MEGACPP_REQUIRE_GPU();
  const auto chunk_of = [](LmHeadLossShape s) {
    oracle::DeviceBuffer buffer(LmHeadLossCuda::workspace_bytes(s));
    return LmHeadLossCuda(s, buffer.get(), buffer.bytes()).chunk_rows();
  };
  // 256 MiB / (50304 · 4 bytes) = 1334 rows, rounded down to a multiple of 128.
  EXPECT_EQ(chunk_of({8192, 64, 50304, 50257, 0}), 1280);
  EXPECT_EQ(chunk_of({1000, 64, 50304, 50257, 0}), 1000);
  EXPECT_EQ(chunk_of({100, 64, 264, 257, 500}), 100);
  EXPECT_EQ(chunk_of({100, 64, 264, 257, 7}), 7);
}

// bf16 h [rows, dim] ~ N(0, 1) and weight [vocab_padded, dim] ~ N(0, 0.25), from `seed`.
std::pair<std::vector<uint16_t>, std::vector<uint16_t>> random_operands(const LmHeadLossShape& s,
                                                                        uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<uint16_t> h(static_cast<size_t>(s.rows) * s.dim),
      weight(static_cast<size_t>(s.vocab_padded) * s.dim);
  for (uint16_t& v : h) v = megacpp::testing::to_bf16(normal(rng));
  for (uint16_t& v : weight) v = megacpp::testing::to_bf16(0.5 * normal(rng));
  return {h, weight};
}

// The CPU op refuses a target >= vocab_size; the device cannot, and ignores it like a negative
// one: the loss, count and gradients are those of the same targets with -1 in its place.
TEST(LmHeadLossCudaTargets, OutOfVocabularyTargetsAreIgnored) {
  MEGACPP_REQUIRE_GPU();
  const LmHeadLossShape s{6, 8, 12, 10, 4};
  const auto [h, weight] = random_operands(s, 7);
  const std::vector<int32_t> odd{3, 10, 0, 12, 9, 1000};  // 10 and 12: padding, 1000: beyond
  const std::vector<int32_t> plain{3, -1, 0, -1, 9, -1};
  oracle::DeviceBuffer d_h(h.size() * 2), d_weight(weight.size() * 2), d_targets(6 * 4), d_loss(4),
      d_count(4), d_dh(h.size() * 2), d_dweight(weight.size() * 4),
      work(LmHeadLossCuda::workspace_bytes(s));
  d_h.upload(h.data());
  d_weight.upload(weight.data());
  LmHeadLossCuda op(s, work.get(), work.bytes());
  struct Result {
    float loss = 0, eval_loss = 0;
    int32_t count = 0, eval_count = 0;
    std::vector<uint8_t> dh, dweight;
  };
  const auto run = [&](const std::vector<int32_t>& targets) {
    d_targets.upload(targets.data());
    MEGACPP_CUDA_CHECK(cudaMemset(d_dweight.get(), 0, d_dweight.bytes()));
    Result r;
    const auto* t = static_cast<const int32_t*>(d_targets.get());
    op.forward(static_cast<uint16_t*>(d_h.get()), static_cast<uint16_t*>(d_weight.get()), t,
               static_cast<float*>(d_loss.get()), static_cast<int32_t*>(d_count.get()));
    MEGACPP_CUDA_CHECK(cudaMemcpy(&r.eval_loss, d_loss.get(), 4, cudaMemcpyDeviceToHost));
    MEGACPP_CUDA_CHECK(cudaMemcpy(&r.eval_count, d_count.get(), 4, cudaMemcpyDeviceToHost));
    op.forward_backward(static_cast<uint16_t*>(d_h.get()), static_cast<uint16_t*>(d_weight.get()),
                        t, 1.f, static_cast<float*>(d_loss.get()),
                        static_cast<int32_t*>(d_count.get()), static_cast<uint16_t*>(d_dh.get()),
                        static_cast<float*>(d_dweight.get()));
    MEGACPP_CUDA_CHECK(cudaMemcpy(&r.loss, d_loss.get(), 4, cudaMemcpyDeviceToHost));
    MEGACPP_CUDA_CHECK(cudaMemcpy(&r.count, d_count.get(), 4, cudaMemcpyDeviceToHost));
    r.dh = d_dh.download();
    r.dweight = d_dweight.download();
    return r;
  };
  const Result a = run(odd), b = run(plain);
  EXPECT_EQ(a.count, 3);
  EXPECT_EQ(a.eval_count, 3);
  EXPECT_EQ(b.count, 3);
  EXPECT_GT(a.loss, 0.f);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.eval_loss, b.eval_loss);
  EXPECT_FLOAT_EQ(a.loss, a.eval_loss);  // another kernel instantiation: close, maybe not equal
  EXPECT_TRUE(a.dh == b.dh);
  EXPECT_TRUE(a.dweight == b.dweight);
}

// Sequence parallelism's split: two ops, each with half of a batch's rows and the whole batch's
// targets, give shares that sum to the whole op's mean, the whole op's dh in halves (the same
// scale: the batch's count) and dweights that sum to its dweight.
TEST(LmHeadLossCudaTargets, SharesOfABatchSumToItsMean) {
  MEGACPP_REQUIRE_GPU();
  const LmHeadLossShape whole{8, 16, 24, 20, 4};  // a chunk per half: the same GEMMs
  const auto [h, weight] = random_operands(whole, 11);
  // Ignored rows fall unevenly: 1 in the first half, 2 in the second.
  const std::vector<int32_t> targets{3, -1, 0, 7, 9, -1, 19, 25};
  oracle::DeviceBuffer d_h(h.size() * 2), d_weight(weight.size() * 2), d_targets(8 * 4), d_loss(4),
      d_count(4), d_dh(h.size() * 2), d_dweight(weight.size() * 4);
  d_h.upload(h.data());
  d_weight.upload(weight.data());
  d_targets.upload(targets.data());
  struct Result {
    float loss = 0;
    int32_t count = 0;
    std::vector<float> dweight;
    std::vector<uint8_t> dh;
  };
  const size_t half_bytes = h.size();  // half of the rows, bf16
  const auto run = [&](LmHeadLossShape s) {
    oracle::DeviceBuffer work(LmHeadLossCuda::workspace_bytes(s));
    LmHeadLossCuda op(s, work.get(), work.bytes());
    MEGACPP_CUDA_CHECK(cudaMemset(d_dweight.get(), 0, d_dweight.bytes()));
    const size_t offset = static_cast<size_t>(s.first_row) * s.dim;
    op.forward_backward(
        static_cast<uint16_t*>(d_h.get()) + offset, static_cast<uint16_t*>(d_weight.get()),
        static_cast<const int32_t*>(d_targets.get()), 1.f, static_cast<float*>(d_loss.get()),
        static_cast<int32_t*>(d_count.get()), static_cast<uint16_t*>(d_dh.get()) + offset,
        static_cast<float*>(d_dweight.get()));
    Result r;
    MEGACPP_CUDA_CHECK(cudaMemcpy(&r.loss, d_loss.get(), 4, cudaMemcpyDeviceToHost));
    MEGACPP_CUDA_CHECK(cudaMemcpy(&r.count, d_count.get(), 4, cudaMemcpyDeviceToHost));
    r.dweight.resize(weight.size());
    MEGACPP_CUDA_CHECK(
        cudaMemcpy(r.dweight.data(), d_dweight.get(), d_dweight.bytes(), cudaMemcpyDeviceToHost));
    const std::vector<uint8_t> all = d_dh.download();
    r.dh.assign(all.begin() + static_cast<std::ptrdiff_t>(offset * 2),
                all.begin() + static_cast<std::ptrdiff_t>(offset * 2 + s.rows * s.dim * 2));
    return r;
  };
  const Result all = run(whole);
  LmHeadLossShape first = whole, second = whole;
  first.rows = second.rows = 4;
  first.total_rows = second.total_rows = 8;
  second.first_row = 4;
  const Result a = run(first), b = run(second);
  EXPECT_EQ(all.count, 5);
  EXPECT_EQ(a.count, 5);
  EXPECT_EQ(b.count, 5);
  EXPECT_NEAR(a.loss + b.loss, all.loss, 1e-6 * std::abs(all.loss));
  EXPECT_GT(a.loss, 0.f);
  EXPECT_GT(b.loss, 0.f);
  std::vector<uint8_t> halves = a.dh;
  halves.insert(halves.end(), b.dh.begin(), b.dh.end());
  ASSERT_EQ(halves.size(), half_bytes * 2);
  EXPECT_TRUE(halves == all.dh) << "dh of the shares differs from the whole op's";
  double worst = 0;
  for (size_t i = 0; i < weight.size(); ++i) {
    worst = std::max(worst,
                     static_cast<double>(std::abs(a.dweight[i] + b.dweight[i] - all.dweight[i])));
  }
  EXPECT_LT(worst, 1e-5);
}

}  // namespace

MEGACPP_ORACLE_ENTRY(LmHeadLoss);

#else

MEGACPP_ORACLE_NO_CUDA(LmHeadLossCuda);

#endif
