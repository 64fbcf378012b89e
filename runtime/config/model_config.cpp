#include "runtime/config/model_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <set>

#include "base/error.h"

namespace megacpp {

int ModelConfig::rope_angles() const {
  int n = static_cast<int>(ssm.rope_fraction * ssm.d_state);
  n -= n % 2;
  return n / 2;
}

int ModelConfig::padded_vocab() const {
  const int m = pad_vocab_size_multiple;
  return (vocab_size + m - 1) / m * m;
}

bool ModelConfig::is_attention_layer(int layer) const {
  return std::find(attn_layer_idx.begin(), attn_layer_idx.end(), layer) != attn_layer_idx.end();
}

int ModelConfig::attn_head_dim() const {
  if (attn.head_dim > 0) return attn.head_dim;
  return attn.num_heads > 0 ? d_model / attn.num_heads : 0;
}

double ModelConfig::attn_softmax_scale() const {
  return attn.softmax_scale > 0 ? attn.softmax_scale
                                : 1.0 / std::sqrt(static_cast<double>(attn_head_dim()));
}

std::string ModelConfig::pattern() const {
  std::string p;
  for (int i = 0; i < n_layer; ++i) p += is_attention_layer(i) ? '*' : 'M';
  return p;
}

namespace {

using nlohmann::json;

// Reads the keys of one JSON object, refusing unknown ones and wrong types.
class ObjectReader {
 public:
  ObjectReader(const json& object, std::string prefix, const std::string& source)
      : object_(object), prefix_(std::move(prefix)), source_(source) {
    if (!object.is_object()) {
      fail(ErrorKind::kInvalidArgument, "{}: {} must be a JSON object", source_,
           prefix_.empty() ? "the model config" : prefix_);
    }
  }
  // Integers are read at 64 bits and checked before narrowing: narrowing first turns
  // 2^40 into 0 and reports the wrong value, or none at all.
  void read(const char* key, int& target, int max) {
    const json* value = find(key);
    if (value == nullptr) return;
    target = narrow(key, *value, max);
  }
  void read(const char* key, std::vector<int>& target, int max) {
    const json* value = find(key);
    if (value == nullptr) return;
    if (!value->is_array()) wrong_type(key, *value, "not an array of integers");
    std::vector<int> values;
    for (const json& element : *value) values.push_back(narrow(key, element, max));
    target = std::move(values);
  }
  // Non-finite values are refused here: a NaN passes every `x < bound` test and then
  // silently falls back to a default (softmax_scale) while the spec records the NaN.
  void read(const char* key, double& target) {
    const json* value = find(key);
    if (value == nullptr) return;
    if (!value->is_number()) wrong_type(key, *value, "not a number");
    const double number = value->get<double>();
    if (!std::isfinite(number)) {
      fail(ErrorKind::kInvalidArgument, "{}: {}{}={} must be a finite number", source_, prefix_,
           key, number);
    }
    target = number;
  }
  void read(const char* key, bool& target) {
    const json* value = find(key);
    if (value == nullptr) return;
    if (!value->is_boolean()) wrong_type(key, *value, "not true/false");
    target = value->get<bool>();
  }
  void read(const char* key, std::string& target) {
    const json* value = find(key);
    if (value == nullptr) return;
    if (!value->is_string()) wrong_type(key, *value, "not a string");
    target = value->get<std::string>();
  }
  void ignore(const char* key) { seen_.insert(key); }
  void refuse_unknown() const {
    for (const auto& [key, value] : object_.items()) {
      if (!seen_.count(key)) {
        fail(ErrorKind::kInvalidArgument, "{}: unknown key {}{}", source_, prefix_, key);
      }
    }
  }

