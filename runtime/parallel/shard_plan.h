#pragma once
// Tensor parallelism of shared/spec/model.md (Megatron style): for every parameter of a model,
// the slice each tensor-parallel rank holds and how that slice's gradient is reduced. The one
// place the split rules live: the CUDA model lays out its local parameters from it, the NCCL
// runtime picks its reductions from it, and the daemon refuses an illegal geometry with it
// before any device is touched. Plain C++: no CUDA, no NCCL.
//
// Devices: device_count = tensor_parallel · data_parallel. World rank w is tensor-parallel rank
// w % tp of data-parallel replica w / tp, so a TP group is tp consecutive devices: TP reduces
// activations in every layer and wants the fastest links, DP reduces gradients once per step.
//
// Sequence parallelism (Megatron's, beside TP): between the sublayers the residual stream is
// split by rows. Each TP rank holds its share of the micro-batch's batch · seqlen rows
// (sequence_split) and runs the embedding, the residual adds, the norms and the lm_head with the
// loss on those rows alone; a sublayer's input is all-gathered before its column-parallel GEMM
// and its row-parallel output reduce-scattered back to the rows.
//
// Gradients: every gradient is averaged over the data-parallel group. Over the TP group only the
// pieces marked TpGradient::kSumOverTp are summed; every other piece's gradient is already whole
// on each rank that holds it.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/config/model_config.h"

namespace megacpp::parallel {

struct ParallelConfig {
  int tensor_parallel = 1;  // tp
  int device_count = 1;     // tp · data_parallel
  int data_parallel() const { return device_count / tensor_parallel; }
  int tp_rank(int world_rank) const { return world_rank % tensor_parallel; }
  int dp_rank(int world_rank) const { return world_rank / tensor_parallel; }
};

enum class Split {
  // Whole on every rank and fed only whole activations (the attention out_proj bias, whose
  // gradient sums the gathered output gradient): every rank computes the same gradient.
  kReplicated,
  // Whole on every rank, but each rank uses it only for its own heads (B_norm/C_norm weights) or
  // its own rows (the embedding, the norms and the lm_head under sequence parallelism): each
  // rank's gradient is a partial sum.
  kReplicatedSummed,
  // Split along dim 0: the output rows of a column-parallel weight (or its bias), or the head
  // axis of a per-head tensor. A column-parallel weight may also hold rows every rank keeps
  // (the Mamba-3 in_proj's angle rows, and its B and C rows when G % tp != 0).
  kColumn,
  // Split along dim 1, the input columns of a row-parallel weight: the layer's output is a
  // partial sum that the runtime all-reduces over TP.
  kRow,
};
const char* split_name(Split split);

enum class TpGradient {
  kComplete,   // the rank's gradient of the piece is whole: no TP reduction
  kSumOverTp,  // every rank holds the piece and computes part of its gradient: all-reduce (sum)
};

// A contiguous range of indices along the parameter's split dim (ParameterPlan::dim).
struct ShardPiece {
  std::string segment;  // what the range is: "z", "B[r=1]", "q", "a", "heads", "all", ...
  int64_t global_begin = 0;
  int64_t local_begin = 0;
  int64_t length = 0;
  bool replicated = false;  // every TP rank holds this same range
  TpGradient gradient = TpGradient::kComplete;
};

// One TP rank's part of a parameter: the pieces, in local order, tile dim `dim` of `shape`.
struct ParameterShard {
  std::vector<int64_t> shape;
  std::vector<ShardPiece> pieces;
  int64_t numel() const;
};

struct ParameterPlan {
  std::string name;            // as ParameterSet (and the checkpoint) names it
  std::vector<int64_t> shape;  // global: checkpoints are always global
  Split split = Split::kReplicated;
  int dim = 0;                         // the dim the pieces index: 1 for kRow, 0 otherwise
  std::vector<ParameterShard> shards;  // one per TP rank

