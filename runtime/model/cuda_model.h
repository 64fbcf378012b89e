#pragma once
// The model of shared/spec/model.md trained on one CUDA GPU: the forward and backward of
// runtime/model/model.h over the kernels of kernels/cuda, and the optimizer step (global gradient
// norm, clipping and AdamW) on the device.
//
// Mixed precision as the official model trains under bf16 autocast with residual_in_fp32: fp32
// master weights, gradients and AdamW moments; bf16 copies of the weights as matmul operands
// (the optimizer rewrites them after every update); bf16 activations between matmuls; an fp32
// residual stream; an fp32 loss.
//
// Memory: every buffer the step touches (parameters, gradients, moments, the activations kept for
// the backward, the scratch of the backward and the ops' workspaces) is planned from (config,
// batch, seqlen) in the constructor and taken from one device allocation; nothing is allocated
// while a step runs. (The scan and the preprocessing own their workspaces, also allocated once,
// in the constructor.)
//
// The host model is the mirror this one is loaded from and saved to: it holds the parameter
// names, shapes and values, so initialization and checkpoints stay the CPU runtime's code.
//
// Plain C++ (no CUDA types in this header).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/mamba3_scan.h"
#include "runtime/model/attention_engine.h"
#include "runtime/model/model.h"
#include "runtime/optimizer/adamw.h"

namespace megacpp {

namespace parallel {
class CudaCommunicator;
}
namespace cuda {
class GemmPlanCache;
}

// Where a CudaModel sits in a tensor- and data-parallel job (runtime/parallel/shard_plan.h): its
// rank in its TP group and the groups' communicators. The default is one GPU alone.
//
// Tensor parallel: the model holds only its rank's shard of every parameter (the shard plan's
// local layout) and computes its heads and MLP units. Sequence parallel beside it: between the
// sublayers each rank holds 1/tp of the rows (shard_plan.h's sequence_split) and runs
// the embedding, residual adds, norms and lm_head + loss on them alone; a sublayer's input is
// all-gathered (bf16) and its row-parallel output reduce-scattered (bf16) in the forward, the
// output gradient all-gathered (bf16) and the input gradient reduce-scattered (bf16) in the
// backward. The pieces every rank holds but computes part of (the embedding, norm and lm_head
// weights, B/C norm weights, the angle rows, replicated B/C rows) are summed once before the
// optimizer. Data parallel: gradients are averaged over the DP group, block by
// block on a stream of their own while the backward goes on with the blocks below (the last
// micro-batch of a step; set_overlapped_gradient_reduction), and the loss a step returns is the
// group's mean. The model's host mirror, uploads, downloads and checkpoints stay global.
//
// The communicators are borrowed: each must outlive every model built on it (the model's
// destructor gives its symmetric memory back to the tensor group; runtime/trainer declares them
// before the model for that reason).
struct CudaModelParallel {
  int tensor_parallel = 1;
  int data_parallel = 1;
  int tp_rank = 0;
  parallel::CudaCommunicator* tensor_group = nullptr;  // null exactly when tensor_parallel == 1
  parallel::CudaCommunicator* data_group = nullptr;    // null exactly when data_parallel == 1
};

// How the step runs where there is a choice: what it keeps from the forward for its backward and
// what it recomputes instead, which attention kernels it uses and whether it is bitwise
// reproducible.
struct CudaModelOptions {
  // Each Mamba-3 layer's in_proj output ([rows, in_proj columns] bf16: 310 MB a layer at
  // bench-350m's micro-batch) is not kept: every layer's forward writes it to one shared buffer,
  // and the backward recomputes it there with the same GEMM on the same input (the same bits), at
  // the price of one more in_proj GEMM per Mamba layer. The recompute_in_proj feature gate.
  bool recompute_in_proj = false;
  AttentionEngine attention = AttentionEngine::kCudnn;
  // Two runs of a step give the same bits. Off, cuDNN's attention backward sums dQ in whatever
  // order its engine likes: faster, and without the batch · heads · seqlen² bf16 workspace the
  // deterministic one keeps dS in. Our own kernels are deterministic either way.
  bool deterministic = true;
  // Tensor parallel: the SMs left free beside the weight-gradient GEMMs, which run while tp_stream
  // reduce-scatters the sublayer's input gradient, runs the norm's backward and all-gathers the
  // next output gradient. Planned for every SM, a GEMM holds them all until it ends and those
  // kernels wait behind it (LinearCuda's weight_gradient_sms). 0: every SM to the GEMMs.
  // kReservedSmsByDegree: the best of those measured on H200s at the degree (bench/RESULTS.md,
  // sessions 22 and 23): 32 at TP = 2, 48 from TP = 4 (TP = 8 unmeasured).
  int tensor_parallel_reserved_sms = kReservedSmsByDegree;
  static constexpr int kReservedSmsByDegree = -1;
  int reserved_sms(int tensor_parallel) const {
    if (tensor_parallel_reserved_sms != kReservedSmsByDegree) return tensor_parallel_reserved_sms;
    return tensor_parallel <= 2 ? 32 : 48;
  }
  // Tensor parallel: the all-gathers on the GPUs' copy engines, leaving every SM to the kernels
  // beside them (the reduce-scatters stay kernels: as an all-to-all on the copy engines and a sum
  // kernel they were slower, bench/RESULTS.md session 23). The tensor group must be split for it
  // (CudaCommunicator::split's copy_engines). Off by default: NCCL 2.28's copy-engine path
  // writes flags into peers' memory with stream memory operations, which drivers of CUDA 13.1
  // and later refuse (NCCL issue 2052). Nor is it for jobs: after an abort of the group, the
  // copy engines' waits on flags that a failed peer never writes may not end, so the model's
  // destructor (which synchronizes its streams) may not return; the kernels end on an abort.
  bool tensor_parallel_copy_engines = false;
};

// The device memory a CudaModel takes: its one planned allocation and what its Mamba-3 layers'
// scans and preprocessings allocate beside it (the chunk states the forward keeps for the
// backward, the norm scales). The CUDA context, the libraries' handles and NCCL's buffers come
// on top.
struct CudaMemoryPlan {
  uint64_t arena = 0;
  uint64_t layer_workspaces = 0;
  uint64_t total() const { return arena + layer_workspaces; }
};

// The device time of one op of the step (e.g. "mamba scan backward"), summed over its calls in
// the profiled steps (every layer's call is one call).
struct OpTime {
  std::string op;
  int64_t calls = 0;
  double total_ms = 0;
  double min_ms = 0;  // of one call
  double median_ms = 0;
  double max_ms = 0;
};

class CudaModel {
 public:
  // Plans and allocates the device memory for micro-batches of [batch, seqlen] tokens of
  // `host`'s model on CUDA device `device`. Throws megacpp::Error: kInvalidArgument for a shape
  // a kernel does not cover or a parallel geometry the model cannot split (naming it),
  // kFailedPrecondition when the device lacks memory or cuDNN cannot run its attention. With tensor
  // or data parallelism the constructor and every method below are collective: each rank of the
  // groups calls them in the same order (the forward and backward reduce inside). plan_cache:
  // the GEMM algorithms of every linear and the cuDNN attention plans are looked up and stored
  // there (kernels/cuda/gemm_plan_cache.h); null: each built afresh, uncounted.
  CudaModel(const Model<float>& host, int batch, int seqlen, const OptimizerConfig& optimizer,
            int device = 0, const CudaModelParallel& parallel = {},
            cuda::GemmPlanCache* plan_cache = nullptr, const CudaModelOptions& options = {});
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  // Copies the host's parameter values (and, when given, the optimizer's moments and step
  // count) to the device and rebuilds the bf16 weight copies. Synchronous.
  void upload(const ParameterSet<float>& params, const AdamW<float>* optimizer);
  // Copies the device's parameter values (and moments and step count) into the host. Synchronous.
  void download(ParameterSet<float>& params, AdamW<float>* optimizer) const;
  // The accumulated gradients (reduced over the groups first), in the host ParameterSet's flat
  // layout. Synchronous.
  std::vector<float> download_gradients();
  // Sums and averages the gradients accumulated since zero_grad over the parallel groups, once
  // (optimizer_step and download_gradients call it; a no-op on one GPU or when already reduced).
  void reduce_gradients();

