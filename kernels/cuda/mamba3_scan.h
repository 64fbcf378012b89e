#pragma once
// The Mamba-3 MIMO scan on a CUDA GPU: steps 3-7 of the mixer in shared/spec/model.md,
// the same function as kernels/cpu/mamba3_scan_chunked.h, forward and all 14 gradients.
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it.
// Device tensors are bf16 passed as uint16_t bit patterns, in the layouts of
// kernels/contracts/mamba3_scan.h. Accumulation and the SSM state are fp32. The gradients of
// the per-head parameters (biases, mimo weights, D) are fp32.
//
// The computation is the SSD structure over chunks of `chunk` tokens:
//   forward   angle offsets per chunk (a prefix over chunks), chunk-local exit states in
//             parallel, a sequential-over-chunks pass per (batch, head) that turns them
//             into chunk-entry states, then every chunk's outputs in parallel (at the fixed
//             shapes on the tensor cores all three in one kernel, each block handing the
//             next chunk's block its entry state);
//   backward  chunk-local gradients of the entry states in parallel, a reverse
//             sequential pass that turns them into exit-state gradients (in the same kernel
//             at the fixed shapes), every chunk's
//             gradients in parallel (one block per (batch, group, chunk) looping over the
//             group's heads, so q and k gradients are summed over heads in a fixed order),
//             then the cross-chunk suffix sums (angles) and fixed-order reductions of the
//             per-head parameter gradients; or, at the fixed SISO and MIMO shapes on Hopper, a
//             sweep (ScanSweep below) in place of the first three. No floating-point atomics:
//             results are bitwise reproducible.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/contracts/mamba3_scan.h"

