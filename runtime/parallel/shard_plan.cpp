#include "runtime/parallel/shard_plan.h"

#include <fmt/format.h>

#include <string>
#include <utility>

#include "base/error.h"
#include "kernels/contracts/mamba3_preprocess.h"

namespace megacpp::parallel {

namespace {

// A range of a split parameter's dim, before it is placed in the rank's local tensor.
struct Segment {
  std::string name;
  int64_t begin = 0;
  int64_t length = 0;
  bool replicated = false;
};

Range part(int total, int tp, int rank) {
  return {rank * (total / tp), total / tp};
}

bool has_mamba_layer(const ModelConfig& m) {
  for (int i = 0; i < m.n_layer; ++i) {
    if (!m.is_attention_layer(i)) return true;
  }
  return false;
}

class Builder {
 public:
  Builder(int tp, std::vector<ParameterPlan>& out) : tp_(tp), out_(out) {}

  void replicated(std::string name, std::vector<int64_t> shape, Split kind) {
    ParameterPlan p{std::move(name), std::move(shape), kind, 0, {}};
    const TpGradient gradient =
        kind == Split::kReplicatedSummed ? TpGradient::kSumOverTp : TpGradient::kComplete;
    for (int r = 0; r < tp_; ++r) {
      p.shards.push_back({p.shape, {{"all", 0, 0, p.shape[0], true, gradient}}});
    }
    out_.push_back(std::move(p));
  }

  // segments_of(rank) lists the rank's ranges of the split dim in the order its local tensor
  // keeps them. A replicated range of a split parameter is one the rank needs in full while
  // computing only its own heads (in_proj's angle rows; its B and C rows when G % tp != 0),
  // so its gradient on each rank is partial.
  template <typename F>
  void split(std::string name, std::vector<int64_t> shape, Split kind, F segments_of) {
    ParameterPlan p{std::move(name), std::move(shape), kind, kind == Split::kRow ? 1 : 0, {}};
    const auto dim = static_cast<size_t>(p.dim);
    for (int r = 0; r < tp_; ++r) {
      ParameterShard s{p.shape, {}};
      int64_t local = 0;
      for (const Segment& seg : segments_of(r)) {
        if (seg.length == 0) continue;
        s.pieces.push_back({seg.name, seg.begin, local, seg.length, seg.replicated,
                            seg.replicated ? TpGradient::kSumOverTp : TpGradient::kComplete});
        local += seg.length;
      }
      s.shape[dim] = local;
      p.shards.push_back(std::move(s));
    }
    out_.push_back(std::move(p));
  }