 private:
  const json* find(const char* key) {
    seen_.insert(key);
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  [[noreturn]] void wrong_type(const char* key, const json& value, const char* why) const {
    fail(ErrorKind::kInvalidArgument, "{}: {}{} has the wrong type ({}): {}", source_, prefix_, key,
         why, value.dump());
  }
  int narrow(const char* key, const json& value, int max) const {
    if (!value.is_number_integer()) wrong_type(key, value, "not an integer");
    if (value.is_number_unsigned()) {
      const auto number = value.get<std::uint64_t>();
      if (number > static_cast<std::uint64_t>(max)) too_large(key, number, max);
      return static_cast<int>(number);
    }
    const auto number = value.get<std::int64_t>();
    if (number > max) too_large(key, number, max);
    if (number < std::numeric_limits<int>::min()) {
      fail(ErrorKind::kInvalidArgument, "{}: {}{}={} is below the 32-bit range", source_, prefix_,
           key, number);
    }
    return static_cast<int>(number);
  }
  template <typename N>
  [[noreturn]] void too_large(const char* key, N value, int max) const {
    fail(ErrorKind::kInvalidArgument, "{}: {}{}={} must be at most {}", source_, prefix_, key,
         value, max);
  }

  const json& object_;
  std::string prefix_;
  const std::string& source_;
  std::set<std::string> seen_;
};

}  // namespace

ModelConfig parse_model_config(const json& j, const std::string& source) {
  ModelConfig c;
  ObjectReader top(j, "", source);
  top.read("d_model", c.d_model, ModelConfigLimits::kMaxDModel);
  top.read("n_layer", c.n_layer, ModelConfigLimits::kMaxLayers);
  top.read("d_intermediate", c.d_intermediate, ModelConfigLimits::kMaxIntermediate);
  top.read("vocab_size", c.vocab_size, ModelConfigLimits::kMaxVocab);
  top.read("pad_vocab_size_multiple", c.pad_vocab_size_multiple,
           ModelConfigLimits::kMaxPadMultiple);
  top.read("attn_layer_idx", c.attn_layer_idx, ModelConfigLimits::kMaxLayers);
  top.read("rms_norm", c.rms_norm);
  top.read("norm_epsilon", c.norm_epsilon);
  top.read("residual_in_fp32", c.residual_in_fp32);
  top.read("tie_embeddings", c.tie_embeddings);
  top.ignore("fused_add_norm");  // a kernel choice in mamba_ssm, not a semantic one
  std::string pattern;
  top.read("pattern", pattern);
  if (j.contains("ssm_cfg") && !j["ssm_cfg"].is_null()) {
    ObjectReader s(j["ssm_cfg"], "ssm_cfg.", source);
    std::string layer = "Mamba3";
    s.read("layer", layer);
    if (layer != "Mamba3") {
      fail(ErrorKind::kInvalidArgument,
           "{}: ssm_cfg.layer=\"{}\" is not supported: must be \"Mamba3\"", source, layer);
    }
    s.read("d_state", c.ssm.d_state, ModelConfigLimits::kMaxState);
    s.read("expand", c.ssm.expand, ModelConfigLimits::kMaxExpand);
    s.read("headdim", c.ssm.headdim, ModelConfigLimits::kMaxHeadDim);
    s.read("ngroups", c.ssm.ngroups, ModelConfigLimits::kMaxGroups);
    s.read("rope_fraction", c.ssm.rope_fraction);
    s.read("dt_min", c.ssm.dt_min);
    s.read("dt_max", c.ssm.dt_max);
    s.read("dt_init_floor", c.ssm.dt_init_floor);
    s.read("A_floor", c.ssm.A_floor);
    s.read("is_mimo", c.ssm.is_mimo);
    s.read("mimo_rank", c.ssm.mimo_rank, ModelConfigLimits::kMaxMimoRank);
    s.read("chunk_size", c.ssm.chunk_size, ModelConfigLimits::kMaxChunk);
    s.refuse_unknown();
  }
  top.ignore("ssm_cfg");
  if (j.contains("attn_cfg") && !j["attn_cfg"].is_null()) {
    ObjectReader a(j["attn_cfg"], "attn_cfg.", source);
    a.read("num_heads", c.attn.num_heads, ModelConfigLimits::kMaxHeads);
    a.read("num_heads_kv", c.attn.num_heads_kv, ModelConfigLimits::kMaxHeads);
    a.read("head_dim", c.attn.head_dim, ModelConfigLimits::kMaxHeadDim);
    a.read("qkv_proj_bias", c.attn.qkv_proj_bias);
    a.read("out_proj_bias", c.attn.out_proj_bias);
    a.read("rotary_emb_dim", c.attn.rotary_emb_dim, ModelConfigLimits::kMaxHeadDim);
    a.read("rotary_emb_base", c.attn.rotary_emb_base);
    a.read("rotary_emb_interleaved", c.attn.rotary_emb_interleaved);
    a.read("softmax_scale", c.attn.softmax_scale);
    a.read("causal", c.attn.causal);
    a.refuse_unknown();
  }
  top.ignore("attn_cfg");
  top.refuse_unknown();

  if (!pattern.empty()) {
    if (pattern.size() > static_cast<size_t>(ModelConfigLimits::kMaxLayers)) {
      fail(ErrorKind::kInvalidArgument, "{}: pattern has {} layers, more than the limit of {}",
           source, pattern.size(), ModelConfigLimits::kMaxLayers);
    }
    std::vector<int> from_pattern;
    for (size_t i = 0; i < pattern.size(); ++i) {
      if (pattern[i] == '*') {
        from_pattern.push_back(static_cast<int>(i));
      } else if (pattern[i] != 'M') {
        fail(ErrorKind::kInvalidArgument,
             "{}: pattern=\"{}\" has '{}' at position {}: only 'M' (Mamba-3) and '*' (attention) "
             "are allowed",
             source, pattern, pattern[i], i);
      }
    }
    const int layers = static_cast<int>(pattern.size());
    if (j.contains("n_layer") && c.n_layer != layers) {
      fail(ErrorKind::kInvalidArgument,
           "{}: pattern=\"{}\" has {} layers but n_layer={}: they must agree", source, pattern,
           layers, c.n_layer);
    }
    if (j.contains("attn_layer_idx") && c.attn_layer_idx != from_pattern) {
      fail(ErrorKind::kInvalidArgument,
           "{}: pattern=\"{}\" puts attention at [{}] but attn_layer_idx=[{}]: they must agree",
           source, pattern, fmt::join(from_pattern, ", "), fmt::join(c.attn_layer_idx, ", "));
    }
    c.n_layer = layers;
    c.attn_layer_idx = from_pattern;
  }
  validate_model_config(c, source);
  return c;
}

void validate_model_config(const ModelConfig& c, const std::string& source) {
  auto refuse = [&]<typename... Args>(fmt::format_string<Args...> rule, Args&&... args) {
    fail(ErrorKind::kInvalidArgument, "{}: {}", source,
         fmt::format(rule, std::forward<Args>(args)...));
  };
  // Configs built in code or read from a checkpoint get the same limits as parsed ones.
  using L = ModelConfigLimits;
  auto at_most = [&](const char* field, int value, int max) {
    if (value > max) refuse("{}={} must be at most {}", field, value, max);
  };
  at_most("d_model", c.d_model, L::kMaxDModel);
  at_most("n_layer", c.n_layer, L::kMaxLayers);
  at_most("d_intermediate", c.d_intermediate, L::kMaxIntermediate);
  at_most("vocab_size", c.vocab_size, L::kMaxVocab);
  at_most("pad_vocab_size_multiple", c.pad_vocab_size_multiple, L::kMaxPadMultiple);
  at_most("ssm_cfg.d_state", c.ssm.d_state, L::kMaxState);
  at_most("ssm_cfg.expand", c.ssm.expand, L::kMaxExpand);
  at_most("ssm_cfg.headdim", c.ssm.headdim, L::kMaxHeadDim);
  at_most("ssm_cfg.ngroups", c.ssm.ngroups, L::kMaxGroups);
  at_most("ssm_cfg.mimo_rank", c.ssm.mimo_rank, L::kMaxMimoRank);
  at_most("ssm_cfg.chunk_size", c.ssm.chunk_size, L::kMaxChunk);
  at_most("attn_cfg.num_heads", c.attn.num_heads, L::kMaxHeads);
  at_most("attn_cfg.num_heads_kv", c.attn.num_heads_kv, L::kMaxHeads);
  at_most("attn_cfg.head_dim", c.attn.head_dim, L::kMaxHeadDim);
  // A NaN fails no `x < bound` test, and some fields fall back to a default when they
  // fail `x > 0` (softmax_scale): non-finite values are refused outright.
  const std::pair<const char*, double> reals[] = {
      {"norm_epsilon", c.norm_epsilon},
      {"ssm_cfg.rope_fraction", c.ssm.rope_fraction},
      {"ssm_cfg.dt_min", c.ssm.dt_min},
      {"ssm_cfg.dt_max", c.ssm.dt_max},
      {"ssm_cfg.dt_init_floor", c.ssm.dt_init_floor},
      {"ssm_cfg.A_floor", c.ssm.A_floor},
      {"attn_cfg.rotary_emb_base", c.attn.rotary_emb_base},
      {"attn_cfg.softmax_scale", c.attn.softmax_scale}};
  for (const auto& [field, value] : reals) {
    if (!std::isfinite(value)) refuse("{}={} must be a finite number", field, value);
  }
  if (c.d_model <= 0) refuse("d_model={} must be positive", c.d_model);
  if (c.n_layer <= 0) refuse("n_layer={} must be positive", c.n_layer);
  if (c.vocab_size <= 0) refuse("vocab_size={} must be positive", c.vocab_size);
  if (c.pad_vocab_size_multiple <= 0) {
    refuse("pad_vocab_size_multiple={} must be positive", c.pad_vocab_size_multiple);
  }
  if (c.d_intermediate < 0) refuse("d_intermediate={} must be >= 0", c.d_intermediate);
  if (!c.rms_norm) refuse("rms_norm=false is not supported: the model uses RMSNorm everywhere");
  if (!(c.norm_epsilon > 0)) refuse("norm_epsilon={} must be positive", c.norm_epsilon);
  std::set<int> seen;
  for (int idx : c.attn_layer_idx) {
    if (idx < 0 || idx >= c.n_layer) {
      refuse("attn_layer_idx contains {}, outside [0, n_layer={})", idx, c.n_layer);
    }
    if (!seen.insert(idx).second) refuse("attn_layer_idx lists layer {} twice", idx);
  }
  const SsmConfig& s = c.ssm;
  const bool has_mamba = static_cast<int>(c.attn_layer_idx.size()) < c.n_layer;
  if (has_mamba) {
    if (s.d_state <= 0) refuse("ssm_cfg.d_state={} must be positive", s.d_state);
    if (s.expand <= 0) refuse("ssm_cfg.expand={} must be positive", s.expand);
    if (s.headdim <= 0) refuse("ssm_cfg.headdim={} must be positive", s.headdim);
    if (c.d_inner() % s.headdim != 0) {
      refuse("ssm_cfg.headdim={} does not divide d_inner={} (expand·d_model)", s.headdim,
             c.d_inner());
    }
    if (s.ngroups <= 0 || c.ssm_heads() % s.ngroups != 0) {
      refuse("ssm_cfg.ngroups={} does not divide the number of heads H={}", s.ngroups,
             c.ssm_heads());
    }
    if (s.rope_fraction != 0.5 && s.rope_fraction != 1.0) {
      refuse("ssm_cfg.rope_fraction={} must be 0.5 or 1.0", s.rope_fraction);
    }
    if (s.rope_fraction == 0.5 && s.d_state % 4 != 0) {
      refuse("ssm_cfg.d_state={} must be a multiple of 4 with rope_fraction=0.5", s.d_state);
    }
    if (s.d_state % 2 != 0) refuse("ssm_cfg.d_state={} must be even", s.d_state);
    if (!s.is_mimo) refuse("ssm_cfg.is_mimo=false is not supported: use mimo_rank=1 for SISO");
    if (s.mimo_rank <= 0) refuse("ssm_cfg.mimo_rank={} must be positive", s.mimo_rank);
    if (s.chunk_size <= 0) refuse("ssm_cfg.chunk_size={} must be positive", s.chunk_size);
    if (!(s.dt_min > 0 && s.dt_max >= s.dt_min)) {
      refuse("ssm_cfg.dt_min={} and dt_max={} must satisfy 0 < dt_min <= dt_max", s.dt_min,
             s.dt_max);
    }
    if (!(s.dt_init_floor > 0))
      refuse("ssm_cfg.dt_init_floor={} must be positive", s.dt_init_floor);
    if (!(s.A_floor > 0)) refuse("ssm_cfg.A_floor={} must be positive", s.A_floor);
  }
  if (!c.attn_layer_idx.empty()) {
    const AttnConfig& a = c.attn;
    if (a.num_heads <= 0) refuse("attn_cfg.num_heads={} must be positive", a.num_heads);
    if (a.num_heads_kv < 0) refuse("attn_cfg.num_heads_kv={} must be >= 0", a.num_heads_kv);
    if (a.num_heads % c.attn_kv_heads() != 0) {
      refuse("attn_cfg.num_heads_kv={} does not divide num_heads={}", c.attn_kv_heads(),
             a.num_heads);
    }
    if (a.head_dim == 0 && c.d_model % a.num_heads != 0) {
      refuse("attn_cfg.num_heads={} does not divide d_model={} (set head_dim explicitly)",
             a.num_heads, c.d_model);
    }
    if (c.attn_head_dim() <= 0) refuse("attn_cfg.head_dim={} must be positive", a.head_dim);
    if (a.rotary_emb_dim < 0 || a.rotary_emb_dim % 2 != 0 || a.rotary_emb_dim > c.attn_head_dim()) {
      refuse("attn_cfg.rotary_emb_dim={} must be even and in [0, head_dim={}]", a.rotary_emb_dim,
             c.attn_head_dim());
    }
    if (a.rotary_emb_interleaved) {
      refuse("attn_cfg.rotary_emb_interleaved=true is not supported: only false is implemented");
    }
    if (!(a.rotary_emb_base > 0))
      refuse("attn_cfg.rotary_emb_base={} must be positive", a.rotary_emb_base);
    if (a.softmax_scale < 0) refuse("attn_cfg.softmax_scale={} must be positive", a.softmax_scale);
    if (!a.causal) refuse("attn_cfg.causal=false is not supported: attention must be causal");
  }
}

ModelConfig load_model_config(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) fail(ErrorKind::kNotFound, "{}: cannot open model config", path.string());
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    fail(ErrorKind::kInvalidArgument, "{}: invalid JSON at byte {}: {}", path.string(), e.byte,
         e.what());
  } catch (const json::exception& e) {
    // A number beyond the double range (1e400) is out_of_range, not a parse_error.
    fail(ErrorKind::kInvalidArgument, "{}: invalid JSON: {}", path.string(), e.what());
  }
  return parse_model_config(j, path.string());
}

