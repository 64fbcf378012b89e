// The tensor-parallel shard plan: it names exactly the model's parameters, its shards tile every
// tensor, the Mamba-3 in_proj, MHA and MLP splits follow the spec, illegal geometries are
// refused naming the rule, and tp=1 keeps everything whole.
#include "runtime/parallel/shard_plan.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "base/error.h"
#include "kernels/contracts/mamba3_preprocess.h"
#include "runtime/model/model.h"
#include "tests/support/expect_error.h"

namespace megacpp::parallel {
namespace {

using nlohmann::json;

// Three layers (Mamba-3, MHA, Mamba-3) with an MLP: H = 8 heads of P = 8, N = 8, R = 2,
// GQA with Hq = 4, Hkv = 2, MLP hidden 128. Each test varies what it needs.
json base_config() {
  return json{
      {"d_model", 32},
      {"pattern", "M*M"},
      {"d_intermediate", 40},
      {"vocab_size", 37},
      {"tie_embeddings", true},
      {"ssm_cfg",
       {{"d_state", 8}, {"headdim", 8}, {"ngroups", 1}, {"mimo_rank", 2}, {"chunk_size", 4}}},
      {"attn_cfg", {{"num_heads", 4}, {"num_heads_kv", 2}, {"rotary_emb_dim", 4}}}};
}

ModelConfig config_of(const json& j) {
  return parse_model_config(j, "test config");
}

struct Case {
  std::string label;
  json config;
  int tp;
};

// Both layer kinds, MLP and none, GQA and MHA, tied and untied, biases on and off, G = 1 < tp,
// G = tp, tp < G with G % tp == 0, and 1 < G < tp with G % tp != 0.
std::vector<Case> cases() {
  std::vector<Case> out;
  for (int tp : {1, 2}) out.push_back({"G=1", base_config(), tp});
  json untied = base_config();
  untied["tie_embeddings"] = false;
  untied["ssm_cfg"]["ngroups"] = 2;
  out.push_back({"untied, G=tp=2", untied, 2});
  json wide = base_config();
  wide["d_intermediate"] = 0;
  wide["ssm_cfg"]["ngroups"] = 4;
  wide["ssm_cfg"]["rope_fraction"] = 1.0;
  wide["attn_cfg"] = {{"num_heads", 4}, {"qkv_proj_bias", false}, {"out_proj_bias", false}};
  out.push_back({"no MLP, MHA without biases, G=4 tp=2", wide, 2});
  json four = base_config();
  four["pattern"] = "*MM*";
  four["ssm_cfg"]["ngroups"] = 2;
  four["attn_cfg"] = {{"num_heads", 8}, {"num_heads_kv", 4}};
  out.push_back({"G=2 tp=4", four, 4});
  json attention_only = base_config();
  attention_only["pattern"] = "**";
  out.push_back({"attention only", attention_only, 2});
  json mamba_only = base_config();
  mamba_only["pattern"] = "MM";
  mamba_only["d_intermediate"] = 0;
  out.push_back({"Mamba-3 only, G=1 tp=8", mamba_only, 8});
  return out;
}

std::string error_of(const json& j, int tp, int devices) {
  try {
    ShardPlan(config_of(j), ParallelConfig{.tensor_parallel = tp, .device_count = devices});
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    return e.what();
  }
  return "";
}

TEST(ShardPlan, EveryParameterOfTheModelHasExactlyOneSplit) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.label + ", tp=" + std::to_string(c.tp));
    const ModelConfig config = config_of(c.config);
    const ShardPlan plan(config, {c.tp, c.tp});
    const Model<float> model(config);
    const auto& entries = model.parameters().entries();
    ASSERT_EQ(plan.parameters().size(), entries.size());
    std::set<std::string> names;
    for (size_t i = 0; i < entries.size(); ++i) {
      const ParameterPlan& p = plan.parameters()[i];
      EXPECT_EQ(p.name, entries[i].name);
      EXPECT_EQ(p.shape, entries[i].shape) << p.name;
      EXPECT_TRUE(names.insert(p.name).second) << p.name << " planned twice";
      EXPECT_EQ(&plan.at(p.name), &p);
      EXPECT_EQ(p.dim, p.split == Split::kRow ? 1 : 0) << p.name;
      ASSERT_EQ(p.shards.size(), static_cast<size_t>(c.tp)) << p.name;
    }
    EXPECT_EQ(plan.find("backbone.layers.99.norm.weight"), nullptr);
    EXPECT_THROW(plan.at("backbone.layers.99.norm.weight"), Error);
  }
}

