#pragma once
// The model configuration: the keys of mamba_ssm's MambaConfig (config.json of a
// checkpoint) plus the "pattern" shorthand. See shared/spec/model.md.
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace megacpp {

// How the CPU runtime evaluates the Mamba-3 scan: chunked (the GPU's form, the default) or
// recurrent (the definition, token by token). Both compute the same function.
enum class ScanForm { kChunked, kRecurrent };

struct SsmConfig {
  int d_state = 128;  // N
  int expand = 2;
  int headdim = 64;  // P
  int ngroups = 1;   // G
  double rope_fraction = 0.5;
  double dt_min = 0.001;
  double dt_max = 0.1;
  double dt_init_floor = 1e-4;
  double A_floor = 1e-4;
  bool is_mimo = true;
  int mimo_rank = 4;    // R
  int chunk_size = 16;  // C
};

struct AttnConfig {
  int num_heads = 0;     // Hq
  int num_heads_kv = 0;  // Hkv (0 = Hq)
  int head_dim = 0;      // 0 = d_model / Hq
  bool qkv_proj_bias = true;
  bool out_proj_bias = true;
  int rotary_emb_dim = 0;
  double rotary_emb_base = 10000.0;
  bool rotary_emb_interleaved = false;
  double softmax_scale = 0.0;  // 0 = 1/sqrt(head_dim)
  bool causal = true;
};

struct ModelConfig {
  int d_model = 0;
  int n_layer = 0;
  int d_intermediate = 0;
  int vocab_size = 0;
  int pad_vocab_size_multiple = 8;
  SsmConfig ssm;
  std::vector<int> attn_layer_idx;
  AttnConfig attn;
  bool rms_norm = true;
  double norm_epsilon = 1e-5;
  bool residual_in_fp32 = true;
  bool tie_embeddings = true;

  // Derived sizes (valid after validation).
  int d_inner() const { return ssm.expand * d_model; }
  int ssm_heads() const { return d_inner() / ssm.headdim; }
  int rope_angles() const;  // A_n
  int padded_vocab() const;
  int mlp_hidden() const { return (d_intermediate + 127) / 128 * 128; }
  bool is_attention_layer(int layer) const;
  int attn_head_dim() const;
  int attn_kv_heads() const { return attn.num_heads_kv > 0 ? attn.num_heads_kv : attn.num_heads; }
  double attn_softmax_scale() const;
  std::string pattern() const;  // "MM*M"
};

// The largest value each integer field may take. Far beyond any model this runtime
// trains, and small enough that every derived size (d_inner, the projections' widths,
// the padded vocabulary) stays within the int the kernels index with.
struct ModelConfigLimits {
  static constexpr int kMaxDModel = 1 << 20;
  static constexpr int kMaxLayers = 1 << 12;
  static constexpr int kMaxIntermediate = 1 << 22;
  static constexpr int kMaxVocab = 1 << 26;
  static constexpr int kMaxPadMultiple = 1 << 16;
  static constexpr int kMaxState = 1 << 12;
  static constexpr int kMaxExpand = 16;
  static constexpr int kMaxHeadDim = 1 << 12;
  static constexpr int kMaxGroups = 1 << 12;
  static constexpr int kMaxMimoRank = 256;
  static constexpr int kMaxChunk = 1 << 12;
  static constexpr int kMaxHeads = 1 << 12;
};

// Parses and validates. Unknown keys are refused (a typo must not silently fall
// back to a default); `source` names the file or object in error messages.
ModelConfig parse_model_config(const nlohmann::json& json, const std::string& source);
ModelConfig load_model_config(const std::filesystem::path& path);
// Checks every rule of the spec; throws Error(kInvalidArgument) naming the field
// and the rule, before anything is allocated.
void validate_model_config(const ModelConfig& config, const std::string& source);
nlohmann::json model_config_to_json(const ModelConfig& config);
// Named presets ("tiny", ...), or throws naming the known ones.
ModelConfig model_preset(const std::string& name);

}  // namespace megacpp
