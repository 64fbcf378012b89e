#include "service/gates/gates.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "base/error.h"

namespace megacpp::gates {
namespace {

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << part << "\" not found in: " << text;
}

ErrorKind kind_of(const std::function<void()>& body, std::string* message) {
  try {
    body();
  } catch (const Error& e) {
    *message = e.what();
    return e.kind();
  }
  ADD_FAILURE() << "expected megacpp::Error";
  return ErrorKind::kInternal;
}

const GateDecision& decision_for(const std::vector<GateDecision>& decisions,
                                 const std::string& gate) {
  for (const GateDecision& d : decisions) {
    if (d.gate == gate) return d;
  }
  ADD_FAILURE() << "no decision for " << gate;
  static const GateDecision none;
  return none;
}

// One implemented gate per device kind, one for both, and one scaffold with a finished stage:
// every branch of decide() has a gate to land on.
GateRegistry custom_registry() {
  return GateRegistry({
      {"cpu_only",
       "runs on CPU",
       GateImplementation::kImplemented,
       {{"only", true}},
       {DeviceKind::kCpu}},
      {"cuda_only", "runs on CUDA", GateImplementation::kImplemented, {}, {DeviceKind::kCuda}},
      {"both",
       "runs anywhere",
       GateImplementation::kImplemented,
       {},
       {DeviceKind::kCpu, DeviceKind::kCuda}},
      {"half_done",
       "a scaffold",
       GateImplementation::kScaffold,
       {{"first half", true}, {"second half", false}},
       {DeviceKind::kCuda}},
  });
}

TEST(DeviceKind, RoundTripsAndRefusesUnknown) {
  EXPECT_EQ(to_string(DeviceKind::kCpu), "cpu");
  EXPECT_EQ(to_string(DeviceKind::kCuda), "cuda");
  EXPECT_EQ(device_kind_from_string("cpu"), DeviceKind::kCpu);
  EXPECT_EQ(device_kind_from_string("cuda"), DeviceKind::kCuda);
  std::string message;
  EXPECT_EQ(kind_of([] { device_kind_from_string("gpu"); }, &message), ErrorKind::kInvalidArgument);
  EXPECT_TRUE(contains(message, "\"gpu\""));
  EXPECT_TRUE(contains(message, "\"cuda\""));
}

TEST(Builtin, RegistersTheFourScaffoldsAndTheTwoImplementedGates) {
  const GateRegistry& registry = GateRegistry::builtin();
  std::vector<std::string> names;
  for (const GateInfo& gate : registry.gates()) {
    names.push_back(gate.name);
    EXPECT_EQ(gate.implementation,
              gate.name == "recompute_in_proj" || gate.name == "nondeterministic_attention"
                  ? GateImplementation::kImplemented
                  : GateImplementation::kScaffold)
        << gate.name;
    EXPECT_FALSE(gate.description.empty()) << gate.name;
    EXPECT_FALSE(gate.stages.empty()) << gate.name;
    EXPECT_FALSE(gate.supported_devices.empty()) << gate.name;
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"psiv_cache", "tma", "cuda_graphs", "recompute_in_proj",
                                      "nondeterministic_attention", "fused_out_norm"}));
  const GateInfo* psiv = registry.find("psiv_cache");
  ASSERT_NE(psiv, nullptr);
  ASSERT_EQ(psiv->stages.size(), 3u);
  EXPECT_EQ(psiv->stages[0].name, "materialize PsiV in forward");
  EXPECT_EQ(psiv->stages[1].name, "reuse in backward");
  EXPECT_EQ(psiv->stages[2].name, "pays for itself in a measured receipt");
  EXPECT_FALSE(psiv->stages[2].done);
  EXPECT_TRUE(contains(psiv->description, "PsiV"));
  EXPECT_EQ(registry.find("nope"), nullptr);
}

TEST(Builtin, NothingRequestedIsAllOff) {
  for (DeviceKind device : {DeviceKind::kCpu, DeviceKind::kCuda}) {
    const auto decisions = GateRegistry::builtin().decide({}, device);
    ASSERT_EQ(decisions.size(), 6u);
    for (const GateDecision& d : decisions) {
      EXPECT_EQ(d.decision, Decision::kOff) << d.gate;
      const bool implemented =
          d.gate == "recompute_in_proj" || d.gate == "nondeterministic_attention";
      EXPECT_EQ(d.implementation,
                implemented ? GateImplementation::kImplemented : GateImplementation::kScaffold);
      EXPECT_FALSE(d.stages.empty());
    }
    EXPECT_FALSE(any_refused(decisions));
  }
}