 private:
  int tp_;
  std::vector<ParameterPlan>& out_;
};

}  // namespace

const char* split_name(Split split) {
  switch (split) {
    case Split::kReplicated:
      return "replicated";
    case Split::kReplicatedSummed:
      return "replicated (gradients summed over TP)";
    case Split::kColumn:
      return "column-parallel";
    case Split::kRow:
      return "row-parallel";
  }
  return "?";
}

int64_t ParameterShard::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const ParameterShard& ParameterPlan::shard(int tp_rank) const {
  if (tp_rank < 0 || tp_rank >= static_cast<int>(shards.size())) {
    fail(ErrorKind::kInternal, "{}: tensor-parallel rank {} outside [0, {})", name, tp_rank,
         shards.size());
  }
  return shards[static_cast<size_t>(tp_rank)];
}

int64_t ParameterPlan::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t ParameterPlan::outer() const {
  int64_t n = 1;
  for (size_t i = 0; i < static_cast<size_t>(dim); ++i) n *= shape[i];
  return n;
}

int64_t ParameterPlan::inner() const {
  int64_t n = 1;
  for (size_t i = static_cast<size_t>(dim) + 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

void check_tensor_parallel(const ModelConfig& m, const ParallelConfig& parallel) {
  const int tp = parallel.tensor_parallel;
  if (tp < 1) fail(ErrorKind::kInvalidArgument, "tensor_parallel={} must be >= 1", tp);
  if (parallel.device_count < 1) {
    fail(ErrorKind::kInvalidArgument, "device_count={} must be >= 1", parallel.device_count);
  }
  if (parallel.device_count % tp != 0) {
    fail(ErrorKind::kInvalidArgument, "tensor_parallel={} does not divide device_count={}", tp,
         parallel.device_count);
  }
  const bool has_mamba = has_mamba_layer(m);
  // Each rank computes whole heads (and whole MLP hidden units): a head split across ranks
  // would need its scan state or softmax shared between them.
  if (has_mamba && m.ssm_heads() % tp != 0) {
    fail(ErrorKind::kInvalidArgument, "tensor_parallel={} does not divide the Mamba-3 heads H={}",
         tp, m.ssm_heads());
  }
  if (!m.attn_layer_idx.empty()) {
    if (m.attn.num_heads % tp != 0) {
      fail(ErrorKind::kInvalidArgument, "tensor_parallel={} does not divide attn_cfg.num_heads={}",
           tp, m.attn.num_heads);
    }
    if (m.attn_kv_heads() % tp != 0) {
      fail(ErrorKind::kInvalidArgument,
           "tensor_parallel={} does not divide attn_cfg.num_heads_kv={}", tp, m.attn_kv_heads());
    }
  }
  if (m.d_intermediate > 0 && m.mlp_hidden() % tp != 0) {
    fail(ErrorKind::kInvalidArgument, "tensor_parallel={} does not divide the MLP hidden size {}",
         tp, m.mlp_hidden());
  }
}

ShardPlan::ShardPlan(const ModelConfig& m, const ParallelConfig& parallel) : parallel_(parallel) {
  validate_model_config(m, "model config");
  check_tensor_parallel(m, parallel);
  const int tp = parallel.tensor_parallel;
  const bool has_mamba = has_mamba_layer(m);
  const bool has_attention = !m.attn_layer_idx.empty();

  for (int r = 0; r < tp; ++r) {
    RankGeometry g;
    if (has_mamba) {
      g.ssm_heads = part(m.ssm_heads(), tp, r);
      g.ssm_bc_replicated = m.ssm.ngroups % tp != 0;
      g.ssm_groups = g.ssm_bc_replicated ? Range{0, m.ssm.ngroups} : part(m.ssm.ngroups, tp, r);
    }
    if (has_attention) {
      g.attn_q_heads = part(m.attn.num_heads, tp, r);
      g.attn_kv_heads = part(m.attn_kv_heads(), tp, r);
    }
    if (m.d_intermediate > 0) g.mlp_hidden = part(m.mlp_hidden(), tp, r);
    geometry_.push_back(g);
  }
  auto geo = [this](int r) -> const RankGeometry& {
    return geometry_[static_cast<size_t>(r)];
  };

  Builder b(tp, parameters_);
  const int64_t dm = m.d_model;
  // Sequence parallelism: the embedding, every norm and the lm_head see only the rank's rows.
  b.replicated("backbone.embedding.weight", {m.padded_vocab(), dm}, Split::kReplicatedSummed);
  for (int i = 0; i < m.n_layer; ++i) {
    const std::string p = "backbone.layers." + std::to_string(i) + ".";
    b.replicated(p + "norm.weight", {dm}, Split::kReplicatedSummed);
    const std::string mixer = p + "mixer.";
    if (m.is_attention_layer(i)) {
      const int64_t hq = m.attn.num_heads, hkv = m.attn_kv_heads(), hd = m.attn_head_dim();
      const int64_t width = (hq + 2 * hkv) * hd;
      // Rank r's q heads use exactly its kv heads: Hq/tp q heads span Hkv/tp kv heads.
      auto qkv = [&](int r) {
        const Range q = geo(r).attn_q_heads, kv = geo(r).attn_kv_heads;
        return std::vector<Segment>{{"q", q.begin * hd, q.count * hd},
                                    {"k", (hq + kv.begin) * hd, kv.count * hd},
                                    {"v", (hq + hkv + kv.begin) * hd, kv.count * hd}};
      };
      b.split(mixer + "in_proj.weight", {width, dm}, Split::kColumn, qkv);
      if (m.attn.qkv_proj_bias) b.split(mixer + "in_proj.bias", {width}, Split::kColumn, qkv);
      b.split(mixer + "out_proj.weight", {dm, hq * hd}, Split::kRow, [&](int r) {
        const Range q = geo(r).attn_q_heads;
        return std::vector<Segment>{{"heads", q.begin * hd, q.count * hd}};
      });
      // Added once, after the all-reduce of the row-parallel product.
      if (m.attn.out_proj_bias) {
        b.replicated(mixer + "out_proj.bias", {dm}, Split::kReplicated);
      }
    } else {
      ops::Mamba3PreprocessShape s;
      s.heads = m.ssm_heads();
      s.headdim = m.ssm.headdim;
      s.state = m.ssm.d_state;
      s.groups = m.ssm.ngroups;
      s.rank = m.ssm.mimo_rank;
      s.angles = m.rope_angles();
      const int64_t h = s.heads, pd = s.headdim, n = s.state, g_all = s.groups, rk = s.rank;
      auto heads = [&](int r) {
        const Range hr = geo(r).ssm_heads;
        return std::vector<Segment>{{"heads", hr.begin, hr.count}};
      };
      b.split(mixer + "in_proj.weight", {s.columns(), dm}, Split::kColumn, [&](int r) {
        const Range hr = geo(r).ssm_heads, gr = geo(r).ssm_groups;
        std::vector<Segment> seg = {{"z", hr.begin * pd, hr.count * pd},
                                    {"x", s.col_x() + hr.begin * pd, hr.count * pd}};
        // B and C are laid out (r, g, n): a rank's groups are one run of rows per MIMO rank.
        for (const auto& [bc, col] : {std::pair{"B", s.col_b()}, std::pair{"C", s.col_c()}}) {
          if (geo(r).ssm_bc_replicated) {
            seg.push_back({bc, col, s.bc_width(), true});
            continue;
          }
          for (int64_t mr = 0; mr < rk; ++mr) {
            seg.push_back(
                {fmt::format("{}[r={}]", bc, mr), col + (mr * g_all + gr.begin) * n, gr.count * n});
          }
        }
        seg.push_back({"dd_dt", s.col_dd_dt() + hr.begin, hr.count});
        seg.push_back({"dd_A", s.col_dd_a() + hr.begin, hr.count});
        seg.push_back({"trap", s.col_trap() + hr.begin, hr.count});
        // The angles are shared by all heads.
        seg.push_back({"angles", s.col_angles(), s.angles, true});
        return seg;
      });
      b.split(mixer + "dt_bias", {h}, Split::kColumn, heads);
      b.split(mixer + "B_bias", {h, rk, n}, Split::kColumn, heads);
      b.split(mixer + "C_bias", {h, rk, n}, Split::kColumn, heads);
      b.replicated(mixer + "B_norm.weight", {n}, Split::kReplicatedSummed);
      b.replicated(mixer + "C_norm.weight", {n}, Split::kReplicatedSummed);
      b.split(mixer + "mimo_x", {h, rk, pd}, Split::kColumn, heads);
      b.split(mixer + "mimo_z", {h, rk, pd}, Split::kColumn, heads);
      b.split(mixer + "mimo_o", {h, rk, pd}, Split::kColumn, heads);
      b.split(mixer + "D", {h}, Split::kColumn, heads);
      b.split(mixer + "out_proj.weight", {dm, s.d_inner()}, Split::kRow, [&](int r) {
        const Range hr = geo(r).ssm_heads;
        return std::vector<Segment>{{"heads", hr.begin * pd, hr.count * pd}};
      });
    }
    if (m.d_intermediate > 0) {
      const int64_t hidden = m.mlp_hidden();
      b.replicated(p + "norm2.weight", {dm}, Split::kReplicatedSummed);
      // y = a ⊙ silu(g) pairs unit j of a with unit j of g: a rank takes the same units of both.
      b.split(p + "mlp.fc1.weight", {2 * hidden, dm}, Split::kColumn, [&](int r) {
        const Range u = geo(r).mlp_hidden;
        return std::vector<Segment>{{"a", u.begin, u.count}, {"g", hidden + u.begin, u.count}};
      });
      b.split(p + "mlp.fc2.weight", {dm, hidden}, Split::kRow, [&](int r) {
        const Range u = geo(r).mlp_hidden;
        return std::vector<Segment>{{"hidden", u.begin, u.count}};
      });
    }
  }
  b.replicated("backbone.norm_f.weight", {dm}, Split::kReplicatedSummed);
  if (!m.tie_embeddings) {
    b.replicated("lm_head.weight", {m.padded_vocab(), dm}, Split::kReplicatedSummed);
  }
}

SequenceSplit sequence_split(int64_t rows, int tensor_parallel, int tp_rank) {
  if (tensor_parallel < 1 || tp_rank < 0 || tp_rank >= tensor_parallel || rows < 1) {
    fail(ErrorKind::kInvalidArgument,
         "sequence_split: rows={}, tensor_parallel={}, tp_rank={}: rows and the degree must be "
         ">= 1 and the rank in [0, tensor_parallel)",
         rows, tensor_parallel, tp_rank);
  }
  const int64_t slot = (rows + tensor_parallel - 1) / tensor_parallel;
  const int64_t last = rows - slot * (tensor_parallel - 1);
  if (last < 1) {
    fail(ErrorKind::kInvalidArgument,
         "tensor_parallel={} leaves its last rank none of a micro-batch's {} rows: sequence "
         "parallelism gives every other rank ceil(rows / tensor_parallel) = {}; use more rows or "
         "fewer tensor-parallel ranks",
         tensor_parallel, rows, slot);
  }
  SequenceSplit s;
  s.tensor_parallel = tensor_parallel;
  s.slot = static_cast<int>(slot);
  s.first = slot * tp_rank;
  s.rows = static_cast<int>(tp_rank + 1 == tensor_parallel ? last : slot);
  return s;
}

const ParameterPlan* ShardPlan::find(const std::string& name) const {
  for (const ParameterPlan& p : parameters_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

const ParameterPlan& ShardPlan::at(const std::string& name) const {
  const ParameterPlan* p = find(name);
  if (p == nullptr) fail(ErrorKind::kNotFound, "the shard plan has no parameter {}", name);
  return *p;
}

const RankGeometry& ShardPlan::geometry(int tp_rank) const {
  if (tp_rank < 0 || tp_rank >= tensor_parallel()) {
    fail(ErrorKind::kInternal, "tensor-parallel rank {} outside [0, {})", tp_rank,
         tensor_parallel());
  }
  return geometry_[static_cast<size_t>(tp_rank)];
}

int64_t ShardPlan::local_numel(int tp_rank) const {
  int64_t n = 0;
  for (const ParameterPlan& p : parameters_) n += p.shard(tp_rank).numel();
  return n;
}

}  // namespace megacpp::parallel
