// Mamba3ScanCuda: shape validation, the workspace, the launch table and the kernels' attributes.
// The kernels are in mamba3_scan_forward.cu and mamba3_scan_backward.cu; what the three files
// share is in mamba3_scan_device.cuh.
#include <cuda_runtime.h>
#include <algorithm>
#include <array>
#include <cstdint>

#include <initializer_list>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/device_query.h"
#include "kernels/cuda/mamba3_scan.h"
#include "kernels/cuda/mamba3_scan_device.cuh"

namespace megacpp::cuda {
namespace scan_detail {
namespace {

using detail::refuse;

Dims dims_of(const ops::ScanShape& s) {
  Dims d{};
  d.batch = s.batch;
  d.seqlen = s.seqlen;
  d.heads = s.heads;
  d.groups = s.groups;
  d.state = s.state;
  d.headdim = s.headdim;
  d.rank = s.rank;
  d.chunk = s.chunk;
  d.angles = s.angles;
  d.chunks = (s.seqlen + s.chunk - 1) / s.chunk;
  d.rows = s.chunk * s.rank;
  d.heads_per_group = s.heads / s.groups;
  d.partial_width = 2 * s.rank * s.state + 3 * s.rank * s.headdim + 1;
  d.by_rank = FastDiv(d.rank);
  d.by_headdim = FastDiv(d.headdim);
  d.by_state = FastDiv(d.state);
  d.by_half = FastDiv(d.state / 2);
  d.by_angles = FastDiv(d.angles);
  d.by_chunk = FastDiv(d.chunk);
  d.by_rows = FastDiv(d.rows);
  return d;
}

// Refuses, naming the field and value, every shape the kernels do not compute.
void validate(const ops::ScanShape& s) {
  const auto positive = [](int value, const char* field) {
    if (value <= 0) {
      refuse(ErrorKind::kInvalidArgument, "Mamba3ScanCuda: ScanShape.{}={} must be positive", field,
             value);
    }
  };
  positive(s.batch, "batch");
  positive(s.seqlen, "seqlen");
  positive(s.heads, "heads");
  positive(s.groups, "groups");
  positive(s.state, "state");
  positive(s.headdim, "headdim");
  positive(s.rank, "rank");
  positive(s.chunk, "chunk");
  if (s.heads % s.groups != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: ScanShape.groups={} does not divide heads={}", s.groups, s.heads);
  }
  if (s.state % 16 != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: ScanShape.state={} is not covered (must be a multiple of 16)", s.state);
  }
  if (s.headdim % 16 != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: ScanShape.headdim={} is not covered (must be a multiple of 16)",
           s.headdim);
  }
  if ((s.chunk * s.rank) % 16 != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: ScanShape.chunk={} × rank={} is not covered (rows per chunk must be a "
           "multiple of 16)",
           s.chunk, s.rank);
  }
  if (s.angles < 0 || s.angles > s.state / 2) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: ScanShape.angles={} must lie in [0, state/2={}]", s.angles,
           s.state / 2);
  }
  // The bounds the chunk kernels are tested within (load_scalars once gave each token and each
  // rotation pair one thread of the smallest block).
  if (s.chunk > kThreads || s.angles > kThreads) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: ScanShape.chunk={} and angles={} must each be at most {}", s.chunk,
           s.angles, kThreads);
  }
}

// The largest chunk, from s.chunk down in steps that keep the rows a multiple of 16, whose
// chunk_backward plan (the largest kernel's) fits `per_block` bytes; 0 where none does.
int largest_fitting_chunk(const ops::ScanShape& s, size_t per_block) {
  const int step = 16 / std::gcd(s.rank, 16);
  ops::ScanShape at = s;
  for (at.chunk = s.chunk; at.chunk >= step; at.chunk -= step) {
    if (least_backward_bytes(dims_of(at)) <= per_block) return at.chunk;
  }
  return 0;
}

