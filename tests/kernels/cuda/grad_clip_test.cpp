// The CUDA global gradient norm and clipping factor (kernels/cuda/grad_clip.h) against the CPU
// oracle (kernels/cpu/grad_clip.h in double) on the same fp32 gradients: an entry of the oracle
// harness, plus the refusals.
#include "tests/kernels/cuda/oracle_harness.h"

#ifdef MEGACPP_HAVE_CUDA

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu/grad_clip.h"
#include "kernels/cuda/grad_clip.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using megacpp::cuda::GradNormCuda;
using megacpp::cuda::GradTensorRef;
using oracle::DType;
using oracle::Role;

int64_t total_of(const std::vector<int64_t>& sizes) {
  int64_t total = 0;
  for (const int64_t s : sizes) total += s;
  return total;
}

struct GradClip {
  static constexpr const char* kName = "GradNormCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  using Variant = oracle::Variant;
  struct Case {
    std::string name;
    std::vector<int64_t> sizes;  // the tensors, back to back in one buffer (odd offsets too)
    // max_norm as a multiple of the true norm: < 1 clips, > 1 does not, 0 disables clipping.
    double max_norm_ratio;
    std::vector<Variant> variants;
  };

  static std::vector<Case> cases() {
    // A model's mix: large matrices, chunk-boundary sizes, norm weights and biases, an empty one.
    const std::vector<int64_t> model{4194304, 65536, 65537, 1024, 3, 0, 1048583, 17, 2500000};
    return {{"model_clipped", model, 0.25, {}},
            {"model_unclipped", model, 4.0, {}},
            {"model_clipping_off", model, 0.0, {}},
            {"one_value", {1}, 0.5, {}},
            {"one_large_tensor", {GradNormCuda::kChunk * 37 + 5}, 0.9, {}}};
  }

  static void declare(const Case& c, oracle::Problem& p) {
    std::mt19937_64& rng = p.rng();
    std::normal_distribution<double> normal(0.0, 1.0);
    // Per-tensor scales spread over decades, as gradients of different layers are.
    std::vector<double> scale(c.sizes.size());
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    for (double& s : scale) s = std::pow(10.0, -4.0 + 4.0 * unit(rng));
    std::vector<size_t> owner;
    for (size_t t = 0; t < c.sizes.size(); ++t)
      owner.insert(owner.end(), static_cast<size_t>(c.sizes[t]), t);
    p.input("grads", DType::kF32, owner.size(),
            [&](size_t i) { return scale[owner[i]] * normal(rng); });
    p.output("norm", DType::kF32, 1, Role::kOutput);
    p.output("scale", DType::kF32, 1, Role::kOutput);
  }

  // The oracle's norm, which also sets max_norm (a ratio of it) for both sides.
  static double norm_of(const Case& c, const double* grads) {
    std::vector<megacpp::cpu::GradBuffer<const double>> buffers;
    int64_t offset = 0;
    for (const int64_t s : c.sizes) {
      buffers.push_back({grads + offset, s});
      offset += s;
    }
    return megacpp::cpu::global_grad_norm<const double>(std::span(buffers));
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    std::vector<double> grads(p.in("grads"), p.in("grads") + total_of(c.sizes));
    const double norm = norm_of(c, grads.data());
    const double max_norm = c.max_norm_ratio * norm;
    // clip_grad_norm scales in place: its factor is what a unit gradient becomes.
    std::vector<megacpp::cpu::GradBuffer<double>> buffers{{grads.data(), total_of(c.sizes)}};
    const double before = grads[0];
    p.out("norm")[0] = megacpp::cpu::clip_grad_norm<double>(
        std::span<const megacpp::cpu::GradBuffer<double>>(buffers), max_norm);
    p.out("scale")[0] = max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
    EXPECT_NEAR(grads[0], before * p.out("scale")[0], 1e-12 * std::abs(before));
  }

