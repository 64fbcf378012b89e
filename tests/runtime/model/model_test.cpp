// The whole model: finite-difference gradient check in double over every
// parameter tensor (both layer kinds, the MLP, tied and untied embeddings, both
// scan forms), initialization per spec, and parameter names and shapes.
#include "runtime/model/model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "tests/support/gradcheck.h"

namespace megacpp {
namespace {

ModelConfig tiny_test_config(bool tied) {
  return parse_model_config(
      nlohmann::json{
          {"d_model", 16},
          {"pattern", "M*M"},
          {"d_intermediate", 8},
          {"vocab_size", 11},
          {"tie_embeddings", tied},
          {"ssm_cfg",
           {{"d_state", 8}, {"headdim", 8}, {"ngroups", 2}, {"mimo_rank", 2}, {"chunk_size", 3}}},
          {"attn_cfg", {{"num_heads", 2}, {"num_heads_kv", 1}, {"rotary_emb_dim", 4}}}},
      "test config");
}

std::vector<int32_t> random_tokens(int batch, int seqlen, int vocab, std::mt19937_64& rng) {
  std::vector<int32_t> t(static_cast<size_t>(batch) * (seqlen + 1));
  for (auto& v : t) v = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

void check_model_gradients(bool tied, ScanForm form) {
  const ModelConfig config = tiny_test_config(tied);
  Model<double> model(config, ModelOptions{form});
  model.init_parameters(7);
  auto& params = model.parameters();
  // Perturb the structured inits (ones, 1/R) so no gradient vanishes by symmetry.
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> jitter(-0.2, 0.2);
  for (auto& v : params.values()) v += jitter(rng) * (std::abs(v) > 0.5 ? 1.0 : 0.1);
  const int batch = 2, seqlen = 7;
  model.plan(batch, seqlen);
  auto tokens = random_tokens(batch, seqlen, config.vocab_size, rng);
  tokens[seqlen] = -1;  // the last target of row 0 is ignored: it must not contribute
  params.zero_grad();
  const double loss = model.forward_backward(tokens.data(), 1.0);
  EXPECT_NEAR(loss, model.forward(tokens.data()), 1e-12);
  const std::vector<double> analytic(params.grads().begin(), params.grads().end());
  for (const auto& info : params.entries()) {
    // Three elements of every tensor, central differences.
    for (int trial = 0; trial < 3; ++trial) {
      const int64_t i =
          info.offset + static_cast<int64_t>(rng() % static_cast<uint64_t>(info.size));
      double& value = params.values()[static_cast<size_t>(i)];
      const double saved = value, eps = 1e-6;
      value = saved + eps;
      const double plus = model.forward(tokens.data());
      value = saved - eps;
      const double minus = model.forward(tokens.data());
      value = saved;
      const double numeric = (plus - minus) / (2 * eps);
      EXPECT_NEAR(analytic[static_cast<size_t>(i)], numeric, 1e-6 + 1e-5 * std::abs(numeric))
          << info.name << " element " << (i - info.offset);
    }
  }
}

TEST(ModelGradients, TiedEmbeddingsChunkedScan) {
  check_model_gradients(true, ScanForm::kChunked);
}
TEST(ModelGradients, UntiedEmbeddingsRecurrentScan) {
  check_model_gradients(false, ScanForm::kRecurrent);
}

// The loss is a softmax over the whole padded vocabulary (shared/spec/model.md): the lm_head rows
// of the padded tokens (11 → 16 here) are real parameters and receive gradients. Untied, the
// embedding's padded rows are never looked up (no input token reaches them): zero gradient.
// Tied, the shared matrix gets the lm_head's gradient on those rows.
TEST(ModelGradients, PaddedVocabularyRowsTrainThroughTheLmHead) {
  for (const bool tied : {false, true}) {
    const ModelConfig config = tiny_test_config(tied);
    Model<double> model(config);
    model.init_parameters(5);
    model.plan(2, 6);
    std::mt19937_64 rng(4);
    const auto tokens = random_tokens(2, 6, config.vocab_size, rng);
    auto& params = model.parameters();
    params.zero_grad();
    model.forward_backward(tokens.data(), 1.0);
    const int dm = config.d_model;
    const auto row_norm = [&](const std::string& name, int row) {
      const double* g = params.grad(params.find(name)) + static_cast<ptrdiff_t>(row) * dm;
      double sum = 0;
      for (int c = 0; c < dm; ++c) sum += g[c] * g[c];
      return std::sqrt(sum);
    };
    const std::string head = tied ? "backbone.embedding.weight" : "lm_head.weight";
    for (int row = config.vocab_size; row < config.padded_vocab(); ++row) {
      EXPECT_GT(row_norm(head, row), 1e-8) << head << " padded row " << row;
      if (!tied) {
        EXPECT_EQ(row_norm("backbone.embedding.weight", row), 0.0) << "row " << row;
      }
    }
  }
}

TEST(ModelGradients, GradScaleAndAccumulation) {
  Model<double> model(tiny_test_config(true));
  model.init_parameters(3);
  model.plan(1, 5);
  std::mt19937_64 rng(2);
  auto tokens = random_tokens(1, 5, 11, rng);
  model.parameters().zero_grad();
  model.forward_backward(tokens.data(), 1.0);
  const auto once = model.parameters().grads();
  model.parameters().zero_grad();
  model.forward_backward(tokens.data(), 0.5);
  model.forward_backward(tokens.data(), 0.5);
  for (size_t i = 0; i < once.size(); i += 97)
    EXPECT_NEAR(model.parameters().grads()[i], once[i], 1e-12);
}

TEST(ModelParameters, NamesAndShapesFollowTheSpec) {
  const ModelConfig c = tiny_test_config(false);
  Model<float> model(c);
  const auto& p = model.parameters();
  auto shape_of = [&](const std::string& name) {
    const int id = p.find(name);
    EXPECT_GE(id, 0) << name;
    return id >= 0 ? p.info(id).shape : std::vector<int64_t>{};
  };
  // in_proj: z, x (2·d_inner) + B, C (2·N·G·R) + dd_dt, dd_A, trap (3H) + angles (A_n).
  const int64_t cols = 2 * 32 + 2 * 8 * 2 * 2 + 3 * 4 + 2;
  EXPECT_EQ(shape_of("backbone.layers.0.mixer.in_proj.weight"), (std::vector<int64_t>{cols, 16}));
  EXPECT_EQ(shape_of("backbone.layers.0.mixer.B_bias"), (std::vector<int64_t>{4, 2, 8}));
  EXPECT_EQ(shape_of("backbone.layers.0.mixer.mimo_o"), (std::vector<int64_t>{4, 2, 8}));
  EXPECT_EQ(shape_of("backbone.layers.0.mixer.out_proj.weight"), (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(shape_of("backbone.layers.1.mixer.in_proj.weight"),
            (std::vector<int64_t>{(2 + 2) * 8, 16}));
  EXPECT_EQ(shape_of("backbone.layers.1.mixer.out_proj.bias"), (std::vector<int64_t>{16}));
  EXPECT_EQ(shape_of("backbone.layers.2.mlp.fc1.weight"), (std::vector<int64_t>{2 * 128, 16}));
  EXPECT_EQ(shape_of("backbone.embedding.weight"), (std::vector<int64_t>{16, 16}));  // 11 → 16
  EXPECT_EQ(shape_of("lm_head.weight"), (std::vector<int64_t>{16, 16}));
  EXPECT_EQ(shape_of("backbone.norm_f.weight"), (std::vector<int64_t>{16}));
  Model<float> tied(tiny_test_config(true));
  EXPECT_LT(tied.parameters().find("lm_head.weight"), 0);
  // The no-decay set: dt_bias, D, norm weights and biases.
  EXPECT_FALSE(p.info(p.find("backbone.layers.0.mixer.dt_bias")).weight_decay);
  EXPECT_FALSE(p.info(p.find("backbone.layers.0.mixer.D")).weight_decay);
  EXPECT_FALSE(p.info(p.find("backbone.layers.0.mixer.C_norm.weight")).weight_decay);
  EXPECT_FALSE(p.info(p.find("backbone.layers.1.mixer.in_proj.bias")).weight_decay);
  EXPECT_FALSE(p.info(p.find("backbone.layers.0.norm.weight")).weight_decay);
  EXPECT_TRUE(p.info(p.find("backbone.layers.0.mixer.in_proj.weight")).weight_decay);
}

TEST(ModelInit, FollowsTheSpec) {
  const ModelConfig c = tiny_test_config(true);
  Model<double> model(c);
  model.init_parameters(42);
  auto& p = model.parameters();
  auto values = [&](const std::string& name) {
    const int id = p.find(name);
    return std::vector<double>(p.value(id), p.value(id) + p.info(id).size);
  };
  for (double v : values("backbone.layers.0.mixer.B_bias")) EXPECT_EQ(v, 1.0);
  for (double v : values("backbone.layers.0.mixer.mimo_x")) EXPECT_EQ(v, 0.5);  // 1/R
  for (double v : values("backbone.layers.0.mixer.mimo_z")) EXPECT_EQ(v, 1.0);
  for (double v : values("backbone.layers.0.mixer.D")) EXPECT_EQ(v, 1.0);
  for (double v : values("backbone.layers.1.mixer.in_proj.bias")) EXPECT_EQ(v, 0.0);
  for (double v : values("backbone.layers.0.mixer.dt_bias")) {
    const double dt = std::log1p(std::exp(v));
    EXPECT_GE(dt, c.ssm.dt_min * (1 - 1e-9));
    EXPECT_LE(dt, c.ssm.dt_max * (1 + 1e-9));
  }
  // out_proj: U(±1/√fan_in)/√(2·n_layer) with an MLP.
  const double bound = 1.0 / std::sqrt(32.0) / std::sqrt(2.0 * 3);
  double max_abs = 0;
  for (double v : values("backbone.layers.0.mixer.out_proj.weight"))
    max_abs = std::max(max_abs, std::abs(v));
  EXPECT_LE(max_abs, bound);
  EXPECT_GT(max_abs, 0.5 * bound);
  // Embedding N(0, 0.02).
  const auto emb = values("backbone.embedding.weight");
  double sq = 0;
  for (double v : emb) sq += v * v;
  EXPECT_NEAR(std::sqrt(sq / static_cast<double>(emb.size())), 0.02, 0.006);
  // Same seed, same parameters; another seed, others.
  Model<double> again(c);
  again.init_parameters(42);
  EXPECT_EQ(again.parameters().values(), p.values());
  again.init_parameters(43);
  EXPECT_NE(again.parameters().values(), p.values());
}

TEST(ModelForward, RejectsTokensOutsideTheVocabulary) {
  Model<float> model(tiny_test_config(true));
  model.init_parameters(1);
  model.plan(1, 3);
  std::vector<int32_t> tokens = {1, 2, 11, 3};
  try {
    model.forward(tokens.data());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 11"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace megacpp