  const ParameterShard& shard(int tp_rank) const;
  int64_t numel() const;
  // The tensor as [outer, shape[dim], inner]: a piece is `length · inner` contiguous elements
  // in each of the `outer` slabs.
  int64_t outer() const;
  int64_t inner() const;
};

struct Range {
  int begin = 0;
  int count = 0;
  int end() const { return begin + count; }
};

// What one TP rank computes, in the model's own index spaces.
struct RankGeometry {
  Range ssm_heads;   // Mamba-3 heads h of H
  Range ssm_groups;  // the B/C groups whose in_proj rows the rank holds: G/tp, or all G
  bool ssm_bc_replicated = false;  // G % tp != 0: every rank holds all B and C rows
  Range attn_q_heads;
  Range attn_kv_heads;
  Range mlp_hidden;  // of round_up(d_intermediate, 128), in each of fc1's a and g halves
};

// Sequence parallelism's split of a micro-batch's batch · seqlen rows over the TP ranks: every
// rank a slot of ceil(rows / tp) rows (the collectives move whole slots, so all are the same
// size), rank r's rows the first of rows [r · slot, (r + 1) · slot): all of them but on the last
// rank, which takes what is left, and whose slot the runtime pads.
struct SequenceSplit {
  int tensor_parallel = 1;
  int slot = 0;       // rows a rank's slot holds
  int rows = 0;       // of them, this rank's
  int64_t first = 0;  // its first row
  int64_t padded_rows() const { return static_cast<int64_t>(slot) * tensor_parallel; }
};
// Refuses (kInvalidArgument, naming the rule) rows that leave the last rank none.
SequenceSplit sequence_split(int64_t rows, int tensor_parallel, int tp_rank);

// Refuses (Error kInvalidArgument, naming the field and the rule) a tensor-parallel degree
// that cannot split this model over these devices. Expects a validated model config.
void check_tensor_parallel(const ModelConfig& config, const ParallelConfig& parallel);

class ShardPlan {
 public:
  // Validates the model config and the geometry (check_tensor_parallel), then plans every
  // parameter the model registers.
  ShardPlan(const ModelConfig& config, const ParallelConfig& parallel);

  const ParallelConfig& parallel() const { return parallel_; }
  int tensor_parallel() const { return parallel_.tensor_parallel; }
  // In the order ParameterSet registers them.
  const std::vector<ParameterPlan>& parameters() const { return parameters_; }
  const ParameterPlan* find(const std::string& name) const;
  const ParameterPlan& at(const std::string& name) const;  // throws kNotFound
  const RankGeometry& geometry(int tp_rank) const;
  int64_t local_numel(int tp_rank) const;  // all parameters one rank holds

 private:
  ParallelConfig parallel_;
  std::vector<ParameterPlan> parameters_;
  std::vector<RankGeometry> geometry_;
};

// Copies one rank's shard out of the global tensor (loading a global checkpoint) and back
// (saving one). Replicated pieces are copied like the others.
template <typename T>
void extract_shard(const ParameterPlan& plan, int tp_rank, const T* global, T* local) {
  const ParameterShard& s = plan.shard(tp_rank);
  const int64_t inner = plan.inner();
  const int64_t global_dim = plan.shape[static_cast<size_t>(plan.dim)];
  const int64_t local_dim = s.shape[static_cast<size_t>(plan.dim)];
  for (int64_t o = 0; o < plan.outer(); ++o) {
    for (const ShardPiece& p : s.pieces) {
      std::copy_n(global + (o * global_dim + p.global_begin) * inner, p.length * inner,
                  local + (o * local_dim + p.local_begin) * inner);
    }
  }
}

template <typename T>
void insert_shard(const ParameterPlan& plan, int tp_rank, const T* local, T* global) {
  const ParameterShard& s = plan.shard(tp_rank);
  const int64_t inner = plan.inner();
  const int64_t global_dim = plan.shape[static_cast<size_t>(plan.dim)];
  const int64_t local_dim = s.shape[static_cast<size_t>(plan.dim)];
  for (int64_t o = 0; o < plan.outer(); ++o) {
    for (const ShardPiece& p : s.pieces) {
      std::copy_n(local + (o * local_dim + p.local_begin) * inner, p.length * inner,
                  global + (o * global_dim + p.global_begin) * inner);
    }
  }
}

}  // namespace megacpp::parallel