namespace megacpp::cuda {

// Device pointers, bf16 (uint16_t bit patterns), shapes and layouts of ops::ScanInputs. q, k, v,
// z, y, dy and the gradients of q, k, v and z must be 16-byte aligned (forward and backward refuse
// others, naming the tensor); per-head parameters at other alignments are copied to an aligned
// stage in the scan's workspace first.
struct ScanDeviceInputs {
  const uint16_t* q = nullptr;
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  const uint16_t* z = nullptr;
  const uint16_t* adt = nullptr;
  const uint16_t* dt = nullptr;
  const uint16_t* trap = nullptr;
  const uint16_t* angles = nullptr;
  const uint16_t* q_bias = nullptr;
  const uint16_t* k_bias = nullptr;
  const uint16_t* mimo_x = nullptr;
  const uint16_t* mimo_z = nullptr;
  const uint16_t* mimo_o = nullptr;
  const uint16_t* d = nullptr;
  // Elements from one token's z row to the next, and v's: 0 for heads · headdim (each its own
  // dense tensor), or more where both are read in place inside a wider row, such as in_proj's
  // output [rows, columns] (z and v at their columns' offsets). A multiple of 8 (16-byte rows).
  int64_t zv_row_stride = 0;
};

// Device pointers for the 14 gradients; backward() overwrites them. Per-token tensors
// are bf16, per-head parameter gradients fp32.
struct ScanDeviceGrads {
  uint16_t* q = nullptr;
  uint16_t* k = nullptr;
  uint16_t* v = nullptr;
  uint16_t* z = nullptr;
  uint16_t* adt = nullptr;
  uint16_t* dt = nullptr;
  uint16_t* trap = nullptr;
  uint16_t* angles = nullptr;
  float* q_bias = nullptr;
  float* k_bias = nullptr;
  float* mimo_x = nullptr;
  float* mimo_z = nullptr;
  float* mimo_o = nullptr;
  float* d = nullptr;
};

// What the CUDA runtime says about one kernel at the launch configuration it gets.
struct KernelAttributes {
  std::string name;
  int chunk = 0;  // the chunk the scan runs at (planned_scan_chunk): the shape's, or less
  int registers_per_thread = 0;
  size_t static_shared_bytes = 0;
  size_t dynamic_shared_bytes = 0;
  size_t local_bytes_per_thread = 0;  // stack frame / spills
  int max_threads_per_block = 0;      // the most this kernel could be launched with
  int block_threads = 0;              // what it is launched with
  long long grid_blocks = 0;
  int blocks_per_sm = 0;  // theoretical, from the occupancy API
  double occupancy = 0;   // resident warps / the SM's maximum warps
};

// At the shapes compiled with fixed dimensions (state 64, headdim 64, and rank 4 at chunk 16 or
// rank 1 at chunk 64) the scan can walk the chunk-entry states in chains: chunk_forward, and
// chunk_dstate with the reverse state pass, whose blocks each wait for their (batch, head) pair's
// previous chunk. A chain's links (a state through L2, a release of the flag, its acquire) follow
// one another, so with few pairs the separate passes (chunk_state, state_pass, chunk_output;
// chunk_dstate, then state_pass_backward) are faster. kWherePaying picks by the pair count at the
// crossovers measured on an H200 (bench/RESULTS.md, sessions 22 and 27); kAlways and kNever force
// one way, for the benchmark's comparison and the test that both give the same bits. Other shapes
// have no chains.
enum class ScanChains { kWherePaying, kAlways, kNever };

// chunk_backward runs a block per (batch, group, chunk) that walks the group's heads one after
// another. Where the blocks left over after the last whole wave (the blocks the GPU holds at once)
// would leave most SMs idle for a whole group's time, the backward splits those units into a block
// per head (at M3-ref on 132 SMs the last 4 of 4096 units become 64 blocks). The split heads' q and
// k gradients are summed in the same order, so splitting changes no bit. kWherePaying splits where
// the last wave then takes at most half the time (only where the plan keeps the group's dQ and dK
// sums in shared memory, with 2 or more heads a group: not the tensor-core plan at the fixed SISO
// shape, whose sums are in the workspace); kAlways splits every unit where it can (for the test
// that both ways give the same bits, and the benchmark); kNever splits none.
enum class ScanHeadSplit { kWherePaying, kAlways, kNever };
// At the fixed SISO and MIMO shapes (state 64, headdim 64, rank 1 and chunk 64 or rank 4 and chunk
// 16: 64 rows (token, rank) a chunk) with 16 rotation pairs, at most 256 heads and at most INT_MAX
// rows of entry states (B·H·chunks·2P, scan_sweep_rows_fit), on the tensor cores, where a block
// may have about 210 KiB of shared memory and the kernels run as built for sm_90 (Hopper: the
// sweep's copies are the tensor memory accelerator's), the backward can run as a
// sweep (kernels/cuda/mamba3_scan_sweep.cu): a block per (batch, head) walks its chunks in reverse
// with dL/d(state) on chip, the official SISO kernels' structure, instead of chunk_dstate, the
// reverse state pass and chunk_backward (a block per chunk), and finishes dθ's sums and the
// per-token terms itself (no dtheta_offsets or finish_tokens). The forward then also keeps for the
// backward its output before the gating (bf16, B·L·H·R·P), the per-token scalars and the
// rotation's cos θ and sin θ (fp32, B·H·chunks·chunk·(3 + 2A)). kWherePaying runs it from
// kSweepLeastPairs (batch, head) pairs: a block each walks all its chunks, so with fewer the SMs
// idle (on an H200 at seqlen 8192 and 16 heads, SISO: the backward 40% faster at 128 pairs, 7% at
// 64, 72% slower at 32, bench/RESULTS.md session 33; MIMO forward+backward: 37% faster at 128, 11%
// at 64, 43% slower at 32, session 36); kAlways wherever it applies (elsewhere the scan plans the
// backward without it, as kNever would: the choice of a faster path, not a gate; sweeps() says
// which); kNever nowhere. Other shapes and devices have no sweep. The two ways round differently
// (the sweep's dO is bf16), so each is held to the oracle, not to the other's bits.
enum class ScanSweep { kWherePaying, kAlways, kNever };
inline constexpr long kSweepLeastPairs = 64;
// Dynamic shared memory (bytes) of the sweep's core kernel a block: where the device allows less
// a block, the sweep does not run.
size_t scan_sweep_shared_bytes();
// Whether the sweep's tile copies, whose coordinates are ints, reach every row of `shape`'s
// entry states and rotation tables: B·H·chunks·2P ≤ INT_MAX (one of the conditions under which
// the sweep applies; the others are the shape's dimensions, the variant and the device's).
bool scan_sweep_rows_fit(const ops::ScanShape& shape);

// kWherePaying's choice: of `units` units of `heads_per_group` heads where `slots` blocks of
// chunk_backward run at once (SMs × blocks an SM), the leftover ones (units mod slots) when the
// wave they make as a block per head takes at most half a whole unit's time
// (ceil(leftover · heads / slots) ≤ heads / 2), else none. A head in a block of its own costs
// more than in a block of 16, whose loads for the next head are issued during this one's work: at
// M3-ref MIMO every unit split took the backward 12% longer (10.66 → 11.96 ms, H200, session 28).
inline int units_worth_splitting(long units, int heads_per_group, long slots) {
  if (heads_per_group < 2 || slots < 1) return 0;
  const long leftover = units % slots;
  const long wave_heads = (leftover * heads_per_group + slots - 1) / slots;
  return leftover > 0 && 2 * wave_heads <= heads_per_group ? static_cast<int>(leftover) : 0;
}

class Mamba3ScanCuda {
 public:
  // Validates the shape against what the kernels cover (throws megacpp::Error
  // kInvalidArgument naming the field and value otherwise), plans it at the chunk this device's
  // shared memory allows (planned_scan_chunk; planned_chunk()), then allocates all device
  // workspace once. psiv_cache: forward stores PsiV = v ⊙ mimo_x ([B, L, H, R, P], bf16)
  // and backward reads it instead of recomputing it. tensor_cores: the chunk products run
  // on the tensor cores (bf16 operands, fp32 accumulation; the products with the fp32 state
  // take their fp32 operands as split hi + lo bf16 pairs); off, on CUDA cores in fp32
  // (operands held in shared memory as bf16 either way).
  // backward_workspace: null, or backward_workspace_bytes(shape) bytes of 16-byte aligned device
  // memory (refused otherwise) for backward()'s temporaries, which scans whose backwards run one
  // after another on one stream (a model's layers) may share; the scan then allocates only what
  // forward() keeps for backward() (the chunk-entry states and decays, PsiV; where the sweep runs,
  // o before the gating, l, κ, γ and cos θ, sin θ) and the chunk chains' tickets and flags
  // (B·H·chunks + 1 ints).
  // chains: see ScanChains; head_split: see ScanHeadSplit; sweep: see ScanSweep.
  explicit Mamba3ScanCuda(const ops::ScanShape& shape, bool psiv_cache = false,
                          bool tensor_cores = true, void* backward_workspace = nullptr,
                          size_t backward_bytes = 0, ScanChains chains = ScanChains::kWherePaying,
                          ScanHeadSplit head_split = ScanHeadSplit::kWherePaying,
                          ScanSweep sweep = ScanSweep::kWherePaying);
  // Bytes of backward()'s temporaries for `shape` on the current device, for either math variant
  // (throws like the constructor on a bad shape). The split units' q and k gradients are among
  // them, so the figure depends on head_split and on the device's SMs; and the sweep's, where it
  // runs.
  static size_t backward_workspace_bytes(const ops::ScanShape& shape,
                                         ScanHeadSplit head_split = ScanHeadSplit::kWherePaying,
                                         ScanSweep sweep = ScanSweep::kWherePaying);
  // Bytes the constructor allocates for itself (workspace_bytes()): with shared_backward (a
  // backward_workspace given), only what forward() keeps for backward() and the tickets and flags.
  static size_t own_workspace_bytes(const ops::ScanShape& shape, bool psiv_cache,
                                    bool shared_backward,
                                    ScanHeadSplit head_split = ScanHeadSplit::kWherePaying,
                                    ScanSweep sweep = ScanSweep::kWherePaying);
  ~Mamba3ScanCuda();
  Mamba3ScanCuda(const Mamba3ScanCuda&) = delete;
  Mamba3ScanCuda& operator=(const Mamba3ScanCuda&) = delete;