TEST(Builtin, RequestedScaffoldIsRefusedNamingItsStagesAndDevice) {
  const auto decisions = GateRegistry::builtin().decide({"psiv_cache"}, DeviceKind::kCuda);
  ASSERT_EQ(decisions.size(), 6u);
  EXPECT_TRUE(any_refused(decisions));
  const GateDecision& psiv = decision_for(decisions, "psiv_cache");
  EXPECT_EQ(psiv.decision, Decision::kRefused);
  EXPECT_TRUE(contains(psiv.reason, "psiv_cache"));
  EXPECT_TRUE(contains(psiv.reason, "scaffold"));
  // Built and measured, but it bought nothing: the unfinished stage is the reason.
  EXPECT_TRUE(contains(psiv.reason, "pays for itself in a measured receipt"));
  EXPECT_TRUE(contains(psiv.reason, "cuda"));
  ASSERT_EQ(psiv.stages.size(), 3u);
  EXPECT_TRUE(psiv.stages[0].done);
  EXPECT_FALSE(psiv.stages[2].done);
  for (const char* other : {"tma", "cuda_graphs", "recompute_in_proj", "nondeterministic_attention",
                            "fused_out_norm"}) {
    EXPECT_EQ(decision_for(decisions, other).decision, Decision::kOff) << other;
  }
}

TEST(Builtin, CudaGraphsIsBuiltButRefusedForItsReceipt) {
  const auto decisions = GateRegistry::builtin().decide({"cuda_graphs"}, DeviceKind::kCuda);
  const GateDecision& graphs = decision_for(decisions, "cuda_graphs");
  EXPECT_EQ(graphs.decision, Decision::kRefused);
  EXPECT_TRUE(contains(graphs.reason, "pays for itself in a measured receipt"));
  ASSERT_EQ(graphs.stages.size(), 3u);
  EXPECT_TRUE(graphs.stages[0].done);
  EXPECT_TRUE(graphs.stages[1].done);
  EXPECT_FALSE(graphs.stages[2].done);
}

TEST(Builtin, EveryScaffoldIsRefusedOnEveryDevice) {
  for (const GateInfo& gate : GateRegistry::builtin().gates()) {
    if (gate.implementation != GateImplementation::kScaffold) continue;
    for (DeviceKind device : {DeviceKind::kCpu, DeviceKind::kCuda}) {
      const auto decisions = GateRegistry::builtin().decide({gate.name}, device);
      const GateDecision& d = decision_for(decisions, gate.name);
      EXPECT_EQ(d.decision, Decision::kRefused) << gate.name;
      EXPECT_TRUE(contains(d.reason, gate.name));
      EXPECT_TRUE(contains(d.reason, std::string(to_string(device))));
      for (const GateStage& stage : gate.stages) {
        EXPECT_EQ(contains(d.reason, stage.name), !stage.done) << gate.name << ": " << stage.name;
      }
    }
  }
}

TEST(Builtin, TheImplementedGatesAreOnForCudaJobsAndRefusedForCpuJobs) {
  for (const char* gate : {"recompute_in_proj", "nondeterministic_attention"}) {
    const GateDecision cuda =
        decision_for(GateRegistry::builtin().decide({gate}, DeviceKind::kCuda), gate);
    EXPECT_EQ(cuda.decision, Decision::kOn) << gate;
    EXPECT_TRUE(contains(cuda.reason, "implemented for cuda")) << cuda.reason;
    const GateDecision cpu =
        decision_for(GateRegistry::builtin().decide({gate}, DeviceKind::kCpu), gate);
    EXPECT_EQ(cpu.decision, Decision::kRefused) << gate;
    EXPECT_TRUE(contains(cpu.reason, "not supported on device kind cpu")) << cpu.reason;
    EXPECT_FALSE(contains(cpu.reason, "scaffold")) << cpu.reason;
  }
}

TEST(Builtin, CudaOnlyScaffoldOnCpuNamesBothReasons) {
  const auto decisions = GateRegistry::builtin().decide({"tma"}, DeviceKind::kCpu);
  const GateDecision& tma = decision_for(decisions, "tma");
  EXPECT_EQ(tma.decision, Decision::kRefused);
  EXPECT_TRUE(contains(tma.reason, "scaffold"));
  EXPECT_TRUE(contains(tma.reason, "not supported on device kind cpu"));
}

TEST(Decide, UnknownGateIsInvalidArgumentListingKnownGates) {
  std::string message;
  EXPECT_EQ(kind_of(
                [] {
                  GateRegistry::builtin().decide({"tma", "warp_speed"}, DeviceKind::kCpu);
                },
                &message),
            ErrorKind::kInvalidArgument);
  EXPECT_TRUE(contains(message, "warp_speed"));
  for (const char* known : {"psiv_cache", "tma", "cuda_graphs", "recompute_in_proj",
                            "nondeterministic_attention", "fused_out_norm"}) {
    EXPECT_TRUE(contains(message, known));
  }
}

TEST(Decide, DuplicateGateIsInvalidArgument) {
  std::string message;
  EXPECT_EQ(kind_of(
                [] {
                  custom_registry().decide({"both", "both"}, DeviceKind::kCpu);
                },
                &message),
            ErrorKind::kInvalidArgument);
  EXPECT_TRUE(contains(message, "\"both\""));
  EXPECT_TRUE(contains(message, "more than once"));
  EXPECT_TRUE(contains(message, "cpu_only"));
}

