#include "runtime/model/memory_estimate.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>

namespace megacpp {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// Saturating arithmetic: a config of absurd sizes must give a total no machine has,
// not one that wrapped around to something small.
uint64_t add(uint64_t a, uint64_t b) {
  return a > kMax - b ? kMax : a + b;
}

uint64_t mul(uint64_t a, uint64_t b) {
  if (a != 0 && b > kMax / a) return kMax;
  return a * b;
}

template <typename... Rest>
uint64_t mul(uint64_t a, uint64_t b, Rest... rest) {
  return mul(mul(a, b), static_cast<uint64_t>(rest)...);
}

uint64_t at_least_one(int64_t value) {
  return value < 1 ? 1 : static_cast<uint64_t>(value);
}

// The sizes every count below uses, in 64 bits (the config's int accessors are exact for
// a validated config; recomputing here keeps the estimate safe for any input).
struct Sizes {
  uint64_t dm, vp, hidden;
  // Mamba-3
  uint64_t heads, headdim, state, groups, rank, angles, d_inner, bc, columns;
  // attention
  uint64_t hq, hkv, hd, width;

  explicit Sizes(const ModelConfig& c) {
    const auto u = [](int v) {
      return v < 0 ? uint64_t{0} : static_cast<uint64_t>(v);
    };
    dm = u(c.d_model);
    const uint64_t multiple = std::max<uint64_t>(1, u(c.pad_vocab_size_multiple));
    vp = add(u(c.vocab_size), multiple - 1) / multiple * multiple;
    hidden = add(u(c.d_intermediate), 127) / 128 * 128;
    headdim = std::max<uint64_t>(1, u(c.ssm.headdim));
    heads = mul(u(c.ssm.expand), dm) / headdim;
    state = u(c.ssm.d_state);
    groups = u(c.ssm.ngroups);
    rank = u(c.ssm.mimo_rank);
    angles = u(c.rope_angles());
    d_inner = mul(heads, headdim);
    bc = mul(state, groups, rank);
    columns = add(add(mul(2, d_inner), mul(2, bc)), add(mul(3, heads), angles));
    hq = u(c.attn.num_heads);
    hkv = u(c.attn_kv_heads());
    hd = u(c.attn_head_dim());
    width = mul(add(hq, mul(2, hkv)), hd);
  }
};

uint64_t mamba_parameters(const Sizes& s) {
  const uint64_t hrn = mul(s.heads, s.rank, s.state);
  uint64_t n = mul(s.columns, s.dm);               // in_proj
  n = add(n, s.heads);                             // dt_bias
  n = add(n, mul(2, hrn));                         // B_bias, C_bias
  n = add(n, mul(2, s.state));                     // B_norm, C_norm
  n = add(n, mul(3, s.heads, s.rank, s.headdim));  // mimo_x, mimo_z, mimo_o
  n = add(n, s.heads);                             // D
  return add(n, mul(s.dm, s.d_inner));             // out_proj
}

uint64_t attention_parameters(const ModelConfig& c, const Sizes& s) {
  uint64_t n = mul(s.width, s.dm);  // in_proj
  if (c.attn.qkv_proj_bias) n = add(n, s.width);
  n = add(n, mul(s.dm, s.hq, s.hd));  // out_proj
  if (c.attn.out_proj_bias) n = add(n, s.dm);
  return n;
}

// Elements Mamba3Mixer::plan allocates, with its scan runner (Mamba3ScanChunked or
// Mamba3ScanRecurrent over ScanCommon).
uint64_t mamba_activations(const ModelConfig& c, const Sizes& s, const TrainingShape& t) {
  const uint64_t batch = at_least_one(t.batch), seqlen = at_least_one(t.seqlen);
  const uint64_t rows = mul(batch, seqlen);
  uint64_t n = mul(2, rows, s.columns);  // proj_, dproj_
  const uint64_t scan_width =
      add(add(mul(2, s.d_inner), mul(2, s.bc)), add(mul(3, s.heads), s.angles));
  n = add(n, mul(2, rows, scan_width));                  // scan_in_, scan_grad_
  n = add(n, mul(rows, 2, s.rank, s.groups));            // bc_rstd_
  n = add(n, mul(rows, add(s.heads, mul(2, s.state))));  // row_scratch_
  n = add(n, mul(2, rows, s.d_inner));                   // y_, dy_
  const uint64_t rn = mul(s.rank, s.state), rp = mul(s.rank, s.headdim);
  n = add(n, add(mul(2, s.heads, rn), add(mul(3, s.heads, rp), s.heads)));  // param_grad_

  const uint64_t pairs = mul(batch, s.heads);
  // ScanCommon: q k dq dk, v o gate_sigmoid dv d_o, cos sin d_angles, 12 token scalars.
  const uint64_t per_token = add(add(mul(4, rn), mul(5, rp)), add(mul(3, s.angles), 12));
  const uint64_t per_pair = add(mul(seqlen, per_token), add(add(mul(2, rn), mul(3, rp)), 1));
  n = add(n, mul(pairs, per_pair));
  const uint64_t matrix = mul(s.headdim, s.state);
  if (t.scan_form == ScanForm::kChunked) {
    const uint64_t chunk = std::min<uint64_t>(at_least_one(c.ssm.chunk_size), seqlen);
    const uint64_t chunks = (seqlen + chunk - 1) / chunk;
    const uint64_t chunk_rows = mul(chunk, s.rank);
    const uint64_t widest = std::max(s.state, s.headdim);
    n = add(n, mul(pairs, chunks, matrix));  // states_
    const uint64_t stride = add(add(mul(3, chunk_rows, chunk_rows), mul(2, chunk_rows, widest)),
                                add(matrix, add(mul(chunk, chunk), mul(3, chunk))));
    n = add(n, mul(pairs, stride));  // scratch_
  } else {
    n = add(n, mul(pairs, add(seqlen, 5), matrix));  // every state, plus 5 scratch matrices
  }
  return n;
}

// Elements AttentionMixer::plan allocates, with CausalAttention's per-thread scratch.
uint64_t attention_activations(const Sizes& s, const TrainingShape& t) {
  const uint64_t seqlen = at_least_one(t.seqlen);
  const uint64_t rows = mul(at_least_one(t.batch), seqlen);
  uint64_t n = mul(2, rows, s.width);                            // qkv_, dqkv_
  n = add(n, mul(2, rows, s.hq, s.hd));                          // ctx_, dctx_
  const uint64_t tile = std::min<uint64_t>(64, seqlen);          // CausalAttention's kRowTile
  return add(n, mul(at_least_one(t.threads), 2, tile, seqlen));  // probs, dscores
}

uint64_t mlp_activations(const Sizes& s, const TrainingShape& t) {
  const uint64_t rows = mul(at_least_one(t.batch), at_least_one(t.seqlen));
  return add(mul(2, rows, 2, s.hidden), mul(2, rows, s.hidden));  // fc1_out dfc1_out, act dact
}

}  // namespace

