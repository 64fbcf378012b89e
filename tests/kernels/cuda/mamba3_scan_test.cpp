// The CUDA Mamba-3 scan (kernels/cuda/mamba3_scan.h) against the CPU oracle, the chunked form in
// double (which equals the recurrence to 1e-15): an entry of the oracle harness, plus the shape
// refusals and the launch introspection.
#include "tests/kernels/cuda/oracle_harness.h"

#ifdef MEGACPP_HAVE_CUDA

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/contracts/mamba3_scan.h"
#include "kernels/cpu/mamba3_scan_chunked.h"
#include "kernels/cuda/device_query.h"
#include "kernels/cuda/mamba3_scan.h"

namespace {

namespace oracle = megacpp::testing::oracle;
using megacpp::cuda::Mamba3ScanCuda;
using megacpp::ops::ScanShape;
using oracle::DType;
using oracle::Role;

// The correctness grid's shape (shared/bench/anchors.md): batch 4, seqlen 2048, 16 heads, one
// group, A_n = N/4 rotation pairs.
ScanShape grid_shape(int n, int p, int r, int chunk) {
  ScanShape s;
  s.batch = 4;
  s.seqlen = 2048;
  s.heads = 16;
  s.groups = 1;
  s.state = n;
  s.headdim = p;
  s.rank = r;
  s.chunk = chunk;
  s.angles = n / 4;
  return s;
}

std::string shape_name(const ScanShape& s) {
  std::ostringstream name;
  name << "N" << s.state << "_P" << s.headdim << "_R" << s.rank << "_C" << s.chunk << "_B"
       << s.batch << "_L" << s.seqlen << "_H" << s.heads << "_G" << s.groups;
  return name.str();
}

// What this GPU allows a block (as megacpp's kernels plan with it: kSharedMemoryCapVariable may
// lower it).
size_t device_shared_per_block() {
  return megacpp::cuda::current_shared_memory_limits().per_block;
}

struct Mamba3Scan {
  static constexpr const char* kName = "Mamba3ScanCuda";
  static constexpr oracle::Tolerance kTolerance = oracle::kBf16Tolerance;

  struct Variant {
    std::string name;
    int same_bits_as = -1;
    bool tensor_cores = true;
    bool psiv_cache = false;
    // Built over a backward workspace shared with a second scan, whose forward and backward on
    // other inputs run between this one's: this one's results must not change by a bit.
    bool shared_backward = false;
    // The per-head parameters (biases, mimo projections) 2 bytes past a 16-byte boundary, as a
    // tensor-parallel model's bf16 parameter copies may lie: the scan stages aligned copies.
    bool unaligned_parameters = false;
    // The chunk chains forced on or off (ScanChains): the two ways must give the same bits.
    megacpp::cuda::ScanChains chains = megacpp::cuda::ScanChains::kWherePaying;
    // chunk_backward's units split into a block per head everywhere or nowhere (ScanHeadSplit):
    // the same bits either way.
    megacpp::cuda::ScanHeadSplit head_split = megacpp::cuda::ScanHeadSplit::kWherePaying;
    // z and v read in place inside one wider row a token (as the model reads them in in_proj's
    // output: ScanDeviceInputs::zv_row_stride), with columns between and after them: the same
    // bits as from their own tensors.
    bool zv_in_a_wider_row = false;
    // The backward as a sweep (ScanSweep, SISO and MIMO): forced off, the other way's rounding is
    // held to the oracle too.
    megacpp::cuda::ScanSweep sweep = megacpp::cuda::ScanSweep::kWherePaying;
  };
  struct Case {
    std::string name;
    ScanShape shape;
    std::vector<Variant> variants;
  };