TEST(ShardPlan, ShardsTileEveryParameterExactly) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.label + ", tp=" + std::to_string(c.tp));
    const ShardPlan plan(config_of(c.config), {c.tp, 2 * c.tp});
    for (const ParameterPlan& p : plan.parameters()) {
      SCOPED_TRACE(p.name);
      const auto dim = static_cast<size_t>(p.dim);
      const int64_t extent = p.shape[dim];
      std::vector<int> owned(static_cast<size_t>(extent), 0), copies(owned);
      int64_t split_numel = 0;
      for (int r = 0; r < c.tp; ++r) {
        const ParameterShard& s = p.shard(r);
        // The pieces tile the local dim in order; the other dims are whole.
        int64_t local = 0;
        for (const ShardPiece& piece : s.pieces) {
          EXPECT_EQ(piece.local_begin, local) << piece.segment;
          EXPECT_GT(piece.length, 0) << piece.segment;
          ASSERT_GE(piece.global_begin, 0);
          ASSERT_LE(piece.global_begin + piece.length, extent) << piece.segment;
          local += piece.length;
          auto& count = piece.replicated ? copies : owned;
          for (int64_t i = 0; i < piece.length; ++i)
            ++count[static_cast<size_t>(piece.global_begin + i)];
          if (!piece.replicated) split_numel += piece.length * p.outer() * p.inner();
          // Only a replicated piece needs its gradient summed over TP, and in a replicated
          // parameter only when the spec says so.
          if (!piece.replicated) {
            EXPECT_EQ(piece.gradient, TpGradient::kComplete);
          }
          if (p.split == Split::kReplicated) {
            EXPECT_EQ(piece.gradient, TpGradient::kComplete);
          }
          if (p.split == Split::kReplicatedSummed || p.split == Split::kColumn) {
            EXPECT_EQ(piece.gradient,
                      piece.replicated ? TpGradient::kSumOverTp : TpGradient::kComplete);
          }
        }
        std::vector<int64_t> expected = p.shape;
        expected[dim] = local;
        EXPECT_EQ(s.shape, expected);
        if (p.split == Split::kReplicated || p.split == Split::kReplicatedSummed) {
          EXPECT_EQ(s.shape, p.shape);
          ASSERT_EQ(s.pieces.size(), 1u);
          EXPECT_TRUE(s.pieces[0].replicated);
        }
        if (p.split == Split::kRow) {
          for (const ShardPiece& piece : s.pieces) EXPECT_FALSE(piece.replicated);
        }
      }
      // Every index is held by exactly one rank, or by every rank as a replicated piece.
      for (int64_t i = 0; i < extent; ++i) {
        const auto k = static_cast<size_t>(i);
        EXPECT_TRUE((owned[k] == 1 && copies[k] == 0) || (owned[k] == 0 && copies[k] == c.tp))
            << "index " << i << ": held by " << owned[k] << " rank(s) and replicated on "
            << copies[k];
      }
      if (p.split == Split::kRow || p.split == Split::kColumn) {
        int64_t replicated_numel = 0;
        for (const ShardPiece& piece : p.shard(0).pieces) {
          if (piece.replicated) replicated_numel += piece.length * p.outer() * p.inner();
        }
        EXPECT_EQ(split_numel + replicated_numel, p.numel());
      }
      // The shards put back together give the tensor back.
      std::vector<double> global(static_cast<size_t>(p.numel()));
      std::iota(global.begin(), global.end(), 1.0);
      std::vector<double> rebuilt(global.size(), std::nan(""));
      for (int r = 0; r < c.tp; ++r) {
        std::vector<double> local(static_cast<size_t>(p.shard(r).numel()), -1.0);
        extract_shard(p, r, global.data(), local.data());
        for (double v : local) ASSERT_GE(v, 1.0);  // every local element was written
        insert_shard(p, r, local.data(), rebuilt.data());
      }
      EXPECT_EQ(rebuilt, global);
    }
  }
}

