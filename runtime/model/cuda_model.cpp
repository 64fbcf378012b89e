#include "runtime/model/cuda_model.h"

#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "kernels/cuda/adamw.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/gated_mlp.h"
#include "kernels/cuda/grad_clip.h"
#include "kernels/cuda/linear.h"
#include "kernels/cuda/lm_head_loss.h"
#include "kernels/cuda/mamba3_preprocess.h"
#include "kernels/cuda/mamba3_scan.h"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/cuda/rotary.h"
#include "kernels/cuda/tensor_ops.h"
#include "runtime/model/device_arena.h"
#include "runtime/parallel/cuda_communicator.h"
#include "runtime/parallel/shard_plan.h"

namespace megacpp {

namespace {

size_t free_device_bytes() {
  size_t free = 0, total = 0;
  MEGACPP_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

// in_proj's output rows, where the scan reads z and x in them, padded to 128 bytes.
constexpr int kProjRowAlignment = 64;

}  // namespace

struct CudaModel::Impl {
  // A parameter of the host set: where its fp32 value, gradient and bf16 copy sit on the device.
  struct Param {
    int id = -1;
    int64_t offset = 0;
    int64_t size = 0;
  };

  struct MambaLayer {
    Param in_proj, dt_bias, b_bias, c_bias, b_norm, c_norm, mimo_x, mimo_z, mimo_o, d, out_proj;
    ops::Mamba3PreprocessShape shape;
    // Elements from one of proj's rows to the next: columns() padded to kProjRowAlignment. The
    // scan reads z and x in place there (ScanDeviceInputs::zv_row_stride), not as copies in
    // scan_in; it covers only head dimensions that are multiples of 16, so x's column offset
    // (d_inner) keeps its 16-byte rows aligned. (128-byte rows: whole cache lines; the scan alone
    // ran as fast at either stride, bench/RESULTS.md, session 26.)
    int proj_stride = 0;
    std::unique_ptr<cuda::LinearCuda> in_linear, out_linear;
    std::unique_ptr<cuda::Mamba3PreprocessCuda> preprocess;
    std::unique_ptr<cuda::Mamba3ScanCuda> scan;
    // Kept from the forward for the backward.
    uint16_t* proj = nullptr;     // [rows, columns]
    uint16_t* scan_in = nullptr;  // z, x, k, q, adt, dt, trap, angles: [rows, columns - 2·... ]
    uint16_t* y = nullptr;        // [rows, d_inner]
  };

  struct AttentionLayer {
    Param in_proj, in_bias, out_proj, out_bias;
    int q_heads = 0, kv_heads = 0, head_dim = 0, width = 0;
    std::unique_ptr<cuda::LinearCuda> in_linear, out_linear;
    // One of the two, as CudaModelOptions::attention says. Every attention layer has the same
    // shape: they share one cuDNN op, whose plans are built (and their kernels compiled) once.
    std::unique_ptr<cuda::CausalAttentionCuda> attention;
    std::shared_ptr<cuda::CausalAttentionCudnn> attention_cudnn;
    uint16_t* qkv = nullptr;  // [rows, width], q and k rotated
    uint16_t* ctx = nullptr;  // [rows, q_heads·head_dim]
    float* lse = nullptr;     // [batch, q_heads, seqlen]
  };

  struct MlpLayer {
    Param fc1, fc2;
    std::unique_ptr<cuda::GatedMlpCuda> mlp;
    uint16_t* fc1_out = nullptr;  // [rows, 2·hidden]
    uint16_t* act = nullptr;      // [rows, hidden]
  };

  struct Block {
    Param norm, norm2;
    std::unique_ptr<MambaLayer> mamba;
    std::unique_ptr<AttentionLayer> attention;
    std::unique_ptr<MlpLayer> mlp;
  };

  ModelConfig config;
  OptimizerConfig optimizer;
  int device = 0;
  int batch = 0, seqlen = 0, rows = 0;
  // Sequence parallelism (shard_plan.h's sequence_split): the rows of the residual stream this
  // rank holds, split.rows of the micro-batch's from split.first, at the start of its slot of
  // split.slot rows; all of them on one GPU. The buffers the collectives fill hold
  // split.padded_rows(): the last rank's slot ends in rows no op reads, kept zero.
  parallel::SequenceSplit split;
  template <class T>
  T* my_rows(T* whole) const {
    return whole + split.first * config.d_model;
  }
  int64_t local_elements() const { return static_cast<int64_t>(split.rows) * config.d_model; }
  int64_t slot_elements() const { return static_cast<int64_t>(split.slot) * config.d_model; }
  // The device holds the rank's shards (the plan's local layout); the host mirror is global.
  CudaModelParallel par;
  std::unique_ptr<parallel::ShardPlan> plan;
  std::vector<ParameterInfo> host_entries;  // global
  int64_t host_total = 0;
  int64_t total = 0;                   // local
  std::vector<ParameterInfo> entries;  // local: offsets and sizes in the device buffers
  bool sharded() const { return par.tensor_parallel > 1; }
  // Contiguous gradient ranges every TP rank holds and computes part of: summed over TP.
  struct Range {
    int64_t offset = 0, count = 0;
  };
  std::vector<Range> tp_summed;
  // reduce_gradients sums the ranges of tp_summed from kDirectSumElements up in place, one
  // all-reduce each (the embedding table), and packs the others into tp_pack for one all-reduce:
  // summed one by one (even batched) bench-1.3b's 139 of them, 78 MB (a Mamba in_proj's
  // replicated B, C and angle rows, the norms' weights), took 1.0 ms a step at TP = 4.
  static constexpr int64_t kDirectSumElements = int64_t{1} << 22;
  std::vector<Range> tp_direct, tp_packed_ranges;
  int64_t tp_packed = 0, tp_packed_longest = 0;  // tp_packed_ranges' elements, largest count
  float* tp_pack = nullptr;
  int64_t* tp_pack_table = nullptr;  // (offset, count, start) per packed range
  int packed_range_count() const { return static_cast<int>(tp_packed_ranges.size()); }
  // CudaModelOptions: how the step runs.
  bool recompute_in_proj = false;
  AttentionEngine attention_engine = AttentionEngine::kCudnn;
  bool deterministic = true;
  int reserved_sms = 0;  // CudaModelOptions::tensor_parallel_reserved_sms
  int sm_count = 0;      // the device's, read once by the constructor
  // Tensor parallel: the all-gathers' buffers. Where the tensor group was split for copy engines
  // (CudaCommunicator::split), its symmetric memory, so that they run on the copy engines.
  DeviceArena gathered_arena;
  void* symmetric_arena = nullptr;
  // Data parallel: the gradient ranges of each block (then one more bucket: embedding, final norm,
  // lm_head), averaged over the DP group on reduce_stream as soon as the backward is done with
  // them, while it goes on with the blocks below (forward_backward's last micro-batch).
  bool overlap_dp = true;
  // Beside tensor parallelism, only on a GPU with room for two NCCL kernels of the most blocks
  // NCCL gives one (plan_gradient_buckets; see forward_backward).
  bool overlap_beside_tp = false;
  bool overlap_now = false;  // this forward_backward averages its buckets as it goes
  bool dp_reduced = false;   // the gradients since zero_grad were averaged in the backward
  std::vector<std::vector<Range>> buckets;
  std::vector<cudaEvent_t> bucket_ready;
  cudaEvent_t buckets_reduced = nullptr;
  cudaStream_t reduce_stream = nullptr;
  void plan_gradient_buckets();
  void reduce_bucket(size_t bucket);
  // The gradient ranges this rank counts in the global norm: its own pieces, and the pieces every
  // rank holds only on TP rank 0.
  std::vector<Range> owned;
  bool grads_reduced = true;
  size_t free_before = 0;
  cudaStream_t stream = nullptr;
  DeviceArena arena;

  float* values = nullptr;
  float* grads = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  uint16_t* values_bf16 = nullptr;
  int64_t steps_taken = 0;

  Param embedding, norm_f, lm_head;
  std::vector<Block> blocks;
  std::vector<Param> site_weight;

  int32_t* inputs = nullptr;   // [rows]
  int32_t* targets = nullptr;  // [rows]
  std::vector<int32_t> host_inputs, host_targets;
  std::vector<float*> residual;  // per site [split.rows, d_model]
  // Those the collectives fill hold split.padded_rows() (the rows past `rows` stay zero).
  std::vector<uint16_t*> normed;  // per site [padded, d_model]: the rank's rows, gathered
  std::vector<float*> rstd;       // per site [split.rows]
  uint16_t* delta = nullptr;      // a sublayer's output [padded, d_model], reduced into my_rows
  uint16_t* ddelta = nullptr;     // its gradient, bf16 [padded, d_model], gathered from my_rows
  // Tensor parallel: the next sublayer's output gradient, made while the sublayer whose gradient
  // is in ddelta still reads it (start_input_gradient_sum); the two swap between sublayers.
  uint16_t* ddelta_next = nullptr;
  float* dresidual = nullptr;  // [split.rows, d_model]
  // The gradient of a norm site's output [padded, d_model], made by the sublayer's input GEMM.
  // One GPU: fp32 (dnormed), because the norm weight's gradient sums it over every row. Tensor
  // parallel: bf16 (dnormed_half), the rank's partial sum, reduce-scattered into my_rows in bf16
  // as Megatron's sequence parallelism does: half the bytes of the one collective of the backward
  // that the weight-gradient GEMMs do not hide (bench/RESULTS.md, session 22).
  float* dnormed = nullptr;
  uint16_t* dnormed_half = nullptr;
  cuda::RowsOut input_gradient_out() const {
    return sharded() ? cuda::RowsOut{dnormed_half, nullptr} : cuda::RowsOut{nullptr, dnormed};
  }
  uint16_t* scratch_a = nullptr;    // the largest per-token backward scratch of any sublayer
  uint16_t* scratch_b = nullptr;    // a second one
  uint16_t* scratch_c = nullptr;    // a third one (the scan's input gradients)
  float* param_scratch = nullptr;   // per-mixer parameter gradients the ops overwrite
  float* loss = nullptr;            // [1]
  float* grad_norm = nullptr;       // [1]
  float* clip_scale = nullptr;      // [1]
  double* square_sum = nullptr;     // [1] this rank's Σ g², then the TP group's
  float* gather_scratch = nullptr;  // a split parameter's shards from every TP rank
  void* op_workspace = nullptr;     // shared by the ops that run one after another
  size_t op_workspace_bytes = 0;
  void* scan_backward_workspace = nullptr;  // every Mamba layer's scan backward temporaries
  size_t scan_backward_bytes = 0;
  void* norm_op_workspace = nullptr;  // the rmsnorm backward's partials
  size_t norm_op_workspace_bytes = 0;
  void* norm_workspace = nullptr;  // the global norm's tables (kept)
  size_t norm_workspace_bytes = 0;
  void* adamw_workspace = nullptr;  // AdamW's tables (kept)
  size_t adamw_workspace_bytes = 0;
  uint16_t* shared_proj = nullptr;  // recompute_in_proj: every Mamba layer's in_proj output
  // What the layers' scans and preprocessings allocate for themselves, beside the arena.
  size_t layer_workspace_bytes = 0;