// `s` validated (validate) at the chunk the kernels run it at on a device with `shared`: its own
// chunk where chunk_backward's plan fits, else the largest smaller one that fits
// (planned_scan_chunk). Refuses, naming both figures, a shape that fits at no chunk.
ops::ScanShape planned_shape(const ops::ScanShape& s, const SharedMemoryLimits& shared) {
  validate(s);
  ops::ScanShape planned = s;
  planned.chunk = largest_fitting_chunk(s, shared.per_block);
  if (planned.chunk == 0) {
    ops::ScanShape smallest = s;
    smallest.chunk = 16 / std::gcd(s.rank, 16);
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: shape (state={}, headdim={}, rank={}, chunk={}, angles={}) needs {} "
           "bytes of shared memory per block ({} at the smallest chunk, {}); this device allows "
           "{}{}",
           s.state, s.headdim, s.rank, s.chunk, s.angles, least_backward_bytes(dims_of(s)),
           least_backward_bytes(dims_of(smallest)), smallest.chunk, shared.per_block,
           cap_note(shared));
  }
  return planned;
}

DevInputs dev_inputs(const ScanDeviceInputs& in, const Dims& dims) {
  const int angles = dims.angles;
  const auto need = [](const uint16_t* p, const char* field) {
    if (p == nullptr) refuse(ErrorKind::kInvalidArgument, "ScanDeviceInputs.{} is null", field);
    return reinterpret_cast<const bf16*>(p);
  };
  DevInputs d{};
  d.q = need(in.q, "q");
  d.k = need(in.k, "k");
  d.v = need(in.v, "v");
  d.z = need(in.z, "z");
  d.adt = need(in.adt, "adt");
  d.dt = need(in.dt, "dt");
  d.trap = need(in.trap, "trap");
  d.angles = angles > 0 ? need(in.angles, "angles") : reinterpret_cast<const bf16*>(in.angles);
  d.q_bias = need(in.q_bias, "q_bias");
  d.k_bias = need(in.k_bias, "k_bias");
  d.mimo_x = need(in.mimo_x, "mimo_x");
  d.mimo_z = need(in.mimo_z, "mimo_z");
  d.mimo_o = need(in.mimo_o, "mimo_o");
  d.d = need(in.d, "d");
  const int64_t dense = static_cast<int64_t>(dims.heads) * dims.headdim;
  if (in.zv_row_stride != 0 && (in.zv_row_stride < dense || in.zv_row_stride % 8 != 0)) {
    refuse(ErrorKind::kInvalidArgument,
           "ScanDeviceInputs.zv_row_stride={} must be 0 (dense) or at least heads · headdim = {} "
           "and a multiple of 8 (the scan moves z's and v's rows 16 bytes at a time)",
           in.zv_row_stride, dense);
  }
  d.zv_stride = static_cast<size_t>(in.zv_row_stride == 0 ? dense : in.zv_row_stride);
  return d;
}

DevGrads dev_grads(const ScanDeviceGrads& g, int angles) {
  const auto need = [](auto* p, const char* field) {
    if (p == nullptr) refuse(ErrorKind::kInvalidArgument, "ScanDeviceGrads.{} is null", field);
    return p;
  };
  DevGrads d{};
  d.q = reinterpret_cast<bf16*>(need(g.q, "q"));
  d.k = reinterpret_cast<bf16*>(need(g.k, "k"));
  d.v = reinterpret_cast<bf16*>(need(g.v, "v"));
  d.z = reinterpret_cast<bf16*>(need(g.z, "z"));
  d.adt = reinterpret_cast<bf16*>(need(g.adt, "adt"));
  d.dt = reinterpret_cast<bf16*>(need(g.dt, "dt"));
  d.trap = reinterpret_cast<bf16*>(need(g.trap, "trap"));
  d.angles = reinterpret_cast<bf16*>(angles > 0 ? need(g.angles, "angles") : g.angles);
  d.q_bias = need(g.q_bias, "q_bias");
  d.k_bias = need(g.k_bias, "k_bias");
  d.mimo_x = need(g.mimo_x, "mimo_x");
  d.mimo_z = need(g.mimo_z, "mimo_z");
  d.mimo_o = need(g.mimo_o, "mimo_o");
  d.d = need(g.d, "d");
  return d;
}