  static std::vector<Case> cases() {
    // Both math variants: chunk products on the tensor cores and on CUDA cores.
    const std::vector<Variant> both = {{.name = "tensor-core"},
                                       {.name = "cuda-core", .tensor_cores = false}};
    std::vector<Case> out;
    const auto add = [&](const ScanShape& s, std::vector<Variant> variants,
                         const std::string& suffix = "") {
      out.push_back({shape_name(s).append(suffix), s, std::move(variants)});
    };
    // The correctness grid of shared/bench/anchors.md: (N, P, R, chunk).
    for (const auto& [n, p, r, chunk] :
         {std::array{16, 64, 4, 8}, std::array{32, 64, 4, 16}, std::array{64, 64, 4, 16},
          std::array{128, 64, 4, 16}, std::array{256, 64, 4, 8}, std::array{64, 128, 4, 16},
          std::array{128, 32, 4, 16}, std::array{128, 128, 4, 8}, std::array{128, 64, 8, 8},
          std::array{128, 64, 2, 32}, std::array{128, 64, 1, 64}}) {
      add(grid_shape(n, p, r, chunk), both);
    }
    // A grid shape at a batch and sequence length of its own (ragged where seqlen is not a
    // multiple of the chunk).
    const auto sized = [](int n, int p, int r, int chunk, int batch, int seqlen) {
      ScanShape shape = grid_shape(n, p, r, chunk);
      shape.batch = batch;
      shape.seqlen = seqlen;
      return shape;
    };
    // A last chunk shorter than the others.
    add(sized(64, 64, 4, 16, 2, 2043), both);
    add(sized(128, 64, 1, 64, 2, 1000), both);
    // The shapes compiled with fixed dimensions (with_fixed_dims in mamba3_scan_device.cuh): the
    // MIMO one is in the grid and above; the SISO benchmark shape here, ragged.
    add(sized(64, 64, 1, 64, 2, 1000), both);
    // A single chunk, shorter than the chunk, at both fixed shapes and 8 × 16 = 128 (batch, head)
    // pairs: the chunk chains of chunk_forward and the fused chunk_dstate with nothing to wait for
    // and nothing to hand on.
    add(sized(64, 64, 4, 16, 8, 13), both);
    add(sized(64, 64, 1, 64, 8, 50), both);
    // The chains over many chunks in both passes: 128 pairs (forward_chains_run and
    // backward_chains_run; the grid's 64 pairs take the separate reverse state pass, and at MIMO
    // the batch-1 and batch-2 shapes the separate forward passes too).
    add(sized(64, 64, 4, 16, 8, 512), both);
    add(sized(64, 64, 1, 64, 8, 1000), both);
    // Two groups: q and k gradients summed over each group's heads.
    ScanShape s = sized(64, 64, 4, 16, 2, 2048);
    s.groups = 2;
    add(s, both);
    add(sized(128, 64, 2, 32, 1, 2048), both);
    // load_scalars' rotation scans at other chunks and angle counts than the grid's (powers of two
    // up to 64, A = N/4); C·R must be a multiple of 16. A chunk of 48 (not a power of two: idle
    // lanes past the chunk in its second group of 32 tokens) with every pair rotated (A = N/2); a
    // chunk of 12 (16-lane segments, two pairs a warp, lanes past the chunk in each); a chunk of
    // 80 (a third group of 32 tokens a pair, and token loads past the two groups issued ahead);
    // and no rotation (A = 0) at the fixed MIMO shape. (At a chunk of 96, N = P = 32 would run at
    // a smaller chunk: chunk_backward's plan at 96 needs more shared memory than a block may have.)
    s = sized(64, 64, 1, 48, 2, 1001);
    s.angles = 32;
    add(s, both, "_AllPairs");
    add(sized(32, 64, 4, 12, 2, 1001), both);
    add(sized(32, 32, 1, 80, 2, 1001), both);
    s = sized(64, 64, 4, 16, 2, 1001);
    s.angles = 0;
    add(s, both, "_NoAngles");
    // Variants that must give the tensor-core variant's bits exactly.
    const auto same_bits_as_tensor_cores = [](Variant variant) {
      variant.same_bits_as = 0;
      return std::vector<Variant>{{.name = "tensor-core"}, std::move(variant)};
    };
    const Variant psiv_cache{.name = "tensor-core psiv-cache", .psiv_cache = true};
    // The PsiV cache changes no bit.
    s = sized(64, 64, 4, 16, 2, 1000);
    add(s, same_bits_as_tensor_cores(psiv_cache), "_PsivCache");
    add(s,
        same_bits_as_tensor_cores({.name = "tensor-core shared-backward", .shared_backward = true}),
        "_SharedBackward");
    add(s,
        same_bits_as_tensor_cores(
            {.name = "tensor-core unaligned-parameters", .unaligned_parameters = true}),
        "_UnalignedParameters");
    // Runtime shapes (not compiled with fixed dimensions) where chunk_backward's score products
    // make dL/dW in registers (N ≤ rows, R a power of two up to 8), all ragged: R = 2, 4 and 8 sum
    // the R × R blocks over lanes, and o's tiles make the gating terms (dz over a token's R
    // lanes). R = 1 also makes dV's tiles whole: at chunk 32 with z and dy in shared memory (o's
    // tiles take the gating terms), at chunk 64 > N + 1 without (mimo_z's terms in dV's space).
    for (const auto& [n, r, chunk] :
         {std::array{64, 2, 32}, std::array{32, 4, 16}, std::array{64, 8, 8}, std::array{32, 1, 32},
          std::array{32, 1, 64}}) {
      add(sized(n, 64, r, chunk, 2, 1001), both);
    }
    // At the SISO shape too: there dV's tiles read v from shared memory, or global memory with
    // the cache.
    add(sized(64, 64, 1, 64, 2, 1000), same_bits_as_tensor_cores(psiv_cache), "_PsivCache");
    // The chains walk the states with the separate passes' bits (scale_add: one rounding a step
    // either way). At 64 pairs MIMO's forward runs its chain and its backward the separate reverse
    // pass; forcing the backward's chain changes no bit. Forcing the forward's off changes y's
    // bits at MIMO (chunk_output sums a token's ranks in another order than chunk_forward), so
    // that variant is held to the oracle alone. At 32 pairs SISO's forward chain runs: both forced
    // ways give its bits.
    using megacpp::cuda::ScanChains;
    add(sized(64, 64, 4, 16, 4, 1000),
        {{.name = "tensor-core"},
         {.name = "tensor-core chains", .same_bits_as = 0, .chains = ScanChains::kAlways},
         {.name = "tensor-core no chains", .chains = ScanChains::kNever}},
        "_Chains");
    add(sized(64, 64, 1, 64, 2, 1000),
        {{.name = "tensor-core"},
         {.name = "tensor-core chains", .same_bits_as = 0, .chains = ScanChains::kAlways},
         {.name = "tensor-core no chains", .same_bits_as = 0, .chains = ScanChains::kNever}},
        "_Chains");
    // chunk_backward's units as a block per head (all of them) or a block per unit: the same bits,
    // at the fixed MIMO shape (ragged, two groups of 8 heads) on both math variants, at the SISO
    // shape on the CUDA cores (its tensor-core plan keeps the group's sums in the workspace and
    // never splits), at a runtime shape, and at 140 units of 16 heads, where the default splits
    // the units left after the last whole wave (8 of them on 132 SMs) beside whole ones.
    using megacpp::cuda::ScanHeadSplit;
    const auto split_or_not = [](bool cuda_cores) {
      const std::string way = cuda_cores ? "cuda-core" : "tensor-core";
      return std::vector<Variant>{{.name = way, .tensor_cores = !cuda_cores},
                                  {.name = way + " head-split",
                                   .same_bits_as = 0,
                                   .tensor_cores = !cuda_cores,
                                   .head_split = ScanHeadSplit::kAlways},
                                  {.name = way + " no head-split",
                                   .same_bits_as = 0,
                                   .tensor_cores = !cuda_cores,
                                   .head_split = ScanHeadSplit::kNever}};
    };
    s = sized(64, 64, 4, 16, 2, 1001);
    s.groups = 2;
    add(s, split_or_not(false), "_HeadSplit");
    add(s, split_or_not(true), "_HeadSplitCudaCores");
    add(sized(64, 64, 1, 64, 2, 1000), split_or_not(true), "_HeadSplitCudaCores");
    add(sized(32, 64, 4, 16, 2, 1001), split_or_not(false), "_HeadSplit");
    add(sized(64, 64, 4, 16, 1, 2240), split_or_not(false), "_HeadSplitWholeAndSplit");
    // z and v in a wider row: at both fixed shapes (MIMO at 64 pairs, its forward chained, with
    // the PsiV cache too; SISO ragged), at MIMO's 32 pairs (the separate forward passes) and at a
    // runtime shape; on the tensor cores and CUDA cores.
    const auto in_a_wider_row = [](bool cuda_cores) {
      const std::string way = cuda_cores ? "cuda-core" : "tensor-core";
      return std::vector<Variant>{{.name = way, .tensor_cores = !cuda_cores},
                                  {.name = way + " zv-in-a-wider-row",
                                   .same_bits_as = 0,
                                   .tensor_cores = !cuda_cores,
                                   .zv_in_a_wider_row = true}};
    };
    for (const ScanShape& shape : {sized(64, 64, 4, 16, 4, 1000), sized(64, 64, 1, 64, 2, 1000),
                                   sized(64, 64, 4, 16, 2, 1001), sized(32, 64, 4, 16, 2, 1001)}) {
      add(shape, in_a_wider_row(false), "_ZvInAWiderRow");
      add(shape, in_a_wider_row(true), "_ZvInAWiderRowCudaCores");
    }
    add(sized(64, 64, 4, 16, 4, 1000),
        {{.name = "tensor-core psiv-cache", .psiv_cache = true},
         {.name = "tensor-core psiv-cache zv-in-a-wider-row",
          .same_bits_as = 0,
          .psiv_cache = true,
          .zv_in_a_wider_row = true}},
        "_ZvInAWiderRowPsivCache");
    // The backward's two ways at the fixed SISO and MIMO shapes (R = 1 and chunk 64, R = 4 and
    // chunk 16: 64 rows (token, rank) a chunk either way; the sweep where a Hopper GPU has its
    // shared memory, else chunk_backward both times), each held to the oracle: ragged, a single
    // short chunk, 128 pairs over many chunks, two groups (q and k summed over each group's 8
    // heads), 24 heads (sweep_token_terms' tiles of 256 (token, head) items hold 10 tokens, so a
    // chunk ends on a partial tile), and the sweep's other ways in, which give its bits: a shared
    // backward workspace, the PsiV cache, the separate forward passes (chunk_output keeps o and
    // the token scalars instead of chunk_forward), z and v in a wider row.
    using megacpp::cuda::ScanSweep;
    const auto sweep_or_not = [](std::vector<Variant> more = {}) {
      std::vector<Variant> variants = {
          {.name = "tensor-core sweep", .sweep = ScanSweep::kAlways},
          {.name = "tensor-core no sweep", .sweep = ScanSweep::kNever}};
      variants.insert(variants.end(), more.begin(), more.end());
      return variants;
    };
    // More heads than angle_sums' dt table holds (kDtTable, 4096 heads · tokens): its dt read from
    // memory, and more (head, pair) items than a block's threads.
    {
      ScanShape many_heads = sized(16, 64, 4, 8, 1, 20);
      many_heads.heads = 4104;
      add(many_heads, both, "_DtFromMemory");
    }
    for (const auto& [rank, chunk] : {std::array{1, 64}, std::array{4, 16}}) {
      add(sized(64, 64, rank, chunk, 2, 1000), sweep_or_not(), "_Sweep");
      add(sized(64, 64, rank, chunk, 8, 50), sweep_or_not(), "_Sweep");
      add(sized(64, 64, rank, chunk, 8, 1000), sweep_or_not(), "_Sweep");
      // 400 tokens: 7 chunks at SISO and 25 at MIMO, so the last group of the partials' (4 and 8
      // chunks) is partly filled.
      add(sized(64, 64, rank, chunk, 2, 400), sweep_or_not(), "_Sweep");
      // Two and three chunks (the last one short): the walks where sweep_core's operand warps start
      // the second chunk's copies without a free barrier, and the only free barrier is chunk 2's.
      add(sized(64, 64, rank, chunk, 2, 2 * chunk - chunk / 4), sweep_or_not(), "_Sweep");
      add(sized(64, 64, rank, chunk, 2, 3 * chunk - chunk / 4), sweep_or_not(), "_Sweep");
      s = sized(64, 64, rank, chunk, 2, 1000);
      s.groups = 2;
      add(s, sweep_or_not(), "_Sweep");
      s = sized(64, 64, rank, chunk, 1, 1000);
      s.heads = 24;
      add(s, sweep_or_not(), "_Sweep");
      add(sized(64, 64, rank, chunk, 2, 1001),
          sweep_or_not({{.name = "tensor-core sweep shared-backward",
                         .same_bits_as = 0,
                         .shared_backward = true,
                         .sweep = ScanSweep::kAlways},
                        {.name = "tensor-core sweep psiv-cache",
                         .same_bits_as = 0,
                         .psiv_cache = true,
                         .sweep = ScanSweep::kAlways},
                        {.name = "tensor-core sweep no chains",
                         .same_bits_as = 0,
                         .chains = ScanChains::kNever,
                         .sweep = ScanSweep::kAlways},
                        {.name = "tensor-core sweep zv-in-a-wider-row",
                         .same_bits_as = 0,
                         .zv_in_a_wider_row = true,
                         .sweep = ScanSweep::kAlways}}),
          "_SweepWaysIn");
    }
    return out;
  }