json model_config_to_json(const ModelConfig& c) {
  json ssm = {{"layer", "Mamba3"},
              {"d_state", c.ssm.d_state},
              {"expand", c.ssm.expand},
              {"headdim", c.ssm.headdim},
              {"ngroups", c.ssm.ngroups},
              {"rope_fraction", c.ssm.rope_fraction},
              {"dt_min", c.ssm.dt_min},
              {"dt_max", c.ssm.dt_max},
              {"dt_init_floor", c.ssm.dt_init_floor},
              {"A_floor", c.ssm.A_floor},
              {"is_mimo", c.ssm.is_mimo},
              {"mimo_rank", c.ssm.mimo_rank},
              {"chunk_size", c.ssm.chunk_size}};
  json attn = {{"num_heads", c.attn.num_heads},
               {"num_heads_kv", c.attn_kv_heads()},
               {"head_dim", c.attn_head_dim()},
               {"qkv_proj_bias", c.attn.qkv_proj_bias},
               {"out_proj_bias", c.attn.out_proj_bias},
               {"rotary_emb_dim", c.attn.rotary_emb_dim},
               {"rotary_emb_base", c.attn.rotary_emb_base},
               {"rotary_emb_interleaved", c.attn.rotary_emb_interleaved},
               {"causal", c.attn.causal}};
  if (c.attn.softmax_scale > 0) attn["softmax_scale"] = c.attn.softmax_scale;
  return {{"d_model", c.d_model},
          {"n_layer", c.n_layer},
          {"d_intermediate", c.d_intermediate},
          {"vocab_size", c.vocab_size},
          {"pad_vocab_size_multiple", c.pad_vocab_size_multiple},
          {"ssm_cfg", ssm},
          {"attn_layer_idx", c.attn_layer_idx},
          {"attn_cfg", c.attn_layer_idx.empty() ? json::object() : attn},
          {"rms_norm", c.rms_norm},
          {"norm_epsilon", c.norm_epsilon},
          {"residual_in_fp32", c.residual_in_fp32},
          {"fused_add_norm", true},
          {"tie_embeddings", c.tie_embeddings}};
}

