// The CUDA fused multi-tensor AdamW (kernels/cuda/adamw.h), with the gradient clipping of
// kernels/cuda/grad_clip.h fused into it, against the CPU oracle in double (cpu::clip_grad_norm,
// then cpu::adamw_step per tensor with weight decay off for the no-decay tensors) on the same fp32
// state: an entry of the oracle harness, plus the bf16 copy's exact rounding and the refusals.
#include "tests/kernels/cuda/oracle_harness.h"

#ifdef MEGACPP_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/grad_clip.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/grad_clip.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using megacpp::cuda::AdamWCuda;
using megacpp::cuda::AdamWTensorRef;
using megacpp::cuda::GradNormCuda;
using megacpp::cuda::GradTensorRef;
using oracle::DType;
using oracle::Role;

struct TensorSpec {
  int64_t size;
  bool decay;  // false: the spec's no-decay set
  bool bf16;   // keeps a bf16 copy for the matmuls
};

struct AdamWCase {
  std::string name;
  std::vector<TensorSpec> tensors;  // back to back in flat buffers (odd offsets too)
  int64_t step;                     // 1: fresh moments (zero), else moments drawn
  // max_norm as a multiple of the gradients' norm: < 1 clips (GradNormCuda's factor fused into
  // the step), 0: no clipping (a null factor).
  double max_norm_ratio;
  std::vector<oracle::Variant> variants;
};

// lr large enough that the update is of the parameters' own size: the outputs then check the
// update, not only the parameters carried through.
constexpr megacpp::ops::AdamWHyper kHyper{0.3, 0.9, 0.95, 1e-8, 0.1};

int64_t total_of(const std::vector<TensorSpec>& tensors, bool bf16_only) {
  int64_t total = 0;
  for (const TensorSpec& t : tensors) total += bf16_only && !t.bf16 ? 0 : t.size;
  return total;
}

struct AdamW {
  static constexpr const char* kName = "AdamWCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  using Variant = oracle::Variant;
  using Case = AdamWCase;

  static std::vector<Case> cases() {
    // A small model's parameter list: matrices with copies and decay, norm weights, dt_bias, D
    // and biases without either; sizes around the chunk.
    const std::vector<TensorSpec> model{
        {1048576, true, true}, {1024, false, false},  {65537, true, true},
        {16, false, false},    {3, false, true},      {65536, true, true},
        {0, true, true},       {2500001, true, true}, {777, false, false}};
    return {{"model_step1", model, 1, 0.0, {}},
            {"model_step7_clipped", model, 7, 0.3, {}},
            {"model_step1000_unclipped", model, 1000, 5.0, {}},
            {"one_value", {{1, true, true}}, 3, 0.0, {}}};
  }

  static void declare(const Case& c, oracle::Problem& p) {
    std::mt19937_64& rng = p.rng();
    std::normal_distribution<double> normal(0.0, 1.0);
    const size_t n = static_cast<size_t>(total_of(c.tensors, false));
    p.input("param_in", DType::kF32, n, [&] { return normal(rng); });
    p.input("grad", DType::kF32, n, [&] { return 0.01 * normal(rng); });
    // Moments of earlier steps, consistent as Adam's are (|m| ≤ sqrt(v)): an m drawn apart from
    // v would put updates thousands of times lr where v happens to be tiny, and those few would
    // set the scale every error is measured against.
    const bool fresh = c.step == 1;
    std::uniform_real_distribution<double> unit(-1.0, 1.0);
    p.input("exp_avg_sq_in", DType::kF32, n, [&] {
      const double g = 0.01 * normal(rng);
      return fresh ? 0.0 : g * g;
    });
    p.input("exp_avg_in", DType::kF32, n, [&](size_t i) {
      return fresh ? 0.0 : std::sqrt(p.in("exp_avg_sq_in")[i]) * unit(rng);
    });
    p.output("param", DType::kF32, n, Role::kOutput);
    p.output("exp_avg", DType::kF32, n, Role::kOutput);
    p.output("exp_avg_sq", DType::kF32, n, Role::kOutput);
    p.output("param_bf16", DType::kBf16, static_cast<size_t>(total_of(c.tensors, true)),
             Role::kOutput);
  }