  // A shape whose chunk_backward fits this GPU's shared memory at no chunk is refused at
  // construction, and the case is skipped (no grid case is: an A100's 166,912 bytes run 10 of
  // them at a smaller chunk, checked against the oracle like any other run: see
  // PlansTheLargestChunkThatFitsTheDevice).
  static std::string beyond_device(const Case& c) {
    const size_t allows = device_shared_per_block();
    if (megacpp::cuda::planned_scan_chunk(c.shape, allows) > 0) return "";
    return "chunk_backward needs more than the " + std::to_string(allows) +
           " bytes of shared memory per block this device allows, at every chunk";
  }

  // Plausible model values: unit-scale q, k, x, z, dy; DT log-uniform in [1e-3, 0.1]; ADT = A·DT
  // with A in [-8, -0.5]; biases and mimo weights near their initial values.
  static void declare(const Case& c, oracle::Problem& p) {
    const ScanShape& s = c.shape;
    std::mt19937_64& rng = p.rng();
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    const size_t tokens = static_cast<size_t>(s.batch) * s.seqlen;
    const size_t qk = tokens * s.rank * s.groups * s.state;
    const size_t xz = tokens * s.heads * s.headdim;
    const size_t th = tokens * s.heads;
    const size_t rn = static_cast<size_t>(s.heads) * s.rank * s.state;
    const size_t rp = static_cast<size_t>(s.heads) * s.rank * s.headdim;
    const size_t heads = static_cast<size_t>(s.heads);
    const double inv_rank = 1.0 / s.rank;
    const auto gaussian = [&] {
      return normal(rng);
    };
    const auto near_one = [&] {
      return 1.0 + 0.3 * normal(rng);
    };
    const auto near_inv_rank = [&] {
      return inv_rank * (1.0 + 0.3 * normal(rng));
    };
    std::vector<double> dt(th);
    for (double& x : dt)
      x = std::exp(std::log(1e-3) + unit(rng) * (std::log(0.1) - std::log(1e-3)));

    p.input("q", DType::kBf16, qk, gaussian);
    p.input("k", DType::kBf16, qk, gaussian);
    p.input("v", DType::kBf16, xz, gaussian);
    p.input("z", DType::kBf16, xz, gaussian);
    p.input("dt", DType::kBf16, th, [&](size_t i) { return dt[i]; });
    p.input("adt", DType::kBf16, th, [&](size_t i) { return -(0.5 + 7.5 * unit(rng)) * dt[i]; });
    p.input("trap", DType::kBf16, th, gaussian);
    p.input("angles", DType::kBf16, tokens * s.angles, gaussian);
    p.input("q_bias", DType::kBf16, rn, near_one);
    p.input("k_bias", DType::kBf16, rn, near_one);
    p.input("mimo_x", DType::kBf16, rp, near_inv_rank);
    p.input("mimo_z", DType::kBf16, rp, near_one);
    p.input("mimo_o", DType::kBf16, rp, near_inv_rank);
    p.input("d", DType::kBf16, heads, [&] { return 0.5 + unit(rng); });
    p.input("dy", DType::kBf16, xz, gaussian);

    p.output("y", DType::kBf16, xz, Role::kOutput);
    // The 14 gradients: per-token ones bf16, per-head parameter ones fp32.
    const std::pair<const char*, size_t> token_grads[] = {
        {"dq", qk},   {"dk", qk},  {"dv", xz},    {"dz", xz},
        {"dadt", th}, {"ddt", th}, {"dtrap", th}, {"dangles", tokens * s.angles}};
    for (const auto& [name, count] : token_grads)
      p.output(name, DType::kBf16, count, Role::kGradient);
    const std::pair<const char*, size_t> param_grads[] = {{"dq_bias", rn}, {"dk_bias", rn},
                                                          {"dmimo_x", rp}, {"dmimo_z", rp},
                                                          {"dmimo_o", rp}, {"dD", heads}};
    for (const auto& [name, count] : param_grads)
      p.output(name, DType::kF32, count, Role::kGradient);
  }

  static void cpu(const Case& c, oracle::Problem& p) {
    const megacpp::ops::ScanInputs<double> in{.q = p.in("q"),
                                              .k = p.in("k"),
                                              .v = p.in("v"),
                                              .z = p.in("z"),
                                              .adt = p.in("adt"),
                                              .dt = p.in("dt"),
                                              .trap = p.in("trap"),
                                              .angles = p.in("angles"),
                                              .q_bias = p.in("q_bias"),
                                              .k_bias = p.in("k_bias"),
                                              .mimo_x = p.in("mimo_x"),
                                              .mimo_z = p.in("mimo_z"),
                                              .mimo_o = p.in("mimo_o"),
                                              .d = p.in("d")};
    const megacpp::ops::ScanGrads<double> grads{.q = p.out("dq"),
                                                .k = p.out("dk"),
                                                .v = p.out("dv"),
                                                .z = p.out("dz"),
                                                .adt = p.out("dadt"),
                                                .dt = p.out("ddt"),
                                                .trap = p.out("dtrap"),
                                                .angles = p.out("dangles"),
                                                .q_bias = p.out("dq_bias"),
                                                .k_bias = p.out("dk_bias"),
                                                .mimo_x = p.out("dmimo_x"),
                                                .mimo_z = p.out("dmimo_z"),
                                                .mimo_o = p.out("dmimo_o"),
                                                .d = p.out("dD")};
    megacpp::cpu::Mamba3ScanChunked<double> scan(c.shape);
    scan.forward(in, p.out("y"));
    scan.backward(in, p.in("dy"), grads);
  }