ModelConfig model_preset(const std::string& name) {
  if (name == "tiny") {
    // About 2M parameters: three Mamba-3 layers and one attention layer, each with
    // an MLP, over the 257-token byte vocabulary. Sized to train on 2 CPU cores.
    return parse_model_config(
        json{{"d_model", 192},
             {"pattern", "MM*M"},
             {"d_intermediate", 384},
             {"vocab_size", 257},
             {"ssm_cfg", {{"d_state", 32}, {"headdim", 48}, {"mimo_rank", 4}, {"chunk_size", 16}}},
             {"attn_cfg", {{"num_heads", 4}, {"num_heads_kv", 2}, {"rotary_emb_dim", 48}}},
             {"tie_embeddings", true}},
        "preset tiny");
  }
  if (name == "bench-350m") {
    // shared/bench/anchors.md's whole-step benchmark: 24 layers, (MMM*)×6, 16 q / 4 kv heads.
    return parse_model_config(
        json{{"d_model", 1024},
             {"pattern", "MMM*MMM*MMM*MMM*MMM*MMM*"},
             {"d_intermediate", 2816},
             {"vocab_size", 32000},
             {"ssm_cfg", {{"d_state", 64}, {"headdim", 64}, {"mimo_rank", 4}, {"chunk_size", 16}}},
             {"attn_cfg", {{"num_heads", 16}, {"num_heads_kv", 4}, {"rotary_emb_dim", 64}}},
             {"tie_embeddings", true}},
        "preset bench-350m");
  }
  if (name == "bench-1.3b") {
    // shared/bench/anchors.md's tensor-parallel benchmark: bench-350m at twice the width, 64
    // Mamba-3 heads, 32 q / 8 kv heads of 64.
    return parse_model_config(
        json{{"d_model", 2048},
             {"pattern", "MMM*MMM*MMM*MMM*MMM*MMM*"},
             {"d_intermediate", 5632},
             {"vocab_size", 32000},
             {"ssm_cfg", {{"d_state", 64}, {"headdim", 64}, {"mimo_rank", 4}, {"chunk_size", 16}}},
             {"attn_cfg", {{"num_heads", 32}, {"num_heads_kv", 8}, {"rotary_emb_dim", 64}}},
             {"tie_embeddings", true}},
        "preset bench-1.3b");
  }
  fail(ErrorKind::kInvalidArgument,
       "unknown model preset \"{}\": known presets are: tiny, bench-350m, bench-1.3b", name);
}

}  // namespace megacpp