uint64_t count_parameters(const ModelConfig& c) {
  const Sizes s(c);
  uint64_t n = mul(s.vp, s.dm);  // embedding
  for (int layer = 0; layer < c.n_layer; ++layer) {
    n = add(n, s.dm);  // norm
    n = add(n, c.is_attention_layer(layer) ? attention_parameters(c, s) : mamba_parameters(s));
    if (c.d_intermediate > 0) n = add(n, add(s.dm, mul(3, s.hidden, s.dm)));  // norm2, fc1, fc2
  }
  n = add(n, s.dm);                                    // norm_f
  if (!c.tie_embeddings) n = add(n, mul(s.vp, s.dm));  // lm_head
  return n;
}

MemoryEstimate estimate_training_memory(const ModelConfig& c, const TrainingShape& t) {
  const Sizes s(c);
  const uint64_t e = t.element_bytes;
  MemoryEstimate m;
  m.parameter_count = count_parameters(c);
  m.parameters = mul(m.parameter_count, e);
  m.gradients = m.parameters;
  m.optimizer = mul(2, m.parameters);

  const uint64_t seqlen = at_least_one(t.seqlen);
  const uint64_t rows = mul(at_least_one(t.batch), seqlen);
  const uint64_t layers = c.n_layer < 0 ? 0 : static_cast<uint64_t>(c.n_layer);
  const uint64_t sites = add(add(layers, c.d_intermediate > 0 ? layers : 0), 1);
  // Model::plan: residual_ and normed_ per site, rstd_ per site, delta_, dresidual_,
  // dresidual_next_, dnormed_, logits_ and dlogits_ (inputs_ and targets_ are int32).
  uint64_t elements = mul(2, sites, rows, s.dm);
  elements = add(elements, mul(sites, rows));
  elements = add(elements, mul(4, rows, s.dm));
  elements = add(elements, mul(2, rows, s.vp));
  uint64_t attention_layers = 0;
  for (int layer = 0; layer < c.n_layer; ++layer) {
    const bool attention = c.is_attention_layer(layer);
    attention_layers += attention ? 1 : 0;
    elements = add(elements, attention ? attention_activations(s, t) : mamba_activations(c, s, t));
    if (c.d_intermediate > 0) elements = add(elements, mlp_activations(s, t));
  }
  m.activations = add(mul(elements, e), mul(2, rows, sizeof(int32_t)));

  // The trainer's token windows (training and evaluation), its ring of step times, and
  // the largest per-call scratch: cross entropy's per-row losses, the rotary tables,
  // the gradient norm's block partials.
  const uint64_t window = mul(at_least_one(t.batch), add(seqlen, 1));
  uint64_t workspace = mul(2, window, sizeof(int32_t));
  workspace = add(workspace, mul(uint64_t{1} << 20, sizeof(double)));  // step times
  workspace = add(workspace, mul(rows, sizeof(double)));
  if (attention_layers > 0) {
    const uint64_t half =
        c.attn.rotary_emb_dim < 0 ? 0 : static_cast<uint64_t>(c.attn.rotary_emb_dim) / 2;
    workspace = add(workspace, add(mul(2, seqlen, half, e), mul(half, sizeof(double))));
  }
  workspace = add(workspace, mul(m.parameter_count / (1 << 14) + 1, sizeof(double)));
  m.workspace = workspace;
  return m;
}