  static double norm_of(const Case& c, const double* grads) {
    std::vector<megacpp::cpu::GradBuffer<const double>> buffers;
    int64_t offset = 0;
    for (const TensorSpec& t : c.tensors) {
      buffers.push_back({grads + offset, t.size});
      offset += t.size;
    }
    return megacpp::cpu::global_grad_norm<const double>(std::span(buffers));
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    const size_t n = static_cast<size_t>(total_of(c.tensors, false));
    std::vector<double> grad(p.in("grad"), p.in("grad") + n);
    if (c.max_norm_ratio > 0) {
      const megacpp::cpu::GradBuffer<double> all{grad.data(), static_cast<int64_t>(n)};
      megacpp::cpu::clip_grad_norm<double>(std::span(&all, 1),
                                           c.max_norm_ratio * norm_of(c, p.in("grad")));
    }
    double* param = p.out("param");
    double* m = p.out("exp_avg");
    double* v = p.out("exp_avg_sq");
    std::copy(p.in("param_in"), p.in("param_in") + n, param);
    std::copy(p.in("exp_avg_in"), p.in("exp_avg_in") + n, m);
    std::copy(p.in("exp_avg_sq_in"), p.in("exp_avg_sq_in") + n, v);
    double* copy = p.out("param_bf16");
    int64_t offset = 0;
    for (const TensorSpec& t : c.tensors) {
      megacpp::cpu::AdamWHyper h = kHyper;
      if (!t.decay) h.weight_decay = 0.0;
      megacpp::cpu::adamw_step<double>(t.size, param + offset, grad.data() + offset, m + offset,
                                       v + offset, h, c.step);
      if (t.bf16) copy = std::copy(param + offset, param + offset + t.size, copy);
      offset += t.size;
    }
  }

  static oracle::Gpu gpu(const Case& c, const Variant&, oracle::DeviceTensors& t) {
    std::vector<AdamWTensorRef> tensors;
    std::vector<GradTensorRef> grads;
    int64_t offset = 0, copy_offset = 0;
    for (const TensorSpec& s : c.tensors) {
      tensors.push_back({t.f32("param") + offset, t.f32("grad") + offset, t.f32("exp_avg") + offset,
                         t.f32("exp_avg_sq") + offset,
                         s.bf16 ? t.bf16("param_bf16") + copy_offset : nullptr, s.size, s.decay});
      grads.push_back({t.f32("grad") + offset, s.size});
      offset += s.size;
      copy_offset += s.bf16 ? s.size : 0;
    }
    const auto workspace =
        std::make_shared<oracle::DeviceBuffer>(AdamWCuda::workspace_bytes(tensors));
    const auto op = std::make_shared<AdamWCuda>(tensors, workspace->get(), workspace->bytes());
    const auto clip_workspace =
        std::make_shared<oracle::DeviceBuffer>(GradNormCuda::workspace_bytes(grads));
    const auto clip =
        std::make_shared<GradNormCuda>(grads, clip_workspace->get(), clip_workspace->bytes());
    const auto norm_and_scale = std::make_shared<oracle::DeviceBuffer>(2 * sizeof(float));
    double max_norm = 0;
    if (c.max_norm_ratio > 0) {
      std::vector<float> host(static_cast<size_t>(offset));
      MEGACPP_CUDA_CHECK(cudaMemcpy(host.data(), t.f32("grad"), host.size() * sizeof(float),
                                    cudaMemcpyDeviceToHost));
      const std::vector<double> widened(host.begin(), host.end());
      max_norm = c.max_norm_ratio * norm_of(c, widened.data());
    }
    const size_t bytes = static_cast<size_t>(offset) * sizeof(float);
    float* param = t.f32("param");
    float* m = t.f32("exp_avg");
    float* v = t.f32("exp_avg_sq");
    const float* param_in = t.f32("param_in");
    const float* m_in = t.f32("exp_avg_in");
    const float* v_in = t.f32("exp_avg_sq_in");
    const int64_t step = c.step;
    oracle::Gpu g;
    // The step updates in place: the state starts from the inputs on every run.
    g.passes.push_back({"load", [=] {
                          MEGACPP_CUDA_CHECK(
                              cudaMemcpy(param, param_in, bytes, cudaMemcpyDeviceToDevice));
                          MEGACPP_CUDA_CHECK(cudaMemcpy(m, m_in, bytes, cudaMemcpyDeviceToDevice));
                          MEGACPP_CUDA_CHECK(cudaMemcpy(v, v_in, bytes, cudaMemcpyDeviceToDevice));
                        }});
    if (max_norm > 0) {
      g.passes.push_back({"grad_norm", [=] {
                            float* f = static_cast<float*>(norm_and_scale->get());
                            clip->compute(max_norm, f, f + 1);
                          }});
    }
    g.passes.push_back({"step", [=] {
                          (void)workspace;
                          (void)clip_workspace;
                          const float* scale =
                              max_norm > 0 ? static_cast<const float*>(norm_and_scale->get()) + 1
                                           : nullptr;
                          op->step(kHyper, step, scale);
                        }});
    return g;
  }
};