TEST(ShardPlan, MambaInProjSplitsPerSegmentAsTheSpecSays) {
  for (const int groups : {1, 2}) {
    SCOPED_TRACE("G=" + std::to_string(groups));
    json j = base_config();
    j["ssm_cfg"]["ngroups"] = groups;
    const ModelConfig m = config_of(j);
    const int tp = 2;
    const ShardPlan plan(m, {tp, tp});
    const bool replicated = groups % tp != 0;
    ops::Mamba3PreprocessShape s;
    s.heads = m.ssm_heads();
    s.headdim = m.ssm.headdim;
    s.state = m.ssm.d_state;
    s.groups = m.ssm.ngroups;
    s.rank = m.ssm.mimo_rank;
    s.angles = m.rope_angles();
    const std::string mixer = "backbone.layers.0.mixer.";
    const ParameterPlan& in_proj = plan.at(mixer + "in_proj.weight");
    EXPECT_EQ(in_proj.split, Split::kColumn);
    for (int r = 0; r < tp; ++r) {
      const RankGeometry& g = plan.geometry(r);
      EXPECT_EQ(g.ssm_heads.begin, r * 4);
      EXPECT_EQ(g.ssm_heads.count, 4);
      EXPECT_EQ(g.ssm_bc_replicated, replicated);
      EXPECT_EQ(g.ssm_groups.begin, replicated ? 0 : r);
      EXPECT_EQ(g.ssm_groups.count, replicated ? groups : 1);
      // The local in_proj is that of a mixer with the rank's heads and groups, same layout.
      ops::Mamba3PreprocessShape local = s;
      local.heads = g.ssm_heads.count;
      local.groups = g.ssm_groups.count;
      EXPECT_EQ(in_proj.shard(r).shape, (std::vector<int64_t>{local.columns(), m.d_model}));
      std::vector<std::string> segments;
      for (const ShardPiece& piece : in_proj.shard(r).pieces) {
        segments.push_back(piece.segment);
        const bool bc = piece.segment[0] == 'B' || piece.segment[0] == 'C';
        EXPECT_EQ(piece.replicated, piece.segment == "angles" || (bc && replicated))
            << piece.segment;
        EXPECT_EQ(piece.gradient,
                  piece.replicated ? TpGradient::kSumOverTp : TpGradient::kComplete);
        if (piece.segment == "z") {
          EXPECT_EQ(piece.global_begin, r * 4 * s.headdim);
        }
        if (piece.segment == "x") {
          EXPECT_EQ(piece.global_begin, s.col_x() + r * 4 * s.headdim);
        }
        if (piece.segment == "dd_A") {
          EXPECT_EQ(piece.global_begin, s.col_dd_a() + r * 4);
        }
        if (piece.segment == "angles") {
          EXPECT_EQ(piece.global_begin, s.col_angles());
          EXPECT_EQ(piece.length, s.angles);
        }
        // B is laid out (r, g, n): MIMO rank 1's rows of group g start at (1·G + g)·N.
        if (piece.segment == "C[r=1]") {
          EXPECT_EQ(piece.global_begin, s.col_c() + (1 * groups + r) * s.state);
          EXPECT_EQ(piece.length, s.state);
        }
      }
      const std::vector<std::string> expected =
          replicated
              ? std::vector<std::string>{"z", "x", "B", "C", "dd_dt", "dd_A", "trap", "angles"}
              : std::vector<std::string>{"z",      "x",     "B[r=0]", "B[r=1]", "C[r=0]",
                                         "C[r=1]", "dd_dt", "dd_A",   "trap",   "angles"};
      EXPECT_EQ(segments, expected);
    }
    // B/C norm weights are shared by every head, so each rank's gradient is partial even when
    // the groups are split.
    for (const char* norm : {"B_norm.weight", "C_norm.weight"}) {
      EXPECT_EQ(plan.at(mixer + norm).split, Split::kReplicatedSummed);
    }
    for (const char* per_head :
         {"dt_bias", "B_bias", "C_bias", "mimo_x", "mimo_z", "mimo_o", "D"}) {
      const ParameterPlan& p = plan.at(mixer + per_head);
      EXPECT_EQ(p.split, Split::kColumn) << per_head;
      EXPECT_EQ(p.shard(1).shape[0], 4) << per_head;
      EXPECT_EQ(p.shard(1).pieces.at(0).global_begin, 4) << per_head;
    }
    const ParameterPlan& out_proj = plan.at(mixer + "out_proj.weight");
    EXPECT_EQ(out_proj.split, Split::kRow);
    EXPECT_EQ(out_proj.shard(1).shape, (std::vector<int64_t>{m.d_model, 4 * s.headdim}));
    EXPECT_EQ(out_proj.shard(1).pieces.at(0).global_begin, 4 * s.headdim);
  }
}