uint64_t MemoryEstimate::total() const {
  return add(add(add(parameters, gradients), add(optimizer, activations)),
             add(workspace, datasets));
}

std::string MemoryEstimate::describe() const {
  return fmt::format(
      "{} bytes ({} parameters: weights {}, gradients {}, AdamW moments {}; activations {}; "
      "workspace {}; dataset indexes {})",
      total(), parameter_count, parameters, gradients, optimizer, activations, workspace, datasets);
}

HostMemory read_host_memory() {
  HostMemory memory;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    std::istringstream fields(line);
    std::string key, unit;
    uint64_t kib = 0;
    if (!(fields >> key >> kib)) continue;
    fields >> unit;
    const uint64_t bytes = unit == "kB" ? mul(kib, 1024) : kib;
    if (key == "MemAvailable:") memory.available = bytes;
    if (key == "MemTotal:") memory.total = bytes;
  }
  const long page = ::sysconf(_SC_PAGESIZE);
  if (memory.available == 0 && page > 0) {
    const long pages = ::sysconf(_SC_AVPHYS_PAGES);
    if (pages > 0)
      memory.available = mul(static_cast<uint64_t>(pages), static_cast<uint64_t>(page));
  }
  if (memory.total == 0 && page > 0) {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    if (pages > 0) memory.total = mul(static_cast<uint64_t>(pages), static_cast<uint64_t>(page));
  }
  return memory;
}

}  // namespace megacpp