// Opts `l`'s kernel in to its dynamic shared memory where that is above 48 KiB, never lowering
// what it allows already: the kernels of the runtime shapes serve every such shape, and a scan of
// a smaller shape must not take away what an earlier, larger one set.
void allow_shared(const Launch& l) {
  if (l.smem.total <= 48 * 1024) return;
  cudaFuncAttributes attr{};
  MEGACPP_CUDA_CHECK(cudaFuncGetAttributes(&attr, l.function));
  if (static_cast<size_t>(attr.maxDynamicSharedSizeBytes) >= l.smem.total) return;
  MEGACPP_CUDA_CHECK(cudaFuncSetAttribute(l.function, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(l.smem.total)));
}

// The blocks of launch `l` an SM of the current device holds: the occupancy API's figure, lowered
// where `shared` is capped (the API reads the GPU's own shared memory). Opts the kernel in to its
// shared memory first (allow_shared).
int resident_blocks(const Launch& l, const SharedMemoryLimits& shared) {
  allow_shared(l);
  int blocks = 0;
  MEGACPP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, l.function, static_cast<int>(l.block.x * l.block.y * l.block.z), l.smem.total));
  if (shared.capped) {
    cudaFuncAttributes attr{};
    MEGACPP_CUDA_CHECK(cudaFuncGetAttributes(&attr, l.function));
    const size_t per_block = l.smem.total + attr.sharedSizeBytes + kSharedReservedPerBlock;
    blocks = std::min(blocks, static_cast<int>(shared.per_sm / per_block));
  }
  return blocks;
}

// chunk_backward's units that run a block per head (HeadSplit) for one math variant on the current
// device (its SMs, and the blocks of chunk_backward an SM holds under `shared`).
int planned_split_units(const Dims& d, bool tensor_cores, const SharedMemoryLimits& shared,
                        ScanHeadSplit head_split) {
  const long units = static_cast<long>(d.chunks) * d.batch * d.groups;
  if (head_split == ScanHeadSplit::kNever || d.heads_per_group < 2) return 0;
  const Launch l =
      backward_launches(d, tensor_cores, shared.per_block, ScanChains::kNever).chunk_backward;
  if (l.smem.dq_acc == 0) return 0;  // the sums in the workspace: a unit's heads add in order
  if (head_split == ScanHeadSplit::kAlways) return static_cast<int>(units);
  int device = 0, multiprocessors = 0;
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device));
  MEGACPP_CUDA_CHECK(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  return units_worth_splitting(units, d.heads_per_group,
                               static_cast<long>(multiprocessors) * resident_blocks(l, shared));
}

// Whether the backward of one math variant runs the sweep (ScanSweep) on a device with `shared`.
bool sweep_planned(const Dims& d, bool tensor_cores, const SharedMemoryLimits& shared,
                   ScanSweep sweep) {
  if (sweep == ScanSweep::kNever || !sweep_applies(d, tensor_cores, shared.per_block)) return false;
  return sweep == ScanSweep::kAlways || static_cast<long>(d.batch) * d.heads >= kSweepLeastPairs;
}

// Every launch of one math variant, forward then backward, in launch order, as planned for a
// device with `shared` (current_shared_memory_limits()).
std::vector<Launch> all_launches(const Dims& d, bool tensor_cores, const SharedMemoryLimits& shared,
                                 ScanChains chains, ScanHeadSplit head_split, ScanSweep sweep) {
  const ForwardLaunches f = forward_launches(d, tensor_cores, shared.per_sm, chains);
  const bool sweeps = sweep_planned(d, tensor_cores, shared, sweep);
  const BackwardLaunches b = backward_launches(
      d, tensor_cores, shared.per_block, chains,
      sweeps ? 0 : planned_split_units(d, tensor_cores, shared, head_split), sweeps);
  std::vector<Launch> launches = {f.angle_sums, f.angle_prefix};
  if (f.fused) {
    launches.push_back(f.chunk_forward);
  } else {
    launches.insert(launches.end(), {f.chunk_state, f.state_pass, f.chunk_output});
  }
  if (b.sweep) {
    launches.insert(launches.end(), {b.sweep_kernels.prep, b.sweep_kernels.core,
                                     b.sweep_kernels.finish, b.reduce_params});
  } else {
    launches.push_back(b.chunk_dstate);
    if (!b.reverse_pass_fused) launches.push_back(b.state_pass_backward);
    launches.insert(launches.end(),
                    {b.chunk_backward, b.dtheta_offsets, b.finish_tokens, b.reduce_params});
  }
  return launches;
}