TEST(ShardPlan, AttentionAndMlpSplitsAsTheSpecSays) {
  json j = base_config();
  j["tie_embeddings"] = false;
  const ModelConfig m = config_of(j);
  const ShardPlan plan(m, {2, 2});
  const int64_t hd = m.attn_head_dim(), hq = 4, hkv = 2;
  const std::string mixer = "backbone.layers.1.mixer.";
  for (const char* name : {"in_proj.weight", "in_proj.bias"}) {
    const ParameterPlan& p = plan.at(mixer + name);
    EXPECT_EQ(p.split, Split::kColumn);
    const auto& pieces = p.shard(1).pieces;
    ASSERT_EQ(pieces.size(), 3u);
    EXPECT_EQ(pieces[0].segment, "q");
    EXPECT_EQ(pieces[0].global_begin, 2 * hd);  // q heads 2, 3
    EXPECT_EQ(pieces[1].segment, "k");
    EXPECT_EQ(pieces[1].global_begin, (hq + 1) * hd);  // kv head 1
    EXPECT_EQ(pieces[2].segment, "v");
    EXPECT_EQ(pieces[2].global_begin, (hq + hkv + 1) * hd);
    EXPECT_EQ(p.shard(1).shape[0], (2 + 1 + 1) * hd);
  }
  EXPECT_EQ(plan.at(mixer + "out_proj.weight").split, Split::kRow);
  EXPECT_EQ(plan.at(mixer + "out_proj.weight").shard(1).pieces.at(0).global_begin, 2 * hd);
  EXPECT_EQ(plan.at(mixer + "out_proj.bias").split, Split::kReplicated);
  EXPECT_EQ(plan.geometry(1).attn_q_heads.begin, 2);
  EXPECT_EQ(plan.geometry(1).attn_kv_heads.begin, 1);

  const ParameterPlan& fc1 = plan.at("backbone.layers.1.mlp.fc1.weight");
  EXPECT_EQ(fc1.split, Split::kColumn);
  ASSERT_EQ(fc1.shard(1).pieces.size(), 2u);
  EXPECT_EQ(fc1.shard(1).pieces[0].segment, "a");
  EXPECT_EQ(fc1.shard(1).pieces[0].global_begin, 64);
  EXPECT_EQ(fc1.shard(1).pieces[1].segment, "g");
  EXPECT_EQ(fc1.shard(1).pieces[1].global_begin, 128 + 64);
  EXPECT_EQ(plan.at("backbone.layers.1.mlp.fc2.weight").split, Split::kRow);
  EXPECT_EQ(plan.at("backbone.layers.1.mlp.fc2.weight").shard(1).shape,
            (std::vector<int64_t>{m.d_model, 64}));
  EXPECT_EQ(plan.geometry(1).mlp_hidden.begin, 64);

  // Sequence parallelism feeds these each rank's rows only: partial gradients, summed over TP.
  for (const char* name : {"backbone.embedding.weight", "lm_head.weight", "backbone.norm_f.weight",
                           "backbone.layers.0.norm.weight", "backbone.layers.2.norm2.weight"}) {
    EXPECT_EQ(plan.at(name).split, Split::kReplicatedSummed) << name;
    EXPECT_EQ(plan.at(name).shard(1).pieces.at(0).gradient, TpGradient::kSumOverTp) << name;
  }
}