  std::unique_ptr<cuda::EmbeddingCuda> embedding_op;
  std::unique_ptr<cuda::ResidualRmsNormCuda> norm_op;
  std::unique_ptr<cuda::LmHeadLossCuda> lm_head_op;
  std::unique_ptr<cuda::GradNormCuda> grad_norm_op;
  std::unique_ptr<cuda::AdamWCuda> adamw_op;

  Param param(const std::string& name, bool required = true) {
    // Ids are ParameterSet's registration order, which host_entries keeps.
    for (size_t id = 0; id < host_entries.size(); ++id) {
      if (host_entries[id].name != name) continue;
      const ParameterInfo& local = entries[id];
      return {static_cast<int>(id), local.offset, local.size};
    }
    if (required) fail(ErrorKind::kInternal, "CudaModel: the host model has no {}", name);
    return {};
  }
  float* value(const Param& p) const { return p.id < 0 ? nullptr : values + p.offset; }
  float* grad(const Param& p) const { return p.id < 0 ? nullptr : grads + p.offset; }
  uint16_t* bf16(const Param& p) const { return p.id < 0 ? nullptr : values_bf16 + p.offset; }
  void* s() const { return stream; }

  // Op timing while profiling: lap() records an event on the stream and charges the time since
  // the previous one to `label` (nullptr: a starting mark); harvest(), after the stream was
  // synchronized, adds the laps into op_times. The events exist before the first profiled step.
  static constexpr size_t kMaxLaps = 4096;
  bool profiling = false;
  std::vector<cudaEvent_t> events;
  std::vector<const char*> lap_labels;
  size_t laps = 0;
  std::map<std::string, std::vector<float>> op_samples;  // per op, one time per call
  void lap(const char* label);
  void harvest();

  // The step graph (set_step_graph): forward, loss and backward captured once from the stream and
  // replayed. Re-captured when grad_scale changes (it is a kernel argument). Profiled steps run
  // eagerly: the op timings need events between the ops.
  bool graph_wanted = false;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t graph_exec = nullptr;
  float graph_scale = 0.f;
  int64_t graph_captures = 0;
  void forward_backward_body(float grad_scale);
  void capture_step(float grad_scale);
  void drop_graph();

  // The scan's inputs: the preprocessing's outputs and the bf16 copies of the per-head parameters
  // (C_bias is the scan's q bias, B_bias its k bias).
  cuda::ScanDeviceInputs scan_inputs(const MambaLayer& l,
                                     const cuda::PreprocessDeviceOutputs& in) const {
    cuda::ScanDeviceInputs s;
    s.q = in.q;
    s.k = in.k;
    s.z = l.proj;
    s.v = l.proj + l.shape.col_x();
    s.zv_row_stride = l.proj_stride;
    s.adt = in.adt;
    s.dt = in.dt;
    s.trap = in.trap;
    s.angles = in.angles;
    s.q_bias = bf16(l.c_bias);
    s.k_bias = bf16(l.b_bias);
    s.mimo_x = bf16(l.mimo_x);
    s.mimo_z = bf16(l.mimo_z);
    s.mimo_o = bf16(l.mimo_o);
    s.d = bf16(l.d);
    return s;
  }