// Kernels above 48 KiB of dynamic shared memory must opt in, per kernel and per device.
void raise_shared_limits(const Dims& d, const SharedMemoryLimits& shared, ScanChains chains) {
  for (bool tensor_cores : {false, true}) {
    for (const ScanSweep sweep : {ScanSweep::kNever, ScanSweep::kAlways}) {
      for (const Launch& l :
           all_launches(d, tensor_cores, shared, chains, ScanHeadSplit::kNever, sweep)) {
        allow_shared(l);
      }
    }
  }
}

}  // namespace
}  // namespace scan_detail

using detail::refuse;
using scan_detail::Dims;
using scan_detail::Work;

struct Mamba3ScanCuda::Buffers {
  Dims dims;
  Work work;
  // 16-byte aligned copies of the per-head parameters (q_bias, k_bias, mimo_x, mimo_z, mimo_o),
  // taken where the caller's are not aligned (see stage_parameters).
  std::array<bf16*, 5> staged_parameters{};
  scan_detail::ForwardLaunches forward;
  scan_detail::BackwardLaunches backward;
};

int planned_scan_chunk(const ops::ScanShape& shape, size_t per_block) {
  scan_detail::validate(shape);
  return scan_detail::largest_fitting_chunk(shape, per_block);
}

size_t scan_sweep_shared_bytes() {
  return scan_detail::sweep_core_shared_bytes();
}

bool scan_sweep_rows_fit(const ops::ScanShape& shape) {
  return scan_detail::sweep_copy_rows_fit(scan_detail::dims_of(shape));
}

size_t scan_shared_bytes_needed(const ops::ScanShape& shape) {
  return scan_detail::least_backward_bytes(scan_detail::dims_of(shape));
}

namespace {

// The workspace's parts in floats, in the order the arena hands them out: the first
// kForwardParts are the layer's own: written by forward() and read by backward(), and `order`
// (the chunk chains' tickets and flags, zeroed before each use by forward() and backward()), which
// must not be shared: a scan sharing the temporaries may run its forward between this one's
// forward and backward. The rest are backward()'s temporaries (several scans may share them).
constexpr int kParts = 19;
constexpr int kForwardParts = 7;

// split_units: chunk_backward's units that run a block per head (planned_split_units); sweep: the
// sweep's parts are sized (either math variant may run it: sweep_planned).
std::array<size_t, kParts> part_sizes(const Dims& d, int split_units, bool sweep) {
  const scan_detail::SweepFloats f =
      sweep ? scan_detail::sweep_floats(d) : scan_detail::SweepFloats{};
  const size_t B = static_cast<size_t>(d.batch), L = static_cast<size_t>(d.seqlen);
  const size_t H = static_cast<size_t>(d.heads), chunks = static_cast<size_t>(d.chunks);
  const size_t A = static_cast<size_t>(d.angles), matrix = static_cast<size_t>(d.headdim) * d.state;
  const size_t qk = B * L * d.rank * d.groups * d.state;
  return {
      B * H * chunks * A,       // theta0
      B * H * chunks * matrix,  // states
      B * H * chunks,           // decay
      chain_order_ints(d),      // order (ints)
      f.gate_in,                // gate_in (bf16)
      f.scalars,                // sweep_scalars (the forward's l, κ, γ)
      f.rotation,               // sweep_rotation (the forward's cos θ and sin θ)
      B * H * chunks * matrix,  // gstates (the sweep's dq and dk, bf16: the same size)
      qk,                       // dq_acc
      qk,                       // dk_acc
      B * H * L * A,            // dtheta
      B * H * chunks * A,       // dtheta_tot
      B * L * H,
      B * L * H,
      B * L * H,
      B * L * H,                                              // per-token scalars
      H * B * chunks * static_cast<size_t>(d.partial_width),  // partials
      scan_detail::split_qk_floats(d, split_units),           // split_qk
      f.d_out,                                                // sweep_d_out (bf16)
  };
}

size_t part_bytes(size_t floats) {
  return (floats * sizeof(float) + 255) / 256 * 256;
}

size_t bytes_of_parts(const std::array<size_t, kParts>& sizes, int first, int last) {
  size_t total = 0;
  for (int i = first; i < last; ++i) total += part_bytes(sizes[static_cast<size_t>(i)]);
  return total;
}

// The split units the workspace holds q and k gradients for: the more of the two math variants'
// (so that either may use a workspace sized for the shape).
int workspace_split_units(const Dims& d, const SharedMemoryLimits& shared,
                          ScanHeadSplit head_split) {
  return std::max(scan_detail::planned_split_units(d, true, shared, head_split),
                  scan_detail::planned_split_units(d, false, shared, head_split));
}

}  // namespace