TEST(SequenceSplit, EqualSlotsTheLastRankTakesWhatIsLeft) {
  // 74 rows (2 x 37) over 4 ranks: slots of 19, the last rank 17 rows of its slot.
  for (int r = 0; r < 4; ++r) {
    const SequenceSplit s = sequence_split(74, 4, r);
    EXPECT_EQ(s.slot, 19);
    EXPECT_EQ(s.first, 19 * r);
    EXPECT_EQ(s.rows, r == 3 ? 17 : 19);
    EXPECT_EQ(s.padded_rows(), 76);
  }
  // An even split pads nothing.
  const SequenceSplit even = sequence_split(16384, 4, 3);
  EXPECT_EQ(even.rows, 4096);
  EXPECT_EQ(even.first, 3 * 4096);
  EXPECT_EQ(even.padded_rows(), 16384);
  EXPECT_EQ(sequence_split(5, 1, 0).rows, 5);
  const auto refusal = [](int64_t rows, int tp, int rank) -> std::string {
    try {
      sequence_split(rows, tp, rank);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      return e.what();
    }
    return "";
  };
  // 6 rows over 4 ranks: slots of 2 leave the last rank none.
  EXPECT_NE(refusal(6, 4, 0).find("tensor_parallel=4 leaves its last rank none of a "
                                  "micro-batch's 6 rows"),
            std::string::npos);
  EXPECT_NE(refusal(8, 2, 2).find("tp_rank=2"), std::string::npos);
  EXPECT_NE(refusal(0, 2, 0).find("rows=0"), std::string::npos);
  EXPECT_EQ(refusal(7, 4, 3), "");  // slots of 2, the last rank 1 row
}

TEST(ShardPlan, IllegalGeometriesAreRefusedNamingTheRule) {
  // H = 3: d_inner = 96 in heads of 32.
  json three_heads = base_config();
  three_heads["d_model"] = 48;
  three_heads["ssm_cfg"]["headdim"] = 32;
  three_heads["attn_cfg"] = {{"num_heads", 4}, {"num_heads_kv", 2}};
  EXPECT_NE(error_of(three_heads, 2, 2)
                .find("tensor_parallel=2 does not divide the Mamba-3 heads "
                      "H=3"),
            std::string::npos);
  // H = 6 Mamba-3 heads, so tp = 3 passes the Mamba-3 rule and meets the others.
  json six = base_config();
  six["d_model"] = 48;
  six["ssm_cfg"]["headdim"] = 16;
  six["attn_cfg"] = {{"num_heads", 4}, {"num_heads_kv", 2}, {"head_dim", 12}};
  EXPECT_NE(error_of(six, 3, 3).find("tensor_parallel=3 does not divide attn_cfg.num_heads=4"),
            std::string::npos);
  six["attn_cfg"] = {{"num_heads", 6}, {"num_heads_kv", 2}, {"head_dim", 8}};
  EXPECT_NE(error_of(six, 3, 3).find("tensor_parallel=3 does not divide attn_cfg.num_heads_kv=2"),
            std::string::npos);
  six["attn_cfg"] = {{"num_heads", 6}, {"head_dim", 8}};
  EXPECT_NE(error_of(six, 3, 3).find("tensor_parallel=3 does not divide the MLP hidden size 128"),
            std::string::npos);
  six["d_intermediate"] = 0;
  EXPECT_EQ(error_of(six, 3, 3), "");  // without an MLP, tp = 3 is legal
  EXPECT_NE(error_of(base_config(), 2, 3).find("tensor_parallel=2 does not divide device_count=3"),
            std::string::npos);
  EXPECT_NE(error_of(base_config(), 4, 2).find("tensor_parallel=4 does not divide device_count=2"),
            std::string::npos);
  EXPECT_NE(error_of(base_config(), 0, 2).find("tensor_parallel=0 must be >= 1"),
            std::string::npos);
  EXPECT_NE(error_of(base_config(), 1, 0).find("device_count=0 must be >= 1"), std::string::npos);
  // A rule applies only where its layer kind exists: H = 3 is no obstacle without Mamba-3 layers.
  three_heads["pattern"] = "**";
  EXPECT_EQ(error_of(three_heads, 2, 2), "");
  // The legality check alone says the same as the plan.
  try {
    check_tensor_parallel(config_of(base_config()), {8, 8});
    ADD_FAILURE() << "tp=8 accepted with Hq=4";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("attn_cfg.num_heads=4"), std::string::npos) << e.what();
  }
}

