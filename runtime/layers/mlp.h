#pragma once
// The GatedMLP block's layer wrapper: parameters backbone.layers.{i}.mlp.fc1/fc2.
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/gated_mlp.h"
#include "runtime/config/model_config.h"
#include "runtime/layers/init.h"
#include "runtime/parameters/parameter_set.h"

namespace megacpp {

template <typename T>
class GatedMlp {
 public:
  GatedMlp(const ModelConfig& config, int layer, ParameterSet<T>& params)
      : config_(config), params_(params), hidden_(config.mlp_hidden()) {
    const std::string p = "backbone.layers." + std::to_string(layer) + ".mlp.";
    fc1_ = params.add(p + "fc1.weight", {2 * hidden_, config.d_model}, true);
    fc2_ = params.add(p + "fc2.weight", {config.d_model, hidden_}, true);
  }

  void init(Rng& rng, double out_proj_divisor) {
    fill_uniform(params_.value(fc1_), params_.info(fc1_).size, 1.0 / std::sqrt(config_.d_model),
                 rng);
    fill_uniform(params_.value(fc2_), params_.info(fc2_).size,
                 1.0 / std::sqrt(hidden_) / out_proj_divisor, rng);
  }

  void plan(int rows) {
    rows_ = rows;
    fc1_out_.assign(static_cast<size_t>(rows) * 2 * hidden_, T(0));
    act_.assign(static_cast<size_t>(rows) * hidden_, T(0));
    dact_.assign(static_cast<size_t>(rows) * hidden_, T(0));
    dfc1_out_.assign(static_cast<size_t>(rows) * 2 * hidden_, T(0));
  }

  void forward(const T* x, T* out) {
    cpu::gated_mlp_forward<T>(rows_, config_.d_model, hidden_, x, params_.value(fc1_),
                              params_.value(fc2_), fc1_out_.data(), act_.data(), out);
  }

  void backward(const T* x, const T* dout, T* dx) {
    cpu::gated_mlp_backward<T>(rows_, config_.d_model, hidden_, x, params_.value(fc1_),
                               params_.value(fc2_), fc1_out_.data(), act_.data(), dout, dx,
                               params_.grad(fc1_), params_.grad(fc2_), dact_.data(),
                               dfc1_out_.data());
  }

 private:
  const ModelConfig& config_;
  ParameterSet<T>& params_;
  int hidden_;
  int fc1_, fc2_;
  int rows_ = 0;
  std::vector<T> fc1_out_, act_, dact_, dfc1_out_;
};

}  // namespace megacpp