  void upload_tokens(const int32_t* tokens);
  // planning_only: no communicators (plan_memory), so the groups are not checked.
  void plan_parallel(const CudaModelParallel& parallel, bool planning_only = false);
  // Every buffer of the arena reserved (the layers' structs and parameters set up on the way),
  // and the layers' own workspace bytes counted: all from (config, batch, seqlen, the rank's
  // geometry, memory), nothing touched on the device. The constructor allocates what this plans;
  // plan_memory reports it.
  void plan_buffers(const CudaModelOptions& options);
  // Allocates the planned arena, points the buffers into it and makes the ops.
  void allocate_and_build(cuda::GemmPlanCache* plan_cache);
  cuda::EmbeddingShape embedding_shape() const {
    return {split.rows, config.d_model, config.padded_vocab()};
  }
  cuda::RmsNormShape norm_shape() const {
    return {split.rows, config.d_model, config.norm_epsilon};
  }
  // The loss of the rank's rows, as its share of the micro-batch's mean.
  cuda::LmHeadLossShape lm_head_shape() const {
    return {split.rows,
            config.d_model,
            config.padded_vocab(),
            config.vocab_size,
            0,
            static_cast<int>(split.first),
            sharded() ? rows : 0};
  }
  // Tensor parallel: a sublayer's output (delta, a partial sum on each rank) summed over the group
  // into the rank's rows; a norm site's output (or the residual gradient) gathered from every
  // rank's rows; the rows' shares of the loss summed.
  void tp_reduce_scatter_output();
  void tp_all_gather(uint16_t* whole, void* on);
  void tp_sum_loss();
  // The backward at a norm site, once the sublayer above it has made its input gradient
  // (dnormed): the norm's backward into dresidual and, above site 0, the gradient of the
  // sublayer below, dresidual in bf16 (all rows gathered under tensor parallelism) into
  // `output_gradient`. On `on`.
  size_t backward_site = 0;
  void norm_site_backward(uint16_t* output_gradient, void* on);
  // dresidual in bf16 into the rank's rows of `output_gradient`, then (tensor parallel) every
  // rank's rows gathered: the output gradient of the sublayer below a site. On `on`.
  void output_gradient_from_residual(uint16_t* output_gradient, void* on);
  // A sublayer's backward calls start_input_gradient_sum once it has enqueued its input gradient
  // (dnormed), before its weight-gradient GEMMs, which need only the sublayer's own inputs;
  // finish_input_gradient_sum follows the sublayer. On one GPU the site's backward runs there,
  // on the compute stream. Tensor parallel: tp_stream sums dnormed over the group into the rank's
  // rows and runs the site's backward into ddelta_next beside the weight gradients (Megatron's
  // overlap of the input-gradient reduction, with the norm and the next all-gather after it);
  // finish makes the compute stream wait for it and swaps ddelta_next in for the sublayer below.
  // (Measured against running the norm and the cast on the compute stream between the two
  // weight-gradient GEMMs: that was slower, 324.5 against 319 ms at TP = 2; bench/RESULTS.md.)
  cudaStream_t tp_stream = nullptr;
  cudaEvent_t input_gradient_ready = nullptr;
  cudaEvent_t input_gradient_summed = nullptr;
  void make_tp_stream();
  void start_input_gradient_sum();
  void finish_input_gradient_sum();
  bool input_gradient_sum_pending = false;  // started, not yet finished
  void dp_average_loss();
  // Every TP rank's shards of the device buffer `local` (this rank's layout) into the host's
  // global layout: a collective over the TP group.
  void gather_to_host(const float* local, float* global) const;
  void scatter_from_host(const float* global, float* local) const;
  void run_forward();
  void mamba_forward(MambaLayer& l, const uint16_t* x);
  void attention_forward(AttentionLayer& l, const uint16_t* x);
  void mamba_backward(MambaLayer& l, const uint16_t* x);
  void attention_backward(AttentionLayer& l, const uint16_t* x);
  float read_loss();
  // Here rather than in ~CudaModel, so that a constructor that throws half way (a plan refused,
  // a vote lost) gives back what it had made: the streams and events, the symmetric memory.
  ~Impl();
};

namespace {

// The scan's per-token tensors carved out of one buffer, in the preprocessing's output order:
// its inputs without z and x (null: it reads them in place in in_proj's output), its input
// gradients with them (with_zx).
cuda::PreprocessDeviceOutputs carve_scan_inputs(uint16_t* base, const ops::Mamba3PreprocessShape& s,
                                                size_t rows, bool with_zx) {
  cuda::PreprocessDeviceOutputs o;
  const size_t di = static_cast<size_t>(s.d_inner()), bc = static_cast<size_t>(s.bc_width());
  const size_t h = static_cast<size_t>(s.heads);
  o.z = with_zx ? base : nullptr;
  o.x = with_zx ? base + rows * di : nullptr;
  o.k = with_zx ? base + 2 * rows * di : base;
  o.q = o.k + rows * bc;
  o.adt = o.q + rows * bc;
  o.dt = o.adt + rows * h;
  o.trap = o.dt + rows * h;
  o.angles = s.angles > 0 ? o.trap + rows * h : nullptr;
  return o;
}

size_t scan_input_elements(const ops::Mamba3PreprocessShape& s, size_t rows, bool with_zx) {
  return rows * ((with_zx ? 2 * static_cast<size_t>(s.d_inner()) : 0) +
                 2 * static_cast<size_t>(s.bc_width()) + 3 * static_cast<size_t>(s.heads) +
                 static_cast<size_t>(s.angles));
}

}  // namespace

void CudaModel::Impl::plan_parallel(const CudaModelParallel& parallel, bool planning_only) {
  const int tp = parallel.tensor_parallel, dp = parallel.data_parallel;
  if (tp < 1 || dp < 1 || parallel.tp_rank < 0 || parallel.tp_rank >= tp) {
    fail(ErrorKind::kInvalidArgument,
         "CudaModel: tensor_parallel={}, data_parallel={}, tp_rank={}: degrees must be >= 1 and "
         "the rank in [0, tensor_parallel)",
         tp, dp, parallel.tp_rank);
  }
  const auto check_group = [](const char* what, int degree, const parallel::CudaCommunicator* g) {
    if ((degree > 1) != (g != nullptr) || (g != nullptr && g->size() != degree)) {
      fail(ErrorKind::kInternal, "CudaModel: {} degree {} but its group has {} ranks", what, degree,
           g == nullptr ? 0 : g->size());
    }
  };
  if (!planning_only) {
    check_group("tensor-parallel", tp, parallel.tensor_group);
    check_group("data-parallel", dp, parallel.data_group);
  }
  if (parallel.tensor_group != nullptr && parallel.tensor_group->rank() != parallel.tp_rank) {
    fail(ErrorKind::kInternal, "CudaModel: tp_rank {} but rank {} of its tensor-parallel group",
         parallel.tp_rank, parallel.tensor_group->rank());
  }
  par = parallel;
  split = parallel::sequence_split(rows, tp, parallel.tp_rank);
  // Validates the geometry against the model, naming the rule a split breaks.
  plan = std::make_unique<parallel::ShardPlan>(config, parallel::ParallelConfig{tp, tp * dp});
  const parallel::RankGeometry& geo = plan->geometry(parallel.tp_rank);
  if (tp > 1 && geo.ssm_bc_replicated && config.ssm.ngroups != 1) {
    // The local scan maps its heads onto groups from 0: a rank whose heads start inside a group
    // would need the group offset passed down to the kernels.
    fail(ErrorKind::kInvalidArgument,
         "tensor_parallel={} with ssm_cfg.ngroups={}: the CUDA backend splits B/C groups only "
         "when tensor_parallel divides ngroups, or ngroups is 1",
         tp, config.ssm.ngroups);
  }
  entries = host_entries;
  if (!sharded()) {
    total = host_total;
    owned = {{0, total}};
    return;
  }
  int64_t offset = 0;
  for (ParameterInfo& e : entries) {
    const parallel::ParameterPlan& p = plan->at(e.name);
    const parallel::ParameterShard& shard = p.shard(par.tp_rank);
    e.shape = shard.shape;
    e.offset = offset;
    e.size = shard.numel();
    offset += e.size;
    const bool whole_replicated =
        p.split == parallel::Split::kReplicated || p.split == parallel::Split::kReplicatedSummed;
    bool any_replicated = false;
    for (const parallel::ShardPiece& piece : shard.pieces) any_replicated |= piece.replicated;
    if (!any_replicated) {
      owned.push_back({e.offset, e.size});
      continue;
    }
    if (!whole_replicated && p.outer() != 1) {
      fail(ErrorKind::kInternal, "CudaModel: {} has a replicated piece along a strided dim",
           e.name);
    }
    for (const parallel::ShardPiece& piece : shard.pieces) {
      const Range r{e.offset + piece.local_begin * p.inner(), piece.length * p.inner()};
      if (piece.gradient == parallel::TpGradient::kSumOverTp) tp_summed.push_back(r);
      if (!piece.replicated || par.tp_rank == 0) owned.push_back(r);
    }
  }
  total = offset;
}

void CudaModel::Impl::plan_gradient_buckets() {
  const size_t layers = static_cast<size_t>(config.n_layer);
  buckets.assign(layers + 1, {});
  const std::string prefix = "backbone.layers.";
  for (const ParameterInfo& e : entries) {
    size_t bucket = layers;
    if (e.name.rfind(prefix, 0) == 0) {
      bucket = std::stoul(e.name.substr(prefix.size()));  // stops at the '.' after the index
      if (bucket >= layers) {
        fail(ErrorKind::kInternal, "CudaModel: parameter {} names a layer beyond n_layer={}",
             e.name, layers);
      }
    }
    std::vector<Range>& list = buckets[bucket];
    if (!list.empty() && list.back().offset + list.back().count == e.offset) {
      list.back().count += e.size;
    } else {
      list.push_back({e.offset, e.size});
    }
  }
  if (sharded()) {
    overlap_beside_tp = sm_count >= 2 * parallel::GroupOptions::kMaxCtas;
    if (!overlap_beside_tp) {
      spdlog::info(
          "CudaModel: device {} has {} SMs, fewer than two NCCL kernels of {} blocks need: the "
          "data-parallel gradients are averaged after the backward, not beside it",
          device, sm_count, parallel::GroupOptions::kMaxCtas);
    }
  }
  MEGACPP_CUDA_CHECK(cudaStreamCreateWithFlags(&reduce_stream, cudaStreamNonBlocking));
  bucket_ready.assign(buckets.size(), nullptr);
  for (cudaEvent_t& e : bucket_ready) {
    MEGACPP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  MEGACPP_CUDA_CHECK(cudaEventCreateWithFlags(&buckets_reduced, cudaEventDisableTiming));
}

// Enqueues the DP average of one bucket on reduce_stream, behind the work the compute stream has
// enqueued so far (which last wrote those gradients).
void CudaModel::Impl::reduce_bucket(size_t bucket) {
  MEGACPP_CUDA_CHECK(cudaEventRecord(bucket_ready[bucket], stream));
  MEGACPP_CUDA_CHECK(cudaStreamWaitEvent(reduce_stream, bucket_ready[bucket], 0));
  parallel::CudaCommunicator::Batch together(*par.data_group);
  for (const Range& r : buckets[bucket]) {
    par.data_group->all_reduce(grads + r.offset, r.count, parallel::CollectiveType::kFloat,
                               parallel::ReduceOp::kAverage, reduce_stream);
  }
  together.end();
}

void CudaModel::Impl::tp_reduce_scatter_output() {
  if (!sharded()) return;
  par.tensor_group->reduce_scatter(delta, my_rows(delta), slot_elements(),
                                   parallel::CollectiveType::kBf16, parallel::ReduceOp::kSum,
                                   stream);
  lap("tensor-parallel reduce-scatter forward");
}

void CudaModel::Impl::tp_all_gather(uint16_t* whole, void* on) {
  if (!sharded()) return;
  par.tensor_group->all_gather(my_rows(whole), whole, slot_elements(),
                               parallel::CollectiveType::kBf16, on);
}

void CudaModel::Impl::tp_sum_loss() {
  if (!sharded()) return;
  par.tensor_group->all_reduce(loss, 1, parallel::CollectiveType::kFloat, parallel::ReduceOp::kSum,
                               stream);
  lap("tensor-parallel loss sum");
}

void CudaModel::Impl::norm_site_backward(uint16_t* output_gradient, void* on) {
  const size_t site = backward_site;
  const cuda::RowsRef dy = sharded() ? cuda::RowsRef{my_rows(dnormed_half), nullptr}
                                     : cuda::RowsRef{nullptr, my_rows(dnormed)};
  norm_op->backward(residual[site], value(site_weight[site]), rstd[site], dy, dresidual, dresidual,
                    grad(site_weight[site]), true, on);
  if (site == 0) return;  // the embedding's backward takes dresidual as it is
  output_gradient_from_residual(output_gradient, on);
}

void CudaModel::Impl::output_gradient_from_residual(uint16_t* output_gradient, void* on) {
  cuda::cast_f32_to_bf16(dresidual, my_rows(output_gradient), local_elements(), on);
  tp_all_gather(output_gradient, on);
}

void CudaModel::Impl::make_tp_stream() {
  // The highest priority: the blocks of the site's backward (collectives, norm, cast) take SMs
  // as the GEMMs beside it free them, instead of queueing behind all of their tiles.
  int lowest = 0, highest = 0;
  MEGACPP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
  MEGACPP_CUDA_CHECK(cudaStreamCreateWithPriority(&tp_stream, cudaStreamNonBlocking, highest));
  MEGACPP_CUDA_CHECK(cudaEventCreateWithFlags(&input_gradient_ready, cudaEventDisableTiming));
  MEGACPP_CUDA_CHECK(cudaEventCreateWithFlags(&input_gradient_summed, cudaEventDisableTiming));
}

void CudaModel::Impl::start_input_gradient_sum() {
  if (!sharded()) return;
  if (input_gradient_sum_pending) {
    fail(ErrorKind::kInternal,
         "a sublayer backward started a second input-gradient reduction before the first was "
         "finished");
  }
  input_gradient_sum_pending = true;
  MEGACPP_CUDA_CHECK(cudaEventRecord(input_gradient_ready, stream));
  MEGACPP_CUDA_CHECK(cudaStreamWaitEvent(tp_stream, input_gradient_ready, 0));
  par.tensor_group->reduce_scatter(dnormed_half, my_rows(dnormed_half), slot_elements(),
                                   parallel::CollectiveType::kBf16, parallel::ReduceOp::kSum,
                                   tp_stream);
  norm_site_backward(ddelta_next, tp_stream);
  MEGACPP_CUDA_CHECK(cudaEventRecord(input_gradient_summed, tp_stream));
}

void CudaModel::Impl::finish_input_gradient_sum() {
  if (!sharded()) {
    // One GPU: the site's backward in order on the compute stream, after the weight gradients
    // have read the sublayer's output gradient.
    norm_site_backward(ddelta, stream);
    lap("add+rmsnorm backward, residual gradient to bf16");
    return;
  }
  // Waiting on an event no reduction recorded would let the compute stream go on before the
  // other ranks' parts are in dnormed: wrong gradients, silently.
  if (!input_gradient_sum_pending) {
    fail(ErrorKind::kInternal,
         "a sublayer backward returned without starting its input-gradient reduction "
         "(start_input_gradient_sum)");
  }
  input_gradient_sum_pending = false;
  MEGACPP_CUDA_CHECK(cudaStreamWaitEvent(stream, input_gradient_summed, 0));
  std::swap(ddelta, ddelta_next);
  lap("tensor-parallel reduce-scatter, norm backward, all-gather (not hidden)");
}

void CudaModel::Impl::dp_average_loss() {
  if (par.data_group == nullptr) return;
  par.data_group->all_reduce(loss, 1, parallel::CollectiveType::kFloat,
                             parallel::ReduceOp::kAverage, stream);
}

void CudaModel::Impl::scatter_from_host(const float* global, float* local) const {
  if (!sharded()) {
    MEGACPP_CUDA_CHECK(cudaMemcpyAsync(local, global, static_cast<size_t>(total) * sizeof(float),
                                       cudaMemcpyHostToDevice, stream));
    MEGACPP_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  std::vector<float> staging(static_cast<size_t>(total));
  for (size_t id = 0; id < entries.size(); ++id) {
    parallel::extract_shard(plan->at(entries[id].name), par.tp_rank,
                            global + host_entries[id].offset, staging.data() + entries[id].offset);
  }
  MEGACPP_CUDA_CHECK(cudaMemcpyAsync(local, staging.data(), staging.size() * sizeof(float),
                                     cudaMemcpyHostToDevice, stream));
  MEGACPP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void CudaModel::Impl::gather_to_host(const float* local, float* global) const {
  if (!sharded()) {
    MEGACPP_CUDA_CHECK(cudaMemcpyAsync(global, local, static_cast<size_t>(total) * sizeof(float),
                                       cudaMemcpyDeviceToHost, stream));
    MEGACPP_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  const int tp = par.tensor_parallel;
  std::vector<float> shards;
  for (size_t id = 0; id < entries.size(); ++id) {
    const ParameterInfo& e = entries[id];
    const parallel::ParameterPlan& p = plan->at(e.name);
    float* out = global + host_entries[id].offset;
    if (p.split == parallel::Split::kReplicated || p.split == parallel::Split::kReplicatedSummed) {
      MEGACPP_CUDA_CHECK(cudaMemcpyAsync(out, local + e.offset,
                                         static_cast<size_t>(e.size) * sizeof(float),
                                         cudaMemcpyDeviceToHost, stream));
      continue;
    }
    // Every rank's shard of a parameter has the same size: the plan splits evenly.
    par.tensor_group->all_gather(local + e.offset, gather_scratch, e.size,
                                 parallel::CollectiveType::kFloat, stream);
    shards.resize(static_cast<size_t>(e.size) * tp);
    MEGACPP_CUDA_CHECK(cudaMemcpyAsync(shards.data(), gather_scratch, shards.size() * sizeof(float),
                                       cudaMemcpyDeviceToHost, stream));
    MEGACPP_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int r = 0; r < tp; ++r) {
      parallel::insert_shard(p, r, shards.data() + static_cast<size_t>(r) * e.size, out);
    }
  }
  MEGACPP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

CudaModel::CudaModel(const Model<float>& host, int batch, int seqlen,
                     const OptimizerConfig& optimizer, int device,
                     const CudaModelParallel& parallel, cuda::GemmPlanCache* plan_cache,
                     const CudaModelOptions& options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  if (batch <= 0 || seqlen <= 0) {
    fail(ErrorKind::kInvalidArgument, "batch={} and seqlen={} must be positive", batch, seqlen);
  }
  m.config = host.config();
  m.optimizer = optimizer;
  m.device = device;
  m.batch = batch;
  m.seqlen = seqlen;
  m.rows = batch * seqlen;
  MEGACPP_CUDA_CHECK(cudaSetDevice(device));
  MEGACPP_CUDA_CHECK(cudaDeviceGetAttribute(&m.sm_count, cudaDevAttrMultiProcessorCount, device));
  m.free_before = free_device_bytes();
  MEGACPP_CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));

  const ParameterSet<float>& set = host.parameters();
  m.host_total = set.total();
  m.host_entries = set.entries();
  m.plan_parallel(parallel);
  if (m.par.data_group != nullptr) m.plan_gradient_buckets();
  if (m.sharded()) m.make_tp_stream();
  m.plan_buffers(options);
  m.allocate_and_build(plan_cache);
}

void CudaModel::Impl::plan_buffers(const CudaModelOptions& options) {
  Impl& m = *this;
  const ModelConfig& c = m.config;
  const parallel::RankGeometry& geo = m.plan->geometry(m.par.tp_rank);
  const size_t row_count = static_cast<size_t>(m.rows), dm = static_cast<size_t>(c.d_model);
  const size_t local_count = static_cast<size_t>(m.split.rows);
  const size_t padded_count = static_cast<size_t>(m.split.padded_rows());
  DeviceArena& a = m.arena;

  const size_t n = static_cast<size_t>(m.total);
  a.reserve(&m.values, n, "parameters");
  a.reserve(&m.grads, n, "gradients");
  a.reserve(&m.exp_avg, n, "AdamW exp_avg");
  a.reserve(&m.exp_avg_sq, n, "AdamW exp_avg_sq");
  a.reserve(&m.values_bf16, n, "bf16 weights");

  m.embedding = m.param("backbone.embedding.weight");
  m.norm_f = m.param("backbone.norm_f.weight");
  m.lm_head = c.tie_embeddings ? m.embedding : m.param("lm_head.weight");

  // Sizes of the shared backward scratch: the largest need of any sublayer.
  size_t scratch_a_size = row_count * dm, scratch_b_size = row_count * dm, scratch_c_size = 0,
         param_scratch_size = 0;
  m.recompute_in_proj = options.recompute_in_proj;
  m.attention_engine = options.attention;
  m.deterministic = options.deterministic;
  if (options.tensor_parallel_reserved_sms < CudaModelOptions::kReservedSmsByDegree) {
    fail(ErrorKind::kInvalidArgument,
         "CudaModelOptions.tensor_parallel_reserved_sms={} must be a count of SMs, 0 for none or "
         "{} for the default of the tensor-parallel degree",
         options.tensor_parallel_reserved_sms, CudaModelOptions::kReservedSmsByDegree);
  }
  m.reserved_sms = options.reserved_sms(m.split.tensor_parallel);
  if (options.tensor_parallel_copy_engines && !m.sharded()) {
    fail(ErrorKind::kInvalidArgument,
         "CudaModelOptions.tensor_parallel_copy_engines=true needs tensor parallelism "
         "(tensor_parallel={}): there are no all-gathers to move",
         m.par.tensor_parallel);
  }
  if (m.par.tensor_group != nullptr &&
      m.par.tensor_group->copy_engines() != options.tensor_parallel_copy_engines) {
    fail(ErrorKind::kInvalidArgument,
         "CudaModelOptions.tensor_parallel_copy_engines={} but the tensor-parallel group was split "
         "{}for copy engines: split it with copy_engines={} (CudaCommunicator::split)",
         options.tensor_parallel_copy_engines, m.par.tensor_group->copy_engines() ? "" : "not ",
         options.tensor_parallel_copy_engines);
  }
  size_t shared_proj_size = 0;  // recompute_in_proj: one in_proj output for every Mamba layer
  size_t workspace = 0, scan_backward = 0;
  const auto need_workspace = [&](size_t bytes) {
    workspace = std::max(workspace, bytes);
  };

  m.blocks.resize(static_cast<size_t>(c.n_layer));
  for (int i = 0; i < c.n_layer; ++i) {
    Impl::Block& b = m.blocks[static_cast<size_t>(i)];
    const std::string p = "backbone.layers." + std::to_string(i) + ".";
    b.norm = m.param(p + "norm.weight");
    m.site_weight.push_back(b.norm);
    if (c.is_attention_layer(i)) {
      auto layer = std::make_unique<Impl::AttentionLayer>();
      layer->in_proj = m.param(p + "mixer.in_proj.weight");
      layer->in_bias = m.param(p + "mixer.in_proj.bias", false);
      layer->out_proj = m.param(p + "mixer.out_proj.weight");
      layer->out_bias = m.param(p + "mixer.out_proj.bias", false);
      layer->q_heads = geo.attn_q_heads.count;
      layer->kv_heads = geo.attn_kv_heads.count;
      layer->head_dim = c.attn_head_dim();
      layer->width = (layer->q_heads + 2 * layer->kv_heads) * layer->head_dim;
      const size_t width = static_cast<size_t>(layer->width);
      const size_t ctx = static_cast<size_t>(layer->q_heads) * layer->head_dim;
      a.reserve(&layer->qkv, row_count * width, p + "qkv");
      a.reserve(&layer->ctx, row_count * ctx, p + "ctx");
      a.reserve(&layer->lse, row_count * static_cast<size_t>(layer->q_heads), p + "lse");
      scratch_a_size = std::max(scratch_a_size, row_count * ctx);    // dctx
      scratch_b_size = std::max(scratch_b_size, row_count * width);  // dqkv
      need_workspace(cuda::LinearCuda::workspace_bytes({m.rows, c.d_model, layer->width}));
      need_workspace(cuda::LinearCuda::workspace_bytes({m.rows, static_cast<int>(ctx), c.d_model}));
      const cuda::AttentionShape shape{m.batch,         m.seqlen,        layer->q_heads,
                                       layer->kv_heads, layer->head_dim, c.attn_softmax_scale()};
      need_workspace(m.attention_engine == AttentionEngine::kCudnn
                         ? cuda::CausalAttentionCudnn::workspace_bytes(shape, m.deterministic)
                         : cuda::CausalAttentionCuda::workspace_bytes(shape));
      b.attention = std::move(layer);
    } else {
      auto layer = std::make_unique<Impl::MambaLayer>();
      const std::string q = p + "mixer.";
      layer->in_proj = m.param(q + "in_proj.weight");
      layer->dt_bias = m.param(q + "dt_bias");
      layer->b_bias = m.param(q + "B_bias");
      layer->c_bias = m.param(q + "C_bias");
      layer->b_norm = m.param(q + "B_norm.weight");
      layer->c_norm = m.param(q + "C_norm.weight");
      layer->mimo_x = m.param(q + "mimo_x");
      layer->mimo_z = m.param(q + "mimo_z");
      layer->mimo_o = m.param(q + "mimo_o");
      layer->d = m.param(q + "D");
      layer->out_proj = m.param(q + "out_proj.weight");
      layer->shape = mamba3_preprocess_shape(c, m.rows);
      layer->shape.heads = geo.ssm_heads.count;
      layer->shape.groups = geo.ssm_groups.count;
      const ops::Mamba3PreprocessShape& s = layer->shape;
      const size_t cols = static_cast<size_t>(s.columns());
      const size_t di = static_cast<size_t>(s.d_inner());
      layer->proj_stride =
          static_cast<int>((cols + kProjRowAlignment - 1) / kProjRowAlignment * kProjRowAlignment);
      const size_t proj_size = row_count * static_cast<size_t>(layer->proj_stride);
      if (options.recompute_in_proj) {
        shared_proj_size = std::max(shared_proj_size, proj_size);  // pointed at after allocate()
      } else {
        a.reserve(&layer->proj, proj_size, q + "proj");
      }
      a.reserve(&layer->scan_in, scan_input_elements(s, row_count, false), q + "scan inputs");
      a.reserve(&layer->y, row_count * di, q + "y");
      scratch_a_size = std::max(scratch_a_size, row_count * di);    // dy of the scan
      scratch_b_size = std::max(scratch_b_size, row_count * cols);  // dproj
      scratch_c_size = std::max(scratch_c_size, scan_input_elements(s, row_count, true));
      const size_t h = static_cast<size_t>(s.heads);
      const size_t rn = static_cast<size_t>(s.rank) * s.state;
      const size_t rp = static_cast<size_t>(s.rank) * s.headdim;
      // The scan's 6 parameter gradients, then the preprocessing's 3.
      param_scratch_size =
          std::max(param_scratch_size, 2 * h * rn + 3 * h * rp + h + h + 2 * s.state);
      const ops::ScanShape scan = s.scan_shape(m.batch, m.seqlen, c.ssm.chunk_size);
      scan_backward = std::max(scan_backward, cuda::Mamba3ScanCuda::backward_workspace_bytes(scan));
      // As allocate_and_build makes them: no PsiV cache, the backward temporaries shared.
      m.layer_workspace_bytes += cuda::Mamba3ScanCuda::own_workspace_bytes(scan, false, true) +
                                 cuda::Mamba3PreprocessCuda::workspace_bytes(s);
      need_workspace(cuda::LinearCuda::workspace_bytes({m.rows, c.d_model, s.columns()}));
      need_workspace(cuda::LinearCuda::workspace_bytes({m.rows, s.d_inner(), c.d_model}));
      b.mamba = std::move(layer);
    }
    if (c.d_intermediate > 0) {
      b.norm2 = m.param(p + "norm2.weight");
      m.site_weight.push_back(b.norm2);
      auto layer = std::make_unique<Impl::MlpLayer>();
      layer->fc1 = m.param(p + "mlp.fc1.weight");
      layer->fc2 = m.param(p + "mlp.fc2.weight");
      const size_t hidden = static_cast<size_t>(geo.mlp_hidden.count);
      a.reserve(&layer->fc1_out, row_count * 2 * hidden, p + "mlp fc1_out");
      a.reserve(&layer->act, row_count * hidden, p + "mlp act");
      scratch_a_size = std::max(scratch_a_size, row_count * hidden);      // dact
      scratch_b_size = std::max(scratch_b_size, row_count * 2 * hidden);  // dfc1_out
      need_workspace(
          cuda::GatedMlpCuda::workspace_bytes({m.rows, c.d_model, geo.mlp_hidden.count}));
      b.mlp = std::move(layer);
    }
  }
  m.site_weight.push_back(m.norm_f);

  const size_t sites = m.site_weight.size();
  m.residual.assign(sites, nullptr);
  m.normed.assign(sites, nullptr);
  m.rstd.assign(sites, nullptr);
  // Tensor parallel: what the all-gathers read and write, in an arena of its own that every rank
  // plans alike (the same sizes in the same order), so it can be NCCL's symmetric memory.
  DeviceArena& gathered = m.sharded() ? m.gathered_arena : a;
  for (size_t k = 0; k < sites; ++k) {
    a.reserve(&m.residual[k], local_count * dm, "residual " + std::to_string(k));
    gathered.reserve(&m.normed[k], padded_count * dm, "normed " + std::to_string(k));
    a.reserve(&m.rstd[k], local_count, "rstd " + std::to_string(k));
  }
  a.reserve(&m.inputs, row_count, "input tokens");
  a.reserve(&m.targets, row_count, "target tokens");
  a.reserve(&m.delta, padded_count * dm, "sublayer output");
  gathered.reserve(&m.ddelta, padded_count * dm, "sublayer output gradient");
  if (m.sharded()) {
    gathered.reserve(&m.ddelta_next, padded_count * dm, "next sublayer output gradient");
  }
  a.reserve(&m.dresidual, local_count * dm, "residual gradient");
  if (m.sharded()) {
    a.reserve(&m.dnormed_half, padded_count * dm, "normed gradient");
  } else {
    a.reserve(&m.dnormed, padded_count * dm, "normed gradient");
  }
  a.reserve(&m.scratch_a, scratch_a_size, "backward scratch a");
  a.reserve(&m.scratch_b, scratch_b_size, "backward scratch b");
  a.reserve(&m.scratch_c, std::max<size_t>(scratch_c_size, 1), "scan input gradients");
  a.reserve(&m.param_scratch, std::max<size_t>(param_scratch_size, 1), "mixer parameter gradients");
  a.reserve(&m.loss, 1, "loss");
  a.reserve(&m.grad_norm, 1, "gradient norm");
  a.reserve(&m.clip_scale, 1, "clip scale");
  a.reserve(&m.square_sum, 1, "gradient square sum");
  if (m.sharded()) {
    for (const Impl::Range& r : m.tp_summed) {
      (r.count >= Impl::kDirectSumElements ? m.tp_direct : m.tp_packed_ranges).push_back(r);
    }
    for (const Impl::Range& r : m.tp_packed_ranges) {
      m.tp_packed += r.count;
      m.tp_packed_longest = std::max(m.tp_packed_longest, r.count);
    }
    a.reserve(&m.tp_pack, static_cast<size_t>(std::max<int64_t>(m.tp_packed, 1)),
              "tensor-parallel gradient sums, packed");
    a.reserve(&m.tp_pack_table, std::max<size_t>(m.tp_packed_ranges.size(), 1) * 3,
              "tensor-parallel gradient sums' ranges");
    int64_t largest = 1;
    for (const parallel::ParameterPlan& p : m.plan->parameters()) {
      if (p.split == parallel::Split::kColumn || p.split == parallel::Split::kRow) {
        largest = std::max(largest, p.numel());
      }
    }
    a.reserve(&m.gather_scratch, static_cast<size_t>(largest), "shard gather scratch");
  }

  need_workspace(cuda::EmbeddingCuda::workspace_bytes(m.embedding_shape()));
  // Its own: under tensor parallelism the norm backward runs on tp_stream beside the GEMMs.
  m.norm_op_workspace_bytes = cuda::ResidualRmsNormCuda::workspace_bytes(m.norm_shape());
  a.reserve(reinterpret_cast<char**>(&m.norm_op_workspace), m.norm_op_workspace_bytes,
            "norm backward partials");
  need_workspace(cuda::LmHeadLossCuda::workspace_bytes(m.lm_head_shape()));
  m.op_workspace_bytes = workspace;
  m.scan_backward_bytes = scan_backward;
  if (scan_backward > 0) {
    a.reserve(reinterpret_cast<char**>(&m.scan_backward_workspace), scan_backward,
              "scan backward temporaries");
  }
  a.reserve(reinterpret_cast<char**>(&m.op_workspace), workspace, "op workspace");

  // The optimizer's tables hold the tensors' addresses, which exist only after allocate():
  // their sizes depend on the tensor sizes alone, so they are computed from placeholders.
  std::vector<cuda::GradTensorRef> grad_refs;
  for (const Impl::Range& r : m.owned) {
    grad_refs.push_back({reinterpret_cast<const float*>(alignof(float)), r.count});
  }
  std::vector<cuda::AdamWTensorRef> adamw_refs;
  const auto placeholder = reinterpret_cast<float*>(alignof(float));
  for (const ParameterInfo& e : m.entries) {
    adamw_refs.push_back(
        {placeholder, placeholder, placeholder, placeholder, nullptr, e.size, e.weight_decay});
  }
  m.norm_workspace_bytes = cuda::GradNormCuda::workspace_bytes(grad_refs);
  m.adamw_workspace_bytes = cuda::AdamWCuda::workspace_bytes(adamw_refs);
  a.reserve(reinterpret_cast<char**>(&m.norm_workspace), m.norm_workspace_bytes,
            "gradient norm tables");
  a.reserve(reinterpret_cast<char**>(&m.adamw_workspace), m.adamw_workspace_bytes, "AdamW tables");
  if (shared_proj_size > 0) {
    a.reserve(&m.shared_proj, shared_proj_size, "in_proj output (shared, recomputed)");
  }
}

void CudaModel::Impl::allocate_and_build(cuda::GemmPlanCache* plan_cache) {
  Impl& m = *this;
  const ModelConfig& c = m.config;
  const parallel::RankGeometry& geo = m.plan->geometry(m.par.tp_rank);
  const size_t n = static_cast<size_t>(m.total);
  if (m.sharded() && m.par.tensor_group->copy_engines()) {
    // One symmetric window: every rank registers the same size, and each buffer sits at the same
    // offset in it on every rank, as NCCL's symmetric collectives address their peers' buffers.
    const auto bytes = static_cast<int64_t>(m.gathered_arena.bytes());
    const int64_t ranks = m.par.tensor_group->size();
    const int64_t unequal = m.par.tensor_group->sum_over_ranks(
        m.par.tensor_group->sum_over_ranks(bytes) == ranks * bytes ? 0 : 1);
    if (unequal != 0) {
      fail(ErrorKind::kInternal,
           "CudaModelOptions.tensor_parallel_copy_engines: the ranks plan the all-gathers' "
           "buffers at different sizes (this rank {} bytes); the copy engines need one plan on "
           "every rank",
           bytes);
    }
    m.symmetric_arena = m.par.tensor_group->allocate_symmetric(m.gathered_arena.bytes());
  }
  m.arena.allocate();
  m.gathered_arena.allocate(m.symmetric_arena);
  if (!m.tp_packed_ranges.empty()) {
    std::vector<int64_t> table;
    int64_t start = 0;
    for (const Impl::Range& r : m.tp_packed_ranges) {
      table.insert(table.end(), {r.offset, r.count, start});
      start += r.count;
    }
    MEGACPP_CUDA_CHECK(cudaMemcpyAsync(m.tp_pack_table, table.data(),
                                       table.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                                       m.stream));
    MEGACPP_CUDA_CHECK(cudaStreamSynchronize(m.stream));  // `table` goes out of scope
  }
  for (Impl::Block& b : m.blocks) {
    if (b.mamba && m.recompute_in_proj) b.mamba->proj = m.shared_proj;
  }

  void* ws = m.op_workspace;
  const size_t wsb = m.op_workspace_bytes;
  m.embedding_op = std::make_unique<cuda::EmbeddingCuda>(m.embedding_shape(), ws, wsb);
  m.norm_op = std::make_unique<cuda::ResidualRmsNormCuda>(m.norm_shape(), m.norm_op_workspace,
                                                          m.norm_op_workspace_bytes);
  m.lm_head_op = std::make_unique<cuda::LmHeadLossCuda>(m.lm_head_shape(), ws, wsb, plan_cache);
  std::shared_ptr<cuda::CausalAttentionCudnn> shared_attention;
  bool chunk_noted = false;
  // Tensor parallel: the weight-gradient GEMMs leave reserved_sms SMs to tp_stream's kernels.
  int wgrad_sms = 0;
  if (m.sharded() && m.reserved_sms > 0) {
    if (m.reserved_sms >= m.sm_count) {
      fail(ErrorKind::kInvalidArgument,
           "CudaModelOptions.tensor_parallel_reserved_sms={} leaves the weight-gradient GEMMs no "
           "SM of device {}'s {}",
           m.reserved_sms, m.device, m.sm_count);
    }
    wgrad_sms = m.sm_count - m.reserved_sms;
  }
  for (Impl::Block& b : m.blocks) {
    if (b.attention) {
      Impl::AttentionLayer& l = *b.attention;
      l.in_linear = std::make_unique<cuda::LinearCuda>(
          cuda::LinearShape{m.rows, c.d_model, l.width}, ws, wsb, plan_cache, wgrad_sms);
      l.out_linear = std::make_unique<cuda::LinearCuda>(
          cuda::LinearShape{m.rows, l.q_heads * l.head_dim, c.d_model}, ws, wsb, plan_cache,
          wgrad_sms);
      const cuda::AttentionShape shape{m.batch,    m.seqlen,   l.q_heads,
                                       l.kv_heads, l.head_dim, c.attn_softmax_scale()};
      if (m.attention_engine == AttentionEngine::kCudnn) {
        if (!shared_attention) {
          // q, k and v are views into the packed qkv rows.
          shared_attention = std::make_shared<cuda::CausalAttentionCudnn>(
              shape, l.width, l.width, m.deterministic, ws, wsb, m.device, plan_cache);
        }
        const cuda::AttentionShape& built = shared_attention->shape();
        if (built.q_heads != shape.q_heads || built.kv_heads != shape.kv_heads ||
            built.head_dim != shape.head_dim) {
          fail(ErrorKind::kInternal,
               "CudaModel: attention layers of different shapes ({}/{} heads of {} and {}/{} of "
               "{}) cannot share one cuDNN op",
               built.q_heads, built.kv_heads, built.head_dim, shape.q_heads, shape.kv_heads,
               shape.head_dim);
        }
        l.attention_cudnn = shared_attention;
      } else {
        l.attention = std::make_unique<cuda::CausalAttentionCuda>(shape, ws, wsb);
      }
    }
    if (b.mamba) {
      Impl::MambaLayer& l = *b.mamba;
      l.in_linear = std::make_unique<cuda::LinearCuda>(
          cuda::LinearShape{m.rows, c.d_model, l.shape.columns(), l.proj_stride}, ws, wsb,
          plan_cache, wgrad_sms);
      l.out_linear = std::make_unique<cuda::LinearCuda>(
          cuda::LinearShape{m.rows, l.shape.d_inner(), c.d_model}, ws, wsb, plan_cache, wgrad_sms);
      l.preprocess = std::make_unique<cuda::Mamba3PreprocessCuda>(l.shape, l.proj_stride);
      // The layers' backwards run one after another: they share the scan's temporaries.
      l.scan = std::make_unique<cuda::Mamba3ScanCuda>(
          l.shape.scan_shape(m.batch, m.seqlen, c.ssm.chunk_size), false, true,
          m.scan_backward_workspace, m.scan_backward_bytes);
      if (l.scan->planned_chunk() != c.ssm.chunk_size && !chunk_noted) {
        // The same recurrence at a finer tiling, with other rounding: said once here, and in every
        // receipt's kernel records.
        spdlog::info(
            "mamba scan runs at chunk {} (config chunk_size {}): its backward's shared memory at "
            "chunk {} exceeds what device {} allows a block",
            l.scan->planned_chunk(), c.ssm.chunk_size, c.ssm.chunk_size, m.device);
        chunk_noted = true;
      }
    }
    if (b.mlp) {
      b.mlp->mlp = std::make_unique<cuda::GatedMlpCuda>(
          cuda::GatedMlpShape{m.rows, c.d_model, geo.mlp_hidden.count}, ws, wsb, plan_cache,
          wgrad_sms);
    }
  }
  std::vector<cuda::GradTensorRef> grad_refs;
  for (const Impl::Range& r : m.owned) grad_refs.push_back({m.grads + r.offset, r.count});
  m.grad_norm_op =
      std::make_unique<cuda::GradNormCuda>(grad_refs, m.norm_workspace, m.norm_workspace_bytes);
  std::vector<cuda::AdamWTensorRef> adamw_refs;
  for (const ParameterInfo& e : m.entries) {
    adamw_refs.push_back({m.values + e.offset, m.grads + e.offset, m.exp_avg + e.offset,
                          m.exp_avg_sq + e.offset, m.values_bf16 + e.offset, e.size,
                          e.weight_decay});
  }
  m.adamw_op =
      std::make_unique<cuda::AdamWCuda>(adamw_refs, m.adamw_workspace, m.adamw_workspace_bytes);
  if (m.split.padded_rows() > m.rows) {
    // The last rank's slot ends past the micro-batch. No op writes those rows: the collectives
    // only sum and copy them among themselves, so zeroed once they stay zero (and no collective
    // reads memory nothing wrote).
    const size_t first = static_cast<size_t>(m.rows) * c.d_model;
    const size_t pad = static_cast<size_t>(m.split.padded_rows() - m.rows) * c.d_model;
    MEGACPP_CUDA_CHECK(cudaMemsetAsync(m.delta + first, 0, pad * sizeof(uint16_t), m.stream));
    MEGACPP_CUDA_CHECK(cudaMemsetAsync(m.ddelta + first, 0, pad * sizeof(uint16_t), m.stream));
    MEGACPP_CUDA_CHECK(cudaMemsetAsync(m.ddelta_next + first, 0, pad * sizeof(uint16_t), m.stream));
    MEGACPP_CUDA_CHECK(
        cudaMemsetAsync(m.dnormed_half + first, 0, pad * sizeof(uint16_t), m.stream));
    for (uint16_t* site : m.normed) {
      MEGACPP_CUDA_CHECK(cudaMemsetAsync(site + first, 0, pad * sizeof(uint16_t), m.stream));
    }
  }
  MEGACPP_CUDA_CHECK(cudaMemsetAsync(m.grads, 0, n * sizeof(float), m.stream));
  MEGACPP_CUDA_CHECK(cudaMemsetAsync(m.exp_avg, 0, n * sizeof(float), m.stream));
  MEGACPP_CUDA_CHECK(cudaMemsetAsync(m.exp_avg_sq, 0, n * sizeof(float), m.stream));
  MEGACPP_CUDA_CHECK(cudaStreamSynchronize(m.stream));
}

CudaModel::Impl::~Impl() {
  // A constructor that threw half way leaves some handles null; destroying a null event would
  // leave an error behind for this thread's next launch check to report.
  const auto destroy = [](cudaEvent_t e) {
    if (e != nullptr) cudaEventDestroy(e);
  };
  if (stream != nullptr) {
    cudaStreamSynchronize(stream);
    drop_graph();
    for (cudaEvent_t e : events) destroy(e);
    if (reduce_stream != nullptr) {
      cudaStreamSynchronize(reduce_stream);
      for (cudaEvent_t e : bucket_ready) destroy(e);
      destroy(buckets_reduced);
      cudaStreamDestroy(reduce_stream);
    }
    if (tp_stream != nullptr) {
      cudaStreamSynchronize(tp_stream);
      destroy(input_gradient_ready);
      destroy(input_gradient_summed);
      cudaStreamDestroy(tp_stream);
    }
    cudaStreamDestroy(stream);
  }
  if (symmetric_arena != nullptr) {
    try {
      par.tensor_group->free_symmetric(symmetric_arena);
    } catch (const std::exception& e) {
      spdlog::warn("CudaModel: {}", e.what());
    }
  }
}

CudaModel::~CudaModel() = default;

int CudaModel::batch() const {
  return impl_->batch;
}
int CudaModel::seqlen() const {
  return impl_->seqlen;
}
CudaMemoryPlan CudaModel::memory_plan() const {
  // What the layers' ops allocated, as they report it (not the plan's count of it).
  uint64_t layer_workspaces = 0;
  for (const Impl::Block& b : impl_->blocks) {
    if (b.mamba) {
      layer_workspaces += b.mamba->scan->workspace_bytes() + b.mamba->preprocess->workspace_bytes();
    }
  }
  return {impl_->arena.bytes() + impl_->gathered_arena.bytes(), layer_workspaces};
}

CudaMemoryPlan CudaModel::plan_memory(const ModelConfig& config, int batch, int seqlen,
                                      int tensor_parallel, int tp_rank,
                                      const CudaModelOptions& options) {
  if (batch <= 0 || seqlen <= 0) {
    fail(ErrorKind::kInvalidArgument, "batch={} and seqlen={} must be positive", batch, seqlen);
  }
  Impl m;
  m.config = config;
  m.batch = batch;
  m.seqlen = seqlen;
  m.rows = batch * seqlen;
  // The host model's parameter list without its values: the shard plan lists every parameter
  // in ParameterSet's registration order with its global shape.
  const parallel::ShardPlan global(config, parallel::ParallelConfig{1, 1});
  for (const parallel::ParameterPlan& p : global.parameters()) {
    ParameterInfo e;
    e.name = p.name;
    e.shape = p.shape;
    e.offset = m.host_total;
    e.size = p.numel();
    m.host_entries.push_back(std::move(e));
    m.host_total += p.numel();
  }
  CudaModelParallel parallel;
  parallel.tensor_parallel = tensor_parallel;
  parallel.tp_rank = tp_rank;
  m.plan_parallel(parallel, true);
  m.plan_buffers(options);
  return {m.arena.bytes() + m.gathered_arena.bytes(), m.layer_workspace_bytes};
}

size_t CudaModel::device_bytes_in_use() const {
  const size_t now = free_device_bytes();
  return impl_->free_before > now ? impl_->free_before - now : 0;
}

void CudaModel::upload(const ParameterSet<float>& params, const AdamW<float>* optimizer) {
  Impl& m = *impl_;
  if (params.total() != m.host_total) {
    fail(ErrorKind::kInternal, "CudaModel::upload: {} parameters, the device model has {}",
         params.total(), m.host_total);
  }
  m.scatter_from_host(params.values().data(), m.values);
  if (optimizer != nullptr) {
    if (optimizer->moments_are_zero()) {
      // A fresh optimizer: clearing is the same as copying 2 × 4 bytes per parameter of zeros.
      const size_t bytes = sizeof(float) * static_cast<size_t>(m.total);
      MEGACPP_CUDA_CHECK(cudaMemsetAsync(m.exp_avg, 0, bytes, m.stream));
      MEGACPP_CUDA_CHECK(cudaMemsetAsync(m.exp_avg_sq, 0, bytes, m.stream));
    } else {
      m.scatter_from_host(optimizer->exp_avg().data(), m.exp_avg);
      m.scatter_from_host(optimizer->exp_avg_sq().data(), m.exp_avg_sq);
    }
    m.steps_taken = optimizer->steps_taken();
  }
  cuda::cast_f32_to_bf16(m.values, m.values_bf16, m.total, m.s());
  MEGACPP_CUDA_CHECK(cudaStreamSynchronize(m.stream));
}

void CudaModel::download(ParameterSet<float>& params, AdamW<float>* optimizer) const {
  const Impl& m = *impl_;
  m.gather_to_host(m.values, params.values().data());
  if (optimizer != nullptr) {
    m.gather_to_host(m.exp_avg, optimizer->exp_avg().data());
    m.gather_to_host(m.exp_avg_sq, optimizer->exp_avg_sq().data());
    optimizer->set_steps_taken(m.steps_taken);
  }
}

std::vector<float> CudaModel::download_gradients() {
  Impl& m = *impl_;
  reduce_gradients();
  std::vector<float> out(static_cast<size_t>(m.host_total));
  m.gather_to_host(m.grads, out.data());
  return out;
}

void CudaModel::reduce_gradients() {
  Impl& m = *impl_;
  if (m.grads_reduced) return;
  if (m.par.data_group != nullptr && !m.dp_reduced) {
    m.par.data_group->all_reduce(m.grads, m.total, parallel::CollectiveType::kFloat,
                                 parallel::ReduceOp::kAverage, m.stream);
  }
  if (m.sharded() && !m.tp_summed.empty()) {
    cuda::pack_ranges_f32(m.grads, m.tp_pack_table, m.packed_range_count(), m.tp_packed_longest,
                          m.tp_pack, m.stream);
    parallel::CudaCommunicator::Batch together(*m.par.tensor_group);
    if (m.tp_packed > 0) {
      m.par.tensor_group->all_reduce(m.tp_pack, m.tp_packed, parallel::CollectiveType::kFloat,
                                     parallel::ReduceOp::kSum, m.stream);
    }
    for (const Impl::Range& r : m.tp_direct) {
      m.par.tensor_group->all_reduce(m.grads + r.offset, r.count, parallel::CollectiveType::kFloat,
                                     parallel::ReduceOp::kSum, m.stream);
    }
    together.end();
    cuda::unpack_ranges_f32(m.tp_pack, m.tp_pack_table, m.packed_range_count(), m.tp_packed_longest,
                            m.grads, m.stream);
  }
  m.lap("gradient all-reduce");
  m.grads_reduced = true;
  m.dp_reduced = false;
}

void CudaModel::set_overlapped_gradient_reduction(bool on) {
  impl_->overlap_dp = on;
}

void CudaModel::zero_grad() {
  Impl& m = *impl_;
  MEGACPP_CUDA_CHECK(
      cudaMemsetAsync(m.grads, 0, static_cast<size_t>(m.total) * sizeof(float), m.stream));
  m.grads_reduced = true;
  m.dp_reduced = false;
}

namespace {

// Splits [batch, seqlen + 1] windows into inputs and next-token targets, refusing what the
// device cannot: an input outside the vocabulary, a target at or beyond it (negative targets are
// ignored rows, as in the CPU loss).
void split_tokens(const ModelConfig& c, int batch, int seqlen, const int32_t* tokens,
                  std::vector<int32_t>& inputs, std::vector<int32_t>& targets) {
  inputs.resize(static_cast<size_t>(batch) * seqlen);
  targets.resize(inputs.size());
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < seqlen; ++t) {
      const int32_t in = tokens[b * (seqlen + 1) + t];
      const int32_t target = tokens[b * (seqlen + 1) + t + 1];
      if (in < 0 || in >= c.vocab_size) {
        fail(ErrorKind::kInvalidArgument,
             "token {} at batch row {}, position {} is outside [0, {})", in, b, t, c.vocab_size);
      }
      if (target >= c.vocab_size) {
        fail(ErrorKind::kInvalidArgument,
             "target token {} at batch row {}, position {} is outside [0, {})", target, b, t + 1,
             c.vocab_size);
      }
      inputs[static_cast<size_t>(b * seqlen + t)] = in;
      targets[static_cast<size_t>(b * seqlen + t)] = target;
    }
  }
}

}  // namespace

void CudaModel::Impl::lap(const char* label) {
  if (!profiling) return;
  if (laps == events.size()) {
    fail(ErrorKind::kInternal, "CudaModel: more than {} timed ops between two synchronizations",
         events.size());
  }
  MEGACPP_CUDA_CHECK(cudaEventRecord(events[laps], stream));
  lap_labels[laps] = label;
  ++laps;
}

void CudaModel::Impl::harvest() {
  for (size_t i = 1; i < laps; ++i) {
    if (lap_labels[i] == nullptr) continue;
    float ms = 0;
    MEGACPP_CUDA_CHECK(cudaEventElapsedTime(&ms, events[i - 1], events[i]));
    op_samples[lap_labels[i]].push_back(ms);
  }
  laps = 0;
}

void CudaModel::Impl::upload_tokens(const int32_t* tokens) {
  split_tokens(config, batch, seqlen, tokens, host_inputs, host_targets);
  const size_t bytes = host_inputs.size() * sizeof(int32_t);
  MEGACPP_CUDA_CHECK(
      cudaMemcpyAsync(inputs, host_inputs.data(), bytes, cudaMemcpyHostToDevice, stream));
  MEGACPP_CUDA_CHECK(
      cudaMemcpyAsync(targets, host_targets.data(), bytes, cudaMemcpyHostToDevice, stream));
}

float CudaModel::Impl::read_loss() {
  float value = 0;
  MEGACPP_CUDA_CHECK(cudaMemcpyAsync(&value, loss, sizeof(float), cudaMemcpyDeviceToHost, stream));
  // The copy lands in pageable memory: the host must wait for it before reading.
  MEGACPP_CUDA_CHECK(cudaStreamSynchronize(stream));
  harvest();
  return value;
}

double CudaModel::forward(const int32_t* tokens) {
  Impl& m = *impl_;
  m.upload_tokens(tokens);
  m.lap(nullptr);
  m.run_forward();
  m.lm_head_op->forward(m.my_rows(m.normed.back()), m.bf16(m.lm_head), m.targets, m.loss, nullptr,
                        m.s());
  m.lap("lm_head+loss forward");
  m.tp_sum_loss();
  m.dp_average_loss();
  return m.read_loss();
}

void CudaModel::Impl::mamba_forward(MambaLayer& l, const uint16_t* x) {
  Impl& m = *this;
  l.in_linear->forward(x, m.bf16(l.in_proj), nullptr, cuda::RowsOut{l.proj, nullptr}, m.s());
  m.lap("mamba in_proj forward");
  const cuda::PreprocessDeviceOutputs in =
      carve_scan_inputs(l.scan_in, l.shape, static_cast<size_t>(m.rows), false);
  l.preprocess->forward(l.proj, {m.value(l.dt_bias), m.value(l.b_norm), m.value(l.c_norm)}, in,
                        m.s());
  m.lap("mamba preprocess forward");
  const cuda::ScanDeviceInputs s = m.scan_inputs(l, in);
  l.scan->forward(s, l.y, m.s());
  m.lap("mamba scan forward");
  l.out_linear->forward(l.y, m.bf16(l.out_proj), nullptr, cuda::RowsOut{m.delta, nullptr}, m.s());
  m.lap("mamba out_proj forward");
  m.tp_reduce_scatter_output();
}

void CudaModel::Impl::attention_forward(AttentionLayer& l, const uint16_t* x) {
  Impl& m = *this;
  const ModelConfig& c = m.config;
  l.in_linear->forward(x, m.bf16(l.in_proj), m.value(l.in_bias), cuda::RowsOut{l.qkv, nullptr},
                       m.s());
  m.lap("attention qkv forward");
  if (c.attn.rotary_emb_dim > 0) {
    // q and k heads are adjacent in the packed row: one rotation covers both.
    cuda::rotary_forward({m.batch, m.seqlen, l.width, 0, l.q_heads + l.kv_heads, l.head_dim,
                          c.attn.rotary_emb_dim, c.attn.rotary_emb_base},
                         l.qkv, m.s());
    m.lap("attention rotary forward");
  }
  const uint16_t* q = l.qkv;
  const uint16_t* k = q + l.q_heads * l.head_dim;
  const uint16_t* v = q + (l.q_heads + l.kv_heads) * l.head_dim;
  if (l.attention_cudnn) {
    l.attention_cudnn->forward(q, k, v, l.ctx, l.lse, m.s());
  } else {
    l.attention->forward(q, k, v, l.width, l.width, l.ctx, l.lse, m.s());
  }
  m.lap("attention core forward");
  // Under tensor parallelism the bias is added once, by rank 0, into the sum of the ranks' parts.
  l.out_linear->forward(l.ctx, m.bf16(l.out_proj),
                        m.par.tp_rank == 0 ? m.value(l.out_bias) : nullptr,
                        cuda::RowsOut{m.delta, nullptr}, m.s());
  m.lap("attention out_proj forward");
  m.tp_reduce_scatter_output();
}

// The forward of every sublayer and norm site; the last site's output is left in the rank's rows of
// normed.back().
void CudaModel::Impl::run_forward() {
  Impl& m = *this;
  m.embedding_op->forward(m.inputs + m.split.first, m.value(m.embedding), m.residual[0], m.s());
  m.lap("embedding forward");
  size_t site = 0;
  const size_t last_site = m.site_weight.size() - 1;
  const auto norm_site = [&](bool with_delta) {
    const float* in = site == 0 ? m.residual[0] : m.residual[site - 1];
    m.norm_op->forward(in, cuda::RowsRef{with_delta ? m.my_rows(m.delta) : nullptr, nullptr},
                       m.value(m.site_weight[site]), m.residual[site], m.my_rows(m.normed[site]),
                       m.rstd[site], m.s());
    m.lap("add+rmsnorm forward");
    // The last site feeds only the lm_head, which takes the rank's rows.
    if (site != last_site && m.sharded()) {
      m.tp_all_gather(m.normed[site], m.s());
      m.lap("tensor-parallel all-gather forward");
    }
  };
  norm_site(false);
  for (Block& b : m.blocks) {
    if (b.mamba) mamba_forward(*b.mamba, m.normed[site]);
    if (b.attention) attention_forward(*b.attention, m.normed[site]);
    ++site;
    norm_site(true);
    if (b.mlp) {
      b.mlp->mlp->forward(m.normed[site], m.bf16(b.mlp->fc1), m.bf16(b.mlp->fc2), b.mlp->fc1_out,
                          b.mlp->act, cuda::RowsOut{m.delta, nullptr}, m.s());
      m.lap("mlp forward");
      m.tp_reduce_scatter_output();
      ++site;
      norm_site(true);
    }
  }
}

// Backward of a Mamba-3 mixer fed x, its output gradient in m.ddelta; dx into m.dnormed.
void CudaModel::Impl::mamba_backward(MambaLayer& l, const uint16_t* x) {
  Impl& m = *this;
  const size_t row_count = static_cast<size_t>(m.rows);
  uint16_t* dy = m.scratch_a;
  uint16_t* dproj = m.scratch_b;
  // out_proj's weight gradient waits until dnormed is being summed (start_input_gradient_sum).
  l.out_linear->backward_input(m.bf16(l.out_proj), m.ddelta, cuda::RowsOut{dy, nullptr}, m.s());
  m.lap("mamba out_proj input gradient");
  if (m.recompute_in_proj) {
    // The same GEMM on the same input as the forward's: the same bits, before the scan's
    // backward, which may read z and x in them.
    l.in_linear->forward(x, m.bf16(l.in_proj), nullptr, cuda::RowsOut{l.proj, nullptr}, m.s());
    m.lap("mamba in_proj recompute");
  }
  const cuda::PreprocessDeviceOutputs in = carve_scan_inputs(l.scan_in, l.shape, row_count, false);
  const cuda::PreprocessDeviceOutputs gin =
      carve_scan_inputs(m.scratch_c, l.shape, row_count, true);
  const cuda::ScanDeviceInputs s = m.scan_inputs(l, in);
  const ops::Mamba3PreprocessShape& sh = l.shape;
  const size_t h = static_cast<size_t>(sh.heads);
  const size_t rn = static_cast<size_t>(sh.rank) * sh.state;
  const size_t rp = static_cast<size_t>(sh.rank) * sh.headdim;
  float* pg = m.param_scratch;
  cuda::ScanDeviceGrads g;
  g.q = gin.q;
  g.k = gin.k;
  g.v = gin.x;
  g.z = gin.z;
  g.adt = gin.adt;
  g.dt = gin.dt;
  g.trap = gin.trap;
  g.angles = gin.angles;
  g.q_bias = pg;
  g.k_bias = pg + h * rn;
  g.mimo_x = pg + 2 * h * rn;
  g.mimo_z = g.mimo_x + h * rp;
  g.mimo_o = g.mimo_z + h * rp;
  g.d = g.mimo_o + h * rp;
  l.scan->backward(s, dy, g, m.s());
  m.lap("mamba scan backward");
  const auto add = [&](const float* src, const Param& p) {
    cuda::add_f32(src, m.grad(p), p.size, m.s());
  };
  add(g.q_bias, l.c_bias);
  add(g.k_bias, l.b_bias);
  add(g.mimo_x, l.mimo_x);
  add(g.mimo_z, l.mimo_z);
  add(g.mimo_o, l.mimo_o);
  add(g.d, l.d);
  m.lap("mamba parameter-gradient adds");
  float* pre = g.d + h;
  cuda::PreprocessDeviceParamGrads pre_grads{pre, pre + h, pre + h + sh.state};
  l.preprocess->backward(l.proj, {m.value(l.dt_bias), m.value(l.b_norm), m.value(l.c_norm)},
                         {gin.z, gin.x, gin.k, gin.q, gin.adt, gin.dt, gin.trap, gin.angles}, dproj,
                         pre_grads, m.s());
  m.lap("mamba preprocess backward");
  add(pre_grads.dt_bias, l.dt_bias);
  add(pre_grads.b_norm_weight, l.b_norm);
  add(pre_grads.c_norm_weight, l.c_norm);
  m.lap("mamba parameter-gradient adds");
  l.in_linear->backward_input(m.bf16(l.in_proj), dproj, m.input_gradient_out(), m.s());
  m.lap("mamba in_proj input gradient");
  m.start_input_gradient_sum();
  l.in_linear->backward_weights(x, dproj, m.grad(l.in_proj), nullptr, true, m.s());
  l.out_linear->backward_weights(l.y, m.ddelta, m.grad(l.out_proj), nullptr, true, m.s());
  m.lap("mamba in_proj and out_proj weight gradients");
}

void CudaModel::Impl::attention_backward(AttentionLayer& l, const uint16_t* x) {
  Impl& m = *this;
  const ModelConfig& c = m.config;
  uint16_t* dctx = m.scratch_a;
  uint16_t* dqkv = m.scratch_b;
  // out_proj's weight gradient waits until dnormed is being summed (start_input_gradient_sum).
  l.out_linear->backward_input(m.bf16(l.out_proj), m.ddelta, cuda::RowsOut{dctx, nullptr}, m.s());
  m.lap("attention out_proj input gradient");
  const uint16_t* q = l.qkv;
  const int k_offset = l.q_heads * l.head_dim, v_offset = (l.q_heads + l.kv_heads) * l.head_dim;
  if (l.attention_cudnn) {
    l.attention_cudnn->backward(q, q + k_offset, q + v_offset, l.ctx, dctx, l.lse, dqkv,
                                dqkv + k_offset, dqkv + v_offset, m.s());
  } else {
    l.attention->backward(q, q + k_offset, q + v_offset, l.width, l.width, l.ctx, dctx, l.lse, dqkv,
                          dqkv + k_offset, dqkv + v_offset, m.s());
  }
  m.lap("attention core backward");
  if (c.attn.rotary_emb_dim > 0) {
    cuda::rotary_backward({m.batch, m.seqlen, l.width, 0, l.q_heads + l.kv_heads, l.head_dim,
                           c.attn.rotary_emb_dim, c.attn.rotary_emb_base},
                          dqkv, m.s());
    m.lap("attention rotary backward");
  }
  l.in_linear->backward_input(m.bf16(l.in_proj), dqkv, m.input_gradient_out(), m.s());
  m.lap("attention qkv input gradient");
  m.start_input_gradient_sum();
  l.in_linear->backward_weights(x, dqkv, m.grad(l.in_proj), m.grad(l.in_bias), true, m.s());
  l.out_linear->backward_weights(l.ctx, m.ddelta, m.grad(l.out_proj), m.grad(l.out_bias), true,
                                 m.s());
  m.lap("attention qkv and out_proj weight gradients");
}

void CudaModel::Impl::drop_graph() {
  if (graph_exec != nullptr) cudaGraphExecDestroy(graph_exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  graph_exec = nullptr;
  graph = nullptr;
}

void CudaModel::Impl::capture_step(float grad_scale) {
  drop_graph();
  // Thread-local mode: another thread's CUDA calls (a second job in the process, a test) are
  // not captured and do not invalidate this capture.
  MEGACPP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    forward_backward_body(grad_scale);
  } catch (...) {
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(stream, &partial);
    if (partial != nullptr) cudaGraphDestroy(partial);
    throw;
  }
  MEGACPP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MEGACPP_CUDA_CHECK(cudaGraphInstantiate(&graph_exec, graph, 0));
  graph_scale = grad_scale;
  ++graph_captures;
}

double CudaModel::forward_backward(const int32_t* tokens, double grad_scale,
                                   bool last_micro_batch) {
  Impl& m = *impl_;
  m.upload_tokens(tokens);
  m.grads_reduced = false;
  const float scale = static_cast<float>(grad_scale);
  if (m.graph_wanted && !m.profiling) {
    m.overlap_now = false;  // (the step graph is refused for parallel jobs)
    if (m.graph_exec == nullptr || scale != m.graph_scale) m.capture_step(scale);
    MEGACPP_CUDA_CHECK(cudaGraphLaunch(m.graph_exec, m.stream));
  } else {
    // Beside tensor parallelism the DP group's all-reduces on reduce_stream run at the same time
    // as the TP group's collectives on tp_stream, which NCCL leaves to the user to keep
    // deadlock-free (its "multiple communicators" notes). Here: every rank launches both groups'
    // collectives in one order; nothing on the compute stream or tp_stream waits on reduce_stream
    // until the backward is done; at most two NCCL kernels run at once (one DP all-reduce, one TP
    // collective, each stream's in order), and each holds at most kMaxCtas blocks (NCCL's
    // MAXCHANNELS), so on a GPU of 2 · kMaxCtas SMs or more both can always be resident and
    // neither waits on an SM held by a kernel that waits on it. With fewer SMs (an A100's 108) the
    // reduction runs after the backward (overlap_beside_tp).
    m.overlap_now = m.par.data_group != nullptr && m.overlap_dp && last_micro_batch &&
                    (!m.sharded() || m.overlap_beside_tp);
    m.lap(nullptr);
    m.forward_backward_body(scale);
  }
  // Averaging is linear: buckets averaged in an earlier call and added to since are averaged
  // again as a whole by reduce_gradients, which gives the same mean.
  m.dp_reduced = m.overlap_now;
  m.dp_average_loss();
  return m.read_loss();
}

void CudaModel::set_step_graph(bool on) {
  if (on && (impl_->par.tensor_group != nullptr || impl_->par.data_group != nullptr)) {
    fail(ErrorKind::kFailedPrecondition,
         "the step graph (cuda_graphs) is not built for tensor- or data-parallel jobs: their "
         "collectives have not been captured and checked");
  }
  impl_->graph_wanted = on;
  if (!on) impl_->drop_graph();
}

bool CudaModel::step_graph() const {
  return impl_->graph_wanted;
}

int64_t CudaModel::step_graph_captures() const {
  return impl_->graph_captures;
}

void CudaModel::Impl::forward_backward_body(float grad_scale) {
  Impl& m = *this;
  m.run_forward();
  size_t site = m.site_weight.size() - 1;
  m.lm_head_op->forward_backward(m.my_rows(m.normed[site]), m.bf16(m.lm_head), m.targets,
                                 grad_scale, m.loss, nullptr, m.my_rows(m.ddelta),
                                 m.grad(m.lm_head), m.s());
  m.lap("lm_head+loss forward+backward");
  m.tp_sum_loss();
  m.norm_op->backward(m.residual[site], m.value(m.site_weight[site]), m.rstd[site],
                      cuda::RowsRef{m.my_rows(m.ddelta), nullptr}, nullptr, m.dresidual,
                      m.grad(m.site_weight[site]), true, m.s());
  m.lap("add+rmsnorm backward");
  // Site k's residual is site k-1's plus the sublayer's output, so the sublayer's output gradient
  // is the gradient of site k's residual, which also flows on into site k-1.
  m.output_gradient_from_residual(m.ddelta, m.s());
  m.lap("residual gradient to bf16 (all-gathered under tensor parallelism)");
  const auto back_through_site = [&](auto&& sublayer_backward) {
    m.backward_site = --site;
    sublayer_backward(m.normed[site]);  // calls start_input_gradient_sum once
    m.finish_input_gradient_sum();
  };
  for (size_t index = m.blocks.size(); index-- > 0;) {
    Impl::Block& b = m.blocks[index];
    if (b.mlp) {
      back_through_site([&](const uint16_t* x) {
        Impl::MlpLayer& l = *b.mlp;
        l.mlp->backward(x, m.bf16(l.fc1), m.bf16(l.fc2), l.fc1_out, l.act, m.ddelta,
                        m.input_gradient_out(), m.grad(l.fc1), m.grad(l.fc2), true, m.scratch_a,
                        m.scratch_b, m.s(), [&] { m.start_input_gradient_sum(); });
        m.lap("mlp backward");
      });
    }
    if (b.mamba) back_through_site([&](const uint16_t* x) { m.mamba_backward(*b.mamba, x); });
    if (b.attention) {
      back_through_site([&](const uint16_t* x) { m.attention_backward(*b.attention, x); });
    }
    if (m.overlap_now) m.reduce_bucket(index);  // the block's gradients are final
  }
  m.embedding_op->backward(m.inputs + m.split.first, m.dresidual, m.grad(m.embedding), true, m.s());
  m.lap("embedding backward");
  if (m.overlap_now) {
    m.reduce_bucket(m.blocks.size());
    // Whatever the stream does next may touch the gradients: it waits for the last bucket.
    MEGACPP_CUDA_CHECK(cudaEventRecord(m.buckets_reduced, m.reduce_stream));
    MEGACPP_CUDA_CHECK(cudaStreamWaitEvent(m.stream, m.buckets_reduced, 0));
    m.lap("data-parallel gradient all-reduce (not hidden)");
  }
}

double CudaModel::optimizer_step(double lr) {
  Impl& m = *impl_;
  ++m.steps_taken;
  m.lap(nullptr);
  reduce_gradients();
  if (m.sharded()) {
    m.grad_norm_op->square_sum(m.square_sum, m.s());
    m.par.tensor_group->all_reduce(m.square_sum, 1, parallel::CollectiveType::kDouble,
                                   parallel::ReduceOp::kSum, m.stream);
    cuda::GradNormCuda::norm_from_square_sum(m.square_sum, m.optimizer.grad_clip, m.grad_norm,
                                             m.clip_scale, m.s());
  } else {
    m.grad_norm_op->compute(m.optimizer.grad_clip, m.grad_norm, m.clip_scale, m.s());
  }
  m.lap("gradient norm");
  const ops::AdamWHyper hyper{lr, m.optimizer.beta1, m.optimizer.beta2, m.optimizer.eps,
                              m.optimizer.weight_decay};
  m.adamw_op->step(hyper, m.steps_taken, m.clip_scale, m.s());
  m.lap("AdamW");
  float norm = 0;
  MEGACPP_CUDA_CHECK(
      cudaMemcpyAsync(&norm, m.grad_norm, sizeof(float), cudaMemcpyDeviceToHost, m.stream));
  MEGACPP_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.harvest();
  return norm;
}

void CudaModel::set_profiling(bool on) {
  Impl& m = *impl_;
  if (on && m.events.empty()) {
    m.events.resize(Impl::kMaxLaps);
    m.lap_labels.assign(Impl::kMaxLaps, nullptr);
    for (cudaEvent_t& e : m.events) MEGACPP_CUDA_CHECK(cudaEventCreate(&e));
  }
  m.profiling = on;
  m.laps = 0;
}

std::vector<OpTime> CudaModel::op_times() const {
  std::vector<OpTime> out;
  for (const auto& [name, samples] : impl_->op_samples) {
    std::vector<float> sorted = samples;
    std::sort(sorted.begin(), sorted.end());
    OpTime t;
    t.op = name;
    t.calls = static_cast<int64_t>(sorted.size());
    for (float ms : sorted) t.total_ms += ms;
    t.min_ms = sorted.front();
    t.median_ms = sorted[sorted.size() / 2];
    t.max_ms = sorted.back();
    out.push_back(t);
  }
  std::sort(out.begin(), out.end(),
            [](const OpTime& a, const OpTime& b) { return a.total_ms > b.total_ms; });
  return out;
}

std::vector<cuda::KernelAttributes> CudaModel::scan_kernel_attributes() const {
  for (const Impl::Block& b : impl_->blocks) {
    if (b.mamba) return cuda::kernel_attributes(b.mamba->scan->shape());
  }
  return {};
}

std::string CudaModel::attention_plans() const {
  // Every layer's plans are built for the same shape: the first one speaks for all.
  for (const Impl::Block& b : impl_->blocks) {
    if (b.attention && b.attention->attention_cudnn)
      return b.attention->attention_cudnn->describe();
  }
  return {};
}

void CudaModel::reset_op_times() {
  impl_->op_samples.clear();
}

}  // namespace megacpp