  void zero_grad();
  // As Model::forward / forward_backward: tokens [batch, seqlen + 1] on the host (validated
  // there); returns the mean cross entropy; forward_backward accumulates grad_scale · dloss/dθ.
  double forward(const int32_t* tokens);
  // last_micro_batch: the step's last call before optimizer_step. Data parallel, it averages the
  // gradients over the DP group during its backward; earlier calls leave that to later.
  double forward_backward(const int32_t* tokens, double grad_scale, bool last_micro_batch = true);
  // Data parallel: the gradients averaged during the last micro-batch's backward (on, the
  // default; with tensor parallelism beside it too) or after it, in one all-reduce before the
  // optimizer (off: for comparisons).
  void set_overlapped_gradient_reduction(bool on);
  // Global gradient norm, clipping at the optimizer config's grad_clip and one AdamW update
  // with learning rate `lr` (the step counter advances first). Returns the norm before clipping.
  double optimizer_step(double lr);

  // The step graph: forward_backward's device work (everything after the token upload and
  // before the loss read) is captured as one CUDA graph on its first call and replayed by the
  // calls after it, in place of launching its ~1,000 kernels one by one. Results are bitwise
  // those of the eager step. A change of grad_scale captures again; steps while profiling run
  // eagerly. Off by default (the cuda_graphs feature gate).
  void set_step_graph(bool on);
  bool step_graph() const;
  // How many times the step was captured (for tests and receipts).
  int64_t step_graph_captures() const;

  // Profiling times every op of the step with CUDA events between its neighbours on the stream
  // (so the times add up to the step's device time); off, no event is recorded. The events are
  // created when profiling is first turned on, never inside a step.
  void set_profiling(bool on);
  // The ops' times since the last reset, the most expensive first.
  std::vector<OpTime> op_times() const;
  void reset_op_times();
  // What the runtime says about each kernel the Mamba-3 scan launches at this model's shape
  // (registers, shared memory, occupancy); empty for a model without Mamba-3 layers.
  std::vector<cuda::KernelAttributes> scan_kernel_attributes() const;
  // The attention layers' cuDNN plans (engines, workspace, whether from the plan cache); empty
  // with our own kernels or without attention layers.
  std::string attention_plans() const;

  int batch() const;
  int seqlen() const;
  // The one planned allocation (arena) and what the layers' scans and preprocessings allocated for
  // themselves (as each reports it).
  CudaMemoryPlan memory_plan() const;
  // What the constructor would allocate for this config, shape and TP rank (`options` as the
  // constructor's), planned by the same code without the host model's values and without
  // touching the device's memory: what megacppd checks a cuda job against at submit. Throws as
  // the constructor does for a shape or geometry the kernels or the shard plan refuse.
  static CudaMemoryPlan plan_memory(const ModelConfig& config, int batch, int seqlen,
                                    int tensor_parallel = 1, int tp_rank = 0,
                                    const CudaModelOptions& options = {});
  // Device memory this model holds now (the planned allocation, the scan's and preprocessing's
  // workspaces, the libraries' handles), measured as the drop in the device's free memory since
  // just before construction.
  size_t device_bytes_in_use() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megacpp