  static oracle::Gpu gpu(const Case& c, const Variant& v, oracle::DeviceTensors& t) {
    const ScanShape& sh = c.shape;
    std::shared_ptr<oracle::DeviceBuffer> shared;
    if (v.shared_backward) {
      shared = std::make_shared<oracle::DeviceBuffer>(Mamba3ScanCuda::backward_workspace_bytes(
          sh, megacpp::cuda::ScanHeadSplit::kWherePaying, v.sweep));
    }
    const auto make_scan = [&] {
      return std::make_shared<Mamba3ScanCuda>(
          sh, v.psiv_cache, v.tensor_cores, shared ? shared->get() : nullptr,
          shared ? shared->bytes() : 0, v.chains, v.head_split, v.sweep);
    };
    const auto scan = make_scan();
    EXPECT_EQ(scan->psiv_bytes() > 0, v.psiv_cache) << "PsiV cache of " << scan->psiv_bytes();
    // A forced sweep runs wherever the GPU has its shared memory (the variants force it only at
    // the fixed shapes, on the tensor cores), and a sweep forced off never does.
    if (v.sweep == megacpp::cuda::ScanSweep::kAlways) {
      EXPECT_EQ(scan->sweeps(),
                device_shared_per_block() >= megacpp::cuda::scan_sweep_shared_bytes());
    } else if (v.sweep == megacpp::cuda::ScanSweep::kNever) {
      EXPECT_FALSE(scan->sweeps());
    }
    megacpp::cuda::ScanDeviceInputs in{.q = t.bf16("q"),
                                       .k = t.bf16("k"),
                                       .v = t.bf16("v"),
                                       .z = t.bf16("z"),
                                       .adt = t.bf16("adt"),
                                       .dt = t.bf16("dt"),
                                       .trap = t.bf16("trap"),
                                       .angles = t.bf16("angles"),
                                       .q_bias = t.bf16("q_bias"),
                                       .k_bias = t.bf16("k_bias"),
                                       .mimo_x = t.bf16("mimo_x"),
                                       .mimo_z = t.bf16("mimo_z"),
                                       .mimo_o = t.bf16("mimo_o"),
                                       .d = t.bf16("d")};
    const megacpp::cuda::ScanDeviceGrads grads{.q = t.bf16("dq"),
                                               .k = t.bf16("dk"),
                                               .v = t.bf16("dv"),
                                               .z = t.bf16("dz"),
                                               .adt = t.bf16("dadt"),
                                               .dt = t.bf16("ddt"),
                                               .trap = t.bf16("dtrap"),
                                               .angles = t.bf16("dangles"),
                                               .q_bias = t.f32("dq_bias"),
                                               .k_bias = t.f32("dk_bias"),
                                               .mimo_x = t.f32("dmimo_x"),
                                               .mimo_z = t.f32("dmimo_z"),
                                               .mimo_o = t.f32("dmimo_o"),
                                               .d = t.f32("dD")};
    uint16_t* const y = t.bf16("y");
    const uint16_t* const dy = t.bf16("dy");
    std::shared_ptr<oracle::DeviceBuffer> wide;
    if (v.zv_in_a_wider_row) {
      // A token's row: 8 columns, z, 16 columns, v, 8 columns.
      const size_t dense = static_cast<size_t>(sh.heads) * sh.headdim;
      const size_t stride = 2 * dense + 32, tokens = static_cast<size_t>(sh.batch) * sh.seqlen;
      wide = std::make_shared<oracle::DeviceBuffer>(tokens * stride * sizeof(uint16_t));
      MEGACPP_CUDA_CHECK(cudaMemset(wide->get(), 0xff, wide->bytes()));  // NaNs around them
      uint16_t* row = static_cast<uint16_t*>(wide->get());
      const std::pair<const uint16_t**, size_t> placed[] = {{&in.z, 8}, {&in.v, dense + 24}};
      for (const auto& [tensor, column] : placed) {
        MEGACPP_CUDA_CHECK(cudaMemcpy2D(row + column, stride * sizeof(uint16_t), *tensor,
                                        dense * sizeof(uint16_t), dense * sizeof(uint16_t), tokens,
                                        cudaMemcpyDeviceToDevice));
        *tensor = row + column;
      }
      in.zv_row_stride = static_cast<int64_t>(stride);
    }
    std::shared_ptr<oracle::DeviceBuffer> unaligned;
    if (v.unaligned_parameters) {
      // Each parameter copied to 2 bytes past a 256-byte slot of its own.
      const size_t hr = static_cast<size_t>(sh.heads) * sh.rank;
      const std::array<std::pair<const uint16_t**, size_t>, 5> parameters = {
          {{&in.q_bias, hr * sh.state},
           {&in.k_bias, hr * sh.state},
           {&in.mimo_x, hr * sh.headdim},
           {&in.mimo_z, hr * sh.headdim},
           {&in.mimo_o, hr * sh.headdim}}};
      const size_t slot = (hr * std::max(sh.state, sh.headdim) * 2 + 2 + 255) / 256 * 256;
      unaligned = std::make_shared<oracle::DeviceBuffer>(5 * slot);
      char* base = static_cast<char*>(unaligned->get());
      for (size_t i = 0; i < parameters.size(); ++i) {
        uint16_t* copy = reinterpret_cast<uint16_t*>(base + i * slot + 2);
        MEGACPP_CUDA_CHECK(cudaMemcpy(copy, *parameters[i].first, parameters[i].second * 2,
                                      cudaMemcpyDeviceToDevice));
        *parameters[i].first = copy;
      }
    }
    if (!v.shared_backward) {
      return {{{"forward",
                [=] {
                  (void)unaligned;
                  (void)wide;
                  scan->forward(in, y);
                }},
               {"backward",
                [=] {
                  scan->backward(in, dy, grads);
                }}},
              {}};
    }
    // The other scan: q and k swapped (other inputs), its outputs in scratch buffers.
    const auto other = make_scan();
    megacpp::cuda::ScanDeviceInputs swapped = in;
    std::swap(swapped.q, swapped.k);
    const size_t tokens = static_cast<size_t>(sh.batch) * sh.seqlen;
    const size_t qk = tokens * sh.rank * sh.groups * sh.state;
    const size_t hp = tokens * sh.heads * sh.headdim, h = tokens * sh.heads;
    const size_t a = tokens * static_cast<size_t>(std::max(sh.angles, 1));
    const size_t params =
        static_cast<size_t>(sh.heads) * sh.rank * (2 * sh.state + 3 * sh.headdim) +
        static_cast<size_t>(sh.heads);
    // bf16 per-token gradients and y first, then (256-byte aligned) the fp32 parameter gradients.
    const size_t bf16_bytes = (2 * (2 * qk + 3 * hp + 3 * h + a + 8) + 255) / 256 * 256;
    const auto scratch = std::make_shared<oracle::DeviceBuffer>(bf16_bytes + 4 * params);
    uint16_t* b = static_cast<uint16_t*>(scratch->get());
    megacpp::cuda::ScanDeviceGrads other_grads = grads;
    other_grads.q = b;
    other_grads.k = b += qk;
    other_grads.v = b += qk;
    other_grads.z = b += hp;
    other_grads.adt = b += hp;
    other_grads.dt = b += h;
    other_grads.trap = b += h;
    b += h;
    other_grads.angles = sh.angles > 0 ? b : nullptr;
    uint16_t* other_y = b + (a + 7) / 8 * 8;  // 16-byte aligned, as the scan requires
    float* f = reinterpret_cast<float*>(static_cast<char*>(scratch->get()) + bf16_bytes);
    other_grads.q_bias = f;
    other_grads.k_bias = f += static_cast<size_t>(sh.heads) * sh.rank * sh.state;
    other_grads.mimo_x = f += static_cast<size_t>(sh.heads) * sh.rank * sh.state;
    other_grads.mimo_z = f += static_cast<size_t>(sh.heads) * sh.rank * sh.headdim;
    other_grads.mimo_o = f += static_cast<size_t>(sh.heads) * sh.rank * sh.headdim;
    other_grads.d = f + static_cast<size_t>(sh.heads) * sh.rank * sh.headdim;
    return {{{"forward",
              [=] {
                scan->forward(in, y);
                other->forward(swapped, other_y);
              }},
             {"backward",
              [=] {
                (void)shared;
                (void)scratch;
                other->backward(swapped, dy, other_grads);
                scan->backward(in, dy, grads);
              }}},
            {}};
  }
};

TEST(Mamba3ScanCudaShapes, RefusesShapesItDoesNotCover) {
  MEGACPP_REQUIRE_GPU();
  const auto refused = [](const ScanShape& s, const std::string& field) {
    oracle::expect_error([&] { Mamba3ScanCuda scan(s); }, megacpp::ErrorKind::kInvalidArgument,
                         field, shape_name(s));
  };
  ScanShape s = grid_shape(64, 64, 4, 16);
  s.state = 24;
  s.angles = 6;
  refused(s, "state=24");
  s = grid_shape(64, 64, 4, 16);
  s.headdim = 40;
  refused(s, "headdim=40");
  s = grid_shape(64, 64, 1, 8);
  refused(s, "chunk=8");
  s = grid_shape(64, 64, 4, 16);
  s.groups = 3;
  refused(s, "groups=3");
  // Its state alone (256 × 512 fp32) is more than any GPU's shared memory, at every chunk.
  s = grid_shape(512, 256, 8, 64);
  refused(s, "bytes of shared memory per block (682960 at the smallest chunk, 2)");
}

// The chunk each grid case runs at where a block may have an A100's 166,912 bytes of shared
// memory: 10 cases' chunk_backward plans need more at their own chunk (even with the token weights
// made again where they are read), and each runs at the largest smaller chunk that fits (keeping
// chunk × rank a multiple of 16); on a Hopper GPU (232,448 bytes) every case runs at its own. No
// device needed: the plans are the host's arithmetic.
TEST(Mamba3ScanCudaShapes, PlansTheLargestChunkThatFitsTheDevice) {
  constexpr size_t kHopperPerBlock = 232448, kA100PerBlock = 166912;
  std::map<std::string, int> smaller;
  for (const auto& c : Mamba3Scan::cases()) {
    EXPECT_EQ(megacpp::cuda::planned_scan_chunk(c.shape, kHopperPerBlock), c.shape.chunk) << c.name;
    const int chunk = megacpp::cuda::planned_scan_chunk(c.shape, kA100PerBlock);
    ASSERT_GT(chunk, 0) << c.name;
    ScanShape at = c.shape;
    at.chunk = chunk;
    EXPECT_LE(megacpp::cuda::scan_shared_bytes_needed(at), kA100PerBlock) << c.name;
    if (chunk == c.shape.chunk) continue;
    smaller[c.name] = chunk;
    // Each chunk between the planned one and the shape's needs more than the device allows.
    const int step = 16 / std::gcd(c.shape.rank, 16);
    for (at.chunk = chunk + step; at.chunk < c.shape.chunk; at.chunk += step) {
      EXPECT_GT(megacpp::cuda::scan_shared_bytes_needed(at), kA100PerBlock) << c.name;
    }
  }
  const std::map<std::string, int> expected = {
      {"N128_P64_R4_C16_B4_L2048_H16_G1", 12}, {"N256_P64_R4_C8_B4_L2048_H16_G1", 4},
      {"N64_P128_R4_C16_B4_L2048_H16_G1", 8},  {"N128_P128_R4_C8_B4_L2048_H16_G1", 4},
      {"N128_P64_R8_C8_B4_L2048_H16_G1", 6},   {"N128_P64_R2_C32_B4_L2048_H16_G1", 16},
      {"N128_P64_R1_C64_B4_L2048_H16_G1", 32}, {"N128_P64_R1_C64_B2_L1000_H16_G1", 32},
      {"N128_P64_R2_C32_B1_L2048_H16_G1", 16}, {"N32_P32_R1_C80_B2_L1001_H16_G1", 64}};
  EXPECT_EQ(smaller, expected);
  // M3-ref's MIMO and SISO shapes run at their own chunks on an A100; the SISO shape only because
  // its token weights (C rows of weights_stride: 16.5 KB) get no space (175,520 bytes with them).
  EXPECT_EQ(megacpp::cuda::planned_scan_chunk(grid_shape(64, 64, 4, 16), kA100PerBlock), 16);
  EXPECT_EQ(megacpp::cuda::planned_scan_chunk(grid_shape(64, 64, 1, 64), kA100PerBlock), 64);
  EXPECT_EQ(megacpp::cuda::scan_shared_bytes_needed(grid_shape(64, 64, 1, 64)), 158624u);
  // A shape that fits no chunk: none is planned.
  EXPECT_EQ(megacpp::cuda::planned_scan_chunk(grid_shape(512, 256, 8, 64), kHopperPerBlock), 0);
}

// Sets an environment variable for one scope and puts back what was there.
class ScopedVariable {
 public:
  ScopedVariable(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedVariable() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedVariable(const ScopedVariable&) = delete;
  ScopedVariable& operator=(const ScopedVariable&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// On the GPU, the scan runs each grid case at the chunk planned for the device's shared memory
// (its own on a Hopper GPU; at an A100's figures, kSharedMemoryCapVariable, where the GPU has that
// much, the 10 of PlansTheLargestChunkThatFitsTheDevice at a smaller one), and says so: the scan's
// planned_chunk() and every kernel's attributes. The oracle grid checks those runs' results. At
// those figures the SISO shape's chunk_backward plans 165,952 bytes: no space for W, v's space.
TEST(Mamba3ScanCudaShapes, RunsAtThePlannedChunk) {
  MEGACPP_REQUIRE_GPU();
  const auto smaller_chunks = [] {
    const size_t allows = device_shared_per_block();
    int smaller = 0;
    for (const auto& c : Mamba3Scan::cases()) {
      const int chunk = megacpp::cuda::planned_scan_chunk(c.shape, allows);
      Mamba3ScanCuda scan(c.shape);
      EXPECT_EQ(scan.planned_chunk(), chunk) << c.name;
      EXPECT_EQ(scan.shape().chunk, c.shape.chunk) << c.name;
      for (const auto& k : scan.kernel_attributes()) EXPECT_EQ(k.chunk, chunk) << c.name << k.name;
      if (chunk < c.shape.chunk) ++smaller;
    }
    return smaller;
  };
  const megacpp::cuda::SharedMemoryLimits native = megacpp::cuda::current_shared_memory_limits();
  const int smaller = smaller_chunks();
  if (native.per_block >= 232448) {
    EXPECT_EQ(smaller, 0);
  }
  constexpr size_t kA100PerSm = 167936;
  if (native.capped || native.per_sm < kA100PerSm) return;
  const ScopedVariable cap(megacpp::cuda::kSharedMemoryCapVariable,
                           std::to_string(kA100PerSm).c_str());
  EXPECT_EQ(device_shared_per_block(), 166912u);
  EXPECT_EQ(smaller_chunks(), 10);
  for (const auto& k : megacpp::cuda::kernel_attributes(grid_shape(64, 64, 1, 64))) {
    if (k.name == std::string("chunk_backward")) {
      EXPECT_EQ(k.dynamic_shared_bytes, 166816u);
    }
  }
}

TEST(Mamba3ScanCudaShapes, RefusesAMisalignedSharedBackwardWorkspace) {
  MEGACPP_REQUIRE_GPU();
  const ScanShape s = grid_shape(64, 64, 4, 16);
  const size_t bytes = Mamba3ScanCuda::backward_workspace_bytes(s);
  oracle::DeviceBuffer workspace(bytes + 16);
  char* misaligned = static_cast<char*>(workspace.get()) + 4;
  oracle::expect_error([&] { Mamba3ScanCuda scan(s, false, true, misaligned, bytes); },
                       megacpp::ErrorKind::kInvalidArgument, "16-byte aligned",
                       "backward workspace 4 bytes past an allocation");
}

// The chunk kernels move rows 16 bytes at a time: a per-token tensor 2 bytes past an allocation is
// refused, by name, before anything runs (the per-head parameters are staged instead: the
// _UnalignedParameters case); so is a z/v row stride (ScanDeviceInputs::zv_row_stride) shorter
// than their dense rows or not a multiple of 8.
TEST(Mamba3ScanCudaShapes, RefusesMisalignedInputRows) {
  MEGACPP_REQUIRE_GPU();
  const ScanShape s = grid_shape(64, 64, 4, 16);
  Mamba3ScanCuda scan(s);
  oracle::DeviceBuffer buffer(4096);
  uint16_t* aligned = static_cast<uint16_t*>(buffer.get());
  megacpp::cuda::ScanDeviceInputs in;
  for (const uint16_t** tensor :
       {&in.q, &in.k, &in.v, &in.z, &in.adt, &in.dt, &in.trap, &in.angles, &in.q_bias, &in.k_bias,
        &in.mimo_x, &in.mimo_z, &in.mimo_o, &in.d}) {
    *tensor = aligned;
  }
  in.v = aligned + 1;
  oracle::expect_error([&] { scan.forward(in, aligned); }, megacpp::ErrorKind::kInvalidArgument,
                       "v at", "v 2 bytes past an allocation");
  in.v = aligned;
  oracle::expect_error([&] { scan.forward(in, aligned + 3); }, megacpp::ErrorKind::kInvalidArgument,
                       "y at", "y 6 bytes past an allocation");
  const int64_t dense = static_cast<int64_t>(s.heads) * s.headdim;
  for (const int64_t stride : {dense - 8, dense + 4}) {
    in.zv_row_stride = stride;
    oracle::expect_error([&] { scan.forward(in, aligned); }, megacpp::ErrorKind::kInvalidArgument,
                         "zv_row_stride=" + std::to_string(stride),
                         "a z/v row stride of " + std::to_string(stride));
  }
}

// The backward's own tensors likewise, after a forward of all-zero inputs at a small fixed shape.
TEST(Mamba3ScanCudaShapes, RefusesMisalignedBackwardRows) {
  MEGACPP_REQUIRE_GPU();
  ScanShape s = grid_shape(64, 64, 4, 16);
  s.batch = 1;
  s.seqlen = 64;
  const size_t tokens = static_cast<size_t>(s.batch) * s.seqlen;
  const size_t qk = tokens * s.rank * s.groups * s.state, hp = tokens * s.heads * s.headdim;
  const size_t h = tokens * s.heads, a = tokens * s.angles;
  const size_t hr = static_cast<size_t>(s.heads) * s.rank;
  // Every tensor in a 256-byte slot of one zeroed buffer, slot bytes reserved for 4-byte elements.
  const std::vector<size_t> elements = {qk,
                                        qk,
                                        hp,
                                        hp,
                                        h,
                                        h,
                                        h,
                                        a,
                                        hr * s.state,
                                        hr * s.state,
                                        hr * s.headdim,
                                        hr * s.headdim,
                                        hr * s.headdim,
                                        static_cast<size_t>(s.heads),
                                        hp,
                                        hp};
  std::vector<size_t> slots;
  size_t bytes = 0;
  for (const size_t n : elements) {
    slots.push_back(bytes);
    bytes += (4 * n + 255) / 256 * 256;
  }
  const size_t grad_base = bytes;
  bytes *= 2;
  oracle::DeviceBuffer buffer(bytes);
  MEGACPP_CUDA_CHECK(cudaMemset(buffer.get(), 0, bytes));
  char* base = static_cast<char*>(buffer.get());
  const auto at = [&](size_t i, size_t offset = 0) {
    return reinterpret_cast<uint16_t*>(base + offset + slots[i]);
  };
  const megacpp::cuda::ScanDeviceInputs in{.q = at(0),
                                           .k = at(1),
                                           .v = at(2),
                                           .z = at(3),
                                           .adt = at(4),
                                           .dt = at(5),
                                           .trap = at(6),
                                           .angles = at(7),
                                           .q_bias = at(8),
                                           .k_bias = at(9),
                                           .mimo_x = at(10),
                                           .mimo_z = at(11),
                                           .mimo_o = at(12),
                                           .d = at(13)};
  const auto f32 = [&](size_t i) {
    return reinterpret_cast<float*>(at(i, grad_base));
  };
  megacpp::cuda::ScanDeviceGrads grads{.q = at(0, grad_base),
                                       .k = at(1, grad_base),
                                       .v = at(2, grad_base),
                                       .z = at(3, grad_base),
                                       .adt = at(4, grad_base),
                                       .dt = at(5, grad_base),
                                       .trap = at(6, grad_base),
                                       .angles = at(7, grad_base),
                                       .q_bias = f32(8),
                                       .k_bias = f32(9),
                                       .mimo_x = f32(10),
                                       .mimo_z = f32(11),
                                       .mimo_o = f32(12),
                                       .d = f32(13)};
  Mamba3ScanCuda scan(s);
  scan.forward(in, at(14));
  MEGACPP_CUDA_CHECK(cudaDeviceSynchronize());
  oracle::expect_error([&] { scan.backward(in, at(15) + 1, grads); },
                       megacpp::ErrorKind::kInvalidArgument, "dy at", "dy 2 bytes past a slot");
  grads.z += 1;
  oracle::expect_error([&] { scan.backward(in, at(15), grads); },
                       megacpp::ErrorKind::kInvalidArgument, "the gradient z at",
                       "the gradient of z 2 bytes past a slot");
  grads.z -= 1;
  // The sweep writes q's and k's gradients 16 bytes at a time (sweep_finish): every path refuses
  // them misaligned.
  grads.k += 4;
  oracle::expect_error([&] { scan.backward(in, at(15), grads); },
                       megacpp::ErrorKind::kInvalidArgument, "the gradient k at",
                       "the gradient of k 8 bytes past a slot");
  grads.k -= 4;
  grads.q += 1;
  oracle::expect_error([&] { scan.backward(in, at(15), grads); },
                       megacpp::ErrorKind::kInvalidArgument, "the gradient q at",
                       "the gradient of q 2 bytes past a slot");
}

// The forward is one kernel (chunk_forward, two blocks an SM) on the tensor cores at the fixed
// shapes of a Hopper GPU where the (batch, head) pairs are many enough for its chunk chain to pay
// (48 at MIMO, 32 at SISO), else three (chunk_state, state_pass, chunk_output), as on the CUDA
// cores and at other shapes. At the fixed shapes chunk_dstate also does the reverse state pass
// from 96 pairs; otherwise state_pass_backward follows it. At both fixed shapes on the tensor
// cores of a GPU with the sweep's shared memory, from kSweepLeastPairs pairs, the sweep's three
// kernels replace those.
TEST(Mamba3ScanCudaShapes, ReportsEveryKernelItLaunches) {
  MEGACPP_REQUIRE_GPU();
  const auto names = [](const ScanShape& shape, bool tensor_cores) {
    std::vector<std::string> out;
    for (const auto& a : megacpp::cuda::kernel_attributes(shape, tensor_cores)) {
      EXPECT_GT(a.registers_per_thread, 0) << a.name;
      EXPECT_GT(a.blocks_per_sm, 0) << a.name;
      // These kernels take their block size as a constant (__builtin_assume, token_sums): each is
      // launched with exactly its __launch_bounds__.
      if (a.name == "angle_prefix" || a.name == "chunk_forward" || a.name == "chunk_backward") {
        EXPECT_EQ(a.block_threads, a.max_threads_per_block) << a.name;
      }
      out.push_back(a.name);
    }
    return out;
  };
  const std::vector<std::string> three = {"angle_sums", "angle_prefix", "chunk_state", "state_pass",
                                          "chunk_output"};
  const std::vector<std::string> chained = {"angle_sums", "angle_prefix", "chunk_forward"};
  const auto with = [](std::vector<std::string> first, const std::vector<std::string>& then) {
    first.insert(first.end(), then.begin(), then.end());
    return first;
  };
  const std::vector<std::string> tail = {"chunk_backward", "dtheta_offsets", "finish_tokens",
                                         "reduce_params"};
  const auto chained_backward = with({"chunk_dstate"}, tail);
  const auto separate_backward = with({"chunk_dstate", "state_pass_backward"}, tail);
  const std::vector<std::string> sweep_backward = {"sweep_prep", "sweep_core", "sweep_finish",
                                                   "reduce_params"};
  const bool sweep_fits = device_shared_per_block() >= megacpp::cuda::scan_sweep_shared_bytes();
  // Hopper's 228 KB of shared memory per SM holds two chunk_forward blocks at both fixed shapes;
  // with less (an A100's 164 KB, or a cap: kSharedMemoryCapVariable) a fixed shape may keep the
  // three kernels.
  const size_t shared_per_sm = megacpp::cuda::current_shared_memory_limits().per_sm;
  for (const int rank : {4, 1}) {
    // 4 × 16 = 64 pairs (the grid's), 6 × 16 = 96 (the backward's crossover), 8 × 16 = 128 and
    // 1 × 16 = 16.
    ScanShape fixed = grid_shape(64, 64, rank, rank == 4 ? 16 : 64);
    if (megacpp::cuda::planned_scan_chunk(fixed, device_shared_per_block()) != fixed.chunk) {
      // Run at a smaller chunk (a device with less shared memory than an A100), the shape is no
      // longer a fixed one.
      EXPECT_EQ(names(fixed, true), with(three, separate_backward)) << "rank " << rank;
      continue;
    }
    const bool two_forward_blocks = shared_per_sm >= 228 * 1024;
    for (const int batch : {4, 6, 8, 1}) {
      fixed.batch = batch;
      const int pairs = batch * fixed.heads;
      const bool forward_chain = two_forward_blocks && pairs >= (rank == 1 ? 32 : 48);
      const std::vector<std::string> got = names(fixed, true);
      const bool fused = std::find(got.begin(), got.end(), "chunk_forward") != got.end();
      if (two_forward_blocks) {
        EXPECT_EQ(fused, forward_chain) << "rank " << rank << ", " << pairs << " pairs";
      }
      const bool backward_chain = pairs >= 96;
      const bool sweeps = sweep_fits && pairs >= megacpp::cuda::kSweepLeastPairs;
      EXPECT_EQ(got, with(fused ? chained : three, sweeps           ? sweep_backward
                                                   : backward_chain ? chained_backward
                                                                    : separate_backward))
          << "rank " << rank << ", " << pairs << " pairs";
    }
    fixed.batch = 8;
    for (const auto& a : megacpp::cuda::kernel_attributes(fixed, true)) {
      if (a.name == "chunk_forward") {
        EXPECT_GE(a.blocks_per_sm, 2) << "rank " << rank;
      }
    }
  }
  // sweep_token_terms holds a token's heads in one tile of 256: at 256 heads the sweep runs
  // (where it fits), at 272 chunk_backward does.
  if (sweep_fits) {
    ScanShape wide = grid_shape(64, 64, 1, 64);
    for (const int heads : {256, 272}) {
      wide.heads = heads;
      const std::vector<std::string> got = names(wide, true);
      EXPECT_EQ(std::count(got.begin(), got.end(), "sweep_core"), heads <= 256 ? 1 : 0) << heads;
      EXPECT_EQ(std::count(got.begin(), got.end(), "chunk_backward"), heads <= 256 ? 0 : 1)
          << heads;
    }
  }
  ScanShape many = grid_shape(64, 64, 4, 16);
  many.batch = 8;
  EXPECT_EQ(names(many, false), with(three, chained_backward));
  EXPECT_EQ(names(grid_shape(32, 64, 4, 16), true), with(three, separate_backward));
}

// The sweep runs at the fixed SISO and MIMO shapes (64 rows a chunk) with 16 rotation pairs and at
// most 256 heads on the tensor cores of a GPU that has its shared memory (and runs it as built for
// sm_90: its copies are the tensor memory accelerator's; every such GPU here), from
// kSweepLeastPairs pairs where paying; nowhere else (ReportsEveryKernelItLaunches checks the head
// limit), and never when forced off. Its parts are among the workspace's where the tensor-core
// variant would sweep.
TEST(Mamba3ScanCudaShapes, SweepsTheBackwardWhereItApplies) {
  MEGACPP_REQUIRE_GPU();
  using megacpp::cuda::ScanChains;
  using megacpp::cuda::ScanHeadSplit;
  using megacpp::cuda::ScanSweep;
  const bool fits = device_shared_per_block() >= megacpp::cuda::scan_sweep_shared_bytes();
  ScanShape siso = grid_shape(64, 64, 1, 64);
  const auto sweeps = [](const ScanShape& s, bool tensor_cores, ScanSweep sweep) {
    return Mamba3ScanCuda(s, false, tensor_cores, nullptr, 0, ScanChains::kWherePaying,
                          ScanHeadSplit::kWherePaying, sweep)
        .sweeps();
  };
  EXPECT_EQ(sweeps(siso, true, ScanSweep::kAlways), fits);
  EXPECT_EQ(sweeps(siso, true, ScanSweep::kWherePaying),
            fits && siso.batch * siso.heads >= megacpp::cuda::kSweepLeastPairs);
  EXPECT_FALSE(sweeps(siso, true, ScanSweep::kNever));
  EXPECT_FALSE(sweeps(siso, false, ScanSweep::kAlways));
  ScanShape other = siso;
  other.angles = 8;
  EXPECT_FALSE(sweeps(other, true, ScanSweep::kAlways));
  EXPECT_FALSE(sweeps(grid_shape(128, 64, 1, 64), true, ScanSweep::kAlways));
  const ScanShape mimo = grid_shape(64, 64, 4, 16);
  EXPECT_EQ(sweeps(mimo, true, ScanSweep::kAlways), fits);
  EXPECT_FALSE(sweeps(mimo, true, ScanSweep::kNever));
  EXPECT_FALSE(sweeps(mimo, false, ScanSweep::kAlways));
  // 64 rows a chunk but rank 2, and rank 4 at chunk 8 (32 rows): other shapes.
  EXPECT_FALSE(sweeps(grid_shape(64, 64, 2, 32), true, ScanSweep::kAlways));
  EXPECT_FALSE(sweeps(grid_shape(64, 64, 4, 8), true, ScanSweep::kAlways));
  const size_t with_sweep =
      Mamba3ScanCuda::backward_workspace_bytes(siso, ScanHeadSplit::kNever, ScanSweep::kAlways);
  const size_t without =
      Mamba3ScanCuda::backward_workspace_bytes(siso, ScanHeadSplit::kNever, ScanSweep::kNever);
  if (fits) {
    EXPECT_GT(with_sweep, without);
    EXPECT_GT(Mamba3ScanCuda::own_workspace_bytes(siso, false, true, ScanHeadSplit::kNever,
                                                  ScanSweep::kAlways),
              Mamba3ScanCuda::own_workspace_bytes(siso, false, true, ScanHeadSplit::kNever,
                                                  ScanSweep::kNever));
  } else {
    EXPECT_EQ(with_sweep, without);
  }
}

// The sweep's tile copies address the entry states' split (2P = 128 rows a chunk of a (batch,
// head) pair) and the rotation's tables (one row a token) with int coordinates: a shape past
// INT_MAX rows does not sweep (one of the sweep's conditions, testable without a GPU).
TEST(Mamba3ScanCudaShapes, SweepsOnlyWhereTheTileCopiesReachEveryRow) {
  using megacpp::cuda::scan_sweep_rows_fit;
  EXPECT_TRUE(scan_sweep_rows_fit(grid_shape(64, 64, 4, 16)));
  EXPECT_TRUE(scan_sweep_rows_fit(grid_shape(64, 64, 1, 64)));
  for (const int chunk : {16, 64}) {
    ScanShape s = grid_shape(64, 64, chunk == 16 ? 4 : 1, chunk);
    s.batch = 256;
    s.heads = 256;
    s.seqlen = 255 * chunk;  // 2^16 pairs × 255 chunks × 128 rows = 2^31 − 2^23
    EXPECT_TRUE(scan_sweep_rows_fit(s)) << chunk;
    s.seqlen = 256 * chunk;  // 2^31 rows: one past INT_MAX
    EXPECT_FALSE(scan_sweep_rows_fit(s)) << chunk;
    s.batch = 1;
    s.heads = 1;
    s.seqlen = ((1 << 24) - 1) * chunk;  // 2^31 − 128 rows in one pair
    EXPECT_TRUE(scan_sweep_rows_fit(s)) << chunk;
    s.seqlen = (1 << 24) * chunk - (chunk - 1);  // a partial last chunk counts whole
    EXPECT_FALSE(scan_sweep_rows_fit(s)) << chunk;
  }
}

// kWherePaying splits the units left over after the last whole wave where the wave of a block per
// head they make takes at most half a unit's time; M3-ref on an H100 or H200 (132 SMs, one
// chunk_backward block each) leaves 4 of 4096 units.
TEST(Mamba3ScanCudaShapes, SplitsTheUnitsLeftAfterTheLastWholeWave) {
  using megacpp::cuda::units_worth_splitting;
  EXPECT_EQ(units_worth_splitting(4096, 16, 132), 4);   // M3-ref MIMO: a wave of 1 head
  EXPECT_EQ(units_worth_splitting(3072, 16, 132), 36);  // batch 6: 5 heads
  EXPECT_EQ(units_worth_splitting(1024, 16, 132), 0);   // M3-ref SISO's units: 13 heads of 16
  EXPECT_EQ(units_worth_splitting(64, 16, 132), 64);    // fewer units than slots: 8 heads
  EXPECT_EQ(units_worth_splitting(100, 16, 132), 0);    // 13 heads
  EXPECT_EQ(units_worth_splitting(3960, 16, 132), 0);   // whole waves
  EXPECT_EQ(units_worth_splitting(133, 2, 132), 1);     // 1 head of 2
  EXPECT_EQ(units_worth_splitting(395, 2, 132), 0);     // 2 heads of 2
  EXPECT_EQ(units_worth_splitting(4096, 1, 132), 0);    // a head a group
  EXPECT_EQ(units_worth_splitting(4096, 16, 0), 0);
  MEGACPP_REQUIRE_GPU();
  using megacpp::cuda::ScanHeadSplit;
  using megacpp::cuda::ScanSweep;
  // chunk_backward's units: at M3-ref MIMO on Hopper the sweep would run instead (forced off).
  ScanShape s = grid_shape(64, 64, 4, 16);
  s.batch = 8;
  s.seqlen = 8192;
  const long units = static_cast<long>(s.batch) * (s.seqlen / s.chunk);
  const auto backward = [&](ScanHeadSplit head_split, bool tensor_cores = true) {
    for (const auto& a :
         megacpp::cuda::kernel_attributes(s, tensor_cores, {}, head_split, ScanSweep::kNever)) {
      if (a.name == "chunk_backward") return a;
    }
    ADD_FAILURE() << "no chunk_backward";
    return megacpp::cuda::KernelAttributes{};
  };
  EXPECT_EQ(backward(ScanHeadSplit::kNever).grid_blocks, units);
  EXPECT_EQ(backward(ScanHeadSplit::kAlways).grid_blocks, units * s.heads);
  int device = 0, multiprocessors = 0;
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device));
  MEGACPP_CUDA_CHECK(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  long most = 0;  // of the two math variants
  for (const bool tensor_cores : {true, false}) {
    const auto paying = backward(ScanHeadSplit::kWherePaying, tensor_cores);
    const long split = units_worth_splitting(
        units, s.heads, static_cast<long>(multiprocessors) * paying.blocks_per_sm);
    EXPECT_EQ(paying.grid_blocks, units - split + split * s.heads)
        << split << " units split, tensor cores " << tensor_cores;
    most = std::max(most, split);
  }
  // The split units' q and k gradients are among backward()'s temporaries (either variant's).
  EXPECT_EQ(
      Mamba3ScanCuda::backward_workspace_bytes(s, ScanHeadSplit::kWherePaying, ScanSweep::kNever) -
          Mamba3ScanCuda::backward_workspace_bytes(s, ScanHeadSplit::kNever, ScanSweep::kNever),
      (most * s.heads * 2 * s.rank * s.chunk * s.state * sizeof(float) + 255) / 256 * 256);
}

}  // namespace

MEGACPP_ORACLE_ENTRY(Mamba3Scan);

#else

MEGACPP_ORACLE_NO_CUDA(Mamba3ScanCuda);

#endif