size_t Mamba3ScanCuda::backward_workspace_bytes(const ops::ScanShape& shape,
                                                ScanHeadSplit head_split, ScanSweep sweep) {
  const SharedMemoryLimits shared = current_shared_memory_limits();
  const Dims d = scan_detail::dims_of(scan_detail::planned_shape(shape, shared));
  return bytes_of_parts(part_sizes(d, workspace_split_units(d, shared, head_split),
                                   scan_detail::sweep_planned(d, true, shared, sweep)),
                        kForwardParts, kParts);
}

namespace {

// Elements of the per-head parameters in stage order: q_bias, k_bias [H, R, N]; mimo_x, mimo_z,
// mimo_o [H, R, P].
std::array<size_t, 5> parameter_elements(const Dims& d) {
  const size_t hr = static_cast<size_t>(d.heads) * d.rank;
  const size_t n = hr * d.state, p = hr * d.headdim;
  return {n, n, p, p, p};
}
size_t parameter_stage_bytes(const Dims& d) {
  size_t total = 0;
  for (const size_t elements : parameter_elements(d)) total += part_bytes(elements / 2 + 1);
  return total;
}
size_t psiv_cache_bytes(const Dims& d, bool psiv_cache) {
  const size_t tokens = static_cast<size_t>(d.batch) * d.seqlen * d.heads;
  return psiv_cache ? tokens * d.rank * d.headdim * sizeof(bf16) : 0;
}

// What the constructor allocates for itself at dims `d` (own_workspace_bytes).
size_t own_bytes(const Dims& d, bool psiv_cache, bool shared_backward, int split_units,
                 bool sweep) {
  const size_t own = bytes_of_parts(part_sizes(d, split_units, sweep), 0,
                                    shared_backward ? kForwardParts : kParts);
  return own + psiv_cache_bytes(d, psiv_cache) + parameter_stage_bytes(d);
}

}  // namespace

size_t Mamba3ScanCuda::own_workspace_bytes(const ops::ScanShape& shape, bool psiv_cache,
                                           bool shared_backward, ScanHeadSplit head_split,
                                           ScanSweep sweep) {
  const SharedMemoryLimits shared = current_shared_memory_limits();
  const Dims d = scan_detail::dims_of(scan_detail::planned_shape(shape, shared));
  return own_bytes(d, psiv_cache, shared_backward,
                   shared_backward ? 0 : workspace_split_units(d, shared, head_split),
                   scan_detail::sweep_planned(d, true, shared, sweep));
}

