// The whole training step on the GPU (runtime/model/cuda_model.h) against the CPU model in
// double: the loss and every parameter's gradient of one forward+backward, on small configs that
// cover both layer kinds, the MLP, GQA, tied and untied embeddings, MIMO rank 4 and 1; bitwise
// reproducibility of the step; the optimizer step's gradient norm; and a round trip of the
// parameters and optimizer state through the host.
//
// Both models start from the same values, rounded to bf16 first: the GPU multiplies bf16 copies
// of the weights, so the oracle sees exactly the weights the GPU sees, and what remains is the
// step's own mixed-precision error (bf16 activations and bf16 per-token gradients between the
// ops, as under the official model's autocast).
//
// Tolerances, max-abs normalised per tensor: the loss within shared/bench/anchors.md's forward
// bound (0.01; measured 1e-5 to 7e-5). The gradients do NOT meet the per-op bound (0.012) after a
// whole backward: measured on an H100 (2026-11-23) the worst tensors are the ones summed over
// every token with heavy cancellation (dt_bias 5.4e-2, B/C biases and norm weights, D,
// mimo_* 1.4e-2 to 3.6e-2) and the first layers' weights (fc1 1.8e-2), while every op alone meets
// 0.012 in the oracle harness. The bound here, 0.08, is what the composition gives with margin; a
// wrong op or wiring shows up as errors of order 1.
#include <gtest/gtest.h>

#ifdef MEGACPP_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/layers/mamba3_mixer.h"
#include "runtime/model/cuda_model.h"
#include "runtime/model/model.h"
#include "tests/support/bf16.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"