// The bf16 copy is the fp32 master weight rounded to nearest even, bit for bit.
TEST(AdamWCudaCopy, Bf16CopyIsTheRoundedMasterWeight) {
  MEGACPP_REQUIRE_GPU();
  const int64_t n = 100003;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> param(static_cast<size_t>(n)), grad(param.size()), zeros(param.size(), 0.f);
  for (float& x : param) x = normal(rng);
  for (float& x : grad) x = 0.01f * normal(rng);
  const size_t bytes = param.size() * sizeof(float);
  oracle::DeviceBuffer d_param(bytes), d_grad(bytes), d_m(bytes), d_v(bytes),
      d_copy(param.size() * sizeof(uint16_t));
  d_param.upload(param.data());
  d_grad.upload(grad.data());
  d_m.upload(zeros.data());
  d_v.upload(zeros.data());
  const std::vector<AdamWTensorRef> tensors{
      {static_cast<float*>(d_param.get()), static_cast<const float*>(d_grad.get()),
       static_cast<float*>(d_m.get()), static_cast<float*>(d_v.get()),
       static_cast<uint16_t*>(d_copy.get()), n, true}};
  oracle::DeviceBuffer work(AdamWCuda::workspace_bytes(tensors));
  AdamWCuda op(tensors, work.get(), work.bytes());
  op.step(kHyper, 1, nullptr);
  MEGACPP_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> updated = d_param.download(), copy = d_copy.download();
  for (size_t i = 0; i < param.size(); ++i) {
    float p = 0.f;
    uint16_t bits = 0;
    std::memcpy(&p, updated.data() + i * sizeof(float), sizeof(p));
    std::memcpy(&bits, copy.data() + i * sizeof(bits), sizeof(bits));
    ASSERT_NE(p, param[i]) << i;  // the step moved it
    ASSERT_EQ(bits, megacpp::testing::to_bf16(p)) << "element " << i << " = " << p;
  }
}

