// AdamW's moments start as zeros, and it says so only while nothing could have changed them
// (CudaModel::upload clears the device moments instead of copying them on that word).
#include "runtime/optimizer/adamw.h"

#include <gtest/gtest.h>

namespace megacpp {
namespace {

ParameterSet<float> two_tensors() {
  ParameterSet<float> params;
  params.add("a", {3, 4}, true);
  params.add("b", {5}, false);
  params.finalize();
  return params;
}

TEST(AdamW, FreshMomentsAreZeroAndSaySo) {
  ParameterSet<float> params = two_tensors();
  const AdamW<float> optimizer(params, OptimizerConfig{});
  EXPECT_TRUE(optimizer.moments_are_zero());
  for (float v : optimizer.exp_avg()) EXPECT_EQ(v, 0.f);
  for (float v : optimizer.exp_avg_sq()) EXPECT_EQ(v, 0.f);
  EXPECT_TRUE(optimizer.moments_are_zero()) << "reading through const access changes nothing";
}

TEST(AdamW, MutableAccessOrAStepEndsTheZeroClaim) {
  ParameterSet<float> params = two_tensors();
  AdamW<float> written(params, OptimizerConfig{});
  written.exp_avg()[0] = 1.f;  // as load_optimizer_state does
  EXPECT_FALSE(written.moments_are_zero());
  AdamW<float> squared(params, OptimizerConfig{});
  squared.exp_avg_sq();
  EXPECT_FALSE(squared.moments_are_zero());
  AdamW<float> stepped(params, OptimizerConfig{});
  params.grads()[0] = 1.f;
  stepped.step(1e-3);
  EXPECT_FALSE(stepped.moments_are_zero());
  EXPECT_NE(stepped.exp_avg()[0], 0.f);
}

}  // namespace
}  // namespace megacpp