// The benchmark presets split as far as their kv heads allow: bench-1.3b (8 kv heads, issue 13's
// strong-scaling model) to TP = 8, bench-350m (4) to TP = 4, at their benchmark micro-batches'
// rows, each rank holding less the more ranks share the model; one step further is refused,
// naming the kv heads.
TEST(ShardPlan, TheBenchmarkPresetsSplitAsFarAsTheirKvHeads) {
  struct Preset {
    std::string name;
    int64_t rows;
    int widest;
  };
  for (const Preset& p : {Preset{"bench-350m", 4 * 8192, 4}, Preset{"bench-1.3b", 2 * 8192, 8}}) {
    const ModelConfig m = model_preset(p.name);
    int64_t held_before = ShardPlan(m, {1, 1}).local_numel(0);
    for (int tp = 2; tp <= p.widest; tp *= 2) {
      SCOPED_TRACE(p.name + " tp=" + std::to_string(tp));
      const ShardPlan plan(m, {tp, tp});
      for (int rank = 0; rank < tp; ++rank) {
        EXPECT_EQ(sequence_split(p.rows, tp, rank).rows, p.rows / tp);
        EXPECT_EQ(plan.local_numel(rank), plan.local_numel(0));
      }
      EXPECT_LT(plan.local_numel(0), held_before);
      held_before = plan.local_numel(0);
    }
    testing::expect_error(
        [&] {
          check_tensor_parallel(m, {2 * p.widest, 2 * p.widest});
        },
        ErrorKind::kInvalidArgument, "attn_cfg.num_heads_kv",
        p.name + " split over " + std::to_string(2 * p.widest) + " ranks");
  }
}

TEST(ShardPlan, TensorParallelOneKeepsEveryParameterWhole) {
  json j = base_config();
  j["tie_embeddings"] = false;
  j["ssm_cfg"]["ngroups"] = 2;
  const ModelConfig m = config_of(j);
  const ShardPlan plan(m, {1, 1});
  for (const ParameterPlan& p : plan.parameters()) {
    ASSERT_EQ(p.shards.size(), 1u);
    EXPECT_EQ(p.shard(0).shape, p.shape) << p.name;
    std::vector<float> global(static_cast<size_t>(p.numel()));
    std::iota(global.begin(), global.end(), 0.0f);
    std::vector<float> local(global.size(), -1.0f);
    extract_shard(p, 0, global.data(), local.data());
    EXPECT_EQ(local, global) << p.name;
  }
  EXPECT_EQ(plan.local_numel(0), Model<float>(m).parameters().total());
  const RankGeometry& g = plan.geometry(0);
  EXPECT_EQ(g.ssm_heads.count, m.ssm_heads());
  EXPECT_EQ(g.ssm_groups.count, 2);
  EXPECT_FALSE(g.ssm_bc_replicated);
  EXPECT_EQ(g.attn_q_heads.count, 4);
  EXPECT_EQ(g.attn_kv_heads.count, 2);
  EXPECT_EQ(g.mlp_hidden.count, 128);
}

TEST(ShardPlan, LocalSizesShrinkWithTheSplitAndRanksMapToGroups) {
  const ModelConfig m = config_of(base_config());
  const ShardPlan one(m, {1, 1}), two(m, {2, 4});
  EXPECT_LT(two.local_numel(0), one.local_numel(0));
  EXPECT_EQ(two.local_numel(0), two.local_numel(1));
  const ParallelConfig p = two.parallel();
  EXPECT_EQ(p.data_parallel(), 2);
  // TP groups are consecutive world ranks: {0, 1} and {2, 3}.
  EXPECT_EQ(p.tp_rank(3), 1);
  EXPECT_EQ(p.dp_rank(3), 1);
  EXPECT_EQ(p.tp_rank(2), 0);
  EXPECT_EQ(p.dp_rank(1), 0);
  EXPECT_STREQ(split_name(Split::kRow), "row-parallel");
}

}  // namespace
}  // namespace megacpp::parallel
