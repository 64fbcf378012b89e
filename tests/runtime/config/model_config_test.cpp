// Model config parsing and validation: every rule refused with the field named.
#include "runtime/config/model_config.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "base/error.h"

namespace megacpp {
namespace {

using nlohmann::json;

json valid() {
  return json{{"d_model", 64},
              {"n_layer", 4},
              {"vocab_size", 100},
              {"attn_layer_idx", {3}},
              {"ssm_cfg", {{"d_state", 16}, {"headdim", 32}}},
              {"attn_cfg", {{"num_heads", 4}}}};
}

std::string error_of(const json& j) {
  try {
    parse_model_config(j, "cfg.json");
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return e.what();
  }
  return "";
}

TEST(ModelConfig, ParsesDefaultsAndDerivedSizes) {
  const ModelConfig c = parse_model_config(valid(), "cfg.json");
  EXPECT_EQ(c.d_inner(), 128);
  EXPECT_EQ(c.ssm_heads(), 4);
  EXPECT_EQ(c.rope_angles(), 4);  // N=16, ρ=0.5 → 8 → 4
  EXPECT_EQ(c.padded_vocab(), 104);
  EXPECT_EQ(c.pattern(), "MMM*");
  EXPECT_EQ(c.attn_head_dim(), 16);
  EXPECT_EQ(c.ssm.mimo_rank, 4);
  json rope1 = valid();
  rope1["ssm_cfg"]["rope_fraction"] = 1.0;
  EXPECT_EQ(parse_model_config(rope1, "x").rope_angles(), 8);
  // Round trip through JSON.
  const ModelConfig again = parse_model_config(model_config_to_json(c), "again");
  EXPECT_EQ(model_config_to_json(again), model_config_to_json(c));
}

TEST(ModelConfig, PatternExpandsAndMustAgree) {
  json j = valid();
  j.erase("n_layer");
  j.erase("attn_layer_idx");
  j["pattern"] = "MM*M*";
  const ModelConfig c = parse_model_config(j, "cfg.json");
  EXPECT_EQ(c.n_layer, 5);
  EXPECT_EQ(c.attn_layer_idx, (std::vector<int>{2, 4}));
  j["n_layer"] = 4;
  EXPECT_NE(error_of(j).find("pattern=\"MM*M*\" has 5 layers but n_layer=4"), std::string::npos);
  j["n_layer"] = 5;
  j["attn_layer_idx"] = {1};
  EXPECT_NE(error_of(j).find("attn_layer_idx=[1]"), std::string::npos);
  j.erase("attn_layer_idx");
  j["pattern"] = "MMxM*";
  EXPECT_NE(error_of(j).find("'x' at position 2"), std::string::npos);
}

struct Rule {
  const char* name;
  std::function<void(json&)> breaks;
  const char* message;
};

TEST(ModelConfig, EveryRuleNamesItsField) {
  const std::vector<Rule> rules = {
      {"headdim", [](json& j) { j["ssm_cfg"]["headdim"] = 48; },
       "ssm_cfg.headdim=48 does not divide d_inner=128"},
      {"ngroups", [](json& j) { j["ssm_cfg"]["ngroups"] = 3; },
       "ssm_cfg.ngroups=3 does not divide"},
      {"rope", [](json& j) { j["ssm_cfg"]["rope_fraction"] = 0.25; }, "ssm_cfg.rope_fraction=0.25"},
      {"mimo", [](json& j) { j["ssm_cfg"]["mimo_rank"] = 0; }, "ssm_cfg.mimo_rank=0"},
      {"chunk", [](json& j) { j["ssm_cfg"]["chunk_size"] = -1; }, "ssm_cfg.chunk_size=-1"},
      {"layer", [](json& j) { j["ssm_cfg"]["layer"] = "Mamba2"; }, "ssm_cfg.layer=\"Mamba2\""},
      {"is_mimo", [](json& j) { j["ssm_cfg"]["is_mimo"] = false; }, "ssm_cfg.is_mimo=false"},
      {"kv", [](json& j) { j["attn_cfg"]["num_heads_kv"] = 3; },
       "attn_cfg.num_heads_kv=3 does not divide num_heads=4"},
      {"rotary", [](json& j) { j["attn_cfg"]["rotary_emb_dim"] = 5; }, "attn_cfg.rotary_emb_dim=5"},
      {"causal", [](json& j) { j["attn_cfg"]["causal"] = false; }, "attn_cfg.causal=false"},
      {"interleaved", [](json& j) { j["attn_cfg"]["rotary_emb_interleaved"] = true; },
       "rotary_emb_interleaved"},
      {"attn idx", [](json& j) { j["attn_layer_idx"] = {4}; }, "attn_layer_idx contains 4"},
      {"attn dup",
       [](json& j) {
         j["attn_layer_idx"] = {1, 1};
       },
       "lists layer 1 twice"},
      {"d_model", [](json& j) { j["d_model"] = 0; }, "d_model=0"},
      {"vocab", [](json& j) { j["vocab_size"] = -5; }, "vocab_size=-5"},
      {"rms", [](json& j) { j["rms_norm"] = false; }, "rms_norm=false"},
      {"unknown", [](json& j) { j["d_modle"] = 3; }, "unknown key d_modle"},
      {"unknown ssm", [](json& j) { j["ssm_cfg"]["dstate"] = 3; }, "unknown key ssm_cfg.dstate"},
      {"type", [](json& j) { j["n_layer"] = "four"; }, "n_layer has the wrong type"},
      {"no heads", [](json& j) { j["attn_cfg"].erase("num_heads"); }, "attn_cfg.num_heads=0"},
  };
  for (const auto& rule : rules) {
    json j = valid();
    rule.breaks(j);
    const std::string message = error_of(j);
    EXPECT_NE(message.find(rule.message), std::string::npos)
        << rule.name << ": got \"" << message << "\"";
    EXPECT_EQ(message.rfind("cfg.json: ", 0), 0u) << rule.name << ": " << message;
  }
}

// Integers are range-checked at 64 bits: 2^40 used to be cut to 0 and reported as
// "d_model=0", and 2^32 + 1 in attn_layer_idx became layer 1 without a word.
TEST(ModelConfig, WideIntegersAreRefusedWithTheirValue) {
  const std::vector<Rule> rules = {
      {"d_model 2^40", [](json& j) { j["d_model"] = int64_t{1} << 40; },
       "d_model=1099511627776 must be at most 1048576"},
      {"d_model 2^64-1", [](json& j) { j["d_model"] = std::numeric_limits<uint64_t>::max(); },
       "d_model=18446744073709551615 must be at most"},
      {"d_model -2^40", [](json& j) { j["d_model"] = -(int64_t{1} << 40); },
       "d_model=-1099511627776"},
      {"n_layer", [](json& j) { j["n_layer"] = int64_t{1} << 32; }, "n_layer=4294967296"},
      {"vocab", [](json& j) { j["vocab_size"] = (int64_t{1} << 32) + 100; },
       "vocab_size=4294967396 must be at most 67108864"},
      {"headdim", [](json& j) { j["ssm_cfg"]["headdim"] = (int64_t{1} << 32) + 32; },
       "ssm_cfg.headdim=4294967328"},
      {"chunk", [](json& j) { j["ssm_cfg"]["chunk_size"] = int64_t{1} << 31; },
       "ssm_cfg.chunk_size=2147483648 must be at most 4096"},
      {"heads", [](json& j) { j["attn_cfg"]["num_heads"] = (int64_t{1} << 32) + 4; },
       "attn_cfg.num_heads=4294967300"},
      {"attn idx", [](json& j) { j["attn_layer_idx"] = {(int64_t{1} << 32) + 3}; },
       "attn_layer_idx=4294967299"},
      {"attn idx float", [](json& j) { j["attn_layer_idx"] = {3.5}; }, "attn_layer_idx"},
      {"expand bound", [](json& j) { j["ssm_cfg"]["expand"] = 17; },
       "ssm_cfg.expand=17 must be at most 16"},
      {"rank bound", [](json& j) { j["ssm_cfg"]["mimo_rank"] = 1000; },
       "ssm_cfg.mimo_rank=1000 must be at most 256"},
  };
  for (const auto& rule : rules) {
    json j = valid();
    rule.breaks(j);
    const std::string message = error_of(j);
    EXPECT_NE(message.find(rule.message), std::string::npos)
        << rule.name << ": got \"" << message << "\"";
  }
}

// NaN passes every `x < bound` test, and softmax_scale = NaN used to fall back to
// 1/sqrt(head_dim) silently; infinities passed the `> 0` rules.
TEST(ModelConfig, NonFiniteRealsAreRefused) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<Rule> rules = {
      {"softmax nan", [&](json& j) { j["attn_cfg"]["softmax_scale"] = nan; },
       "attn_cfg.softmax_scale=nan must be a finite number"},
      {"dt_max inf", [&](json& j) { j["ssm_cfg"]["dt_max"] = inf; },
       "ssm_cfg.dt_max=inf must be a finite number"},
      {"A_floor inf", [&](json& j) { j["ssm_cfg"]["A_floor"] = inf; }, "ssm_cfg.A_floor=inf"},
      {"dt_init_floor", [&](json& j) { j["ssm_cfg"]["dt_init_floor"] = inf; },
       "ssm_cfg.dt_init_floor=inf"},
      {"eps", [&](json& j) { j["norm_epsilon"] = inf; }, "norm_epsilon=inf"},
      {"base", [&](json& j) { j["attn_cfg"]["rotary_emb_base"] = -inf; },
       "attn_cfg.rotary_emb_base=-inf"},
  };
  for (const auto& rule : rules) {
    json j = valid();
    rule.breaks(j);
    const std::string message = error_of(j);
    EXPECT_NE(message.find(rule.message), std::string::npos)
        << rule.name << ": got \"" << message << "\"";
  }
  // Configs built in code (or read back from a checkpoint) meet the same limits.
  ModelConfig c = parse_model_config(valid(), "cfg.json");
  c.d_model = ModelConfigLimits::kMaxDModel + 64;
  EXPECT_THROW(validate_model_config(c, "code"), Error);
  c = parse_model_config(valid(), "cfg.json");
  c.attn.softmax_scale = nan;
  EXPECT_THROW(validate_model_config(c, "code"), Error);
}

TEST(ModelConfig, PresetsAreValidAndUnknownPresetsNamed) {
  const ModelConfig tiny = model_preset("tiny");
  EXPECT_EQ(tiny.pattern(), "MM*M");
  try {
    model_preset("huge");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown model preset \"huge\""), std::string::npos);
  }
}

}  // namespace
}  // namespace megacpp
