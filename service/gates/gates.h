#pragma once
// Named feature gates: optional code paths a job may ask for. Every job gets a decision for every
// registered gate, so a receipt shows exactly which paths ran. A gate that is asked for but cannot
// run here (its implementation is unfinished, or it does not exist for the job's device kind) is
// refused, and the job with it: silently running the default path instead would make a run's
// receipts claim an optimisation that never happened.
#include <string>
#include <string_view>
#include <vector>

namespace megacpp::gates {

enum class DeviceKind { kCpu, kCuda };

// "cpu" / "cuda".
std::string_view to_string(DeviceKind kind);
// Throws Error(kInvalidArgument) naming the value and the accepted spellings.
DeviceKind device_kind_from_string(std::string_view name);

enum class GateImplementation {
  kImplemented,  // every stage is done; runs on the gate's supported devices
  kScaffold,     // registered so it can be requested and refused by name; not usable yet
};

// "implemented" / "scaffold".
std::string_view to_string(GateImplementation implementation);

struct GateStage {
  std::string name;
  bool done = false;
};

struct GateInfo {
  std::string name;  // lower_snake_case, unique in a registry
  std::string description;
  GateImplementation implementation = GateImplementation::kScaffold;
  std::vector<GateStage> stages;
  // The device kinds the gate is (or, for a scaffold, will be) implemented for.
  std::vector<DeviceKind> supported_devices;
};

enum class Decision { kOff, kOn, kRefused };

// "off" / "on" / "refused".
std::string_view to_string(Decision decision);

struct GateDecision {
  std::string gate;
  Decision decision = Decision::kOff;
  std::string reason;  // for a refusal: names the gate, the unfinished stages and the device
  GateImplementation implementation = GateImplementation::kScaffold;
  std::vector<GateStage> stages;
};

class GateRegistry {
 public:
  // The gates this build knows: psiv_cache, tma, cuda_graphs, recompute_in_proj,
  // nondeterministic_attention, fused_out_norm.
  static const GateRegistry& builtin();

  // Throws Error(kInternal) for an inconsistent registry: an empty or badly spelled name, a name
  // registered twice, or an implemented gate with an unfinished stage or no supported device.
  explicit GateRegistry(std::vector<GateInfo> gates);

  const std::vector<GateInfo>& gates() const { return gates_; }
  // nullptr when no gate has this name.
  const GateInfo* find(std::string_view name) const;

  // One decision per registered gate, in registration order. Throws Error(kInvalidArgument)
  // when `requested` names an unknown gate or names a gate twice; the message lists the known
  // gates.
  std::vector<GateDecision> decide(const std::vector<std::string>& requested,
                                   DeviceKind device) const;

 private:
  std::vector<GateInfo> gates_;
};

bool any_refused(const std::vector<GateDecision>& decisions);

}  // namespace megacpp::gates