namespace megacpp {
namespace {

constexpr double kForwardTolerance = 0.01;
constexpr double kGradientTolerance = 0.08;
// The global gradient norm sums every gradient: its error is the per-op one.
constexpr double kNormTolerance = 0.012;

struct StepCase {
  std::string name;
  nlohmann::json config;
  int batch;
  int seqlen;
};

std::vector<StepCase> step_cases() {
  return {
      // Both layer kinds with the MLP, GQA (4 q heads over 2 kv heads), tied embeddings, R = 4.
      {"hybrid_gqa_tied_r4",
       {{"d_model", 256},
        {"pattern", "M*M"},
        {"d_intermediate", 384},
        {"vocab_size", 300},
        {"tie_embeddings", true},
        {"ssm_cfg", {{"d_state", 32}, {"headdim", 32}, {"mimo_rank", 4}, {"chunk_size", 16}}},
        {"attn_cfg", {{"num_heads", 4}, {"num_heads_kv", 2}, {"rotary_emb_dim", 32}}}},
       2,
       48},
      // Untied lm_head, MHA, no MLP, SISO (R = 1) with two B/C groups, a length that is not a
      // multiple of the chunk.
      {"untied_mha_r1_nomlp",
       {{"d_model", 128},
        {"pattern", "*MM"},
        {"d_intermediate", 0},
        {"vocab_size", 200},
        {"tie_embeddings", false},
        {"ssm_cfg",
         {{"d_state", 16}, {"headdim", 16}, {"ngroups", 2}, {"mimo_rank", 1}, {"chunk_size", 16}}},
        {"attn_cfg", {{"num_heads", 2}, {"num_heads_kv", 2}, {"rotary_emb_dim", 64}}}},
       3,
       37},
      // The tiny preset's shapes (head_dim 48) over a short window.
      {"tiny_preset", model_config_to_json(model_preset("tiny")), 2, 64},
  };
}

std::vector<int32_t> random_tokens(int batch, int seqlen, int vocab, std::mt19937_64& rng) {
  std::vector<int32_t> t(static_cast<size_t>(batch) * (seqlen + 1));
  for (auto& v : t) v = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

// The host float model (the GPU's mirror) and the double oracle with the same bf16-exact values.
struct Pair {
  ModelConfig config;
  Model<float> host;
  Model<double> oracle;
  explicit Pair(const ModelConfig& c) : config(c), host(c), oracle(c) {
    host.init_parameters(5);
    // Perturb the structured inits (ones, 1/R) so that no gradient vanishes by symmetry.
    std::mt19937_64 rng(17);
    std::uniform_real_distribution<float> jitter(-0.2f, 0.2f);
    for (float& v : host.parameters().values()) {
      const float jittered = v + jitter(rng) * (std::abs(v) > 0.5f ? 1.0f : 0.1f);
      v = static_cast<float>(testing::from_bf16(testing::to_bf16(jittered)));
    }
    const auto& src = host.parameters().values();
    auto& dst = oracle.parameters().values();
    for (size_t i = 0; i < src.size(); ++i) dst[i] = src[i];
  }
};

class CudaModelStep : public ::testing::TestWithParam<StepCase> {};

// One step of `c` with `options` against the CPU double model: the loss and every parameter's
// gradient within the bf16 tolerances.
void expect_step_matches_the_oracle(const StepCase& c, const CudaModelOptions& options) {
  Pair pair(parse_model_config(c.config, c.name));
  std::mt19937_64 rng(23);
  std::vector<int32_t> tokens = random_tokens(c.batch, c.seqlen, pair.config.vocab_size, rng);
  tokens[static_cast<size_t>(c.seqlen)] = -1;  // an ignored target

  pair.oracle.plan(c.batch, c.seqlen);
  pair.oracle.parameters().zero_grad();
  const double want_loss = pair.oracle.forward_backward(tokens.data(), 1.0);

  CudaModel gpu(pair.host, c.batch, c.seqlen, OptimizerConfig{}, 0, {}, nullptr, options);
  gpu.upload(pair.host.parameters(), nullptr);
  gpu.zero_grad();
  const double got_loss = gpu.forward_backward(tokens.data(), 1.0);
  const std::vector<float> grads = gpu.download_gradients();
  EXPECT_LE(std::abs(got_loss - want_loss) / std::abs(want_loss), kForwardTolerance)
      << "loss: gpu " << got_loss << ", cpu double " << want_loss;
  EXPECT_NEAR(gpu.forward(tokens.data()), got_loss, 1e-6 * std::abs(want_loss));

  const auto& want = pair.oracle.parameters().grads();
  std::vector<std::pair<double, std::string>> errors;
  for (const ParameterInfo& p : pair.host.parameters().entries()) {
    double max_ref = 0, max_err = 0;
    bool finite = true;
    for (int64_t i = p.offset; i < p.offset + p.size; ++i) {
      const double g = grads[static_cast<size_t>(i)], w = want[static_cast<size_t>(i)];
      finite = finite && std::isfinite(g);
      max_ref = std::max(max_ref, std::abs(w));
      max_err = std::max(max_err, std::abs(g - w));
    }
    ASSERT_TRUE(finite) << p.name << ": non-finite gradient on the GPU";
    const double rel = max_ref > 0 ? max_err / max_ref : max_err;
    EXPECT_LE(rel, kGradientTolerance)
        << p.name << ": max|gpu - cpu| = " << max_err << ", max|cpu| = " << max_ref;
    errors.emplace_back(rel, p.name);
  }
  std::sort(errors.rbegin(), errors.rend());
  std::printf(
      "[ %s, %s attention%s ] loss gpu %.7f cpu %.7f (rel %.2e); device %zu bytes planned, %zu "
      "in use; worst gradients:",
      c.name.c_str(), options.attention == AttentionEngine::kCudnn ? "cuDNN" : "own",
      options.deterministic ? "" : ", nondeterministic", got_loss, want_loss,
      std::abs(got_loss - want_loss) / want_loss, gpu.memory_plan().arena,
      gpu.device_bytes_in_use());
  for (size_t i = 0; i < std::min<size_t>(errors.size(), 6); ++i) {
    std::printf(" %s %.2e;", errors[i].second.c_str(), errors[i].first);
  }
  std::printf("\n");
}

TEST_P(CudaModelStep, LossAndEveryGradientMatchTheCpuDoubleModel) {
  MEGACPP_REQUIRE_GPU();
  expect_step_matches_the_oracle(GetParam(), CudaModelOptions{});
}

TEST_P(CudaModelStep, WithOurOwnAttentionKernelsTheStepMatchesTheCpuDoubleModel) {
  MEGACPP_REQUIRE_GPU();
  expect_step_matches_the_oracle(GetParam(),
                                 CudaModelOptions{.attention = AttentionEngine::kMegacpp});
}

TEST_P(CudaModelStep, WithNondeterministicAttentionTheStepMatchesTheCpuDoubleModel) {
  MEGACPP_REQUIRE_GPU();
  expect_step_matches_the_oracle(GetParam(), CudaModelOptions{.deterministic = false});
}

TEST_P(CudaModelStep, TwoStepsOfTheSameJobAreBitwiseEqual) {
  MEGACPP_REQUIRE_GPU();
  const StepCase& c = GetParam();
  Pair pair(parse_model_config(c.config, c.name));
  std::mt19937_64 rng(29);
  const std::vector<int32_t> tokens = random_tokens(c.batch, c.seqlen, pair.config.vocab_size, rng);
  CudaModel gpu(pair.host, c.batch, c.seqlen, OptimizerConfig{});
  std::vector<std::vector<float>> runs;
  std::vector<double> losses;
  for (int run = 0; run < 2; ++run) {
    AdamW<float> fresh(pair.host.parameters(), OptimizerConfig{});  // zero moments, step 0
    gpu.upload(pair.host.parameters(), &fresh);
    gpu.zero_grad();
    losses.push_back(gpu.forward_backward(tokens.data(), 0.5));
    losses.push_back(gpu.forward_backward(tokens.data(), 0.5));  // accumulation
    losses.push_back(gpu.optimizer_step(1e-3));
    runs.push_back(gpu.download_gradients());
    ParameterSet<float> after = pair.host.parameters();
    gpu.download(after, nullptr);
    runs.emplace_back(after.values().begin(), after.values().end());
  }
  EXPECT_EQ(losses[0], losses[3]);
  EXPECT_EQ(losses[1], losses[4]);
  EXPECT_EQ(losses[2], losses[5]);
  EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[2].data(), runs[0].size() * sizeof(float)))
      << "gradients differ between two identical steps";
  EXPECT_EQ(0, std::memcmp(runs[1].data(), runs[3].data(), runs[1].size() * sizeof(float)))
      << "updated parameters differ between two identical steps";
}

// The step graph replays what the eager step launches: three steps on three different batches
// (the replay must read each new upload) give the same losses, norms and parameters, bit for bit,
// from one capture.
TEST_P(CudaModelStep, TheStepGraphReplaysTheEagerStepBitwise) {
  MEGACPP_REQUIRE_GPU();
  const StepCase& c = GetParam();
  Pair pair(parse_model_config(c.config, c.name));
  std::mt19937_64 rng(37);
  std::vector<std::vector<int32_t>> batches;
  for (int i = 0; i < 3; ++i) {
    batches.push_back(random_tokens(c.batch, c.seqlen, pair.config.vocab_size, rng));
  }
  std::vector<std::vector<double>> losses(2);
  std::vector<std::vector<float>> params_after;
  for (int graph = 0; graph < 2; ++graph) {
    CudaModel gpu(pair.host, c.batch, c.seqlen, OptimizerConfig{});
    AdamW<float> fresh(pair.host.parameters(), OptimizerConfig{});
    gpu.upload(pair.host.parameters(), &fresh);
    gpu.set_step_graph(graph == 1);
    for (const std::vector<int32_t>& tokens : batches) {
      gpu.zero_grad();
      losses[graph].push_back(gpu.forward_backward(tokens.data(), 1.0));
      losses[graph].push_back(gpu.optimizer_step(1e-3));
    }
    EXPECT_EQ(gpu.step_graph_captures(), graph == 1 ? 1 : 0);
    ParameterSet<float> after = pair.host.parameters();
    gpu.download(after, nullptr);
    params_after.emplace_back(after.values().begin(), after.values().end());
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(0, std::memcmp(params_after[0].data(), params_after[1].data(),
                           params_after[0].size() * sizeof(float)))
      << "the replayed steps updated the parameters differently from the eager ones";
}

// recompute_in_proj: the backward recomputes each Mamba layer's in_proj output with the forward's
// GEMM, so a step (two accumulated micro-batches, then AdamW) gives the same bits as the step that
// kept them, from less planned memory (one shared buffer for every Mamba layer).
TEST_P(CudaModelStep, RecomputingTheInProjOutputsGivesTheSameStepFromLessMemory) {
  MEGACPP_REQUIRE_GPU();
  const StepCase& c = GetParam();
  Pair pair(parse_model_config(c.config, c.name));
  std::mt19937_64 rng(43);
  const std::vector<int32_t> tokens = random_tokens(c.batch, c.seqlen, pair.config.vocab_size, rng);
  std::vector<double> losses[2];
  std::vector<float> grads[2], params[2];
  size_t planned[2] = {0, 0};
  for (int recompute = 0; recompute < 2; ++recompute) {
    const CudaModelOptions memory{recompute == 1};
    CudaModel gpu(pair.host, c.batch, c.seqlen, OptimizerConfig{}, 0, {}, nullptr, memory);
    planned[recompute] = gpu.memory_plan().arena;
    // What megacppd checks a job against at submit, planned from the config alone, is what the
    // constructor allocated, and no more than the device gave up.
    const CudaMemoryPlan plan =
        CudaModel::plan_memory(pair.config, c.batch, c.seqlen, 1, 0, memory);
    EXPECT_EQ(plan.arena, gpu.memory_plan().arena);
    EXPECT_EQ(plan.layer_workspaces, gpu.memory_plan().layer_workspaces);
    // Within 2 MiB: cuDNN loads the kernels of the attention plans this model builds and
    // unloads those of the plans an earlier model dropped, which moves the device's free memory
    // by a fraction of a MiB either way while the model is made.
    EXPECT_GE(gpu.device_bytes_in_use() + (size_t{2} << 20), plan.total());
    std::printf("[ %s ] recompute_in_proj=%d: planned %llu bytes, the device gave up %zu\n",
                c.name.c_str(), recompute, static_cast<unsigned long long>(plan.total()),
                gpu.device_bytes_in_use());
    AdamW<float> fresh(pair.host.parameters(), OptimizerConfig{});
    gpu.upload(pair.host.parameters(), &fresh);
    gpu.zero_grad();
    losses[recompute].push_back(gpu.forward_backward(tokens.data(), 0.5));
    losses[recompute].push_back(gpu.forward_backward(tokens.data(), 0.5));
    grads[recompute] = gpu.download_gradients();
    losses[recompute].push_back(gpu.optimizer_step(1e-3));
    ParameterSet<float> after = pair.host.parameters();
    gpu.download(after, nullptr);
    params[recompute].assign(after.values().begin(), after.values().end());
    losses[recompute].push_back(gpu.forward(tokens.data()));
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(0, std::memcmp(grads[0].data(), grads[1].data(), grads[0].size() * sizeof(float)))
      << "the recomputed in_proj outputs changed the gradients";
  EXPECT_EQ(0, std::memcmp(params[0].data(), params[1].data(), params[0].size() * sizeof(float)))
      << "the recomputed in_proj outputs changed the step";
  int mamba_layers = 0;
  for (int i = 0; i < pair.config.n_layer; ++i) mamba_layers += !pair.config.is_attention_layer(i);
  if (mamba_layers > 1) {
    EXPECT_LT(planned[1], planned[0]);
  } else {
    EXPECT_LE(planned[1], planned[0]);
  }
  std::printf("[ %s ] planned %zu bytes keeping in_proj outputs, %zu recomputing them\n",
              c.name.c_str(), planned[0], planned[1]);
}

TEST_P(CudaModelStep, OptimizerStepReportsTheCpuGradientNormAndRoundTripsThroughTheHost) {
  MEGACPP_REQUIRE_GPU();
  const StepCase& c = GetParam();
  Pair pair(parse_model_config(c.config, c.name));
  std::mt19937_64 rng(31);
  const std::vector<int32_t> tokens = random_tokens(c.batch, c.seqlen, pair.config.vocab_size, rng);
  pair.oracle.plan(c.batch, c.seqlen);
  pair.oracle.parameters().zero_grad();
  pair.oracle.forward_backward(tokens.data(), 1.0);
  double want_sq = 0;
  for (double g : pair.oracle.parameters().grads()) want_sq += g * g;

  OptimizerConfig opt;
  opt.grad_clip = 0.5;
  AdamW<float> host_optimizer(pair.host.parameters(), opt);
  CudaModel gpu(pair.host, c.batch, c.seqlen, opt);
  gpu.upload(pair.host.parameters(), &host_optimizer);
  gpu.zero_grad();
  gpu.forward_backward(tokens.data(), 1.0);
  const double norm = gpu.optimizer_step(1e-3);
  EXPECT_LE(std::abs(norm - std::sqrt(want_sq)) / std::sqrt(want_sq), kNormTolerance);

  // Download, upload into a fresh device model, download again: the same bits and step count.
  ParameterSet<float> params = pair.host.parameters();
  AdamW<float> moments(params, opt);
  gpu.download(params, &moments);
  EXPECT_EQ(moments.steps_taken(), 1);
  bool changed = false;
  for (size_t i = 0; i < params.values().size(); ++i) {
    changed = changed || params.values()[i] != pair.host.parameters().values()[i];
  }
  EXPECT_TRUE(changed) << "the optimizer step left every parameter as it was";
  CudaModel again(pair.host, c.batch, c.seqlen, opt);
  again.upload(params, &moments);
  ParameterSet<float> back = pair.host.parameters();
  AdamW<float> back_moments(back, opt);
  again.download(back, &back_moments);
  EXPECT_EQ(back.values(), params.values());
  EXPECT_EQ(back_moments.exp_avg(), moments.exp_avg());
  EXPECT_EQ(back_moments.exp_avg_sq(), moments.exp_avg_sq());
  EXPECT_EQ(back_moments.steps_taken(), 1);
}

INSTANTIATE_TEST_SUITE_P(Configs, CudaModelStep, ::testing::ValuesIn(step_cases()),
                         [](const auto& test) { return test.param.name; });

// anchors.md's bench-350m at micro-batch 4 x 8192 fits an 80 GB H100 (the memory bound),
// and recompute_in_proj frees every Mamba layer's in_proj output but one: what megacppd's
// submit-time check (daemon/job_spec.cpp) computes, without allocating it.
TEST(CudaModelOptionsPlan, Bench350mFitsAnH100AndTheGateFreesTheInProjOutputs) {
  MEGACPP_REQUIRE_GPU();  // the plan asks CUB for its sort sizes, which needs a device
  const ModelConfig config = model_preset("bench-350m");
  const int batch = 4, seqlen = 8192;
  const CudaMemoryPlan kept = CudaModel::plan_memory(config, batch, seqlen);
  const CudaMemoryPlan lean = CudaModel::plan_memory(config, batch, seqlen, 1, 0, {true});
  const CudaMemoryPlan nondeterministic =
      CudaModel::plan_memory(config, batch, seqlen, 1, 0, CudaModelOptions{.deterministic = false});
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  EXPECT_LT(kept.total(), 78 * kGiB);  // an H100's 80 GB less the context and libraries
  int mamba_layers = 0;
  for (int i = 0; i < config.n_layer; ++i) mamba_layers += !config.is_attention_layer(i);
  const ops::Mamba3PreprocessShape shape = mamba3_preprocess_shape(config, batch * seqlen);
  // Its rows padded to 64 elements (128 bytes): the scan reads z and x in them.
  ASSERT_EQ(shape.columns() % 8, 0);
  const uint64_t row = (static_cast<uint64_t>(shape.columns()) + 63) / 64 * 64;
  const uint64_t proj_bytes = static_cast<uint64_t>(batch) * seqlen * row * 2;
  EXPECT_EQ(kept.arena - lean.arena, static_cast<uint64_t>(mamba_layers - 1) * proj_bytes);
  EXPECT_EQ(kept.layer_workspaces, lean.layer_workspaces);
  std::printf(
      "bench-350m R=4, 4 x 8192: planned %.2f GiB (arena %.2f, layer workspaces %.2f); "
      "with recompute_in_proj %.2f GiB; with nondeterministic attention %.2f GiB\n",
      static_cast<double>(kept.total()) / kGiB, static_cast<double>(kept.arena) / kGiB,
      static_cast<double>(kept.layer_workspaces) / kGiB, static_cast<double>(lean.total()) / kGiB,
      static_cast<double>(nondeterministic.total()) / kGiB);
  // The deterministic attention backward's dS: batch · q heads · seqlen² bf16 in cuDNN's
  // workspace, which the op workspace the ops share is sized for. Less what the op workspace
  // holds without it: the nondeterministic backward's fp32 dQ accumulator, or another op's need
  // where that is larger (under 1 GiB).
  const uint64_t ds_bytes = static_cast<uint64_t>(batch) * config.attn.num_heads * seqlen *
                            static_cast<uint64_t>(seqlen) * 2;
  EXPECT_GE(kept.arena - nondeterministic.arena, ds_bytes - kGiB);
  EXPECT_LE(kept.arena - nondeterministic.arena, ds_bytes);
}

// The one-GPU plan of the tiny preset with `options`, which must be refused naming `needle`.
void expect_tiny_plan_refused(const CudaModelOptions& options, const std::string& needle,
                              const std::string& what) {
  megacpp::testing::expect_error(
      [&] { (void)CudaModel::plan_memory(model_preset("tiny"), 2, 64, 1, 0, options); },
      ErrorKind::kInvalidArgument, needle, what);
}

TEST(CudaModelOptionsPlan, RefusesANegativeSmReserve) {
  MEGACPP_REQUIRE_GPU();  // the plan asks CUB for its sort sizes, which needs a device
  expect_tiny_plan_refused(CudaModelOptions{.tensor_parallel_reserved_sms = -4},
                           "tensor_parallel_reserved_sms=-4", "a negative reserve");
}

TEST(CudaModelOptionsPlan, RefusesCopyEnginesWithoutTensorParallelism) {
  MEGACPP_REQUIRE_GPU();
  expect_tiny_plan_refused(CudaModelOptions{.tensor_parallel_copy_engines = true},
                           "tensor_parallel_copy_engines=true", "copy engines on one GPU");
}

TEST(CudaModelInput, RefusesTokensOutsideTheVocabularyNamingThePosition) {
  MEGACPP_REQUIRE_GPU();
  const StepCase c = step_cases()[0];
  Pair pair(parse_model_config(c.config, c.name));
  CudaModel gpu(pair.host, 1, 8, OptimizerConfig{});
  std::vector<int32_t> tokens(9, 1);
  tokens[3] = pair.config.vocab_size;
  try {
    gpu.forward(tokens.data());
    FAIL() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("position 3"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace megacpp

#else

TEST(CudaModelStep, SkippedWithoutCuda) {
  GTEST_SKIP() << "built without CUDA";
}

#endif