Mamba3ScanCuda::Mamba3ScanCuda(const ops::ScanShape& shape, bool psiv_cache, bool tensor_cores,
                               void* backward_workspace, size_t backward_bytes, ScanChains chains,
                               ScanHeadSplit head_split, ScanSweep sweep)
    : shape_(shape),
      psiv_cache_(psiv_cache),
      tensor_cores_(tensor_cores),
      chains_(chains),
      head_split_(head_split),
      sweep_policy_(sweep) {
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device_));
  const SharedMemoryLimits shared = shared_memory_limits(device_);
  const ops::ScanShape planned = scan_detail::planned_shape(shape, shared);
  planned_chunk_ = planned.chunk;
  const Dims d = scan_detail::dims_of(planned);
  scan_detail::raise_shared_limits(d, shared, chains);
  // The workspace is sized as backward_workspace_bytes and own_workspace_bytes size it: for the
  // split units of either variant (the larger), and with the sweep's parts wherever the
  // tensor-core variant would sweep; this scan uses what its own plan needs (no split units
  // where it sweeps).
  const bool runs_sweep = scan_detail::sweep_planned(d, tensor_cores, shared, sweep);
  const bool workspace_sweep = scan_detail::sweep_planned(d, true, shared, sweep);
  const int own_split = scan_detail::planned_split_units(d, tensor_cores, shared, head_split);
  const int split_units = runs_sweep ? 0 : own_split;
  const int workspace_split =
      std::max(own_split, scan_detail::planned_split_units(d, !tensor_cores, shared, head_split));
  const std::array<size_t, kParts> sizes = part_sizes(d, workspace_split, workspace_sweep);
  const size_t backward_needed = bytes_of_parts(sizes, kForwardParts, kParts);
  if (backward_workspace != nullptr && backward_bytes < backward_needed) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: the shared backward workspace has {} bytes; this shape needs {} "
           "(backward_workspace_bytes with the same head_split and sweep as this scan's)",
           backward_bytes, backward_needed);
  }
  // The state passes move four floats at a time.
  if (reinterpret_cast<uintptr_t>(backward_workspace) % 16 != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "Mamba3ScanCuda: the shared backward workspace at {} is not 16-byte aligned",
           backward_workspace);
  }
  const bool own_backward = backward_workspace == nullptr;
  const size_t own = bytes_of_parts(sizes, 0, own_backward ? kParts : kForwardParts);
  workspace_bytes_ = own_bytes(d, psiv_cache, !own_backward, workspace_split, workspace_sweep);
  psiv_bytes_ = psiv_cache_bytes(d, psiv_cache);
  MEGACPP_CUDA_CHECK(cudaMalloc(&arena_, workspace_bytes_));
  buffers_ = new Buffers{};
  buffers_->dims = d;
  buffers_->forward = scan_detail::forward_launches(d, tensor_cores, shared.per_sm, chains);
  buffers_->backward = scan_detail::backward_launches(d, tensor_cores, shared.per_block, chains,
                                                      split_units, runs_sweep);
  unsigned char* cursor = static_cast<unsigned char*>(arena_);
  float* parts[kParts];
  for (int i = 0; i < kParts; ++i) {
    if (i == kForwardParts && !own_backward) {
      // psiv stays in the own arena, after the forward parts.
      unsigned char* psiv = cursor;
      cursor = static_cast<unsigned char*>(backward_workspace);
      parts[i] = reinterpret_cast<float*>(cursor);
      cursor += part_bytes(sizes[static_cast<size_t>(i)]);
      for (int j = i + 1; j < kParts; ++j) {
        parts[j] = reinterpret_cast<float*>(cursor);
        cursor += part_bytes(sizes[static_cast<size_t>(j)]);
      }
      cursor = psiv;
      break;
    }
    parts[i] = reinterpret_cast<float*>(cursor);
    cursor += part_bytes(sizes[static_cast<size_t>(i)]);
  }
  Work& w = buffers_->work;
  w.theta0 = parts[0];
  w.states = parts[1];
  w.decay = parts[2];
  w.order = reinterpret_cast<int*>(parts[3]);
  w.gstates = parts[7];
  w.dq_acc = parts[8];
  w.dk_acc = parts[9];
  w.dtheta = parts[10];
  w.dtheta_tot = parts[11];
  w.tok_dadt = parts[12];
  w.tok_ddt = parts[13];
  w.tok_dtau = parts[14];
  w.tok_dkappa = parts[15];
  w.partials = parts[16];
  w.split_qk = buffers_->backward.split.split_units > 0 ? parts[17] : nullptr;
  w.psiv = psiv_cache ? reinterpret_cast<bf16*>(cursor) : nullptr;
  if (runs_sweep) {
    w.gate_in = reinterpret_cast<bf16*>(parts[4]);
    w.sweep_scalars = parts[5];
    w.sweep_rotation = parts[6];
    w.sweep_d_out = reinterpret_cast<bf16*>(parts[18]);
    // Each head's dq and dk, bf16, in gstates' space (B·H·chunks·P·N floats at P = N = C·R).
    w.sweep_dq = reinterpret_cast<bf16*>(w.gstates);
    w.sweep_dk = w.sweep_dq + static_cast<size_t>(d.batch) * d.heads * d.chunks * d.rows * d.state;
  }
  // The parameter stage: the arena's last bytes, each tensor's slot a multiple of 256 bytes.
  unsigned char* stage = static_cast<unsigned char*>(arena_) + own + psiv_bytes_;
  const std::array<size_t, 5> elements = parameter_elements(d);
  for (size_t i = 0; i < elements.size(); ++i) {
    buffers_->staged_parameters[i] = reinterpret_cast<bf16*>(stage);
    stage += part_bytes(elements[i] / 2 + 1);
  }
  // θ offsets stay zero when there are no angles: the kernels that read them then skip.
  MEGACPP_CUDA_CHECK(cudaMemset(arena_, 0, workspace_bytes_));
  if (!own_backward) MEGACPP_CUDA_CHECK(cudaMemset(backward_workspace, 0, backward_needed));
}