  // y: [B, L, H, P] bf16. Keeps the chunk-entry states (and PsiV) for backward().
  // stream: a cudaStream_t, or null for the default stream. Asynchronous.
  void forward(const ScanDeviceInputs& in, uint16_t* y, void* stream = nullptr);
  // Needs a forward() with the same inputs first (throws kFailedPrecondition otherwise).
  void backward(const ScanDeviceInputs& in, const uint16_t* dy, const ScanDeviceGrads& grads,
                void* stream = nullptr);

  const ops::ScanShape& shape() const { return shape_; }
  // The chunk the kernels run at: shape().chunk, or less on a device with less shared memory.
  int planned_chunk() const { return planned_chunk_; }
  bool psiv_cache() const { return psiv_cache_; }
  bool tensor_cores() const { return tensor_cores_; }
  ScanChains chains() const { return chains_; }
  ScanHeadSplit head_split() const { return head_split_; }
  // Whether backward() runs the sweep (ScanSweep), as planned for this shape and device.
  bool sweeps() const;
  size_t workspace_bytes() const { return workspace_bytes_; }
  size_t psiv_bytes() const { return psiv_bytes_; }
  std::vector<KernelAttributes> kernel_attributes() const;

 private:
  ops::ScanShape shape_;
  bool psiv_cache_;
  bool tensor_cores_;
  ScanChains chains_;
  ScanHeadSplit head_split_;
  ScanSweep sweep_policy_;
  bool has_forward_ = false;
  int planned_chunk_ = 0;
  int device_ = 0;
  void* arena_ = nullptr;
  size_t workspace_bytes_ = 0;
  size_t psiv_bytes_ = 0;
  struct Buffers;
  Buffers* buffers_ = nullptr;
};

// The attributes of every kernel the scan launches for `shape` (with psiv_cache off and
// on the launch shapes are the same), for the tensor-core or the CUDA-core variant.
// Throws like the constructor for shapes not covered.
std::vector<KernelAttributes> kernel_attributes(
    const ops::ScanShape& shape, bool tensor_cores = true,
    ScanChains chains = ScanChains::kWherePaying,
    ScanHeadSplit head_split = ScanHeadSplit::kWherePaying,
    ScanSweep sweep = ScanSweep::kWherePaying);

// Dynamic shared memory (bytes) per block that the largest kernel for `shape` cannot do without
// at shape.chunk (no device needed): chunk_backward's plan with its C² token weights made again
// where they are read, nothing added. Where the device's opt-in limit per block (232448 bytes on
// Hopper, 166912 on an A100, lower where MEGACPP_CUDA_SHARED_MEMORY_PER_SM caps it:
// kernels/cuda/device_query.h) is below it, the scan runs at a smaller chunk (planned_scan_chunk);
// where the device has room beyond it, chunk_backward takes more (the weights' space, split state
// operands, the group's dQ/dK sums). A smaller chunk computes the same recurrence with other
// rounding (so a deterministic run does not repeat its bits on such a device); the space taken or
// not changes speed alone.
size_t scan_shared_bytes_needed(const ops::ScanShape& shape);

// The chunk the scan runs `shape` at where a block may have `per_block` bytes of shared memory:
// shape.chunk where scan_shared_bytes_needed fits, else the largest smaller chunk (keeping
// chunk × rank a multiple of 16) that fits, 0 where none does (the constructor then refuses the
// shape, naming both figures). The chunked form computes the recurrence at any chunk
// (../shared/spec/model.md), so a smaller chunk costs speed and changes rounding, not the model: a
// chunk is a tiling.
// Throws like the constructor for a shape whose fields are not covered.
int planned_scan_chunk(const ops::ScanShape& shape, size_t per_block);

}  // namespace megacpp::cuda