TEST(Decide, ImplementedOnItsDeviceIsOn) {
  const GateRegistry registry = custom_registry();
  auto decisions = registry.decide({"cpu_only", "both"}, DeviceKind::kCpu);
  ASSERT_EQ(decisions.size(), 4u);
  EXPECT_EQ(decision_for(decisions, "cpu_only").decision, Decision::kOn);
  EXPECT_EQ(decision_for(decisions, "both").decision, Decision::kOn);
  EXPECT_EQ(decision_for(decisions, "cuda_only").decision, Decision::kOff);
  EXPECT_EQ(decision_for(decisions, "half_done").decision, Decision::kOff);
  EXPECT_EQ(decision_for(decisions, "cpu_only").implementation, GateImplementation::kImplemented);
  EXPECT_FALSE(any_refused(decisions));

  decisions = registry.decide({"cuda_only", "both"}, DeviceKind::kCuda);
  EXPECT_EQ(decision_for(decisions, "cuda_only").decision, Decision::kOn);
  EXPECT_EQ(decision_for(decisions, "both").decision, Decision::kOn);
  EXPECT_EQ(decision_for(decisions, "cpu_only").decision, Decision::kOff);
  EXPECT_FALSE(any_refused(decisions));
}

TEST(Decide, ImplementedOnOtherDeviceIsRefusedNamingTheDevice) {
  const GateRegistry registry = custom_registry();
  auto decisions = registry.decide({"cuda_only"}, DeviceKind::kCpu);
  EXPECT_TRUE(any_refused(decisions));
  const GateDecision& d = decision_for(decisions, "cuda_only");
  EXPECT_EQ(d.decision, Decision::kRefused);
  EXPECT_TRUE(contains(d.reason, "cuda_only"));
  EXPECT_TRUE(contains(d.reason, "not supported on device kind cpu (supported: cuda)"));
  EXPECT_FALSE(contains(d.reason, "scaffold"));

  decisions = registry.decide({"cpu_only"}, DeviceKind::kCuda);
  EXPECT_EQ(decision_for(decisions, "cpu_only").decision, Decision::kRefused);
  EXPECT_TRUE(contains(decision_for(decisions, "cpu_only").reason, "(supported: cpu)"));
}

TEST(Decide, ScaffoldNamesOnlyItsUnfinishedStages) {
  const auto decisions = custom_registry().decide({"half_done"}, DeviceKind::kCuda);
  const GateDecision& d = decision_for(decisions, "half_done");
  EXPECT_EQ(d.decision, Decision::kRefused);
  EXPECT_TRUE(contains(d.reason, "\"second half\""));
  EXPECT_FALSE(contains(d.reason, "first half"));
  EXPECT_FALSE(contains(d.reason, "not supported"));
  ASSERT_EQ(d.stages.size(), 2u);
  EXPECT_TRUE(d.stages[0].done);
  EXPECT_FALSE(d.stages[1].done);
}

TEST(Decide, MixedRequestKeepsRegistrationOrderAndOneDecisionPerGate) {
  const auto decisions =
      custom_registry().decide({"half_done", "both", "cuda_only"}, DeviceKind::kCpu);
  ASSERT_EQ(decisions.size(), 4u);
  EXPECT_EQ(decisions[0].gate, "cpu_only");
  EXPECT_EQ(decisions[0].decision, Decision::kOff);
  EXPECT_EQ(decisions[0].reason, "not requested");
  EXPECT_EQ(decisions[1].gate, "cuda_only");
  EXPECT_EQ(decisions[1].decision, Decision::kRefused);
  EXPECT_EQ(decisions[2].gate, "both");
  EXPECT_EQ(decisions[2].decision, Decision::kOn);
  EXPECT_EQ(decisions[3].gate, "half_done");
  EXPECT_EQ(decisions[3].decision, Decision::kRefused);
  EXPECT_EQ(to_string(decisions[3].decision), "refused");
}

TEST(Registry, RefusesInconsistentDefinitions) {
  std::string message;
  EXPECT_EQ(kind_of(
                [] {
                  GateRegistry({{"dup", "", GateImplementation::kScaffold, {}, {}},
                                {"dup", "", GateImplementation::kScaffold, {}, {}}});
                },
                &message),
            ErrorKind::kInternal);
  EXPECT_TRUE(contains(message, "dup"));
  EXPECT_EQ(kind_of(
                [] {
                  GateRegistry({{"Bad-Name", "", GateImplementation::kScaffold, {}, {}}});
                },
                &message),
            ErrorKind::kInternal);
  EXPECT_EQ(kind_of(
                [] {
                  GateRegistry({{"unfinished",
                                 "",
                                 GateImplementation::kImplemented,
                                 {{"stage", false}},
                                 {DeviceKind::kCpu}}});
                },
                &message),
            ErrorKind::kInternal);
  EXPECT_TRUE(contains(message, "\"stage\""));
  EXPECT_EQ(kind_of(
                [] {
                  GateRegistry({{"nowhere", "", GateImplementation::kImplemented, {}, {}}});
                },
                &message),
            ErrorKind::kInternal);
}

}  // namespace
}  // namespace megacpp::gates