// A tensor whose buffers are 16-byte aligned steps four elements a thread; the same values one
// float further on (misaligned) step one at a time. The same arithmetic either way: the same
// bits for the parameters, both moments and the bf16 copy.
TEST(AdamWCudaCopy, FourWideAndElementwiseStepsGiveTheSameBits) {
  MEGACPP_REQUIRE_GPU();
  const int64_t n = 50001;
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> param(static_cast<size_t>(n)), grad(param.size()), m(param.size()),
      v(param.size());
  for (size_t i = 0; i < param.size(); ++i) {
    param[i] = normal(rng);
    grad[i] = 0.01f * normal(rng);
    m[i] = 0.01f * normal(rng);
    v[i] = 1e-4f * std::abs(normal(rng));
  }
  std::vector<std::vector<uint8_t>> results[2];
  for (const int shift : {0, 1}) {  // elements: 0 keeps 16-byte alignment, 1 breaks it
    const size_t bytes = (param.size() + 1) * sizeof(float);
    oracle::DeviceBuffer d_param(bytes), d_grad(bytes), d_m(bytes), d_v(bytes),
        d_copy((param.size() + 1) * sizeof(uint16_t));
    const auto at = [&](oracle::DeviceBuffer& b) {
      return static_cast<float*>(b.get()) + shift;
    };
    for (auto [buffer, values] : {std::pair{&d_param, &param}, std::pair{&d_grad, &grad},
                                  std::pair{&d_m, &m}, std::pair{&d_v, &v}}) {
      MEGACPP_CUDA_CHECK(cudaMemcpy(at(*buffer), values->data(), values->size() * sizeof(float),
                                    cudaMemcpyHostToDevice));
    }
    uint16_t* copy = static_cast<uint16_t*>(d_copy.get()) + shift;
    const std::vector<AdamWTensorRef> tensors{
        {at(d_param), at(d_grad), at(d_m), at(d_v), copy, n, true}};
    oracle::DeviceBuffer work(AdamWCuda::workspace_bytes(tensors));
    AdamWCuda op(tensors, work.get(), work.bytes());
    op.step(kHyper, 5, nullptr);
    MEGACPP_CUDA_CHECK(cudaDeviceSynchronize());
    for (oracle::DeviceBuffer* b : {&d_param, &d_m, &d_v}) {
      const std::vector<uint8_t> all = b->download();
      results[shift].emplace_back(all.begin() + shift * static_cast<int64_t>(sizeof(float)),
                                  all.begin() + (shift + n) * static_cast<int64_t>(sizeof(float)));
    }
    const std::vector<uint8_t> all = d_copy.download();
    results[shift].emplace_back(all.begin() + shift * static_cast<int64_t>(sizeof(uint16_t)),
                                all.begin() + (shift + n) * static_cast<int64_t>(sizeof(uint16_t)));
  }
  const char* names[] = {"param", "exp_avg", "exp_avg_sq", "param_bf16"};
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_TRUE(results[0][k] == results[1][k]) << names[k] << " differs";
  }
}

TEST(AdamWCudaTensors, RefusesBadTensorsStepAndWorkspace) {
  MEGACPP_REQUIRE_GPU();
  oracle::DeviceBuffer buffer(4096);
  float* f = static_cast<float*>(buffer.get());
  oracle::expect_error(
      [&] {
        AdamWCuda op({{f, f, f, f, nullptr, -2, true}}, buffer.get(), buffer.bytes());
      },
      megacpp::ErrorKind::kInvalidArgument, "size -2", "a negative size");
  oracle::expect_error(
      [&] {
        AdamWCuda op({{f, f, f, f, nullptr, 4, true}, {f, nullptr, f, f, nullptr, 4, false}},
                     buffer.get(), buffer.bytes());
      },
      megacpp::ErrorKind::kInvalidArgument, "tensor 1", "a null gradient");
  oracle::expect_error(
      [&] {
        AdamWCuda op({{f, f, f, f, nullptr, 4, true}}, buffer.get(), 16);
      },
      megacpp::ErrorKind::kInvalidArgument, "workspace_bytes", "16 bytes");
  AdamWCuda op({{f, f, f, f, nullptr, 4, true}}, buffer.get(), buffer.bytes());
  oracle::expect_error([&] { op.step(kHyper, 0, nullptr); }, megacpp::ErrorKind::kInvalidArgument,
                       "step=0", "step 0");
}

}  // namespace

MEGACPP_ORACLE_ENTRY(AdamW);

#else

MEGACPP_ORACLE_NO_CUDA(AdamWCuda);

#endif