bool Mamba3ScanCuda::sweeps() const {
  return buffers_->backward.sweep;
}

Mamba3ScanCuda::~Mamba3ScanCuda() {
  if (arena_ != nullptr) cudaFree(arena_);
  delete buffers_;
}

namespace {

// The chunk kernels move the bf16 tensors' rows 16 bytes at a time at the fixed shapes
// (kColumnsPerItem). The per-token tensors are refused unless 16-byte aligned (cudaMalloc's
// allocations and the model's buffers are 256-byte aligned); the small per-head parameters are
// copied to an aligned stage instead (stage_parameters), since a tensor-parallel model's bf16
// parameter copies lie wherever the parameters before them end.
void require_aligned_rows(const char* call, const ScanDeviceInputs& in,
                          std::initializer_list<std::pair<const char*, const void*>> outputs) {
  const auto check = [call](const char* name, const void* at) {
    if (reinterpret_cast<uintptr_t>(at) % 16 != 0) {
      refuse(ErrorKind::kInvalidArgument,
             "{}: {} at {} is not 16-byte aligned (the scan moves its rows 16 bytes at a time)",
             call, name, at);
    }
  };
  check("q", in.q);
  check("k", in.k);
  check("v", in.v);
  check("z", in.z);
  for (const auto& [name, at] : outputs) check(name, at);
}

// Points each per-head parameter that is not 16-byte aligned at an aligned copy, made on `stream`
// (a few tens of KB; capturable in a CUDA graph).
void stage_parameters(scan_detail::DevInputs& in, const Dims& d, const std::array<bf16*, 5>& stage,
                      cudaStream_t stream) {
  const bf16** parameters[] = {&in.q_bias, &in.k_bias, &in.mimo_x, &in.mimo_z, &in.mimo_o};
  const std::array<size_t, 5> elements = parameter_elements(d);
  for (size_t i = 0; i < elements.size(); ++i) {
    if (reinterpret_cast<uintptr_t>(*parameters[i]) % 16 == 0) continue;
    MEGACPP_CUDA_CHECK(cudaMemcpyAsync(stage[i], *parameters[i], elements[i] * sizeof(bf16),
                                       cudaMemcpyDeviceToDevice, stream));
    *parameters[i] = stage[i];
  }
}

}  // namespace

