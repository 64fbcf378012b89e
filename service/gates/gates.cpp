#include "service/gates/gates.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>

#include "base/error.h"

namespace megacpp::gates {

std::string_view to_string(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

DeviceKind device_kind_from_string(std::string_view name) {
  if (name == "cpu") return DeviceKind::kCpu;
  if (name == "cuda") return DeviceKind::kCuda;
  fail(ErrorKind::kInvalidArgument, "device kind \"{}\" is not known: must be \"cpu\" or \"cuda\"",
       name);
}

std::string_view to_string(GateImplementation implementation) {
  switch (implementation) {
    case GateImplementation::kImplemented:
      return "implemented";
    case GateImplementation::kScaffold:
      return "scaffold";
  }
  return "unknown";
}

std::string_view to_string(Decision decision) {
  switch (decision) {
    case Decision::kOff:
      return "off";
    case Decision::kOn:
      return "on";
    case Decision::kRefused:
      return "refused";
  }
  return "unknown";
}

namespace {

bool is_gate_name(std::string_view name) {
  if (name.empty() || name.front() < 'a' || name.front() > 'z') return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

std::string device_list(const std::vector<DeviceKind>& devices) {
  if (devices.empty()) return "no device";
  std::vector<std::string_view> names;
  for (DeviceKind d : devices) names.push_back(to_string(d));
  return fmt::format("{}", fmt::join(names, ", "));
}

std::vector<std::string> unfinished_stages(const GateInfo& gate) {
  std::vector<std::string> names;
  for (const GateStage& stage : gate.stages) {
    if (!stage.done) names.push_back("\"" + stage.name + "\"");
  }
  return names;
}

GateDecision decide_one(const GateInfo& gate, bool requested, DeviceKind device) {
  GateDecision d{gate.name, Decision::kOff, "", gate.implementation, gate.stages};
  if (!requested) {
    d.reason = "not requested";
    return d;
  }
  const bool scaffold = gate.implementation == GateImplementation::kScaffold;
  const bool supported = std::find(gate.supported_devices.begin(), gate.supported_devices.end(),
                                   device) != gate.supported_devices.end();
  if (!scaffold && supported) {
    d.decision = Decision::kOn;
    d.reason = fmt::format("requested; implemented for {}", to_string(device));
    return d;
  }
  d.decision = Decision::kRefused;
  std::vector<std::string> why;
  if (scaffold) {
    const std::vector<std::string> missing = unfinished_stages(gate);
    if (missing.empty()) {
      why.push_back("is a scaffold (all stages are done but it is not yet marked implemented)");
    } else {
      why.push_back(
          fmt::format("is a scaffold whose unfinished stages are {}", fmt::join(missing, ", ")));
    }
  }
  if (!supported) {
    why.push_back(fmt::format("is not supported on device kind {} (supported: {})",
                              to_string(device), device_list(gate.supported_devices)));
  }
  d.reason = fmt::format(
      "gate {} was requested for a {} job but {}; remove it from the job's "
      "gates to run without it",
      gate.name, to_string(device), fmt::join(why, " and "));
  return d;
}

}  // namespace

const GateRegistry& GateRegistry::builtin() {
  static const GateRegistry registry({
      {"psiv_cache",
       "forward writes PsiV = v ⊙ mimo_x once and backward reads it instead of recomputing it. "
       "Kept refused on measurement (bench/RESULTS.md, H200, 2026-11-22): at M3-ref the CUDA "
       "kernels' cache leaves outputs bitwise unchanged but costs +0.3 ms and +537 MB, because "
       "recomputing PsiV is one multiply on an x that backward reads anyway",
       GateImplementation::kScaffold,
       {{"materialize PsiV in forward", true},
        {"reuse in backward", true},
        {"pays for itself in a measured receipt", false}},
       {DeviceKind::kCpu, DeviceKind::kCuda}},
      {"tma",
       "Hopper Tensor Memory Accelerator bulk copies for the chunked-scan and attention tile loads",
       GateImplementation::kScaffold,
       {{"TMA descriptors for chunked-scan tiles", false},
        {"TMA loads in our own attention kernels (attention: megacpp)", false}},
       {DeviceKind::kCuda}},
      {"cuda_graphs",
       "captures the step's forward and backward as one CUDA graph and replays it "
       "(CudaModel::set_step_graph; bitwise the eager step). Kept refused on measurement "
       "(bench/RESULTS.md, H100, 2026-11-23): at bench-350m, micro-batch 4 x 8192, two eager and "
       "two replaying runs of cuda_step_bench in one call gave R=4 medians of 1154.9 and 1155.3 "
       "ms eager against 1155.6 and 1155.7 ms replayed (every step 1153.9-1158.0 ms), R=1 578.6 "
       "against 575.7 ms with overlapping ranges: the ~1,000 launches of a step are hidden "
       "behind a second of kernels",
       GateImplementation::kScaffold,
       {{"static buffers for a step's activations and gradients", true},
        {"capture and replay of forward and backward", true},
        {"pays for itself in a measured receipt", false}},
       {DeviceKind::kCuda}},
      {"recompute_in_proj",
       "the Mamba-3 layers' in_proj outputs are recomputed in the backward (the same GEMM, the "
       "same bits) instead of kept from the forward: one shared buffer in place of one per "
       "layer (CudaModelOptions). Measured (bench/RESULTS.md, H100, 2026-11-24, with our own "
       "attention kernels, before cuDNN's became the default): bench-350m, "
       "micro-batch 4 x 8192, R=4 62.7 -> 57.8 GiB in use for 747.9 -> 756.0 ms a step "
       "(+1.1%), R=1 47.0 -> 42.5 GiB for 409.9 -> 419.0 ms (+2.2%): memory for time, so off "
       "unless requested",
       GateImplementation::kImplemented,
       {{"one shared in_proj output buffer", true},
        {"the in_proj GEMM recomputed before the preprocessing backward", true}},
       {DeviceKind::kCuda}},
      {"nondeterministic_attention",
       "cuDNN's attention backward accumulates dQ in fp32 in whatever order its engine likes "
       "instead of the deterministic engine, which keeps dS (batch x heads x seqlen^2 bf16) in its "
       "workspace: two runs of the job no longer give the same bits. Measured (bench/RESULTS.md, "
       "H100, 2026-11-24): at A-ref (batch 8, seqlen 8192, 16 heads of 64) forward+backward "
       "11.68 -> 9.12 ms and 17.2 GB -> 0.3 GB of workspace; bench-350m R=1 micro-batch 4 x 8192 "
       "349.8 -> 342.4 ms a step, 54.8 -> 47.1 GiB. Off unless requested: deterministic is the "
       "default",
       GateImplementation::kImplemented,
       {{"cuDNN's fp32-accumulated dQ graph", true}, {"the job's deterministic=false", true}},
       {DeviceKind::kCuda}},
      {"fused_out_norm",
       "fuses each mixer's residual add with the next RMSNorm: one pass over the residual stream",
       GateImplementation::kScaffold,
       {{"fused add + RMSNorm forward kernel", false},
        {"fused add + RMSNorm backward kernel", false}},
       {DeviceKind::kCuda}},
  });
  return registry;
}

GateRegistry::GateRegistry(std::vector<GateInfo> gates) : gates_(std::move(gates)) {
  std::set<std::string_view> names;
  for (const GateInfo& gate : gates_) {
    if (!is_gate_name(gate.name)) {
      fail(ErrorKind::kInternal,
           "feature gate name \"{}\" is invalid: must be lower_snake_case (a-z, 0-9, _)",
           gate.name);
    }
    if (!names.insert(gate.name).second) {
      fail(ErrorKind::kInternal, "feature gate {} is registered twice", gate.name);
    }
    if (gate.implementation == GateImplementation::kImplemented) {
      const std::vector<std::string> missing = unfinished_stages(gate);
      if (!missing.empty()) {
        fail(ErrorKind::kInternal,
             "feature gate {} is marked implemented but has unfinished stages {}", gate.name,
             fmt::join(missing, ", "));
      }
      if (gate.supported_devices.empty()) {
        fail(ErrorKind::kInternal,
             "feature gate {} is marked implemented but supports no device kind", gate.name);
      }
    }
  }
}

const GateInfo* GateRegistry::find(std::string_view name) const {
  for (const GateInfo& gate : gates_) {
    if (gate.name == name) return &gate;
  }
  return nullptr;
}

std::vector<GateDecision> GateRegistry::decide(const std::vector<std::string>& requested,
                                               DeviceKind device) const {
  auto known = [&] {
    std::vector<std::string_view> names;
    for (const GateInfo& gate : gates_) names.push_back(gate.name);
    return names.empty() ? std::string("(none)") : fmt::format("{}", fmt::join(names, ", "));
  };
  std::set<std::string_view> wanted;
  for (const std::string& name : requested) {
    if (find(name) == nullptr) {
      fail(ErrorKind::kInvalidArgument, "gates: unknown feature gate \"{}\"; known gates: {}", name,
           known());
    }
    if (!wanted.insert(name).second) {
      fail(ErrorKind::kInvalidArgument,
           "gates: feature gate \"{}\" is requested more than once; known gates: {}", name,
           known());
    }
  }
  std::vector<GateDecision> decisions;
  decisions.reserve(gates_.size());
  for (const GateInfo& gate : gates_) {
    decisions.push_back(decide_one(gate, wanted.count(gate.name) > 0, device));
  }
  return decisions;
}

bool any_refused(const std::vector<GateDecision>& decisions) {
  return std::any_of(decisions.begin(), decisions.end(),
                     [](const GateDecision& d) { return d.decision == Decision::kRefused; });
}

}  // namespace megacpp::gates