  static oracle::Gpu gpu(const Case& c, const Variant&, oracle::DeviceTensors& t) {
    std::vector<GradTensorRef> tensors;
    const float* base = t.f32("grads");
    int64_t offset = 0;
    for (const int64_t s : c.sizes) {
      tensors.push_back({base + offset, s});
      offset += s;
    }
    // max_norm from the oracle's norm of the same values (the harness uploaded their bits).
    std::vector<float> host(static_cast<size_t>(offset));
    MEGACPP_CUDA_CHECK(
        cudaMemcpy(host.data(), base, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
    const std::vector<double> widened(host.begin(), host.end());
    const double max_norm = c.max_norm_ratio * norm_of(c, widened.data());
    const auto workspace =
        std::make_shared<oracle::DeviceBuffer>(GradNormCuda::workspace_bytes(tensors));
    const auto op = std::make_shared<GradNormCuda>(tensors, workspace->get(), workspace->bytes());
    float* norm = t.f32("norm");
    float* scale = t.f32("scale");
    return {{{"norm",
              [=] {
                (void)workspace;
                op->compute(max_norm, norm, scale);
              }}},
            {}};
  }
};

TEST(GradNormCudaTensors, RefusesBadTensorsAndWorkspace) {
  MEGACPP_REQUIRE_GPU();
  oracle::DeviceBuffer buffer(4096);
  const float* g = static_cast<const float*>(buffer.get());
  oracle::expect_error(
      [&] {
        GradNormCuda op({{g, -1}}, buffer.get(), buffer.bytes());
      },
      megacpp::ErrorKind::kInvalidArgument, "size -1", "a negative size");
  oracle::expect_error(
      [&] {
        GradNormCuda op({{g, 4}, {nullptr, 3}}, buffer.get(), buffer.bytes());
      },
      megacpp::ErrorKind::kInvalidArgument, "tensor 1", "a null tensor");
  oracle::expect_error(
      [&] {
        GradNormCuda op({{g, 4}}, buffer.get(), 8);
      },
      megacpp::ErrorKind::kInvalidArgument, "workspace_bytes", "8 bytes");
}

// A norm over tensors split between devices (tensor parallelism) is the norm over all of them:
// the two halves' square sums, added, give the norm and clipping factor compute() gives.
TEST(GradNormCudaTensors, SquareSumsOfPartsGiveTheWholeNorm) {
  MEGACPP_REQUIRE_GPU();
  const std::vector<int64_t> sizes{300000, 17, GradNormCuda::kChunk + 3, 4096};
  std::vector<float> host(static_cast<size_t>(total_of(sizes)));
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.f, 0.01f);
  for (float& g : host) g = normal(rng);
  oracle::DeviceBuffer grads(host.size() * sizeof(float));
  MEGACPP_CUDA_CHECK(
      cudaMemcpy(grads.get(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  std::vector<GradTensorRef> all, first, second;
  int64_t offset = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    const GradTensorRef ref{static_cast<const float*>(grads.get()) + offset, sizes[t]};
    all.push_back(ref);
    (t < 2 ? first : second).push_back(ref);
    offset += sizes[t];
  }
  const auto make = [](const std::vector<GradTensorRef>& list, oracle::DeviceBuffer& workspace) {
    workspace = oracle::DeviceBuffer(GradNormCuda::workspace_bytes(list));
    return GradNormCuda(list, workspace.get(), workspace.bytes());
  };
  oracle::DeviceBuffer wa, wb, wc, results(64);
  const GradNormCuda whole = make(all, wa), part_one = make(first, wb), part_two = make(second, wc);
  auto* out = static_cast<float*>(results.get());  // norm, scale, norm, scale
  auto* sums = reinterpret_cast<double*>(out + 8);
  const double max_norm = 0.5;
  whole.compute(max_norm, out, out + 1);
  part_one.square_sum(sums);
  part_two.square_sum(sums + 1);
  std::vector<double> parts(2);
  MEGACPP_CUDA_CHECK(cudaMemcpy(parts.data(), sums, 2 * sizeof(double), cudaMemcpyDeviceToHost));
  const double total = parts[0] + parts[1];
  MEGACPP_CUDA_CHECK(cudaMemcpy(sums + 2, &total, sizeof(double), cudaMemcpyHostToDevice));
  GradNormCuda::norm_from_square_sum(sums + 2, max_norm, out + 2, out + 3);
  std::vector<float> got(4);
  MEGACPP_CUDA_CHECK(cudaMemcpy(got.data(), out, 4 * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_NEAR(got[2], got[0], 1e-6 * got[0]);
  EXPECT_NEAR(got[3], got[1], 1e-6 * got[1]);
  EXPECT_LT(got[1], 1.f) << "the case must clip";
}

}  // namespace

MEGACPP_ORACLE_ENTRY(GradClip);

#else

MEGACPP_ORACLE_NO_CUDA(GradNormCuda);

#endif