void Mamba3ScanCuda::forward(const ScanDeviceInputs& in, uint16_t* y, void* stream) {
  if (y == nullptr) refuse(ErrorKind::kInvalidArgument, "Mamba3ScanCuda::forward: y is null");
  require_aligned_rows("Mamba3ScanCuda::forward", in, {{"y", y}});
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const Dims& d = buffers_->dims;
  scan_detail::DevInputs din = scan_detail::dev_inputs(in, d);
  stage_parameters(din, d, buffers_->staged_parameters, static_cast<cudaStream_t>(stream));
  scan_detail::run_forward(buffers_->forward, tensor_cores_, psiv_cache_, d, din, buffers_->work,
                           reinterpret_cast<bf16*>(y), static_cast<cudaStream_t>(stream));
  has_forward_ = true;
}

void Mamba3ScanCuda::backward(const ScanDeviceInputs& in, const uint16_t* dy,
                              const ScanDeviceGrads& grads, void* stream) {
  if (!has_forward_) {
    refuse(ErrorKind::kFailedPrecondition,
           "Mamba3ScanCuda::backward needs a forward() with the same inputs first");
  }
  if (dy == nullptr) refuse(ErrorKind::kInvalidArgument, "Mamba3ScanCuda::backward: dy is null");
  require_aligned_rows("Mamba3ScanCuda::backward", in,
                       {{"dy", dy},
                        {"the gradient q", grads.q},
                        {"the gradient k", grads.k},
                        {"the gradient v", grads.v},
                        {"the gradient z", grads.z}});
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const Dims& d = buffers_->dims;
  scan_detail::DevInputs din = scan_detail::dev_inputs(in, d);
  stage_parameters(din, d, buffers_->staged_parameters, static_cast<cudaStream_t>(stream));
  const scan_detail::DevGrads dg = scan_detail::dev_grads(grads, d.angles);
  scan_detail::run_backward(buffers_->backward, tensor_cores_, psiv_cache_, d, din, buffers_->work,
                            reinterpret_cast<const bf16*>(dy), dg,
                            static_cast<cudaStream_t>(stream));
}

std::vector<KernelAttributes> kernel_attributes(const ops::ScanShape& shape, bool tensor_cores,
                                                ScanChains chains, ScanHeadSplit head_split,
                                                ScanSweep sweep) {
  int device = 0, max_threads_per_sm = 0;
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device));
  const SharedMemoryLimits shared = shared_memory_limits(device);
  const Dims d = scan_detail::dims_of(scan_detail::planned_shape(shape, shared));
  scan_detail::raise_shared_limits(d, shared, chains);
  MEGACPP_CUDA_CHECK(
      cudaDeviceGetAttribute(&max_threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  std::vector<KernelAttributes> out;
  for (const scan_detail::Launch& l :
       scan_detail::all_launches(d, tensor_cores, shared, chains, head_split, sweep)) {
    cudaFuncAttributes attr{};
    MEGACPP_CUDA_CHECK(cudaFuncGetAttributes(&attr, l.function));
    const int threads = static_cast<int>(l.block.x * l.block.y * l.block.z);
    const int blocks = scan_detail::resident_blocks(l, shared);
    KernelAttributes k;
    k.name = l.name;
    k.chunk = d.chunk;
    k.registers_per_thread = attr.numRegs;
    k.static_shared_bytes = attr.sharedSizeBytes;
    k.dynamic_shared_bytes = l.smem.total;
    k.local_bytes_per_thread = attr.localSizeBytes;
    k.max_threads_per_block = attr.maxThreadsPerBlock;
    k.block_threads = threads;
    k.grid_blocks = static_cast<long long>(l.grid.x) * l.grid.y * l.grid.z;
    k.blocks_per_sm = blocks;
    k.occupancy = max_threads_per_sm > 0 ? static_cast<double>(blocks * threads) /
                                               static_cast<double>(max_threads_per_sm)
                                         : 0.0;
    out.push_back(k);
  }
  return out;
}

std::vector<KernelAttributes> Mamba3ScanCuda::kernel_attributes() const {
  return megacpp::cuda::kernel_attributes(shape_, tensor_cores_, chains_, head_split_,
                                          sweep_policy_);
}

}  // namespace megacpp::cuda
